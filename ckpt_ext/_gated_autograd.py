"""Autograd of the gated_mlp op: it keeps x and the parameters only. First order: the recomputing
C++ gated_mlp_backward. With create_graph=True and under torch.func, the composite below (ATen
ops, which autograd and the transforms differentiate to any order). Forward mode: its jvp.
Design: docs/design.md, "Gated MLPs".
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import Tensor
from torch.autograd.function import _SingleLevelFunction

from ._activations import activate, activation_backward
from ._autograd import (_below_autograd, _needed, _note_tensor_inputs, _plain_autograd,
                        _register_autograd_kernel)
from ._derivatives import (NO_LORA_NEED, _OPS, _add, _flat, _layer_biases, _linear_tangent,
                           _lora_backward, lora_linear)


# ---- the composite -----------------------------------------------------------------------------

def _gate_and_up(x, weights, layer_b, loras=None):
    """(g, u): the gate's and the up projection's pre-activations (a gate_up weight: its two
    halves, the gate's first), each with its LoRA term where ``loras`` (one entry per weight) has
    one, the gate's computed (and its mask drawn) first."""
    loras = loras or [None] * len(weights)
    if len(weights) == 2:
        return lora_linear(x, weights[0], layer_b[0], loras[0]).chunk(2, dim=-1)
    return (lora_linear(x, weights[0], layer_b[0], loras[0]),
            lora_linear(x, weights[1], layer_b[1], loras[1]))


def gated_forward_composite(x, weights, layer_b, act, loras=None):
    """y = down(f(gate(x)) · up(x)) from ATen ops, each Linear with its LoRA term where ``loras``
    has one: the order of LlamaMLP's forward (gate, up, down), so masks are drawn in peft's
    order."""
    g, u = _gate_and_up(x, weights, layer_b, loras)
    return lora_linear(activate(act, g) * u, weights[-1], layer_b[-1],
                       loras[-1] if loras else None)


def gated_backward_composite(grad_out, x, weights, layer_b, act, need_x, need_w, need_b):
    """(grad_x?, [grad_W?] per weight, [grad_b?] per weight) of y = down(f(g)·u), recomputed with
    ATen ops (lora_gated_backward_composite without LoRA terms)."""
    L = len(weights)
    return lora_gated_backward_composite(grad_out, x, weights, layer_b, [None] * L, act, need_x,
                                         need_w, need_b, [NO_LORA_NEED] * L)[:3]


def lora_gated_backward_composite(grad_out, x, weights, layer_b, loras, act, need_x, need_w,
                                  need_b, need_lora):
    """(grad_x?, [grad_W?], [grad_b?], [(grad_A?, grad_B?, grad_b_B?) or None] per weight) of
    y = down(f(g)·u), each Linear with its LoRA term where ``loras`` has one, recomputed with
    ATen ops: h = f(g)·u; grad_down = gyᵀ·h; gh = gy·W_down (+ the down LoRA's share);
    du = gh·f(g); dg = (gh·u)·f'(g); then the input projections' GEMMs (and LoRA terms,
    _lora_backward) from dz = [dg | du]."""
    L = len(weights)
    gws: List[Optional[Tensor]] = [None] * L
    gbs: List[Optional[Tensor]] = [None] * L
    glora = [None if t is None else (None, None, None) for t in loras]
    need_b = [bool(n) and b is not None for n, b in zip(need_b, layer_b)]
    lora_need = [t is not None and any(n) for t, n in zip(loras, need_lora)]
    need_in = need_x or any(need_w[:-1]) or any(need_b[:-1]) or any(lora_need[:-1])
    down_reads_h = need_w[-1] or (lora_need[-1] and any(need_lora[-1][:2]))
    if not (need_in or need_w[-1] or need_b[-1] or lora_need[-1]):
        return None, gws, gbs, glora
    gy = grad_out
    if need_b[-1]:
        gbs[-1] = _flat(gy).sum(0)
    if not (need_in or down_reads_h):
        if lora_need[-1]:
            glora[-1] = _lora_backward(gy, None, loras[-1], False, need_lora[-1])[1]
        return None, gws, gbs, glora
    g, u = _gate_and_up(x, weights, layer_b, loras)
    fg = activate(act, g)
    h = fg * u
    if need_w[-1]:
        gws[-1] = _flat(gy).t() @ _flat(h)
    gh = gy @ weights[-1] if need_in else None
    if loras[-1] is not None:
        gh_lora, glora[-1] = _lora_backward(gy, h, loras[-1], need_in, need_lora[-1])
        gh = _add(gh, gh_lora)
    if not need_in:
        return None, gws, gbs, glora
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
        if loras[i] is not None:
            gx_lora, glora[i] = _lora_backward(dz, x, loras[i], need_x, need_lora[i])
            gx = _add(gx, gx_lora)
    return gx, gws, gbs, glora


def gated_jvp(x, weights, layer_b, act, x_t, w_t, b_t, loras=None, lora_t=None):
    """The tangent of y: ż of each input projection (_linear_tangent, with its LoRA term where
    ``loras`` has one; ``lora_t``: their tangents), ḣ = f'(g)·ġ·u + f(g)·u̇, ẏ the down
    projection's ż for h, ḣ."""
    L = len(weights)
    loras = loras or [None] * L
    lora_t = lora_t or [None] * L

    def linear_t(a, a_t, i):
        return _linear_tangent(a, a_t, weights[i], w_t[i], b_t[i], loras[i], lora_t[i])

    g, u = _gate_and_up(x, weights, layer_b, loras)
    zs_t = [linear_t(x, x_t, i) for i in range(L - 1)]
    if L == 2:
        z_t = zs_t[0] if zs_t[0] is not None else torch.zeros_like(torch.cat([g, u], dim=-1))
        g_t, u_t = z_t.expand(*g.shape[:-1], 2 * g.shape[-1]).chunk(2, dim=-1)
    else:
        g_t, u_t = (t if t is not None else torch.zeros_like(g) for t in zs_t)
    fg = activate(act, g)
    h = fg * u
    h_t = activation_backward(act, g_t.expand(g.shape), g, fg) * u + fg * u_t
    y_t = linear_t(h, h_t, L - 1)
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
