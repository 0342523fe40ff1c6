"""fuse on peft LoRA models: the tiny Llama of _lora_models (r=8 on all seven projections) fuses
each MLP as one unit with plain ``fuse(model)``; outputs and the gradients of every trainable
parameter are the unfused model's (float64, train and eval, dropout 0 and 0.05, seeded); a float32
step keeps >= 90 % less of what the MLPs keep beyond their input, the report's figures to the byte;
at every call the unit reads peft's state (disabled, merged, the active adapter, several active,
adapter_names, hooks) and computes what peft computes; peft's own operations (merge_and_unload,
unmerge, set_adapter, save_pretrained / from_pretrained) and unfuse work on a fused model."""
from __future__ import annotations

import copy

import pytest
import torch

from ckpt_ext import fuse, unfuse

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")
import _lora_models as lm  # noqa: E402


def _pair(dropout=0.0, dtype=torch.float64, **config):
    plain = lm.with_lora(lm.llama(dtype), dropout, **config)
    fused = copy.deepcopy(plain)
    _, report = fuse(fused)
    return plain, fused, report


def _run(model, x, seed=2):
    if not lm.trainable(model):  # peft's state changes freeze adapters: train them all
        lm.freeze(model)
    torch.manual_seed(seed)
    y = lm.output(model(x))
    names, params = zip(*lm.trainable(model))
    grads = torch.autograd.grad(y.square().sum(), params, allow_unused=True)
    return y.detach(), dict(zip(names, grads))


def _assert_same(plain, fused, x, what, tol=1e-13, seed=2):
    y0, g0 = _run(plain, x, seed)
    y1, g1 = _run(fused, x, seed)
    scale = y0.abs().max()
    assert ((y1 - y0).abs().max() / scale) <= tol, f"{what}: output"
    assert g0.keys() == g1.keys()
    for name in g0:
        a, b = g0[name], g1[name]
        assert (a is None) == (b is None), f"{what}: {name}"
        if a is not None:
            err = ((b - a).abs().max() / a.abs().max().clamp_min(1e-300)).item()
            assert err <= tol, f"{what}: {name} rel err {err:.3g}"


def _run_problem(fused):
    """What keeps the first MLP's unit from computing fused at this call (None: it does)."""
    gate = fused.base_model.model.layers[0].mlp.gate_proj
    return gate._ckpt_ext_run.problem()


def _mlp_units(report):
    return [d for d in report.fused if d.where.endswith(".mlp")]


@pytest.mark.parametrize("dropout", [0.0, 0.05])
def test_every_mlp_is_one_unit_exact_to_peft(dropout):
    plain, fused, report = _pair(dropout)
    units = _mlp_units(report)
    assert len(units) == 2, str(report)
    assert all(d.unit.startswith("gated_mlp silu") and "LoRA" in d.unit for d in units), units
    x = lm.ids(2, 9)
    for train in (True, False):
        plain.train(train)
        fused.train(train)
        _assert_same(plain, fused, x, f"train={train}")


@pytest.mark.parametrize("dropout", [0.0, 0.05])
def test_a_step_keeps_90_percent_less_of_the_mlps_the_report_to_the_byte(dropout):
    plain, fused, report = _pair(dropout, torch.float32)
    x = lm.ids()
    torch.manual_seed(2)
    mlp_kept, rows = lm.mlp_kept_bytes(plain, x)
    torch.manual_seed(2)
    kept_plain = lm.step_kept_bytes(plain, x)
    torch.manual_seed(2)
    kept_fused = lm.step_kept_bytes(fused, x)
    freed = kept_plain - kept_fused
    claimed = sum(d.bytes_per_row for d in _mlp_units(report)) * rows
    assert freed >= 0.9 * mlp_kept, (freed, mlp_kept)
    assert freed == claimed, (freed, claimed, str(report))


def test_report_counts_only_the_trainable_gradients():
    # A frozen base makes no weight-gradient GEMM: the plain FLOPs of a LoRA MLP are its forward,
    # the input gradients and the LoRA terms' gradients; trained bases add their dW GEMMs.
    _, _, frozen = _pair()
    plain = lm.with_lora(lm.llama(torch.float64))
    for n, p in plain.named_parameters():
        p.requires_grad_(True)
    _, trained = fuse(copy.deepcopy(plain))
    f, t = _mlp_units(frozen)[0], _mlp_units(trained)[0]
    H, I = 64, 176
    assert t.plain_flops_per_row - f.plain_flops_per_row == 3 * 2 * H * I
    assert f.flops_per_row == t.flops_per_row  # the recompute: the same GEMMs either way


