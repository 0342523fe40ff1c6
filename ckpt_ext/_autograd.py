"""The create_graph path of tanh layers in plain autograd (one layer, _first_order_from; a stack,
_tanh_stack_first_order): the first order built from the layers' outputs, recomputed once by
nodes that keep them, so that every later order reuses them (docs/design.md, "Higher orders").
And what every recorder of the ops shares: the op's Autograd kernel (_register_autograd_kernel)
and the helpers of the single-level Functions.

Two recorders, one per situation (docs/design.md, "Autograd (first order)"): the mlp op's
single-level Function (``_mlp_autograd``), the public-API path (torch.func, modes, subclasses,
compile); and in plain eager autograd the C++ node of csrc/autograd_node.cpp, whose native path
frees the incoming gradient as early as plain autograd does (its Python side:
``_autograd_node``). Both run the same first order (``_mlp_autograd.first_order``). The
higher-order ops are in ``_higher_order``.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.autograd.forward_ad as _fwAD
from torch._functorch.utils import enable_single_level_autograd_function
from torch.autograd.forward_ad import _set_fwd_grad_enabled
from torch import Tensor
from torch.autograd.function import _SingleLevelFunction

from . import _C
from ._derivatives import _OPS, _layer_biases, _mlp_jvp, _stack_backward_composite


def _below_autograd(op, *args):
    # Inside a Function's forward: run the kernel itself, not our Autograd kernel again — as ATen's
    # own Autograd kernels redispatch: grad mode stays on (a Function's forward runs with it off),
    # so that an enclosing torch.func transform one level down still records the call.
    with torch.enable_grad(), _set_fwd_grad_enabled(True), torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def _note_tensor_inputs(ctx, inputs) -> None:
    """Which inputs are tensors: a node has one edge per tensor input, in order, and none for a
    flag or a None, so _needed finds input i's edge by this (called in setup_context)."""
    ctx.tensor_inputs = tuple(i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor))


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
    positions = getattr(ctx, "tensor_inputs", range(len(edges)))
    for (node, _), i in zip(edges, positions):
        if i < n and need[i] and node is not None:
            try:
                need[i] = bool(torch._C._will_engine_execute_node(node))
            except RuntimeError:  # a leaf captured by autograd.grad: its gradient is the result
                pass
    return need


def _tanh_layer_args(x, weight, bias) -> tuple:
    """The mlp op's arguments for one tanh layer, tanh applied (linear_tanh's form)."""
    has_bias = bias is not None
    return x, [weight], [bias] if has_bias else [], [has_bias], "tanh", True


def _plain_autograd() -> bool:
    """No torch.func transform and no forward-mode AD around: where the output-based path of the
    higher orders is used; under the transforms the mlp op's composite runs."""
    return not torch._C._are_functorch_transforms_active() and _fwAD._current_level < 0


def _recompute_chain(ctx, x, weight, bias):
    """(input, t) for the one-tanh-layer node ctx in a create_graph pass: t = tanh(x·Wᵀ + b)
    recomputed once by a node that keeps it (_LinearTanhKeep), and remembered by ctx. When x is the
    unmodified output of another one-tanh-layer node (a chain of FusedLinearTanh), the input is
    that node's own recomputed t instead (recursively): the recompute nodes then form one chain
    fed by the chain's first input, so the gradients of every later order meet at them and never
    reach the forward nodes, as in a stack."""
    t = getattr(ctx, "recomputed_output", None)
    if t is not None:
        return ctx.recomputed_input, t
    x_in = x
    below = _tanh_layer_below(x)
    if below is not None:
        below_ctx, (bx, bw, bb) = below
        x_in = _recompute_chain(below_ctx, bx, bw, bb)[1]
    t = _LinearTanhKeep.apply(x_in, weight, bias)
    ctx.recomputed_input, ctx.recomputed_output = x_in, t
    return x_in, t


def _tanh_layer_below(x):
    """(ctx, (x, W, b)) of the one-tanh-layer mlp node whose output x is (unmodified), with its
    saved tensors still there; else None. The node is the C++ one eager autograd records (its ctx
    is the per-node state object, _C._tanh_layer_node_state) or the mlp Function's (the node is
    its own ctx; one_tanh_layer set by its setup_context)."""
    below = x.grad_fn
    if below is None:
        return None
    if getattr(below, "one_tanh_layer", False):
        try:
            bx, w, *b = below.saved_tensors
        except RuntimeError:  # that node's saved tensors are already freed: no chain
            return None
        return below, (bx, w, b[0] if b else None)
    return _C._tanh_layer_node_state(x)


