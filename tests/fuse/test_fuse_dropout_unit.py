"""A Dropout with p > 0 in training inside a fused gated MLP (T5's ``wo(dropout(act(wi_0(x)) *
wi_1(x)))``): the unit keeps only its input and the generator's state; the fused model draws
bitwise the masks the unfused model draws under the same seed, backward draws them again from
the saved state (whatever was drawn in between) and leaves the generator as it was; outputs and
gradients (to second order, and under autocast) equal the unfused model's; where the unit cannot
run recomputed (torch.compile, torch.func, forward-mode AD) the call computes module by module."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ckpt_ext import fuse
from _ecosys import saved_activation_bytes
from _fuse_models import TimmMlp, torchvision_mlp
from _masks import record_masks, same_draws_on_device
from test_fuse_gated import H, I, _close, _gated, _t5

transformers = pytest.importorskip("transformers")


class DropMLP(nn.Module):
    """``w2(drop(silu(w1(x)) * w3(x)))``."""

    def __init__(self, p: float = 0.25):
        super().__init__()
        self.w1, self.w3 = nn.Linear(H, I), nn.Linear(H, I)
        self.drop, self.w2 = nn.Dropout(p), nn.Linear(I, H)

    def forward(self, x):
        return self.w2(self.drop(F.silu(self.w1(x)) * self.w3(x)))


class PackedDropMLP(nn.Module):
    """One packed Linear, the activation on its second half, two Dropouts before ``w2``."""

    def __init__(self):
        super().__init__()
        self.w13, self.w2 = nn.Linear(H, 2 * I), nn.Linear(I, H)
        self.drop1, self.drop2 = nn.Dropout(0.25), nn.Dropout(0.5)

    def forward(self, x):
        up, gate = self.w13(x).chunk(2, dim=-1)
        return self.w2(self.drop2(self.drop1(F.silu(gate) * up)))


def _pair(make):
    """(unfused, fused) float64 copies of the model, and the report, which fuses one unit with
    each Dropout inside (a gated MLP, or a plain run)."""
    torch.manual_seed(0)
    plain = make().double()
    fused = copy.deepcopy(plain)
    _, report = fuse(fused)
    assert report.fused and all("inside the unit, which keeps the generator" in d.why or
                                "Dropout mask(s) drawn again" in d.why for d in report.fused), \
        str(report)
    return plain, fused, report


def _grads(model, inputs, seed=1, between=None, create_graph=False):
    """(output, gradients of every parameter, generator state after forward, after backward)."""
    torch.manual_seed(seed)
    out = model(*inputs)
    out = out if isinstance(out, torch.Tensor) else out.last_hidden_state
    after_forward = torch.get_rng_state()
    if between is not None:
        between()
    grads = torch.autograd.grad(out.square().sum(), list(model.parameters()),
                                create_graph=create_graph)
    return out, grads, after_forward, torch.get_rng_state()


def _same(plain, fused, inputs, between=None):
    a, ga, fa, ba = _grads(plain, inputs, between=between)
    b, gb, fb, bb = _grads(fused, inputs, between=between)
    assert torch.equal(fa, fb) and torch.equal(ba, bb), "the generator advanced differently"
    _close(b, a, "output")
    scale = max(g.abs().max() for g in ga)
    for (name, _), x, y in zip(plain.named_parameters(), ga, gb):
        assert (y - x).abs().max() <= 1e-14 * scale, f"grad of {name}"


def test_t5_in_training_is_one_unit_per_layer_with_its_mask(monkeypatch):
    """Every F.dropout call of a training step, recorded: the fused model's forward draws the
    unfused model's masks bitwise, in the same order; backward draws the MLPs' masks again,
    bitwise the forward's, while the generator ends where the unfused one does."""
    plain, fused, report = _pair(lambda: _t5("gated-gelu", 0.1))
    assert len(_gated(report)) == 2 and all("Dropout mask" in d.why for d in _gated(report))
    drawn = record_masks(monkeypatch)
    ids = torch.randint(0, 50, (2, 5))
    masks = []
    for model in (plain, fused):
        drawn.clear()
        torch.manual_seed(1)
        out = model(ids).last_hidden_state
        forward = list(drawn)
        out.square().sum().backward()
        masks.append((forward, drawn[len(forward):]))
    (plain_fwd, plain_bwd), (fused_fwd, fused_bwd) = masks
    assert not plain_bwd and len(plain_fwd) == len(fused_fwd)
    for (sa, ma), (sb, mb) in zip(plain_fwd, fused_fwd):
        assert sa == sb and torch.equal(ma, mb)
    mlp = [m for s, m in plain_fwd if s[-1] == I]
    assert len(mlp) == 2 and all(m.any() and not m.all() for m in mlp)
    assert len(fused_bwd) == 2  # the recomputed layers, last first
    assert all(torch.equal(m, r) for m, (_, r) in zip(mlp, reversed(fused_bwd)))
    _same(plain, fused, (ids,))


