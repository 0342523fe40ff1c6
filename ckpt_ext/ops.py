"""The fused ops: public functions, autograd and FLOP formulas, side by side.

The kernels are C++/CUDA ops registered with the dispatcher under ``torch.ops.ckpt_ext`` (schemas in
``csrc/linear_tanh.cpp``; those of the higher orders in
``csrc/linear_tanh_double_backward.cpp``). The C++ side also registers a Meta kernel per op, which FakeTensor and
``torch.compile`` run; it calls the very checks the eager ops call, so a traced program is rejected
with the eager message and there is no Python copy of the checks to keep in step. This file adds:

* the public functions, :func:`linear_tanh` and :func:`tanh_mlp`;
* the autograd formulas: they save only the input ``x`` and references to the parameters; the
  backward ops recompute the activations; every order above the first is an op with its own
  backward (create_graph=True keeps op inputs, never intermediates). In plain eager autograd the
  forward ops record a C++ node (``csrc/autograd_node.cpp``, see _node_backward) that frees the
  incoming gradient as early as plain autograd does; elsewhere, autograd Functions;
* torch.func support: single-level autograd Functions with jvp rules, and vmap rules;
* FLOP formulas for ``torch.utils.flop_counter``.
"""
from __future__ import annotations

import math
import types
from typing import List, Optional, Sequence

import torch
import torch.autograd.forward_ad as _fwAD
import torch.nn.functional as F
from torch import Tensor
from torch._functorch.utils import enable_single_level_autograd_function
from torch.autograd.forward_ad import _set_fwd_grad_enabled
from torch.autograd.function import _SingleLevelFunction

from . import _C  # loading the library registers torch.ops.ckpt_ext.*

#: The dtypes the ops accept, read from the C++ library (one list, csrc/linear_tanh.cpp).
SUPPORTED_DTYPES = tuple(getattr(torch, name) for name in _C.SUPPORTED_DTYPES)


