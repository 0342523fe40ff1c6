"""The plain kind: runs of Linear/activation module calls, computed by a Sequential or in their
lowest common caller's forward, applied as ``_Run``. Design: docs/converter.md."""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from torch import fx, nn

from .facts import (ACROSS, LayerKind, no_hooks, own_forward, Slot, failing, join_path,
                    module_tensors, passes_through, passing_name, stored_weight)
from .graph import LayerCall, ModelGraph
from .policy import Chain, LayerShape, Unit, chain_problem, decide, item_misses, mask_bytes, \
    split_at_problems
from .report import Action, Decision, How
from .runtime import PartRole, _Run
from .units import MemberPlan, Options, PartPlan, Placement, UnitKind, arguments_note
from .values import Crossing, Fate


class Run(NamedTuple):
    """A maximal run of layer calls ``Linear, Act, Linear, ...``, and why it ``stop``s there."""
    calls: List[LayerCall]
    through: Dict[LayerCall, Tuple[Slot, ...]]
    stop: Optional[str]
    takes = ()
    not_analysed = ()


class Plain(UnitKind):
    def find(self, graph: ModelGraph, taken: set, options: Options) -> List[Run]:
        calls = [s for s in graph.layer_calls if s.node is None or s.node not in taken]
        at = {(id(s.container), s.index if s.node is None else s.node): s for s in calls}
        links, stops, through = {}, {}, {}  # by call: the next call, why not, the Slots between
        for s in calls:
            nxt, problem, through[s] = _next(graph, s, at)
            if nxt is None or nxt.kind == s.kind:
                continue
            if s.kind is LayerKind.LINEAR:
                drawing = [p for p in through[s] if not passes_through(p.module)]
                if drawing:
                    problem = problem or (
                        f"dropout p>0 between it and its activation: {drawing[0].label} (p="
                        f"{drawing[0].module.p}) draws a mask in training that the fused op would "
                        f"not (in eval() it is fused)")
            if problem:
                stops[s] = problem
            else:
                links[s] = nxt
        has_prev = set(links.values())
        runs = []
        for s in calls:
            if s in has_prev:
                continue
            path = [s]
            while path[-1] in links and links[path[-1]] not in path:
                path.append(links[path[-1]])
            while path and path[0].kind is not LayerKind.LINEAR:
                path.pop(0)
            if len(path) >= 2:
                runs.append(Run(path, through, stops.get(path[-1])))
        return runs

    def decide(self, graph: ModelGraph, run: Run, options: Options):
        """The units of one run, split where a call has a problem, and its near misses."""
        layer_calls = run.calls
        at = _where(graph, layer_calls)
        labels = [s.label for s in layer_calls]
        problems = [_problem(graph, s) for s in layer_calls]
        misses = item_misses(at, labels, problems)
        shapes = [LayerShape(s.label, *graph.facts[id(s.module)].width)
                  for s in layer_calls[0::2]]
        acts = layer_calls[1::2]
        full = Chain(at, How.NOWHERE, labels, layer_calls, shapes,
                     tuple(s.activation for s in acts), len(layer_calls) % 2 == 0,
                     lambda: Fate(None, ""),
                     tuple(module_tensors(s.module, s.activation) for s in acts))
        units: List[Unit] = []
        for s, e in split_at_problems(problems, len(layer_calls)):
            last = layer_calls[e - 1]
            site = (last.container, last.index if last.node is None else last.node)
            sub = full.sub(s, e, lambda site=site: graph.fate(*site))
            sub.where = _where(graph, sub.items)
            problem = chain_problem(sub.layers, [x.module for x in sub.items[0::2]])
            if problem is not None:
                misses.append(Decision(where=sub.where, layers=tuple(sub.labels),
                                       action=Action.LEFT_ALONE, why=problem))
                continue
            sub_units, sub_misses = decide(sub, options.policy)
            units += sub_units
            misses += sub_misses
        return units, misses

    def place(self, graph: ModelGraph, run: Run, units: Sequence[Unit], misses):
        """In call order: each unit placed, and the near misses where their layers are held."""
        placed: List[Tuple[Decision, Optional[Placement]]] = [(d, None) for d in misses]
        for u in units:
            calls = u.items
            between = [run.through[c] for c in calls[:-1]]
            p = _placement(graph, self, calls, u.activation, u.last_act, between)
            d = u.decision
            if p is None:
                placed.append((dataclasses.replace(
                    d, action=Action.LEFT_ALONE, unit="", how=How.NOWHERE, bytes_per_row=0,
                    why="its layers share no container that calls them in sequence"), None))
                continue
            note = "; ".join(filter(None, [_through(p.passes) if p.passes else "", p.note]))
            masks = collections.Counter(k for slot, k in p.passes
                                        if not passes_through(slot.module))
            w = stored_weight(calls[0].module)
            freed = mask_bytes(masks, u.chain.layers[u.first:], u.chain.activations[u.first:],
                               w is not None and w.device.type == "cuda")
            d = dataclasses.replace(d, where=p.where, how=p.how, bytes_per_row=d.bytes_per_row
                                    + freed, why=d.why + (f"; {note}" if note else ""))
            placed.append((arguments_note(graph, p, d), p))
        labels = [s.label for s in run.calls]
        position = {label: i for i, label in enumerate(labels)}
        by_label = {s.label: s for s in run.calls}
        out = []
        for d, p in sorted(placed, key=lambda dp: position.get(dp[0].layers[0], len(labels))):
            if p is None:
                d = dataclasses.replace(d, where=_where(graph, [by_label[x] for x in d.layers]))
            if run.stop and labels[-1] in d.layers:
                d = dataclasses.replace(d, why=f"{d.why}; the run stops after {labels[-1]}: "
                                               f"{run.stop}")
            out.append((d, p))
        return out

    def runtime(self, graph: ModelGraph, p: Placement, decision: Optional[Decision]) -> _Run:
        calls = p.layer_calls
        return _Run(
            labels=[s.label for s in calls], members=[s.module for s in calls],
            layers=[s.module for s in calls[0::2]], last_activation=p.last_act, owner=p.owner,
            activation=p.activation, slots=p.slots, calls=p.calls, decision=decision,
            sequences=[(seq, graph.path[id(seq)]) for seq in p.sequences],
            unhooked=[(m, graph.path[id(m)]) for m in p.unhooked]
            + [(s.module, s.label) for s in calls],
            elements=[(s.container, s.name) for s in calls if s.node is None],
            passes=[(slot.module, slot.label, k) for slot, k in p.passes])


