"""The public ops: :func:`linear_tanh`, :func:`tanh_mlp` and :func:`mlp` (any activation of
``ACTIVATIONS``), :func:`gated_mlp` (the gated MLP of Llama, Mistral, Qwen, Gemma, Phi-3, T5), the
:class:`LoRA` term ``mlp`` and ``gated_mlp`` take per Linear, :func:`moe_experts` (transformers'
mixture-of-experts experts), and the dtypes they accept.

The first three run one op, ``torch.ops.ckpt_ext.mlp``; ``gated_mlp`` runs
``torch.ops.ckpt_ext.gated_mlp``; with LoRA terms ``lora_mlp`` and ``lora_gated_mlp``;
``moe_experts`` ``torch.ops.ckpt_ext.moe_experts`` (C++/CUDA; schemas in csrc/schemas.cpp, each
op with a Meta kernel that runs the eager checks), or with LoRA dropout the recomputed ATen
composite of ``_lora_dropout``. Importing this module registers the ops' autograd
(``_mlp_autograd``, ``_gated_autograd``, ``_lora_autograd``, ``_moe_autograd``, ``_autograd``,
``_autograd_node``, ``_higher_order``), vmap rules (``_vmap``) and FLOP formulas (``_flops``). The
design and the math: docs/design.md.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch
from torch import Tensor

from . import _C  # loading the library registers torch.ops.ckpt_ext.*
from . import (_autograd, _autograd_node, _flops, _gated_autograd, _higher_order,  # noqa: F401
               _lora_autograd, _mlp_autograd, _moe_autograd, _vmap)
from ._activations import ACTIVATIONS, activation_spec, check_activation
from ._lora import LoRA, check_lora, draws_masks, lora_spec
from ._lora_dropout import run_with_dropout

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
        activation: Union[str, Sequence[str]] = "tanh", last_activation: bool = True,
        lora: Optional[Sequence[Optional[LoRA]]] = None) -> Tensor:
    """:func:`tanh_mlp` with any activations of ``ACTIVATIONS``: ``h = act_i(h @ weights[i].T +
    biases[i])`` per layer (none after the last when ``last_activation`` is False), kept for
    backward as ``x`` only. ``activation`` is one name for every layer or one name per layer with
    an activation (``len(weights)``, or one less without the last), so a run may mix them
    (``["relu", "relu", "tanh"]``); one name throughout is that name, to the bit. ``"tanh"``
    is what :func:`tanh_mlp` runs; the others are ``nn.GELU()`` ("gelu"),
    ``nn.GELU(approximate="tanh")`` ("gelu_tanh"), ``nn.SiLU``, ``nn.Sigmoid``, ``nn.Softplus()``
    (beta 1, threshold 20), ``torch.sin``, ``nn.ReLU`` and transformers' ``QuickGELUActivation``
    ("quick_gelu").

    ``lora``: None, or one entry per layer, a :class:`LoRA` or None: that layer computes
    ``F.linear(h, W, b) + F.linear(F.linear(drop(h), A), B, bias) * scaling`` (peft's vanilla
    ``lora.Linear``), still kept as ``x`` only (and the generator's state where a LoRA draws a
    dropout mask)."""
    weights = list(weights)
    spec = activation_spec(activation, len(weights), bool(last_activation), "ckpt_ext.mlp")
    return _stack("ckpt_ext.mlp", x, weights, biases, spec, last_activation, lora)


def _stack(where: str, x: Tensor, weights: List[Tensor],
           biases: Optional[Sequence[Optional[Tensor]]], spec: str, last: bool,
           lora: Optional[Sequence[Optional[LoRA]]] = None) -> Tensor:
    """The mlp op on ``biases`` given as None or one entry (a tensor or None) per layer; a list of
    the wrong length is a ValueError naming ``where``, before any kernel runs."""
    if not weights:
        raise ValueError(f"{where}: weights must hold at least one layer's weight, got an empty "
                         f"list")
    biases = [None] * len(weights) if biases is None else list(biases)
    if len(biases) != len(weights):
        raise ValueError(f"{where}: biases must have one entry (a tensor or None) per layer "
                         f"({len(weights)}), got {len(biases)}")
    if lora is not None:
        return _with_lora(where, False, x, weights, biases, spec, last, lora,
                          f"layer ({len(weights)})")
    return torch.ops.ckpt_ext.mlp.default(
        x, weights, [b for b in biases if b is not None], [b is not None for b in biases], spec,
        bool(last))


def named_form(activation: Union[str, Sequence[str]], layers: int, last_activation: bool):
    """The public function a run of ``layers`` Linear layers with ``activation`` is named by:
    tanh's named forms where they apply (:func:`linear_tanh` for one layer with its tanh,
    :func:`tanh_mlp` for tanh throughout), else :func:`mlp`. All three run the one mlp op."""
    if activation != "tanh":
        return mlp
    return linear_tanh if layers == 1 and last_activation else tanh_mlp


def _with_lora(where: str, gated: bool, x: Tensor, weights: List[Tensor],
               biases: List[Optional[Tensor]], activation: str, last: bool, lora, what: str):
    """The lora op (lora_mlp or lora_gated_mlp) for ``lora``, one entry per weight (``what``
    names them in errors); with dropout, the recomputed composite; with no LoRA at all, the op
    without."""
    loras = check_lora(where, lora, len(weights), what)
    has_bias = [b is not None for b in biases]
    spec, lora_tensors = lora_spec(gated, has_bias, activation, last, loras)
    if not any(spec.has_lora):
        op = torch.ops.ckpt_ext.gated_mlp if gated else torch.ops.ckpt_ext.mlp
        args = (activation,) if gated else (activation, bool(last))
        return op.default(x, weights, [b for b in biases if b is not None], has_bias, *args)
    if draws_masks(loras):
        return run_with_dropout(spec, x, weights, biases, loras)
    op = torch.ops.ckpt_ext.lora_gated_mlp if gated else torch.ops.ckpt_ext.lora_mlp
    return op.default(x, *spec.op_args([*weights, *(b for b in biases if b is not None),
                                        *lora_tensors]))


def gated_mlp(x: Tensor, gate_weight: Tensor, up_weight: Optional[Tensor], down_weight: Tensor,
              gate_bias: Optional[Tensor] = None, up_bias: Optional[Tensor] = None,
              down_bias: Optional[Tensor] = None, activation: str = "silu",
              lora: Optional[Sequence[Optional[LoRA]]] = None) -> Tensor:
    """``F.linear(act(F.linear(x, gate_weight, gate_bias)) * F.linear(x, up_weight, up_bias),
    down_weight, down_bias)``, kept for backward as ``x`` only: the gated MLP (SwiGLU with
    "silu", GeGLU with "gelu" or "gelu_tanh", any activation of ``ACTIVATIONS``).

    x: (..., hidden); gate_weight and up_weight: (intermediate, hidden); down_weight: (out,
    intermediate); biases of their weight's out_features or None. Backward recomputes the gate
    and up projections (their two GEMMs) and makes the activation, its derivative and the product
    in one pass. ``up_weight=None``: ``gate_weight`` is one (2·intermediate, hidden) weight
    holding the gate's rows then the up projection's (Phi-3's ``gate_up_proj``), ``gate_bias``
    likewise (2·intermediate) and ``up_bias`` None: one GEMM for both, their gradient made
    whole. Its two halves given as views (``w.chunk(2)``) work too; autograd then joins their
    gradients into ``w``.

    ``lora``: None, or one entry per weight — (gate, up, down), or (gate_up, down) with
    ``up_weight=None`` — each a :class:`LoRA` or None, as :func:`mlp` takes them; masks of LoRA
    dropout are drawn in the order LlamaMLP's forward calls its Linears (gate, up, down).
    """
    where = "ckpt_ext.gated_mlp"
    act = check_activation(activation, where)
    if up_weight is None:
        if up_bias is not None:
            raise ValueError(f"{where}: up_bias must be None when up_weight is None (gate_weight "
                             f"then holds both projections, and gate_bias both biases); got a "
                             f"tensor of shape {tuple(up_bias.shape)}")
        weights, biases = [gate_weight, down_weight], [gate_bias, down_bias]
    else:
        weights = [gate_weight, up_weight, down_weight]
        biases = [gate_bias, up_bias, down_bias]
    if lora is not None:
        names = "gate_up, down: 2" if up_weight is None else "gate, up, down: 3"
        return _with_lora(where, True, x, weights, biases, act, True, lora, f"weight ({names})")
    return torch.ops.ckpt_ext.gated_mlp.default(
        x, weights, [b for b in biases if b is not None], [b is not None for b in biases], act)


#: The layouts of moe_experts' expert weights, read from the C++ library (csrc/moe.h).
MOE_LAYOUTS = tuple(_moe_autograd.LAYOUT_FACTS)


def moe_layout(*, gated: bool = True, interleaved: bool = False, transposed: bool = False) -> str:
    """The :func:`moe_experts` layout name of expert weights stored so: ``gated`` (gate_up holds
    the gate's and the up projection's outputs; else the up projection's only), ``interleaved``
    (those outputs alternate, g0 u0 g1 u1 ..., instead of [gate; up]), ``transposed`` (each
    expert's matrices stored (in, out)). transformers' experts classes carry these as
    ``has_gate``, ``not is_concatenated`` and ``is_transposed``."""
    for name, facts in _moe_autograd.LAYOUT_FACTS.items():
        if facts == (bool(gated), bool(interleaved), bool(transposed)):
            return name
    raise ValueError(f"ckpt_ext.moe_layout: an ungated layout has no gate to interleave; got "
                     f"gated={gated}, interleaved={interleaved}")


def moe_experts(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: Tensor,
                down: Tensor, *, activation: str, gate_up_bias: Optional[Tensor] = None,
                down_bias: Optional[Tensor] = None, layout: str = "concatenated",
                limit: Optional[float] = None, up_offset: float = 0.0) -> Tensor:
    """The experts of a mixture of experts as transformers stores them, kept for backward as x and
    the routing only: ``y[t] = Σ_k top_k_weights[t, k] · expert_e(x[t])`` with
    ``e = top_k_index[t, k]`` and ``expert_e(v) = h_e(v) @ down_e.T + down_bias[e]``.

    x: (..., hidden); top_k_index (int64 or int32) and top_k_weights: (..., top_k) over x's leading
    dimensions, an index equal to the number of experts E routing its pair to no expert;
    top_k_weights of any dtype the ops take (float32 routing with bfloat16 x: the weighted sum runs
    in the promoted dtype). ``layout`` (one of ``MOE_LAYOUTS``, :func:`moe_layout` maps
    transformers' flags to it) says how gate_up and down store each expert:
    ``"concatenated"``: gate_up (E, 2·inter, hidden) holding the gate's rows then the up
    projection's, down (E, out, inter) (Mixtral, Qwen-MoE, DeepSeek, OLMoE); ``"interleaved"``:
    gate and up rows alternating; ``"ungated"``: gate_up is the up projection (E, inter, hidden);
    each with ``_transposed``: every matrix stored (in, out), gate_up (E, hidden, 2·inter) and down
    (E, inter, out) (gpt-oss is ``"interleaved_transposed"``). gate_up_bias (E, gate_up's outputs,
    in their stored order) and down_bias (E, out), or None.

    h is ``act(g) · u`` (gated), or ``act(u)`` (ungated), for any activation of ``ACTIVATIONS``;
    with ``limit`` (gated only) ``act(min(g, limit)) · (clamp(u, -limit, limit) + up_offset)``
    (gpt-oss: ``activation="quick_gelu"``, its alpha being QuickGELU's 1.702, ``limit=7.0``,
    ``up_offset=1.0``). Returns (..., out) in x's dtype. Each expert runs its GEMMs on its own
    rows (an expert with none runs nothing); backward routes again and recomputes the gate and up
    projections, and makes the gradients w.r.t. x, top_k_weights and every parameter that needs
    one.
    """
    where = "ckpt_ext.moe_experts"
    act = check_activation(activation, where)
    if not isinstance(layout, str):
        raise TypeError(f"{where}: layout must be a str, one of {', '.join(map(repr, MOE_LAYOUTS))}"
                        f"; got {type(layout).__name__}")
    return torch.ops.ckpt_ext.moe_experts.default(
        x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, act, layout,
        None if limit is None else float(limit), float(up_offset))


#: The public ops; each keeps its input x for backward, as a Linear does.
PUBLIC_OPS = (linear_tanh, tanh_mlp, mlp, gated_mlp, moe_experts)
