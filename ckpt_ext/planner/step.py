"""The training step the planner plans for: ``loss_fn(model(*inputs))`` (or ``model(**inputs)``)
and its backward, with the default loss, the checks of what a caller hands in, and
:func:`measure_step`, that step measured by ``ckpt_ext.memory.measured_step`` (the figure a
plan's budget bounds)."""
from __future__ import annotations

import gc
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from ..memory import MemoryMeter, clear_grads, measured_step

Inputs = Union[tuple, dict]


def check_inputs(where: str, example_inputs: Any) -> None:
    if not isinstance(example_inputs, (tuple, dict)):
        raise TypeError(f"{where}: example_inputs must be a tuple of positional arguments or a "
                        f"dict of keyword arguments for model(...), got "
                        f"{type(example_inputs).__name__}")


def describe_inputs(inputs: Inputs) -> str:
    """What was given as inputs, for a message: a tensor's shape and dtype, a plain value's repr,
    another object's type."""
    def one(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"{str(v.dtype).replace('torch.', '')} tensor {tuple(v.shape)}"
        if v is None or isinstance(v, (bool, int, float, str)):
            return repr(v)
        return type(v).__name__
    if isinstance(inputs, dict):
        return "a dict: " + ", ".join(f"{k}={one(v)}" for k, v in inputs.items()) \
            if inputs else "an empty dict"
    return "a tuple: " + ", ".join(one(v) for v in inputs) if inputs else "an empty tuple"


def inputs_error(where: str, inputs: Inputs, error: Exception) -> Exception:
    """The error for inputs the model cannot take (its forward raised ``error`` on them): a
    TypeError where the call's arguments were refused, else a ValueError."""
    spelled = "model(**example_inputs)" if isinstance(inputs, dict) else "model(*example_inputs)"
    kind = TypeError if isinstance(error, TypeError) else ValueError
    return kind(f"{where}: the model cannot take example_inputs ({describe_inputs(inputs)}): "
                f"{spelled} raised {type(error).__name__}: {error}")


def call(model: nn.Module, inputs: Inputs) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def first_floating(out: Any) -> Optional[torch.Tensor]:
    """The first floating tensor of a model's output: the output itself, the first of a tuple,
    list or dict (depth first), of a transformers ``ModelOutput`` (its fields in order: ``loss``
    where labels were given, else ``logits`` / ``last_hidden_state``), or its ``.logits`` /
    ``.last_hidden_state``."""
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    to_tuple = getattr(out, "to_tuple", None)
    if callable(to_tuple):
        out = to_tuple()
    if isinstance(out, dict):
        out = tuple(out.values())
    if isinstance(out, (tuple, list)):
        for item in out:
            found = first_floating(item)
            if found is not None:
                return found
        return None
    for name in ("logits", "last_hidden_state"):
        found = getattr(out, name, None)
        if isinstance(found, torch.Tensor) and found.is_floating_point():
            return found
    return None


def default_loss(out: Any) -> torch.Tensor:
    """The sum of the output's first floating tensor (:func:`first_floating`)."""
    t = first_floating(out)
    if t is None:
        raise ValueError(f"ckpt_ext.plan: the model's output ({type(out).__name__}) holds no "
                         f"floating tensor to sum as the default loss; pass loss_fn")
    return t.sum()


def loss_of(loss_fn: Optional[Callable], out: Any) -> torch.Tensor:
    loss = (loss_fn or default_loss)(out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        what = (f"a tensor of shape {tuple(loss.shape)}, requires_grad={loss.requires_grad}"
                if isinstance(loss, torch.Tensor) else type(loss).__name__)
        raise ValueError(f"ckpt_ext.plan: loss_fn(output) must return a scalar tensor that "
                         f"requires grad, got {what}")
    return loss


def model_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def measure_step(model: nn.Module, example_inputs: Inputs,
                 loss_fn: Optional[Callable] = None) -> dict:
    """One training step of ``model`` measured by ``ckpt_ext.memory.measured_step`` on the
    model's device (gradients cleared first): its ``peak_above_before_forward`` is what a plan's
    ``peak_bytes`` predicts and its budget bounds, ``kept_for_backward`` what ``kept_bytes``
    predicts."""
    check_inputs("ckpt_ext.planner.measure_step", example_inputs)
    clear_grads(model)
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with MemoryMeter(model_device(model)) as meter:
            return measured_step(lambda inputs: call(model, inputs), example_inputs, meter,
                                 loss_fn=lambda out, _: loss_of(loss_fn, out))
    finally:
        if was_enabled:
            gc.enable()
