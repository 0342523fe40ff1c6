"""``ckpt_ext.fuse(model)``: make a model's Linear/Tanh layers recompute in backward — in place,
without changing what the model computes, and only where that frees memory.

What fuse changes (in place; the returned model is always the object passed in)
---------------------------------------------------------------------------------
* **nn.Sequential** (at any depth; exactly ``nn.Sequential``, not a user's subclass): when it holds
  a unit worth fusing, its class becomes :class:`FusedSequential`, a subclass with the same
  elements, the same ``state_dict`` keys and the same parameters. Its forward runs each planned run
  ``Linear, Tanh, Linear, ...`` of consecutive elements through one fused op and every other element
  as before. ``seq[i]`` is still the ``nn.Linear``; a slice runs unfused; a run whose elements were
  replaced or given hooks after fusing runs element by element.
* **direct children a module's forward calls in sequence** (``self.act(self.fc(x))``, or
  ``fc1, act1, fc2, act2, fc3`` one after the other): swapped inside that module — a lone pair
  becomes ``FusedLinearTanh`` + ``nn.Identity``; a run becomes a :class:`FusedRunHead` at the first
  Linear (it runs the whole run and holds that layer's ``weight``/``bias``), ``nn.Identity`` at each
  fused Tanh and a :class:`RunLayer` at each later Linear (a pass-through holding that layer's
  parameters under the same names, read by the head at forward time). ``state_dict`` keys and
  parameter objects are unchanged, so old checkpoints load and an optimizer built before keeps
  training them. Which children qualify is found by torch.fx on a **copy** of the model (see below).
* **forward code** (``F.linear``, ``torch.tanh``, ``.tanh()``, a Linear in a ModuleList loop): only
  with ``rewrite=True``. The module keeps its class; its instance gets a ``forward`` generated from
  the fx graph of its class's forward with the pairs replaced by the fused ops.

What fuse never changes: the classes of the user's modules, their methods, hooks, plain
attributes, ``training``-dependent branches, and the numbers the model computes (to rounding).

How the analysis avoids side effects, and what it refuses
----------------------------------------------------------
fx runs a forward's Python code with placeholder values. fuse traces a deep copy whose parameters
and buffers are on the ``meta`` device (no memory), once in ``train()`` and once in ``eval()`` mode,
and compares every attribute of the traced module and its descendants before and after. A module's
forward is not used (neither to swap its children nor to rewrite it) when: fx cannot trace it;
tracing changed an attribute (``self.calls += 1``, a list that now holds a Proxy: statements the
graph would not replay); the graphs differ between train() and eval() (it branches on
``self.training``); it takes optional or variadic arguments (fx would see one value of them); or its
``forward`` was replaced on the instance. The report lists each with the reason. A child is swapped
only if it appears at one place in the model, the forward calls it exactly once, it has no hooks,
and no other method of the class refers to it.

Which units fuse (``policy="memory"``, the default)
---------------------------------------------------
In ``Linear, Tanh, Linear, Tanh, ...`` every tanh output is also the next Linear's input, so
fusing one pair at a time frees nothing but costs a recompute. fuse therefore fuses **maximal
runs** as one ``tanh_mlp`` (it keeps only the run's input); a run's trailing Tanh, and a lone
``Linear -> Tanh`` pair, are included only where their output is not kept by its consumer anyway
(a residual add, a ``.mean()`` loss, the model's output — not a following Linear, LayerNorm, matmul,
or a consumer the analysis cannot see). ``policy="all"`` fuses every pair on its own, as before.
The report gives, for every decision, the activation bytes per row it frees and the FLOPs per row
its recompute costs, and says why each near miss was left alone. Running fuse twice with the same
policy changes nothing.
"""
from __future__ import annotations

import ast
import copy
import inspect
import operator
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import fx, nn

from . import _C
from .modules import FusedLinearTanh, FusedTanhMLP, _has_hooks, run_problem
from .ops import SUPPORTED_DTYPES, linear_tanh, tanh_mlp

__all__ = ["fuse", "Fused", "FuseReport", "Decision", "FusedSequential", "FusedRunHead",
           "RunLayer", "POLICIES"]

POLICIES = ("memory", "all")

Fate = Tuple[Optional[bool], str]  # (True: kept by a consumer, False: not kept, None: unknown; why)


# ------------------------------------------------------------------------------------------------
# The report

@dataclass(frozen=True)
class Decision:
    """One run or pair of Linear/Tanh layers and what fuse did with it.

    Byte and FLOP figures are per *row*: one row of the layers' input (one sample; for a sequence
    input, one token — every leading dimension counts). For a near miss they say what fusing would
    have freed and cost.
    """
    where: str                # module holding the layers ("" = the model itself)
    layers: Tuple[str, ...]   # the layers in call order: paths, or "F.linear" / "torch.tanh" / ...
    action: str               # "fused", "already fused" or "left alone"
    unit: str                 # what runs them ("tanh_mlp, 3 layers 4->64->64->2", "linear_tanh")
    how: str                  # "sequential", "children", "rewrite" ("" when left alone)
    bytes_per_row: int        # activation bytes per row no longer kept for backward
    flops_per_row: int        # extra FLOPs per row: the forward GEMMs that backward recomputes
    plain_flops_per_row: int  # these layers' forward + backward GEMM FLOPs per row, unfused
    why: str

    @property
    def extra_cost(self) -> float:
        """Extra FLOPs as a fraction of these layers' unfused forward + backward."""
        return self.flops_per_row / self.plain_flops_per_row if self.plain_flops_per_row else 0.0


@dataclass
class FuseReport:
    dry_run: bool
    policy: str
    rewrite: bool
    decisions: List[Decision] = field(default_factory=list)
    #: (module path, why) for each module whose forward fuse did not use (not analysed, so its
    #: children are not swapped and its code is not rewritten).
    not_analysed: List[Tuple[str, str]] = field(default_factory=list)
    #: modules whose instance got a rewritten forward (rewrite=True)
    rewritten: List[str] = field(default_factory=list)

    @property
    def fused(self) -> List[Decision]:
        return [d for d in self.decisions if d.action == "fused"]

    @property
    def near_misses(self) -> List[Decision]:
        return [d for d in self.decisions if d.action == "left alone"]

    @property
    def bytes_per_row(self) -> int:
        return sum(d.bytes_per_row for d in self.fused)

    @property
    def flops_per_row(self) -> int:
        return sum(d.flops_per_row for d in self.fused)

    def __len__(self) -> int:
        return len(self.fused)

    def __str__(self) -> str:
        verb = "would fuse" if self.dry_run else "fused"
        lines = [f"ckpt_ext.fuse(policy={self.policy!r}{', rewrite=True' if self.rewrite else ''}):"
                 f" {verb} {len(self)} unit(s), freeing {self.bytes_per_row:,} B per row for "
                 f"+{self.flops_per_row:,} FLOPs per row"]
        for d in self.decisions:
            layers = " -> ".join(d.layers)
            if d.action == "left alone":
                lines.append(f"  left alone  {layers}: {d.why}")
                continue
            tag = verb if d.action == "fused" else "already fused"
            lines.append(f"  {tag:<11s} {layers} [{d.how}] as {d.unit}: frees "
                         f"{d.bytes_per_row:,} B/row, +{d.flops_per_row:,} FLOPs/row "
                         f"(+{100 * d.extra_cost:.0f}% of these layers' fwd+bwd); {d.why}")
        if self.rewritten:
            lines.append("  forward rewritten (rewrite=True): "
                         + ", ".join(p or "<model>" for p in self.rewritten))
        for path, why in self.not_analysed:
            lines.append(f"  not analysed: {path or '<model>'}: {why}")
        return "\n".join(lines)


