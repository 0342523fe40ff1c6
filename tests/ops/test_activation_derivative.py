"""The activation kernels' derivative pass (_C._activation_derivative: f^(k)(z) for k = 0 to 3, the
values the create_graph formulas of the higher orders multiply by where they record no graph)
against the registry row's ATen spelling in float64: every activation, order and dtype, every
CPU ISA level, odd and empty shapes, strided inputs, poisoned buffers; order 0 is the forward's f
to the bit; and the errors."""
from __future__ import annotations

import pytest
import torch

import ckpt_ext
from ckpt_ext import _C
from ckpt_ext._activations import REGISTRY
from reference import measured, rel_err, requires_gpu

ACTS = list(ckpt_ext.ACTIVATIONS)
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# ‖ours − ref‖/‖ref‖ bounds per order 0..3, ~10× the largest measured over the activations and
# the CPU levels. float32: 3.7e-8, 2.7e-7, 2.4e-6, 1.2e-5; float64: 2.3e-17, 5.2e-16, 2.1e-14,
# 2.1e-13 (orders 2 and 3: gelu_tanh's, whose tails cancel); bfloat16 <= 1.9e-3; float16 <= 2.5e-4.
BOUND = {torch.float32: (4e-7, 3e-6, 2.5e-5, 1.2e-4), torch.float64: (2.5e-16, 5e-15, 2e-13, 2e-12),
         torch.bfloat16: (2e-2,) * 4, torch.float16: (2.5e-3,) * 4}


def _z(shape, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    # both sides of 0, softplus's threshold 20 crossed, no exact 0 (relu's kink)
    z = torch.randn(shape, generator=g, dtype=torch.float64) * 8
    return z.to(dtype=dtype, device=device)


def _reference(name, z):
    """f and its first three derivatives at z (any dtype; from its values in float64): the
    registry row's ATen spelling, which tests/ops/test_activation_registry.py holds to autograd of
    the row's own op (autograd's own third derivative of gelu_tanh is NaN at z = -28; the row's
    is finite)."""
    row = REGISTRY[name]
    z64 = z.detach().double().cpu()
    ref = [row.f(z64), row.derivative(z64), row.d2(z64), row.d3(z64)]
    assert all(torch.isfinite(r).all() for r in ref)
    return ref


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ACTS)
def test_every_order_against_autograd_of_f(level, name, dtype):
    z = _z((37, 65), dtype)  # odd widths: the vector loop's tail
    ref = _reference(name, z)
    for k in range(4):
        ours = _C._activation_derivative(z, name, k)
        assert ours.dtype == dtype and ours.shape == z.shape and ours.is_contiguous()
        assert torch.isfinite(ours).all()
        if name == "relu" and k >= 2:
            assert torch.equal(ours, torch.zeros_like(ours))  # piecewise linear
            continue
        err = rel_err(ours.double(), ref[k])
        assert measured(f"activation_derivative {dtype} order {k}", err) <= BOUND[dtype][k], \
            (name, k, err)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ACTS)
def test_order_zero_is_the_forward_f_bitwise(name, dtype):
    """f from the derivative pass is the f the fused forward computes, to the bit (so the
    create_graph formulas recompute the forward's own values)."""
    z = _z((5, 131), dtype, seed=1)
    eye = torch.eye(131, dtype=dtype)  # z·I is z exactly: one nonzero term per sum
    assert torch.equal(_C._activation_derivative(z, name, 0),
                       ckpt_ext.mlp(z, [eye], activation=name))


@pytest.mark.parametrize("shape", [(0, 7), (3, 0), (7,), (2, 3, 33), (1, 1)], ids=str)
def test_odd_and_empty_shapes(shape):
    for name in ("silu", "sin", "gelu_tanh"):
        z = _z(shape, torch.float32, seed=2)
        ref = _reference(name, z)
        for k in range(4):
            ours = _C._activation_derivative(z, name, k)
            assert ours.shape == z.shape
            if z.numel():
                assert rel_err(ours.double(), ref[k]) <= BOUND[torch.float32][k]


def test_strided_input_reads_its_values():
    z = _z((65, 33), torch.float32, seed=3).t()  # not contiguous
    for k in range(4):
        ours = _C._activation_derivative(z, "quick_gelu", k)
        assert torch.equal(ours, _C._activation_derivative(z.contiguous(), "quick_gelu", k))


def test_every_element_written_over_poisoned_buffers():
    _C._set_poison_buffers(True)
    try:
        z = _z((17, 257), torch.float32, seed=4)
        for name in ACTS:
            for k in range(4):
                assert torch.isfinite(_C._activation_derivative(z, name, k)).all(), (name, k)
    finally:
        _C._set_poison_buffers(False)


def test_nan_stays_nan():
    z = torch.tensor([float("nan"), 1.0])
    for name in ACTS:
        for k in range(4):
            if name == "relu" and k >= 1:
                continue  # f' is stock threshold_backward's (gy at NaN), f'' = f''' = 0
            assert torch.isnan(_C._activation_derivative(z, name, k)[0]), (name, k)


def test_errors_name_expected_and_given():
    z = torch.ones(3)
    with pytest.raises(ValueError, match="order must be 0, 1, 2 or 3; got 4"):
        _C._activation_derivative(z, "tanh", 4)
    with pytest.raises(ValueError, match="mish"):
        _C._activation_derivative(z, "mish", 1)
    with pytest.raises(ValueError, match="Int"):
        _C._activation_derivative(torch.ones(3, dtype=torch.int32), "tanh", 1)


@pytest.mark.cuda
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_every_order_against_autograd_of_f(dtype):
    for name in ACTS:
        z = _z((37, 65), dtype, device="cuda")
        ref = _reference(name, z)
        for k in range(4):
            ours = _C._activation_derivative(z, name, k)
            assert ours.is_cuda and torch.isfinite(ours).all()
            if name == "relu" and k >= 2:
                assert not ours.any()
                continue
            assert rel_err(ours.double().cpu(), ref[k]) <= BOUND[dtype][k], (name, k)
        # an input 4 bytes past a 16-byte boundary: the kernel's one-element path
        zu = z.flatten()[1:]
        for k in range(4):
            ours = _C._activation_derivative(zu, name, k)
            if not (name == "relu" and k >= 2):
                assert rel_err(ours.double().cpu(), ref[k].flatten()[1:]) <= BOUND[dtype][k]
