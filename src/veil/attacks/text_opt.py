"""Optimisation attacks on text: TAG (Deng et al. 2021, "TAG: Gradient Attack on Transformer-based
Language Models") and LAMP (Balunovic et al. 2022, "LAMP: Extracting Text from Gradients with
Language Model Priors").

Both optimise continuous dummy input embeddings ``x`` (B, T, D), fed through the model's embedding
step (``assemble`` + ``forward_from_embeddings``, so position/segment embeddings and LayerNorms are
the model's own), until the parameter gradient they produce, ``g'(x) = dL(x, y)/dtheta``, matches the
observed one ``g``; the gradient is taken with ``create_graph=True`` (double backward). Then every
position is decoded to its nearest vocabulary token by cosine against the token-embedding table.

* TAG (sec. 3, eq. 3-4): ``D(x) = sum_l ||g'_l - g_l||_2^2 + alpha ||g'_l - g_l||_1`` (alpha 0.01),
  Adam on ``x`` (and on soft label logits when labels are unknown).
* LAMP (sec. 4, eq. 2-5): ``D(x) = 1 - <g', g> / (||g'|| ||g||)`` over all matched parameters plus
  the embedding-norm prior ``lambda * mean_i ((||x_i|| - mu) / mu)^2`` (mu = mean token-embedding norm);
  every ``k`` continuous steps a discrete step scores candidate sequences -- the current one, two
  positions swapped, a span moved elsewhere, each also re-projected onto its nearest tokens -- by
  ``D`` (per-candidate gradients with ``torch.func.vmap``) and keeps the best. LAMP's GPT-2
  perplexity prior is NOT used: no offline language model covers arbitrary veil vocabularies.
  As in LAMP/DAGER, decoding (and LAMP's projection) can be restricted to the tokens the
  token-embedding gradient shows present (`veil.attacks.presence`; ``restrict_to_present``).

Threat-model details a user should know:
* The token-embedding table's own gradient is not matched (the dummy input bypasses the lookup);
  it only feeds the presence restriction. Every other exported parameter gradient is matched.
* Sentence length: rows of the position-table gradient are non-zero exactly at the positions the
  batch used, so the dummy length is the last such row + 1 (else ``Knowledge.seq_len``), with an
  all-ones attention mask. Known format (``fix_special``): [CLS] at position 0, and at batch 1
  [SEP] at the end (encoders); a causal LM's last input position gets no gradient, so its
  [SEP] is the known last target and is appended to the output.
* Labels: ``Knowledge.labels`` if given; else at batch 1 the label from the head's bias gradient
  (iDLG); else learnable soft labels. A causal LM's targets are the next dummy tokens, made
  differentiable as ``softmax(cos(x_{t+1}, E) / tau)``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from veil.attacks import ATTACKS
from veil.attacks.base import Attack, Knowledge, Observation, Reconstruction, set_seed, work_bar
from veil.attacks.options import Options, option
from veil.attacks.presence import embedding_row_norms, present_tokens
from veil.errors import VeilError
from veil.models.base import NoPositionTable, VeilModel


# ----------------------------------------------------------------------------- what is matched
def matched_gradients(obs: Observation, attack: str) -> dict[str, Tensor]:
    """Observed gradients of every trainable parameter except the token-embedding table."""
    emb = obs.model.token_embedding().weight
    out = {
        n: obs.grads[n].detach().float()
        for n, p in obs.model.named_parameters()
        if n in obs.grads and p is not emb and p.requires_grad
    }
    if not out:
        raise VeilError(
            f"{attack} needs exported gradients of the model's parameters past the token embedding; this update exports none"
        )
    return out


def dummy_length(obs: Observation, know: Knowledge) -> int:
    """Last position with a non-zero position-table gradient + 1, else the known sequence length.

    A model without a position table (RoPE rotates queries and keys; nothing per position is
    trained) leaks no length this way: the dummy takes the known length, capped at the model's."""
    limit = obs.model.max_positions()
    try:
        table = obs.model.position_table()
    except NoPositionTable:
        return min(int(know.seq_len or limit), limit)
    if obs.has_grad(table):
        rows = obs.grad(table).reshape(-1, table.shape[-1]).float().norm(dim=1)
        used = torch.nonzero(rows > 1e-12 * rows.max().clamp_min(1e-30)).flatten()
        if len(used):
            return int(used[-1]) + 1
    return min(int(know.seq_len or limit), limit)


