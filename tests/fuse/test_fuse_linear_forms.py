"""The Linear forms table (ckpt_ext/convert/linears.py): each row claims its modules and reads
them as their own forward computes them; the traced row, a Linear whose forward tracing shows
computes x·Wᵀ + b, is fused in a Sequential, in its owner's forward and in a gated MLP, computing
what an unfused deep copy computes (float64: outputs and every gradient), counted by
``ckpt_ext.stats`` and freeing what the report says by saved tensors and the allocator's meter;
a subclass whose forward computes anything else is left alone with its traced form as the
reason, and one whose class's forward changes after fusing computes unfused."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ckpt_ext
from ckpt_ext import fuse, unfuse
from ckpt_ext.convert import RunMember
from ckpt_ext.convert.linears import (CONV1D, FORMS, LINEAR, LORA, OTHER_LORA, QLORA, TRACED,
                                      form_of, op_terms, stored_weight)
from _ecosys import assert_same_outputs_and_grads, kept_bytes, rel_err, saved_activation_bytes

F64 = torch.float64
# Measured (CPU, float64, --seed-sweep=0:30 with CKPT_EXT_MEASURE): outputs and every gradient
# within 6.8e-16 of the unfused copy's, relative (the op adds the bias inside its GEMM,
# `x @ W.T + b` after it). TOL is ~3x.
TOL = 2e-15


class MatmulT(nn.Linear):
    def forward(self, input):
        return input @ self.weight.T + self.bias


class TorchMatmul(nn.Linear):
    def forward(self, x):
        return torch.matmul(x, self.weight.t()) + self.bias


class FLinear(nn.Linear):
    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class Inherited(nn.Linear):
    """A subclass that only adds an attribute: nn.Linear's own forward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tag = "mine"


class Affine(nn.Module):
    """Not an nn.Linear at all: a module holding a weight (out, in) and a bias."""

    def __init__(self, in_features, out_features):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features) / in_features ** 0.5)
        self.bias = nn.Parameter(torch.randn(out_features) * 0.1)

    def forward(self, x):
        return self.bias + x @ self.weight.transpose(0, 1)


FORMS_TRACED = [MatmulT, TorchMatmul, FLinear, Inherited, Affine]


class Children(nn.Module):
    def __init__(self, lin):
        super().__init__()
        self.fc1, self.act1, self.fc2 = lin(6, 16), nn.Tanh(), lin(16, 12)
        self.act2, self.fc3 = nn.Tanh(), lin(12, 3)

    def forward(self, x):
        return self.fc3(self.act2(self.fc2(self.act1(self.fc1(x)))))


class Gated(nn.Module):
    def __init__(self, lin):
        super().__init__()
        self.gate, self.up, self.down, self.act = lin(6, 16), lin(6, 16), lin(16, 6), nn.SiLU()

    def forward(self, x):
        return self.down(self.act(self.gate(x)) * self.up(x))


def assert_same(before, after, *inputs):
    assert_same_outputs_and_grads("fuse_linear_forms.float64", TOL, before, after, *inputs)


def _model(how, lin, seed=0):
    torch.manual_seed(seed)
    if how == "sequential":
        return nn.Sequential(lin(6, 16), nn.Tanh(), lin(16, 12), nn.Tanh(), lin(12, 3)).double()
    return (Children if how == "children" else Gated)(lin).double()


@pytest.mark.parametrize("lin,how", [  # a gated MLP's Linears have in_features: not Affine
    (lin, how) for lin in FORMS_TRACED for how in ("sequential", "children", "gated")
    if not (lin is Affine and how == "gated")], ids=lambda v: getattr(v, "__name__", v))
def test_traced_form_is_fused_exact_and_counted(lin, how, seed):
    model = _model(how, lin, seed)
    before = copy.deepcopy(model)
    assert all(form_of(m) is TRACED for m in model.modules() if type(m) is lin)
    _, report = fuse(model)
    (d,) = report.fused
    assert d.how == ("sequential" if how == "sequential" else "children"), str(report)
    assert len(d.layers) == (3 if how == "gated" else 5) + (how == "gated")
    x = torch.randn(7, 6, dtype=F64)
    assert_same(before, model, x)
    (s,) = ckpt_ext.stats(model)
    assert (s.fused_calls, s.unfused_calls) == (1, 0)
    if how == "children":  # its members: the user's objects, of a member class of theirs
        assert isinstance(model.fc1, (lin, RunMember)) and type(model.fc1).__name__ == \
            f"Run{lin.__name__}"
        assert_same(before, copy.deepcopy(model), x)
    unfuse(model)
    assert [type(m) for m in model.modules()] == [type(m) for m in before.modules()]


