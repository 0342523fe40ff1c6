"""The exact choice: an option per unit whose step peaks within the budget at the least FLOPs, and
the least peak any choice reaches.

A multiple-choice knapsack whose capacity constraint is the step's peak: the largest, over the
marks of the step, of a sum of the units' growths plus one segment's excess (figures.py). Solved by
dynamic programming over the units in forward order. After unit j a partial choice is summed up
by four numbers, each never helped by being larger:

* ``A``: the bytes alive when unit j + 1's forward starts;
* ``P``: the forward's peak so far;
* ``D``: the largest backward peak of the units so far, less the head's growth, counted as if the
  units still to come kept what they keep until the end (their growth through forward and
  backward, ``r``, is added as each is chosen);
* ``F``: the FLOPs so far.

A state no better than another in all four is dropped: what the other reaches, it cannot beat.
Identical units (equal figures) give equal (A, F) after the same counts of each option, so their
orders merge into one state: they are counted, not enumerated. Units whose figures differ by
less than ``tolerance`` are first given the largest of their figures (a prediction at most that
much high). A head with options is solved for under each (a choice then ends with the head's
option). Design and proof sketch: docs/plan.md, "The choice"."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

from .figures import OptionFigures, StepFigures, with_head
from .units import Option

#: More states than this after one unit: the figures are too varied to merge (a model of many
#: unlike units); the solver says so rather than run for minutes.
MAX_STATES = 400_000


@dataclass(frozen=True)
class Solution:
    choice: Tuple[Option, ...]
    peak: int    # as the (grouped) figures predict it
    flops: int


def _close(a: Dict[Option, OptionFigures], b: Dict[Option, OptionFigures], tol: int,
           tol_flops: int) -> bool:
    if a.keys() != b.keys():
        return False
    for o in a:
        x, y = a[o], b[o]
        if abs(x.flops - y.flops) > tol_flops:
            return False
        if any(abs(getattr(x, k) - getattr(y, k)) > tol
               for k in ("fwd_growth", "fwd_excess", "bwd_growth", "bwd_excess")):
            return False
    return True


def grouped(fig: StepFigures, tolerance: int, tolerance_flops: int) -> StepFigures:
    """``fig`` with the figures of units within ``tolerance`` bytes (``tolerance_flops`` FLOPs)
    of a group's first unit made the group's largest (each figure its own maximum)."""
    groups: List[List[int]] = []
    for i, u in enumerate(fig.units):
        for g in groups:
            if _close(fig.units[g[0]], u, tolerance, tolerance_flops):
                g.append(i)
                break
        else:
            groups.append([i])
    units = list(fig.units)
    for g in groups:
        merged = {o: OptionFigures(*(max(getattr(fig.units[i][o], k) for i in g)
                                     for k in ("fwd_growth", "fwd_excess", "bwd_growth",
                                               "bwd_excess", "flops")))
                  for o in fig.units[g[0]]}
        for i in g:
            units[i] = merged
    return replace(fig, units=units)


def _final_peak(fig: StepFigures, a: int, d: float, p: int) -> int:
    return int(max(p, a + fig.head_excess, fig.head_growth + d))


def solve(fig: StepFigures, budget: Optional[int] = None
          ) -> Tuple[Solution, Optional[Solution]]:
    """(the choice of least peak, the choice of least FLOPs whose peak is within ``budget``, or
    None). Ties: the least peak at the least FLOPs, then the least FLOPs at the least peak; then
    the head's option first in its list."""
    if not fig.heads:
        return _solve_chain(fig, budget)
    least, best = None, None
    for option in fig.head_options():
        a, b = _solve_chain(with_head(fig, option), budget)
        if a is not None:
            a = replace(a, choice=a.choice + (option,))
            if least is None or (a.peak, a.flops) < (least.peak, least.flops):
                least = a
        if b is not None:
            b = replace(b, choice=b.choice + (option,))
            if best is None or (b.flops, b.peak) < (best.flops, best.peak):
                best = b
    return least, best


def _solve_chain(fig: StepFigures, budget: Optional[int]
                 ) -> Tuple[Optional[Solution], Optional[Solution]]:
    n = len(fig.units)
    gaps = list(fig.gaps) + [(0, 0)]

    def added(j: int, f: OptionFigures) -> int:  # bytes unit j leaves to the next unit
        return f.fwd_growth + gaps[j][0]

    # lower bounds of what the units after j still add: forward (a) and through the step (r)
    rest_a = [0] * (n + 1)
    rest_r = [0] * (n + 1)
    for j in reversed(range(n)):
        rest_a[j] = rest_a[j + 1] + min(added(j, f) for f in fig.units[j].values())
        rest_r[j] = rest_r[j + 1] + min(added(j, f) + f.bwd_growth
                                        for f in fig.units[j].values())
    # states: (A, F) -> [(D, P, node)], node = (option, parent node) for the choice
    states: Dict[Tuple[int, int], List[tuple]] = {
        (fig.first_growth, fig.other_flops): [(-math.inf, fig.first_excess, None)]}
    for j in range(n):
        grown: Dict[Tuple[int, int], List[tuple]] = {}
        for (a, fl), entries in states.items():
            for option, f in fig.units[j].items():
                p_add = max(a + f.fwd_excess, a + f.fwd_growth + gaps[j][1] if j < n - 1
                            else -math.inf)
                a2 = a + added(j, f)
                fl2 = fl + f.flops
                r = added(j, f) + f.bwd_growth
                d_new = a + added(j, f) + f.bwd_excess
                for d, p, node in entries:
                    p2 = max(p, p_add)
                    d2 = max(d + r, d_new)
                    if budget is not None and (
                            p2 > budget or a2 + rest_a[j + 1] + fig.head_excess > budget or
                            fig.head_growth + d2 + rest_r[j + 1] > budget):
                        continue
                    grown.setdefault((a2, fl2), []).append((d2, p2, (option, node)))
        states = {key: _pareto(entries) for key, entries in grown.items()}
        if sum(len(v) for v in states.values()) > MAX_STATES:
            raise RuntimeError(f"ckpt_ext.plan: more than {MAX_STATES:,} partial choices after "
                               f"unit {j}: its units' figures are too varied to merge")
    ends = [(_final_peak(fig, a, d, p), fl, node)
            for (a, fl), entries in states.items() for d, p, node in entries]
    if not ends:
        return None, None  # only with a budget no choice meets
    least = min(ends, key=lambda e: (e[0], e[1]))
    within = [e for e in ends if budget is None or e[0] <= budget]
    best = min(within, key=lambda e: (e[1], e[0])) if within else None
    as_solution = (lambda e: Solution(_choice(e[2]), e[0], e[1]))
    return as_solution(least), (as_solution(best) if best is not None else None)


def _pareto(entries: List[tuple]) -> List[tuple]:
    """The (D, P) entries no other entry matches or beats on both."""
    entries.sort(key=lambda e: (e[0], e[1]))
    kept: List[tuple] = []
    best_p = math.inf
    for e in entries:
        if e[1] < best_p:
            kept.append(e)
            best_p = e[1]
    return kept


def _choice(node) -> Tuple[Option, ...]:
    out = []
    while node is not None:
        option, node = node
        out.append(option)
    return tuple(reversed(out))
