"""The higher orders' elementwise pass (_C._activation_terms: add + Σ f^(k)(p)·Π factors in one
pass, the products the create_graph formulas of ckpt_ext/_mlp_higher_order.py take where they
record no graph) against the registry row's ATen spelling in float64: every activation and dtype,
every CPU ISA level, odd, empty and strided shapes, poisoned buffers, NaN, writing in place; one
order alone is the derivative pass to the bit; and the errors."""
from __future__ import annotations

import pytest
import torch

import ckpt_ext
from ckpt_ext import _C
from ckpt_ext._activations import REGISTRY
from reference import measured, rel_err, requires_gpu

ACTS = list(ckpt_ext.ACTIVATIONS)
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# ‖ours − ref‖/‖ref‖ over TERMS below, ~10× the largest measured over the activations and the
# CPU levels: float32 5.2e-7, float64 1.8e-14 (gelu_tanh's, whose f'' and f''' cancel in their
# tails), bfloat16 1.8e-3, float16 2.2e-4.
BOUND = {torch.float32: 5e-6, torch.float64: 2e-13, torch.bfloat16: 2e-2, torch.float16: 2.5e-3}
# Every order, 0 to 3 factors, one order twice: (order, factor indices)
TERMS = [(2, (0, 1)), (3, (0, 1, 2)), (1, (2,)), (0, ()), (2, (3,))]


def _tensor(shape, dtype, seed, device="cpu", scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype=dtype,
                                                                             device=device)


def _inputs(shape, dtype, device="cpu", seed=0):
    # p on both sides of 0 and past softplus's threshold 20; no exact 0 (relu's kink)
    p = _tensor(shape, dtype, seed, device, scale=8)
    factors = [_tensor(shape, dtype, seed + 1 + i, device) for i in range(4)]
    add = _tensor(shape, dtype, seed + 9, device)
    return p, factors, add


def _reference(name, p, factors, terms, add=None):
    """add + Σ f^(k)(p)·Π factors in float64 on the CPU, from the registry row's ATen spelling."""
    row = REGISTRY[name]
    p64 = p.double().cpu()
    orders = [row.f, row.derivative, row.d2, row.d3]
    out = torch.zeros_like(p64) if add is None else add.double().cpu()
    for k, idx in terms:
        term = orders[k](p64)
        for i in idx:
            term = term * factors[i].double().cpu()
        out = out + term
    return out


def _ours(name, p, factors, terms, add=None, out=None):
    return _C._activation_terms(p, name, [(k, [factors[i] for i in idx]) for k, idx in terms],
                                add, out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ACTS)
def test_terms_against_the_registry_spelling(level, name, dtype):
    p, factors, add = _inputs((37, 65), dtype)  # odd widths: the vector loop's tail
    for terms in (TERMS[:4], TERMS[4:]):  # at most 4 terms a call
        ours = _ours(name, p, factors, terms, add)
        assert ours.dtype == dtype and ours.shape == p.shape and ours.is_contiguous()
        err = rel_err(ours, _reference(name, p, factors, terms, add))
        assert measured(f"activation_terms {dtype}", err) <= BOUND[dtype], (name, terms, err)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ACTS)
def test_one_order_alone_is_the_derivative_pass_bitwise(level, name, dtype):
    p, _, _ = _inputs((5, 131), dtype, seed=1)
    for k in range(4):
        assert torch.equal(_C._activation_terms(p, name, [(k, [])]),
                           _C._activation_derivative(p, name, k)), (name, k)


@pytest.mark.parametrize("shape", [(0, 7), (3, 0), (7,), (2, 3, 33), (4099, 7), (1, 1)], ids=str)
def test_odd_and_empty_shapes(shape):
    """(4099, 7): several parallel chunks and blocks of the CPU kernel, a partial last vector."""
    for name in ("silu", "sin", "gelu_tanh"):
        p, factors, add = _inputs(shape, torch.float32, seed=2)
        ours = _ours(name, p, factors, TERMS[:4], add)
        assert ours.shape == p.shape
        if p.numel():
            assert rel_err(ours, _reference(name, p, factors, TERMS[:4], add)) <= \
                BOUND[torch.float32]


def test_strided_tensors_read_their_values():
    p, factors, add = _inputs((65, 33), torch.float32, seed=3)
    strided = [t.t().contiguous().t() for t in (p, *factors, add)]  # same values, not contiguous
    assert not strided[0].is_contiguous()
    ours = _ours("quick_gelu", strided[0], strided[1:5], TERMS[:4], strided[5])
    assert torch.equal(ours, _ours("quick_gelu", p, factors, TERMS[:4], add))


