"""Planning: one loop over the kinds of unit, in priority order, before anything changes. Each kind
finds its candidates on the graph among the nodes no earlier kind took, decides and places them;
the plan is every placed unit (with the run an earlier fuse put in place for exactly it, kept),
and every decision of the report, by the module holding its layers."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from torch import nn

from .gated import GATED
from .graph import ModelGraph
from .inline import INLINE
from .plain import PLAIN
from .report import Decision
from .rewrite import REWRITE
from .runtime import FusedSequential, RunLinear, RunMember, _OwnerForward, _Run
from .units import Options, Placement

#: The kinds of unit, in priority order: a node one takes is no later one's.
KINDS = (GATED, INLINE, REWRITE, PLAIN)


class Placed(NamedTuple):
    placement: Placement
    decision: Decision
    in_place: Optional[_Run]  # the same run, put in place by an earlier fuse and kept


@dataclass
class Plan:
    """Everything fuse does to one model, made before anything changes: the units to put in
    place, and the report's decisions by the module holding their layers (fused and already
    fused first, then the near misses); forwards found unusable while planning."""
    placed: List[Placed] = field(default_factory=list)
    fused_at: Dict[str, List[Decision]] = field(default_factory=dict)
    missed_at: Dict[str, List[Decision]] = field(default_factory=dict)
    not_analysed: List[Tuple[str, str]] = field(default_factory=list)

    def add(self, d: Decision) -> None:
        store = self.missed_at if d.action == "left alone" else self.fused_at
        store.setdefault(d.where, []).append(d)

    def decisions(self, model: nn.Module) -> List[Decision]:
        """Every decision, in the order of the modules holding their layers."""
        order = [path for path, _ in model.named_modules()]
        out: List[Decision] = []
        for path in order + sorted((set(self.fused_at) | set(self.missed_at)) - set(order)):
            out += self.fused_at.get(path, []) + self.missed_at.get(path, [])
        return out

    @property
    def rewritten(self) -> List[str]:
        """The modules whose forward the plan rewrites."""
        return list(dict.fromkeys(p.placement.where for p in self.placed
                                  if p.placement.source is not None))


def make_plan(graph: ModelGraph, options: Options) -> Plan:
    plan = Plan()
    taken: set = set()
    existing = {r.key: r for r in existing_runs(graph.model)}
    for kind in KINDS:
        for found in kind.find(graph, taken, options):
            units, misses = kind.decide(graph, found, options)
            for d, p in kind.place(graph, found, units, misses):
                if p is None:
                    plan.add(d)
                    continue
                already = in_place(graph, p, existing)
                plan.placed.append(Placed(p, d, already))
                plan.add(dataclasses.replace(d, action="already fused") if already else d)
            taken.update(found.takes)
            plan.not_analysed += found.not_analysed
    return plan


def existing_runs(model: nn.Module) -> List[_Run]:
    """The runs an earlier fuse put in place, each once."""
    runs: Dict[int, _Run] = {}
    for m in model.modules():
        if isinstance(m, FusedSequential):
            for part in m._ckpt_ext_runs:
                runs.setdefault(id(part.run), part.run)
        elif isinstance(m, (RunLinear, RunMember)) and m._ckpt_ext_run is not None:
            runs.setdefault(id(m._ckpt_ext_run), m._ckpt_ext_run)
    return list(runs.values())


def in_place(graph: ModelGraph, p: Placement, existing: Dict[Any, _Run]) -> Optional[_Run]:
    """The run an earlier fuse put in place for exactly this placement, if it is still whole."""
    if p.source is not None:
        return None
    if not existing:
        return None
    run = existing.get(p.key)
    if run is None or run.problem() is not None:
        return None
    for seq, key in p.part_keys():
        if not any(part.key == key and part.run is run for part in getattr(seq, "_ckpt_ext_runs", ())):
            return None
    for call, k in p.members:
        m = call.module
        if getattr(m, "_ckpt_ext_run", None) is not run or m._ckpt_ext_index != k:
            return None
    if p.owner is not None:
        fwd = vars(p.owner).get(graph.trace.get(id(p.owner)).method)
        if not isinstance(fwd, _OwnerForward) or run not in fwd.runs:
            return None
    return run
