"""The one plain-PyTorch reference every test compares against, and the error measure."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

# Relative-error bounds against the float64 reference, per dtype of the computation.
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def linear_tanh_ref(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """tanh(x @ weight.T + bias), computed by stock PyTorch in float64."""
    return torch.tanh(F.linear(x.double(), weight.double(),
                               None if bias is None else bias.double()))


def linear_tanh_ref_grads(x, weight, bias, grad_out):
    """Output and (grad_x, grad_weight, grad_bias) of the float64 reference, computed on the CPU
    whatever the inputs' device (the CUDA tests compare against it too)."""
    xs = x.detach().double().cpu().requires_grad_()
    ws = weight.detach().double().cpu().requires_grad_()
    bs = None if bias is None else bias.detach().double().cpu().requires_grad_()
    y = linear_tanh_ref(xs, ws, bs)
    y.backward(grad_out.detach().double().cpu())
    return y.detach(), xs.grad, ws.grad, (None if bs is None else bs.grad)


def rel_err(out: Tensor, ref: Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64, on out's device (no copy of a large GPU result); inf when
    out has a NaN/inf or the shapes differ, so a non-finite result can never pass a bound."""
    if out.shape != ref.shape:
        return math.inf
    out = out.detach().double()
    ref = ref.detach().to(out.device, torch.float64)
    if not torch.isfinite(out).all():
        return math.inf
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    if denom == 0.0:
        return diff  # an all-zero reference (e.g. 0 rows): the output must be zero too
    return diff / denom
