"""Runs with function calls between their child Linears: ``fc2(F.dropout(F.relu(fc1(x)), p,
training))`` in a forward, and ``nn.TransformerEncoderLayer`` / ``DecoderLayer``'s ``_ff_block``
(``linear2(dropout(activation(linear1(x))))`` with ``activation=F.relu``). Plain ``fuse`` makes
each one unit computed in its owner's region: outputs and every gradient as unfused, the
unfused model's dropout masks bitwise, the report's bytes equal to what autograd no longer keeps;
a call that breaks what the analysis assumed (an attribute changed, a hook) computes module by
module; torch's fast path keeps running."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ckpt_ext import fuse, unfuse
from ckpt_ext.convert import RunLinear
from _ecosys import kept_bytes, saved_activation_bytes
from _masks import record_masks, same_draws_on_device

F64 = torch.float64
# Measured (CPU, float64): outputs and every gradient within 4e-16 of the unfused copy's,
# relative to the largest; 1e-14 leaves room for another CPU's GEMM blocking.
TOL = 1e-14


class InlineMLP(nn.Module):
    """A hand-written MLP with its activation and dropout as function calls."""

    def __init__(self, act=F.relu, p=0.2):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 5)
        self.act, self.p = act, p

    def forward(self, x):
        return self.fc2(F.dropout(self.act(self.fc1(x)), p=self.p, training=self.training))


class Between(nn.Module):
    """Something other than an activation or a dropout between the Linears."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 5)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)) * 2)


def _encoder(norm_first=False, **kw):
    return nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, norm_first=norm_first,
                                      batch_first=True, **kw)


def _decoder(norm_first=False, **kw):
    return nn.TransformerDecoderLayer(16, 2, 32, dropout=0.1, norm_first=norm_first,
                                      batch_first=True, **kw)


LAYERS = {"encoder": (_encoder, 1), "encoder, norm_first": (lambda: _encoder(True), 1),
          "decoder": (_decoder, 2), "decoder, norm_first": (lambda: _decoder(True), 2)}


def _inputs(n):
    g = torch.Generator().manual_seed(5)
    return tuple(torch.randn(3, 7 - k, 16, dtype=F64, generator=g) for k in range(n))


def _pair(make):
    torch.manual_seed(0)
    plain = make().double()
    fused = copy.deepcopy(plain)
    _, report = fuse(fused)
    return plain, fused, report


def _step(model, inputs, seed=1):
    torch.manual_seed(seed)
    out = model(*inputs)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.square().sum(), params)
    return out, grads, torch.get_rng_state()


def _close(a, b, what):
    err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()
    assert err <= TOL, f"{what}: {err:.3g}"


def _same(plain, fused, inputs):
    a, ga, sa = _step(plain, inputs)
    b, gb, sb = _step(fused, inputs)
    assert torch.equal(sa, sb), "the generator advanced differently"
    _close(b, a, "output")
    for (name, _), r, g in zip(plain.named_parameters(), ga, gb):
        _close(g, r, f"grad of {name}")


def _freed(plain, fused, inputs, drawing):
    """What autograd saves for backward unfused and no longer fused, by both meters: a unit
    drawing masks also keeps the CPU generator's state (a fixed 5,056 bytes per call)."""
    saved = saved_activation_bytes(plain, *inputs) - saved_activation_bytes(fused, *inputs)
    if len(inputs) == 1:
        rng = torch.get_rng_state().numel() if drawing else 0
        assert kept_bytes(plain, *inputs) - kept_bytes(fused, *inputs) == saved - rng
    return saved


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_hand_written_mlp_is_one_unit_exact_and_frees_its_claim(mode):
    plain, fused, report = _pair(lambda: InlineMLP().train(mode == "train"))
    (d,) = report.fused
    assert d.layers == ("fc1", "F.relu", "fc2") and d.how == "children", str(report)
    assert "F.relu, F.dropout, between its Linears, run on a zero-width placeholder" in d.why
    assert ("drawn inside the unit" in d.why) == (mode == "train")
    assert isinstance(fused.fc1, RunLinear) and type(fused) is InlineMLP
    x = torch.randn(9, 6, dtype=F64)
    _same(plain, fused, (x,))
    # relu's output, and in train() the mask (float64 on the CPU) and the dropout's output
    assert _freed(plain, fused, (x,), mode == "train") == 9 * d.bytes_per_row == \
        9 * 16 * 8 * (3 if mode == "train" else 1)


