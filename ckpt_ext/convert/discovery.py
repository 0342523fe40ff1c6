"""Discovery: where values go from one Linear/activation call to the next. :class:`RunDiscovery`
finds the runs of module calls (:class:`LayerCall`: an element of a Sequential, or a child an
analysed forward calls), across Sequentials and through the calls of one forward, and why each run
stops where it does (a run may mix activations: each layer's is its own); :func:`graph_chains`
finds the chains in forward code (``F.linear``, ``torch.tanh``, ``F.gelu``, a Linear held in a
list) that only a rewrite fuses."""
from __future__ import annotations

import ast
import enum
import inspect
import operator
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.nn.utils import parametrize

from ..modules import _has_hooks
from .activations import Recognised, module_activation, module_tensors, node_activation
from .consumers import Fate, elements_fate, node_fate, output_fate
from .policy import Chain, LayerShape, item_misses, layer_shape
from .report import Decision
from .runtime import (RunLinear, Slot, foreign_forward, is_conv1d, is_sequential, join_path,
                      may_pass, passes_through, stored_weight, unsupported_reason)
from .tracing import ModelAnalysis, Trace, statement_source


class LayerKind(enum.Enum):
    LINEAR = "Linear"
    ACTIVATION = "activation"
    PASS = "pass"  # an Identity or Dropout between them, a member of a run in its owner's forward


INSTANCE_FORWARD = ("its forward is set on the instance (an instance forward, as accelerate's "
                    "add_hook_to_module sets), which the fused op would not call")


def linear_problem(lin: nn.Module) -> Optional[str]:
    if foreign_forward(lin):
        return f"the Linear: {INSTANCE_FORWARD}"
    if not is_conv1d(lin) and type(lin) not in (nn.Linear, RunLinear):
        name = type(lin).__name__
        if parametrize.is_parametrized(lin):
            return (f"{name}: its weight is computed by a parametrization "
                    f"({', '.join(lin.parametrizations)}), which the fused op would not run")
        if isinstance(lin, nn.modules.lazy.LazyModuleMixin):
            return f"{name} is a lazy layer: its weight is made at its first call"
        return f"{name} subclasses nn.Linear; its forward may not be F.linear"
    if _has_hooks(lin):
        return "the Linear has hooks, which the fused op would not call"
    return unsupported_reason(stored_weight(lin))


def activation_problem(act: nn.Module) -> Optional[str]:
    found = module_activation(act)
    if found is None or found.problem is not None:
        return found.problem if found is not None else f"{type(act).__name__} is no activation"
    name = getattr(type(act), "_ckpt_ext_base", type(act)).__name__
    if foreign_forward(act):
        return f"the {name}: {INSTANCE_FORWARD}"
    if _has_hooks(act):
        return f"the {name} has hooks, which the fused op would not call"
    return None


def getattr_path(root: Any, target: str) -> Any:
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def stored_attr(root: nn.Module, target: str) -> Any:
    """``getattr_path`` that evaluates nothing: a parametrized attribute gives its stored original
    (see :func:`stored_weight`), not the tensor its parametrization would compute."""
    *parents, name = target.split(".")
    obj = getattr_path(root, ".".join(parents)) if parents else root
    if isinstance(obj, nn.Module) and parametrize.is_parametrized(obj, name):
        return next(iter(obj.parametrizations[name].parameters()), None)
    return getattr(obj, name)


_LINEAR_FUNCTIONS = (F.linear, torch._C._nn.linear)
_LINEAR_SIGNATURE = inspect.signature(lambda input, weight, bias=None: None)


def linear_args(node: fx.Node):
    bound = _LINEAR_SIGNATURE.bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    return bound.arguments["input"], bound.arguments["weight"], bound.arguments["bias"]


def node_kind(node: fx.Node, owner: nn.Module) -> Optional[Tuple[LayerKind, Optional[Recognised]]]:
    """The kind of a linear / activation node of any spelling (and for an activation, what it
    computes), else None."""
    if node.op == "call_module":
        return _module_kind(owner.get_submodule(node.target))
    if node.op == "call_function" and node.target in _LINEAR_FUNCTIONS:
        try:
            linear_args(node)
            return LayerKind.LINEAR, None
        except TypeError:
            return None
    found = node_activation(node)
    return (LayerKind.ACTIVATION, found[0]) if found is not None else None


