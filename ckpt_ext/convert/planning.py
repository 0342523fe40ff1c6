"""Planning: where each unit of module calls is computed (:func:`plan_run`: the Sequential
holding it, or the forward of its lowest common caller, whose calls become the run's members),
and :func:`plan_model`, which discovers, decides and places every unit of a model before anything
changes. The plan is also what the report says."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from torch import nn

from ..modules import LayerActivations, collapse_activations
from .activations import module_tensors
from .consumers import Fate
from .discovery import (GatedCall, LayerCall, LayerKind, RunDiscovery, find_gated, graph_chains,
                        node_label)
from .inline import InlineCall, find_inline, inline_decision
from .policy import (Chain, LayerShape, Unit, chain_problem, decide, gated_decision,
                     item_misses, layer_shape, mask_bytes, split_at_problems, sub_chain)
from .report import Decision
from .runtime import (FusedSequential, PartRole, RunLinear, RunMember, Slot, _Guard,
                      _OwnerForward, _Run, base_type, is_sequential, join_path, parts_of,
                      passes_through, stored_weight)
from .tracing import ModelAnalysis, Trace


class PartPlan(NamedTuple):
    """The elements of one Sequential a run covers, and its role there: see :class:`_RunPart`."""
    seq: nn.Module
    names: Tuple[str, ...]
    role: PartRole
    index: int                                 # the member it is, in the owner's call order
    before: Tuple[Tuple[nn.Module, Tuple[str, ...]], ...]  # elements of nested Sequentials
    after: Tuple[Tuple[nn.Module, Tuple[str, ...]], ...]   # run before / after the run


class PlannedRun(NamedTuple):
    plan: "RunPlan"
    decision: Decision
    in_place: Optional[_Run]  # the same run, put in place by an earlier fuse and kept


class MemberPlan(NamedTuple):
    """A child Linear/activation that becomes member ``index`` of a run."""
    call: LayerCall
    index: int


@dataclass
class RunPlan:
    """How one unit of module calls is put in place (computed before anything changes, for the
    report too)."""
    how: str                          # "sequential", "children" or "across"
    where: str                        # the module holding every layer of the unit ("" = model)
    layer_calls: List[LayerCall]
    activation: LayerActivations      # the name, or one per activated layer (a mixed run)
    last_act: bool
    parts: List[PartPlan] = field(default_factory=list)
    members: List[MemberPlan] = field(default_factory=list)
    calls: List[str] = field(default_factory=list)  # the members' labels, in the owner's call order
    sequences: List[nn.Module] = field(default_factory=list)  # must keep their elements
    slots: List[Slot] = field(default_factory=list)
    unhooked: List[nn.Module] = field(default_factory=list)
    owner: Optional[nn.Module] = None  # the module whose forward calls the members
    guards: List[_Guard] = field(default_factory=list)  # those of the forwards the run crosses
    # per member Sequential: the run of its own elements it computes fused when called on its own
    alone: Dict[int, List[LayerCall]] = field(default_factory=dict)
    note: str = ""
    gated: Optional[GatedCall] = None  # a gated MLP, computed by gated_mlp
    inline: Optional[InlineCall] = None  # a run with function calls between its Linears
    # (Identity or Dropout, k): the modules between its layers, after its item k
    passes: List[Tuple[Slot, int]] = field(default_factory=list)

    @property
    def key(self) -> Tuple[Any, ...]:
        g = self.gated
        if g is not None:
            return ("gated", tuple(c.module for c in self.layer_calls), g.act.name,
                    g.gate_second)
        if self.inline is not None:
            return ("inline", tuple(c.module for c in self.layer_calls), self.activation)
        return (tuple(c.module for c in self.layer_calls), self.last_act)

    def part_keys(self) -> List[Tuple[nn.Module, Tuple[Any, ...]]]:
        return [(part.seq, (part.names, part.role, part.index, self.key)) for part in self.parts]


def _call_parent(analysis: ModelAnalysis, m: nn.Module) -> Optional[nn.Module]:
    places = analysis.paths.get(id(m), [])
    if len(places) != 1 or places[0] not in analysis.parent:
        return None
    parent, ppath, _ = analysis.parent[places[0]]
    while isinstance(parent, (nn.ModuleList, nn.ModuleDict)) and ppath in analysis.parent:
        parent, ppath, _ = analysis.parent[ppath]
    return parent


def _ancestry(analysis: ModelAnalysis, layer_calls: Sequence[LayerCall]):
    """Each call's containers from its own upward, and the lowest one they share."""
    chains = []
    for s in layer_calls:
        chain = [s.container]
        while len(chain) < 256:
            p = _call_parent(analysis, chain[-1])
            if p is None:
                break
            chain.append(p)
        chains.append(chain)
    ids = [{id(c) for c in chain} for chain in chains]
    lca = next((c for c in chains[0] if all(id(c) in x for x in ids)), None)
    return chains, lca


