"""Planning, before anything changes: one loop over the kinds of unit, in priority order, each
finding its candidates among the nodes no kind before it took, deciding and placing them."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from torch import nn

from .gated import GATED
from .graph import ModelGraph
from .inline import INLINE
from .moe import MOE
from .plain import PLAIN
from .report import Action, Decision
from .rewrite import REWRITE
from .runtime import FusedSequential, RunMember, _OwnerForward, _Run
from .units import Options, Placement

#: The kinds of unit, in priority order: a node one takes is no later one's.
KINDS = (GATED, INLINE, REWRITE, PLAIN, MOE)


class Placed(NamedTuple):
    placement: Placement
    decision: Decision
    in_place: Optional[_Run]  # the same run, put in place by an earlier fuse and kept


@dataclass
class Plan:
    placed: List[Placed] = field(default_factory=list)
    at: Dict[str, List[Decision]] = field(default_factory=dict)  # the decisions, by where
    not_analysed: List[Tuple[str, str]] = field(default_factory=list)

    def decisions(self, model: nn.Module) -> List[Decision]:
        """Every decision, in the order of the modules holding their layers, fused first."""
        order = [path for path, _ in model.named_modules()]
        return [d for path in order + sorted(set(self.at) - set(order))
                for d in sorted(self.at.get(path, []), key=lambda d: d.action == Action.LEFT_ALONE)]

    @property
    def rewritten(self) -> List[str]:
        return list(dict.fromkeys(p.placement.where for p in self.placed
                                  if p.placement.source is not None))


def make_plan(graph: ModelGraph, options: Options) -> Plan:
    plan, taken, existing = Plan(), set(), {}
    for m in graph.model.modules():  # the runs an earlier fuse put in place, by key
        for run in [p.run for p in m._ckpt_ext_runs] if isinstance(m, FusedSequential) else \
                [m._ckpt_ext_run] if isinstance(m, RunMember) and m._ckpt_ext_run else []:
            existing[run.key] = run
    for kind in KINDS:
        for found in kind.find(graph, taken, options):
            units, misses = kind.decide(graph, found, options)
            for d, p in kind.place(graph, found, units, misses):
                already = _in_place(graph, p, d, existing) if p is not None else None
                if p is not None:
                    plan.placed.append(Placed(p, d, already))
                d = dataclasses.replace(d, action=Action.ALREADY_FUSED) if already else d
                plan.at.setdefault(d.where, []).append(d)
            taken.update(found.takes)
            plan.not_analysed += found.not_analysed
    return plan


def _in_place(graph: ModelGraph, p: Placement, d: Decision,
              existing: Dict[Any, _Run]) -> Optional[_Run]:
    """The run an earlier fuse put in place for exactly this placement (with the key of the run it
    would make), if it is still whole."""
    if not existing or p.source is not None:
        return None
    run = existing.get(p.kind.runtime(graph, p, d).key)
    if run is None or run.problem() is not None:
        return None
    for part in p.parts:  # each Sequential holds its part of exactly this run
        if not any(x.key == (part.names, part.role, part.index, run.key) and x.run is run
                   for x in getattr(part.seq, "_ckpt_ext_runs", ())):
            return None
    if any(getattr(m, "_ckpt_ext_run", None) is not run or m._ckpt_ext_index != k
           for m, k in p.members):
        return None
    fwd = vars(p.owner).get(graph.trace[id(p.owner)].method) if p.owner is not None else None
    return run if p.owner is None or isinstance(fwd, _OwnerForward) and run in fwd.runs \
        else None
