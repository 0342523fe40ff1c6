"""What the consumers of a value do with it: keep it for their backward (a Linear, a matmul), not
keep it (an add, a Tanh, a ``.mean()``), or unknown. The tables name what ops do with their input;
the functions follow a value through an analysed forward's graph, into and out of Sequentials
and modules, up to the model's output. fuse asks this of the last output of a run or a pair: a
trailing activation that keeps its output (a row whose backward reads it) is fused only where that output is not
kept anyway."""
from __future__ import annotations

import inspect
import operator
from typing import Any, Callable, List, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import fx, nn

from .. import ops
from ..modules import FusedLinearTanh, FusedTanhMLP
from ..ops import linear_tanh, tanh_mlp
from .._activations import REGISTRY
from .activations import SAVES_INPUT, module_activation
from .runtime import is_conv1d, is_sequential, join_path
from .tracing import ModelAnalysis, Trace, after_branch


class Fate(NamedTuple):
    """What the consumers of a value do with it."""
    kept: Optional[bool]  # True: kept for backward by a consumer, False: not kept, None: unknown
    why: str


# What an op does with a tensor it is given, for the question "is this tanh output kept anyway?"
_VIEW_FUNCTIONS = {operator.getitem, torch.flatten, torch.reshape, torch.squeeze, torch.unsqueeze,
                   torch.transpose, torch.permute, torch.narrow, torch.select, torch.chunk,
                   torch.split, torch.unbind, torch.t}
_VIEW_METHODS = {"view", "reshape", "flatten", "unsqueeze", "squeeze", "permute", "transpose", "t",
                 "contiguous", "expand", "expand_as", "view_as", "reshape_as", "narrow", "select",
                 "unflatten", "chunk", "split", "unbind", "to", "float", "double", "half",
                 "bfloat16", "type_as", "detach"}
_META_FUNCTIONS = {getattr, len}
_META_METHODS = {"size", "dim", "numel", "stride", "ndimension"}
# The activations' calls, methods and module classes, by what the registry's row says stock
# autograd keeps: the output (a backward from the output) or z too.
_ACT_ROWS = list(REGISTRY.values())


def _act_calls(keeps_input: bool) -> set:
    return {c.fn for r in _ACT_ROWS if r.saves_input == keeps_input for c in r.calls}


def _act_methods(keeps_input: bool) -> set:
    return {m for r in _ACT_ROWS if r.saves_input == keeps_input for m in r.methods}


def _act_modules(keeps_input: bool) -> tuple:
    return tuple({f.cls for r in _ACT_ROWS if r.saves_input == keeps_input for f in r.modules
                  if isinstance(f.cls, type)})


_FREEING_FUNCTIONS = {operator.add, operator.sub, operator.iadd, operator.isub, operator.neg,
                      torch.add, torch.sub, torch.neg, torch.cat, torch.concat, torch.stack,
                      torch.sum, torch.mean, torch.clone, F.softmax, F.log_softmax,
                      torch.softmax} | _act_calls(False)
_FREEING_METHODS = {"add", "sub", "add_", "sub_", "neg", "sum", "mean", "clone", "softmax",
                    "log_softmax"} | _act_methods(False)
_SCALING_FUNCTIONS = {operator.mul, operator.truediv, operator.imul, operator.itruediv,
                      torch.mul, torch.div}
_SCALING_METHODS = {"mul", "div", "mul_", "div_"}
_KEEPING_FUNCTIONS = {F.linear, torch._C._nn.linear, torch.matmul, torch.mm, torch.bmm,
                      operator.matmul, torch.einsum, F.layer_norm, F.mse_loss, torch.pow,
                      operator.pow, linear_tanh, tanh_mlp, ops.mlp} | _act_calls(True)
_KEEPING_METHODS = {"matmul", "mm", "bmm", "pow"} | _act_methods(True)
_PASS_THROUGH_MODULES = (nn.Identity, nn.Flatten, nn.Unflatten)
# These save their output or a mask for backward, never their input.
_FREEING_MODULES = (nn.Softmax, nn.LogSoftmax) + _act_modules(False)
_KEEPING_MODULES = (nn.Linear, nn.Bilinear, nn.LayerNorm, nn.GroupNorm, nn.MultiheadAttention,
                    nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm, FusedLinearTanh,
                    FusedTanhMLP) + _act_modules(True)

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


