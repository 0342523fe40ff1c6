"""Which ``nn`` modules compute an activation of the fused ops (``ckpt_ext.ACTIVATIONS``), and
exactly which one: :func:`module_activation` (torch's ``nn.GELU`` ..., ``Sin``, transformers'
``GELUActivation`` ...), with the reason where a module is close but not fusable. Used by the
modules' ``from_modules`` and by the converter; tests/fuse/test_fuse_activations.py checks every
entry numerically against the reference formulas."""
from __future__ import annotations

import functools
import inspect
import math
import sys
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch.nn.functional as F
from torch import nn

from ._activations import Sin


class Recognised(NamedTuple):
    """An activation module or call: the activation it computes (None when fuse cannot fuse it,
    with the reason in ``problem``)."""
    name: Optional[str]
    problem: Optional[str] = None



def _gelu(m: nn.GELU) -> Recognised:
    name = {"none": "gelu", "tanh": "gelu_tanh"}.get(m.approximate)
    return Recognised(name, None if name else f"nn.GELU(approximate={m.approximate!r}) is not "
                                              f"an approximation the fused op computes")


def _softplus(m: nn.Softplus) -> Recognised:
    if m.beta == 1 and m.threshold == 20:
        return Recognised("softplus")
    return Recognised(None, f"nn.Softplus(beta={m.beta}, threshold={m.threshold}): the fused op "
                            f"computes softplus with beta=1, threshold=20 only")


def _bound(m: nn.Module, attr: str, method: str) -> bool:
    """Whether ``m.<attr>`` is ``m``'s own method ``method`` of its class."""
    f = vars(m).get(attr)
    return inspect.ismethod(f) and f.__self__ is m and \
        f.__func__ is getattr(type(m), method, None)


def _transformers_gelu(m: nn.Module) -> Recognised:
    # act = F.gelu, or the Python erf formula x·(1 + erf(x/√2))/2 (use_gelu_python=True)
    if vars(m).get("act") is F.gelu or _bound(m, "act", "_gelu_python"):
        return Recognised("gelu")
    return Recognised(None, f"its act {vars(m).get('act')!r} is not one fuse recognises")


def _transformers_gelu_tanh(m: nn.Module) -> Recognised:
    # act = partial(F.gelu, approximate="tanh"), or the Python tanh formula
    act = vars(m).get("act")
    if isinstance(act, functools.partial) and act.func is F.gelu and not act.args and \
            act.keywords == {"approximate": "tanh"}:
        return Recognised("gelu_tanh")
    if _bound(m, "act", "_gelu_tanh_python"):
        return Recognised("gelu_tanh")
    return Recognised(None, f"its act {act!r} is not one fuse recognises")


def _transformers_accurate_gelu(m: nn.Module) -> Recognised:
    if getattr(m, "precomputed_constant", None) == math.sqrt(2 / math.pi):
        return Recognised("gelu_tanh")  # GELU's tanh form, with sqrt(2/pi) computed once
    return Recognised(None, "its precomputed_constant is not sqrt(2/pi)")


def _never(why: str) -> Callable[[nn.Module], Recognised]:
    return lambda m: Recognised(None, why)


_TORCH: List[Tuple[type, Callable[[nn.Module], Recognised]]] = [
    (nn.Tanh, lambda m: Recognised("tanh")),
    (nn.GELU, _gelu),
    (nn.SiLU, lambda m: Recognised("silu")),
    (nn.Sigmoid, lambda m: Recognised("sigmoid")),
    (nn.Softplus, _softplus),
    (nn.ReLU, lambda m: Recognised("relu")),
    (Sin, lambda m: Recognised("sin")),  # ckpt_ext's module of torch.sin
]

# transformers.activations, by class name: read only when transformers is already imported (a
# model holding its modules imported it). Each maps to the function it computes, exactly.
_TRANSFORMERS: Dict[str, Callable[[nn.Module], Recognised]] = {
    "GELUActivation": _transformers_gelu,
    "GELUTanh": _transformers_gelu_tanh,
    "PytorchGELUTanh": _transformers_gelu_tanh,
    "NewGELUActivation": lambda m: Recognised("gelu_tanh"),
    "AccurateGELUActivation": _transformers_accurate_gelu,
    "SiLUActivation": lambda m: Recognised("silu"),
    "FastGELUActivation": _never("it computes GELU's tanh form with the rounded constant "
                                 "0.7978845608, not gelu_tanh exactly"),
    "QuickGELUActivation": _never("it computes x*sigmoid(1.702*x), which the fused op does not"),
}


def _table() -> List[Tuple[type, str, Callable[[nn.Module], Recognised]]]:
    rows = [(cls, f"nn.{cls.__name__}", read) for cls, read in _TORCH]
    acts = sys.modules.get("transformers.activations")
    if acts is not None:
        for name, read in _TRANSFORMERS.items():
            cls = getattr(acts, name, None)
            if isinstance(cls, type) and issubclass(cls, nn.Module):
                rows.append((cls, name, read))
    return rows


def module_activation(m: Any) -> Optional[Recognised]:
    """What activation module ``m`` computes; None when it is no activation module fuse knows.
    Exactly the class (or the member class fuse gives it): a subclass may have its own forward."""
    for cls, label, read in _table():
        if isinstance(m, cls):
            t = type(m)
            if t is not cls and getattr(t, "_ckpt_ext_base", None) is not cls:
                return Recognised(None, f"{t.__name__} subclasses {label}; its forward may not "
                                        f"be the activation")
            if "forward" in vars(m):
                return Recognised(None, "its forward is set on the instance")
            return read(m)
    return None
