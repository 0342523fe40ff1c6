"""The model's values as one graph, built once per ``fuse()`` from the per-forward traces
(tracing.py; each forward traced on its own, every child opaque, so that an untraceable forward
is isolated): the module tree (every place a module is held), the calls of each analysed
forward and each Sequential's elements, and where a value goes across module boundaries — into
the first element of a Sequential or the forward of a module it is passed to, out of a forward
that returns it to the call of its module, on to the next element. The queries every unit kind
asks are here: ``caller[id(m)]``, ``calls[id(owner)][target]``, ``child_problem`` (may a
run reach this call), ``fate(value)`` (do the consumers keep it for backward), ``follow(call)``
(the one call that receives a layer's output, and why a run may not take that step),
``placeholder_problems`` (may a unit's members pass placeholders in this forward).

Glossary: a *layer call* (:class:`LayerCall`) is one call of a Linear or activation module, an
element of a Sequential or a direct child an analysed forward calls; a value's *fate*
(:class:`Fate`) says whether its consumers keep it for backward."""
from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from torch import fx, nn

from .facts import (ACROSS, DROPOUT_FUNCTIONS, DROPOUT_SIGNATURE, FREEING_FUNCTIONS,
                    FREEING_METHODS, FREEING_MODULES, KEEPING_FUNCTIONS,
                    KEEPING_METHODS, KEEPING_MODULES, META_FUNCTIONS, META_METHODS,
                    PASS_THROUGH_MODULES, SAVES_INPUT, SCALING_FUNCTIONS, SCALING_METHODS,
                    VIEW_FUNCTIONS, VIEW_METHODS, Fact, LayerKind, NodeFact, NoHooks, OwnForward,
                    Recognised, Slot, failing, node_facts)
from .tracing import Trace, after_branch, statement_source


@dataclass(eq=False)
class LayerCall:
    """One call of a Linear or activation module: an element of a Sequential, or a direct child
    that an analysed forward calls (``node`` in its graph)."""
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


class Fate(NamedTuple):
    """What the consumers of a value do with it."""
    kept: Optional[bool]  # True: kept for backward by a consumer, False: not kept, None: unknown
    why: str


_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


