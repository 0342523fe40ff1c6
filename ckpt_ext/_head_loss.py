"""A causal LM's head and loss fused (the plan's ``fused loss`` option): the loss's gradient made in
its forward (``_linear_cross_entropy``), so the step keeps neither the log-softmax of the logits nor
their gradient. Set on the user's own objects, as a checkpointed block's forward is:
:class:`HeadForward` is the ``forward`` set on the head's instance (``F.linear``, as
``nn.Linear``'s, noting its input and output), :class:`FusedLoss` the model's ``loss_function``
(transformers' setter): given the very logits the head just made, the fused loss; given any
other, transformers' own, counted and warned. ``ckpt_ext.unfuse`` takes both out
(:func:`undo_head_losses`). Which models: :func:`head_refusal`. Design: docs/plan.md, "The head's
loss"."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ._linear_cross_entropy import linear_cross_entropy
from ._unit_stats import SetByFuse, UnitStats

_NONE = "none"  # the model had no loss_function of its own
_NOT_ITS_LOGITS = ("the loss was handed logits other than the head's output just made (changed "
                   "after the head, or the head not called), so transformers' own loss ran")
_NOT_CONSUMED = ("the head's output of a step with gradients never reached the model's loss "
                 "(no labels?), so it was held until the next call")


def _causal_lm_loss():
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return None
    return ForCausalLMLoss


def head_of(model: nn.Module) -> Tuple[str, Optional[nn.Module]]:
    """(path, module) of the model's output embeddings (transformers' ``get_output_embeddings``),
    or ("", None)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Module):
        return "", None
    for path, m in model.named_modules():
        if m is head:
            return path, head
    return "", None


def head_refusal(model: nn.Module) -> Optional[str]:
    """None where the model's head and loss can be fused, else why not."""
    path, head = head_of(model)
    if head is None:
        return "the model has no output embeddings (transformers' get_output_embeddings)"
    if type(head) is not nn.Linear:
        return f"its head {path} is a {type(head).__name__}, not an nn.Linear"
    if "forward" in vars(head):
        return f"{path} has a forward set on its instance"
    sharding = _sharding(head.weight)
    if sharding is not None:
        return (f"{path}'s weight is sharded by {sharding}: whole only inside the head's "
                f"forward, not at the loss after it")
    wanted = _causal_lm_loss()
    try:
        loss = model.loss_function
    except AttributeError:
        loss = None
    if wanted is None or loss is not wanted:
        return (f"its loss_function is {getattr(loss, '__name__', type(loss).__name__)}, not "
                f"transformers' ForCausalLMLoss")
    return None


def _sharding(weight: torch.Tensor) -> Optional[str]:
    """The engine that shards ``weight`` between forwards, or None."""
    if getattr(weight, "ds_id", None) is not None:
        return "DeepSpeed ZeRO-3"
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return "FSDP2" if isinstance(weight, DTensor) else None


class HeadForward(SetByFuse):
    """The forward set on the head's instance: ``F.linear(x, weight, bias)``; with gradients
    recorded, it notes (x, output) for the loss that follows. Counts: ``ckpt_ext.stats``."""

    def __init__(self, head: nn.Module, path: str) -> None:
        self.head, self.path = head, path
        self.pending: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self.__dict__["_ckpt_ext_stats"] = UnitStats(path, (path, "loss"))

    @property
    def runs(self):  # what ckpt_ext.stats counts
        return (self,)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        head = self.head
        out = F.linear(x, head.weight, head.bias)
        if torch.is_grad_enabled():
            if self.pending is not None:
                self.__dict__["_ckpt_ext_stats"].unfused(_NOT_CONSUMED)
            self.pending = (x, out)
        return out

    def taken(self, logits: torch.Tensor) -> Optional[torch.Tensor]:
        """The head's input behind ``logits`` when they are its output just made, else None (the
        note dropped either way)."""
        pending, self.pending = self.pending, None
        if pending is None or pending[1] is not logits:
            return None
        return pending[0]

    def __getstate__(self):
        return {"head": self.head, "path": self.path}

    def __setstate__(self, state):
        self.__init__(state["head"], state["path"])


class FusedLoss:
    """The ``loss_function`` set on the model: transformers' ``ForCausalLMLoss`` (its arguments,
    its figures), the head and loss fused when handed the head's output just made."""

    def __init__(self, forward: HeadForward, replaced) -> None:
        self.forward = forward
        self.replaced = replaced  # the model's own ``_loss_function`` it had, or _NONE

    @property
    def __name__(self) -> str:
        return "ForCausalLMLoss (ckpt_ext: head and loss fused)"

    def __call__(self, logits, labels, vocab_size: int, num_items_in_batch=None,
                 ignore_index: int = -100, shift_labels=None, **kwargs):
        forward = self.forward
        x = forward.taken(logits) if torch.is_grad_enabled() else None
        stats = forward.__dict__["_ckpt_ext_stats"]
        if x is None:
            if torch.is_grad_enabled():
                stats.unfused(_NOT_ITS_LOGITS)
            return _causal_lm_loss()(logits, labels, vocab_size, num_items_in_batch,
                                     ignore_index, shift_labels, **kwargs)
        stats.fused()
        if shift_labels is None:
            labels = F.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:].contiguous()
        head = forward.head
        return linear_cross_entropy(x.reshape(-1, x.shape[-1]), head.weight, head.bias,
                                    logits.reshape(-1, vocab_size),
                                    shift_labels.reshape(-1).to(logits.device), ignore_index,
                                    num_items_in_batch)


def fuse_head_loss(model: nn.Module) -> None:
    """Fuse ``model``'s head and loss (ValueError naming why where :func:`head_refusal` does)."""
    why = head_refusal(model)
    if why is not None:
        raise ValueError(f"ckpt_ext: cannot fuse the head and loss: {why}")
    path, head = head_of(model)
    forward = HeadForward(head, path)
    vars(head)["forward"] = forward
    model.loss_function = FusedLoss(forward, vars(model).get("_loss_function", _NONE))


def is_head_fused(m: nn.Module) -> bool:
    return isinstance(vars(m).get("forward"), HeadForward) or \
        isinstance(vars(m).get("_loss_function"), FusedLoss)


def undo_head_losses(model: nn.Module) -> None:
    """Take every :class:`HeadForward` and :class:`FusedLoss` out of ``model``."""
    for m in model.modules():
        if isinstance(vars(m).get("forward"), HeadForward):
            del vars(m)["forward"]
        fused = vars(m).get("_loss_function")
        if isinstance(fused, FusedLoss):
            if fused.replaced is _NONE:
                del vars(m)["_loss_function"]
            else:
                vars(m)["_loss_function"] = fused.replaced