def test_peft_states_at_each_call():
    plain, fused, _ = _pair(0.05)
    x = lm.ids(2, 7)
    for model in (plain, fused):
        torch.manual_seed(5)  # the same adapter in both
        model.add_adapter("other", peft.LoraConfig(r=4, target_modules=lm.LLAMA_TARGETS,
                                                   init_lora_weights=False))
    _assert_same(plain, fused, x, "the default adapter")
    assert _run_problem(fused) is None
    with plain.disable_adapter(), fused.disable_adapter():
        for model in (plain, fused):
            lm.freeze(model, "embed")  # the adapters are out of the computation: a gradient
        _assert_same(plain, fused, x, "disable_adapter()")
        assert _run_problem(fused) is None  # the base alone, fused
    for model in (plain, fused):
        model.set_adapter("other")
    _assert_same(plain, fused, x, "set_adapter('other')")
    assert _run_problem(fused) is None
    for model in (plain, fused):
        model.base_model.set_adapter(["default", "other"])
    _assert_same(plain, fused, x, "two active adapters")
    assert "several adapters are active (default, other)" in _run_problem(fused)
    for model in (plain, fused):
        model.set_adapter("default")
        model.merge_adapter()
    _assert_same(plain, fused, x, "merged", tol=1e-12)
    assert _run_problem(fused) is None  # the merged base weight alone, fused
    for model in (plain, fused):
        model.unmerge_adapter()
    _assert_same(plain, fused, x, "unmerged", tol=1e-12)
    plain.eval()
    fused.eval()
    names = ["default", "other"]
    torch.manual_seed(0)
    y0 = plain(x, adapter_names=names).last_hidden_state
    y1 = fused(x, adapter_names=names).last_hidden_state
    assert torch.allclose(y0, y1, rtol=0, atol=1e-13), "adapter_names"


def test_dora_is_left_alone_with_its_reason():
    _, fused, report = _pair(use_dora=True)
    assert not _mlp_units(report)
    text = str(report)
    assert "DoRA" in text or "lora_magnitude_vector" in text, text


def test_merge_and_unload_unfuse_and_adapter_files(tmp_path):
    plain, fused, _ = _pair()
    x = lm.ids(2, 5)
    fused.save_pretrained(tmp_path / "fused")
    plain.save_pretrained(tmp_path / "plain")
    a = open(tmp_path / "fused" / "adapter_model.safetensors", "rb").read()
    b = open(tmp_path / "plain" / "adapter_model.safetensors", "rb").read()
    assert a == b
    reloaded = peft.PeftModel.from_pretrained(lm.llama(torch.float64), tmp_path / "fused")
    _assert_same(plain, reloaded, x, "from_pretrained", seed=2)
    fuse(reloaded)
    _assert_same(plain, reloaded, x, "from_pretrained, fused")
    undone = unfuse(copy.deepcopy(fused))
    assert {type(m) for m in undone.modules()} == {type(m) for m in plain.modules()}
    _assert_same(plain, undone, x, "unfuse")
    merged_plain = copy.deepcopy(plain).merge_and_unload()
    merged_fused = fused.merge_and_unload()
    torch.manual_seed(0)
    assert torch.equal(merged_plain(x).last_hidden_state, merged_fused(x).last_hidden_state)
    assert not any("lora" in n for n, _ in merged_fused.named_parameters())


def _allocator_step(model, x):
    """(bytes kept after the forward, peak of the step), by ckpt_ext's allocator meter, and the
    trainable parameters' gradients."""
    from ckpt_ext.memory import MemoryMeter
    torch.manual_seed(2)
    with MemoryMeter("cpu") as meter:
        start = meter.current()
        meter.reset_peak()
        y = lm.output(model(x))
        kept = meter.current() - start - y.untyped_storage().nbytes()
        y.square().mean().backward()
        peak = meter.peak() - start
    grads = {n: p.grad for n, p in lm.trainable(model)}
    for _, p in lm.trainable(model):
        p.grad = None
    return kept, peak, grads


