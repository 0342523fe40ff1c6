"""The activation registry (ckpt_ext/_activations.py) against stock PyTorch, row by row: f, f', f'',
f''' against autograd of the row's own op in float64; what the backward reads against what
autograd saves (saved_tensors_hooks); every module form, call form and method computes f; and a
module of the user's own that returns one activation call is recognised (and fused) while one that
does anything more is not."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ckpt_ext
from ckpt_ext._activation_modules import module_activation
from ckpt_ext._activations import REGISTRY
from ckpt_ext.convert.facts import SAVES_INPUT, tensors_per_layer

ACTS = list(ckpt_ext.ACTIVATIONS)


def _z(n=257, seed=0):
    g = torch.Generator().manual_seed(seed)
    # both sides of 0, softplus's threshold 20 crossed, no exact 0 (relu's kink)
    return (torch.randn(n, generator=g, dtype=torch.float64) * 8).requires_grad_()


def test_one_row_per_activation_of_the_library():
    assert list(REGISTRY) == sorted(REGISTRY, key=ACTS.index)
    assert set(REGISTRY) == set(ACTS)


@pytest.mark.parametrize("name", ACTS)
def test_derivatives_equal_autograd_of_f(name):
    row = REGISTRY[name]
    z = _z()
    d = [row.f(z)]
    for _ in range(3):  # f', f'', f''' by autograd of the row's own op
        d.append(torch.autograd.grad(d[-1].sum(), z, create_graph=True)[0])
    z0 = z.detach()
    for k, mine in ((1, row.derivative(z0)), (2, row.d2(z0)), (3, row.d3(z0))):
        # against the largest value: the tails cancel (gelu_tanh's third derivative measured
        # 4.2e-13 of it, the others <= 6e-16)
        ref = d[k].detach()
        assert not mine.isnan().any()
        assert (mine - ref).abs().max() <= 2e-12 * ref.abs().max(), f"{name}: derivative {k}"
    gy = torch.randn_like(z0)
    torch.testing.assert_close(row.backward(gy, z0), gy * d[1].detach(), rtol=1e-13, atol=1e-14)
    if row.from_output is not None:
        assert torch.equal(row.from_output(gy, row.f(z0)), row.backward(gy, z0))


@pytest.mark.parametrize("name", ACTS)
def test_what_the_backward_reads_is_what_autograd_saves(name):
    # rows with a backward from the output: autograd saves f(z) alone; the others save z
    row = REGISTRY[name]
    z = torch.randn(64, dtype=torch.float64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        zz = z * 1.0  # a non-leaf input, as a Linear's output is
        out = row.f(zz)
    ptrs = {t.untyped_storage().data_ptr() for t in saved}
    assert (zz.untyped_storage().data_ptr() in ptrs) == (row.from_output is None), name
    if row.from_output is not None:
        assert ptrs == {out.untyped_storage().data_ptr()}, name
    assert SAVES_INPUT[name] == (row.from_output is None)
    assert tensors_per_layer(name) == len(ptrs | {out.untyped_storage().data_ptr()})


@pytest.mark.parametrize("name", ACTS)
def test_every_form_computes_f(name):
    row = REGISTRY[name]
    z = _z().detach()
    want = row.f(z)
    m = row.module()
    assert module_activation(m).name == name
    assert torch.equal(m(z), want)
    for form in row.modules:
        if isinstance(form.cls, type):
            inst = form.cls() if form.cls is not nn.GELU else form.cls(approximate=m.approximate)
            assert module_activation(inst).name == name
    for call in row.calls:
        assert torch.equal(call.fn(z, **dict(call.want)), want), call.label
    for meth in row.methods:
        assert torch.equal(getattr(z, meth)(), want), meth


class OwnSin(nn.Module):
    """As PINN code writes it."""

    def forward(self, x):
        return torch.sin(x)


class OwnSilu(nn.Module):
    def forward(self, inp):
        "SiLU by its functional form."
        return F.silu(inp)


class OwnTanhMethod(nn.Module):
    def forward(self, x):
        return x.tanh()


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.sin(x)


class Scaled(nn.Module):
    def forward(self, x):
        return torch.sin(2 * x)


class Softplus2(nn.Module):
    def forward(self, x):
        return F.softplus(x, beta=2)


class WithParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return torch.sin(x)


@pytest.mark.parametrize("cls, name", [(OwnSin, "sin"), (OwnSilu, "silu"),
                                       (OwnTanhMethod, "tanh")])
def test_own_module_returning_one_call_is_recognised(cls, name):
    found = module_activation(cls())
    assert found is not None and found.name == name


@pytest.mark.parametrize("cls", [Counting, Scaled, Softplus2, WithParam])
def test_own_module_doing_more_is_not(cls):
    assert module_activation(cls()) is None


def test_own_module_with_instance_forward_is_not():
    m = OwnSin()
    m.forward = lambda x: torch.cos(x)
    assert module_activation(m) is None


def test_sequential_of_own_sin_fuses_as_a_run():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16), OwnSin(), nn.Linear(16, 16), OwnSin(),
                          nn.Linear(16, 1)).double()
    import copy
    ref = copy.deepcopy(model)
    model, report = ckpt_ext.fuse(model)
    fused = [d for d in report.decisions if d.action == "fused"]
    assert len(fused) == 1 and len(fused[0].layers) == 5, str(report)
    assert fused[0].activation == "sin" and fused[0].bytes_per_row > 0, str(report)
    x = torch.randn(33, 3, dtype=torch.float64, requires_grad=True)
    out, out_ref = model(x), ref(x)
    # not bitwise: ATen's float64 sin is MKL's on some CPUs, the fused op's is Sleef's (both
    # within an ulp)
    torch.testing.assert_close(out, out_ref, rtol=1e-13, atol=1e-15)
    g = torch.autograd.grad(out.square().sum(), [x, *model.parameters()])
    g_ref = torch.autograd.grad(out_ref.square().sum(), [x, *ref.parameters()])
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_what_autograd_keeps_is_asked_whatever_the_callers_grad_mode(mode):
    from ckpt_ext._activations import _stock_tensors
    want = {name: _stock_tensors.__wrapped__(name) for name in ACTS}
    rng = torch.get_rng_state()
    with mode():
        assert {name: _stock_tensors.__wrapped__(name) for name in ACTS} == want
    assert torch.equal(torch.get_rng_state(), rng)  # asked without a random draw
    assert want["quick_gelu"] == 3 and want["gelu"] == 2 and want["tanh"] == 1
