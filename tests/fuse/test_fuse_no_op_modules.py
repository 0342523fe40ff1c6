"""Modules that return their input inside a run of Linear/activation layers (``nn.Identity``, an
``nn.Dropout`` with p = 0 or in eval(): timm's ``Mlp``, torchvision's ``ops.MLP``) do not stop
it: the run is one unit, equal to the unfused model; a call in which one of them no longer
returns its input (p set > 0 in training, a hook, replaced) computes module by module, drawing
the unfused model's masks."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ckpt_ext import fuse, unfuse
from _fuse_models import TimmMlp, torchvision_mlp


def _close(a, b, what):
    err = (a - b).abs().max() / b.abs().max().clamp_min(1e-300)
    assert err <= 1e-14, f"{what}: {err:.3g}"


def _pair(make):
    torch.manual_seed(0)
    plain = make().double()
    fused = copy.deepcopy(plain)
    _, report = fuse(fused)
    return plain, fused, report


def _step(model, x, seed=1):
    torch.manual_seed(seed)
    out = model(x)
    grads = torch.autograd.grad(out.square().sum(), list(model.parameters()))
    return out, grads, torch.get_rng_state()


def _same(plain, fused, x):
    a, ga, sa = _step(plain, x)
    b, gb, sb = _step(fused, x)
    assert torch.equal(sa, sb), "the generator advanced differently"
    _close(b, a, "output")
    for (name, _), r, g in zip(plain.named_parameters(), ga, gb):
        _close(g, r, f"grad of {name}")


CASES = {
    "timm Mlp": (TimmMlp, "fc1 -> act -> fc2", ("drop1 (Dropout(p=0.0))", "norm (Identity)")),
    "timm Mlp, drop 0.1 in eval": (lambda: TimmMlp(drop=0.1).eval(), "fc1 -> act -> fc2",
                                   ("drop1 (Dropout(p=0.1, eval))",)),
    "torchvision MLP": (torchvision_mlp, "0 -> 1 -> 3 -> 4 -> 6",
                        ("2 (Dropout(p=0.0))", "5 (Dropout(p=0.0))")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_one_unit_through_them_and_exact(name):
    make, layers, through = CASES[name]
    plain, fused, report = _pair(make)
    assert [" -> ".join(d.layers) for d in report.fused] == [layers], str(report)
    assert all(t in report.fused[0].why for t in through), str(report)
    x = torch.randn(5, 16, dtype=torch.float64)
    for mode in (fused.training, not fused.training):
        plain.train(mode)
        fused.train(mode)
        _same(plain, fused, x)  # in train() with p = 0.1: module by module, the same masks


@pytest.mark.parametrize("change", ["p", "hook", "replaced", "instance forward"])
def test_a_call_where_one_does_not_return_its_input_computes_module_by_module(change):
    plain, fused, _ = _pair(TimmMlp)
    called = []
    for m in (plain, fused):
        if change == "p":
            m.drop1.p = 0.5
        elif change == "hook":
            m.norm.register_forward_hook(lambda mod, inp, out: called.append(1) or out * 2)
        elif change == "replaced":
            m.norm = nn.LayerNorm(64, dtype=torch.float64)
        else:
            m.norm.forward = lambda h: h * 3
    x = torch.randn(5, 16, dtype=torch.float64)
    _same(plain, fused, x)
    if change == "hook":
        assert len(called) == 2  # forward of each model


def test_hooked_dropout_at_fuse_time_stops_the_run_with_the_reason():
    model = TimmMlp()
    model.drop1.register_forward_pre_hook(lambda mod, inp: None)
    _, report = fuse(model)
    assert not any("fc2" in d.layers for d in report.fused), str(report)
    assert "drop1 has hooks" in str(report), str(report)


def test_dropout_p_drawing_a_mask_at_fuse_time_stops_the_run():
    model = TimmMlp(drop=0.1)
    _, report = fuse(model)
    assert not any("fc2" in d.layers for d in report.fused), str(report)


def test_kept_bytes_and_unfuse():
    from _ecosys import saved_activation_bytes
    torch.manual_seed(0)
    plain = torchvision_mlp()
    fused = copy.deepcopy(plain)
    _, report = fuse(fused)
    x = torch.randn(16, 16)
    drop = saved_activation_bytes(plain, x) - saved_activation_bytes(fused, x)
    assert drop == report.bytes_per_row * 16 == 2 * 64 * 4 * 16  # two inner ReLU outputs
    unfuse(fused)
    assert type(fused) is nn.Sequential
    assert torch.equal(fused(x), plain(x))


def test_sequential_dropout_set_to_draw_after_fuse():
    plain, fused, _ = _pair(torchvision_mlp)
    for m in (plain, fused):
        m[2].p = 0.3
    _same(plain, fused, torch.randn(5, 16, dtype=torch.float64))
