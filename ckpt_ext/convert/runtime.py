"""What ``fuse`` leaves inside users' models, and so in their pickles, which name these classes at
``ckpt_ext.convert.runtime``. Design: docs/converter.md, "Where a run is computed"."""
from __future__ import annotations

import copy
import copyreg
import enum
import inspect
import sys
import threading
from typing import TYPE_CHECKING, Any, Dict, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from .. import ops
from ..modules import LayerActivations, as_mlp_argument, each_layer
from .. import _dropout_autograd as dropout_unit
from .._recompute import recomputed_modules
from .facts import (GLOBAL, computes, elements, mask_inside, masks_drawable, no_hooks, of_class,
                    own_forward, SetByFuse, Slot, base_type, failing, join_path,
                    layer_forward, of_weights, op_terms, passes_through, Condition,
                    experts_class, first_failing, unsupported_reason)
from .fallback import count_fused, count_unfused, counting, fell_back
from .linears import class_form
from .zero3 import real_shape

if TYPE_CHECKING:
    from .report import Decision

__all__ = ["Slot"]  # a run's slots pickle as facts.Slot; pickles may name it here


class _Region(threading.local):
    """A run's region, per thread: [the next member, the tensor it must receive, the state of an
    enclosing call]; None outside the owner's forward. Set in __init__ (per thread), so the
    instance dict torch.compile guards on holds it from the first call."""

    def __init__(self) -> None:
        self.state: Optional[list] = None


#: a region's first field while its owner computes the class's forward (_OwnerForward refused)
_REFUSED = -2


def _by_state(self, memo):
    """``__deepcopy__`` through ``__getstate__`` and ``__setstate__``."""
    new = type(self).__new__(type(self))
    memo[id(self)] = new
    new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
    return new


