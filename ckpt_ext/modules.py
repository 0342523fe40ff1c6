"""Drop-in modules built on the fused op."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .ops import linear_tanh


class FusedLinearTanh(nn.Module):
    """``nn.Sequential(nn.Linear(in_features, out_features), nn.Tanh())`` in one module whose
    backward recomputes the activation instead of keeping it.

    Parameters are named ``weight`` (out_features, in_features) and ``bias`` (out_features) and are
    initialised exactly as ``nn.Linear`` does (same seed, same values). It deliberately does not
    subclass ``nn.Linear``: tools that replace every ``nn.Linear`` (quantizers, LoRA injectors)
    would otherwise swap it for a plain Linear and silently drop the tanh.
    """

    __constants__ = ["in_features", "out_features"]

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty((out_features, in_features), **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's own initialisation, called on our parameters: the same RNG draws in the same
        # order, so a seeded FusedLinearTanh equals a seeded nn.Linear.
        nn.Linear.reset_parameters(self)  # type: ignore[arg-type]

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "FusedLinearTanh":
        """A FusedLinearTanh that shares (not copies) ``linear``'s parameters, so an optimizer
        built over the Linear keeps updating them."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear expects an nn.Linear, got {type(linear).__name__}")
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.in_features = linear.in_features
        m.out_features = linear.out_features
        m.weight = linear.weight
        if linear.bias is not None:
            m.bias = linear.bias
        else:
            m.register_parameter("bias", None)
        return m

    def forward(self, x: Tensor) -> Tensor:
        return linear_tanh(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")
