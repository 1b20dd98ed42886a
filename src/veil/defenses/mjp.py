"""MJP — the Masked Jigsaw Puzzle defense (`mjp-masked-jigsaw-puzzle.txt`, Ye et al.; Ren et al. CVPR'23).

Implements, on every veil model with a learnable position table (ViT, text encoders, HF BERT /
MiniLM, HF ViT):

* Alg. 1 — token-wise jigsaw shuffle: per sequence a ratio ``gamma`` of the movable slots is
  selected (vision: BEiT block-wise or plain random on the patch grid; text: within each
  non-overlapping n-gram window of ``window`` slots, Eq. 6) and the selected tokens are permuted
  among themselves (`veil.defenses.jigsaw`). [CLS], [SEP] and padding never move. With
  ``gamma > 0`` at least two slots are selected and at least two tokens move (``MIN_SELECTED``:
  on a 16-patch image at gamma 0.03, stochastic rounding of 0.48 slots alone selects none about
  every other image, and one selected slot cannot move), so a small gamma is a small shuffle, never none.
* Eq. 2-3 — MJP position embedding: one shared learnable ``E_unk`` (1, D) replaces ``E_pos`` at
  every selected slot. It is the parameter ``model.mjp.unk`` (in the state dict and checkpoints).
* Eq. 4-5 — DAL: a regressor ``g`` (``model.mjp.loc``: Linear(D, D) - ReLU - Linear(D, c))
  maps the position embedding ``E_pos[l]`` of every *unshuffled* movable slot to its location:
  ``(row, col) / K`` on the K x K patch grid (c = 2) or ``l / (rows - 1)`` for text (c = 1, rows =
  the size of the position table). Loss: mean over (sequence, unshuffled slot) of
  ``|| loc_l - g(E_pos[l]) ||_1``, weighted by ``aux_lambda`` (0.01 in the paper).
* DRL (text in the paper, allowed for vision too): the relative variant. Pairs (i, j) of unshuffled
  slots are drawn (``pairs_per_token`` x N pairs per step, i and j independently, each slot
  weighted by how many sequences left it unshuffled); ``g`` (Linear(2D, D) - ReLU - Linear(D, c))
  maps ``[E_pos[i]; E_pos[j]]`` to the offset ``loc_i - loc_j``; loss = mean L1 over pairs.

Variants under the same switch: ``mjp`` (shuffle + E_unk), ``shuffle`` (shuffle, original PEs:
the paper's "shuff" baseline) and ``nope`` (no position embeddings at all, train and test: the
"w/o PEs" baseline; the tokens are still shuffled at ``gamma`` in training).

The shuffle runs only in training mode. `set_eval_gamma(g)` turns on a test-time shuffle at ratio
g (the consistency evaluation of Fig. 4/5 and Table VIII (b)): as in the authors' consistency
code, the client knows which slots it shuffled, so an ``mjp`` model gets ``E_unk`` at them, a
``shuffle`` model keeps its PEs. ``gamma = 0`` makes the transform the identity (bit-identical
training); the auxiliary loss is a separate switch (``aux='none'`` for a zero-strength run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from veil.defenses import DEFENSES
from veil.defenses.base import Defense, check_unit_interval
from veil.defenses.jigsaw import MIN_SELECTED, apply_perm, jigsaw, select_blocks, select_random, select_windows
from veil.defenses.noise import torch_seed
from veil.errors import VeilError
from veil.models.base import Batch, VeilModel

VARIANTS = ("mjp", "shuffle", "nope")
AUXES = ("dal", "drl", "none")
SELECTIONS = ("block", "random")
UNK_INITS = ("random", "mean")


@dataclass
class JigsawState:
    """What the last forward pass did (read by `aux_loss` and by tests)."""

    pos: Tensor  # (1, N, D) the slots' original position embeddings
    movable: Tensor  # (B, N)
    mask: Tensor | None  # (B, N) selected (shuffled, E_unk) slots; None when nothing ran
    perm: Tensor | None  # (B, N) index map, shuffled[:, j] = tok[:, perm[:, j]]
    pos_out: Tensor | None = None  # the position embeddings actually used


class MJPModule(nn.Module):
    """The parameters MJP adds to a model: ``unk`` (E_unk) and the location regressor ``loc``."""

    def __init__(self, dim: int, coords: int, unk: bool, aux: str, unk_start: Tensor | None = None) -> None:
        super().__init__()
        if unk:
            start = torch.randn(1, dim) * 0.02 if unk_start is None else unk_start.detach().reshape(1, dim).clone()
            self.unk = nn.Parameter(start)
        if aux != "none":
            inp = 2 * dim if aux == "drl" else dim
            self.loc = nn.Sequential(nn.Linear(inp, dim), nn.ReLU(), nn.Linear(dim, coords))


def grid_locations(grid: tuple[int, int], n: int, device: torch.device | str = "cpu") -> Tensor:
    """(n, 2) DAL targets on an H x W patch grid: (row / H, col / W) of slot l = row * W + col."""
    H, W = grid
    idx = torch.arange(n, device=device)
    return torch.stack([idx // W / H, idx % W / W], dim=1).float()


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise VeilError(f"mjp {name} {value!r} is not known; choose one of: {', '.join(allowed)}")
    return value


@DEFENSES.register(
    "mjp", "Masked Jigsaw Puzzle: shuffle a ratio gamma of tokens, learnable E_unk at their positions, DAL/DRL"
)
class MJP(Defense):
    """Masked Jigsaw Puzzle (Alg. 1, Eq. 2-6).

    gamma: shuffle ratio in [0, 1] (default 0.03 for images, 0.5 for text, the paper's choices).
    window: text n-gram window size >= 2 (default 32); None shuffles across the whole sequence.
    selection: ``block`` (BEiT blocks, default) or ``random`` for images.
    aux: ``dal``, ``drl`` or ``none`` (default: dal for images, none for text, as in the paper).
    aux_lambda: weight of the auxiliary loss (0.01). variant: ``mjp``, ``shuffle`` or ``nope``.
    unk_init: ``random`` (default: N(0, 0.02^2), like a fresh position table) or ``mean``: E_unk
    starts at the mean row of the model's position table. For a pretrained model this matters:
    MiniLM's position rows share a large common component (the mean row has norm 0.33 against
    ~0.47 per row), which a random E_unk lacks, so a masked slot starts off the distribution the
    pretrained LayerNorm and attention saw; ``mean`` starts it at "some position".
    seed: None (default) draws shuffles from torch's global RNG, which the training loop reseeds
    per epoch from ``train.seed`` (reproducible); an int gives MJP its own generator. Image masks
    are drawn 2048 at a time (`_from_pool`); the pool's unused rest and the generator are the
    resume state (`state_dict`), so a resumed run draws what the uninterrupted run would have.
    """

    POOL = 2048  # image masks drawn per batch of draws (see `_from_pool`)

    def __init__(
        self,
        gamma: float | None = None,
        window: int | None = 32,
        selection: str = "block",
        aux: str | None = None,
        aux_lambda: float = 0.01,
        variant: str = "mjp",
        seed: int | None = None,
        unk_init: str = "random",
        pairs_per_token: int = 4,
    ) -> None:
        super().__init__()
        self.gamma = None if gamma is None else check_unit_interval("mjp gamma", gamma)
        if window is not None and (isinstance(window, bool) or int(window) != window or int(window) < 2):
            raise VeilError(f"mjp window must be an integer >= 2 (or none for the whole sequence), got {window}")
        self.window = None if window is None else int(window)
        self.selection = _check_choice("selection", str(selection), SELECTIONS)
        self.aux = None if aux is None else _check_choice("aux", str(aux), AUXES)
        if float(aux_lambda) < 0:
            raise VeilError(f"mjp aux_lambda must be >= 0, got {aux_lambda}")
        self.aux_lambda = float(aux_lambda)
        self.variant = _check_choice("variant", str(variant), VARIANTS)
        if self.variant == "nope" and self.aux not in (None, "none"):
            raise VeilError(
                f"mjp aux {self.aux!r} regresses position embeddings, which variant 'nope' removes; use aux=none"
            )
        self.seed = None if seed is None else int(seed)
        self.unk_init = _check_choice("unk_init", str(unk_init), UNK_INITS)
        self.pairs_per_token = int(pairs_per_token)
        self.eval_gamma: float | None = None
        self.eval_unk = True
        self.last: JigsawState | None = None
        self._gen: torch.Generator | None = None
        self._locs: dict[tuple[int, str], Tensor] = {}
        self._pool: list[Any] | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    def _attach(self, model: VeilModel) -> None:
        if model.task == "lm":
            raise VeilError(
                "mjp shuffles input tokens, which breaks next-token prediction; use it on classification models"
            )
        if hasattr(model, "mjp"):
            raise VeilError("this model already carries MJP parameters (model.mjp); detach the other MJP first")
        image = model.modality == "image"
        if self.gamma is None:
            self.gamma = 0.03 if image else 0.5
        if not model.absolute_positions:  # CNN, RoPE: no E_pos to mask or regress; MJP is the shuffle alone
            if self.aux not in (None, "none"):
                raise VeilError(
                    f"mjp aux {self.aux!r} regresses position embeddings, which this model lacks; use aux=none"
                )
            self.variant, self.aux = ("shuffle" if self.variant == "mjp" else self.variant), "none"
        if self.aux is None:
            self.aux = "dal" if image and self.variant != "nope" else "none"
        self.grid = tuple(model.grid_shape) if image else None
        dim = int(model.width)
        ref = model.position_table() if model.absolute_positions else next(model.parameters())
        model.set_embedding_transform(self._transform)  # refuses a second transform
        start = ref.detach().reshape(-1, dim).mean(0) if self.unk_init == "mean" else None
        model.mjp = MJPModule(dim, 2 if image else 1, unk=self.variant == "mjp", aux=self.aux, unk_start=start).to(
            ref.device, ref.dtype
        )

    def _detach(self, model: VeilModel) -> None:
        model.set_embedding_transform(None)
        if hasattr(model, "mjp"):
            del model.mjp
        self.last = None
        self._locs = {}
        self._pool = None

    def set_eval_gamma(self, gamma: float | None, unk: bool = True) -> None:
        """Shuffle at ratio `gamma` in eval mode too (consistency evaluation); None turns it off.

        ``unk=False`` keeps the original PEs at the shuffled slots even for an ``mjp`` model (the
        "w/o E_unk" ablation of Table VIII (3)).
        """
        self.eval_gamma = None if gamma is None else check_unit_interval("mjp test-time gamma", gamma)
        self.eval_unk = bool(unk)

    def describe(self) -> dict[str, Any]:
        return self.settings_of("gamma", "window", "selection", "aux", "aux_lambda", "variant", "seed", "unk_init")

    # ---- exact resume --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Tensor]:
        """Its generator's state (with a seed) and the unused rest of the pooled image masks: a run
        resumed from a checkpoint draws the masks the uninterrupted run would have drawn."""
        state: dict[str, Tensor] = {}
        if self._gen is not None:
            state["generator"] = self._gen.get_state()
        if self._pool is not None:
            (gamma, _, _), mask, perm, used = self._pool
            state.update(
                {
                    "pool.gamma": torch.tensor(gamma, dtype=torch.float64),
                    "pool.mask": mask[used:].cpu(),
                    "pool.perm": perm[used:].cpu(),
                }
            )
        return state

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Exactly the state `state_dict` saw: no generator or pool there means none here (drawn afresh)."""
        device = next(self.model.parameters()).device if self.model is not None else torch.device("cpu")
        self._gen, self._pool = None, None
        if "generator" in state:
            self._generator(device).set_state(state["generator"])
        if "pool.mask" in state:
            key = (float(state["pool.gamma"]), self.selection, str(device))
            self._pool = [key, state["pool.mask"].to(device), state["pool.perm"].to(device), 0]

    # ---- the embedding transform (Alg. 1 + Eq. 2-3) ------------------------------------------
    def _generator(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None
        if self._gen is None or self._gen.device != device:
            self._gen = torch.Generator(device=device)
            # with a client-held secret: shuffles the server cannot replay
            self._gen.manual_seed(self.seed if self.secret is None else torch_seed((self.seed,), self.secret))
        return self._gen

    def select(self, movable: Tensor, gamma: float) -> tuple[Tensor, Tensor]:
        """(B, N) bool slots to shuffle (and mask) for this batch, and the (B, N) index map."""
        g = self._generator(movable.device)
        if self.grid is not None and bool(movable.all()):
            return self._from_pool(movable.shape[0], gamma, movable.device)
        if self.grid is not None:
            mask = select_random(movable, gamma, g, MIN_SELECTED)
            return mask, jigsaw(mask, None, g)
        mask = select_windows(movable, gamma, self.window, g, MIN_SELECTED)
        return mask, jigsaw(mask, self.window, g)

    def _from_pool(self, batch: int, gamma: float, device: torch.device) -> tuple[Tensor, Tensor]:
        """Image masks and permutations are drawn POOL rows at a time and consumed in order.

        Every row is used once, so the distribution is the same as drawing per step; batching the
        draws removes most of the per-step cost on small ViTs.
        """
        key = (gamma, self.selection, str(device))
        pool = self._pool
        if pool is None or pool[0] != key or pool[3] + batch > pool[1].shape[0]:
            g = self._generator(device)
            size = max(self.POOL, batch)
            if self.selection == "block":
                mask = select_blocks(size, self.grid, gamma, g, device, least=MIN_SELECTED)
            else:
                mask = select_random(
                    torch.ones(size, self.grid[0] * self.grid[1], dtype=torch.bool, device=device),
                    gamma,
                    g,
                    MIN_SELECTED,
                )
            pool = self._pool = [key, mask, jigsaw(mask, None, g), 0]
        i = pool[3]
        pool[3] = i + batch
        return pool[1][i : i + batch], pool[2][i : i + batch]

    def _transform(self, tok: Tensor, pos: Tensor, movable: Tensor) -> tuple[Tensor, Tensor]:
        model = self.model
        training = model is not None and model.training
        gamma = self.gamma if training else self.eval_gamma
        self.last = JigsawState(pos, movable, None, None)
        pos_out = torch.zeros_like(pos) if self.variant == "nope" else pos
        if not gamma:
            self.last.pos_out = pos_out
            return tok, pos_out
        mask, perm = self.select(movable, gamma)
        tok = apply_perm(tok, perm)
        if self.variant == "mjp" and (training or self.eval_unk):
            pos_out = torch.where(mask.unsqueeze(-1), model.mjp.unk, pos)
        self.last = JigsawState(pos, movable, mask, perm, pos_out)
        return tok, pos_out

    # ---- DAL / DRL (Eq. 4-5) ------------------------------------------------------------------
    def locations(self, n: int, device: torch.device) -> Tensor:
        """(n, c) normalised location of each slot: (row, col) / K on the grid, index / (rows - 1) for text."""
        key = (n, str(device))
        if key not in self._locs:
            self._locs[key] = self._locations(n, device)
        return self._locs[key]

    def _locations(self, n: int, device: torch.device) -> Tensor:
        if self.grid is not None:
            return grid_locations(self.grid, n, device)
        rows = self.model.position_table().shape[-2]
        return (torch.arange(n, device=device).float() / max(rows - 1, 1)).unsqueeze(1)

    def aux_loss(self, model: VeilModel, batch: Batch, logits: Tensor) -> Tensor | None:
        if self.aux in (None, "none") or not model.training or self.last is None or self.aux_lambda == 0:
            return None
        st = self.last
        keep = st.movable if st.mask is None else st.movable & ~st.mask
        weight = keep.sum(0, dtype=st.pos.dtype)  # how many sequences left each slot unshuffled
        table = st.pos[0]  # (N, D)
        loc = self.locations(table.shape[0], table.device).to(table.dtype)
        if self.aux == "dal":  # weights normalised outside the graph: one backward node fewer
            w = weight * (self.aux_lambda / weight.sum().clamp(min=1))
            return w @ (model.mjp.loc(table) - loc).abs().sum(-1)
        return self.aux_lambda * self.drl_loss(model, table, loc, weight)

    def drl_loss(self, model: VeilModel, table: Tensor, loc: Tensor, weight: Tensor) -> Tensor:
        """Mean L1 between predicted and true offsets loc_i - loc_j over sampled unshuffled pairs."""
        m = self.pairs_per_token * table.shape[0]
        g = self._generator(table.device)
        w = weight.float()
        w = w + (w.sum() == 0).float()  # every slot shuffled everywhere: fall back to all slots
        ij = torch.multinomial(w, 2 * m, replacement=True, generator=g).view(2, m)
        pred = model.mjp.loc(torch.cat([table[ij[0]], table[ij[1]]], dim=-1))
        return (pred - (loc[ij[0]] - loc[ij[1]])).abs().sum(-1).mean()