def linear_tanh(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``tanh(x @ weight.T + bias)`` that keeps only ``x`` for backward.

    x: (..., in_features); weight: (out_features, in_features); bias: (out_features,) or None.
    Returns (..., out_features). Backward recomputes ``x @ weight.T + bias`` instead of saving the
    activation, trading one GEMM for ``batch x out_features`` elements of memory.
    """
    return torch.ops.ckpt_ext.linear_tanh.default(x, weight, bias)


def tanh_mlp(x: Tensor, weights: Sequence[Tensor],
             biases: Optional[Sequence[Optional[Tensor]]] = None, last_tanh: bool = True) -> Tensor:
    """A whole stack of Linear layers with tanh, kept for backward as its input only.

    ``h = x; for each layer i: h = tanh(h @ weights[i].T + biases[i])``, with no tanh after the last
    layer when ``last_tanh`` is False. ``weights[i]`` is (out_i, in_i) with ``in_0 = x.shape[-1]``
    and ``in_i = out_{i-1}``; ``biases`` is None (no bias anywhere) or one entry per layer, a
    (out_i,) tensor or None. Backward recomputes the stack's activations once and walks the layers
    back, freeing each as soon as it is used; with one layer and ``last_tanh`` it is exactly
    :func:`linear_tanh`.
    """
    weights = list(weights)
    if biases is None:
        biases = [None] * len(weights)
    else:
        biases = list(biases)
        if len(biases) != len(weights):
            raise ValueError(f"ckpt_ext.tanh_mlp: biases must have one entry (a tensor or None) per "
                             f"layer ({len(weights)}), got {len(biases)}")
    has_bias = [b is not None for b in biases]
    return torch.ops.ckpt_ext.tanh_mlp.default(
        x, weights, [b for b in biases if b is not None], has_bias, bool(last_tanh))


# ------------------------------------------------------------------------------------------------
# Autograd: this is where the memory is saved. Only x is kept (weights and biases are parameters the
# model holds anyway); nothing of size batch x out_features survives the forward.
#
# A plain first-order backward runs the recomputing kernel linear_tanh_backward (tanh_mlp_backward
# for the stack). Every higher order is an op with its own backward too, so that a graph built
# with create_graph=True (physics-informed losses: u_x and u_xx by torch.autograd.grad) keeps only
# the inputs of each op, never its intermediates. Two families (the math is in
# csrc/linear_tanh_double_backward.cpp):
#
#   From the output — plain autograd with create_graph=True (_first_order_from):
#     t = linear_tanh(x) recomputed once per layer by _LinearTanhKeep, which keeps x and t;
#     order 1: linear_tanh_backward_from_output(grad_out, x, t)   keeps grad_out, x, t
#     order 2: linear_tanh_backward_from_output_backward          keeps its inputs; no recompute
#     order 3: linear_tanh_backward_from_output_double_backward   (CPU kernel; elsewhere, and for
#              order 4 and up, its ATen composition _from_output_backward_vjp)
#     Every gradient w.r.t. t meets at the one _LinearTanhKeep node of its layer, and a chain of
#     layers recomputes as one chain (_recompute_chain), so the forward nodes are not reached
#     again until the last pass.
#   Recomputing — under torch.func, and for the backward ops called directly:
#     order 1: linear_tanh_backward(grad_out, x)                  keeps grad_out, x
#     order 2: linear_tanh_double_backward                        keeps its inputs, recomputes t
#     order 3: _double_backward_vjp (ATen ops and linear_tanh: differentiable again)
#     The stack: tanh_mlp_backward keeps (grad_out, x) for all layers; its backward is
#     _stack_double_backward, a composition of the one-layer ops.
#
# (plus references to weight and bias everywhere.)
#
# Why not torch.library.register_autograd: the autograd.Function it generates has no
# setup_context, and functorch refuses such a Function ("In order to use an autograd.Function with
# functorch transforms ... it must override the setup_context staticmethod": pytorch#168393,
# still open in torch 2.14). Adding one is not enough either: a Function applied from inside a
# dispatcher kernel goes to functorch's custom_function_call, which has no kernel at the Autograd
# key. So each op gets a single-level Function below (forward, setup_context, backward, jvp) and
# a kernel at the Autograd key that applies it (_register_autograd_kernel). Under a torch.func
# transform the kernel records the node at the transform's current level only — what ATen's own
# Autograd kernels do, and how functorch itself applies a Function at one level — and the forward
# redispatches with grad mode on, so the levels below see the op again. vmap is a rule per op
# (torch.library.register_vmap, further down). Together: torch.func.grad / vjp / jacrev / jvp /
# jacfwd / hessian / vmap, nested in any order (tests/test_func.py).

_OPS = torch.ops.ckpt_ext


def _rows(x: Tensor) -> int:
    return math.prod(x.shape[:-1])  # not reshape(-1, ...): -1 is ambiguous for 0 features


def _flat(t: Tensor) -> Tensor:
    """t (..., C) as (rows, C)."""
    return t.reshape(_rows(t), t.shape[-1])


def _below_autograd(op, *args):
    # Inside a Function's forward: run the kernel itself, not our Autograd kernel again — as ATen's
    # own Autograd kernels redispatch: grad mode stays on (a Function's forward runs with it off),
    # so that an enclosing torch.func transform one level down still records the call.
    with torch.enable_grad(), _set_fwd_grad_enabled(True), torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def _needed(ctx, n: int) -> List[bool]:
    """Which of the first n inputs' gradients the running backward pass will use.

    ctx.needs_input_grad says which inputs require grad; the engine knows more: in
    ``torch.autograd.grad(u.sum(), points, create_graph=True)`` the weights require grad but their
    gradients are not wanted, and computing them anyway costs a GEMM each (and, with create_graph,
    graph nodes). Asking the engine is what ATen's own backward formulas do
    (task_should_compute_output). Where it cannot answer (no engine running, a leaf that
    autograd.grad captures, functorch's vmapped ctx), assume needed."""
    need = [bool(v) for v in ctx.needs_input_grad[:n]]
    try:
        edges = ctx.next_functions
    except (AttributeError, RuntimeError):
        return need
    for i in range(min(n, len(edges))):
        node = edges[i][0]
        if need[i] and node is not None:
            try:
                need[i] = bool(torch._C._will_engine_execute_node(node))
            except RuntimeError:  # a leaf captured by autograd.grad: its gradient is the result
                pass
    return need


def _add(a: Optional[Tensor], b: Optional[Tensor]) -> Optional[Tensor]:
    if a is None:
        return b
    return a if b is None else a + b


def _grad_of_g(ggx2: Optional[Tensor], ggw: Optional[Tensor], ggb: Optional[Tensor], x2: Tensor,
               weight: Tensor) -> Optional[Tensor]:
    """dg, the gradient reaching g = grad_out·(1 − t²) from the first-order results' gradients
    (ggx, ggW, ggb): ggx·Wᵀ (through grad_x = g·W), x·ggWᵀ (through grad_W = gᵀ·x), ggb on every
    row (through grad_b = Σ g). None when none of them is given."""
    dg = None
    if ggx2 is not None:
        dg = ggx2 @ weight.t()
    if ggw is not None:
        dg = _add(dg, x2 @ ggw.t())
    if ggb is not None:
        dg = _add(dg, ggb.expand(x2.shape[0], weight.shape[0]))
    return dg


def _zeros_out(x: Tensor, n: int) -> Tensor:
    """A zero tensor of shape x.shape[:-1] + (n,) that owns no memory (an expanded scalar): the
    grad_out placeholder of a double-backward call whose result does not read it."""
    return x.new_zeros(()).expand(*x.shape[:-1], n)


# ---- one layer ---------------------------------------------------------------------------------

def _plain_autograd() -> bool:
    """No torch.func transform and no forward-mode AD around: where the output-based path of the
    higher orders is used (see _LinearTanh.backward); the transforms use the recomputing ops."""
    return not torch._C._are_functorch_transforms_active() and _fwAD._current_level < 0


def _result_like(values, mask, likes):
    """One result per output of a Function: None where the output is not produced (mask False or
    no tensor to be like), else the value or zeros."""
    return tuple(None if not m or like is None else (v if v is not None else torch.zeros_like(like))
                 for v, m, like in zip(values, mask, likes))


def _recompute_chain(ctx, x, weight, bias):
    """(input, t) for the linear_tanh node ctx in a create_graph pass: t = tanh(x·Wᵀ + b)
    recomputed once by a node that keeps it (_LinearTanhKeep), and remembered by ctx. When x is the
    unmodified output of another linear_tanh node (a chain of FusedLinearTanh), the input is that
    node's own recomputed t instead (recursively): the recompute nodes then form one chain fed by
    the chain's first input, so the gradients of every later order meet at them and never reach
    the forward nodes, as in the stack op."""
    t = getattr(ctx, "recomputed_output", None)
    if t is not None:
        return ctx.recomputed_input, t
    x_in = x
    below = _linear_tanh_below(x)
    if below is not None:
        below_ctx, (bx, bw, bb) = below
        x_in = _recompute_chain(below_ctx, bx, bw, bb)[1]
    t = _LinearTanhKeep.apply(x_in, weight, bias)
    ctx.recomputed_input, ctx.recomputed_output = x_in, t
    return x_in, t


def _linear_tanh_below(x):
    """(ctx, (x, W, b)) of the linear_tanh node whose output x is (unmodified), with its saved
    tensors still there; else None. The node is the C++ one eager autograd records (its ctx is the
    per-node state object, _C._linear_tanh_node_state) or a _LinearTanh Function's (the node is
    its own ctx)."""
    below = x.grad_fn
    if below is None:
        return None
    if isinstance(below, _LinearTanh._backward_cls):
        try:
            return below, below.saved_tensors
        except RuntimeError:  # that node's saved tensors are already freed: no chain
            return None
    return _C._linear_tanh_node_state(x)


def _first_order_from(ctx, grad_out, x, weight, bias, mask):
    """The first-order backward of a linear_tanh node (ctx), outside torch.func.

    With create_graph=True (grad mode on) it is recorded, from the output: t = tanh(x·Wᵀ + b) is
    recomputed once by a node that keeps it (_recompute_chain) and handed as an input to
    linear_tanh_backward_from_output, whose node keeps (grad_out, x, t) and rebuilds g from them.
    All later orders then reuse this t (no GEMM, no tanh pass again), and every gradient w.r.t. t
    from every order meets at the one _LinearTanhKeep node, which turns it into x and W
    gradients once per pass — as plain autograd does at its tanh node. Without create_graph: from
    that t when a create_graph pass made one (then released), else the recomputing kernel."""
    if torch.is_grad_enabled():
        x_in, t = _recompute_chain(ctx, x, weight, bias)
        return _OPS.linear_tanh_backward_from_output.default(grad_out, x_in, t, weight, bias,
                                                             mask)
    t = getattr(ctx, "recomputed_output", None)
    if t is not None:
        del ctx.recomputed_output, ctx.recomputed_input  # the last pass: let them go
        return _OPS.linear_tanh_backward_from_output.default(grad_out, x, t.detach(), weight, bias,
                                                             mask)
    return _OPS.linear_tanh_backward.default(grad_out, x, weight, bias, mask)


def _linear_tanh_jvp(x, weight, bias, x_t, weight_t, bias_t):
    # ẏ = (1 − t²)·(ẋ·Wᵀ + x·Ẇᵀ + ḃ): the grad_grad_out result of the double backward, which
    # does not read grad_out (so a zero placeholder is passed).
    return _OPS.linear_tanh_double_backward.default(
        x_t, weight_t, bias_t if bias is not None else None, _zeros_out(x, weight.shape[0]), x,
        weight, bias, [True, False, False, False])[0]


class _LinearTanh(_SingleLevelFunction):
    """y = tanh(x·Wᵀ + b); keeps (x, W, b); backward = the recomputing linear_tanh_backward op
    (or the output-based path with create_graph=True, _first_order_from)."""

    @staticmethod
    def forward(x, weight, bias):
        return _below_autograd(_OPS.linear_tanh.default, x, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)  # for jvp; released right after the forward when unused

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias = ctx.saved_tensors
        need_x, need_w, need_b = _needed(ctx, 3)
        mask = [need_x, need_w, need_b and bias is not None]
        if _plain_autograd():
            return _first_order_from(ctx, grad_out, x, weight, bias, mask)
        # Under torch.func: the recomputing op, recorded (_LinearTanhBackward) where the transform
        # builds a graph: its node keeps (grad_out, x).
        return _OPS.linear_tanh_backward.default(grad_out, x, weight, bias, mask)

    @staticmethod
    def jvp(ctx, x_t, weight_t, bias_t):
        return _linear_tanh_jvp(*ctx.saved_tensors, x_t, weight_t, bias_t)


class _LinearTanhKeep(_SingleLevelFunction):
    """linear_tanh keeping its output too: the recompute node of the create_graph path, whose
    output (t) the first-order node keeps anyway. Backward from that t, recorded or not."""

    @staticmethod
    def forward(x, weight, bias):
        return _below_autograd(_OPS.linear_tanh.default, x, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs, output)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias, t = ctx.saved_tensors  # t: our own output, differentiable
        need_x, need_w, need_b = _needed(ctx, 3)
        if not torch.is_grad_enabled():
            t = t.detach()
        return _OPS.linear_tanh_backward_from_output.default(
            grad_out, x, t, weight, bias, [need_x, need_w, need_b and bias is not None])

    @staticmethod
    def jvp(ctx, x_t, weight_t, bias_t):
        return _linear_tanh_jvp(*ctx.saved_tensors, x_t, weight_t, bias_t)


def _first_order_jvp(grad_out, x, weight, bias, mask, grad_out_t, x_t, weight_t, bias_t):
    """Tangent of linear_tanh_backward's outputs. It is linear in grad_out, and its derivative in
    (x, W, b) applied to (ẋ, Ẇ, ḃ) is the Hessian-vector product that linear_tanh_double_backward
    computes (the Hessian of <grad_out, y> is symmetric):
        d(grad_x, grad_W, grad_b) = backward(ġrad_out) + double_backward(ẋ, Ẇ, ḃ)[x, W, b]."""
    if bias is None:
        bias_t = None
    out: List[Optional[Tensor]] = [None, None, None]
    if grad_out_t is not None:
        out = list(_OPS.linear_tanh_backward.default(grad_out_t, x, weight, bias, mask))
    if x_t is not None or weight_t is not None or bias_t is not None:
        d = _OPS.linear_tanh_double_backward.default(x_t, weight_t, bias_t, grad_out, x, weight,
                                                     bias, [False, *mask])
        out = [_add(o, e) for o, e in zip(out, d[1:])]
    return _result_like(out, mask, (x, weight, bias))


class _LinearTanhBackward(_SingleLevelFunction):
    """(grad_x, grad_W, grad_b) = linear_tanh_backward(grad_out, x, W, b, mask); keeps
    (grad_out, x, W, b); backward = the recomputing linear_tanh_double_backward op."""

    @staticmethod
    def forward(grad_out, x, weight, bias, output_mask):
        return _below_autograd(_OPS.linear_tanh_backward.default, grad_out, x, weight, bias,
                               output_mask)

    @staticmethod
    def setup_context(ctx, inputs, output):
        grad_out, x, weight, bias, output_mask = inputs
        ctx.save_for_backward(grad_out, x, weight, bias)
        ctx.save_for_forward(grad_out, x, weight, bias)
        ctx.output_mask = [bool(m) for m in output_mask]
        ctx.set_materialize_grads(False)  # an output nobody used gets None, not a zero tensor

    @staticmethod
    def backward(ctx, ggx, ggw, ggb):
        grad_out, x, weight, bias = ctx.saved_tensors
        need = _needed(ctx, 4)
        if bias is None:
            ggb, need[3] = None, False
        return (*_OPS.linear_tanh_double_backward.default(ggx, ggw, ggb, grad_out, x, weight, bias,
                                                           need), None)

    @staticmethod
    def jvp(ctx, grad_out_t, x_t, weight_t, bias_t, _mask_t):
        grad_out, x, weight, bias = ctx.saved_tensors
        return _first_order_jvp(grad_out, x, weight, bias, ctx.output_mask, grad_out_t, x_t,
                                weight_t, bias_t)


class _LinearTanhBackwardFromOutput(_SingleLevelFunction):
    """linear_tanh_backward_from_output(grad_out, x, t, W, b, mask) -> (grad_x, grad_W, grad_b):
    g = grad_out·(1 − t²), grad_x = g·W, grad_W = gᵀ·x, grad_b = Σ g, with t an input. Keeps
    (grad_out, x, t, W); backward = linear_tanh_backward_from_output_backward (nothing
    recomputed). b only says whether grad_b is made: no gradient flows into it here (it reaches b
    through t's node)."""

    @staticmethod
    def forward(grad_out, x, output, weight, bias, output_mask):
        return _below_autograd(_OPS.linear_tanh_backward_from_output.default, grad_out, x, output,
                               weight, bias, output_mask)

    @staticmethod
    def setup_context(ctx, inputs, output):
        grad_out, x, t, weight, bias, output_mask = inputs
        ctx.save_for_backward(grad_out, x, t, weight)
        ctx.save_for_forward(grad_out, x, t, weight)
        ctx.output_mask = [bool(m) for m in output_mask]
        ctx.has_bias = bias is not None
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, ggx, ggw, ggb):
        grad_out, x, t, weight = ctx.saved_tensors
        need = _needed(ctx, 4)  # grad_out, x, t, weight
        # x appears only in grad_W = gᵀ·x, W only in grad_x = g·W (their share through t goes to
        # t's node): without ggW (ggx) their gradient here is zero, so it is not made at all.
        need[1] = need[1] and ggw is not None
        need[3] = need[3] and ggx is not None
        r = _OPS.linear_tanh_backward_from_output_backward.default(
            ggx, ggw, ggb if ctx.has_bias else None, grad_out, x, t, weight, need)
        return r[0], r[1], r[2], r[3], None, None

    @staticmethod
    def jvp(ctx, grad_out_t, x_t, t_t, weight_t, _bias_t, _mask_t):
        # g = gy·s with s = 1 − t²:  ġ = ġy·s − 2·gy·t·ṫ;  then ġx = ġ·W + g·Ẇ,
        # ġW = ġᵀ·x + gᵀ·ẋ, ġb = Σ ġ.
        grad_out, x, t, weight = ctx.saved_tensors
        s = 1 - t * t
        g = grad_out * s
        gdot = None if grad_out_t is None else grad_out_t * s
        if t_t is not None:
            gdot = _add(gdot, -2 * grad_out * t * t_t)
        n, k = weight.shape
        gx = None if gdot is None else gdot @ weight
        if weight_t is not None:
            gx = _add(gx, g @ weight_t)
        gw = None if gdot is None else _flat(gdot).t() @ x.reshape(-1, k)
        if x_t is not None:
            gw = _add(gw, _flat(g).t() @ x_t.reshape(-1, k))
        gb = None if gdot is None else _flat(gdot).sum(0)
        return _result_like((gx, gw, gb), ctx.output_mask,
                            (x, weight, weight[:, 0] if ctx.has_bias else None))


class _LinearTanhBackwardFromOutputBackward(_SingleLevelFunction):
    """The backward of linear_tanh_backward_from_output; keeps its inputs; backward = the CPU
    kernel linear_tanh_backward_from_output_double_backward where no graph is built, else
    _from_output_backward_vjp (ATen ops: differentiable again)."""

    @staticmethod
    def forward(ggx, ggw, ggb, grad_out, x, output, weight, output_mask):
        return _below_autograd(_OPS.linear_tanh_backward_from_output_backward.default, ggx, ggw,
                               ggb, grad_out, x, output, weight, output_mask)

    @staticmethod
    def setup_context(ctx, inputs, output):
        *tensors, output_mask = inputs
        ctx.save_for_backward(*tensors)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, u_gy, u_x, u_t, u_w):
        tensors = ctx.saved_tensors
        need = _needed(ctx, 7)
        if all(u is None for u in (u_gy, u_x, u_t, u_w)):
            return (None,) * 8
        # x and W enter only through dg = ggx·Wᵀ + x·ggWᵀ: without ggW (ggx) their gradient is
        # zero; not made at all.
        need[4] = need[4] and tensors[1] is not None
        need[6] = need[6] and tensors[0] is not None
        if not torch.is_grad_enabled() and tensors[4].device.type == "cpu":
            # The last pass (no graph to build): the fused CPU kernel, one elementwise pass
            # instead of a dozen.
            r = _OPS.linear_tanh_backward_from_output_double_backward.default(
                *tensors, u_gy, u_x, u_t, u_w, need)
            return (*r, None)
        return (*_from_output_backward_vjp(*tensors, u_gy, u_x, u_t, u_w, need), None)


