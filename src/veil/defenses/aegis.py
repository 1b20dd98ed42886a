"""AEGIS — Attention-Embedding Gradient Isolation Shield: triple-channel gradient masking for
federated LLM fine-tuning (`seeds/aegis-gradient-isolation.txt`, abstract only). It closes each
channel through which a Transformer's gradient leaks private tokens with one backward-path
operation, in `transform_grads` on ``p.grad`` (what the client both steps with and exports):

  1. attention projections: dL/dW_{q,k,v,o} = sum_t delta_t x_t^T has rank <= n and spans the
     layer's inputs (DAGER's span check) -> frozen (requires_grad=False: no update, no gradient).
  2. token embedding: dL/dE[v] = 0 for every row v not in the batch (the non-zero rows are the
     bag of tokens) -> Gaussian noise on EVERY row, of std per coordinate
       (E)  s_E = embed_noise * rho_max / (2 D)^{1/4},  rho_max = the largest clean row norm.
     ||g_v||^2 / s_E^2 is the sufficient statistic of any rotation-invariant presence test;
     an absent row gives chi2_D (std sqrt(2D)), a present row shifts its mean by at most
     1 / embed_noise^2 of that std, for every row; scaling to the largest row (not the median)
     keeps frequent tokens ([CLS], "the") from standing out.
  3. MLP expansion (fc1 / c_fc): the same low-rank structure -> per-block noise of std per entry
       (M)  s_M = mlp_noise * ||G_l||_F / (H_l D_l)^{1/4}
     for the H_l x D_l weight gradient G_l (its bias by its own norm): a singular value sigma is
     detectable in H x D i.i.d. noise of std s only above s (H D)^{1/4} (the BBP transition), and
     every singular value of G_l is <= ||G_l||_F, so mlp_noise >= 1 hides the input span.

Beyond the abstract: an untied LM head leaks like channel 2 (row v of dL/dW_head =
sum_t (p_tv - 1[y_t = v]) h_t), so its rows get eq. (E) too (``head_noise``, default embed_noise);
the MLP down-projection (fc2 / c_proj / w2) leaks in every model: its gradient sum_t delta_t a_t^T
spans the blocks' MLP activations a_t, which the server recomputes for any candidate sentence
with the weights it sent (a causal model's grow token by token, an encoder's by coordinate descent
over the vocabulary: `veil.attacks.span.down`), so ``mlp_down_noise`` applies eq. (M) there,
1.0 by default on every model (0: AEGIS as published).
``freeze_attention_bias=False`` freezes only the projection weights (a bias gradient
sum_t delta_t holds no input x_t). ``noised_lr`` scales the local learning rate of the noised
tables (Adam would turn pure-noise rows into full-size steps), ``lr_scale`` every parameter
that still trains. Clipping sees the clean gradient (`veil.training.step` clips first).

LoRA (`veil.models.lora`: only adapters ``y = W x + s B A x`` train, the base is frozen), channel
by channel: 1. the adapters on q / k / v / o are frozen with their base (their gradient
dL/dB = s G (A x)^T spans the projected inputs A x: the same span check in r dimensions); 2. the
token embedding (and an LM head) is frozen under LoRA, so no embedding gradient is exported and
eq. (E) has nothing to noise; 3. eq. (M) applies to each adapter tensor of the MLP expansion (and
down-projection) by its own norm and shape: dL/dB (H x r) = s G (A x)^T has every singular value
<= its Frobenius norm, and BBP's threshold for an H x r matrix is s (H r)^{1/4}, so mlp_noise >= 1
hides the span of A x there too (dL/dA = s B^T G x^T is zero while B = 0, and noised likewise).
A model on which nothing trains once attention is frozen (adapters on attention only) is refused.

Noise is keyed on (seed, step, call count): reruns draw the same, no two calls repeat (repeated
noise would cancel in the difference of two updates); all tables of a step share one draw
(`veil.defenses.noise.noise_tables_`). With every strength 0 and nothing frozen the defense is
bit-identical to none. Measured effects, costs and the defaults' calibration: docs/results.md
(AEGIS sections).
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


def expansion_modules(model: VeilModel) -> list[nn.Module]:
    """Every MLP expansion module, all blocks (SwiGLU's gate and up both: `mlp_up_groups`)."""
    return [m for group in model.mlp_up_groups() for m in group]


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
            for name, p in mod.named_parameters():  # a LoRA layer: its base and its adapters
                if biases or name.rsplit(".", 1)[-1] != "bias":
                    seen.setdefault(id(p), p)
    return list(seen.values())


def module_parameters(mod: nn.Module) -> list[nn.Parameter]:
    """A layer's weight and bias, or for a LoRA layer its adapters A and B besides its base."""
    return list(mod.parameters())


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
        #: None = the default, 1.0 on every model (see the module docstring)
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
            self.mlp_down_noise = 1.0
        if self.freeze_attention:
            self._frozen = [(p, p.requires_grad) for p in attention_parameters(model, self.freeze_attention_bias)]
            for p, _ in self._frozen:
                p.requires_grad_(False)
                p.grad = None
            if not any(p.requires_grad for p in model.parameters()):
                self._detach(model)
                self.model = None
                raise VeilError(
                    "aegis freezes the attention projections and their LoRA adapters, and nothing else of this model "
                    "trains; adapt the MLP too (train.lora.targets: [q, k, v, o, up, down]) or set freeze_attention: false"
                )

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
        for scale, mods in ((self.mlp_noise, expansion_modules(model)), (self.mlp_down_noise, model.mlp_down())):
            if scale > 0:
                out += [p for m in mods for p in module_parameters(m)]
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
        if not targets:  # nothing noised trains (e.g. LoRA adapters only on frozen attention)
            self.last_std = {}
            return
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
            ("mlp_up", self.mlp_noise, expansion_modules(model)),
            ("mlp_down", self.mlp_down_noise, model.mlp_down()),
        ):
            if scale > 0:
                out += [(channel, p, frobenius, block_factor(p, scale)) for m in mods for p in module_parameters(m)]
        return [t for t in out if t[1].grad is not None]

    def describe(self) -> dict[str, Any]:
        """What an adaptive attacker is granted: the frozen set and the noise laws with their scales."""
        scales = ("embed_noise", "mlp_noise", "head_noise", "mlp_down_noise", "noised_lr", "lr_scale")
        return {
            **self.settings_of("freeze_attention", "freeze_attention_bias", *scales),
            "embed_law": "N(0, s^2), s = embed_noise * rho_max / (2D)^(1/4)",
            "mlp_law": "N(0, s^2), s = mlp_noise * ||G||_F / (H D)^(1/4)",
            "last_std": dict(self.last_std),
        }


DEFENSES.register("aegis", "AEGIS: freeze attention projections + calibrated noise on embedding and MLP-up gradients")(
    Aegis
)
