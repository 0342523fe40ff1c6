"""What every kind of unit is to the planning loop: the :class:`UnitKind` protocol, the
:class:`Placement` a unit hands to applying, and what region kinds share."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import fx, nn

from ..modules import LayerActivations
from .facts import GLOBAL, LayerKind, Slot, masks_drawable, of_weights, own_forward
from .graph import LayerCall, ModelGraph
from .policy import Policy
from .report import Decision, How
from .runtime import PartRole, _Guard, _Run
from .tracing import Trace


class Options(NamedTuple):
    policy: Policy
    rewrite: bool


class PartPlan(NamedTuple):
    """The elements of one Sequential a run covers, and its role there (``_RunPart``)."""
    seq: nn.Module
    names: Tuple[str, ...]
    role: PartRole
    index: int                                 # the member it is, in the owner's call order
    before: Tuple[Tuple[nn.Module, Tuple[str, ...]], ...]  # elements of nested Sequentials
    after: Tuple[Tuple[nn.Module, Tuple[str, ...]], ...]   # run before / after the run


class MemberPlan(NamedTuple):
    module: nn.Module  # a child Linear, activation, pass or experts module: member ``index``
    index: int


@dataclass
class Placement:
    """Where and how one unit is computed: by a Sequential, in its owner's region, or rewritten."""
    how: How
    where: str                        # the module holding every layer of the unit ("" = model)
    layer_calls: List[LayerCall]
    activation: LayerActivations
    last_act: bool
    kind: Any = None                  # the UnitKind that makes its runtime object
    found: Any = None                 # what that kind found
    parts: List[PartPlan] = field(default_factory=list)
    members: List[MemberPlan] = field(default_factory=list)
    calls: List[str] = field(default_factory=list)  # the members' labels, in call order
    sequences: List[nn.Module] = field(default_factory=list)  # must keep their elements
    slots: List[Slot] = field(default_factory=list)
    unhooked: List[nn.Module] = field(default_factory=list)
    owner: Optional[nn.Module] = None  # the module whose forward calls the members
    guards: List[_Guard] = field(default_factory=list)  # of the forwards the run crosses
    alone: Dict[int, List[LayerCall]] = field(default_factory=dict)  # see plain._alone
    passes: List[Tuple[Slot, int]] = field(default_factory=list)  # (Identity/Dropout, after k)
    note: str = ""
    source: Optional[str] = None


class UnitKind:
    """One kind of unit, with methods ``find(graph, taken, options)``: its candidates among the fx
    nodes no kind before it took, each with the ``takes`` it takes and the ``not_analysed`` it
    found; ``decide(graph, found, options)``: (units, near misses); ``place(graph, found, units,
    misses)``: [(decision, its :class:`Placement` or None)] in report order; ``runtime(graph,
    placement, decision)``: the object put in the model, whose ``key`` identifies it."""


@dataclass(eq=False)
class InForward:
    """A candidate unit of one analysed forward, computed in its owner's region: its members are
    the child Linears ``linears``; ``others``: its other child modules; ``nodes``: all its nodes."""
    owner: nn.Module
    path: str
    trace: Trace
    linears: Tuple[fx.Node, ...]
    nodes: Tuple[fx.Node, ...]
    labels: Tuple[str, ...]           # its Linears and activations, in call order
    activation: LayerActivations
    others: Tuple[fx.Node, ...] = ()
    problems: Tuple[str, ...] = ()
    not_analysed = ()

    @property
    def takes(self) -> Tuple[fx.Node, ...]:
        return () if self.problems else self.nodes

    def child(self, n: fx.Node) -> nn.Module:
        return self.owner._modules[n.target]


class RegionKind(UnitKind):
    def place(self, graph: ModelGraph, c: InForward, units: Sequence[Decision], misses):
        calls = [LayerCall(c.owner, n.target, c.child(n), LayerKind.LINEAR,
                           graph.nodes[n].label, node=n, trace=c.trace) for n in c.linears]
        placed = []
        for d in units:
            p = Placement(How.CHILDREN, c.path, calls, c.activation, False, self, c,
                          owner=c.owner, calls=[s.label for s in calls],
                          members=[MemberPlan(s.module, k) for k, s in enumerate(calls)],
                          unhooked=[c.child(n) for n in c.linears + c.others])
            p.slots = [Slot(c.owner, n.target, c.child(n), graph.nodes[n].label)
                       for n in c.linears + c.others]
            placed.append((arguments_note(graph, p, d), p))
        return [(d, None) for d in misses] + placed


def arguments_note(graph: ModelGraph, p: Placement, d: Decision) -> Decision:
    """The decision, saying so where the unit is computed fused only in calls giving arguments."""
    t = graph.trace.get(id(p.owner)) if p.owner is not None else None
    if t is None or t.arg_guard is None or not t.arg_guard.given:
        return d
    given = ", ".join(t.arg_guard.given)
    return dataclasses.replace(d, why=f"{d.why}; computed fused in calls giving {given} (not "
                                      f"None), module by module in others")


class _PlaceholderRun(_Run):
    """A unit whose forward computes something between its Linears: the first member computes it
    and returns a zero-width placeholder, on which that code runs; the last returns the output."""

    def _conditions(self):
        yield from GLOBAL
        yield from (own_forward(m, label) for m, label in self.unhooked)
        yield from self._placement()
        yield from self._own()
        yield masks_drawable(self)
        yield from of_weights(self.layers, self.calls)

    _another = " with another value"

    def _receives(self, index: int, x: Any, carried: Any) -> bool:
        return _is_placeholder(x, carried)

    def _step(self, index: int, x: Any, state: list, before) -> Any:
        if index == 0:
            state[1], state[3] = x, self(x)
        elif index == len(self.calls) - 1:
            state[1], state[3] = state[3], None
            return state[1]
        return _placeholder(x, state[3])


def _placeholder(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[:-1] + (0,), dtype=out.dtype)


def _is_placeholder(h: Any, x: torch.Tensor) -> bool:
    return isinstance(h, torch.Tensor) and h.dim() >= 1 and h.shape[-1] == 0 and \
        h.shape[:-1] == x.shape[:-1] and not h.requires_grad