def _from_output_backward_vjp(ggx, ggw, ggb, gy, x, t, weight, u_gy, u_x, u_t, u_w,
                              need: Sequence[bool]) -> List[Optional[Tensor]]:
    """The vjp of linear_tanh_backward_from_output_backward, from ATen ops.

    Its forward, on (M, ·) rows: s = 1 − t², g = gy·s, dg = ggx·Wᵀ + x·ggWᵀ + ggb,
        out_gy = dg·s,  out_x = g·ggW,  out_t = −2·dg·gy·t,  out_W = gᵀ·ggx.
    With u_* the cotangents of the outputs:
        d̄g = u_gy·s − 2·u_t·gy·t          ḡ = u_x·ggWᵀ + ggx·u_Wᵀ          s̄ = u_gy·dg + ḡ·gy
    and the results
        ggx: d̄g·W + g·u_W     ggW: d̄gᵀ·x + gᵀ·u_x     ggb: Σ d̄g
        gy:  ḡ·s − 2·u_t·dg·t        t: −2·t·s̄ − 2·u_t·dg·gy
        x:   d̄g·ggW                  W: d̄gᵀ·ggx
    ``need`` says which of (ggx, ggW, ggb, gy, x, t, W) to return; the others are None."""
    res: List[Optional[Tensor]] = [None] * 7
    if not any(need) or all(u is None for u in (u_gy, u_x, u_t, u_w)):
        return res
    n, k = weight.shape
    m = _rows(x)
    x2, gy2, t2 = x.reshape(m, k), gy.reshape(m, n), t.reshape(m, n)
    ggx2 = None if ggx is None else ggx.reshape(m, k)
    ugy2 = None if u_gy is None else u_gy.reshape(m, n)
    ux2 = None if u_x is None else u_x.reshape(m, k)
    ut2 = None if u_t is None else u_t.reshape(m, n)
    s = 1 - t2 * t2
    dg = _grad_of_g(ggx2, ggw, ggb, x2, weight)
    dgbar = None if ugy2 is None else ugy2 * s
    m2ut = None if ut2 is None else -2 * ut2  # −2·u_t
    if m2ut is not None:
        dgbar = _add(dgbar, m2ut * gy2 * t2)
    gbar = None
    if ux2 is not None and ggw is not None:
        gbar = ux2 @ ggw.t()
    if u_w is not None and ggx2 is not None:
        gbar = _add(gbar, ggx2 @ u_w.t())
    g = gy2 * s if (u_w is not None and need[0]) or (ux2 is not None and need[1]) else None

    if need[0] and dgbar is not None:
        res[0] = dgbar @ weight
    if need[0] and g is not None and u_w is not None:
        res[0] = _add(res[0], g @ u_w)
    if need[1] and dgbar is not None:
        res[1] = dgbar.t() @ x2
    if need[1] and g is not None and ux2 is not None:
        res[1] = _add(res[1], g.t() @ ux2)
    if need[2] and dgbar is not None:
        res[2] = dgbar.sum(0)
    if need[3]:
        r = None if gbar is None else gbar * s
        if m2ut is not None and dg is not None:
            r = _add(r, m2ut * dg * t2)
        res[3] = r
    if need[4] and dgbar is not None and ggw is not None:
        res[4] = dgbar @ ggw
    if need[5]:
        sbar = None
        if ugy2 is not None and dg is not None:
            sbar = ugy2 * dg
        if gbar is not None:
            sbar = _add(sbar, gbar * gy2)
        r = None if sbar is None else -2 * t2 * sbar
        if m2ut is not None and dg is not None:
            r = _add(r, m2ut * dg * gy2)
        res[5] = r
    if need[6] and dgbar is not None and ggx2 is not None:
        res[6] = dgbar.t() @ ggx2
    shapes = (x.shape, weight.shape, None, gy.shape, x.shape, t.shape, weight.shape)
    for i, shape in enumerate(shapes):
        if res[i] is not None and shape is not None:
            res[i] = res[i].reshape(shape)
    return res


class _LinearTanhDoubleBackward(_SingleLevelFunction):
    """The backward of linear_tanh_backward; keeps its inputs; backward = _double_backward_vjp."""

    @staticmethod
    def forward(ggx, ggw, ggb, grad_out, x, weight, bias, output_mask):
        return _below_autograd(_OPS.linear_tanh_double_backward.default, ggx, ggw, ggb, grad_out,
                               x, weight, bias, output_mask)

    @staticmethod
    def setup_context(ctx, inputs, output):
        *tensors, output_mask = inputs
        ctx.save_for_backward(*tensors)
        ctx.save_for_forward(*tensors)
        ctx.output_mask = [bool(m) for m in output_mask]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, u_gy, u_x, u_w, u_b):
        return (*_double_backward_vjp(*ctx.saved_tensors, u_gy, u_x, u_w, u_b, _needed(ctx, 7)),
                None)

    @staticmethod
    def jvp(ctx, ggx_t, ggw_t, ggb_t, grad_out_t, x_t, weight_t, bias_t, _mask_t):
        # The op is linear in (ggx, ggW, ggb) and is the gradient of <linear_tanh_backward(...),
        # (ggx, ggW, ggb)> w.r.t. (grad_out, x, W, b); its derivative along (ġrad_out, ẋ, Ẇ, ḃ) is
        # that function's (symmetric) Hessian applied to them, i.e. the vjp of this op with
        # cotangents (ġrad_out, ẋ, Ẇ, ḃ), restricted to the (grad_out, x, W, b) parts.
        ggx, ggw, ggb, grad_out, x, weight, bias = ctx.saved_tensors
        mask = ctx.output_mask
        if bias is None:
            ggb_t = bias_t = None
        out: List[Optional[Tensor]] = [None] * 4
        if ggx_t is not None or ggw_t is not None or ggb_t is not None:
            out = list(_OPS.linear_tanh_double_backward.default(ggx_t, ggw_t, ggb_t, grad_out, x,
                                                                weight, bias, mask))
        if any(v is not None for v in (grad_out_t, x_t, weight_t, bias_t)):
            h = _double_backward_vjp(ggx, ggw, ggb, grad_out, x, weight, bias, grad_out_t, x_t,
                                     weight_t, bias_t, [False, False, False, *mask])
            out = [_add(o, e) for o, e in zip(out, h[3:])]
        return _result_like(out, mask, (grad_out, x, weight, bias))


