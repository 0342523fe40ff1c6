"""Which calls compute an activation of the fused ops (``ckpt_ext.ACTIVATIONS``), and exactly which
one: :func:`node_activation` (``F.gelu``, ``torch.sin``, ``.relu()`` in an fx graph; modules:
``ckpt_ext._activation_modules.module_activation``). Also what stock autograd keeps for each
(:data:`SAVES_INPUT`), which sets what fusing frees. The tests check every entry numerically
against the reference formulas (tests/fuse/test_fuse_activations.py)."""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import fx

from .._activation_modules import Recognised, module_activation  # noqa: F401  (re-exported)


# What PyTorch's autograd saves for each activation (tools/autograd/derivatives.yaml): tanh,
# sigmoid and relu their output — the next Linear's input, kept by that Linear too — and the others
# their input z. So a run's inner layer keeps one tensor unfused for the first kind, two (z and
# act(z)) for the second; a trailing activation one (its output or its input).
SAVES_INPUT = {"tanh": False, "sigmoid": False, "relu": False, "gelu": True, "gelu_tanh": True,
               "silu": True, "softplus": True, "sin": True}

# How messages name each activation.
DISPLAY = {"tanh": "Tanh", "sigmoid": "Sigmoid", "relu": "ReLU", "gelu": "GELU",
           "gelu_tanh": "GELU(tanh)", "silu": "SiLU", "softplus": "Softplus", "sin": "sin"}


def tensors_per_layer(name: str) -> int:
    """Distinct tensors stock autograd keeps per inner layer of a run that the fused op does not."""
    return 2 if SAVES_INPUT[name] else 1


# ------------------------------------------------------------------------------------------------
# calls in forward code

def _sig(*params: Tuple[str, Any]) -> inspect.Signature:
    return inspect.Signature([inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                default=d) for p, d in params])


_NO_DEFAULT = inspect.Parameter.empty
_INPUT = ("input", _NO_DEFAULT)


def _fixed(name: str, **want: Any) -> Callable[[Dict[str, Any]], Recognised]:
    """The activation ``name`` when the call's other arguments are these values."""
    def read(args: Dict[str, Any]) -> Recognised:
        for k, v in want.items():
            if args[k] != v:
                shown = ", ".join(f"{a}={args[a]!r}" for a in want)
                return Recognised(None, f"called with {shown}: the fused op computes {name} with "
                                        + ", ".join(f"{a}={b!r}" for a, b in want.items()))
        return Recognised(name)
    return read


def _gelu_call(args: Dict[str, Any]) -> Recognised:
    name = {"none": "gelu", "tanh": "gelu_tanh"}.get(args["approximate"])
    return Recognised(name, None if name else f"approximate={args['approximate']!r} is not an "
                                              f"approximation the fused op computes")


# function -> (label, signature, reader of the bound arguments)
_FUNCTIONS: Dict[Any, Tuple[str, inspect.Signature, Callable[[Dict[str, Any]], Recognised]]] = {
    torch.tanh: ("torch.tanh", _sig(_INPUT), _fixed("tanh")),
    F.tanh: ("F.tanh", _sig(_INPUT), _fixed("tanh")),
    F.gelu: ("F.gelu", _sig(_INPUT, ("approximate", "none")), _gelu_call),
    F.silu: ("F.silu", _sig(_INPUT, ("inplace", False)), _fixed("silu")),
    torch.sigmoid: ("torch.sigmoid", _sig(_INPUT), _fixed("sigmoid")),
    F.sigmoid: ("F.sigmoid", _sig(_INPUT), _fixed("sigmoid")),
    F.softplus: ("F.softplus", _sig(_INPUT, ("beta", 1), ("threshold", 20)),
                 _fixed("softplus", beta=1, threshold=20)),
    torch.relu: ("torch.relu", _sig(_INPUT), _fixed("relu")),
    F.relu: ("F.relu", _sig(_INPUT, ("inplace", False)), _fixed("relu")),
    torch.sin: ("torch.sin", _sig(_INPUT), _fixed("sin")),
}
_METHODS = {"tanh": "tanh", "sigmoid": "sigmoid", "relu": "relu", "sin": "sin"}


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
        read = _fixed(_METHODS[node.target])
    else:
        return None
    if args is None:
        return None
    x = args.pop("input")
    if any(isinstance(v, fx.Node) for v in args.values()):
        return None
    return read(args), x, label
