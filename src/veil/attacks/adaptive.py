"""Adaptive attackers against AEGIS (and the noise baselines): they know the mechanism — the frozen
set, the noise law and how its scale is set (`Knowledge.defense` = `Defense.describe()`).

presence-adaptive   Channel 2 with the noise law known. Under N(0, s^2 I) an absent row's
                    ||g_v||^2 / s^2 ~ chi2_D and a present row's ~ chi2_D(lambda), lambda =
                    ||signal||^2 / s^2; the likelihood ratio is monotone in ||g_v||^2, so the most
                    powerful rotation-invariant test thresholds it. s is estimated from the data
                    (the median row, absent rows being the vast majority): s^2 = median ||g_v||^2 /
                    median(chi2_D). Rows with z = (||g_v||^2/s^2 - D)/sqrt(2D) above the chi2_D
                    quantile 1 - alpha (alpha = 1/V by default: one expected false positive) are
                    guessed present. ``source=head`` reads the rows of an untied LM head instead
                    (each target pulls its row by -h_t): without head noise, by the widest gap in
                    the sorted log row norms (targets are orders of magnitude above the rest); with AEGIS's head noise, by the chi2 test.
presence-average    The same test on the mean of R exported updates of the same client (R rounds
                    on the same batch and weights: the worst case for the client): the signal
                    stays, the fresh noise shrinks to s / sqrt(R). The other R - 1 updates come in
                    ``Knowledge.aux_data = {"rounds": [grads, ...]}`` (`observe_rounds` makes them).
span-unfrozen       DAGER's span check (eq. 2-3) on every 2-D gradient that is still exported in
                    the first block(s): MLP up (noisy under AEGIS), MLP down, and the head; layer
                    norms are vectors (rank 1, no span to test). The rank cutoff knows which gradients are noised
                    (AEGIS: MLP up, untied LM head, MLP down if mlp_down_noise): there only singular values above the
                    Marchenko-Pastur edge s (sqrt(H) + sqrt(D)) of i.i.d. noise count. Candidates: the input of that module for every vocabulary
                    token as the first content token after the known [CLS] — exact for a causal
                    decoder's first token (it attends only to [CLS] and itself), approximate for an
                    encoder (every position attends to the rest of the sentence).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from scipy.stats import chi2
from torch import Tensor, nn

from veil.attacks import ATTACKS
from veil.attacks.base import Attack, Knowledge, Observation, Reconstruction, observe, param_names
from veil.attacks.options import Options, option
from veil.attacks.presence import special_ids, token_bag
from veil.errors import VeilError
from veil.models.base import VeilModel, linear_weight

# ----------------------------------------------------------------------------- what is known
#: the settings of the noise baselines that put noise on every exported tensor
_NOISE_EVERYWHERE = {"gaussian": "sigma", "dpsgd": "noise_multiplier"}
#: AEGIS's per-channel noise scale, by channel
_AEGIS_SCALE = {"embedding": "embed_noise", "mlp_up": "mlp_noise", "head": "head_noise", "mlp_down": "mlp_down_noise"}


def defense_settings(defense: dict[str, Any]) -> list[dict[str, Any]]:
    """Each defense's granted settings (`Defense.describe()`), from `Knowledge.defense` in either
    shape: one flat description (``{"name": "aegis", ...}``) or the harness's, nested under each
    defense's name (``{"aegis": {"name": "aegis", ...}}``, `veil.attacks.harness.knowledge_for`)."""
    if not defense:
        return []
    if "name" in defense and not isinstance(defense["name"], dict):
        return [defense]
    return [{"name": k, **v} for k, v in defense.items() if isinstance(v, dict)]


def noised_channel(defense: dict[str, Any], channel: str) -> bool:
    """Whether a granted defense puts noise on `channel` (embedding, mlp_up, head, mlp_down): AEGIS
    by its scale for that channel, the Gaussian and DP-SGD baselines on every tensor."""
    for s in defense_settings(defense):
        name = str(s.get("name"))
        if name in _NOISE_EVERYWHERE and float(s.get(_NOISE_EVERYWHERE[name]) or 0) > 0:
            return True
        if name == "aegis" and float(s.get(_AEGIS_SCALE[channel]) or 0) > 0:
            return True
    return False


