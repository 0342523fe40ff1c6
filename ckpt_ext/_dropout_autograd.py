"""Autograd of a fused unit whose Dropouts draw masks (p > 0, in training): computed with the ATen
ops the unfused model calls, in its order, keeping only x, the parameters and the state of the
generator the masks come from. Backward restores that state (and the forward's autocast
settings), recomputes the unit, so each Dropout draws its mask again bitwise, and differentiates
it; the generator is left as it was. The same composites (:func:`chain`, :func:`gated_chain`)
compute a unit through its Linears' own forwards where the ops cannot (a LoRA Linear over a 4-bit
base). Design: docs/converter.md, "Dropout inside a unit"."""
from __future__ import annotations

import functools
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch.nn.functional as F
from torch import Tensor

from ._activations import activate
from ._recompute import RecomputedWithGenerator as _Recomputed
from ._recompute import unsupported  # noqa: F401  (a unit asks whether it may draw masks now)


def gated(x: Tensor, gate_w: Tensor, up_w: Optional[Tensor], down_w: Tensor,
          gate_b: Optional[Tensor], up_b: Optional[Tensor], down_b: Optional[Tensor],
          activation: str, gate_second: bool, ps: Sequence[float]) -> Tensor:
    """``down(dropout_ps(act(gate(x)) * up(x)))``; ``up_w`` None: ``gate_w`` is the packed
    (2I, H) weight, its halves (gate, up), or (up, gate) with ``gate_second``."""
    compute = functools.partial(_gated, activation, gate_second, tuple(ps))
    return _Recomputed.apply(compute, x, gate_w, up_w, down_w, gate_b, up_b, down_b)


def plain(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Optional[Tensor]],
          activations: Sequence[str], masks: Dict[int, Tuple[float, ...]]) -> Tensor:
    """A run ``Linear, act, Linear, ...`` (``activations``: one per activated layer) with
    ``F.dropout`` of each p in ``masks[k]`` after item k (Linear j is item 2j, its activation
    2j + 1)."""
    compute = functools.partial(_plain, tuple(activations), len(weights),
                                {k: tuple(ps) for k, ps in masks.items()})
    return _Recomputed.apply(compute, x, *weights, *biases)


def chain(linears: Sequence[Callable], activations: Sequence[str],
          masks: Dict[int, Tuple[float, ...]], h: Tensor) -> Tensor:
    """A run through ``linears`` (one callable per Linear), each activated layer's activation,
    and ``F.dropout`` of each p in ``masks[k]`` after item k, in the unfused model's order."""
    for j, linear in enumerate(linears):
        h = linear(h)
        for k in (2 * j, 2 * j + 1)[:1 + (j < len(activations))]:
            if k % 2:
                h = activate(activations[j], h)
            for p in masks.get(k, ()):
                h = F.dropout(h, p, True)
    return h


def gated_chain(gate: Callable, up: Optional[Callable], down: Callable, activation: str,
                gate_second: bool, up_first: bool, ps: Sequence[float], x: Tensor) -> Tensor:
    """``down(dropout_ps(act(g) * u))`` with g, u from ``gate`` and ``up`` called in the unfused
    model's order (``up`` None: the halves of ``gate(x)``, (up, gate) with ``gate_second``)."""
    if up is None:
        g, u = gate(x).chunk(2, dim=-1)
        g, u = (u, g) if gate_second else (g, u)
    elif up_first:
        u = up(x)
        g = gate(x)
    else:
        g = gate(x)
        u = up(x)
    h = activate(activation, g) * u
    for p in ps:
        h = F.dropout(h, p, True)
    return down(h)


def _linear(w, b) -> Callable:
    return lambda h: F.linear(h, w, b)


def _plain(acts, layers, masks, x, *params):
    return chain([_linear(params[j], params[layers + j]) for j in range(layers)], acts, masks, x)


def _gated(act, gate_second, ps, x, gate_w, up_w, down_w, gate_b, up_b, down_b):
    return gated_chain(_linear(gate_w, gate_b), None if up_w is None else _linear(up_w, up_b),
                       _linear(down_w, down_b), act, gate_second, False, ps, x)
