"""A block recomputed by stock non-reentrant ``torch.utils.checkpoint``, set on the user's own
object: :class:`CheckpointedForward` is the ``forward`` set on the block's instance (its class,
keys and parameters untouched; hooks on the block run around it, outside the checkpoint, as
transformers' gradient checkpointing runs them). ``ckpt_ext.plan(...).apply`` sets it,
``ckpt_ext.unfuse`` takes it out (:func:`undo_checkpoints`). Design: docs/plan.md."""
from __future__ import annotations

import functools
import inspect
from typing import Dict

import torch
import torch.utils.checkpoint
from torch import nn

#: Keyword arguments that hand a block a KV cache it updates: a recompute would update it twice.
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")


def cache_argument(kwargs: Dict[str, object]) -> str:
    """The first keyword argument that hands a cache to a block (``use_cache=True`` or a cache
    object), or ""."""
    if kwargs.get("use_cache"):
        return "use_cache=True"
    for name in CACHE_ARGUMENTS:
        if kwargs.get(name) is not None:
            return f"{name}={type(kwargs[name]).__name__}"
    return ""


class CheckpointedForward:
    """The forward set on a checkpointed block's instance: ``checkpoint(type(block).forward,
    block, *args, use_reentrant=False, **kwargs)`` while gradients are recorded; the class's
    forward as it is when they are not (no backward to recompute for), under ``torch.jit``
    tracing, or when the call hands the block a cache (generation: a recompute would update the
    cache twice). Pickles and deep-copies with its block."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block

    def __call__(self, *args, **kwargs):
        block = self.block
        forward = type(block).forward
        if not torch.is_grad_enabled() or torch.jit.is_tracing() or cache_argument(kwargs):
            return forward(block, *args, **kwargs)
        # keywords bound first: none can collide with checkpoint's own (use_reentrant, ...)
        return torch.utils.checkpoint.checkpoint(functools.partial(forward, block, **kwargs),
                                                 *args, use_reentrant=False)

    @property
    def __signature__(self) -> inspect.Signature:  # the class's, for libraries that look
        sig = inspect.signature(type(self.block).forward)
        return sig.replace(parameters=list(sig.parameters.values())[1:])

    def __getstate__(self):
        return {"block": self.block}

    def __setstate__(self, state):
        self.block = state["block"]


def checkpoint_block(block: nn.Module) -> None:
    """Recompute ``block`` in backward from its inputs (see :class:`CheckpointedForward`)."""
    vars(block)["forward"] = CheckpointedForward(block)


def is_checkpointed(block: nn.Module) -> bool:
    return isinstance(vars(block).get("forward"), CheckpointedForward)


def undo_checkpoints(model: nn.Module) -> None:
    """Take every :class:`CheckpointedForward` out of ``model`` (its blocks compute as their
    class does again)."""
    for m in model.modules():
        if is_checkpointed(m):
            del vars(m)["forward"]
