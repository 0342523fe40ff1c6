"""The fused ops: public functions, autograd and FLOP formulas, side by side.

The kernels are C++/CUDA ops registered with the dispatcher under ``torch.ops.ckpt_ext`` (schemas in
``csrc/linear_tanh.cpp``). The C++ side also registers a Meta kernel per op, which FakeTensor and
``torch.compile`` run; it calls the very checks the eager ops call, so a traced program is rejected
with the eager message and there is no Python copy of the checks to keep in step. This file adds:

* the public functions, :func:`linear_tanh` and :func:`tanh_mlp`;
* the autograd formulas: they save only the input ``x`` and references to the parameters; the
  backward ops recompute the activations;
* FLOP formulas for ``torch.utils.flop_counter``.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _C  # loading the library registers torch.ops.ckpt_ext.*

#: The dtypes the ops accept, read from the C++ library (one list, csrc/linear_tanh.cpp).
SUPPORTED_DTYPES = tuple(getattr(torch, name) for name in _C.SUPPORTED_DTYPES)


def linear_tanh(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``tanh(x @ weight.T + bias)`` that keeps only ``x`` for backward.

    x: (..., in_features); weight: (out_features, in_features); bias: (out_features,) or None.
    Returns (..., out_features). Backward recomputes ``x @ weight.T + bias`` instead of saving the
    activation, trading one GEMM for ``batch x out_features`` elements of memory.
    """
    return torch.ops.ckpt_ext.linear_tanh.default(x, weight, bias)


def tanh_mlp(x: Tensor, weights: Sequence[Tensor],
             biases: Optional[Sequence[Optional[Tensor]]] = None, last_tanh: bool = True) -> Tensor:
    """A whole stack of Linear layers with tanh, kept for backward as its input only.

    ``h = x; for each layer i: h = tanh(h @ weights[i].T + biases[i])``, with no tanh after the last
    layer when ``last_tanh`` is False. ``weights[i]`` is (out_i, in_i) with ``in_0 = x.shape[-1]``
    and ``in_i = out_{i-1}``; ``biases`` is None (no bias anywhere) or one entry per layer, a
    (out_i,) tensor or None. Backward recomputes the stack's activations once and walks the layers
    back, freeing each as soon as it is used; with one layer and ``last_tanh`` it is exactly
    :func:`linear_tanh`.
    """
    weights = list(weights)
    if biases is None:
        biases = [None] * len(weights)
    else:
        biases = list(biases)
        if len(biases) != len(weights):
            raise ValueError(f"ckpt_ext.tanh_mlp: biases must have one entry (a tensor or None) per "
                             f"layer ({len(weights)}), got {len(biases)}")
    has_bias = [b is not None for b in biases]
    return torch.ops.ckpt_ext.tanh_mlp.default(
        x, weights, [b for b in biases if b is not None], has_bias, bool(last_tanh))


# ------------------------------------------------------------------------------------------------
# Autograd: this is where the memory is saved. Only x is kept (weights and biases are parameters the
# model holds anyway); nothing of size batch x out_features survives the forward.
#
# With create_graph=True (double backward, e.g. physics-informed losses) the backward must itself be
# differentiable: it is then built from differentiable ops — the fused forward among them — by
# _differentiable_backward, instead of the backward kernels.

def _rows(x: Tensor) -> int:
    return math.prod(x.shape[:-1])  # not reshape(-1, ...): -1 is ambiguous for 0 features


def _differentiable_backward(grad_out: Tensor, x: Tensor, weights: Sequence[Tensor],
                             biases: Sequence[Optional[Tensor]], last_tanh: bool, need_x: bool,
                             need_w: Sequence[bool], need_b: Sequence[bool]):
    """(grad_x, [grad_W_i], [grad_b_i]) of a stack (biases per layer, None where absent), from ops
    autograd can differentiate again."""
    L = len(weights)
    acts = [x]  # acts[i]: the input of layer i
    for i, (w, b) in enumerate(zip(weights, biases)):
        if i + 1 < L:
            acts.append(linear_tanh(acts[i], w, b))
    rows = _rows(x)
    grad = grad_out
    grads_w: List[Optional[Tensor]] = [None] * L
    grads_b: List[Optional[Tensor]] = [None] * L
    lowest = 0 if need_x else min([i for i in range(L) if need_w[i] or need_b[i]], default=L)
    for i in reversed(range(lowest, L)):
        w, a = weights[i], acts[i]
        if i + 1 < L:
            t = acts[i + 1]
            g = grad * (1 - t * t)
        elif last_tanh:
            t = linear_tanh(a, w, biases[i])
            g = grad * (1 - t * t)
        else:
            g = grad
        g2 = g.reshape(rows, w.shape[0])
        if need_w[i]:
            grads_w[i] = g2.t() @ a.reshape(rows, w.shape[1])
        if need_b[i] and biases[i] is not None:
            grads_b[i] = g2.sum(0)
        if i > lowest or need_x:
            grad = (g2 @ w).reshape(a.shape)
    return (grad if need_x else None), grads_w, grads_b


def _linear_tanh_setup_context(ctx, inputs, output) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight, bias)


