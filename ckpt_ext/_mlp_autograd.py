"""Autograd of the mlp op (any activation; tanh_mlp keeps its own, ``_autograd``): it keeps x and
the parameters only. First order: the recomputing C++ mlp_backward. With create_graph=True that
call is recorded by a node that keeps (grad_out, x, parameters) and differentiates the composite
below (ATen ops) when a later order reaches it; under torch.func the composite runs directly.
Design: docs/design.md, "Other activations".
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import _SingleLevelFunction

from ._activations import activate, activation_backward
from ._autograd import _below_autograd, _needed, _plain_autograd, _register_autograd_kernel
from ._derivatives import _OPS, _add, _flat, _layer_biases


# ---- the composite: the run and its first-order backward from ATen ops ------------------------

def _applies(i: int, L: int, last_activation: bool) -> bool:
    return i + 1 < L or last_activation


def mlp_backward_composite(grad_out, x, weights, layer_b, act, last_activation, need_x,
                           need_w, need_b):
    """(grad_x?, [grad_W_i?], [grad_b_i?] per layer) of the run, recomputed with ATen ops:
    z_i = a_i·W_iᵀ + b_i, a_{i+1} = f(z_i); from the top, g_i = gy_i·f'(z_i) (gy_i itself above a
    top layer without activation), grad_W_i = g_iᵀ·a_i, grad_b_i = Σ g_i, gy_{i−1} = g_i·W_i."""
    L = len(weights)
    need_b = [bool(n) and b is not None for n, b in zip(need_b, layer_b)]
    lowest = 0 if need_x else min([i for i in range(L) if need_w[i] or need_b[i]], default=L)
    gws: List[Optional[Tensor]] = [None] * L
    gbs: List[Optional[Tensor]] = [None] * L
    if lowest == L:
        return None, gws, gbs
    acts, zs = [x], []
    for i in range(L - 1):
        zs.append(F.linear(acts[i], weights[i], layer_b[i]))
        acts.append(activate(act, zs[i]))
    zs.append(F.linear(acts[L - 1], weights[L - 1], layer_b[L - 1])
              if last_activation else None)
    grad = grad_out
    for i in reversed(range(lowest, L)):
        g = activation_backward(act, grad, zs[i]) if _applies(i, L, last_activation) else grad
        if need_w[i]:
            gws[i] = _flat(g).t() @ _flat(acts[i])
        if need_b[i]:
            gbs[i] = _flat(g).sum(0)
        grad = g @ weights[i] if (i > lowest or need_x) else None
    return (grad if need_x else None), gws, gbs


def _mlp_jvp(x, weights, layer_b, act, last_activation, x_t, w_t, b_t):
    """The tangent of the run's output: ż_i = ȧ_i·W_iᵀ + a_i·Ẇ_iᵀ + ḃ_i, ȧ_{i+1} = ż_i·f'(z_i)."""
    L = len(weights)
    a, a_t = x, x_t
    for i in range(L):
        w, b = weights[i], layer_b[i]
        z = F.linear(a, w, b)
        z_t = None if a_t is None else a_t @ w.t()
        if w_t[i] is not None:
            z_t = _add(z_t, a @ w_t[i].t())
        if b_t[i] is not None:
            z_t = _add(z_t, b_t[i])
        if z_t is None:
            z_t = torch.zeros_like(z)
        z_t = z_t.expand(z.shape)
        if _applies(i, L, last_activation):
            a, a_t = activate(act, z), activation_backward(act, z_t, z)
        else:
            a, a_t = z, z_t
    return a_t


# ---- the Functions -----------------------------------------------------------------------------

def _split(ctx, params):
    L = len(ctx.has_bias)
    return list(params[:L]), _layer_biases(params[L:], ctx.has_bias)


class _Mlp(_SingleLevelFunction):
    """mlp; keeps (x, weights, biases). apply(x, has_bias, activation, last_activation, *weights,
    *biases)."""

    @staticmethod
    def forward(x, has_bias, act, last_activation, *params):
        L = len(has_bias)
        return _below_autograd(_OPS.mlp.default, x, params[:L], params[L:], list(has_bias), act,
                               last_activation)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, has_bias, act, last_activation, *params = inputs
        ctx.save_for_backward(x, *params)
        ctx.save_for_forward(x, *params)
        ctx.has_bias, ctx.act, ctx.last = tuple(has_bias), act, bool(last_activation)

    @staticmethod
    def backward(ctx, grad_out):
        x, *params = ctx.saved_tensors
        L = len(ctx.has_bias)
        need = _needed(ctx, 4 + len(params))
        need_x, need_w, need_b = need[0], need[4:4 + L], need[4 + L:]
        weights, layer_b = _split(ctx, params)
        if not _plain_autograd():  # torch.func: the composite, which the transforms see through
            gx, gw, gb = mlp_backward_composite(grad_out, x, weights, layer_b, ctx.act, ctx.last,
                                                need_x, need_w, _layer_biases(need_b, ctx.has_bias))
            return (gx, None, None, None, *gw, *[g for g, hb in zip(gb, ctx.has_bias) if hb])
        if torch.is_grad_enabled():  # create_graph: recorded, for the orders above
            out = _MlpBackward.apply(grad_out, x, ctx.has_bias, ctx.act, ctx.last, need_x,
                                     tuple(need_w), tuple(need_b), *params)
        else:
            out = _MlpBackward.forward(grad_out, x, ctx.has_bias, ctx.act, ctx.last, need_x,
                                       need_w, need_b, *params)
        it = iter(out[1:])
        gw = [next(it) if n else None for n in need_w]
        gb = [next(it) if n else None for n in need_b]
        return (out[0] if need_x else None, None, None, None, *gw, *gb)

    @staticmethod
    def jvp(ctx, x_t, _hb, _act, _last, *param_t):
        x, *params = ctx.saved_tensors
        weights, layer_b = _split(ctx, params)
        L = len(weights)
        return _mlp_jvp(x, weights, layer_b, ctx.act, ctx.last, x_t, list(param_t[:L]),
                        _layer_biases(param_t[L:], ctx.has_bias))


class _MlpBackward(_SingleLevelFunction):
    """mlp_backward (the C++ kernel, recomputing); keeps (grad_out, x, weights, biases). Its
    backward differentiates the composite on them. apply(grad_out, x, has_bias, activation,
    last_activation, need_x, need_w, need_b, *params) -> (grad_x, *asked grad_W, *asked grad_b)."""

    @staticmethod
    def forward(grad_out, x, has_bias, act, last_activation, need_x, need_w, need_b, *params):
        L = len(has_bias)
        gx, gw, gb = _below_autograd(_OPS.mlp_backward.default, grad_out, x, params[:L],
                                     params[L:], list(has_bias), act, last_activation, need_x,
                                     list(need_w), list(need_b))
        return (gx, *gw, *gb)

    @staticmethod
    def setup_context(ctx, inputs, output):
        grad_out, x, has_bias, act, last_activation, need_x, need_w, need_b, *params = inputs
        ctx.save_for_backward(grad_out, x, *params)
        ctx.has_bias, ctx.act, ctx.last = tuple(has_bias), act, bool(last_activation)
        ctx.need_x, ctx.need_w, ctx.need_b = bool(need_x), tuple(need_w), tuple(need_b)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *cotangents):
        saved = list(ctx.saved_tensors)
        need = _needed(ctx, 8 + len(saved) - 2)
        wanted = [need[0], need[1], *need[8:]]  # grad_out, x, *params
        pairs = [(o, c) for o, c in zip(range(len(cotangents)), cotangents) if c is not None]
        if not pairs or not any(wanted):
            return (None,) * (8 + len(saved) - 2)
        create = torch.is_grad_enabled()
        # With create_graph the saved tensors themselves (so the result is differentiable in
        # them); else detached copies of the ones whose gradient is wanted.
        inputs = [t if (create and t.requires_grad) else t.detach().requires_grad_(w)
                  for t, w in zip(saved, wanted)]
        with torch.enable_grad():
            grad_out, x, *params = inputs
            weights, layer_b = _split(ctx, params)
            gx, gw, gb = mlp_backward_composite(grad_out, x, weights, layer_b, ctx.act, ctx.last,
                                                ctx.need_x, list(ctx.need_w),
                                                _layer_biases(list(ctx.need_b), ctx.has_bias))
            outs = [gx] + [g for g, n in zip(gw, ctx.need_w) if n]
            outs += [g for g, n in zip(gb, _layer_biases(list(ctx.need_b), ctx.has_bias))
                     if n and g is not None]
            used = [(outs[o], c) for o, c in pairs if outs[o] is not None and outs[o].requires_grad]
            targets = [t for t, w in zip(inputs, wanted) if w]
            grads = torch.autograd.grad([u for u, _ in used], targets, [c for _, c in used],
                                        create_graph=create, allow_unused=True) if used else \
                [None] * len(targets)
        it = iter(grads)
        res = [next(it) if w else None for w in wanted]
        return (res[0], res[1], None, None, None, None, None, None, *res[2:])


def _apply_mlp(x, weights, biases, has_bias, act, last_activation):
    return _Mlp.apply(x, tuple(has_bias), act, bool(last_activation), *weights, *biases)


_register_autograd_kernel("mlp", _apply_mlp)