def test_masks_are_the_unfused_models_bitwise(monkeypatch):
    plain, fused, report = _pair(InlineMLP)
    assert len(report.fused) == 1
    drawn = record_masks(monkeypatch)  # after fuse, which must see F.dropout itself
    x = torch.randn(9, 6, dtype=F64)
    runs = []
    for model in (plain, fused):
        drawn.clear()
        torch.manual_seed(3)
        y = model(x)
        forward = list(drawn)
        y.square().sum().backward()
        runs.append((forward, drawn[len(forward):]))
    (plain_fwd, plain_bwd), (fused_fwd, fused_bwd) = runs
    assert not plain_bwd and len(plain_fwd) == len(fused_fwd) == 1
    assert torch.equal(plain_fwd[0][1], fused_fwd[0][1])
    assert len(fused_bwd) == 1 and torch.equal(fused_bwd[0][1], plain_fwd[0][1])


@pytest.mark.parametrize("change", ["p", "act", "hook", "replaced", "instance forward"])
def test_a_call_that_breaks_the_analysis_computes_module_by_module(change):
    plain, fused, _ = _pair(InlineMLP)
    called = []
    for m in (plain, fused):
        if change == "p":
            m.p = 0.5  # a guard: the class's forward, unfused
        elif change == "act":
            m.act = torch.tanh
        elif change == "hook":
            m.fc1.register_forward_hook(lambda mod, inp, out: called.append(out.shape) or out * 2)
        elif change == "replaced":
            m.fc2 = nn.Linear(16, 5, dtype=F64)
            m.fc2.load_state_dict(plain.fc2.state_dict())
        else:
            m.fc1.forward = lambda h, lin=m.fc1: F.linear(h, lin.weight, lin.bias) * 3
    x = torch.randn(4, 6, dtype=F64)
    _same(plain, fused, (x,))
    if change == "hook":
        assert called == [(4, 16), (4, 16)]  # each model's fc1 output, as it computes it


def test_other_code_between_the_linears_is_left_alone():
    _, report = fuse(Between())
    assert not report.fused and "F.relu" not in str(report.fused), str(report)


def test_rewrite_true_still_rewrites_a_forward_it_may():
    torch.manual_seed(0)
    plain = InlineMLP(p=0.0).double().eval()
    fused = copy.deepcopy(plain)
    _, report = fuse(fused, rewrite=True)
    # F.dropout hands self.training: not rewritten, computed in the region
    assert [d.how for d in report.fused] == ["children"] and report.rewritten == []
    _same(plain, fused, (torch.randn(4, 6, dtype=F64),))


@pytest.mark.parametrize("name", list(LAYERS))
def test_torch_transformer_layers_feed_forward_is_one_unit(name):
    make, n = LAYERS[name]
    plain, fused, report = _pair(make)
    (d,) = report.fused
    assert d.layers == ("linear1", "F.relu", "linear2") and d.how == "children", str(report)
    assert any("analysed the method its forward names, _ff_block" in why
               for _, why in report.not_analysed), report.not_analysed
    assert "_ff_block" in vars(fused) and "forward" not in vars(fused)
    inputs = _inputs(n)
    for mode in (True, False):
        plain.train(mode)
        fused.train(mode)
        _same(plain, fused, inputs)
    plain.train()
    fused.train()
    rows = inputs[0].shape[0] * inputs[0].shape[1]
    assert _freed(plain, fused, inputs, True) == rows * d.bytes_per_row == rows * 3 * 32 * 8
    clone = pickle.loads(pickle.dumps(fused))
    _same(plain, clone, inputs)
    unfuse(fused)
    assert "_ff_block" not in vars(fused) and type(fused.linear1) is nn.Linear


@pytest.mark.parametrize("activation", ["gelu", nn.GELU(), F.silu])
def test_other_activations(activation):
    plain, fused, report = _pair(lambda: _encoder(activation=copy.deepcopy(activation)))
    (d,) = report.fused
    assert d.layers[0] == "linear1" and d.layers[-1] == "linear2", str(report)
    _same(plain, fused, _inputs(1))


