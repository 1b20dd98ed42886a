"""DP-SGD (Abadi et al., CCS 2016, "Deep Learning with Differential Privacy", Algorithm 1), on Opacus.

For a logical batch L drawn by Poisson sampling (each of the N training samples independently
with probability q = batch_size / N) and per-sample gradients g_i over the trainable parameters:

    g~_i = g_i * min(1, C / ||g_i||_2)                        (per-sample clipping to norm C)
    g    = (sum_{i in L} g~_i + N(0, sigma^2 C^2 I)) / (q N)    (Gaussian mechanism, sigma = noise_multiplier)

dividing by the expected batch size q N, as Opacus does under Poisson sampling. The privacy cost
of T such steps is tracked by Opacus' accountant (``accountant: rdp``, Mironov 2017, or ``prv``,
Gopi et al. 2021): epsilon at ``delta`` (default 1/N). Give exactly one of ``noise_multiplier``
or ``target_epsilon``; with the latter the accountant picks sigma for the run's schedule
(`prepare`: sample rate, steps, delta) through Opacus' ``get_noise_multiplier``.

A logical batch larger than memory is processed in physical micro-batches of ``chunk`` samples
whose clipped sums accumulate before the one noise draw (Opacus' virtual steps /
``BatchMemoryManager``); text samples are grouped by length and each micro-batch drops the
padding columns none of its samples use (`dpsgd_engines.micro_batches`). Per-sample gradients (`veil.defenses.dpsgd_engines`): ``ghost`` (Opacus
ghost clipping), ``hooks`` (Opacus per-layer hooks) or ``functorch`` (``torch.func``). ``auto``
takes ghost clipping when Opacus' hooks cover every trainable parameter, else functorch: veil's
own models and the HF adapters read the position table (HF BERT: the segment row too) as a raw
slice ``weight[:T]``, which module hooks cannot attribute to samples. An explicit ``ghost`` /
``hooks`` freezes such tables instead (listed in `describe()["frozen"]`). ``trainable`` (a regular
expression over parameter names) restricts DP fine-tuning to the matching parameters, e.g. the
top layers and the head (parameter-efficient DP fine-tuning: Yu et al., ICLR 2022; Li et al.,
ICLR 2022); frozen parameters are restored on `detach`. Under ``ghost`` / ``hooks`` the per-sample
loss is the model's task loss (`dpsgd_engines.per_sample_loss`; another defense's ``aux_loss`` is
not included); ``functorch`` differentiates the whole client loss of each sample.

Step times against Opacus' own engines: docs/results.md (DP-SGD, `benchmarks/dp_step.py`).

The hook replaces ``loss.backward()`` (`Defense.backward`): it sets ``p.grad`` for every trainable
parameter to the noised clipped mean, which is both the local update and the exported update a
server sees (`client_step`). The noise is fresh every step. Its generator is keyed by ``seed`` (and
the client's ``secret`` when there is one): by default (``seed: null``) a seed drawn from the OS's
entropy at construction, never written anywhere, so whoever holds the config cannot regenerate the
noise; an explicit ``seed`` makes runs repeatable but lets anyone who knows it subtract the noise
(tests, debugging). A resumed run continues the noise sequence where the checkpoint left it
(`resume`), never replaying an earlier step's draw.
"""

from __future__ import annotations

import math
import re
import secrets
from typing import Any

import torch
from torch import Tensor

from veil.defenses import DEFENSES
from veil.defenses.aegis import check_scale
from veil.defenses.base import Defense, check_seed
from veil.defenses.dpsgd_engines import (  # noqa: F401
    LossFn,
    OpacusEngine,
    clip_and_sum,
    functorch_chunk,
    micro_batches,
    per_sample_grads,
    restore_order,
    uncovered,
)
from veil.defenses.noise import keyed_generator
from veil.errors import VeilError
from veil.models.base import Batch, VeilModel

MODES = ("auto", "ghost", "hooks", "functorch")
ACCOUNTANTS = ("rdp", "prv")


def _positive(name: str, value: Any) -> float:
    v = check_scale(name, value)
    if v == 0:
        raise VeilError(f"{name} must be a number > 0, got {value!r}")
    return v


def epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "rdp") -> float:
    """epsilon of `steps` Poisson-subsampled Gaussian steps at `delta` (Opacus' accountant)."""
    from opacus.accountants import create_accountant

    if steps == 0 or sample_rate == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    acc = create_accountant(accountant)
    acc.history = [(noise_multiplier, sample_rate, steps)]
    return float(acc.get_epsilon(delta=delta))