def _first_order_from(ctx, grad_out, x, weight, bias, mask):
    """The first-order backward of a one-tanh-layer node (ctx) in plain autograd; None where there
    is nothing to build it from (no create_graph pass: the recomputing mlp_backward then runs).

    With create_graph=True (grad mode on) it is recorded, from the output: t = tanh(x·Wᵀ + b) is
    recomputed once by a node that keeps it (_recompute_chain) and handed as an input to
    linear_tanh_backward_from_output, whose node keeps (grad_out, x, t) and rebuilds g from them.
    All later orders then reuse this t (no GEMM, no tanh pass again), and every gradient w.r.t. t
    from every order meets at the one _LinearTanhKeep node, which turns it into x and W
    gradients once per pass — as plain autograd does at its tanh node. Without create_graph: from
    that t when a create_graph pass made one (then released)."""
    if torch.is_grad_enabled():
        x_in, t = _recompute_chain(ctx, x, weight, bias)
        return _OPS.linear_tanh_backward_from_output.default(grad_out, x_in, t, weight, bias,
                                                             mask)
    t = getattr(ctx, "recomputed_output", None)
    if t is not None:
        del ctx.recomputed_output, ctx.recomputed_input  # the last pass: let them go
        return _OPS.linear_tanh_backward_from_output.default(grad_out, x, t.detach(), weight, bias,
                                                             mask)
    return None


class _LinearTanhKeep(_SingleLevelFunction):
    """One tanh layer (the mlp op) keeping its output too: the recompute node of the create_graph
    path, whose output (t) the first-order node keeps anyway. Backward from that t, recorded or
    not."""

    @staticmethod
    def forward(x, weight, bias):
        return _below_autograd(_OPS.mlp.default, *_tanh_layer_args(x, weight, bias))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _note_tensor_inputs(ctx, inputs)
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
        x, weight, bias = ctx.saved_tensors
        return _mlp_jvp(x, [weight], [bias], ["tanh"], True, x_t, [weight_t], [bias_t])


# ---- a stack of layers -------------------------------------------------------------------------

def _stack_outputs_kept(x, weights, layer_b, last_tanh) -> List[Optional[Tensor]]:
    """The layers' outputs t_0 .. t_{L−1}, recomputed by nodes that keep them (_LinearTanhKeep);
    None for a top layer without tanh. The create_graph path of a tanh stack."""
    outs: List[Optional[Tensor]] = []
    h = x
    for i, (w, b) in enumerate(zip(weights, layer_b)):
        if i + 1 == len(weights) and not last_tanh:
            outs.append(None)
        else:
            h = _LinearTanhKeep.apply(h, w, b)
            outs.append(h)
    return outs


def _tanh_stack_first_order(state, grad_out, x, weights, biases, has_bias, last_tanh, need_x,
                            need_w, need_b):
    """The first-order backward of a tanh stack's mlp node in plain autograd (state: the C++
    node's per-node state object): (grad_x?, [grad_W_i?] per layer, [grad_b_j?] per bias), None
    where not asked; None where there is nothing to build it from (no create_graph pass: the
    recomputing op then runs). As for one layer (_first_order_from): with create_graph=True the
    layers' outputs are recomputed once by nodes that keep them and the first-order backward is
    built from the output-based one-layer ops on them; the state keeps the outputs for later
    passes."""
    outs = getattr(state, "recomputed_outputs", None)
    layer_b = _layer_biases(biases, has_bias)
    if torch.is_grad_enabled() and outs is None:
        outs = state.recomputed_outputs = _stack_outputs_kept(x, weights, layer_b, last_tanh)
    elif outs is not None and not torch.is_grad_enabled():
        del state.recomputed_outputs  # the last pass (no graph is built)
        outs = [None if o is None else o.detach() for o in outs]
    if outs is None:
        return None
    gx, gw, gb = _stack_backward_composite(grad_out, x, weights, layer_b, last_tanh, need_x, need_w,
                                           _layer_biases(need_b, has_bias), outs)
    return gx, gw, [g for g, hb in zip(gb, has_bias) if hb]


# ---- the Autograd kernels ----------------------------------------------------------------------

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