def where(analysis: ModelAnalysis, layer_calls: Sequence[LayerCall]) -> str:
    _, lca = _ancestry(analysis, layer_calls)
    return analysis.path_of(lca) if lca is not None else ""


def _below(analysis: ModelAnalysis, upper: nn.Module, lower: nn.Module) -> str:
    """The name under which ``upper`` reaches ``lower`` ("2", or "blocks.0" through a
    ModuleList)."""
    up, low = analysis.path_of(upper), analysis.path_of(lower)
    return low[len(up) + 1:] if up else low


def _descent(analysis: ModelAnalysis, call: LayerCall, chain: List[nn.Module], lca: nn.Module):
    """[(container, name)] from the lca down to the call: each container on the way and the
    name of what it holds next."""
    ids = [id(c) for c in chain]
    path = chain[:ids.index(id(lca)) + 1][::-1]  # lca, ..., call.container
    steps = [(upper, _below(analysis, upper, lower)) for upper, lower in zip(path, path[1:])]
    return steps + [(call.container, call.name)]


def plan_run(analysis: ModelAnalysis, layer_calls: List[LayerCall],
             activation: LayerActivations, last_act: bool,
             between: Sequence[Sequence[Slot]] = ()) -> Optional[RunPlan]:
    """Where the unit of these calls is computed: by the Sequential holding them all, or inside
    the forward of their lowest common caller (the owner), whose calls become members (an
    Identity or Dropout a forward calls between them too: ``between[i]``, after call i); None
    when no module calls them all."""
    chains, lca = _ancestry(analysis, layer_calls)
    if lca is None:
        return None
    inside: Dict[int, nn.Module] = {}  # containers below the lca that hold layers of the run
    for chain in chains:
        for c in chain:
            if c is lca:
                break
            inside[id(c)] = c
    p = RunPlan("", analysis.path_of(lca), layer_calls, activation, last_act)
    first = _descent(analysis, layer_calls[0], chains[0], lca)
    last = _descent(analysis, layer_calls[-1], chains[-1], lca)

    def before(steps):  # the elements of each nested container before the run's first layer
        out = []
        for seq, name in steps:
            names = list(seq._modules)
            if names.index(name):
                out.append((seq, tuple(names[:names.index(name)])))
        return tuple(out)

    def after(steps):  # ... and after its last layer, innermost first
        out = []
        for seq, name in reversed(steps):
            names = list(seq._modules)
            if names.index(name) + 1 < len(names):
                out.append((seq, tuple(names[names.index(name) + 1:])))
        return tuple(out)

    p.sequences = [c for c in inside.values() if is_sequential(c)]
    p.unhooked = list(inside.values())
    p.passes = [(slot, i) for i, slots in enumerate(between) for slot in slots]
    p.slots += [slot for slot, _ in p.passes]
    p.unhooked += [slot.holder for slot, _ in p.passes
                   if is_sequential(slot.holder) and slot.holder not in p.unhooked]
    crossed = [c for c in inside.values() if not is_sequential(c)]  # their forwards run it
    if is_sequential(lca):
        if crossed:  # a Sequential computes its elements: it marks no region
            return None
        names = list(lca._modules)
        i0, i1 = names.index(first[0][1]), names.index(last[0][1])
        p.parts.append(PartPlan(lca, tuple(names[i0:i1 + 1]), PartRole.WHOLE, 0,
                                before(first[1:]), after(last[1:])))
        p.how = "sequential" if len(first) == 1 and len(last) == 1 else "across"
        p.sequences.insert(0, lca)
        if p.how == "across":
            crossed = ", ".join(analysis.path_of(c) for c in inside.values())
            p.note = (f"it crosses {crossed} inside {p.where or '<model>'}, which computes the "
                      f"whole run; called on its own, each of them computes its own layers")
        return p
    # The calls the run is made of, in order: child Linear/activation modules of the lca or of a
    # module whose forward it crosses, or the outermost Sequential on the way down to a layer.
    # Each becomes a member of the run.
    units: List[Any] = []
    for i, (s, chain) in enumerate(zip(layer_calls, chains)):
        below = chain[:[id(c) for c in chain].index(id(lca))]
        u = next((c for c in reversed(below) if is_sequential(c)), s)
        if not units or units[-1] is not u:
            units.append(u)
        # a module a forward calls between two calls of the run passes the run's output on
        units += [LayerCall(slot.holder, slot.name, slot.module, LayerKind.PASS, slot.label)
                  for slot in (between[i] if i < len(between) else ())
                  if not is_sequential(slot.holder)]
    for c in crossed:
        holder, hpath, hname = analysis.parent[analysis.paths[id(c)][0]]
        p.slots.append(Slot(holder, hname, c, join_path(hpath, hname)))
        at = _below(analysis, lca, c)
        p.guards += [g._replace(path=join_path(at, g.path) if g.path else at)
                     for g in analysis.trace_of(c).guards]
    for k, u in enumerate(units):
        if isinstance(u, LayerCall):
            p.members.append(MemberPlan(u, k))
            if u.kind is not LayerKind.PASS:  # a pass's slot is there already
                p.slots.append(Slot(u.container, u.name, u.module, u.label))
            p.calls.append(u.label)
            continue
        holder, hpath, hname = analysis.parent[analysis.paths[id(u)][0]]
        p.slots.append(Slot(holder, hname, u, join_path(hpath, hname)))
        p.calls.append(analysis.path_of(u))
        names = list(u._modules)
        if k == 0:
            down = _descent(analysis, layer_calls[0], chains[0], u)
            p.parts.append(PartPlan(u, tuple(names[names.index(down[0][1]):]), PartRole.FIRST,
                                    0, before(down[1:]), ()))
        elif k == len(units) - 1:
            down = _descent(analysis, layer_calls[-1], chains[-1], u)
            p.parts.append(PartPlan(u, tuple(names[:names.index(down[0][1]) + 1]), PartRole.ON,
                                    k, (), after(down[1:])))
        else:
            p.parts.append(PartPlan(u, tuple(names), PartRole.ON, k, (), ()))
        alone = _alone(u, layer_calls)
        if alone:
            p.alone[id(u)] = alone
    p.how = "children" if all(isinstance(u, LayerCall) and u.container is lca for u in units) \
        else "across"
    p.owner = lca
    where = p.where or "<model>"
    method = analysis.trace_of(lca).method
    if p.how == "across":
        crosses = ", ".join([analysis.path_of(c) for c in crossed] or p.calls)
        p.note = (f"it crosses {crosses} in {where}: inside {where}.{method}, "
                  f"{p.calls[0]} computes the whole run and {', '.join(p.calls[1:])} "
                  f"pass{'es' if len(p.calls) == 2 else ''} its output on; called any other "
                  f"way, each computes its own layers")
        for alone_calls in p.alone.values():
            p.note += (f" ({alone_calls[0].label}..{alone_calls[-1].label} as one run of "
                       f"its own)")
    return p


