"""Every Linear accounted for: why no run starts at or goes through each Linear no decision names,
read from the analysis only. Design: docs/converter.md, "What the report lists"."""
from __future__ import annotations

import operator
from typing import Iterable, List, Optional, Tuple

import torch
from torch import fx, nn

from .facts import OUR_MODULES, LayerKind, join_path, module_activation
from .graph import ModelGraph
from .tracing import Trace

_VIEWS = {operator.getitem, torch.chunk, torch.split, torch.narrow, "chunk", "split", "view",
          "reshape", "narrow", "contiguous"}
_PRODUCTS = {operator.mul, torch.mul, operator.imul, "mul", "mul_"}


def unaccounted(graph: ModelGraph, named: Iterable[str]) -> List[Tuple[str, str]]:
    """(path, why) for each Linear or Conv1D of the model that the report does not name."""
    named = set(named)
    return [(path, _why(graph, path, m)) for path, m in graph.modules
            if path not in named and graph.facts[id(m)].kind is LayerKind.LINEAR]


def _why(graph: ModelGraph, path: str, m: nn.Module) -> str:
    places = graph.paths.get(id(m), [path])
    if len(places) > 1:
        return f"it is held at {len(places)} places ({', '.join(places)})"
    fact = graph.facts[id(m)]
    if fact.foreign:
        return fact.problem
    caller = graph.caller.get(id(m))
    if caller is None:
        return "it is the model itself: nothing follows it"
    parent, ppath, target = caller
    caller = ppath or "<model>"
    if hasattr(parent, "lora_A") and hasattr(parent, "parameter_name"):
        return (f"a factor of the LoRA update peft's ParamWrapper {caller} adds to its base "
                f"layer's {parent.parameter_name} (target_parameters): its weight is read, the "
                f"Linear is not called")
    if graph.facts[id(parent)].sequential:
        return _in_sequential(parent, ppath, target) or fact.problem or \
            "no activation fuse computes follows it"
    if isinstance(parent, OUR_MODULES):
        return f"its caller {caller} is ckpt_ext's {type(parent).__name__}, which computes it fused"
    if type(parent).__module__.startswith("torch."):
        return (f"its caller {caller} is torch.nn.{type(parent).__name__}, whose forward is "
                f"torch's own code, which fuse does not analyse")
    t = graph.traces.get(id(parent))
    if t is None:
        return f"its caller {caller} was not analysed (trace=False)"
    if not t.ok:
        return f"its caller {caller} was not analysed: {t.reason}"
    return _in_graph(graph, parent, caller, t, target) or fact.problem or \
        "no activation fuse computes follows it"


def _in_sequential(seq: nn.Module, spath: str, name: str) -> Optional[str]:
    names = list(seq._modules)
    i = names.index(name)
    if i >= 2:
        prev, before = seq._modules[names[i - 1]], seq._modules[names[i - 2]]
        if isinstance(prev, nn.modules.dropout._DropoutNd) and prev.p > 0 and \
                module_activation(before) is not None:
            return (f"dropout p>0 between it and {join_path(spath, names[i - 2])}: "
                    f"{names[i - 1]} (p={prev.p}) draws a mask the fused op would not")
    if i + 1 == len(names):
        return f"it is the last element of {spath or '<model>'}: no activation follows it there"
    nxt = seq._modules[names[i + 1]]
    found = module_activation(nxt)
    if isinstance(nxt, nn.modules.dropout._DropoutNd) and nxt.p > 0 and nxt.training:
        return (f"dropout p>0 between it and its activation: {join_path(spath, names[i + 1])} "
                f"(p={nxt.p}) draws a mask in training that the fused op would not (in eval() "
                f"it is fused)")
    if found is None:
        return (f"{join_path(spath, names[i + 1])} ({type(nxt).__name__}) follows it, not an "
                f"activation fuse computes")
    return None


def _in_graph(graph: ModelGraph, owner: nn.Module, caller: str, t: Trace, target: str):
    calls = graph.calls_of(owner, target)
    if len(calls) != 1:
        return f"{caller}.{t.method} calls it {len(calls)} times"
    node = calls[0]
    x = node.args[0] if node.args else None
    if isinstance(x, fx.Node) and x.op == "call_module":
        sub = owner.get_submodule(x.target)
        if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0:
            return (f"dropout p>0 between it and what comes before: {join_path(caller, x.target)}"
                    f" (p={sub.p}) draws a mask the fused op would not")
    users = list(node.users)
    if len(users) != 1:
        return f"its output has {len(users)} users in {caller}.{t.method}"
    gated = _gated(graph, users[0], 0)
    if gated:
        return (f"gated product: {gated} (a GLU MLP) of a form fuse does not compute fused: only "
                f"down(act(gate(x)) * up(x)) of child Linears, or of one Linear split by "
                f"chunk(2, dim=-1), is")
    return f"its output goes to {_describe(owner, caller, users[0])}, not an activation"


def _gated(graph: ModelGraph, u: fx.Node, depth: int) -> Optional[str]:
    """How ``u`` (through views) multiplies an activation's output by another tensor, if so."""
    if depth > 4:
        return None
    if _product(u):
        return "its output is multiplied by another tensor"
    nf = graph.nodes[u]
    if nf.kind is LayerKind.ACTIVATION:
        if any(_product(v) for v in u.users):
            return f"{u.target if u.op == 'call_module' else nf.label}(its output) * another tensor"
        return None
    if u.op in ("call_function", "call_method") and u.target in _VIEWS:
        return next(filter(None, (_gated(graph, v, depth + 1) for v in u.users)), None)
    return None


def _product(n: fx.Node) -> bool:
    return n.op in ("call_function", "call_method") and n.target in _PRODUCTS and \
        sum(isinstance(a, fx.Node) for a in n.args) == 2


def _describe(owner: nn.Module, caller: str, u: fx.Node) -> str:
    if u.op == "output":
        return f"the return of {caller}'s forward"
    if u.op == "call_module":
        return f"{join_path(caller, u.target)} ({type(owner.get_submodule(u.target)).__name__})"
    if u.op == "call_method":
        return f".{u.target}()"
    name = getattr(u.target, "__name__", str(u.target))
    mod = getattr(u.target, "__module__", "") or ""
    return f"{'operator.' if mod == '_operator' else ''}{name}"
