"""``max_batch``: the largest batch whose planned step fits a budget, from probes at a few small
batches. Every figure of the step (each segment's growth and excess, each unit's FLOPs) is a
line in the batch size n for models whose tensors grow with n, so two probes give the figures at
any n; the largest n whose least peak fits is found by bisection on those lines. A first pair of
probes at n = 1 and 2 gives an estimate n₀; a second pair at about n₀/4 and n₀/2 (no larger than
what the plain step is predicted to fit) gives the lines used, away from small-batch effects
(per-thread scratch, kernels chosen by size). The plan found is applied and measured at its
batch, and lowered where it does not fit (:func:`_checked`). No step runs at a batch not
predicted to fit."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Tuple

from torch import nn

from .choose import choice_for, least_peak, plan_of, survey_step
from .figures import HeadFigures, OptionFigures, StepFigures, raised, simulate
from .probe import Probe
from .result import Plan
from .step import TrainingStep
from .units import Option, find_units

#: The largest batch searched for.
MAX_N = 1 << 40
#: Planned steps measured at the batch found before giving up.
MAX_CHECKS = 4


def _line(a: int, b: int, na: int, nb: int, n: int) -> int:
    """The value at n of the line through (na, a) and (nb, b), rounded up."""
    return math.ceil(a + (b - a) * (n - na) / (nb - na))


def figures_at(fa: StepFigures, fb: StepFigures, na: int, nb: int, n: int) -> StepFigures:
    """Every figure at batch n, on the line through its values at na and nb."""
    def line(x, y):
        return _line(x, y, na, nb, n)

    units = [{o: OptionFigures(*(line(getattr(ua[o], k), getattr(ub[o], k))
                                 for k in OptionFigures.__dataclass_fields__))
              for o in ua} for ua, ub in zip(fa.units, fb.units)]
    return replace(fa, first_excess=line(fa.first_excess, fb.first_excess),
                   first_growth=line(fa.first_growth, fb.first_growth),
                   gaps=[(line(ga[0], gb[0]), line(ga[1], gb[1]))
                         for ga, gb in zip(fa.gaps, fb.gaps)],
                   head_excess=line(fa.head_excess, fb.head_excess),
                   head_growth=line(fa.head_growth, fb.head_growth),
                   head_kept=line(fa.head_kept, fb.head_kept),
                   other_flops=line(fa.other_flops, fb.other_flops),
                   plain_peak=line(fa.plain_peak, fb.plain_peak),
                   plain_kept=line(fa.plain_kept, fb.plain_kept), units=units,
                   heads={o: HeadFigures(*(line(getattr(h, k), getattr(fb.heads[o], k))
                                           for k in HeadFigures.__dataclass_fields__))
                          for o, h in fa.heads.items()})


def _largest(fits: Callable[[int], bool]) -> int:
    """The largest n >= 1 with fits(n), for fits true at 1 and false from some n on."""
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > MAX_N:
            raise ValueError(f"ckpt_ext.max_batch: the step's least peak does not grow with the "
                             f"batch (it fits at n = {lo:,}): no largest batch")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def largest_batch(model: nn.Module, make: Callable[[int], Tuple[str, TrainingStep]],
                  budget: int) -> Tuple[int, Plan]:
    """``make(n)``: the step at batch n, and the words that begin its errors."""
    found = find_units(model)

    def probe(n: int):
        where, step = make(n)
        return survey_step(model, step, found, where)

    points = {1: probe(1), 2: probe(2)}
    fig1, units, notes, spread, device = points[1]
    least1 = least_peak(fig1)
    if least1 > budget:
        raise ValueError(f"ckpt_ext.max_batch: even a batch of 1 needs {least1:,} bytes with the "
                         f"least recompute, above the budget of {budget:,} bytes")

    def lines(na: int, nb: int):
        fa, ua = points[na][0], points[na][1]
        fb, ub = points[nb][0], points[nb][1]
        if [(u.path, u.options) for u in ua] != [(u.path, u.options) for u in ub] or \
                set(fa.heads) != set(fb.heads):
            raise RuntimeError(f"ckpt_ext.max_batch: the units differ between batches {na} and "
                               f"{nb}: {[u.path for u in ua]} against {[u.path for u in ub]}")
        return lambda n: figures_at(fa, fb, na, nb, n)

    at = lines(1, 2)
    estimate = _largest(lambda n: least_peak(at(n)) <= budget)
    plain_fits = _largest(lambda n: simulate(at(n), [Option.NONE] * len(units)).peak <= budget) \
        if simulate(fig1, [Option.NONE] * len(units)).peak <= budget else 1
    nb = min(estimate // 2, plain_fits)
    na = nb // 2
    if na > 2:
        points[na], points[nb] = probe(na), probe(nb)
        at = lines(na, nb)
        units, notes, spread = points[nb][1], points[nb][2], points[nb][3]
        estimate = _largest(lambda n: least_peak(at(n)) <= budget)
    return _checked(model, make, at, estimate, (units, notes, spread, device), budget)


def _checked(model: nn.Module, make, at, n: int, surveyed, budget: int) -> Tuple[int, Plan]:
    """The batch and plan whose step, applied and measured at that batch, fits ``budget``: the
    lines from small batches can fall short where a kernel's scratch grows faster at larger ones
    (a fused MLP's backward below 4 x 64 tokens). Each check that does not fit raises every
    prediction by its excess, then the batch is the largest whose raised least peak fits (the
    step measured is the one predicted to fit: nothing runs above the budget by more than the
    lines fell short)."""
    units, notes, spread, device = surveyed
    excess = 0
    for _ in range(MAX_CHECKS):
        fig = raised(at(n), excess)
        if least_peak(fig) > budget:
            n = _largest(lambda k: least_peak(raised(at(k), excess)) <= budget)
            fig = raised(at(n), excess)
        choice = choice_for(fig, budget)
        where, step = make(n)
        with Probe(model, step, device, where) as probe:
            probe.configure(units, choice)
            measured = max(m.peak for m in probe.step(units, count_flops=False).marks)
        if measured <= budget:
            p = plan_of(fig, units, notes, spread, budget, str(device), choice)
            p.measured_peak_bytes = measured
            return n, p
        excess += measured - budget
    raise RuntimeError(f"ckpt_ext.max_batch: the planned step measured above the budget of "
                       f"{budget:,} bytes after {MAX_CHECKS} checks (the last at a batch of {n})")