def any_defense(defense: dict[str, Any]) -> bool:
    """Whether the knowledge names a defense other than none."""
    return any(s.get("name") not in (None, "none") for s in defense_settings(defense))


# ----------------------------------------------------------------------------- presence
def presence_rows(obs: Observation, source: str) -> Tensor:
    """The (rows, D) gradient the presence test reads: token embedding or untied LM head."""
    model = obs.model
    emb = model.token_embedding()
    head = model.classifier()
    tied = getattr(head, "weight", None) is emb.weight
    if source == "embedding":
        if tied:
            raise VeilError(
                "presence-adaptive needs an untied token embedding; this model ties it to the LM head (use source=head on untied decoders)"
            )
        return obs.grad(emb).float()
    if source == "head":
        if model.task != "lm" or tied:
            raise VeilError("presence-adaptive source=head needs an untied LM head (a causal LM); this model has none")
        return linear_weight(head, obs.grad(head)).float()
    raise VeilError(f"presence-adaptive source must be 'embedding' or 'head', got {source!r}")


def presence_reads(model: VeilModel, source: str) -> list[str]:
    """The tensor a presence test reads: the token embedding, or the LM head with ``source=head``."""
    return param_names(model, [model.classifier() if source == "head" else model.token_embedding()])[:1]


def chi2_scores(rows: Tensor) -> tuple[Tensor, float]:
    """z-scores of ||g_v||^2 / s^2 against chi2_D, with s^2 estimated from the median row."""
    sq = rows.pow(2).sum(1).double()
    D = rows.shape[1]
    s2 = float(sq.median()) / chi2.median(D)
    if s2 <= 0:  # no noise: absent rows are exact zeros
        return torch.where(sq > 0, torch.inf, -torch.inf), 0.0
    return (sq / s2 - D) / math.sqrt(2 * D), s2


def log_norm_scores(rows: Tensor) -> Tensor:
    """Robust z-scores (median / MAD) of log row norms: a clean LM head's target rows are outliers."""
    ln = rows.norm(dim=1).clamp_min(1e-30).log().double()
    med = ln.median()
    return (ln - med) / (1.4826 * (ln - med).abs().median()).clamp_min(1e-12)


