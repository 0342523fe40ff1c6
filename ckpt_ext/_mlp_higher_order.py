"""The create_graph backward of the mlp op (every activation but relu, and tanh in plain autograd,
which builds it from the layers' kept outputs, ``_autograd``): nodes per layer that keep their
inputs only and recompute one layer at every later order, with formulas for the first three
orders and autograd through the third above that.
Design: docs/design.md, "Other activations".
"""
from __future__ import annotations

import functools
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _C
from ._activations import activate, derivative, second_derivative, third_derivative
from ._autograd import _needed, _note_tensor_inputs
from ._derivatives import _flat

_NATIVE_DTYPES = frozenset(getattr(torch, name) for name in _C.SUPPORTED_DTYPES)
_ATEN_ORDERS = (activate, derivative, second_derivative, third_derivative)


def _native(p: Tensor) -> bool:
    """Whether f and its derivatives at p come from the activation's own kernel
    (_C._activation_derivative: one pass, f as the forward computes it): where no graph is recorded
    (a formula's derivative is the next formula, or autograd through the ATen spelling past the
    last) and p is a plain CPU or CUDA tensor of a dtype the ops take."""
    return (not torch.is_grad_enabled() and type(p) is Tensor and p.dtype in _NATIVE_DTYPES
            and (p.device.type == "cpu" or (p.device.type == "cuda" and _C.WITH_CUDA)))


def _like(t: Tensor, p: Tensor) -> bool:
    """Whether the terms kernel can read t beside p: a plain tensor of p's shape, dtype and
    device (anything else takes ATen's products, which broadcast and promote)."""
    return type(t) is Tensor and t.shape == p.shape and t.dtype == p.dtype and t.device == p.device


# ---- one layer, written on its pre-activation input --------------------------------------------
# Layer i reads p = z_{i−1} (x for the first layer) and makes a = f(p) itself (a = p for the
# first layer: act None), so its nodes keep pre-activations and gradients, never f(z):
#   forward:  z = a·Wᵀ + b
#   backward: gp = (gz·W)·f'(p),  gW = gzᵀ·a,  gb = Σ gz     (gz: the gradient w.r.t. z)
# The activation on top of the run (last_activation) is that backward without W: gp = gz·f'(p).

class _Input:
    """f and its derivatives at a layer's input p, in the products the formulas take; the
    identity where act is None."""

    def __init__(self, act: Optional[str], p: Tensor) -> None:
        self.act, self.p, self._f = act, p, None
        self._native = act is not None and _native(p)

    def _order(self, k: int) -> Tensor:
        """f^(k)(p), a new tensor."""
        if self._native:
            return _C._activation_derivative(self.p, self.act, k)
        return _ATEN_ORDERS[k](self.act, self.p)

    def f(self) -> Tensor:
        if self.act is None:
            return self.p
        if self._f is None:
            self._f = self._order(0)
        return self._f

    def d1(self, v: Tensor) -> Tensor:
        """v·f'(p); v itself for the identity."""
        return v if self.act is None else self.terms((1, v))

    def terms(self, *terms, add: Optional[Tensor] = None) -> Optional[Tensor]:
        """add + Σ f^(k)(p)·Π factors over the terms (k, factor, ...), each with a factor, add
        None or a temporary of the formula (updated in place where no graph is recorded); None
        when nothing is left. The identity's f' is 1, its f'' and f''' 0. Native: one pass of the
        activation's kernel (_C._activation_terms), each f^(k) made once per element, no buffer
        but the result."""
        if self.act is None:
            for k, *f in terms:
                if k < 2:
                    add = _plus(add, _product([self.p, *f] if k == 0 else f))
            return add
        if not terms:
            return add
        if self._native and all(_like(t, self.p) for _, *f in terms for t in (*f, add)
                                if t is not None):
            return _C._activation_terms(self.p, self.act, [(k, list(f)) for k, *f in terms],
                                        add, add)
        for k, *f in terms:
            add = _plus(add, _product([self._order(k), *f]))
        return add


# Where no graph is recorded, a formula updates its own temporaries in place (one buffer fewer
# per term); the ``acc`` argument of the helpers below is always such a temporary.

def _plus(acc: Optional[Tensor], t: Optional[Tensor]) -> Optional[Tensor]:
    """acc + t (t may be an input: returned as it is when acc is None)."""
    if acc is None or t is None:
        return t if acc is None else acc
    return acc + t if torch.is_grad_enabled() else acc.add_(t)


