"""The activation registry: one :class:`Activation` row per activation of the fused ops, holding
every fact the Python side uses — f and its derivatives from ATen ops, what the first-order
backward reads (so what stock autograd keeps), the ``nn`` modules, functional calls, Tensor
methods and transformers classes that compute it — and nothing else keeps a per-activation table:
the ops, modules, higher orders, the converter's recognition and its "does this consumer keep it"
answers read the rows. The kernels' side of a row: its functor in csrc/activations.h, whose list
names the activations (``ACTIVATIONS``, read from the C++ library).

Adding an activation: a row here, its functor in csrc/activations.h; the tests parametrise over
``ACTIVATIONS``."""
from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _C

_ATEN = torch.ops.aten


class Sin(nn.Module):
    """``torch.sin`` as a module (PyTorch has none), the activation of SIREN-style networks."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.sin(x)


class QuickGELU(nn.Module):
    """``x·sigmoid(1.702·x)`` as a module: transformers' ``QuickGELUActivation`` (CLIP's MLP),
    for models without transformers."""

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(1.702 * x)


class ModuleForm(NamedTuple):
    """A module class that computes the activation when ``accepts(module)``; ``cls`` is a class,
    or the name of a class of ``transformers.activations`` (read only when transformers is already
    imported). ``explain(module)`` says why not when no row accepts a module of the class."""
    cls: Union[type, str]
    accepts: Callable[[nn.Module], bool] = lambda m: True
    explain: Optional[Callable[[nn.Module], str]] = None


class CallForm(NamedTuple):
    """A function computing the activation of its first argument ``input`` when its other
    arguments (``params``: name and default, in order) have the values in ``want``."""
    fn: Any
    label: str
    params: Tuple[Tuple[str, Any], ...] = ()
    want: Mapping[str, Any] = {}


class Activation(NamedTuple):
    """One row of the registry."""
    name: str
    display: str                                     # how messages and reports name it
    f: Callable[[Tensor], Tensor]                    # f(z), PyTorch's own op
    backward: Callable[[Tensor, Tensor], Tensor]     # (gy, z) -> gy·f'(z), PyTorch's own formula
    # (gy, f(z)) -> gy·f'(z) where PyTorch's backward reads the output (stock autograd then keeps
    # f(z), the next Linear's input: one tensor per layer); None where it reads z (two: z, f(z))
    from_output: Optional[Callable[[Tensor, Tensor], Tensor]]
    d2: Callable[[Tensor], Tensor]                   # f''(z)
    d3: Callable[[Tensor], Tensor]                   # f'''(z)
    module: Callable[[], nn.Module]                  # the module an equivalent Sequential holds
    modules: Tuple[ModuleForm, ...] = ()
    calls: Tuple[CallForm, ...] = ()
    methods: Tuple[str, ...] = ()                    # Tensor methods: x.tanh()
    d1: Optional[Callable[[Tensor], Tensor]] = None  # f'(z) written out (else backward with gy=1)

    @property
    def saves_input(self) -> bool:
        """Whether stock autograd keeps z for this activation's backward: where PyTorch's
        backward does not read the output (tests/ops/test_activation_registry.py holds this to
        what saved_tensors_hooks sees)."""
        return self.from_output is None

    @property
    def tensors_per_layer(self) -> int:
        """Distinct (rows, width) tensors stock autograd keeps per inner layer of a run that the
        fused op does not: f(z), the next Linear's input, and whatever else f's own ops save (z,
        an intermediate)."""
        return _stock_tensors(self.name)

    def derivative(self, z: Tensor) -> Tensor:
        """f'(z), from ATen ops."""
        return self.d1(z) if self.d1 is not None else self.backward(torch.ones_like(z), z)


# ------------------------------------------------------------------------------------------------
# formulas the rows share. s = sigmoid(z), φ = exp(−z²/2)/√(2π); gelu_tanh with
# u = k(z + c·z³), th = tanh(u), S = 1 − th²: f'' = S·P with P = u' + z·(u'' − 2·th·u'²)/2, and
# f''' = S·(P' − 2·th·u'·P) with P' = 3u''/2 − th·u'² + z·(u''' − 2·S·u'³ − 4·th·u'·u'')/2.

_K, _C3 = math.sqrt(2 / math.pi), 0.044715


