"""The activations of :func:`ckpt_ext.mlp` on the Python side: their names (read from the C++
library, csrc/checks.cpp), f(z) and gy·f'(z) from ATen's own ops (differentiable again, and
batched by vmap), f'(z), f''(z) and f'''(z) for the orders above the first, and the ``nn``
module that computes each (recognising one is the converter's job:
ckpt_ext/convert/activations.py). The kernels' formulas: csrc/activations.h."""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _C

#: The activation names the mlp op takes, in the C++ library's order.
ACTIVATIONS = tuple(_C.ACTIVATIONS)

_ATEN = torch.ops.aten

# name -> (f(z), gy·f'(z)): PyTorch's own forward and backward formulas, so the composite path
# (every order above the first, torch.func) differentiates exactly what autograd would.
_FORMULAS: Dict[str, tuple] = {
    "tanh": (torch.tanh, lambda gy, z: _ATEN.tanh_backward(gy, torch.tanh(z))),
    "gelu": (F.gelu, lambda gy, z: _ATEN.gelu_backward(gy, z)),
    "gelu_tanh": (lambda z: F.gelu(z, approximate="tanh"),
                  lambda gy, z: _ATEN.gelu_backward(gy, z, approximate="tanh")),
    "silu": (F.silu, lambda gy, z: _silu_backward(gy, z)),
    "sigmoid": (torch.sigmoid, lambda gy, z: _ATEN.sigmoid_backward(gy, torch.sigmoid(z))),
    "softplus": (F.softplus, lambda gy, z: _ATEN.softplus_backward(gy, z, 1, 20)),
    "sin": (torch.sin, lambda gy, z: gy * _FIRST["sin"](z)),
    "relu": (torch.relu, lambda gy, z: _ATEN.threshold_backward(gy, z, 0)),
}

# The activations whose derivative PyTorch takes from the output (as stock autograd keeps it):
# given the output, gy·f'(z) reads it instead of z (the output is the next layer's input anyway).
_FROM_OUTPUT = {
    "tanh": lambda gy, out: _ATEN.tanh_backward(gy, out),
    "sigmoid": lambda gy, out: _ATEN.sigmoid_backward(gy, out),
    "relu": lambda gy, out: _ATEN.threshold_backward(gy, out, 0),
}


def _silu_backward(gy, z):
    # aten.silu_backward's own formula, spelled in ops autograd can differentiate again (it cannot
    # differentiate silu_backward itself).
    return gy * _silu_derivative(z)


def _silu_derivative(z):
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


assert set(_FORMULAS) == set(ACTIVATIONS), "a formula for every activation of the C++ library"

# f'(z) as a tensor, for the formulas of the orders above the first: written out where _FORMULAS
# multiplies gy by it, else PyTorch's backward op with gy = 1.
_FIRST = {"sin": torch.cos, "silu": _silu_derivative}


def _higher_derivatives():
    # f''(z) and f'''(z) (third=True), for the second and third orders of the per-layer nodes
    # (the orders above by autograd through these ATen ops). s = sigmoid(z),
    # φ = exp(−z²/2)/√(2π); gelu_tanh with u = k(z + c·z³), th = tanh(u), S = 1 − th²:
    # f'' = S·P with P = u' + z·(u'' − 2·th·u'²)/2, and f''' = S·(P' − 2·th·u'·P) with
    # P' = 3u''/2 − th·u'² + z·(u''' − 2·S·u'³ − 4·th·u'·u'')/2.
    k, c = math.sqrt(2 / math.pi), 0.044715

    def gelu_tanh(z, third):
        th = torch.tanh(k * (z + c * z ** 3))
        du, d2u = k * (1 + 3 * c * z * z), 6 * k * c * z
        sech2 = 1 - th * th
        p = du + 0.5 * z * (d2u - 2 * th * du * du)
        if not third:
            return sech2 * p
        dp = (1.5 * d2u - th * du * du
              + 0.5 * z * (6 * k * c - 2 * sech2 * du ** 3 - 4 * th * du * d2u))
        return sech2 * (dp - 2 * th * du * p)

    def silu(z, third):
        s = torch.sigmoid(z)
        if not third:
            return s * (1 - s) * (2 + z * (1 - 2 * s))
        return s * (1 - s) * ((1 - 2 * s) * (3 + z * (1 - 2 * s)) - 2 * z * s * (1 - s))

    def sigmoid(z, third):
        s = torch.sigmoid(z)
        return s * (1 - s) * ((1 - 6 * s + 6 * s * s) if third else (1 - 2 * s))

    def softplus(z, third):  # f(z) = z above the threshold 20
        s = torch.sigmoid(z)
        return torch.where(z > 20, torch.zeros_like(z), s * (1 - s) * ((1 - 2 * s) if third else 1))

    def tanh(z, third):
        t = torch.tanh(z)
        return (1 - t * t) * ((6 * t * t - 2) if third else -2 * t)

    def gelu(z, third):
        phi = torch.exp(-0.5 * z * z) * (1 / math.sqrt(2 * math.pi))
        return phi * (z * (z * z - 4) if third else (2 - z * z))

    def sin(z, third):
        return (torch.cos(z) if third else torch.sin(z)).neg_()  # one buffer

    return {"tanh": tanh, "gelu": gelu, "gelu_tanh": gelu_tanh, "silu": silu, "sigmoid": sigmoid,
            "softplus": softplus, "sin": sin, "relu": lambda z, third: torch.zeros_like(z)}


_HIGHER = _higher_derivatives()


def derivative(name: str, z: Tensor) -> Tensor:
    """f'(z), from ATen ops."""
    if name in _FIRST:
        return _FIRST[name](z)
    return _FORMULAS[name][1](torch.ones_like(z), z)


def second_derivative(name: str, z: Tensor) -> Tensor:
    """f''(z), from ATen ops."""
    return _HIGHER[name](z, False)


def third_derivative(name: str, z: Tensor) -> Tensor:
    """f'''(z), from ATen ops."""
    return _HIGHER[name](z, True)


def check_activation(name, where: str) -> str:
    if not isinstance(name, str) or name not in _FORMULAS:
        raise ValueError(f"{where}: activation must be one of "
                         f"{', '.join(repr(a) for a in ACTIVATIONS)}; got {name!r}")
    return name


def activate(name: str, z: Tensor) -> Tensor:
    """f(z)."""
    return _FORMULAS[name][0](z)


def activation_backward(name: str, gy: Tensor, z: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """gy·f'(z), elementwise: the backward through f, and the forward-mode tangent of f(z) for a
    tangent gy of z. ``out`` = f(z), where the caller has it: tanh, sigmoid and relu read it."""
    if out is not None and name in _FROM_OUTPUT:
        return _FROM_OUTPUT[name](gy, out)
    return _FORMULAS[name][1](gy, z)


class Sin(nn.Module):
    """``torch.sin`` as a module (PyTorch has none), the activation of SIREN-style networks."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.sin(x)


#: The module of each activation, as FusedMLP's equivalent nn.Sequential holds it.
MODULE_OF: Dict[str, Callable[[], nn.Module]] = {
    "tanh": nn.Tanh, "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": nn.SiLU, "sigmoid": nn.Sigmoid, "softplus": nn.Softplus, "sin": Sin, "relu": nn.ReLU,
}
