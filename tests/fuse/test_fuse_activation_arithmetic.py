"""Activation modules of the user's own recognised by what they compute
(ckpt_ext/_activation_arithmetic.py): each written form fused as its row, computing what an
unfused deep copy computes (float64: outputs and every gradient), counted by ``ckpt_ext.stats``,
freeing what the report says by the allocator's meter; the bounds against what was measured; a
form with a rounded constant and one no row computes left alone with their traced form and the
nearest row; a module whose scalar attribute changes after fusing computes unfused."""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ckpt_ext
from ckpt_ext import fuse
from ckpt_ext._activation_arithmetic import BOUNDS, arithmetic
from ckpt_ext.convert.facts import module_activation
from _ecosys import assert_same_outputs_and_grads, kept_bytes, saved_activation_bytes

F64 = torch.float64
# Measured (CPU, float64; CKPT_EXT_MEASURE): outputs and every gradient within 3.7e-16 of the
# unfused copy's, relative. TOL is ~5x that.
TOL = 2e-15


class NewGELU(nn.Module):
    """transformers' NewGELUActivation, op for op."""

    def forward(self, input):
        return 0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) *
                                               (input + 0.044715 * torch.pow(input, 3.0))))


class Swish(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(x)


class WrittenQuickGELU(nn.Module):
    def __init__(self, scale=1.702):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return x * torch.sigmoid(self.scale * x)


class ErfGELU(nn.Module):
    def forward(self, x):
        return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


class RoundedGELU(nn.Module):
    """GELU's tanh form with 0.79788456 written for sqrt(2/pi)."""

    def forward(self, x):
        return x * 0.5 * (1 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


class Mish(nn.Module):
    def forward(self, x):
        return x * torch.tanh(F.softplus(x))


FORMS = {NewGELU: "gelu_tanh", Swish: "silu", WrittenQuickGELU: "quick_gelu", ErfGELU: "gelu"}
# What each form's distances (values, derivative) from its row were measured at on the probe:
# its row's bound is ~9x the larger (the table above BOUNDS).
MEASURED = {NewGELU: 4.5e-15, Swish: 2.2e-16, WrittenQuickGELU: 2.3e-16, ErfGELU: 2.8e-14}


class Children(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.fc1, self.act1, self.fc2, self.act2 = nn.Linear(6, 16), act(), nn.Linear(16, 12), act()
        self.fc3 = nn.Linear(12, 3)

    def forward(self, x):
        return self.fc3(self.act2(self.fc2(self.act1(self.fc1(x)))))


def assert_same(before, after, *inputs):
    assert_same_outputs_and_grads("fuse_activation_arithmetic.float64", TOL, before, after, *inputs)


def freed(before, after, x):
    """Bytes plain autograd keeps that the fused model does not: by the storages of the saved
    tensors, and by the allocator's meter (which also counts the 0-dim scalars a formula saves,
    ``1.702 * x``'s 1.702, a few bytes whatever the rows)."""
    return saved_activation_bytes(before, x) - saved_activation_bytes(after, x), \
        kept_bytes(before, x) - kept_bytes(after, x)


def assert_claims_what_it_frees(before, after, x, d):
    """The decision's bytes per row are what ``x``'s 7 rows free, by the saved tensors (and by the
    allocator's meter, within the formula's 0-dim scalars), and exactly what 4 rows free."""
    saved, kept = freed(before, after, x)
    assert saved == 7 * d.bytes_per_row and 0 <= kept - saved <= 8 * 8
    _, kept3 = freed(before, after, x[:3])
    assert kept - kept3 == 4 * d.bytes_per_row  # per row: the allocator's figure exactly


@pytest.mark.parametrize("cls", list(FORMS), ids=lambda c: c.__name__)
def test_written_form_within_its_rows_measured_bound(cls):
    found = arithmetic(cls())
    assert found.name == found.nearest == FORMS[cls]
    assert max(found.distances) <= BOUNDS[found.name] <= 10 * MEASURED[cls]
    assert max(found.distances) == pytest.approx(MEASURED[cls], rel=0.05)
    assert arithmetic(cls()) is found  # made once per class


@pytest.mark.parametrize("how", ["sequential", "children"])
@pytest.mark.parametrize("cls", list(FORMS), ids=lambda c: c.__name__)
def test_written_form_fused_as_its_row(cls, how):
    name = FORMS[cls]
    torch.manual_seed(0)
    model = (nn.Sequential(nn.Linear(6, 16), cls(), nn.Linear(16, 12), cls(), nn.Linear(12, 3))
             if how == "sequential" else Children(cls)).double()
    before = copy.deepcopy(model)
    _, report = fuse(model)
    (d,) = report.fused
    assert (d.activation, d.how, len(d.layers)) == (name, how, 5)
    assert d.unit == f"mlp {name}, 3 layers 6->16->12->3"
    x = torch.randn(7, 6, dtype=F64)
    assert_same(before, model, x)
    (s,) = ckpt_ext.stats(model)
    assert (s.fused_calls, s.unfused_calls) == (1, 0)
    assert_claims_what_it_frees(before, model, x, d)
    # a formula keeps more than its row's op (2 tensors per layer): the report counts what the
    # class's forward keeps
    assert d.bytes_per_row > 2 * (16 + 12) * 8


def test_rounded_constant_is_left_alone_with_its_form_and_distance():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), RoundedGELU(), nn.Linear(8, 2)).double()
    before = copy.deepcopy(model)
    assert module_activation(RoundedGELU()) is None
    _, report = fuse(model)
    assert len(report) == 0 and type(model[1]) is RoundedGELU
    (d,) = report.near_misses
    assert d.layers == ("0", "1")
    assert d.why.startswith("its forward computes x * 0.5 * (1 + torch.tanh(0.79788456 * x * "
                            "(1 + 0.044715 * x * x))), no activation of the fused ops to float64 "
                            "rounding: nearest gelu_tanh, its values 1.3e-11 and derivative "
                            "2.7e-10 from that row's"), d.why
    x = torch.randn(3, 4, dtype=F64)
    assert torch.equal(model(x), before(x))


def test_form_no_row_computes_is_left_alone_with_its_form():
    model = nn.Sequential(nn.Linear(4, 8), Mish(), nn.Linear(8, 2)).double()
    _, report = fuse(model)
    assert len(report) == 0 and type(model[1]) is Mish
    assert report.near_misses[0].why.startswith(
        "its forward computes x * torch.tanh(F.softplus(x)), no activation of the fused ops to "
        "float64 rounding: nearest silu, its values 2.0e-01")


def test_scalar_attribute_changed_after_fusing_computes_unfused():
    """The match holds for the module's scalars as fused (here 1.702); the run asks at each call,
    so with another scale it computes layer by layer, and fused again once it is put back."""
    torch.manual_seed(0)
    model = Children(WrittenQuickGELU).double()
    before = copy.deepcopy(model)
    fuse(model)
    x = torch.randn(5, 6, dtype=F64)
    for m in (model, before):
        m.act2.scale = 1.5
    assert arithmetic(model.act2).name is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckpt_ext.FallbackWarning)
        assert_same(before, model, x)
    (s,) = ckpt_ext.stats(model)
    assert (s.fused_calls, s.unfused_calls) == (0, 1)
    for m in (model, before):
        m.act2.scale = 1.702
    assert_same(before, model, x)
    assert (s.fused_calls, s.unfused_calls) == (1, 1)


def test_not_pointwise_or_not_pure_is_no_activation():
    class Centred(nn.Module):  # a reduction
        def forward(self, x):
            return x - x.mean(-1, keepdim=True)

    class WithTensor(nn.Module):  # another tensor
        def forward(self, x):
            return x * torch.tensor(2.0, dtype=x.dtype)

    class Counting(nn.Module):  # changes its module while it runs
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x * torch.sigmoid(x)

    for cls in (Centred, WithTensor, Counting):
        m = cls()
        assert arithmetic(m) is None and module_activation(m) is None, cls.__name__
        assert getattr(m, "calls", 0) == 0
