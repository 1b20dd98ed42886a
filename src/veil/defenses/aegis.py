"""AEGIS — Attention-Embedding Gradient Isolation Shield (triple-channel gradient masking for
federated LLM fine-tuning; `seeds/aegis-gradient-isolation.txt`, abstract only).

The paper names three channels through which a Transformer's gradient leaks private tokens and
closes each with one backward-path operation, with no change to the architecture:

  Channel 1  attention projection gradients  dL/dW_{q,k,v,o} = sum_t delta_t x_t^T have rank <= n
             (n tokens) and their row space is the span of the layer's inputs x_t: a span check
             of candidate embeddings (DAGER) recovers the tokens.
             -> FREEZE W_{q,k,v,o} (+ biases): requires_grad=False, so they get no update and
             export no gradient. Closed by construction.
  Channel 2  token-embedding gradient: dL/dE[v] = 0 for every vocabulary row v not in the batch,
             so the non-zero rows ARE the bag of tokens.
             -> Gaussian noise on EVERY row (absent rows too), eq. (E) below.
  Channel 3  MLP expansion (fc1 / intermediate / c_fc) gradient: same low-rank structure as
             channel 1, on the post-attention hidden states.
             -> per-block Gaussian noise, eq. (M) below.

All three act in `transform_grads`, in place on ``p.grad`` — `veil.training.step.client_step`
exports and steps with that one tensor, so neither the local optimiser nor the server sees a
clean gradient.

Calibration (where the abstract is silent, our choices):

(E) Row noise std per coordinate   s_E = embed_noise * rho_max / (2 D)^{1/4},
    rho_max = the largest row norm of the clean embedding gradient at this step.
    Why: with the attacker knowing s_E, the row norm ||g_v||^2 / s_E^2 is the sufficient
    statistic of any rotation-invariant presence test (the likelihood ratio chi2_D(lambda) vs
    chi2_D is monotone in it). Absent rows give chi2_D: mean D, std sqrt(2D). A present row of
    norm rho shifts the mean by lambda = rho^2 / s_E^2, i.e. by rho^2 / (embed_noise^2 rho_max^2)
    <= 1 / embed_noise^2 absent-row standard deviations — a width-free bound for EVERY row.
    We scale to the largest row, not to the typical (median) present row: row norms grow with
    a token's count in the batch ([CLS], [SEP], "the", "." carry 10-100x the median), so noise
    sized to the median would leave exactly the frequent tokens visible. The scale is data-
    dependent (it follows the gradient as the loss falls); it reveals only rho_max.
(M) Block noise std per entry      s_M = mlp_noise * ||G_l||_F / (H_l D_l)^{1/4}
    for the (H_l x D_l) weight gradient G_l of block l (the bias uses its own norm, same law).
    Why: a spiked signal of singular value sigma in H x D i.i.d. noise of std s is detectable
    in the noisy spectrum (BBP transition) only if sigma > s (H D)^{1/4}. Every singular value of
    G_l is <= ||G_l||_F, so mlp_noise >= 1 puts each direction of the input span at or below the
    threshold: the top singular subspace is noise, and a span check of true inputs against it
    fails. Per block, because gradient norms differ by orders of magnitude across depth.

Channel 2 has a twin in a causal LM whose head is NOT tied to the embedding (veil's gpt-tiny,
Llama-style models): row v of dL/dW_head = sum_t (p_tv - 1[y_t = v]) h_t, and the target rows
stand out by orders of magnitude (measured: presence F1 ~1 from the clean head). The abstract's
models tie it (GPT-2), where the embedding noise covers it; for untied heads we add the same
row noise, eq. (E), to the head rows (``head_noise``, default = embed_noise; 0 disables).

The abstract names three channels; we measured a fourth it does not: the MLP down-projection
(fc2 / c_proj) gradient, left clean, leaks in a CAUSAL model. There the down-projection's input
at position t depends only on tokens <= t, so DAGER's span check on it grows sentences token by
token (`span-unfrozen` found every sentence's first token on gpt-tiny under AEGIS as published:
presence F1 0.108 against 0.0002 for a random guess). In a bidirectional encoder the same input
mixes the whole sentence: a span check needs whole-sentence hypotheses, whose candidates come
from the bag of tokens that channel 2's noise destroys (measured: span-unfrozen finds nothing on
transformer4, even undefended). ``mlp_down_noise`` applies eq. (M) to it; its default (None)
resolves at attach time to 1.0 for causal models (`VeilModel.causal`) and 0 for encoders, so the
encoder defense is AEGIS as published and the decoder defense closes the fourth channel too.
An optimisation attack does use that channel on an encoder, though: TAG recovers 0.250 of the
tokens in place from a trained transformer4's update under these defaults, 0.096 with
mlp_down_noise 0.3, 0.048 with 1.0, 0.001 undefended (docs/results.md, "AEGIS against an
optimisation attack"). Set ``mlp_down_noise: 1.0`` on an encoder when such attackers matter; the
encoder default stays as published because that costs accuracy (MiniLM on SST-2: -3.6 points
with 1.0, -2.0 with 0.3, against -0.4 without it; docs/results.md utility table).

Defaults (measured with `veil analyze channels` and the attacks in `veil.attacks.adaptive`,
numbers in docs/results.md): embed_noise=3.0 (a present row moves the norm statistic by at most
0.11 absent-row std), mlp_noise=1.0 (the BBP bound); freeze_attention=True; mlp_down_noise by
model (above). With embed_noise=0, mlp_noise=0, mlp_down_noise=0 and freeze_attention=False the
defense is bit-identical to none (head_noise follows embed_noise unless set).

``freeze_attention_bias=False`` freezes only the projection WEIGHTS. Channel 1 lives in the
weight gradient sum_t delta_t x_t^T; a bias gradient is sum_t delta_t, which holds no input
vector x_t, and with the weights frozen there is no exported weight gradient it could serve as
a key for (a clean bias is dangerous beside a NOISED weight of the same layer: G^T db is a
combination of the inputs — why the MLP-up bias stays noised). Off by default: the abstract
freezes the projection "parameters".

Local step. The noised gradient drives the client's own optimiser step too. Two measured
consequences (MiniLM on 1,500 SST-2 sentences, seed 0, `veil train`): (1) global-norm clipping
must see the CLEAN gradient (`veil.training.step` clips before any defense): the embedding noise
has ~10^3 times the clean gradient's norm, and clipping after it pushed every clean gradient
below Adam's epsilon; (2) what AEGIS costs in accuracy there is the frozen attention (-1.3
points) and the MLP-up noise (-1.8 more: Adam sees almost no signal in that table), not the
embedding noise (-0.1). ``noised_lr`` scales the local learning rate of the noised tables (1.0 =
the same as the rest; 0.1 and 0 gave the same accuracy as 1.0 on that run), which keeps Adam's
per-coordinate normalisation from turning pure-noise rows into full-size random steps.
``lr_scale`` multiplies the local learning rate of every parameter that still trains. With the
attention frozen and the noised tables learning next to nothing, the rest of the model (MLP
down-projections, norms, head) carries the fine-tuning and wants a larger step — as in other
partial fine-tuning. Measured on a validation split of SST-2's training pool, never the test
split (`scripts/screen_aegis_minilm.py`, MiniLM, 2,000 sentences, seeds 0 and 1): AEGIS at lr
1e-4 -2.3 / -1.7 points below undefended, at 3e-4 (lr_scale 3) -0.7 / -0.6, at 6e-4 -0.6 /
-1.2; undefended itself is best at 1e-4 (-0.3 / -0.7 at 3e-4). Default 1.0: the best scale
depends on the model and its recipe; set it per task (configs/paper/minilm_utility.yaml: 3).

Noise is seeded and changes every call: one stream per call keyed on (seed, step, call count),
so two runs with the same seed draw the same noise, and no two calls ever repeat it — repeated
noise would cancel in the difference of two updates. All noised tables of a step share one draw,
taken with their scales and added in one pass (`veil.defenses.noise.noise_tables_`: SFC64 bits,
Box-Muller compiled with torch.compile, or in numpy where no C++ compiler works). That draw is
most of what AEGIS costs on a CPU, where the vocabulary-sized tables dominate a small model:
transformer4's step costs 1.09x an undefended one on one core and 1.03-1.13x on two
(docs/results.md), against 1.13-1.14x and 1.12-1.25x with the numpy path.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torch import Tensor, nn

from veil.defenses import DEFENSES
from veil.defenses.base import KeyedNoiseDefense, check_seed
from veil.defenses.noise import Statistic, noise_tables_
from veil.errors import VeilError
from veil.models.base import VeilModel


def check_scale(name: str, value: float) -> float:
    """A noise scale: a finite number >= 0."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise VeilError(f"{name} must be a number >= 0, got {value!r}") from None
    if not np.isfinite(v) or v < 0:
        raise VeilError(f"{name} must be a finite number >= 0, got {value!r}")
    return v


