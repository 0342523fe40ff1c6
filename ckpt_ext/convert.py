"""``ckpt_ext.fuse(model)``: make a model's Linear/Tanh layers recompute in backward — in place,
without changing what any caller of any of its modules gets, and only where that frees memory.
The contract, in full: ``docs/converter.md``.

What a caller may rely on
-------------------------
Every module of the model, called in any way (by the model's forward, on its own, from a method
or outside code, with hooks registered after fusing, under torch.compile, torch.func or
torch.utils.checkpoint), returns what the unfused model returns, with the same gradients. The model
is the object passed in; the classes of the user's own modules, their methods, hooks, attributes
and branches are unchanged; Linear, Tanh and Sequential objects stay the same objects (their class
may become a subclass), with the same parameters and ``state_dict`` keys.

Where a run is computed
-----------------------
* **nn.Sequential** (exactly that class, at any depth) holding a whole run, directly or in nested
  Sequentials: its class becomes :class:`FusedSequential`, whose forward computes each planned run
  with one fused op and every other element as nn.Sequential does. Nested Sequentials stay as they
  are.
* **a run through several calls of one forward** (child Linear/Tanh modules called one after the
  other, ``self.act(self.fc(x))``; a Sequential then the child its caller calls next,
  ``block1, block2, block3`` of the write-up's Net): the calls are the run's *members* — the Linear
  becomes :class:`RunLinear`, the Tanh :class:`RunTanh`, a Sequential :class:`FusedSequential` —
  and the calling module (the *owner*) gets a forward on its instance, :class:`_OwnerForward`, that
  marks a region for each call and runs the class's forward unchanged. Inside the region, in the
  analysed order, the first member computes the whole run and the later ones pass its output on;
  anywhere else each member computes its own output (see :class:`_Run`). A member replaced or
  given hooks after fusing makes the call compute member by member.
* **forward code** (``F.linear``, ``torch.tanh``, ``.tanh()``, a Linear in a ModuleList loop): only
  with ``rewrite=True``; the instance gets a forward generated from the fx graph of its class's
  forward, with the units replaced by the fused ops.

How the analysis avoids side effects, and what it relies on
-----------------------------------------------------------
fx runs a forward's Python code with placeholder values, on a deep copy whose parameters and
buffers are on the ``meta`` device (no memory), once in ``train()`` and once in ``eval()`` mode;
every attribute of the copy is compared before and after, and every instance attribute the forward
reads is recorded. A region, or a rewritten forward, is used at a call only while each attribute
read still has the value it had (:class:`_Guard`): otherwise that call runs the class's forward.
An attribute the forward only counts with (``self.nfe += 1``) is no obstacle; a forward that changes
other state, or reads a value fuse cannot check at each call, marks no region and is not
rewritten (its graph still says what each output's consumer keeps); a forward that changed any
attribute is not rewritten. A member must be called once, directly by the owner's forward (not
through a helper or torch.utils.checkpoint, which re-runs it alone), be held at one place and have
no hooks. A forward is not analysed at all when fx cannot trace it, its graphs differ between
train() and eval(), it takes optional or variadic arguments (fx would see one value of them), or
its ``forward`` was set on the instance by someone else; ``report.not_analysed`` lists each.

Which units fuse (``policy="memory"``, the default)
---------------------------------------------------
In ``Linear, Tanh, Linear, Tanh, ...`` every tanh output is also the next Linear's input, so
fusing one pair at a time frees nothing but costs a recompute. fuse therefore fuses **maximal
runs** — across containers, as above — as one ``tanh_mlp`` (the op ``FusedTanhMLP`` runs; it keeps
only the run's input); a run's trailing Tanh, and a lone ``Linear -> Tanh`` pair, are included
only where their output is not kept by its consumer anyway (a residual add, a ``.mean()`` loss,
the model's output — not a following Linear, LayerNorm, matmul, or a consumer the analysis cannot
see). ``policy="all"`` fuses every pair on its own.
The report gives, for every decision, the activation bytes per row it frees and the FLOPs per row
its recompute costs, and says why each near miss was left alone (a run that stops at a container
says which, and why). Running fuse twice with the same arguments changes nothing; with other
arguments it plans the model again.
"""
from __future__ import annotations

import copy
import dataclasses
import enum
import inspect
import operator
import os
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
import torch.nn.modules.module as _module_hooks  # the hooks registered for every module
from torch import fx, nn

from . import _C
from .modules import FusedLinearTanh, FusedTanhMLP, _has_hooks
from .ops import SUPPORTED_DTYPES, linear_tanh, tanh_mlp

__all__ = ["fuse", "Fused", "FuseReport", "Decision", "FusedSequential", "RunLinear",
           "RunTanh", "POLICIES"]

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
    #: (module path, why) for every module with a forward of its own (not torch.nn's) that fuse did
    #: not analyse: no run goes through its calls and its code is not rewritten.
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
# What fuse puts in place: runs, and where they are computed

class _Region(threading.local):
    """A run's region, per thread: [the next member, the tensor it must receive, the state of an
    enclosing call] inside its owner's forward; None outside it."""

    def __init__(self) -> None:
        self.state: Optional[list] = None


