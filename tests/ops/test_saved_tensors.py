"""What autograd keeps between forward and backward: the point of the project. Measured with
saved_tensors_hooks (count and bytes of every packed tensor)."""
import torch
from torch import nn

import ckpt_ext


def _saved(model, x):
    """(tensors packed, bytes of packed tensors that are not parameters) during model(x)."""
    params = {p.data_ptr() for p in model.parameters()}
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = model(x)
    act_bytes = sum(t.numel() * t.element_size() for t in packed if t.data_ptr() not in params)
    return out, packed, act_bytes


def test_fused_saves_input_and_parameter_references_only():
    m = ckpt_ext.FusedLinearTanh(64, 256)
    x = torch.randn(32, 64, requires_grad=True)
    _, packed, act_bytes = _saved(m, x)
    assert len(packed) == 3  # x, weight, bias
    assert packed[0] is x or packed[0].data_ptr() == x.data_ptr()
    assert {packed[1].data_ptr(), packed[2].data_ptr()} == {m.weight.data_ptr(), m.bias.data_ptr()}
    assert act_bytes == 32 * 64 * 4  # x only: nothing of size batch x out_features


def test_fused_without_bias_saves_no_bias():
    m = ckpt_ext.FusedLinearTanh(8, 16, bias=False)
    _, packed, act_bytes = _saved(m, torch.randn(4, 8, requires_grad=True))
    assert sum(t is not None for t in packed) == 2 and act_bytes == 4 * 8 * 4


def test_chain_saves_less_than_unfused():
    # A 3-block chain, batch B, width H: unfused keeps each block's input AND each tanh output
    # (the last one is kept by nobody else); fused keeps only each block's input.
    B, H, depth = 16, 128, 3
    torch.manual_seed(0)
    plain = nn.Sequential(*[nn.Sequential(nn.Linear(H, H), nn.Tanh()) for _ in range(depth)])
    fused = nn.Sequential(*[ckpt_ext.FusedLinearTanh.from_linear(b[0]) for b in plain])
    x = torch.randn(B, H, requires_grad=True)
    _, _, plain_bytes = _saved(plain, x)
    _, _, fused_bytes = _saved(fused, x)
    elem = 4
    assert fused_bytes == depth * B * H * elem
    # plain: x and the Linear inputs (= previous tanh outputs, shared storage counted per pack),
    # plus every tanh output. Distinct storages: x + depth tanh outputs.
    assert plain_bytes == (depth + depth) * B * H * elem
    assert fused_bytes < plain_bytes
