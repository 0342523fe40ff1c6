"""Autograd of the mlp op, every activation (linear_tanh and tanh_mlp included): it keeps x and
the parameters only. First order (``first_order``, for the Function below and the C++ node
alike): the recomputing C++ mlp_backward. With create_graph=True the first order is built from
per-layer nodes that keep their inputs only and recompute (one layer) for every later order
(``_mlp_higher_order``; tanh in plain autograd: from the layers' kept outputs, ``_autograd``);
under torch.func the composite below runs directly.
Design: docs/design.md, "Other activations".
"""
from __future__ import annotations


import torch
from torch.autograd.function import _SingleLevelFunction

from . import _C
from ._activations import activate, activation_backward, layer_activations
from ._autograd import (_below_autograd, _first_order_from, _needed, _note_tensor_inputs,
                        _plain_autograd, _register_autograd_kernel, _tanh_stack_first_order)
from ._derivatives import (NO_LORA_NEED, _OPS, _add, _applies, _flat, _layer_biases,
                           _lora_backward, _mlp_jvp, lora_linear)
from ._mlp_higher_order import asked_layers, create_graph_backward


# ---- the composite: the run and its first-order backward from ATen ops ------------------------

def mlp_backward_composite(grad_out, x, weights, layer_b, acts, last_activation, need_x,
                           need_w, need_b):
    """(grad_x?, [grad_W_i?], [grad_b_i?] per layer) of the run, recomputed with ATen ops
    (lora_mlp_backward_composite without LoRA terms)."""
    L = len(weights)
    return lora_mlp_backward_composite(grad_out, x, weights, layer_b, [None] * L, acts,
                                       last_activation, need_x, need_w, need_b,
                                       [NO_LORA_NEED] * L)[:3]


def lora_mlp_backward_composite(grad_out, x, weights, layer_b, loras, acts, last_activation,
                                need_x, need_w, need_b, need_lora):
    """(grad_x?, [grad_W_i?], [grad_b_i?], [(grad_A?, grad_B?, grad_b_B?) or None] per layer) of
    the run, recomputed with ATen ops: z_i = a_i·W_iᵀ + b_i (+ its LoRA term, ``loras[i]``),
    a_{i+1} = f_i(z_i); from the top, g_i = gy_i·f_i'(z_i) (gy_i itself above a top layer without
    activation), grad_W_i = g_iᵀ·a_i, grad_b_i = Σ g_i, gy_{i−1} = g_i·W_i (+ the LoRA term's
    share, _lora_backward). ``acts``: one activation name per layer; a top layer without one is
    a plain Linear. ``need_lora[i]``: (A, B, b_B) of layer i's LoRA."""
    need_b, lowest, gws, gbs = asked_layers(need_x, need_w, need_b, layer_b)
    L = len(weights)
    lowest = min([lowest] + [i for i in range(L) if loras[i] is not None and any(need_lora[i])])
    glora = [None if t is None else (None, None, None) for t in loras]
    if lowest == L:
        return None, gws, gbs, glora
    ins, zs = [x], []
    for i in range(L):
        if not _applies(i, L, last_activation):
            break
        zs.append(lora_linear(ins[i], weights[i], layer_b[i], loras[i]))
        ins.append(activate(acts[i], zs[i]))
    grad = grad_out
    for i in reversed(range(lowest, L)):
        below = i > lowest or need_x
        g = (activation_backward(acts[i], grad, zs[i], ins[i + 1])
             if _applies(i, L, last_activation) else grad)
        gx, gws[i], gbs[i] = _linear_backward((below, bool(need_w[i]), need_b[i]), g, ins[i],
                                              weights[i])
        if loras[i] is not None:
            ga, glora[i] = _lora_backward(g, ins[i], loras[i], below, need_lora[i])
            gx = _add(gx, ga)
        grad = gx
    return (grad if need_x else None), gws, gbs, glora


# ---- the first order ---------------------------------------------------------------------------

def one_tanh_layer(act, layers: int, last_activation: bool) -> bool:
    """linear_tanh's form: one layer, tanh applied."""
    return layers == 1 and act == "tanh" and bool(last_activation)


def first_order(state, grad_out, x, weights, biases, has_bias, act, last_activation, need_x,
                need_w, need_b):
    """(grad_x?, [grad_W_i?] per layer, [grad_b_j?] per bias) of an mlp node, None where not
    asked. ``state``: the node's ctx (the Function's, or the C++ node's per-node state object),
    which keeps what a create_graph pass recomputed for the later passes. Tanh in plain autograd
    builds it from the layers' kept outputs (``_autograd``: one layer chains through the tanh
    layers below it; a stack); everything else, and tanh where there is nothing to build from,
    takes mlp_first_order."""
    grads = None
    if act == "tanh" and _plain_autograd():
        if one_tanh_layer(act, len(weights), last_activation):
            bias = biases[0] if biases else None
            mask = [need_x, bool(need_w[0]), bool(need_b) and bool(need_b[0])]
            r = _first_order_from(state, grad_out, x, weights[0], bias, mask)
            if r is not None:
                grads = (r[0], [r[1]], [r[2]] if bias is not None else [])
        else:
            grads = _tanh_stack_first_order(state, grad_out, x, weights, biases, has_bias,
                                            last_activation, need_x, need_w, need_b)
    if grads is None:
        grads = mlp_first_order(grad_out, x, weights, biases, has_bias, act, last_activation,
                                need_x, need_w, need_b)
    return grads


