"""The `seed-claims` section: each seed paper's headline privacy claim, confirmed or refuted by the
strongest attack veil ran against that defense in any collected audit (docs/results/*.json).

Every row scans every collected summary for the tasks that ran the claim's defense (and match its
model / dropout filter). *naive*: the attack that rebuilt the most among those that do not know
the defense (their `knows` ends in "(naive)"); *worst case*: the audit's own verdict
(`summary.tasks[t].worst_case[defense]`, `veil.metrics.leakage`: naive or adaptive, e.g.
`head-embedding`, `span-mjp`, `april-mjp`). Nothing collected: "not measured", verdict open.

Verdict rules (a claim of protection is refuted by the strongest attacker veil has):
  images    refuted if an attack rebuilds a region of the defended image at >= 30 dB PSNR (a
            near-identical copy); confirmed if the best stays within 3 dB of the paper's defended
            figure or below; partly otherwise.
  text      refuted if the best bag of words (ROUGE-1 / presence F1) or token recovery is >= 0.5;
            confirmed if both are <= 0.05; partly otherwise.
  features  (split learning) refuted if the best PSNR on p-FeSTA's permuted features is within 3 dB
            of the inversion of FeSTA's unpermuted ones in the same task; confirmed within 3 dB of the
            naive one; partly otherwise.
"confirmed" means that no attack veil ran beat the claim: a lower bound on the leakage, never proof.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from results import load
from veil.metrics.leakage import cell_leakage

NAME = "seed-claims"
#: the audits the claims are judged on (the section waits until all are collected, so a partial
#: collection never replaces a verdict with "not measured"); each claim scans all of them
SOURCES = (
    "attacks-image",
    "adaptive-image",
    "adaptive-text",
    "aegis-tag",
    "attacks-text",
    "span-robust",
)
#: read too when collected (the split-learning feature attacks: hours on this machine)
OPTIONAL = ("pfesta_tables4_5", "quickstart", "aegis-down")
NM = "not measured"
#: at most this many (audit, task) figures per cell, the strongest first
SHOWN = 4


@dataclass(frozen=True)
class Claim:
    paper: str
    claim: str
    defense: str  # a defense name (its label's prefix before any options)
    kind: str  # images | text | features
    models: tuple[str, ...] = ()  # only tasks of these models ('' : any)
    dropout: float | None = None  # only tasks with this client dropout
    defended_db: float = 0.0  # images: the paper's defended PSNR
    naive: tuple[str, ...] = ()  # the naive column's attacks (name prefixes; '': any naive attack)
    only: tuple[str, ...] = ()  # both columns: only these attacks (name prefixes; '': every attack)
    plain: str = "none"  # the undefended entry of the same task (features: split learning's unpermuted protocol)
    recipe: str = ""  # AEGIS only: "published" | "default" (`_recipe`); '': any settings
    pool_free: bool = False  # leave out the attacks that need a candidate pool holding the private input
    sources: tuple[str, ...] = ()  # only these audits ('': all collected)


CLAIMS = (
    Claim(
        "MJP",
        "APRIL's reconstruction fails on MJP models: PSNR 19.27 (ViT-S) → 11.52 (DeiT-S+MJP, a), 8.07 (c) (Table VIII)",
        "mjp",
        "images",
        defended_db=11.52,
        naive=("april",),
    ),
    Claim(
        "MJP",
        "an optimisation attack rebuilds less from MJP: PSNR 14.25 → 13.71 (Table IX)",
        "mjp",
        "images",
        defended_db=13.71,
        naive=("ig", "dlg"),
    ),
    Claim(
        "MJP",
        "TAG yields unrecognisable text from MJP models: ROUGE-1 39.2% → 1.4% (Transformer4, Yelp, Table X)",
        "mjp",
        "text",
    ),
    Claim(
        "AEGIS",
        "token recovery near zero against analytical, optimisation and adaptive attacks with full knowledge of the "
        "mechanism",
        "aegis",
        "text",
    ),
    Claim(
        "AEGIS, as published",
        "the same claim for the abstract's three channels alone (no LM-head or down-projection noise), against "
        "the strongest attacker without a candidate pool",
        "aegis",
        "text",
        recipe="published",
        pool_free=True,
    ),
    Claim(
        "AEGIS, veil's default",
        "the same claim with veil's default (+ eq. M noise on every down-projection, eq. E on an untied LM head), "
        "against the strongest attacker without a candidate pool",
        "aegis",
        "text",
        recipe="default",
        pool_free=True,
        sources=("aegis-down", "quickstart"),
    ),
    Claim(
        "p-FeSTA",
        "inverting permuted patch features is infeasible: the attacker would need the unknown order and position "
        "embedding",
        "pfesta",
        "features",
        plain="festa",
    ),
    Claim(
        "veil (docs, not a seed paper)",
        "with client dropout 0.1 the span attack recovers nothing (MiniLM, batch 1)",
        "none",
        "text",
        models=("minilm",),
        dropout=0.1,
        only=("span",),
    ),
)


def _modality(leakage: dict[str, dict[str, Any]]) -> str:
    keys = {k for cells in leakage.values() for m in cells.values() for k in m}
    return "images" if "psnr" in keys else "text" if keys & {"rouge1", "presence_f1", "token_recovery"} else "other"


def _strength(c: dict[str, Any], kind: str) -> float:
    """The figure a verdict compares: PSNR (images, features) or max(bag, token recovery) (text)."""
    if kind == "text":
        return max(float(c["value"]), float(c["beside"].get("token_recovery", 0.0)))
    return float(c["value"])


def _figure(source: str, task: str, defense: str, attack: str, c: dict[str, Any], kind: str) -> str:
    where = f"{source} / {task} / {defense}"
    if kind == "text":
        tok = c["beside"].get("token_recovery")
        extra = f", token recovery {float(tok):.2f}" if tok is not None and c["metric"] != "token_recovery" else ""
        return f"{where}: `{attack}` {c['metric']} {float(c['value']):.2f}{extra}"
    return f"{where}: `{attack}` {float(c['value']):.1f} dB ({c['region']})"


#: attacks that match the update to a pool of candidate inputs holding the private one
POOLED = ("head-embedding",)
#: models whose LM head AEGIS's published recipe leaves clean (causal LMs)
DECODERS = ("gpt-tiny", "llama-tiny", "hf-gpt2", "hf-llama", "hf-decoder")


def _recipe(claim: Claim, defense: str, model: str) -> bool:
    """Whether an AEGIS defense label is the claim's recipe: as published (no down-projection noise,
    and on a causal LM no head noise either), or veil's default (the bare name; audits made since
    the default noises encoders' down-projections too: `Claim.sources`)."""
    if claim.recipe == "published":
        return "mlp_down_noise=0.0" in defense and ("head_noise=0.0" in defense or not model.startswith(DECODERS))
    if claim.recipe == "default":
        return defense == claim.defense
    return True


