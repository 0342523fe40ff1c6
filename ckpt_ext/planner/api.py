"""``ckpt_ext.plan(model, example_inputs, budget_bytes)`` (or ``step=``): the least recompute whose
training step fits a memory budget; ``ckpt_ext.max_batch(model, make_inputs, budget_bytes)`` (or
``make_step=``): the largest batch whose planned step fits. Checks what callers hand in, runs the
probes, solves. Design and usage: docs/plan.md."""
from __future__ import annotations

import math
from typing import Any, Callable, Optional, Tuple

import torch
from torch import nn

from .batch import largest_batch
from .choose import choice_for, choose, least_peak_choice, plan_of, survey_step
from .compiled import (FRACTIONS, MAX_CHECKS, checked_step, compile_budget_fit, compiled_figures,
                       compiled_flops, without_graph_breaks)
from .figures import raised
from .measure import figures_of
from .probe import Probe
from .result import Plan
from .step import check_form, closure_step, inputs_step, model_device, training_step
from .units import Option, find_units

Step = Callable[[nn.Module], torch.Tensor]

#: The share of the budget a compiled plan keeps below it after a check that did not fit, on top
#: of that check's excess.
MARGIN = 0.01


def check_model(where: str, model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where} expects an nn.Module, got {type(model).__name__}")


def check_budget(where: str, budget_bytes: Any, first: Any, step: Any, step_name: str) -> None:
    """``first``: what came as the second argument; a budget there with a step is named."""
    if budget_bytes is None:
        hint = f" ({first!r} came as the second argument: pass budget_bytes=... with " \
               f"{step_name})" if step is not None and isinstance(first, int) else ""
        raise TypeError(f"{where}: budget_bytes is required: an int (bytes), got none{hint}")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
        raise TypeError(f"{where}: budget_bytes must be an int (bytes), got "
                        f"{type(budget_bytes).__name__}")
    if budget_bytes <= 0:
        raise ValueError(f"{where}: budget_bytes must be > 0, got {budget_bytes}")


def plan(model: nn.Module, example_inputs=None, budget_bytes: Optional[int] = None, *,
         loss_fn: Optional[Callable] = None, step: Optional[Step] = None,
         compiled: bool = False) -> Plan:
    """The option per unit (a row of the options table: ``none``, ``fuse``, ``checkpoint``,
    ``pointwise``, ``fuse+pointwise``, ``fuse+checkpoint``) for which a training step of
    ``model`` peaks within ``budget_bytes`` at the least added FLOPs.

    The step is given in one of two forms. ``example_inputs``: a tuple of positional arguments or
    a dict of keyword arguments for ``model(...)``; ``loss_fn(output)`` gives the scalar loss
    (default: the sum of the output's first floating tensor: ``.loss`` where labels were given,
    else ``.logits`` / ``.last_hidden_state``). Or ``step``: ``step(m) -> loss``, the forward
    and scalar loss of one training step of the module ``m`` it is handed (a trainer's own,
    ``lambda m: trainer.compute_loss(m, dict(batch))``); the planner runs the backward. The
    budget bounds the step's peak tensor bytes above what was allocated before it, as
    ``ckpt_ext.memory.measured_step`` reports it. A probe step per option on a copy sharing the
    model's parameters (plain, then every unit under each option, each after a FLOP-counted one)
    gives each unit's bytes and FLOPs under each option; the choice is exact. With
    ``compiled=True`` the budget bounds the compiled step (``Plan.compile``): compiled probe
    steps (one per option) predict it, the choice's compiled step is measured within the budget
    (as inductor is configured, or with its buffer reuse off: ``Plan.compile_options``), and
    where torch.compile's own ``activation_memory_budget`` also fits and its step is faster, the
    plan takes that instead (compiled.py). Nothing in the model changes: its gradients, buffers
    and the RNG are as they were. ``ValueError`` when no choice fits, naming the least budget
    that does; an error naming ``example_inputs`` when the model cannot take them, or ``step``
    when it raises; ``RuntimeError`` when the probe step runs the model's own units instead of
    the copy's, or none, naming them."""
    where = "ckpt_ext.plan"
    check_model(where, model)
    check_budget(where, budget_bytes, example_inputs, step, "step")
    how = training_step(where, example_inputs, loss_fn, step)
    if compiled:
        return plan_compiled(model, how, budget_bytes, where)
    fig, units, notes, spread, device = survey_step(model, how, where=where)
    return choose(fig, units, notes, spread, budget_bytes, str(device))