class _Run:
    """One run of Linear/activation layers, computed by the Sequential holding it (``owner`` None)
    or in the region its owner's forward marks, in which each member takes its :meth:`turn`: the
    first computes the run, each later one passes its output on."""

    activation = "tanh"  # what a run pickled without one computes
    passes: Tuple[Tuple[nn.Module, str, int], ...] = ()

    def __init__(self, labels, members, layers, last_activation: bool, sequences, slots, unhooked,
                 owner: Optional[nn.Module], calls, elements, decision: Optional[Decision] = None,
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
        self.decision = decision           # what the report said when fuse applied it
        self.passes = tuple(passes)  # (module, label, k): Identity/Dropout modules after item k
        self._region = _Region()

    @property
    def conditions(self) -> tuple:
        """What must hold at a call for the fused op to compute the run (made once; not by
        functools.cached_property, whose lock torch.compile cannot trace on Python 3.11)."""
        if "_made_conditions" not in self.__dict__:
            self.__dict__["_made_conditions"] = tuple(self._conditions())
        return self.__dict__["_made_conditions"]

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

    # pickles and copies keep neither the region (per process and call) nor the conditions
    def __getstate__(self):
        state = dict(self.__dict__)
        del state["_region"]
        state.pop("_made_conditions", None)
        return state

    def refused(self) -> bool:
        """At its first member's call: False while every condition holds; else the call is
        counted unfused with the failing condition's reason, and True."""
        failed = first_failing(self.conditions)
        if failed is None:
            return False
        fell_back(self, failed)
        return True

    def missed(self, extra: bool) -> None:
        """Count a call of the first member that computed the run unfused without a condition
        failing (those are counted where they fail): the reason the region was not marked."""
        state = self._region.state
        if state is None:
            if self.owner is not None:
                count_unfused(self, *_outside_region(self))
        elif state[0] == _REFUSED:
            state[0] = -1
            count_unfused(self, *state[3])
        elif state[0] == 0 and extra:
            count_unfused(self, f"{self.calls[0]} was called with arguments beyond its input, "
                                f"which the fused op does not take")

    def __setstate__(self, state):
        if "last_tanh" in state:  # a state that names it last_tanh holds a tanh run
            state["last_activation"] = state.pop("last_tanh")
        self.__dict__.update(state)
        self._region = _Region()

    __deepcopy__ = _by_state

    @property
    def last_tanh(self) -> bool:
        return self.last_activation and self.activation == "tanh"

    @property
    def activations(self) -> Tuple[str, ...]:
        return each_layer(self.activation, len(self.layers) - (not self.last_activation))

    def problem(self) -> Optional[str]:
        """None while the run can be computed fused, else what changed since fuse."""
        return failing(self.conditions)

    def masks(self) -> Dict[int, Tuple[float, ...]]:
        """The p of each Dropout drawing a mask at this call, by the item it follows."""
        return _by_item((k, m.p) for m, _, k in self.passes if not passes_through(m))

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
        its class's forward, and the run's first member counts the call unfused. The state: [the
        next member, its input, an enclosing call's state, the refusal or (a _PlaceholderRun's)
        the op's output until returned]."""
        self._region.state = [0 if refusal is None else _REFUSED, None, self._region.state,
                              refusal]

    def leave(self, completed: bool) -> None:
        state = self._region.state
        self._region.state = state[2]
        if completed and 0 < state[0] < len(self.calls):
            raise RuntimeError(self._strayed(state[0], "the forward returned"))

    def turn(self, index: int, x: Any) -> Optional[list]:
        """The region's state if member ``index`` is to take its part in the run here, else None."""
        state = self._region.state
        if state is None:
            return None
        expected = state[0]
        if expected == index and (index == 0 or x is state[1]):
            if index == 0 and self.refused():
                state[0] = -1  # computed member by member for the rest of this call
                return None
            return state
        if 0 < expected < len(self.calls):
            # computed by its first member, but the forward took a path fx did not see: the
            # output holds later layers, so it is returned as nothing else
            raise RuntimeError(self._strayed(expected, f"{self.calls[index]} was called"))
        return None

    def take(self, index: int, x: Any) -> Optional[torch.Tensor]:
        """What member ``index`` returns when it takes its part here, else None."""
        state = self.turn(index, x)
        if state is None:
            return None
        state[0], state[1] = index + 1, self(x) if index == 0 else x
        return state[1]

    def _strayed(self, expected: int, event: str) -> str:
        owner = self.calls and (self.decision.where if self.decision else "") or ""
        return (f"ckpt_ext.fuse: the fused run {' -> '.join(self.labels)} was computed by "
                f"{self.calls[0]}, but {event} before {self.calls[expected]} received its output: "
                f"{owner or '<model>'}.forward took a path its analysis did not see (it depends on "
                f"state outside the module). Fuse an unfused copy of the model with trace=False, "
                f"or make that state an attribute of the module")


class _PlaceholderRun(_Run):
    """A unit whose forward computes something between its Linears: the first member computes it
    and returns a zero-width placeholder, on which that code runs; the last returns the output."""

    def _conditions(self):
        yield from GLOBAL
        yield from (own_forward(m, label) for m, label in self.unhooked)
        yield from self._placement()
        yield from self._own()
        yield masks_drawable(self)
        yield from of_weights(self.layers, self.calls)

    def take(self, index: int, x: Any) -> Optional[torch.Tensor]:
        state = self._region.state
        if state is None:
            return None
        expected, last = state[0], len(self.calls) - 1
        if expected == index == 0:
            if self.refused():
                state[0] = -1  # computed module by module for the rest of this call
                return None
            out = self(x)
            state[0], state[1], state[3] = 1, x, out
            return _placeholder(x, out)
        if expected == index and 0 < index < last and self._carried(x, state[1]):
            state[0] = index + 1
            return _placeholder(x, state[3])
        if expected == index == last and _is_placeholder(x, state[1]):
            out, state[3] = state[3], None
            state[0], state[1] = index + 1, out
            return out
        if 0 < expected <= last:
            other = " with another value" if expected == index else ""
            raise RuntimeError(self._strayed(expected, f"{self.calls[index]} was called{other}"))
        return None

    def _carried(self, x: Any, first_input: torch.Tensor) -> bool:
        return _is_placeholder(x, first_input)


class _GatedRun(_PlaceholderRun):
    """A gated MLP, ``down(act(gate(x)) * up(x))``, computed by ``gated_mlp``."""

    def __init__(self, labels, members, gate: nn.Linear, up: Optional[nn.Linear], down: nn.Linear,
                 activation: str, act_module: Optional[nn.Module], dropouts, gate_second: bool,
                 slots, unhooked, owner: nn.Module, calls, decision: Optional[Decision] = None):
        super().__init__(labels, members, [gate] + ([up] if up is not None else []) + [down],
                         False, (), slots, unhooked, owner, calls, (), decision, activation)
        self.key = ("gated", tuple(members), activation, bool(gate_second))
        self.members, self.dropouts = tuple(members), tuple(dropouts)
        self.gate, self.up, self.down, self.act_module = gate, up, down, act_module
        self.gate_second = bool(gate_second)

    def _own(self):
        if self.act_module is not None:
            yield computes(self.act_module, "its activation module", self.activation)
        for d in self.dropouts:
            yield of_class(d, "a Dropout between the product and the down projection",
                          (nn.Dropout,))

    def _carried(self, x: Any, first_input: torch.Tensor) -> bool:
        return x is first_input

    def masks(self) -> Tuple[float, ...]:
        return tuple(d.p for d in self.dropouts if d.p > 0 and d.training)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        count_fused(self)
        gate, up, down = self.gate, self.up, self.down
        layers = [m for m in (gate, up, down) if m is not None]
        terms, masks = [op_terms(m) for m in layers], self.masks()
        up_first = up is not None and self.members[0] is up
        loras = [t[2] for t in terms if t is not None]
        # peft draws the LoRA masks in call order, the op gate's first; a packed gate_up's term
        # is one, which the op would split for gate_second
        if _through_modules(terms, bool(masks)) or any(loras) and (
                up_first and any(t is not None and t.dropout > 0 for t in loras) or
                up is None and self.gate_second):
            return recomputed_modules(lambda h: dropout_unit.gated_chain(
                layer_forward(gate), None if up is None else layer_forward(up), layer_forward(down),
                self.activation, self.gate_second, up_first, masks, h), x, _trained(layers))
        (w, b, _), (w_up, b_up, _) = terms[0], terms[1] if up is not None else (None, None, None)
        w_down, b_down, _ = terms[-1]
        _as_layer_would(x, self.members[0], w_up if up_first else w)
        if masks:
            return dropout_unit.gated(x, w, w_up, w_down, b, b_up, b_down, self.activation,
                                      self.gate_second, masks)
        if up is None and self.gate_second:  # the activation takes the second half
            (w_up, w), (b_up, b) = w.chunk(2), b.chunk(2) if b is not None else (None, None)
        return ops.gated_mlp(x, w, w_up, w_down, b, b_up, b_down, activation=self.activation,
                             lora=loras if any(t is not None for t in loras) else None)


class InlineDrop(NamedTuple):
    """A Dropout after activation ``item // 2``: a child ``module``, or an ``F.dropout`` call with
    its ``p`` and whether it ``draws`` in train() and in eval()."""
    item: int
    label: str
    module: Optional[nn.Module]
    p: float
    draws: Tuple[bool, bool]

    def drawing(self, owner_training: bool) -> bool:
        if self.module is not None:
            return isinstance(self.module, nn.Dropout) and self.module.training and \
                self.module.p > 0
        return self.p > 0 and self.draws[0 if owner_training else 1]


class _InlineRun(_PlaceholderRun):
    """A run with function calls between its Linears; ``acts``: its activation modules'."""

    def __init__(self, labels, members, activation: LayerActivations, acts, drops, slots, unhooked,
                 owner: nn.Module, calls, decision: Optional[Decision] = None) -> None:
        super().__init__(labels, members, members, False, (), slots, unhooked, owner, calls, (),
                         decision, activation)
        self.key = ("inline", tuple(members), activation)
        self.acts, self.drops = tuple(acts), tuple(drops)

    def _own(self):
        yield from (computes(m, label, name) for m, label, name in self.acts)
        for d in self.drops:
            if d.module is not None:
                yield of_class(d.module, d.label, (nn.Dropout, nn.Identity))

    def masks(self) -> Dict[int, Tuple[float, ...]]:
        return _by_item((d.item, d.module.p if d.module is not None else d.p)
                        for d in self.drops if d.drawing(self.owner.training))


def _outside_region(run: _Run) -> Tuple[str, str]:
    """(reason, fix) for a run whose first member was called with no region of its owner's."""
    owner = run.decision.where if run.decision else "its owner"
    owner = owner or "<model>"
    fwd = [v for v in vars(run.owner).values() if isinstance(v, _OwnerForward)]
    if not fwd:
        why = (f"{owner}'s forward is no longer the one fuse set on it (replaced on the "
               f"instance), so the run's region is not marked")
    else:
        why = (f"{run.calls[0]} was called outside {owner}'s forward as fuse set it (a forward "
               f"patched on {owner} as a closure over the method fuse replaced, or the member "
               f"called on its own)")
    return why, ("call ckpt_ext.fuse after what patches the forward (on the model the trainer "
                 "actually trains), or call the module itself rather than its old bound forward")


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


def _by_item(pairs) -> Dict[int, Tuple[float, ...]]:
    """(item, p) pairs as {item: (p, ...)}."""
    out: Dict[int, Tuple[float, ...]] = {}
    for k, p in pairs:
        out[k] = out.get(k, ()) + (p,)
    return out


def _placeholder(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[:-1] + (0,), dtype=out.dtype)


def _is_placeholder(h: Any, x: torch.Tensor) -> bool:
    return isinstance(h, torch.Tensor) and h.dim() >= 1 and h.shape[-1] == 0 and \
        h.shape[:-1] == x.shape[:-1] and not h.requires_grad


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
        return self.run.last_tanh

    @property
    def key(self) -> Tuple[Any, ...]:
        return (self.names, self.role, self.index, self.run.key)

    def compute(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The output of this part's elements computed as the run, or None to run them."""
        run = self.run
        if self.role == PartRole.WHOLE:
            if run.refused():
                return None
            return _elements(self.after, run(_elements(self.before, x)))
        state = run.turn(self.index, x)
        if state is None:
            return None
        if self.role == PartRole.FIRST:
            x = run(_elements(self.before, x))
        state[0], state[1] = self.index + 1, x
        return _elements(self.after, x)

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
        if run is None:
            return super().forward(input, *args, **kwargs)
        out = run.take(self._ckpt_ext_index, input) if not (args or kwargs) else None
        if out is None:
            if self._ckpt_ext_index == 0 and counting():
                run.missed(bool(args or kwargs))
            return super().forward(input, *args, **kwargs)
        return out

    def extra_repr(self) -> str:
        own = super().extra_repr()
        run = self._ckpt_ext_run
        if run is None:
            return own
        k = self._ckpt_ext_index
        if isinstance(run, _GatedRun):
            what = ("computes the gated MLP" if k == 0 else "returns the gated MLP's output"
                    if k == len(run.calls) - 1 else "takes part in the gated MLP")
        else:
            what = ("computes" if k == 0 else "passes on") + " the run"
        mine = f"{what} {run.labels[0]}..{run.labels[-1]} inside its owner's forward"
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


def member_class(cls: type) -> type:
    """The class fuse gives a member of class ``cls``: a subclass made once per class."""
    base = getattr(cls, "_ckpt_ext_base", cls)
    if base not in _MEMBER_CLASSES:
        form = class_form(base)
        name = f"Run{form.prefix if form else ''}{base.__name__}"
        mixin = RunExperts if experts_class(base) else RunMember if form else RunActivation
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
                 method: str = "forward", arg_guard: Optional[_ArgGuard] = None) -> None:
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
        refusal = None
        if torch.jit.is_tracing() or cls_fn is not self._analysed or \
                not all(guard.holds(owner) for guard in self.guards) or \
                (self.arg_guard is not None and not self.arg_guard.holds(args, kwargs)):
            if not self.runs or not counting():
                return cls_fn(owner, *args, **kwargs)  # the class's own code, exactly
            refusal, fn = self.refusal(args, kwargs), cls_fn  # the same, counted by its runs
        else:
            fn = self._fn if self._fn is not None else cls_fn
        for run in self.runs:
            run.enter(refusal)
        completed = False
        try:
            out = fn(owner, *args, **kwargs)
            completed = True
        finally:
            for run in self.runs:
                run.leave(completed)
        return out

    def refusal(self, args: tuple, kwargs: dict) -> Tuple[str, Optional[str]]:
        """(reason, fix) why this call computes the class's forward rather than the runs'."""
        owner, cls = self.owner, type(self.owner).__name__
        where = next((r.decision.where for r in self.runs if r.decision is not None), "")
        where = where or "<model>"
        if torch.jit.is_tracing():
            return GLOBAL[0].describe(), None
        if getattr(type(owner), self.method) is not self._analysed:
            return (f"{cls}.{self.method} is no longer the method fuse analysed in {where}",
                    "fuse again after changing the class")
        for guard in self.guards:
            if not guard.holds(owner):
                return (f"{where}.{self.method} read {guard.describe()} when fuse analysed it, "
                        f"and that no longer holds, so its path may differ",
                        "fuse again after changing it")
        assumed = f"at most {self.arg_guard.positional} positional argument(s)"
        if self.arg_guard.given:
            assumed += ", " + self.arg_guard.describe()
        return (f"{where}.{self.method} was called with arguments its analysis did not cover "
                f"(it assumed {assumed})", None)

    @property
    def __signature__(self) -> inspect.Signature:  # the class method's, for libraries that look
        sig = inspect.signature(getattr(type(self.owner), self.method))
        return sig.replace(parameters=list(sig.parameters.values())[1:])

    def __getstate__(self):
        return {"owner": self.owner, "runs": self.runs, "guards": self.guards,
                "source": self.source, "method": self.method, "arg_guard": self.arg_guard}

    def __setstate__(self, state):
        self.__init__(state["owner"], state["runs"], state["guards"], state["source"],
                      state.get("method", "forward"), state.get("arg_guard"))

    __deepcopy__ = _by_state


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


class _ArgGuard(NamedTuple):
    """What the analysed forward assumed of its arguments: each of ``given`` is not None."""
    names: frozenset
    positional: int
    given: Tuple[str, ...] = ()
    order: Tuple[str, ...] = ()

    def holds(self, args: tuple, kwargs: dict) -> bool:
        if len(args) > self.positional:
            return False
        for name in self.given:
            k = self.order.index(name)
            if (args[k] if k < len(args) else kwargs.get(name)) is None:
                return False
        return True

    def describe(self) -> str:
        return ", ".join(f"{name} given (not None)" for name in self.given)


# -- Mixture of experts: an experts module computed by moe_experts ---------------------------------

#: transformers' experts implementations whose arithmetic is moe_experts': the class's own loop
#: ("eager", or None), batched_mm and grouped_mm (transformers checks that they agree)
_SAME_ARITHMETIC = ("batched_mm_experts_forward", "grouped_mm_experts_forward")
#: gpt-oss's gated product, (clamp(u, -L, L) + 1) · min(g, L)·σ(α·min(g, L)): quick_gelu's when
#: α is QuickGELU's 1.702
GPT_OSS_GATE = ("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssExperts._apply_gate")
QUICK_GELU_ALPHA = 1.702


class ExpertsForm(NamedTuple):
    """How ``moe_experts`` computes one experts module, read by fuse from its flags and modules."""
    params: Tuple[str, str, Optional[str], Optional[str]]  # gate_up, down and their biases
    layout: str                     # ops.MOE_LAYOUTS
    activation: str                 # the registry's name
    gate: str                       # "default", "gpt_oss" (clamped, up + 1) or "" (ungated)
    flags: Tuple[bool, bool, bool, bool]  # has_gate, has_bias, is_transposed, is_concatenated
    arguments: Tuple[str, str, str]  # the names of its forward's x, top_k_index, top_k_weights


FLAG_NAMES = ("has_gate", "has_bias", "is_transposed", "is_concatenated")


def experts_dispatch(cls: type) -> Tuple[Any, Any]:
    """(the ExpertsInterface, the class's own forward) that the decorator's forward closes over."""
    fn = cls.forward
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
    return cells["experts_interface"].cell_contents, cells["original_forward"].cell_contents


def experts_gate(m: nn.Module) -> Optional[str]:
    """"default" (transformers' ``_default_apply_gate``) or "gpt_oss" for the gated product the
    module's ``_apply_gate`` computes, None for any other (one set on the instance included)."""
    moe = sys.modules["transformers.integrations.moe"]
    fn = getattr(type(m), "_apply_gate", None)
    if "_apply_gate" in vars(m) or fn is None:
        return None
    if fn is moe._default_apply_gate:
        return "default"
    return "gpt_oss" if (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)) == \
        GPT_OSS_GATE else None


