"""The step's memory as a chain of units, from the probe steps' marks, and its prediction for any
choice of options.

The step is cut at the marks into segments: before the first unit; per unit i its forward
(``pre i`` -> ``post i``), the gap to the next unit, and its backward (``grad i`` -> ``grad i-1``,
the last one to ``end``); between the last unit's forward and its backward, the head (the rest of
the forward, the loss, the backward up to the last unit's output). A segment's figures are its
*growth* (bytes at its end minus at its start) and its *excess* (its peak minus its start). A
unit's segments depend on its own option only and a gap's, the head's and the first segment's on
none, so a choice's memory at every mark is a sum of growths, and its peak the largest mark plus
excess (:func:`simulate`). The head's figures are its option's (``heads``: measured with every
unit ``none``); a choice names it after the units' options, or leaves it ``none``. Why this holds
and where it does not: docs/plan.md, "The memory model"."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

from .probe import StepTrace
from .units import Option, Unit


@dataclass(frozen=True)
class OptionFigures:
    """One unit under one option, bytes and FLOPs of one step."""
    fwd_growth: int
    fwd_excess: int
    bwd_growth: int
    bwd_excess: int
    flops: int


@dataclass(frozen=True)
class HeadFigures:
    """The head under an option: its segment's figures, and the FLOPs outside every unit."""
    excess: int
    growth: int
    kept: int
    other_flops: int


@dataclass
class StepFigures:
    """Everything :func:`simulate` needs; per unit a dict option -> figures."""
    first_excess: int                 # the segment before the first unit
    first_growth: int
    gaps: List[Tuple[int, int]]       # (growth, excess) after unit i, i < n - 1
    head_excess: int
    head_growth: int
    head_kept: int                    # bytes the head keeps at "loss", the loss itself not counted
    other_flops: int                  # FLOPs outside every unit
    units: List[Dict[Option, OptionFigures]] = field(default_factory=list)
    #: the plain step as its own probe measured it (peak; kept after the loss): the prediction of
    #: every unit ``none``, free of the other probes' spread
    plain_peak: int = 0
    plain_kept: int = 0
    #: the head unit, if any, and its figures under each option but none (the fields above)
    head: Optional[Unit] = None
    heads: Dict[Option, HeadFigures] = field(default_factory=dict)

    def head_options(self) -> Tuple[Option, ...]:
        return (Option.NONE,) + tuple(self.heads)


def with_head(fig: StepFigures, option: Option) -> StepFigures:
    """``fig`` with the head under ``option``."""
    if option == Option.NONE:
        return fig
    h = fig.heads[option]
    return replace(fig, head_excess=h.excess, head_growth=h.growth, head_kept=h.kept,
                   other_flops=h.other_flops)


def raised(fig: StepFigures, by: int) -> StepFigures:
    """``fig`` with every excess ``by`` bytes higher: every choice's predicted peak is ``by``
    higher (the solver then keeps that much further below a budget)."""
    units = [{o: replace(f, fwd_excess=f.fwd_excess + by, bwd_excess=f.bwd_excess + by)
              for o, f in u.items()} for u in fig.units]
    return replace(fig, first_excess=fig.first_excess + by, head_excess=fig.head_excess + by,
                   gaps=[(g, e + by) for g, e in fig.gaps], plain_peak=fig.plain_peak + by,
                   units=units,
                   heads={o: replace(h, excess=h.excess + by) for o, h in fig.heads.items()})


def headed(fig: StepFigures, choice: Sequence[Option]) -> Tuple[StepFigures, Sequence[Option]]:
    """(figures with the choice's head option, the units' options)."""
    n = len(fig.units)
    return (with_head(fig, choice[n]) if len(choice) > n else fig), choice[:n]


def head_figures(shared: "StepFigures") -> HeadFigures:
    return HeadFigures(shared.head_excess, shared.head_growth, shared.head_kept,
                       shared.other_flops)


def _by_label(trace: StepTrace) -> Dict[Tuple[str, int], int]:
    return {(m.label, m.unit): k for k, m in enumerate(trace.marks)}


def _segment(marks, a: int, b: int) -> Tuple[int, int, int]:
    """(growth, excess, flops) of the segment from mark a to mark b."""
    start = marks[a].current
    peak = max(m.peak for m in marks[a + 1:b + 1])
    return marks[b].current - start, peak - start, marks[b].flops - marks[a].flops