def reserved_ids(tokenizer: Any, vocab: int, keep: set[int]) -> Tensor:
    """Bracketed reserved tokens ([PAD], [unused*], [MASK], ...) the public tokenizer never emits
    inside a sentence, except those in `keep`; empty without a tokenizer."""
    if tokenizer is None or not hasattr(tokenizer, "decode"):
        return torch.zeros(0, dtype=torch.long)
    words = tokenizer.decode(list(range(vocab)))
    return torch.tensor(
        [
            i
            for i, w in enumerate(words)
            if len(w) > 2 and w[0] == "[" and w[-1] == "]" and w != "[UNK]" and i not in keep
        ],
        dtype=torch.long,
    )


def allowed_tokens(obs: Observation, restrict: bool, drop: Tensor) -> tuple[Tensor, bool]:
    """Vocabulary ids decoding may use: the present tokens when asked and available (else the whole
    vocabulary), without the ids in `drop`."""
    vocab = obs.model.token_embedding().weight.shape[0]
    ids = torch.arange(vocab)
    restricted = False
    if restrict:
        try:
            found = present_tokens(embedding_row_norms(obs))
            if len(found):
                ids, restricted = found, True
        except VeilError:
            pass  # not exported or tied: fall back to the whole vocabulary (recorded in stats)
    kept = ids[~torch.isin(ids, drop)]
    return (kept if len(kept) else ids), restricted