def _dispatched(m: nn.Module) -> Tuple[Any, Optional[Any]]:
    """(config._experts_implementation, the function the module's forward runs for it: None
    where the forward raises for an unknown name)."""
    impl = getattr(getattr(m, "config", None), "_experts_implementation", None)
    interface, original = experts_dispatch(base_type(m))
    if impl is not None and impl != "eager" and impl not in interface:
        return impl, None
    return impl, interface.get(impl, original)


def _same_arithmetic(m: nn.Module) -> bool:
    fn = _dispatched(m)[1]
    moe = sys.modules["transformers.integrations.moe"]
    return fn is not None and (fn is experts_dispatch(base_type(m))[1] or
                               any(fn is getattr(moe, name, None) for name in _SAME_ARITHMETIC))


def _weights_problem(m: nn.Module, label: str, form: ExpertsForm) -> Optional[str]:
    """None while the module's parameters are 3-D expert weights (2-D biases) moe_experts takes,
    read at their real shapes (ZeRO-3 holds a shape-[0] partition of each between calls)."""
    ps = []
    for name, dim in zip(form.params, (3, 3, 2, 2)):
        if name is None:
            continue
        p = m._parameters.get(name)
        if p is None:
            return (f"{join_path(label, name)} is no longer a parameter of it (computed by a "
                    f"parametrization, as peft's ParamWrapper does for LoRA on expert weights)")
        if type(p) not in (nn.Parameter, torch.Tensor) or len(real_shape(p)) != dim:
            return (f"{join_path(label, name)} is a {type(p).__name__} of {len(real_shape(p))} "
                    f"dimensions, not the {dim}-D tensor moe_experts takes")
        ps.append(p)
    experts = {real_shape(p)[0] for p in ps} | {getattr(m, "num_experts", real_shape(ps[0])[0])}
    if len(experts) != 1:
        return f"{label}: its parameters hold different numbers of experts ({sorted(experts)})"
    if (reason := unsupported_reason(ps[0])) is not None:
        return f"{label}: {reason}"
    if len({(p.dtype, p.device) for p in ps}) != 1:
        return (f"{label}: its parameters are of different dtypes or devices (" + ", ".join(
            f"{n}: {p.dtype} on {p.device}" for n, p in zip(form.params, ps)) + ")")
    return None


