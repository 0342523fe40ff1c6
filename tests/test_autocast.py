"""Autocast: the fused op follows nn.Linear's policy (aten::linear is lower_precision_fp).

Inputs are cast to the dtype of the *current* autocast context, the output comes back in it, and
gradients land in the parameters' own dtype. The reference is nn.Linear + tanh under the very same
context, and the float64 math of the same (float32) parameters.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import ckpt_ext
from ckpt_ext import FusedLinearTanh, fuse
from _ecosys import Net, rel_err
from reference import linear_tanh_ref

HAS_CUDA = torch.cuda.is_available() and ckpt_ext.WITH_CUDA
NO_CUDA = "CUDA autocast: needs a GPU and a CUDA build of ckpt_ext"

# bound on ‖out − ref64‖/‖ref64‖ per autocast dtype
TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}

CASES = [
    ("cpu", torch.bfloat16),
    ("cpu", torch.float16),
    pytest.param("cuda", torch.float16, marks=pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)),
]


def _pair(device, K=37, N=29, bias=True):
    torch.manual_seed(0)
    plain = nn.Linear(K, N, bias=bias, device=device)
    fused = FusedLinearTanh.from_linear(plain)  # same parameters
    return plain, fused


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("device,dtype", CASES)
def test_matches_nn_linear_under_autocast(device, dtype, bias):
    plain, fused = _pair(device, bias=bias)
    x = torch.randn(3, 5, 37, device=device, requires_grad=True)
    g = torch.randn(3, 5, 29, device=device)

    with torch.autocast(device, dtype=dtype):
        y = fused(x)
        y_ref = torch.tanh(plain(x))
    assert y.dtype == y_ref.dtype == dtype  # computed and returned in the context's dtype

    params = [x, plain.weight] + ([plain.bias] if bias else [])
    grads = torch.autograd.grad(y, params, g.to(dtype))
    grads_ref = torch.autograd.grad(y_ref, params, g.to(dtype))

    # float64 math of the same parameters: the error of the fused op is that of nn.Linear's
    # autocast path (both compute in `dtype`), within the dtype's bound.
    x64 = x.detach().double().requires_grad_()
    w64 = plain.weight.detach().double().requires_grad_()
    b64 = plain.bias.detach().double().requires_grad_() if bias else None
    y64 = linear_tanh_ref(x64, w64, b64)
    grads64 = torch.autograd.grad(y64, [x64, w64] + ([b64] if bias else []), g.double())

    assert rel_err(y, y64) <= TOL[dtype]
    assert rel_err(y, y_ref) <= TOL[dtype]
    for got, ref, r64, p in zip(grads, grads_ref, grads64, params):
        assert got.dtype == ref.dtype == p.dtype == torch.float32  # grads in the params' dtype
        assert rel_err(got, r64) <= 2 * TOL[dtype]
        assert rel_err(got, ref) <= 2 * TOL[dtype]


@pytest.mark.parametrize("device,dtype", CASES)
def test_parameter_grads_accumulate_in_float32(device, dtype):
    torch.manual_seed(0)
    model, _ = fuse(Net().to(device))
    x = torch.randn(9, 12, device=device)
    with torch.autocast(device, dtype=dtype):
        out = model(x)
    assert out.dtype == dtype
    out.float().pow(2).sum().backward()
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
        assert torch.isfinite(p.grad).all(), name


def test_follows_the_current_context_not_a_fixed_dtype():
    # (Nesting two lower-precision contexts is not tested: PyTorch's cast cache is keyed by tensor
    # only, so nn.Linear itself then fails with "mat1 and mat2 must have the same dtype".)
    plain, fused = _pair("cpu")
    x = torch.randn(4, 37)
    for dtype in (torch.bfloat16, torch.float16, torch.bfloat16):
        with torch.autocast("cpu", dtype=dtype):
            assert fused(x).dtype == dtype
            with torch.autocast("cpu", enabled=False):
                assert fused(x).dtype == torch.float32
    assert fused(x).dtype == torch.float32


def test_float64_is_left_in_float64_like_nn_linear():
    plain, fused = _pair("cpu")
    plain.double()
    x = torch.randn(4, 37, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_ref = fused(x), torch.tanh(plain(x))
    assert y.dtype == y_ref.dtype == torch.float64
    assert rel_err(y, y_ref) <= 1e-12


def test_autocast_inside_compiled_function():
    plain, fused = _pair("cpu")
    x = torch.randn(4, 37, requires_grad=True)

    def f(inp):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fused(inp)

    torch._dynamo.reset()
    y = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    y_eager = f(x)
    assert y.dtype == torch.bfloat16
    assert rel_err(y, y_eager) == 0.0
    (gw,) = torch.autograd.grad(y.float().sum(), [plain.weight])
    (gw_e,) = torch.autograd.grad(y_eager.float().sum(), [plain.weight])
    assert gw.dtype == torch.float32 and rel_err(gw, gw_e) <= 1e-6
