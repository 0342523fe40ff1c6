"""The report's bytes in the dtypes the activations have, on the tiny peft Llama of _lora_models:
base activations in the base weight's dtype, a LoRA term's tensors in its adapter's (peft casts
the input to it), each case equal to what the allocator sees the fused step keep less (CPU,
exact bytes): float32 base with bfloat16 adapters (TRL's cast), bfloat16 base with float32
adapters (peft's autocast_adapter_dtype), a whole model in bfloat16, dropout 0 and 0.05. Beyond
the rows, per call: each unit that keeps the generator's state keeps its bytes, and each LoRA
term's ``* scaling`` no longer keeps its 8-byte scalar. And QLoRA in eval() with grad enabled:
the fused model runs and its output and gradients are peft's. Under bfloat16 autocast on a float32
model (FuseReport.under_autocast), the same measure, with and without LoRA."""
from __future__ import annotations

import copy

import pytest
import torch

from ckpt_ext import fuse
from ckpt_ext.memory import MemoryMeter

pytest.importorskip("peft")
pytest.importorskip("transformers")
import _lora_models as lm  # noqa: E402

F32, BF16 = torch.float32, torch.bfloat16
SCALAR = torch.empty((), dtype=torch.float64).element_size()  # a wrapped Python number
TERMS_PER_MLP = 3


def _adapters(model, dtype):
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(dtype)
    return model


def _model(base, adapters, dropout):
    model = lm.with_lora(lm.llama(base), dropout)  # peft casts bfloat16 adapters to float32
    return _adapters(model, adapters)


def _kept(model, x, autocast=None) -> int:
    """Bytes the allocator sees kept after the forward (under ``torch.autocast`` of that dtype,
    its cache of weight casts emptied on leaving it), less the output."""
    torch.manual_seed(2)
    with MemoryMeter("cpu") as meter:
        start = meter.current()
        with torch.autocast("cpu", autocast or BF16, enabled=autocast is not None):
            y = lm.output(model(x))
        kept = meter.current() - start - y.untyped_storage().nbytes()
    return kept


def _mlp_units(report):
    return [d for d in report.fused if d.where.endswith(".mlp")]


def _keeps_generator(unit_dtypes, dropout) -> bool:
    """A unit keeps the generator's state where it draws masks or runs its members' forwards
    (a LoRA weight of another dtype than its base)."""
    base, adapters = unit_dtypes
    return dropout > 0 or base != adapters


@pytest.mark.parametrize("dropout", [0.0, 0.05])
@pytest.mark.parametrize("base, adapters", [(F32, BF16), (BF16, F32), (BF16, BF16), (F32, F32)],
                         ids=["f32-base-bf16-adapters", "bf16-base-f32-adapters", "bf16",
                              "f32"])
def test_report_equals_the_allocator(base, adapters, dropout):
    plain = _model(base, adapters, dropout)
    layer = plain.base_model.model.layers[0].mlp.gate_proj
    assert (layer.base_layer.weight.dtype, layer.lora_A["default"].weight.dtype) == \
        (base, adapters)
    fused = copy.deepcopy(plain)
    _, report = fuse(fused)
    units = _mlp_units(report)
    assert len(units) == 2, str(report)
    x = lm.ids()
    freed = _kept(plain, x) - _kept(fused, x)
    per_call = len(units) * (TERMS_PER_MLP * SCALAR - torch.get_rng_state().nbytes *
                             _keeps_generator((base, adapters), dropout))
    assert freed == sum(d.bytes_per_row for d in units) * x.numel() + per_call, str(report)


@pytest.mark.parametrize("dropout", [None, 0.0, 0.05], ids=["no-lora", "lora", "lora-dropout"])
def test_under_autocast_equals_the_allocator(dropout):
    plain = lm.llama(F32) if dropout is None else _model(F32, F32, dropout)
    fused = copy.deepcopy(plain)
    _, report = fuse(fused)
    units = _mlp_units(report.under_autocast(BF16))
    assert len(units) == 2, str(report)
    x = lm.ids()
    freed = _kept(plain, x, BF16) - _kept(fused, x, BF16)
    per_call = 0 if dropout is None else len(units) * (
        TERMS_PER_MLP * SCALAR - torch.get_rng_state().nbytes * _keeps_generator((F32, F32),
                                                                                 dropout))
    assert freed == sum(d.bytes_per_row * x.numel() + d.bytes_per_call for d in units) + \
        per_call, str(report)


def test_under_autocast_counts_the_cast_copies():
    # per MLP and row in bfloat16: the SiLU's input and output, up's output and the product; and
    # x cast once per projection reading it (gate, up) where the fused op casts it once
    _, report = fuse(lm.llama(F32))
    H, I = 64, 176
    assert [d.bytes_per_row for d in _mlp_units(report.under_autocast(BF16))] == \
        [4 * I * 2 + (2 - 1) * H * 2] * 2
    assert "report.under_autocast(torch.bfloat16)" in str(report)
    assert "torch.autocast(dtype=torch.bfloat16)" in str(report.under_autocast(BF16))


def test_mixed_dtypes_count_the_cast_inputs():
    # float32 base, bfloat16 adapters: per MLP and row the gate's and up's LoRA each keep x cast
    # to bfloat16, the down's the product cast; the MLP keeps the activation's input, its output
    # and up's (float32), and the rank-wide tensors (bfloat16); fused, its input x (float32)
    _, report = fuse(_model(F32, BF16, 0.0))
    H, I, r = 64, 176, 8
    kept = 3 * I * 4 + (2 * H + I) * 2 + 3 * r * 2
    assert [d.bytes_per_row for d in _mlp_units(report)] == [kept - H * 4] * 2


def _run(model, x):
    torch.manual_seed(2)
    y = lm.output(model(x))
    names, params = zip(*lm.trainable(model))
    grads = torch.autograd.grad(y.square().sum(), params)
    return y.detach(), dict(zip(names, grads))


def test_qlora_in_eval_with_grad_runs_fused_and_equals_peft():
    # bitsandbytes' Linear4bit, in eval() on a CPU with AVX512-BF16, repacks its weight for
    # inference at a call whose input does not require grad: the unit's forward shows its
    # members what a step shows them, so none repacks and the backward's recompute reads the
    # weight as the forward did
    pytest.importorskip("bitsandbytes")
    plain = lm.with_lora(lm.four_bit(lm.llama(F32)))
    fused = copy.deepcopy(plain)
    _, report = fuse(fused)
    assert len(_mlp_units(report)) == 2, str(report)
    plain.eval()
    fused.eval()
    x = lm.ids(2, 9)
    y0, g0 = _run(plain, x)
    y1, g1 = _run(fused, x)
    assert torch.equal(y0, y1)
    assert g0.keys() == g1.keys()
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name
    assert fused.base_model.model.layers[0].mlp.gate_proj._ckpt_ext_run.problem() is None
    assert _packed(fused) == _packed(plain)  # the first layer's q, k, v: their input needs none


def _packed(model):
    return [p for p, m in model.named_modules() if type(m).__name__ == "Linear4bit" and
            getattr(m.weight.quant_state, "packing_format_for_cpu", False)]
