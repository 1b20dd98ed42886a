"""Building blocks of the span attack (`veil.attacks.span`; Petrov et al. 2024, DAGER, sec. 3):
the span of a layer's inputs read off its Q/K/V weight gradients, the inputs a candidate token or
sentence gives a layer, the per-position layer-1 candidates, and the encoder's LayerNorm pins.

A linear layer ``Y = X W^T`` gets ``dL/dW = sum_i g_i x_i^T``, so the row space of ``dL/dW`` lies
in ``span{x_i}`` (eq. 2-3); a vector x is a layer input iff its relative distance to that span,

    d(x) = || x - P P^T x ||_2 / ||x||_2,   P = orthonormal basis of the top right singular
                                               vectors of [dW_Q; dW_K; dW_V],

is (numerically) zero. Layer 1's input is ``h0(v, t) = N0(assemble(E_tok[v], E_pos[t]))``, a known
function of one token and its position, so every candidate token is tested at every position:
``S_t = {v : d(h0(v, t)) < tol1}``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from veil.attacks.base import Knowledge, Observation
from veil.attacks.presence import embedding_row_norms, present_tokens, special_ids
from veil.attacks.span.options import DEFAULTS
from veil.errors import VeilError
from veil.models.base import AttentionHandles, VeilModel, linear_weight


# ----------------------------------------------------------------------------- spans
@dataclass
class Span:
    """Orthonormal basis (width, rank) of the row space of one layer's projection gradients."""

    basis: Tensor
    singular: Tensor
    width: int

    @property
    def rank(self) -> int:
        return self.basis.shape[1]

    def distance(self, x: Tensor) -> Tensor:
        """Relative distance of each row of ``x`` (..., width) to the span, in x's precision. In
        float64 as ``sqrt(1 - |P^T x|^2 / |x|^2)`` (P orthonormal): one product with the basis
        instead of two, and the cancellation leaves ~2e-8 of absolute error, far below every
        tolerance (>= 1e-4); in float32 as ``|x - P P^T x| / |x|`` (that formula's error there
        would be ~3e-4)."""
        basis = self.basis.to(x.dtype)
        if x.dtype == torch.float64:
            r = (x @ basis).pow(2).sum(-1) / x.pow(2).sum(-1).clamp_min(1e-300)
            return (1 - r).clamp_min(0).sqrt()
        res = x - (x @ basis) @ basis.T
        return res.norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30)


def layer_span(obs: Observation, layer: int, rank_tol: float = DEFAULTS.rank_tol) -> Span:
    """The span of layer `layer`'s attention inputs from its Q/K/V weight gradients."""
    model = obs.model
    layers = model.attention_layers()
    if layer >= len(layers):
        raise VeilError(f"span needs attention layer {layer + 1}; this model has {len(layers)}")
    att = layers[layer]
    grads = [linear_weight(m, obs.grads[param_name(model, m.weight)]) for m in qkv_modules(att) if obs.has_grad(m)]
    if not grads:
        obs.grad(att.q)  # raises the one-line error naming the missing gradient
    g = torch.cat(grads, dim=0).double()
    _, s, vh = torch.linalg.svd(g, full_matrices=False)
    keep = s > rank_tol * s[0] if s.numel() and s[0] > 0 else torch.zeros_like(s, dtype=torch.bool)
    return Span(basis=vh[keep].T.contiguous(), singular=s, width=g.shape[1])


def span_reads(model: VeilModel) -> list[str]:
    """What the span attacks read (`Attack.reads`): the first two attention layers' Q/K/V and the
    last one's Q, the token embedding, the position table and the down-projections but the last."""
    from veil.attacks.base import param_names

    layers = model.attention_layers()
    mods: list[nn.Module | Tensor] = [m for att in layers[:2] for m in qkv_modules(att)] + (
        [layers[-1].q] if layers else []
    )
    mods.append(model.token_embedding())
    if model.absolute_positions:
        mods.append(model.position_table())
    mods += list(model.mlp_down())[:-1]
    return param_names(model, [m.weight if isinstance(m, nn.Module) and hasattr(m, "weight") else m for m in mods])


