"""``ckpt_ext.fuse(model)``: swap every Linear -> Tanh pair in a model for the fused op.

Two passes, both in place on ``model``:

1. **nn.Sequential** (at any depth): ``Sequential(..., Linear, Tanh, ...)`` becomes
   ``Sequential(..., FusedLinearTanh, Identity, ...)`` at the same indices. ``state_dict()`` keys are
   unchanged (the Linear's ``i.weight`` / ``i.bias`` become the fused module's ``i.weight`` /
   ``i.bias``) and the parameters are the same ``nn.Parameter`` objects, so old checkpoints load
   and an optimizer built before the swap keeps updating them.

2. **forward code** (torch.fx): every other module's own ``forward`` is traced with all its
   children kept as opaque calls, and a ``Linear`` module call or ``F.linear`` whose only user is
   ``torch.tanh`` / ``F.tanh`` / an ``nn.Tanh`` child / ``.tanh()`` is replaced by the fused op. A
   module whose forward was rewritten is replaced, in its parent, by a ``torch.fx.GraphModule``
   that holds the same children, parameters and buffers under the same names (so again
   ``state_dict()`` keys and parameter identity are unchanged). Tracing is local to one module, so a
   model whose top level fx cannot trace still gets its traceable submodules fused; a module fx
   cannot trace keeps its Python forward and only its Sequential pairs are fused — the report says
   which modules and why.

What ``fuse`` returns: ``(model, report)`` as a :class:`Fused` named tuple. ``model`` is the very
object passed in, modified in place, unless fx rewrote the *top-level* forward itself: then it is a
new ``GraphModule`` sharing all parameters (the object passed in is left with its parameters
unchanged; use the returned one). Modules left alone: Linear -> anything but tanh, a Tanh alone, a
Linear whose output has another user, subclasses of ``nn.Linear`` (LazyLinear, quantized or LoRA
layers: their forward is not ``F.linear``), modules with hooks (a swap would drop them), dtypes or
devices the op does not support, and forwards with optional arguments (fx would bake in one value
of them). Running ``fuse`` twice changes nothing the second time.

One assumption of the Sequential pass: a Sequential is run as a whole (or element by element in
order). Code that calls ``seq[i]`` alone and expects the Linear's output, without the Tanh, would
now get the tanh applied; such code is rare, and ``dry_run=True`` lists every pair first.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import fx, nn

from . import _C
from .modules import FusedLinearTanh
from .ops import SUPPORTED_DTYPES, linear_tanh

__all__ = ["fuse", "Fused", "FuseReport", "Swap", "Skip"]


# ------------------------------------------------------------------------------------------------
# The report

@dataclass(frozen=True)
class Swap:
    """One Linear -> Tanh pair that was (or, in a dry run, would be) fused."""
    where: str   # path of the module holding the pair ("" is the model itself)
    linear: str  # the Linear: child path, or "F.linear" for a functional call
    tanh: str    # the tanh: child path, "torch.tanh", "F.tanh" or ".tanh()"
    how: str     # "sequential" (in-place index swap) or "fx" (forward rewritten)


@dataclass(frozen=True)
class Skip:
    """A Linear followed by a tanh that was NOT fused, and why."""
    where: str
    linear: str
    reason: str


@dataclass
class FuseReport:
    dry_run: bool
    swaps: List[Swap] = field(default_factory=list)
    skipped: List[Skip] = field(default_factory=list)
    #: modules whose forward fx could not trace (or would specialise), with the reason; their
    #: forward code is unchanged, only their nn.Sequential pairs are fused.
    untraced: List[Tuple[str, str]] = field(default_factory=list)
    #: modules replaced by a torch.fx.GraphModule ("" = the model itself)
    rewritten: List[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.swaps)

    def __str__(self) -> str:
        verb = "would fuse" if self.dry_run else "fused"
        lines = [f"ckpt_ext.fuse: {verb} {len(self.swaps)} Linear->Tanh pair(s)"]
        for s in self.swaps:
            where = s.where or "<model>"
            lines.append(f"  [{s.how:10s}] in {where}: {s.linear} -> {s.tanh}")
        if self.rewritten:
            verb = "would replace" if self.dry_run else "replaced"
            lines.append(f"  {verb} by a torch.fx.GraphModule: "
                         + ", ".join(p or "<model>" for p in self.rewritten))
        for s in self.skipped:
            lines.append(f"  left alone in {s.where or '<model>'}: {s.linear} ({s.reason})")
        for path, why in self.untraced:
            lines.append(f"  forward of {path or '<model>'} not traced by torch.fx, only its "
                         f"nn.Sequential pairs are fused: {why}")
        return "\n".join(lines)


class Fused(NamedTuple):
    model: nn.Module
    report: FuseReport


# ------------------------------------------------------------------------------------------------
# What the op supports

def _unsupported(weight: Optional[torch.Tensor]) -> Optional[str]:
    """None when the op runs on this weight's device and dtype, else why not."""
    if weight is None:
        return None
    if weight.dtype not in SUPPORTED_DTYPES:
        return f"dtype {weight.dtype} is not supported by the fused op"
    ok = {"cpu", "meta"} | ({"cuda"} if _C.WITH_CUDA else set())
    if weight.device.type not in ok:
        return f"device {weight.device} is not supported by this build of the fused op"
    return None


