"""APRIL against MJP, mechanism-aware: `april-mjp` (APRIL: Lu et al., CVPR 2022; MJP: Ren et al.,
`mjp-masked-jigsaw-puzzle.txt`, Alg. 1 and Eq. 2-5).

What the attacker knows: the update of one image (batch 1) and the weights it sent (as for
`april`), and MJP's mechanism from `Knowledge.defense["mjp"]`: the masked slots carry one shared
``E_unk`` (``model.mjp.unk``) and DAL's loss ``aux_lambda * mean_{unshuffled l} |loc_l - g(E_pos[l])|_1``
with the public regressor ``g`` (``model.mjp.loc``) and the public grid targets ``loc_l``. It
does not know which slots were masked, the permutation, or the label (read from the head's bias).

Under MJP the ViT embeds the shuffled patches X~ (X~[j] = X[perm[j]]; unmasked slots keep their
own patch, perm only permutes the masked set M) as

    Z_j = X~_j W^T + b + (E_unk if j in M else E_pos[j]),         G = dL/dZ  (N x D)

so the exported update holds (Eq. 2-3 with DAL, Eq. 4):

    dL/dE_pos[j] = G_j + a_j  (j not in M),   0  (j in M)         a = DAL's term, a_j = 0 on M
    dL/dE_unk    = sum_{j in M} G_j
    dL/dW        = G^T X~ ,   dL/db = G^T 1 ,   dL/dg = DAL's term only.

1. Masked slots: the exactly zero rows of dL/dE_pos (every unmasked row carries G_j != 0).
2. DAL's term: a and dL/dg are recomputed from the weights with the masks of step 1 (batch 1:
   weight aux_lambda / |unmasked| on each unmasked slot) and subtracted. A global rescaling of the
   update (norm clipping) shows as dL/dg = c * (DAL's dL/dg): c is fitted and divided out.
3. Structured closed form (APRIL's solve with the masked rows filled by their mean): G_M ~ 1 S/m,
   S = dL/dE_unk, then X~ = pinv(G^T) dL/dW. Exact when m <= 1; otherwise a start for 4.
   3b (`masked_span`, when m < P): with Q spanning the complement of the known rows G_U in R^D,
   Q^T dL/dW = Q^T G_M^T X~_M has rank m and the row space of X~_M, V (m x P); so
   X_U (I - V^T V) = pinv(G_U^T) dL/dW (I - V^T V) exactly, and only X_U V^T and X~_M = C V
   (u x m + m x m numbers) stay unknown.
4. Gradient matching on a float64 copy of the model with E_unk at the masked slots (the client's
   forward, less the order among the masked slots, which the output does not depend on). With
   G(X) = dL/dZ of the copy at slot patches X, the residual of the input layers
       r(X) = [ G(X)_U - G_U ,  sum_{j in M} G(X)_j - S ,  G(X)^T X - dL/dW ]   (each block / its norm)
   is driven to zero by Levenberg-Marquardt (forward-difference Jacobian, all perturbations in
   batched passes) when X has at most `lm_max` entries (vit-digits: 64), else by L-BFGS on
   ||r||^2 over the unknowns 3b leaves. Recovers the unmasked patches at their slots and the
   masked patches as a set.
5. Placement of the masked set among the masked slots by an edge-continuity jigsaw prior
   (`veil.attacks.jigsaw_solver`): the hidden order is the only thing MJP keeps.

Settings of the MJP paper: (a) no shuffle (gamma 0 or eval): steps 2-4 remove DAL's share and the
attack is exact APRIL; (b) scored against the shuffled input, (c) against the original. The
reconstruction is the same in (b) and (c): the attacker cannot know the shuffle. The harness
scores what leaks in every setting: `psnr_unshuffled` (unmasked patches), `psnr_masked_set`.

Options: iterations (LM / L-BFGS iterations, 0 = closed form only; default 200), solver ("auto",
"lm", "lbfgs"), lm_max (1024), restarts (LM only, default 6), place ("solver" or "slots": the masked patches in the order the
matching left them), rcond, clamp, seed (symmetry-breaking noise on the start).
DRL (sampled pairs) cannot be replayed: with aux=drl the position rows are left out of the match.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from veil.attacks import ATTACKS
from veil.attacks.analytic_vit import April, AprilOptions, patch_geometry, position_rows, weight_as_matrix
from veil.attacks.base import Knowledge, Observation, Reconstruction, work_bar
from veil.attacks.inverting import strong_wolfe_lbfgs
from veil.attacks.jigsaw_solver import place
from veil.attacks.labels import recover_labels
from veil.attacks.options import option
from veil.errors import VeilError
from veil.models.base import VeilModel
from veil.models.vit import unpatchify

LM_FLOOR = 1e-8  # residual cost below which the match is at the float32 update's rounding


class Twin:
    """A float64 copy of the attacked model whose forward puts E_unk at given slots."""

    def __init__(self, model: VeilModel) -> None:
        inner = model.embedding_transform
        model.set_embedding_transform(None)  # never copy the client's defense object
        try:
            self.model = copy.deepcopy(model).double().eval()
        finally:
            model.set_embedding_transform(inner)
        self.names = {id(p): n for n, p in self.model.named_parameters()}
        self.masked: Tensor | None = None
        self.tok: Tensor | None = None
        self.model.set_embedding_transform(self._transform)

    def name(self, param: torch.nn.Parameter) -> str:
        return self.names[id(param)]

    def _transform(self, tok: Tensor, pos: Tensor, movable: Tensor) -> tuple[Tensor, Tensor]:
        self.tok = tok
        unk = getattr(getattr(self.model, "mjp", None), "unk", None)
        if self.masked is None or unk is None or not bool(self.masked.any()):
            return tok, pos
        return tok, torch.where(self.masked.view(1, -1, 1), unk, pos)

    def loss(self, pixels: Tensor, label: Tensor) -> Tensor:
        batch = {"pixels": pixels, "labels": label}
        return self.model.loss(self.model(batch), batch)

    def rows(self, X: Tensor, label: Tensor, geom: tuple[int, int, int], create_graph: bool = False) -> Tensor:
        """(B, N, D) dL/dZ of each of B candidate slot-patch matrices X (B, N, P), one batched pass."""
        B = X.shape[0]
        loss = self.loss(unpatchify(X, *geom), label.expand(B)) * B  # the sum of the per-image losses
        return torch.autograd.grad(loss, self.tok, create_graph=create_graph)[0]

    def dal(self, masked: Tensor, mech: dict[str, Any]) -> dict[str, Tensor]:
        """DAL's gradient (batch 1, unmasked slots weighted aux_lambda / count) by parameter name."""
        from veil.defenses.mjp import grid_locations

        m = self.model
        if (
            mech.get("aux") != "dal"
            or not float(mech.get("aux_lambda") or 0)
            or not hasattr(getattr(m, "mjp", None), "loc")
        ):
            return {}
        table = m.position_embeddings(None)[0]  # (N, D): the patch slots' rows
        keep = (~masked).to(table.dtype)
        w = keep * float(mech["aux_lambda"]) / keep.sum().clamp(min=1)
        loc = grid_locations(tuple(m.grid_shape), table.shape[0]).to(table.dtype)
        loss = w @ (m.mjp.loc(table) - loc).abs().sum(-1)
        params = [m.position_table(), *m.mjp.loc.parameters()]
        return {self.name(p): g for p, g in zip(params, torch.autograd.grad(loss, params))}