def _gelu_tanh_d(z: Tensor, third: bool) -> Tensor:
    th = torch.tanh(_K * (z + _C3 * z ** 3))
    du, d2u = _K * (1 + 3 * _C3 * z * z), 6 * _K * _C3 * z
    sech2 = 1 - th * th
    p = du + 0.5 * z * (d2u - 2 * th * du * du)
    if not third:
        return sech2 * p
    dp = (1.5 * d2u - th * du * du
          + 0.5 * z * (6 * _K * _C3 - 2 * sech2 * du ** 3 - 4 * th * du * d2u))
    return sech2 * (dp - 2 * th * du * p)


def _silu_derivative(z: Tensor) -> Tensor:
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


def _silu_backward(gy: Tensor, z: Tensor) -> Tensor:
    # aten.silu_backward's own formula, spelled in ops autograd can differentiate again (it cannot
    # differentiate silu_backward itself).
    return gy * _silu_derivative(z)


_QUICK = 1.702  # QuickGELU's sigmoid scale: f(z) = z·σ(1.702·z) = silu(1.702·z)/1.702


def _quick_gelu(z: Tensor) -> Tensor:
    return z * torch.sigmoid(_QUICK * z)  # transformers' QuickGELUActivation, op for op


def _quick_gelu_derivative(z: Tensor) -> Tensor:
    return _silu_derivative(_QUICK * z)


def _quick_gelu_d(z: Tensor, third: bool) -> Tensor:
    # f^(n)(z) = a^(n-1)·silu^(n)(a·z)
    return (_QUICK ** 2 if third else _QUICK) * _silu_d(_QUICK * z, third)


def _silu_d(z: Tensor, third: bool) -> Tensor:
    s = torch.sigmoid(z)
    if not third:
        return s * (1 - s) * (2 + z * (1 - 2 * s))
    return s * (1 - s) * ((1 - 2 * s) * (3 + z * (1 - 2 * s)) - 2 * z * s * (1 - s))


def _sigmoid_d(z: Tensor, third: bool) -> Tensor:
    s = torch.sigmoid(z)
    return s * (1 - s) * ((1 - 6 * s + 6 * s * s) if third else (1 - 2 * s))


def _softplus_d(z: Tensor, third: bool) -> Tensor:  # f(z) = z above the threshold 20
    s = torch.sigmoid(z)
    return torch.where(z > 20, torch.zeros_like(z), s * (1 - s) * ((1 - 2 * s) if third else 1))


def _tanh_d(z: Tensor, third: bool) -> Tensor:
    t = torch.tanh(z)
    return (1 - t * t) * ((6 * t * t - 2) if third else -2 * t)


def _gelu_d(z: Tensor, third: bool) -> Tensor:
    phi = torch.exp(-0.5 * z * z) * (1 / math.sqrt(2 * math.pi))
    return phi * (z * (z * z - 4) if third else (2 - z * z))


def _orders(d: Callable[[Tensor, bool], Tensor]):
    return dict(d2=lambda z: d(z, False), d3=lambda z: d(z, True))


# ---- module forms' conditions -------------------------------------------------------------------

def _bound(m: nn.Module, attr: str, method: str) -> bool:
    """Whether ``m.<attr>`` is ``m``'s own method ``method`` of its class."""
    f = vars(m).get(attr)
    return inspect.ismethod(f) and f.__self__ is m and \
        f.__func__ is getattr(type(m), method, None)


def _gelu_module_problem(m: nn.Module) -> str:
    return f"nn.GELU(approximate={m.approximate!r}) is not an approximation the fused op computes"


def _softplus_module_problem(m: nn.Module) -> str:
    return (f"nn.Softplus(beta={m.beta}, threshold={m.threshold}): the fused op computes softplus "
            f"with beta=1, threshold=20 only")


def _hf_act_problem(m: nn.Module) -> str:
    return f"its act {vars(m).get('act')!r} is not one fuse recognises"


def _hf_gelu_tanh_act(m: nn.Module) -> bool:
    # act = partial(F.gelu, approximate="tanh"), or the Python tanh formula
    act = vars(m).get("act")
    return (isinstance(act, functools.partial) and act.func is F.gelu and not act.args
            and act.keywords == {"approximate": "tanh"}) or _bound(m, "act", "_gelu_tanh_python")


_INPLACE = (("inplace", False),)  # either value: the same f

# ------------------------------------------------------------------------------------------------
# the rows

