"""The forms of Linear fuse computes, one row each (:data:`FORMS`): how fuse knows one, reads its
weight and bias, what the op takes and a unit checks at each call, and why it refuses a module.
Nothing here imports peft, transformers or bitsandbytes. Design: docs/converter.md,
"Linear forms"."""
from __future__ import annotations

import inspect
import operator
import warnings
import weakref
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.nn.parameter import UninitializedTensorMixin
from torch.nn.utils import parametrize

from .._activation_arithmetic import rng_kept
from .._activation_modules import sig
from .._lora import LoRA
from ..modules import _has_hooks as has_hooks
from .engines import real_shape

Check = Tuple[Callable[[], bool], Callable[[], str]]  # (holds, describe): a facts.Condition's
LINEAR_FUNCTIONS = (F.linear, torch._C._nn.linear)
LINEAR_SIGNATURE = sig(("input", inspect.Parameter.empty), ("weight", inspect.Parameter.empty),
                       ("bias", None))


def linear_args(node: fx.Node):
    """(input, weight, bias) of an ``F.linear`` call; TypeError when they do not bind."""
    bound = LINEAR_SIGNATURE.bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    return bound.arguments["input"], bound.arguments["weight"], bound.arguments["bias"]


def base_type(m: nn.Module) -> type:
    """The module's class, or the class fuse gave it a member class (or FusedSequential) of."""
    return getattr(type(m), "_ckpt_ext_base", type(m))


def _conv1d(cls: type) -> bool:
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers")


class Form:
    """A form of Linear; its methods take a module of the form."""
    who = "the Linear"      # what its refusals call it
    transposed = False      # its weight is stored (in, out): the op takes ``weight.t()``
    parts = False           # its children are parts of it (a LoRA Linear's base and adapters)
    prefix = ""             # of its member class's name: Run{prefix}{class name}
    not_rewritten: Optional[str] = None  # why a rewritten forward cannot compute it

    def of_class(self, cls: type) -> bool:  # every module of class cls is of the form
        return False

    def problem(self, m: nn.Module) -> Optional[str]:  # why it is in no unit, whatever its state
        return None

    def traced(self, m: nn.Module) -> bool:  # its forward traced as any module's, not a Linear's
        return False

    def weight(self, m: nn.Module) -> Optional[torch.Tensor]:
        """What a unit computes in the dtype and device of, as stored; None if lazy."""
        w = m._parameters.get("weight")
        if w is None and parametrize.is_parametrized(m, "weight"):
            w = next(iter(m.parametrizations["weight"].parameters()), None)
        return None if w is None or isinstance(w, UninitializedTensorMixin) else w

    def terms(self, m: nn.Module) -> Optional[tuple]:
        """The op's (weight (out, in), bias, LoRA term) now; None: only its forward computes it."""
        return (m.weight.t() if self.transposed else m.weight), m.bias, None

    def size(self, m: nn.Module) -> Tuple[int, int]:  # (in, out)
        return m.in_features, m.out_features

    def width(self, m: nn.Module) -> tuple:  # the survey's Fact.width
        w = self.weight(m)
        return (*self.size(m), w.element_size() if w is not None else 0, 0, 0,
                w is None or w.requires_grad, 0)

    def checks(self, m: nn.Module, label: str) -> List[Check]:  # at each call, beyond every form's
        return []


class Read(NamedTuple):
    """All the survey asks of a module's row (:func:`reads`): what refusals call it, its problem,
    stored weight, checks, width and whether it is traced."""
    who: str
    problem: Optional[str]
    weight: Optional[torch.Tensor]
    checks: List[Check]
    width: tuple
    traced: bool


class _Linear(Form):
    """torch's ``nn.Linear``: x·Wᵀ + b."""

    def of_class(self, cls: type) -> bool:
        return cls is nn.Linear


