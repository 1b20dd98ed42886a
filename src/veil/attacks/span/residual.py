"""Peeling's residual gradient (`veil.attacks.span.peel`): the observed gradients minus those of
the sentences already found. The client's loss is the batch mean, ``(1/B) sum_b grad l(s_b, y_b)``,
so a found sentence's own gradient / B is subtracted exactly; what is left belongs to the others.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from veil.attacks.base import Observation
from veil.attacks.span.checks import CLSCheck, RowCheck, row_span
from veil.attacks.span.core import Span, qkv_modules
from veil.models.base import linear_weight


class Residual:
    """The observed gradients minus the gradients of the sentences already found ("peeling").

    The client's loss is the batch mean of per-sentence losses, so the observed gradient is
    ``(1/B) sum_b grad l(s_b, y_b)``: once a sentence s and its label y are known, the attacker (who
    has the weights and the loss) computes ``grad l(s, y) / B`` and subtracts it. The rest is the
    gradient of the other sentences alone: fewer tokens behind every layer's span, so the spans of
    layers 1 and 2 regain a gap when B*T >= width and the layer-1 candidates shrink. The label is
    the one whose subtraction drops the rank of the last block's Q gradient (`CLSCheck`): by one
    ([CLS] pooling), or by the sentence's length (mean pooling).
    """

    def __init__(self, obs: Observation, batch_size: int) -> None:
        self.model = obs.model
        self.names = {id(p): n for n, p in self.model.named_parameters()}
        layers = self.model.attention_layers()
        used = [m.weight for att in layers[:2] for m in qkv_modules(att)] + [layers[-1].q.weight]
        used += [getattr(self.model.token_embedding(), "weight", None), self.model.position_table()]
        used += [getattr(m, "weight", None) for m in self.model.mlp_down()[:-1]]  # `veil.attacks.span.mlp`
        keep = {self.names[id(p)] for p in used if p is not None and id(p) in self.names}
        # only what the spans, the check and the prior read: a peel's backward pass then skips the other weights
        self.grads = {n: g.detach().double().clone() for n, g in obs.grads.items() if n in keep}
        self.batch_size = batch_size
        self.left = batch_size

    def weight_grad(self, module: nn.Module) -> Tensor:
        return linear_weight(module, self.grads[self.names[id(module.weight)]])

    def token_grad(self) -> Tensor | None:
        """The residual token-embedding gradient (vocab, width), or None if it was not exported."""
        name = self.names.get(id(getattr(self.model.token_embedding(), "weight", None)))
        g = self.grads.get(name) if name is not None else None
        return g if g is not None and g.dim() == 2 else None

    def position_grad(self) -> Tensor | None:
        """The residual position-table gradient (rows, width), or None if it was not exported."""
        name = self.names.get(id(self.model.position_table()))
        g = self.grads.get(name) if name is not None else None
        return g.reshape(-1, g.shape[-1]) if g is not None else None

    def layer_span(self, layer: int, rank_tol: float) -> Span:
        att = self.model.attention_layers()[layer]
        return row_span(torch.cat([self.weight_grad(m) for m in qkv_modules(att)]), tol=rank_tol)

    def sentence_grads(self, ids: list[int], label: int) -> dict[str, Tensor]:
        model = self.model
        dev = next(model.parameters()).device
        x = torch.tensor([ids], device=dev)
        batch = {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": torch.tensor([label], device=dev)}
        params = {n: p for n, p in model.named_parameters() if n in self.grads}
        with torch.enable_grad():
            grads = torch.autograd.grad(model.loss(model(batch), batch), list(params.values()), allow_unused=True)
        return {
            n: (g.double() / self.batch_size if g is not None else torch.zeros_like(self.grads[n]))
            for n, g in zip(params, grads)
        }

    def peel(self, ids: list[int], check: CLSCheck | RowCheck) -> tuple[int, float]:
        """Subtract sentence `ids` with the label that passes the check: the one that leaves the
        Q gradient at `check.rank_after` (`CLSCheck`), or whose token rows match (`RowCheck`)."""
        best: tuple[float, int, dict[str, Tensor]] | None = None
        for y in range(int(getattr(self.model.classifier(), "out_features", 2))):
            g = self.sentence_grads(ids, y)
            r = self._label_miss(ids, check, g)
            if best is None or r < best[0]:
                best = (r, y, g)
        assert best is not None
        for n, g in best[2].items():
            self.grads[n] -= g
        self.left -= 1
        return best[1], best[0]

    def _label_miss(self, ids: list[int], check: CLSCheck | RowCheck, g: dict[str, Tensor]) -> float:
        """How far subtracting the sentence's gradients `g` (one label's) is from what the true
        label leaves: the relative singular value past the expected rank, or the row mismatch."""
        if isinstance(check, RowCheck):
            return check.rows_missed(ids, g[self.names[id(self.model.token_embedding().weight)]])
        name = self.names[id(check.module.weight)]
        scale = float(torch.linalg.svdvals(self.grads[name])[0])
        sv = torch.linalg.svdvals(self.grads[name] - g[name])
        k = check.rank_after(len(ids))
        return float(sv[k] / max(scale, 1e-300)) if 0 <= k < len(sv) else 0.0