def _tied(model: VeilModel) -> list[str]:
    """Names of trainable parameters reachable from two modules (e.g. an LM head tied to the token embedding)."""
    seen: dict[int, str] = {}
    tied: list[str] = []
    for n, p in model.named_parameters(remove_duplicate=False):
        if p.requires_grad and id(p) in seen and seen[id(p)] not in tied:
            tied.append(seen[id(p)])
        seen.setdefault(id(p), n)
    return tied


class DPSGD(Defense):
    """DP-SGD: Poisson batches, per-sample clipping to `clip`, Gaussian noise, privacy accounting."""

    poisson = True  # the training loop draws Poisson batches for a defense that says so
    keeps_forward = True  # per-sample clipping and noise act on gradients only (veil.training.frozen)

    def __init__(
        self,
        clip: float = 1.0,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        delta: float | None = None,
        accountant: str = "rdp",
        mode: str = "auto",
        trainable: str | None = None,
        chunk: int = 64,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        self.clip = _positive("clip", clip)
        self.noise_multiplier = None if noise_multiplier is None else check_scale("noise_multiplier", noise_multiplier)
        self.target_epsilon = None if target_epsilon is None else _positive("target_epsilon", target_epsilon)
        self.delta = None if delta is None else _positive("delta", delta)
        if self.delta is not None and self.delta >= 1:
            raise VeilError(f"delta must be in (0, 1), got {delta!r}")
        if accountant not in ACCOUNTANTS:
            raise VeilError(f"dpsgd accountant must be one of {', '.join(ACCOUNTANTS)}, got {accountant!r}")
        if mode not in MODES:
            raise VeilError(f"dpsgd mode must be one of {', '.join(MODES)}, got {mode!r}")
        if trainable is not None:
            try:
                re.compile(trainable)
            except (re.error, TypeError):
                raise VeilError(
                    f"dpsgd trainable must be a regular expression over parameter names, got {trainable!r}"
                ) from None
        seed = check_seed(seed, none_means="a secret seed from the OS")
        seed = secrets.randbits(62) if seed is None else seed
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise VeilError(f"chunk must be an integer >= 1 (samples per physical micro-batch), got {chunk!r}")
        if (noise_multiplier is None) == (target_epsilon is None):
            raise VeilError(
                "dpsgd needs exactly one of noise_multiplier (sigma) or target_epsilon (sigma from the accountant)"
            )
        self.accountant, self.mode, self.trainable, self.seed, self.chunk = accountant, mode, trainable, seed, chunk
        self.sample_rate: float | None = None
        self.expected_batch: float | None = None
        self.steps = 0
        self.engine_mode = mode
        self.frozen: list[str] = []
        self._engine: OpacusEngine | None = None
        self._calls = 0

    # ---- lifecycle -------------------------------------------------------------------------------
    def _attach(self, model: VeilModel) -> None:
        self._calls = 0
        self._restore = {n: p.requires_grad for n, p in model.named_parameters()}
        if self.trainable is not None:
            pat = re.compile(self.trainable)
            for n, p in model.named_parameters():
                p.requires_grad_(p.requires_grad and bool(pat.search(n)))
            if not any(p.requires_grad for p in model.parameters()):
                for n, p in model.named_parameters():
                    p.requires_grad_(self._restore[n])
                self.model = None
                raise VeilError(
                    f"dpsgd trainable={self.trainable!r} matches no trainable parameter of {type(model).__name__}"
                )
        left = uncovered(model, ghost=self.mode != "hooks")
        tied = _tied(model)
        self.engine_mode = ("ghost" if not left and not tied else "functorch") if self.mode == "auto" else self.mode
        if self.engine_mode == "ghost" and tied:
            for n, p in model.named_parameters():
                p.requires_grad_(self._restore[n])
            self.model = None
            raise VeilError(
                f"dpsgd mode=ghost: Opacus ghost clipping does not support tied weights ({type(model).__name__} ties "
                f"{', '.join(tied)}); use mode=hooks, functorch or auto"
            )
        if self.engine_mode in ("ghost", "hooks"):
            self.frozen = left
            named = dict(model.named_parameters())
            for n in left:
                named[n].requires_grad_(False)
            self._engine = OpacusEngine(model, ghost=self.engine_mode == "ghost", clip=self.clip)

    def _detach(self, model: VeilModel) -> None:
        if self._engine is not None:
            self._engine.remove()
            self._engine = None
        for n, p in model.named_parameters():
            p.requires_grad_(self._restore.get(n, p.requires_grad))
        self.frozen = []

    # ---- accounting ------------------------------------------------------------------------------
    def prepare(self, n_train: int, batch_size: int, steps: int) -> None:
        """The training schedule: sample rate q = batch_size / N, total steps, delta (default 1/N);
        with target_epsilon, sigma from the accountant."""
        if n_train < 1 or not 1 <= batch_size <= n_train:
            raise VeilError(f"dpsgd needs 1 <= train.batch_size <= the training set size ({n_train}), got {batch_size}")
        self.sample_rate, self.expected_batch = batch_size / n_train, float(batch_size)
        self.delta = self.delta if self.delta is not None else 1.0 / n_train
        if self.target_epsilon is not None:
            from opacus.accountants.utils import get_noise_multiplier

            self.noise_multiplier = float(
                get_noise_multiplier(
                    target_epsilon=self.target_epsilon,
                    target_delta=self.delta,
                    sample_rate=self.sample_rate,
                    steps=steps,
                    accountant=self.accountant,
                )
            )

    def resume(self, step: int) -> None:
        """Continue after `step` finished steps (a resumed run): the accountant's count and the noise sequence."""
        self.steps = self._calls = step

    def state_dict(self) -> dict[str, Tensor]:
        """The noise seed (an OS-entropy one by default): the run's own checkpoint keeps it, so a
        resumed run continues the same noise stream. The checkpoint is as secret as the data."""
        return {"seed": torch.tensor(self.seed, dtype=torch.int64), "calls": torch.tensor(self._calls)}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.seed, self._calls = int(state["seed"]), int(state["calls"])

    def privacy(self, steps: int | None = None) -> dict[str, Any]:
        """epsilon spent after `steps` (default: the steps taken) at delta, with what it rests on."""
        steps = self.steps if steps is None else steps
        out: dict[str, Any] = {
            "mode": self.engine_mode,
            "accountant": self.accountant,
            "clip": self.clip,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "delta": self.delta,
            "steps": steps,
            "epsilon": None,
        }
        if self.sample_rate is not None and self.noise_multiplier is not None and self.delta is not None:
            eps = epsilon(self.noise_multiplier, self.sample_rate, steps, self.delta, self.accountant)
            out["epsilon"] = eps if math.isfinite(eps) else "inf"
        if self.frozen:
            out["frozen"] = list(self.frozen)
        return out

    # ---- the step --------------------------------------------------------------------------------
    def backward(self, model: VeilModel, batch: Batch, loss_fn: LossFn) -> tuple[Tensor, Tensor]:
        """Set ``p.grad`` to the noised mean of the clipped per-sample gradients (virtual steps of `chunk`)."""
        if self.noise_multiplier is None:
            raise VeilError(
                "dpsgd target_epsilon needs the training schedule (veil train); give noise_multiplier for a single step"
            )
        named = {n: p for n, p in model.named_parameters() if p.requires_grad}
        n = next(iter(batch.values())).shape[0]
        losses, logits = [], []
        parts, order = micro_batches(batch, self.chunk)
        for part in parts:
            if self._engine is not None:
                loss, logit = self._engine.chunk(model, part, loss_fn)
            else:
                loss, logit = functorch_chunk(model, part, loss_fn, self.clip)
            losses.append(loss)
            logits.append(logit)
        denom = self.expected_batch or max(n, 1)
        gen = None  # one keyed stream per step, drawn parameter by parameter in a fixed order
        if self.noise_multiplier and named:
            gen = keyed_generator(self.seed, self._calls, 0, next(iter(named.values())).device, self.secret)
        for p in named.values():
            total = p.grad if p.grad is not None else torch.zeros_like(p)
            p.grad = self._noised(total, gen) / denom
        self._calls += 1
        self.steps += 1
        if not losses:
            return torch.zeros(()), torch.zeros(0)
        mask = batch.get("attention_mask")
        loss, logit = restore_order(losses, logits, order, mask.shape[1] if mask is not None else 0)
        return loss.mean(), logit

    def _noised(self, total: Tensor, gen: torch.Generator | None) -> Tensor:
        if gen is None:
            return total
        noise = torch.randn(total.shape, generator=gen, device=total.device, dtype=total.dtype)
        return total + noise * (self.noise_multiplier * self.clip)

    def describe(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "clip": self.clip,
            "noise_multiplier": self.noise_multiplier,
            "target_epsilon": self.target_epsilon,
            "delta": self.delta,
            "sample_rate": self.sample_rate,
            "mode": self.engine_mode,
            "trainable": self.trainable,
            "law": "(sum of per-sample clipped grads + N(0, (noise_multiplier * clip)^2)) / expected batch",
        }
        if self.frozen:
            out["frozen"] = list(self.frozen)
        return out


DEFENSES.register(
    "dpsgd", "DP-SGD: Poisson batches, per-sample clipping + Gaussian noise, RDP/PRV accountant (Opacus)"
)(DPSGD)