def qkv_modules(att: AttentionHandles) -> list[nn.Module]:
    """The distinct Q, K, V projections of one attention layer (GPT-2: one fused c_attn)."""
    return list({id(m): m for m in (att.q, att.k, att.v)}.values())


def param_name(model: nn.Module, p: nn.Parameter) -> str:
    return next(n for n, q in model.named_parameters() if q is p)


# ----------------------------------------------------------------------------- layer inputs
def model_device(model: nn.Module) -> torch.device:
    """Where the model's weights live: the searches keep ids and scores on the CPU and move each
    scoring call's inputs there (the same code on ``cuda``)."""
    return next(model.parameters()).device


#: memory one scoring call may use on the CPU, and the float32 activations a block keeps per token
#: and width (Q/K/V/O, the MLP's 4x hidden, LayerNorms, residuals: ~12), x3 with the backward pass
CALL_BYTES = 1 << 30
ACT_FLOATS = 12


def rows_per_call(model: nn.Module, row_bytes: int) -> int:
    """How many candidate sentences of `row_bytes` activations each one scoring call may hold:
    `CALL_BYTES` on the CPU, a quarter of the free memory on a GPU (at least one)."""
    dev = model_device(model)
    room = torch.cuda.mem_get_info(dev)[0] // 4 if dev.type == "cuda" else CALL_BYTES
    return max(1, int(room // max(1, row_bytes)))


def first_layer_inputs(model: VeilModel, ids: Tensor, positions: Tensor) -> Tensor:
    """``h0(ids[i], positions[j])`` for all pairs: (len(positions), len(ids), width), on the model's device."""
    dev = model_device(model)
    tok = model.token_embedding().weight[ids.to(dev)]  # (V, D)
    pos = model.position_table().reshape(-1, tok.shape[-1])[positions.to(dev)]  # (P, D)
    h = model.assemble(tok.unsqueeze(0).expand(len(positions), -1, -1), pos.unsqueeze(1), {})
    return model.layer_input_norms()[0](h)


class _Stop(Exception):
    pass


@contextmanager
def recording_inputs(mods: list[nn.Module], stop: nn.Module | None = None) -> Iterator[dict[int, Tensor]]:
    """Record (detached) the input each module of `mods` receives, keyed by ``id(module)``; with
    `stop`, the forward pass ends (quietly) as soon as `stop` receives its input."""
    seen: dict[int, Tensor] = {}

    def hook_for(m: nn.Module) -> Callable[[nn.Module, tuple[Tensor, ...]], None]:
        def hook(_m: nn.Module, args: tuple[Tensor, ...]) -> None:
            seen[id(m)] = args[0].detach()
            if m is stop:
                raise _Stop

        return hook

    handles = [m.register_forward_pre_hook(hook_for(m)) for m in {id(m): m for m in mods}.values()]
    try:
        yield seen
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()


def layer_inputs(model: VeilModel, ids: Tensor, mask: Tensor | None = None, layer: int = 1) -> Tensor:
    """The input that attention layer `layer`'s Q projection receives for sentences `ids` (N, T)
    (on the model's device)."""
    mask = torch.ones_like(ids) if mask is None else mask
    dev = model_device(model)
    batch = {"input_ids": ids.to(dev), "attention_mask": mask.to(dev)}
    q = model.attention_layers()[layer].q
    with recording_inputs([q], stop=q) as seen:
        tok = model.embed_tokens(batch)
        model.forward_from_embeddings(model.assemble(tok, model.position_embeddings(tok), batch), batch)
    return seen[id(q)]


#: (token, position) pairs per layer-1 scoring call: a bound on one call's memory, not a tunable
#: of the search (which pairs pass is decided by `tol`)
PAIRS_PER_CALL = 8192


def position_candidates(
    model: VeilModel,
    span: Span,
    max_len: int,
    tol: float,
    chunk: int = PAIRS_PER_CALL,
    max_per_position: int | None = None,
    vocab: Tensor | None = None,
) -> tuple[list[Tensor], list[Tensor]]:
    """Per position t < max_len: ids of tokens (of `vocab`, default all) with d(h0(v, t)) < tol, and their distances.

    Distances are computed in float64 (the true pairs sit at the float32 noise floor of the
    gradient, ~1e-7..1e-4; wrong pairs at >= 1e-3), one matrix product per chunk of
    (position, token) pairs. The candidates come in the vocabulary's order, not by distance: the
    true pairs' distances are rounding noise, whose order changes with the thread count, and the
    searches' draws and ties follow this order."""
    ids_all = torch.arange(model.token_embedding().weight.shape[0]) if vocab is None else vocab
    per = max(1, chunk // max(1, len(ids_all)))  # positions per chunk
    dists = torch.empty(max_len, len(ids_all), dtype=torch.float64)
    for start in range(0, len(ids_all), chunk):
        ids = ids_all[start : start + chunk]
        for t0 in range(0, max_len, per):
            pos = torch.arange(t0, min(max_len, t0 + per))
            x = first_layer_inputs(model, ids, pos).double()
            dists[pos, start : start + len(ids)] = span.distance(x).cpu()
    found, fd = [], []
    for t in range(max_len):
        idx = torch.nonzero(dists[t] < tol).flatten()
        if max_per_position:  # the nearest ones, then back in the vocabulary's order
            idx = idx[dists[t, idx].argsort(stable=True)][:max_per_position].sort().values
        found.append(ids_all[idx])
        fd.append(dists[t, idx].float())
    return found, fd


def vocabulary(obs: Observation, know: Knowledge, rel_tol: float = DEFAULTS.presence_tol) -> Tensor | None:
    """The tokens worth testing: the batch's bag from the token-embedding gradient (`presence`) plus
    the special tokens (a causal LM's final [SEP] gets no gradient); None (whole vocabulary) if that
    gradient is not exported or the embedding is tied to the LM head. A token is in the bag where
    its row norm passes `rel_tol` x the largest (`SpanOptions.presence_tol`)."""
    if not obs.has_grad(obs.model.token_embedding()):
        return None
    try:
        norms = embedding_row_norms(obs)
    except VeilError:
        return None
    extra = torch.tensor(special_ids(obs.model, know.tokenizer), dtype=torch.long)
    return torch.unique(torch.cat([present_tokens(norms, rel_tol).cpu(), extra]))


@dataclass
class Specials:
    cls: int | None
    sep: int | None
    pad: int | None

    @classmethod
    def of(cls, model: VeilModel, know: Knowledge) -> Specials:
        tok = know.tokenizer
        if tok is not None:
            return cls(getattr(tok, "cls_id", None), getattr(tok, "sep_id", None), getattr(tok, "pad_id", None))
        ids = special_ids(model)
        return cls(ids[1] if len(ids) > 1 else None, ids[2] if len(ids) > 2 else None, ids[0])


# ----------------------------------------------------------------------------- encoder positions
def pin_positions(
    obs: Observation, cands: list[Tensor], floor: float, slack_max: float = DEFAULTS.ln_slack
) -> tuple[list[Tensor], dict[int, int]] | None:
    """Narrow an encoder's per-position candidates with the embedding LayerNorm's Jacobian.

    For ``h = LN(x)``, ``x = E[v] + P[t] + s``, ``c = x - mean(x)``, the backward pass gives
    ``<J^T g, c> = <gamma g, c> / s * eps / (var(x) + eps)``: the LayerNorm removes the direction of
    its own centred input (up to its eps). So if token v occurs at ONE position t (in any number of
    sentences), ``dL/dE[v] = J(v, t)^T g`` and ``|cos(dL/dE[v], c(v, t))| ~< eps / (var + eps)``,
    while at any other position the cosine is generic (~1/sqrt(width)). Such a token is pinned to
    t and removed from every other position's candidates; tokens with no orthogonal position
    occur at several positions and keep their layer-1 candidates. The cosine threshold is `floor`
    (`SpanOptions.tol_ln`) plus that leak where the leak is below `slack_max`
    (`SpanOptions.ln_slack`). Returns (candidates, pins) or None if the model has no embedding
    LayerNorm or the gradients are not exported.
    """
    model = obs.model
    emb = model.token_embedding()
    if not hasattr(model, "embedding_norm") or not obs.has_grad(emb):
        return None
    T = len(cands)
    if not any(len(c) for c in cands):
        return None
    toks = torch.unique(torch.cat([c for c in cands if len(c)]))
    cos, var, g = _centred_cosines(obs, toks, T)
    col = {int(v): j for j, v in enumerate(toks.tolist())}
    allowed = torch.zeros(T, len(toks), dtype=torch.bool)
    for t, ct in enumerate(cands):
        allowed[t, [col[int(v)] for v in ct.tolist()]] = True
    eps = float(getattr(model.embedding_norm(), "eps", 1e-5))
    slack = eps / (var + eps)  # the LayerNorm's leak along its own input; trusted only where it is tiny
    ok = allowed & (cos < torch.where(slack < slack_max, slack, torch.zeros_like(slack)) + floor) & (g.norm(dim=-1) > 0)
    single = (ok.sum(0) == 1) | (allowed.sum(0) == 1)
    where = torch.where(ok.sum(0) == 1, ok.double().argmax(0), allowed.double().argmax(0))
    pins = {int(toks[j]): int(where[j]) for j in torch.nonzero(single).flatten().tolist()}
    return apply_pins(cands, pins), pins


def _centred_cosines(obs: Observation, toks: Tensor, T: int) -> tuple[Tensor, Tensor, Tensor]:
    """For each position t < T and token of `toks`: ``|cos(dL/dE[v], c(v, t))|`` (T, V), the
    variance of the centred embedding-LayerNorm input (T, V), and the gradient rows (V, width)."""
    model = obs.model
    emb = model.token_embedding()
    table = model.position_table().reshape(-1, emb.weight.shape[1])[:T].double()
    on = toks.to(emb.weight.device)
    x = emb.weight[on].double()[None] + table[:, None] + model.segment_row().double()
    c = x - x.mean(-1, keepdim=True)
    var = c.pow(2).mean(-1)
    g = obs.grad(emb)[on].double()
    cos = ((c * g).sum(-1).abs() / (c.norm(dim=-1) * g.norm(dim=-1)).clamp_min(1e-300)).cpu()  # (T, V)
    return cos, var.cpu(), g.cpu()


def apply_pins(cands: list[Tensor], pins: dict[int, int]) -> list[Tensor]:
    """Each position's candidates without the tokens pinned to another position (`pin_positions`)."""
    if not pins:
        return cands
    dev = next((c.device for c in cands if len(c)), torch.device("cpu"))
    top = max(max(pins), *(int(c.max()) for c in cands if len(c))) + 1
    at = torch.full((top,), -1, dtype=torch.long, device=dev)  # each token id's pinned position, -1: none
    at[torch.tensor(list(pins), device=dev)] = torch.tensor(list(pins.values()), device=dev)
    return [c[(at[c] < 0) | (at[c] == t)] for t, c in enumerate(cands)]


def last_position(cands: list[Tensor]) -> int:
    """One past the last position with a candidate (later positions got no gradient)."""
    nonempty = [t for t, c in enumerate(cands) if len(c)]
    return nonempty[-1] + 1 if nonempty else 0
