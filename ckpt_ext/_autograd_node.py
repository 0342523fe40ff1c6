"""The Python side of the C++ autograd node (csrc/autograd_node.cpp) that plain eager autograd
records for linear_tanh and mlp: its Python path, and its node types as autograd Nodes.

The node is an optimisation of the first-order backward's peak (docs/design.md, "Autograd (first
order)": one (batch, out_features) buffer less than the Functions of ``_autograd``); every
derivative it takes is ``_autograd``'s.
"""
import types

import torch

from . import _C, _autograd, _mlp_autograd
from ._derivatives import _OPS


# Where the node's native path does not apply (create_graph=True, a mode active during backward,
# tensor subclasses) it calls _node_backward: the Functions' backward (_autograd), with a per-node
# state object as ctx (it keeps the create_graph path's recomputed outputs across passes).

def _node_backward(one_layer, state, grad_out, x, weights, biases, has_bias, activation, last,
                   need_x, need_w, need_b):
    """The C++ node's Python path: (grad_x?, [grad_W_i?], [grad_b_j?], keep_state)."""
    grads = None
    if one_layer:  # linear_tanh's
        bias = biases[0] if biases else None
        mask = [need_x, need_w[0], bool(need_b) and need_b[0]]
        if _autograd._plain_autograd():
            gx, gw, gb = _autograd._first_order_from(state, grad_out, x, weights[0], bias, mask)
        else:
            gx, gw, gb = _OPS.linear_tanh_backward.default(grad_out, x, weights[0], bias, mask)
        grads = (gx, [gw], [gb] if bias is not None else [])
    elif activation == "tanh" and _autograd._plain_autograd():  # a tanh stack: tanh's engine
        grads = _autograd._tanh_stack_first_order(state, grad_out, x, weights, biases, has_bias,
                                                  last, need_x, need_w, need_b)
    if grads is None:  # mlp's Function's first order
        grads = _mlp_autograd.mlp_first_order(grad_out, x, weights, biases, has_bias, activation,
                                              last, need_x, need_w, need_b)
    # The node keeps its state only while it holds recomputed outputs for a later pass.
    return (*grads, bool(vars(state)))


_C._set_node_python_backward(_node_backward, types.SimpleNamespace)
# isinstance(y.grad_fn, torch.autograd.graph.Node) holds, as for a Function's node.
torch.autograd.graph.Node.register(_C.LinearTanhBackward)
torch.autograd.graph.Node.register(_C.MlpBackward)
