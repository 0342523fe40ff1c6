"""The model's values as one graph (:class:`ModelGraph`), built once per ``fuse()`` from the traces:
its modules, their calls and layer calls, and what keeps a call from a unit; where its values go is
the view of :mod:`.values`. Design: docs/converter.md."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from torch import fx, nn

from .facts import Fact, LayerKind, NodeFact, Recognised, node_facts
from .tracing import Trace, statement_source
from .values import ValueFates


@dataclass(eq=False)
class LayerCall:
    """One call of a Linear or activation module: a Sequential's element, or a child ``node``."""
    container: nn.Module
    name: str
    module: nn.Module
    kind: LayerKind
    label: str
    index: int = -1                   # its index among the Sequential's elements
    node: Optional[fx.Node] = None
    trace: Optional[Trace] = None
    found: Optional[Recognised] = None  # what an activation computes
    activation: Optional[str] = None    # its name


_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


class ModelGraph(ValueFates):
    """One model's module tree, its traces and the calls they make, and the queries on them."""

    def __init__(self, model: nn.Module, facts: Dict[int, Fact], traces: Dict[int, Trace]):
        self.model, self.facts, self.traces = model, facts, traces
        self.paths: Dict[int, List[str]] = {}  # id(module) -> every path it is held at
        self.parent: Dict[str, Tuple[nn.Module, str, str]] = {}  # path -> (parent, path, name)
        self.slots: Dict[int, set] = {}  # id(module) -> {(id(parent), name)}
        for path, m in model.named_modules(remove_duplicate=False):
            self.paths.setdefault(id(m), []).append(path)
            for name, c in m._modules.items():
                if c is not None:
                    self.parent[f"{path}.{name}" if path else name] = (m, path, name)
                    self.slots.setdefault(id(c), set()).add((id(m), name))
        self.modules = list(model.named_modules())
        self.path = {id(m): p for p, m in self.modules}  # id(module) -> its (first) path
        self.trace = {id(m): t for p, m in self.modules  # id(module) -> its analysed trace
                      for t in [traces.get(id(m))] if t is not None and t.ok}
        #: id(module) -> (the Sequential or module whose forward calls it, its path, the name it
        #: calls it by: "blocks.0" through a ModuleList), from its first place
        self.caller: Dict[int, Tuple[nn.Module, str, str]] = {}
        for p, m in self.modules:
            if p in self.parent:
                parent, ppath, target = self.parent[p]
                while isinstance(parent, _CONTAINERS) and ppath in self.parent:
                    parent, ppath, holder = self.parent[ppath]
                    target = f"{holder}.{target}"
                self.caller[id(m)] = (parent, ppath, target)
        self.analysed = [(p, m, self.trace[id(m)]) for p, m in self.modules
                         if not facts[id(m)].sequential and id(m) in self.trace]
        #: of every node of every analysed forward
        self.nodes: Dict[fx.Node, NodeFact] = node_facts(self.analysed, facts)
        self.calls: Dict[int, Dict[str, List[fx.Node]]] = {}  # id(owner) -> {target: its calls}
        for p, m, t in self.analysed:
            calls = self.calls[id(m)] = {}
            for n in t.graph.nodes:
                if n.op == "call_module":
                    calls.setdefault(n.target, []).append(n)
        self.layer_calls = self._layer_calls()

    def calls_of(self, owner: nn.Module, target: str) -> List[fx.Node]:
        return self.calls.get(id(owner), {}).get(target, [])

    def child_problem(self, owner: nn.Module, t: Trace, target: str, label: str, sub):
        """Why child ``target`` of ``owner`` may not be a member of a unit in its region."""
        calls = self.calls_of(owner, target)
        if len(calls) != 1:
            return f"{label} is called {len(calls)} times"
        owner_label = self.path[id(owner)] or "<model>"
        if t.region_problem is not None:
            return f"{owner_label} cannot mark the run's region: {t.region_problem}"
        if calls[0].name in t.indirect:
            return (f"{label} is called through {t.indirect[calls[0].name]}, not by "
                    f"{owner_label}.forward itself (it may run again on its own, as checkpoint "
                    f"does in backward)")
        if len(self.slots.get(id(sub), ())) != 1:  # held elsewhere too: it may be called there
            return f"{label} is also held elsewhere: {', '.join(self.paths[id(sub)][1:])}"
        return None

    def members_problems(self, owner: nn.Module, t: Trace, children: Sequence[fx.Node]) -> list:
        """What keeps each child these nodes call from being a member of a unit in the region."""
        out = []
        for n in children:
            sub = owner._modules[n.target]
            out += [self.facts[id(sub)].problem,
                    self.child_problem(owner, t, n.target, self.nodes[n].label, sub)]
        return out

    def placeholder_problems(self, path: str, owner: nn.Module, t: Trace, linears,
                             excused: Callable[[Any], bool] = lambda stmt: False) -> list:
        """Why the method may compute, between a unit's Linears, what the analysis did not see."""
        where = f"{path or '<model>'}.{t.method}"
        code = getattr(inspect.unwrap(getattr(type(owner), t.method)), "__code__", None)
        out = [f"{where} calls {name}, whose paths fuse does not follow (the fused op would skip "
               f"what it does between the Linears)" for name in t.calls_out]
        if t.unrun is None:
            out.append(f"the source of {where} cannot be read, so fuse cannot check that tracing "
                       f"saw every statement it runs")
        for line in t.unrun or ():
            if t.cut_line is not None and line > t.cut_line:
                continue  # after the branch fx could not follow: the unit ran whole before it
            if not excused(statement_source(code, line)):
                out.append(f"{where} may run code that fx did not see run (line {line}: a branch, "
                           f"or a part of a conditional expression), which at call time would "
                           f"work on what the fused op does not compute")
        if t.already_rewritten:
            source = vars(owner)[t.method].source
            if any(f"self.{n.target}(" not in source for n in linears):
                out.append(f"{path or '<model>'}.forward was rewritten by an earlier fuse")
        return out

    def _layer_calls(self) -> List[LayerCall]:
        out = []
        for path, m in self.modules:
            t = self.trace.get(id(m))
            if self.facts[id(m)].sequential:
                for i, (name, e) in enumerate(m._modules.items()):
                    f = self.facts.get(id(e))
                    if f is not None and f.kind is not None:
                        out.append(LayerCall(m, name, e, f.kind, f"{path}.{name}" if path
                                             else name, i, found=f.found,
                                             activation=f.found and f.found.name))
            elif t is not None:
                # a forward an earlier fuse rewrote calls the child modules its rewrite left alone
                calls = vars(m)["forward"].source if t.already_rewritten else None
                for node in t.graph.nodes:  # a Linear held in a list is only fused by a rewrite
                    nf = self.nodes[node]
                    if nf.child is not None and nf.kind is not None and \
                            (calls is None or f"self.{node.target}(" in calls):
                        out.append(LayerCall(m, node.target, nf.child, nf.kind, nf.label,
                                             node=node, trace=t, found=nf.found,
                                             activation=nf.found and nf.found.name))
        return out