_ROWS = (
    Activation(
        "tanh", "Tanh", torch.tanh,
        backward=lambda gy, z: _ATEN.tanh_backward(gy, torch.tanh(z)),
        from_output=lambda gy, out: _ATEN.tanh_backward(gy, out),
        **_orders(_tanh_d), module=nn.Tanh,
        modules=(ModuleForm(nn.Tanh),),
        calls=(CallForm(torch.tanh, "torch.tanh"), CallForm(F.tanh, "F.tanh")),
        methods=("tanh",)),
    Activation(
        "gelu", "GELU", F.gelu,
        backward=lambda gy, z: _ATEN.gelu_backward(gy, z), from_output=None,
        **_orders(_gelu_d), module=nn.GELU,
        modules=(ModuleForm(nn.GELU, lambda m: m.approximate == "none", _gelu_module_problem),
                 # act = F.gelu, or the Python erf formula x·(1 + erf(x/√2))/2
                 ModuleForm("GELUActivation", lambda m: vars(m).get("act") is F.gelu
                            or _bound(m, "act", "_gelu_python"), _hf_act_problem)),
        calls=(CallForm(F.gelu, "F.gelu", (("approximate", "none"),), {"approximate": "none"}),)),
    Activation(
        "gelu_tanh", "GELU(tanh)", lambda z: F.gelu(z, approximate="tanh"),
        backward=lambda gy, z: _ATEN.gelu_backward(gy, z, approximate="tanh"), from_output=None,
        **_orders(_gelu_tanh_d), module=lambda: nn.GELU(approximate="tanh"),
        modules=(ModuleForm(nn.GELU, lambda m: m.approximate == "tanh", _gelu_module_problem),
                 ModuleForm("GELUTanh", _hf_gelu_tanh_act, _hf_act_problem),
                 ModuleForm("PytorchGELUTanh", _hf_gelu_tanh_act, _hf_act_problem),
                 ModuleForm("NewGELUActivation"),
                 # GELU's tanh form, with sqrt(2/pi) computed once
                 ModuleForm("AccurateGELUActivation",
                            lambda m: getattr(m, "precomputed_constant", None)
                            == math.sqrt(2 / math.pi),
                            lambda m: "its precomputed_constant is not sqrt(2/pi)")),
        calls=(CallForm(F.gelu, "F.gelu", (("approximate", "none"),), {"approximate": "tanh"}),)),
    Activation(
        "silu", "SiLU", F.silu, backward=_silu_backward, from_output=None,
        d1=_silu_derivative, **_orders(_silu_d), module=nn.SiLU,
        modules=(ModuleForm(nn.SiLU), ModuleForm("SiLUActivation")),
        calls=(CallForm(F.silu, "F.silu", _INPLACE),)),
    Activation(
        "sigmoid", "Sigmoid", torch.sigmoid,
        backward=lambda gy, z: _ATEN.sigmoid_backward(gy, torch.sigmoid(z)),
        from_output=lambda gy, out: _ATEN.sigmoid_backward(gy, out),
        **_orders(_sigmoid_d), module=nn.Sigmoid,
        modules=(ModuleForm(nn.Sigmoid),),
        calls=(CallForm(torch.sigmoid, "torch.sigmoid"), CallForm(F.sigmoid, "F.sigmoid")),
        methods=("sigmoid",)),
    Activation(
        "softplus", "Softplus", F.softplus,
        backward=lambda gy, z: _ATEN.softplus_backward(gy, z, 1, 20), from_output=None,
        **_orders(_softplus_d), module=nn.Softplus,
        modules=(ModuleForm(nn.Softplus, lambda m: m.beta == 1 and m.threshold == 20,
                            _softplus_module_problem),),
        calls=(CallForm(F.softplus, "F.softplus", (("beta", 1), ("threshold", 20)),
                        {"beta": 1, "threshold": 20}),)),
    Activation(
        "sin", "sin", torch.sin, backward=lambda gy, z: gy * torch.cos(z), from_output=None,
        d1=torch.cos, d2=lambda z: torch.sin(z).neg_(), d3=lambda z: torch.cos(z).neg_(),
        module=Sin, modules=(ModuleForm(Sin),),
        calls=(CallForm(torch.sin, "torch.sin"),), methods=("sin",)),
    Activation(
        "relu", "ReLU", torch.relu,
        backward=lambda gy, z: _ATEN.threshold_backward(gy, z, 0),
        from_output=lambda gy, out: _ATEN.threshold_backward(gy, out, 0),
        d2=torch.zeros_like, d3=torch.zeros_like, module=nn.ReLU,
        modules=(ModuleForm(nn.ReLU),),
        calls=(CallForm(torch.relu, "torch.relu"), CallForm(F.relu, "F.relu", _INPLACE)),
        methods=("relu",)),
    Activation(
        "quick_gelu", "QuickGELU", _quick_gelu,
        backward=lambda gy, z: gy * _quick_gelu_derivative(z), from_output=None,
        d1=_quick_gelu_derivative, **_orders(_quick_gelu_d), module=QuickGELU,
        modules=(ModuleForm(QuickGELU), ModuleForm("QuickGELUActivation"))),
)

