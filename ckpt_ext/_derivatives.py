"""The derivative formulas of tanh layers from their outputs (the higher orders of ``_higher_order``
and a tanh stack's first order from its kept outputs), the tangent of a run (any activations,
the jvp of the mlp op's Functions), and a Linear with a LoRA term (its forward in peft's order,
its backward and its tangent), each written once, from ATen ops and the ckpt_ext ops so autograd
can differentiate them again (the notation of docs/design.md).

Rows are flattened to (M, ·). ``_autograd`` and ``_higher_order`` record the ops whose backward or
jvp these are; the vmap rules (``_vmap``) call the ops themselves.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _C  # noqa: F401  (loading the library registers torch.ops.ckpt_ext.*)
from ._activations import activate, activation_backward

_OPS = torch.ops.ckpt_ext


def _rows(x: Tensor) -> int:
    return math.prod(x.shape[:-1])  # not reshape(-1, ...): -1 is ambiguous for 0 features


def _flat(t: Tensor) -> Tensor:
    """t (..., C) as (rows, C)."""
    return t.reshape(_rows(t), t.shape[-1])


def _add(a: Optional[Tensor], b: Optional[Tensor]) -> Optional[Tensor]:
    if a is None:
        return b
    return a if b is None else a + b


def _grad_of_g(ggx2: Optional[Tensor], ggw: Optional[Tensor], ggb: Optional[Tensor], x2: Tensor,
               weight: Tensor) -> Optional[Tensor]:
    """dg (M, N), the gradient reaching g = grad_out·(1 − t²) from the first-order results'
    gradients (ggx, ggW, ggb): ggx·Wᵀ (through grad_x = g·W), x·ggWᵀ (through grad_W = gᵀ·x), ggb
    on every row (through grad_b = Σ g). None when none of them is given."""
    dg = None
    if ggx2 is not None:
        dg = ggx2 @ weight.t()
    if ggw is not None:
        dg = _add(dg, x2 @ ggw.t())
    if ggb is not None:
        dg = _add(dg, ggb.expand(x2.shape[0], weight.shape[0]))
    return dg


def _result_like(values, mask, likes):
    """One result per output of a Function: None where the output is not produced (mask False or
    no tensor to be like), else the value or zeros."""
    return tuple(None if not m or like is None else (v if v is not None else torch.zeros_like(like))
                 for v, m, like in zip(values, mask, likes))


def _from_output_backward_vjp(ggx, ggw, ggb, gy, x, t, weight, u_gy, u_x, u_t, u_w,
                              need: Sequence[bool], dg: Optional[Tensor] = None
                              ) -> List[Optional[Tensor]]:
    """The vjp of linear_tanh_backward_from_output_backward, from ATen ops.

    Its forward, on (M, ·) rows: s = 1 − t², g = gy·s, dg = ggx·Wᵀ + x·ggWᵀ + ggb,
        out_gy = dg·s,  out_x = g·ggW,  out_t = −2·dg·gy·t,  out_W = gᵀ·ggx.
    With u_* the cotangents of the outputs:
        d̄g = u_gy·s − 2·u_t·gy·t          ḡ = u_x·ggWᵀ + ggx·u_Wᵀ          s̄ = u_gy·dg + ḡ·gy
    and the results
        ggx: d̄g·W + g·u_W     ggW: d̄gᵀ·x + gᵀ·u_x     ggb: Σ d̄g
        gy:  ḡ·s − 2·u_t·dg·t        t: −2·t·s̄ − 2·u_t·dg·gy
        x:   d̄g·ggW                  W: d̄gᵀ·ggx
    ``need`` says which of (ggx, ggW, ggb, gy, x, t, W) to return; the others are None. ``dg``
    (M, N): given where the caller has computed it already."""
    res: List[Optional[Tensor]] = [None] * 7
    if not any(need) or all(u is None for u in (u_gy, u_x, u_t, u_w)):
        return res
    n, k = weight.shape
    m = _rows(x)
    x2, gy2, t2 = x.reshape(m, k), gy.reshape(m, n), t.reshape(m, n)
    ggx2 = None if ggx is None else ggx.reshape(m, k)
    ugy2 = None if u_gy is None else u_gy.reshape(m, n)
    ux2 = None if u_x is None else u_x.reshape(m, k)
    ut2 = None if u_t is None else u_t.reshape(m, n)
    s = 1 - t2 * t2
    if dg is None:
        dg = _grad_of_g(ggx2, ggw, ggb, x2, weight)
    dgbar = None if ugy2 is None else ugy2 * s
    m2ut = None if ut2 is None else -2 * ut2  # −2·u_t
    if m2ut is not None:
        dgbar = _add(dgbar, m2ut * gy2 * t2)
    gbar = None
    if ux2 is not None and ggw is not None:
        gbar = ux2 @ ggw.t()
    if u_w is not None and ggx2 is not None:
        gbar = _add(gbar, ggx2 @ u_w.t())
    g = gy2 * s if (u_w is not None and need[0]) or (ux2 is not None and need[1]) else None

    if need[0] and dgbar is not None:
        res[0] = dgbar @ weight
    if need[0] and g is not None and u_w is not None:
        res[0] = _add(res[0], g @ u_w)
    if need[1] and dgbar is not None:
        res[1] = dgbar.t() @ x2
    if need[1] and g is not None and ux2 is not None:
        res[1] = _add(res[1], g.t() @ ux2)
    if need[2] and dgbar is not None:
        res[2] = dgbar.sum(0)
    if need[3]:
        r = None if gbar is None else gbar * s
        if m2ut is not None and dg is not None:
            r = _add(r, m2ut * dg * t2)
        res[3] = r
    if need[4] and dgbar is not None and ggw is not None:
        res[4] = dgbar @ ggw
    if need[5]:
        sbar = None
        if ugy2 is not None and dg is not None:
            sbar = ugy2 * dg
        if gbar is not None:
            sbar = _add(sbar, gbar * gy2)
        r = None if sbar is None else -2 * t2 * sbar
        if m2ut is not None and dg is not None:
            r = _add(r, m2ut * dg * gy2)
        res[5] = r
    if need[6] and dgbar is not None and ggx2 is not None:
        res[6] = dgbar.t() @ ggx2
    shapes = (x.shape, weight.shape, None, gy.shape, x.shape, t.shape, weight.shape)
    for i, shape in enumerate(shapes):
        if res[i] is not None and shape is not None:
            res[i] = res[i].reshape(shape)
    return res


# ---- a stack of layers -------------------------------------------------------------------------

def _layer_biases(biases: Sequence[Tensor], has_bias: Sequence[bool]) -> List[Optional[Tensor]]:
    it = iter(biases)
    return [next(it) if hb else None for hb in has_bias]


def _stack_backward_composite(grad_out, x, weights, layer_b, last_tanh, need_x, need_w, need_b,
                              outputs: Sequence[Optional[Tensor]]):
    """A tanh stack's first-order backward from the one-layer ops on its layers' outputs
    (``outputs``: _stack_outputs_kept): (grad_x?, [grad_W_i?], [grad_b_i?] per layer)."""
    L = len(weights)
    need_b = [nb and b is not None for nb, b in zip(need_b, layer_b)]
    lowest = 0 if need_x else min([i for i in range(L) if need_w[i] or need_b[i]], default=L)
    gws: List[Optional[Tensor]] = [None] * L
    gbs: List[Optional[Tensor]] = [None] * L
    if lowest == L:
        return None, gws, gbs
    acts = [x, *outputs[:L - 1]]
    grad = grad_out
    for i in reversed(range(lowest, L)):
        want_x = i > lowest or need_x
        w, a = weights[i], acts[i]
        mask = (want_x, need_w[i], need_b[i])
        if i == L - 1 and not last_tanh:  # a plain Linear on top
            g2, a2 = _flat(grad), _flat(a)
            gws[i] = g2.t() @ a2 if need_w[i] else None
            gbs[i] = g2.sum(0) if need_b[i] else None
            gx = grad @ w if want_x else None
        else:
            gx, gws[i], gbs[i] = _OPS.linear_tanh_backward_from_output.default(
                grad, a, outputs[i], w, layer_b[i], list(mask))
        grad = gx
    return (grad if need_x else None), gws, gbs


# ---- a Linear with a LoRA term ------------------------------------------------------------------

#: The LoRA gradients asked of a Linear without a LoRA term: (A, B, its bias).
NO_LORA_NEED = (False, False, False)


def lora_linear(a: Tensor, weight: Tensor, bias: Optional[Tensor], lora=None) -> Tensor:
    """z = a·Wᵀ + b, plus s·(drop(a)·Aᵀ·Bᵀ + b_B) where ``lora`` (a ckpt_ext.LoRA) is given: peft's
    ``result + lora_B(lora_A(dropout(x))) * scaling``, op for op (so rounded where peft rounds;
    the mask drawn by F.dropout as nn.Dropout draws it)."""
    z = F.linear(a, weight, bias)
    if lora is None:
        return z
    d = F.dropout(a, float(lora.dropout), True) if lora.dropout > 0 else a
    return z + F.linear(F.linear(d, lora.A), lora.B, lora.bias) * lora.scaling


def _lora_backward(g: Tensor, a: Tensor, lora, need_a: bool, need: Sequence[bool]):
    """(grad_a?, (grad_A?, grad_B?, grad_b_B?)) of the LoRA term l = s·((a·Aᵀ)·Bᵀ + b_B) (no
    dropout) for g = ∂L/∂z: gt = s·g·B (M, r), grad_a = gt·A, grad_A = gtᵀ·a,
    grad_B = gᵀ·(s·a·Aᵀ), grad_b_B = s·Σ g; ``need`` = (A, B, b_B)."""
    need_A, need_B, need_bias = need
    s = lora.scaling
    gt = (g @ lora.B) * s if need_a or need_A else None
    grad_a = gt @ lora.A if need_a else None
    grad_A = _flat(gt).t() @ _flat(a) if need_A else None
    grad_B = _flat(g).t() @ (_flat(a) @ lora.A.t() * s) if need_B else None
    grad_bias = _flat(g).sum(0) * s if need_bias and lora.bias is not None else None
    return grad_a, (grad_A, grad_B, grad_bias)


def _linear_tangent(a: Tensor, a_t: Optional[Tensor], weight: Tensor, w_t: Optional[Tensor],
                    b_t: Optional[Tensor], lora=None, lora_t=None) -> Optional[Tensor]:
    """ż of z = a·Wᵀ + b + s·((a·Aᵀ)·Bᵀ + b_B): ȧ·Wᵀ + a·Ẇᵀ + ḃ + s·((ȧ·Aᵀ + a·Ȧᵀ)·Bᵀ +
    (a·Aᵀ)·Ḃᵀ + ḃ_B), each term where its tangent is given (``lora_t``: a ckpt_ext.LoRA of the
    tangents of A, B and b_B, or None); None when none is."""
    z_t = None if a_t is None else a_t @ weight.t()
    if w_t is not None:
        z_t = _add(z_t, a @ w_t.t())
    if b_t is not None:
        z_t = _add(z_t, b_t)
    if lora is None:
        return z_t
    A_t, B_t, bias_t = (None, None, None) if lora_t is None else (lora_t.A, lora_t.B, lora_t.bias)
    t_t = None if a_t is None else a_t @ lora.A.t()
    if A_t is not None:
        t_t = _add(t_t, a @ A_t.t())
    l_t = None if t_t is None else t_t @ lora.B.t()
    if B_t is not None:
        l_t = _add(l_t, (a @ lora.A.t()) @ B_t.t())
    if bias_t is not None:
        l_t = _add(l_t, bias_t)
    return z_t if l_t is None else _add(z_t, l_t * lora.scaling)


# ---- the tangent of a run, any activations -----------------------------------------------------

def _applies(i: int, L: int, last_activation: bool) -> bool:
    return i + 1 < L or last_activation


def _mlp_jvp(x, weights, layer_b, acts, last_activation, x_t, w_t, b_t, loras=None,
             lora_t=None):
    """The tangent of the run's output: ż_i of each Linear (_linear_tangent; ``loras``, ``lora_t``:
    a LoRA or None per layer, and their tangents), ȧ_{i+1} = ż_i·f_i'(z_i)."""
    L = len(weights)
    loras = loras or [None] * L
    lora_t = lora_t or [None] * L
    a, a_t = x, x_t
    for i in range(L):
        z = lora_linear(a, weights[i], layer_b[i], loras[i])
        z_t = _linear_tangent(a, a_t, weights[i], w_t[i], b_t[i], loras[i], lora_t[i])
        if z_t is None:
            z_t = torch.zeros_like(z)
        z_t = z_t.expand(z.shape)
        if _applies(i, L, last_activation):
            a, a_t = activate(acts[i], z), activation_backward(acts[i], z_t, z)
        else:
            a, a_t = z, z_t
    return a_t