def experts_conditions(m: nn.Module, label: str, form: ExpertsForm,
                       act: Optional[nn.Module]) -> list:
    """What must hold at a call for ``moe_experts`` to compute module ``m`` as ``form`` says
    (without ``GLOBAL``, which only a call checks)."""
    flags = tuple(getattr(m, name, None) for name in FLAG_NAMES)
    out = [own_forward(m, label),
           Condition(lambda: getattr(m, "_is_expert_parallel", None) is False,
                     lambda: f"{label} computes expert parallel (_is_expert_parallel="
                             f"{getattr(m, '_is_expert_parallel', None)}): its experts are one "
                             f"rank's share, which fuse leaves to its forward"),
           Condition(lambda: getattr(m, "has_post_expert_norm", None) is False,
                     lambda: f"{label} normalises each expert's output (has_post_expert_norm="
                             f"{getattr(m, 'has_post_expert_norm', None)}), which moe_experts "
                             f"does not compute"),
           Condition(lambda: tuple(getattr(m, name, None) for name in FLAG_NAMES) == flags ==
                     form.flags,
                     lambda: f"{label}: its use_experts_implementation flags changed (" + ", ".join(
                         f"{name}={getattr(m, name, None)}" for name in FLAG_NAMES) + ")"),
           Condition(lambda: _same_arithmetic(m),
                     lambda: f"{label}: config._experts_implementation={_dispatched(m)[0]!r} "
                             f"runs {getattr(_dispatched(m)[1], '__name__', 'no function')}, "
                             f"not the class's loop, batched_mm or grouped_mm, whose arithmetic "
                             f"moe_experts computes")]
    if form.gate:
        out.append(Condition(lambda: experts_gate(m) == form.gate,
                             lambda: f"{label}: its _apply_gate is not the gated product it "
                                     f"computed when fused ({form.gate})"))
    if form.gate == "gpt_oss":
        out.append(Condition(
            lambda: getattr(m, "alpha", None) == QUICK_GELU_ALPHA and
            type(getattr(m, "limit", None)) in (int, float),
            lambda: f"{label}: gpt-oss's gated product with alpha={getattr(m, 'alpha', None)} "
                    f"and limit={getattr(m, 'limit', None)!r} is not quick_gelu's (alpha "
                    f"{QUICK_GELU_ALPHA}) clamped at a number"))
    else:
        who = join_path(label, "act_fn")
        out += [Slot(m, "act_fn", act, who), computes(act, who, form.activation),
                own_forward(act, who), no_hooks(act, who)]
    out.append(Condition(lambda: _weights_problem(m, label, form) is None,
                         lambda: _weights_problem(m, label, form) or ""))
    return out


