"""The activations of :func:`ckpt_ext.mlp` on the Python side: their names (read from the C++
library, csrc/checks.cpp), f(z) and gy·f'(z) from ATen's own ops (differentiable again, and
batched by vmap), and the ``nn`` module that computes each (recognising one is the converter's
job: ckpt_ext/convert/activations.py). The kernels' formulas: csrc/activations.h."""
from __future__ import annotations

from typing import Callable, Dict

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
    "sin": (torch.sin, lambda gy, z: gy * torch.cos(z)),
    "relu": (torch.relu, lambda gy, z: _ATEN.threshold_backward(gy, z, 0)),
}


def _silu_backward(gy, z):
    # aten.silu_backward's own formula, spelled in ops autograd can differentiate again (it cannot
    # differentiate silu_backward itself).
    s = torch.sigmoid(z)
    return gy * s * (1 + z * (1 - s))


assert set(_FORMULAS) == set(ACTIVATIONS), "a formula for every activation of the C++ library"


def check_activation(name, where: str) -> str:
    if not isinstance(name, str) or name not in _FORMULAS:
        raise ValueError(f"{where}: activation must be one of "
                         f"{', '.join(repr(a) for a in ACTIVATIONS)}; got {name!r}")
    return name


def activate(name: str, z: Tensor) -> Tensor:
    """f(z)."""
    return _FORMULAS[name][0](z)


def activation_backward(name: str, gy: Tensor, z: Tensor) -> Tensor:
    """gy·f'(z), elementwise: the backward through f, and the forward-mode tangent of f(z) for a
    tangent gy of z."""
    return _FORMULAS[name][1](gy, z)


#: The module of each activation, as FusedMLP's equivalent nn.Sequential holds it (sin has none).
MODULE_OF: Dict[str, Callable[[], nn.Module]] = {
    "tanh": nn.Tanh, "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": nn.SiLU, "sigmoid": nn.Sigmoid, "softplus": nn.Softplus, "relu": nn.ReLU,
}