class _Conv1D(Form):
    """transformers' ``Conv1D`` (GPT-2's projections): x·W + b with W stored (in, out)."""
    transposed = True

    def of_class(self, cls: type) -> bool:
        return _conv1d(cls)

    def size(self, m: nn.Module) -> Tuple[int, int]:
        return tuple(real_shape(m.weight))


class _LoRA(Form):
    """peft's LoRA Linears, read at each call as peft's forward reads them (:meth:`term`, or
    :meth:`state_problem` where peft computes something else). This row: peft's other LoRA
    Linears (8-bit, GPTQ, AWQ, HQQ, torchao, ... bases), refused. Design: docs/converter.md."""
    who, parts, prefix = "the LoRA Linear", True, "Lora"
    not_rewritten = "a LoRA Linear, which a rewritten forward does not compute"
    trains_base = False  # its base weight is a tensor autograd trains (not a quantized base's)
    named: Optional[Tuple[str, str]] = None  # (module, qualname) of its class

    def of_class(self, cls: type) -> bool:
        return (cls.__module__, cls.__qualname__) == self.named if self.named else \
            cls.__module__.startswith("peft.tuners.lora.") and "Linear" in cls.__name__

    def problem(self, m: nn.Module) -> Optional[str]:
        return (f"peft's {type(m).__module__.rsplit('.', 1)[-1]}.{type(m).__name__} over "
                f"{type(m._modules['base_layer']).__name__}: fuse computes the LoRA Linears over "
                f"nn.Linear, transformers' Conv1D and bitsandbytes' Linear4bit")

    def adapters_problem(self, m: nn.Module) -> Optional[str]:
        for adapter, a in m.lora_A.items():
            parts = (a, m.lora_B[adapter], m.lora_dropout[adapter])
            if type(parts[0]) is not nn.Linear or type(parts[1]) is not nn.Linear or \
                    type(parts[2]) not in (nn.Dropout, nn.Identity):
                return (f"adapter {adapter!r} is not peft's vanilla lora_A, lora_B and "
                        f"lora_dropout ({', '.join(type(p).__name__ for p in parts)})")
        return "it holds embedding adapters" if len(m.lora_embedding_A) else None

    def weight(self, m: nn.Module) -> Optional[torch.Tensor]:  # a quantized base's: lora_A's
        return next((a.weight for a in m.lora_A.values()), None)

    def size(self, m: nn.Module) -> Tuple[int, int]:
        return int(m.in_features), int(m.out_features)

    def state_problem(self, m: nn.Module) -> Optional[str]:
        """None while peft's forward computes the base plus at most one vanilla term."""
        if m.disable_adapters and m.merged:
            return "its adapters are disabled while merged: peft unmerges them at this call"
        active = [] if m.disable_adapters or m.merged else _active(m)
        if len(active) > 1:
            return f"several adapters are active ({', '.join(active)}): peft adds each one's term"
        for a in active:
            if a in m.lora_variant or a in m.lora_magnitude_vector:
                kind = "DoRA" if a in m.lora_magnitude_vector else type(m.lora_variant[a]).__name__
                return f"adapter {a!r} is a LoRA variant ({kind}), not vanilla LoRA"
        return None

    def term(self, m: nn.Module) -> Optional[LoRA]:
        """The term peft's forward adds now (``state_problem`` None), or None."""
        active = [] if m.disable_adapters or m.merged else _active(m)
        if not active:
            return None
        a, drop = active[0], m.lora_dropout[active[0]]
        p = float(drop.p) if isinstance(drop, nn.Dropout) and drop.training else 0.0
        return LoRA(m.lora_A[a].weight, m.lora_B[a].weight, m.scaling[a], m.lora_B[a].bias, p)

    def width(self, m: nn.Module) -> tuple:
        t = self.term(m) if self.state_problem(m) is None else None
        w, base = self.weight(m), m._modules["base_layer"]._parameters.get("weight")
        item = w.element_size() if w is not None else 0
        cast = t.A.element_size() if t is not None and self.trains_base and base is not None \
            and t.A.dtype != base.dtype else 0  # peft casts the input to the adapter's dtype
        mask = (1 if w.device.type == "cuda" else cast or item) if t is not None and \
            t.dropout > 0 else 0
        return (*self.size(m), item, int(real_shape(t.A)[0]) if t is not None else 0, mask,
                self.trains_base and base is not None and base.requires_grad, cast)

    def checks(self, m: nn.Module, label: str) -> List[Check]:
        def problem() -> Optional[str]:  # a state the unit computes, nothing on its parts
            for name, sub in m.named_modules():
                if name and (has_hooks(sub) or "forward" in vars(sub)):
                    return f"{label}.{name} has hooks or a forward of its own, which the fused " \
                           f"op would not call"
            why = self.state_problem(m)
            return f"{label}: {why}" if why else None
        return [(lambda: problem() is None, lambda: problem() or "")]


