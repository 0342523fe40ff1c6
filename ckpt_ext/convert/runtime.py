"""What ``fuse`` leaves inside users' models that the kinds share (runs, their parts and members,
owners' forwards), and so in their pickles, which name these classes, and those in a kind's own
file, at ``ckpt_ext.convert.runtime``. Design: docs/converter.md, "Where a run is computed"."""
from __future__ import annotations

import copyreg
import enum
import importlib
import inspect
import sys
import threading
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from .. import ops
from ..modules import LayerActivations, as_mlp_argument, each_layer
from .. import _dropout_autograd as dropout_unit
from .._recompute import recomputed_modules
from .linears import class_form
from .facts import (GLOBAL, computes, elements, mask_inside, masks_drawable, no_hooks,
                    own_forward, SetByFuse, base_type, join_path, layer_forward, of_weights,
                    op_terms, passes_through)
from .fallback import Checked, by_state, count_fused, count_unfused, counting, outside_region

#: what fuse leaves in models and another file holds (a kind's, its file), by the names pickles use
_ELSEWHERE = {"_GatedRun": "gated", "_InlineRun": "inline", "InlineDrop": "inline",
              "_ExpertsRun": "moe", "RunExperts": "moe", "ExpertsForm": "moe",
              "_ArgGuard": "arguments", "Slot": "facts"}