def attention_parameters(model: VeilModel, biases: bool = True) -> list[nn.Parameter]:
    """The q, k, v, o projection weights (and biases) — a fused c_attn counted once."""
    seen: dict[int, nn.Parameter] = {}
    for layer in model.attention_layers():
        for mod in (layer.q, layer.k, layer.v, layer.o):
            for name, p in mod.named_parameters(recurse=False):
                if biases or name != "bias":
                    seen.setdefault(id(p), p)
    return list(seen.values())


def row_norm_max(grad: Tensor) -> Tensor:
    """rho_max of eq. (E): the largest row norm."""
    return grad.reshape(grad.shape[0], -1).norm(dim=1).max()


def frobenius(grad: Tensor) -> Tensor:
    """||G||_F of eq. (M)."""
    return grad.norm()


def embedding_factor(grad: Tensor, scale: float) -> float:
    """s_E / rho_max = scale / (2 D)^{1/4}."""
    return scale / (2 * grad[0].numel()) ** 0.25


def block_factor(grad: Tensor, scale: float) -> float:
    """s_M / ||G||_F = scale / (H D)^{1/4}."""
    return scale / grad.numel() ** 0.25


def untied_lm_head(model: VeilModel) -> nn.Parameter | None:
    """The LM head's (vocab, D) weight when it is NOT the token embedding (tied heads are covered)."""
    if model.task != "lm":
        return None
    w = getattr(model.classifier(), "weight", None)
    return None if w is None or w is model.token_embedding().weight else w


