"""Parameter gradients of veil's `ViT` and their adjoint, written out by hand (Inverting Gradients' step).

A gradient-matching attack needs, at a dummy image x, every parameter's gradient g(x) = dL/dθ
(the "first backward") and then the image's gradient of a function F of g: (dg/dx)^T dF/dg.
Autograd does the second part by recording its own backward formulas with ``create_graph=True``
and walking them back: on `vit-tiny` some 2,500 small operators a step (a view, a transpose and
a sum per linear layer, LayerNorm's, GELU's and softmax's double-backward formulas) around the
~190 matrix products that are the real work. `ViTGrads` computes the same two things without a
graph: `grads` runs the forward and the first backward of `ViT.forward` (eval mode, dropout off;
the loss of `VeilModel.loss`: cross-entropy, mean over the batch, the model's label smoothing)
under ``no_grad`` and keeps what the adjoint reads; `image_grad` takes dF/dg (one tensor per
part) and returns dF/dx, the reverse of the first backward (input to output), then the reverse
of the forward (output to input). The same function up to float rounding, tested against
autograd in tests/test_ig_speed.py. On top of that:

* only the [CLS] row of the last block's output reaches the loss (the final norm and the head
  read it alone), so that block runs its query, attention output and MLP on that row (autograd
  multiplies the other rows' exact-zero gradients);
* a block's Q, K and V projections are one product with the stacked weight, and their weight
  gradient one part (`Part`: a tensor covering the named parameters in order, flattened and
  concatenated), and the LayerNorm, GELU and softmax backward steps are aten's fused kernels.

Only the exact `ViT` class with pre-LN `Block`s, exact GELU, no embedding transform and no hooks
is handled (`ViTGrads.supports`); anything else goes through autograd (`veil.attacks.inverting`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from veil.models.blocks import Block
from veil.models.embedding import patchify, unpatchify
from veil.models.vit import ViT

__all__ = ["Part", "ViTGrads"]

#: a gradient tensor and the parameters it covers (flattened, concatenated in this order)
Part = tuple[Tensor, tuple[str, ...]]

_aten = torch.ops.aten
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _ln_grad(dy: Tensor, h: Tensor, mu: Tensor, r: Tensor, w: Tensor | None = None, b: Tensor | None = None) -> tuple:
    """aten's LayerNorm backward at input h (mean mu, 1/std r) from the output's dy: (dx, dweight, dbias)
    with the affine weight w and bias b, dx alone without them."""
    mask = [True, w is not None, b is not None]
    return _aten.native_layer_norm_backward(dy, h, [h.shape[-1]], mu, r, w, b, mask)


def _norm_adjoint(nb: Tensor, rb: Tensor | None, h: Tensor, mu: Tensor, r: Tensor, n: Tensor) -> Tensor:
    """dL/dh for n = (h - mean) r and r = 1 / sqrt(var + eps), given dL/dn and dL/dr."""
    hb = _ln_grad(nb, h, mu, r)[0]
    return hb if rb is None else torch.addcmul(hb, n, rb * r * r, value=-1.0 / h.shape[-1])


def _ln_back_adjoint(w: Tensor, dn: Tensor, n: Tensor, r: Tensor, dx: Tensor, h: Tensor, mu: Tensor) -> tuple:
    """The adjoint of dx = r (dn - mean(dn) - n mean(dn n)) (LayerNorm's backward) given w = dL/d(dx):
    (dL/d(dn), dL/dn, dL/dr)."""
    d_dn = _ln_grad(w, h, mu, r)[0]
    wr = w * r
    c = (dn * n).mean(-1, keepdim=True)
    d_n = -(wr * c + dn * (wr * n).mean(-1, keepdim=True))
    d_r = (w * dx).sum(-1, keepdim=True) / r
    return d_dn, d_n, d_r


def _affine_ln_adjoint(
    w: Tensor, d: Tensor, g: Tensor, n: Tensor, r: Tensor, dx: Tensor, h: Tensor, mu: Tensor, gb, bb
) -> tuple:
    """The adjoint of an affine LayerNorm's backward (dx = LN-backward(d * g), dg = sum d n, db = sum d)
    given w = dL/d(dx) and the bars of dg / db (None where not wanted): (dL/d(d), dL/dn, dL/dr)."""
    d_dn, n_bar, r_bar = _ln_back_adjoint(w, d * g, n, r, dx, h, mu)
    d_bar = d_dn * g
    if gb is not None:
        d_bar, n_bar = torch.addcmul(d_bar, n, gb), torch.addcmul(n_bar, d, gb)
    if bb is not None:
        d_bar = d_bar + bb
    return d_bar, n_bar, r_bar


def _acc(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    return b if a is None else a if b is None else a + b


class _Tape:
    """The parts of the gradient being computed, which parameters are wanted, and each part's index."""

    def __init__(self, need: set[str]) -> None:
        self.need, self.parts = need, []

    def linear(self, dy: Tensor, x: Tensor, w: tuple[str, ...], b: tuple[str, ...]) -> tuple:
        """y = x W^T + b: dW = dy^T x and db = the sum of dy's rows, where wanted."""
        return self.add(w, lambda: torch.mm(dy.t(), x)), self.add(b, lambda: dy.sum(0))

    def add(self, names: tuple[str, ...], make) -> int | list[int | None] | None:  # noqa: ANN001 - a thunk
        """A part for `names` (a stack along dim 0 of equal tensors, one per name); when only some of
        them are wanted, one part per wanted name (a view) and the layout to rebuild the stack's adjoint."""
        wanted = [n in self.need for n in names]
        if not any(wanted):
            return None
        t = make()
        if all(wanted):
            self.parts.append((t, names))
            return len(self.parts) - 1
        layout = []
        for name, piece, w in zip(names, t.chunk(len(names)), wanted):
            if w:
                self.parts.append((piece, (name,)))
            layout.append(len(self.parts) - 1 if w else None)
        return layout


def _bar(bars: list[Tensor], i: int | list[int | None] | None) -> Tensor | None:
    """The adjoint of one `_Tape.add` entry (zeros for the names not wanted)."""
    if i is None or isinstance(i, int):
        return None if i is None else bars[i]
    like = bars[next(k for k in i if k is not None)]
    return torch.cat([torch.zeros_like(like) if k is None else bars[k] for k in i])


def _lin_adjoint(a: Tensor | None, w: Tensor | None, x: Tensor, wb: Tensor | None, bb: Tensor | None) -> Tensor | None:
    """a w (the chain's own term, when given) plus the adjoint of dW = dy^T x, db = sum(dy) toward dy,
    x Wbar^T + bbar, accumulated in one output (addmm's beta)."""
    if a is not None:
        out = torch.mm(a, w) if bb is None else torch.addmm(bb, a, w)
        return out if wb is None else out.addmm_(x, wb.t())
    if wb is None:
        return None if bb is None else bb.expand(x.shape[0], -1)
    return torch.mm(x, wb.t()) if bb is None else torch.addmm(bb, x, wb.t())


class _Block:
    """One pre-LN block's weights (detached: only the image is differentiated) and its four passes."""

    def __init__(self, blk: Block, prefix: str) -> None:
        at, mlp, d = blk.attn, blk.mlp, (lambda t: t.detach())
        self.heads, self.eps1, self.eps2 = at.heads, blk.ln1.eps, blk.ln2.eps
        self.g1, self.b1, self.g2, self.b2 = d(blk.ln1.weight), d(blk.ln1.bias), d(blk.ln2.weight), d(blk.ln2.bias)
        self.wqkv = torch.cat([d(at.q.weight), d(at.k.weight), d(at.v.weight)])
        self.bqkv = torch.cat([d(at.q.bias), d(at.k.bias), d(at.v.bias)])
        self.wo, self.bo = d(at.o.weight), d(at.o.bias)
        self.w1, self.c1, self.w2, self.c2 = d(mlp.fc1.weight), d(mlp.fc1.bias), d(mlp.fc2.weight), d(mlp.fc2.bias)
        self.nm = lambda *ks: tuple(f"{prefix}.{k}" for k in ks)

    def forward(self, h: Tensor, last: bool) -> tuple[Tensor, dict]:
        """h (B, T, D) -> the block's output: all rows, or only the [CLS] row (B, 1, D) when `last`."""
        B, T, D = h.shape
        H, Tq = self.heads, 1 if last else T
        dh = D // H
        n1, mu1, r1 = torch.native_layer_norm(h, [D], None, None, self.eps1)
        a = torch.addcmul(self.b1, n1, self.g1).view(B * T, D)
        heads = lambda t, rows: t.reshape(B, rows, H, dh).transpose(1, 2)  # noqa: E731
        a0 = a.view(B, T, D)[:, 0] if last else None
        if last:  # keys and values of every row, the query of the [CLS] row
            kv = torch.addmm(self.bqkv[D:], a, self.wqkv[D:].t())
            q = heads(torch.addmm(self.bqkv[:D], a0, self.wqkv[:D].t()), 1)
            k, v = (heads(t, T) for t in kv.split(D, dim=1))
        else:
            q, k, v = (heads(t, T) for t in torch.addmm(self.bqkv, a, self.wqkv.t()).split(D, dim=1))
        scale = 1.0 / math.sqrt(dh)
        p = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * scale, dim=-1)  # (B, H, Tq, T)
        ctx = torch.matmul(p, v).transpose(1, 2).reshape(B * Tq, D)
        hm = h[:, :Tq] + torch.addmm(self.bo, ctx, self.wo.t()).view(B, Tq, D)
        n2, mu2, r2 = torch.native_layer_norm(hm, [D], None, None, self.eps2)
        m = torch.addcmul(self.b2, n2, self.g2).view(B * Tq, D)
        u = torch.addmm(self.c1, m, self.w1.t())
        g = nn.functional.gelu(u)
        out = hm + torch.addmm(self.c2, g, self.w2.t()).view(B, Tq, D)
        s = dict(h=h, n1=n1, mu1=mu1, r1=r1, a=a, a0=a0, q=q, k=k, v=v, p=p, ctx=ctx, hm=hm, n2=n2, mu2=mu2, r2=r2)
        s.update(m=m, u=u, g=g, dims=(B, T, D, H, dh, Tq), scale=scale, last=last)
        return out, s

    def backward(self, dout: Tensor, s: dict, tape: _Tape) -> Tensor:
        """dL/d(output rows) -> dL/d(input) (B, T, D); the wanted parameter gradients go on the tape."""
        B, T, D, H, dh, Tq = s["dims"]
        nm, R, idx = self.nm, B * Tq, {}
        dy = dout.reshape(R, D)
        idx["w2"], idx["c2"] = tape.linear(dy, s["g"], nm("mlp.fc2.weight"), nm("mlp.fc2.bias"))
        dgact = torch.mm(dy, self.w2)
        d1 = _aten.gelu_backward(torch.ones_like(s["u"]), s["u"])  # gelu'(u), read again by both adjoints
        du = dgact * d1
        idx["w1"], idx["c1"] = tape.linear(du, s["m"], nm("mlp.fc1.weight"), nm("mlp.fc1.bias"))
        dm = torch.mm(du, self.w1).view(B, Tq, D)
        dx2, dg2, db2 = _ln_grad(dm, s["hm"], s["mu2"], s["r2"], self.g2, self.b2)
        idx["g2"], idx["b2"] = tape.add(nm("ln2.weight"), lambda: dg2), tape.add(nm("ln2.bias"), lambda: db2)
        dhm = dout + dx2
        do = dhm.reshape(R, D)
        idx["wo"], idx["bo"] = tape.linear(do, s["ctx"], nm("attn.o.weight"), nm("attn.o.bias"))
        dctx = torch.mm(do, self.wo).view(B, Tq, H, dh).transpose(1, 2)
        p, q, k, v = s["p"], s["q"], s["k"], s["v"]
        dp = torch.matmul(dctx, v.transpose(-2, -1))
        dpc = dp - (dp * p).sum(-1, keepdim=True)
        ds = p * dpc * s["scale"]
        dq, dk, dv = torch.matmul(ds, k), torch.matmul(ds.transpose(-2, -1), q), torch.matmul(p.transpose(-2, -1), dctx)
        merge = lambda t: t.transpose(1, 2).reshape(-1, D)  # noqa: E731
        a, W, Bn = (
            s["a"],
            nm("attn.q.weight", "attn.k.weight", "attn.v.weight"),
            nm("attn.q.bias", "attn.k.bias", "attn.v.bias"),
        )
        if s["last"]:
            dq2, dkv = merge(dq), torch.cat([merge(dk), merge(dv)], dim=1)
            idx["wq"], idx["bq"] = tape.linear(dq2, s["a0"], W[:1], Bn[:1])
            idx["wkv"], idx["bkv"] = tape.linear(dkv, a, W[1:], Bn[1:])
            da = torch.mm(dkv, self.wqkv[D:]).view(B, T, D)
            da[:, 0] += torch.mm(dq2, self.wqkv[:D])
            s.update(dq2=dq2, dkv=dkv)
        else:
            dqkv = torch.cat([merge(dq), merge(dk), merge(dv)], dim=1)
            idx["wqkv"], idx["bqkv"] = tape.linear(dqkv, a, W, Bn)
            da = torch.mm(dqkv, self.wqkv).view(B, T, D)
            s.update(dqkv=dqkv)
        dx1, dg1, db1 = _ln_grad(da, s["h"], s["mu1"], s["r1"], self.g1, self.b1)
        idx["g1"], idx["b1"] = tape.add(nm("ln1.weight"), lambda: dg1), tape.add(nm("ln1.bias"), lambda: db1)
        s.update(
            dy=dy, dgact=dgact, d1=d1, du=du, dm=dm, dx2=dx2, do=do, dctx=dctx, dp=dp, dpc=dpc, ds=ds, da=da, dx1=dx1
        )
        s["idx"] = idx
        return torch.cat([dx1[:, :1] + dhm, dx1[:, 1:]], dim=1) if s["last"] else dx1 + dhm

    def adjoint(self, wbar: Tensor, s: dict, bars: list[Tensor]) -> Tensor:
        """The reverse of `backward`: dF/d(its output) (B, T, D) -> dF/d(its input dout); the forward
        activations' adjoints are kept in `s` for `forward_adjoint`."""
        B, T, D, H, dh, Tq = s["dims"]
        R, ix = B * Tq, s["idx"]
        pb = lambda k: _bar(bars, ix.get(k))  # noqa: E731
        # dh = LN1-backward(da) + dhm (rows Tq)
        dhm_bar = wbar[:, :Tq]
        da_bar, nb1, rb1 = _affine_ln_adjoint(
            wbar, s["da"], self.g1, s["n1"], s["r1"], s["dx1"], s["h"], s["mu1"], pb("g1"), pb("b1")
        )
        da_bar = da_bar.reshape(B * T, D)
        a = s["a"]
        if s["last"]:
            wb, bb = pb("wkv"), pb("bkv")
            dkv_bar = _lin_adjoint(da_bar, self.wqkv[D:].t(), a, wb, bb)
            a_bar = None if wb is None else torch.mm(s["dkv"], wb)
            wq, bq = pb("wq"), pb("bq")
            dq_bar = _lin_adjoint(da_bar.view(B, T, D)[:, 0], self.wqkv[:D].t(), s["a0"], wq, bq)
            if wq is not None:
                a_bar = torch.zeros_like(a) if a_bar is None else a_bar
                a_bar.view(B, T, D)[:, 0] += torch.mm(s["dq2"], wq)
            dk_bar, dv_bar = dkv_bar.split(D, dim=1)
        else:
            wb, bb = pb("wqkv"), pb("bqkv")
            dqkv_bar = _lin_adjoint(da_bar, self.wqkv.t(), a, wb, bb)
            a_bar = None if wb is None else torch.mm(s["dqkv"], wb)
            dq_bar, dk_bar, dv_bar = dqkv_bar.split(D, dim=1)
        heads = lambda t, rows: t.reshape(B, rows, H, dh).transpose(1, 2)  # noqa: E731
        dq_bar, dk_bar, dv_bar = heads(dq_bar, Tq), heads(dk_bar, T), heads(dv_bar, T)
        p, q, k, v, dctx, scale = s["p"], s["q"], s["k"], s["v"], s["dctx"], s["scale"]
        ds_bar = torch.matmul(dq_bar, k.transpose(-2, -1)) + torch.matmul(q, dk_bar.transpose(-2, -1))
        k_bar = torch.matmul(s["ds"].transpose(-2, -1), dq_bar)
        q_bar = torch.matmul(s["ds"], dk_bar)
        dctx_bar = torch.matmul(p, dv_bar)
        z = ds_bar * scale
        zp = z * p
        tau = zp.sum(-1, keepdim=True)
        dp_bar = zp - p * tau
        p_bar = torch.matmul(dctx, dv_bar.transpose(-2, -1)) + z * s["dpc"] - tau * s["dp"]
        dctx_bar = dctx_bar + torch.matmul(dp_bar, v)
        v_bar = torch.matmul(dp_bar.transpose(-2, -1), dctx)
        dctx_bar = dctx_bar.transpose(1, 2).reshape(R, D)
        wo = pb("wo")
        dhm_bar = dhm_bar + _lin_adjoint(dctx_bar, self.wo.t(), s["ctx"], wo, pb("bo")).view(B, Tq, D)
        ctx_bar = None if wo is None else torch.mm(s["do"], wo)
        # dhm = dout + LN2-backward(dm)
        dm_bar, nb2, rb2 = _affine_ln_adjoint(
            dhm_bar, s["dm"], self.g2, s["n2"], s["r2"], s["dx2"], s["hm"], s["mu2"], pb("g2"), pb("b2")
        )
        w1 = pb("w1")
        du_bar = _lin_adjoint(dm_bar.reshape(R, D), self.w1.t(), s["m"], w1, pb("c1"))
        m_bar = None if w1 is None else torch.mm(s["du"], w1)
        u = s["u"]
        dgact_bar = du_bar * s["d1"]
        uu = u * u
        u_bar = (
            torch.exp(uu * -0.5).mul_(uu.neg_().add_(2.0)).mul_(du_bar).mul_(s["dgact"]).mul_(_INV_SQRT_2PI)
        )  # gelu''
        w2 = pb("w2")
        dout_bar = _lin_adjoint(dgact_bar, self.w2.t(), s["g"], w2, pb("c2")).view(B, Tq, D).add_(dhm_bar)
        g_bar = None if w2 is None else torch.mm(s["dy"], w2)
        s["bar"] = dict(n1=nb1, r1=rb1, a=a_bar, q=q_bar, k=k_bar, v=v_bar, p=p_bar, ctx=ctx_bar)
        s["bar"].update(n2=nb2, r2=rb2, m=m_bar, u=u_bar, g=g_bar)
        return dout_bar

    def forward_adjoint(self, hb: Tensor, s: dict) -> Tensor:
        """The reverse of `forward`: dF/d(output rows) plus what `adjoint` kept -> dF/d(input) (B, T, D)."""
        B, T, D, H, dh, Tq = s["dims"]
        R, bar, scale = B * Tq, s["bar"], s["scale"]
        g_bar = _acc(bar["g"], torch.mm(hb.reshape(R, D), self.w2))
        u_bar = torch.addcmul(bar["u"], g_bar, s["d1"])
        m_bar = _acc(bar["m"], torch.mm(u_bar, self.w1))
        n2_bar = _acc(bar["n2"], m_bar.view(B, Tq, D) * self.g2)
        hm_bar = hb + _norm_adjoint(n2_bar, bar["r2"], s["hm"], s["mu2"], s["r2"], s["n2"])
        ctx_bar = _acc(bar["ctx"], torch.mm(hm_bar.reshape(R, D), self.wo))
        ch = ctx_bar.view(B, Tq, H, dh).transpose(1, 2)
        p, q, k, v = s["p"], s["q"], s["k"], s["v"]
        p_bar = bar["p"] + torch.matmul(ch, v.transpose(-2, -1))
        v_bar = bar["v"] + torch.matmul(p.transpose(-2, -1), ch)
        S_bar = torch._softmax_backward_data(p_bar, p, -1, p.dtype) * scale
        q_bar = bar["q"] + torch.matmul(S_bar, k)
        k_bar = bar["k"] + torch.matmul(S_bar.transpose(-2, -1), q)
        merge = lambda t: t.transpose(1, 2).reshape(-1, D)  # noqa: E731
        if s["last"]:
            a_bar = _acc(bar["a"], torch.mm(torch.cat([merge(k_bar), merge(v_bar)], dim=1), self.wqkv[D:]))
            a_bar.view(B, T, D)[:, 0] += torch.mm(merge(q_bar), self.wqkv[:D])
        else:
            a_bar = _acc(bar["a"], torch.mm(torch.cat([merge(q_bar), merge(k_bar), merge(v_bar)], dim=1), self.wqkv))
        n1_bar = _acc(bar["n1"], a_bar.view(B, T, D) * self.g1)
        h_bar = _norm_adjoint(n1_bar, bar["r1"], s["h"], s["mu1"], s["r1"], s["n1"])
        h_bar[:, :Tq] += hm_bar
        return h_bar


