"""Autograd of the gated_mlp op: it keeps x and the parameters only. First order: the recomputing
C++ gated_mlp_backward. With create_graph=True and under torch.func, the composite below (ATen
ops, which autograd and the transforms differentiate to any order). Forward mode: its jvp.
Design: docs/design.md, "Gated MLPs".
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import _SingleLevelFunction

from ._activations import activate, activation_backward
from ._autograd import (_below_autograd, _needed, _note_tensor_inputs, _plain_autograd,
                        _register_autograd_kernel)
from ._derivatives import _OPS, _add, _flat, _layer_biases


# ---- the composite -----------------------------------------------------------------------------

def _gate_and_up(x, weights, layer_b):
    """(g, u): the gate's and the up projection's pre-activations (a gate_up weight: its two
    halves, the gate's first)."""
    if len(weights) == 2:
        return F.linear(x, weights[0], layer_b[0]).chunk(2, dim=-1)
    return F.linear(x, weights[0], layer_b[0]), F.linear(x, weights[1], layer_b[1])


def gated_backward_composite(grad_out, x, weights, layer_b, act, need_x, need_w, need_b):
    """(grad_x?, [grad_W?] per weight, [grad_b?] per weight) of y = down(f(g)·u), recomputed with
    ATen ops: h = f(g)·u; grad_down = gyᵀ·h; gh = gy·W_down; du = gh·f(g); dg = (gh·u)·f'(g);
    then the input projections' GEMMs from dz = [dg | du]."""
    L = len(weights)
    gws: List[Optional[Tensor]] = [None] * L
    gbs: List[Optional[Tensor]] = [None] * L
    need_b = [bool(n) and b is not None for n, b in zip(need_b, layer_b)]
    need_in = need_x or any(need_w[:-1]) or any(need_b[:-1])
    if not (need_in or need_w[-1] or need_b[-1]):
        return None, gws, gbs
    gy = grad_out
    if need_b[-1]:
        gbs[-1] = _flat(gy).sum(0)
    if not (need_in or need_w[-1]):
        return None, gws, gbs
    g, u = _gate_and_up(x, weights, layer_b)
    fg = activate(act, g)
    if need_w[-1]:
        gws[-1] = _flat(gy).t() @ _flat(fg * u)
    if not need_in:
        return None, gws, gbs
    gh = gy @ weights[-1]
    dg = activation_backward(act, gh * u, g, fg)
    du = gh * fg
    dzs = [torch.cat([dg, du], dim=-1)] if L == 2 else [dg, du]
    gx = None
    for i, dz in enumerate(dzs):
        if need_w[i]:
            gws[i] = _flat(dz).t() @ _flat(x)
        if need_b[i]:
            gbs[i] = _flat(dz).sum(0)
        if need_x:
            gx = _add(gx, dz @ weights[i])
    return gx, gws, gbs


def gated_jvp(x, weights, layer_b, act, x_t, w_t, b_t):
    """The tangent of y: ż = ẋ·Wᵀ + x·Ẇᵀ + ḃ per input projection, ḣ = f'(g)·ġ·u + f(g)·u̇,
    ẏ = ḣ·W_downᵀ + h·Ẇ_downᵀ + ḃ_down."""
    def linear_t(a, a_t, i):
        z_t = None if a_t is None else a_t @ weights[i].t()
        if w_t[i] is not None:
            z_t = _add(z_t, a @ w_t[i].t())
        if b_t[i] is not None:
            z_t = _add(z_t, b_t[i])
        return z_t

    g, u = _gate_and_up(x, weights, layer_b)
    zs_t = [linear_t(x, x_t, i) for i in range(len(weights) - 1)]
    if len(weights) == 2:
        z_t = zs_t[0] if zs_t[0] is not None else torch.zeros_like(torch.cat([g, u], dim=-1))
        g_t, u_t = z_t.expand(*g.shape[:-1], 2 * g.shape[-1]).chunk(2, dim=-1)
    else:
        g_t, u_t = (t if t is not None else torch.zeros_like(g) for t in zs_t)
    fg = activate(act, g)
    h = fg * u
    h_t = activation_backward(act, g_t.expand(g.shape), g, fg) * u + fg * u_t
    y_t = linear_t(h, h_t, len(weights) - 1)
    return y_t


# ---- the first order ---------------------------------------------------------------------------

def gated_first_order(grad_out, x, weights, biases, has_bias, act, need_x, need_w, need_b):
    """(grad_x?, [grad_W?] per weight, [grad_b_j?] per bias), None where not asked: the C++
    gated_mlp_backward in plain autograd without create_graph; the composite otherwise."""
    if _plain_autograd() and not torch.is_grad_enabled():
        gx, gw_asked, gb_asked = _OPS.gated_mlp_backward.default(
            grad_out, x, list(weights), list(biases), list(has_bias), act, need_x,
            list(need_w), list(need_b))
        it_w, it_b = iter(gw_asked), iter(gb_asked)
        return ((gx if need_x else None), [next(it_w) if n else None for n in need_w],
                [next(it_b) if n else None for n in need_b])
    gx, gw, gb = gated_backward_composite(grad_out, x, list(weights),
                                          _layer_biases(list(biases), has_bias), act, need_x,
                                          need_w, _layer_biases(list(need_b), has_bias))
    return gx, gw, [g for g, hb in zip(gb, has_bias) if hb]


class _GatedMlp(_SingleLevelFunction):
    """gated_mlp; keeps (x, weights, biases). apply(x, *weights, *biases, has_bias, activation):
    the tensors first, so the node's edges line up with the inputs (_needed)."""

    @staticmethod
    def forward(x, *rest):
        *params, has_bias, act = rest
        L = len(has_bias)
        return _below_autograd(_OPS.gated_mlp.default, x, params[:L], params[L:], list(has_bias),
                               act)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _note_tensor_inputs(ctx, inputs)
        x, *params, has_bias, act = inputs
        ctx.save_for_backward(x, *params)
        ctx.save_for_forward(x, *params)
        ctx.has_bias, ctx.act = tuple(has_bias), act

    @staticmethod
    def backward(ctx, grad_out):
        x, *params = ctx.saved_tensors
        L = len(ctx.has_bias)
        need = _needed(ctx, 1 + len(params))
        gx, gw, gb = gated_first_order(grad_out, x, params[:L], params[L:], ctx.has_bias,
                                       ctx.act, need[0], need[1:1 + L], need[1 + L:])
        return (gx, *gw, *gb, None, None)

    @staticmethod
    def jvp(ctx, x_t, *rest):
        param_t = rest[:-2]
        x, *params = ctx.saved_tensors
        L = len(ctx.has_bias)
        return gated_jvp(x, params[:L], _layer_biases(params[L:], ctx.has_bias), ctx.act, x_t,
                         list(param_t[:L]), _layer_biases(param_t[L:], ctx.has_bias))


def _apply_gated(x, weights: Sequence[Tensor], biases: Sequence[Tensor], has_bias, act):
    return _GatedMlp.apply(x, *weights, *biases, tuple(has_bias), act)


_register_autograd_kernel("gated_mlp", _apply_gated)