@dataclass
class Problem:
    """What step 4 matches: the cleaned input-layer gradients and the masks found in step 1."""

    twin: Twin
    G: Tensor  # (N, D) dL/dE_pos patch rows, DAL removed (masked rows 0)
    dW: Tensor  # (D, P)
    S: Tensor  # (D,) dL/dE_unk
    masked: Tensor  # (N,) bool
    label: Tensor
    geom: tuple[int, int, int]
    use_rows: bool  # False under DRL: its sampled term stays in the rows

    def residual(self, X: Tensor, create_graph: bool = False) -> Tensor:
        """(B, R) per candidate X (B, N, P): [G_U(X) - G_U, sum_M G(X) - S, G(X)^T X - dW], each block / its norm."""
        Gx = self.twin.rows(X, self.label, self.geom, create_graph)
        keep = ~self.masked
        parts = [((torch.einsum("bnd,bnp->bdp", Gx, X) - self.dW) / self.dW.norm()).flatten(1)]
        if self.use_rows:
            parts.append(((Gx[:, keep] - self.G[keep]) / self.G[keep].norm()).flatten(1))
        if bool(self.masked.any()):
            parts.append((Gx[:, self.masked].sum(1) - self.S) / self.S.norm().clamp(min=1e-30))
        return torch.cat(parts, 1)