class _Run:
    """One run of Linear/Tanh layers as fuse applied it: the modules whose weights it reads, what
    must stay as it was for the fused op to compute it, and that op.

    Where the run is computed:

    * ``owner is None``: every layer lies in one ``nn.Sequential`` (directly, or in nested
      Sequentials it covers), and that Sequential's own forward computes the run (its
      :class:`FusedSequential` part). Called on its own, any nested Sequential computes its own
      elements.
    * otherwise the run's layers are reached through several calls that ``owner``'s forward makes
      one after the other (its *members*: child Linear/Tanh modules, child Sequentials). The
      owner's forward marks a *region* (:class:`_OwnerForward`) for the length of each call.
      Inside it the first member computes the whole run and each later member, called in turn
      with exactly the tensor the previous one returned, passes it on. Outside a region, or when
      anything the run relies on changed (a member replaced or given hooks, another dtype), every
      member computes its own output, unfused.

    The region's state is per thread and lives only for one call of the owner's forward; it holds
    the run's output between two members, a tensor the forward holds anyway."""

    def __init__(self, labels: Sequence[str], members: Sequence[nn.Module],
                 layers: Sequence[nn.Module], last_tanh: bool,
                 sequences: Sequence[Tuple[nn.Module, str]],
                 slots: Sequence[Tuple[nn.Module, str, nn.Module, str]],
                 unhooked: Sequence[Tuple[nn.Module, str]], owner: Optional[nn.Module],
                 calls: Sequence[str], elements: Sequence[Tuple[nn.Module, str]],
                 decision: Optional["Decision"] = None) -> None:
        self.labels = tuple(labels)        # the layers' paths in call order, for messages
        self.key = (tuple(members), bool(last_tanh))  # the Linear/Tanh modules fused (identity)
        self.layers = tuple(layers)        # its Linear modules, in order
        self.last_tanh = bool(last_tanh)
        # Sequentials whose elements must stay exactly these (name, module) pairs
        self.sequences = tuple((seq, label, tuple(seq._modules), tuple(seq._modules.values()))
                               for seq, label in sequences)
        self.slots = tuple(slots)          # (holder, name, module, label): children in place
        self.unhooked = tuple(unhooked)    # (module, label): hooks the fused op would skip
        self.owner = owner                 # the module whose forward marks the region, or None
        self.calls = tuple(calls)          # the members' labels in the owner's call order
        self.elements = tuple(elements)    # (Sequential, name) of its layers that are elements
        self.decision = decision           # what the report said when fuse applied it
        self._region = _Region()

    # -- pickling and copying: the region is per process and per call, never state to keep -----
    def __getstate__(self):
        state = dict(self.__dict__)
        del state["_region"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._region = _Region()

    def __deepcopy__(self, memo):
        new = _Run.__new__(_Run)
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return new

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
        if _module_hooks._global_forward_hooks or _module_hooks._global_forward_pre_hooks or \
                _module_hooks._global_backward_hooks or _module_hooks._global_backward_pre_hooks:
            return "hooks registered for every module, which the fused run would not call"
        w0 = self.layers[0].weight
        problem = _unsupported(w0)
        if problem is not None:
            return problem
        for layer in self.layers[1:]:
            if layer.weight.dtype != w0.dtype or layer.weight.device != w0.device:
                return "its layers' weights no longer share one dtype and device"
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights = [layer.weight for layer in self.layers]
        biases = [layer.bias for layer in self.layers]
        if len(weights) == 1 and self.last_tanh:
            return linear_tanh(x, weights[0], biases[0])  # a lone pair: the op a pair is
        # What FusedTanhMLP.forward runs: the stack op, keeping only x for backward.
        return tanh_mlp(x, weights, biases, self.last_tanh)

    # -- the region --------------------------------------------------------------------------
    def enter(self) -> None:
        self._region.state = [0, None, self._region.state]

    def leave(self, completed: bool) -> None:
        state = self._region.state
        self._region.state = state[2]
        if completed and 0 < state[0] < len(self.calls):
            raise RuntimeError(self._strayed(state[0], "the forward returned"))

    def turn(self, index: int, x: Any) -> Optional[list]:
        """The region's state if member ``index`` is to take its part in the run now (the first
        member: compute it; a later one: pass ``x`` on), else None: compute its own output."""
        state = self._region.state
        if state is None:
            return None
        expected = state[0]
        if expected == index and (index == 0 or x is state[1]):
            if index == 0 and self.problem() is not None:
                state[0] = -1  # computed member by member for the rest of this call
                return None
            return state
        if 0 < expected < len(self.calls):
            # The run was computed by its first member, but the forward did not go on as analysed
            # (a path fx did not see: it branched on state outside the module). Its output
            # already holds later layers: refuse to return it as anything else.
            raise RuntimeError(self._strayed(expected, f"{self.calls[index]} was called"))
        return None

    def _strayed(self, expected: int, event: str) -> str:
        owner = self.calls and (self.decision.where if self.decision else "") or ""
        return (f"ckpt_ext.fuse: the fused run {' -> '.join(self.labels)} was computed by "
                f"{self.calls[0]}, but {event} before {self.calls[expected]} received its output: "
                f"{owner or '<model>'}.forward took a path its analysis did not see (it depends on "
                f"state outside the module). Fuse an unfused copy of the model with trace=False, "
                f"or make that state an attribute of the module")


class _RunPart:
    """The consecutive elements ``names`` of one FusedSequential that a run covers, and what the
    Sequential does with them:

    * ``"whole"``: the Sequential holds the whole run (maybe in nested Sequentials) and computes
      it: the elements of nested Sequentials before the run's first layer (``before``), the run,
      then those after its last layer (``after``);
    * ``"first"``: member 0 of an owner's run: inside the owner's region, ``before``, then the run;
    * ``"on"``: a later member: inside the region, passes the run's output on, then ``after``.

    Outside a region (or when the run cannot be computed) the Sequential runs these elements one
    by one, as ``nn.Sequential`` does."""

    def __init__(self, run: _Run, names: Sequence[str], role: str, index: int,
                 before: Sequence[Tuple[nn.Module, Tuple[str, ...]]],
                 after: Sequence[Tuple[nn.Module, Tuple[str, ...]]]) -> None:
        self.run, self.names, self.role, self.index = run, tuple(names), role, index
        self.before, self.after = tuple(before), tuple(after)
        # "first"/"on": a run of the Sequential's own elements computed fused when this part is
        # not computed as the owner's run (called on its own, or the run falls back)
        self.alone: Optional["_RunPart"] = None

    @property
    def last_tanh(self) -> bool:
        return self.run.last_tanh

    @property
    def key(self) -> Tuple[Any, ...]:
        return (self.names, self.role, self.index, self.run.key)

    def compute(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The output of this part's elements computed as the run, or None to run them one by
        one."""
        run = self.run
        if self.role == "whole":
            if run.problem() is not None:
                return None
            return _elements(self.after, run(_elements(self.before, x)))
        state = run.turn(self.index, x)
        if state is None:
            return None
        if self.role == "first":
            x = run(_elements(self.before, x))
        state[0], state[1] = self.index + 1, x
        return _elements(self.after, x)

    def describe(self) -> str:
        span = f"{self.names[0]}..{self.names[-1]}" if len(self.names) > 1 else self.names[0]
        run = self.run
        if self.role == "whole":
            if not self.before and not self.after and run.elements and \
                    all(seq is run.elements[0][0] for seq, _ in run.elements):
                return span + (" (last tanh)" if self.last_tanh else "")
            return f"{span} (computes the run {run.labels[0]}..{run.labels[-1]})"
        where = f"inside {run.decision.where or '<model>'}.forward" if run.decision else \
            "inside its caller's forward"
        alone = "" if self.alone is None else \
            f"; otherwise {self.alone.names[0]}..{self.alone.names[-1]} as one run"
        if self.role == "first":
            return f"{span} (computes the run {run.labels[0]}..{run.labels[-1]} {where}{alone})"
        return f"{span} (passes the run from {run.labels[0]} on {where}{alone})"


def _elements(steps: Sequence[Tuple[nn.Module, Tuple[str, ...]]], x: torch.Tensor):
    for seq, names in steps:
        for name in names:
            x = seq._modules[name](x)
    return x


class FusedSequential(nn.Sequential):
    """An ``nn.Sequential`` whose planned runs of ``Linear, Tanh, Linear, ...`` elements each run
    through one fused op (``tanh_mlp``, or ``linear_tanh`` for a single pair).

    ``fuse`` sets this class on the user's own ``nn.Sequential`` objects: same object, same
    elements, same ``state_dict`` keys, same parameters. Only ``forward`` differs, and only for the
    planned runs, which it re-checks at every call: a run whose elements were replaced, reordered or
    given hooks since, or whose dtype the op does not support, runs element by element. Indexing
    returns the real elements; a slice is a new FusedSequential without a plan, so it runs unfused.

    A run that crosses into other containers is computed by the Sequential holding all of it, or,
    when the run goes from this Sequential to what its caller's forward calls next, only inside
    that forward (see :class:`_Run`): called on its own, this Sequential computes its own elements.
    """

    _ckpt_ext_runs: Tuple[_RunPart, ...] = ()

    def forward(self, input):
        parts = self._ckpt_ext_runs
        if not parts:
            return super().forward(input)
        starts = {part.names[0]: part for part in parts}
        alone = {p.alone.names[0]: p.alone for p in parts if p.alone is not None}
        items = list(self._modules.items())
        i = 0
        while i < len(items):
            for part in (starts.get(items[i][0]), alone.get(items[i][0])):
                if part is not None:
                    out = part.compute(input)
                    if out is not None:
                        input = out
                        i += len(part.names)
                        break
            else:
                input = items[i][1](input)
                i += 1
        return input

    def extra_repr(self) -> str:
        if not self._ckpt_ext_runs:
            return ""
        return "fused runs: " + ", ".join(p.describe() for p in self._ckpt_ext_runs)


class RunLinear(nn.Linear):
    """An ``nn.Linear`` that a module's forward calls as part of a fused run. ``fuse`` sets this
    class on the user's own Linear (same object, parameters and keys). Inside its owner's forward,
    in the analysed order, the first member computes the whole run and a later one passes the run's
    output on; called any other way it is exactly ``nn.Linear``."""

    _ckpt_ext_run: Optional[_Run] = None
    _ckpt_ext_index: int = 0

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        run = self._ckpt_ext_run
        state = run.turn(self._ckpt_ext_index, input) if run is not None else None
        if state is None:
            return super().forward(input)
        if self._ckpt_ext_index == 0:
            input = run(input)
        state[0], state[1] = self._ckpt_ext_index + 1, input
        return input

    def extra_repr(self) -> str:
        return super().extra_repr() + _member_repr(self)


class RunTanh(nn.Tanh):
    """An ``nn.Tanh`` that a module's forward calls as part of a fused run: inside its owner's
    forward, in the analysed order, it passes the run's output on; called any other way it is
    exactly ``nn.Tanh``."""

    _ckpt_ext_run: Optional[_Run] = None
    _ckpt_ext_index: int = 0

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        run = self._ckpt_ext_run
        state = run.turn(self._ckpt_ext_index, input) if run is not None else None
        if state is None:
            return super().forward(input)
        state[0], state[1] = self._ckpt_ext_index + 1, input
        return input

    def extra_repr(self) -> str:
        return _member_repr(self).lstrip(", ")


def _member_repr(m: nn.Module) -> str:
    run = getattr(m, "_ckpt_ext_run", None)
    if run is None:
        return ""
    what = "computes" if m._ckpt_ext_index == 0 else "passes on"
    return f", {what} the run {run.labels[0]}..{run.labels[-1]} inside its owner's forward"


_MEMBER_CLASSES = {nn.Linear: RunLinear, nn.Tanh: RunTanh, RunLinear: RunLinear,
                   RunTanh: RunTanh}


class _OwnerForward:
    """The forward ``fuse`` sets on one module instance (its class is untouched) when that module's
    forward calls the members of a run one after the other, or its code was rewritten
    (``rewrite=True``).

    At each call it first checks that every attribute the analysed forward read still has the value
    it had (``guards``): if one changed, the forward may take another path, so it runs the class's
    forward as it is, unfused. Otherwise it runs the rewritten code (or the class's forward) inside
    the region of each of its runs. It pickles and deep-copies by its source, as
    torch.fx.GraphModule does."""

    def __init__(self, owner: nn.Module, runs: Sequence[_Run] = (),
                 guards: Sequence["_Guard"] = (), source: Optional[str] = None) -> None:
        self.owner, self.runs, self.guards, self.source = owner, tuple(runs), tuple(guards), source
        self._fn = _compile_forward(source) if source is not None else None

    def __call__(self, *args, **kwargs):
        owner = self.owner
        for guard in self.guards:
            if not guard.holds(owner):
                return type(owner).forward(owner, *args, **kwargs)
        fn = self._fn if self._fn is not None else type(owner).forward
        runs = self.runs
        if not runs:
            return fn(owner, *args, **kwargs)
        for run in runs:
            run.enter()
        completed = False
        try:
            out = fn(owner, *args, **kwargs)
            completed = True
        finally:
            for run in runs:
                run.leave(completed)
        return out

    @property
    def __signature__(self) -> inspect.Signature:  # the class forward's, for libraries that look
        sig = inspect.signature(type(self.owner).forward)
        return sig.replace(parameters=list(sig.parameters.values())[1:])

    def __getstate__(self):
        return {"owner": self.owner, "runs": self.runs, "guards": self.guards,
                "source": self.source}

    def __setstate__(self, state):
        self.__init__(state["owner"], state["runs"], state["guards"], state["source"])

    def __deepcopy__(self, memo):
        new = _OwnerForward.__new__(_OwnerForward)
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return new


class _Guard(NamedTuple):
    """An attribute the analysed forward read, and the value it read: ``path`` is the module
    holding it, relative to the owner; ``same`` compares by identity (functions, classes), else
    by type and value."""
    path: str
    name: str
    value: Any
    same: bool

    def holds(self, owner: nn.Module) -> bool:
        obj = owner
        for part in self.path.split(".") if self.path else ():
            obj = obj._modules.get(part)
            if obj is None:
                return False
        v = getattr(obj, self.name, _MISSING)
        if self.same:
            return v is self.value
        return type(v) is type(self.value) and v == self.value

    def describe(self) -> str:
        return f"{_join(self.path, self.name)} = {self.value!r}"


_MISSING = object()


def _compile_forward(source: str) -> Callable:
    scope: Dict[str, Any] = {}
    exec(compile(source, "<ckpt_ext.fuse rewritten forward>", "exec", dont_inherit=True), scope)
    return scope["forward"]


_OUR_MODULES = (FusedLinearTanh, FusedTanhMLP, RunLinear, RunTanh)


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
    if type(lin) not in (nn.Linear, RunLinear):
        return f"{type(lin).__name__} subclasses nn.Linear; its forward may not be F.linear"
    if _has_hooks(lin):
        return "the Linear has hooks, which the fused op would not call"
    return _unsupported(lin.weight)


def _tanh_problem(act: nn.Module) -> Optional[str]:
    if type(act) not in (nn.Tanh, RunTanh):
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

_FX_DIR = os.path.dirname(fx.__file__)
_MODULE_FILE = inspect.getsourcefile(nn.Module)


class _LocalTracer(fx.Tracer):
    """Keeps every child opaque, and notes each child call that does not come straight from the
    traced forward's own code (through ``torch.utils.checkpoint``, a helper, a lambda): such a
    call may run again, on its own, outside that forward (checkpoint re-runs it in backward)."""

    def __init__(self, forward_code: Any) -> None:
        super().__init__()
        self.forward_code = forward_code
        self.indirect: Dict[str, str] = {}  # node name -> the function the call came from

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return True

    def call_module(self, m, forward, args, kwargs):
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename.startswith(_FX_DIR)
                                     or frame.f_code.co_filename == _MODULE_FILE):
            frame = frame.f_back
        out = super().call_module(m, forward, args, kwargs)
        if frame is not None and frame.f_code is not self.forward_code and \
                isinstance(out, fx.Proxy):
            code = frame.f_code
            module = frame.f_globals.get("__name__", "?")
            self.indirect[out.node.name] = f"{module}.{getattr(code, 'co_qualname', code.co_name)}"
        return out


@dataclass
class _Trace:
    ok: bool
    reason: str = ""
    graph: Optional[fx.Graph] = None
    already_rewritten: bool = False
    calls: Optional[Dict[str, int]] = None  # call_module counts per target, filled on first use
    indirect: Dict[str, str] = field(default_factory=dict)  # see _LocalTracer
    guards: Tuple["_Guard", ...] = ()
    # Why the forward may not mark a region (its children's run), or be rewritten; None if it may.
    region_problem: Optional[str] = None
    rewrite_problem: Optional[str] = None


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
        return int.__int__(v) if type(v) is _Counted else v
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


# -- what a forward reads: attributes of the traced copy, recorded while fx runs the forward ------

# nn.Module's own bookkeeping (hooks, the dicts of parameters and children, ``training``, which is
# checked by tracing in both modes) and fuse's: not state a forward branches on.
_MODULE_INTERNALS = frozenset(vars(nn.Module())) | {
    "forward", "_ckpt_ext_runs", "_ckpt_ext_run", "_ckpt_ext_index"}


class _Reads:
    """The attribute reads of one trace: {(id(module), name): (value, counted)}; None outside."""
    log: Optional[Dict[Tuple[int, str], Any]] = None
    observed: set = set()   # (id(module), name) of counters whose value the forward looked at


class _Counted(int):
    """An int attribute's value as the traced forward sees it: adding or subtracting a number gives
    another _Counted (``self.nfe += 1``); any other use — a comparison, a branch, an index, a
    product — marks the attribute as one the forward looks at, so its value is not just a count."""

    def __new__(cls, value: int, key: Tuple[int, str]):
        obj = super().__new__(cls, value)
        obj.key = key
        return obj

    def _count(self, other, op):
        if _Reads.log is None or isinstance(other, bool) or not isinstance(other, int):
            self._look()
            return op(int.__int__(self), other)
        return _Counted(op(int.__int__(self), int.__int__(other)), self.key)

    def _look(self):
        if _Reads.log is not None:
            _Reads.observed.add(self.key)

    def __add__(self, other):
        return self._count(other, operator.add)

    __radd__ = __add__

    def __sub__(self, other):
        return self._count(other, operator.sub)

    def __rsub__(self, other):
        return self._count(other, lambda a, b: b - a)

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (int, (int.__int__(self),))


def _looking(name: str):
    def method(self, *args):
        self._look()
        return getattr(int, name)(int.__int__(self), *(int.__int__(a) if type(a) is _Counted
                                                        else a for a in args))
    return method


for _name in ("__bool__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__",
              "__index__", "__int__", "__float__", "__complex__", "__str__", "__repr__",
              "__format__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__", "__floordiv__",
              "__rfloordiv__", "__mod__", "__rmod__", "__divmod__", "__rdivmod__", "__pow__",
              "__rpow__", "__neg__", "__pos__", "__abs__", "__invert__", "__and__", "__rand__",
              "__or__", "__ror__", "__xor__", "__rxor__", "__lshift__", "__rlshift__",
              "__rshift__", "__rrshift__", "__round__", "__trunc__", "__floor__", "__ceil__",
              "bit_length", "bit_count", "to_bytes", "conjugate", "as_integer_ratio",
              "is_integer"):
    if hasattr(int, _name):
        setattr(_Counted, _name, _looking(_name))


_RECORDING: Dict[type, type] = {}


def _recording_class(cls: type) -> type:
    """A subclass of ``cls`` that logs, while a trace runs, each attribute the forward reads that
    is state — of the instance, or a plain value of the user's class — (first value read), handing
    out int values as _Counted."""
    sub = _RECORDING.get(cls)
    if sub is not None:
        return sub

    def __getattribute__(self, name):
        value = super(sub, self).__getattribute__(name)
        log = _Reads.log
        if log is None or name in _MODULE_INTERNALS or name.startswith("__"):
            return value
        if name not in object.__getattribute__(self, "__dict__") and \
                not _class_value(cls, name):
            return value  # a method, a child, a parameter or a buffer, torch's own attributes
        key = (id(self), name)
        if type(value) is int:
            value = _Counted(value, key)
        log.setdefault(key, value)
        return value

    sub = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__,
                                      "__module__": cls.__module__,
                                      "__qualname__": cls.__qualname__})
    _RECORDING[cls] = sub
    return sub


def _class_value(cls: type, name: str) -> bool:
    """Whether ``name`` is a plain value that a class of the user's (not torch's) defines, such as
    a constant a forward branches on: read like an instance attribute, and set the same way."""
    for klass in cls.__mro__:
        if name in vars(klass):
            if klass.__module__.startswith("torch.") or klass is object:
                return False
            raw = vars(klass)[name]
            return not (inspect.isroutine(raw) or isinstance(raw, (staticmethod, classmethod))
                        or hasattr(type(raw), "__get__"))
    return False


def _record_reads(clone: nn.Module) -> Optional[str]:
    """Give every module of the analysis copy its recording class; why not, if it cannot."""
    for m in clone.modules():
        try:
            m.__class__ = _recording_class(type(m))
        except TypeError as e:
            return f"fuse cannot record what its forward reads ({type(e).__name__}: {e})"
    return None


def _guard_value(v: Any, depth: int = 0) -> Optional[bool]:
    """How a guard compares a value a forward read: False by value, True by identity, None when
    fuse cannot check it cheaply and exactly (a tensor, a module, an arbitrary object)."""
    if v is None or type(v) in (bool, int, float, complex, str, bytes, torch.dtype,
                                torch.device, _Counted):
        return False
    if isinstance(v, enum.Enum):
        return True
    if type(v) in (tuple, list, frozenset, set) and depth < 3:
        return False if all(_guard_value(x, depth + 1) is False for x in v) else None
    if type(v) is dict and depth < 3:
        return False if all(_guard_value(k, depth + 1) is False and
                            _guard_value(x, depth + 1) is False for k, x in v.items()) else None
    if inspect.isfunction(v) or inspect.isbuiltin(v) or isinstance(v, type):
        return True
    return None


def _plain(v: Any) -> Any:
    if type(v) is _Counted:
        return int.__int__(v)
    if type(v) in (tuple, list, set, frozenset):
        return type(v)(_plain(x) for x in v)
    if type(v) is dict:
        return {_plain(k): _plain(x) for k, x in v.items()}
    return v


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
    already = isinstance(fwd, _OwnerForward) and fwd.source is not None
    # A forward fuse set (a region, or code rewritten by an earlier fuse) came from its class's
    # forward, which fx traces: that graph still says what the code does with each value, but
    # nothing new is rewritten in it.
    if fwd is not None and not isinstance(fwd, _OwnerForward):
        return _Trace(False, "its forward is set on the instance (fx would trace its class's "
                             "forward, not what runs)")
    problem = _signature_problem(orig)
    if problem:
        return _Trace(False, problem)
    code = getattr(inspect.unwrap(type(orig).forward), "__code__", None)
    codes, graph, indirect = [], None, {}
    reads: Dict[Tuple[int, str], Any] = {}
    changed: set = set()
    _Reads.observed = set()
    for mode in (True, False):
        clone.train(mode)
        before = _snapshot(clone)
        tracer = _LocalTracer(code)
        _Reads.log = reads
        try:
            # Warnings raised while fx runs the forward on placeholders (torch.utils.checkpoint:
            # "None of the inputs have requires_grad=True") are about that run, not the model.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                g = tracer.trace(clone)
        except Exception as e:  # fx raises many types (TraceError, TypeError, ...)
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            return _Trace(False, f"torch.fx cannot trace it ({type(e).__name__}: {msg[:160]})")
        finally:
            _Reads.log = None
        after = _snapshot(clone)
        changed |= {(p, k) for (p, k) in set(before) | set(after)
                    if before.get((p, k)) != after.get((p, k))}
        codes.append(g.python_code(root_module="self").src)
        if graph is None:
            graph, indirect = g, tracer.indirect
    if codes[0] != codes[1]:
        return _Trace(False, "its forward runs different code in train() and eval() (it reads "
                             "self.training)")
    t = _Trace(True, "", graph, already_rewritten=already, indirect=indirect)
    # What the forward read, and what tracing changed: a region and a rewrite both rely on the
    # forward taking the path fx saw, so every attribute that could steer it is checked at call
    # time (a guard), and one that changes at every call must be a pure count.
    paths = {id(m): p for p, m in clone.named_modules()}
    changed_names = {_join(p, k) for p, k in changed}
    guards, unchecked, steering = [], [], []
    for (mid, name), value in reads.items():
        path = paths.get(mid)
        if path is None:
            continue
        label = _join(path, name)
        if label in changed_names:
            if type(value) is not _Counted or (mid, name) in _Reads.observed:
                steering.append(label)
            continue
        same = _guard_value(value)
        if same is None:
            unchecked.append(f"{label} ({type(value).__name__})")
        else:
            want = getattr(orig.get_submodule(path), name, _MISSING) if same else _plain(value)
            guards.append(_Guard(path, name, want, same))
    _Reads.observed = set()
    t.guards = tuple(guards)
    counted = sorted(changed_names - set(steering))
    if steering:
        t.region_problem = (f"tracing its forward changed {', '.join(sorted(steering))}, which it "
                            f"also reads other than to count: fuse cannot tell that its path "
                            f"does not depend on them")
    elif unchecked:
        t.region_problem = (f"its forward reads {', '.join(unchecked)}, a value fuse cannot check "
                            f"at each call")
    t.rewrite_problem = t.region_problem
    if changed_names and not t.rewrite_problem:
        t.rewrite_problem = (f"tracing its forward changed {', '.join(counted)}: a rewritten "
                             f"forward would not replay that statement")
    return t


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
_PASS_THROUGH_MODULES = (nn.Identity, nn.Flatten, nn.Unflatten)
# These save their output or a mask for backward, never their input.
_FREEING_MODULES = (nn.Dropout, nn.Tanh, nn.Sigmoid, nn.ReLU, nn.Softmax, nn.LogSoftmax)
_KEEPING_MODULES = (nn.Linear, nn.Bilinear, nn.LayerNorm, nn.GroupNorm, nn.GELU, nn.SiLU,
                    nn.MultiheadAttention, nn.modules.conv._ConvNd,
                    nn.modules.batchnorm._BatchNorm, FusedLinearTanh, FusedTanhMLP)


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
        unrecorded = _record_reads(clone)
        for path, m in wanted:
            t = _trace_module(clones[path], m)
            if t.ok and unrecorded:
                t.region_problem = t.rewrite_problem = unrecorded
            self.traces[id(m)] = t
            if not t.ok:
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
    """Why a run may not reach child ``target`` that ``owner``'s forward calls (as a member of a
    run computed inside that forward's region), else None."""
    calls = _call_counts(t).get(target, 0)
    if calls != 1:
        return f"{label} is called {calls} times"
    owner_label = an.path_of(owner) or "<model>"
    if t.region_problem is not None:
        return f"{owner_label} cannot mark the run's region: {t.region_problem}"
    node = next(n for n in t.graph.nodes if n.op == "call_module" and n.target == target)
    if node.name in t.indirect:
        return (f"{label} is called through {t.indirect[node.name]}, not by {owner_label}.forward "
                f"itself (it may run again on its own, as checkpoint does in backward)")
    if len(an.slots.get(id(sub), ())) != 1:  # held by another module too: it may be called there
        return f"{label} is also held elsewhere: {', '.join(an.paths[id(sub)][1:])}"
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
    # (Sequential, names, role, member index, elements before, elements after): see _RunPart
    parts: List[Tuple[nn.Module, Tuple[str, ...], str, int, tuple, tuple]] = \
        field(default_factory=list)
    members: List[Tuple[_Site, int]] = field(default_factory=list)  # child Linear/Tanh, index
    calls: List[str] = field(default_factory=list)  # the members, in the owner's call order
    sequences: List[nn.Module] = field(default_factory=list)  # must keep their elements
    slots: List[Tuple[nn.Module, str, nn.Module, str]] = field(default_factory=list)
    unhooked: List[nn.Module] = field(default_factory=list)
    owner: Optional[nn.Module] = None  # the module whose forward calls the members
    # per member Sequential: the run of its own elements it computes fused when called on its own
    alone: Dict[int, List[_Site]] = field(default_factory=dict)
    note: str = ""

    @property
    def key(self) -> Tuple[Any, ...]:
        return (tuple(s.module for s in self.sites), self.last_tanh)

    def part_keys(self) -> List[Tuple[nn.Module, Tuple[Any, ...]]]:
        return [(seq, (names, role, index, self.key))
                for seq, names, role, index, _, _ in self.parts]


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

    def __init__(self, an: "_Model", taken_nodes: set) -> None:
        self.an = an
        self.sites: List[_Site] = []
        self.at: Dict[Tuple[int, Any], _Site] = {}
        for path, m in an.model.named_modules():
            if _is_sequential(m):
                for i, (name, e) in enumerate(m._modules.items()):
                    kind = _module_kind(e)
                    if kind:
                        self._add((id(m), name), _Site(m, name, e, kind, _join(path, name), i))
                continue
            t = an.trace_of(m)
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

    def _below(self, upper: nn.Module, lower: nn.Module) -> str:
        """The name under which ``upper`` reaches ``lower`` ("2", or "blocks.0" through a
        ModuleList)."""
        up, low = self.an.path_of(upper), self.an.path_of(lower)
        return low[len(up) + 1:] if up else low

    def _descent(self, site: _Site, chain: List[nn.Module], lca: nn.Module):
        """[(container, name)] from the lca down to the site: each container on the way and the
        name of what it holds next."""
        ids = [id(c) for c in chain]
        path = chain[:ids.index(id(lca)) + 1][::-1]  # lca, ..., site.container
        steps = [(upper, self._below(upper, lower)) for upper, lower in zip(path, path[1:])]
        return steps + [(site.container, site.name)]

    def plan(self, sites: List[_Site], last_tanh: bool, policy: str) -> Optional[_Plan]:
        an = self.an
        chains, lca = self._ancestry(sites)
        if lca is None:
            return None
        inside: Dict[int, nn.Module] = {}  # containers below the lca that hold layers of the run
        for chain in chains:
            for c in chain:
                if c is lca:
                    break
                inside[id(c)] = c
        p = _Plan("", an.path_of(lca), sites, last_tanh)
        first = self._descent(sites[0], chains[0], lca)
        last = self._descent(sites[-1], chains[-1], lca)

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

        p.sequences = list(inside.values())
        p.unhooked = list(inside.values())
        if _is_sequential(lca):
            names = list(lca._modules)
            i0, i1 = names.index(first[0][1]), names.index(last[0][1])
            p.parts.append((lca, tuple(names[i0:i1 + 1]), "whole", 0, before(first[1:]),
                            after(last[1:])))
            p.how = "sequential" if len(first) == 1 and len(last) == 1 else "across"
            p.sequences.insert(0, lca)
            if p.how == "across":
                crossed = ", ".join(an.path_of(c) for c in inside.values())
                p.note = (f"it crosses {crossed} inside {p.where or '<model>'}, which computes the "
                          f"whole run; called on its own, each of them computes its own layers")
            return p
        # The calls the lca's forward makes, in order: child Linear/Tanh modules, or a child
        # Sequential the run goes through. Each becomes a member of the run.
        units: List[Any] = []
        for s, chain in zip(sites, chains):
            u = s if s.container is lca else chain[[id(c) for c in chain].index(id(lca)) - 1]
            if not units or units[-1] is not u:
                units.append(u)
        for k, u in enumerate(units):
            if isinstance(u, _Site):
                p.members.append((u, k))
                p.slots.append((lca, u.name, u.module, u.label))
                p.calls.append(u.label)
                continue
            holder, hpath, hname = an.parent[an.paths[id(u)][0]]
            p.slots.append((holder, hname, u, _join(hpath, hname)))
            p.calls.append(an.path_of(u))
            names = list(u._modules)
            if k == 0:
                p.parts.append((u, tuple(names[names.index(first[1][1]):]), "first", 0,
                                before(first[2:]), ()))
            elif k == len(units) - 1:
                p.parts.append((u, tuple(names[:names.index(last[1][1]) + 1]), "on", k, (),
                                after(last[2:])))
            else:
                p.parts.append((u, tuple(names), "on", k, (), ()))
            alone = _alone(u, sites) if policy == "memory" else None
            if alone:
                p.alone[id(u)] = alone
        p.how = "children" if all(isinstance(u, _Site) for u in units) else "across"
        p.owner = lca
        where = p.where or "<model>"
        if p.how == "across":
            p.note = (f"it crosses {', '.join(p.calls)} in {where}: inside {where}.forward, "
                      f"{p.calls[0]} computes the whole run and {', '.join(p.calls[1:])} "
                      f"pass{'es' if len(p.calls) == 2 else ''} its output on; called any other "
                      f"way, each computes its own layers")
            for sites_alone in p.alone.values():
                p.note += (f" ({sites_alone[0].label}..{sites_alone[-1].label} as one run of "
                           f"its own)")
        return p


def _alone(seq: nn.Module, sites: Sequence[_Site]) -> Optional[List[_Site]]:
    """The longest stretch of the run's layers that are consecutive elements of ``seq``, from a
    Linear to a Linear with at least two of them: a run seq computes fused when called on its own
    (its inner tanh outputs feed only its next Linear; where its output goes is not known there)."""
    best: List[_Site] = []
    stretch: List[_Site] = []
    for s in list(sites) + [None]:
        if s is not None and s.node is None and s.container is seq and \
                (not stretch or s.index == stretch[-1].index + 1):
            stretch.append(s)
            continue
        while stretch and stretch[0].kind != "L":
            stretch.pop(0)
        while stretch and stretch[-1].kind != "L":
            stretch.pop()
        if len(stretch) >= 3 and len(stretch) > len(best):
            best = stretch
        stretch = [s] if s is not None and s.node is None and s.container is seq else []
    return best or None


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

    def member_problem(n: fx.Node) -> Optional[str]:
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
        if t.rewrite_problem is not None:
            return f"{path or '<model>'}.forward cannot be rewritten: {t.rewrite_problem}"
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
        problems = [rw[k] if (rewrite and rw[k] is not None) else member_problem(x)
                    for k, x in enumerate(items)]
        in_pair = [only[k - k % 2] or (k - k % 2 + 1 < len(items) and only[k - k % 2 + 1])
                   for k in range(len(items))]
        _item_misses(path, labels, [p if in_pair[k] else None for k, p in enumerate(problems)],
                     misses)
    return chains


# ------------------------------------------------------------------------------------------------
# Applying the units

def _apply_plan(an: _Model, plan: _Plan, decision: Decision,
                run: Optional[_Run]) -> Tuple[_Run, list]:
    """Make the plan's run (or keep ``run``, the same run already in place), give its child
    Linear/Tanh members their member class; returns the run and its (Sequential, part)s."""
    sites = plan.sites
    if run is None:
        run = _Run(
            labels=[s.label for s in sites], members=[s.module for s in sites],
            layers=[s.module for s in sites[0::2]], last_tanh=plan.last_tanh,
            sequences=[(seq, an.path_of(seq)) for seq in plan.sequences], slots=plan.slots,
            unhooked=[(m, an.path_of(m)) for m in plan.unhooked] + [(s.module, s.label)
                                                                   for s in sites],
            owner=plan.owner, calls=plan.calls,
            elements=[(s.container, s.name) for s in sites if s.node is None], decision=decision)
    for site, k in plan.members:
        m = site.module
        m.__class__ = _MEMBER_CLASSES[type(m)]  # a subclass: same object, parameters and keys
        m._ckpt_ext_run, m._ckpt_ext_index = run, k
    parts = []
    for seq, names, role, index, before, after in plan.parts:
        part = _RunPart(run, names, role, index, before, after)
        alone = plan.alone.get(id(seq))
        if alone:
            part.alone = _RunPart(_Run(
                labels=[s.label for s in alone], members=[s.module for s in alone],
                layers=[s.module for s in alone[0::2]], last_tanh=False,
                sequences=[(seq, an.path_of(seq))], slots=(),
                unhooked=[(s.module, s.label) for s in alone], owner=None, calls=(),
                elements=[(seq, s.name) for s in alone]), [s.name for s in alone], "whole", 0,
                (), ())
        parts.append((seq, part))
    return run, parts


def _existing_runs(model: nn.Module) -> List[_Run]:
    """The runs an earlier fuse put in place, each once."""
    runs: Dict[int, _Run] = {}
    for m in model.modules():
        if isinstance(m, FusedSequential):
            for part in m._ckpt_ext_runs:
                runs.setdefault(id(part.run), part.run)
        elif type(m) in (RunLinear, RunTanh) and m._ckpt_ext_run is not None:
            runs.setdefault(id(m._ckpt_ext_run), m._ckpt_ext_run)
    return list(runs.values())


def _in_place(plan: _Plan, existing: Dict[Any, _Run]) -> Optional[_Run]:
    """The run an earlier fuse put in place for exactly this plan, if it is still whole."""
    run = existing.get(plan.key)
    if run is None or run.problem() is not None:
        return None
    for seq, key in plan.part_keys():
        if not any(p.key == key and p.run is run for p in _parts_of(seq)):
            return None
    for site, k in plan.members:
        m = site.module
        if getattr(m, "_ckpt_ext_run", None) is not run or m._ckpt_ext_index != k:
            return None
    if plan.owner is not None:
        fwd = vars(plan.owner).get("forward")
        if not isinstance(fwd, _OwnerForward) or run not in fwd.runs:
            return None
    return run


def _chain_problem(layers: Sequence[nn.Module]) -> Optional[str]:
    """None when the Linear layers of a run chain (widths) and share one dtype and device."""
    for i, (a, b) in enumerate(zip(layers, layers[1:]), start=1):
        if b.in_features != a.out_features:
            return (f"layer {i}: in_features {b.in_features} does not match the previous "
                    f"Linear's out_features {a.out_features}")
        if b.weight.dtype != a.weight.dtype or b.weight.device != a.weight.device:
            return (f"layer {i}: weight is {b.weight.dtype} on {b.weight.device}, the previous "
                    f"Linear's is {a.weight.dtype} on {a.weight.device}")
    return None


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
    disc = _Discovery(an, taken_nodes)
    existing = {r.key: r for r in _existing_runs(model)}
    paths, stops = disc.runs()
    planned: List[Tuple[_Plan, Decision, Optional[_Run]]] = []  # (plan, decision, in place)
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
            problem = _chain_problem([x.module for x in sub.items[0::2]])
            if problem is not None:
                found.append(Decision(sub.where, tuple(sub.labels), "left alone", "", "", 0, 0, 0,
                                      problem))
                continue
            us, ms = _decide(sub, policy)
            found += ms
            for u in us:
                a, b = sub.span(u.a, u.b, u.last_tanh)
                plan = disc.plan(sub.items[a:b], u.last_tanh, policy)
                d = u.decision
                if plan is None:  # no module calls them all: no region to compute it in
                    found.append(dataclasses.replace(
                        d, action="left alone", unit="", how="", bytes_per_row=0,
                        why="its layers share no container that calls them in sequence"))
                    continue
                d = dataclasses.replace(d, where=plan.where, how=plan.how,
                                        why=d.why + (f"; {plan.note}" if plan.note else ""))
                already = _in_place(plan, existing)
                planned.append((plan, d, already))
                found.append(_already(d) if already is not None else d)
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

    sources: Dict[int, str] = {}
    for path, m, t, units in rewrite_units:
        report.rewritten.append(path)
        if dry_run:
            continue
        try:
            sources[id(m)] = _rewrite_source(m, t.graph, units)
        except Exception as e:  # refuse rather than guess: report and leave the forward alone
            report.rewritten.remove(path)
            report.not_analysed.append((path, f"forward not rewritten: {type(e).__name__}: {e}"))
            ids = {id(u.decision) for u in units}
            for store in (units_at, misses_at):
                for key, ds in store.items():
                    store[key] = [d if id(d) not in ids else _refused(d, str(e)) for d in ds]
    if not dry_run:
        _apply(an, model, planned, sources)

    order = [path for path, _ in model.named_modules()]
    for path in order + sorted((set(units_at) | set(misses_at)) - set(order)):
        report.decisions += units_at.get(path, []) + misses_at.get(path, [])
    return Fused(model, report)


def _apply(an: _Model, model: nn.Module,
           planned: List[Tuple[_Plan, Decision, Optional[_Run]]], sources: Dict[int, str]) -> None:
    """Put the planned runs in place (keeping those already in place as they are), undo the runs
    of an earlier fuse that are no longer planned, and set each owner's forward."""
    parts: Dict[int, List[_RunPart]] = {}
    owner_runs: Dict[int, List[_Run]] = {}
    members = set()
    for plan, d, run in planned:
        run, plan_parts = _apply_plan(an, plan, d, run)
        for seq, part in plan_parts:
            parts.setdefault(id(seq), []).append(part)
        if plan.owner is not None:
            owner_runs.setdefault(id(plan.owner), []).append(run)
        members.update(id(site.module) for site, _ in plan.members)
    for m in model.modules():
        if type(m) in (RunLinear, RunTanh) and id(m) not in members:
            m.__class__ = nn.Linear if type(m) is RunLinear else nn.Tanh
            for name in ("_ckpt_ext_run", "_ckpt_ext_index"):
                vars(m).pop(name, None)
        if _is_sequential(m):
            _set_parts(m, parts.get(id(m), []))
        fwd = vars(m).get("forward")
        runs = tuple(owner_runs.get(id(m), ()))
        source = sources.get(id(m), fwd.source if isinstance(fwd, _OwnerForward) else None)
        if not runs and source is None:
            if isinstance(fwd, _OwnerForward):
                del vars(m)["forward"]
            continue
        t = an.trace_of(m)
        guards = t.guards if t is not None else fwd.guards
        if isinstance(fwd, _OwnerForward) and (fwd.runs, fwd.guards, fwd.source) == \
                (runs, tuple(guards), source):
            continue  # as it is: keep the very object
        m.forward = _OwnerForward(m, runs, guards, source)


def _already(d: Decision) -> Decision:
    return Decision(d.where, d.layers, "already fused", d.unit, d.how, d.bytes_per_row,
                    d.flops_per_row, d.plain_flops_per_row, d.why)


def _refused(d: Decision, why: str) -> Decision:
    return Decision(d.where, d.layers, "left alone", "", "", d.bytes_per_row, d.flops_per_row,
                    d.plain_flops_per_row, f"the forward rewrite failed: {why}")