def _double_backward_vjp(ggx, ggw, ggb, gy, x, weight, bias, u_gy, u_x, u_w, u_b,
                         need: Sequence[bool]) -> List[Optional[Tensor]]:
    """The vjp of linear_tanh_double_backward (the third order), from ATen ops and linear_tanh, so
    autograd can differentiate it again.

    The forward it differentiates (see csrc/linear_tanh_double_backward.cpp), on (M, ·) rows:
        z = x·Wᵀ + b, t = tanh z, s = 1 − t², g = gy·s, dg = ggx·Wᵀ + x·ggWᵀ + ggb,
        out_gy = dg·s, dz = −2·dg·gy·t·s, out_x = dz·W + g·ggW, out_W = dzᵀ·x + gᵀ·ggx,
        out_b = Σ dz.
    With u_* the cotangents of the outputs, walking it back:
        c   = ∂/∂dz   = u_b + x·u_Wᵀ + u_x·Wᵀ
        ḡ   = ∂/∂g    = ggx·u_Wᵀ + u_x·ggWᵀ
        d̄g  = ∂/∂dg   = u_gy·s − 2·c·gy·t·s
        s̄   = ∂/∂s    = u_gy·dg − 2·c·dg·gy·t + ḡ·gy
        z̄   = ∂/∂z    = (−2·t·s̄ − 2·c·dg·gy·s)·s
    and the results
        ggx: d̄g·W + g·u_W        ggW: d̄gᵀ·x + gᵀ·u_x      ggb: Σ d̄g
        gy:  ḡ·s − 2·c·dg·t·s
        x:   z̄·W + d̄g·ggW + dz·u_W
        W:   z̄ᵀ·x + d̄gᵀ·ggx + dzᵀ·u_x
        b:   Σ z̄
    ``need`` says which of (ggx, ggW, ggb, gy, x, W, b) to return; the others are None."""
    need = list(need)
    if bias is None:
        need[2] = need[6] = False
        u_b = ggb = None
    res: List[Optional[Tensor]] = [None] * 7
    if not any(need) or all(u is None for u in (u_gy, u_x, u_w, u_b)):
        return res
    n, k = weight.shape
    m = _rows(x)
    x2, gy2 = x.reshape(m, k), gy.reshape(m, n)
    ggx2 = None if ggx is None else ggx.reshape(m, k)
    ugy2 = None if u_gy is None else u_gy.reshape(m, n)
    ux2 = None if u_x is None else u_x.reshape(m, k)

    t = linear_tanh(x2, weight, bias)  # recomputed, as the forward computes it
    s = 1 - t * t
    dg = _grad_of_g(ggx2, ggw, ggb, x2, weight)

    c = None if u_b is None else u_b.expand(m, n)
    if u_w is not None:
        c = _add(c, x2 @ u_w.t())
    if ux2 is not None:
        c = _add(c, ux2 @ weight.t())
    gbar = None
    if u_w is not None and ggx2 is not None:
        gbar = ggx2 @ u_w.t()
    if ux2 is not None and ggw is not None:
        gbar = _add(gbar, ux2 @ ggw.t())

    m2cs = None if c is None else -2 * c * s  # −2·c·s, a factor of several terms
    dgbar = None if ugy2 is None else ugy2 * s
    if m2cs is not None:
        dgbar = _add(dgbar, m2cs * gy2 * t)
    sbar = None
    if ugy2 is not None and dg is not None:
        sbar = ugy2 * dg
    if c is not None and dg is not None:
        sbar = _add(sbar, -2 * c * dg * gy2 * t)
    if gbar is not None:
        sbar = _add(sbar, gbar * gy2)
    tbar = None if sbar is None else -2 * t * sbar
    if m2cs is not None and dg is not None:
        tbar = _add(tbar, m2cs * dg * gy2)
    zbar = None if tbar is None else tbar * s
    g = gy2 * s if (u_w is not None and need[0]) or (ux2 is not None and need[1]) else None
    dz = None
    if dg is not None and ((u_w is not None and need[4]) or (ux2 is not None and need[5])):
        dz = -2 * dg * gy2 * t * s

    def mm_sum(*pairs):
        out = None
        for a, b in pairs:
            if a is not None and b is not None:
                out = _add(out, a @ b)
        return out

    if need[0]:
        res[0] = mm_sum((dgbar, weight), (g, u_w))
    if need[1]:
        res[1] = mm_sum((None if dgbar is None else dgbar.t(), x2),
                        (None if g is None else g.t(), ux2))
    if need[2]:
        res[2] = None if dgbar is None else dgbar.sum(0)
    if need[3]:
        r = None if gbar is None else gbar * s
        if m2cs is not None and dg is not None:
            r = _add(r, m2cs * dg * t)
        res[3] = r
    if need[4]:
        res[4] = mm_sum((zbar, weight), (dgbar, ggw), (dz, u_w))
    if need[5]:
        res[5] = mm_sum((None if zbar is None else zbar.t(), x2),
                        (None if dgbar is None else dgbar.t(), ggx2),
                        (None if dz is None else dz.t(), ux2))
    if need[6]:
        res[6] = None if zbar is None else zbar.sum(0)
    shapes = (x.shape, weight.shape, None, gy.shape, x.shape, weight.shape, None)
    for i, shape in enumerate(shapes):
        if res[i] is not None and shape is not None:
            res[i] = res[i].reshape(shape)
    return res


# ---- a stack of layers -------------------------------------------------------------------------

def _layer_biases(biases: Sequence[Tensor], has_bias: Sequence[bool]) -> List[Optional[Tensor]]:
    it = iter(biases)
    return [next(it) if hb else None for hb in has_bias]


def _stack_forward_composite(x, weights, layer_b, last_tanh):
    """tanh_mlp from the one-layer ops (for vmap and as the reference of the stack's rules)."""
    h = x
    for i, (w, b) in enumerate(zip(weights, layer_b)):
        h = linear_tanh(h, w, b) if i + 1 < len(weights) or last_tanh else F.linear(h, w, b)
    return h


def _stack_activations(x, weights, layer_b, upto: int) -> List[Tensor]:
    """[a_0 = x, a_1, ..., a_upto]: the inputs of layers 0..upto, recomputed with linear_tanh."""
    acts = [x]
    for i in range(upto):
        acts.append(linear_tanh(acts[i], weights[i], layer_b[i]))
    return acts


def _stack_outputs_kept(x, weights, layer_b, last_tanh) -> List[Optional[Tensor]]:
    """The layers' outputs t_0 .. t_{L−1}, recomputed by nodes that keep them (_LinearTanhKeep);
    None for a top layer without tanh. The create_graph path of the stack (_TanhMlp.backward)."""
    outs: List[Optional[Tensor]] = []
    h = x
    for i, (w, b) in enumerate(zip(weights, layer_b)):
        if i + 1 == len(weights) and not last_tanh:
            outs.append(None)
        else:
            h = _LinearTanhKeep.apply(h, w, b)
            outs.append(h)
    return outs


def _stack_backward_composite(grad_out, x, weights, layer_b, last_tanh, need_x, need_w, need_b,
                              outputs: Optional[Sequence[Optional[Tensor]]] = None):
    """tanh_mlp_backward from the one-layer ops: (grad_x?, [grad_W_i?], [grad_b_i?] per layer).
    With ``outputs`` (the layers' outputs, _stack_outputs_kept) each layer runs the output-based
    op on them; without, the activations are recomputed with linear_tanh and each layer runs the
    recomputing linear_tanh_backward."""
    L = len(weights)
    need_b = [nb and b is not None for nb, b in zip(need_b, layer_b)]
    lowest = 0 if need_x else min([i for i in range(L) if need_w[i] or need_b[i]], default=L)
    gws: List[Optional[Tensor]] = [None] * L
    gbs: List[Optional[Tensor]] = [None] * L
    if lowest == L:
        return None, gws, gbs
    if outputs is None:
        acts = _stack_activations(x, weights, layer_b, L - 1)
    else:
        acts = [x, *outputs[:L - 1]]
    grad = grad_out
    for i in reversed(range(lowest, L)):
        want_x = i > lowest or need_x
        w, a = weights[i], acts[i]
        mask = (want_x, need_w[i], need_b[i])
        if i == L - 1 and not last_tanh:  # a plain Linear on top
            g2, a2 = _flat(grad), _flat(a)
            gws[i] = g2.t() @ a2 if need_w[i] else None
            gbs[i] = g2.sum(0) if need_b[i] else None
            gx = grad @ w if want_x else None
        elif outputs is None:
            gx, gws[i], gbs[i] = linear_tanh_backward(grad, a, w, layer_b[i], mask)
        else:
            gx, gws[i], gbs[i] = _OPS.linear_tanh_backward_from_output.default(
                grad, a, outputs[i], w, layer_b[i], list(mask))
        grad = gx
    return (grad if need_x else None), gws, gbs


