"""Autograd of the moe_experts op: it keeps x, the routing (top_k_index, top_k_weights) and the
parameters only. First order: the recomputing C++ moe_experts_backward. With create_graph=True and
under torch.func, the composite below: the same formulas in ATen ops, one expert at a time (not
the hot path), which autograd and the transforms differentiate again. Forward mode is not
provided. Design: docs/design.md, "Mixture of experts".
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import _SingleLevelFunction

from . import _C
from ._activations import activate, activation_backward
from ._autograd import (_below_autograd, _needed, _note_tensor_inputs, _plain_autograd,
                        _register_autograd_kernel)
from ._derivatives import _OPS, _rows


class LayoutFacts(NamedTuple):
    """What a layout name of the op says about the stored weights (csrc/moe.h, read from _C)."""
    gated: bool        # gate_up holds the gate's and the up projection's outputs
    interleaved: bool  # ... alternating (g0 u0 g1 u1 ...) rather than [gate; up]
    transposed: bool   # each expert's matrices stored (in, out)


#: layout name -> its facts, in the C++ library's order.
LAYOUT_FACTS = {name: LayoutFacts(*flags) for name, flags in _C.MOE_LAYOUTS.items()}


# ---- the composite -----------------------------------------------------------------------------

def _linear_weight(w: Tensor, e: int, transposed: bool) -> Tensor:
    """Expert e's matrix as nn.Linear reads it, (out, in)."""
    return w[e].t() if transposed else w[e]


def _stored(grad_linear: Tensor, transposed: bool) -> Tensor:
    """A gradient of an (out, in) matrix, in the layout the expert weights store it."""
    return grad_linear.t() if transposed else grad_linear


def moe_backward_composite(grad_out, x, top_k_index, top_k_weights, gate_up, down, gate_up_bias,
                           down_bias, act: str, layout: str, limit: Optional[float],
                           up_offset: float, need) -> List[Optional[Tensor]]:
    """[grad_x, grad_top_k_weights, grad_gate_up, grad_down, grad_gate_up_bias, grad_down_bias],
    None where not asked (need, the op's output_mask), recomputed with ATen ops expert by expert.
    Per routed pair j (token t, weight w_j, expert e), with g0_j = gy_t·W_down,e:
    grad_w_j = ⟨h_j, g0_j⟩ + ⟨b_down,e, gy_t⟩; dy_j = w_j·gy_t gives grad_W_down,e and
    grad_b_down,e; gh_j = w_j·g0_j goes back through the gated product and the clamps to dz_j,
    which gives grad_W_gate_up,e, grad_b_gate_up,e and grad_x_t (moe.cpp's formulas)."""
    need_x, need_w, need_gu, need_d, need_gub, need_db = need
    need_gub = need_gub and gate_up_bias is not None
    need_db = need_db and down_bias is not None
    need_in = need_x or need_gu or need_gub
    facts = LAYOUT_FACTS[layout]
    tr = facts.transposed
    E, K, H = gate_up.shape[0], top_k_index.shape[-1], x.shape[-1]
    T = _rows(x)
    N = down.shape[2 if tr else 1]
    xf, gy = x.reshape(T, H), grad_out.reshape(T, N)
    pairs = top_k_index.reshape(T * K)
    wf = top_k_weights.reshape(T * K)
    promoted = torch.promote_types(x.dtype, top_k_weights.dtype)

    gx = torch.zeros_like(xf) if need_x else None
    gw = torch.zeros(T * K, dtype=promoted, device=x.device) if need_w else None
    per_expert = {name: [] for name, n in (("gu", need_gu), ("d", need_d), ("gub", need_gub),
                                           ("db", need_db)) if n}
    order = torch.argsort(pairs, stable=True)
    counts = torch.bincount(pairs, minlength=E + 1).tolist()  # one host copy (the op checked them)
    start = 0
    for e in range(E):
        rows = order[start:start + counts[e]]
        start += counts[e]
        if counts[e] == 0:
            for name, like in (("gu", gate_up), ("d", down), ("gub", gate_up_bias),
                               ("db", down_bias)):
                if name in per_expert:
                    per_expert[name].append(torch.zeros_like(like[e]))
            continue
        tok = torch.div(rows, K, rounding_mode="trunc")
        xs, gyp, wp = xf[tok], gy[tok], wf[rows]
        w_gu, w_d = _linear_weight(gate_up, e, tr), _linear_weight(down, e, tr)
        z = F.linear(xs, w_gu, None if gate_up_bias is None else gate_up_bias[e])
        if facts.gated:
            g, u = (z[:, 0::2], z[:, 1::2]) if facts.interleaved else z.chunk(2, dim=-1)
            gc = g if limit is None else g.clamp(max=limit)
            uc = u if limit is None else u.clamp(-limit, limit)
            uc = uc + up_offset if up_offset else uc
            fg = activate(act, gc)
            h = fg * uc
        else:
            h = activate(act, z)
        g0 = gyp @ w_d if need_w or need_in else None
        if need_d or need_db:
            dy = (gyp * wp.unsqueeze(1)).to(x.dtype)
            if need_d:
                per_expert["d"].append(_stored(dy.t() @ h, tr))
            if need_db:
                per_expert["db"].append(dy.sum(0))
        if need_w:
            gw_rows = (h.to(promoted) * g0.to(promoted)).sum(1)
            if down_bias is not None:
                gw_rows = gw_rows + gyp.to(promoted) @ down_bias[e].to(promoted)
            gw = gw.index_add(0, rows, gw_rows)
        if not need_in:
            continue
        gh = (g0 * wp.unsqueeze(1)).to(x.dtype)
        if facts.gated:
            du = gh * fg
            dg = activation_backward(act, gh * uc, gc, fg)
            if limit is not None:
                dg = torch.where(g <= limit, dg, 0.0)
                du = torch.where((u >= -limit) & (u <= limit), du, 0.0)
            dz = (torch.stack([dg, du], dim=-1).flatten(-2) if facts.interleaved
                  else torch.cat([dg, du], dim=-1))
        else:
            dz = activation_backward(act, gh, z, h)
        if need_gu:
            per_expert["gu"].append(_stored(dz.t() @ xs, tr))
        if need_gub:
            per_expert["gub"].append(dz.sum(0))
        if need_x:
            gx = gx.index_add(0, tok, dz @ w_gu)
    stacked = {name: torch.stack(gs) for name, gs in per_expert.items()}
    return [None if gx is None else gx.view(x.shape),
            None if gw is None else gw.to(top_k_weights.dtype).view(top_k_weights.shape),
            stacked.get("gu"), stacked.get("d"), stacked.get("gub"), stacked.get("db")]