class Fused(NamedTuple):
    model: nn.Module
    report: FuseReport


# ------------------------------------------------------------------------------------------------
# Modules fuse puts in place

class _PlannedRun:
    """A run of consecutive elements of a FusedSequential, computed by one fused op."""

    def __init__(self, names: Sequence[str], modules: Sequence[nn.Module], last_tanh: bool):
        self.names, self.modules, self.last_tanh = tuple(names), tuple(modules), bool(last_tanh)
        layers = sum(type(m) is nn.Linear for m in self.modules)
        # Two or more layers: the lead's FusedTanhMLP over the very same Linear modules (it reads
        # their weight and bias at every call). One layer: linear_tanh itself, the op a pair is.
        self.mlp = FusedTanhMLP.from_modules(dict(zip(self.names, self.modules))) \
            if layers > 1 else None

    def matches(self, items: List[Tuple[str, nn.Module]], i: int) -> bool:
        """Elements i.. are still exactly this run, without hooks, in a dtype the op runs."""
        n = len(self.names)
        if i + n > len(items):
            return False
        for (name, m), want_name, want in zip(items[i:i + n], self.names, self.modules):
            if name != want_name or m is not want:
                return False
        return run_problem(self.modules) is None and _unsupported(self.modules[0].weight) is None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.mlp is not None:
            return self.mlp(x)
        lin = self.modules[0]
        return linear_tanh(x, lin.weight, lin.bias)

    def describe(self) -> str:
        return f"{self.names[0]}..{self.names[-1]}" + (" (last tanh)" if self.last_tanh else "")


class FusedSequential(nn.Sequential):
    """An ``nn.Sequential`` whose planned runs of ``Linear, Tanh, Linear, ...`` elements each run
    through one fused op (``tanh_mlp``, or ``linear_tanh`` for a single pair).

    ``fuse`` sets this class on the user's own ``nn.Sequential`` objects: same object, same
    elements, same ``state_dict`` keys, same parameters. Only ``forward`` differs, and only for the
    planned runs, which it re-checks at every call: a run whose elements were replaced, reordered or
    given hooks since, or whose dtype the op does not support, runs element by element. Indexing
    returns the real elements; a slice is a new FusedSequential without a plan, so it runs unfused.
    """

    _ckpt_ext_runs: Tuple[_PlannedRun, ...] = ()

    def forward(self, input):
        runs = self._ckpt_ext_runs
        if not runs:
            return super().forward(input)
        items = list(self._modules.items())
        starts = {run.names[0]: run for run in runs}
        i = 0
        while i < len(items):
            run = starts.get(items[i][0])
            if run is not None and run.matches(items, i):
                input = run(input)
                i += len(run.names)
            else:
                input = items[i][1](input)
                i += 1
        return input

    def extra_repr(self) -> str:
        if not self._ckpt_ext_runs:
            return ""
        return "fused runs: " + ", ".join(r.describe() for r in self._ckpt_ext_runs)