@pytest.mark.parametrize("dropout", [0.0, 0.05])
def test_qlora_four_bit_bases_are_dequantized_inside_the_unit(dropout):
    # peft's lora.bnb.Linear4bit over bitsandbytes' Linear4bit (nf4, CPU backend): the unit runs
    # the modules' own forwards, recomputed in backward, so the 4-bit weights stay packed and
    # the step's gradients are peft's to the bit; the allocator sees it keep the MLPs' inputs
    # and, per unit, the generator's state only.
    pytest.importorskip("bitsandbytes")
    plain = lm.with_lora(lm.four_bit(lm.llama(torch.float32)), dropout)
    assert type(plain.base_model.model.layers[0].mlp.gate_proj).__module__ == \
        "peft.tuners.lora.bnb"
    fused = copy.deepcopy(plain)
    _, report = fuse(fused)
    units = _mlp_units(report)
    assert len(units) == 2, str(report)
    x = lm.ids()
    torch.manual_seed(2)
    mlp_kept, rows = lm.mlp_kept_bytes(plain, x)
    kept_plain, peak_plain, g_plain = _allocator_step(plain, x)
    kept_fused, peak_fused, g_fused = _allocator_step(fused, x)
    for name, g in g_plain.items():
        assert torch.equal(g, g_fused[name]), name
    freed, claimed = kept_plain - kept_fused, sum(d.bytes_per_row for d in units) * rows
    rng = torch.get_rng_state().nbytes  # each unit keeps the generator's state
    assert freed >= 0.9 * mlp_kept, (freed, mlp_kept)
    assert claimed - len(units) * rng <= freed <= claimed, (freed, claimed)
    assert peak_fused < peak_plain


def test_lora_on_some_linears_of_a_hand_written_run():
    # A Sequential of Linears and Tanhs with LoRA on its first and last Linears only: one run,
    # each LoRA Linear with its term, the middle one plain; the same with dropout in training.
    from torch import nn
    for dropout in (0.0, 0.1):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh(),
                            nn.Linear(40, 6)).double()
        plain = lm.with_lora(net, dropout, targets=["0", "4"], r=4)
        fused = copy.deepcopy(plain)
        _, report = fuse(fused)
        assert [d.unit for d in report.fused] == ["tanh_mlp, 3 layers 12->40->40->6, LoRA r=4 "
                                                 "on base_model.model.0, base_model.model.4"]
        x = torch.randn(5, 12, dtype=torch.float64)
        _assert_same(plain, fused, x, f"dropout={dropout}")


def test_gradient_checkpointing_is_named_with_its_cost():
    model = lm.llama()
    model.gradient_checkpointing_enable()
    _, report = fuse(lm.with_lora(model))
    units = _mlp_units(report)
    assert [(p[-8:], n) for p, _, n, _ in report.checkpointed] == [("layers.0", 1), ("layers.1", 1)]
    assert all(flops == units[0].flops_per_row for *_, flops in report.checkpointed)
    assert "recomputed twice: base_model.model.layers.{0..1} runs under transformers' gradient " \
           "checkpointing" in str(report)


def test_a_lora_linear_over_another_base_names_it():
    bnb = pytest.importorskip("bitsandbytes")
    model = lm.llama()
    gate = model.layers[0].mlp.gate_proj
    q = bnb.nn.Linear8bitLt(64, 176, bias=False, has_fp16_weights=False)
    q.weight = bnb.nn.Int8Params(gate.weight.data.clone(), requires_grad=False,
                                 has_fp16_weights=False)
    model.layers[0].mlp.gate_proj = q
    model.is_loaded_in_8bit = True  # peft then makes lora.bnb.Linear8bitLt
    _, report = fuse(lm.with_lora(model))
    assert len(_mlp_units(report)) == 1  # layer 1's MLP
    assert "a gated MLP: peft's bnb.Linear8bitLt over Linear8bitLt: fuse computes the LoRA " \
           "Linears over nn.Linear, transformers' Conv1D and bitsandbytes' Linear4bit" in \
           str(report)