class ModelGraph:
    """One model's module tree, its traces and the calls they make, and the queries on them."""

    def __init__(self, model: nn.Module, facts: Dict[int, Fact],
                 traces: Dict[int, Trace]) -> None:
        self.model, self.facts, self.traces = model, facts, traces
        self.paths: Dict[int, List[str]] = {}  # id(module) -> every path it is held at
        self.parent: Dict[str, Tuple[nn.Module, str, str]] = {}  # path -> (parent, path, name)
        self.slots: Dict[int, set] = {}  # id(module) -> {(id(parent), name)}: where it is held
        for path, m in model.named_modules(remove_duplicate=False):
            self.paths.setdefault(id(m), []).append(path)
            for name, c in m._modules.items():
                if c is not None:
                    self.parent[f"{path}.{name}" if path else name] = (m, path, name)
                    self.slots.setdefault(id(c), set()).add((id(m), name))
        self.modules = list(model.named_modules())
        #: id(module) -> its (first) path
        self.path = {id(m): p for p, m in self.modules}
        #: id(module) -> its analysed trace, where it has one
        self.trace = {id(m): t for p, m in self.modules
                      for t in [traces.get(id(m))] if t is not None and t.ok}
        #: id(module) -> (the Sequential or module whose forward calls it, that one's path, the
        #: name it calls it by: "blocks.0" through a ModuleList), from its first place
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
        #: what each node of every analysed forward computes
        self.nodes: Dict[fx.Node, NodeFact] = {}
        #: id(owner) -> {target: the nodes of its analysed forward calling that submodule}
        self.calls: Dict[int, Dict[str, List[fx.Node]]] = {}
        for p, m, t in self.analysed:
            self.nodes.update(node_facts(t.graph, m, p, facts))
            calls = self.calls[id(m)] = {}
            for n in t.graph.nodes:
                if n.op == "call_module":
                    calls.setdefault(n.target, []).append(n)
        self.layer_calls = self._layer_calls()

    def calls_of(self, owner: nn.Module, target: str) -> List[fx.Node]:
        return self.calls.get(id(owner), {}).get(target, [])

    def child_problem(self, owner: nn.Module, t: Trace, target: str, label: str,
                      sub: nn.Module) -> Optional[str]:
        """Why a run may not reach child ``target`` that ``owner``'s forward calls (as a member
        of a unit computed inside that forward's region), else None."""
        calls = len(self.calls_of(owner, target))
        if calls != 1:
            return f"{label} is called {calls} times"
        owner_label = self.path[id(owner)] or "<model>"
        if t.region_problem is not None:
            return f"{owner_label} cannot mark the run's region: {t.region_problem}"
        node = self.calls_of(owner, target)[0]
        if node.name in t.indirect:
            return (f"{label} is called through {t.indirect[node.name]}, not by "
                    f"{owner_label}.forward itself (it may run again on its own, as checkpoint "
                    f"does in backward)")
        if len(self.slots.get(id(sub), ())) != 1:  # held elsewhere too: it may be called there
            return f"{label} is also held elsewhere: {', '.join(self.paths[id(sub)][1:])}"
        return None

    def members_problems(self, owner: nn.Module, t: Trace, children: Sequence[fx.Node]):
        """What keeps each child a forward calls (a Linear, an activation module) from being a
        member of a unit its region computes."""
        for n in children:
            sub = owner._modules[n.target]
            yield self.facts[id(sub)].problem
            yield self.child_problem(owner, t, n.target, self.nodes[n].label, sub)

    def placeholder_problems(self, path: str, owner: nn.Module, t: Trace,
                             linears: Sequence[fx.Node],
                             excused: Callable[[Any], bool] = lambda stmt: False):
        """Why the traced method may compute something between a unit's Linears that the
        analysis did not see (the members pass zero-width placeholders there, so such code would
        work on nothing): a Python function it calls, a statement tracing did not run whole
        (unless ``excused``), source that cannot be read, or a forward an earlier fuse
        rewrote."""
        where = f"{path or '<model>'}.{t.method}"
        code = getattr(inspect.unwrap(getattr(type(owner), t.method)), "__code__", None)
        for name in t.calls_out:
            yield (f"{where} calls {name}, whose paths fuse does not follow (the fused op would "
                   f"skip what it does between the Linears)")
        if t.unrun is None:
            yield (f"the source of {where} cannot be read, so fuse cannot check that tracing saw "
                   f"every statement it runs")
        for line in t.unrun or ():
            if t.cut_line is not None and line > t.cut_line:
                continue  # after the branch fx could not follow: the unit ran whole before it
            if not excused(statement_source(code, line)):
                yield (f"{where} may run code that fx did not see run (line {line}: a branch, or "
                       f"a part of a conditional expression), which at call time would work on "
                       f"what the fused op does not compute")
        if t.already_rewritten:
            source = vars(owner)[t.method].source
            if any(f"self.{n.target}(" not in source for n in linears):
                yield f"{path or '<model>'}.forward was rewritten by an earlier fuse"

    # -- the layer calls -------------------------------------------------------------------------
    def _layer_calls(self) -> List[LayerCall]:
        out = []
        for path, m in self.modules:
            if self.facts[id(m)].sequential:
                for i, (name, e) in enumerate(m._modules.items()):
                    f = self.facts.get(id(e))
                    if f is not None and f.kind is not None:
                        out.append(LayerCall(m, name, e, f.kind, f"{path}.{name}" if path
                                             else name, i, found=f.found,
                                             activation=f.found and f.found.name))
                continue
            t = self.trace.get(id(m))
            if t is None:
                continue
            # A forward an earlier fuse rewrote calls the child modules its rewrite left alone.
            calls = vars(m)["forward"].source if t.already_rewritten else None
            for node in t.graph.nodes:
                nf = self.nodes[node]
                if nf.child is None or nf.kind is None:
                    continue  # a Linear held in a list is only fused by a rewrite
                if calls is None or f"self.{node.target}(" in calls:
                    out.append(LayerCall(m, node.target, nf.child, nf.kind, nf.label, node=node,
                                         trace=t, found=nf.found,
                                         activation=nf.found and nf.found.name))
        return out

    # -- fates: what the consumers of a value do with it ------------------------------------------
    def fate(self, s: LayerCall) -> Fate:
        """What consumes the call's output."""
        if s.node is None:
            seq = s.container
            return self.elements_fate(seq, self.path[id(seq)], s.index + 1,
                                      lambda: self.output_fate(seq), 0)
        return self.node_fate(s.container, s.trace, s.node)

    def output_fate(self, m: nn.Module, index: Optional[int] = None, depth: int = 0) -> Fate:
        """What the callers of module ``m`` do with its output (element ``index`` of a tuple)."""
        if depth > 64:
            return Fate(None, "the chain of callers is too deep to follow")
        if m is self.model:
            return Fate(False, "returned by the model (freed unless the loss keeps it: "
                               ".mean()/.sum() do not, mse_loss does)")
        paths = self.paths.get(id(m), [])
        if len(paths) != 1:
            return Fate(None, f"{paths[0] if paths else 'a module'} sits at {len(paths)} places")
        parent, ppath, name = self.caller[id(m)]
        if self.facts[id(parent)].sequential and "." not in name:
            if index is not None:
                return Fate(None, f"{paths[0]} returns a tuple inside an nn.Sequential")
            return self.elements_fate(parent, ppath, list(parent._modules).index(name) + 1,
                                      lambda: self.output_fate(parent, None, depth + 1),
                                      depth + 1)
        t = self.traces.get(id(parent))
        if t is None or not t.ok:
            why = f" ({t.reason})" if t is not None else ""
            return Fate(None, f"its caller {ppath or '<model>'} was not analysed{why}")
        calls = self.calls_of(parent, name)
        if not calls and t.cut_line is not None:
            return Fate(None, f"{ppath or '<model>'}.{t.method} calls {name} after it branches "
                              f"on a traced value (line {t.cut_line}), which fx cannot follow")
        if len(calls) != 1:
            return Fate(None, f"{ppath or '<model>'}.forward calls {name} {len(calls)} times")
        return self.node_fate(parent, t, calls[0], index, depth + 1)

    def node_fate(self, owner: nn.Module, t: Trace, node: fx.Node, index: Optional[int] = None,
                  depth: int = 0) -> Fate:
        """What the users of ``node`` in ``owner``'s graph do with its value."""
        if depth > 64:
            return Fate(None, "the chain of users is too deep to follow")
        results: List[Fate] = []
        for u in node.users:
            if index is None:
                results.append(self._use_fate(owner, t, node, u, depth + 1))
            elif u.op == "call_function" and u.target is operator.getitem and \
                    u.args[0] is node and not isinstance(u.args[1], fx.Node):
                if u.args[1] == index:
                    results.append(self.node_fate(owner, t, u, None, depth + 1))
            else:
                results.append(Fate(None, f"output {index} is used as part of a whole"))
        return _combine(results)

    def _use_fate(self, owner: nn.Module, t: Trace, node: fx.Node, u: fx.Node,
                  depth: int) -> Fate:
        opath = self.path[id(owner)]
        if u.op == "output":
            if t.method != "forward":
                return Fate(None, f"{opath or '<model>'}.{t.method} returns it to callers fuse "
                                  f"did not analyse")
            out = u.args[0]
            if out is node:
                return self.output_fate(owner, None, depth)
            if isinstance(out, (tuple, list)):
                where = [i for i, o in enumerate(out) if o is node]
                if len(where) == 1:
                    return self.output_fate(owner, where[0], depth)
            return Fate(None, f"{opath or '<model>'} returns it inside a nested structure")
        on_output = (lambda: self.node_fate(owner, t, u, None, depth + 1))
        if u.op == "call_module":
            label = self.nodes[u].label
            others = list(u.args[1:]) + list(u.kwargs.values())
            if not u.args or u.args[0] is not node or any(a is node for a in others):
                return Fate(None, f"passed to {label} other than as its only input")
            return self._module_input_fate(owner.get_submodule(u.target), label, on_output,
                                           depth)
        if u.op not in ("call_function", "call_method"):
            return Fate(None, f"used by a {u.op} node")
        target, is_fn = u.target, u.op == "call_function"
        name = _fn_name(target)

        def among(functions: set, methods: set) -> bool:
            return target in (functions if is_fn else methods)

        if is_fn and target is after_branch:
            return Fate(None, f"used after {opath or '<model>'}.{t.method} branches on a traced "
                              f"value (line {t.cut_line}), which fx cannot follow")
        if is_fn and target in DROPOUT_FUNCTIONS:
            try:
                bound = DROPOUT_SIGNATURE.bind(*u.args, **u.kwargs)
            except TypeError:
                return Fate(None, f"used by {name} with arguments fuse cannot read")
            bound.apply_defaults()
            p, training = bound.arguments["p"], bound.arguments["training"]
            if bound.arguments["input"] is not node or isinstance(p, fx.Node) or \
                    isinstance(training, fx.Node):
                return Fate(None, f"used by {name} with a p or training fuse cannot read")
            return _dropout_fate(f"{name}(p={p})", p, training, on_output)
        if among(META_FUNCTIONS, META_METHODS):
            return Fate(False, "")
        if among(VIEW_FUNCTIONS, VIEW_METHODS):
            return on_output()
        if among(FREEING_FUNCTIONS, FREEING_METHODS):
            what = " (a residual add)" if target in (operator.add, operator.iadd, "add") else ""
            return Fate(False, f"its user {name}{what} does not keep it")
        if among(SCALING_FUNCTIONS, SCALING_METHODS):
            if any(isinstance(a, fx.Node) and a is not node for a in u.args):
                return Fate(True, f"kept by {name} with another tensor")
            return Fate(False, f"its user {name} by a constant does not keep it")
        if among(KEEPING_FUNCTIONS, KEEPING_METHODS):
            return Fate(True, f"kept by {name}")
        return Fate(None, f"used by {name}, not known to keep or free its input")

    def _module_input_fate(self, sub: nn.Module, label: str, on_output: Callable[[], Fate],
                           depth: int) -> Fate:
        """What module ``sub`` does with its input; ``on_output`` answers for its output when it
        only passes the input through."""
        fact = self.facts[id(sub)]
        if fact.sequential:
            return self.elements_fate(sub, label, 0, on_output, depth + 1)
        if isinstance(sub, PASS_THROUGH_MODULES):
            return on_output()
        if isinstance(sub, nn.modules.dropout._DropoutNd):
            return _dropout_fate(f"{label} ({type(sub).__name__}(p={sub.p}))", sub.p,
                                 sub.training, on_output)
        if isinstance(sub, FREEING_MODULES):
            return Fate(False, f"its user {label} ({type(sub).__name__}) does not keep it")
        if isinstance(sub, KEEPING_MODULES) or fact.kind is LayerKind.LINEAR:
            return Fate(True, f"kept by {label} ({type(sub).__name__} keeps its input)")
        found = fact.found
        if found is not None and found.name is not None:  # transformers' activation modules
            if SAVES_INPUT[found.name]:
                return Fate(True, f"kept by {label} ({type(sub).__name__} keeps its input)")
            return Fate(False, f"its user {label} ({type(sub).__name__}) does not keep it")
        ts = self.trace.get(id(sub))
        if ts is not None and ts.method == "forward":  # a method's inputs are not the module's
            ph = [n for n in ts.graph.nodes if n.op == "placeholder"]
            if ph:
                return self.node_fate(sub, ts, ph[0], None, depth + 1)
        return Fate(None, f"its user {label} ({type(sub).__name__}) is not known to keep or "
                          f"free it")

    def elements_fate(self, seq: nn.Module, seq_path: str, start: int,
                      on_end: Callable[[], Fate], depth: int) -> Fate:
        """What the elements of ``seq`` from ``start`` on do with their input; ``on_end``
        answers when they all pass it through."""
        names = list(seq._modules)
        for i in range(start, len(names)):
            e = seq._modules[names[i]]
            if isinstance(e, PASS_THROUGH_MODULES):
                continue
            rest = (lambda i=i: self.elements_fate(seq, seq_path, i + 1, on_end, depth + 1))
            label = f"{seq_path}.{names[i]}" if seq_path else names[i]
            return self._module_input_fate(e, label, rest, depth + 1)
        return on_end()

    # -- where a layer's output goes next: the one call receiving it ------------------------------
    def follow(self, calls: Sequence[LayerCall]) -> \
            Dict[LayerCall, Tuple[Optional[LayerCall], Optional[str], Tuple[Slot, ...]]]:
        """For each of ``calls``: (the one of them that receives its output as its only consumer,
        why a run may not take that step or None, the Identity and Dropout modules stepped over). The value
        goes between consecutive elements of a Sequential, from a Sequential's last element to
        what consumes the Sequential's output, into the first element of a Sequential it is
        passed to, between children an analysed forward calls, into and out of a child whose
        analysed forward takes it (as any one of its positional arguments) or returns it.
        Crossing a Sequential or a module needs it to have no hooks and no instance forward, to
        be held at one place and, when a forward calls it, to be called once there, directly;
        its own forward must be one whose guards can be checked."""
        at = {(id(s.container), s.name if s.node is None else s.node): s for s in calls}
        out = {}
        for s in calls:
            walk = _Walk(self, at)
            if s.node is None:
                found = walk.after_element(s.container, s.index, 0)
            else:
                found = walk.after_node(s.container, s.trace, s.node, 0)
            out[s] = (found[0], found[1], tuple(walk.passed))
        return out

    def crossing_problem(self, c: nn.Module) -> Optional[str]:
        """Why a run may not cross container ``c`` (a Sequential, or a module whose analysed
        forward it passes through), else None."""
        places = self.paths.get(id(c), [])
        label = places[0] if places else f"<a {type(c).__name__}>"
        problem = failing([NoHooks(c, label, ACROSS), OwnForward(c, label)])
        if problem is not None:
            return problem
        if len(places) != 1:
            return f"{label} is held at {len(places)} places ({', '.join(places)})"
        if not self.facts[id(c)].sequential:
            t = self.trace.get(id(c))
            if t.region_problem is not None:
                return f"the run cannot cross {label}.forward: {t.region_problem}"
            if t.arg_guard is not None:
                return (f"the run cannot cross {label}.forward: what it assumes of its "
                        f"arguments ({t.arg_guard.describe()}) is checked only where it marks a "
                        f"region")
        return None


