"""The training step the planner plans for, in one of two forms with one protocol: example inputs
and a loss (:class:`InputsStep`: ``loss_fn(model(*inputs))`` or ``model(**inputs)``), or the
caller's own step (:class:`ClosureStep`: ``step(m) -> loss``, as a trainer's ``compute_loss``);
the planner runs the backward. Also the default loss, the checks of what a caller hands in
(:func:`training_step`), and :func:`measure_step`, a step measured by
``ckpt_ext.memory.measured_step`` (the figure a plan's budget bounds)."""
from __future__ import annotations

import gc
from typing import Any, Callable, List, Optional, Union

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


def refusal(what: str, error: Exception) -> Exception:
    """The error for a first step that raised ``error``: ``what`` and the error after it; a
    TypeError where a call refused its arguments, else a ValueError."""
    kind = TypeError if isinstance(error, TypeError) else ValueError
    return kind(f"{what} raised {type(error).__name__}: {error}")


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


def checked_loss(where: str, what: str, loss: Any) -> torch.Tensor:
    """``loss`` (what ``what`` returned) if it is a scalar tensor that requires grad."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        got = (f"a tensor of shape {tuple(loss.shape)}, requires_grad={loss.requires_grad}"
               if isinstance(loss, torch.Tensor) else type(loss).__name__)
        raise ValueError(f"{where}: {what} must return a scalar tensor that requires grad, got "
                         f"{got}")
    return loss


def loss_of(loss_fn: Optional[Callable], out: Any, where: str = "ckpt_ext.plan") -> torch.Tensor:
    return checked_loss(where, "loss_fn(output)", (loss_fn or default_loss)(out))


# ------------------------------------------------------------------------------------------------
# The two forms of a step. Each: forward(m) (what the step computes before its loss is checked),
# loss(out, where), refused(where, error) (the error of a first step that raised), leaves() (leaf
# tensors handed in that require grad), rebound(rebind) (the step called on the probe's copy),
# and why its units could not be measured: escaped (it ran the model's own), none_ran.

class InputsStep:
    """``loss_fn(model(*inputs))`` or ``loss_fn(model(**inputs))`` (default loss:
    :func:`default_loss`)."""
    escaped = ("a forward or hook reaches the model's own modules through an object the copy "
               "cannot rebind (a trainer's state, a global). Plan the model before that forward "
               "is set (the plan applies to the model afterwards)")
    none_ran = "the model's forward does not call them on these inputs"

    def __init__(self, inputs: Inputs, loss_fn: Optional[Callable] = None) -> None:
        self.inputs, self.loss_fn = inputs, loss_fn

    def forward(self, m: nn.Module) -> Any:
        return call(m, self.inputs)

    def loss(self, out: Any, where: str) -> torch.Tensor:
        return loss_of(self.loss_fn, out, where)

    def refused(self, where: str, error: Exception) -> Exception:
        spelled = "model(**example_inputs)" if isinstance(self.inputs, dict) else \
            "model(*example_inputs)"
        return refusal(f"{where}: the model cannot take example_inputs "
                       f"({describe_inputs(self.inputs)}): {spelled}", error)

    def leaves(self) -> List[torch.Tensor]:
        values = self.inputs.values() if isinstance(self.inputs, dict) else self.inputs
        return [v for v in values if isinstance(v, torch.Tensor) and v.requires_grad and v.is_leaf]

    def rebound(self, rebind: Callable[[Any], Any]) -> "InputsStep":
        return self


class ClosureStep:
    """The caller's ``step(m) -> loss``: one step's forward and scalar loss for the module ``m``
    it is handed."""
    escaped = ("step(m), or a forward or hook on its way, reaches the model's own modules "
               "through an object the copy cannot rebind (a trainer's state, a global): have "
               "step call the module m it is handed, and plan the model before such a forward "
               "is set (the plan applies to the model afterwards)")
    none_ran = "step(m) does not call them in the module m it is handed"

    def __init__(self, step: Callable[[nn.Module], torch.Tensor]) -> None:
        self.step = step

    def forward(self, m: nn.Module) -> Any:
        return self.step(m)

    def loss(self, out: Any, where: str) -> torch.Tensor:
        return checked_loss(where, "step(model)", out)

    def refused(self, where: str, error: Exception) -> Exception:
        return refusal(f"{where}: step(model)", error)

    def leaves(self) -> List[torch.Tensor]:
        return []

    def rebound(self, rebind: Callable[[Any], Any]) -> "ClosureStep":
        """This step with every object of the model it reaches (through its closure, defaults,
        bound instance, a partial's arguments) replaced by the copy's (rebind.py)."""
        return ClosureStep(rebind(self.step))


TrainingStep = Union[InputsStep, ClosureStep]


def check_form(where: str, inputs: Any, loss_fn: Any, step: Any,
               inputs_name: str = "example_inputs", step_name: str = "step") -> None:
    """Exactly one of ``inputs`` (with an optional callable ``loss_fn``) or ``step`` given."""
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"{where}: loss_fn must be callable (output -> scalar) or None, got "
                        f"{type(loss_fn).__name__}")
    if inputs is None and step is None:
        raise TypeError(f"{where}: expects {inputs_name} or {step_name}, got neither")
    if inputs is not None and step is not None:
        raise TypeError(f"{where}: expects {inputs_name} or {step_name}, not both (got "
                        f"{inputs_name} of type {type(inputs).__name__} and {step_name})")
    if step is not None and loss_fn is not None:
        raise TypeError(f"{where}: loss_fn goes with {inputs_name}; with {step_name} the step "
                        f"computes its own loss")


def inputs_step(where: str, example_inputs: Any, loss_fn: Optional[Callable]) -> InputsStep:
    check_inputs(where, example_inputs)
    return InputsStep(example_inputs, loss_fn)


def closure_step(where: str, step: Any) -> ClosureStep:
    if not callable(step):
        raise TypeError(f"{where}: step must be callable (model -> scalar loss tensor), got "
                        f"{type(step).__name__}")
    return ClosureStep(step)


def training_step(where: str, example_inputs: Any, loss_fn: Any, step: Any) -> TrainingStep:
    """The step of what a caller handed in (:func:`check_form`), checked before anything
    runs."""
    check_form(where, example_inputs, loss_fn, step)
    return inputs_step(where, example_inputs, loss_fn) if step is None else \
        closure_step(where, step)


def model_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def measure_step(model: nn.Module, example_inputs: Optional[Inputs] = None,
                 loss_fn: Optional[Callable] = None, *,
                 step: Optional[Callable[[nn.Module], torch.Tensor]] = None) -> dict:
    """One training step of ``model`` (on ``example_inputs`` with ``loss_fn``, or ``step(model)``
    and its backward) measured by ``ckpt_ext.memory.measured_step`` on the model's device
    (gradients cleared first): its ``peak_above_before_forward`` is what a plan's ``peak_bytes``
    predicts and its budget bounds, ``kept_for_backward`` what ``kept_bytes`` predicts."""
    where = "ckpt_ext.planner.measure_step"
    how = training_step(where, example_inputs, loss_fn, step)
    clear_grads(model)
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with MemoryMeter(model_device(model)) as meter:
            return measured_step(lambda _: how.forward(model), None, meter,
                                 loss_fn=lambda out, _: how.loss(out, where))
    finally:
        if was_enabled:
            gc.enable()