def unit_figures(memory: StepTrace, flops: StepTrace, i: int, n: int) -> OptionFigures:
    """Unit i's figures in one configuration's traces."""
    at, at_f = _by_label(memory), _by_label(flops)
    g_f, e_f, _ = _segment(memory.marks, at[("pre", i)], at[("post", i)])
    end = ("grad", i - 1) if i > 0 else ("end", -1)
    g_b, e_b, _ = _segment(memory.marks, at[("grad", i)], at[end])
    fl = (flops.marks[at_f[("post", i)]].flops - flops.marks[at_f[("pre", i)]].flops
          + flops.marks[at_f[end]].flops - flops.marks[at_f[("grad", i)]].flops)
    return OptionFigures(g_f, e_f, g_b, e_b, fl)


def shared_figures(memory: StepTrace, flops: StepTrace, n: int) -> StepFigures:
    """The segments outside the units, from one configuration's traces (with no units, the head
    is the whole step)."""
    marks = memory.marks
    at, at_f = _by_label(memory), _by_label(flops)
    start = at[("start", -1)]
    first = at[("pre", 0)] if n else start
    first_growth, first_excess, _ = _segment(marks, start, first) if n else (0, 0, 0)
    gaps = [_segment(marks, at[("post", i)], at[("pre", i + 1)])[:2] for i in range(n - 1)]
    head_start = at[("post", n - 1)] if n else start
    head_end = at[("grad", n - 1)] if n else at[("end", -1)]
    head_growth, head_excess, _ = _segment(marks, head_start, head_end)
    head_kept = marks[at[("loss", -1)]].current - marks[head_start].current - memory.loss_bytes
    units_flops = sum(flops.marks[at_f[("post", i)]].flops - flops.marks[at_f[("pre", i)]].flops
                      + flops.marks[at_f[("grad", i - 1) if i else ("end", -1)]].flops
                      - flops.marks[at_f[("grad", i)]].flops for i in range(n))
    return StepFigures(first_excess, first_growth, [(g, e) for g, e in gaps], head_excess,
                       head_growth, head_kept, flops.marks[-1].flops - units_flops, [])


def combine(shared: Sequence[StepFigures]) -> StepFigures:
    """The figures outside the units of several configurations' steps, each the largest seen
    (they differ only where the model is not a chain of independent units: see
    :func:`spread`)."""
    s0 = shared[0]
    return StepFigures(
        max(s.first_excess for s in shared), max(s.first_growth for s in shared),
        [tuple(max(s.gaps[i][k] for s in shared) for k in range(2)) for i in range(len(s0.gaps))],
        max(s.head_excess for s in shared), max(s.head_growth for s in shared),
        max(s.head_kept for s in shared), s0.other_flops, [])


def spread(shared: Sequence[StepFigures]) -> int:
    """The largest difference, in bytes, between the configurations' figures outside the units:
    0 where the units are independent, as the model assumes."""
    worst = 0
    for getter in (lambda s: s.first_excess, lambda s: s.first_growth,
                   lambda s: s.head_excess, lambda s: s.head_growth, lambda s: s.head_kept):
        values = [getter(s) for s in shared]
        worst = max(worst, max(values) - min(values))
    for i in range(len(shared[0].gaps)):
        for k in range(2):
            values = [s.gaps[i][k] for s in shared]
            worst = max(worst, max(values) - min(values))
    return worst


@dataclass(frozen=True)
class Prediction:
    peak: int   # bytes above the step's start
    kept: int   # bytes kept for backward after the loss (the loss not counted)
    flops: int  # FLOPs of the step


def simulate(fig: StepFigures, choice: Sequence[Option]) -> Prediction:
    """The step's peak, kept bytes and FLOPs with unit i under option ``choice[i]``: for every
    unit ``none`` the plain probe's own figures, else :func:`chain_prediction`."""
    got = chain_prediction(fig, choice)
    if all(o == Option.NONE for o in choice):  # the head too
        return Prediction(fig.plain_peak, fig.plain_kept, got.flops)
    return got


def chain_prediction(fig: StepFigures, choice: Sequence[Option]) -> Prediction:
    """The chain's sums: the step's peak, kept bytes and FLOPs with unit i under option
    ``choice[i]`` (and the head under ``choice[n]``, if there)."""
    fig, choice = headed(fig, choice)
    n = len(fig.units)
    cur, peak = fig.first_growth, fig.first_excess
    flops = fig.other_flops
    for i, option in enumerate(choice):
        f = fig.units[i][option]
        peak = max(peak, cur + f.fwd_excess)
        cur += f.fwd_growth
        flops += f.flops
        if i < n - 1:
            growth, excess = fig.gaps[i]
            peak = max(peak, cur + excess)
            cur += growth
    kept = cur + fig.head_kept
    peak = max(peak, cur + fig.head_excess)
    cur += fig.head_growth
    for i in reversed(range(n)):
        f = fig.units[i][choice[i]]
        peak = max(peak, cur + f.bwd_excess)
        cur += f.bwd_growth
    return Prediction(peak, kept, flops)
