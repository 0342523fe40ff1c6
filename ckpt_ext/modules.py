"""Drop-in modules built on the fused ops: :class:`FusedLinearTanh` (one Linear+Tanh),
:class:`FusedTanhMLP` (a whole run of Linear layers with tanh between them, recomputed as one),
:class:`FusedMLP` (the same with any activation of ``ckpt_ext.ACTIVATIONS``, or one per layer) and
:class:`FusedGatedMLP` (the gated MLP of Llama-style transformers)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ._activation_modules import module_activation as recognise
from ._activations import MODULE_OF, activation_spec, check_activation
from .ops import gated_mlp, linear_tanh, mlp, tanh_mlp


class FusedLinearTanh(nn.Module):
    """``nn.Sequential(nn.Linear(in_features, out_features), nn.Tanh())`` in one module whose
    backward recomputes the activation instead of keeping it.

    Parameters are named ``weight`` (out_features, in_features) and ``bias`` (out_features) and are
    initialised exactly as ``nn.Linear`` does (same seed, same values). It deliberately does not
    subclass ``nn.Linear``: tools that replace every ``nn.Linear`` (quantizers, LoRA injectors)
    would otherwise swap it for a plain Linear and silently drop the tanh.
    """

    __constants__ = ["in_features", "out_features"]

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty((out_features, in_features), **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's own initialisation, called on our parameters: the same RNG draws in the same
        # order, so a seeded FusedLinearTanh equals a seeded nn.Linear.
        nn.Linear.reset_parameters(self)  # type: ignore[arg-type]

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "FusedLinearTanh":
        """A FusedLinearTanh that shares (not copies) ``linear``'s parameters, so an optimizer
        built over the Linear keeps updating them."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear expects an nn.Linear, got {type(linear).__name__}")
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.in_features = linear.in_features
        m.out_features = linear.out_features
        m.weight = linear.weight
        if linear.bias is not None:
            m.bias = linear.bias
        else:
            m.register_parameter("bias", None)
        return m

    def forward(self, x: Tensor) -> Tensor:
        return linear_tanh(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


def _has_hooks(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or getattr(m, "_backward_pre_hooks", None))


class _LinearRun(nn.Module):
    """What FusedTanhMLP and FusedMLP share: their Linear layers, registered under their
    ``nn.Sequential`` indices (or a source run's names), made or adopted."""

    _layer_names: Tuple[str, ...]

    def _make_layers(self, where: str, sizes: Sequence[int], bias, device, dtype) -> None:
        sizes = [int(s) for s in sizes]
        if len(sizes) < 2:
            raise ValueError(f"{where}: sizes must hold at least 2 entries (in_features, "
                             f"out_features), got {sizes}")
        self._layer_names = tuple(str(2 * i) for i in range(len(sizes) - 1))
        # In layer order: the same RNG draws as the nn.Sequential (activations draw nothing).
        for name, k, n in zip(self._layer_names, sizes[:-1], sizes[1:]):
            self.add_module(name, nn.Linear(k, n, bias=bias, device=device, dtype=dtype))

    @classmethod
    def _adopt(cls, modules, where: str, activation: Optional[str]):
        """(a new instance sharing the Linears of run ``modules``, its (name, module) list);
        ValueError naming the problem when ``modules`` is not such a run (run_problem)."""
        named = _named(modules)
        problem = run_problem([m for _, m in named], activation=activation)
        if problem is not None:
            raise ValueError(f"{where}: {problem}")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._layer_names = tuple(name for name, m in named if type(m) is nn.Linear)
        for name, m in named:
            if type(m) is nn.Linear:
                self.add_module(name, m)
        return self, named

    def layers(self) -> List[nn.Linear]:
        return [self._modules[name] for name in self._layer_names]

    @property
    def sizes(self) -> List[int]:
        layers = self.layers()
        return [layers[0].in_features] + [lin.out_features for lin in layers]


class FusedTanhMLP(_LinearRun):
    """``nn.Sequential(Linear(s0, s1), Tanh(), Linear(s1, s2), Tanh(), ..., Linear(s_{L-1}, s_L))``
    (and a final ``Tanh()`` when ``last_tanh``) as one module whose autograd keeps only its input.

    This is the unit that saves memory: in such a run every tanh output is also the next Linear's
    input, so recomputing one Linear+Tanh at a time frees only the run's last activation, while
    recomputing the run (:func:`ckpt_ext.tanh_mlp`) frees all of them but the input.

    The layers are ``nn.Linear`` modules registered under the indices they have in the equivalent
    ``nn.Sequential`` ("0", "2", "4", ...), so the two have the same ``state_dict`` keys and load
    each other's checkpoints, and a seeded ``FusedTanhMLP`` has the same initial values as the
    seeded ``nn.Sequential``. Only their ``weight`` and ``bias`` are used: a layer replaced by
    something else (a LoRA or quantized wrapper) or given hooks makes ``forward`` raise, rather
    than silently compute without it.
    """

    def __init__(self, sizes: Sequence[int], bias: bool = True, last_tanh: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.last_tanh = bool(last_tanh)
        self._make_layers("FusedTanhMLP", sizes, bias, device, dtype)

    @classmethod
    def from_modules(cls, modules: Union[Sequence[nn.Module], Mapping[str, nn.Module],
                                         nn.Sequential]) -> "FusedTanhMLP":
        """A FusedTanhMLP over an existing run ``Linear, Tanh, Linear, ..., Linear[, Tanh]``,
        sharing (not copying) the Linear modules and so their parameters: an optimizer built over
        them keeps training them. A sequence (or ``nn.Sequential``) registers the Linears under
        their indices, a mapping under its keys, so ``state_dict`` keys are those of the source."""
        self, named = cls._adopt(modules, "FusedTanhMLP.from_modules", "tanh")
        self.last_tanh = type(named[-1][1]) is not nn.Linear
        return self

    def forward(self, x: Tensor) -> Tensor:
        weights, biases = _layer_params(self)
        return tanh_mlp(x, weights, biases, self.last_tanh)

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}, last_tanh={self.last_tanh}"


def _layer_params(module: nn.Module):
    """(weights, biases) of a FusedTanhMLP / FusedMLP's layers; raises where a layer is no longer
    a plain nn.Linear, whose weight and bias alone the fused op would compute with."""
    weights, biases = [], []
    for name in module._layer_names:
        lin = module._modules[name]
        if type(lin) is not nn.Linear or _has_hooks(lin):
            what = (f"was replaced by {type(lin).__name__}" if type(lin) is not nn.Linear
                    else "has hooks")
            raise RuntimeError(
                f"{type(module).__name__}: layer {name!r} {what}; this module computes with the "
                f"layers' weight and bias only and would not run it. Use an nn.Sequential instead.")
        weights.append(lin.weight)
        biases.append(lin.bias)
    return weights, biases


def module_activation(m: nn.Module) -> Optional[str]:
    """The activation of ``ckpt_ext.ACTIVATIONS`` that module ``m`` computes exactly, else None:
    the converter's table (torch's modules and transformers'), so both accept the same ones."""
    found = recognise(m)
    return None if found is None else found.name


def _named(modules) -> List[Tuple[str, nn.Module]]:
    if isinstance(modules, Mapping):
        return [(str(k), v) for k, v in modules.items()]
    if isinstance(modules, nn.Sequential):
        return list(modules._modules.items())
    return [(str(i), m) for i, m in enumerate(modules)]


#: What a fused module or run computes after its layers: one name of ``ckpt_ext.ACTIVATIONS``
#: (every activated layer the same), or one name per activated layer (a mixed run).
LayerActivations = Union[str, Tuple[str, ...]]


def collapse_activations(names: Sequence[str]) -> LayerActivations:
    """Valid per-layer names as a fused module or run keeps them: the name when they are all the
    same (``mlp`` computes that as the name, to the bit), else their tuple."""
    names = tuple(names)
    return names[0] if names and len(set(names)) == 1 else names


def checked_activations(activation, layers: int, last_activation: bool,
                        where: str) -> LayerActivations:
    """``activation`` (one name, or one per layer with an activation) checked as ``mlp`` checks
    it, and collapsed; ValueError naming what was expected and given."""
    return collapse_activations(activation_spec(activation, layers, last_activation,
                                                where).split(","))


def each_layer(activation: LayerActivations, count: int) -> Tuple[str, ...]:
    """The name of each of ``count`` activated layers."""
    return (activation,) * count if isinstance(activation, str) else tuple(activation)


def as_mlp_argument(activation: LayerActivations) -> Union[str, List[str]]:
    """``activation`` as :func:`ckpt_ext.mlp` takes it: the name, or the list of names."""
    return activation if isinstance(activation, str) else list(activation)


class FusedMLP(_LinearRun):
    """``nn.Sequential(Linear(s0, s1), Act(), Linear(s1, s2), Act(), ..., Linear(s_{L-1}, s_L))``
    (and a final ``Act()`` when ``last_activation``) as one module whose autograd keeps only its
    input, for any ``activation`` of ``ckpt_ext.ACTIVATIONS`` (:func:`ckpt_ext.mlp`).

    ``activation`` is one name, or one name per activated layer (``len(sizes) - 1`` names with
    ``last_activation``, one fewer without): an RL actor ``Linear, ReLU, Linear, ReLU, Linear,
    Tanh`` is ``FusedMLP([obs, 64, 64, act], ["relu", "relu", "tanh"])``. The ``activation``
    attribute is the name (a str) when every layer has the same one, a list of equal names
    included, else the tuple of names.

    As :class:`FusedTanhMLP`: the Linears are registered under their ``nn.Sequential`` indices
    ("0", "2", ...), so ``state_dict`` keys and seeded initial values are the Sequential's.
    """

    def __init__(self, sizes: Sequence[int], activation: Union[str, Sequence[str]] = "tanh",
                 bias: bool = True, last_activation: bool = True, device=None,
                 dtype=None) -> None:
        super().__init__()
        self.last_activation = bool(last_activation)
        self._make_layers("FusedMLP", sizes, bias, device, dtype)
        self.activation = checked_activations(activation, len(self._layer_names),
                                              self.last_activation, "FusedMLP")

    def _activated(self) -> int:
        """How many layers an activation follows."""
        return len(self._layer_names) - (not self.last_activation)

    @classmethod
    def from_modules(cls, modules: Union[Sequence[nn.Module], Mapping[str, nn.Module],
                                         nn.Sequential]) -> "FusedMLP":
        """A FusedMLP over an existing run ``Linear, Act, Linear, ..., Linear[, Act]`` (each
        activation module one that :func:`module_activation` names, the same or differing from
        layer to layer, see :func:`run_problem`), sharing its Linears."""
        self, named = cls._adopt(modules, "FusedMLP.from_modules", None)
        self.last_activation = type(named[-1][1]) is not nn.Linear
        names = [module_activation(m) for _, m in named[1::2]]
        self.activation = collapse_activations(names) if names else "tanh"
        return self

    def to_sequential(self) -> nn.Sequential:
        """The equivalent nn.Sequential over the same Linears (sin as ``ckpt_ext.models.Sin``)."""
        mods = {}
        layers = self.layers()
        names = each_layer(self.activation, self._activated())
        for i, (name, lin) in enumerate(zip(self._layer_names, layers)):
            mods[name] = lin
            if i < len(names):
                mods[str(int(name) + 1)] = MODULE_OF[names[i]]()
        return nn.Sequential(OrderedDict(mods))

    def forward(self, x: Tensor) -> Tensor:
        weights, biases = _layer_params(self)
        return mlp(x, weights, biases, as_mlp_argument(self.activation), self.last_activation)

    def extra_repr(self) -> str:
        return (f"sizes={self.sizes}, activation={self.activation!r}, "
                f"last_activation={self.last_activation}")


def run_problem(modules: Iterable[nn.Module], activation: Optional[str] = "tanh"
                ) -> Union[str, None]:
    """None when ``modules`` is a run a fused module can take over — ``Linear, Act, Linear, ...``,
    starting with a Linear, Linears and activations alternating, each exactly ``nn.Linear`` or an
    activation module (``activation``'s throughout, or, with None, any that
    :func:`module_activation` names, one per layer), without hooks, widths chaining, one dtype and
    device — else why not."""
    modules = list(modules)
    if not modules:
        return "the run is empty"
    prev_out, ref = None, None
    act_name = ("Tanh" if activation == "tanh" else f"an activation module computing {activation}"
                if activation is not None else "an activation module of ckpt_ext.ACTIVATIONS")
    for i, m in enumerate(modules):
        if i % 2 == 1:
            found = module_activation(m)
            if found is None or (activation is not None and found != activation):
                return (f"entry {i} must be exactly {act_name} (Linear and activation modules "
                        f"alternate, starting with a Linear), got {type(m).__name__}"
                        + ("" if found is None else f" ({found})"))
        elif type(m) is not nn.Linear:
            return (f"entry {i} must be exactly Linear (Linear and activation modules alternate, "
                    f"starting with a Linear), got {type(m).__name__}")
        if _has_hooks(m):
            return f"entry {i} ({type(m).__name__}) has hooks, which the fused run would not call"
        if i % 2 == 0:
            if prev_out is not None and m.in_features != prev_out:
                return (f"entry {i}: in_features {m.in_features} does not match the previous "
                        f"Linear's out_features {prev_out}")
            prev_out = m.out_features
            if ref is None:
                ref = m.weight
            elif m.weight.dtype != ref.dtype or m.weight.device != ref.device:
                return (f"entry {i}: weight is {m.weight.dtype} on {m.weight.device}, the first "
                        f"Linear's is {ref.dtype} on {ref.device}")
    return None


class FusedGatedMLP(nn.Module):
    """The gated MLP of Llama, Mistral, Qwen2 and Gemma, ``down_proj(act(gate_proj(x)) *
    up_proj(x))``, as one module whose autograd keeps only its input (:func:`ckpt_ext.gated_mlp`).

    Its submodules are ``nn.Linear`` named ``gate_proj`` (hidden → intermediate), ``up_proj``
    (likewise) and ``down_proj`` (intermediate → hidden), made in that order, so a ``LlamaMLP``'s
    state dict loads into it unchanged and a seeded one starts from the same values.
    ``activation``: one name of ``ckpt_ext.ACTIVATIONS`` ("silu": SwiGLU; "gelu_tanh": Gemma's
    GeGLU).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu",
                 bias: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        self.activation = check_activation(activation, "FusedGatedMLP")
        factory = {"bias": bias, "device": device, "dtype": dtype}
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **factory)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **factory)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **factory)

    @classmethod
    def from_modules(cls, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear,
                     activation: str = "silu") -> "FusedGatedMLP":
        """A FusedGatedMLP over existing Linears, sharing (not copying) them, so an optimizer
        built over them keeps updating the same parameters."""
        where = "FusedGatedMLP.from_modules"
        for name, m in (("gate_proj", gate_proj), ("up_proj", up_proj), ("down_proj", down_proj)):
            if type(m) is not nn.Linear:
                raise TypeError(f"{where}: {name} must be exactly nn.Linear, got "
                                f"{type(m).__name__}")
        if (up_proj.in_features, up_proj.out_features) != (gate_proj.in_features,
                                                           gate_proj.out_features):
            raise ValueError(f"{where}: up_proj must have gate_proj's shape (in_features="
                             f"{gate_proj.in_features}, out_features={gate_proj.out_features}), "
                             f"got ({up_proj.in_features}, {up_proj.out_features})")
        if down_proj.in_features != gate_proj.out_features:
            raise ValueError(f"{where}: down_proj.in_features must equal the intermediate size "
                             f"{gate_proj.out_features}, got {down_proj.in_features}")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.activation = check_activation(activation, where)
        self.hidden_size, self.intermediate_size = gate_proj.in_features, gate_proj.out_features
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        return self

    def forward(self, x: Tensor) -> Tensor:
        g, u, d = self.gate_proj, self.up_proj, self.down_proj
        return gated_mlp(x, g.weight, u.weight, d.weight, g.bias, u.bias, d.bias,
                         self.activation)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"activation={self.activation!r}")