def _linear_tanh_backward(ctx, grad_out: Tensor):
    x, weight, bias = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    need_b = need_b and bias is not None
    if torch.is_grad_enabled():
        gx, gw, gb = _differentiable_backward(grad_out, x, [weight], [bias], True, need_x,
                                              [need_w], [need_b])
        return gx, gw[0], gb[0]
    return torch.ops.ckpt_ext.linear_tanh_backward.default(
        grad_out, x, weight, bias, [need_x, need_w, need_b])


torch.library.register_autograd(
    "ckpt_ext::linear_tanh", _linear_tanh_backward, setup_context=_linear_tanh_setup_context)


def _tanh_mlp_setup_context(ctx, inputs, output) -> None:
    x, weights, biases, has_bias, last_tanh = inputs
    ctx.save_for_backward(x, *weights, *biases)
    ctx.num_layers, ctx.has_bias, ctx.last_tanh = len(weights), list(has_bias), last_tanh


def _tanh_mlp_backward(ctx, grad_out: Tensor):
    L, has_bias = ctx.num_layers, ctx.has_bias
    saved = ctx.saved_tensors
    x, weights, biases = saved[0], list(saved[1:1 + L]), list(saved[1 + L:])
    need_x = bool(ctx.needs_input_grad[0])
    need_w = [bool(n) for n in ctx.needs_input_grad[1]]
    need_b = [bool(n) for n in ctx.needs_input_grad[2]]
    if torch.is_grad_enabled():
        it = iter(biases)
        per_layer = [next(it) if hb else None for hb in has_bias]
        it = iter(need_b)
        need_b_layer = [next(it) if hb else False for hb in has_bias]
        gx, gw, gb = _differentiable_backward(grad_out, x, weights, per_layer, ctx.last_tanh,
                                              need_x, need_w, need_b_layer)
        return gx, gw, [g for g, hb in zip(gb, has_bias) if hb], None, None
    gx, gw_asked, gb_asked = torch.ops.ckpt_ext.tanh_mlp_backward.default(
        grad_out, x, weights, biases, has_bias, ctx.last_tanh, need_x, need_w, need_b)
    it_w, it_b = iter(gw_asked), iter(gb_asked)
    gw = [next(it_w) if n else None for n in need_w]
    gb = [next(it_b) if n else None for n in need_b]
    return (gx if need_x else None), gw, gb, None, None


torch.library.register_autograd(
    "ckpt_ext::tanh_mlp", _tanh_mlp_backward, setup_context=_tanh_mlp_setup_context)


# ------------------------------------------------------------------------------------------------
# FLOP formulas for torch.utils.flop_counter.FlopCounterMode (the counter torch.compile's tooling
# and MFU estimates use). Without them the custom ops count as 0 FLOPs. Like aten::addmm, only the
# GEMMs count (2·M·K·N each); tanh and the bias are not counted. A backward counts what it runs:
# the recompute (every layer's forward GEMM but the top one's when last_tanh is False), then per
# layer from the top down to the lowest one with a gradient asked for, grad_W where asked and the
# gradient for the layer below (or grad_x where asked).
import torch.utils.flop_counter  # noqa: E402  (not imported by `import torch`)


def _gemm_flops(x_shape, w_shape) -> int:
    n, k = w_shape
    return 2 * math.prod(x_shape[:-1]) * k * n


def _stack_backward_flops(x_shape, w_shapes, has_bias, last_tanh, need_x, need_w, need_b) -> int:
    L = len(w_shapes)
    it = iter(need_b)
    need_b_layer = [next(it) if hb else False for hb in has_bias]
    lowest = 0 if need_x else min([i for i in range(L) if need_w[i] or need_b_layer[i]], default=L)
    if lowest == L:
        return 0
    per_layer = [_gemm_flops(x_shape, w) for w in w_shapes]  # same M for every layer
    recompute = sum(per_layer[:L - 1]) + (per_layer[L - 1] if last_tanh else 0)
    walk = sum(per_layer[i] * (int(need_w[i]) + int(i > lowest or need_x))
               for i in range(lowest, L))
    return recompute + walk


@torch.utils.flop_counter.register_flop_formula(torch.ops.ckpt_ext.linear_tanh)
def _linear_tanh_flop(x_shape, w_shape, *args, **kwargs) -> int:
    return _gemm_flops(x_shape, w_shape)


@torch.utils.flop_counter.register_flop_formula(torch.ops.ckpt_ext.linear_tanh_backward)
def _linear_tanh_backward_flop(grad_out_shape, x_shape, w_shape, bias_shape, output_mask,
                               *args, **kwargs) -> int:
    has_bias = [bias_shape is not None]
    return _stack_backward_flops(x_shape, [w_shape], has_bias, True, output_mask[0],
                                 [output_mask[1]], [output_mask[2]] if has_bias[0] else [])


@torch.utils.flop_counter.register_flop_formula(torch.ops.ckpt_ext.tanh_mlp)
def _tanh_mlp_flop(x_shape, w_shapes, *args, **kwargs) -> int:
    return sum(_gemm_flops(x_shape, w) for w in w_shapes)


@torch.utils.flop_counter.register_flop_formula(torch.ops.ckpt_ext.tanh_mlp_backward)
def _tanh_mlp_backward_flop(grad_out_shape, x_shape, w_shapes, b_shapes, has_bias, last_tanh,
                            need_x, need_weights, need_biases, *args, **kwargs) -> int:
    return _stack_backward_flops(x_shape, w_shapes, has_bias, last_tanh, need_x, need_weights,
                                 need_biases)