# ----------------------------------------------------------------------------- the objective
class _Loss(nn.Module):
    """Training loss of dummy embeddings through the model's own embedding step (for functional_call)."""

    def __init__(self, model: VeilModel, lm_tau: float, allowed: Tensor, table: Tensor, end_target: int | None) -> None:
        super().__init__()
        self.model, self.lm_tau, self.end_target = model, lm_tau, end_target
        self.register_buffer("allowed", allowed, persistent=False)
        self.register_buffer("table", F.normalize(table.detach().float(), dim=-1), persistent=False)

    def forward(self, x: Tensor, label_logits: Tensor) -> Tensor:
        batch = {"attention_mask": torch.ones(x.shape[:2], dtype=torch.long, device=x.device)}
        h = self.model.assemble(x, self.model.position_embeddings(x), batch)
        logits = self.model.forward_from_embeddings(h, batch)
        if self.model.task == "lm":
            return self._lm(x, logits.log_softmax(-1))
        return -(label_logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()

    def _lm(self, x: Tensor, logp: Tensor) -> Tensor:
        """Soft next-token targets: the nearest-token distribution of the next dummy embedding over
        the allowed tokens; the last position's target is [SEP] when known."""
        nxt = (F.normalize(x[:, 1:], dim=-1) @ self.table.T / self.lm_tau).softmax(-1)  # (B, T-1, A)
        ce = -(nxt * logp[:, :-1, self.allowed]).sum(-1)  # (B, T-1)
        if self.end_target is not None:
            ce = torch.cat([ce, -logp[:, -1:, self.end_target]], dim=1)
        return ce.mean()


def grad_distance(kind: str, dummy: list[Tensor], target: list[Tensor], alpha: float) -> Tensor:
    """TAG's L2 + alpha*L1 or LAMP's cosine distance; leading dims of `dummy` are batch dims."""
    lead = dummy[0].dim() - target[0].dim()
    flat = lambda ts, n: torch.cat([t.reshape(*t.shape[:n], -1) for t in ts], dim=-1)  # noqa: E731
    g, t = flat(dummy, lead), flat(target, 0)
    if kind == "tag":
        diff = g - t
        return (diff * diff).sum(-1) + alpha * diff.abs().sum(-1)
    if kind == "cos_layer":  # mean over parameters of 1 - cos: every layer counts the same
        dots = torch.stack(
            [
                (a * b).reshape(*a.shape[:lead], -1).sum(-1)
                / (a.reshape(*a.shape[:lead], -1).norm(dim=-1) * b.norm()).clamp_min(1e-30)
                for a, b in zip(dummy, target)
            ],
            dim=-1,
        )
        return 1.0 - dots.mean(-1)
    g, t = g.double(), t.double()  # float32 sums lose 1 - cos below ~1e-5, where sequences still differ
    return (1.0 - (g * t).sum(-1) / (g.norm(dim=-1) * t.norm().clamp_min(1e-30)).clamp_min(1e-30)).float()


@dataclass
class _Setup:
    """Everything fixed during one reconstruction."""

    loss: _Loss
    names: list[str]
    targets: list[Tensor]
    allowed: Tensor  # vocabulary ids decoding may use
    table: Tensor  # token embeddings of `allowed` (A, D)
    fixed: Tensor  # (T,) bool: positions pinned to a known token
    fixed_ids: Tensor  # (T,) their token ids (-1 where free)
    fixed_emb: Tensor  # (T, D) their embeddings
    mu: float  # mean token-embedding norm
    labels: Tensor | None  # (B, C) soft-label logits when fixed; None when learnt
    restricted: bool

    @property
    def params(self) -> dict[str, nn.Parameter]:
        return dict(self.loss.model.named_parameters())


@dataclass(frozen=True)
class TagOptions(Options):
    iterations: int = option(500, "Adam steps on the dummy embeddings")
    lr: float = option(0.05, "Adam learning rate (on unit-scale embeddings)")
    alpha: float = option(0.01, "weight of TAG's L1 term next to the L2 distance")
    distance: Literal["tag", "cos", "cos_layer"] = option(
        "tag", "gradient distance: TAG's L2 + alpha L1, the cosine, or the mean per-layer cosine"
    )
    norm_weight: float = option(0.0, "weight of the embedding-norm prior (cosine distances only)")
    discrete_every: int = option(0, "a discrete step every this many iterations (0: none)")
    restrict_to_present: bool = option(False, "decode only tokens whose embedding row has a gradient")
    fix_special: bool = option(True, "pin [CLS] (and [SEP] at batch 1) where the format places them")
    skip_reserved: bool = option(True, "never decode [PAD], [unused*], [MASK], nor pinned [CLS]/[SEP]")
    lm_tau: float = option(0.05, "temperature of the soft next-token targets of a decoder's LM loss")
    chunk_size: int = option(8, "candidates per vmap chunk when scoring token sequences (memory)")
    seed: int | None = option(None, "seed of the dummy's start; unset: the knowledge's seed")


@dataclass(frozen=True)
class LampOptions(TagOptions):
    distance: Literal["tag", "cos", "cos_layer"] = option("cos", "gradient distance (LAMP: the cosine)")
    norm_weight: float = option(0.01, "weight of the embedding-norm prior (cosine distances only)")
    discrete_every: int = option(50, "a discrete step every this many iterations (0: none)")
    restrict_to_present: bool = option(True, "decode only tokens whose embedding row has a gradient")
    candidates: int = option(16, "transformations scored per discrete step")
    topk: int = option(3, "nearest tokens a re-projection picks from")


_TagOptionsT = TypeVar("_TagOptionsT", bound=TagOptions)


class TextOptimisation(Attack[_TagOptionsT]):
    """Shared loop of TAG and LAMP; subclasses set the distance and the discrete step."""

    modality = "text"
    observes = frozenset({"gradient", "delta"})

    def _reconstruct(self, obs: Observation, know: Knowledge) -> Reconstruction:
        model = obs.model
        was = model.training
        model.eval()
        try:
            return self._run(obs, know)
        finally:
            model.train(was)
            model.zero_grad(set_to_none=True)

    # ---- setup ---------------------------------------------------------------------------
    def _setup(self, obs: Observation, know: Knowledge) -> tuple[_Setup, int, int]:
        model = obs.model
        grads = matched_gradients(obs, self.name)
        tok = know.tokenizer
        cls_id, sep_id, pad_id = (getattr(tok, a, None) for a in ("cls_id", "sep_id", "pad_id"))
        B = int(know.batch_size or (len(know.labels) if know.labels is not None else 1))
        T = dummy_length(obs, know)
        E = model.token_embedding().weight.detach().float()
        fixed_ids = torch.full((T,), -1, dtype=torch.long)
        lm = model.task == "lm"
        if self.options.fix_special and cls_id is not None:
            fixed_ids[0] = cls_id
            if B == 1 and not lm and sep_id is not None and T > 2:
                fixed_ids[T - 1] = sep_id
        fixed = fixed_ids >= 0
        # [SEP] stays decodable only where sentence ends are unknown (encoder, batch > 1)
        keep = {sep_id} if sep_id is not None and not lm and B > 1 else set()
        drop = (
            reserved_ids(tok, E.shape[0], keep)
            if self.options.skip_reserved
            else torch.tensor([i for i in (pad_id,) if i is not None], dtype=torch.long)
        )
        allowed, restricted = allowed_tokens(obs, self.options.restrict_to_present, drop)
        fixed_emb = torch.where(fixed[:, None], E[fixed_ids.clamp_min(0)], 0.0)
        end = sep_id if (lm and B == 1 and self.options.fix_special) else None
        loss = _Loss(model, self.options.lm_tau, allowed, E[allowed], end)
        names = list(grads)
        mu = float(E[allowed].norm(dim=1).mean())
        return (
            _Setup(
                loss,
                names,
                [grads[n] for n in names],
                allowed,
                E[allowed],
                fixed,
                fixed_ids,
                fixed_emb,
                mu,
                self._labels(obs, know, B),
                restricted,
            ),
            B,
            T,
        )

    def _labels(self, obs: Observation, know: Knowledge, B: int) -> Tensor | None:
        """Fixed label logits (known, or iDLG at batch 1); None means learn soft labels."""
        model = obs.model
        if model.task == "lm":
            return torch.zeros(B, 1)
        C = model.classifier().weight.shape[0]
        y = know.labels
        if y is None and B == 1 and obs.has_grad(model.classifier(), "bias"):
            from veil.attacks.labels import recover_labels

            y = recover_labels(obs, 1)
        return None if y is None else 20.0 * F.one_hot(y.long().flatten(), C).float() - 10.0

    # ---- objective pieces ----------------------------------------------------------------
    @property
    def kind(self) -> str:
        return self.options.distance

    def _embed(self, s: _Setup, z: Tensor) -> Tensor:
        return torch.where(s.fixed[:, None], s.fixed_emb, z * s.mu / math.sqrt(z.shape[-1]))

    def _prior(self, s: _Setup, x: Tensor) -> Tensor:
        if not self.kind.startswith("cos"):
            return x.new_zeros(x.shape[:-3])
        n = x[..., ~s.fixed, :].norm(dim=-1)
        return self.options.norm_weight * ((n - s.mu) / s.mu).pow(2).mean((-1, -2))

    def _objective(self, s: _Setup, x: Tensor, y: Tensor) -> Tensor:
        params = [s.params[n] for n in s.names]
        # parameters the attacker's forward does not reach (e.g. a defense's own, such as MJP's E_unk)
        # give zero dummy gradient, as torch.func's grad does in `_score`
        g = torch.autograd.grad(s.loss(x, y), params, create_graph=True, allow_unused=True)
        g = [gi if gi is not None else torch.zeros_like(p) for gi, p in zip(g, params)]
        return grad_distance(self.kind, g, s.targets, self.options.alpha) + self._prior(s, x)

    def _score(self, s: _Setup, xs: Tensor, y: Tensor) -> Tensor:
        """Gradient distance (no prior: it means nothing for real tokens) of each candidate xs[c]
        (C, B, T, D), vectorised with torch.func."""
        params = {f"model.{n}": p.detach() for n, p in s.loss.model.named_parameters() if n in set(s.names)}
        f: Callable[..., Tensor] = lambda p, x: functional_call(s.loss, p, (x, y))  # noqa: E731
        g = vmap(grad(f), in_dims=(None, 0), chunk_size=self.options.chunk_size)(params, xs)
        return grad_distance(self.kind, [g[f"model.{n}"] for n in s.names], s.targets, self.options.alpha)

    def nearest(self, s: _Setup, x: Tensor, k: int = 1) -> Tensor:
        """Indices into `s.allowed` of the k nearest allowed tokens (cosine) of every position: (..., T, k)."""
        return (F.normalize(x, dim=-1) @ F.normalize(s.table, dim=-1).T).topk(min(k, len(s.allowed)), dim=-1).indices

    def tokens(self, s: _Setup, idx: Tensor) -> Tensor:
        """Embeddings of a sequence of allowed-token indices (..., T), pinned positions in place."""
        return torch.where(s.fixed[:, None], s.fixed_emb, s.table[idx])

    def discrete_step(
        self, s: _Setup, x: Tensor, y: Tensor, gen: torch.Generator, state: dict[str, Any]
    ) -> Tensor | None:
        """Hook for a discrete move every `discrete_every` steps: new embeddings, or None to keep x."""
        return None

    def decode(self, s: _Setup, x: Tensor, y: Tensor, state: dict[str, Any]) -> tuple[Tensor, float]:
        """Final token sequence (allowed indices, (B, T)) and its gradient distance."""
        idx = self.nearest(s, x)[..., 0]
        return idx, float(self._score(s, self.tokens(s, idx)[None], y)[0])

    # ---- the loop ------------------------------------------------------------------------
    def _run(self, obs: Observation, know: Knowledge) -> Reconstruction:
        s, B, T = self._setup(obs, know)
        gen = set_seed(int(know.seed if self.options.seed is None else self.options.seed))
        D = s.table.shape[1]
        z = nn.Parameter(torch.randn(B, T, D, generator=gen))
        learn_y = s.labels is None
        y = (
            nn.Parameter(torch.randn(B, obs.model.classifier().weight.shape[0], generator=gen) * 0.1)
            if learn_y
            else s.labels
        )
        opt = torch.optim.Adam([z, y] if learn_y else [z], lr=self.options.lr)
        iters, every = self.options.iterations, self.options.discrete_every
        history: list[float] = []
        state: dict[str, Any] = {"moves": 0}
        t0 = time.perf_counter()
        bar = work_bar(iters, self.name)
        for it in range(iters):
            bar.update(1)
            opt.zero_grad(set_to_none=True)
            loss = self._objective(s, self._embed(s, z), y)
            loss.backward()
            opt.step()
            history.append(float(loss.detach()))
            if every and (it + 1) % every == 0 and it + 1 < iters:
                with torch.no_grad():
                    new = self.discrete_step(s, self._embed(s, z), y.detach(), gen, state)
                    if new is not None:
                        z.copy_(new * math.sqrt(D) / s.mu)
        bar.close()
        elapsed = time.perf_counter() - t0
        with torch.no_grad():
            idx, decoded = self.decode(s, self._embed(s, z), y.detach(), state)
        return Reconstruction(
            token_ids=self._sequences(s.allowed[idx], s, know, obs.model),
            stats={
                "iterations": iters,
                "iterations_per_second": iters / max(elapsed, 1e-9),
                "final_loss": history[-1] if history else float("nan"),
                "decoded_loss": decoded,
                "initial_loss": history[0] if history else float("nan"),
                "loss_history": history[:: max(1, iters // 50)],
                "length": T,
                "restricted_to_present": s.restricted,
                "allowed_tokens": int(len(s.allowed)),
                "discrete_moves": state["moves"],
                "labels_learnt": learn_y,
                "matched_parameters": len(s.names),
                "work": {"iterations": iters},  # the loop runs its iterations out
                "budget_stopped": True,
            },
        )

    def budget(self) -> dict[str, int]:
        """Adam iterations on the dummy embeddings (LAMP's discrete steps ride on them)."""
        return {"iterations": self.options.iterations}

    def _sequences(self, ids: Tensor, s: _Setup, know: Knowledge, model: VeilModel) -> list[list[int]]:
        """Pinned tokens back in place, cut after the first [SEP]; a causal LM's [SEP] appended."""
        sep = getattr(know.tokenizer, "sep_id", None)
        ids = torch.where(s.fixed[None], s.fixed_ids[None], ids)
        out = []
        for row in ids.tolist():  # one short list per sentence (B of them), not per token
            if sep is not None and sep in row[1:]:
                row = row[: row.index(sep, 1) + 1]
            elif model.task == "lm" and sep is not None and self.options.fix_special:
                row = row + [sep]
            out.append(row)
        return out


@ATTACKS.register(
    "tag", help="TAG: continuous embeddings matched to the gradient by L2 + alpha*L1, nearest-token decoding (text)"
)
class TagAttack(TextOptimisation[TagOptions]):
    """TAG: L2 + alpha L1 gradient distance, nearest-token decoding (options: `TagOptions`)."""

    knows = (
        "the update, the weights, the vocabulary, batch size and length (labels if granted); not the defense (naive)"
    )


@ATTACKS.register(
    "lamp",
    help="LAMP: cosine gradient distance + embedding-norm prior, with discrete swap/move/projection steps (text)",
)
class LampAttack(TextOptimisation[LampOptions]):
    """LAMP: cosine distance + embedding-norm prior, discrete swap / move / projection steps
    (options: `LampOptions`)."""

    knows = (
        "the update, the weights, the vocabulary, batch size and length (labels if granted); not the defense (naive)"
    )

    def discrete_step(
        self, s: _Setup, x: Tensor, y: Tensor, gen: torch.Generator, state: dict[str, Any]
    ) -> Tensor | None:
        """One LAMP discrete step. Continuous candidates: x and swaps / span moves of x (LAMP's
        transformations). Token candidates: proj(x), the best token sequence so far, and swaps / span
        moves / top-k re-projections of both. All are scored by the objective in one vectorised
        call; the best token sequence is kept, and x continues from the best candidate overall."""
        free = torch.nonzero(~s.fixed).flatten()
        if len(free) < 2:
            return None
        n = self.options.candidates
        B, T, D = x.shape
        ar = torch.arange(n)
        cont = x[None].repeat(n, 1, 1, 1)
        sent = torch.randint(0, B, (n,), generator=gen)
        rows = cont[ar, sent]
        rows[:, free] = rows[:, free][ar[:, None], reorderings(len(free), n, gen)]
        cont[ar, sent] = rows
        near = self.nearest(s, x, self.options.topk)  # (B, T, k)
        base = near[None, ..., 0] if "best" not in state else torch.stack([near[..., 0], state["best"]])
        toks = torch.cat([base, self._variants(base, near, free, gen)])  # (C, B, T)
        scores = self._score(s, torch.cat([x[None], cont, self.tokens(s, toks)]), y)
        c, t = 1 + n, int(scores[1 + n :].argmin())
        if "best" not in state or float(scores[c + t]) < state["score"]:
            state["best"], state["score"] = toks[t].clone(), float(scores[c + t])
        i = int(scores.argmin())
        state["moves"] += int(i > 0)
        return None if i == 0 else (cont[i - 1] if i < c else self.tokens(s, toks[i - c]))

    def _variants(self, base: Tensor, near: Tensor, free: Tensor, gen: torch.Generator) -> Tensor:
        """n variants of random rows of `base` (P, B, T): reorder the free positions of one sentence, or
        replace one free position by one of its top-k nearest tokens."""
        n = self.options.candidates
        P, B, T = base.shape
        out = base[torch.randint(0, P, (n,), generator=gen)].clone()  # (n, B, T)
        ar = torch.arange(n)
        sent = torch.randint(0, B, (n,), generator=gen)
        rows = out[ar, sent]  # (n, T), a copy
        moved = rows.clone()
        moved[:, free] = rows[:, free][ar[:, None], reorderings(len(free), n, gen)]
        pos = free[torch.randint(0, len(free), (n,), generator=gen)]
        swapped = rows.clone()
        swapped[ar, pos] = near[sent, pos, torch.randint(0, near.shape[-1], (n,), generator=gen)]
        out[ar, sent] = torch.where((ar % 3 == 2)[:, None], swapped, moved)  # every third: a re-projection
        return out

    def decode(self, s: _Setup, x: Tensor, y: Tensor, state: dict[str, Any]) -> tuple[Tensor, float]:
        """The final projection or the best sequence scored so far, whichever is closer."""
        idx, score = super().decode(s, x, y, state)
        if "best" in state and state["score"] < score:
            return state["best"], state["score"]
        return idx, score


def reorderings(length: int, n: int, gen: torch.Generator) -> Tensor:
    """n random permutations of range(length): half swap two positions, half move a span elsewhere.

    Vectorised by sort keys: kept positions keep key i; a swap exchanges two keys; a span [a, b)
    moved before position c gets keys in (c - 1, c), so a stable argsort yields the new order.
    """
    pos = torch.arange(length, dtype=torch.float64).expand(n, length)
    i, j = (torch.randint(0, length, (n,), generator=gen) for _ in range(2))
    swap = pos.clone()
    swap[torch.arange(n), i] = j.double()
    swap[torch.arange(n), j] = i.double()
    a = torch.randint(0, length, (n,), generator=gen)
    b = a + 1 + (torch.rand(n, generator=gen) * (length - a)).long().clamp_max(length - a - 1)
    c = torch.randint(0, length + 1, (n,), generator=gen).double()
    span = (pos >= a[:, None]) & (pos < b[:, None])
    moved = torch.where(span, c[:, None] - 1 + (pos - a[:, None] + 1) / (length + 2), pos)
    keys = torch.where((torch.arange(n) % 2 == 0)[:, None], swap, moved)
    return keys.argsort(dim=1, stable=True)