def _problem(graph: ModelGraph, s: LayerCall) -> Optional[str]:
    """What keeps a call from a run: how it is called, or its module."""
    if s.node is None:
        problem = failing([own_forward(s.container, graph.path[id(s.container)] or "<model>")])
    else:
        problem = graph.child_problem(s.container, s.trace, s.name, s.label, s.module)
    return problem if problem is not None else graph.facts[id(s.module)].problem


def _through(passes: Sequence[Tuple[Slot, int]]) -> str:
    slots = [slot for slot, _ in passes]
    drawing = [slot.label for slot in slots if not passes_through(slot.module)]
    one = len(drawing) == 1
    return ("through " + ", ".join(f"{s.label} ({passing_name(s.module)})" for s in slots) +
            (f"; {', '.join(drawing)} {'draws its mask' if one else 'draw their masks'} inside "
             f"the unit, which keeps the generator's state and draws {'it' if one else 'them'} "
             f"again in backward" if drawing else "") +
            "; a call in which one of them draws a mask fuse cannot draw computes module by module")


# -- Where a layer's output goes next: the one call receiving it ----------------------------------

def _next(graph: ModelGraph, s: LayerCall, at: Dict[Tuple[int, Any], LayerCall]):
    """(the one call of ``at`` consuming the output of ``s`` alone, why a run may not take that
    step, the Identity and Dropout modules stepped over); (None, None, ...) where none does."""
    site = (s.container, s.index if s.node is None else s.node)
    passed, problem = [], None
    while True:
        uses = graph.users(*site)
        u = uses[0] if len(uses) == 1 and uses[0].module is not None else None
        node = u.at if u is not None and isinstance(u.at, fx.Node) else None
        if u is None or node is not None and (node.kwargs or len(node.args) != 1) or any(
                not c.strict or (c.out and graph.facts[id(c.caller)].sequential and
                                 not graph.facts[id(c.module)].sequential) for c in u.crossed):
            return None, None, tuple(passed)
        for c in u.crossed:
            problem = problem or _crossing(graph, c)
        call = at.get((id(u.owner), u.at))
        if call is not None:
            return call, problem, tuple(passed)
        if not graph.facts[id(u.module)].passes or (node is not None and "." in node.target):
            return None, None, tuple(passed)
        name = node.target if node is not None else list(u.owner._modules)[u.at]
        label = join_path(graph.path[id(u.owner)], name)
        passed.append(Slot(u.owner, name, u.module, label))
        problem = problem or failing([no_hooks(u.module, label, ACROSS),
                                      own_forward(u.module, label)])
        if node is not None:
            problem = problem or graph.child_problem(u.owner, graph.trace[id(u.owner)],
                                                     node.target, label, u.module)
        site = (u.owner, u.at)


