"""Autograd of the lora ops (lora_mlp, lora_gated_mlp: the mlp and gated_mlp ops with LoRA terms,
no dropout): they keep x and the parameters only. First order: the recomputing C++ backward op,
which computes no gradient that is not asked for (a frozen base weight: no grad_W GEMM). With
create_graph=True and under torch.func, the composites of ``_mlp_autograd`` and
``_gated_autograd`` with their LoRA terms (ATen ops, which autograd and the transforms
differentiate to any order). Forward mode: their jvps. Design: docs/design.md, "LoRA".
"""
from __future__ import annotations

from typing import List

import torch
from torch.autograd.function import _SingleLevelFunction

from ._activations import layer_activations
from ._autograd import (_below_autograd, _needed, _note_tensor_inputs, _plain_autograd,
                        _register_autograd_kernel)
from ._derivatives import _OPS, _mlp_jvp
from ._gated_autograd import gated_jvp, lora_gated_backward_composite
from ._lora import LoraSpec
from ._mlp_autograd import lora_mlp_backward_composite


def _forward_op(spec: LoraSpec):
    return (_OPS.lora_gated_mlp if spec.gated else _OPS.lora_mlp).default


def lora_first_order(spec: LoraSpec, grad_out, x, params, need_x: bool, need: List[bool]):
    """(grad_x?, [gradient? per entry of the flat parameter list]), None where not asked: the
    C++ backward op in plain autograd without create_graph; the composite otherwise."""
    if _plain_autograd() and not torch.is_grad_enabled():
        op = (_OPS.lora_gated_mlp_backward if spec.gated else _OPS.lora_mlp_backward).default
        masks = spec.split(need)
        gx, *asked = op(grad_out, x, *spec.op_args(params), need_x, *masks)
        grads = []
        for got, mask in zip(asked, masks):
            it = iter(got)
            grads += [next(it) if n else None for n in mask]
        return (gx if need_x else None), grads
    weights, layer_b, loras = spec.layers(params)
    need_w, need_b, need_lora = spec.needs(need)
    if spec.gated:
        gx, gw, gb, glora = lora_gated_backward_composite(
            grad_out, x, weights, layer_b, loras, spec.activation, need_x, need_w, need_b,
            need_lora)
    else:
        gx, gw, gb, glora = lora_mlp_backward_composite(
            grad_out, x, weights, layer_b, loras,
            layer_activations(spec.activation, len(weights)), spec.last_activation, need_x,
            need_w, need_b, need_lora)
    return gx, spec.flat(gw, gb, glora)


class _LoraOp(_SingleLevelFunction):
    """lora_mlp or lora_gated_mlp; keeps (x, parameters). apply(x, *params, spec): the flat
    parameter list of the spec (weights, biases, lora_A, lora_B, lora_biases), then the spec,
    so the node's edges line up with the inputs (_needed)."""

    @staticmethod
    def forward(x, *rest):
        *params, spec = rest
        return _below_autograd(_forward_op(spec), x, *spec.op_args(params))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _note_tensor_inputs(ctx, inputs)
        x, *params, spec = inputs
        ctx.save_for_backward(x, *params)
        ctx.save_for_forward(x, *params)
        ctx.spec = spec

    @staticmethod
    def backward(ctx, grad_out):
        x, *params = ctx.saved_tensors
        need = _needed(ctx, 1 + len(params))
        gx, grads = lora_first_order(ctx.spec, grad_out, x, params, need[0], need[1:])
        return (gx, *grads, None)

    @staticmethod
    def jvp(ctx, x_t, *rest):
        spec = ctx.spec
        x, *params = ctx.saved_tensors
        weights, layer_b, loras = spec.layers(params)
        w_t, b_t, lora_t = spec.layers(rest[:-1])
        if spec.gated:
            return gated_jvp(x, weights, layer_b, spec.activation, x_t, w_t, b_t, loras, lora_t)
        return _mlp_jvp(x, weights, layer_b, layer_activations(spec.activation, len(weights)),
                        spec.last_activation, x_t, w_t, b_t, loras, lora_t)


def _apply_lora_mlp(x, weights, biases, has_bias, act, last_activation, lora_A, lora_B,
                    lora_biases, has_lora, has_lora_bias, scaling):
    spec = LoraSpec(False, tuple(has_bias), act, bool(last_activation), tuple(has_lora),
                    tuple(has_lora_bias), tuple(scaling))
    return _LoraOp.apply(x, *weights, *biases, *lora_A, *lora_B, *lora_biases, spec)


def _apply_lora_gated(x, weights, biases, has_bias, act, lora_A, lora_B, lora_biases, has_lora,
                      has_lora_bias, scaling):
    spec = LoraSpec(True, tuple(has_bias), act, True, tuple(has_lora), tuple(has_lora_bias),
                    tuple(scaling))
    return _LoraOp.apply(x, *weights, *biases, *lora_A, *lora_B, *lora_biases, spec)


_register_autograd_kernel("lora_mlp", _apply_lora_mlp)
_register_autograd_kernel("lora_gated_mlp", _apply_lora_gated)