def _alone(seq: nn.Module, layer_calls: Sequence[LayerCall]) -> Optional[List[LayerCall]]:
    """The longest stretch of the run's layers that are consecutive elements of ``seq``, from a
    Linear to a Linear with at least two of them: a run seq computes fused when called on its own
    (its inner activations feed only its next Linear; where its output goes is not known
    there)."""
    best: List[LayerCall] = []
    stretch: List[LayerCall] = []
    for s in list(layer_calls) + [None]:
        if s is not None and s.node is None and s.container is seq and \
                (not stretch or s.index == stretch[-1].index + 1):
            stretch.append(s)
            continue
        while stretch and stretch[0].kind is not LayerKind.LINEAR:
            stretch.pop(0)
        while stretch and stretch[-1].kind is not LayerKind.LINEAR:
            stretch.pop()
        if len(stretch) >= 3 and len(stretch) > len(best):
            best = stretch
        stretch = [s] if s is not None and s.node is None and s.container is seq else []
    return best or None


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


def in_place(analysis: ModelAnalysis, plan: RunPlan,
             existing: Dict[Any, _Run]) -> Optional[_Run]:
    """The run an earlier fuse put in place for exactly this plan, if it is still whole."""
    run = existing.get(plan.key)
    if run is None or run.problem() is not None:
        return None
    for seq, key in plan.part_keys():
        if not any(p.key == key and p.run is run for p in parts_of(seq)):
            return None
    for call, k in plan.members:
        m = call.module
        if getattr(m, "_ckpt_ext_run", None) is not run or m._ckpt_ext_index != k:
            return None
    if plan.owner is not None:
        fwd = vars(plan.owner).get(analysis.trace_of(plan.owner).method)
        if not isinstance(fwd, _OwnerForward) or run not in fwd.runs:
            return None
    return run