def _active(m: nn.Module) -> List[str]:
    return [a for a in m.active_adapters if a in m.lora_A]


class _LoRALinear(_LoRA):
    """peft's ``lora.Linear`` over an ``nn.Linear`` or a transformers ``Conv1D``
    (``fan_in_fan_out``): the op takes the base's weight and bias and the active term."""
    named, trains_base = ("peft.tuners.lora.layer", "Linear"), True

    def problem(self, m: nn.Module) -> Optional[str]:
        b = m._modules["base_layer"]
        if type(b) is not nn.Linear and not _conv1d(type(b)):
            return (f"lora.{type(m).__name__} over {type(b).__name__}: its base layer is not an "
                    f"nn.Linear or a transformers Conv1D")
        if _conv1d(type(b)) != bool(getattr(m, "fan_in_fan_out", False)):
            return f"fan_in_fan_out is {m.fan_in_fan_out} over a {type(b).__name__} base layer"
        return self.adapters_problem(m)

    def weight(self, m: nn.Module) -> Optional[torch.Tensor]:
        return m._modules["base_layer"]._parameters.get("weight")

    def terms(self, m: nn.Module) -> Optional[tuple]:
        b = m._modules["base_layer"]
        return (b.weight.t() if _conv1d(type(b)) else b.weight), b.bias, self.term(m)


class _QLoRA(_LoRA):
    """QLoRA: peft's ``lora.bnb.Linear4bit`` over bitsandbytes' ``Linear4bit``, whose weight only
    its own forward dequantizes: the unit calls that forward, inside the unit."""
    named = ("peft.tuners.lora.bnb", "Linear4bit")

    def problem(self, m: nn.Module) -> Optional[str]:
        b = m._modules["base_layer"]
        if (type(b).__module__, type(b).__qualname__) != ("bitsandbytes.nn.modules", "Linear4bit"):
            return f"its base layer is {type(b).__name__}, not bitsandbytes' Linear4bit"
        if b.bias is not None and b.bias.requires_grad:
            return "its 4-bit base layer's bias requires grad"
        return self.adapters_problem(m)

    def terms(self, m: nn.Module) -> Optional[tuple]:
        return None


class _Traced(Form):
    """A subclass of ``nn.Linear``, or any module holding only ``weight`` (out, in) and ``bias``,
    whose forward tracing shows computes x·Wᵀ + b (``input @ self.weight.T + self.bias``, ...);
    asked again at each call. :meth:`problem` says why a subclass is not of the form."""

    def of_class(self, cls: type) -> bool:
        return issubclass(cls, nn.Linear)

    def problem(self, m: nn.Module) -> Optional[str]:
        name = type(m).__name__
        if parametrize.is_parametrized(m):
            return (f"{name}: its weight is computed by a parametrization "
                    f"({', '.join(m.parametrizations)}), which the fused op would not run")
        if isinstance(m, nn.modules.lazy.LazyModuleMixin):
            return f"{name} is a lazy layer: its weight is made at its first call"
        w = m._parameters.get("weight")
        extra = [n for n in m._parameters if n not in ("weight", "bias")] + \
            list(m._buffers) + list(m._modules)
        why = f"it holds {', '.join(extra)} besides its weight and bias" if extra else \
            "its weight is not a matrix" if w is None or len(real_shape(w)) != 2 else _traced(m)
        return f"{name} subclasses nn.Linear; {why}" if why else None

    def traced(self, m: nn.Module) -> bool:
        return self.problem(m) is not None

    def size(self, m: nn.Module) -> Tuple[int, int]:
        return super().size(m) if isinstance(m, nn.Linear) else tuple(real_shape(m.weight))[::-1]

    def checks(self, m: nn.Module, label: str) -> List[Check]:
        return [(lambda: _traced(m) is None,
                 lambda: f"{label}: its class's forward changed since fuse: {_traced(m)}")]