def _matches(claim: Claim, t: dict[str, Any]) -> bool:
    if claim.models and not str(t.get("model", "")).startswith(claim.models):
        return False
    return claim.dropout is None or float(t.get("dropout", 0.0) or 0.0) == claim.dropout


def _best(cells: dict[str, dict[str, Any]], kind: str, keep: Any = lambda a: True) -> tuple[str, dict[str, Any]] | None:
    scored = [(a, c) for a, m in cells.items() if keep(a) and (c := cell_leakage(m)) and c["tier"] == 1]
    # the verdict's figure first, then the engine's score (bag + tokens in place) between equals
    return max(scored, key=lambda ac: (round(_strength(ac[1], kind), 3), ac[1]["score"]), default=None)


def evidence(claim: Claim, summaries: dict[str, dict[str, Any]]) -> dict[str, list[tuple[float, str]]]:
    """(strength, text) of the naive best, the worst case and the undefended worst, per matching task."""
    out: dict[str, list[tuple[float, str]]] = {"naive": [], "worst": [], "plain": []}
    want = "images" if claim.kind in ("images", "features") else "text"
    for source, s in sorted(summaries.items()):
        if claim.sources and source not in claim.sources:
            continue
        for name, t in (s.get("tasks") or {}).items():
            leakage = (t or {}).get("leakage") or {}
            if not _matches(claim, t) or _modality(leakage) != want:
                continue
            knows = t.get("attacker_knows", {})
            for d, cells in leakage.items():
                if d.split("(")[0] != claim.defense or not _recipe(claim, d, str(t.get("model", ""))):
                    continue
                if claim.pool_free:
                    cells = {a: c for a, c in cells.items() if not a.startswith(POOLED)}
                naive = _best(
                    cells,
                    claim.kind,
                    lambda a, knows=knows: (
                        str(knows.get(a, "")).endswith("(naive)")
                        and a.startswith(claim.naive or "")
                        and a.startswith(claim.only or "")
                    ),
                )
                worst = _best(cells, claim.kind, lambda a: a.startswith(claim.only or ""))
                for key, got in (("naive", naive), ("worst", worst)):
                    if got:
                        out[key].append(
                            (_strength(got[1], claim.kind), _figure(source, name, d, got[0], got[1], claim.kind))
                        )
                plain = _best(leakage.get(claim.plain, {}), claim.kind)
                if plain and claim.defense != claim.plain:
                    out["plain"].append((_strength(plain[1], claim.kind), ""))
    return out