def mlp_first_order(grad_out, x, weights, biases, has_bias, act, last_activation, need_x, need_w,
                    need_b):
    """(grad_x?, [grad_W_i?] per layer, [grad_b_j?] per bias) of mlp, each None where not asked:
    the C++ mlp_backward, or where that does not apply the composite (torch.func) or per-layer
    nodes (create_graph). ``act``: the op's activation argument; ``biases``: the compact list."""
    weights = list(weights)
    # torch.func: the composite, which the transforms see through. relu with create_graph too:
    # its derivative is piecewise constant, so what stock autograd keeps for the orders above
    # is already less than what per-layer nodes keep.
    if not _plain_autograd() or (act == "relu" and torch.is_grad_enabled()):
        backward = mlp_backward_composite
    elif torch.is_grad_enabled():  # create_graph: per-layer nodes, for the orders above
        backward = create_graph_backward
    else:
        gx, gw_asked, gb_asked = _OPS.mlp_backward.default(
            grad_out, x, weights, list(biases), list(has_bias), act, last_activation, need_x,
            list(need_w), list(need_b))
        it_w, it_b = iter(gw_asked), iter(gb_asked)
        return ((gx if need_x else None), [next(it_w) if n else None for n in need_w],
                [next(it_b) if n else None for n in need_b])
    gx, gw, gb = backward(grad_out, x, weights, _layer_biases(list(biases), has_bias),
                          layer_activations(act, len(weights)), last_activation, need_x, need_w,
                          _layer_biases(list(need_b), has_bias))
    return gx, gw, [g for g, hb in zip(gb, has_bias) if hb]


# ---- the Functions -----------------------------------------------------------------------------

def _split(ctx, params):
    L = len(ctx.has_bias)
    return list(params[:L]), _layer_biases(params[L:], ctx.has_bias)


class _Mlp(_SingleLevelFunction):
    """mlp; keeps (x, weights, biases). apply(x, *weights, *biases, has_bias, activation,
    last_activation): the tensors first, where the node's edges (one per tensor input) line up
    with the inputs, as _needed reads them."""

    @staticmethod
    def forward(x, *rest):
        *params, has_bias, act, last_activation = rest
        L = len(has_bias)
        return _below_autograd(_OPS.mlp.default, x, params[:L], params[L:], list(has_bias), act,
                               last_activation)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _note_tensor_inputs(ctx, inputs)
        x, *params, has_bias, act, last_activation = inputs
        ctx.save_for_backward(x, *params)
        ctx.save_for_forward(x, *params)
        ctx.has_bias, ctx.act, ctx.last = tuple(has_bias), act, bool(last_activation)
        ctx.acts = layer_activations(act, len(has_bias))
        # a chain of one-tanh-layer nodes is recomputed as one (_autograd._tanh_layer_below)
        ctx.one_tanh_layer = one_tanh_layer(act, len(has_bias), last_activation)

    @staticmethod
    def backward(ctx, grad_out):
        x, *params = ctx.saved_tensors
        L = len(ctx.has_bias)
        need = _needed(ctx, 1 + len(params))
        gx, gw, gb = first_order(ctx, grad_out, x, params[:L], params[L:], ctx.has_bias, ctx.act,
                                 ctx.last, need[0], need[1:1 + L], need[1 + L:])
        return (gx, *gw, *gb, None, None, None)

    @staticmethod
    def jvp(ctx, x_t, *rest):
        param_t = rest[:-3]
        x, *params = ctx.saved_tensors
        weights, layer_b = _split(ctx, params)
        L = len(weights)
        return _mlp_jvp(x, weights, layer_b, ctx.acts, ctx.last, x_t, list(param_t[:L]),
                        _layer_biases(param_t[L:], ctx.has_bias))


# ---- one layer's steps, for the composite ------------------------------------------------------

def _linear_backward(mask, g, a, weight):
    """(g·W, gᵀ·a, Σ g) of z = a·Wᵀ + b for g the gradient w.r.t. z, each where mask says."""
    return (g @ weight if mask[0] else None, _flat(g).t() @ _flat(a) if mask[1] else None,
            _flat(g).sum(0) if mask[2] else None)


def _apply_mlp(x, weights, biases, has_bias, act, last_activation):
    return _Mlp.apply(x, *weights, *biases, tuple(has_bias), act, bool(last_activation))


# record_node: the C++ node (csrc/autograd_node.cpp; its Python side in _autograd_node.py).
_register_autograd_kernel("mlp", _apply_mlp, _C._mlp_with_node)