class RunLayer(nn.Module):
    """Holds a Linear's ``weight`` and ``bias`` (same Parameter objects, same names) for the
    :class:`FusedRunHead` that computes its layer; its own forward passes its input through."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        if linear.bias is not None:
            self.bias = linear.bias
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None} (computed by its run's FusedRunHead)")


class FusedRunHead(nn.Module):
    """The first Linear of a run of a module's children ``Linear, Tanh, Linear, ...`` that its
    forward calls in sequence. It computes the whole run with ``tanh_mlp`` (keeping only the run's
    input) and holds the first layer's ``weight`` and ``bias``; the later layers' parameters stay
    in :class:`RunLayer` children of the same module under their own names, read at every call
    (so ``load_state_dict(assign=True)`` and ``.to()`` are seen)."""

    def __init__(self, linear: nn.Linear, owner: nn.Module, tail: Sequence[str],
                 last_tanh: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        if linear.bias is not None:
            self.bias = linear.bias
        else:
            self.register_parameter("bias", None)
        self.tail, self.last_tanh = tuple(tail), bool(last_tanh)
        # The owner is this module's parent: a plain reference, not a registered child.
        object.__setattr__(self, "_owner", owner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, biases = [self.weight], [self.bias]
        for name in self.tail:
            layer = self._owner._modules.get(name)
            if type(layer) is not RunLayer or _has_hooks(layer):
                what = "has hooks" if type(layer) is RunLayer else \
                    f"was replaced by {type(layer).__name__}"
                raise RuntimeError(f"FusedRunHead: the run's layer {name!r} {what}; this head "
                                   f"computes the run from the layers' weight and bias only")
            weights.append(layer.weight)
            biases.append(layer.bias)
        return tanh_mlp(x, weights, biases, self.last_tanh)

    def extra_repr(self) -> str:
        return f"runs {', '.join(self.tail)} too, last_tanh={self.last_tanh}"


class _RewrittenForward:
    """The forward ``fuse(rewrite=True)`` sets on one module instance: the fx graph of its class's
    forward with Linear/tanh units replaced by the fused ops, compiled from generated source. The
    class is untouched. Pickles and deep-copies by its source, as torch.fx.GraphModule does."""

    def __init__(self, owner: nn.Module, source: str) -> None:
        self.owner, self.source = owner, source
        self._fn = _compile_forward(source)

    def __call__(self, *args, **kwargs):
        return self._fn(self.owner, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:  # the class forward's, for libraries that look
        sig = inspect.signature(type(self.owner).forward)
        return sig.replace(parameters=list(sig.parameters.values())[1:])

    def __getstate__(self):
        return {"owner": self.owner, "source": self.source}

    def __setstate__(self, state):
        self.owner, self.source = state["owner"], state["source"]
        self._fn = _compile_forward(self.source)

    def __deepcopy__(self, memo):
        new = _RewrittenForward.__new__(_RewrittenForward)
        memo[id(self)] = new
        new.__setstate__({"owner": copy.deepcopy(self.owner, memo), "source": self.source})
        return new


def _compile_forward(source: str) -> Callable:
    scope: Dict[str, Any] = {}
    exec(compile(source, "<ckpt_ext.fuse rewritten forward>", "exec", dont_inherit=True), scope)
    return scope["forward"]


_OUR_MODULES = (FusedLinearTanh, FusedTanhMLP, FusedRunHead, RunLayer)


# ------------------------------------------------------------------------------------------------
# Small helpers

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


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_sequential(m: nn.Module) -> bool:
    return type(m) in (nn.Sequential, FusedSequential)


def _linear_problem(lin: nn.Module) -> Optional[str]:
    if type(lin) is not nn.Linear:
        return f"{type(lin).__name__} subclasses nn.Linear; its forward may not be F.linear"
    if _has_hooks(lin):
        return "the Linear has hooks, which the fused op would not call"
    return _unsupported(lin.weight)


def _tanh_problem(act: nn.Module) -> Optional[str]:
    if type(act) is not nn.Tanh:
        return f"{type(act).__name__} subclasses nn.Tanh"
    if _has_hooks(act):
        return "the Tanh has hooks, which the fused op would not call"
    return None


def _getattr_path(root: Any, target: str) -> Any:
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class _Layer:
    label: str
    k: int          # in_features
    n: int          # out_features
    itemsize: int   # bytes per element of its activations


def _gemm(layer: _Layer) -> int:
    return 2 * layer.k * layer.n  # FLOPs per row of one x·Wᵀ (bias and tanh not counted)


def _unit_name(layers: Sequence[_Layer], last_tanh: bool) -> str:
    sizes = "->".join(str(s) for s in [layers[0].k] + [lay.n for lay in layers])
    if len(layers) == 1 and last_tanh:
        return f"linear_tanh {sizes}"
    return f"tanh_mlp, {len(layers)} layers {sizes}" + (", last tanh" if last_tanh else "")


# ------------------------------------------------------------------------------------------------
# Analysis on a copy: one torch.fx graph per module, traced with every child kept opaque

class _LocalTracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return True


@dataclass
class _Trace:
    ok: bool
    reason: str = ""
    graph: Optional[fx.Graph] = None
    already_rewritten: bool = False


def _analysis_copy(model: nn.Module) -> nn.Module:
    """A deep copy to trace, with parameters and buffers on the meta device: tracing never reads
    their values, so the copy costs no tensor memory."""
    memo: Dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"),
                                   requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    # No fallback to a full copy: that could double the memory of a large model.
    return copy.deepcopy(model, memo)


def _fingerprint(v: Any, depth: int = 0) -> Any:
    """A comparable summary of an attribute value: contents of containers, identity of objects."""
    if v is None or isinstance(v, (bool, int, str, bytes)):
        return v
    if isinstance(v, float):
        return ("float", repr(v))
    if isinstance(v, fx.Proxy):
        return ("proxy", id(v))
    if isinstance(v, (torch.Tensor, nn.Module)) or depth > 4:
        return ("obj", id(v))
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_fingerprint(x, depth + 1) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple((repr(k), _fingerprint(x, depth + 1)) for k, x in v.items()))
    if isinstance(v, (set, frozenset)):
        return ("set", tuple(sorted(repr(_fingerprint(x, depth + 1)) for x in v)))
    state = getattr(v, "__dict__", None)
    if isinstance(state, dict) and not inspect.isroutine(v) and not inspect.ismodule(v):
        return ("obj", id(v), _fingerprint(dict(state), depth + 1))
    return ("obj", id(v))


def _snapshot(m: nn.Module) -> Dict[Tuple[str, str], Any]:
    snap = {}
    for path, sub in m.named_modules(remove_duplicate=False):
        for k, v in vars(sub).items():
            if k.startswith("_tensor_constant"):  # fx's own bookkeeping on the traced root
                continue
            snap[(path, k)] = _fingerprint(v)
    return snap


def _signature_problem(m: nn.Module) -> Optional[str]:
    try:
        sig = inspect.signature(type(m).forward)
    except (TypeError, ValueError):
        return "its forward has no inspectable signature"
    for p in list(sig.parameters.values())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            return f"its forward takes *{p.name}; fx would see only the traced arity"
        if p.default is not p.empty:
            return (f"its forward has an optional argument {p.name}={p.default!r}; fx would see "
                    f"only one value of it")
    return None


def _trace_module(clone: nn.Module, orig: nn.Module) -> _Trace:
    fwd = vars(orig).get("forward")
    already = isinstance(fwd, _RewrittenForward)
    # A forward rewritten by an earlier fuse came from its class's forward, which fx traces: that
    # graph still says what the code does with each value (for the units around this module), but
    # nothing new is fused in it.
    if fwd is not None and not already:
        return _Trace(False, "its forward is set on the instance (fx would trace its class's "
                             "forward, not what runs)")
    problem = _signature_problem(orig)
    if problem:
        return _Trace(False, problem)
    codes, graph = [], None
    for mode in (True, False):
        clone.train(mode)
        before = _snapshot(clone)
        try:
            g = _LocalTracer().trace(clone)
        except Exception as e:  # fx raises many types (TraceError, TypeError, ...)
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            return _Trace(False, f"torch.fx cannot trace it ({type(e).__name__}: {msg[:160]})")
        after = _snapshot(clone)
        changed = sorted({_join(p, k) for (p, k) in set(before) | set(after)
                          if before.get((p, k)) != after.get((p, k))})
        if changed:
            return _Trace(False, f"tracing its forward changed {', '.join(changed)}: a statement "
                                 f"that the traced graph would not replay")
        codes.append(g.python_code(root_module="self").src)
        graph = graph or g
    if codes[0] != codes[1]:
        return _Trace(False, "its forward runs different code in train() and eval() (it reads "
                             "self.training)")
    return _Trace(True, "", graph, already_rewritten=already)


_CLASS_USES: Dict[type, Optional[Dict[str, List[str]]]] = {}


def _uses_outside_forward(cls: type) -> Optional[Dict[str, List[str]]]:
    """{name: [methods]} for each ``self.<name>(...)`` call and each string constant in a method of
    ``cls`` (and its own bases) other than forward and __init__; None if a source is missing."""
    if cls in _CLASS_USES:
        return _CLASS_USES[cls]
    uses: Dict[str, List[str]] = {}
    result: Optional[Dict[str, List[str]]] = uses
    for klass in cls.__mro__:
        if klass in (nn.Module, object) or klass.__module__.startswith("torch."):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError, IndentationError):
            result = None
            break
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for fn in body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or \
                    fn.name in ("forward", "__init__"):
                continue
            for node in ast.walk(fn):
                name = None
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    f = node.func
                    if isinstance(f.value, ast.Name) and f.value.id == "self":
                        name = f.attr  # self.name(...)
                    elif isinstance(f.value, ast.Attribute) and \
                            isinstance(f.value.value, ast.Name) and f.value.value.id == "self":
                        name = f.value.attr  # self.name.forward(...) and the like
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    name = node.value
                if name is not None:
                    uses.setdefault(name, []).append(fn.name)
    _CLASS_USES[cls] = result
    return result


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
_FREEING_FUNCTIONS = {operator.add, operator.sub, operator.iadd, operator.isub, operator.neg,
                      torch.add, torch.sub, torch.neg, torch.cat, torch.concat, torch.stack,
                      torch.sum, torch.mean, torch.clone, torch.tanh, torch.sigmoid, torch.relu,
                      F.relu, F.tanh, F.sigmoid, F.dropout, F.softmax, F.log_softmax,
                      torch.softmax}
_FREEING_METHODS = {"add", "sub", "add_", "sub_", "neg", "sum", "mean", "clone", "tanh",
                    "sigmoid", "relu", "softmax", "log_softmax"}
_SCALING_FUNCTIONS = {operator.mul, operator.truediv, operator.imul, operator.itruediv,
                      torch.mul, torch.div}
_SCALING_METHODS = {"mul", "div", "mul_", "div_"}
_KEEPING_FUNCTIONS = {F.linear, torch._C._nn.linear, torch.matmul, torch.mm, torch.bmm,
                      operator.matmul, torch.einsum, F.layer_norm, F.gelu, F.silu, F.mse_loss,
                      torch.pow, operator.pow, linear_tanh, tanh_mlp}
_KEEPING_METHODS = {"matmul", "mm", "bmm", "pow"}
_PASS_THROUGH_MODULES = (nn.Identity, nn.Flatten, nn.Unflatten, RunLayer)
# These save their output or a mask for backward, never their input.
_FREEING_MODULES = (nn.Dropout, nn.Tanh, nn.Sigmoid, nn.ReLU, nn.Softmax, nn.LogSoftmax)
_KEEPING_MODULES = (nn.Linear, nn.Bilinear, nn.LayerNorm, nn.GroupNorm, nn.GELU, nn.SiLU,
                    nn.MultiheadAttention, nn.modules.conv._ConvNd,
                    nn.modules.batchnorm._BatchNorm, FusedLinearTanh, FusedTanhMLP, FusedRunHead)


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


def _combine(results: List[Fate]) -> Fate:
    for r in results:
        if r[0] is True:
            return r
    for r in results:
        if r[0] is None:
            return r
    whys = [r[1] for r in results if r[1]]
    return False, "; ".join(dict.fromkeys(whys)) or "nothing uses it"


class _Model:
    """The model's module tree and, per analysed module, its fx graph; answers what the consumers
    of a value do with it."""

    def __init__(self, model: nn.Module, trace: bool, report: FuseReport) -> None:
        self.model = model
        self.paths: Dict[int, List[str]] = {}
        self.parent: Dict[str, Tuple[nn.Module, str, str]] = {}  # path -> (parent, its path, name)
        self.slots: Dict[int, set] = {}  # id(module) -> {(id(parent), name)}: where it is held
        for path, m in model.named_modules(remove_duplicate=False):
            self.paths.setdefault(id(m), []).append(path)
            for name, child in m._modules.items():
                if child is not None:
                    self.parent[_join(path, name)] = (m, path, name)
                    self.slots.setdefault(id(child), set()).add((id(m), name))
        self.traces: Dict[int, _Trace] = {}
        if trace:
            self._trace_all(report)

    def path_of(self, m: nn.Module) -> str:
        return self.paths[id(m)][0]

    def _trace_all(self, report: FuseReport) -> None:
        wanted = [(p, m) for p, m in self.model.named_modules() if _wants_analysis(m)]
        if not wanted:
            return
        try:
            clone = _analysis_copy(self.model)
        except Exception as e:
            report.not_analysed.append(("", f"the model could not be copied for analysis "
                                            f"({type(e).__name__}: {e}); only nn.Sequential "
                                            f"contents were considered"))
            return
        clones = dict(clone.named_modules())
        for path, m in wanted:
            t = _trace_module(clones[path], m)
            self.traces[id(m)] = t
            if not t.ok and not t.already_rewritten and _worth_reporting(m):
                report.not_analysed.append((path, t.reason))

    def trace_of(self, m: nn.Module) -> Optional[_Trace]:
        t = self.traces.get(id(m))
        return t if t is not None and t.ok else None

    # -- what happens to a value ------------------------------------------------------------------
    def output_fate(self, m: nn.Module, index: Optional[int] = None, depth: int = 0) -> Fate:
        """What the callers of module ``m`` do with its output (element ``index`` of a tuple)."""
        if depth > 64:
            return None, "the chain of callers is too deep to follow"
        if m is self.model:
            return False, ("returned by the model (freed unless the loss keeps it: .mean()/.sum() "
                           "do not, mse_loss does)")
        paths = self.paths.get(id(m), [])
        if len(paths) != 1:
            return None, f"{paths[0] if paths else 'a module'} sits at {len(paths)} places"
        parent, ppath, name = self.parent[paths[0]]
        if _is_sequential(parent):
            if index is not None:
                return None, f"{paths[0]} returns a tuple inside an nn.Sequential"
            names = list(parent._modules)
            i = names.index(name)
            return self.elements_fate(parent, ppath, i + 1,
                                      lambda: self.output_fate(parent, None, depth + 1), depth + 1)
        # A ModuleList / ModuleDict has no forward: the caller is the module holding it, which
        # calls "layers.0".
        while isinstance(parent, (nn.ModuleList, nn.ModuleDict)) and ppath in self.parent:
            parent, ppath, holder = self.parent[ppath]
            name = f"{holder}.{name}"
        t = self.traces.get(id(parent))
        if t is None or not t.ok:
            why = f" ({t.reason})" if t is not None else ""
            return None, f"its caller {ppath or '<model>'} was not analysed{why}"
        calls = [n for n in t.graph.nodes if n.op == "call_module" and n.target == name]
        if len(calls) != 1:
            return None, f"{ppath or '<model>'}.forward calls {name} {len(calls)} times"
        return self.node_fate(parent, t, calls[0], index, depth + 1)

    def node_fate(self, owner: nn.Module, t: _Trace, node: fx.Node, index: Optional[int] = None,
                  depth: int = 0) -> Fate:
        """What the users of ``node`` in ``owner``'s graph do with its value."""
        if depth > 64:
            return None, "the chain of users is too deep to follow"
        results: List[Fate] = []
        for u in node.users:
            if index is not None:
                if u.op == "call_function" and u.target is operator.getitem and \
                        u.args[0] is node and not isinstance(u.args[1], fx.Node):
                    if u.args[1] == index:
                        results.append(self.node_fate(owner, t, u, None, depth + 1))
                    continue
                results.append((None, f"output {index} is used as part of a whole"))
                continue
            results.append(self.use_fate(owner, t, node, u, depth + 1))
        return _combine(results)

    def use_fate(self, owner: nn.Module, t: _Trace, node: fx.Node, u: fx.Node,
                 depth: int) -> Fate:
        opath = self.path_of(owner)
        if u.op == "output":
            out = u.args[0]
            if out is node:
                return self.output_fate(owner, None, depth)
            if isinstance(out, (tuple, list)):
                where = [i for i, o in enumerate(out) if o is node]
                if len(where) == 1:
                    return self.output_fate(owner, where[0], depth)
            return None, f"{opath or '<model>'} returns it inside a nested structure"
        if u.op == "call_module":
            label = _join(opath, u.target)
            others = list(u.args[1:]) + list(u.kwargs.values())
            if not u.args or u.args[0] is not node or any(a is node for a in others):
                return None, f"passed to {label} other than as its only input"
            sub = owner.get_submodule(u.target)
            return self.module_input_fate(sub, label,
                                          lambda: self.node_fate(owner, t, u, None, depth + 1),
                                          depth)
        if u.op in ("call_function", "call_method"):
            target = u.target
            name = _fn_name(target)
            is_fn = u.op == "call_function"

            def among(functions: set, methods: set) -> bool:
                return target in (functions if is_fn else methods)

            if among(_META_FUNCTIONS, _META_METHODS):
                return False, ""
            if among(_VIEW_FUNCTIONS, _VIEW_METHODS):
                return self.node_fate(owner, t, u, None, depth + 1)
            if among(_FREEING_FUNCTIONS, _FREEING_METHODS):
                what = " (a residual add)" if target in (operator.add, operator.iadd, "add") else ""
                return False, f"its user {name}{what} does not keep it"
            if among(_SCALING_FUNCTIONS, _SCALING_METHODS):
                if any(isinstance(a, fx.Node) and a is not node for a in u.args):
                    return True, f"kept by {name} with another tensor"
                return False, f"its user {name} by a constant does not keep it"
            if among(_KEEPING_FUNCTIONS, _KEEPING_METHODS):
                return True, f"kept by {name}"
            return None, f"used by {name}, not known to keep or free its input"
        return None, f"used by a {u.op} node"

    def module_input_fate(self, sub: nn.Module, label: str, on_output: Callable[[], Fate],
                          depth: int) -> Fate:
        """What module ``sub`` does with its input; ``on_output`` answers for its output when it
        only passes the input through."""
        if _is_sequential(sub):
            return self.elements_fate(sub, label, 0, on_output, depth + 1)
        if isinstance(sub, _PASS_THROUGH_MODULES):
            return on_output()
        if isinstance(sub, _FREEING_MODULES):
            return False, f"its user {label} ({type(sub).__name__}) does not keep it"
        if isinstance(sub, _KEEPING_MODULES):
            return True, f"kept by {label} ({type(sub).__name__} keeps its input)"
        ts = self.trace_of(sub)
        if ts is not None:
            ph = [n for n in ts.graph.nodes if n.op == "placeholder"]
            if ph:
                return self.node_fate(sub, ts, ph[0], None, depth + 1)
        return None, f"its user {label} ({type(sub).__name__}) is not known to keep or free it"

    def elements_fate(self, seq: nn.Module, seq_path: str, start: int,
                      on_end: Callable[[], Fate], depth: int) -> Fate:
        names = list(seq._modules)
        for i in range(start, len(names)):
            e = seq._modules[names[i]]
            if isinstance(e, _PASS_THROUGH_MODULES):
                continue
            rest = (lambda i=i: self.elements_fate(seq, seq_path, i + 1, on_end, depth + 1))
            return self.module_input_fate(e, _join(seq_path, names[i]), rest, depth + 1)
        return on_end()


