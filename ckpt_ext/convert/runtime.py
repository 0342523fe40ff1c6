"""What ``fuse`` leaves inside users' models, and so in their pickles: the member classes set on
the user's own objects (:class:`FusedSequential`, :class:`RunLinear`, :class:`RunTanh` and the
other :class:`RunMember` classes, made per class by :func:`member_class`), the
:class:`_Run` they share, the parts (:class:`_RunPart`) of a Sequential, and the
:class:`_OwnerForward` set on an owner's instance with the guards (:class:`_Guard`) it checks at
each call. Pickles name these classes by module and name, so both are part of the format:
``ckpt_ext.convert.runtime.<name>``."""
from __future__ import annotations

import copy
import copyreg
import enum
import inspect
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.nn.utils import parametrize

from .. import _C, ops
from .._observers import foreign_global_hooks
from ..modules import LayerActivations, _has_hooks, as_mlp_argument, each_layer
from ..ops import SUPPORTED_DTYPES, linear_tanh, tanh_mlp
from . import dropout_unit
from .activations import module_activation

if TYPE_CHECKING:
    from .report import Decision


class Slot(NamedTuple):
    """Where a member of a run is held: ``holder._modules[name] is module`` while the run may be
    computed fused; ``label`` is its path, for messages."""
    holder: nn.Module
    name: str
    module: nn.Module
    label: str


class _Region(threading.local):
    """A run's region, per thread: [the next member, the tensor it must receive, the state of an
    enclosing call] inside its owner's forward; None outside it."""

    def __init__(self) -> None:
        self.state: Optional[list] = None