def verdict(claim: Claim, ev: dict[str, list[tuple[float, str]]]) -> str:
    if not ev["worst"]:
        return "open"
    best = max(v for v, _ in ev["worst"])
    if claim.kind == "images":
        return "refuted" if best >= 30 else "confirmed" if best <= claim.defended_db + 3 else "partly"
    if claim.kind == "features":
        plain = max((v for v, _ in ev["plain"]), default=None)
        naive = max((v for v, _ in ev["naive"]), default=None)
        if plain is None:
            return "open"
        if best >= plain - 3:  # refuting needs only the unpermuted inversion beside it
            return "refuted"
        if naive is None:
            return "open"
        return "confirmed" if best <= naive + 3 else "partly"
    return "refuted" if best >= 0.5 else "confirmed" if best <= 0.05 else "partly"


def _cell(items: list[tuple[float, str]]) -> str:
    if not items:
        return NM
    ranked = sorted(dict((t, (v, t)) for v, t in items).values(), key=lambda vt: -vt[0])  # duplicates once
    more = f"; +{len(ranked) - SHOWN} more" if len(ranked) > SHOWN else ""
    return "; ".join(t for _, t in ranked[:SHOWN]) + more


def render(summaries: dict[str, dict[str, Any]], extra: dict[str, dict[str, Any]] | None = None) -> str:
    """The section from {source: summary} (the framework passes SOURCES) and `extra` (default: the
    OPTIONAL sources collected in docs/results/)."""
    if extra is None:
        extra = {n: got for n in OPTIONAL if (got := load(n)) is not None}
    summaries = {**summaries, **extra}
    lines = [
        "## Seed claims, confirmed or refuted",
        "",
        "Regenerated by `python -m results` from the collected audits "
        + ", ".join(f"`{n}`" for n in sorted(summaries))
        + " (docs/results/NAME.json); never edit by hand. A claim of protection is judged by the strongest attacker veil ran against that defense (the worst "
        "case column: naive or knowing the mechanism, e.g. `head-embedding`, which reads the classifier's input off its "
        "clean gradient); the naive column is the best attack that does not know the defense. Each cell lists the "
        f"strongest figures, audit / task first (at most {SHOWN}). Verdict rules "
        "(`results.sections.seed_claims`): images refuted at >= 30 dB on a rebuilt region; text refuted "
        "at >= 0.5 bag of words or token recovery, confirmed at <= 0.05; split learning refuted within 3 dB of the "
        'unpermuted inversion. "confirmed" only means that no attack veil ran beat the claim; "not measured": no '
        "collected audit ran that defense. veil's models and data are small stand-ins for the papers' (vit-digits for "
        "DeiT-S, transformer4 on SST-2 for Transformer4 on Yelp): a verdict is about the mechanism, measured at veil's "
        "scale.",
        "",
        "| paper | headline privacy claim | veil, naive attack | veil, worst case | verdict |",
        "|---|---|---|---|---|",
    ]
    for claim in CLAIMS:
        ev = evidence(claim, summaries)
        lines.append(
            f"| {claim.paper} | {claim.claim} | {_cell(ev['naive'])} | {_cell(ev['worst'])} | "
            f"**{verdict(claim, ev)}** |"
        )
    missing = [n for n in OPTIONAL if n not in summaries]
    if missing:
        lines += [
            "",
            "Not collected: " + ", ".join(f"`{n}`" for n in missing) + " (`veil audit configs/paper/NAME.yaml`, "
            "then `python -m results collect RUN_DIR`); a claim only they measure stays open until they "
            "are (p-FeSTA: the split-learning feature attacks, hours on this 2-core machine; the script-made table "
            "this section replaced read them from a cache no longer here).",
        ]
    return "\n".join(lines)
