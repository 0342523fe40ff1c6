"""peft's LoRA Linears as Linears of a unit: ``lora.Linear`` over an ``nn.Linear`` or a transformers
``Conv1D`` (``fan_in_fan_out``), and QLoRA's ``lora.bnb.Linear4bit`` over a bitsandbytes 4-bit
Linear. A unit reads such a Linear's state at every call as peft's forward reads it: the base
alone where the adapters are disabled or merged into the base weight, else the base plus the one
active vanilla adapter's term (:func:`term`). Where peft computes something else (several active
adapters, a variant such as DoRA, adapters disabled while merged, which peft unmerges at that
call), :func:`state_problem` says so and the unit is computed module by module. Nothing here
imports peft. Design: docs/converter.md, "LoRA"."""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from .._lora import LoRA
from .zero3 import real_shape

_FORMS = {("peft.tuners.lora.layer", "Linear"): "lora",
          ("peft.tuners.lora.bnb", "Linear4bit"): "qlora"}
_FOUR_BIT = ("bitsandbytes.nn.modules", "Linear4bit")


def _named(cls: type) -> Tuple[str, str]:
    return cls.__module__, cls.__qualname__


def class_form(cls: type) -> Optional[str]:
    """"lora" (peft's ``lora.Linear``), "qlora" (``lora.bnb.Linear4bit``), "other" (another LoRA
    Linear of peft's: 8-bit, GPTQ, AWQ, HQQ, torchao, ... bases), else None."""
    cls = getattr(cls, "_ckpt_ext_base", cls)
    other = cls.__module__.startswith("peft.tuners.lora.") and "Linear" in cls.__name__
    return _FORMS.get(_named(cls), "other" if other else None)


def form(m: nn.Module) -> Optional[str]:
    return class_form(type(m))


def base(m: nn.Module) -> nn.Module:
    return m._modules["base_layer"]


def _conv1d(b: nn.Module) -> bool:
    cls = type(b)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers")


def problem(m: nn.Module) -> Optional[str]:
    """What keeps this LoRA Linear from any unit, whatever its state."""
    b, name = base(m), type(m).__name__
    if form(m) == "other":
        where = type(m).__module__.rsplit('.', 1)[-1]
        return (f"peft's {where}.{name} over {type(b).__name__}: fuse computes the LoRA Linears "
                f"over nn.Linear, transformers' Conv1D and bitsandbytes' Linear4bit")
    if form(m) == "qlora":
        if _named(type(b)) != _FOUR_BIT:
            return f"its base layer is {type(b).__name__}, not bitsandbytes' Linear4bit"
        if b.bias is not None and b.bias.requires_grad:
            return "its 4-bit base layer's bias requires grad"
    elif type(b) is not nn.Linear and not _conv1d(b):
        return (f"lora.{name} over {type(b).__name__}: its base layer is not an nn.Linear or a "
                f"transformers Conv1D")
    elif _conv1d(b) != bool(getattr(m, "fan_in_fan_out", False)):
        return f"fan_in_fan_out is {m.fan_in_fan_out} over a {type(b).__name__} base layer"
    for adapter, a in m.lora_A.items():
        parts = (a, m.lora_B[adapter], m.lora_dropout[adapter])
        if type(parts[0]) is not nn.Linear or type(parts[1]) is not nn.Linear or \
                type(parts[2]) not in (nn.Dropout, nn.Identity):
            return (f"adapter {adapter!r} is not peft's vanilla lora_A, lora_B and lora_dropout "
                    f"({', '.join(type(p).__name__ for p in parts)})")
    if len(m.lora_embedding_A):
        return "it holds embedding adapters"
    return None


def _active(m: nn.Module) -> List[str]:
    return [a for a in m.active_adapters if a in m.lora_A]


def state_problem(m: nn.Module) -> Optional[str]:
    """None while peft's forward computes the base plus at most one vanilla term, else what it
    computes instead."""
    if m.disable_adapters and m.merged:
        return "its adapters are disabled while merged: peft unmerges them at this call"
    if m.disable_adapters or m.merged:
        return None
    active = _active(m)
    if len(active) > 1:
        return f"several adapters are active ({', '.join(active)}): peft adds each one's term"
    for a in active:
        if a in m.lora_variant or a in m.lora_magnitude_vector:
            kind = "DoRA" if a in m.lora_magnitude_vector else type(m.lora_variant[a]).__name__
            return f"adapter {a!r} is a LoRA variant ({kind}), not vanilla LoRA"
    return None


def term(m: nn.Module) -> Optional[LoRA]:
    """The LoRA term peft's forward adds now (``state_problem`` None), or None: lora_A and
    lora_B's weights, lora_B's bias, the scaling and the p of the mask its dropout draws."""
    if m.disable_adapters or m.merged:
        return None
    active = _active(m)
    if not active:
        return None
    a = active[0]
    drop = m.lora_dropout[a]
    p = float(drop.p) if isinstance(drop, nn.Dropout) and drop.training else 0.0
    return LoRA(m.lora_A[a].weight, m.lora_B[a].weight, m.scaling[a], m.lora_B[a].bias, p)


def weight_bias(m: nn.Module) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A ``lora.Linear``'s base weight as the ops take it, (out, in), and its bias."""
    b = base(m)
    return (b.weight.t() if _conv1d(b) else b.weight), b.bias


def stored_weight(m: nn.Module) -> Optional[torch.Tensor]:
    """The tensor whose dtype and device the unit computes in: the base weight, or a 4-bit base's
    first adapter's lora_A weight."""
    if form(m) == "lora":
        return base(m)._parameters.get("weight")
    return next((a.weight for a in m.lora_A.values()), None)


def width(m: nn.Module) -> Tuple[int, int]:
    return int(m.in_features), int(m.out_features)


class Shape(NamedTuple):
    """What a LoRA Linear adds to what stock autograd keeps per row, at fuse time: the active
    term's rank, whether its dropout draws a mask, whether the base weight is trained, and the
    bytes per element of the term's tensors where peft casts the input to the adapter's dtype,
    another than the base weight's (0: no cast; the term's tensors in the base's dtype)."""
    rank: int = 0
    drops: bool = False
    base_trained: bool = True
    cast: int = 0


def shape(m: nn.Module) -> Shape:
    t = term(m) if state_problem(m) is None else None
    w = base(m)._parameters.get("weight")
    trained = w is not None and w.requires_grad and form(m) == "lora"
    if t is None:
        return Shape(0, False, trained)
    cast = t.A.element_size() if form(m) == "lora" and w is not None and \
        t.A.dtype != w.dtype else 0
    return Shape(int(real_shape(t.A)[0]), t.dropout > 0, trained, cast)