def _stack_double_backward(q_x, q_w, q_b, grad_out, x, weights, layer_b, last_tanh,
                           need_gy, need_x, need_w, need_b):
    """The vjp of tanh_mlp_backward, from the one-layer ops (so it is differentiable again).

    tanh_mlp_backward is the chain  a_{i+1} = linear_tanh(a_i) (i < L−1), then from the top
    gy_{L−1} = grad_out, (gy_{i−1}, grad_W_i, grad_b_i) = linear_tanh_backward(gy_i, a_i).
    q_x, q_w[i], q_b[i] are the cotangents of grad_x, grad_W_i, grad_b_i (None where none).
    Walking the chain back: first up the backward chain — layer i's double backward takes the
    cotangent of its grad_x (q_x at the bottom, the grad_grad_out result of the layer below
    above it) and gives the cotangents of gy_i, a_i, W_i, b_i — then down the forward chain,
    where each layer's linear_tanh_backward carries the cotangent of a_{i+1} to a_i, W_i, b_i.
    Returns (grad_grad_out?, grad_x?, [grad_W_i?], [grad_b_i?])."""
    L = len(weights)
    need_b = [nb and b is not None for nb, b in zip(need_b, layer_b)]
    q_b = [q if b is not None else None for q, b in zip(q_b, layer_b)]
    gws: List[Optional[Tensor]] = [None] * L
    gbs: List[Optional[Tensor]] = [None] * L
    has_q = [q_w[i] is not None or q_b[i] is not None or (i == 0 and q_x is not None)
             for i in range(L)]
    lowest = min([i for i in range(L) if has_q[i]], default=L)
    if lowest == L:
        return None, None, gws, gbs
    # need_a[i]: the cotangent of a_i is needed (for x, or for a parameter below layer i)
    need_a = [need_x or any(need_w[j] or need_b[j] for j in range(i)) for i in range(L)]
    acts = _stack_activations(x, weights, layer_b, L - 1)
    # gys[i]: the gradient w.r.t. layer i's output, recomputed from the top down to `lowest`
    gys: List[Optional[Tensor]] = [None] * L
    gys[L - 1] = grad_out
    for i in reversed(range(lowest + 1, L)):
        if i == L - 1 and not last_tanh:
            gys[i - 1] = gys[i] @ weights[i]
        else:
            gys[i - 1] = linear_tanh_backward(gys[i], acts[i], weights[i], layer_b[i],
                                              (True, False, False))[0]
    # up the backward chain
    da: List[Optional[Tensor]] = [None] * L  # cotangent of a_i from the backward chain
    carry = q_x if lowest == 0 else None  # cotangent of layer i's grad_x output
    for i in range(lowest, L):
        want_gy = i + 1 < L or need_gy
        w, a, gy = weights[i], acts[i], gys[i]
        if i == L - 1 and not last_tanh:
            # plain Linear: grad_x = gy·W, grad_W = gyᵀ·a, grad_b = Σ gy
            gy2, a2 = _flat(gy), _flat(a)
            dgy = None
            if want_gy:
                if carry is not None:
                    dgy = carry @ w.t()
                if q_w[i] is not None:
                    dgy = _add(dgy, a @ q_w[i].t())
                if q_b[i] is not None:
                    dgy = _add(dgy, q_b[i].expand(gy.shape))
            if need_a[i] and q_w[i] is not None:
                da[i] = gy @ q_w[i]
            if need_w[i] and carry is not None:
                gws[i] = gy2.t() @ _flat(carry)
        else:
            dgy, da[i], gws[i], gbs[i] = linear_tanh_double_backward(
                carry, q_w[i], q_b[i], gy, a, w, layer_b[i],
                (want_gy, need_a[i], need_w[i], need_b[i]))
        carry = dgy
    grad_gy = carry if need_gy else None
    # down the forward chain
    abar = da[L - 1]
    for i in reversed(range(L - 1)):
        if abar is not None and (need_a[i] or need_w[i] or need_b[i]):
            gx, gw, gb = linear_tanh_backward(abar, acts[i], weights[i], layer_b[i],
                                              (need_a[i], need_w[i], need_b[i]))
            gws[i], gbs[i] = _add(gws[i], gw), _add(gbs[i], gb)
            abar = _add(da[i], gx)
        else:
            abar = da[i]
    grad_x = abar if need_x else None
    if need_gy and grad_gy is None:
        grad_gy = torch.zeros_like(grad_out)
    if need_x and grad_x is None:
        grad_x = torch.zeros_like(x)
    return grad_gy, grad_x, gws, gbs


def _tanh_mlp_first_order(ctx, grad_out, x, weights, biases, has_bias, last_tanh, need_x, need_w,
                          need_b):
    """The first-order backward of a tanh_mlp node (ctx: the Function's ctx, or the C++ node's
    state object): (grad_x?, [grad_W_i?] per layer, [grad_b_j?] per bias), None where not asked."""
    if _plain_autograd():
        # As for one layer (_first_order_from): with create_graph=True, the layers' outputs are
        # recomputed once by nodes that keep them and the first-order backward is built from
        # the output-based one-layer ops on them; ctx keeps the outputs for later passes.
        outs = getattr(ctx, "recomputed_outputs", None)
        layer_b = _layer_biases(biases, has_bias)
        if torch.is_grad_enabled() and outs is None:
            outs = ctx.recomputed_outputs = _stack_outputs_kept(x, weights, layer_b, last_tanh)
        elif outs is not None and not torch.is_grad_enabled():
            del ctx.recomputed_outputs  # the last pass (no graph is built)
            outs = [None if o is None else o.detach() for o in outs]
        if outs is not None:
            gx, gw, gb = _stack_backward_composite(grad_out, x, weights, layer_b, last_tanh,
                                                   need_x, need_w,
                                                   _layer_biases(need_b, has_bias), outs)
            return gx, gw, [g for g, hb in zip(gb, has_bias) if hb]
    # With create_graph=True this call is recorded (_TanhMlpBackward): its node keeps only
    # (grad_out, x) for the whole stack.
    gx, gw_asked, gb_asked = _OPS.tanh_mlp_backward.default(
        grad_out, x, weights, biases, has_bias, last_tanh, need_x, need_w, need_b)
    it_w, it_b = iter(gw_asked), iter(gb_asked)
    gw = [next(it_w) if n else None for n in need_w]
    gb = [next(it_b) if n else None for n in need_b]
    return (gx if need_x else None), gw, gb


class _TanhMlp(_SingleLevelFunction):
    """tanh_mlp; keeps (x, weights, biases); backward = the recomputing tanh_mlp_backward op.
    Called as apply(x, has_bias, last_tanh, *weights, *biases): autograd.Function tracks only
    tensors passed directly."""

    @staticmethod
    def forward(x, has_bias, last_tanh, *params):
        weights, biases = params[:len(has_bias)], params[len(has_bias):]
        return _below_autograd(_OPS.tanh_mlp.default, x, weights, biases, list(has_bias),
                               last_tanh)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, has_bias, last_tanh, *params = inputs
        ctx.save_for_backward(x, *params)
        ctx.save_for_forward(x, *params)
        ctx.has_bias, ctx.last_tanh = tuple(has_bias), bool(last_tanh)

    @staticmethod
    def backward(ctx, grad_out):
        L = len(ctx.has_bias)
        x, *params = ctx.saved_tensors
        need = _needed(ctx, 3 + len(params))
        gx, gw, gb = _tanh_mlp_first_order(ctx, grad_out, x, params[:L], params[L:],
                                           list(ctx.has_bias), ctx.last_tanh, need[0],
                                           need[3:3 + L], need[3 + L:])
        return gx, None, None, *gw, *gb

    @staticmethod
    def jvp(ctx, x_t, _hb_t, _lt_t, *param_t):
        # Tangents layer by layer: ȧ_{i+1} = (1 − a_{i+1}²)·(ȧ_i·W_iᵀ + a_i·Ẇ_iᵀ + ḃ_i), by the
        # one-layer rule, with the activations recomputed.
        L, has_bias = len(ctx.has_bias), ctx.has_bias
        x, *params = ctx.saved_tensors
        weights, layer_b = params[:L], _layer_biases(params[L:], has_bias)
        w_t, b_t = param_t[:L], _layer_biases(param_t[L:], has_bias)
        a, a_t = x, x_t
        for i in range(L):
            w, b = weights[i], layer_b[i]
            if i == L - 1 and not ctx.last_tanh:
                terms = [a_t @ w.t() if a_t is not None else None,
                         a @ w_t[i].t() if w_t[i] is not None else None,
                         b_t[i] if b_t[i] is not None else None]
                a_t = None
                for term in terms:
                    a_t = _add(a_t, term)
                if a_t is None:
                    a_t = a.new_zeros(*a.shape[:-1], w.shape[0])
                a_t = a_t.expand(*a.shape[:-1], w.shape[0])
            else:
                a_t = _linear_tanh_jvp(a, w, b, a_t, w_t[i], b_t[i])
                if i + 1 < L:
                    a = linear_tanh(a, w, b)
        return a_t


