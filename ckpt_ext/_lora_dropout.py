"""LoRA terms with dropout (p > 0): the unit computed from ATen ops in peft's order — each LoRA
Linear draws its mask with F.dropout on its own input, one mask per LoRA Linear, in the order the
unit calls its Linears (a gated MLP: gate, up, down) — kept as x, the parameters and the
generator's state, and recomputed with the same draws in backward (_recompute.py). Where that
cannot run (torch.compile tracing, torch.func, forward-mode AD) the same ATen ops run under stock
autograd: the same values and masks, the memory of the unfused unit. Design: docs/design.md,
"LoRA"."""
from __future__ import annotations

import functools
from typing import List, Optional, Sequence, Tuple

from . import _C
from ._activations import activate, layer_activations
from ._derivatives import _applies, lora_linear
from ._gated_autograd import gated_forward_composite
from ._lora import LoRA, LoraSpec
from ._recompute import RecomputedWithGenerator, unsupported


def run_with_dropout(spec: LoraSpec, x, weights, layer_b, loras: Sequence[Optional[LoRA]]):
    """The lora op of ``spec`` with the LoRAs' dropout: checked as the op checks its inputs,
    then computed as the module docstring says."""
    _check(spec, x, weights, layer_b, loras)
    statics = tuple(None if t is None else (float(t.scaling), float(t.dropout)) for t in loras)
    compute = functools.partial(_compute, spec, statics)
    params = [*weights, *layer_b, *_column(loras, "A"), *_column(loras, "B"),
              *_column(loras, "bias")]
    if unsupported() is not None:
        return compute(x, *params)
    return RecomputedWithGenerator.apply(compute, x, *params)


def _column(loras, name) -> list:
    return [None if t is None else getattr(t, name) for t in loras]


def _compute(spec: LoraSpec, statics: Tuple, x, *params):
    """The unit from ATen ops; params: weights, biases, A, B, LoRA biases, one entry per weight
    (None where absent)."""
    L = len(statics)
    w, b, A, B, lb = (params[k * L:(k + 1) * L] for k in range(5))
    loras: List[Optional[LoRA]] = [None if s is None else LoRA(a, bb, s[0], bias, s[1])
                                   for s, a, bb, bias in zip(statics, A, B, lb)]
    if spec.gated:
        return gated_forward_composite(x, list(w), list(b), spec.activation, loras)
    acts = layer_activations(spec.activation, L)
    h = x
    for i in range(L):
        h = lora_linear(h, w[i], b[i], loras[i])
        if _applies(i, L, spec.last_activation):
            h = activate(acts[i], h)
    return h


def _check(spec: LoraSpec, x, weights, layer_b, loras) -> None:
    """The lora op's input checks (csrc/checks.cpp), with its messages; not while torch.compile
    traces (the ATen ops then fail as they do in an unfused unit)."""
    if unsupported() == "torch.compile is tracing it":
        return
    terms = [t for t in loras if t is not None]
    check = _C._check_lora_gated_mlp_inputs if spec.gated else _C._check_lora_mlp_inputs
    check(x, list(weights), [b for b in layer_b if b is not None],
          [b is not None for b in layer_b], [t.A for t in terms], [t.B for t in terms],
          [t.bias for t in terms if t.bias is not None], [t is not None for t in loras],
          [t.bias is not None for t in terms], [float(t.scaling) for t in terms])