def _crossing(graph: ModelGraph, c: Crossing) -> Optional[str]:
    """Why a run may not take a value into or out of ``c.module``, else None."""
    child = None
    if not graph.facts[id(c.caller)].sequential:
        child = graph.child_problem(c.caller, graph.trace[id(c.caller)], c.target,
                                    join_path(graph.path[id(c.caller)], c.target), c.module)
    if c.out:
        return _crossing_problem(graph, c.module) or child
    return child or _crossing_problem(graph, c.module)


def _crossing_problem(graph: ModelGraph, c: nn.Module) -> Optional[str]:
    """Why a run may not cross ``c`` (a Sequential or a module's forward), else None."""
    places = graph.paths.get(id(c), [])
    label = places[0] if places else f"<a {type(c).__name__}>"
    problem = failing([no_hooks(c, label, ACROSS), own_forward(c, label)])
    if problem is not None:
        return problem
    if len(places) != 1:
        return f"{label} is held at {len(places)} places ({', '.join(places)})"
    if not graph.facts[id(c)].sequential:
        t = graph.trace.get(id(c))
        if t.region_problem is not None:
            return f"the run cannot cross {label}.forward: {t.region_problem}"
        if t.arg_guard is not None:
            return (f"the run cannot cross {label}.forward: what it assumes of its "
                    f"arguments ({t.arg_guard.describe()}) is checked only where it marks a "
                    f"region")
    return None


# -- Where a unit of module calls is computed ------------------------------------------------------

def _ancestry(graph: ModelGraph, layer_calls: Sequence[LayerCall]):
    """Each call's containers upward (each held at one place), and the lowest one they share."""
    chains = []
    for s in layer_calls:
        chain = [s.container]
        while len(chain) < 256 and len(graph.paths.get(id(chain[-1]), [])) == 1 and \
                id(chain[-1]) in graph.caller:
            chain.append(graph.caller[id(chain[-1])][0])
        chains.append(chain)
    ids = [{id(c) for c in chain} for chain in chains]
    lca = next((c for c in chains[0] if all(id(c) in x for x in ids)), None)
    return chains, lca


def _where(graph: ModelGraph, layer_calls: Sequence[LayerCall]) -> str:
    _, lca = _ancestry(graph, layer_calls)
    return graph.path[id(lca)] if lca is not None else ""


def _below(graph: ModelGraph, upper: nn.Module, lower: nn.Module) -> str:
    """The name ``upper`` reaches ``lower`` by ("2", or "blocks.0" through a ModuleList)."""
    up, low = graph.path[id(upper)], graph.path[id(lower)]
    return low[len(up) + 1:] if up else low


def _descent(graph: ModelGraph, call: LayerCall, chain: List[nn.Module], lca: nn.Module):
    """[(container, the name of what it holds next)] from the lca down to the call."""
    path = chain[:[id(c) for c in chain].index(id(lca)) + 1][::-1]  # lca, ..., call.container
    steps = [(upper, _below(graph, upper, lower)) for upper, lower in zip(path, path[1:])]
    return steps + [(call.container, call.name)]


def _before(steps):
    """The elements of each nested container before the run's first layer."""
    return tuple((seq, tuple(list(seq._modules)[:list(seq._modules).index(name)]))
                 for seq, name in steps if list(seq._modules).index(name))


def _after(steps):
    """... and after its last layer, innermost first."""
    return tuple((seq, tuple(list(seq._modules)[list(seq._modules).index(name) + 1:]))
                 for seq, name in reversed(steps) if name != list(seq._modules)[-1])


def _part(graph: ModelGraph, seq: nn.Module, layer_calls: Sequence[LayerCall], chains,
          role: PartRole, index: int, first: bool, last: bool) -> PartPlan:
    """The elements of ``seq`` a run covers: from those holding its first layer (``first``; else
    from seq's first) to those holding its last (``last``; else to seq's last)."""
    names, before, after, i0, i1 = list(seq._modules), (), (), 0, len(seq._modules)
    if first:
        down = _descent(graph, layer_calls[0], chains[0], seq)
        before, i0 = _before(down[1:]), names.index(down[0][1])
    if last:
        down = _descent(graph, layer_calls[-1], chains[-1], seq)
        after, i1 = _after(down[1:]), names.index(down[0][1]) + 1
    return PartPlan(seq, tuple(names[i0:i1]), role, index, before, after)