class _TanhMlpBackward(_SingleLevelFunction):
    """tanh_mlp_backward; keeps (grad_out, x, weights, biases); backward =
    _stack_double_backward. apply(grad_out, x, has_bias, last_tanh, need_x, need_w, need_b,
    *weights, *biases) -> (grad_x, *grad_W asked for, *grad_b asked for)."""

    @staticmethod
    def forward(grad_out, x, has_bias, last_tanh, need_x, need_w, need_b, *params):
        L = len(has_bias)
        gx, gw, gb = _below_autograd(_OPS.tanh_mlp_backward.default, grad_out, x, params[:L],
                                     params[L:], list(has_bias), last_tanh, need_x, list(need_w),
                                     list(need_b))
        return (gx, *gw, *gb)

    @staticmethod
    def setup_context(ctx, inputs, output):
        grad_out, x, has_bias, last_tanh, need_x, need_w, need_b, *params = inputs
        ctx.save_for_backward(grad_out, x, *params)
        ctx.save_for_forward(grad_out, x, *params)
        ctx.has_bias, ctx.last_tanh = tuple(has_bias), bool(last_tanh)
        ctx.need_x, ctx.need_w, ctx.need_b = bool(need_x), tuple(need_w), tuple(need_b)
        ctx.set_materialize_grads(False)

    @staticmethod
    def _unpack(ctx):
        L, has_bias = len(ctx.has_bias), ctx.has_bias
        grad_out, x, *params = ctx.saved_tensors
        return grad_out, x, list(params[:L]), _layer_biases(params[L:], has_bias)

    @staticmethod
    def _per_layer(ctx, asked: Sequence[Optional[Tensor]]):
        """(q_x, q_w per layer, q_b per layer) from the outputs' layout (grad_x, the asked W
        gradients, the asked b gradients)."""
        L, has_bias = len(ctx.has_bias), ctx.has_bias
        rest = list(asked[1:])
        n_w = sum(ctx.need_w)
        it_w, it_b = iter(rest[:n_w]), iter(rest[n_w:])
        q_w = [next(it_w) if n else None for n in ctx.need_w]
        q_b_compact = [next(it_b) if n else None for n in ctx.need_b]
        return asked[0], q_w, _layer_biases(q_b_compact, has_bias)

    @staticmethod
    def backward(ctx, *grads):
        grad_out, x, weights, layer_b = _TanhMlpBackward._unpack(ctx)
        L, has_bias = len(weights), ctx.has_bias
        n_params = L + sum(has_bias)
        need = _needed(ctx, 7 + n_params)
        q_x, q_w, q_b = _TanhMlpBackward._per_layer(ctx, grads)
        ggy, gx, gw, gb = _stack_double_backward(
            q_x, q_w, q_b, grad_out, x, weights, layer_b, ctx.last_tanh, need[0], need[1],
            need[7:7 + L], _layer_biases(need[7 + L:], has_bias))
        return (ggy, gx, None, None, None, None, None, *gw,
                *[g for g, hb in zip(gb, has_bias) if hb])

    @staticmethod
    def jvp(ctx, grad_out_t, x_t, _hb, _lt, _nx, _nw, _nb, *param_t):
        # As for one layer: linear in grad_out, plus the stack's Hessian-vector product.
        grad_out, x, weights, layer_b = _TanhMlpBackward._unpack(ctx)
        L, has_bias = len(weights), ctx.has_bias
        w_t, b_t = list(param_t[:L]), _layer_biases(param_t[L:], has_bias)
        need_b_layer = _layer_biases(list(ctx.need_b), has_bias)
        need_b_layer = [bool(n) for n in need_b_layer]
        gx = None
        gw: List[Optional[Tensor]] = [None] * L
        gb: List[Optional[Tensor]] = [None] * L
        if grad_out_t is not None:
            gx, gw, gb = _stack_backward_composite(grad_out_t, x, weights, layer_b, ctx.last_tanh,
                                                   ctx.need_x, list(ctx.need_w), need_b_layer)
        if x_t is not None or any(t is not None for t in w_t) or any(t is not None for t in b_t):
            _, hx, hw, hb = _stack_double_backward(
                x_t, w_t, b_t, grad_out, x, weights, layer_b, ctx.last_tanh, False, ctx.need_x,
                list(ctx.need_w), need_b_layer)
            gx = _add(gx, hx)
            gw = [_add(a, b) for a, b in zip(gw, hw)]
            gb = [_add(a, b) for a, b in zip(gb, hb)]
        out = [None if not ctx.need_x else (gx if gx is not None else torch.zeros_like(x))]
        out += [g if g is not None else torch.zeros_like(w)
                for g, w, n in zip(gw, weights, ctx.need_w) if n]
        out += [g if g is not None else torch.zeros_like(b)
                for g, b, n in zip(gb, layer_b, need_b_layer) if b is not None and n]
        return tuple(out)


# ---- the Autograd kernels ----------------------------------------------------------------------

def linear_tanh_backward(grad_out: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                         output_mask: Sequence[bool] = (True, True, True)):
    """``(grad_x, grad_W, grad_b)`` of :func:`linear_tanh` for ``grad_out``, recomputing the
    activation; each is None where ``output_mask`` is False (grad_b also when bias is None).
    Differentiable: with inputs that require grad, in grad mode, autograd records it (its node
    keeps grad_out and x) with :func:`linear_tanh_double_backward` as its backward."""
    return _OPS.linear_tanh_backward.default(grad_out, x, weight, bias, list(output_mask))


def linear_tanh_double_backward(grad_grad_x: Optional[Tensor], grad_grad_weight: Optional[Tensor],
                                grad_grad_bias: Optional[Tensor], grad_out: Tensor, x: Tensor,
                                weight: Tensor, bias: Optional[Tensor],
                                output_mask: Sequence[bool] = (True, True, True, True)):
    """The backward of :func:`linear_tanh_backward`: given the gradients w.r.t. its outputs
    (grad_x, grad_W, grad_b; None where none), the gradients w.r.t. its inputs ``(grad_out, x,
    weight, bias)``, recomputing what it needs; each None where ``output_mask`` is False.
    Differentiable to any order."""
    return _OPS.linear_tanh_double_backward.default(grad_grad_x, grad_grad_weight, grad_grad_bias,
                                                    grad_out, x, weight, bias, list(output_mask))


_AUTOGRAD_LIB = torch.library.Library("ckpt_ext", "IMPL")  # kept alive: it owns the kernels


def _register_autograd_kernel(name: str, apply, record_node=None) -> None:
    """Install ``apply`` as the op's Autograd kernel: used when grad mode is on and an input
    requires grad; otherwise the call goes straight to the device kernel. ``record_node`` (the
    forward ops): tried first in plain eager autograd, see _node_backward; it returns None where
    the C++ node cannot be used (Python modes, tensor subclasses, FakeTensor), and ``apply``
    runs."""
    op = getattr(_OPS, name).default

    def kernel(keyset, *args):
        if torch._C._are_functorch_transforms_active():
            # Inside a torch.func transform, at one of its levels: record a node at this level
            # only, as ATen's Autograd kernels do (the transforms below see the op again).
            with enable_single_level_autograd_function():
                return apply(*args)
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            if (record_node is not None and _fwAD._current_level < 0
                    and not torch.compiler.is_compiling()):
                out = record_node(*args)
                if out is not None:
                    return out
            return apply(*args)
        if _fwAD._current_level >= 0:  # forward-mode AD: the Function's jvp
            return apply(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & torch._C._after_autograd_keyset, *args)

    _AUTOGRAD_LIB.impl(name, kernel, "Autograd", with_keyset=True)


# The C++ node (csrc/autograd_node.cpp). Plain eager autograd — grad mode on, an input requiring
# grad, no torch.func transform, no forward-mode AD level, no dispatch or function mode, every
# tensor a plain dense one, not compiling — records linear_tanh and tanh_mlp with a C++ node
# instead of the Functions above. It saves the same tensors (as SavedVariables, so saved-tensor
# hooks, the in-place check and retain_graph behave as for any node), and in a first-order
# backward it hands the incoming gradient to the stack engine, which frees it after the top
# layer's elementwise pass: a Python node holds it until its backward returns, one (batch,
# out_features) buffer above plain autograd's peak under the write-up's out.mean() loss.
# Everywhere else — create_graph=True, a mode active during backward, tensor subclasses — the
# node calls _node_backward, which is the Functions' backward above with a per-node state object
# as ctx (it keeps the create_graph path's recomputed outputs across passes).

def _node_backward(one_layer, state, grad_out, x, weights, biases, has_bias, last_tanh, need_x,
                   need_w, need_b):
    """The C++ node's Python path: (grad_x?, [grad_W_i?], [grad_b_j?], keep_state)."""
    if one_layer:
        bias = biases[0] if biases else None
        mask = [need_x, need_w[0], bool(need_b) and need_b[0]]
        if _plain_autograd():
            gx, gw, gb = _first_order_from(state, grad_out, x, weights[0], bias, mask)
        else:
            gx, gw, gb = _OPS.linear_tanh_backward.default(grad_out, x, weights[0], bias, mask)
        grads = (gx, [gw], [gb] if bias is not None else [])
    else:
        grads = _tanh_mlp_first_order(state, grad_out, x, weights, biases, has_bias, last_tanh,
                                      need_x, need_w, need_b)
    # The node keeps its state only while it holds recomputed outputs for a later pass.
    return (*grads, bool(vars(state)))