def _already(d: Decision) -> Decision:
    return dataclasses.replace(d, action="already fused")


# ------------------------------------------------------------------------------------------------
# The plan of a whole model

class PlannedRewrite(NamedTuple):
    path: str
    module: nn.Module
    trace: Trace
    units: List[Unit]


@dataclass
class ModelPlan:
    """Everything fuse does to one model, made before anything changes: the runs of module calls
    to put in place, the forwards to rewrite, and the report's decisions, by the module holding
    their layers (fused and already fused first, then the near misses)."""
    runs: List[PlannedRun] = field(default_factory=list)
    rewrites: List[PlannedRewrite] = field(default_factory=list)
    fused_at: Dict[str, List[Decision]] = field(default_factory=dict)
    missed_at: Dict[str, List[Decision]] = field(default_factory=dict)

    def add(self, d: Decision) -> None:
        store = self.missed_at if d.action == "left alone" else self.fused_at
        store.setdefault(d.where, []).append(d)

    def refuse(self, units: Sequence[Unit], why: str) -> None:
        """The units of a rewrite that failed: left alone, each in its place in the report."""
        ids = {id(u.decision) for u in units}
        for store in (self.fused_at, self.missed_at):
            for key, ds in store.items():
                store[key] = [d if id(d) not in ids else _refused(d, why) for d in ds]

    def decisions(self, model: nn.Module) -> List[Decision]:
        """Every decision, in the order of the modules holding their layers."""
        order = [path for path, _ in model.named_modules()]
        out: List[Decision] = []
        for path in order + sorted((set(self.fused_at) | set(self.missed_at)) - set(order)):
            out += self.fused_at.get(path, []) + self.missed_at.get(path, [])
        return out


def plan_model(analysis: ModelAnalysis, policy: str, rewrite: bool) -> ModelPlan:
    """The plan for the analysed model: forward code to rewrite first (its nodes are then no
    one else's), then the runs of Linear/activation module calls, inside a container or across
    several."""
    plan = ModelPlan()
    taken_nodes: set = set()
    existing = {r.key: r for r in existing_runs(analysis.model)}
    for path, m in analysis.model.named_modules():
        t = analysis.trace_of(m) if not is_sequential(m) else None
        if t is not None:
            _plan_placeheld(analysis, find_gated(analysis, path, m, t), gated_decision,
                            plan_gated, existing, taken_nodes, plan)
    traced = [(path, m, analysis.trace_of(m)) for path, m in analysis.model.named_modules()
              if not is_sequential(m) and analysis.trace_of(m) is not None]
    # a forward to rewrite is rewritten first; in the others a run with function calls between
    # child Linears is computed in a region, and what is left is a near miss
    first = {id(m): rewrite and t.rewrite_problem is None for _, m, t in traced}
    for path, m, t in traced:
        if first[id(m)] and not t.already_rewritten:
            _plan_rewrite(analysis, path, m, t, policy, rewrite, taken_nodes, plan)
    for path, m, t in traced:
        _plan_placeheld(analysis, find_inline(analysis, path, m, t, taken_nodes),
                        lambda c: inline_decision(c, policy), plan_inline, existing,
                        taken_nodes, plan)
    for path, m, t in traced:
        if not first[id(m)] and not t.already_rewritten:
            _plan_rewrite(analysis, path, m, t, policy, rewrite, taken_nodes, plan)
    discovery = RunDiscovery(analysis, taken_nodes)
    runs, stops = discovery.runs()
    for layer_calls in runs:
        _plan_calls(analysis, discovery, layer_calls, stops.get(layer_calls[-1]), policy,
                    existing, plan)
    return plan


def _plan_placeheld(analysis: ModelAnalysis, found: Sequence[Any],
                    decision: Callable[[Any], Decision], make: Callable[..., RunPlan],
                    existing: Dict[Any, _Run], taken_nodes: set, plan: ModelPlan) -> None:
    """The gated MLPs (``GatedCall``) or runs with function calls between their Linears
    (``InlineCall``) found in one forward: each fused is one unit of its Linears, whose nodes are
    then no other unit's (a gate and its activation are no lone pair); one left alone is
    reported, and its nodes stay free for the rest of the discovery."""
    for c in found:
        d = decision(c)
        if c.problems:
            plan.add(d)
            continue
        rp = make(analysis, c)
        d = _arguments_note(analysis, rp, d)
        already = in_place(analysis, rp, existing)
        plan.runs.append(PlannedRun(rp, d, already))
        plan.add(_already(d) if already is not None else d)
        taken_nodes.update(c.nodes)


