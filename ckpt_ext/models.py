"""The benchmark's networks, each in three modes: ``plain``, ``checkpoint`` and ``fused``.

* :class:`Net` is the write-up's network: ``linear1 = Linear(1024, 10240)`` then ``block1..block3``,
  each ``Sequential(Linear(10240, 10240), Tanh())``, loss ``output.mean()`` on a (512, 1024) input.
  ``checkpoint`` wraps every block but the last in ``torch.utils.checkpoint.checkpoint`` (block1 and
  block2 at the write-up's depth of 3), exactly as the write-up does. ``fused`` runs every block as
  :class:`~ckpt_ext.FusedLinearTanh`.
* :class:`ResidualNet`: ``h = h + tanh(Linear(h))`` per block. Here the residual stream ``h`` is
  what a block needs anyway, so a block that keeps only ``h`` keeps half of what plain keeps.
* :class:`MLPNet`: ``h = h + Linear(4H, H)(tanh(Linear(H, 4H)(h)))`` per block (a transformer MLP
  with tanh). Plain keeps ``h`` and the (M, 4H) activation; recomputation keeps only ``h``.

Weights are initialised by ``nn.Linear``'s own initialisation in every mode and the ``state_dict``
keys are the same in every mode (``block1.0.weight``, ``blocks.0.fc1.weight``, ...), so models built
from the same seed, or loaded from one another's ``state_dict``, compute the same function.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .modules import FusedLinearTanh
from .ops import linear_tanh

MODES = ("plain", "checkpoint", "fused")


def _check_mode(mode: str, use_reentrant: bool) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if not isinstance(use_reentrant, bool):
        raise TypeError(f"use_reentrant must be a bool, got {type(use_reentrant).__name__}")


def _linear_tanh_block(mode: str, features: int, device, dtype) -> nn.Sequential:
    # Fused blocks stay Sequentials whose [0] holds weight and bias, so state_dict keys
    # (block1.0.weight) match plain and one model loads the other's weights. Identity keeps the
    # length and indexing of the plain Sequential(Linear, Tanh).
    if mode == "fused":
        return nn.Sequential(FusedLinearTanh(features, features, device=device, dtype=dtype),
                             nn.Identity())
    return nn.Sequential(nn.Linear(features, features, device=device, dtype=dtype), nn.Tanh())


class _CheckpointMixin:
    mode: str
    use_reentrant: bool

    def _run(self, block: nn.Module, h: Tensor, recompute: bool) -> Tensor:
        if recompute and self.mode == "checkpoint" and torch.is_grad_enabled():
            # use_reentrant is always passed: torch warns when it is left out, and the two
            # variants keep different things (reentrant re-runs under its own autograd graph).
            return checkpoint(block, h, use_reentrant=self.use_reentrant)
        return block(h)


class Net(_CheckpointMixin, nn.Module):
    """The write-up's chain ``linear1 -> block1 -> block2 -> block3`` (``depth`` blocks).

    ``mode="checkpoint"`` checkpoints block1 .. block{depth-1} (not the last block, as in the
    write-up); ``use_reentrant`` picks the variant of ``torch.utils.checkpoint``.
    """

    def __init__(self, in_features: int = 1024, hidden: int = 10240, depth: int = 3,
                 mode: str = "plain", use_reentrant: bool = False, device=None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        _check_mode(mode, use_reentrant)
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.mode, self.use_reentrant, self.depth = mode, use_reentrant, depth
        self.linear1 = nn.Linear(in_features, hidden, device=device, dtype=dtype)
        for i in range(1, depth + 1):
            setattr(self, f"block{i}", _linear_tanh_block(mode, hidden, device, dtype))

    def blocks(self) -> list[nn.Module]:
        return [getattr(self, f"block{i}") for i in range(1, self.depth + 1)]

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear1(x)
        for i, block in enumerate(self.blocks(), start=1):
            h = self._run(block, h, recompute=i < self.depth)
        return h


class _ResidualStack(_CheckpointMixin, nn.Module):
    """``h = linear1(x)``, then per block ``h = h + block(h)``; every block is recomputed in
    ``checkpoint`` mode. Subclasses say what a block is."""

    def __init__(self, in_features: int, hidden: int, depth: int, mode: str, use_reentrant: bool,
                 make_block, device=None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        _check_mode(mode, use_reentrant)
        self.mode, self.use_reentrant = mode, use_reentrant
        # linear1 first, then the blocks: the order the parameters draw from the RNG
        self.linear1 = nn.Linear(in_features, hidden, device=device, dtype=dtype)
        self.blocks = nn.ModuleList(make_block() for _ in range(depth))

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear1(x)
        for block in self.blocks:
            h = h + self._run(block, h, recompute=True)
        return h


class ResidualNet(_ResidualStack):
    """``h = linear1(x)``, then per block ``h = h + tanh(Linear(h))``; every block is
    checkpointed in ``checkpoint`` mode and fused in ``fused`` mode."""

    def __init__(self, in_features: int = 1024, hidden: int = 10240, depth: int = 3,
                 mode: str = "plain", use_reentrant: bool = False, device=None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(in_features, hidden, depth, mode, use_reentrant,
                         lambda: _linear_tanh_block(mode, hidden, device, dtype), device, dtype)


# ------------------------------------------------------------------------------------------------
# The fused MLP block. Swapping fc1+tanh for FusedLinearTanh alone saves nothing here: fc2 keeps
# its input u = tanh(fc1(h)) for its weight gradient, and u is exactly what plain Tanh keeps. So the
# fused block keeps only h and rebuilds u in backward with our op:
#   forward : u = linear_tanh(h, W1, b1); y = u·W2ᵀ + b2            saves h (and the parameters)
#   backward: du = dy·W2
#             dh, dW1, db1 = linear_tanh_backward(du, h, W1, b1)   (recompute 1: the fc1 GEMM)
#             u = linear_tanh(h, W1, b1); dW2 = dyᵀ·u; db2 = Σdy    (recompute 2: the fc1 GEMM)
# Two recomputed GEMMs of the fc1 size; checkpoint recomputes fc1 and fc2, the same FLOPs. The
# order keeps at most two (M, ratio*H) buffers alive at once (du and the op's g; later u alone),
# where checkpoint holds three in tanh's backward (u, du and the gradient of fc1's output).
class _FusedMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(h: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor,
                b2: Optional[Tensor]) -> Tensor:
        return F.linear(linear_tanh(h, w1, b1), w2, b2)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: Tensor):
        h, w1, b1, w2, b2 = ctx.saved_tensors
        need_h, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad
        dy2 = dy.reshape(-1, w2.shape[0])
        du = (dy2 @ w2).reshape(*h.shape[:-1], w2.shape[1])
        dh, dw1, db1 = torch.ops.ckpt_ext.linear_tanh_backward.default(
            du, h, w1, b1, [need_h, need_w1, need_b1 and b1 is not None])
        del du
        dw2 = dy2.t() @ linear_tanh(h, w1, b1).reshape(-1, w2.shape[1]) if need_w2 else None
        db2 = dy2.sum(0) if need_b2 and b2 is not None else None
        return dh, dw1, db1, dw2, db2


class MLPBlock(nn.Module):
    """``fc2(tanh(fc1(h)))`` with fc1: H -> ratio*H, fc2: ratio*H -> H (the residual add is in
    :class:`MLPNet`). In ``fused`` mode fc1 is a :class:`FusedLinearTanh` and the whole block keeps
    only its input (see ``_FusedMLPFunction``)."""

    def __init__(self, hidden: int, ratio: int, fused: bool, device=None, dtype=None) -> None:
        super().__init__()
        self.fused = fused
        inner = ratio * hidden
        self.fc1 = (FusedLinearTanh(hidden, inner, device=device, dtype=dtype) if fused
                    else nn.Linear(hidden, inner, device=device, dtype=dtype))
        self.fc2 = nn.Linear(inner, hidden, device=device, dtype=dtype)

    def forward(self, h: Tensor) -> Tensor:
        if self.fused:
            return _FusedMLPFunction.apply(h, self.fc1.weight, self.fc1.bias, self.fc2.weight,
                                           self.fc2.bias)
        return self.fc2(torch.tanh(self.fc1(h)))


class MLPNet(_ResidualStack):
    """``h = linear1(x)``, then per block ``h = h + MLPBlock(h)``; every block is checkpointed in
    ``checkpoint`` mode and fused in ``fused`` mode."""

    def __init__(self, in_features: int = 1024, hidden: int = 10240, depth: int = 3,
                 mode: str = "plain", use_reentrant: bool = False, ratio: int = 4, device=None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(in_features, hidden, depth, mode, use_reentrant,
                         lambda: MLPBlock(hidden, ratio, mode == "fused", device, dtype),
                         device, dtype)


NETWORKS = {"chain": Net, "residual": ResidualNet, "mlp": MLPNet}
