"""Pointwise recompute: a block under torch's selective activation checkpointing
(``torch.utils.checkpoint`` with ``create_selective_checkpoint_contexts``) whose policy saves the
outputs of every GEMM, attention and ``ckpt_ext`` op and recomputes the rest (norms, activations,
products, rotary embeddings) in backward: no GEMM runs twice, so ``FlopCounterMode`` counts no
added FLOPs. Random ops are recomputed too, and checkpoint restores the RNG state for the
recompute, so dropout draws the same masks. Set on the block's instance as
:class:`PointwiseCheckpointedForward`, a :class:`~ckpt_ext._block_checkpoint.CheckpointedForward`
(so ``ckpt_ext.unfuse`` takes it out and the checks that refuse a checkpointed block refuse it)."""
from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .._block_checkpoint import CheckpointedForward, cache_argument

aten = torch.ops.aten

#: The ops whose outputs a pointwise recompute keeps: GEMMs and attention, what FlopCounterMode
#: counts (recomputing any of them would add FLOPs).
SAVED_OPS = frozenset(op for op in (
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten.linear.default, aten._grouped_mm.default if hasattr(aten, "_grouped_mm") else None,
    aten.convolution.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten.scaled_dot_product_attention.default,
) if op is not None)


def save_gemms_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep what a GEMM, attention or one of ckpt_ext's own ops (a fused MLP: it recomputes
    what it needs itself) computes; recompute the rest."""
    if op in SAVED_OPS or getattr(op, "namespace", "") == "ckpt_ext":
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def pointwise_context():
    return create_selective_checkpoint_contexts(save_gemms_policy)


class PointwiseCheckpointedForward(CheckpointedForward):
    """The forward set on a block's instance for pointwise recompute: as
    :class:`CheckpointedForward`, with the policy :func:`save_gemms_policy`."""

    def __call__(self, *args, **kwargs):
        block = self.block
        forward = type(block).forward
        if not torch.is_grad_enabled() or torch.jit.is_tracing() or cache_argument(kwargs):
            return forward(block, *args, **kwargs)
        return torch.utils.checkpoint.checkpoint(functools.partial(forward, block, **kwargs),
                                                 *args, use_reentrant=False,
                                                 context_fn=pointwise_context)


def pointwise_block(block: nn.Module) -> None:
    """Recompute ``block``'s pointwise work in backward (see
    :class:`PointwiseCheckpointedForward`)."""
    vars(block)["forward"] = PointwiseCheckpointedForward(block)
