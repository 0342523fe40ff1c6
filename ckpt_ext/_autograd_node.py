"""The Python side of the C++ autograd node (csrc/autograd_node.cpp) that plain eager autograd
records for the mlp op: its Python path, and its node type as an autograd Node.

The node is an optimisation of the first-order backward's peak (docs/design.md, "Autograd (first
order)": one (batch, out_features) buffer less than the mlp Function of ``_mlp_autograd``);
every derivative it takes is that Function's.
"""
import types

import torch

from . import _C, _mlp_autograd


# Where the node's native path does not apply (create_graph=True, a mode active during backward,
# tensor subclasses) it calls _node_backward: the Function's first order (_mlp_autograd), with a
# per-node state object as ctx (it keeps the create_graph path's recomputed outputs across passes).

def _node_backward(state, grad_out, x, weights, biases, has_bias, activation, last, need_x,
                   need_w, need_b):
    """The C++ node's Python path: (grad_x?, [grad_W_i?], [grad_b_j?], keep_state)."""
    grads = _mlp_autograd.first_order(state, grad_out, x, weights, biases, has_bias, activation,
                                      last, need_x, need_w, need_b)
    # The node keeps its state only while it holds recomputed outputs for a later pass.
    return (*grads, bool(vars(state)))


_C._set_node_python_backward(_node_backward, types.SimpleNamespace)
# isinstance(y.grad_fn, torch.autograd.graph.Node) holds, as for a Function's node.
torch.autograd.graph.Node.register(_C.MlpBackward)
