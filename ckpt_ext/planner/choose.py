"""From a model and its training step to a plan: the probes' figures (:func:`survey_step`, or
:func:`survey` of example inputs), and the choice for a budget (:func:`choose`), with the least
peak any choice reaches."""
from __future__ import annotations

import math

from torch import nn

from .figures import StepFigures, simulate
from .measure import figures_of
from .result import Plan
from .probe import Probe
from .solver import grouped, solve
from .step import InputsStep, TrainingStep, model_device
from .units import Option, find_units

#: Units whose figures differ by no more than this share of the plain step's peak (and FLOPs by
#: no more than this share of its FLOPs) count as identical for the solver.
TOLERANCE = 1e-4


def survey_step(model: nn.Module, step: TrainingStep, found=None, where="ckpt_ext.plan"):
    """The figures of ``model`` in ``step``: (figures, units, notes, spread, device). ``found``:
    ``find_units(model)`` where the caller has it already; ``where`` begins the probe's
    errors."""
    device = model_device(model)
    units, notes = found if found is not None else find_units(model)
    with Probe(model, step, device, where) as probe:
        fig, units, notes, spread = figures_of(probe, units, notes)
    return fig, units, notes, spread, device


def survey(model: nn.Module, example_inputs, loss_fn, found=None, where="ckpt_ext.plan"):
    """:func:`survey_step` of ``model`` stepping on ``example_inputs`` with ``loss_fn``."""
    return survey_step(model, InputsStep(example_inputs, loss_fn), found, where)


def solver_figures(fig: StepFigures) -> StepFigures:
    plain = simulate(fig, [Option.NONE] * len(fig.units))
    return grouped(fig, math.ceil(TOLERANCE * plain.peak), math.ceil(TOLERANCE * plain.flops))


def least_peak(fig: StepFigures) -> int:
    return solve(solver_figures(fig))[0].peak


def least_peak_choice(fig: StepFigures) -> tuple:
    """The choice of least predicted peak (at the least FLOPs among those)."""
    return solve(solver_figures(fig))[0].choice


def choose(fig: StepFigures, units, notes, spread: int, budget: int, device: str) -> Plan:
    return plan_of(fig, units, notes, spread, budget, device, choice_for(fig, budget))


def choice_for(fig: StepFigures, budget: int, what: str = "") -> tuple:
    """The choice of least FLOPs whose predicted peak is within ``budget``; ``what``: words
    after the least peak in the error where none is."""
    n = len(fig.units)
    plain = simulate(fig, [Option.NONE] * n)
    least = least_peak(fig)
    if budget >= plain.peak:
        return (Option.NONE,) * n  # plain fits: nothing to recompute
    if budget < least:
        raise ValueError(f"ckpt_ext.plan: no plan fits a budget of {budget:,} bytes: the least "
                         f"peak any plan reaches is {least:,} bytes (plain's: {plain.peak:,})"
                         f"{what}; a budget of at least {least:,} bytes fits")
    return solve(solver_figures(fig), budget)[1].choice


def plan_of(fig: StepFigures, units, notes, spread: int, budget: int, device: str,
            choice) -> Plan:
    """The Plan of ``choice``, its figures predicted from ``fig``."""
    n = len(units)
    plain = simulate(fig, [Option.NONE] * n)
    least = least_peak(fig)
    got = simulate(fig, choice)
    choices = {u.path: o.value for u, o in zip(units, choice)}
    if fig.head is not None:
        choices[fig.head.path] = (choice[n] if len(choice) > n else Option.NONE).value
    return Plan(budget_bytes=budget, peak_bytes=got.peak, kept_bytes=got.kept,
                added_flops=got.flops - plain.flops, choices=choices, head=fig.head,
                plain_peak_bytes=plain.peak, plain_kept_bytes=plain.kept, plain_flops=plain.flops,
                least_peak_bytes=min(least, plain.peak), units=list(units), figures=fig.units,
                notes=list(notes), device=device, spread_bytes=spread)