#: The activation names the fused ops take, in the C++ library's order (csrc/activations.h).
ACTIVATIONS = tuple(_C.ACTIVATIONS)

#: name -> its row.
REGISTRY: Dict[str, Activation] = {row.name: row for row in _ROWS}

assert set(REGISTRY) == set(ACTIVATIONS) and len(REGISTRY) == len(_ROWS), \
    f"one row per activation of the C++ library: {sorted(REGISTRY)} vs {sorted(ACTIVATIONS)}"

@functools.lru_cache(maxsize=None)
def _stock_tensors(name: str) -> int:
    return stock_tensors(REGISTRY[name].f)


def stock_tensors(f: Callable[[Tensor], Tensor]) -> int:
    """The (rows, width) tensors stock autograd keeps per layer for f, as saved_tensors_hooks
    sees them on a small non-leaf input (a Linear's output is one), its output counted (the next
    Linear keeps it); no random draw, whatever grad mode the caller is in."""
    with torch.inference_mode(False), torch.enable_grad():
        z = torch.linspace(-3, 3, 8, dtype=torch.float64, requires_grad=True) * 1.0
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                      lambda t: t):
            out = f(z)
    storages = {t.untyped_storage().data_ptr() for t in saved if t.dim() > 0}
    storages.add(out.untyped_storage().data_ptr())
    return len(storages)


#: Module classes close to an activation that the fused ops do not compute exactly, and why:
#: recognised so that reports say why they stay unfused.
NEAR_MISSES: Dict[str, str] = {
    "FastGELUActivation": "it computes GELU's tanh form with the rounded constant 0.7978845608, "
                          "not gelu_tanh exactly",
}

#: The module of each activation, as FusedMLP's equivalent nn.Sequential holds it.
MODULE_OF: Dict[str, Callable[[], nn.Module]] = {n: r.module for n, r in REGISTRY.items()}


def check_activation(name, where: str) -> str:
    if not isinstance(name, str) or name not in REGISTRY:
        raise ValueError(f"{where}: activation must be one of "
                         f"{', '.join(repr(a) for a in ACTIVATIONS)}; got {name!r}")
    return name


def activation_spec(activation, layers: int, last_activation: bool, where: str) -> str:
    """The mlp op's activation argument for ``activation``: one name, or a sequence with one name
    per layer with an activation (``layers``, or ``layers - 1`` when not ``last_activation``),
    joined by commas; a sequence of one name throughout is that name. ValueError naming expected
    and given otherwise."""
    if isinstance(activation, str):
        return check_activation(activation, where)
    try:
        names = list(activation)
    except TypeError:
        names = None
    activated = layers if last_activation else layers - 1
    if names is None or (layers > 0 and len(names) != activated) or not names:
        given = f"{len(names)} names" if names is not None else repr(activation)
        raise ValueError(f"{where}: activation must be one name or {activated} (one per layer "
                         f"with an activation: {layers} layers, "
                         f"{'the last one included' if last_activation else 'none after the last'})"
                         f"; got {given}")
    for name in names:
        check_activation(name, where)
    return names[0] if len(set(names)) == 1 else ",".join(names)


def layer_activations(spec: str, layers: int) -> List[str]:
    """One activation name per layer from the op's argument (the top one repeated when the
    spec has one name less: it is never applied)."""
    names = spec.split(",")
    if len(names) == 1:
        return names * layers
    return names + names[-1:] * (layers - len(names))


def activate(name: str, z: Tensor) -> Tensor:
    """f(z)."""
    return REGISTRY[name].f(z)


def activation_backward(name: str, gy: Tensor, z: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """gy·f'(z), elementwise: the backward through f, and the forward-mode tangent of f(z) for a
    tangent gy of z. ``out`` = f(z), where the caller has it: the rows whose PyTorch backward reads
    the output read it."""
    row = REGISTRY[name]
    if out is not None and row.from_output is not None:
        return row.from_output(gy, out)
    return row.backward(gy, z)


def derivative(name: str, z: Tensor) -> Tensor:
    """f'(z), from ATen ops."""
    return REGISTRY[name].derivative(z)


def second_derivative(name: str, z: Tensor) -> Tensor:
    """f''(z), from ATen ops."""
    return REGISTRY[name].d2(z)


def third_derivative(name: str, z: Tensor) -> Tensor:
    """f'''(z), from ATen ops."""
    return REGISTRY[name].d3(z)