@pytest.mark.parametrize("lin", [MatmulT, Affine], ids=lambda c: c.__name__)
def test_what_the_traced_form_frees(lin):
    """An MLP of two such Linears and a tanh: unfused autograd keeps the input and the tanh
    output; fused, the input only. The report's bytes per row are those, by the storages
    autograd saves and by the allocator's meter, and those of the same MLP of nn.Linear."""
    torch.manual_seed(0)
    model = nn.Sequential(lin(8, 64), nn.Tanh(), lin(64, 4)).double()
    before = copy.deepcopy(model)
    _, report = fuse(model)
    (d,) = report.fused
    assert d.bytes_per_row == 64 * 8  # the tanh output, float64
    rows = 32
    x = torch.randn(rows, 8, dtype=F64)
    assert saved_activation_bytes(before, x) - saved_activation_bytes(model, x) == \
        rows * d.bytes_per_row
    assert kept_bytes(before, x) - kept_bytes(model, x) == rows * d.bytes_per_row
    plain = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4)).double()
    _, plain_report = fuse(plain)
    assert plain_report.fused[0].bytes_per_row == d.bytes_per_row
    assert plain_report.fused[0].unit == d.unit


class Scaled(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class BiasIgnored(nn.Linear):
    def forward(self, x):
        return x @ self.weight.T


class WithBuffer(nn.Linear):
    def __init__(self, *args):
        super().__init__(*args)
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) * self.scale


class ReadsFlag(nn.Linear):
    def __init__(self, *args):
        super().__init__(*args)
        self.transposed = False

    def forward(self, x):
        return x @ (self.weight if self.transposed else self.weight.T) + self.bias


class DataBranch(nn.Linear):
    def forward(self, x):
        return F.linear(x, self.weight, self.bias) if x.sum() > 0 else x


@pytest.mark.parametrize("lin,why", [
    (Scaled, "Scaled subclasses nn.Linear; its forward computes linear(x, weight, bias), "
             "mul(linear, 2), not x·Wᵀ + b"),
    (BiasIgnored, "BiasIgnored subclasses nn.Linear; its forward computes getattr(weight, T), "
                  "matmul(x, getattr_1), not x·Wᵀ + b"),
    (WithBuffer, "WithBuffer subclasses nn.Linear; it holds scale besides its weight and bias"),
    (ReadsFlag, "ReadsFlag subclasses nn.Linear; its forward reads self.transposed"),
    (DataBranch, "DataBranch subclasses nn.Linear; torch.fx cannot trace its forward "
                 "(TraceError: symbolically traced variables cannot be used as inputs to "
                 "control flow)"),
], ids=lambda v: v.__name__ if isinstance(v, type) else "")
def test_other_forward_is_left_alone_with_its_traced_form(lin, why):
    torch.manual_seed(0)
    model = nn.Sequential(lin(4, 8), nn.Tanh(), lin(8, 2)).double()
    before = copy.deepcopy(model)
    _, report = fuse(model)
    assert len(report) == 0 and [type(m) for m in model] == [lin, nn.Tanh, lin]
    assert report.near_misses[0].why == why, report.near_misses[0].why
    assert why in str(report)
    x = torch.randn(3, 4, dtype=F64)
    assert torch.equal(model(x), before(x))


def test_module_computing_something_else_is_no_linear():
    class Scale(Affine):
        def forward(self, x):
            return x * self.weight.sum()

    assert form_of(Scale(4, 4)) is None and form_of(Affine(4, 4)) is TRACED