class _Run:
    """One run of Linear/activation layers as fuse applied it: the modules whose weights it reads,
    what must stay as it was for the fused op to compute it (:meth:`problem`), and that op (calling
    the run). With ``owner`` None, the Sequential holding the run computes it. Otherwise the
    owner's forward marks a region (:meth:`enter`, :meth:`leave`; per thread, for one call) in
    which each member takes its :meth:`turn` in the analysed order: the first computes the run,
    each later one passes its output on. Design: docs/converter.md, "Where a run is computed"."""

    activation = "tanh"  # what a run pickled without one computes

    def __init__(self, labels: Sequence[str], members: Sequence[nn.Module],
                 layers: Sequence[nn.Module], last_activation: bool,
                 sequences: Sequence[Tuple[nn.Module, str]],
                 slots: Sequence[Slot],
                 unhooked: Sequence[Tuple[nn.Module, str]], owner: Optional[nn.Module],
                 calls: Sequence[str], elements: Sequence[Tuple[nn.Module, str]],
                 decision: Optional[Decision] = None,
                 activation: LayerActivations = "tanh",
                 passes: Sequence[Tuple[nn.Module, str, int]] = ()) -> None:
        self.labels = tuple(labels)        # the layers' paths in call order, for messages
        self.key = (tuple(members), bool(last_activation))  # the modules fused (identity)
        self.layers = tuple(layers)        # its Linear modules, in order
        # one of ckpt_ext.ACTIVATIONS for every layer, or a tuple of one per activated layer
        self.activation = activation
        self.last_activation = bool(last_activation)  # the last Linear's activation included
        # Sequentials whose elements must stay exactly these (name, module) pairs
        self.sequences = tuple((seq, label, tuple(seq._modules), tuple(seq._modules.values()))
                               for seq, label in sequences)
        self.slots = tuple(slots)          # members that must stay where they are held
        self.unhooked = tuple(unhooked)    # (module, label): hooks the fused op would skip
        self.owner = owner                 # the module whose forward marks the region, or None
        self.calls = tuple(calls)          # the members' labels in the owner's call order
        self.elements = tuple(elements)    # (Sequential, name) of its layers that are elements
        self.decision = decision           # what the report said when fuse applied it
        # (module, label, k): the Identity and Dropout modules after its item k (Linear j is
        # item 2j, its activation 2j + 1); a Dropout drawing a mask after an activation is
        # computed as part of the run, any other must return its input
        self.passes = tuple(passes)
        self._region = _Region()

    passes: Tuple[Tuple[nn.Module, str, int], ...] = ()  # what a run pickled without them has

    # -- pickling and copying: the region is per process and per call, never state to keep -----
    def __getstate__(self):
        state = dict(self.__dict__)
        del state["_region"]
        return state

    def __setstate__(self, state):
        if "last_tanh" in state:  # a state that names it last_tanh holds a tanh run
            state["last_activation"] = state.pop("last_tanh")
        self.__dict__.update(state)
        self._region = _Region()

    @property
    def last_tanh(self) -> bool:
        """Whether the run ends with a tanh."""
        return self.last_activation and self.activation == "tanh"

    @property
    def activations(self) -> Tuple[str, ...]:
        """The activation of each activated layer, in order."""
        return each_layer(self.activation, len(self.layers) - (not self.last_activation))

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return new

    def problem(self) -> Optional[str]:
        """None while the run can be computed fused, else what changed since fuse."""
        if torch.jit.is_tracing():  # it records what each module computes on its own
            return "torch.jit.trace is recording the model"
        for m, label in zip(self.key[0], self.labels):
            if foreign_forward(m):
                return f"{label}'s forward was set on the instance, which the fused run would skip"
        return self._placement_problem() or self._activation_problem() or \
            self._passes_problem() or self._weights_problem()

    def _passes_problem(self) -> Optional[str]:
        for m, label, k in self.passes:
            if foreign_forward(m):
                return f"{label}'s forward was set on the instance, which the fused run would skip"
            if _has_hooks(m):
                return f"{label} has hooks, which the fused run would not call"
            if passes_through(m):
                continue
            if k % 2 == 0:
                return (f"{label} (Dropout, p={m.p}) draws a mask in training between a Linear "
                        f"and its activation, which the fused run does not compute")
            why = dropout_unit.unsupported()
            if why is not None:
                return f"{label} (Dropout, p={m.p}) draws a mask in training and {why}"
        return None

    def _masks(self) -> Dict[int, Tuple[float, ...]]:
        """The p of each Dropout that draws a mask now, by the item it follows."""
        out: Dict[int, Tuple[float, ...]] = {}
        for m, _, k in self.passes:
            if not passes_through(m):
                out[k] = out.get(k, ()) + (m.p,)
        return out

    def _placement_problem(self) -> Optional[str]:
        """What changed where the run's modules are held or in their hooks."""
        for seq, label, _, _ in self.sequences:
            if foreign_forward(seq):
                return f"{label or '<model>'}'s forward was set on the instance"
        for seq, label, names, modules in self.sequences:
            if len(seq._modules) != len(names):
                return f"the elements of {label or '<model>'} changed"
            for (name, m), want_name, want in zip(seq._modules.items(), names, modules):
                if name != want_name or m is not want:
                    return f"{join_path(label, want_name)} was replaced"
        for holder, name, want, label in self.slots:
            if holder._modules.get(name) is not want:
                return f"{label} was replaced"
        for m, label in self.unhooked:
            if _has_hooks(m):
                return f"{label or '<model>'} has hooks, which the fused run would not call"
        foreign = foreign_global_hooks()  # torch's module trackers only observe
        if foreign is not None:
            return f"{foreign}, which the fused run would not call"
        return None

    def _activation_problem(self) -> Optional[str]:
        for m, label, name in zip(self.key[0][1::2], self.labels[1::2], self.activations):
            found = module_activation(m)
            if found is None or found.name != name:
                return f"{label} no longer computes {name}"
        return None

    def _weights_problem(self) -> Optional[str]:
        w0 = self.layers[0].weight
        problem = unsupported_reason(w0)
        if problem is not None:
            return problem
        for layer in self.layers[1:]:
            if layer.weight.dtype != w0.dtype or layer.weight.device != w0.device:
                return "its layers' weights no longer share one dtype and device"
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights = [linear_weight(layer) for layer in self.layers]
        biases = [layer.bias for layer in self.layers]
        _as_layer_would(x, self.layers[0], weights[0])
        masks = self._masks()
        if masks:
            return dropout_unit.plain(x, weights, biases, self.activations, masks)
        if self.activation != "tanh":  # another name, or one per layer
            return ops.mlp(x, weights, biases, activation=as_mlp_argument(self.activation),
                           last_activation=self.last_activation)
        if len(weights) == 1 and self.last_activation:
            return linear_tanh(x, weights[0], biases[0])  # a lone pair: the op a pair is
        # What FusedTanhMLP.forward runs: the stack op, keeping only x for backward.
        return tanh_mlp(x, weights, biases, self.last_activation)

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

    def take(self, index: int, x: Any) -> Optional[torch.Tensor]:
        """What member ``index`` returns when it takes its part in the run now (the first: the
        run's output; a later one: ``x``, passed on), else None: it computes its own output."""
        state = self.turn(index, x)
        if state is None:
            return None
        if index == 0:
            x = self(x)
        state[0], state[1] = index + 1, x
        return x

    def _strayed(self, expected: int, event: str) -> str:
        owner = self.calls and (self.decision.where if self.decision else "") or ""
        return (f"ckpt_ext.fuse: the fused run {' -> '.join(self.labels)} was computed by "
                f"{self.calls[0]}, but {event} before {self.calls[expected]} received its output: "
                f"{owner or '<model>'}.forward took a path its analysis did not see (it depends on "
                f"state outside the module). Fuse an unfused copy of the model with trace=False, "
                f"or make that state an attribute of the module")