def __getattr__(name: str) -> Any:
    if name in _ELSEWHERE:
        return getattr(importlib.import_module(f"{__package__}.{_ELSEWHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Region(threading.local):
    """A run's region, per thread: [the next member, the tensor it must receive, the state of an
    enclosing call, the refusal or (a _PlaceholderRun's) the op's output until returned]; None
    outside the owner's forward. Set in __init__ (per thread), so the instance dict torch.compile
    guards on holds it from the first call."""

    def __init__(self) -> None:
        self.state: Optional[list] = None


#: a region's first field while its owner computes the class's forward (_OwnerForward refused)
_REFUSED = -2


class _Run(Checked):
    """One run of Linear/activation layers, computed by the Sequential holding it (``owner`` None)
    or in the region its owner's forward marks, in which each member takes its part (:meth:`take`):
    the first computes the run, each later one passes its output on."""

    activation = "tanh"  # what a run pickled without one computes
    passes: Tuple[Tuple[nn.Module, str, int], ...] = ()

    def __init__(self, labels, members, layers, last_activation: bool, sequences, slots, unhooked,
                 owner: Optional[nn.Module], calls, elements, decision=None,
                 activation: LayerActivations = "tanh", passes=()) -> None:
        self.labels = tuple(labels)        # the layers' paths in call order
        self.key = (tuple(members), bool(last_activation))  # the modules fused (identity)
        self.layers = tuple(layers)        # its Linear modules, in order
        self.activation = activation       # a name, or a tuple of one per activated layer
        self.last_activation = bool(last_activation)
        # (Sequential, label): Sequentials whose elements must stay exactly these (name, module)
        self.sequences = tuple((seq, label, tuple(seq._modules), tuple(seq._modules.values()))
                               for seq, label in sequences)
        self.slots = tuple(slots)          # Slots: members that must stay where they are held
        self.unhooked = tuple(unhooked)    # (module, label): hooks the fused op would skip
        self.owner = owner                 # the module whose forward marks the region, or None
        self.calls = tuple(calls)          # the members' labels in the owner's call order
        self.elements = tuple(elements)    # (Sequential, name) of its layers that are elements
        self.decision = decision           # the report.Decision fuse applied it by
        self.passes = tuple(passes)  # (module, label, k): Identity/Dropout modules after item k
        self._region = _Region()

    def _conditions(self):
        yield from GLOBAL
        yield from (own_forward(m, label) for m, label in zip(self.key[0], self.labels))
        yield from self._placement()
        yield from map(computes, self.key[0][1::2], self.labels[1::2], self.activations)
        for m, label, k in self.passes:
            yield from (own_forward(m, label), no_hooks(m, label), mask_inside(m, label, k))
        yield masks_drawable(self)
        yield from of_weights(self.layers, self.labels[0::2])

    def _placement(self):
        for seq, label, names, modules in self.sequences:
            yield from (own_forward(seq, label or "<model>"), elements(seq, label, names, modules))
        yield from self.slots
        for m, label in self.unhooked:
            yield no_hooks(m, label or "<model>", "which the fused run would not call")

    def __getstate__(self):  # nor the region (per process and call)
        state = super().__getstate__()
        del state["_region"]
        return state

    def missed(self, extra: bool) -> None:
        """Count a call of the first member that computed the run unfused without a condition
        failing (those are counted where they fail): the reason the region was not marked."""
        state = self._region.state
        if state is None:
            if self.owner is not None:
                count_unfused(self, *outside_region(self))
        elif state[0] == _REFUSED:
            state[0] = -1
            count_unfused(self, *state[3])
        elif state[0] == 0 and extra:
            count_unfused(self, f"{self.calls[0]} was called with arguments beyond its input, "
                                f"which the fused op does not take")

    def __setstate__(self, state):
        if "last_tanh" in state:  # a state that names it last_tanh holds a tanh run
            state["last_activation"] = state.pop("last_tanh")
        super().__setstate__(state)
        self._region = _Region()

    @property
    def activations(self) -> Tuple[str, ...]:
        return each_layer(self.activation, len(self.layers) - (not self.last_activation))

    #: what its first, a middle and its last member do in its owner's forward
    _parts = ("computes the run", "passes on the run", "passes on the run")

    def describe(self, index: int) -> str:
        part = self._parts[0 if index == 0 else 2 if index == len(self.calls) - 1 else 1]
        return f"{part} {self.labels[0]}..{self.labels[-1]} inside its owner's forward"

    def masks(self) -> Dict[int, Tuple[float, ...]]:
        """The p of each Dropout drawing a mask at this call, by the item it follows."""
        out: Dict[int, Tuple[float, ...]] = {}
        for k, p in self._drawing():
            out[k] = out.get(k, ()) + (p,)
        return out

    def _drawing(self):
        """(item, p) of each Dropout drawing a mask at this call."""
        return ((k, m.p) for m, _, k in self.passes if not passes_through(m))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        count_fused(self)
        terms, masks = [op_terms(lin) for lin in self.layers], self.masks()
        if _through_modules(terms, bool(masks)):
            return recomputed_modules(lambda h: dropout_unit.chain(
                [layer_forward(lin) for lin in self.layers], self.activations, masks, h),
                x, _trained(self.layers))
        weights, biases, loras = map(list, zip(*terms))
        _as_layer_would(x, self.layers[0], weights[0])
        if masks:
            return dropout_unit.plain(x, weights, biases, self.activations, masks)
        return ops.mlp(x, weights, biases, activation=as_mlp_argument(self.activation),
                       last_activation=self.last_activation,
                       lora=loras if any(t is not None for t in loras) else None)

    def enter(self, refusal: Optional[Tuple[str, Optional[str]]] = None) -> None:
        """Mark the region of one owner's call; ``refusal`` (reason, fix): the owner computes
        its class's forward, and the run's first member counts the call unfused."""
        self._region.state = [0 if refusal is None else _REFUSED, None, self._region.state,
                              refusal]

    def leave(self, completed: bool) -> None:
        state = self._region.state
        self._region.state = state[2]
        if completed and 0 < state[0] < len(self.calls):
            raise RuntimeError(self._strayed(state[0], "the forward returned"))

    def take(self, index: int, x: Any, before=()) -> Optional[torch.Tensor]:
        """What member ``index`` returns when it takes its part in the run here, else None;
        ``before``: elements a Sequential's first part computes ahead of the run."""
        state = self._region.state
        if state is None:
            return None
        expected = state[0]
        if expected == index and (index == 0 or self._receives(index, x, state[1])):
            if index == 0 and self.refused():
                state[0] = -1  # computed member by member for the rest of this call
                return None
            state[0] = index + 1
            return self._step(index, x, state, before)
        if 0 < expected < len(self.calls):
            # computed by its first member, but the forward took a path fx did not see: the
            # output holds later layers, so it is returned as nothing else
            other = self._another if expected == index else ""
            raise RuntimeError(self._strayed(expected, f"{self.calls[index]} was called{other}"))
        return None

    _another = ""  # what the error says of a member called in its turn on another value

    def _receives(self, index: int, x: Any, carried: Any) -> bool:
        return x is carried

    def _step(self, index: int, x: Any, state: list, before) -> Any:
        state[1] = self(_elements(before, x)) if index == 0 else x
        return state[1]

    def _strayed(self, expected: int, event: str) -> str:
        owner = self.calls and (self.decision.where if self.decision else "") or ""
        return (f"ckpt_ext.fuse: the fused run {' -> '.join(self.labels)} was computed by "
                f"{self.calls[0]}, but {event} before {self.calls[expected]} received its output: "
                f"{owner or '<model>'}.forward took a path its analysis did not see (it depends on "
                f"state outside the module). Fuse an unfused copy of the model with trace=False, "
                f"or make that state an attribute of the module")


def _through_modules(terms: Sequence[Optional[tuple]], masks: bool) -> bool:
    """Whether a unit is computed through its Linears' own forwards (recomputed_modules) rather
    than the ops: a Linear only its forward computes (a 4-bit base), or a LoRA term with Dropouts
    of the unit drawing masks or of another dtype than its base weight (peft casts the input)."""
    if any(t is None for t in terms):
        return True
    loras = [(t[0], t[2]) for t in terms if t[2] is not None]
    return bool(loras) and (masks or any(t.A.dtype != w.dtype for w, t in loras))


def _trained(layers: Sequence[nn.Module]) -> list:
    """The parameters of ``layers`` that require grad, each once."""
    return list({id(p): p for m in layers for p in m.parameters() if p.requires_grad}.values())


def _as_layer_would(x: Any, layer: nn.Module, weight: torch.Tensor) -> None:
    """Input the first Linear would refuse raises its error, not the op's (naming its arguments)."""
    if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[-1] == weight.shape[1] and \
            x.device == weight.device and (x.dtype == weight.dtype or
                                           torch.is_autocast_enabled(x.device.type)):
        return
    base_type(layer).forward(layer, x)  # raises; if not, the op decides


class PartRole(str, enum.Enum):
    """What a FusedSequential does with the elements of a run it covers."""
    WHOLE = "whole"  # it computes the whole run: ``before`` (of nested Sequentials), it, ``after``
    FIRST = "first"  # member 0 of an owner's run: inside the region, ``before``, then the run
    ON = "on"        # a later member: inside the region, passes the run on, then ``after``


class _RunPart:
    """The elements ``names`` of a FusedSequential a run covers; ``alone``: what a FIRST/ON part
    computes fused outside the owner's run."""

    def __init__(self, run: _Run, names, role: PartRole, index: int, before, after) -> None:
        self.run, self.names, self.role, self.index = run, tuple(names), role, index
        self.before, self.after = tuple(before), tuple(after)
        self.alone: Optional["_RunPart"] = None

    @property
    def last_tanh(self) -> bool:
        return self.run.last_activation and self.run.activation == "tanh"

    @property
    def key(self) -> Tuple[Any, ...]:
        return (self.names, self.role, self.index, self.run.key)

    def compute(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The output of this part's elements computed as the run, or None to run them."""
        run = self.run
        if self.role != PartRole.WHOLE:
            out = run.take(self.index, x, self.before)
        else:
            out = None if run.refused() else run(_elements(self.before, x))
        return None if out is None else _elements(self.after, out)

    def describe(self) -> str:
        span = f"{self.names[0]}..{self.names[-1]}" if len(self.names) > 1 else self.names[0]
        run = self.run
        whole = f"the run {run.labels[0]}..{run.labels[-1]}"
        if self.role == PartRole.WHOLE:
            if not self.before and not self.after and run.elements and \
                    all(seq is run.elements[0][0] for seq, _ in run.elements):
                return span + (f" (last {run.activations[-1]})" if run.last_activation else "")
            return f"{span} (computes {whole})"
        where = f"inside {run.decision.where or '<model>'}.forward" if run.decision else \
            "inside its caller's forward"
        alone = "" if self.alone is None else \
            f"; otherwise {self.alone.names[0]}..{self.alone.names[-1]} as one run"
        if self.role == PartRole.FIRST:
            return f"{span} (computes {whole} {where}{alone})"
        return f"{span} (passes the run from {run.labels[0]} on {where}{alone})"


def _elements(steps: Sequence[Tuple[nn.Module, Tuple[str, ...]]], x: torch.Tensor):
    for seq, names in steps:
        for name in names:
            x = seq._modules[name](x)
    return x


class FusedSequential(nn.Sequential):
    """The class fuse sets on the user's own ``nn.Sequential`` (same object, elements and keys):
    each run computes through one fused op while its conditions hold."""

    _ckpt_ext_base = nn.Sequential
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
                out = part.compute(input) if part is not None else None
                if out is not None:
                    input = out
                    i += len(part.names)
                    break
            else:
                input = items[i][1](input)
                i += 1
        return input

    def extra_repr(self) -> str:
        runs = self._ckpt_ext_runs
        return "fused runs: " + ", ".join(p.describe() for p in runs) if runs else ""


class RunMember:
    """Mixed into a run member's class: inside the owner's forward it takes its part in the run."""

    _ckpt_ext_run: Optional[_Run] = None
    _ckpt_ext_index: int = 0

    def forward(self, input: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        run = self._ckpt_ext_run  # other arguments (peft's adapter_names): its own forward
        out = None if run is None or args or kwargs else run.take(self._ckpt_ext_index, input)
        if out is not None:
            return out
        if run is not None and self._ckpt_ext_index == 0 and counting():
            run.missed(bool(args or kwargs))
        return super().forward(input, *args, **kwargs)

    def extra_repr(self) -> str:
        own, run = super().extra_repr(), self._ckpt_ext_run
        if run is None:
            return own
        mine = run.describe(self._ckpt_ext_index)
        return f"{own}, {mine}" if own else mine

    def __reduce_ex__(self, protocol):  # a member class made at run time: by its base
        reduced = super().__reduce_ex__(protocol)
        cls = type(self)
        if _named(cls) or not isinstance(reduced, tuple) or reduced[0] is not copyreg.__newobj__:
            return reduced
        return (_new_member, (cls._ckpt_ext_base,) + tuple(reduced[1][1:])) + reduced[2:]


class RunLinear(RunMember, nn.Linear):
    _ckpt_ext_base = nn.Linear


class RunActivation(RunMember):
    """The member class of an activation module: it passes the run's output on."""


class RunTanh(RunActivation, nn.Tanh):
    _ckpt_ext_base = nn.Tanh


_MEMBER_CLASSES: Dict[type, type] = {nn.Linear: RunLinear, nn.Tanh: RunTanh}
#: (a test of a class, the mixin of its member class) of the kinds whose members compute otherwise
MEMBER_MIXINS: List[Tuple[Callable[[type], bool], type]] = []


def member_class(cls: type) -> type:
    """The class fuse gives a member of class ``cls``: a subclass made once per class."""
    base = getattr(cls, "_ckpt_ext_base", cls)
    if base not in _MEMBER_CLASSES:
        form = class_form(base)
        name = f"Run{form.prefix if form else ''}{base.__name__}"
        mixin = next((mix for test, mix in MEMBER_MIXINS if test(base)), None) or \
            (RunMember if form else RunActivation)
        _MEMBER_CLASSES[base] = type(name, (mixin, base), {
            "__module__": __name__, "__qualname__": name, "_ckpt_ext_base": base})
    return _MEMBER_CLASSES[base]


def _new_member(base: type, *args: Any) -> nn.Module:
    """An empty instance of ``base``'s member class, for pickle and deepcopy to fill."""
    cls = member_class(base)
    return cls.__new__(cls, *args)


def _named(cls: type) -> bool:
    obj = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        obj = getattr(obj, part, None)
    return obj is cls


class _OwnerForward(SetByFuse):
    """The forward (or ``method``) fuse sets on an owner's instance: while every guard holds, the
    class's method (or the rewritten ``source``) in the regions of its runs; else the class's."""

    def __init__(self, owner: nn.Module, runs=(), guards=(), source: Optional[str] = None,
                 method: str = "forward", arg_guard=None) -> None:
        self.owner, self.runs, self.guards, self.source = owner, tuple(runs), tuple(guards), source
        self.method, self.arg_guard = method, arg_guard
        self._fn = None
        if source is not None:
            scope: Dict[str, Any] = {}
            exec(compile(source, "<ckpt_ext.fuse rewritten forward>", "exec", dont_inherit=True),
                 scope)
            self._fn = scope["forward"]
        self._analysed = getattr(type(owner), method, None)

    def __call__(self, *args, **kwargs):
        owner = self.owner
        cls_fn = getattr(type(owner), self.method)
        refusal = self.refusal(args, kwargs)
        if refusal is not None and (not self.runs or not counting()):
            return cls_fn(owner, *args, **kwargs)  # the class's own code, exactly
        fn = cls_fn if refusal is not None or self._fn is None else self._fn
        for run in self.runs:  # a refused call: the class's code, counted by its runs
            run.enter(refusal)
        completed = False
        try:
            out = fn(owner, *args, **kwargs)
            completed = True
        finally:
            for run in self.runs:
                run.leave(completed)
        return out

    def refusal(self, args: tuple, kwargs: dict) -> Optional[Tuple[str, Optional[str]]]:
        """None while this call computes the runs, else (reason, fix) why it computes the class's
        forward."""
        owner, cls, method = self.owner, type(self.owner).__name__, self.method
        if torch.jit.is_tracing():
            return GLOBAL[0].describe(), None
        if getattr(type(owner), method) is not self._analysed:
            return (f"{cls}.{method} is no longer the method fuse analysed in {self._where()}",
                    "fuse again after changing the class")
        for guard in self.guards:
            if not guard.holds(owner):
                return (f"{self._where()}.{method} read {guard.describe()} when fuse analysed it, "
                        f"and that no longer holds, so its path may differ",
                        "fuse again after changing it")
        if self.arg_guard is None or self.arg_guard.holds(args, kwargs):
            return None
        assumed = f"at most {self.arg_guard.positional} positional argument(s)"
        if self.arg_guard.given:
            assumed += ", " + self.arg_guard.describe()
        return (f"{self._where()}.{method} was called with arguments its analysis did not cover "
                f"(it assumed {assumed})", None)

    def _where(self) -> str:
        return next((r.decision.where for r in self.runs if r.decision is not None), "") \
            or "<model>"

    @property
    def __signature__(self) -> inspect.Signature:  # the class method's, for libraries that look
        sig = inspect.signature(getattr(type(self.owner), self.method))
        return sig.replace(parameters=list(sig.parameters.values())[1:])

    def __getstate__(self):
        return {k: getattr(self, k) for k in ("owner", "runs", "guards", "source", "method",
                                              "arg_guard")}

    def __setstate__(self, state):
        self.__init__(**state)

    __deepcopy__ = by_state


MISSING = object()


class _Guard(NamedTuple):
    """An attribute the analysed forward read, and its value (``same``: compared by identity)."""
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
        v = getattr(obj, self.name, MISSING)
        return v is self.value if self.same else type(v) is type(self.value) and v == self.value

    def describe(self) -> str:
        return f"{join_path(self.path, self.name)} = {self.value!r}"
