"""The LoRA term of a Linear as data: the public :class:`LoRA`, the check of a ``lora=`` argument,
and :class:`LoraSpec`, the lora ops' non-tensor arguments with the layout of their tensors (the
flat parameter list ``weights, biases, lora_A, lora_B, lora_biases`` their Function records).

A Linear with a LoRA computes, as peft's ``lora.Linear`` does for a vanilla adapter,
``F.linear(x, W, b) + F.linear(F.linear(drop(x), A), B, b_B) * scaling``; the formulas are in
``_derivatives`` (lora_linear), the design in docs/design.md, "LoRA".
"""
from __future__ import annotations

import numbers
from typing import List, NamedTuple, Optional, Sequence, Tuple

from torch import Tensor

from ._derivatives import _layer_biases  # a compact list spread over its flags, None elsewhere


class LoRA(NamedTuple):
    """A LoRA term on one Linear: ``z = x·Wᵀ + b + scaling·(drop(x)·Aᵀ·Bᵀ + bias)``.

    A: (r, in_features), peft's ``lora_A[name].weight``; B: (out_features, r),
    ``lora_B[name].weight``; scaling: ``scaling[name]`` (lora_alpha / r, or / √r with rsLoRA);
    bias: ``lora_B[name].bias`` (``lora_bias=True``) or None; dropout: the p of the mask drawn
    on the Linear's input, as ``nn.Dropout(p)`` draws it in training (0.0: none, as peft's
    ``nn.Identity`` for ``lora_dropout=0``, or a Dropout in eval mode).
    """
    A: Tensor
    B: Tensor
    scaling: float
    bias: Optional[Tensor] = None
    dropout: float = 0.0


class LoraSpec(NamedTuple):
    """A lora op's non-tensor arguments, and where each tensor of its flat parameter list
    (``weights, biases, lora_A, lora_B, lora_biases``) belongs. ``gated``: lora_gated_mlp (its
    ``last_activation`` unused), else lora_mlp; the LoRA lists' flags as the schema takes them
    (csrc/schemas.cpp)."""
    gated: bool
    has_bias: Tuple[bool, ...]
    activation: str
    last_activation: bool
    has_lora: Tuple[bool, ...]
    has_lora_bias: Tuple[bool, ...]
    scaling: Tuple[float, ...]

    def counts(self) -> Tuple[int, int, int, int]:
        """(weights, biases, LoRAs, LoRA biases)."""
        return (len(self.has_bias), sum(self.has_bias), sum(self.has_lora),
                sum(self.has_lora_bias))

    def split(self, params: Sequence) -> Tuple[list, list, list, list, list]:
        """The flat list as (weights, biases, lora_A, lora_B, lora_biases)."""
        out, start = [], 0
        L, nb, nl, nlb = self.counts()
        for n in (L, nb, nl, nl, nlb):
            out.append(list(params[start:start + n]))
            start += n
        return tuple(out)

    def op_args(self, params: Sequence) -> tuple:
        """The forward op's arguments after x; the backward op's between x and need_x."""
        w, b, A, B, lb = self.split(params)
        head = ((w, b, list(self.has_bias), self.activation) if self.gated else
                (w, b, list(self.has_bias), self.activation, self.last_activation))
        return (*head, A, B, lb, list(self.has_lora), list(self.has_lora_bias),
                list(self.scaling))

    def layers(self, params: Sequence) -> Tuple[list, list, List[Optional[LoRA]]]:
        """(weights, bias or None per weight, LoRA or None per weight) of the flat list, or of a
        list of its tangents (each LoRA then holding the tangents of A, B and its bias)."""
        w, b, A, B, lb = self.split(params)
        terms = iter(zip(A, B, self.scaling, _layer_biases(lb, self.has_lora_bias)))
        return w, _layer_biases(b, self.has_bias), [LoRA(*next(terms)) if has else None
                                                 for has in self.has_lora]

    def flat(self, weights: Sequence, layer_b: Sequence, lora_grads: Sequence) -> list:
        """The flat list from per-weight entries: the inverse of :meth:`layers` for gradients,
        ``lora_grads[i]`` a tuple (grad_A, grad_B, grad_bias) or None where weight i has no
        LoRA."""
        terms = [g for g, has in zip(lora_grads, self.has_lora) if has]
        return [*weights, *(b for b, h in zip(layer_b, self.has_bias) if h),
                *(g[0] for g in terms), *(g[1] for g in terms),
                *(g[2] for g, h in zip(terms, self.has_lora_bias) if h)]

    def needs(self, need_params: Sequence[bool]) -> Tuple[list, list, list]:
        """(need per weight, need per bias slot, (need_A, need_B, need_bias) per weight) from the
        flat list's mask (False where a weight has no bias or no LoRA)."""
        w, b, A, B, lb = self.split(need_params)
        lora_b = iter(_layer_biases(lb, self.has_lora_bias))
        terms = iter(zip(A, B))
        per = [(*next(terms), bool(next(lora_b))) if has else (False, False, False)
               for has in self.has_lora]
        return [bool(n) for n in w], [bool(n) for n in _layer_biases(b, self.has_bias)], per