class _PlaceholderRun(_Run):
    """A unit whose owner's forward computes something between its Linear members (a gated MLP's
    product; an activation function, ``F.dropout``): inside the region the first member computes
    the whole op and returns a zero-width placeholder of x's rows, which what the forward does
    between runs on at no cost; each later member checks it received one (:meth:`_carried`) and
    passes a placeholder on, the last one returns the op's output."""

    def problem(self) -> Optional[str]:
        if torch.jit.is_tracing():
            return "torch.jit.trace is recording the model"
        for m, label in self.unhooked:
            if foreign_forward(m):
                return f"{label}'s forward was set on the instance, which the fused op would skip"
        return self._placement_problem() or self._activation_problem() or self._weights_problem()

    def enter(self) -> None:
        # [the next member, x, the state of an enclosing call, the op's output until returned]
        self._region.state = [0, None, self._region.state, None]

    def take(self, index: int, x: Any) -> Optional[torch.Tensor]:
        state = self._region.state
        if state is None:
            return None
        expected, last = state[0], len(self.calls) - 1
        if expected == index == 0:
            if self.problem() is not None:
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
            raise RuntimeError(self._strayed(expected, f"{self.calls[index]} was called with "
                                                       f"another value"
                                             if expected == index else
                                             f"{self.calls[index]} was called"))
        return None

    def _carried(self, x: Any, first_input: torch.Tensor) -> bool:
        """Whether a member between the first and the last received what the analysed forward
        hands it."""
        return _is_placeholder(x, first_input)


