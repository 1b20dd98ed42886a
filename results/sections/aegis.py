"""Section aegis: AEGIS (gradient isolation) against every text attack and the baselines, on one
client step at init weights (configs/paper/aegis_attacks.yaml), and its utility when a model is
trained from scratch beside DP-SGD (configs/paper/aegis_utility.yaml).

AEGIS's goal, as this section judges it per model and defense: every attack's token recovery
<= 0.05 and every presence F1 within 0.05 of a random guess with as many guesses
(`presence_random_f1`, `veil.attacks.harness.score`). The smallest DP-SGD noise multiplier of the
ladder that meets the same goal is named beside it. The step time is the `aegis-overhead` section
(a benchmark's timings, not the engine's).
"""

from __future__ import annotations

from statistics import mean
from typing import Any

from results.notes import notes
from results.tables import fmt, mean_std, table

NOTES = notes(__name__)

SOURCES = ("aegis-attacks", "aegis-utility")
SPAN_GOAL, PRESENCE_MARGIN = 0.05, 0.05

#: measured once while designing the local step (not rerun: the numbers behind the defaults)
LOCAL_STEP = NOTES["LOCAL_STEP"]
NOISE_DRAW = NOTES["NOISE_DRAW"]


def _over_chance(m: dict[str, Any]) -> float:
    return m.get("presence_f1", 0.0) - m.get("presence_random_f1", 0.0)


#: attacks that read the classifier's gradient, not a token channel (AEGIS leaves the head clean)
HEAD_ATTACKS = ("head-embedding",)