def _present(*terms) -> tuple:
    """The terms that are not None."""
    return tuple(t for t in terms if t is not None)


def _product(factors) -> Tensor:
    """factors[0]·factors[1]·..., a new tensor."""
    acc = factors[0] * factors[1] if len(factors) > 1 else factors[0].clone()
    for t in factors[2:]:
        acc = _times(acc, t)
    return acc


def _times(acc: Tensor, t: Tensor) -> Tensor:
    """acc·t."""
    return acc * t if torch.is_grad_enabled() else acc.mul_(t)


def _mm(t: Tensor, w: Optional[Tensor]) -> Tensor:
    return t if w is None else t @ w  # no W: the activation on top


def _mm_t(t: Tensor, w: Optional[Tensor]) -> Tensor:
    return t if w is None else t @ w.t()


def _outer(u: Tensor, v: Tensor) -> Tensor:
    """uᵀ·v over the rows."""
    return _flat(u).t() @ _flat(v)


def _forward(act, p, weight, bias):
    """(z,) = (f(p)·Wᵀ + b,)."""
    return (F.linear(_Input(act, p).f(), weight, bias),)


def _forward_vjp(act, wanted, p, weight, bias, c):
    """Its vjp for c, the cotangent of z: ((c·W)·f'(p), cᵀ·f(p), Σ c) for (p, W, b)."""
    if c is None:
        return None, None, None
    fp = _Input(act, p)
    return (fp.d1(c @ weight) if wanted[0] else None, _outer(c, fp.f()) if wanted[1] else None,
            _flat(c).sum(0) if wanted[2] and bias is not None else None)


def _forward_vjp_vjp(act, wanted, p, weight, bias, c, u_p, u_w, u_b):
    """The vjp of _forward_vjp, with u_* the cotangents of its results and k = u_p·f'(p):
    p: u_p·(c·W)·f''(p) + (c·u_W)·f'(p),  W: cᵀ·k,  b: 0,  c: k·Wᵀ + f(p)·u_Wᵀ + u_b."""
    fp = _Input(act, p)
    g_p = g_w = g_c = None
    if wanted[0] and c is not None:
        g_p = fp.terms(*_present((2, c @ weight, u_p) if u_p is not None and act else None,
                                 (1, c @ u_w) if u_w is not None else None))
    k = None if u_p is None else fp.d1(u_p)
    if wanted[1] and k is not None and c is not None:
        g_w = _outer(c, k)
    if wanted[3]:
        g_c = None if k is None else k @ weight.t()
        del k
        if u_w is not None:
            g_c = _plus(g_c, fp.f() @ u_w.t())
        if u_b is not None:
            g_c = _plus(g_c, u_b.expand(*p.shape[:-1], weight.shape[0]))
    return g_p, g_w, None, g_c


def _backward(act, mask, gz, p, weight):
    """(gp, gW, gb) = ((gz·W)·f'(p), gzᵀ·f(p), Σ gz), each where mask says."""
    fp = _Input(act, p)
    return (fp.d1(_mm(gz, weight)) if mask[0] else None,
            _outer(gz, fp.f()) if mask[1] else None, _flat(gz).sum(0) if mask[2] else None)


def _backward_vjp(act, wanted, gz, p, weight, c_gp, c_gw, c_gb):
    """Its vjp (the second order), c_* the cotangents of (gp, gW, gb); with s = c_gp·f'(p):
    gz: s·Wᵀ + f(p)·c_gWᵀ + c_gb,  p: c_gp·(gz·W)·f''(p) + (gz·c_gW)·f'(p),  W: gzᵀ·s."""
    fp = _Input(act, p)
    r_gz = r_p = r_w = None
    if wanted[1]:
        r_p = fp.terms(*_present((2, c_gp, _mm(gz, weight)) if c_gp is not None and act else None,
                                 (1, gz @ c_gw) if c_gw is not None else None))
    s = None if c_gp is None else fp.d1(c_gp)
    if wanted[0]:
        r_gz = None if s is None else _mm_t(s, weight)
        if c_gw is not None:
            r_gz = _plus(r_gz, fp.f() @ c_gw.t())
        if c_gb is not None:
            r_gz = _plus(r_gz, c_gb.expand(gz.shape))
    if wanted[2] and s is not None:
        r_w = _outer(gz, s)
    return r_gz, r_p, r_w