# ---- the first order ---------------------------------------------------------------------------

def moe_first_order(grad_out, x, top_k_index, top_k_weights, gate_up, down, gate_up_bias,
                    down_bias, act, layout, limit, up_offset, need) -> List[Optional[Tensor]]:
    """The gradients as moe_backward_composite returns them: the C++ moe_experts_backward in
    plain autograd without create_graph, the composite otherwise."""
    if _plain_autograd() and not torch.is_grad_enabled():
        return list(_OPS.moe_experts_backward.default(
            grad_out, x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, act,
            layout, limit, up_offset, list(need)))
    return moe_backward_composite(grad_out, x, top_k_index, top_k_weights, gate_up, down,
                                  gate_up_bias, down_bias, act, layout, limit, up_offset, need)


class _MoeExperts(_SingleLevelFunction):
    """moe_experts; keeps (x, top_k_index, top_k_weights, gate_up, down, biases). apply takes the
    op's arguments in schema order."""

    @staticmethod
    def forward(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, act,
                layout, limit, up_offset):
        return _below_autograd(_OPS.moe_experts.default, x, top_k_index, top_k_weights, gate_up,
                               down, gate_up_bias, down_bias, act, layout, limit, up_offset)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _note_tensor_inputs(ctx, inputs)
        ctx.save_for_backward(*inputs[:7])
        ctx.spec = tuple(inputs[7:])

    @staticmethod
    def backward(ctx, grad_out):
        x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias = ctx.saved_tensors
        need = _needed(ctx, 7)
        mask = [need[0], need[2], need[3], need[4], need[5] and gate_up_bias is not None,
                need[6] and down_bias is not None]
        gx, gw, ggu, gd, ggub, gdb = moe_first_order(
            grad_out, x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias,
            *ctx.spec, mask)
        return gx, None, gw, ggu, gd, ggub, gdb, None, None, None, None


_register_autograd_kernel("moe_experts", _MoeExperts.apply)