def data_input(node: fx.Node) -> Any:
    """The node's tensor input if it takes exactly one data input the usual way, else None."""
    if node.op == "call_function" and node.target in _LINEAR_FUNCTIONS:
        x, w, b = linear_args(node)
        return x if all(a is not x for a in (w, b)) else None
    if node.op != "call_module":
        found = node_activation(node)
        if found is not None:
            return found[1]
    if len(node.args) == 1 and not node.kwargs:
        return node.args[0]
    return None


def node_label(node: fx.Node, owner_path: str) -> str:
    if node.op == "call_module":
        return join_path(owner_path, node.target)
    if node.op == "call_function" and node.target in _LINEAR_FUNCTIONS:
        return "F.linear"
    return node_activation(node)[2]


def _call_counts(t: Trace) -> Dict[str, int]:
    """How many times the traced forward calls each submodule target."""
    if t.calls is None:
        t.calls = {}
        for n in t.graph.nodes:
            if n.op == "call_module":
                t.calls[n.target] = t.calls.get(n.target, 0) + 1
    return t.calls


def child_problem(analysis: ModelAnalysis, owner: nn.Module, t: Trace, target: str, label: str,
                   sub: nn.Module) -> Optional[str]:
    """Why a run may not reach child ``target`` that ``owner``'s forward calls (as a member of a
    run computed inside that forward's region), else None."""
    calls = _call_counts(t).get(target, 0)
    if calls != 1:
        return f"{label} is called {calls} times"
    owner_label = analysis.path_of(owner) or "<model>"
    if t.region_problem is not None:
        return f"{owner_label} cannot mark the run's region: {t.region_problem}"
    node = next(n for n in t.graph.nodes if n.op == "call_module" and n.target == target)
    if node.name in t.indirect:
        return (f"{label} is called through {t.indirect[node.name]}, not by {owner_label}.forward "
                f"itself (it may run again on its own, as checkpoint does in backward)")
    if len(analysis.slots.get(id(sub), ())) != 1:  # held elsewhere too: it may be called there
        return f"{label} is also held elsewhere: {', '.join(analysis.paths[id(sub)][1:])}"
    return None


def _module_kind(m: Optional[nn.Module]) -> Optional[Tuple[LayerKind, Optional[Recognised]]]:
    if isinstance(m, nn.Linear) or (m is not None and is_conv1d(m)):
        return LayerKind.LINEAR, None
    found = module_activation(m)
    return (LayerKind.ACTIVATION, found) if found is not None else None


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

    @property
    def activation(self) -> Optional[str]:
        return self.found.name if self.found is not None else None