def _wants_analysis(m: nn.Module) -> bool:
    if _is_sequential(m) or isinstance(m, (nn.ModuleList, nn.ModuleDict) + _OUR_MODULES):
        return False
    if type(m).forward is nn.Module.forward:
        return False
    # torch.nn's own modules (Linear, LSTM, TransformerEncoderLayer, ...): no user code to see.
    return not type(m).__module__.startswith("torch.")


def _worth_reporting(m: nn.Module) -> bool:
    return any(type(c) in (nn.Linear, nn.Tanh) or _is_sequential(c) for c in m.children())


# ------------------------------------------------------------------------------------------------
# Candidates: chains Linear, Tanh, Linear, ... and the units the policy makes of them

@dataclass
class _Chain:
    where: str                    # owner path
    how: str                      # "sequential", "children" or "rewrite"
    labels: List[str]             # one per item, in call order
    items: List[Any]              # modules (sequential, children) or fx nodes (rewrite)
    layers: List[_Layer]          # one per Linear item
    ends_with_tanh: bool
    fate: Callable[[], Fate]      # what the consumer does with the chain's last output
    owner: Optional[nn.Module] = None
    names: Optional[List[str]] = None  # element / child names (sequential, children)

    def span(self, a: int, b: int, last_tanh: bool) -> Tuple[int, int]:
        """Item indices [start, stop) of layers a..b, with b's Tanh if last_tanh."""
        return 2 * a, 2 * b + (2 if last_tanh else 1)


