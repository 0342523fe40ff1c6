"""``ckpt_ext.plan(model, example_inputs, budget_bytes)``: the least recompute whose training step
fits a memory budget; ``ckpt_ext.max_batch(model, make_inputs, budget_bytes)``: the largest batch
whose planned step fits. Checks what callers hand in, runs the probes, solves. Design and usage:
docs/plan.md."""
from __future__ import annotations

from typing import Callable, Optional, Tuple

from torch import nn

from .batch import largest_batch
from .choose import choose, survey
from .result import Plan
from .step import check_inputs


def check_common(where: str, model, budget_bytes, loss_fn) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where} expects an nn.Module, got {type(model).__name__}")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
        raise TypeError(f"{where}: budget_bytes must be an int (bytes), got "
                        f"{type(budget_bytes).__name__}")
    if budget_bytes <= 0:
        raise ValueError(f"{where}: budget_bytes must be > 0, got {budget_bytes}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"{where}: loss_fn must be callable (output -> scalar) or None, got "
                        f"{type(loss_fn).__name__}")


def plan(model: nn.Module, example_inputs, budget_bytes: int, *,
         loss_fn: Optional[Callable] = None) -> Plan:
    """The option per unit (``none``, ``fuse`` or ``checkpoint``) for which a training step of
    ``model`` on ``example_inputs`` peaks within ``budget_bytes`` at the least added FLOPs.

    ``example_inputs``: a tuple of positional arguments or a dict of keyword arguments for
    ``model(...)``; ``loss_fn(output)`` gives the scalar loss (default: the sum of the output's
    first floating tensor: ``.loss`` where labels were given, else ``.logits`` /
    ``.last_hidden_state``). The budget bounds the step's peak tensor bytes above what was
    allocated before it, as ``ckpt_ext.memory.measured_step`` reports it. Three probe steps on a
    copy sharing the model's parameters (plain, every unit fused, every block checkpointed, each
    after a FLOP-counted one) give each unit's bytes and FLOPs under each option; the choice is
    exact. Nothing in the model changes: its gradients, buffers and the RNG are as they were.
    ``ValueError`` when no choice fits, naming the least budget that does; an error naming
    ``example_inputs`` when the model cannot take them; ``RuntimeError`` when the probe step runs
    the model's own units instead of the copy's, or none, naming them."""
    where = "ckpt_ext.plan"
    check_common(where, model, budget_bytes, loss_fn)
    check_inputs(where, example_inputs)
    fig, units, notes, spread, device = survey(model, example_inputs, loss_fn)
    return choose(fig, units, notes, spread, budget_bytes, str(device))


def max_batch(model: nn.Module, make_inputs: Callable[[int], object], budget_bytes: int, *,
              loss_fn: Optional[Callable] = None) -> Tuple[int, Plan]:
    """``(n, plan)``: the largest batch ``n`` whose planned step fits ``budget_bytes``, and that
    plan. ``make_inputs(n)`` gives the example inputs for batch n (as ``plan`` takes them). The
    figures of a few probe steps at small batches are fitted against n (every figure a line in
    n); no step runs at a batch that was not predicted to fit, and none is retried."""
    where = "ckpt_ext.max_batch"
    check_common(where, model, budget_bytes, loss_fn)
    if not callable(make_inputs):
        raise TypeError(f"{where}: make_inputs must be callable (n -> example inputs), got "
                        f"{type(make_inputs).__name__}")
    return largest_batch(model, make_inputs, budget_bytes, loss_fn)