def _placement(graph: ModelGraph, kind: UnitKind, layer_calls: List[LayerCall], activation,
               last_act: bool, between: Sequence[Sequence[Slot]] = ()) -> Optional[Placement]:
    """Where the unit is computed: by a Sequential holding it all, or in its lowest caller."""
    chains, lca = _ancestry(graph, layer_calls)
    if lca is None:
        return None
    belows = [chain[:[id(c) for c in chain].index(id(lca))] for chain in chains]
    inside = {id(c): c for below in belows for c in below}  # containers below the lca
    p = Placement(How.NOWHERE, graph.path[id(lca)], layer_calls, activation, last_act, kind)
    p.sequences = [c for c in inside.values() if graph.facts[id(c)].sequential]
    p.unhooked = list(inside.values())
    p.passes = [(slot, i) for i, slots in enumerate(between) for slot in slots]
    p.slots += [slot for slot, _ in p.passes]
    p.unhooked += [slot.holder for slot, _ in p.passes
                   if graph.facts[id(slot.holder)].sequential and slot.holder not in p.unhooked]
    # the modules whose forwards run it
    crossed = [c for c in inside.values() if not graph.facts[id(c)].sequential]
    if graph.facts[id(lca)].sequential:
        if crossed:  # a Sequential computes its elements: it marks no region
            return None
        p.parts.append(_part(graph, lca, layer_calls, chains, PartRole.WHOLE, 0, True, True))
        p.how = How.SEQUENTIAL if layer_calls[0].container is lca is layer_calls[-1].container \
            else How.ACROSS
        p.sequences.insert(0, lca)
        if p.how is How.ACROSS:
            crossed = ", ".join(graph.path[id(c)] for c in inside.values())
            p.note = (f"it crosses {crossed} inside {p.where or '<model>'}, which computes the "
                      f"whole run; called on its own, each of them computes its own layers")
        return p
    # the members, in order: child Linear/activation modules of the lca or of a module whose
    # forward it crosses, or the outermost Sequential on the way down to a layer
    units: List[Any] = []
    for i, (s, below) in enumerate(zip(layer_calls, belows)):
        u = next((c for c in reversed(below) if graph.facts[id(c)].sequential), s)
        if not units or units[-1] is not u:
            units.append(u)
        # a module a forward calls between two of them passes the run's output on
        units += [LayerCall(slot.holder, slot.name, slot.module, LayerKind.PASS, slot.label)
                  for slot in (between[i] if i < len(between) else ())
                  if not graph.facts[id(slot.holder)].sequential]
    for c in crossed:
        holder, hpath, hname = graph.parent[graph.paths[id(c)][0]]
        p.slots.append(Slot(holder, hname, c, join_path(hpath, hname)))
        at = _below(graph, lca, c)
        p.guards += [g._replace(path=join_path(at, g.path) if g.path else at)
                     for g in graph.trace.get(id(c)).guards]
    for k, u in enumerate(units):
        if isinstance(u, LayerCall):
            p.members.append(MemberPlan(u.module, k))
            if u.kind is not LayerKind.PASS:  # a pass's slot is there already
                p.slots.append(Slot(u.container, u.name, u.module, u.label))
            p.calls.append(u.label)
            continue
        holder, hpath, hname = graph.parent[graph.paths[id(u)][0]]
        p.slots.append(Slot(holder, hname, u, join_path(hpath, hname)))
        p.calls.append(graph.path[id(u)])
        p.parts.append(_part(graph, u, layer_calls, chains, PartRole.FIRST if k == 0 else
                             PartRole.ON, k, k == 0, 0 < k == len(units) - 1))
        if alone := _alone(u, layer_calls):
            p.alone[id(u)] = alone
    p.how = How.CHILDREN if all(isinstance(u, LayerCall) and u.container is lca for u in units) \
        else How.ACROSS
    p.owner, where = lca, p.where or "<model>"
    if p.how is How.ACROSS:
        crosses = ", ".join([graph.path[id(c)] for c in crossed] or p.calls)
        p.note = (f"it crosses {crosses} in {where}: inside {where}.{graph.trace[id(lca)].method}"
                  f", {p.calls[0]} computes the whole run and {', '.join(p.calls[1:])} "
                  f"pass{'es' if len(p.calls) == 2 else ''} its output on; called any other "
                  f"way, each computes its own layers")
        p.note += "".join(f" ({a[0].label}..{a[-1].label} as one run of its own)"
                          for a in p.alone.values())
    return p


def _alone(seq: nn.Module, layer_calls: Sequence[LayerCall]) -> Optional[List[LayerCall]]:
    """The longest stretch Linear..Linear of the run's layers that are elements of ``seq``."""
    best, stretch = [], []
    for s in list(layer_calls) + [None]:
        mine = s is not None and s.node is None and s.container is seq
        if mine and (not stretch or s.index == stretch[-1].index + 1):
            stretch.append(s)
            continue
        while stretch and stretch[0].kind is not LayerKind.LINEAR:
            stretch.pop(0)
        while stretch and stretch[-1].kind is not LayerKind.LINEAR:
            stretch.pop()
        if len(stretch) >= 3 and len(stretch) > len(best):
            best = stretch
        stretch = [s] if mine else []
    return best or None


PLAIN = Plain()