def _has_hooks(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or getattr(m, "_backward_pre_hooks", None))


def _linear_problem(lin: nn.Module) -> Optional[str]:
    if type(lin) is not nn.Linear:
        return (f"{type(lin).__name__} subclasses nn.Linear; its forward may not be F.linear")
    if _has_hooks(lin):
        return "the Linear has hooks, which a swap would drop"
    return _unsupported(lin.weight)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


# ------------------------------------------------------------------------------------------------
# Pass 1: nn.Sequential pairs, swapped by index

def _is_plain_sequential(m: nn.Module) -> bool:
    return isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward


def _sequential_pass(path: str, seq: nn.Sequential, report: FuseReport) -> None:
    names = list(seq._modules.keys())
    i = 0
    while i + 1 < len(names):
        lin, act = seq._modules[names[i]], seq._modules[names[i + 1]]
        if isinstance(lin, nn.Linear) and type(act) is nn.Tanh:
            problem = _linear_problem(lin) or (
                "the Tanh has hooks, which a swap would drop" if _has_hooks(act) else None)
            if problem:
                report.skipped.append(Skip(path, _join(path, names[i]), problem))
            else:
                report.swaps.append(Swap(path, _join(path, names[i]), _join(path, names[i + 1]),
                                         "sequential"))
                if not report.dry_run:
                    # Same names, so state_dict keys stay; from_linear shares the Parameters.
                    seq._modules[names[i]] = FusedLinearTanh.from_linear(lin)
                    seq._modules[names[i + 1]] = nn.Identity()
                i += 2
                continue
        i += 1


# ------------------------------------------------------------------------------------------------
# Pass 2: forward code, through torch.fx, one module at a time

class _LocalTracer(fx.Tracer):
    """Traces one module's own forward: every child call stays a single call_module node."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return True


_TANH_FUNCTIONS = {torch.tanh: "torch.tanh", F.tanh: "F.tanh"}
_LINEAR_FUNCTIONS = (F.linear, torch._C._nn.linear)


def _is_leaf_by_default(m: nn.Module) -> bool:
    return fx.Tracer().is_leaf_module(m, "")


def _tanh_of(node: fx.Node, root: nn.Module) -> Optional[str]:
    """How `node` (the only user of a linear) applies tanh to it, or None if it does not."""
    if node.op == "call_function" and node.target in _TANH_FUNCTIONS:
        if len(node.args) == 1 and not node.kwargs:
            return _TANH_FUNCTIONS[node.target]
    elif node.op == "call_method" and node.target == "tanh":
        if len(node.args) == 1 and not node.kwargs:
            return ".tanh()"
    elif node.op == "call_module":
        sub = root.get_submodule(node.target)
        if type(sub) is nn.Tanh and len(node.args) == 1 and not node.kwargs:
            if _has_hooks(sub):
                return None
            return node.target
    return None


def _untraceable_reason(m: nn.Module) -> Optional[str]:
    """Why fx must not rewrite this module's forward even if it traces, or None."""
    if _has_hooks(m):
        return "the module has hooks, which a GraphModule would drop"
    try:
        sig = inspect.signature(m.forward)
    except (TypeError, ValueError):
        return "its forward has no inspectable signature"
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            return f"its forward takes *{p.name}, which fx would fix to the traced arity"
        if p.default is not p.empty:
            return (f"its forward has an optional argument {p.name}={p.default!r}, whose traced "
                    f"value fx would bake in")
    return None