@pytest.mark.parametrize("make", [DropMLP, PackedDropMLP], ids=["three Linears", "packed"])
def test_backward_draws_the_forwards_masks_whatever_was_drawn_between(make):
    plain, fused, _ = _pair(make)
    x = torch.randn(3, 5, H, dtype=torch.float64)
    _same(plain, fused, (x,), between=lambda: torch.rand(1000))


def test_kept_bytes_are_the_input_and_the_report_claims_the_mask():
    """float32: the drop in what autograd keeps is the report's claim (the MLP's intermediates
    and the Dropout's mask, which on the CPU has the dtype), at least 80 % of them."""
    torch.manual_seed(0)
    plain = DropMLP()
    fused = copy.deepcopy(plain)
    _, report = fuse(fused)
    x = torch.randn(6, 7, H)
    rows = 6 * 7
    torch.manual_seed(1)
    kept_plain = saved_activation_bytes(plain, x)
    torch.manual_seed(1)
    drop = kept_plain - saved_activation_bytes(fused, x)
    intermediates = rows * I * 4 * (2 + 2 + 1)  # silu in and out, up, product, mask
    assert drop >= 0.8 * intermediates, (drop, intermediates)
    assert drop == report.bytes_per_row * rows, (drop, str(report))


def test_second_order_through_the_unit():
    plain, fused, _ = _pair(DropMLP)
    x = torch.randn(4, H, dtype=torch.float64, requires_grad=True)
    results = []
    for model in (plain, fused):
        torch.manual_seed(2)
        y = model(x)
        gx, = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        torch.rand(7)  # draws between do not change the masks
        results.append(torch.autograd.grad(gx.sin().sum(), [x] + list(model.parameters())))
    for a, b in zip(*results):
        _close(b, a, "second-order gradient")


def test_autocast_bf16_matches_the_unfused_model():
    torch.manual_seed(0)
    plain = DropMLP()
    fused = copy.deepcopy(plain)
    fuse(fused)
    x = torch.randn(8, H)
    outs = []
    for model in (plain, fused):
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        assert y.dtype == torch.bfloat16
        outs.append((y, torch.autograd.grad(y.float().square().sum(), list(model.parameters()))))
    (a, ga), (b, gb) = outs
    assert torch.equal(b, a)  # the same bf16 ops on the same masks
    for x_, y_ in zip(ga, gb):
        assert torch.equal(y_, x_)


@pytest.mark.parametrize("make", [DropMLP, lambda: torchvision_mlp(d=H, dropout=0.1)],
                         ids=["gated", "plain run"])
def test_torch_func_and_forward_ad_compute_module_by_module(make):
    plain, fused, _ = _pair(make)
    x = torch.randn(3, H, dtype=torch.float64)
    params = dict(fused.named_parameters())
    torch.manual_seed(4)
    grads = torch.func.grad(lambda p: torch.func.functional_call(fused, p, (x,)).sum())(params)
    torch.manual_seed(4)
    ref = torch.autograd.grad(plain(x).sum(), list(plain.parameters()))
    for (name, _), r in zip(plain.named_parameters(), ref):
        _close(grads[name], r, name)
    t = torch.randn_like(x)
    outs = []
    for model in (plain, fused):
        torch.manual_seed(5)
        outs.append(torch.func.jvp(model, (x,), (t,)))
    _close(outs[1][1], outs[0][1], "jvp")
    import torch.autograd.forward_ad as fwAD
    tangents = []
    for model in (plain, fused):
        torch.manual_seed(5)
        with fwAD.dual_level():
            tangents.append(fwAD.unpack_dual(model(fwAD.make_dual(x, t))).tangent)
    _close(tangents[1], tangents[0], "forward-mode AD")


def test_compile_computes_module_by_module_with_the_same_masks():
    plain, fused, _ = _pair(DropMLP)
    x = torch.randn(3, H, dtype=torch.float64)
    compiled = torch.compile(fused, backend="eager")
    torch.manual_seed(6)
    a = plain(x)
    torch.manual_seed(6)
    _close(compiled(x), a, "compiled")


@pytest.mark.parametrize("make", [PackedDropMLP, lambda: TimmMlp(d=H, drop=0.25)],
                         ids=["gated", "plain run"])
def test_float32_on_each_device_draws_the_unfused_models_masks(make, device):
    """float32 on the device: the device's generator ends where the unfused model leaves it,
    after forward and after backward (the Dropout module, called on the zero-width placeholder
    of a gated MLP or as a member of a plain run, draws nothing), and outputs and gradients agree
    to float32 rounding."""
    torch.manual_seed(0)
    plain = make().to(device)
    fused = copy.deepcopy(plain)
    assert len(fuse(fused).report.fused) == 1
    x = torch.randn(33, H, device=device)
    same_draws_on_device(plain, fused, x, device)
