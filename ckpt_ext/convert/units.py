"""What every kind of unit is, to the planning loop: one protocol (:class:`UnitKind`: find its
candidates on the graph, decide under the policy, place each unit, make its runtime object) and
the placement it hands to applying (:class:`Placement`: the module computing the unit, its
members, slots, parts and guards). A kind of unit is one file implementing the protocol and one
line in planning's list of kinds."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from torch import fx, nn

from ..modules import LayerActivations
from .facts import LayerKind, Slot
from .graph import LayerCall, ModelGraph
from .policy import Policy
from .report import Decision
from .runtime import PartRole, _Guard
from .tracing import Trace


class Options(NamedTuple):
    policy: Policy
    rewrite: bool


class PartPlan(NamedTuple):
    """The elements of one Sequential a run covers, and its role there: see ``_RunPart``."""
    seq: nn.Module
    names: Tuple[str, ...]
    role: PartRole
    index: int                                 # the member it is, in the owner's call order
    before: Tuple[Tuple[nn.Module, Tuple[str, ...]], ...]  # elements of nested Sequentials
    after: Tuple[Tuple[nn.Module, Tuple[str, ...]], ...]   # run before / after the run


class MemberPlan(NamedTuple):
    """A child Linear/activation/pass module that becomes member ``index`` of a run."""
    call: LayerCall
    index: int


@dataclass
class Placement:
    """Where and how one unit is computed (made before anything changes, for the report too):
    by a Sequential holding it, or inside the forward of its owner, whose calls are its members;
    or, for a rewrite, by the owner's rewritten forward (``source``)."""
    how: str                          # "sequential", "children", "across" or "rewrite"
    where: str                        # the module holding every layer of the unit ("" = model)
    layer_calls: List[LayerCall]
    activation: LayerActivations      # the name, or one per activated layer (a mixed run)
    last_act: bool
    kind: Any = None                  # the UnitKind that makes its runtime object
    found: Any = None                 # what that kind found (GatedCall, InlineCall, ...)
    parts: List[PartPlan] = field(default_factory=list)
    members: List[MemberPlan] = field(default_factory=list)
    calls: List[str] = field(default_factory=list)  # the members' labels, in call order
    sequences: List[nn.Module] = field(default_factory=list)  # must keep their elements
    slots: List[Slot] = field(default_factory=list)
    unhooked: List[nn.Module] = field(default_factory=list)
    owner: Optional[nn.Module] = None  # the module whose forward calls the members
    guards: List[_Guard] = field(default_factory=list)  # those of the forwards the run crosses
    # per member Sequential: the run of its own elements it computes fused when called on its own
    alone: Dict[int, List[LayerCall]] = field(default_factory=dict)
    # (Identity or Dropout slot, k): the modules between its layers, after its item k
    passes: List[Tuple[Slot, int]] = field(default_factory=list)
    note: str = ""
    source: Optional[str] = None      # a rewrite: the owner's forward, with every unit in it

    @property
    def key(self) -> Tuple[Any, ...]:
        """What the runtime object's ``key`` is when it computes exactly this unit."""
        return self.kind.key(self)

    def part_keys(self) -> List[Tuple[nn.Module, Tuple[Any, ...]]]:
        return [(part.seq, (part.names, part.role, part.index, self.key)) for part in self.parts]


class UnitKind:
    """One kind of unit. ``find`` gives its candidates on the graph that none of ``taken`` (the
    fx nodes of units of the kinds before it) holds: each has ``takes`` (the nodes it takes from
    the kinds after it) and ``not_analysed`` ((path, why) of forwards it found it cannot use,
    once placed). ``decide`` gives the units to fuse of one candidate and its near misses (with
    its problems: what keeps it from being fused); ``place`` the candidate's decisions in the
    report's order, each unit's with its :class:`Placement` (None: a near miss, or a unit left
    alone where it has none); ``runtime`` the object applying puts in the model; ``key`` what
    identifies that object."""

    def find(self, graph: ModelGraph, taken: set, options: Options) -> Iterable[Any]:
        raise NotImplementedError

    def decide(self, graph: ModelGraph, found: Any,
               options: Options) -> Tuple[List[Any], List[Decision]]:
        raise NotImplementedError

    def place(self, graph: ModelGraph, found: Any, units: Sequence[Any],
              misses: Sequence[Decision]) -> List[Tuple[Decision, Optional[Placement]]]:
        raise NotImplementedError

    def runtime(self, graph: ModelGraph, p: Placement, decision: Decision) -> Any:
        raise NotImplementedError

    def key(self, p: Placement) -> Tuple[Any, ...]:
        return (tuple(c.module for c in p.layer_calls), p.last_act)


def child_members(graph: ModelGraph, kind: UnitKind, found: Any, path: str, owner: nn.Module,
                  t: Trace, linears: Sequence[fx.Node], others: Sequence[fx.Node],
                  activation: LayerActivations) -> Placement:
    """A unit computed in the region of its owner's method whose members are the child Linears
    it calls (``linears``, in call order), the other child modules between them (``others``:
    an activation module, Dropouts) held in place and unhooked: a gated MLP, a run with
    function calls between its Linears."""
    calls = [LayerCall(owner, n.target, owner._modules[n.target], LayerKind.LINEAR,
                       graph.nodes[n].label, node=n, trace=t) for n in linears]
    p = Placement("children", path, calls, activation, False, kind, found, owner=owner)
    for k, c in enumerate(calls):
        p.members.append(MemberPlan(c, k))
        p.calls.append(c.label)
    for n in list(linears) + list(others):
        sub = owner._modules[n.target]
        p.slots.append(Slot(owner, n.target, sub, graph.nodes[n].label))
        p.unhooked.append(sub)
    return p


def placed_units(graph: ModelGraph, units: Sequence[Decision], misses: Sequence[Decision],
                 make: Callable[[], Placement]) -> List[Tuple[Decision, Optional[Placement]]]:
    """A candidate of one unit or one near miss, as ``place`` returns it."""
    out: List[Tuple[Decision, Optional[Placement]]] = [(d, None) for d in misses]
    for d in units:
        p = make()
        out.append((arguments_note(graph, p, d), p))
    return out


def arguments_note(graph: ModelGraph, p: Placement, d: Decision) -> Decision:
    """A unit whose owner's forward was traced with an argument given that it tests against
    None is computed fused only in calls where it is given: the decision says so."""
    t = graph.trace.get(id(p.owner)) if p.owner is not None else None
    if t is None or t.arg_guard is None or not t.arg_guard.given:
        return d
    return dataclasses.replace(d, why=f"{d.why}; computed fused in calls giving "
                                      f"{', '.join(t.arg_guard.given)} (not None), module by "
                                      f"module in others")

