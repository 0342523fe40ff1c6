"""The fused head loss (ckpt_ext._linear_cross_entropy) against a float64 reference: the loss and
the gradients of h, weight and bias, on seeded random inputs of odd shapes, with tokens ignored,
every token ignored, and a given divisor (transformers' num_items_in_batch); the gradient scaled
by the loss's; no second derivative; bad shapes refused before anything runs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ckpt_ext._linear_cross_entropy import linear_cross_entropy

# The loss is made in float32 from the logits (``logits.float()``, as transformers' loss makes
# it), so float32 rounding bounds every result: the largest relative error measured over these
# cases and seeds 0-4 is 3.7e-07 (float64 and float32 inputs); bfloat16 inputs round the
# gradient to bfloat16 before its GEMMs (as stock autograd does): 5.1e-03.
TOL = {torch.float64: 1e-06, torch.float32: 1e-06, torch.bfloat16: 3e-02}


def _inputs(n, hidden, vocab, bias, dtype, ignored, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) / hidden ** 0.5
    b = torch.randn(vocab, generator=g, dtype=torch.float64) if bias else None
    target = torch.randint(0, vocab, (n,), generator=g)
    if ignored == "some":
        target[torch.rand(n, generator=g) < 0.3] = -100
    elif ignored == "all":
        target[:] = -100
    return [t.to(dtype) if t is not None else None for t in (h, w, b)] + [target]


def _reference(h, w, b, target, divisor):
    """float64 autograd of F.cross_entropy of F.linear: (loss, dh, dw, db)."""
    h, w = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b = b.detach().double().requires_grad_() if b is not None else None
    logits = F.linear(h, w, b)
    if divisor is None:
        loss = F.cross_entropy(logits, target, ignore_index=-100)
    else:
        loss = F.cross_entropy(logits, target, ignore_index=-100, reduction="sum") / divisor
    loss.backward()
    return loss.detach(), h.grad, w.grad, b.grad if b is not None else None


def _fused(h, w, b, target, divisor, grad_loss=1.0):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    b = b.detach().clone().requires_grad_() if b is not None else None
    with torch.no_grad():
        logits = F.linear(h, w, b)
    loss = linear_cross_entropy(h, w, b, logits, target, -100, divisor)
    (loss * grad_loss).backward()
    return loss.detach(), h.grad, w.grad, b.grad if b is not None else None


def _rel(got, want):
    got, want = got.double(), want.double()
    scale = want.norm().item()
    return (got - want).norm().item() / (scale if scale else 1.0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,hidden,vocab", [(1, 3, 5), (7, 16, 129), (37, 5, 64), (64, 32, 16)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("ignored", ["none", "some"])
@pytest.mark.parametrize("divisor", [None, 11])
def test_matches_float64_reference(dtype, n, hidden, vocab, bias, ignored, divisor):
    h, w, b, target = _inputs(n, hidden, vocab, bias, dtype, ignored)
    if ignored == "some" and divisor is None and (target == -100).all():
        target[0] = 0
    want = _reference(h, w, b, target, divisor)
    got = _fused(h, w, b, target, divisor)
    for name, x, y in zip(("loss", "dh", "dw", "db"), got, want):
        if y is None:
            assert x is None
            continue
        assert x.dtype == (torch.float32 if name == "loss" else dtype)
        assert torch.isfinite(x).all(), name
        assert _rel(x, y) <= TOL[dtype], (name, _rel(x, y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_callers_logits_are_left_as_they_were(dtype):
    """The logits are the caller's (the model returns them): read, never written."""
    h, w, b, target = _inputs(9, 4, 33, True, dtype, "some")
    logits = torch.nn.functional.linear(h, w, b)
    before = logits.clone()
    linear_cross_entropy(h.requires_grad_(), w.requires_grad_(), b, logits, target).backward()
    assert torch.equal(logits, before)


def test_every_token_ignored_is_stock():
    """No token counts: the loss is NaN (0/0) and every gradient 0, as F.cross_entropy's."""
    h, w, b, target = _inputs(6, 4, 9, True, torch.float64, "all")
    want, got = _reference(h, w, b, target, None), _fused(h, w, b, target, None)
    assert torch.isnan(want[0]) and torch.isnan(got[0])
    for x, y in zip(got[1:], want[1:]):
        assert torch.equal(y, torch.zeros_like(y)) and torch.equal(x, torch.zeros_like(x))


def test_chunks_cover_every_row():
    """More rows than chunks, rows not a multiple of the chunk count: every row's gradient is
    written."""
    n = 3 * 32 + 1  # 32 chunks (vocabulary / hidden)
    h, w, b, target = _inputs(n, 2, 64, False, torch.float64, "none")
    got, want = _fused(h, w, b, target, None), _reference(h, w, b, target, None)
    assert torch.isfinite(got[1]).all()
    assert _rel(got[1], want[1]) <= TOL[torch.float64]


def test_gradient_scaled_by_the_loss_gradient():
    h, w, b, target = _inputs(9, 6, 17, True, torch.float64, "some")
    one, two = _fused(h, w, b, target, None), _fused(h, w, b, target, None, grad_loss=2.5)
    for x, y in zip(one[1:], two[1:]):
        assert torch.allclose(y, 2.5 * x, rtol=1e-15, atol=0)


def test_divisor_tensor_equals_int():
    h, w, b, target = _inputs(9, 6, 17, False, torch.float64, "some")
    a = _fused(h, w, b, target, 7)
    t = _fused(h, w, b, target, torch.tensor(7))
    for x, y in zip(a, t):
        if x is not None:
            assert torch.equal(x, y)


def test_no_second_derivative():
    h, w, b, target = _inputs(5, 4, 7, False, torch.float64, "none")
    h.requires_grad_()
    loss = linear_cross_entropy(h, w, None, F.linear(h, w), target)
    (dh,) = torch.autograd.grad(loss, h, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        dh.sum().backward()


@pytest.mark.parametrize("need", [[True, True, True], [False, True, False], [True, False, False]])
def test_opcheck(need):
    """The op behind the loss: schema, fake kernel and dispatch as torch.library checks them."""
    h, w, b, target = _inputs(7, 5, 19, True, torch.float32, "some")
    torch.library.opcheck(torch.ops.ckpt_ext.linear_cross_entropy,
                          (h, w, b, F.linear(h, w, b), target, -100, torch.tensor(5.0), need))


def test_bad_shapes_named():
    h, w, b, target = _inputs(5, 4, 7, False, torch.float64, "none")
    with pytest.raises(ValueError, match=r"logits \(5, 6\)"):
        linear_cross_entropy(h, w, None, torch.zeros(5, 6, dtype=h.dtype), target)
    with pytest.raises(ValueError, match=r"target \(4,\)"):
        linear_cross_entropy(h, w, None, F.linear(h, w), target[:4])