@dataclass
class _Unit:
    chain: _Chain
    a: int
    b: int
    last_tanh: bool
    decision: Decision


def _decide(chain: _Chain, policy: str) -> Tuple[List[_Unit], List[Decision]]:
    """The units to fuse in a chain and the near misses, with their figures."""
    L = chain.layers
    m = len(L)
    units: List[_Unit] = []
    misses: List[Decision] = []

    def figures(a: int, b: int, last_tanh: bool, last_freed: bool) -> Tuple[int, int, int]:
        freed = sum(L[j].n * L[j].itemsize for j in range(a, b))
        if last_tanh and last_freed:
            freed += L[b].n * L[b].itemsize
        extra = sum(_gemm(L[j]) for j in range(a, b)) + (_gemm(L[b]) if last_tanh else 0)
        plain = sum(3 * _gemm(L[j]) for j in range(a, b + 1))
        return freed, extra, plain

    def labels(a: int, b: int, last_tanh: bool) -> Tuple[str, ...]:
        s, e = chain.span(a, b, last_tanh)
        return tuple(chain.labels[s:e])

    def unit(a: int, b: int, last_tanh: bool, last_freed: bool, why: str) -> None:
        freed, extra, plain = figures(a, b, last_tanh, last_freed)
        d = Decision(chain.where, labels(a, b, last_tanh), "fused",
                     _unit_name(L[a:b + 1], last_tanh), chain.how, freed, extra, plain, why)
        units.append(_Unit(chain, a, b, last_tanh, d))

    def miss(a: int, b: int, kept: Optional[bool], why: str, what: str,
             layers: Optional[Tuple[str, ...]] = None) -> None:
        freed, extra, plain = figures(a, b, True, kept is None)
        pot = ("free nothing" if kept else
               f"free {freed:,} B/row only if that consumer does not keep it")
        misses.append(Decision(chain.where, layers or labels(a, b, True), "left alone", "", "",
                               freed if kept is None else 0, extra, plain,
                               f"{what}: {why}; fusing it would {pot} and cost "
                               f"+{extra:,} FLOPs/row"))

    if policy == "all":
        for j in range(m):
            if 2 * j + 1 >= len(chain.items):
                break  # the last Linear, without a Tanh
            if j < m - 1:
                fate: Fate = (True, f"kept by {chain.labels[2 * j + 2]} (nn.Linear keeps its "
                                    f"input)")
            else:
                fate = chain.fate()
            note = "" if fate[0] is False else \
                f"; its output is {'kept anyway' if fate[0] else 'maybe kept'}: {fate[1]}"
            unit(j, j, True, fate[0] is False, "policy='all' fuses every pair" + note)
        return units, misses

    if m >= 2:
        last_tanh = False
        if chain.ends_with_tanh:
            kept, why = chain.fate()
            if kept is False:
                last_tanh = True
            else:
                miss(m - 1, m - 1, kept, why, "the trailing Tanh is left out of the run "
                     + ("(its output is kept anyway)" if kept else "(its output may be kept)"),
                     (chain.labels[2 * m - 1],))
        inner = m - 1
        why = (f"a run: {inner} inner tanh output(s) are no longer kept, only the run's input"
               + (f"; its last output too ({chain.fate()[1]})" if last_tanh else ""))
        unit(0, m - 1, last_tanh, True, why)
    elif chain.ends_with_tanh:
        kept, why = chain.fate()
        if kept is False:
            unit(0, 0, True, True, f"a lone pair whose output is not kept: {why}")
        else:
            miss(0, 0, kept, why, "a lone pair whose output is " +
                 ("kept anyway" if kept else "maybe kept"))
    return units, misses