def test_activation_set_after_fusing_is_a_guard():
    plain, fused, _ = _pair(_encoder)
    for m in (plain, fused):
        m.activation = F.gelu
    _same(plain, fused, _inputs(1))


def test_fast_path_still_runs_in_eval_without_grad(monkeypatch):
    plain, fused, _ = _pair(_encoder)
    calls = []
    real = torch._transformer_encoder_layer_fwd

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", counting)
    (x,) = _inputs(1)
    plain.eval()
    fused.eval()
    # a default device set by an earlier import (DeepXDE sets one) is a torch function mode,
    # which turns the fast path off
    device = torch.get_default_device()
    torch.set_default_device(None)
    try:
        with torch.no_grad():
            a, b = plain(x), fused(x)
    finally:
        torch.set_default_device(device)
    assert len(calls) == 2 and torch.equal(a, b)


@pytest.mark.parametrize("make", [InlineMLP, _encoder], ids=["hand-written", "encoder layer"])
def test_float32_on_each_device(make, device):
    """float32 on the device (cuda-marked on the GPU): the F.dropout called on the zero-width
    placeholder draws nothing, so the device's generator ends where the unfused model leaves
    it, after forward and after backward; outputs and gradients agree to float32 rounding."""
    torch.manual_seed(0)
    plain = make().to(device)
    fused = copy.deepcopy(plain)
    assert len(fuse(fused)[1].fused) == 1
    x = torch.randn(3, 11, 16, device=device) if make is _encoder else \
        torch.randn(33, 6, device=device)
    same_draws_on_device(plain, fused, x, device)


# -- a forward branching on a traced value: analysed up to the branch ----------------------------

class _Branching(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(4, 8), nn.Linear(8, 4), nn.Tanh()


class BranchBetween(_Branching):
    def forward(self, x):
        h = F.relu(self.fc1(x))
        if h.sum() > 0:
            h = h * 2
        return self.fc2(h)


class BranchReadsTheMiddle(_Branching):
    """The branch fx does not trace reads the run's middle value: a local variable at the
    branch, so it is used there."""

    def forward(self, x):
        h = F.relu(self.fc1(x))
        y = self.fc2(h)
        if y.sum() > 0:
            y = y + h[..., :4]
        return y


class BranchReadsTheMiddleOfModules(BranchReadsTheMiddle):
    def forward(self, x):
        h = self.act(self.fc1(x))
        y = self.fc2(h)
        if y.sum() > 0:
            y = y + h[..., :4]
        return y


class BranchAfter(_Branching):
    def forward(self, x):
        h = self.fc2(F.relu(self.fc1(x)))
        if h.sum() > 0:
            return self.fc2(F.relu(self.fc1(h)))
        return h


class BranchAfterModules(_Branching):
    def forward(self, x):
        h = self.fc2(self.act(self.fc1(x)))
        return self.fc2(self.act(self.fc1(h))) if h.sum() > 0 else h


BRANCHING = {BranchBetween: [], BranchReadsTheMiddle: [],
             BranchReadsTheMiddleOfModules: [],
             BranchAfter: [("fc1", "F.relu", "fc2")], BranchAfterModules: [("fc1", "act", "fc2")]}


@pytest.mark.parametrize("cls", list(BRANCHING), ids=lambda c: c.__name__)
def test_a_branch_on_a_traced_value_ends_the_analysis_there(cls):
    """Only calls before the branch can be members, and what the forward's local variables hold
    at the branch may be read after it: both sides of the branch, exact."""
    plain, fused, report = _pair(cls)
    assert [d.layers for d in report.fused] == BRANCHING[cls], str(report)
    assert any("where it branches on a traced value" in why for _, why in report.not_analysed)
    x = torch.randn(5, 4, dtype=F64)
    for bias in (100.0, -100.0):  # sets the sign of what each forward branches on
        for m in (plain, fused):
            with torch.no_grad():
                m.fc1.bias.fill_(bias)
                m.fc2.bias.fill_(bias)
        _same(plain, fused, (x,))