@dataclass(frozen=True)
class AprilMJPOptions(AprilOptions):
    iterations: int = option(200, "iterations of the residual solve per restart (0: the linear solve alone)")
    restarts: int = option(6, "restarts of the residual solve from seeded starts")
    solver: Literal["auto", "lm", "lbfgs"] = option("auto", "residual solver: Levenberg-Marquardt, L-BFGS, or by size")
    lm_max: int = option(1024, "auto: Levenberg-Marquardt up to this many unknowns, L-BFGS above")
    place: Literal["solver", "slots"] = option("solver", "where rebuilt patches go: the jigsaw solver or their slots")
    seed: int = option(0, "seed of the restarts' starts")


class AprilMJP(April):
    """APRIL with MJP's mechanism known: masked slots found, DAL removed, masked set matched, placed."""

    knows = (
        "the update of one image (batch 1), the weights and MJP's mechanism (Knowledge.defense: E_unk at the masked "
        "slots, DAL's loss and weight); not the masks, the shuffle or the label"
    )

    options_type = AprilMJPOptions
    options: AprilMJPOptions

    def _reconstruct(self, obs: Observation, know: Knowledge) -> Reconstruction:
        model = obs.model
        p, chans, size = patch_geometry(model)
        mech = dict(know.defense.get("mjp") or {})
        rows = position_rows(obs).double()  # one-line errors when the update lacks these gradients
        obs.grad(model.token_embedding())
        if rows.shape[0] != model.grid**2:
            raise VeilError(
                f"april-mjp: position gradient has {rows.shape[0]} patch rows, the model has {model.grid**2} patches"
            )
        solver, place_how = self.options.solver, self.options.place
        twin = Twin(model)
        masked = rows.abs().amax(-1) == 0  # step 1
        target, scale, dal = self._target(twin, obs, masked, mech)  # step 2
        pos = target[twin.name(twin.model.position_table())]
        G = pos.reshape(-1, pos.shape[-1])[1:]
        dW = weight_as_matrix(target[twin.name(twin.model.token_embedding().weight)])
        S = target.get("mjp.unk", torch.zeros(1, G.shape[1], dtype=G.dtype)).reshape(-1)
        X = structured_solve(G, masked, S, dW, self.options.rcond)  # step 3
        stats: dict[str, Any] = {
            "masked_found": int(masked.sum()),
            "dal_removed": bool(dal),
            "scale": scale,
            "iterations": 0,
            "evaluations": 0,
            "work": {"iterations": 0},
            "budget_stopped": False,
        }
        batch = int(know.batch_size or 1)
        if self.options.iterations > 0 and batch == 1:
            prob = Problem(twin, G, dW, S, masked, recover_labels(obs, 1), (p, chans, size), mech.get("aux") != "drl")
            twin.masked = masked
            if solver == "auto":
                solver = "lm" if X.numel() <= self.options.lm_max else "lbfgs"
            stats["solver"] = solver
            if solver == "lbfgs":
                X, stats["match_loss"], stats["iterations"], stats["evaluations"] = self._lbfgs(
                    prob, self._start(X, masked, 0)
                )
                stats["budget_stopped"] = stats["iterations"] >= self.options.iterations
            else:
                X, stats["match_loss"], stats["iterations"], stats["evaluations"], stats["restarts"], capped = self._lm(
                    prob, X
                )
                stats["budget_stopped"] = capped
            stats["work"] = {"iterations": stats["iterations"]}
        if place_how == "solver":
            X = X[place(X.view(-1, chans, p, p), masked, tuple(model.grid_shape))]
        img = unpatchify(X.unsqueeze(0), p, chans, size).float()
        if self.options.clamp:
            img = img.clamp(0.0, 1.0)
        stats["exact_possible"] = batch == 1
        return Reconstruction(images=img.detach(), stats=stats)

    def _target(
        self, twin: Twin, obs: Observation, masked: Tensor, mech: dict[str, Any]
    ) -> tuple[dict[str, Tensor], float, dict[str, Tensor]]:
        """The exported gradients in float64, rescaled, with DAL's term removed (and g's dropped)."""
        dal = twin.dal(masked, mech)
        grads = {n: g.double() for n, g in obs.grads.items() if n in set(twin.names.values())}
        loc = [n for n in dal if n.startswith("mjp.loc") and n in grads]
        scale = 1.0
        if loc:
            num = sum((grads[n] * dal[n]).sum() for n in loc)
            den = sum((dal[n] * dal[n]).sum() for n in loc)
            scale = float(num / den) if float(den) > 0 and float(num) > 0 else 1.0
        out = {n: g / scale - dal.get(n, 0.0) for n, g in grads.items() if not n.startswith("mjp.loc")}
        return out, scale, dal

    def _start(self, X: Tensor, masked: Tensor, restart: int) -> Tensor:
        """The closed form with seeded noise on the masked rows: they come out equal, a saddle of the match."""
        gen = torch.Generator().manual_seed(self.options.seed + restart)
        x = X.clone()
        x[masked] += 0.05 * torch.randn(int(masked.sum()), x.shape[1], generator=gen, dtype=x.dtype)
        return x

    def budget(self) -> dict[str, int]:
        """Residual-solve iterations: Levenberg-Marquardt iterations over the restarts (L-BFGS, one
        start, stays within them); 0 iterations leaves the closed form, whose work the input fixes."""
        return {"iterations": self.options.iterations * max(1, self.options.restarts)}

    def _lm(self, prob: Problem, X: Tensor) -> tuple[Tensor, float, int, int, int, bool]:
        """Step 4 for small inputs: Levenberg-Marquardt on every slot patch; restarts (new start
        noise) while the cost stays above the rounding floor: a trained model has local minima.
        Returns (X, cost, LM iterations, residual evaluations, restarts run, whether the budget
        stopped it: a restart ran its iterations out, or every restart ran without reaching the floor)."""
        best: tuple[Tensor, float] | None = None
        evals, iters, capped = 0, 0, False
        bar = work_bar(self.budget()["iterations"], self.name)  # a restart that stops early leaves its share
        for r in range(max(1, self.options.restarts)):
            x0 = self._start(X, prob.masked, r)
            x, cost, n, k = levenberg_marquardt(
                lambda flat: prob.residual(flat.view(-1, *X.shape)),
                x0.flatten(),
                self.options.iterations,
                tick=bar.update,
            )
            evals, iters, capped = evals + n, iters + k, capped or k >= self.options.iterations
            if best is None or cost < best[1]:
                best = (x.view_as(X), cost)
            if cost < LM_FLOOR:
                break
        else:
            capped = True  # the restarts ran out above the floor
        bar.close()
        return best[0], best[1], iters, evals, r + 1, capped

    def _lbfgs(self, prob: Problem, X0: Tensor) -> tuple[Tensor, float, int, int]:
        """Step 4 for large inputs: L-BFGS on ||r||^2 over the unknowns step 3b leaves (all of X when P <= m)."""
        keep, masked = ~prob.masked, prob.masked
        V = masked_span(prob.G[keep], prob.dW, int(masked.sum()))
        if V is None:
            fixed, a, C = None, X0[keep].clone(), X0[masked].clone()
        else:  # X_U = fixed + a V (fixed exact), X_M = C V
            fixed = (torch.linalg.pinv(prob.G[keep].t()) @ prob.dW) @ (torch.eye(V.shape[1], dtype=V.dtype) - V.t() @ V)
            a, C = X0[keep] @ V.t(), X0[masked] @ V.t()
        a.requires_grad_(True)
        C.requires_grad_(True)

        def build() -> Tensor:
            XU, XM = (a, C) if V is None else (fixed + a @ V, C @ V)
            return (
                torch.zeros_like(X0)
                .index_put((keep.nonzero().flatten(),), XU)
                .index_put((masked.nonzero().flatten(),), XM)
            )

        its = self.options.iterations
        lbfgs = strong_wolfe_lbfgs([a, C], its, lr=1.0, history=50, tolerances=(1e-16, 1e-20))
        evals = 0
        bar = work_bar(its, self.name)  # L-BFGS iterations, read off the optimiser at each evaluation

        def closure() -> Tensor:
            nonlocal evals
            lbfgs.zero_grad()
            loss = prob.residual(build()[None], create_graph=True).pow(2).sum()
            loss.backward()
            evals += 1
            bar.update(int(lbfgs.state[a].get("n_iter", 0)) - bar.n)
            return loss

        lbfgs.step(closure)
        bar.close()
        X = build().detach()
        its_done = int(lbfgs.state[a].get("n_iter", 0))
        return X, float(prob.residual(X[None]).pow(2).sum()), its_done, evals