class RunDiscovery:
    """Runs of Linear/activation module calls that follow one another, across container
    boundaries.

    A value goes from one call to the next: between consecutive elements of a Sequential; from a
    Sequential's last element to what consumes the Sequential's output (the next element of the
    Sequential holding it, or the one call using it in the forward that calls it); into the first
    element of a Sequential it is passed to; between children an analysed forward calls one
    after the other; and into and out of a child module whose analysed forward takes the value
    (as any one of its positional arguments) or returns it. A step counts only when the value has
    that single consumer. Crossing a Sequential or a module needs it to have no hooks, to be held
    at one place and, when a forward calls it, to be called once there, directly; a module's own
    forward must be one whose guards can be checked: otherwise the run stops there and the report
    says why. ``nn.Identity`` and ``nn.Dropout`` modules are stepped over (``through[call]``
    holds those between a call and the next), but a Dropout that draws a mask (p > 0, in
    training) between a Linear and its activation stops the run."""

    def __init__(self, analysis: ModelAnalysis, taken_nodes: set) -> None:
        self.analysis = analysis
        self.layer_calls: List[LayerCall] = []
        self.at: Dict[Tuple[int, Any], LayerCall] = {}
        self.through: Dict[LayerCall, Tuple[Slot, ...]] = {}
        self._passed: List[Slot] = []
        for path, m in analysis.model.named_modules():
            if is_sequential(m):
                for i, (name, e) in enumerate(m._modules.items()):
                    kind = _module_kind(e)
                    if kind:
                        self._add((id(m), name), LayerCall(m, name, e, kind[0],
                                                           join_path(path, name), i,
                                                           found=kind[1]))
                continue
            t = analysis.trace_of(m)
            if t is None:
                continue
            # A forward an earlier fuse rewrote calls the child modules its rewrite left alone.
            calls = vars(m)["forward"].source if t.already_rewritten else None
            for node in t.graph.nodes:
                if node.op != "call_module" or "." in node.target or node in taken_nodes:
                    continue  # a Linear held in a list is only fused by a rewrite
                if calls is not None and f"self.{node.target}(" not in calls:
                    continue
                sub = m._modules.get(node.target)
                kind = _module_kind(sub)
                if kind:
                    self._add((id(m), node), LayerCall(m, node.target, sub, kind[0],
                                                       join_path(path, node.target), node=node,
                                                       trace=t, found=kind[1]))

    def _add(self, key: Tuple[int, Any], call: LayerCall) -> None:
        self.layer_calls.append(call)
        self.at[key] = call

    # -- one step: the call that receives a call's output, and why it may not be followed --------
    def succ(self, s: LayerCall) -> Tuple[Optional[LayerCall], Optional[str]]:
        self._passed = []
        if s.node is None:
            found = self._after_element(s.container, s.index, 0)
        else:
            found = self._after_node(s.container, s.trace, s.node, 0)
        self.through[s] = tuple(self._passed)
        return found

    def _pass(self, holder: nn.Module, name: str, m: nn.Module, label: str) -> Optional[str]:
        """Note a module the value passes through; why a run may not pass it, else None."""
        self._passed.append(Slot(holder, name, m, label))
        if _has_hooks(m):
            return f"{label} has hooks, which a run computed across it would not call"
        if foreign_forward(m):
            return f"{label}: {INSTANCE_FORWARD}"
        return None

    def _crossing_problem(self, c: nn.Module) -> Optional[str]:
        """Why a run may not cross container ``c`` (a Sequential, or a module whose analysed
        forward it passes through), else None."""
        places = self.analysis.paths.get(id(c), [])
        label = places[0] if places else f"<a {type(c).__name__}>"
        if _has_hooks(c):
            return f"{label} has hooks, which a run computed across it would not call"
        if foreign_forward(c):
            return f"{label}: {INSTANCE_FORWARD}"
        if len(places) != 1:
            return f"{label} is held at {len(places)} places ({', '.join(places)})"
        if not is_sequential(c):
            t = self.analysis.trace_of(c)
            if t.region_problem is not None:
                return f"the run cannot cross {label}.forward: {t.region_problem}"
            if t.arg_guard is not None:
                return (f"the run cannot cross {label}.forward: what it assumes of its arguments "
                        f"({t.arg_guard.describe()}) is checked only where it marks a region")
        return None

    def _enter(self, seq: nn.Module, name: str, depth: int):
        call = self.at.get((id(seq), name))
        if call is not None:
            return call, None
        e = seq._modules[name]
        if is_sequential(e) and depth < 64:
            return self._enter_seq(e, depth + 1)
        if may_pass(e) and depth < 64:
            problem = self._pass(seq, name, e, join_path(self.analysis.path_of(seq), name))
            call, why = self._after_element(seq, list(seq._modules).index(name), depth + 1)
            return (call, problem or why) if call is not None else (None, None)
        return None, None

    def _enter_seq(self, seq: nn.Module, depth: int):
        names = list(seq._modules)
        if not names:
            return None, None
        call, why = self._enter(seq, names[0], depth)
        if call is None:
            return None, None
        return call, self._crossing_problem(seq) or why

    def _enter_module(self, m: nn.Module, position: int, n_args: int, depth: int):
        """Into the analysed forward of a module that receives the value as argument
        ``position`` of ``n_args``, all positional."""
        t = self.analysis.trace_of(m)
        if t is None or t.method != "forward" or t.already_rewritten or depth > 64:
            return None, None
        placeholders = [n for n in t.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != n_args:
            return None, None
        call, why = self._after_node(m, t, placeholders[position], depth + 1)
        if call is None:
            return None, None
        return call, self._crossing_problem(m) or why

    def _after_element(self, seq: nn.Module, i: int, depth: int):
        names = list(seq._modules)
        if i + 1 < len(names):
            return self._enter(seq, names[i + 1], depth)
        return self._after_container(seq, depth)

    def _after_container(self, c: nn.Module, depth: int):
        """From the output of a Sequential, or of a module whose analysed forward returns the
        value, to where its caller sends it."""
        analysis = self.analysis
        places = analysis.paths.get(id(c), [])
        if not places or places[0] not in analysis.parent or depth > 64:
            return None, None  # the model itself
        problem = self._crossing_problem(c)
        parent, ppath, name = analysis.parent[places[0]]
        if is_sequential(parent):
            if not is_sequential(c):  # a Sequential computes its elements: no region in there
                return None, None
            call, why = self._after_element(parent, list(parent._modules).index(name), depth + 1)
            return call, problem or why
        target = name  # a child held in a ModuleList/ModuleDict: called as "blocks.0"
        while isinstance(parent, (nn.ModuleList, nn.ModuleDict)) and ppath in analysis.parent:
            parent, ppath, holder = analysis.parent[ppath]
            target = f"{holder}.{target}"
        # A forward rewritten by an earlier fuse still calls its child Sequentials as its class
        # graph says (only function pairs became fused ops), so the run may go through it.
        t = analysis.trace_of(parent)
        if t is None:
            return None, None
        calls = [n for n in t.graph.nodes if n.op == "call_module" and n.target == target]
        if not calls:
            return None, None
        call, why = self._after_node(parent, t, calls[0], depth + 1)
        if call is None:
            return None, None
        return call, problem or child_problem(analysis, parent, t, target,
                                              join_path(ppath, target), c) or why

    def _after_node(self, owner: nn.Module, t: Trace, node: fx.Node, depth: int):
        users = list(node.users)
        if len(users) != 1:
            return None, None
        u = users[0]
        if u.op == "output":  # returned: on to the forward's caller
            if u.args[0] is not node or t.method != "forward" or depth > 64:
                return None, None
            return self._after_container(owner, depth + 1)
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
        label = join_path(self.analysis.path_of(owner), u.target)
        if may_pass(sub) and len(u.args) == 1 and "." not in u.target:
            problem = self._pass(owner, u.target, sub, label)
            call, why = self._after_node(owner, t, u, depth + 1)
            if call is None:
                return None, None
            return call, problem or child_problem(self.analysis, owner, t, u.target, label,
                                                  sub) or why
        if is_sequential(sub):
            call, why = self._enter_seq(sub, depth + 1) if len(u.args) == 1 else (None, None)
        else:
            call, why = self._enter_module(sub, at[0], len(u.args), depth + 1)
        if call is None:
            return None, None
        return call, child_problem(self.analysis, owner, t, u.target, label, sub) or why

    # -- the runs ---------------------------------------------------------------------------------
    def runs(self) -> Tuple[List[List[LayerCall]], Dict[LayerCall, str]]:
        """Maximal alternating paths Linear, Act, Linear, ... (from a Linear; each activation its
        own), and for a call whose next call would have continued the run, why that step was not
        taken."""
        links: Dict[LayerCall, LayerCall] = {}
        stops: Dict[LayerCall, str] = {}
        for s in self.layer_calls:
            nxt, problem = self.succ(s)
            if nxt is None or nxt.kind == s.kind:
                continue
            if s.kind is LayerKind.LINEAR:
                drawing = [p for p in self.through[s] if not passes_through(p.module)]
                if drawing:
                    problem = problem or (
                        f"dropout p>0 between it and its activation: {drawing[0].label} "
                        f"(p={drawing[0].module.p}) draws a mask in training that the fused op "
                        f"would not (in eval() it is fused)")
            if problem:
                stops[s] = problem
            else:
                links[s] = nxt
        has_prev = set(links.values())
        paths = []
        for s in self.layer_calls:
            if s in has_prev:
                continue
            path, seen = [s], {s}
            while path[-1] in links and links[path[-1]] not in seen:
                path.append(links[path[-1]])
                seen.add(path[-1])
            while path and path[0].kind is not LayerKind.LINEAR:
                path.pop(0)
            if len(path) >= 2:
                paths.append(path)
        return paths, stops

    def problem(self, s: LayerCall) -> Optional[str]:
        if s.node is None and foreign_forward(s.container):
            return f"{self.analysis.path_of(s.container) or '<model>'}: {INSTANCE_FORWARD}"
        if s.node is not None:
            p = child_problem(self.analysis, s.container, s.trace, s.name, s.label, s.module)
            if p is not None:
                return p
        return linear_problem(s.module) if s.kind is LayerKind.LINEAR else \
            activation_problem(s.module)

    def fate(self, s: LayerCall) -> Fate:
        """What consumes the call's output."""
        analysis = self.analysis
        if s.node is None:
            seq = s.container
            return elements_fate(analysis, seq, analysis.path_of(seq), s.index + 1,
                                    lambda: output_fate(analysis, seq), 0)
        return node_fate(analysis, s.container, s.trace, s.node)


def graph_chains(analysis: ModelAnalysis, path: str, owner: nn.Module, t: Trace, rewrite: bool,
                 misses: List[Decision], taken: set) -> List[Chain]:
    """Chains in one module's graph that hold a function call (``F.linear``, ``torch.tanh``,
    ``F.gelu``, ...) or a Linear held in a list: fused only by rewriting the forward
    (``rewrite=True``). The nodes of a chain to rewrite go into ``taken``. Chains of direct child
    modules only are the discovery's."""
    graph = t.graph
    # a node in ``taken`` is another unit's already (a gated MLP's, or a rewrite's)
    kinds = {n: None if n in taken else node_kind(n, owner) for n in graph.nodes}
    kind = {n: k[0] if k else None for n, k in kinds.items()}

    def name_of(n: fx.Node) -> Optional[str]:
        found = kinds[n][1] if kinds[n] else None
        return found.name if found is not None else None

    def module_of(n: fx.Node) -> Optional[nn.Module]:
        return owner.get_submodule(n.target) if n.op == "call_module" else None

    def nxt(n: fx.Node) -> Optional[fx.Node]:
        users = list(n.users)
        if len(users) != 1:
            return None
        u = users[0]
        want = LayerKind.ACTIVATION if kind[n] is LayerKind.LINEAR else LayerKind.LINEAR
        return u if kind[u] == want and data_input(u) is n else None

    has_prev = {nxt(n) for n in graph.nodes if kind[n] is not None} - {None}

    def graph_only(n: fx.Node) -> bool:
        return n.op != "call_module" or "." in n.target

    def own_problem(n: fx.Node) -> Optional[str]:
        """What the layer itself keeps from being fused, wherever it is called."""
        if n.op == "call_module":
            sub = owner.get_submodule(n.target)
            return linear_problem(sub) if kind[n] is LayerKind.LINEAR else \
                activation_problem(sub)
        if kind[n] is LayerKind.ACTIVATION:
            return kinds[n][1].problem
        _, w, _ = linear_args(n)
        if not (isinstance(w, fx.Node) and w.op == "get_attr"):
            return f"{node_label(n, path)}'s weight is not an attribute of {path or '<model>'}"
        return unsupported_reason(stored_attr(owner, w.target))

    def member_problem(n: fx.Node) -> Optional[str]:
        label = node_label(n, path)
        if n.op != "call_module":
            return (f"{label} is a function call: fusing it rewrites {path or '<model>'}.forward"
                    + ("" if rewrite else "; pass rewrite=True to allow that"))
        if "." in n.target:
            return f"{label} is not a direct child of {path or '<model>'}"
        sub = owner.get_submodule(n.target)
        return child_problem(analysis, owner, t, n.target, label, sub) or own_problem(n)

    def rewrite_problem(n: fx.Node) -> Optional[str]:
        if t.rewrite_problem is not None:
            return f"{path or '<model>'}.forward cannot be rewritten: {t.rewrite_problem}"
        return own_problem(n)

    def layer_of(n: fx.Node) -> Optional[LayerShape]:
        if n.op == "call_module":
            return layer_shape(node_label(n, path), owner.get_submodule(n.target))
        _, w, _ = linear_args(n)
        if isinstance(w, fx.Node) and w.op == "get_attr":
            wt = stored_attr(owner, w.target)
            return LayerShape("F.linear", wt.shape[1], wt.shape[0], wt.element_size())
        return None

    chains = []
    for n in graph.nodes:
        if kind[n] is LayerKind.LINEAR and len(n.users) > 1 and \
                any(kind[u] is LayerKind.ACTIVATION for u in n.users):
            misses.append(Decision(path, (node_label(n, path),), "left alone", "", "", 0, 0, 0,
                                   f"its output has {len(n.users)} users, so it is kept for the "
                                   f"others anyway"))
        if kind[n] is not LayerKind.LINEAR or n in has_prev or nxt(n) is None:
            continue
        whole = [n]
        while nxt(whole[-1]) is not None:
            whole.append(nxt(whole[-1]))
        _graph_chain(whole, path, rewrite, graph_only, rewrite_problem, member_problem,
                     layer_of, name_of, module_of, lambda last: node_fate(analysis, owner, t, last),
                     misses, taken, chains)
    return chains


def _graph_chain(items: List[fx.Node], path: str, rewrite: bool, graph_only, rewrite_problem,
                 member_problem, layer_of, name_of, module_of, fate_of, misses: List[Decision],
                 taken: set, chains: List[Chain]) -> None:
    """One chain of a graph: a chain to rewrite, or its misses."""
    only = [graph_only(x) for x in items]
    if not any(only):
        return
    labels = [node_label(x, path) for x in items]
    rw = [rewrite_problem(x) for x in items]
    layers = [layer_of(x) for x in items[0::2]]
    if rewrite and all(p is None for p in rw) and all(lay is not None for lay in layers):
        last = items[-1]
        names = tuple(name_of(x) for x in items[1::2])
        chains.append(Chain(path, "rewrite", labels, items, layers, names, len(items) % 2 == 0,
                            lambda last=last: fate_of(last), {},
                            tuple(module_tensors(module_of(x), n)
                                  for x, n in zip(items[1::2], names))))
        taken.update(x for x in items if x.op == "call_module")
        return
    # Not rewritten: report the pairs that hold a function call or a Linear held in a list
    # (pairs of child modules are the discovery's, which reports their problems itself).
    problems = [rw[k] if (rewrite and rw[k] is not None) else member_problem(x)
                for k, x in enumerate(items)]
    in_pair = [only[k - k % 2] or (k - k % 2 + 1 < len(items) and only[k - k % 2 + 1])
               for k in range(len(items))]
    item_misses(path, labels, [p if in_pair[k] else None for k, p in enumerate(problems)],
                misses)


# ------------------------------------------------------------------------------------------------
# Gated MLPs: down(act(gate(x)) * up(x)) in one forward (docs/converter.md, "Gated MLPs")

_PRODUCTS = {operator.mul, torch.mul, "mul", "mul_"}


@dataclass(eq=False)
class GatedCall:
    """One gated MLP a forward computes from its direct child Linears: ``down(act(gate(x)) *
    up(x))``, or with one packed ``gate_up`` Linear whose output ``chunk(2, dim=-1)`` splits
    (``packed``; ``gate_second``: the activation takes the second chunk), with any
    ``nn.Dropout`` between the product and ``down``."""
    owner: nn.Module
    path: str
    trace: Trace
    linears: Tuple[fx.Node, ...]      # the Linears in call order: gate, up, down or gate_up, down
    gate: nn.Linear                   # the packed Linear when packed
    up: Optional[nn.Linear]
    down: nn.Linear
    act: Recognised
    act_node: fx.Node
    act_module: Optional[nn.Module]   # the activation's child module; None for a call
    dropouts: Tuple[fx.Node, ...]
    packed: bool
    gate_second: bool
    nodes: Tuple[fx.Node, ...]        # every node of the pattern
    labels: Tuple[str, ...]           # the Linears and the activation, in call order
    problems: Tuple[str, ...] = ()

    def child(self, n: fx.Node) -> nn.Module:
        return self.owner._modules[n.target]

    def label(self, n: fx.Node) -> str:
        return node_label(n, self.path)


def _child(owner: nn.Module, n: Any, cls: type) -> Optional[nn.Module]:
    if not isinstance(n, fx.Node) or n.op != "call_module" or "." in n.target:
        return None
    sub = owner._modules.get(n.target)
    return sub if isinstance(sub, cls) else None


def _one_input(n: fx.Node) -> Optional[fx.Node]:
    return n.args[0] if len(n.args) == 1 and not n.kwargs and isinstance(n.args[0], fx.Node) \
        else None


def _chunk_input(c: Any) -> Optional[fx.Node]:
    """The input of ``chunk(input, 2, dim=-1)`` (method or function), else None: another count
    or dim (the default dim 0 is not the feature dim) is no gated split."""
    if not isinstance(c, fx.Node) or not (
            (c.op == "call_method" and c.target == "chunk") or
            (c.op == "call_function" and c.target is torch.chunk)):
        return None
    try:
        bound = inspect.signature(lambda input, chunks, dim=0: None).bind(*c.args, **c.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    a = bound.arguments
    return a["input"] if a["chunks"] == 2 and a["dim"] == -1 and \
        isinstance(a["input"], fx.Node) else None


def _activation_of(owner: nn.Module, n: fx.Node):
    """(what it computes, its child module or None) when ``n`` is an activation, else None."""
    if n.op == "call_module":
        if "." in n.target:
            return None
        sub = owner._modules.get(n.target)
        found = module_activation(sub)
        return (found, sub) if found is not None else None
    found = node_activation(n)
    return (found[0], None) if found is not None else None


def find_gated(analysis: ModelAnalysis, path: str, owner: nn.Module, t: Trace) -> List[GatedCall]:
    """The gated MLPs of one analysed forward, each with the problems that keep it from being
    fused (``problems`` empty: it is fused)."""
    found: List[GatedCall] = []
    order = {n: i for i, n in enumerate(t.graph.nodes)}
    for m in t.graph.nodes:
        if m.op not in ("call_function", "call_method") or m.target not in _PRODUCTS or \
                m.kwargs or len(m.args) != 2 or not all(isinstance(a, fx.Node) for a in m.args):
            continue
        for k in (0, 1):
            g = _gated_at(analysis, path, owner, t, m, m.args[k], m.args[1 - k], order)
            if g is not None:
                found.append(g)
                break
    return found


def _gated_at(analysis, path, owner, t, m, a, b, order) -> Optional[GatedCall]:
    act = _activation_of(owner, a)
    if act is None or len(a.users) != 1 or len(b.users) != 1:
        return None
    y = data_input(a)
    if not isinstance(y, fx.Node) or len(y.users) != 1:
        return None
    packed = gate_second = False
    gate = _child(owner, y, nn.Linear)
    if gate is not None:  # two Linears of the same input
        up = _child(owner, b, nn.Linear)
        x = _one_input(y)
        if up is None or x is None or _one_input(b) is not x:
            return None
        linears, between = [y, b], []
    else:  # gate, up = gate_up(x).chunk(2, dim=-1)
        if not (y.op == "call_function" and y.target is operator.getitem and
                b.op == "call_function" and b.target is operator.getitem and
                y.args[0] is b.args[0] and {y.args[1], b.args[1]} == {0, 1}):
            return None
        c = y.args[0]
        p = _chunk_input(c)
        gate, up = _child(owner, p, nn.Linear), None
        if gate is None or set(c.users) != {y, b} or len(p.users) != 1 or \
                _one_input(p) is None:
            return None
        packed, gate_second = True, y.args[1] == 1
        linears, between = [p], [c, y, b]
    cur, dropouts = m, []
    while True:  # through Dropouts to the down projection
        if len(cur.users) != 1:
            return None
        u = next(iter(cur.users))
        if _child(owner, u, nn.Dropout) is not None and type(owner._modules[u.target]) is \
                nn.Dropout and _one_input(u) is cur:
            dropouts.append(u)
            cur = u
            continue
        down = _child(owner, u, nn.Linear)
        if down is None or _one_input(u) is not cur:
            return None
        break
    width = down.in_features
    if (up is not None and (up.in_features != gate.in_features or up.out_features != width or
                            gate.out_features != width)) or \
            (up is None and gate.out_features != 2 * width) or width == 0:
        return None
    linears = sorted(linears, key=order.get) + [u]
    labels = tuple(node_label(n, path) for n in sorted(linears + [a], key=order.get))
    g = GatedCall(owner, path, t, tuple(linears), gate, up, down, act[0], a, act[1],
                  tuple(dropouts), packed, gate_second,
                  tuple(linears + [a, m] + between + dropouts), labels)
    g.problems = tuple(dict.fromkeys(p for p in _gated_problems(analysis, g) if p))
    return g


def members_problems(analysis: ModelAnalysis, owner: nn.Module, path: str, t: Trace,
                     linears: Sequence[fx.Node]):
    """What keeps each child Linear a forward calls from being a member of a unit its region
    computes (a gated MLP, a run with function calls between its Linears)."""
    for n in linears:
        sub = owner._modules[n.target]
        yield linear_problem(sub)
        yield child_problem(analysis, owner, t, n.target, node_label(n, path), sub)


def _gated_problems(analysis: ModelAnalysis, g: GatedCall):
    owner, t = g.owner, g.trace
    yield from members_problems(analysis, owner, g.path, t, g.linears)
    yield g.act.problem
    if g.act_module is not None:
        yield activation_problem(g.act_module)
        yield child_problem(analysis, owner, t, g.act_node.target, g.label(g.act_node),
                            g.act_module)
    for n in g.dropouts:
        d = g.child(n)
        yield child_problem(analysis, owner, t, n.target, g.label(n), d)
    weights = [stored_weight(g.child(n)) for n in g.linears]
    if any(w is None for w in weights):
        yield "a weight is not made yet (a lazy layer)"
    elif len({(w.dtype, w.device) for w in weights}) > 1:
        yield ("its Linears' weights are of different dtypes or devices ("
               + ", ".join(f"{g.label(n)}: {w.dtype} on {w.device}"
                           for n, w in zip(g.linears, weights)) + ")")
    yield from placeholder_problems(g.path, owner, t, g.linears,
                                    lambda stmt: _dtype_cast(stmt, g.linears[-1].target))


def placeholder_problems(path: str, owner: nn.Module, t: Trace, linears: Sequence[fx.Node],
                         excused: Callable[[Any], bool] = lambda stmt: False):
    """Why the traced method may compute something between a unit's Linears that the analysis
    did not see (the unit's members pass zero-width placeholders there, so such code would work
    on nothing): a Python function it calls, a statement tracing did not run whole (unless
    ``excused``), source that cannot be read, or a forward an earlier fuse rewrote."""
    code = getattr(inspect.unwrap(getattr(type(owner), t.method)), "__code__", None)
    for name in t.calls_out:
        yield (f"{path or '<model>'}.{t.method} calls {name}, whose paths fuse does not "
               f"follow (the fused op would skip what it does between the Linears)")
    if t.unrun is None:
        yield (f"the source of {path or '<model>'}.{t.method} cannot be read, so fuse cannot "
               f"check that tracing saw every statement it runs")
    for line in t.unrun or ():
        if t.cut_line is not None and line > t.cut_line:
            continue  # after the branch fx could not follow: the unit ran whole before it
        if not excused(statement_source(code, line)):
            yield (f"{path or '<model>'}.{t.method} may run code that fx did not see run "
                   f"(line {line}: a branch, or a part of a conditional expression), which at "
                   f"call time would work on what the fused op does not compute")
    if t.already_rewritten:
        source = vars(owner)[t.method].source
        if any(f"self.{n.target}(" not in source for n in linears):
            yield f"{path or '<model>'}.forward was rewritten by an earlier fuse"


def _dtype_cast(stmt: Any, down: str) -> bool:
    """``h = h.to(self.<down>.weight.dtype)``: T5's cast to its down projection's dtype, which
    changes nothing where the run is fused (its Linears share one dtype; under autocast the down
    projection casts back)."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and
            isinstance(stmt.targets[0], ast.Name) and isinstance(stmt.value, ast.Call)):
        return False
    call, name = stmt.value, stmt.targets[0].id
    return isinstance(call.func, ast.Attribute) and call.func.attr == "to" and \
        isinstance(call.func.value, ast.Name) and call.func.value.id == name and \
        len(call.args) == 1 and not call.keywords and \
        ast.unparse(call.args[0]) == f"self.{down}.weight.dtype"