def _match(graph: fx.Graph, root: nn.Module, path: str, report: FuseReport):
    """The (linear node, tanh node, linear label, tanh label) sites in one module's graph."""
    sites = []
    for node in graph.nodes:
        if node.op == "call_module":
            sub = root.get_submodule(node.target)
            if not isinstance(sub, nn.Linear):
                continue
            label = node.target
        elif node.op == "call_function" and node.target in _LINEAR_FUNCTIONS:
            label, sub = "F.linear", None
            try:
                _linear_args(node)
            except TypeError:
                continue
        else:
            continue
        users = list(node.users)
        tanh_label = _tanh_of(users[0], root) if len(users) == 1 else None
        if tanh_label is None:
            # Only a Linear that meets a tanh is a near miss worth reporting.
            if any(_tanh_of(u, root) for u in users):
                report.skipped.append(Skip(path, label, f"its output has {len(users)} users"))
            continue
        if sub is not None:
            problem = _linear_problem(sub)
        else:
            w = _linear_args(node)[1]
            problem = None
            if isinstance(w, fx.Node) and w.op == "get_attr":
                problem = _unsupported(_getattr_path(root, w.target))
        if problem:
            report.skipped.append(Skip(path, label, problem))
            continue
        sites.append((node, users[0], label, tanh_label))
    return sites


def _linear_args(node: fx.Node):
    """(input, weight, bias) of an F.linear call node, however they were passed."""
    bound = _LINEAR_SIGNATURE.bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    return bound.arguments["input"], bound.arguments["weight"], bound.arguments["bias"]


_LINEAR_SIGNATURE = inspect.signature(lambda input, weight, bias=None: None)


def _getattr_path(root: nn.Module, target: str):
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _rewrite(m: nn.Module, graph: fx.Graph, sites) -> fx.GraphModule:
    """A GraphModule over `m` with each site's linear+tanh replaced by the fused op."""
    fused_targets = {}
    for lin, _, _, _ in sites:
        if lin.op == "call_module":
            fused_targets.setdefault(lin.target, 0)
            fused_targets[lin.target] += 1
    calls = {}
    for node in graph.nodes:
        if node.op == "call_module" and node.target in fused_targets:
            calls[node.target] = calls.get(node.target, 0) + 1
    # A direct child Linear that is only ever called at fused sites becomes a FusedLinearTanh under
    # the same name; otherwise the site calls the op on the Linear's own weight and bias.
    swap_children = {t for t, n in fused_targets.items() if "." not in t and calls[t] == n}

    for lin, act, _, _ in sites:
        if lin.op == "call_module" and lin.target in swap_children:
            act.replace_all_uses_with(lin)
        else:
            with graph.inserting_before(lin):
                if lin.op == "call_module":
                    sub = m.get_submodule(lin.target)
                    x = lin.args[0]
                    w = graph.get_attr(f"{lin.target}.weight")
                    b = graph.get_attr(f"{lin.target}.bias") if sub.bias is not None else None
                else:
                    x, w, b = _linear_args(lin)
                new = graph.call_function(linear_tanh, (x, w, b))
            act.replace_all_uses_with(new)
        graph.erase_node(act)
        if not lin.users:
            graph.erase_node(lin)

    gm = fx.GraphModule(m, graph, class_name=type(m).__name__)
    # GraphModule copied only what the graph touches, and built containers for nested paths; put
    # back every original child, parameter and buffer under its own name so that state_dict() keys
    # and parameter identity are exactly those of `m`.
    for name, child in m._modules.items():
        gm._modules[name] = child
    for name, p in m._parameters.items():
        gm._parameters[name] = p
    for name, b in m._buffers.items():
        gm._buffers[name] = b
    gm._non_persistent_buffers_set = set(m._non_persistent_buffers_set)
    for name in swap_children:
        gm._modules[name] = FusedLinearTanh.from_linear(m._modules[name])
    # Plain attributes (config objects, flags) the parent may read stay available.
    for k, v in vars(m).items():
        if not k.startswith("_") and k not in vars(gm) and k != "forward":
            setattr(gm, k, v)
    gm.training = m.training
    return gm