def token_channels(cells: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {a: m for a, m in cells.items() if not a.startswith(HEAD_ATTACKS)}


def _leaks(attack: str, m: dict[str, Any]) -> bool:
    """Over the goal. A head attack returns real pool sentences, whose common words overlap any
    batch: its token and presence figures have no random-guess baseline here, so it is judged by
    the sentences it identifies (exact_recovery; a random pick of B of N identifies B/N = 0.02)."""
    if attack.startswith(HEAD_ATTACKS):
        return m.get("exact_recovery", 0.0) > SPAN_GOAL
    return m.get("token_recovery", 0.0) > SPAN_GOAL or _over_chance(m) > PRESENCE_MARGIN


def resists(cells: dict[str, dict[str, Any]]) -> bool:
    """AEGIS's goal on one defense's cells (blocked attacks recovered nothing)."""
    return not any(_leaks(a, m) for a, m in cells.items())


def _ladder(defenses: list[str]) -> list[str]:
    dp = [d for d in defenses if d.startswith("dpsgd(")]
    return sorted(dp, key=lambda d: float(d.split("noise_multiplier=")[1].split(",")[0].rstrip(")")))


def attack_rows(t: dict[str, Any], model: str) -> list[list[str]]:
    rows = []
    for d, cells in t["leakage"].items():
        for a, m in cells.items():
            tr = fmt(m.get("token_recovery"))
            pf = f"{fmt(m.get('presence_f1'))} ({fmt(m.get('presence_random_f1'), 4)})"
            rows.append([model, d, a, pf, tr, f"{fmt(m.get('presence_guesses'), 0)} guesses, {fmt(m['seconds'], 1)} s"])
        for a, why in t["blocked"].get(d, {}).items():
            rows.append([model, d, a, "0", "0", f"blocked: {why[:90]}"])
    return rows


def resistance_rows(t: dict[str, Any], model: str) -> list[list[str]]:
    rows = []
    for d, cells in t["leakage"].items():
        tr = max((m.get("token_recovery", 0.0) for m in cells.values()), default=0.0)
        pf = max((_over_chance(m) for m in cells.values()), default=0.0)
        worst = max(
            cells,
            key=lambda a: (_leaks(a, cells[a]), cells[a].get("token_recovery", 0.0), _over_chance(cells[a])),
            default="—",
        )
        verdict = "**yes**" if resists(cells) else "**no**"
        rows.append(
            [model, d, fmt(tr), f"{pf:+.3f}", worst, verdict, "yes" if resists(token_channels(cells)) else "no"]
        )
    ladder = _ladder(list(t["leakage"]))
    match = next((d for d in ladder if resists(t["leakage"][d])), None)
    token_match = next((d for d in ladder if resists(token_channels(t["leakage"][d]))), None)
    rows.append(
        [model, "**lowest DP-SGD meeting the goal**", "", "", "", match or "none of the ladder", token_match or "none"]
    )
    return rows


def utility_rows(t: dict[str, Any], model: str) -> list[list[str]]:
    u = t["utility"]
    base = u["none"]["test_accuracy_values"]
    rows = []
    for d, v in u.items():
        acc = v["test_accuracy_values"]
        delta = "—" if d == "none" else f"{100 * (mean(acc) - mean(base)):+.2f}"
        ppl = v.get("test_perplexity_values")
        rows.append(
            [model, d, len(acc), mean_std(acc, 100.0), delta, mean_std(ppl, 1.0, 1) if ppl else "—"]
            + [fmt(v.get("train_seconds_mean"), 0)]
        )
    return rows


def render(s: dict[str, dict[str, Any]]) -> str:
    attacks, utility = s["aegis-attacks"], s["aegis-utility"]
    arows = [r for m, t in attacks["tasks"].items() for r in attack_rows(t, m)]
    rrows = [r for m, t in attacks["tasks"].items() for r in resistance_rows(t, m)]
    urows = [r for m, t in utility["tasks"].items() for r in utility_rows(t, m)]
    return "\n".join(
        [
            "## AEGIS (gradient isolation)",
            "",
            "Regenerated by `python -m results` from `veil audit configs/paper/aegis_attacks.yaml` and "
            "`configs/paper/aegis_utility.yaml` (collected in docs/results/aegis-attacks.json, aegis-utility.json); "
            "never edit by hand. Attacks see one client step of a batch of 4 test sentences (WordPiece, 24 tokens, "
            "weights at init, no dropout; the attacker knows the batch size and the defense's settings, not the "
            "labels); presence F1 excludes [CLS]/[SEP]/[PAD] and is shown beside the F1 of a random guess with as "
            "many guesses; `presence-average` averages 10 exports of the same batch (fresh noise each); `span` is "
            "capped at 50,000 candidate sentences scored and keeps the 256 layer-1 candidates per position closest "
            "to the span; `blocked` = the attack found no gradient to read (frozen or not exported). AEGIS's "
            "defaults: frozen q/k/v/o, embed_noise 3, mlp_noise 1, and on a causal model mlp_down_noise 1; "
            "`aegis(mlp_down_noise=0.0)` is AEGIS as published (the abstract's three channels only).",
            "",
            "### Attacks",
            "",
            table(
                ["model", "defense", "attack", "presence F1 (random, same guesses)", "token recovery", "note"], arows
            ),
            "",
            "### Resistance per defense (the AEGIS goal) and the DP-SGD level that matches it",
            "",
            table(
                [
                    "model",
                    "defense",
                    "best token recovery",
                    "best presence F1 minus random",
                    "worst attack",
                    "goal met, every attack (the verdict)",
                    "goal met, token channels only",
                ],
                rrows,
            ),
            "",
            "**The verdict is the worst case over every attack.** All attacks but one read a token channel "
            "(embedding rows, Q/K/V spans, the MLP), which AEGIS closes. AEGIS leaves the classifier's gradient "
            "clean, and `head-embedding` reads the head's inputs off it (for a batch: a matching pursuit of the 4 "
            "pooled embeddings over the 200 test sentences the batch is drawn from, the pool of a membership or "
            "attribution attacker) and returns the sentences it identifies. Where it finds one, the update is not "
            "protected, whatever the token channels say; the last column is the token channels' verdict alone, for "
            "comparison with the paper's claim. head-embedding is judged by the sentences it identifies exactly "
            "(exact recovery <= 0.05: none of the 4; a random pick of 4 of the 200 identifies 4/200 = 0.02 of them "
            "on average): its token recovery and presence F1 count the common words any 4 pool sentences share with "
            "the batch, and the random-guess F1 beside them is not that baseline (a chance score measured by drawing "
            "random pool sentences is not in the engine yet). The decoders have no classifier: head-embedding is "
            "blocked there. One sample (one batch of 4) per cell: a single identified sentence reads 0.25.",
            "",
            f"### Utility ({len(utility['seeds'])} seed{'s' if len(utility['seeds']) > 1 else ''})",
            "",
            "veil's encoder (SST-2, 2,000 sentences) and decoder (AG News causal LM, 2,000 texts; accuracy = "
            "next-token accuracy), 2 epochs, trained FROM SCRATCH (lr 1e-3): with its attention frozen at random "
            "init and its embedding / MLP-up gradients noised, AEGIS cannot learn a model from scratch; it is a "
            "fine-tuning defense (the pretrained MiniLM and HF GPT-2 are in *Utility of MJP and AEGIS* below). "
            "DP-SGD at every noise multiplier of the attack table's ladder on the encoder, at the lowest on the decoder "
            "(its DP-SGD runs cost ~10x its undefended ones here).",
            "",
            table(
                ["model", "defense", "seeds", "test accuracy (%)", "minus undefended (points)", "test perplexity"]
                + ["train s"],
                urows,
            ),
            "",
            "### Measured once, behind the defaults of `veil.defenses.aegis` and `veil.defenses.noise`",
            "",
            LOCAL_STEP,
            "",
            NOISE_DRAW,
        ]
    )