class _ExpertsRun:
    """An experts module of transformers' ``use_experts_implementation``, computed by
    ``moe_experts`` in its own forward while every condition holds, else by the class's."""

    def __init__(self, module: nn.Module, label: str, form: ExpertsForm,
                 act: Optional[nn.Module], decision: Optional[Decision] = None) -> None:
        self.module, self.label, self.form, self.act = module, label, form, act
        self.key = ("moe", module)
        self.decision = decision

    @property
    def activation(self) -> str:
        return self.form.activation

    @property
    def conditions(self) -> tuple:
        """Made once, as _Run's."""
        if "_made_conditions" not in self.__dict__:
            self.__dict__["_made_conditions"] = GLOBAL + tuple(
                experts_conditions(self.module, self.label, self.form, self.act))
        return self.__dict__["_made_conditions"]

    def problem(self) -> Optional[str]:
        return failing(self.conditions)

    def compute(self, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
        """The module's output by ``moe_experts``, or None where its class's forward computes it
        (a condition fails, or input the op would refuse: the class's forward raises its own)."""
        names = self.form.arguments
        if kwargs or len(args) != 3:
            if len(args) > 3 or set(kwargs) - set(names[len(args):]):
                count_unfused(self, f"{self.label} was called with arguments beyond "
                                    f"{', '.join(names)}, which moe_experts does not take")
                return None
            args = args + tuple(kwargs.get(name) for name in names[len(args):])
        x, idx, w = args
        failed = first_failing(self.conditions)
        if failed is not None:
            fell_back(self, failed)
            return None
        m, form = self.module, self.form
        gate_up, down, gate_up_bias, down_bias = (
            m._parameters[n] if n is not None else None for n in form.params)
        if any(p is not None and p.shape != real_shape(p)
               for p in (gate_up, down, gate_up_bias, down_bias)):
            count_unfused(self, f"{self.label}: its weights are ZeRO-3 partitions at this call "
                                f"(shape [0]): ZeRO-3 gathers them only where "
                                f"deepspeed.initialize's hooks are on it")
            return None
        if not (isinstance(x, torch.Tensor) and isinstance(idx, torch.Tensor) and
                isinstance(w, torch.Tensor) and x.dim() == 2 and idx.dim() == 2 and
                idx.shape == w.shape and idx.shape[0] == x.shape[0] and
                x.shape[1] == gate_up.shape[1 if form.flags[2] else 2] and
                idx.dtype in (torch.int64, torch.int32) and w.is_floating_point() and
                x.device == idx.device == w.device == gate_up.device and
                (x.dtype == gate_up.dtype or torch.is_autocast_enabled(x.device.type))):
            count_unfused(self, f"{self.label} was called with input moe_experts does not "
                                f"take (its class's forward computes it)")
            return None
        count_fused(self)
        return ops.moe_experts(
            x, idx, w, gate_up, down, activation=form.activation, gate_up_bias=gate_up_bias,
            down_bias=down_bias, layout=form.layout,
            limit=float(m.limit) if form.gate == "gpt_oss" else None,
            up_offset=1.0 if form.gate == "gpt_oss" else 0.0)

    def describe(self) -> str:
        return f"computes moe_experts ({self.form.activation}, {self.form.layout}) in its forward"

    # pickles and copies do not keep the conditions (made again at the first call)
    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_made_conditions", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)

    __deepcopy__ = _by_state


class RunExperts(RunMember):
    """Mixed into an experts class: its forward computes the module by ``moe_experts`` while its
    run's conditions hold, else runs the class's forward."""

    def forward(self, *args, **kwargs):
        run = self._ckpt_ext_run
        out = run.compute(args, kwargs) if run is not None else None
        return self._ckpt_ext_base.forward(self, *args, **kwargs) if out is None else out

    def extra_repr(self) -> str:
        own = self._ckpt_ext_base.extra_repr(self)
        run = self._ckpt_ext_run
        if run is None:
            return own
        return f"{own}, {run.describe()}" if own else run.describe()
