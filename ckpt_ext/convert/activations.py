"""Which calls compute an activation of the fused ops (``ckpt_ext.ACTIVATIONS``), and exactly which
one: :func:`node_activation` (``F.gelu``, ``torch.sin``, ``.relu()`` in an fx graph; modules:
``ckpt_ext._activation_modules.module_activation``), and what stock autograd keeps for each
(:data:`SAVES_INPUT`), which sets what fusing frees: both read from the registry's rows
(ckpt_ext/_activations.py). The tests check every form numerically against the reference formulas
(tests/fuse/test_fuse_activations.py)."""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple

from torch import fx, nn

from .._activation_modules import Recognised, module_activation  # noqa: F401  (re-exported)
from .._activations import REGISTRY, CallForm, stock_tensors

# Whether stock autograd keeps z for each activation (its backward reads z, not the output): a
# run's inner layer then keeps two tensors unfused (z and act(z)), else one (act(z), the next
# Linear's input, kept by that Linear too); a trailing activation one (its output or its input).
SAVES_INPUT = {name: row.saves_input for name, row in REGISTRY.items()}

# How messages name each activation.
DISPLAY = {name: row.display for name, row in REGISTRY.items()}


def tensors_per_layer(name: str) -> int:
    """Distinct tensors stock autograd keeps per inner layer of a run that the fused op does not."""
    return REGISTRY[name].tensors_per_layer


def module_tensors(m: Optional[nn.Module], name: Optional[str]) -> int:
    """:func:`tensors_per_layer` for an activation as it is called: by module ``m`` computing
    ``name`` as its class computes it (a formula of several ops, transformers'
    ``NewGELUActivation``, keeps more than the one op: its class's forward runs on 8 values), or
    by a function call (``m`` None: the op's own count); 0 where it computes no activation."""
    if name is None:
        return 0
    if m is None:
        return tensors_per_layer(name)
    cls = getattr(type(m), "_ckpt_ext_base", type(m))  # a member: the class it stands for
    try:
        return stock_tensors(lambda z: cls.forward(m, z))
    except Exception:  # not computable on a float64 CPU tensor: the op's own count
        return tensors_per_layer(name)


# ------------------------------------------------------------------------------------------------
# calls in forward code

def _sig(*params: Tuple[str, Any]) -> inspect.Signature:
    return inspect.Signature([inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                default=d) for p, d in params])


_NO_DEFAULT = inspect.Parameter.empty
_INPUT = ("input", _NO_DEFAULT)


def _reader(forms: List[Tuple[str, CallForm]]) -> Callable[[Dict[str, Any]], Recognised]:
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


def _call_table() -> Dict[Any, Tuple[str, inspect.Signature, Callable[[Dict[str, Any]],
                                                                       Recognised]]]:
    """function -> (label, signature, reader of the bound arguments), from the registry's calls."""
    forms: Dict[Any, List[Tuple[str, CallForm]]] = {}
    for row in REGISTRY.values():
        for form in row.calls:
            forms.setdefault(form.fn, []).append((row.name, form))
    return {fn: (fs[0][1].label, _sig(_INPUT, *fs[0][1].params), _reader(fs))
            for fn, fs in forms.items()}


_FUNCTIONS = _call_table()
_METHODS = {meth: row.name for row in REGISTRY.values() for meth in row.methods}


def _bind(node: fx.Node, sig: inspect.Signature) -> Optional[Dict[str, Any]]:
    try:
        bound = sig.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def node_activation(node: fx.Node) -> Optional[Tuple[Recognised, Any, str]]:
    """(what it computes, its data input, its label) for an activation call in an fx graph; None
    when the node is no activation call fuse knows, or takes other tensors."""
    if node.op == "call_function" and node.target in _FUNCTIONS:
        label, sig, read = _FUNCTIONS[node.target]
        args = _bind(node, sig)
    elif node.op == "call_method" and node.target in _METHODS:
        label = f".{node.target}()"
        args = _bind(node, _sig(_INPUT))
        read = _reader([(_METHODS[node.target], CallForm(None, label))])
    else:
        return None
    if args is None:
        return None
    x = args.pop("input")
    if any(isinstance(v, fx.Node) for v in args.values()):
        return None
    return read(args), x, label
