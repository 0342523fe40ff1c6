"""The fused Linear+Tanh op: public function, fake kernel and autograd, side by side.

The kernels are C++/CUDA ops registered with the dispatcher under ``torch.ops.ckpt_ext`` (see
``csrc/linear_tanh.cpp``). This file adds what PyTorch needs around them:

* a fake kernel for each op, so FakeTensor / ``torch.compile`` can trace shapes without running a
  kernel (and reject bad input at trace time with the same message as the C++ checks);
* the autograd formula, which saves only ``x`` and references to ``weight`` and ``bias``; backward
  recomputes the activation inside ``linear_tanh_backward``.
"""
from __future__ import annotations

import math

from typing import Optional, Sequence

import torch
from torch import Tensor

from . import _C  # noqa: F401  (loading the library registers torch.ops.ckpt_ext.*)

_SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def linear_tanh(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``tanh(x @ weight.T + bias)`` that keeps only ``x`` for backward.

    x: (..., in_features); weight: (out_features, in_features); bias: (out_features,) or None.
    Returns (..., out_features). Backward recomputes ``x @ weight.T + bias`` instead of saving the
    activation, trading one GEMM for ``batch x out_features`` elements of memory.
    """
    return torch.ops.ckpt_ext.linear_tanh.default(x, weight, bias)


# ------------------------------------------------------------------------------------------------
# Input checks for the fake kernels. Eager calls are checked in C++ (csrc/linear_tanh.cpp); these
# mirror those messages so a traced program fails the same way, at trace time.

def _dtype_name(dtype: torch.dtype) -> str:
    # c10 prints ScalarType names (Float, Double, BFloat16, Half, Long, ...)
    return {
        torch.float32: "Float", torch.float64: "Double", torch.bfloat16: "BFloat16",
        torch.float16: "Half", torch.int64: "Long", torch.int32: "Int", torch.int16: "Short",
        torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool",
        torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
    }.get(dtype, str(dtype))


def _shape(t: Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _check_inputs(op: str, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> None:
    p = f"ckpt_ext.{op}: "
    if x.dim() < 1:
        raise ValueError(p + "x must have shape (..., in_features) with at least 1 dimension, "
                         "got a 0-d tensor")
    if weight.dim() != 2:
        raise ValueError(p + "weight must be 2-D (out_features, in_features), got shape "
                         + _shape(weight))
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(p + f"x.shape[-1] must equal weight.shape[1] (in_features) = "
                         f"{weight.shape[1]}, got x of shape {_shape(x)} and weight of shape "
                         f"{_shape(weight)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(p + f"bias must have shape [{weight.shape[0]}] (out_features), got "
                         f"shape {_shape(bias)}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(p + "x must be float32, float64, bfloat16 or float16, got "
                        + _dtype_name(x.dtype))
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != x.dtype:
            raise TypeError(p + f"{name} must have the dtype of x ({_dtype_name(x.dtype)}), got "
                            f"{_dtype_name(t.dtype)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(p + f"{name} must be on the device of x ({x.device}), got "
                             f"{t.device}")


def _check_grad_out(op: str, grad_out: Tensor, x: Tensor, weight: Tensor) -> None:
    p = f"ckpt_ext.{op}: "
    expected = [*x.shape[:-1], weight.shape[0]]
    if list(grad_out.shape) != expected:
        raise ValueError(p + f"grad_out must have shape [{', '.join(map(str, expected))}], got "
                         + _shape(grad_out))
    if grad_out.dtype != x.dtype:
        raise TypeError(p + f"grad_out must have the dtype of x ({_dtype_name(x.dtype)}), got "
                        f"{_dtype_name(grad_out.dtype)}")
    if grad_out.device != x.device:
        raise ValueError(p + f"grad_out must be on the device of x ({x.device}), got "
                         f"{grad_out.device}")


# ------------------------------------------------------------------------------------------------
# Fake kernels: shapes, dtypes and strides of what the C++ ops return (all freshly allocated and
# contiguous), so torch.compile can trace through the ops without graph breaks.

@torch.library.register_fake("ckpt_ext::linear_tanh")
def _linear_tanh_fake(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    _check_inputs("linear_tanh", x, weight, bias)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("ckpt_ext::linear_tanh_backward")
def _linear_tanh_backward_fake(grad_out: Tensor, x: Tensor, weight: Tensor,
                               bias: Optional[Tensor], output_mask: Sequence[bool]):
    _check_inputs("linear_tanh_backward", x, weight, bias)
    _check_grad_out("linear_tanh_backward", grad_out, x, weight)
    grad_x = x.new_empty(x.shape) if output_mask[0] else None
    grad_w = weight.new_empty(weight.shape) if output_mask[1] else None
    grad_b = x.new_empty((weight.shape[0],)) if output_mask[2] and bias is not None else None
    return grad_x, grad_w, grad_b


# ------------------------------------------------------------------------------------------------
# Autograd: this is where the memory is saved. Only x is kept (weight and bias are parameters the
# model holds anyway); nothing of size batch x out_features survives the forward.

def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight, bias)


def _backward(ctx, grad_out: Tensor):
    x, weight, bias = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    if torch.is_grad_enabled():
        # create_graph=True (double backward, e.g. physics-informed losses): build the gradient
        # from differentiable ops, the fused forward among them, so it can be differentiated again.
        y = linear_tanh(x, weight, bias)
        g = grad_out * (1 - y * y)
        rows = math.prod(x.shape[:-1])  # not reshape(-1, ...): -1 is ambiguous for 0 features
        g2 = g.reshape(rows, weight.shape[0])
        grad_x = (g2 @ weight).reshape(x.shape) if need_x else None
        grad_w = g2.t() @ x.reshape(rows, weight.shape[1]) if need_w else None
        grad_b = g2.sum(0) if need_b and bias is not None else None
        return grad_x, grad_w, grad_b
    return torch.ops.ckpt_ext.linear_tanh_backward.default(
        grad_out, x, weight, bias, [need_x, need_w, need_b and bias is not None])


torch.library.register_autograd(
    "ckpt_ext::linear_tanh", _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------------
# FLOP formulas for torch.utils.flop_counter.FlopCounterMode (the counter torch.compile's tooling
# and MFU estimates use). Without them the custom ops count as 0 FLOPs. Like aten::addmm, only the
# GEMMs count (2·M·K·N each); tanh and the bias are not counted. The backward counts its recompute:
# 2·M·K·N for x·Wᵀ again, plus 2·M·K·N for each of grad_x and grad_W that output_mask asks for.
import torch.utils.flop_counter  # noqa: E402  (not imported by `import torch`)


def _gemm_flops(x_shape, w_shape) -> int:
    m = 1
    for s in x_shape[:-1]:
        m *= s
    n, k = w_shape
    return 2 * m * k * n


@torch.utils.flop_counter.register_flop_formula(torch.ops.ckpt_ext.linear_tanh)
def _linear_tanh_flop(x_shape, w_shape, *args, **kwargs) -> int:
    return _gemm_flops(x_shape, w_shape)


@torch.utils.flop_counter.register_flop_formula(torch.ops.ckpt_ext.linear_tanh_backward)
def _linear_tanh_backward_flop(grad_out_shape, x_shape, w_shape, bias_shape, output_mask,
                               *args, **kwargs) -> int:
    return _gemm_flops(x_shape, w_shape) * (1 + int(output_mask[0]) + int(output_mask[1]))
