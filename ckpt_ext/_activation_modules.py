"""Which ``nn`` modules and calls compute an activation of the fused ops, and exactly which one,
read from the registry's forms (ckpt_ext/_activations.py): :func:`module_activation` for
torch's ``nn.GELU`` ..., ``Sin``, transformers' ``GELUActivation`` ..., and a module of the
user's own whose ``forward`` computes a row by its traced arithmetic (ckpt_ext/
_activation_arithmetic.py; :func:`unmatched` says why one does not); :func:`node_activation`
for a call in an fx graph (``F.gelu``, ``torch.sin``, ``.relu()``). Used by the modules' ``from_modules`` and by the converter;
tests/fuse/test_fuse_activations.py checks every form numerically against the reference
formulas."""
from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from torch import fx, nn

from ._activation_arithmetic import Arithmetic, arithmetic
from ._activations import NEAR_MISSES, REGISTRY, CallForm, ModuleForm


class Recognised(NamedTuple):
    """An activation module or call: the activation it computes (None when fuse cannot fuse it,
    with the reason in ``problem``)."""
    name: Optional[str]
    problem: Optional[str] = None


def _forms() -> List[Tuple[type, str, List[Tuple[str, ModuleForm]]]]:
    """(class, label, [(activation, form), ...]) for every module class of the registry;
    transformers' classes only when transformers.activations is already imported."""
    return _forms_with(sys.modules.get("transformers.activations"))


@functools.lru_cache(maxsize=4)
def _forms_with(acts: Any) -> List[Tuple[type, str, List[Tuple[str, ModuleForm]]]]:
    """_forms, made once per transformers.activations module (or None): a fused run asks at
    each call."""
    by_class: Dict[type, Tuple[str, List[Tuple[str, ModuleForm]]]] = {}
    for row in REGISTRY.values():
        for form in row.modules:
            if isinstance(form.cls, str):
                cls = getattr(acts, form.cls, None) if acts is not None else None
                if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                    continue
                label = form.cls
            else:
                cls, label = form.cls, (f"nn.{form.cls.__name__}" if form.cls.__module__
                                        .startswith("torch.nn") else form.cls.__name__)
            by_class.setdefault(cls, (label, []))[1].append((row.name, form))
    if acts is not None:
        for name, why in NEAR_MISSES.items():
            cls = getattr(acts, name, None)
            if isinstance(cls, type) and issubclass(cls, nn.Module) and cls not in by_class:
                by_class[cls] = (name, [("", ModuleForm(cls, lambda m: False,
                                                        lambda m, why=why: why))])
    return [(cls, label, forms) for cls, (label, forms) in by_class.items()]


def module_activation(m: Any) -> Optional[Recognised]:
    """What activation module ``m`` computes; None when it is no activation module fuse knows.
    Exactly the class (or the member class fuse gives it): a subclass may have its own forward."""
    for cls, label, forms in _forms():
        if isinstance(m, cls):
            t = type(m)
            if t is not cls and getattr(t, "_ckpt_ext_base", None) is not cls:
                return Recognised(None, f"{t.__name__} subclasses {label}; its forward may not "
                                        f"be the activation")
            if "forward" in vars(m):
                return Recognised(None, "its forward is set on the instance")
            for name, form in forms:
                if form.accepts(m):
                    return Recognised(name)
            explain = next((f.explain for _, f in forms if f.explain is not None), None)
            return Recognised(None, explain(m) if explain else f"{label} is not computed exactly")
    if isinstance(m, nn.Module):
        return _own_module(m)
    return None


# ------------------------------------------------------------------------------------------------
# a user's own activation module, by what its forward computes (_activation_arithmetic.py)

def _arithmetic(m: nn.Module) -> Optional[Arithmetic]:
    """What a module of the user's own computes by its traced arithmetic (torch's and
    transformers' classes are known by class)."""
    cls = getattr(type(m), "_ckpt_ext_base", type(m))
    if cls.__module__.startswith("torch.") or cls.__module__.startswith("transformers."):
        return None
    return arithmetic(m)


def _own_module(m: nn.Module) -> Optional[Recognised]:
    """The row a module of the user's own computes (its forward pointwise arithmetic within the
    row's bound of its f), else None."""
    found = _arithmetic(m)
    return Recognised(found.name) if found is not None and found.name is not None else None


def unmatched(m: Any) -> Optional[Recognised]:
    """Recognised(None, why) for a module of the user's own whose forward is pointwise arithmetic
    that no row computes, with its traced form and the nearest row; else None."""
    found = _arithmetic(m) if isinstance(m, nn.Module) else None
    return Recognised(None, found.describe()) if found is not None and found.name is None \
        else None


# ------------------------------------------------------------------------------------------------
# a call in an fx graph

def sig(*params: Tuple[str, Any]) -> inspect.Signature:
    """A signature of positional-or-keyword parameters (name, default)."""
    return inspect.Signature([inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                default=d) for p, d in params])


def bind(node: fx.Node, signature: inspect.Signature) -> Optional[Dict[str, Any]]:
    """The node's arguments bound with defaults applied; None if they do not bind."""
    try:
        bound = signature.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


_INPUT = ("input", inspect.Parameter.empty)


def _reader(forms: List[Tuple[str, CallForm]]):
    """The activation whose form's wanted values the call's other arguments have, else why not."""
    def read(args: Dict[str, Any]) -> Recognised:
        for name, form in forms:
            if all(args[k] == v for k, v in form.want.items()):
                return Recognised(name)
        shown = ", ".join(f"{a}={args[a]!r}" for a in forms[0][1].want)
        wanted = " or ".join(f"{name} with " + ", ".join(f"{a}={b!r}" for a, b in f.want.items())
                             for name, f in forms)
        return Recognised(None, f"called with {shown}: the fused op computes {wanted}")
    return read


def _call_table():
    forms: Dict[Any, List[Tuple[str, CallForm]]] = {}
    for row in REGISTRY.values():
        for form in row.calls:
            forms.setdefault(form.fn, []).append((row.name, form))
    return {fn: (fs[0][1].label, sig(_INPUT, *fs[0][1].params), _reader(fs))
            for fn, fs in forms.items()}


_FUNCTIONS = _call_table()
_METHODS = {meth: row.name for row in REGISTRY.values() for meth in row.methods}


def node_activation(node: fx.Node) -> Optional[Tuple[Recognised, Any, str]]:
    """(what it computes, its data input, its label) for an activation call in an fx graph; None
    when the node is no activation call fuse knows, or takes other tensors."""
    if node.op == "call_function" and node.target in _FUNCTIONS:
        label, signature, read = _FUNCTIONS[node.target]
    elif node.op == "call_method" and node.target in _METHODS:
        label, signature = f".{node.target}()", sig(_INPUT)
        read = _reader([(_METHODS[node.target], CallForm(None, label))])
    else:
        return None
    args = bind(node, signature)
    if args is None:
        return None
    x = args.pop("input")
    if any(isinstance(v, fx.Node) for v in args.values()):
        return None
    return read(args), x, label
