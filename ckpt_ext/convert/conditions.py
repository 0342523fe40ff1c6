"""What must hold for a unit to be computed fused, each as one object that checks and describes
itself: ``holds()`` and ``describe()``. fuse builds a unit's conditions when it finds the unit,
refuses it with the description of one that does not hold, and the unit's run builds the same
conditions from what it keeps and checks them at every call (a failing one makes that call
compute module by module). Conditions that are only known while analysing (how often a forward
calls a child, what fx saw) are not here: they cannot change between calls."""
from __future__ import annotations

from typing import Any, Iterable, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.modules.module as _module_hooks  # the hooks registered for every module
from torch import nn
from torch.nn.utils import parametrize

from . import dropout_unit
from .facts import (INSTANCE_FORWARD, base_type, foreign_forward, has_hooks, is_conv1d,
                    module_activation, passes_through, stored_weight, unsupported_reason)


class OwnForward(NamedTuple):
    """No ``forward`` set on the instance but fuse's own."""
    module: nn.Module
    who: str

    def holds(self) -> bool:
        return not foreign_forward(self.module)

    def describe(self) -> str:
        return f"{self.who}: {INSTANCE_FORWARD}"


class NoHooks(NamedTuple):
    module: nn.Module
    who: str
    because: str = "which the fused op would not call"

    def holds(self) -> bool:
        return not has_hooks(self.module)

    def describe(self) -> str:
        return f"{self.who} has hooks, {self.because}"


class Slot(NamedTuple):
    """A module of a unit held where fuse found it: ``holder._modules[name] is module``."""
    holder: nn.Module
    name: str
    module: nn.Module
    label: str

    def holds(self) -> bool:
        return self.holder._modules.get(self.name) is self.module

    def describe(self) -> str:
        return f"{self.label} was replaced"


class Elements(NamedTuple):
    """A Sequential a unit goes through, with exactly these elements."""
    seq: nn.Module
    label: str
    names: Tuple[str, ...]
    modules: Tuple[nn.Module, ...]

    def holds(self) -> bool:
        seq = self.seq._modules
        return len(seq) == len(self.names) and all(
            name == want and m is mod for (name, m), want, mod in
            zip(seq.items(), self.names, self.modules))

    def describe(self) -> str:
        return f"the elements of {self.label or '<model>'} changed"


class Computes(NamedTuple):
    """An activation module computing activation ``name`` of the fused ops."""
    module: nn.Module
    label: str
    name: str

    def holds(self) -> bool:
        found = module_activation(self.module)
        return found is not None and found.name == self.name

    def describe(self) -> str:
        return f"{self.label} no longer computes {self.name}"


class OfClass(NamedTuple):
    """A module of one of ``classes`` exactly (a Dropout a unit draws inside)."""
    module: nn.Module
    label: str
    classes: Tuple[type, ...]

    def holds(self) -> bool:
        return type(self.module) in self.classes

    def describe(self) -> str:
        return f"{self.label} changed class"


class Supported(NamedTuple):
    """A Linear whose weight's dtype and device the ops take."""
    layer: nn.Module

    def holds(self) -> bool:
        return unsupported_reason(stored_weight(self.layer)) is None

    def describe(self) -> str:
        return unsupported_reason(stored_weight(self.layer)) or ""


class OneDtypeDevice(NamedTuple):
    """Linears whose weights share one dtype and device."""
    layers: Tuple[nn.Module, ...]
    labels: Tuple[str, ...]

    def holds(self) -> bool:
        weights = [stored_weight(layer) for layer in self.layers]
        return None not in weights and len({(w.dtype, w.device) for w in weights}) == 1

    def describe(self) -> str:
        weights = [stored_weight(layer) for layer in self.layers]
        if None in weights:
            return "a weight is not made yet (a lazy layer)"
        return ("its Linears' weights are of different dtypes or devices ("
                + ", ".join(f"{label}: {w.dtype} on {w.device}"
                            for label, w in zip(self.labels, weights)) + ")")


class MaskInside(NamedTuple):
    """A Dropout of a run (after its item ``item``: Linear j is item 2j, its activation 2j + 1)
    that returns its input, or draws its mask after an activation, where the unit draws it."""
    module: nn.Module
    label: str
    item: int

    def holds(self) -> bool:
        return passes_through(self.module) or self.item % 2 == 1

    def describe(self) -> str:
        return (f"{self.label} (Dropout, p={self.module.p}) draws a mask in training between a "
                f"Linear and its activation, which the fused run does not compute")


class MasksDrawable(NamedTuple):
    """A unit whose Dropouts draw masks now can draw them inside (not while torch.compile traces,
    a torch.func transform or forward-mode AD runs)."""
    run: Any  # its masks(): the p of each Dropout drawing now, by item

    def holds(self) -> bool:
        return not self.run.masks() or dropout_unit.unsupported() is None

    def describe(self) -> str:
        return f"a Dropout of the run draws a mask in training and {dropout_unit.unsupported()}"


class NoGlobalHooks(NamedTuple):
    def holds(self) -> bool:
        return not (_module_hooks._global_forward_hooks or
                    _module_hooks._global_forward_pre_hooks or
                    _module_hooks._global_backward_hooks or
                    _module_hooks._global_backward_pre_hooks)

    def describe(self) -> str:
        return "hooks registered for every module, which the fused run would not call"


class NotJitTracing(NamedTuple):
    def holds(self) -> bool:
        return not torch.jit.is_tracing()  # it records what each module computes on its own

    def describe(self) -> str:
        return "torch.jit.trace is recording the model"


# ------------------------------------------------------------------------------------------------
# The conditions of a unit's modules, in one place for fuse and for its run, and what keeps a
# Linear or an activation module from any unit

def linear_problem(lin: nn.Module) -> Optional[str]:
    own, hooks = of_layer(lin, "the Linear")
    if not own.holds():
        return own.describe()
    if not is_conv1d(lin) and base_type(lin) is not nn.Linear:
        name = type(lin).__name__
        if parametrize.is_parametrized(lin):
            return (f"{name}: its weight is computed by a parametrization "
                    f"({', '.join(lin.parametrizations)}), which the fused op would not run")
        if isinstance(lin, nn.modules.lazy.LazyModuleMixin):
            return f"{name} is a lazy layer: its weight is made at its first call"
        return f"{name} subclasses nn.Linear; its forward may not be F.linear"
    return failing([hooks, Supported(lin)])


def activation_problem(act: nn.Module) -> Optional[str]:
    found = module_activation(act)
    if found is None or found.problem is not None:
        return found.problem if found is not None else f"{type(act).__name__} is no activation"
    return failing(of_layer(act, f"the {base_type(act).__name__}"))


def of_layer(m: nn.Module, who: str, because: str = "which the fused op would not call"):
    """A module computed inside a unit: its own forward, no hooks."""
    return [OwnForward(m, who), NoHooks(m, who, because)]


def of_activation(m: nn.Module, label: str, name: str, who: Optional[str] = None):
    return of_layer(m, who or label) + [Computes(m, label, name)]


def of_weights(layers: Sequence[nn.Module], labels: Sequence[str]):
    return [Supported(layers[0]), OneDtypeDevice(tuple(layers), tuple(labels))]


GLOBAL = (NotJitTracing(), NoGlobalHooks())


def failing(conditions: Iterable) -> Optional[str]:
    """The description of the first condition that does not hold, else None."""
    for c in conditions:
        if not c.holds():
            return c.describe()
    return None