def plan_compiled(model: nn.Module, how, budget: int, where: str) -> Plan:
    """``plan(..., compiled=True)``: the eager probes (units, options, FLOPs), the compiled
    probes; the plan's own choice measured compiled until it fits; where plain's compiled step
    does not fit, compile's own budget that fits, and of the two that fit, the faster step
    (compiled.py)."""
    device = model_device(model)
    units, notes = find_units(model)
    units = without_graph_breaks(units)
    with Probe(model, how, device, where) as probe:
        fig, units, notes, spread = figures_of(probe, units, notes)
        cfig, _ = compiled_figures(probe, fig, units)
        n = len(units)
        if budget >= cfig.plain_peak:  # plain's compiled step fits: nothing to recompute
            mine = ((Option.NONE,) * n, {"peak": cfig.plain_peak, "kept": cfig.plain_kept}, {})
            theirs = None
        else:
            mine = _checked_choice(probe, units, cfig, budget)
            theirs = compile_budget_fit(probe, units, budget)
        if mine is None and theirs is None:
            choice_for(cfig, budget)  # none predicted to fit: the error names the least
            raise ValueError(f"{where}: no compiled plan measured within the budget of "
                             f"{budget:,} bytes after {MAX_CHECKS} compiled checks, and no "
                             f"activation_memory_budget of torch.compile's in {FRACTIONS}")
        timed = {}
        if mine is not None and "seconds" in mine[1]:
            timed["plan"] = mine[1]["seconds"]
        if theirs is not None:
            timed[f"activation_memory_budget {theirs[0]:g}"] = theirs[1]["seconds"]
        if theirs is not None and (mine is None or theirs[1]["seconds"] < mine[1]["seconds"]):
            choice, got, fraction, inductor = (Option.NONE,) * n, theirs[1], theirs[0], {}
            probe.configure(units, choice)
            flops = compiled_flops(probe.copy, probe.run, fraction)
        else:
            (choice, got, inductor), fraction, flops = mine, None, None
    p = plan_of(cfig, units, notes, spread, budget, str(device), choice)
    # the check measured this very configuration compiled: the figures to promise
    p.compiled, p.peak_bytes, p.kept_bytes = True, got["peak"], got["kept"]
    p.measured_peak_bytes, p.compile_memory_budget = got["peak"], fraction
    p.compile_options = inductor
    p.least_peak_bytes = min(p.least_peak_bytes, got["peak"])  # the sums' least, or measured
    p.compiled_seconds = timed
    if flops is not None:
        p.added_flops = flops - p.plain_flops
    return p


def _checked_choice(probe: Probe, units, cfig, budget: int):
    """(choice, its timed compiled step, inductor's options it ran under) of the least FLOPs
    predicted to fit ``budget`` and measured within it compiled (``checked_step``; the budget
    lowered by each check's excess and a margin, at most MAX_CHECKS checks), or None."""
    excess, checked = 0, {}
    for _ in range(MAX_CHECKS):
        try:
            choice = choice_for(raised(cfig, excess), budget)
        except ValueError:  # kept below by the excess, none fits: the least peak's choice
            choice = least_peak_choice(cfig)
        if choice not in checked:
            checked[choice] = checked_step(probe, units, choice, budget)
        got, inductor = checked[choice]
        if got["peak"] <= budget:
            return choice, got, inductor
        # the sums were that far off: keep as much again below, and a margin of MARGIN
        excess += got["peak"] - budget + math.ceil(MARGIN * budget)
    return None


def max_batch(model: nn.Module, make_inputs: Optional[Callable[[int], object]] = None,
              budget_bytes: Optional[int] = None, *, loss_fn: Optional[Callable] = None,
              make_step: Optional[Callable[[int], Step]] = None) -> Tuple[int, Plan]:
    """``(n, plan)``: the largest batch ``n`` whose planned step fits ``budget_bytes``, and that
    plan. ``make_inputs(n)`` gives the example inputs for batch n, or ``make_step(n)`` the step
    (as ``plan`` takes them). The figures of a few probe steps at small batches are fitted
    against n (every figure a line in n); no step runs at a batch that was not predicted to fit,
    and none is retried."""
    where = "ckpt_ext.max_batch"
    check_model(where, model)
    check_budget(where, budget_bytes, make_inputs, make_step, "make_step")
    check_form(where, make_inputs, loss_fn, make_step, "make_inputs", "make_step")
    for name, made in (("make_inputs", make_inputs), ("make_step", make_step)):
        if made is not None and not callable(made):
            raise TypeError(f"{where}: {name} must be callable (n -> "
                            f"{'example inputs' if name == 'make_inputs' else 'a step'}), got "
                            f"{type(made).__name__}")

    def make(n: int):
        if make_step is None:
            at = f"{where}: make_inputs({n})"
            return at, inputs_step(at, make_inputs(n), loss_fn)
        at = f"{where}: make_step({n})"
        return at, closure_step(at, make_step(n))

    return largest_batch(model, make, budget_bytes)
