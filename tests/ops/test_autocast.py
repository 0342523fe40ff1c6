"""Autocast: the fused op follows nn.Linear's policy (aten::linear is lower_precision_fp).

Inputs are cast to the dtype of the *current* autocast context, the output comes back in it, and
gradients land in the parameters' own dtype. Every test checks values, not only dtypes: against
nn.Linear + tanh under the very same context, and against the float64 math of the same (float32)
parameters.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ckpt_ext
from ckpt_ext import FusedLinearTanh, fuse
from _ecosys import Net, rel_err
from reference import linear_tanh_ref, measured, requires_gpu

# Bounds per autocast dtype, ~3-4x the largest relative errors measured over 500 seed offsets
# (CPU, AVX2 build):
#   output vs float64: bfloat16 3.4e-3, float16 4.3e-4;
#   gradients vs float64 (one layer / the 4-layer Net): bfloat16 4.4e-3 / 1.07e-2, float16
#   5.3e-4 / 1.25e-3; vs nn.Linear under the same autocast: bfloat16 5.2e-3, float16 6.7e-4
#   (both sides round to the autocast dtype, so they differ by about the rounding of each).
# The output against nn.Linear + tanh under the same autocast measured 0 (the same bits: the same
# casts, the same GEMM with the bias in it, tanh rounded once); one eps of the dtype is allowed for
# ISA levels or devices whose tanh differs in the last bit.
TOL_OUT = {torch.bfloat16: 1e-02, torch.float16: 1.5e-03}
TOL_GRAD = {torch.bfloat16: 4e-02, torch.float16: 5e-03}
SAME_BITS_BUT = {dt: torch.finfo(dt).eps for dt in (torch.bfloat16, torch.float16)}

CASES = [
    ("cpu", torch.bfloat16),
    ("cpu", torch.float16),
    pytest.param("cuda", torch.float16, marks=[pytest.mark.cuda, requires_gpu]),
    pytest.param("cuda", torch.bfloat16, marks=[pytest.mark.cuda, requires_gpu]),
]
case_id = lambda v: str(v).removeprefix("torch.")


def _pair(device, seed, K=37, N=29, bias=True):
    torch.manual_seed(seed)
    plain = nn.Linear(K, N, bias=bias, device=device)
    fused = FusedLinearTanh.from_linear(plain)  # same parameters
    return plain, fused


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("device,dtype", CASES, ids=case_id)
def test_matches_nn_linear_under_autocast(device, dtype, bias, seed):
    plain, fused = _pair(device, seed, bias=bias)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, 37, generator=gen).to(device).requires_grad_()
    g = torch.randn(3, 5, 29, generator=gen).to(device)

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

    dt = case_id(dtype)
    assert measured(f"autocast/{dt}/out_vs_f64", rel_err(y, y64)) <= TOL_OUT[dtype]
    assert measured(f"autocast/{dt}/out_vs_linear", rel_err(y, y_ref)) <= SAME_BITS_BUT[dtype]
    for got, ref, r64, p in zip(grads, grads_ref, grads64, params):
        assert got.dtype == ref.dtype == p.dtype == torch.float32  # grads in the params' dtype
        assert measured(f"autocast/{dt}/grad_vs_f64", rel_err(got, r64)) <= TOL_GRAD[dtype]
        assert measured(f"autocast/{dt}/grad_vs_linear", rel_err(got, ref)) <= TOL_GRAD[dtype]


@pytest.mark.parametrize("device,dtype", CASES, ids=case_id)
def test_parameter_grads_accumulate_in_float32(device, dtype, seed):
    torch.manual_seed(seed)
    plain = Net().to(device)
    model, _ = fuse(copy.deepcopy(plain))
    x = torch.randn(9, 12, device=device)
    outs = []
    for m in (model, plain):
        with torch.autocast(device, dtype=dtype):
            out = m(x)
        assert out.dtype == dtype
        out.float().pow(2).sum().backward()
        outs.append(out)
    dt = case_id(dtype)
    assert measured(f"autocast/{dt}/net_out_vs_plain",
                    rel_err(outs[0], outs[1])) <= SAME_BITS_BUT[dtype]
    # and against the float64 model: the fused run's error is that of autocast itself
    ref = copy.deepcopy(plain).double()
    ref.zero_grad()
    ref(x.double()).pow(2).sum().backward()
    grads_plain = dict(plain.named_parameters())
    grads_ref = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
        err_plain = rel_err(p.grad, grads_plain[name].grad)
        err_ref = rel_err(p.grad, grads_ref[name].grad)
        assert measured(f"autocast/{dt}/net_grad_vs_plain", err_plain) <= TOL_GRAD[dtype], name
        assert measured(f"autocast/{dt}/net_grad_vs_f64", err_ref) <= TOL_GRAD[dtype], name


def test_follows_the_current_context_not_a_fixed_dtype(seed):
    # (Nesting two lower-precision contexts is not tested: PyTorch's cast cache is keyed by tensor
    # only, so nn.Linear itself then fails with "mat1 and mat2 must have the same dtype".)
    plain, fused = _pair("cpu", seed)
    x = torch.randn(4, 37)
    for dtype in (torch.bfloat16, torch.float16, torch.bfloat16):
        with torch.autocast("cpu", dtype=dtype):
            y, y_ref = fused(x), torch.tanh(plain(x))
            assert y.dtype == y_ref.dtype == dtype
            assert measured(f"autocast/{case_id(dtype)}/out_vs_linear",
                            rel_err(y, y_ref)) <= SAME_BITS_BUT[dtype]
            with torch.autocast("cpu", enabled=False):
                y32 = fused(x)
                assert y32.dtype == torch.float32
                assert torch.equal(y32, ckpt_ext.linear_tanh(x, plain.weight, plain.bias))
    assert torch.equal(fused(x), ckpt_ext.linear_tanh(x, plain.weight, plain.bias))


def test_float64_is_left_in_float64_like_nn_linear(seed):
    plain, fused = _pair("cpu", seed)
    plain.double()
    x = torch.randn(4, 37, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_ref = fused(x), torch.tanh(plain(x))
    assert y.dtype == y_ref.dtype == torch.float64
    # measured 0 (the same bits); a few float64 eps for a tanh that differs in the last bit
    assert measured("autocast/float64_left_alone", rel_err(y, y_ref)) <= 1e-15


def test_autocast_inside_compiled_function(seed):
    plain, fused = _pair("cpu", seed)
    x = torch.randn(4, 37, requires_grad=True)

    def f(inp):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fused(inp)

    torch._dynamo.reset()
    y = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    y_eager = f(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, y_eager)  # the same op on the same casts: the same bits
    (gw,) = torch.autograd.grad(y.float().sum(), [plain.weight])
    (gw_e,) = torch.autograd.grad(y_eager.float().sum(), [plain.weight])
    assert gw.dtype == torch.float32 and torch.equal(gw, gw_e)