#: (channel, parameter, statistic of the clean gradient, factor): the noise std is factor * statistic
NoiseTarget = tuple[str, nn.Parameter, Statistic, float]


class Aegis(KeyedNoiseDefense):
    """AEGIS: freeze attention projections, calibrated noise on the embedding and MLP-up gradients."""

    name = "aegis"
    modalities = ("text",)

    def __init__(
        self,
        freeze_attention: bool = True,
        freeze_attention_bias: bool = True,
        embed_noise: float = 3.0,
        mlp_noise: float = 1.0,
        head_noise: float | None = None,
        mlp_down_noise: float | None = None,
        noised_lr: float = 1.0,
        lr_scale: float = 1.0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not isinstance(freeze_attention, bool):
            raise VeilError(f"freeze_attention must be true or false, got {freeze_attention!r}")
        if not isinstance(freeze_attention_bias, bool):
            raise VeilError(f"freeze_attention_bias must be true or false, got {freeze_attention_bias!r}")
        self.freeze_attention = freeze_attention
        self.freeze_attention_bias = freeze_attention_bias
        self.embed_noise = check_scale("embed_noise", embed_noise)
        self.mlp_noise = check_scale("mlp_noise", mlp_noise)
        self.head_noise = self.embed_noise if head_noise is None else check_scale("head_noise", head_noise)
        #: None = by model: 1.0 for causal models, 0 for encoders (see the module docstring)
        self.mlp_down_setting = None if mlp_down_noise is None else check_scale("mlp_down_noise", mlp_down_noise)
        self.mlp_down_noise = self.mlp_down_setting or 0.0
        self.noised_lr = check_scale("noised_lr", noised_lr)
        self.lr_scale = check_scale("lr_scale", lr_scale)
        self.seed = check_seed(seed)
        self._frozen: list[tuple[nn.Parameter, bool]] = []
        self._work: dict[str, Tensor] = {}  # the numpy draw's work space, reused across steps
        #: the noise std used at the last call, by channel (for the analysis and adaptive attackers)
        self.last_std: dict[str, Any] = {}

    def _attach(self, model: VeilModel) -> None:
        self._calls = 0
        if self.mlp_down_setting is None:
            self.mlp_down_noise = 1.0 if model.causal else 0.0
        if self.freeze_attention:
            self._frozen = [(p, p.requires_grad) for p in attention_parameters(model, self.freeze_attention_bias)]
            for p, _ in self._frozen:
                p.requires_grad_(False)
                p.grad = None

    def _detach(self, model: VeilModel) -> None:
        self._work = {}
        for p, was in self._frozen:
            p.requires_grad_(was)
        self._frozen = []

    def noised_parameters(self, model: VeilModel) -> list[nn.Parameter]:
        """The parameters whose exported gradient carries AEGIS noise (at the current settings)."""
        out: list[nn.Parameter] = []
        if self.embed_noise > 0:
            out.append(model.token_embedding().weight)
        head = untied_lm_head(model)
        if self.head_noise > 0 and head is not None:
            out.append(head)
        for scale, mods in ((self.mlp_noise, model.mlp_up()), (self.mlp_down_noise, model.mlp_down())):
            if scale > 0:
                out += [p for m in mods for p in (m.weight, getattr(m, "bias", None)) if p is not None]
        return [p for p in dict.fromkeys(out) if p.requires_grad]

    def lr_scales(self, model: VeilModel) -> list[tuple[nn.Parameter, float]]:
        """``lr_scale`` for every parameter that still trains, times ``noised_lr`` for the noised
        ones (see the module docstring, "Local step")."""
        if self.noised_lr == 1.0 and self.lr_scale == 1.0:
            return []
        noised = {id(p) for p in self.noised_parameters(model)}
        return [
            (p, self.lr_scale * (self.noised_lr if id(p) in noised else 1.0))
            for p in model.parameters()
            if p.requires_grad
        ]

    def transform_grads(self, model: VeilModel, step: int) -> None:
        if self.embed_noise == 0 and self.mlp_noise == 0 and self.head_noise == 0 and self.mlp_down_noise == 0:
            return
        targets = self._noise_targets(model)
        # every std from the clean gradients, then one draw for all the tables (veil.defenses.noise)
        stds = noise_tables_(
            [p.grad for _, p, _, _ in targets],
            [stat for _, _, stat, _ in targets],
            [factor for _, _, _, factor in targets],
            (self.seed, step, self._calls),
            self.secret,
            self._work,
        )
        self._calls += 1
        self.last_std = {}
        for (channel, _, _, _), std in zip(targets, stds):
            if channel in ("embedding", "head"):
                self.last_std[channel] = std
            else:
                self.last_std.setdefault(channel, []).append(std)

    def _noise_targets(self, model: VeilModel) -> list[NoiseTarget]:
        """(channel, parameter, statistic, factor) for every gradient to noise, in a fixed order:
        its noise std is factor * statistic(clean gradient)."""
        out: list[NoiseTarget] = []
        emb, head = model.token_embedding().weight, untied_lm_head(model)
        if self.embed_noise > 0:
            out.append(("embedding", emb, row_norm_max, embedding_factor(emb, self.embed_noise)))
        if self.head_noise > 0 and head is not None:
            out.append(("head", head, row_norm_max, embedding_factor(head, self.head_noise)))
        for channel, scale, mods in (
            ("mlp_up", self.mlp_noise, model.mlp_up()),
            ("mlp_down", self.mlp_down_noise, model.mlp_down()),
        ):
            if scale > 0:
                out += [
                    (channel, p, frobenius, block_factor(p, scale))
                    for m in mods
                    for p in (m.weight, getattr(m, "bias", None))
                    if p is not None
                ]
        return [t for t in out if t[1].grad is not None]

    def describe(self) -> dict[str, Any]:
        """What an adaptive attacker is granted: the frozen set and the noise laws with their scales."""
        return {
            "name": self.name,
            "freeze_attention": self.freeze_attention,
            "freeze_attention_bias": self.freeze_attention_bias,
            "embed_noise": self.embed_noise,
            "mlp_noise": self.mlp_noise,
            "head_noise": self.head_noise,
            "mlp_down_noise": self.mlp_down_noise,
            "noised_lr": self.noised_lr,
            "lr_scale": self.lr_scale,
            "embed_law": "N(0, s^2), s = embed_noise * rho_max / (2D)^(1/4)",
            "mlp_law": "N(0, s^2), s = mlp_noise * ||G||_F / (H D)^(1/4)",
            "last_std": dict(self.last_std),
        }


DEFENSES.register("aegis", "AEGIS: freeze attention projections + calibrated noise on embedding and MLP-up gradients")(
    Aegis
)
