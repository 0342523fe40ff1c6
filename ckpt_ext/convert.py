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
* **runs across containers**: a run does not stop at a container's edge. It goes on from a
  Sequential's last element to what consumes the Sequential's output (the next element of the
  Sequential holding it, or the next child the calling forward passes it to), and into a nested or
  next Sequential: ``linear1, block1, block2, block3`` with ``block_i = Sequential(Linear, Tanh)``
  called in sequence is ONE run ``block1.0 .. block3.1``. A nested Sequential the run covers whole,
  inside a Sequential holding the whole run, is left as it is (the outer Sequential runs it).
  Otherwise the container holding the run's first layer computes the whole run, and the
  containers holding later layers pass the activation through them (Sequentials: a
  ``FusedSequential`` part that skips those elements; children: ``RunLayer`` / ``nn.Identity``).
  So, **called on its own**, such a container no longer computes only its own layers: ``block1(h)``
  returns the whole run's output and ``block2(h)`` returns ``h``. fuse makes them pass-throughs
  rather than raise because a container can only tell "called as part of the run" from "called on
  its own" by keeping state between calls (the head marking its output): that state would keep an
  activation alive (the memory fusing frees), would be Python state ``torch.compile`` has to guard
  and replay, and would have to survive ``torch.utils.checkpoint``, which re-runs one block's
  forward alone during backward (the write-up ``Net`` in checkpoint mode does exactly that; with
  pass-throughs it stays exact). The pass-through is also what a fused child already was
  (``RunLayer``, ``nn.Identity``). The report names these containers and what each returns alone
  (``dry_run=True`` shows it first); the modules inside them are untouched (``block2[0]`` is still
  the Linear and computes its layer).
  A run crosses into or out of a container only if that container has no hooks, is held at one
  place, and (when a forward calls it) is called once there and by no other method of the class.
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
runs** — across containers, as above — as one ``tanh_mlp`` (the op ``FusedTanhMLP`` runs; it keeps
only the run's input); a run's trailing Tanh, and a lone ``Linear -> Tanh`` pair, are included
only where their output is not kept by its consumer anyway (a residual add, a ``.mean()`` loss,
the model's output — not a following Linear, LayerNorm, matmul, or a consumer the analysis cannot
see). ``policy="all"`` fuses every pair on its own, as before.
The report gives, for every decision, the activation bytes per row it frees and the FLOPs per row
its recompute costs, and says why each near miss was left alone (a run that stops at a container
says which, and why). Running fuse twice with the same policy changes nothing; a run that replaced
children is kept as it is by a later fuse (with any policy), since its layers are no longer
Linear/Tanh modules to plan again.
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
import operator
import textwrap
import warnings
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

class _Run:
    """One run of Linear/Tanh layers as fuse applied it: the modules holding its layers' weights,
    what must stay as it was for the fused op to compute it, and that op.

    A run may lie inside one container (the elements of one ``nn.Sequential``, or children of one
    module) or cross several: Sequentials called one after another, nested, or a Sequential and
    the sibling children its caller calls next. Then the container holding the run's first layer
    computes the whole run, and those holding later layers pass the activation through (see
    :class:`FusedSequential`, :class:`FusedRunHead`, :class:`RunLayer`). Every one of them asks
    :meth:`problem` at each call; the answer depends only on the module structure (which elements
    and children sit where, hooks, dtypes), which does not change within a forward, so they agree
    on whether the run is computed fused, without any state carried from one call to the next."""

    def __init__(self, labels: Sequence[str], members: Sequence[nn.Module],
                 layers: Sequence[nn.Module], last_tanh: bool,
                 sequences: Sequence[Tuple[nn.Module, str]],
                 slots: Sequence[Tuple[nn.Module, str, nn.Module, str]],
                 unhooked: Sequence[Tuple[nn.Module, str]],
                 owners: Sequence[Tuple[nn.Module, str]], fallback: bool, local: bool,
                 elements: Sequence[Tuple[nn.Module, str]],
                 decision: Optional["Decision"] = None) -> None:
        self.labels = tuple(labels)        # the layers' paths in call order, for messages
        self.key = (tuple(members), bool(last_tanh))  # the Linear/Tanh modules fused (identity)
        self.layers = tuple(layers)        # per Linear: the module whose weight/bias it reads
        self.last_tanh = bool(last_tanh)
        # Sequentials whose elements must stay exactly these (name, module) pairs
        self.sequences = tuple((seq, label, tuple(seq._modules), tuple(seq._modules.values()))
                               for seq, label in sequences)
        self.slots = tuple(slots)          # (holder, name, module, label): children in place
        self.unhooked = tuple(unhooked)    # (module, label): hooks the fused op would skip
        # (module, label) whose forward calls the run's containers one after another; the forward
        # each had when fuse finished is set by fuse (a rewrite may set one in the same call).
        self.owners = tuple((m, label, vars(m).get("forward")) for m, label in owners)
        # True when every layer is still its own module (only Sequential elements), so that a
        # run that no longer matches can run element by element; False when fuse replaced
        # children by pass-throughs, which only the run computes.
        self.fallback = bool(fallback)
        self.local = bool(local)           # all its layers are elements of one Sequential
        self.elements = tuple(elements)    # (Sequential, name) of its layers that are elements
        self.decision = decision           # what the report said when fuse applied it

    def seal_owners(self) -> None:
        self.owners = tuple((m, label, vars(m).get("forward")) for m, label, _ in self.owners)

    def problem(self) -> Optional[str]:
        """None while the run can be computed fused, else what changed since fuse."""
        for seq, label, names, modules in self.sequences:
            if len(seq._modules) != len(names):
                return f"the elements of {label or '<model>'} changed"
            for (name, m), want_name, want in zip(seq._modules.items(), names, modules):
                if name != want_name or m is not want:
                    return f"{_join(label, want_name)} was replaced"
        for holder, name, want, label in self.slots:
            if holder._modules.get(name) is not want:
                return f"{label} was replaced"
        for m, label in self.unhooked:
            if _has_hooks(m):
                return f"{label or '<model>'} has hooks, which the fused run would not call"
        for m, label, forward in self.owners:
            if vars(m).get("forward") is not forward:
                return f"{label or '<model>'}.forward was replaced"
        w0 = self.layers[0].weight
        problem = _unsupported(w0)
        if problem is not None:
            return problem
        for layer in self.layers[1:]:
            if layer.weight.dtype != w0.dtype or layer.weight.device != w0.device:
                return "its layers' weights no longer share one dtype and device"
        return None

    def broken(self, problem: str) -> str:
        return (f"ckpt_ext.fuse: the fused run {' -> '.join(self.labels)} cannot be computed: "
                f"{problem}. fuse replaced some of its layers by pass-throughs (RunLayer, "
                f"nn.Identity) that only the run computes, so it cannot fall back to running "
                f"them one by one; undo the change, or fuse an unfused copy of the model")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights = [layer.weight for layer in self.layers]
        biases = [layer.bias for layer in self.layers]
        if len(weights) == 1 and self.last_tanh:
            return linear_tanh(x, weights[0], biases[0])  # a lone pair: the op a pair is
        # What FusedTanhMLP.forward runs: the stack op, keeping only x for backward.
        return tanh_mlp(x, weights, biases, self.last_tanh)


class _RunPart:
    """The consecutive elements of one FusedSequential that a run covers (Linear/Tanh elements,
    and nested Sequentials the run covers whole). The head part computes the whole run; any other
    part passes its input through, since the run was computed where it started."""

    def __init__(self, run: _Run, names: Sequence[str], head: bool) -> None:
        self.run, self.names, self.head = run, tuple(names), bool(head)

    @property
    def last_tanh(self) -> bool:
        return self.run.last_tanh

    @property
    def key(self) -> Tuple[Any, ...]:
        return (self.names, self.head, self.run.key)

    def describe(self) -> str:
        span = f"{self.names[0]}..{self.names[-1]}" if len(self.names) > 1 else self.names[0]
        if not self.head:
            return f"{span} (in the run from {self.run.labels[0]}: passes its input through)"
        if self.run.local:
            return span + (" (last tanh)" if self.last_tanh else "")
        return f"{span} (computes the run {self.run.labels[0]}..{self.run.labels[-1]})"


class FusedSequential(nn.Sequential):
    """An ``nn.Sequential`` whose planned runs of ``Linear, Tanh, Linear, ...`` elements each run
    through one fused op (``tanh_mlp``, or ``linear_tanh`` for a single pair).

    ``fuse`` sets this class on the user's own ``nn.Sequential`` objects: same object, same
    elements, same ``state_dict`` keys, same parameters. Only ``forward`` differs, and only for the
    planned runs, which it re-checks at every call: a run whose elements were replaced, reordered or
    given hooks since, or whose dtype the op does not support, runs element by element. Indexing
    returns the real elements; a slice is a new FusedSequential without a plan, so it runs unfused.

    A run that continues past this Sequential (into the next Sequential its caller calls, or out
    of a nested one) is computed whole where it starts; a Sequential it reaches later passes the
    activation through its elements of the run. Called on its own, such a Sequential therefore
    does not compute only its own layers: see ``fuse``'s documentation.
    """

    _ckpt_ext_runs: Tuple[_RunPart, ...] = ()

    def forward(self, input):
        parts = self._ckpt_ext_runs
        if not parts:
            return super().forward(input)
        starts = {part.names[0]: part for part in parts}
        items = list(self._modules.items())
        i = 0
        while i < len(items):
            part = starts.get(items[i][0])
            if part is not None:
                problem = part.run.problem()
                if problem is None:
                    if part.head:
                        input = part.run(input)
                    i += len(part.names)
                    continue
                if not part.run.fallback:
                    raise RuntimeError(part.run.broken(problem))
            input = items[i][1](input)
            i += 1
        return input

    def extra_repr(self) -> str:
        if not self._ckpt_ext_runs:
            return ""
        return "fused runs: " + ", ".join(p.describe() for p in self._ckpt_ext_runs)


class _LinearParams(nn.Module):
    """A Linear's ``weight`` and ``bias`` (the same Parameter objects, under the same names, so
    ``state_dict`` keys and an optimizer built before stay valid) and its sizes."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        if linear.bias is not None:
            self.bias = linear.bias
        else:
            self.register_parameter("bias", None)


class RunLayer(_LinearParams):
    """Holds a Linear's ``weight`` and ``bias`` (same Parameter objects, same names) for the run
    that computes its layer (started by a :class:`FusedRunHead` or a :class:`FusedSequential`);
    its own forward passes its input through."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None} (computed by its fused run)")


