"""The orders above the first of a tanh layer, from its output, as differentiable ops: every order
above the first is an op with its own backward, so a graph built with create_graph=True keeps op
inputs, never intermediates (docs/design.md, "Higher orders"). Each op gets a single-level
Function (forward, setup_context, backward, jvp) applied by its Autograd kernel; the formulas are
in ``_derivatives``.
"""
from __future__ import annotations

import torch
from torch.autograd.function import _SingleLevelFunction

from ._autograd import (_below_autograd, _needed, _note_tensor_inputs,
                        _register_autograd_kernel)
from ._derivatives import _OPS, _add, _flat, _from_output_backward_vjp, _result_like


class _LinearTanhBackwardFromOutput(_SingleLevelFunction):
    """linear_tanh_backward_from_output(grad_out, x, t, W, b, mask) -> (grad_x, grad_W, grad_b):
    g = grad_out·(1 − t²), grad_x = g·W, grad_W = gᵀ·x, grad_b = Σ g, with t an input. Keeps
    (grad_out, x, t, W); backward = linear_tanh_backward_from_output_backward (nothing
    recomputed). b only says whether grad_b is made: no gradient flows into it here (it reaches b
    through t's node)."""

    @staticmethod
    def forward(grad_out, x, output, weight, bias, output_mask):
        return _below_autograd(_OPS.linear_tanh_backward_from_output.default, grad_out, x, output,
                               weight, bias, output_mask)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _note_tensor_inputs(ctx, inputs)
        grad_out, x, t, weight, bias, output_mask = inputs
        ctx.save_for_backward(grad_out, x, t, weight)
        ctx.save_for_forward(grad_out, x, t, weight)
        ctx.output_mask = [bool(m) for m in output_mask]
        ctx.has_bias = bias is not None
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, ggx, ggw, ggb):
        grad_out, x, t, weight = ctx.saved_tensors
        need = _needed(ctx, 4)  # grad_out, x, t, weight
        # x appears only in grad_W = gᵀ·x, W only in grad_x = g·W (their share through t goes to
        # t's node): without ggW (ggx) their gradient here is zero, so it is not made at all.
        need[1] = need[1] and ggw is not None
        need[3] = need[3] and ggx is not None
        r = _OPS.linear_tanh_backward_from_output_backward.default(
            ggx, ggw, ggb if ctx.has_bias else None, grad_out, x, t, weight, need)
        return r[0], r[1], r[2], r[3], None, None

    @staticmethod
    def jvp(ctx, grad_out_t, x_t, t_t, weight_t, _bias_t, _mask_t):
        # g = gy·s with s = 1 − t²:  ġ = ġy·s − 2·gy·t·ṫ;  then ġx = ġ·W + g·Ẇ,
        # ġW = ġᵀ·x + gᵀ·ẋ, ġb = Σ ġ.
        grad_out, x, t, weight = ctx.saved_tensors
        s = 1 - t * t
        g = grad_out * s
        gdot = None if grad_out_t is None else grad_out_t * s
        if t_t is not None:
            gdot = _add(gdot, -2 * grad_out * t * t_t)
        n, k = weight.shape
        gx = None if gdot is None else gdot @ weight
        if weight_t is not None:
            gx = _add(gx, g @ weight_t)
        gw = None if gdot is None else _flat(gdot).t() @ x.reshape(-1, k)
        if x_t is not None:
            gw = _add(gw, _flat(g).t() @ x_t.reshape(-1, k))
        gb = None if gdot is None else _flat(gdot).sum(0)
        return _result_like((gx, gw, gb), ctx.output_mask,
                            (x, weight, weight[:, 0] if ctx.has_bias else None))


class _LinearTanhBackwardFromOutputBackward(_SingleLevelFunction):
    """The backward of linear_tanh_backward_from_output; keeps its inputs; backward = the CPU
    kernel linear_tanh_backward_from_output_double_backward where no graph is built, else
    _from_output_backward_vjp (ATen ops: differentiable again)."""

    @staticmethod
    def forward(ggx, ggw, ggb, grad_out, x, output, weight, output_mask):
        return _below_autograd(_OPS.linear_tanh_backward_from_output_backward.default, ggx, ggw,
                               ggb, grad_out, x, output, weight, output_mask)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _note_tensor_inputs(ctx, inputs)
        *tensors, output_mask = inputs
        ctx.save_for_backward(*tensors)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, u_gy, u_x, u_t, u_w):
        tensors = ctx.saved_tensors
        need = _needed(ctx, 7)
        if all(u is None for u in (u_gy, u_x, u_t, u_w)):
            return (None,) * 8
        # x and W enter only through dg = ggx·Wᵀ + x·ggWᵀ: without ggW (ggx) their gradient is
        # zero; not made at all.
        need[4] = need[4] and tensors[1] is not None
        need[6] = need[6] and tensors[0] is not None
        if not torch.is_grad_enabled() and tensors[4].device.type == "cpu":
            # The last pass (no graph to build): the fused CPU kernel, one elementwise pass
            # instead of a dozen.
            r = _OPS.linear_tanh_backward_from_output_double_backward.default(
                *tensors, u_gy, u_x, u_t, u_w, need)
            return (*r, None)
        return (*_from_output_backward_vjp(*tensors, u_gy, u_x, u_t, u_w, need), None)


def _apply_backward_from_output(grad_out, x, output, weight, bias, output_mask):
    return _LinearTanhBackwardFromOutput.apply(grad_out, x, output, weight, bias,
                                               tuple(output_mask))


def _apply_from_output_backward(ggx, ggw, ggb, grad_out, x, output, weight, output_mask):
    return _LinearTanhBackwardFromOutputBackward.apply(ggx, ggw, ggb, grad_out, x, output, weight,
                                                       tuple(output_mask))


def _apply_from_output_triple(ggx, ggw, ggb, grad_out, x, output, weight, u_gy, u_x, u_t, u_w,
                              output_mask):
    # The third-order CPU kernel, differentiated: by its ATen composition, which autograd (and
    # torch.func) differentiate to any order.
    mask = [bool(m) for m in output_mask]
    r = _from_output_backward_vjp(ggx, ggw, ggb, grad_out, x, output, weight, u_gy, u_x, u_t, u_w,
                                  mask)
    return _result_like(r, mask, (x, weight, weight[:, 0], grad_out, x, output, weight))


_register_autograd_kernel("linear_tanh_backward_from_output", _apply_backward_from_output)
_register_autograd_kernel("linear_tanh_backward_from_output_backward", _apply_from_output_backward)
_register_autograd_kernel("linear_tanh_backward_from_output_double_backward",
                          _apply_from_output_triple)
