"""Autograd of a fused unit whose Dropouts draw masks (p > 0, in training): computed with the ATen
ops the unfused model calls, in its order, keeping only x, the parameters and the state of the
generator the masks come from. Backward restores that state (and the forward's autocast
settings), recomputes the unit, so each Dropout draws its mask again bitwise, and differentiates
it; the generator is left as it was. Design: docs/converter.md, "Dropout inside a unit"."""
from __future__ import annotations

import functools
from typing import Dict, Optional, Sequence, Tuple

import torch.nn.functional as F
from torch import Tensor

from ._activations import activate
from ._gated_autograd import _gate_and_up
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


def _plain(acts, layers, masks, x, *params):
    h = x
    for j in range(layers):
        h = F.linear(h, params[j], params[layers + j])
        for k in (2 * j, 2 * j + 1)[:1 + (j < len(acts))]:
            if k % 2:
                h = activate(acts[j], h)
            for p in masks.get(k, ()):
                h = F.dropout(h, p, True)
    return h


def _gated(act, gate_second, ps, x, gate_w, up_w, down_w, gate_b, up_b, down_b):
    if up_w is None:
        g, u = _gate_and_up(x, [gate_w, down_w], [gate_b, down_b])
        g, u = (u, g) if gate_second else (g, u)
    else:
        g, u = _gate_and_up(x, [gate_w, up_w, down_w], [gate_b, up_b, down_b])
    h = activate(act, g) * u
    for p in ps:
        h = F.dropout(h, p, True)
    return F.linear(h, down_w, down_b)
