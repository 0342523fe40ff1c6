"""FLOP formulas of the ckpt_ext ops for torch.utils.flop_counter.FlopCounterMode (the counter
torch.compile's tooling and MFU estimates use); without them the custom ops count as 0 FLOPs.

Like aten::addmm, only the GEMMs count (2·M·K·N each); activations and the bias are not counted.
A backward counts what it runs: the recompute (every layer's forward GEMM but the top one's when
last_activation is False), then per layer from the top down to the lowest one with a gradient
asked for, grad_W where asked and the gradient for the layer below (or grad_x where asked). A gated
MLP's backward: the gate and up GEMMs again, then the down projection's grad_W and the gradient
w.r.t. h, and each input projection's grad_W and share of grad_x, each where asked. The experts of
a mixture of experts count routed rows only: a formula gets shapes, so every (token, k) pair of
top_k_index counts as one row of its expert (pairs routed to no expert, index E, count too),
never the E·tokens rows of running every expert on every token.

The lora ops add, per LoRA term on a weight (N, K) of rank r, GEMMs of two sizes: the "A" ones
(2·M·K·r: t = a·Aᵀ, grad_A = gtᵀ·a, the input's share gt·A) and the "B" ones (2·M·r·N:
t·Bᵀ, gt = g·B, grad_B = gᵀ·t). Forward: one of each. Backward: the recompute's (one of each per
term it recomputes), then per term: gt where the gradient below or grad_A is asked, grad_A, and
grad_B with t made again unless the recompute kept it (_lora_walk_flops).
"""
import math

import torch
import torch.utils.flop_counter  # not imported by `import torch`

from . import _C  # noqa: F401  (loading the library registers torch.ops.ckpt_ext.*)


def _gemm_flops(x_shape, w_shape) -> int:
    n, k = w_shape
    return 2 * math.prod(x_shape[:-1]) * k * n


def _stack_backward_flops(x_shape, w_shapes, has_bias, last_act, need_x, need_w, need_b) -> int:
    L = len(w_shapes)
    it = iter(need_b)
    need_b_layer = [next(it) if hb else False for hb in has_bias]
    lowest = 0 if need_x else min([i for i in range(L) if need_w[i] or need_b_layer[i]], default=L)
    if lowest == L:
        return 0
    per_layer = [_gemm_flops(x_shape, w) for w in w_shapes]  # same M for every layer
    recompute = sum(per_layer[:L - 1]) + (per_layer[L - 1] if last_act else 0)
    walk = sum(per_layer[i] * (int(need_w[i]) + int(i > lowest or need_x))
               for i in range(lowest, L))
    return recompute + walk


@torch.utils.flop_counter.register_flop_formula(torch.ops.ckpt_ext.linear_tanh_backward_from_output)
def _linear_tanh_backward_from_output_flop(grad_out_shape, x_shape, output_shape, w_shape,
                                           bias_shape, output_mask, *args, **kwargs) -> int:
    # the layer's mlp_backward without its recompute: grad_x and grad_W, each where asked.
    return _gemm_flops(x_shape, w_shape) * (int(output_mask[0]) + int(output_mask[1]))


@torch.utils.flop_counter.register_flop_formula(
    torch.ops.ckpt_ext.linear_tanh_backward_from_output_backward)
def _linear_tanh_backward_from_output_backward_flop(ggx_shape, ggw_shape, ggb_shape,
                                                    grad_out_shape, x_shape, output_shape,
                                                    w_shape, output_mask, *args, **kwargs) -> int:
    # dg = ggx·Wᵀ + x·ggWᵀ (one GEMM per defined input) when grad_grad_out or grad_output is
    # asked; grad_x = g·ggW and grad_W = gᵀ·ggx where asked and their input is given.
    has_ggx, has_ggw = ggx_shape is not None, ggw_shape is not None
    n = (int(has_ggx) + int(has_ggw)) * int(output_mask[0] or output_mask[2])
    n += int(output_mask[1] and has_ggw) + int(output_mask[3] and has_ggx)
    return n * _gemm_flops(x_shape, w_shape)


@torch.utils.flop_counter.register_flop_formula(
    torch.ops.ckpt_ext.linear_tanh_backward_from_output_double_backward)
def _linear_tanh_backward_from_output_double_backward_flop(
        ggx_shape, ggw_shape, ggb_shape, grad_out_shape, x_shape, output_shape, w_shape,
        u_gy_shape, u_x_shape, u_t_shape, u_w_shape, output_mask, *args, **kwargs) -> int:
    # As the kernel runs them: dg (one GEMM per defined ggx, ggW) and ḡ (u_x·ggWᵀ, ggx·u_Wᵀ) when
    # d_grad_out or d_output is asked; then per result the GEMMs of its terms whose inputs exist.
    has = {k: v is not None for k, v in dict(ggx=ggx_shape, ggw=ggw_shape, ux=u_x_shape,
                                             uw=u_w_shape).items()}
    any_u_dg = u_gy_shape is not None or u_t_shape is not None
    n = 0
    if output_mask[3] or output_mask[5]:
        n += (int(has["ggx"]) + int(has["ggw"])) * int(any_u_dg)
        n += int(has["ux"] and has["ggw"]) + int(has["uw"] and has["ggx"])
    n += int(output_mask[0]) * (int(any_u_dg) + int(has["uw"]))
    n += int(output_mask[1]) * (int(any_u_dg) + int(has["ux"]))
    n += int(output_mask[4] and any_u_dg and has["ggw"]) + int(output_mask[6] and any_u_dg and
                                                               has["ggx"])
    return n * _gemm_flops(x_shape, w_shape)


