"""Per-sample clipped gradient sums for DP-SGD, three ways (Abadi et al. 2016, Alg. 1, lines 4-5).

Each engine returns, for one physical micro-batch, ``sum_i g_i * min(1, C / ||g_i||)`` (added into
``p.grad``) and the per-sample losses:

- ``ghost``: Opacus' ghost clipping (Li et al., ICLR 2022, "Large Language Models Can Be Strong
  Differentially Private Learners", Sec. 4): a first backward through Opacus' hooks gives the
  per-sample gradient norms without materialising per-sample gradients (Linear / Embedding
  norm samplers; other layers via fast gradient clipping), a second backward of
  ``sum_i c_i * loss_i`` with ``c_i = min(1, C / ||g_i||)`` gives the clipped sum.
- ``hooks``: Opacus' per-layer hooks (``GradSampleHooks``) materialise ``p.grad_sample`` (B, ...);
  veil clips and sums them.
- ``functorch``: ``torch.func`` ``vmap(grad(functional_call))`` over samples; differentiates any
  parameter, including tables a model reads as raw slices (veil's ``pos.weight[:T]``).

Opacus' hooks see a parameter only through its module's forward call. A table read as a slice of
its weight (every veil adapter reads the position table so; HF BERT also the segment row) gets no
per-sample gradient under ``ghost`` / ``hooks``: `uncovered` finds those, and the defense then
freezes them (explicit mode) or falls back to ``functorch`` (``mode: auto``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from veil.errors import VeilError
from veil.models.base import Batch, VeilModel

LossFn = Callable[[Batch], tuple[Tensor, Tensor]]


# ---- per-sample losses ---------------------------------------------------------------------------
def per_sample_loss(model: VeilModel, logits: Tensor, batch: Batch) -> Tensor:
    """The model's task loss per sample (B,): cross-entropy, or the mean next-token loss of each
    sequence (the privacy unit is the sequence)."""
    if model.task == "lm":
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        tgt = ids[:, 1:]
        keep = torch.ones_like(tgt, dtype=logits.dtype) if mask is None else mask[:, 1:].to(logits.dtype)
        tok = nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), tgt, reduction="none")
        return (tok * keep).sum(1) / keep.sum(1).clamp_min(1.0)
    return nn.functional.cross_entropy(
        logits, batch["labels"], reduction="none", label_smoothing=getattr(model, "label_smoothing", 0.0)
    )


# ---- physical micro-batches ----------------------------------------------------------------------
def micro_batches(batch: Batch, size: int) -> tuple[list[Batch], Tensor | None]:
    """Split a logical batch into physical micro-batches of at most `size` samples. A text batch
    (one with an ``attention_mask``) is sorted by length first and each micro-batch is cut to its
    longest sample: trailing padding columns hold no token of any sample in it, and the padding
    bias already keeps them out of every real token's computation, so per-sample gradients are
    unchanged (to float rounding) while the work follows the real lengths (SST-2: 18 tokens on
    average in a 64-token frame). Returns the micro-batches and the order used (None: unsorted)."""
    n = next(iter(batch.values())).shape[0]
    mask = batch.get("attention_mask")
    if mask is None or mask.dim() != 2 or n == 0:
        return [{k: v[s : s + size] for k, v in batch.items()} for s in range(0, n, size)], None
    used = mask.ne(0)
    last = torch.where(used, torch.arange(1, mask.shape[1] + 1, device=mask.device), 0).amax(
        1
    )  # length incl. inner pads
    order = torch.argsort(last, stable=True)
    parts = []
    for s in range(0, n, size):
        idx = order[s : s + size]
        width = max(int(last[idx].max()), 1)
        parts.append(
            {k: (v[idx][:, :width] if v.dim() >= 2 and v.shape[:2] == mask.shape else v[idx]) for k, v in batch.items()}
        )
    return parts, order


def restore_order(
    losses: list[Tensor], logits: list[Tensor], order: Tensor | None, width: int
) -> tuple[Tensor, Tensor]:
    """Per-sample losses and logits of the micro-batches, back in the logical batch's order;
    sequence logits (B, T', ...) padded with zeros to the batch's `width` T."""
    logits = [
        lg
        if lg.dim() < 3 or lg.shape[1] == width
        else torch.nn.functional.pad(lg, (0, 0) * (lg.dim() - 2) + (0, width - lg.shape[1]))
        for lg in logits
    ]
    loss, logit = torch.cat(losses), torch.cat(logits)
    if order is None:
        return loss, logit
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order), device=order.device)
    return loss[inverse], logit[inverse]


# ---- functorch -----------------------------------------------------------------------------------
class _LossModule(nn.Module):
    """Wraps `loss_fn` so `functional_call` can swap the model's parameters underneath it."""

    def __init__(self, model: VeilModel, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: Batch) -> tuple[Tensor, Tensor]:
        return self.loss_fn(batch)


def per_sample_grads(model: VeilModel, batch: Batch, loss_fn: LossFn) -> tuple[dict[str, Tensor], Tensor, Tensor]:
    """Per-sample gradients {name: (B, *shape)} of every trainable parameter, with the per-sample
    losses (B,) and logits (B, ...)."""
    wrapper = _LossModule(model, loss_fn)
    params = {f"model.{n}": p.detach() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {f"model.{n}": p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    buffers = {f"model.{n}": b for n, b in model.named_buffers()}

    def one(trainable: dict[str, Tensor], sample: Batch) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        b = {k: v.unsqueeze(0) for k, v in sample.items()}
        loss, logits = functional_call(wrapper, {**trainable, **frozen, **buffers}, (b,), tie_weights=True)
        return loss, (loss.detach(), logits.detach()[0])

    grads, (losses, logits) = vmap(grad(one, has_aux=True), in_dims=(None, 0), randomness="different")(params, batch)
    return {k[len("model.") :]: v for k, v in grads.items()}, losses, logits


def clip_factors(norms: Tensor, clip: float) -> Tensor:
    """min(1, C / ||g_i||), as Opacus computes it."""
    return (clip / (norms + 1e-6)).clamp(max=1.0)


def clip_and_sum(grads: dict[str, Tensor], clip: float) -> dict[str, Tensor]:
    """sum_i g_i * min(1, C / ||g_i||) over the samples of one micro-batch."""
    norms = torch.stack([g.reshape(g.shape[0], -1).norm(dim=1) for g in grads.values()]).norm(dim=0)
    factor = clip_factors(norms, clip)
    return {n: torch.einsum("b,b...->...", factor.to(g.dtype), g) for n, g in grads.items()}


def _accumulate(named: dict[str, nn.Parameter], sums: dict[str, Tensor]) -> None:
    for name, p in named.items():
        p.grad = sums[name] if p.grad is None else p.grad + sums[name]


def functorch_chunk(model: VeilModel, batch: Batch, loss_fn: LossFn, clip: float) -> tuple[Tensor, Tensor]:
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads, losses, logits = per_sample_grads(model, batch, loss_fn)
    _accumulate(named, clip_and_sum(grads, clip))
    return losses, logits


# ---- Opacus hooks / ghost clipping -----------------------------------------------------------------
def raw_read(model: VeilModel) -> set[int]:
    """ids of parameters the model reads as raw slices, outside their module's forward."""
    out = {id(model.position_table())} if model.absolute_positions else set()
    seg = getattr(model, "segment_row", None)
    if seg is not None:
        ptr = seg().untyped_storage().data_ptr()
        out |= {id(p) for p in model.parameters() if p.untyped_storage().data_ptr() == ptr}
    return out


def uncovered(model: VeilModel, ghost: bool) -> list[str]:
    """Trainable parameters Opacus' hooks cannot give a per-sample gradient (norm)."""
    from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import GradSampleHooksFastGradientClipping as G

    kinds = set(G.GRAD_SAMPLERS) | (set(G.NORM_SAMPLERS) if ghost else set())
    owned = {id(p) for m in model.modules() if type(m) in kinds for p in m.parameters(recurse=False)}
    raw = raw_read(model)
    return [n for n, p in model.named_parameters() if p.requires_grad and (id(p) not in owned or id(p) in raw)]


class OpacusEngine:
    """Opacus' hooks on the model itself (no wrapper module): `ghost` or per-sample `hooks`."""

    def __init__(self, model: VeilModel, ghost: bool, clip: float) -> None:
        from opacus.grad_sample import GradSampleHooks
        from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import GradSampleHooksFastGradientClipping

        self.ghost, self.clip = ghost, clip
        if ghost:
            self.hooks = GradSampleHooksFastGradientClipping(
                model, loss_reduction="sum", strict=False, max_grad_norm=clip, use_ghost_clipping=True
            )
        else:
            self.hooks = GradSampleHooks(model, loss_reduction="sum", strict=False)
        self.named = {n: p for n, p in model.named_parameters() if p.requires_grad}
        #: the hooked layers (Linear, Embedding, norms, convs: no train/eval behaviour); Opacus
        #: captures activations only in training mode, so they are flagged training for the step
        #: even when the caller runs the model in eval mode (an attack's single observed step)
        self.layers = [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]

    def remove(self) -> None:
        self.hooks.remove_hooks()
        for p in self.named.values():
            for attr in ("grad_sample", "_current_grad_sample", "_norm_sample", "_forward_counter"):
                if hasattr(p, attr):
                    delattr(p, attr)

    def _samples(self, attr: str, n: int) -> list[Tensor]:
        """Each trainable parameter's per-sample gradients (or norms), cleared after reading. A
        parameter outside the graph (e.g. BERT's pooler under mean pooling) contributes zeros;
        one that got a gradient but no sample was read outside its module's forward: an error."""
        missing = [k for k, p in self.named.items() if getattr(p, attr, None) is None and p.grad is not None]
        if missing:
            raise VeilError(
                f"dpsgd: Opacus hooks gave no per-sample gradient for {', '.join(missing[:4])} "
                "(a table read outside its module's forward); use mode=functorch or leave it out of `trainable`"
            )
        shape = (lambda p: (n,)) if attr == "_norm_sample" else (lambda p: (n, *p.shape))
        out = [getattr(p, attr, None) for p in self.named.values()]
        out = [
            torch.zeros(shape(p), dtype=p.dtype, device=p.device) if o is None else o
            for o, p in zip(out, self.named.values())
        ]
        for p in self.named.values():
            setattr(p, attr, None)
        return out

    def chunk(self, model: VeilModel, batch: Batch, loss_fn: LossFn) -> tuple[Tensor, Tensor]:
        flags = [m.training for m in self.layers]
        for m in self.layers:
            m.training = True
        try:
            with warnings.catch_warnings():  # the first hooked layer's input needs no gradient: expected
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                return self._chunk(model, batch, loss_fn)
        finally:
            for m, f in zip(self.layers, flags):
                m.training = f

    def _chunk(self, model: VeilModel, batch: Batch, loss_fn: LossFn) -> tuple[Tensor, Tensor]:
        _, logits = loss_fn(batch)
        losses = per_sample_loss(model, logits, batch)
        before = {n: p.grad for n, p in self.named.items()}
        for p in self.named.values():
            p.grad = None
        if self.ghost:
            losses.sum().backward(retain_graph=True)
            norms = torch.stack(self._samples("_norm_sample", len(losses))).norm(dim=0)
            for p in self.named.values():
                p.grad = None
            self.hooks.disable_hooks()
            try:
                (clip_factors(norms, self.clip).detach() * losses).sum().backward()
            finally:
                self.hooks.enable_hooks()
            sums = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in self.named.items()}
        else:
            losses.sum().backward()
            sums = clip_and_sum(dict(zip(self.named, self._samples("grad_sample", len(losses)))), self.clip)
        for n, p in self.named.items():
            p.grad = before[n]
        _accumulate(self.named, sums)
        return losses.detach(), logits.detach()