def output_fate(analysis: ModelAnalysis, m: nn.Module, index: Optional[int] = None,
                depth: int = 0) -> Fate:
    """What the callers of module ``m`` do with its output (element ``index`` of a tuple)."""
    if depth > 64:
        return Fate(None, "the chain of callers is too deep to follow")
    if m is analysis.model:
        return Fate(False, "returned by the model (freed unless the loss keeps it: .mean()/.sum() "
                           "do not, mse_loss does)")
    paths = analysis.paths.get(id(m), [])
    if len(paths) != 1:
        return Fate(None, f"{paths[0] if paths else 'a module'} sits at {len(paths)} places")
    parent, ppath, name = analysis.parent[paths[0]]
    if is_sequential(parent):
        if index is not None:
            return Fate(None, f"{paths[0]} returns a tuple inside an nn.Sequential")
        names = list(parent._modules)
        i = names.index(name)
        return elements_fate(analysis, parent, ppath, i + 1,
                             lambda: output_fate(analysis, parent, None, depth + 1), depth + 1)
    # A ModuleList / ModuleDict has no forward: the caller is the module holding it, which
    # calls "layers.0".
    while isinstance(parent, (nn.ModuleList, nn.ModuleDict)) and ppath in analysis.parent:
        parent, ppath, holder = analysis.parent[ppath]
        name = f"{holder}.{name}"
    t = analysis.traces.get(id(parent))
    if t is None or not t.ok:
        why = f" ({t.reason})" if t is not None else ""
        return Fate(None, f"its caller {ppath or '<model>'} was not analysed{why}")
    calls = [n for n in t.graph.nodes if n.op == "call_module" and n.target == name]
    if not calls and t.cut_line is not None:
        return Fate(None, f"{ppath or '<model>'}.{t.method} calls {name} after it branches on "
                          f"a traced value (line {t.cut_line}), which fx cannot follow")
    if len(calls) != 1:
        return Fate(None, f"{ppath or '<model>'}.forward calls {name} {len(calls)} times")
    return node_fate(analysis, parent, t, calls[0], index, depth + 1)


def node_fate(analysis: ModelAnalysis, owner: nn.Module, t: Trace, node: fx.Node,
              index: Optional[int] = None, depth: int = 0) -> Fate:
    """What the users of ``node`` in ``owner``'s graph do with its value."""
    if depth > 64:
        return Fate(None, "the chain of users is too deep to follow")
    results: List[Fate] = []
    for u in node.users:
        if index is not None:
            if u.op == "call_function" and u.target is operator.getitem and \
                    u.args[0] is node and not isinstance(u.args[1], fx.Node):
                if u.args[1] == index:
                    results.append(node_fate(analysis, owner, t, u, None, depth + 1))
                continue
            results.append(Fate(None, f"output {index} is used as part of a whole"))
            continue
        results.append(_use_fate(analysis, owner, t, node, u, depth + 1))
    return _combine(results)


def _use_fate(analysis: ModelAnalysis, owner: nn.Module, t: Trace, node: fx.Node, u: fx.Node,
              depth: int) -> Fate:
    opath = analysis.path_of(owner)
    if u.op == "output":
        if t.method != "forward":
            return Fate(None, f"{opath or '<model>'}.{t.method} returns it to callers fuse did "
                              f"not analyse")
        out = u.args[0]
        if out is node:
            return output_fate(analysis, owner, None, depth)
        if isinstance(out, (tuple, list)):
            where = [i for i, o in enumerate(out) if o is node]
            if len(where) == 1:
                return output_fate(analysis, owner, where[0], depth)
        return Fate(None, f"{opath or '<model>'} returns it inside a nested structure")
    if u.op == "call_module":
        label = join_path(opath, u.target)
        others = list(u.args[1:]) + list(u.kwargs.values())
        if not u.args or u.args[0] is not node or any(a is node for a in others):
            return Fate(None, f"passed to {label} other than as its only input")
        sub = owner.get_submodule(u.target)
        return _module_input_fate(analysis, sub, label,
                                  lambda: node_fate(analysis, owner, t, u, None, depth + 1), depth)
    if u.op in ("call_function", "call_method"):
        target = u.target
        name = _fn_name(target)
        is_fn = u.op == "call_function"

        def among(functions: set, methods: set) -> bool:
            return target in (functions if is_fn else methods)

        if is_fn and target is after_branch:
            return Fate(None, f"used after {opath or '<model>'}.{t.method} branches on a traced "
                              f"value (line {t.cut_line}), which fx cannot follow")
        if is_fn and target in _DROPOUT_FUNCTIONS:
            try:
                bound = _DROPOUT_SIGNATURE.bind(*u.args, **u.kwargs)
            except TypeError:
                return Fate(None, f"used by {name} with arguments fuse cannot read")
            bound.apply_defaults()
            p, training = bound.arguments["p"], bound.arguments["training"]
            if bound.arguments["input"] is not node or isinstance(p, fx.Node) or \
                    isinstance(training, fx.Node):
                return Fate(None, f"used by {name} with a p or training fuse cannot read")
            return _dropout_fate(f"{name}(p={p})", p, training,
                                 lambda: node_fate(analysis, owner, t, u, None, depth + 1))
        if among(_META_FUNCTIONS, _META_METHODS):
            return Fate(False, "")
        if among(_VIEW_FUNCTIONS, _VIEW_METHODS):
            return node_fate(analysis, owner, t, u, None, depth + 1)
        if among(_FREEING_FUNCTIONS, _FREEING_METHODS):
            what = " (a residual add)" if target in (operator.add, operator.iadd, "add") else ""
            return Fate(False, f"its user {name}{what} does not keep it")
        if among(_SCALING_FUNCTIONS, _SCALING_METHODS):
            if any(isinstance(a, fx.Node) and a is not node for a in u.args):
                return Fate(True, f"kept by {name} with another tensor")
            return Fate(False, f"its user {name} by a constant does not keep it")
        if among(_KEEPING_FUNCTIONS, _KEEPING_METHODS):
            return Fate(True, f"kept by {name}")
        return Fate(None, f"used by {name}, not known to keep or free its input")
    return Fate(None, f"used by a {u.op} node")