_C._set_node_python_backward(_node_backward, types.SimpleNamespace)
# isinstance(y.grad_fn, torch.autograd.graph.Node) holds, as it did for the Functions' nodes.
torch.autograd.graph.Node.register(_C.LinearTanhBackward)
torch.autograd.graph.Node.register(_C.TanhMlpBackward)


def _apply_linear_tanh_backward(grad_out, x, weight, bias, output_mask):
    return _LinearTanhBackward.apply(grad_out, x, weight, bias, tuple(output_mask))


def _apply_backward_from_output(grad_out, x, output, weight, bias, output_mask):
    return _LinearTanhBackwardFromOutput.apply(grad_out, x, output, weight, bias,
                                               tuple(output_mask))


def _apply_from_output_backward(ggx, ggw, ggb, grad_out, x, output, weight, output_mask):
    return _LinearTanhBackwardFromOutputBackward.apply(ggx, ggw, ggb, grad_out, x, output, weight,
                                                       tuple(output_mask))


def _apply_double_backward(ggx, ggw, ggb, grad_out, x, weight, bias, output_mask):
    return _LinearTanhDoubleBackward.apply(ggx, ggw, ggb, grad_out, x, weight, bias,
                                           tuple(output_mask))


def _apply_tanh_mlp(x, weights, biases, has_bias, last_tanh):
    return _TanhMlp.apply(x, tuple(has_bias), bool(last_tanh), *weights, *biases)


def _apply_tanh_mlp_backward(grad_out, x, weights, biases, has_bias, last_tanh, need_x,
                             need_weights, need_biases):
    out = _TanhMlpBackward.apply(grad_out, x, tuple(has_bias), bool(last_tanh), bool(need_x),
                                 tuple(need_weights), tuple(need_biases), *weights, *biases)
    n_w = sum(bool(n) for n in need_weights)
    return out[0], list(out[1:1 + n_w]), list(out[1 + n_w:])


_register_autograd_kernel("linear_tanh", _LinearTanh.apply, _C._linear_tanh_with_node)
_register_autograd_kernel("linear_tanh_backward", _apply_linear_tanh_backward)
_register_autograd_kernel("linear_tanh_backward_from_output", _apply_backward_from_output)
_register_autograd_kernel("linear_tanh_backward_from_output_backward", _apply_from_output_backward)
_register_autograd_kernel("linear_tanh_double_backward", _apply_double_backward)


def _apply_from_output_triple(ggx, ggw, ggb, grad_out, x, output, weight, u_gy, u_x, u_t, u_w,
                              output_mask):
    # The third-order CPU kernel, differentiated: by its ATen composition, which autograd (and
    # torch.func) differentiate to any order.
    mask = [bool(m) for m in output_mask]
    r = _from_output_backward_vjp(ggx, ggw, ggb, grad_out, x, output, weight, u_gy, u_x, u_t, u_w,
                                  mask)
    return _result_like(r, mask, (x, weight, weight[:, 0], grad_out, x, output, weight))


_register_autograd_kernel("linear_tanh_backward_from_output_double_backward",
                          _apply_from_output_triple)
_register_autograd_kernel("tanh_mlp", _apply_tanh_mlp, _C._tanh_mlp_with_node)
_register_autograd_kernel("tanh_mlp_backward", _apply_tanh_mlp_backward)


# ------------------------------------------------------------------------------------------------
# vmap rules (torch.vmap, and the vmaps inside torch.func.jacrev / jacfwd / hessian). A rule gets
# the tensors without their batch dimension and `in_dims` saying where it was (None: unbatched).
#
# Fast path: when only the row tensors (x, grad_out, grad_grad_x) are batched and only row
# results (y, grad_x, grad_grad_out) are asked for, the batch is folded into the rows and the op
# runs once, recomputing as usual. Otherwise — batched weights (model ensembles, tangents of
# jacfwd/hessian w.r.t. the weights) or per-sample weight gradients — the one-layer ops are
# computed from batched ATen matmuls below (_batched_*), and the stack ops loop over the batch.
# torch.vmap cannot be called inside a rule (functorch asserts), hence the explicit batch dim.

def _bdim_first(t: Optional[Tensor], bdim: Optional[int], batch: int) -> Optional[Tensor]:
    """t with its batch dimension first; an unbatched t expanded to the batch (a view)."""
    if t is None:
        return None
    return t.movedim(bdim, 0) if bdim is not None else t.expand(batch, *t.shape)


def _batched_rows(t: Optional[Tensor]) -> Optional[Tensor]:
    """(B, ..., C) as (B, rows, C)."""
    return None if t is None else t.reshape(t.shape[0], math.prod(t.shape[1:-1]), t.shape[-1])