def _pair_labels(labels: List[str], k: int) -> Tuple[str, ...]:
    """The Linear/Tanh pair that item k belongs to (k even: a Linear and its Tanh)."""
    s = k - (k % 2)
    return tuple(labels[s:s + 2])


def _item_misses(where: str, labels: List[str], problems: List[Optional[str]],
                 misses: List[Decision]) -> None:
    """One near miss per pair that holds an item with a problem, with all its reasons."""
    groups: Dict[Tuple[str, ...], List[str]] = {}
    for k, p in enumerate(problems):
        if p is not None:
            groups.setdefault(_pair_labels(labels, k), []).append(p)
    for pair, whys in groups.items():
        misses.append(Decision(where, pair, "left alone", "", "", 0, 0, 0,
                               "; ".join(dict.fromkeys(whys))))


def _split(items_ok: List[Optional[str]], n: int) -> List[Tuple[int, int]]:
    """Maximal item ranges [s, e) without a problem, starting at a Linear (even index)."""
    ranges, s = [], 0
    for i in range(n + 1):
        if i == n or items_ok[i] is not None:
            if s % 2:
                s += 1  # a range must start at a Linear
            if i - s >= 2:
                ranges.append((s, i))
            s = i + 1
    return ranges


def _sub_chain(chain: _Chain, s: int, e: int, fate: Callable[[], Fate]) -> _Chain:
    return _Chain(chain.where, chain.how, chain.labels[s:e], chain.items[s:e],
                  chain.layers[s // 2:(e + 1) // 2], (e - s) % 2 == 0, fate, chain.owner,
                  chain.names[s:e] if chain.names else None)


def _layer(label: str, lin: nn.Linear) -> _Layer:
    return _Layer(label, lin.in_features, lin.out_features, lin.weight.element_size())


def _sequential_chains(an: _Model, path: str, seq: nn.Sequential,
                       misses: List[Decision]) -> List[_Chain]:
    names = list(seq._modules)
    mods = [seq._modules[n] for n in names]
    chains = []
    i = 0
    while i < len(mods):
        if not (isinstance(mods[i], nn.Linear) and i + 1 < len(mods)
                and isinstance(mods[i + 1], nn.Tanh)):
            i += 1
            continue
        j = i  # alternate Linear, Tanh, ... as far as it goes
        while j + 1 < len(mods) and isinstance(mods[j + 1], nn.Tanh if (j - i) % 2 == 0
                                               else nn.Linear):
            j += 1
        n = j - i + 1
        problems = [(_linear_problem(m) if k % 2 == 0 else _tanh_problem(m))
                    for k, m in enumerate(mods[i:j + 1])]
        labels = [_join(path, nm) for nm in names[i:j + 1]]
        _item_misses(path, labels, problems, misses)
        full = _Chain(path, "sequential", labels, mods[i:j + 1],
                      [_layer(labels[k], mods[i + k]) for k in range(0, n, 2)],
                      n % 2 == 0, lambda: (None, ""), seq, names[i:j + 1])
        for s, e in _split(problems, n):
            after = i + e  # element index after the sub-chain
            fate = (lambda after=after: an.elements_fate(
                seq, path, after, lambda: an.output_fate(seq), 0))
            sub = _sub_chain(full, s, e, fate)
            problem = run_problem(sub.items)
            if problem is not None:
                misses.append(Decision(path, tuple(sub.labels), "left alone", "", "", 0, 0, 0,
                                       problem))
                continue
            chains.append(sub)
        i = j + 1
    return chains


_TANH_FUNCTIONS = {torch.tanh: "torch.tanh", F.tanh: "F.tanh"}
_LINEAR_FUNCTIONS = (F.linear, torch._C._nn.linear)
_LINEAR_SIGNATURE = inspect.signature(lambda input, weight, bias=None: None)


def _linear_args(node: fx.Node):
    bound = _LINEAR_SIGNATURE.bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    return bound.arguments["input"], bound.arguments["weight"], bound.arguments["bias"]


def _node_kind(node: fx.Node, owner: nn.Module) -> Optional[str]:
    """'L' or 'T' for a linear / tanh node of any spelling, else None."""
    if node.op == "call_module":
        sub = owner.get_submodule(node.target)
        if isinstance(sub, nn.Linear):
            return "L"
        if isinstance(sub, nn.Tanh):
            return "T"
    elif node.op == "call_function":
        if node.target in _LINEAR_FUNCTIONS:
            try:
                _linear_args(node)
                return "L"
            except TypeError:
                return None
        if node.target in _TANH_FUNCTIONS:
            return "T"
    elif node.op == "call_method" and node.target == "tanh":
        return "T"
    return None


def _data_input(node: fx.Node) -> Any:
    """The node's tensor input if it takes exactly one data input the usual way, else None."""
    if node.op == "call_function" and node.target in _LINEAR_FUNCTIONS:
        x, w, b = _linear_args(node)
        return x if all(a is not x for a in (w, b)) else None
    if len(node.args) == 1 and not node.kwargs:
        return node.args[0]
    return None


def _node_label(node: fx.Node, owner_path: str) -> str:
    if node.op == "call_module":
        return _join(owner_path, node.target)
    if node.op == "call_method":
        return ".tanh()"
    if node.target in _LINEAR_FUNCTIONS:
        return "F.linear"
    return _TANH_FUNCTIONS[node.target]


def _graph_chains(an: _Model, path: str, owner: nn.Module, t: _Trace, rewrite: bool,
                  misses: List[Decision]) -> List[_Chain]:
    """Chains in one module's graph: each is 'children' (every item a swappable direct child) or
    'rewrite' (needs the forward rewritten; only kept when rewrite=True)."""
    graph = t.graph
    kind = {n: _node_kind(n, owner) for n in graph.nodes}

    def nxt(n: fx.Node) -> Optional[fx.Node]:
        users = list(n.users)
        if len(users) != 1:
            return None
        u = users[0]
        want = "T" if kind[n] == "L" else "L"
        return u if kind[u] == want and _data_input(u) is n else None

    has_prev = {nxt(n) for n in graph.nodes if kind[n] is not None} - {None}
    calls: Dict[str, int] = {}
    for n in graph.nodes:
        if n.op == "call_module":
            calls[n.target] = calls.get(n.target, 0) + 1
    other_uses = _uses_outside_forward(type(owner))

    def swap_problem(n: fx.Node) -> Optional[str]:
        label = _node_label(n, path)
        if n.op != "call_module":
            return (f"{label} is a function call: fusing it rewrites {path or '<model>'}.forward"
                    + ("" if rewrite else "; pass rewrite=True to allow that"))
        if "." in n.target:
            return f"{label} is not a direct child of {path or '<model>'}"
        sub = owner.get_submodule(n.target)
        if calls[n.target] != 1:
            return f"{label} is called {calls[n.target]} times"
        if len(an.slots[id(sub)]) != 1:  # held by another module too: it may be called there
            return f"{label} is also held elsewhere: {', '.join(an.paths[id(sub)][1:])}"
        if other_uses is None:
            return f"the source of {type(owner).__name__} is not available to check its methods"
        if n.target in other_uses:
            return f"{label} is also used by {type(owner).__name__}." \
                   f"{'/'.join(sorted(set(other_uses[n.target])))}()"
        return _linear_problem(sub) if kind[n] == "L" else _tanh_problem(sub)

    def rewrite_problem(n: fx.Node) -> Optional[str]:
        label = _node_label(n, path)
        if n.op == "call_module":
            sub = owner.get_submodule(n.target)
            return _linear_problem(sub) if kind[n] == "L" else _tanh_problem(sub)
        if kind[n] == "L":
            _, w, _ = _linear_args(n)
            if not (isinstance(w, fx.Node) and w.op == "get_attr"):
                return f"{label}'s weight is not an attribute of {path or '<model>'}"
            return _unsupported(_getattr_path(owner, w.target))
        return None

    def layer_of(n: fx.Node) -> Optional[_Layer]:
        if n.op == "call_module":
            return _layer(_node_label(n, path), owner.get_submodule(n.target))
        _, w, _ = _linear_args(n)
        if isinstance(w, fx.Node) and w.op == "get_attr":
            wt = _getattr_path(owner, w.target)
            return _Layer("F.linear", wt.shape[1], wt.shape[0], wt.element_size())
        return None

    chains = []
    for n in graph.nodes:
        if kind[n] == "L" and len(n.users) > 1 and any(kind[u] == "T" for u in n.users):
            misses.append(Decision(path, (_node_label(n, path),), "left alone", "", "", 0, 0, 0,
                                   f"its output has {len(n.users)} users, so it is kept for the "
                                   f"others anyway"))
        if kind[n] != "L" or n in has_prev or nxt(n) is None:
            continue
        items = [n]
        while nxt(items[-1]) is not None:
            items.append(nxt(items[-1]))
        labels = [_node_label(x, path) for x in items]
        swap = [swap_problem(x) for x in items]
        if all(p is None for p in swap):
            how, problems = "children", swap
        else:
            rw = [rewrite_problem(x) for x in items]
            if rewrite and all(p is None for p in rw):
                how, problems = "rewrite", rw
            else:
                how, problems = "children", swap
                _item_misses(path, labels, [p if (rw[k] is None or not rewrite) else rw[k]
                                            for k, p in enumerate(swap)], misses)
        layers = [layer_of(x) for x in items[0::2]]
        if any(lay is None for lay in layers):
            continue
        full = _Chain(path, how, labels, items, layers, len(items) % 2 == 0, lambda: (None, ""),
                      owner, [x.target if x.op == "call_module" else None for x in items])
        for s, e in _split(problems, len(items)):
            last = items[e - 1]
            sub = _sub_chain(full, s, e, lambda last=last: an.node_fate(owner, t, last))
            if how == "children":
                problem = run_problem([owner.get_submodule(x.target) for x in sub.items])
                if problem is not None:
                    misses.append(Decision(path, tuple(sub.labels), "left alone", "", "", 0, 0,
                                           0, problem))
                    continue
            chains.append(sub)
    return chains


# ------------------------------------------------------------------------------------------------
# Applying the units

def _apply_sequential(seq: nn.Sequential, units: List[_Unit]) -> None:
    runs = []
    for u in units:
        s, e = u.chain.span(u.a, u.b, u.last_tanh)
        runs.append(_PlannedRun(u.chain.names[s:e], u.chain.items[s:e], u.last_tanh))
    if type(seq) is nn.Sequential:
        seq.__class__ = FusedSequential  # a subclass: same object, elements and keys
    seq._ckpt_ext_runs = tuple(runs)


def _planned(seq: nn.Module) -> set:
    return {(r.names, r.modules, r.last_tanh) for r in getattr(seq, "_ckpt_ext_runs", ())}


def _apply_children(owner: nn.Module, u: _Unit) -> None:
    s, e = u.chain.span(u.a, u.b, u.last_tanh)
    names = u.chain.names[s:e]
    lins = [owner._modules[nm] for nm in names[0::2]]
    if u.a == u.b:
        owner._modules[names[0]] = FusedLinearTanh.from_linear(lins[0])
    else:
        owner._modules[names[0]] = FusedRunHead(lins[0], owner, names[2::2], u.last_tanh)
        for nm, lin in zip(names[2::2], lins[1:]):
            owner._modules[nm] = RunLayer(lin)
    for nm in names[1::2]:
        owner._modules[nm] = nn.Identity()


def _rewrite_source(owner: nn.Module, graph: fx.Graph, units: List[_Unit]) -> str:
    """Replace each unit's nodes by one fused call; return the source of the new forward."""
    for u in units:
        s, e = u.chain.span(u.a, u.b, u.last_tanh)
        nodes = u.chain.items[s:e]
        lins = nodes[0::2]
        x = _data_input(lins[0])
        with graph.inserting_before(nodes[-1]):  # after every weight's own get_attr
            ws, bs = [], []
            for n in lins:
                if n.op == "call_module":
                    sub = owner.get_submodule(n.target)
                    ws.append(graph.get_attr(f"{n.target}.weight"))
                    bs.append(graph.get_attr(f"{n.target}.bias") if sub.bias is not None else None)
                else:
                    _, w, b = _linear_args(n)
                    ws.append(w)
                    bs.append(b)
            if len(lins) == 1 and u.last_tanh:
                new = graph.call_function(linear_tanh, (x, ws[0], bs[0]))
            else:
                new = graph.call_function(tanh_mlp, (x, ws, bs, u.last_tanh))
        nodes[-1].replace_all_uses_with(new)
        for n in reversed(nodes):
            graph.erase_node(n)
    graph.lint()
    for n in graph.nodes:
        if n.op == "get_attr":
            _getattr_path(owner, n.target)  # AttributeError: a constant fx made on the copy
    from torch.fx.graph_module import _format_import_block
    from torch.package import sys_importer
    code = graph.python_code(root_module="self")
    return _format_import_block(code.globals, sys_importer) + "\n" + code.src


# ------------------------------------------------------------------------------------------------
# Entry point

def fuse(model: nn.Module, *, policy: str = "memory", rewrite: bool = False,
         dry_run: bool = False, trace: bool = True) -> Fused:
    """Fuse ``model``'s Linear/Tanh layers where that frees memory, in place; returns
    ``(model, report)`` with ``model`` the very object passed in.

    ``policy="memory"`` (default) fuses maximal runs, and lone pairs only where their output is not
    kept anyway; ``policy="all"`` fuses every pair on its own. ``rewrite=True`` also rewrites
    forward code (``F.linear``, ``torch.tanh``) of modules whose forward is safe to rewrite.
    ``dry_run=True`` changes nothing and reports what would be done. ``trace=False`` skips the fx
    analysis: only the insides of ``nn.Sequential`` are considered. ``print(report)`` shows every
    decision with the bytes it frees and the FLOPs it costs per row, every near miss and why, and
    every module whose forward was not used. See the module docstring for the full contract.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"ckpt_ext.fuse expects an nn.Module, got {type(model).__name__}")
    if policy not in POLICIES:
        raise ValueError(f"ckpt_ext.fuse: policy must be one of {', '.join(map(repr, POLICIES))},"
                         f" got {policy!r}")
    report = FuseReport(dry_run=dry_run, policy=policy, rewrite=rewrite)
    an = _Model(model, trace, report)

    # Plan everything on the unmodified model, then apply.
    seq_units: List[Tuple[nn.Module, List[_Unit]]] = []
    child_units: List[Tuple[nn.Module, _Unit]] = []
    rewrite_units: List[Tuple[str, nn.Module, _Trace, List[_Unit]]] = []
    for path, m in model.named_modules():
        misses: List[Decision] = []
        if _is_sequential(m):
            units: List[_Unit] = []
            for chain in _sequential_chains(an, path, m, misses):
                us, ms = _decide(chain, policy)
                units += us
                misses += ms
            keys = set()
            for u in units:
                s, e = u.chain.span(u.a, u.b, u.last_tanh)
                keys.add((tuple(u.chain.names[s:e]), tuple(u.chain.items[s:e]), u.last_tanh))
            done = _planned(m)
            if keys != done:  # a new plan (idempotence: the same plan is left as it is)
                seq_units.append((m, units))
            for u in units:
                report.decisions.append(_already(u.decision) if keys == done else u.decision)
        else:
            t = an.trace_of(m)
            if t is None or t.already_rewritten:
                continue
            rw: List[_Unit] = []
            for chain in _graph_chains(an, path, m, t, rewrite, misses):
                us, ms = _decide(chain, policy)
                misses += ms
                for u in us:
                    if chain.how == "rewrite":
                        rw.append(u)
                    else:
                        child_units.append((m, u))
                    report.decisions.append(u.decision)
            if rw:
                rewrite_units.append((path, m, t, rw))
        report.decisions += misses

    if not dry_run:
        for seq, units in seq_units:
            _apply_sequential(seq, units)
        for owner, u in child_units:
            _apply_children(owner, u)
    for path, m, t, units in rewrite_units:
        report.rewritten.append(path)
        if dry_run:
            continue
        try:
            source = _rewrite_source(m, t.graph, units)
        except Exception as e:  # refuse rather than guess: report and leave the forward alone
            report.rewritten.remove(path)
            report.not_analysed.append((path, f"forward not rewritten: {type(e).__name__}: {e}"))
            ids = {id(u.decision) for u in units}
            report.decisions = [d if id(d) not in ids else _refused(d, str(e))
                                for d in report.decisions]
            continue
        m.forward = _RewrittenForward(m, source)
    return Fused(model, report)


def _already(d: Decision) -> Decision:
    return Decision(d.where, d.layers, "already fused", d.unit, d.how, d.bytes_per_row,
                    d.flops_per_row, d.plain_flops_per_row, d.why)


def _refused(d: Decision, why: str) -> Decision:
    return Decision(d.where, d.layers, "left alone", "", "", d.bytes_per_row, d.flops_per_row,
                    d.plain_flops_per_row, f"the forward rewrite failed: {why}")