def plan_gated(analysis: ModelAnalysis, g: GatedCall) -> RunPlan:
    """A gated MLP computed inside its owner's forward: the Linears are the members, in call
    order; the activation module and Dropouts must stay in place and unhooked too."""
    calls = [LayerCall(g.owner, n.target, g.child(n), LayerKind.LINEAR, g.label(n), node=n,
                       trace=g.trace) for n in g.linears]
    p = RunPlan("children", g.path, calls, g.act.name, False, owner=g.owner, gated=g)
    others = ([g.act_node] if g.act_module is not None else []) + list(g.dropouts)
    for k, c in enumerate(calls):
        p.members.append(MemberPlan(c, k))
        p.calls.append(c.label)
    for n in list(g.linears) + others:
        sub = g.child(n)
        p.slots.append(Slot(g.owner, n.target, sub, g.label(n)))
        p.unhooked.append(sub)
    return p


def plan_inline(analysis: ModelAnalysis, c: InlineCall) -> RunPlan:
    """A run with function calls between its Linears, computed inside its owner's method: the
    Linears are the members; its activation and Dropout modules stay in place and unhooked."""
    calls = [LayerCall(c.owner, n.target, c.child(n), LayerKind.LINEAR,
                       node_label(n, c.path), node=n, trace=c.trace) for n in c.linears]
    p = RunPlan("children", c.path, calls,
                collapse_activations([found.name for found, _, _ in c.acts]), False,
                owner=c.owner, inline=c)
    for k, call in enumerate(calls):
        p.members.append(MemberPlan(call, k))
        p.calls.append(call.label)
    for n in c.nodes:
        if n.op == "call_module":
            sub = c.child(n)
            p.slots.append(Slot(c.owner, n.target, sub, node_label(n, c.path)))
            p.unhooked.append(sub)
    return p


def _plan_rewrite(analysis: ModelAnalysis, path: str, m: nn.Module, t: Trace, policy: str,
                  rewrite: bool, taken_nodes: set, plan: ModelPlan) -> None:
    """Chains in ``m``'s forward code that hold a function call: fused only by a rewrite."""
    misses: List[Decision] = []
    units: List[Unit] = []
    for chain in graph_chains(analysis, path, m, t, rewrite, misses, taken_nodes):
        chain_units, chain_misses = decide(chain, policy)
        misses += chain_misses
        for u in chain_units:
            units.append(u)
            plan.add(u.decision)
    for d in misses:
        plan.add(d)
    if units:
        plan.rewrites.append(PlannedRewrite(path, m, t, units))


