"""The public ops: :func:`linear_tanh`, :func:`tanh_mlp` and :func:`mlp` (any activation of
``ACTIVATIONS``), and the dtypes they accept.

All three run one op, ``torch.ops.ckpt_ext.mlp`` (C++/CUDA; schemas in csrc/schemas.cpp, each op
with a Meta kernel that runs the eager checks). Importing this module registers the ops' autograd
(``_mlp_autograd``, ``_autograd``, ``_autograd_node``, ``_higher_order``), vmap rules (``_vmap``)
and FLOP formulas (``_flops``). The design and the math: docs/design.md.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch
from torch import Tensor

from . import _C  # loading the library registers torch.ops.ckpt_ext.*
from . import _autograd, _autograd_node, _flops, _higher_order, _mlp_autograd, _vmap  # noqa: F401
from ._activations import ACTIVATIONS, activation_spec

#: The dtypes the ops accept, read from the C++ library (one list, csrc/checks.cpp).
SUPPORTED_DTYPES = tuple(getattr(torch, name) for name in _C.SUPPORTED_DTYPES)


def linear_tanh(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``tanh(x @ weight.T + bias)`` that keeps only ``x`` for backward.

    x: (..., in_features); weight: (out_features, in_features); bias: (out_features,) or None.
    Returns (..., out_features). Backward recomputes ``x @ weight.T + bias`` instead of saving the
    activation, trading one GEMM for ``batch x out_features`` elements of memory. It is
    :func:`mlp` with one layer and ``activation="tanh"``.
    """
    try:
        return torch.ops.ckpt_ext.mlp.default(*_autograd._tanh_layer_args(x, weight, bias))
    except (ValueError, TypeError):
        # The op rejected the call before any kernel ran: name linear_tanh's own arguments
        # (weight, bias) rather than the op's lists, where its check says the same.
        _C._check_linear_tanh_inputs(x, weight, bias)
        raise


def tanh_mlp(x: Tensor, weights: Sequence[Tensor],
             biases: Optional[Sequence[Optional[Tensor]]] = None, last_tanh: bool = True) -> Tensor:
    """A whole stack of Linear layers with tanh, kept for backward as its input only.

    ``h = x; for each layer i: h = tanh(h @ weights[i].T + biases[i])``, with no tanh after the last
    layer when ``last_tanh`` is False. ``weights[i]`` is (out_i, in_i) with ``in_0 = x.shape[-1]``
    and ``in_i = out_{i-1}``; ``biases`` is None (no bias anywhere) or one entry per layer, a
    (out_i,) tensor or None. Backward recomputes the stack's activations once and walks the layers
    back, freeing each as soon as it is used; with one layer and ``last_tanh`` it is
    :func:`linear_tanh`. It is :func:`mlp` with ``activation="tanh"``.
    """
    return _stack("ckpt_ext.tanh_mlp", x, list(weights), biases, "tanh", last_tanh)


def mlp(x: Tensor, weights: Sequence[Tensor], biases: Optional[Sequence[Optional[Tensor]]] = None,
        activation: Union[str, Sequence[str]] = "tanh", last_activation: bool = True) -> Tensor:
    """:func:`tanh_mlp` with any activations of ``ACTIVATIONS``: ``h = act_i(h @ weights[i].T +
    biases[i])`` per layer (none after the last when ``last_activation`` is False), kept for
    backward as ``x`` only. ``activation`` is one name for every layer or one name per layer with
    an activation (``len(weights)``, or one less without the last), so a run may mix them
    (``["relu", "relu", "tanh"]``); one name throughout is that name, to the bit. ``"tanh"``
    is what :func:`tanh_mlp` runs; the others are ``nn.GELU()`` ("gelu"),
    ``nn.GELU(approximate="tanh")`` ("gelu_tanh"), ``nn.SiLU``, ``nn.Sigmoid``, ``nn.Softplus()``
    (beta 1, threshold 20), ``torch.sin``, ``nn.ReLU`` and transformers' ``QuickGELUActivation``
    ("quick_gelu")."""
    weights = list(weights)
    spec = activation_spec(activation, len(weights), bool(last_activation), "ckpt_ext.mlp")
    return _stack("ckpt_ext.mlp", x, weights, biases, spec, last_activation)


def _stack(where: str, x: Tensor, weights: List[Tensor],
           biases: Optional[Sequence[Optional[Tensor]]], spec: str, last: bool) -> Tensor:
    """The mlp op on ``biases`` given as None or one entry (a tensor or None) per layer; a list of
    the wrong length is a ValueError naming ``where``, before any kernel runs."""
    if not weights:
        raise ValueError(f"{where}: weights must hold at least one layer's weight, got an empty "
                         f"list")
    biases = [None] * len(weights) if biases is None else list(biases)
    if len(biases) != len(weights):
        raise ValueError(f"{where}: biases must have one entry (a tensor or None) per layer "
                         f"({len(weights)}), got {len(biases)}")
    return torch.ops.ckpt_ext.mlp.default(
        x, weights, [b for b in biases if b is not None], [b is not None for b in biases], spec,
        bool(last))