def _backward_vjp_vjp(act, wanted, gz, p, weight, c_gp, c_gw, c_gb, v_gz, v_p, v_w):
    """The vjp of _backward_vjp (the third order), v_* the cotangents of its results. With
    s = c_gp·f'(p), m = gz·W, n = gz·c_gW and the cotangents reaching them
        s̄ = v_gz·W + gz·v_W,   m̄ = v_p·c_gp·f''(p),   n̄ = v_p·f'(p),   ā = v_gz·c_gW (of f(p)):
    gz: m̄·Wᵀ + n̄·c_gWᵀ + s·v_Wᵀ,   W: v_gzᵀ·s + gzᵀ·m̄,
    p: c_gp·(v_p·m·f'''(p) + s̄·f''(p)) + v_p·n·f''(p) + ā·f'(p),
    c_gp: v_p·m·f''(p) + s̄·f'(p),   c_gW: v_gzᵀ·f(p) + gzᵀ·n̄,   c_gb: Σ v_gz.
    Ordered so that at most four (rows, width) buffers are alive at once."""
    fp = _Input(act, p)
    curved = act is not None  # f'' and f''' nonzero
    through_m = curved and v_p is not None and c_gp is not None
    res: List[Optional[Tensor]] = [None] * 6
    s_bar = None if v_gz is None else _mm(v_gz, weight)
    if v_w is not None:
        s_bar = _plus(gz @ v_w, s_bar)
    m = _mm(gz, weight) if through_m and (wanted[1] or wanted[3]) else None
    if wanted[3]:
        res[3] = fp.terms(*_present((1, s_bar) if s_bar is not None else None,
                                    (2, v_p, m) if m is not None else None))
    if wanted[1]:
        res[1] = fp.terms(*_present(
            (2, c_gp, s_bar) if curved and c_gp is not None and s_bar is not None else None,
            (3, c_gp, v_p, m) if m is not None else None))
    del s_bar, m
    if wanted[1] and c_gw is not None:
        res[1] = fp.terms(*_present((2, v_p, gz @ c_gw) if curved and v_p is not None else None,
                                    (1, v_gz @ c_gw) if v_gz is not None else None), add=res[1])
    if through_m and (wanted[0] or wanted[2]):
        m_bar = fp.terms((2, v_p, c_gp))
        if wanted[2]:
            res[2] = _outer(gz, m_bar)
        if wanted[0]:
            res[0] = m_bar @ weight.t() if weight is not None else m_bar
        del m_bar
    s = None
    if c_gp is not None and ((wanted[0] and v_w is not None) or (wanted[2] and v_gz is not None)):
        s = fp.d1(c_gp)
    if wanted[2] and v_gz is not None and s is not None:
        res[2] = _plus(res[2], _outer(v_gz, s))
    n_bar = None if v_p is None or c_gw is None else fp.d1(v_p)
    if wanted[0]:
        if n_bar is not None:
            res[0] = _plus(res[0], n_bar @ c_gw.t())
        if v_w is not None and s is not None:
            res[0] = _plus(res[0], s @ v_w.t())
    del s
    if wanted[4]:
        r = None if v_gz is None else _outer(v_gz, fp.f())
        if n_bar is not None:
            r = _plus(r, _outer(gz, n_bar))
        res[4] = r
    if wanted[5] and v_gz is not None:
        res[5] = _flat(v_gz).sum(0)
    return tuple(res)


# ---- the run -----------------------------------------------------------------------------------

def asked_layers(need_x, need_w, need_b, layer_b):
    """The bias gradients asked for of layers that have one, the lowest layer a first-order
    backward must reach (len(layer_b): none), and the per-layer lists of gradients to fill."""
    L = len(layer_b)
    need_b = [bool(n) and b is not None for n, b in zip(need_b, layer_b)]
    lowest = 0 if need_x else min([i for i in range(L) if need_w[i] or need_b[i]], default=L)
    gws: List[Optional[Tensor]] = [None] * L
    gbs: List[Optional[Tensor]] = [None] * L
    return need_b, lowest, gws, gbs