LINEAR, CONV1D, TRACED = _Linear(), _Conv1D(), _Traced()
LORA, QLORA, OTHER_LORA = _LoRALinear(), _QLoRA(), _LoRA()
#: every form: the first whose class test holds is a module's (peft's before their kin)
FORMS: Tuple[Form, ...] = (LORA, QLORA, OTHER_LORA, CONV1D, LINEAR, TRACED)
_CLASS_FORMS: "weakref.WeakKeyDictionary[type, Optional[Form]]" = weakref.WeakKeyDictionary()


def class_form(cls: type) -> Optional[Form]:
    """The row of class ``cls``'s modules (a member class: its base's), remembered per class."""
    cls = getattr(cls, "_ckpt_ext_base", cls)
    if cls not in _CLASS_FORMS:
        _CLASS_FORMS[cls] = next((f for f in FORMS if f.of_class(cls)), None)
    return _CLASS_FORMS[cls]


def form_of(m: nn.Module) -> Optional[Form]:
    """Module ``m``'s row: its class's, or the traced form where its class is no row's but its
    forward computes x·Wᵀ + b of its weight; None: not a Linear."""
    found, cls = class_form(type(m)), base_type(m)
    if found is None and "weight" in m._parameters and not m._modules and \
            cls.forward is not nn.Module.forward and not cls.__module__.startswith("torch.") and \
            TRACED.problem(m) is None:
        return TRACED
    return found


def forms(modules: Iterable[nn.Module]) -> Dict[int, Optional[Form]]:
    """:func:`form_of` each module, by id."""
    return {id(m): form_of(m) for m in modules}


def reads(modules: Iterable[nn.Module], forms: Dict[int, Optional[Form]]) -> Dict[int, Read]:
    """Each module's :class:`Read` by its row, by id: in one call, its work in this file."""
    return {id(m): Read(f.who, f.problem(m), f.weight(m), f.checks(m, f.who), f.width(m),
                        f.traced(m)) for m in modules for f in [forms[id(m)]]}


def stored_weight(m: nn.Module) -> Optional[torch.Tensor]:
    return (class_form(type(m)) or TRACED).weight(m)


def op_terms(m: nn.Module) -> Optional[tuple]:
    return (class_form(type(m)) or TRACED).terms(m)


def one_dtype_device(layers: Sequence[nn.Module], labels: Sequence[str]) -> Check:
    """Linears whose stored weights are made and share one dtype and device."""
    def holds() -> bool:
        weights = [stored_weight(layer) for layer in layers]
        return None not in weights and len({(w.dtype, w.device) for w in weights}) == 1

    def describe() -> str:
        weights = [stored_weight(layer) for layer in layers]
        if None in weights:
            return "a weight is not made yet (a lazy layer)"
        return ("its Linears' weights are of different dtypes or devices (" + ", ".join(
            f"{label}: {w.dtype} on {w.device}" for label, w in zip(labels, weights)) + ")")
    return holds, describe


# -- Does a forward compute x·Wᵀ + b? --------------------------------------------------------------

_TRACED: "weakref.WeakKeyDictionary[type, dict]" = weakref.WeakKeyDictionary()
_TRANSPOSES = {(getattr, "T"), (getattr, "mT"), ("t",), (torch.t,)} | {
    (f, *d) for f in ("transpose", torch.transpose) for d in ((0, 1), (1, 0), (-1, -2), (-2, -1))}