class _Walk:
    """One step of :meth:`ModelGraph.follow`: each method returns (the call reached, why the run
    may not take the step) or (None, None) where the value has no single layer call to go to."""

    def __init__(self, graph: ModelGraph, at: Dict[Tuple[int, Any], LayerCall]) -> None:
        self.graph, self.at, self.passed, self.facts = graph, at, [], graph.facts

    def passing(self, holder: nn.Module, name: str, m: nn.Module, label: str) -> Optional[str]:
        """Note a module the value passes through; why a run may not pass it, else None."""
        self.passed.append(Slot(holder, name, m, label))
        return failing([NoHooks(m, label, ACROSS), OwnForward(m, label)])

    def enter(self, seq: nn.Module, name: str, depth: int):
        call = self.at.get((id(seq), name))
        if call is not None:
            return call, None
        e = seq._modules[name]
        fact = self.facts[id(e)]
        if fact.sequential and depth < 64:
            return self.enter_seq(e, depth + 1)
        if fact.passes and depth < 64:
            path = self.graph.path[id(seq)]
            problem = self.passing(seq, name, e, f"{path}.{name}" if path else name)
            call, why = self.after_element(seq, list(seq._modules).index(name), depth + 1)
            return (call, problem or why) if call is not None else (None, None)
        return None, None

    def enter_seq(self, seq: nn.Module, depth: int):
        names = list(seq._modules)
        if not names:
            return None, None
        call, why = self.enter(seq, names[0], depth)
        if call is None:
            return None, None
        return call, self.graph.crossing_problem(seq) or why

    def enter_module(self, m: nn.Module, position: int, n_args: int, depth: int):
        """Into the analysed forward of a module that receives the value as argument
        ``position`` of ``n_args``, all positional."""
        t = self.graph.trace.get(id(m))
        if t is None or t.method != "forward" or t.already_rewritten or depth > 64:
            return None, None
        placeholders = [n for n in t.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != n_args:
            return None, None
        call, why = self.after_node(m, t, placeholders[position], depth + 1)
        if call is None:
            return None, None
        return call, self.graph.crossing_problem(m) or why

    def after_element(self, seq: nn.Module, i: int, depth: int):
        names = list(seq._modules)
        if i + 1 < len(names):
            return self.enter(seq, names[i + 1], depth)
        return self.after_container(seq, depth)

    def after_container(self, c: nn.Module, depth: int):
        """From the output of a Sequential, or of a module whose analysed forward returns the
        value, to where its caller sends it."""
        graph = self.graph
        caller = graph.caller.get(id(c))
        if caller is None or depth > 64:
            return None, None  # the model itself
        problem = graph.crossing_problem(c)
        parent, ppath, target = caller
        if self.facts[id(parent)].sequential and "." not in target:
            if not self.facts[id(c)].sequential:  # a Sequential computes its elements: no region
                return None, None
            call, why = self.after_element(parent, list(parent._modules).index(target),
                                           depth + 1)
            return call, problem or why
        # A forward rewritten by an earlier fuse still calls its child Sequentials as its class
        # graph says (only function pairs became fused ops), so the run may go through it.
        t = graph.trace.get(id(parent))
        calls = graph.calls_of(parent, target) if t is not None else []
        if not calls:
            return None, None
        call, why = self.after_node(parent, t, calls[0], depth + 1)
        if call is None:
            return None, None
        return call, problem or graph.child_problem(
            parent, t, target, f"{ppath}.{target}" if ppath else target, c) or why

    def after_node(self, owner: nn.Module, t: Trace, node: fx.Node, depth: int):
        users = list(node.users)
        if len(users) != 1:
            return None, None
        u = users[0]
        if u.op == "output":  # returned: on to the forward's caller
            if u.args[0] is not node or t.method != "forward" or depth > 64:
                return None, None
            return self.after_container(owner, depth + 1)
        if u.op != "call_module" or u.kwargs:
            return None, None
        at = [k for k, a in enumerate(u.args) if a is node]
        if len(at) != 1:
            return None, None
        call = self.at.get((id(owner), u))
        if call is not None:
            return (call, None) if len(u.args) == 1 else (None, None)
        sub = owner.get_submodule(u.target)
        if depth > 64:
            return None, None
        graph = self.graph
        label, fact = graph.nodes[u].label, self.facts[id(sub)]
        if fact.passes and len(u.args) == 1 and "." not in u.target:
            problem = self.passing(owner, u.target, sub, label)
            call, why = self.after_node(owner, t, u, depth + 1)
            if call is None:
                return None, None
            return call, problem or graph.child_problem(owner, t, u.target, label, sub) or why
        if fact.sequential:
            call, why = self.enter_seq(sub, depth + 1) if len(u.args) == 1 else (None, None)
        else:
            call, why = self.enter_module(sub, at[0], len(u.args), depth + 1)
        if call is None:
            return None, None
        return call, graph.child_problem(owner, t, u.target, label, sub) or why


# ------------------------------------------------------------------------------------------------

def _fn_name(target: Any) -> str:
    if isinstance(target, str):
        return f".{target}()"
    mod = getattr(target, "__module__", "") or ""
    name = getattr(target, "__name__", repr(target))
    if mod.startswith("torch.nn.functional"):
        return f"F.{name}"
    if mod.startswith("torch") or mod == "_operator":
        return ("operator." if mod == "_operator" else "torch.") + name
    return name


def _combine(fates: List[Fate]) -> Fate:
    """Kept if any consumer keeps it, else unknown if any consumer is unknown, else not kept."""
    for f in fates:
        if f.kept is True:
            return f
    for f in fates:
        if f.kept is None:
            return f
    whys = [f.why for f in fates if f.why]
    return Fate(False, "; ".join(dict.fromkeys(whys)) or "nothing uses it")


def _dropout_fate(label: str, p: float, training: bool, on_output: Callable[[], Fate]) -> Fate:
    """Dropout with p > 0 in training keeps only its mask; with p = 0, or in eval(), it returns
    its input, so what its output's consumer keeps is what counts."""
    if p == 0 or training is False:
        kept, why = on_output()
        return Fate(kept, f"{why} (through {label}, which returns its input "
                          f"{'with p=0' if p == 0 else 'in eval()'})")
    return Fate(False, f"its user {label} keeps only its mask (in train(); in eval() it passes "
                       f"the value on)")