@torch.utils.flop_counter.register_flop_formula(torch.ops.ckpt_ext.mlp)
def _mlp_flop(x_shape, w_shapes, *args, **kwargs) -> int:
    return sum(_gemm_flops(x_shape, w) for w in w_shapes)


@torch.utils.flop_counter.register_flop_formula(torch.ops.ckpt_ext.mlp_backward)
def _mlp_backward_flop(grad_out_shape, x_shape, w_shapes, b_shapes, has_bias, activation,
                       last_activation, need_x, need_weights, need_biases, *args, **kwargs) -> int:
    return _stack_backward_flops(x_shape, w_shapes, has_bias, last_activation, need_x,
                                 need_weights, need_biases)


@torch.utils.flop_counter.register_flop_formula(torch.ops.ckpt_ext.gated_mlp)
def _gated_mlp_flop(x_shape, w_shapes, *args, **kwargs) -> int:
    return sum(_gemm_flops(x_shape, w) for w in w_shapes)  # each weight's GEMM reads M rows


@torch.utils.flop_counter.register_flop_formula(torch.ops.ckpt_ext.gated_mlp_backward)
def _gated_mlp_backward_flop(grad_out_shape, x_shape, w_shapes, b_shapes, has_bias, activation,
                             need_x, need_weights, need_biases, *args, **kwargs) -> int:
    it = iter(need_biases)
    need_b = [next(it) if hb else False for hb in has_bias]
    ins = range(len(w_shapes) - 1)
    need_in = need_x or any(need_weights[i] or need_b[i] for i in ins)
    if not (need_in or need_weights[-1]):
        return 0  # at most the down bias: a column sum
    gemm = [_gemm_flops(x_shape, w) for w in w_shapes]
    n = sum(gemm[i] for i in ins) + gemm[-1] * int(need_weights[-1])  # recompute, grad_W_down
    if need_in:
        n += gemm[-1] + sum(gemm[i] * (int(need_weights[i]) + int(need_x)) for i in ins)
    return n


# ---- the lora ops ------------------------------------------------------------------------------

def _lora_terms(has_lora, A_shapes, B_shapes) -> list:
    """(A shape, B shape) or None per weight."""
    it = iter(zip(A_shapes, B_shapes))
    return [next(it) if h else None for h in has_lora]


def _lora_needs(has_lora, has_lora_bias, need_A, need_B, need_lb) -> list:
    """(need_A, need_B, need_bias) per weight ((False,) * 3 without a term)."""
    lb = iter(need_lb)
    per = iter(zip(need_A, need_B, [bool(next(lb)) if h else False for h in has_lora_bias]))
    return [tuple(map(bool, next(per))) if h else (False, False, False) for h in has_lora]


def _lora_pair_flops(x_shape, term) -> int:
    """One A GEMM and one B GEMM of a term (its forward, or its recompute)."""
    return 0 if term is None else _gemm_flops(x_shape, term[0]) + _gemm_flops(x_shape, term[1])


def _lora_walk_flops(x_shape, term, need, need_below: bool, t_kept: bool) -> int:
    """A term's backward GEMMs (csrc/lora.cpp, lora_param_grads and its callers)."""
    if term is None:
        return 0
    need_A, need_B, _ = need
    a, b = _gemm_flops(x_shape, term[0]), _gemm_flops(x_shape, term[1])
    return (b * (int(need_below or need_A) + int(need_B))
            + a * (int(need_A) + int(need_B and not t_kept) + int(need_below)))


@torch.utils.flop_counter.register_flop_formula(torch.ops.ckpt_ext.lora_mlp)
def _lora_mlp_flop(x_shape, w_shapes, b_shapes, has_bias, activation, last_activation, A_shapes,
                   B_shapes, lb_shapes, has_lora, *args, **kwargs) -> int:
    return sum(_gemm_flops(x_shape, w) + _lora_pair_flops(x_shape, t)
               for w, t in zip(w_shapes, _lora_terms(has_lora, A_shapes, B_shapes)))