def test_class_forward_changed_after_fusing_computes_unfused():
    class Local(nn.Linear):
        def forward(self, x):
            return x @ self.weight.T + self.bias

    model = _model("children", Local)
    before = copy.deepcopy(model)
    fuse(model)
    x = torch.randn(5, 6, dtype=F64)
    original = Local.forward
    Local.forward = lambda self, x: F.linear(x, self.weight, self.bias) * 2
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ckpt_ext.FallbackWarning)
            out = model(x)
        (s,) = ckpt_ext.stats(model)
        assert (s.fused_calls, s.unfused_calls) == (0, 1)
        assert list(s.reasons) == ["fc1: its class's forward changed since fuse: its forward "
                                   "computes linear(x, weight, bias), mul(linear, 2), not "
                                   "x·Wᵀ + b"]
        assert torch.equal(out, before(x))  # the new forward, in every layer
    finally:
        Local.forward = original
    assert_same(before, model, x)
    assert (s.fused_calls, s.unfused_calls) == (1, 1)


# -- Every row of the table: the module each claims, read as its own forward computes it -----------

def _lora(base):
    from peft import LoraConfig, get_peft_model

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = base

    torch.manual_seed(1)
    cfg = LoraConfig(r=2, lora_alpha=4, target_modules=["fc"], init_lora_weights=False,
                     fan_in_fan_out=type(base).__name__ == "Conv1D")
    return get_peft_model(Holder(), cfg).base_model.model.fc


def _conv1d():
    from transformers.pytorch_utils import Conv1D
    torch.manual_seed(0)
    m = Conv1D(5, 6)
    nn.init.normal_(m.bias)
    return m


def _qlora():
    pytest.importorskip("bitsandbytes")
    import _lora_models as lm
    holder = lm.four_bit(nn.ModuleDict({"fc": nn.Linear(64, 32)}))
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(1)
    model = get_peft_model(holder, LoraConfig(r=2, target_modules=["fc"],
                                              init_lora_weights=False))
    return model.base_model.model.fc


def _other_lora():
    bnb = pytest.importorskip("bitsandbytes")
    from peft import LoraConfig, get_peft_model
    q = bnb.nn.Linear8bitLt(64, 32, bias=False, has_fp16_weights=False)
    q.weight = bnb.nn.Int8Params(torch.randn(32, 64), requires_grad=False, has_fp16_weights=False)
    holder = nn.ModuleDict({"fc": q})
    holder.is_loaded_in_8bit = True
    return get_peft_model(holder, LoraConfig(r=2, target_modules=["fc"])).base_model.model.fc


ROWS = {"Linear": (LINEAR, lambda: nn.Linear(6, 5)), "Conv1D": (CONV1D, _conv1d),
        "LoRA over Linear": (LORA, lambda: _lora(nn.Linear(6, 5))),
        "LoRA over Conv1D": (LORA, lambda: _lora(_conv1d())),
        "QLoRA": (QLORA, _qlora), "other LoRA": (OTHER_LORA, _other_lora),
        "traced": (TRACED, lambda: MatmulT(6, 5))}


def test_every_row_is_exercised():
    assert set(FORMS) == {row for row, _ in ROWS.values()} and len(FORMS) == 6


@pytest.mark.parametrize("name", list(ROWS))
def test_each_row_reads_its_module_as_its_forward_computes_it(name):
    row, make = ROWS[name]
    m = make()
    form = form_of(m)
    assert form is row
    if form is OTHER_LORA:
        assert form.problem(m).startswith("peft's bnb.Linear8bitLt over Linear8bitLt")
        return
    assert form.problem(m) is None and form.width(m)[:2] == form.size(m) and \
        form.width(m)[3] == (2 if form in (LORA, QLORA) else 0)
    assert stored_weight(m) is (m.lora_A["default"].weight if form is QLORA else
                                m.base_layer.weight if form is LORA else m.weight)
    assert form.transposed == (form is CONV1D)
    if form is QLORA:  # only its own forward dequantizes its base
        assert op_terms(m) is None
        return
    m = m.double()
    w, b, term = op_terms(m)
    x = torch.randn(3, form.size(m)[0], dtype=F64)
    z = F.linear(x, w, b)
    if term is not None:
        z = z + F.linear(F.linear(x, term.A), term.B, term.bias) * term.scaling
    assert rel_err(z, m(x)) <= TOL
    assert (term is not None) == (form is LORA)