def _batched_tanh(x3: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
    z = x3 @ w.transpose(-1, -2)
    return torch.tanh(z if b is None else z + b.unsqueeze(1))


def _batched_backward(gy3, x3, w, b, mask):
    """linear_tanh_backward on (B, R, ·) rows and (B, ·) parameters."""
    t = _batched_tanh(x3, w, b)
    g = gy3 * (1 - t * t)
    return (g @ w if mask[0] else None,
            g.transpose(-1, -2) @ x3 if mask[1] else None,
            g.sum(1) if mask[2] and b is not None else None)


def _batched_double_backward(ggx3, ggw, ggb, gy3, x3, w, b, mask):
    """linear_tanh_double_backward on (B, R, ·) rows and (B, ·) parameters (formulas in
    csrc/linear_tanh_double_backward.cpp)."""
    t = _batched_tanh(x3, w, b)
    s = 1 - t * t
    g = gy3 * s
    dg = torch.zeros_like(t)
    if ggx3 is not None:
        dg = dg + ggx3 @ w.transpose(-1, -2)
    if ggw is not None:
        dg = dg + x3 @ ggw.transpose(-1, -2)
    if ggb is not None and b is not None:
        dg = dg + ggb.unsqueeze(1)
    dz = -2 * dg * gy3 * t * s
    dx = dz @ w
    if ggw is not None:
        dx = dx + g @ ggw
    dw = dz.transpose(-1, -2) @ x3
    if ggx3 is not None:
        dw = dw + g.transpose(-1, -2) @ ggx3
    return (dg * s if mask[0] else None, dx if mask[1] else None, dw if mask[2] else None,
            dz.sum(1) if mask[3] and b is not None else None)


def _unrows(t: Optional[Tensor], like_shape) -> Optional[Tensor]:
    """(B, R, C) back to (B, *like_shape[:-1], C)."""
    return None if t is None else t.reshape(t.shape[0], *like_shape[:-1], t.shape[-1])


@torch.library.register_vmap("ckpt_ext::linear_tanh")
def _linear_tanh_vmap(info, in_dims, x, weight, bias):
    bx, bw, bb = in_dims
    if bw is None and bb is None:
        return linear_tanh(x.movedim(bx, 0), weight, bias), 0
    B = info.batch_size
    x, weight, bias = (_bdim_first(t, d, B) for t, d in zip((x, weight, bias), in_dims))
    return _unrows(_batched_tanh(_batched_rows(x), weight, bias), x.shape[1:]), 0


@torch.library.register_vmap("ckpt_ext::linear_tanh_backward")
def _linear_tanh_backward_vmap(info, in_dims, grad_out, x, weight, bias, output_mask):
    bgy, bx, bw, bb, _ = in_dims
    B = info.batch_size
    grad_out, x = _bdim_first(grad_out, bgy, B), _bdim_first(x, bx, B)
    mask = [bool(m) for m in output_mask]
    if bw is None and bb is None and not mask[1] and not mask[2]:
        gx = linear_tanh_backward(grad_out, x, weight, bias, mask)[0]
        return (gx, None, None), (0 if mask[0] else None, None, None)
    weight, bias = _bdim_first(weight, bw, B), _bdim_first(bias, bb, B)
    gx, gw, gb = _batched_backward(_batched_rows(grad_out), _batched_rows(x), weight, bias, mask)
    return (_unrows(gx, x.shape[1:]), gw, gb), tuple(None if r is None else 0 for r in (gx, gw, gb))


@torch.library.register_vmap("ckpt_ext::linear_tanh_double_backward")
def _linear_tanh_double_backward_vmap(info, in_dims, ggx, ggw, ggb, grad_out, x, weight, bias,
                                      output_mask):
    b_ggx, b_ggw, b_ggb, bgy, bx, bw, bb, _ = in_dims
    B = info.batch_size
    ggx, grad_out, x = (_bdim_first(t, d, B) for t, d in ((ggx, b_ggx), (grad_out, bgy), (x, bx)))
    mask = [bool(m) for m in output_mask]
    if all(d is None for d in (b_ggw, b_ggb, bw, bb)) and not mask[2] and not mask[3]:
        r = linear_tanh_double_backward(ggx, ggw, ggb, grad_out, x, weight, bias, mask)
        return (r[0], r[1], None, None), (0 if mask[0] else None, 0 if mask[1] else None, None,
                                          None)
    ggw, ggb, weight, bias = (_bdim_first(t, d, B)
                              for t, d in ((ggw, b_ggw), (ggb, b_ggb), (weight, bw), (bias, bb)))
    r = _batched_double_backward(_batched_rows(ggx), ggw, ggb, _batched_rows(grad_out),
                                 _batched_rows(x), weight, bias, mask)
    r = (_unrows(r[0], grad_out.shape[1:]), _unrows(r[1], x.shape[1:]), r[2], r[3])
    return r, tuple(None if t is None else 0 for t in r)


# The output-based ops serve create_graph=True in plain autograd (torch.func uses the recomputing
# ones); their rules are the batched formulas, for completeness.
@torch.library.register_vmap("ckpt_ext::linear_tanh_backward_from_output")
def _linear_tanh_backward_from_output_vmap(info, in_dims, grad_out, x, output, weight, bias,
                                           output_mask):
    B = info.batch_size
    grad_out, x, output, weight, bias = (_bdim_first(t, d, B) for t, d in
                                         zip((grad_out, x, output, weight, bias), in_dims))
    gy3, x3, t3 = _batched_rows(grad_out), _batched_rows(x), _batched_rows(output)
    g = gy3 * (1 - t3 * t3)
    r = (_unrows(g @ weight, x.shape[1:]) if output_mask[0] else None,
         g.transpose(-1, -2) @ x3 if output_mask[1] else None,
         g.sum(1) if output_mask[2] and bias is not None else None)
    return r, tuple(None if v is None else 0 for v in r)


@torch.library.register_vmap("ckpt_ext::linear_tanh_backward_from_output_backward")
def _linear_tanh_backward_from_output_backward_vmap(info, in_dims, ggx, ggw, ggb, grad_out, x,
                                                    output, weight, output_mask):
    B = info.batch_size
    ggx, ggw, ggb, grad_out, x, output, weight = (
        _bdim_first(t, d, B) for t, d in zip((ggx, ggw, ggb, grad_out, x, output, weight), in_dims))
    gy3, x3, t3 = _batched_rows(grad_out), _batched_rows(x), _batched_rows(output)
    s = 1 - t3 * t3
    g = gy3 * s
    dg = torch.zeros_like(t3)
    if ggx is not None:
        dg = dg + _batched_rows(ggx) @ weight.transpose(-1, -2)
    if ggw is not None:
        dg = dg + x3 @ ggw.transpose(-1, -2)
    if ggb is not None:
        dg = dg + ggb.unsqueeze(1)
    r = (_unrows(dg * s, grad_out.shape[1:]) if output_mask[0] else None,
         _unrows(g @ ggw if ggw is not None else torch.zeros_like(x3), x.shape[1:])
         if output_mask[1] else None,
         _unrows(-2 * dg * gy3 * t3, output.shape[1:]) if output_mask[2] else None,
         (g.transpose(-1, -2) @ _batched_rows(ggx) if ggx is not None
          else torch.zeros_like(weight)) if output_mask[3] else None)
    return r, tuple(None if v is None else 0 for v in r)


def _slices(args, dims, i):
    """Sample i of each (possibly nested) argument, by its batch dimension."""
    out = []
    for a, d in zip(args, dims):
        if isinstance(a, (list, tuple)):
            out.append(type(a)(_slices(a, d, i)))
        else:
            out.append(a.select(d, i) if isinstance(a, Tensor) and d is not None else a)
    return out


def _all_none(dims) -> bool:
    return all(_all_none(d) if isinstance(d, (list, tuple)) else d is None for d in dims)


@torch.library.register_vmap("ckpt_ext::tanh_mlp")
def _tanh_mlp_vmap(info, in_dims, x, weights, biases, has_bias, last_tanh):
    bx, bws, bbs = in_dims[:3]
    B = info.batch_size
    if _all_none(bws) and _all_none(bbs):
        return tanh_mlp(_bdim_first(x, bx, B), weights, _layer_biases(biases, has_bias),
                        last_tanh), 0
    args = (x, weights, biases, has_bias, last_tanh)
    return torch.stack([_OPS.tanh_mlp.default(*_slices(args, in_dims, i)) for i in range(B)]), 0


@torch.library.register_vmap("ckpt_ext::tanh_mlp_backward")
def _tanh_mlp_backward_vmap(info, in_dims, grad_out, x, weights, biases, has_bias, last_tanh,
                            need_x, need_weights, need_biases):
    bgy, bx, bws, bbs = in_dims[:4]
    B = info.batch_size
    n_w, n_b = sum(map(bool, need_weights)), sum(map(bool, need_biases))
    if _all_none(bws) and _all_none(bbs) and n_w == 0 and n_b == 0:
        gx, _, _ = _OPS.tanh_mlp_backward.default(
            _bdim_first(grad_out, bgy, B), _bdim_first(x, bx, B), weights, biases, has_bias,
            last_tanh, need_x, need_weights, need_biases)
        return (gx, [], []), (0 if need_x else None, [], [])
    args = (grad_out, x, weights, biases, has_bias, last_tanh, need_x, need_weights, need_biases)
    per = [_OPS.tanh_mlp_backward.default(*_slices(args, in_dims, i)) for i in range(B)]
    gx = torch.stack([p[0] for p in per]) if need_x else None
    gw = [torch.stack([p[1][j] for p in per]) for j in range(n_w)]
    gb = [torch.stack([p[2][j] for p in per]) for j in range(n_b)]
    return (gx, gw, gb), (0 if need_x else None, [0] * n_w, [0] * n_b)


# ------------------------------------------------------------------------------------------------
# FLOP formulas for torch.utils.flop_counter.FlopCounterMode (the counter torch.compile's tooling
# and MFU estimates use). Without them the custom ops count as 0 FLOPs. Like aten::addmm, only the
# GEMMs count (2·M·K·N each); tanh and the bias are not counted. A backward counts what it runs:
# the recompute (every layer's forward GEMM but the top one's when last_tanh is False), then per
# layer from the top down to the lowest one with a gradient asked for, grad_W where asked and the
# gradient for the layer below (or grad_x where asked).
import torch.utils.flop_counter  # noqa: E402  (not imported by `import torch`)


def _gemm_flops(x_shape, w_shape) -> int:
    n, k = w_shape
    return 2 * math.prod(x_shape[:-1]) * k * n


def _stack_backward_flops(x_shape, w_shapes, has_bias, last_tanh, need_x, need_w, need_b) -> int:
    L = len(w_shapes)
    it = iter(need_b)
    need_b_layer = [next(it) if hb else False for hb in has_bias]
    lowest = 0 if need_x else min([i for i in range(L) if need_w[i] or need_b_layer[i]], default=L)
    if lowest == L:
        return 0
    per_layer = [_gemm_flops(x_shape, w) for w in w_shapes]  # same M for every layer
    recompute = sum(per_layer[:L - 1]) + (per_layer[L - 1] if last_tanh else 0)
    walk = sum(per_layer[i] * (int(need_w[i]) + int(i > lowest or need_x))
               for i in range(lowest, L))
    return recompute + walk


@torch.utils.flop_counter.register_flop_formula(torch.ops.ckpt_ext.linear_tanh)
def _linear_tanh_flop(x_shape, w_shape, *args, **kwargs) -> int:
    return _gemm_flops(x_shape, w_shape)


@torch.utils.flop_counter.register_flop_formula(torch.ops.ckpt_ext.linear_tanh_backward)
def _linear_tanh_backward_flop(grad_out_shape, x_shape, w_shape, bias_shape, output_mask,
                               *args, **kwargs) -> int:
    has_bias = [bias_shape is not None]
    return _stack_backward_flops(x_shape, [w_shape], has_bias, True, output_mask[0],
                                 [output_mask[1]], [output_mask[2]] if has_bias[0] else [])


@torch.utils.flop_counter.register_flop_formula(torch.ops.ckpt_ext.linear_tanh_double_backward)
def _linear_tanh_double_backward_flop(ggx_shape, ggw_shape, ggb_shape, grad_out_shape, x_shape,
                                      w_shape, bias_shape, output_mask, *args, **kwargs) -> int:
    # As the kernel runs them: nothing when no gradient came in or none is asked for; else the
    # recompute of z, one GEMM per defined input of dg = ggx·Wᵀ + x·ggWᵀ, then grad_x = dz·W
    # (+ g·ggW) and grad_W = dzᵀ·x (+ gᵀ·ggx) where asked.
    has_ggx, has_ggw = ggx_shape is not None, ggw_shape is not None
    want_db = output_mask[3] and bias_shape is not None
    if not (has_ggx or has_ggw or ggb_shape is not None) or not (
            output_mask[0] or output_mask[1] or output_mask[2] or want_db):
        return 0
    gemm = _gemm_flops(x_shape, w_shape)
    n = 1 + int(has_ggx) + int(has_ggw)
    n += int(output_mask[1]) * (1 + int(has_ggw)) + int(output_mask[2]) * (1 + int(has_ggx))
    return n * gemm


@torch.utils.flop_counter.register_flop_formula(torch.ops.ckpt_ext.linear_tanh_backward_from_output)
def _linear_tanh_backward_from_output_flop(grad_out_shape, x_shape, output_shape, w_shape,
                                           bias_shape, output_mask, *args, **kwargs) -> int:
    # linear_tanh_backward without its recompute: grad_x and grad_W, each where asked.
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


@torch.utils.flop_counter.register_flop_formula(torch.ops.ckpt_ext.tanh_mlp)
def _tanh_mlp_flop(x_shape, w_shapes, *args, **kwargs) -> int:
    return sum(_gemm_flops(x_shape, w) for w in w_shapes)


@torch.utils.flop_counter.register_flop_formula(torch.ops.ckpt_ext.tanh_mlp_backward)
def _tanh_mlp_backward_flop(grad_out_shape, x_shape, w_shapes, b_shapes, has_bias, last_tanh,
                            need_x, need_weights, need_biases, *args, **kwargs) -> int:
    return _stack_backward_flops(x_shape, w_shapes, has_bias, last_tanh, need_x, need_weights,
                                 need_biases)