@torch.utils.flop_counter.register_flop_formula(torch.ops.ckpt_ext.lora_mlp_backward)
def _lora_mlp_backward_flop(grad_out_shape, x_shape, w_shapes, b_shapes, has_bias, activation,
                            last_activation, A_shapes, B_shapes, lb_shapes, has_lora,
                            has_lora_bias, scaling, need_x, need_weights, need_biases, need_A,
                            need_B, need_lb, *args, **kwargs) -> int:
    L = len(w_shapes)
    terms = _lora_terms(has_lora, A_shapes, B_shapes)
    lora_need = _lora_needs(has_lora, has_lora_bias, need_A, need_B, need_lb)
    it = iter(need_biases)
    need_b = [next(it) if hb else False for hb in has_bias]
    lowest = 0 if need_x else min([i for i in range(L) if need_weights[i] or need_b[i]
                                   or any(lora_need[i])], default=L)
    if lowest == L:
        return 0
    top = L if last_activation else L - 1
    n = sum(_gemm_flops(x_shape, w_shapes[i]) + _lora_pair_flops(x_shape, terms[i])
            for i in range(top))
    for i in range(lowest, L):
        below = i > lowest or bool(need_x)
        n += _gemm_flops(x_shape, w_shapes[i]) * (int(need_weights[i]) + int(below))
        n += _lora_walk_flops(x_shape, terms[i], lora_need[i], below, i < top)
    return n


@torch.utils.flop_counter.register_flop_formula(torch.ops.ckpt_ext.lora_gated_mlp)
def _lora_gated_mlp_flop(x_shape, w_shapes, b_shapes, has_bias, activation, A_shapes, B_shapes,
                         lb_shapes, has_lora, *args, **kwargs) -> int:
    return sum(_gemm_flops(x_shape, w) + _lora_pair_flops(x_shape, t)
               for w, t in zip(w_shapes, _lora_terms(has_lora, A_shapes, B_shapes)))


@torch.utils.flop_counter.register_flop_formula(torch.ops.ckpt_ext.lora_gated_mlp_backward)
def _lora_gated_mlp_backward_flop(grad_out_shape, x_shape, w_shapes, b_shapes, has_bias,
                                  activation, A_shapes, B_shapes, lb_shapes, has_lora,
                                  has_lora_bias, scaling, need_x, need_weights, need_biases,
                                  need_A, need_B, need_lb, *args, **kwargs) -> int:
    terms = _lora_terms(has_lora, A_shapes, B_shapes)
    lora_need = _lora_needs(has_lora, has_lora_bias, need_A, need_B, need_lb)
    it = iter(need_biases)
    need_b = [next(it) if hb else False for hb in has_bias]
    ins = range(len(w_shapes) - 1)
    need_in = need_x or any(need_weights[i] or need_b[i] or any(lora_need[i]) for i in ins)
    down, down_need = terms[-1], lora_need[-1]
    if not (need_in or need_weights[-1] or (down is not None and any(down_need[:2]))):
        return 0  # at most the down biases: column sums
    gemm = [_gemm_flops(x_shape, w) for w in w_shapes]
    n = sum(gemm[i] + _lora_pair_flops(x_shape, terms[i]) for i in ins)  # the recompute
    n += gemm[-1] * (int(need_weights[-1]) + int(need_in))  # grad_W_down, gh
    n += _lora_walk_flops(x_shape, down, down_need, need_in, False)
    if need_in:
        for i in ins:
            n += gemm[i] * (int(need_weights[i]) + int(bool(need_x)))
            n += _lora_walk_flops(x_shape, terms[i], lora_need[i], bool(need_x), True)
    return n


def _moe_gemms(idx_shape, gu_shape, d_shape):
    """(gate_up GEMM, down GEMM) FLOPs over the routed rows, whichever way the matrices are
    stored."""
    rows = math.prod(idx_shape)
    return 2 * rows * gu_shape[1] * gu_shape[2], 2 * rows * d_shape[1] * d_shape[2]


@torch.utils.flop_counter.register_flop_formula(torch.ops.ckpt_ext.moe_experts)
def _moe_experts_flop(x_shape, idx_shape, w_shape, gu_shape, d_shape, *args, **kwargs) -> int:
    return sum(_moe_gemms(idx_shape, gu_shape, d_shape))


@torch.utils.flop_counter.register_flop_formula(torch.ops.ckpt_ext.moe_experts_backward)
def _moe_experts_backward_flop(grad_out_shape, x_shape, idx_shape, w_shape, gu_shape, d_shape,
                               gub_shape, db_shape, activation, layout, limit, up_offset,
                               output_mask, *args, **kwargs) -> int:
    # The recompute of gate_up, then g0 = gy·W_down (for the routing weights' gradient and gh),
    # grad_W_down, grad_W_gate_up and grad_x, each where asked (csrc/moe.cpp).
    need_x, need_w, need_gu, need_d, need_gub, _ = output_mask
    need_in = need_x or need_gu or (need_gub and gub_shape is not None)
    if not (need_in or need_w or need_d):
        return 0  # at most the down bias: column sums
    gu, dn = _moe_gemms(idx_shape, gu_shape, d_shape)
    return gu * (1 + int(need_gu) + int(need_x)) + dn * (int(need_in or need_w) + int(need_d))
