"""FusedLinearTanh against nn.Sequential(nn.Linear, nn.Tanh): initialisation, parameter names and
sharing, output and every parameter grad."""
import pytest
import torch
from torch import nn

import ckpt_ext
from ckpt_ext import FusedLinearTanh
from reference import TOL, measured, rel_err


@pytest.mark.parametrize("bias", [True, False])
def test_same_seed_same_initialisation_as_nn_linear(bias):
    torch.manual_seed(123)
    ref = nn.Linear(37, 11, bias=bias)
    torch.manual_seed(123)
    fused = FusedLinearTanh(37, 11, bias=bias)
    assert torch.equal(fused.weight, ref.weight)
    assert (fused.bias is None) == (not bias)
    if bias:
        assert torch.equal(fused.bias, ref.bias)
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in ref.named_parameters()]


def test_not_an_nn_linear_subclass():
    # Tools that replace every nn.Linear would otherwise drop the tanh silently.
    assert not isinstance(FusedLinearTanh(2, 3), nn.Linear)


def test_factory_kwargs():
    torch.manual_seed(7)
    m = FusedLinearTanh(4, 5, dtype=torch.float64, device="cpu")
    torch.manual_seed(7)
    ref = nn.Linear(4, 5, dtype=torch.float64, device="cpu")
    assert m.weight.dtype == torch.float64 and m.bias.dtype == torch.float64
    assert m.weight.shape == (5, 4) and m.bias.shape == (5,)
    assert torch.equal(m.weight, ref.weight) and torch.equal(m.bias, ref.bias)  # values too
    meta = FusedLinearTanh(4, 5, device="meta")
    assert meta.weight.is_meta


def test_extra_repr_like_nn_linear():
    assert repr(FusedLinearTanh(3, 4, bias=False)) == \
        "FusedLinearTanh(in_features=3, out_features=4, bias=False)"


@pytest.mark.parametrize("bias", [True, False])
def test_from_linear_shares_parameters(bias):
    lin = nn.Linear(6, 4, bias=bias)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    fused = FusedLinearTanh.from_linear(lin)
    assert fused.weight is lin.weight and fused.bias is lin.bias
    before = lin.weight.detach().clone()
    fused(torch.randn(3, 6)).sum().backward()
    opt.step()  # the optimizer built over the Linear updates what the fused module uses
    assert not torch.equal(before, fused.weight)


def test_from_linear_rejects_non_linear():
    with pytest.raises(TypeError, match="from_linear expects an nn.Linear, got Conv1d"):
        FusedLinearTanh.from_linear(nn.Conv1d(1, 1, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("bias", [True, False])
def test_module_matches_sequential_linear_tanh(device, dtype, bias, seed):
    torch.manual_seed(seed)
    seq = nn.Sequential(nn.Linear(33, 17, bias=bias), nn.Tanh()).to(device, dtype)
    fused = FusedLinearTanh(33, 17, bias=bias, device=device, dtype=dtype)
    fused.load_state_dict({k.removeprefix("0."): v for k, v in seq.state_dict().items()})
    x = torch.randn(5, 9, 33, device=device, dtype=dtype)
    xs, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    ys, yf = seq(xs), fused(xf)
    # Both sides round: TOL (reference.py) is ~5x the largest difference measured over 500 seed
    # offsets (float32 1.9e-07, float64 3.3e-16, both in grad_bias; outputs: the same bits).
    dt = str(dtype).removeprefix("torch.")
    assert measured(f"modules/{dt}/out", rel_err(yf, ys)) <= TOL[dtype]
    ys.square().mean().backward()
    yf.square().mean().backward()
    assert measured(f"modules/{dt}/grad_x", rel_err(xf.grad, xs.grad)) <= TOL[dtype]
    assert measured(f"modules/{dt}/grad_weight",
                    rel_err(fused.weight.grad, seq[0].weight.grad)) <= TOL[dtype]
    if bias:
        assert measured(f"modules/{dt}/grad_bias",
                        rel_err(fused.bias.grad, seq[0].bias.grad)) <= TOL[dtype]


def test_module_state_dict_loads_into_nn_linear():
    fused = FusedLinearTanh(5, 3)
    lin = nn.Linear(5, 3)
    lin.load_state_dict(fused.state_dict())
    assert torch.equal(lin.weight, fused.weight)


def test_public_api():
    assert ckpt_ext.FusedLinearTanh is FusedLinearTanh
    assert callable(ckpt_ext.linear_tanh)
    assert isinstance(ckpt_ext.WITH_CUDA, bool)
    assert "ckpt_ext" in str(torch.ops.ckpt_ext.mlp)