_DROPOUT_FUNCTIONS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                      torch.dropout}
_DROPOUT_SIGNATURE = inspect.signature(lambda input, p=0.5, training=True, inplace=False: None)


def _dropout_fate(label: str, p: float, training: bool, on_output: Callable[[], Fate]) -> Fate:
    """Dropout with p > 0 in training keeps only its mask; with p = 0, or in eval(), it returns
    its input, so what its output's consumer keeps is what counts."""
    if p == 0 or training is False:
        kept, why = on_output()
        return Fate(kept, f"{why} (through {label}, which returns its input "
                          f"{'with p=0' if p == 0 else 'in eval()'})")
    return Fate(False, f"its user {label} keeps only its mask (in train(); in eval() it passes "
                       f"the value on)")


def _module_input_fate(analysis: ModelAnalysis, sub: nn.Module, label: str,
                       on_output: Callable[[], Fate], depth: int) -> Fate:
    """What module ``sub`` does with its input; ``on_output`` answers for its output when it
    only passes the input through."""
    if is_sequential(sub):
        return elements_fate(analysis, sub, label, 0, on_output, depth + 1)
    if isinstance(sub, _PASS_THROUGH_MODULES):
        return on_output()
    if isinstance(sub, nn.modules.dropout._DropoutNd):
        return _dropout_fate(f"{label} ({type(sub).__name__}(p={sub.p}))", sub.p, sub.training,
                             on_output)
    if isinstance(sub, _FREEING_MODULES):
        return Fate(False, f"its user {label} ({type(sub).__name__}) does not keep it")
    if isinstance(sub, _KEEPING_MODULES) or is_conv1d(sub):
        return Fate(True, f"kept by {label} ({type(sub).__name__} keeps its input)")
    found = module_activation(sub)
    if found is not None and found.name is not None:  # transformers' activation modules
        if SAVES_INPUT[found.name]:
            return Fate(True, f"kept by {label} ({type(sub).__name__} keeps its input)")
        return Fate(False, f"its user {label} ({type(sub).__name__}) does not keep it")
    ts = analysis.trace_of(sub)
    if ts is not None and ts.method == "forward":  # a method's inputs are not the module's
        ph = [n for n in ts.graph.nodes if n.op == "placeholder"]
        if ph:
            return node_fate(analysis, sub, ts, ph[0], None, depth + 1)
    return Fate(None, f"its user {label} ({type(sub).__name__}) is not known to keep or free it")


def elements_fate(analysis: ModelAnalysis, seq: nn.Module, seq_path: str, start: int,
                  on_end: Callable[[], Fate], depth: int) -> Fate:
    """What the elements of ``seq`` from ``start`` on do with their input; ``on_end`` answers
    when they all pass it through."""
    names = list(seq._modules)
    for i in range(start, len(names)):
        e = seq._modules[names[i]]
        if isinstance(e, _PASS_THROUGH_MODULES):
            continue
        rest = (lambda i=i: elements_fate(analysis, seq, seq_path, i + 1, on_end, depth + 1))
        return _module_input_fate(analysis, e, join_path(seq_path, names[i]), rest, depth + 1)
    return on_end()
