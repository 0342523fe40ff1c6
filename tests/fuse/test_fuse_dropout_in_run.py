"""Identity and Dropout modules inside a run of Linear/activation layers (timm's ``Mlp``:
``fc1, act, drop1, norm, fc2``; torchvision's ``ops.MLP``) do not stop it. One that returns its
input (Identity, Dropout with p = 0 or in eval()) is skipped; a Dropout drawing a mask after an
activation is drawn inside the unit, which keeps the generator's state and draws it again in
backward: the fused model draws bitwise the unfused model's masks under the same seed, equal
outputs and gradients. A call in which one of them does what the unit cannot (a hook, a forward
set on it, a mask between a Linear and its activation, a torch.func transform) computes module by
module."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ckpt_ext import fuse, unfuse
from _fuse_models import TimmMlp, torchvision_mlp
from _masks import record_masks


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


CASES.update({
    "timm Mlp, drop 0.1": (lambda: TimmMlp(drop=0.1), "fc1 -> act -> fc2",
                           ("drop1 (Dropout(p=0.1))", "drop1 draws its mask inside the unit")),
    "torchvision MLP, dropout 0.1": (lambda: torchvision_mlp(dropout=0.1),
                                     "0 -> 1 -> 3 -> 4 -> 6", ("2 (Dropout(p=0.1))",)),
})


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


@pytest.mark.parametrize("make", [lambda: TimmMlp(drop=0.1),
                                  lambda: torchvision_mlp(dropout=0.1)],
                         ids=["timm Mlp", "torchvision MLP"])
def test_masks_are_the_unfused_models_bitwise(make, monkeypatch):
    """Every F.dropout call of a training step recorded: the fused forward draws the unfused
    model's masks bitwise in the same order; backward draws the run's masks again, bitwise."""
    drawn = record_masks(monkeypatch)
    plain, fused, _ = _pair(make)
    x = torch.randn(9, 16, dtype=torch.float64)
    runs = []
    for model in (plain, fused):
        drawn.clear()
        torch.manual_seed(3)
        y = model(x)
        forward = list(drawn)
        y.square().sum().backward()
        runs.append((forward, drawn[len(forward):]))
    (plain_fwd, plain_bwd), (fused_fwd, fused_bwd) = runs
    assert not plain_bwd and len(plain_fwd) == len(fused_fwd) >= 2
    assert all(sa == sb and torch.equal(ma, mb)
               for (sa, ma), (sb, mb) in zip(plain_fwd, fused_fwd))
    inside = [m for s, m in plain_fwd if s[-1] != 16]  # the run's, 64 wide
    assert inside and len(fused_bwd) == len(inside)
    assert all(torch.equal(a, b) for a, (_, b) in zip(inside, fused_bwd))


def test_dropout_between_a_linear_and_its_activation():
    """Drawing a mask there at fuse time stops the run, with the reason; set to draw after fuse,
    the call computes module by module."""
    def make(p):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.Dropout(p), nn.Tanh(), nn.Linear(32, 16))
    _, report = fuse(make(0.2))
    assert not report.fused and "1 (p=0.2) draws a mask in training" in str(report), str(report)
    plain, fused, report = _pair(lambda: make(0.0))
    assert len(report.fused) == 1
    for m in (plain, fused):
        m[1].p = 0.2
    _same(plain, fused, torch.randn(4, 16, dtype=torch.float64))


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


def test_pickle_deepcopy_and_fusing_again():
    import io
    plain, fused, _ = _pair(lambda: TimmMlp(drop=0.2))
    buf = io.BytesIO()
    torch.save(fused, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(4, 16, dtype=torch.float64)
    for model in (loaded, copy.deepcopy(fused)):
        _same(plain, model, x)
    _, again = fuse(fused)
    assert [d.action for d in again.decisions if "fc2" in d.layers] == ["already fused"]
    assert "norm (Identity)" in str(again)
    _same(plain, fused, x)