def largest_gap_cut(z: Tensor) -> float:
    """The midpoint of the widest gap between consecutive sorted scores above the median."""
    top = z.sort(descending=True).values[: max(2, len(z) // 2)]
    gaps = top[:-1] - top[1:]
    i = int(gaps.argmax())
    return float((top[i] + top[i + 1]) / 2)


def guess_present(z: Tensor, D: int, alpha: float) -> Tensor:
    """Rows whose statistic exceeds the chi2_D (1 - alpha) quantile, in z units."""
    cut = (chi2.isf(alpha, D) - D) / math.sqrt(2 * D)
    return torch.nonzero(z > cut).flatten()


def random_guess_f1(n_true: int, n_guess: int, n_rows: int) -> float:
    """Expected presence F1 of `n_guess` rows drawn at random: precision K/V, recall m/V."""
    if n_true == 0 or n_guess == 0:
        return 0.0
    return 2 * n_true * n_guess / (n_rows * (n_true + n_guess))


@dataclass(frozen=True)
class PresenceTestOptions(Options):
    alpha: float | None = option(None, "false-positive rate per row of the chi-square test; unset: 1 / vocabulary")
    source: Literal["embedding", "head"] = option("embedding", "rows tested: the token embedding's or the LM head's")
    keep_special: bool = option(False, "keep the special tokens in the bag")


_PresenceOptionsT = TypeVar("_PresenceOptionsT", bound=PresenceTestOptions)


class _PresenceTest(Attack[_PresenceOptionsT]):
    modality = "text"
    observes = frozenset({"gradient", "delta"})
    closed_form = "one test per vocabulary row"

    def _test(self, rows: Tensor, obs: Observation, know: Knowledge, rounds: int) -> Reconstruction:
        alpha = 1.0 / rows.shape[0] if self.options.alpha is None else self.options.alpha
        if self.options.source == "head" and not noised_channel(know.defense, "head"):
            z, s2 = log_norm_scores(rows), 0.0  # clean head: softmax mass on every row, targets stand out
            found = set(torch.nonzero(z > largest_gap_cut(z)).flatten().tolist())
        else:
            z, s2 = chi2_scores(rows)
            found = set(guess_present(z, rows.shape[1], alpha).tolist())
        max_z = float(z.max()) if torch.isfinite(z.max()) else None
        stats = {"noise_std": math.sqrt(s2), "alpha": alpha, "rows": rows.shape[0], "rounds": rounds, "max_z": max_z}
        return token_bag(found, obs, know, self.options.keep_special, **stats)


@ATTACKS.register(
    "presence-adaptive",
    help="token bag by a chi-square test of embedding row norms, knowing the noise law (adaptive vs AEGIS)",
)
class PresenceAdaptive(_PresenceTest[PresenceTestOptions]):
    """Chi-square presence test on the noised rows (options: `PresenceTestOptions`)."""

    knows = "the defense's mechanism (noised tables, noise law: Knowledge.defense) and the token-embedding gradient"

    def reads(self, model: VeilModel) -> list[str]:
        """The token embedding's rows, or the untied LM head's (``source=head``)."""
        return presence_reads(model, self.options.source)

    def _reconstruct(self, obs: Observation, know: Knowledge) -> Reconstruction:
        return self._test(presence_rows(obs, self.options.source), obs, know, 1)


@dataclass(frozen=True)
class PresenceAverageOptions(PresenceTestOptions):
    rounds: int = option(10, "exports of the same batch the server averages (the harness makes the other R - 1)")

    def __post_init__(self) -> None:
        if self.rounds < 2:
            raise VeilError(
                f"presence-average: option 'rounds' must be at least 2 (one export is presence-adaptive), got {self.rounds}"
            )


@ATTACKS.register(
    "presence-average", help="presence test on the mean of R rounds of one client's updates (needs aux_data rounds)"
)
class PresenceAverage(_PresenceTest[PresenceAverageOptions]):
    """Options as presence-adaptive, and `rounds`; the other rounds in ``Knowledge.aux_data["rounds"]``
    (`veil.attacks.harness` observes them when it runs the attack; a caller may pass its own)."""

    knows = "the defense's mechanism and R updates of the same client on the same batch"
    observes = frozenset({"gradient", "delta", "repeats"})

    def reads(self, model: VeilModel) -> list[str]:
        """As presence-adaptive."""
        return presence_reads(model, self.options.source)

    def _reconstruct(self, obs: Observation, know: Knowledge) -> Reconstruction:
        source = self.options.source
        others = (know.aux_data or {}).get("rounds") if isinstance(know.aux_data, dict) else None
        if not others:
            raise VeilError(
                "presence-average needs the client's other updates in knowledge aux_data={'rounds': [grads, ...]}"
            )
        rows = presence_rows(obs, source)
        for grads in others:
            rows = rows + presence_rows(Observation(obs.model, grads), source)
        return self._test(rows / (len(others) + 1), obs, know, len(others) + 1)


def observe_rounds(model: VeilModel, batch: dict[str, Tensor], defenses: list, rounds: int) -> list[Observation]:
    """R defended exports of the same batch from the same weights (fresh noise each: step r)."""
    if rounds < 1:
        raise VeilError(f"rounds must be at least 1, got {rounds}")
    return [observe(model, batch, defenses, step=r) for r in range(rounds)]


# ----------------------------------------------------------------------------- span on what is left
class _Stop(Exception):
    pass


def module_inputs(model: VeilModel, modules: list[nn.Module], ids: Tensor, prefix: list[int]) -> list[Tensor]:
    """Inputs of `modules` at the last position when each id in `ids` follows the known `prefix`
    (e.g. [CLS]) as a short sentence."""
    seen: dict[int, Tensor] = {}
    hooks = [
        m.register_forward_pre_hook(lambda mod, a, i=i: seen.__setitem__(i, a[0][:, -1].detach()))
        for i, m in enumerate(modules)
    ]
    seqs = torch.cat([torch.tensor(prefix, dtype=torch.long).expand(len(ids), len(prefix)), ids[:, None]], dim=1)
    try:
        with torch.no_grad():
            model(
                {
                    "input_ids": seqs,
                    "attention_mask": torch.ones_like(seqs),
                    "labels": torch.zeros(len(ids), dtype=torch.long),
                }
            )
    finally:
        for h in hooks:
            h.remove()
    return [seen[i] for i in range(len(modules))]


def noisy_span(g: Tensor, noise_aware: bool, rank_tol: float = 1e-6) -> Tensor:
    """Orthonormal basis (in, r) of the row space of g (out, in); above the MP edge if noise_aware."""
    g = g.double()
    _, s, vh = torch.linalg.svd(g, full_matrices=False)
    if s.numel() == 0 or s[0] == 0:
        return vh[:0].T
    keep = s > rank_tol * s[0]
    if noise_aware:  # noise-dominated: std from the Frobenius norm, keep what rises above the bulk
        H, D = g.shape
        std = float(g.norm()) / math.sqrt(H * D)
        keep &= s > 1.05 * std * (math.sqrt(H) + math.sqrt(D))
    return vh[keep].T


@dataclass(frozen=True)
class SpanUnfrozenOptions(Options):
    tol: float = option(0.01, "a token passes when its input's relative distance to the gradient's span is below tol")
    blocks: int = option(1, "first blocks whose MLP layers are checked")
    noise_aware: bool | None = option(
        None, "keep only singular values above the noise bulk; unset: when the knowledge names a defense"
    )


@ATTACKS.register(
    "span-unfrozen",
    help="DAGER span check on every still-exported first-block layer (MLP up/down, head), noise-aware rank",
)
class SpanUnfrozen(Attack[SpanUnfrozenOptions]):
    """DAGER's span check on the first blocks' still-exported layers (options: `SpanUnfrozenOptions`)."""

    knows = "the defense's frozen set and noised channels (Knowledge.defense); the gradients still exported in the first blocks"
    modality = "text"
    observes = frozenset({"gradient", "delta"})
    closed_form = "rank tests on the unfrozen blocks' gradients"

    def _targets(self, model: VeilModel, blocks: int) -> dict[str, nn.Module]:
        out: dict[str, nn.Module] = {}
        for b in range(min(blocks, len(model.mlp_up()))):
            out[f"mlp_up.{b}"] = model.mlp_up()[b]
            out[f"mlp_down.{b}"] = model.mlp_down()[b]
        out["head"] = model.classifier()
        return out

    def reads(self, model: VeilModel) -> list[str]:
        """The first blocks' MLP layers and the head (`_targets`)."""
        return param_names(model, [m.weight for m in self._targets(model, self.options.blocks).values()])

    def _reconstruct(self, obs: Observation, know: Knowledge) -> Reconstruction:
        model = obs.model
        tol, noise_aware = self.options.tol, self.options.noise_aware
        if noise_aware is None:
            noise_aware = any_defense(know.defense)
        targets = {k: m for k, m in self._targets(model, self.options.blocks).items() if obs.has_grad(m)}
        vocab = torch.arange(model.token_embedding().weight.shape[0])
        was = model.training
        model.eval()
        try:
            cls = getattr(know.tokenizer, "cls_id", None)
            inputs = module_inputs(model, list(targets.values()), vocab, [] if cls is None else [int(cls)])
        finally:
            model.train(was)
        specials = set(special_ids(model, know.tokenizer))
        per_layer, found = {}, set()
        for (name, mod), x in zip(targets.items(), inputs):
            channel = "head" if name == "head" else name.split(".")[0]
            noised = noise_aware and noised_channel(know.defense, channel)
            basis = noisy_span(linear_weight(mod, obs.grad(mod)), noised)
            if basis.shape[1] == 0 or basis.shape[1] >= basis.shape[0] or x.shape[-1] != basis.shape[0]:
                per_layer[name] = {"rank": int(basis.shape[1]), "width": int(basis.shape[0]), "passed": 0}
                continue
            xd = x.double()
            d = (xd - (xd @ basis) @ basis.T).norm(dim=1) / xd.norm(dim=1).clamp_min(1e-30)
            hit = set(torch.nonzero(d < tol).flatten().tolist()) - specials
            per_layer[name] = {"rank": int(basis.shape[1]), "width": int(basis.shape[0]), "passed": len(hit)}
            found |= hit
        return Reconstruction(token_set=found, stats={"layers": per_layer, "noise_aware": noise_aware, "tol": tol})