def test_written_in_place_into_add():
    p, factors, add = _inputs((33, 17), torch.float32, seed=4)
    expected = _ours("sin", p, factors, TERMS[:3], add)
    buf = add.clone()
    result = _ours("sin", p, factors, TERMS[:3], buf, buf)
    assert result.data_ptr() == buf.data_ptr() and torch.equal(buf, expected)


def test_every_element_written_over_poisoned_buffers():
    _C._set_poison_buffers(True)
    try:
        p, factors, _ = _inputs((17, 257), torch.float32, seed=5)
        for name in ACTS:
            assert torch.isfinite(_ours(name, p, factors, TERMS[:4])).all(), name
    finally:
        _C._set_poison_buffers(False)


def test_nan_stays_nan():
    p = torch.tensor([float("nan"), 1.0, 0.5])
    f = torch.tensor([2.0, float("nan"), 1.0])
    a = torch.tensor([1.0, 1.0, float("nan")])
    for name in ACTS:
        out = _C._activation_terms(p, name, [(1, [f]), (0, [])], a)
        assert torch.isnan(out).all(), (name, out)


def test_errors_name_expected_and_given():
    p = torch.ones(3)
    with pytest.raises(ValueError, match="order must be 0, 1, 2 or 3; got 4"):
        _C._activation_terms(p, "tanh", [(4, [])])
    with pytest.raises(ValueError, match="1 to 4 terms; got 5"):
        _C._activation_terms(p, "tanh", [(1, [])] * 5)
    with pytest.raises(ValueError, match="1 to 4 terms; got 0"):
        _C._activation_terms(p, "tanh", [])
    with pytest.raises(ValueError, match="at most 3 factors; got 4"):
        _C._activation_terms(p, "tanh", [(1, [p] * 4)])
    with pytest.raises(ValueError, match=r"a factor must have p's shape \[3\].*got \[4\]"):
        _C._activation_terms(p, "tanh", [(1, [torch.ones(4)])])
    with pytest.raises(ValueError, match="add must have p's shape.*Double"):
        _C._activation_terms(p, "tanh", [(1, [])], torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="out must be contiguous"):
        _C._activation_terms(torch.ones(3, 2), "tanh", [(1, [])], None, torch.ones(2, 3).t())
    with pytest.raises(ValueError, match="mish"):
        _C._activation_terms(p, "mish", [(1, [])])
    with pytest.raises(ValueError, match="Int"):
        _C._activation_terms(torch.ones(3, dtype=torch.int32), "tanh", [(1, [])])


@pytest.mark.cuda
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_terms_against_the_registry_spelling(dtype):
    for name in ACTS:
        p, factors, add = _inputs((37, 65), dtype, device="cuda")
        ours = _ours(name, p, factors, TERMS[:4], add)
        assert ours.is_cuda
        assert rel_err(ours, _reference(name, p, factors, TERMS[:4], add)) <= BOUND[dtype], name
        for k in range(4):  # one order alone: the derivative pass to the bit
            assert torch.equal(_C._activation_terms(p, name, [(k, [])]),
                               _C._activation_derivative(p, name, k)), (name, k)
        # inputs 4 bytes past a 16-byte boundary, written in place into add
        pu, fu, au = p.flatten()[1:], [f.flatten()[1:] for f in factors], add.flatten()[1:].clone()
        expected = _reference(name, pu, fu, TERMS[:4], au)
        _ours(name, pu, fu, TERMS[:4], au, au)
        assert rel_err(au, expected) <= BOUND[dtype], name


def test_formulas_take_atens_products_for_what_the_kernel_cannot_read():
    """_mlp_higher_order's _Input.terms runs the kernel for plain tensors of p's shape, dtype and
    device, and ATen's products otherwise (a broadcast factor, another dtype): the same values."""
    from ckpt_ext._mlp_higher_order import _Input
    p, factors, add = _inputs((9, 5), torch.float32, seed=6)
    with torch.no_grad():
        native = _Input("silu", p).terms((2, factors[0], factors[1]), (1, factors[2]))
        row = factors[1][:1]  # (1, 5): broadcast along the rows
        mixed = _Input("silu", p).terms((2, factors[0], row.expand_as(p).contiguous()),
                                        (1, factors[2]))
        broadcast = _Input("silu", p).terms((2, factors[0], row), (1, factors[2]))
        promoted = _Input("silu", p).terms((1, factors[2].double()))
    assert torch.equal(broadcast, mixed)
    torch.testing.assert_close(promoted, _Input("silu", p).terms((1, factors[2])).double())
    assert rel_err(native, _reference("silu", p, factors, [(2, (0, 1)), (1, (2,))])) <= \
        BOUND[torch.float32]