def check_lora(where: str, lora, layers: int, what: str) -> List[Optional[LoRA]]:
    """``lora`` given to a public op as one entry per weight, each a :class:`LoRA` or None
    (``what``: the weights, "layer (3)", "weight (gate, up, down: 3)"): a TypeError or ValueError
    naming expected and given, before any kernel runs. The tensors' shapes, dtypes and devices
    are the ops' checks (csrc/checks.cpp)."""
    if isinstance(lora, (LoRA, Tensor)) or not isinstance(lora, Sequence):
        raise TypeError(f"{where}: lora must be None or a sequence with one entry (a "
                        f"ckpt_ext.LoRA or None) per {what}, got {type(lora).__name__}")
    entries = list(lora)
    if len(entries) != layers:
        raise ValueError(f"{where}: lora must have one entry (a ckpt_ext.LoRA or None) per {what}, "
                         f"got {len(entries)}")
    for i, e in enumerate(entries):
        if e is None:
            continue
        if not isinstance(e, LoRA):
            raise TypeError(f"{where}: lora[{i}] must be a ckpt_ext.LoRA or None, got "
                            f"{type(e).__name__}")
        for name in ("A", "B"):
            if not isinstance(getattr(e, name), Tensor):
                raise TypeError(f"{where}: lora[{i}].{name} must be a Tensor, got "
                                f"{type(getattr(e, name)).__name__}")
        if e.bias is not None and not isinstance(e.bias, Tensor):
            raise TypeError(f"{where}: lora[{i}].bias must be a Tensor or None, got "
                            f"{type(e.bias).__name__}")
        for name in ("scaling", "dropout"):
            v = getattr(e, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(f"{where}: lora[{i}].{name} must be a real number, got "
                                f"{type(v).__name__}")
        if not 0.0 <= float(e.dropout) <= 1.0:
            raise ValueError(f"{where}: lora[{i}].dropout must be a probability in [0, 1], got "
                             f"{e.dropout}")
    return entries


def lora_spec(gated: bool, has_bias: Sequence[bool], activation: str, last_activation: bool,
              loras: Sequence[Optional[LoRA]]) -> Tuple[LoraSpec, List[Tensor]]:
    """The lora op's spec and its LoRA tensors (lora_A, lora_B, lora_biases, in that order) for
    ``loras``, one entry per weight (their dropout is not an op argument)."""
    terms = [t for t in loras if t is not None]
    spec = LoraSpec(gated, tuple(bool(h) for h in has_bias), activation, bool(last_activation),
                    tuple(t is not None for t in loras),
                    tuple(t.bias is not None for t in terms),
                    tuple(float(t.scaling) for t in terms))
    return spec, ([t.A for t in terms] + [t.B for t in terms]
                  + [t.bias for t in terms if t.bias is not None])


def draws_masks(loras: Sequence[Optional[LoRA]]) -> bool:
    """Whether any LoRA draws a dropout mask (p > 0)."""
    return any(t is not None and float(t.dropout) > 0 for t in loras)