def create_graph_backward(grad_out, x, weights, layer_b, acts, last_activation, need_x, need_w,
                          need_b):
    """The first-order backward of the run (grad_x?, [grad_W_i?], [grad_b_i?]), recorded as
    per-layer nodes: one forward node per pre-activation z_i (from z_{i−1}, W_i, b_i), one
    backward node per layer (and one for the activation on top). ``acts``: one name per layer."""
    need_b, lowest, gws, gbs = asked_layers(need_x, need_w, need_b, layer_b)
    L = len(weights)
    if lowest == L:
        return None, gws, gbs

    def act_in(i):  # the activation layer i applies to its input z_{i−1}
        return acts[i - 1] if i > 0 else None

    ps = [x]  # the layers' inputs: x, z_0, z_1, ...
    for i in range(L if last_activation else L - 1):
        ps.append(_Recomputed.apply(
            functools.partial(_forward, act_in(i)),
            (functools.partial(_forward_vjp, act_in(i)),
             functools.partial(_forward_vjp_vjp, act_in(i))),
            ps[i], weights[i], layer_b[i])[0])
    grad = grad_out
    if last_activation:
        grad = _backward_node(acts[L - 1], (True, False, False), grad, ps[L], None)[0]
    for i in reversed(range(lowest, L)):
        mask = (i > lowest or need_x, bool(need_w[i]), need_b[i])
        grad, gws[i], gbs[i] = _backward_node(act_in(i), mask, grad, ps[i], weights[i])
    return (grad if need_x else None), gws, gbs


def _backward_node(act, mask, gz, p, weight):
    return _Recomputed.apply(functools.partial(_backward, act, mask),
                             (functools.partial(_backward_vjp, act),
                              functools.partial(_backward_vjp_vjp, act)), gz, p, weight)


class _Recomputed(torch.autograd.Function):
    """fn(*inputs), ATen ops, as a node that keeps its inputs only. Its backward is the vjp of fn:
    vjps[0](wanted, *inputs, *cotangents) (a formula, whose own vjp is vjps[1], ...) or, past
    the last formula, autograd through fn recomputed; recorded as another such node when a graph
    is built (create_graph): the memory of checkpointing one layer at every order."""

    @staticmethod
    def forward(ctx, fn, vjps, *inputs):
        _note_tensor_inputs(ctx, (fn, vjps, *inputs))
        ctx.fn, ctx.vjps = fn, vjps
        ctx.save_for_backward(*inputs)
        ctx.set_materialize_grads(False)
        return tuple(fn(*inputs))

    @staticmethod
    def backward(ctx, *cotangents):
        inputs = ctx.saved_tensors
        wanted = _wanted(ctx, inputs)
        if all(c is None for c in cotangents) or not any(wanted):
            return (None,) * (2 + len(inputs))
        if ctx.vjps:
            fn, vjps = functools.partial(ctx.vjps[0], wanted), ctx.vjps[1:]
        else:
            fn, vjps = functools.partial(_vjp, ctx.fn, len(inputs), wanted), ()
        if torch.is_grad_enabled():
            return (None, None, *_Recomputed.apply(fn, vjps, *inputs, *cotangents))
        return (None, None, *fn(*inputs, *cotangents))


def _wanted(ctx, inputs) -> tuple:
    """Which inputs' gradients the running pass uses (_autograd._needed asks the engine)."""
    return tuple(_needed(ctx, 2 + len(inputs))[2:])


def _vjp(fn, n_inputs, wanted, *tensors):
    """The gradient of <fn(*inputs), cotangents> w.r.t. each input where ``wanted`` (else None),
    fn recomputed. In grad mode (a caller differentiating this) the inputs that require grad are
    used as they are, so the result is differentiable in them."""
    inputs, cotangents = tensors[:n_inputs], tensors[n_inputs:]
    create = torch.is_grad_enabled()
    with torch.enable_grad():
        ins = [t if (t is None or (create and t.requires_grad))
               else t.detach().requires_grad_(w) for t, w in zip(inputs, wanted)]
        outs = fn(*ins)
        pairs = [(o, c) for o, c in zip(outs, cotangents)
                 if c is not None and o is not None and o.requires_grad]
        targets = [t for t, w in zip(ins, wanted) if w]
        grads = (torch.autograd.grad([o for o, _ in pairs], targets, [c for _, c in pairs],
                                     create_graph=create, allow_unused=True)
                 if pairs else [None] * len(targets))
    it = iter(grads)
    return tuple(next(it) if w else None for w in wanted)