def masked_span(G_U: Tensor, dW: Tensor, m: int) -> Tensor | None:
    """Step 3b: (m, P) orthonormal basis of the masked patches' span, or None when it is all of R^P.

    With Q an orthonormal basis of the complement of the known rows G_U (in R^D), Q^T G_U^T = 0, so
    Q^T dL/dW = Q^T G_M^T X~_M has rank m, and its row space is the row space of X~_M. The
    unmasked patches' part orthogonal to it then follows exactly: X_U (I - V^T V) =
    pinv(G_U^T) dL/dW (I - V^T V); only X_U V^T (u x m) and X~_M = C V (C: m x m) stay unknown.
    """
    u, D = G_U.shape
    P = dW.shape[1]
    if m == 0 or m >= P or u + m > D:
        return None
    Q = torch.linalg.qr(G_U.t(), mode="complete")[0][:, u:]
    return torch.linalg.svd(Q.t() @ dW, full_matrices=False)[2][:m]


def levenberg_marquardt(
    residual: Callable[[Tensor], Tensor],
    x0: Tensor,
    iterations: int,
    chunk: int = 128,
    h: float = 1e-7,
    floor: float = LM_FLOOR,
    tick: Callable[[int], Any] | None = None,
) -> tuple[Tensor, float, int, int]:
    """min ||r(x)||^2 by Levenberg-Marquardt (Marquardt's diagonal scaling); the Jacobian by forward
    differences, all n perturbed points in batched calls of `residual` ((B, n) -> (B, R)). Stops
    when no step lowers the cost, or when an iteration gains < 1% with the cost under `floor`.
    Returns x, the final cost, the number of points evaluated and of iterations run; `tick(1)` is
    called after each iteration (a progress bar's update)."""
    x = x0.clone()
    n = x.numel()
    r = residual(x[None])[0]
    cost, lam, evals = float(r @ r), 1e-3, 1
    eye = torch.eye(n, dtype=x.dtype)
    done = 0
    for _ in range(iterations):
        done += 1
        J = torch.cat([(residual(x + h * eye[i : i + chunk]) - r) / h for i in range(0, n, chunk)]).t()  # (R, n)
        evals += n
        A, g = J.t() @ J, J.t() @ r
        scale = torch.diag(A.diagonal().clamp(min=1e-30))
        before = cost
        for _ in range(12):
            step = torch.linalg.solve(A + lam * scale, -g)
            r_new = residual((x + step)[None])[0]
            evals += 1
            if float(r_new @ r_new) < cost:
                x, r, cost, lam = x + step, r_new, float(r_new @ r_new), max(lam / 3, 1e-12)
                break
            lam *= 4
        else:
            break  # no step lowers the cost: converged to rounding
        if tick is not None:
            tick(1)
        if cost < 1e-30 or (before - cost < 1e-2 * before and cost < floor):
            break  # at the rounding floor of the float32 update
    return x, cost, evals, done


def structured_solve(G: Tensor, masked: Tensor, S: Tensor, dW: Tensor, rcond: float = 1e-7) -> Tensor:
    """Step 3: X~ (N, P) = pinv(G^T) dW with the masked rows of G replaced by S / m (float64)."""
    G = G.double().clone()
    m = int(masked.sum())
    if m:
        G[masked] = S.double() / m
    return torch.linalg.pinv(G.t(), rtol=rcond) @ dW.double()


ATTACKS.register(
    "april-mjp",
    "APRIL knowing MJP: masked slots from zero rows, DAL removed, masked set by gradient matching, "
    "jigsaw-placed (ViT, batch 1)",
)(AprilMJP)