def _traced(m: nn.Module) -> Optional[str]:
    """Why ``m``'s class forward does not compute x·Wᵀ + b, None where it does: remembered per
    class, forward and whether it has a bias."""
    bias = m._parameters.get("bias") is not None
    known = _TRACED.setdefault(base_type(m), {})
    key = (base_type(m).forward, bias)
    if key not in known:
        known[key] = _reads(m) or _trace(m, bias)
    return known[key]


def _reads(m: nn.Module) -> Optional[str]:
    """The attributes but weight and bias its class's forwards name (a flag, ``self.training``):
    a trace follows one value of each."""
    cls = base_type(m)
    names = dict.fromkeys(n for c in cls.__mro__ if "forward" in vars(c) and c is not nn.Module
                          for n in getattr(getattr(vars(c)["forward"], "__code__", None),
                                           "co_names", ()))
    reads = [f"self.{n}" for n in names if n not in ("weight", "bias") and (
        n in vars(m) or hasattr(cls, n) and not callable(getattr(cls, n)))]
    return f"its forward reads {', '.join(reads)}" if reads else None


def _trace(m: nn.Module, bias: bool) -> Optional[str]:
    """Its class's forward traced by torch.fx on a copy holding only its weight and bias, on the
    meta device: None where it is x·Wᵀ + b."""
    try:  # what the forward draws on the copy is drawn from no generator of the user's
        with rng_kept(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            clone = base_type(m).__new__(base_type(m))  # its weight and bias only, on meta
            nn.Module.__init__(clone)
            clone.training = m.training
            for name, p in m._parameters.items():
                clone._parameters[name] = p if p is None else nn.Parameter(torch.empty(
                    real_shape(p), dtype=p.dtype, device="meta"), p.requires_grad)
            graph = fx.Tracer().trace(clone)
        return None if _affine(graph, bias) else \
            f"its forward computes {_described(graph)}, not x·Wᵀ + b"
    except Exception as e:  # fx raises many types (TraceError, TypeError, ...)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"torch.fx cannot trace its forward ({type(e).__name__}: {msg[:120]})"


def _affine(graph: fx.Graph, bias: bool) -> bool:
    """Whether ``graph`` computes input·weightᵀ (+ bias where ``bias``) and nothing else."""
    nodes = list(graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    attrs = {n.target: n for n in nodes if n.op == "get_attr"}
    if len(inputs) != 1 or set(attrs) != {"weight"} | ({"bias"} if bias else set()):
        return False
    x, w, b = inputs[0], attrs["weight"], attrs.get("bias")
    seen = {x, w, b, nodes[-1]} - {None}

    def call(n, *targets) -> bool:
        return isinstance(n, fx.Node) and n.target in targets and not seen.add(n)

    def product(n, with_bias) -> bool:  # x·Wᵀ, + b where with_bias is b
        if call(n, *LINEAR_FUNCTIONS):
            try:
                return linear_args(n) == (x, w, with_bias)
            except TypeError:
                return False
        t = n.args[1] if call(n, operator.matmul, torch.matmul) and len(n.args) == 2 and \
            not n.kwargs and n.args[0] is x else None
        return with_bias is None and call(t, *{f[0] for f in _TRANSPOSES}) and not t.kwargs and \
            t.args[0] is w and (t.target, *t.args[1:]) in _TRANSPOSES

    out = nodes[-1].args[0]
    ok = product(out, b) or b is not None and call(out, operator.add, torch.add) and \
        not out.kwargs and len(out.args) == 2 and b in out.args and \
        product(out.args[out.args[0] is b], None)
    return ok and seen == set(nodes)


def _described(graph: fx.Graph) -> str:
    calls = [f"{getattr(n.target, '__name__', n.target)}({', '.join(map(str, n.args))})"
             for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    return ", ".join(calls)[:200] or "no call"