def _plan_calls(analysis: ModelAnalysis, discovery: RunDiscovery, layer_calls: List[LayerCall],
                stop: Optional[str], policy: str, existing: Dict[Any, _Run],
                plan: ModelPlan) -> None:
    """The units of one discovered run of module calls, placed; ``stop``: why it ends there."""
    at = where(analysis, layer_calls)
    labels = [s.label for s in layer_calls]
    problems = [discovery.problem(s) for s in layer_calls]
    found: List[Decision] = []
    item_misses(at, labels, problems, found)
    shapes = [layer_shape(s.label, s.module) for s in layer_calls[0::2]]
    full = Chain(at, "", labels, layer_calls, shapes,
                 tuple(s.activation for s in layer_calls[1::2]), len(layer_calls) % 2 == 0,
                 lambda: Fate(None, ""), _inner_fates(discovery, layer_calls),
                 tuple(module_tensors(s.module, s.activation) for s in layer_calls[1::2]))
    for s, e in split_at_problems(problems, len(layer_calls)):
        last = layer_calls[e - 1]
        sub = sub_chain(full, s, e, lambda last=last: discovery.fate(last))
        sub.where = where(analysis, sub.items)
        problem = chain_problem([x.module for x in sub.items[0::2]])
        if problem is not None:
            found.append(Decision(sub.where, tuple(sub.labels), "left alone", "", "", 0, 0, 0,
                                  problem))
            continue
        units, misses = decide(sub, policy)
        found += misses
        for u in units:
            a, b = sub.span(u.first, u.last, u.last_act)
            between = [discovery.through[c] for c in sub.items[a:b - 1]]
            run_plan = plan_run(analysis, sub.items[a:b], u.activation, u.last_act, between)
            d = u.decision
            if run_plan is None:  # no module calls them all: no region to compute it in
                found.append(dataclasses.replace(
                    d, action="left alone", unit="", how="", bytes_per_row=0,
                    why="its layers share no container that calls them in sequence"))
                continue
            note = run_plan.note
            if run_plan.passes:
                note = "; ".join(filter(None, [_through(run_plan.passes), note]))
            d = dataclasses.replace(d, where=run_plan.where, how=run_plan.how,
                                    bytes_per_row=d.bytes_per_row + _mask_bytes(
                                        run_plan.passes, sub.layers[u.first:],
                                        sub.activations[u.first:],
                                        _on_cuda(sub.items[a].module)),
                                    why=d.why + (f"; {note}" if note else ""))
            d = _arguments_note(analysis, run_plan, d)
            already = in_place(analysis, run_plan, existing)
            plan.runs.append(PlannedRun(run_plan, d, already))
            found.append(_already(d) if already is not None else d)
    position = {label: i for i, label in enumerate(labels)}
    found.sort(key=lambda d: position.get(d.layers[0], len(labels)))  # in call order
    by_label = {s.label: s for s in layer_calls}
    for d in found:
        if d.action == "left alone":  # placed at the module holding its own layers
            d = dataclasses.replace(d, where=where(analysis, [by_label[x] for x in d.layers]))
        if stop and layer_calls[-1].label in d.layers:
            d = dataclasses.replace(
                d, why=f"{d.why}; the run stops after {layer_calls[-1].label}: {stop}")
        plan.add(d)


def _arguments_note(analysis: ModelAnalysis, rp: RunPlan, d: Decision) -> Decision:
    """A unit whose owner's forward was traced with an argument given that it tests against
    None is computed fused only in calls where it is given: the report says so."""
    t = analysis.trace_of(rp.owner) if rp.owner is not None else None
    if t is None or t.arg_guard is None or not t.arg_guard.given:
        return d
    return dataclasses.replace(d, why=f"{d.why}; computed fused in calls giving "
                                      f"{', '.join(t.arg_guard.given)} (not None), module by "
                                      f"module in others")


def _passing(m: nn.Module) -> str:
    return f"Dropout(p={m.p}{'' if m.training else ', eval'})" if isinstance(m, nn.Dropout) \
        else base_type(m).__name__


def _on_cuda(lin: nn.Module) -> bool:
    w = stored_weight(lin)
    return w is not None and w.device.type == "cuda"


def _through(passes: Sequence[Tuple[Slot, int]]) -> str:
    slots = [slot for slot, _ in passes]
    drawing = [slot.label for slot in slots if not passes_through(slot.module)]
    return ("through " + ", ".join(f"{s.label} ({_passing(s.module)})" for s in slots) +
            (f"; {', '.join(drawing)} " +
             ("draws its mask" if len(drawing) == 1 else "draw their masks") +
             " inside the unit, which keeps the generator's state and draws "
             + ("it" if len(drawing) == 1 else "them") + " again in backward"
             if drawing else "") +
            "; a call in which one of them draws a mask fuse cannot draw computes module by "
            "module")


def _inner_fates(discovery: RunDiscovery, layer_calls: Sequence[LayerCall]) -> Dict[int, Fate]:
    """Activation j's output goes to a Dropout drawing a mask, which keeps only that."""
    out = {}
    for j, call in enumerate(layer_calls[1::2]):
        drawing = [p for p in discovery.through.get(call, ()) if not passes_through(p.module)]
        if drawing:
            out[j] = Fate(False, f"its user {drawing[0].label} (Dropout, p={drawing[0].module.p})"
                                 f" keeps only its mask (in train(); in eval() it passes the "
                                 f"value on)")
    return out


def _mask_bytes(passes: Sequence[Tuple[Slot, int]], layers: Sequence[LayerShape],
                activations: Sequence[str], on_cuda: bool) -> int:
    """What stock autograd keeps per row for the Dropouts drawing a mask after an activation."""
    masks: Dict[int, int] = {}
    for slot, k in passes:
        if not passes_through(slot.module):
            masks[k] = masks.get(k, 0) + 1
    return mask_bytes(masks, layers, activations, on_cuda)


def _refused(d: Decision, why: str) -> Decision:
    return dataclasses.replace(d, action="left alone", unit="", how="",
                               why=f"the forward rewrite failed: {why}")