class _GatedRun(_PlaceholderRun):
    """A gated MLP as fuse applied it: ``down(act(gate(x)) * up(x))`` in its owner's forward,
    computed by ``gated_mlp`` keeping only x. Its members are the Linears, in call order. Inside
    the owner's region the first computes the whole op and returns a zero-width placeholder;
    the up projection (called with that same x) returns another; what the forward does between
    (the activation, chunk, the product, a Dropout that returns its input) runs on placeholders,
    at no cost; the down projection checks it received a placeholder of x's rows and returns the
    op's output. Design: docs/converter.md, "Gated MLPs"."""

    def __init__(self, labels: Sequence[str], members: Sequence[nn.Module],
                 gate: nn.Linear, up: Optional[nn.Linear], down: nn.Linear, activation: str,
                 act_module: Optional[nn.Module], dropouts: Sequence[nn.Module],
                 gate_second: bool, slots: Sequence[Slot],
                 unhooked: Sequence[Tuple[nn.Module, str]], owner: nn.Module,
                 calls: Sequence[str], decision: Optional[Decision] = None) -> None:
        super().__init__(labels, members, [gate] + ([up] if up is not None else []) + [down],
                         False, (), slots, unhooked, owner, calls, (), decision, activation)
        self.key = ("gated", tuple(members), activation, bool(gate_second))
        self.members = tuple(members)
        self.gate, self.up, self.down = gate, up, down
        self.act_module = act_module
        self.dropouts = tuple(dropouts)
        self.gate_second = bool(gate_second)

    def _activation_problem(self) -> Optional[str]:
        name = self.activation
        if self.act_module is not None:
            found = module_activation(self.act_module)
            if found is None or found.name != name or found.problem is not None:
                return f"its activation module no longer computes {name}"
        for d in self.dropouts:
            if type(d) is not nn.Dropout:
                return "a Dropout between the product and the down projection changed class"
        if self._gated_masks():
            why = dropout_unit.unsupported()
            if why is not None:
                return f"its Dropout draws a mask in training and {why}"
        return None

    def _carried(self, x: Any, first_input: torch.Tensor) -> bool:
        return x is first_input  # the up projection takes the gate's input

    def _gated_masks(self) -> Tuple[float, ...]:
        """The p of each Dropout that draws a mask now (p > 0, in training), in order."""
        return tuple(d.p for d in self.dropouts if d.p > 0 and d.training)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        first = self.members[0]
        _as_layer_would(x, first, first.weight)
        gate, up, down = self.gate, self.up, self.down
        masks = self._gated_masks()
        if masks:
            return dropout_unit.gated(x, gate.weight, up.weight if up is not None else None,
                                      down.weight, gate.bias, up.bias if up is not None else None,
                                      down.bias, self.activation, self.gate_second, masks)
        if up is not None:
            return ops.gated_mlp(x, gate.weight, up.weight, down.weight, gate.bias, up.bias,
                                 down.bias, activation=self.activation)
        w, b = gate.weight, gate.bias
        if not self.gate_second:
            return ops.gated_mlp(x, w, None, down.weight, b, None, down.bias,
                                 activation=self.activation)
        w_up, w_gate = w.chunk(2)  # the activation takes the second half
        b_up, b_gate = b.chunk(2) if b is not None else (None, None)
        return ops.gated_mlp(x, w_gate, w_up, down.weight, b_gate, b_up, down.bias,
                             activation=self.activation)


class InlineDrop(NamedTuple):
    """A Dropout between activation ``item // 2`` and the next Linear: a child module
    (``module``), or an ``F.dropout`` call with its ``p`` and whether it draws in train() and in
    eval() (``training=self.training`` draws in train() only)."""
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
    """A run whose Linears its owner's forward calls with function calls between them (an
    activation function, ``F.dropout``): ``Linear, act, [Dropout ...], Linear, ...`` ending with
    a Linear, computed by the plain run's op (with its Dropouts' masks drawn inside the unit
    while they draw). The members are the Linears; the activations and Dropouts run on
    placeholders. ``acts``: (module, label, name) of each activation that is a child module;
    ``drops``: each Dropout. Design: docs/converter.md, "Function calls
    inside a run"."""

    def __init__(self, labels: Sequence[str], members: Sequence[nn.Module],
                 activation: LayerActivations, acts: Sequence[Tuple[nn.Module, str, str]],
                 drops: Sequence[InlineDrop], slots: Sequence[Slot],
                 unhooked: Sequence[Tuple[nn.Module, str]], owner: nn.Module,
                 calls: Sequence[str], decision: Optional[Decision] = None) -> None:
        super().__init__(labels, members, members, False, (), slots, unhooked, owner, calls, (),
                         decision, activation)
        self.key = ("inline", tuple(members), activation)
        self.acts = tuple(acts)
        self.drops = tuple(drops)

    def _activation_problem(self) -> Optional[str]:
        for m, label, name in self.acts:
            found = module_activation(m)
            if found is None or found.name != name or found.problem is not None:
                return f"{label} no longer computes {name}"
        for d in self.drops:
            if d.module is not None and type(d.module) not in (nn.Dropout, nn.Identity):
                return f"{d.label} changed class"
        if self._masks():
            why = dropout_unit.unsupported()
            if why is not None:
                return f"a Dropout of the run draws a mask in training and {why}"
        return None

    def _masks(self) -> Dict[int, Tuple[float, ...]]:
        out: Dict[int, Tuple[float, ...]] = {}
        for d in self.drops:
            if d.drawing(self.owner.training):
                out[d.item] = out.get(d.item, ()) + (d.module.p if d.module is not None
                                                     else d.p,)
        return out