class ViTGrads:
    """`grads(x, labels)`: the parts of dL/dθ at image x for the parameters named in `need`;
    then `image_grad(bars)`: dF/dx for the adjoints dF/d(part) of that last call's parts."""

    def __init__(self, model: ViT, need: set[str]) -> None:
        if not self.supports(model):
            raise TypeError(f"ViTGrads handles veil's ViT only, not {type(model).__name__}")
        d = lambda t: t.detach()  # noqa: E731
        self.need = set(need)
        self.p, self.chans, self.size = model.cfg.patch_size, model.cfg.in_chans, model.cfg.image_size
        self.wpe, self.bpe, self.cls, self.pos = (
            d(model.patch_embed.weight),
            d(model.patch_embed.bias),
            d(model.cls.weight),
            d(model.pos.weight),
        )
        self.blocks = [_Block(b, f"blocks.{i}") for i, b in enumerate(model.blocks)]
        self.gf, self.bf, self.epsf = d(model.norm.weight), d(model.norm.bias), model.norm.eps
        self.wh, self.bh = d(model.head.weight), d(model.head.bias)
        self.smoothing = float(model.label_smoothing)
        self._s: dict | None = None

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """The exact ViT (not a subclass), pre-LN blocks, exact GELU, classification, nothing hooked in."""
        if type(model) is not ViT or model.task == "lm" or model._embedding_transform is not None or not model.blocks:
            return False
        if any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules()):
            return False
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return False
        return all(
            type(b) is Block and b.prenorm and type(b.mlp.act) is nn.GELU and b.mlp.act.approximate == "none"
            for b in model.blocks
        )

    @torch.no_grad()
    def grads(self, x: Tensor, labels: Tensor) -> list[Part]:
        B, tape = x.shape[0], _Tape(self.need)
        P2 = patchify(x, self.p)
        N = P2.shape[1]
        P2 = P2.reshape(B * N, -1)
        tok = torch.addmm(self.bpe, P2, self.wpe.t()).view(B, N, -1)
        h = torch.cat([(self.cls + self.pos[:1]).expand(B, 1, -1), tok + self.pos[1:]], dim=1)
        saved = []
        for i, blk in enumerate(self.blocks):
            h, s = blk.forward(h, last=i == len(self.blocks) - 1)
            saved.append(s)
        hf = h.view(B, -1)
        nf, muf, rf = torch.native_layer_norm(hf, [hf.shape[-1]], None, None, self.epsf)
        z = torch.addcmul(self.bf, nf, self.gf)
        logits = torch.addmm(self.bh, z, self.wh.t())
        C = logits.shape[-1]
        pi = torch.softmax(logits, -1)
        q = nn.functional.one_hot(labels.long(), C).to(logits.dtype)
        if self.smoothing:
            q = q * (1.0 - self.smoothing) + self.smoothing / C
        dlog = (pi - q) / B
        head = tape.linear(dlog, z, ("head.weight",), ("head.bias",))
        dz = torch.mm(dlog, self.wh)
        dxf, dgf, dbf = _ln_grad(dz, hf, muf, rf, self.gf, self.bf)
        fin = (tape.add(("norm.weight",), lambda: dgf), tape.add(("norm.bias",), lambda: dbf))
        dh = dxf.unsqueeze(1)
        for blk, s in zip(reversed(self.blocks), reversed(saved)):
            dh = blk.backward(dh, s, tape)
        dcls = dh[:, 0].sum(0, keepdim=True)
        emb = (
            tape.add(("cls.weight",), lambda: dcls),
            tape.add(("pos.weight",), lambda: torch.cat([dcls, dh[:, 1:].sum(0)])),
        )
        dtok = dh[:, 1:].reshape(B * N, -1)
        emb += tape.linear(dtok, P2, ("patch_embed.weight",), ("patch_embed.bias",))
        self._s = dict(saved=saved, P2=P2, hf=hf, nf=nf, muf=muf, rf=rf, z=z, pi=pi, dlog=dlog, dz=dz, dxf=dxf)
        self._s.update(idx=(head, fin, emb), dims=(B, N), dtok=dtok)
        return tape.parts

    @torch.no_grad()
    def image_grad(self, bars: list[Tensor]) -> Tensor:
        """dF/dx given dF/d(part) for each part of the last `grads` call (same order and shapes)."""
        if self._s is None:
            raise RuntimeError("image_grad needs a grads call first")
        S, (B, N) = self._s, self._s["dims"]
        (wh, bh), (gf, bf), (cls, pos, wpe, bpe) = ([_bar(bars, i) for i in g] for g in S["idx"])
        D = self.pos.shape[-1]
        # the reverse of the first backward, input side first: the embedding's gradients
        wbar = torch.zeros(B, N + 1, D, dtype=self.pos.dtype, device=self.pos.device)
        for t in (cls, None if pos is None else pos[:1]):
            if t is not None:
                wbar[:, :1] += t
        if pos is not None:
            wbar[:, 1:] += pos[1:]
        tok = _lin_adjoint(None, None, S["P2"], wpe, bpe)
        if tok is not None:
            wbar[:, 1:] += tok.view(B, N, D)
        P2_bar = None if wpe is None else torch.mm(S["dtok"], wpe)
        for blk, s in zip(self.blocks, S["saved"]):
            wbar = blk.adjoint(wbar, s, bars)
        # the head: dh = LN-backward(dz), dWh = dlog^T z, dz = dlog Wh, dlog = (softmax - q) / B
        w = wbar.view(B, D)
        dz_bar, nfb, rfb = _affine_ln_adjoint(
            w, S["dz"], self.gf, S["nf"], S["rf"], S["dxf"], S["hf"], S["muf"], gf, bf
        )
        dlog_bar = _lin_adjoint(dz_bar, self.wh.t(), S["z"], wh, bh)
        z_bar = None if wh is None else torch.mm(S["dlog"], wh)
        logit_bar = torch._softmax_backward_data(dlog_bar / B, S["pi"], -1, dlog_bar.dtype)
        # the reverse of the forward, output side first
        z_bar = _acc(z_bar, torch.mm(logit_bar, self.wh))
        hb = _norm_adjoint(_acc(nfb, z_bar * self.gf), rfb, S["hf"], S["muf"], S["rf"], S["nf"]).view(B, 1, D)
        for blk, s in zip(reversed(self.blocks), reversed(S["saved"])):
            hb = blk.forward_adjoint(hb, s)
        P2_bar = _acc(P2_bar, torch.mm(hb[:, 1:].reshape(B * N, D), self.wpe))
        return unpatchify(P2_bar.view(B, N, -1), self.p, self.chans, self.size)