def _fx_pass(path: str, m: nn.Module, report: FuseReport) -> Optional[fx.GraphModule]:
    reason = _untraceable_reason(m)
    try:
        graph = _LocalTracer().trace(m)
    except Exception as e:  # fx raises many types (TraceError, TypeError, NotImplementedError, ...)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        report.untraced.append((path, f"{type(e).__name__}: {msg}"[:200]))
        return None
    sites = _match(graph, m, path, report)
    if not sites:
        return None
    if reason is not None:
        for _, _, lin_label, _ in sites:
            report.skipped.append(Skip(path, lin_label, "forward not rewritten: " + reason))
        report.untraced.append((path, reason))
        return None
    for lin, act, lin_label, tanh_label in sites:
        report.swaps.append(Swap(
            path,
            _join(path, lin_label) if lin.op == "call_module" else lin_label,
            _join(path, tanh_label) if act.op == "call_module" else tanh_label,
            "fx"))
    report.rewritten.append(path)
    if report.dry_run:
        return None
    return _rewrite(m, graph, sites)


def _wants_fx(m: nn.Module) -> bool:
    if _is_plain_sequential(m) or isinstance(m, (FusedLinearTanh, nn.ModuleList, nn.ModuleDict)):
        return False
    if type(m).forward is nn.Module.forward:  # containers with no forward of their own
        return False
    # torch.nn's own modules (Linear, Tanh, LSTM, ...) have no Linear->tanh in Python code.
    return not _is_leaf_by_default(m)


# ------------------------------------------------------------------------------------------------
# Entry point

def fuse(model: nn.Module, dry_run: bool = False, trace: bool = True) -> Fused:
    """Swap every Linear -> Tanh pair in ``model`` for the fused op; returns ``(model, report)``.

    ``dry_run=True`` changes nothing and returns the report of what would be swapped.
    ``trace=False`` skips the torch.fx pass (only nn.Sequential pairs, never a GraphModule).
    ``print(report)`` lists every swap, every near miss left alone and every module fx could not
    trace. See the module docstring for what is returned and what is left alone.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"ckpt_ext.fuse expects an nn.Module, got {type(model).__name__}")
    report = FuseReport(dry_run=dry_run)
    # Snapshot first: the passes replace modules while we walk.
    modules = list(model.named_modules())
    parents: Dict[int, List[Tuple[nn.Module, str]]] = {}
    for _, parent in model.named_modules(remove_duplicate=False):
        for name, child in parent._modules.items():
            if child is not None:
                parents.setdefault(id(child), []).append((parent, name))

    for path, m in modules:
        if _is_plain_sequential(m):
            _sequential_pass(path, m, report)

    result = model
    if trace:
        # Children before parents: a parent rewritten later copies its (already fused) children.
        for path, m in reversed(modules):
            if not _wants_fx(m):
                continue
            gm = _fx_pass(path, m, report)
            if gm is None:
                continue
            if m is model:
                result = gm
            # A module shared at several places is replaced at all of them.
            for parent, name in parents.get(id(m), []):
                parent._modules[name] = gm
    return Fused(result, report)