def _placeholder(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """What a gated MLP's first members return inside the region: no elements, x's rows (the
    forward's code between them and the down projection runs on it at no cost)."""
    return x.new_empty(x.shape[:-1] + (0,), dtype=out.dtype)


def _is_placeholder(h: Any, x: torch.Tensor) -> bool:
    return isinstance(h, torch.Tensor) and h.dim() >= 1 and h.shape[-1] == 0 and \
        h.shape[:-1] == x.shape[:-1] and not h.requires_grad


def _as_layer_would(x: Any, layer: nn.Module, weight: torch.Tensor) -> None:
    """Input the run's first Linear (``weight``: its (out, in) weight) would refuse makes the
    unfused call raise: the error the unfused model raises (F.linear's RuntimeError, message and
    all), not the fused op's own ValueError/TypeError, which name arguments the user never
    passed."""
    if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[-1] == weight.shape[1] and \
            x.device == weight.device and (x.dtype == weight.dtype or
                                           torch.is_autocast_enabled(x.device.type)):
        return
    base_type(layer).forward(layer, x)  # raises; if not, the op decides


class PartRole(str, enum.Enum):
    """What a FusedSequential does with the elements of a run it covers (a ``str``: it pickles,
    compares and hashes as its value)."""
    #: the Sequential holds the whole run (maybe in nested Sequentials) and computes it: the
    #: elements of nested Sequentials before the run's first layer (``before``), the run, then
    #: those after its last layer (``after``)
    WHOLE = "whole"
    #: member 0 of an owner's run: inside the owner's region, ``before``, then the run
    FIRST = "first"
    #: a later member: inside the region, passes the run's output on, then ``after``
    ON = "on"


class _RunPart:
    """The consecutive elements ``names`` of one FusedSequential that a run covers, and what the
    Sequential does with them (``role``, a :class:`PartRole`).

    Outside a region (or when the run cannot be computed) the Sequential runs these elements one
    by one, as ``nn.Sequential`` does."""

    def __init__(self, run: _Run, names: Sequence[str], role: PartRole, index: int,
                 before: Sequence[Tuple[nn.Module, Tuple[str, ...]]],
                 after: Sequence[Tuple[nn.Module, Tuple[str, ...]]]) -> None:
        self.run, self.names, self.role, self.index = run, tuple(names), role, index
        self.before, self.after = tuple(before), tuple(after)
        # FIRST/ON: a run of the Sequential's own elements computed fused when this part is
        # not computed as the owner's run (called on its own, or the run falls back)
        self.alone: Optional["_RunPart"] = None

    @property
    def last_tanh(self) -> bool:
        return self.run.last_tanh

    @property
    def last_activation(self) -> bool:
        return self.run.last_activation

    @property
    def key(self) -> Tuple[Any, ...]:
        return (self.names, self.role, self.index, self.run.key)

    def compute(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The output of this part's elements computed as the run, or None to run them one by
        one."""
        run = self.run
        if self.role == PartRole.WHOLE:
            if run.problem() is not None:
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
        if self.role == PartRole.WHOLE:
            if not self.before and not self.after and run.elements and \
                    all(seq is run.elements[0][0] for seq, _ in run.elements):
                return span + (f" (last {run.activations[-1]})" if self.last_activation else "")
            return f"{span} (computes the run {run.labels[0]}..{run.labels[-1]})"
        where = f"inside {run.decision.where or '<model>'}.forward" if run.decision else \
            "inside its caller's forward"
        alone = "" if self.alone is None else \
            f"; otherwise {self.alone.names[0]}..{self.alone.names[-1]} as one run"
        if self.role == PartRole.FIRST:
            return f"{span} (computes the run {run.labels[0]}..{run.labels[-1]} {where}{alone})"
        return f"{span} (passes the run from {run.labels[0]} on {where}{alone})"


def _elements(steps: Sequence[Tuple[nn.Module, Tuple[str, ...]]], x: torch.Tensor):
    for seq, names in steps:
        for name in names:
            x = seq._modules[name](x)
    return x


class FusedSequential(nn.Sequential):
    """An ``nn.Sequential`` whose planned runs of ``Linear, Act, Linear, ...`` elements each run
    through one fused op (``tanh_mlp``, or ``linear_tanh`` for a single pair; ``mlp`` for the other
    activations and for a run mixing them).

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

    _ckpt_ext_base = nn.Linear
    _ckpt_ext_run: Optional[_Run] = None
    _ckpt_ext_index: int = 0

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        run = self._ckpt_ext_run
        out = run.take(self._ckpt_ext_index, input) if run is not None else None
        return super().forward(input) if out is None else out

    def extra_repr(self) -> str:
        return super().extra_repr() + _member_repr(self)


class RunMember:
    """The member class of a module other than ``nn.Linear`` that a module's forward calls as
    part of a fused run, mixed into that very class by :func:`member_class` (so the module stays
    an instance of its class): inside its owner's forward, in the analysed order, the first member
    computes the run and a later one passes the run's output on; called any other way it is
    exactly its class. A member class made at run time pickles as its class's ``member_class``."""

    _ckpt_ext_run: Optional[_Run] = None
    _ckpt_ext_index: int = 0

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        run = self._ckpt_ext_run
        out = run.take(self._ckpt_ext_index, input) if run is not None else None
        return super().forward(input) if out is None else out

    def extra_repr(self) -> str:
        own = super().extra_repr()
        return own + _member_repr(self) if own else _member_repr(self).lstrip(", ")

    def __reduce_ex__(self, protocol):
        reduced = super().__reduce_ex__(protocol)
        cls = type(self)
        if _named(cls) or not isinstance(reduced, tuple) or reduced[0] is not copyreg.__newobj__:
            return reduced
        return (_new_member, (cls._ckpt_ext_base,) + tuple(reduced[1][1:])) + reduced[2:]


class RunActivation(RunMember):
    """The member class of an activation module (``nn.GELU``, transformers' ``GELUActivation``,
    ...): it passes the run's output on."""


class RunTanh(RunActivation, nn.Tanh):
    """An ``nn.Tanh`` that a module's forward calls as part of a fused run: inside its owner's
    forward, in the analysed order, it passes the run's output on; called any other way it is
    exactly ``nn.Tanh``."""

    _ckpt_ext_base = nn.Tanh


def _member_repr(m: nn.Module) -> str:
    run = getattr(m, "_ckpt_ext_run", None)
    if run is None:
        return ""
    if isinstance(run, _GatedRun):
        what = ("computes the gated MLP" if m._ckpt_ext_index == 0 else
                "returns the gated MLP's output" if m._ckpt_ext_index == len(run.calls) - 1 else
                "takes part in the gated MLP")
        return f", {what} {run.labels[0]}..{run.labels[-1]} inside its owner's forward"
    what = "computes" if m._ckpt_ext_index == 0 else "passes on"
    return f", {what} the run {run.labels[0]}..{run.labels[-1]} inside its owner's forward"


_MEMBER_CLASSES: Dict[type, type] = {nn.Linear: RunLinear, nn.Tanh: RunTanh}


def member_class(cls: type) -> type:
    """The class ``fuse`` gives a member of class ``cls`` (or of ``cls``'s member class): a
    subclass, made once per class — ``RunLinear``, ``RunTanh``, ``RunGELU``, ``RunConv1D``..."""
    base = getattr(cls, "_ckpt_ext_base", cls)
    sub = _MEMBER_CLASSES.get(base)
    if sub is None:
        name = f"Run{base.__name__}"
        mixin = RunMember if _conv1d_class(base) else RunActivation
        sub = type(name, (mixin, base), {"__module__": __name__, "__qualname__": name,
                                         "_ckpt_ext_base": base})
        _MEMBER_CLASSES[base] = sub
    return sub


def _new_member(base: type, *args: Any) -> nn.Module:
    """An empty instance of ``base``'s member class, for pickle and deepcopy to fill."""
    cls = member_class(base)
    return cls.__new__(cls, *args)


def _named(cls: type) -> bool:
    """Whether pickle finds ``cls`` by its module and name."""
    obj = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        obj = getattr(obj, part, None)
    return obj is cls


class _OwnerForward:
    """The forward ``fuse`` sets on one module instance (its class is untouched) when that module's
    forward calls the members of a run one after the other, or its code was rewritten
    (``rewrite=True``); or, set as ``method``, the method the forward names (handed to a helper
    such as transformers' ``apply_chunking_to_forward``) that calls them.

    At each call it first checks that every attribute the analysed method read still has the value
    it had (``guards``): if one changed, the method may take another path, so it runs the class's
    method as it is, unfused. Otherwise it runs the rewritten code (or the class's method) inside
    the region of each of its runs. It pickles and deep-copies by its source, as
    torch.fx.GraphModule does."""

    def __init__(self, owner: nn.Module, runs: Sequence[_Run] = (),
                 guards: Sequence[_Guard] = (), source: Optional[str] = None,
                 method: str = "forward", arg_guard: Optional["_ArgGuard"] = None) -> None:
        self.owner, self.runs, self.guards, self.source = owner, tuple(runs), tuple(guards), source
        self.method, self.arg_guard = method, arg_guard
        self._fn = _compile_forward(source) if source is not None else None
        # the class's method as analysed: one put on the class later is code fuse has not seen
        self._analysed = getattr(type(owner), method, None)

    def __call__(self, *args, **kwargs):
        owner = self.owner
        cls_fn = getattr(type(owner), self.method)
        if torch.jit.is_tracing() or cls_fn is not self._analysed:
            return cls_fn(owner, *args, **kwargs)  # the class's own code, exactly
        for guard in self.guards:
            if not guard.holds(owner):
                return cls_fn(owner, *args, **kwargs)
        if self.arg_guard is not None and not self.arg_guard.holds(args, kwargs):
            return cls_fn(owner, *args, **kwargs)
        fn = self._fn if self._fn is not None else cls_fn
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
    def __signature__(self) -> inspect.Signature:  # the class method's, for libraries that look
        sig = inspect.signature(getattr(type(self.owner), self.method))
        return sig.replace(parameters=list(sig.parameters.values())[1:])

    def __getstate__(self):
        return {"owner": self.owner, "runs": self.runs, "guards": self.guards,
                "source": self.source, "method": self.method, "arg_guard": self.arg_guard}

    def __setstate__(self, state):
        self.__init__(state["owner"], state["runs"], state["guards"], state["source"],
                      state.get("method", "forward"), state.get("arg_guard"))

    def __deepcopy__(self, memo):
        new = _OwnerForward.__new__(_OwnerForward)
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return new


def owner_wrappers(m: nn.Module) -> Dict[str, "_OwnerForward"]:
    """The forward and methods fuse set on this instance, by name."""
    return {k: v for k, v in vars(m).items() if isinstance(v, _OwnerForward)}


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
        v = getattr(obj, self.name, MISSING)
        if self.same:
            return v is self.value
        return type(v) is type(self.value) and v == self.value

    def describe(self) -> str:
        return f"{join_path(self.path, self.name)} = {self.value!r}"


MISSING = object()


class _ArgGuard(NamedTuple):
    """What the analysed forward assumed of its arguments (arguments.py): each argument of
    ``given`` is not None (the forward tests it, ``if x is not None``, and was traced with one).
    ``order``: the parameters a positional argument binds, in order; a call with more than
    ``positional`` positional arguments is an error the class's forward raises. Arguments and
    ``**kwargs`` handed to children need no check: a child is opaque to the analysis, and what
    it does with them cannot change which of the forward's own lines run."""
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


def _compile_forward(source: str) -> Callable:
    scope: Dict[str, Any] = {}
    exec(compile(source, "<ckpt_ext.fuse rewritten forward>", "exec", dont_inherit=True), scope)
    return scope["forward"]


def stored_weight(lin: nn.Module) -> Optional[torch.Tensor]:
    """The tensor a Linear's weight is stored in, read without evaluating anything: the parameter
    itself, or a parametrization's original (``spectral_norm``'s ``original``, ``weight_norm``'s
    ``original0``), whose dtype and device the computed weight has. Reading ``lin.weight`` would
    run the parametrization (spectral_norm in train mode moves its ``_u``, ``_v``). None for a
    lazy, uninitialised parameter."""
    w = lin._parameters.get("weight")
    if w is None and parametrize.is_parametrized(lin, "weight"):
        w = next(iter(lin.parametrizations["weight"].parameters()), None)
    if w is None or is_lazy(w):
        return None
    return w


def unsupported_reason(weight: Optional[torch.Tensor]) -> Optional[str]:
    """None when the op runs on this weight's device and dtype, else why not."""
    if weight is None:
        return None
    if weight.dtype not in SUPPORTED_DTYPES:
        return f"dtype {weight.dtype} is not supported by the fused op"
    ok = {"cpu", "meta"} | ({"cuda"} if _C.WITH_CUDA else set())
    if weight.device.type not in ok:
        return f"device {weight.device} is not supported by this build of the fused op"
    return None


def is_conv1d(m: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2's projections): x·W + b with W stored (in, out)."""
    return _conv1d_class(base_type(m))


def _conv1d_class(cls: type) -> bool:
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers")


def linear_weight(lin: nn.Module) -> torch.Tensor:
    """The layer's weight as the ops take it, (out, in): a Conv1D's stored (in, out) weight
    transposed, a view (the ops compute with either layout and give its gradient that layout)."""
    return lin.weight.t() if is_conv1d(lin) else lin.weight


def features(lin: nn.Module) -> Tuple[int, int]:
    """(in, out) features of a Linear or a Conv1D."""
    if is_conv1d(lin):
        return tuple(lin.weight.shape)
    return lin.in_features, lin.out_features


def base_type(m: nn.Module) -> type:
    """The module's class, or the class fuse gave it a member class of."""
    return getattr(type(m), "_ckpt_ext_base", type(m))


def passes_through(m: nn.Module) -> bool:
    """Whether the module returns its input, the very tensor: ``nn.Identity``, or an
    ``nn.Dropout`` with p = 0 or in eval()."""
    cls = base_type(m)
    return cls is nn.Identity or (cls is nn.Dropout and not (m.p > 0 and m.training))


def may_pass(m: nn.Module) -> bool:
    """Whether a run may go through the module: ``nn.Identity`` or ``nn.Dropout``."""
    return base_type(m) in (nn.Identity, nn.Dropout)


def foreign_forward(m: nn.Module) -> bool:
    """Whether someone other than fuse set ``forward`` on this instance (accelerate's
    ``add_hook_to_module`` does): a fused op computing this module's output would not call it."""
    fwd = vars(m).get("forward")
    return fwd is not None and not isinstance(fwd, _OwnerForward)


def join_path(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def is_sequential(m: nn.Module) -> bool:
    return type(m) in (nn.Sequential, FusedSequential)


def parts_of(seq: nn.Module) -> Tuple[_RunPart, ...]:
    return seq._ckpt_ext_runs if isinstance(seq, FusedSequential) else ()