class FusedRunHead(_LinearParams):
    """The first Linear of a run ``Linear, Tanh, Linear, ...`` of a module's children that its
    forward calls in sequence (possibly continuing into a Sequential it calls next). It computes
    the whole run with ``tanh_mlp`` (keeping only the run's input) and holds the first layer's
    ``weight`` and ``bias``; the later layers' parameters stay in :class:`RunLayer` children (or
    Sequential elements) under their own names, read at every call (so
    ``load_state_dict(assign=True)`` and ``.to()`` are seen). If a layer of the run was replaced
    or given hooks since, it raises rather than compute without it."""

    def __init__(self, linear: nn.Linear, run: Optional[_Run] = None) -> None:
        super().__init__(linear)
        self._run = run  # a plain object (not a registered child), set by fuse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        run = self._run
        if run is None:
            raise RuntimeError("FusedRunHead computes a run that ckpt_ext.fuse planned; this one "
                               "was built without a run")
        problem = run.problem()
        if problem is not None:
            raise RuntimeError(run.broken(problem))
        return run(x)

    def extra_repr(self) -> str:
        run = self._run
        if run is None:
            return ""
        return f"runs {' -> '.join(run.labels)}, last_tanh={run.last_tanh}"


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
    calls: Optional[Dict[str, int]] = None  # call_module counts per target, filled on first use


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
            stars = "*" if p.kind == p.VAR_POSITIONAL else "**"
            return f"its forward takes {stars}{p.name}; fx would see only the traced arity"
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
            # Warnings raised while fx runs the forward on placeholders (torch.utils.checkpoint:
            # "None of the inputs have requires_grad=True") are about that run, not the model.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
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
    where: str                    # the module holding its items
    how: str                      # "rewrite", or "" for module calls (the plan says how)
    labels: List[str]             # one per item, in call order
    items: List[Any]              # _Site (module calls) or fx nodes (rewrite)
    layers: List[_Layer]          # one per Linear item
    ends_with_tanh: bool
    fate: Callable[[], Fate]      # what the consumer does with the chain's last output

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
                  chain.layers[s // 2:(e + 1) // 2], (e - s) % 2 == 0, fate)


def _layer(label: str, lin: nn.Linear) -> _Layer:
    return _Layer(label, lin.in_features, lin.out_features, lin.weight.element_size())


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


def _call_counts(t: _Trace) -> Dict[str, int]:
    """How many times the traced forward calls each submodule target."""
    if t.calls is None:
        t.calls = {}
        for n in t.graph.nodes:
            if n.op == "call_module":
                t.calls[n.target] = t.calls.get(n.target, 0) + 1
    return t.calls


def _child_problem(an: "_Model", owner: nn.Module, t: _Trace, target: str, label: str,
                   sub: nn.Module) -> Optional[str]:
    """Why fuse may not swap (or compute elsewhere) child ``target`` that ``owner``'s forward
    calls, else None."""
    calls = _call_counts(t).get(target, 0)
    if calls != 1:
        return f"{label} is called {calls} times"
    if len(an.slots.get(id(sub), ())) != 1:  # held by another module too: it may be called there
        return f"{label} is also held elsewhere: {', '.join(an.paths[id(sub)][1:])}"
    other_uses = _uses_outside_forward(type(owner))
    if other_uses is None:
        return f"the source of {type(owner).__name__} is not available to check its methods"
    name = target.split(".")[0]
    if name in other_uses:
        return (f"{label} is also used by {type(owner).__name__}."
                f"{'/'.join(sorted(set(other_uses[name])))}()")
    return None


def _module_kind(m: Optional[nn.Module]) -> Optional[str]:
    if isinstance(m, nn.Linear):
        return "L"
    if isinstance(m, nn.Tanh):
        return "T"
    return None


@dataclass(eq=False)
class _Site:
    """One call of a Linear or Tanh module: an element of a Sequential, or a direct child that an
    analysed forward calls (``node`` in its graph)."""
    container: nn.Module
    name: str
    module: nn.Module
    kind: str                         # "L" or "T"
    label: str
    index: int = -1                   # its index among the Sequential's elements
    node: Optional[fx.Node] = None
    trace: Optional[_Trace] = None


@dataclass
class _Plan:
    """How one unit is put in place (computed before anything changes, for the report too)."""
    how: str                          # "sequential", "children" or "across"
    where: str                        # the module holding every layer of the unit ("" = model)
    sites: List[_Site]
    last_tanh: bool
    parts: List[Tuple[nn.Module, Tuple[str, ...], bool]] = field(default_factory=list)
    swaps: List[Tuple[nn.Module, _Site, str]] = field(default_factory=list)  # (owner, site, role)
    sequences: List[nn.Module] = field(default_factory=list)  # must keep their elements
    slots: List[Tuple[nn.Module, str, nn.Module, str]] = field(default_factory=list)
    unhooked: List[nn.Module] = field(default_factory=list)
    owner: Optional[nn.Module] = None  # the module whose forward calls the containers
    note: str = ""

    def part_keys(self) -> List[Tuple[nn.Module, Tuple[Any, ...]]]:
        key = (tuple(s.module for s in self.sites), self.last_tanh)
        return [(seq, (names, head, key)) for seq, names, head in self.parts]


class _Discovery:
    """Runs of Linear/Tanh module calls that follow one another, across container boundaries.

    A value goes from one call to the next: between consecutive elements of a Sequential; from a
    Sequential's last element to what consumes the Sequential's output (the next element of the
    Sequential holding it, or the one call using it in the forward that calls it); into the first
    element of a Sequential it is passed to; and between children an analysed forward calls one
    after the other. A step counts only when the value has that single consumer. Crossing into or
    out of a Sequential needs that Sequential to have no hooks, to be held at one place and, when
    a forward calls it, to be called once there and by no other method of that class: otherwise
    the run stops there and the report says why."""

    def __init__(self, an: "_Model", taken_nodes: set, taken_elements: set) -> None:
        self.an = an
        self.sites: List[_Site] = []
        self.at: Dict[Tuple[int, Any], _Site] = {}
        for path, m in an.model.named_modules():
            if _is_sequential(m):
                for i, (name, e) in enumerate(m._modules.items()):
                    kind = _module_kind(e)
                    if kind and (id(m), name) not in taken_elements:
                        self._add((id(m), name), _Site(m, name, e, kind, _join(path, name), i))
                continue
            t = an.trace_of(m)
            if t is None or t.already_rewritten:  # nothing new is fused in a rewritten forward
                continue
            for node in t.graph.nodes:
                if node.op != "call_module" or "." in node.target or node in taken_nodes:
                    continue  # a Linear held in a list is only fused by a rewrite
                sub = m._modules.get(node.target)
                kind = _module_kind(sub)
                if kind:
                    self._add((id(m), node), _Site(m, node.target, sub, kind,
                                                   _join(path, node.target), node=node, trace=t))

    def _add(self, key: Tuple[int, Any], site: _Site) -> None:
        self.sites.append(site)
        self.at[key] = site

    # -- one step: the call that receives a site's output, and why it may not be followed --------
    def succ(self, s: _Site) -> Tuple[Optional[_Site], Optional[str]]:
        if s.node is None:
            return self._after_element(s.container, s.index, 0)
        return self._after_node(s.container, s.trace, s.node, 0)

    def _crossing_problem(self, seq: nn.Module) -> Optional[str]:
        places = self.an.paths.get(id(seq), [])
        label = places[0] if places else "<a Sequential>"
        if _has_hooks(seq):
            return f"{label} has hooks, which a run computed across it would not call"
        if len(places) != 1:
            return f"{label} is held at {len(places)} places ({', '.join(places)})"
        return None

    def _enter(self, seq: nn.Module, name: str, depth: int):
        site = self.at.get((id(seq), name))
        if site is not None:
            return site, None
        e = seq._modules[name]
        if _is_sequential(e) and depth < 64:
            return self._enter_seq(e, depth + 1)
        return None, None

    def _enter_seq(self, seq: nn.Module, depth: int):
        names = list(seq._modules)
        if not names:
            return None, None
        site, why = self._enter(seq, names[0], depth)
        if site is None:
            return None, None
        return site, self._crossing_problem(seq) or why

    def _after_element(self, seq: nn.Module, i: int, depth: int):
        names = list(seq._modules)
        if i + 1 < len(names):
            return self._enter(seq, names[i + 1], depth)
        return self._after_seq(seq, depth)

    def _after_seq(self, seq: nn.Module, depth: int):
        an = self.an
        places = an.paths.get(id(seq), [])
        if not places or places[0] not in an.parent or depth > 64:
            return None, None  # the model itself
        problem = self._crossing_problem(seq)
        parent, ppath, name = an.parent[places[0]]
        if _is_sequential(parent):
            site, why = self._after_element(parent, list(parent._modules).index(name), depth + 1)
            return site, problem or why
        target = name  # a Sequential held in a ModuleList/ModuleDict: called as "blocks.0"
        while isinstance(parent, (nn.ModuleList, nn.ModuleDict)) and ppath in an.parent:
            parent, ppath, holder = an.parent[ppath]
            target = f"{holder}.{target}"
        # A forward rewritten by an earlier fuse still calls its child Sequentials as its class
        # graph says (only function pairs became fused ops), so the run may go through it.
        t = an.trace_of(parent)
        if t is None:
            return None, None
        calls = [n for n in t.graph.nodes if n.op == "call_module" and n.target == target]
        if not calls:
            return None, None
        site, why = self._after_node(parent, t, calls[0], depth + 1)
        if site is None:
            return None, None
        return site, problem or _child_problem(an, parent, t, target, _join(ppath, target),
                                               seq) or why

    def _after_node(self, owner: nn.Module, t: _Trace, node: fx.Node, depth: int):
        users = list(node.users)
        if len(users) != 1:
            return None, None
        u = users[0]
        if u.op != "call_module" or len(u.args) != 1 or u.args[0] is not node or u.kwargs:
            return None, None
        site = self.at.get((id(owner), u))
        if site is not None:
            return site, None
        sub = owner.get_submodule(u.target)
        if not _is_sequential(sub) or depth > 64:
            return None, None
        site, why = self._enter_seq(sub, depth + 1)
        if site is None:
            return None, None
        label = _join(self.an.path_of(owner), u.target)
        return site, _child_problem(self.an, owner, t, u.target, label, sub) or why

    # -- the runs ---------------------------------------------------------------------------------
    def runs(self) -> Tuple[List[List[_Site]], Dict[_Site, str]]:
        """Maximal alternating paths Linear, Tanh, Linear, ... (from a Linear), and for a site
        whose next call would have continued the run, why that step was not taken."""
        links: Dict[_Site, _Site] = {}
        stops: Dict[_Site, str] = {}
        for s in self.sites:
            nxt, problem = self.succ(s)
            if nxt is None or nxt.kind == s.kind:
                continue
            if problem:
                stops[s] = problem
            else:
                links[s] = nxt
        has_prev = set(links.values())
        paths = []
        for s in self.sites:
            if s in has_prev:
                continue
            path, seen = [s], {s}
            while path[-1] in links and links[path[-1]] not in seen:
                path.append(links[path[-1]])
                seen.add(path[-1])
            while path and path[0].kind != "L":
                path.pop(0)
            if len(path) >= 2:
                paths.append(path)
        return paths, stops

    def problem(self, s: _Site) -> Optional[str]:
        if s.node is not None:
            p = _child_problem(self.an, s.container, s.trace, s.name, s.label, s.module)
            if p is not None:
                return p
        return _linear_problem(s.module) if s.kind == "L" else _tanh_problem(s.module)

    def fate(self, s: _Site) -> Fate:
        """What consumes the site's output."""
        an = self.an
        if s.node is None:
            seq = s.container
            return an.elements_fate(seq, an.path_of(seq), s.index + 1,
                                    lambda: an.output_fate(seq), 0)
        return an.node_fate(s.container, s.trace, s.node)

    # -- where a unit lives -----------------------------------------------------------------------
    def _call_parent(self, m: nn.Module) -> Optional[nn.Module]:
        an = self.an
        places = an.paths.get(id(m), [])
        if len(places) != 1 or places[0] not in an.parent:
            return None
        parent, ppath, _ = an.parent[places[0]]
        while isinstance(parent, (nn.ModuleList, nn.ModuleDict)) and ppath in an.parent:
            parent, ppath, _ = an.parent[ppath]
        return parent

    def _ancestry(self, sites: Sequence[_Site]):
        """Each site's containers from its own upward, and the lowest one they share."""
        chains = []
        for s in sites:
            chain = [s.container]
            while len(chain) < 256:
                p = self._call_parent(chain[-1])
                if p is None:
                    break
                chain.append(p)
            chains.append(chain)
        ids = [{id(c) for c in chain} for chain in chains]
        lca = next((c for c in chains[0] if all(id(c) in x for x in ids)), None)
        return chains, lca

    def where(self, sites: Sequence[_Site]) -> str:
        _, lca = self._ancestry(sites)
        return self.an.path_of(lca) if lca is not None else ""

    def plan(self, sites: List[_Site], last_tanh: bool) -> Optional[_Plan]:
        an = self.an
        chains, lca = self._ancestry(sites)
        if lca is None:
            return None
        member = {(id(s.container), s.name) for s in sites if s.node is None}
        inside: Dict[int, nn.Module] = {}  # Sequentials below the lca that hold layers of the run
        for chain in chains:
            for c in chain:
                if c is lca:
                    break
                inside[id(c)] = c
        whole_memo: Dict[int, bool] = {}

        def whole(seq: nn.Module) -> bool:  # every element of it belongs to the run
            if id(seq) not in whole_memo:
                whole_memo[id(seq)] = bool(seq._modules) and all(
                    (id(seq), n) in member or (id(e) in inside and whole(e))
                    for n, e in seq._modules.items())
            return whole_memo[id(seq)]

        first, first_ids = sites[0], {id(c) for c in chains[0]}
        p = _Plan("", an.path_of(lca), sites, last_tanh)
        cut: List[nn.Module] = []

        def holds_first(seq: nn.Module, names: Sequence[str]) -> bool:
            return any((first.node is None and first.container is seq and first.name == n)
                       or id(seq._modules[n]) in first_ids for n in names)

        def place(seq: nn.Module) -> None:
            """Parts for the run's consecutive elements of seq; recurse where it starts or ends
            inside an element."""
            seg: List[str] = []
            for n, e in seq._modules.items():
                if (id(seq), n) in member or (id(e) in inside and whole(e)):
                    seg.append(n)
                    continue
                if seg:
                    p.parts.append((seq, tuple(seg), holds_first(seq, seg)))
                    seg = []
                if id(e) in inside:
                    cut.append(e)
                    place(e)
            if seg:
                p.parts.append((seq, tuple(seg), holds_first(seq, seg)))

        if _is_sequential(lca):
            place(lca)
            p.how = "sequential" if len(p.parts) == 1 and not cut else "across"
            p.sequences = [lca] + list(inside.values())
        else:
            # The calls the lca's forward makes: child Linear/Tanh sites, or a child Sequential
            # the run goes through.
            units: List[Any] = []
            for s, chain in zip(sites, chains):
                u = s if s.container is lca else chain[[id(c) for c in chain].index(id(lca)) - 1]
                if not units or units[-1] is not u:
                    units.append(u)
            for u in units:
                if isinstance(u, _Site):
                    role = "head" if u is first else ("layer" if u.kind == "L" else "tanh")
                    p.swaps.append((lca, u, role))
                    continue
                holder, hpath, hname = an.parent[an.paths[id(u)][0]]
                p.slots.append((holder, hname, u, _join(hpath, hname)))
                if whole(u):
                    p.parts.append((u, tuple(u._modules), holds_first(u, tuple(u._modules))))
                else:
                    cut.append(u)
                    place(u)
            if all(isinstance(u, _Site) for u in units):
                p.how = "children"
                if len(sites) == 2:  # a lone pair: FusedLinearTanh + Identity
                    p.swaps[0] = (lca, sites[0], "pair")
            else:
                p.how = "across"
            p.sequences = list(inside.values())
            p.owner = lca
        p.unhooked = list(inside.values())
        if p.how == "across":
            p.note = self._note(p, lca, cut, chains)
        return p

    def _note(self, p: _Plan, lca: nn.Module, cut: List[nn.Module], chains: List[list]) -> str:
        """Which containers the run crosses, and what each does now when called on its own."""
        ids = [{id(c) for c in chain} for chain in chains]

        def order(m: nn.Module) -> int:  # the first layer of the run inside m
            return next(i for i, x in enumerate(ids) if id(m) in x)

        # (position, label, holds the run's start, passes every element through)
        changed: List[Tuple[int, str, bool, bool]] = []
        seen = set()
        for seq, names, head in p.parts:
            if seq is not lca:
                seen.add(id(seq))
                changed.append((order(seq), self.an.path_of(seq), head or id(seq) in ids[0],
                                not head and len(names) == len(seq._modules)))
        for seq in cut:
            if id(seq) not in seen:
                seen.add(id(seq))
                changed.append((order(seq), self.an.path_of(seq), id(seq) in ids[0], False))
        for _, s, role in p.swaps:
            changed.append((p.sites.index(s), s.label, role == "head", role != "head"))
        changed = [c[1:] for c in sorted(changed, key=lambda c: c[0])]
        heads = [c for c in changed if c[1]]
        others = [c for c in changed if not c[1]]
        where = p.where or "<model>"
        text = f"it crosses {', '.join(c[0] for c in changed)} in {where}: "
        parts = []
        if heads:
            parts.append(f"{' and '.join(c[0] for c in heads)} "
                         f"{'computes' if len(heads) == 1 else 'compute'} the whole run")
        if others:
            parts.append(f"{', '.join(c[0] for c in others)} pass"
                         f"{'es' if len(others) == 1 else ''} the activation through")
        text += " and ".join(parts)
        alone = []
        if heads:
            alone.append(f"{' and '.join(c[0] for c in heads)} "
                         f"return{'s' if len(heads) == 1 else ''} the run's output")
        if others:
            verb = ("return their input" if len(others) > 1 else "returns its input") \
                if all(c[2] for c in others) else \
                ("skip the run's layers" if len(others) > 1 else "skips the run's layers")
            alone.append(f"{', '.join(c[0] for c in others)} {verb}")
        return text + "; called on its own, " + ", and ".join(alone)


def _graph_chains(an: _Model, path: str, owner: nn.Module, t: _Trace, rewrite: bool,
                  misses: List[Decision], taken: set) -> List[_Chain]:
    """Chains in one module's graph that hold a function call (``F.linear``, ``torch.tanh``) or a
    Linear held in a list: fused only by rewriting the forward (``rewrite=True``). The nodes of a
    chain to rewrite go into ``taken``. Chains of direct child modules only are the discovery's."""
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

    def graph_only(n: fx.Node) -> bool:
        return n.op != "call_module" or "." in n.target

    def swap_problem(n: fx.Node) -> Optional[str]:
        label = _node_label(n, path)
        if n.op != "call_module":
            return (f"{label} is a function call: fusing it rewrites {path or '<model>'}.forward"
                    + ("" if rewrite else "; pass rewrite=True to allow that"))
        if "." in n.target:
            return f"{label} is not a direct child of {path or '<model>'}"
        sub = owner.get_submodule(n.target)
        problem = _child_problem(an, owner, t, n.target, label, sub)
        if problem is not None:
            return problem
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
        only = [graph_only(x) for x in items]
        if not any(only):
            continue
        labels = [_node_label(x, path) for x in items]
        rw = [rewrite_problem(x) for x in items]
        layers = [layer_of(x) for x in items[0::2]]
        if rewrite and all(p is None for p in rw) and all(lay is not None for lay in layers):
            last = items[-1]
            chains.append(_Chain(path, "rewrite", labels, items, layers, len(items) % 2 == 0,
                                 lambda last=last: an.node_fate(owner, t, last)))
            taken.update(x for x in items if x.op == "call_module")
            continue
        # Not rewritten: report the pairs that hold a function call or a Linear held in a list
        # (pairs of child modules are the discovery's, which reports their problems itself).
        problems = [rw[k] if (rewrite and rw[k] is not None) else swap_problem(x)
                    for k, x in enumerate(items)]
        in_pair = [only[k - k % 2] or (k - k % 2 + 1 < len(items) and only[k - k % 2 + 1])
                   for k in range(len(items))]
        _item_misses(path, labels, [p if in_pair[k] else None for k, p in enumerate(problems)],
                     misses)
    return chains


# ------------------------------------------------------------------------------------------------
# Applying the units

def _apply_plan(an: _Model, plan: _Plan, decision: Decision) -> Tuple[Optional[_Run], list]:
    """Swap the plan's children and make its run; returns the run and its (Sequential, part)s."""
    new: Dict[int, nn.Module] = {}
    heads = []
    for owner, site, role in plan.swaps:
        if role == "pair":
            m: nn.Module = FusedLinearTanh.from_linear(site.module)
        elif role == "head":
            m = FusedRunHead(site.module)
            heads.append(m)
        elif role == "layer":
            m = RunLayer(site.module)
        else:
            m = nn.Identity()
        owner._modules[site.name] = m
        new[id(site)] = m
    if plan.swaps and plan.swaps[0][2] == "pair":
        return None, []  # FusedLinearTanh computes the pair on its own
    sites = plan.sites
    run = _Run(
        labels=[s.label for s in sites], members=[s.module for s in sites],
        layers=[new.get(id(s), s.module) for s in sites[0::2]], last_tanh=plan.last_tanh,
        sequences=[(seq, an.path_of(seq)) for seq in plan.sequences],
        slots=list(plan.slots) + [(o, s.name, new[id(s)], s.label) for o, s, _ in plan.swaps],
        unhooked=[(m, an.path_of(m)) for m in plan.unhooked]
        + [(new.get(id(s), s.module), s.label) for s in sites],
        owners=[(plan.owner, an.path_of(plan.owner))] if plan.owner is not None else [],
        fallback=not plan.swaps, local=plan.how == "sequential",
        elements=[(s.container, s.name) for s in sites if s.node is None], decision=decision)
    for head in heads:
        head._run = run
    return run, [(seq, _RunPart(run, names, head)) for seq, names, head in plan.parts]


def _existing_runs(model: nn.Module) -> List[_Run]:
    """The runs an earlier fuse put in place, each once."""
    runs: Dict[int, _Run] = {}
    for m in model.modules():
        if isinstance(m, FusedSequential):
            for part in m._ckpt_ext_runs:
                runs.setdefault(id(part.run), part.run)
        elif isinstance(m, FusedRunHead) and m._run is not None:
            runs.setdefault(id(m._run), m._run)
    return list(runs.values())


def _parts_of(seq: nn.Module) -> Tuple[_RunPart, ...]:
    return seq._ckpt_ext_runs if isinstance(seq, FusedSequential) else ()


def _set_parts(seq: nn.Module, parts: List[_RunPart]) -> None:
    """Give seq exactly these parts (in element order); leave it as it is if it has them."""
    if [p.key for p in _parts_of(seq)] == [p.key for p in parts]:
        return
    if not parts and type(seq) is nn.Sequential:
        return
    order = {name: i for i, name in enumerate(seq._modules)}
    if type(seq) is nn.Sequential:
        seq.__class__ = FusedSequential  # a subclass: same object, elements and keys
    seq._ckpt_ext_runs = tuple(sorted(parts, key=lambda p: order.get(p.names[0], -1)))


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
    units_at: Dict[str, List[Decision]] = {}   # decisions by the module holding their layers
    misses_at: Dict[str, List[Decision]] = {}

    def add(store: Dict[str, List[Decision]], d: Decision) -> None:
        store.setdefault(d.where, []).append(d)

    # Runs an earlier fuse applied by replacing children (FusedRunHead, RunLayer, Identity): their
    # layers are no longer Linear/Tanh modules, so they are kept as they are (and reported), and
    # their Sequential elements are not planned again.
    kept_runs = [r for r in _existing_runs(model) if not r.fallback]
    taken_elements = {(id(seq), name) for r in kept_runs for seq, name in r.elements}
    for r in kept_runs:
        if r.decision is not None:
            problem = r.problem()
            if problem is None:
                add(units_at, _already(r.decision))
            else:
                add(misses_at, Decision(r.decision.where, r.decision.layers, "left alone", "", "",
                                        0, 0, 0, f"fused by an earlier fuse, but it cannot run "
                                                 f"fused any more: {problem}"))

    # Plan everything on the unmodified model, then apply.
    # 1. Forward code: chains that hold a function call, fused only by a rewrite.
    rewrite_units: List[Tuple[str, nn.Module, _Trace, List[_Unit]]] = []
    taken_nodes: set = set()
    for path, m in model.named_modules():
        t = an.trace_of(m) if not _is_sequential(m) else None
        if t is None or t.already_rewritten:
            continue
        misses: List[Decision] = []
        rw: List[_Unit] = []
        for chain in _graph_chains(an, path, m, t, rewrite, misses, taken_nodes):
            us, ms = _decide(chain, policy)
            misses += ms
            for u in us:
                rw.append(u)
                add(units_at, u.decision)
        for d in misses:
            add(misses_at, d)
        if rw:
            rewrite_units.append((path, m, t, rw))

    # 2. Runs of Linear/Tanh modules, inside a container or across several.
    disc = _Discovery(an, taken_nodes, taken_elements)
    paths, stops = disc.runs()
    planned: List[Tuple[_Plan, Decision, bool]] = []  # (plan, decision, already in place)
    for sites in paths:
        where = disc.where(sites)
        labels = [s.label for s in sites]
        problems = [disc.problem(s) for s in sites]
        found: List[Decision] = []
        _item_misses(where, labels, problems, found)
        full = _Chain(where, "", labels, sites, [_layer(s.label, s.module) for s in sites[0::2]],
                      len(sites) % 2 == 0, lambda: (None, ""))
        for s, e in _split(problems, len(sites)):
            last = sites[e - 1]
            sub = _sub_chain(full, s, e, lambda last=last: disc.fate(last))
            sub.where = disc.where(sub.items)
            problem = run_problem([x.module for x in sub.items])
            if problem is not None:
                found.append(Decision(sub.where, tuple(sub.labels), "left alone", "", "", 0, 0, 0,
                                      problem))
                continue
            us, ms = _decide(sub, policy)
            found += ms
            for u in us:
                a, b = sub.span(u.a, u.b, u.last_tanh)
                plan = disc.plan(sub.items[a:b], u.last_tanh)
                d = u.decision
                if plan is None:  # no module holds them all: nothing to swap safely
                    found.append(dataclasses.replace(
                        d, action="left alone", unit="", how="", bytes_per_row=0,
                        why="its layers share no container that calls them in sequence"))
                    continue
                d = dataclasses.replace(d, where=plan.where, how=plan.how,
                                        why=d.why + (f"; {plan.note}" if plan.note else ""))
                already = not plan.swaps and all(
                    any(p.key == key for p in _parts_of(seq)) for seq, key in plan.part_keys())
                planned.append((plan, d, already))
                found.append(_already(d) if already else d)
        stop = stops.get(sites[-1])
        position = {label: i for i, label in enumerate(labels)}
        found.sort(key=lambda d: position.get(d.layers[0], len(labels)))  # in call order
        by_label = {s.label: s for s in sites}
        for d in found:
            if d.action == "left alone":  # placed at the module holding its own layers
                d = dataclasses.replace(d, where=disc.where([by_label[x] for x in d.layers]))
            if stop and sites[-1].label in d.layers:
                d = dataclasses.replace(
                    d, why=f"{d.why}; the run stops after {sites[-1].label}: {stop}")
            add(units_at if d.action != "left alone" else misses_at, d)

    if not dry_run:
        # Each Sequential gets the parts of the runs planned now, plus those of kept runs.
        desired: Dict[int, List[_RunPart]] = {}

        def parts_for(seq: nn.Module) -> List[_RunPart]:
            if id(seq) not in desired:
                desired[id(seq)] = [p for p in _parts_of(seq) if not p.run.fallback]
            return desired[id(seq)]

        for plan, d, already in planned:
            if already:  # the same run is in place: keep its very objects
                for seq, key in plan.part_keys():
                    parts_for(seq).append(next(p for p in _parts_of(seq) if p.key == key))
                continue
            _, parts = _apply_plan(an, plan, d)
            for seq, part in parts:
                parts_for(seq).append(part)
        for _, m in model.named_modules():
            if _is_sequential(m):
                _set_parts(m, parts_for(m))

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
            for store in (units_at, misses_at):
                for key, ds in store.items():
                    store[key] = [d if id(d) not in ids else _refused(d, str(e)) for d in ds]
            continue
        m.forward = _RewrittenForward(m, source)
    if not dry_run:
        for run in _existing_runs(model):  # the forwards that call its containers, as now set
            run.seal_owners()

    order = [path for path, _ in model.named_modules()]
    for path in order + sorted((set(units_at) | set(misses_at)) - set(order)):
        report.decisions += units_at.get(path, []) + misses_at.get(path, [])
    return Fused(model, report)


def _already(d: Decision) -> Decision:
    return Decision(d.where, d.layers, "already fused", d.unit, d.how, d.bytes_per_row,
                    d.flops_per_row, d.plain_flops_per_row, d.why)


def _refused(d: Decision, why: str) -> Decision:
    return Decision(d.where, d.layers, "left alone", "", "", d.bytes_per_row, d.flops_per_row,
                    d.plain_flops_per_row, f"the forward rewrite failed: {why}")
