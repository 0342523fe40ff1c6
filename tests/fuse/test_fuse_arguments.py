"""A forward with optional arguments or ``**kwargs`` that it only hands to child modules (OPT's
decoder layer: the mask, the cache and ``**kwargs`` go to its attention) is analysed: its MLP is a
run, also in a call that passes a keyword into ``**kwargs`` (the child gets it); an argument it
only tests against None is traced given, and a call passing None computes the class's forward,
unfused; one that looks at an optional argument otherwise is not analysed, and the report says
which."""
from __future__ import annotations

import copy
import os
import pickle

import pytest
import torch
from torch import nn

from ckpt_ext import fuse
from _ecosys import saved_activation_bytes

F64 = torch.float64


class Attn(nn.Module):
    """Stands for an attention block: what it does with its arguments is its own business."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x, mask=None, **kwargs):
        h = self.proj(x)
        if mask is not None:
            h = h * mask
        return h * kwargs.get("scale", 1.0)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attn()
        self.fc1, self.act, self.fc2 = nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 6)

    def forward(self, x, mask=None, cache=None, **kwargs):
        h = x + self.attn(x, mask=mask, **kwargs)
        return h + self.fc2(self.act(self.fc1(h)))


class LooksAtMask(Layer):
    def forward(self, x, mask=None):
        h = x + self.attn(x, mask=mask)
        if isinstance(mask, torch.Tensor):
            h = h * 2
        return h + self.fc2(self.act(self.fc1(h)))


class OtherSelfName(Layer):
    """The method's first parameter is not called ``self``: handing to ``layer.attn`` still counts."""

    def forward(layer, x, mask=None, **kwargs):  # noqa: N805
        h = x + layer.attn(x, mask=mask, **kwargs)
        return h + layer.fc2(layer.act(layer.fc1(h)))


def test_the_first_parameter_is_what_the_method_calls_itself():
    _, report = fuse(OtherSelfName())
    assert [d.layers for d in report.fused] == [("fc1", "act", "fc2")], str(report)


def _pair():
    torch.manual_seed(0)
    plain = Layer().double()
    fused = copy.deepcopy(plain)
    _, report = fuse(fused)
    return plain, fused, report


def test_arguments_handed_to_children_leave_the_mlp_a_run():
    plain, fused, report = _pair()
    assert [d.layers for d in report.fused] == [("fc1", "act", "fc2")], str(report)
    assert [p for p, _ in report.not_analysed] == ["attn"]  # it looks at its mask
    x = torch.randn(3, 6, dtype=F64, requires_grad=True)
    mask = torch.rand(3, 6, dtype=F64)
    for kw in ({}, {"mask": mask}, {"mask": mask, "cache": object()}):
        a, b = plain(x, **kw), fused(x, **kw)
        assert (a - b).abs().max() <= 1e-14 * a.abs().max()
        ga = torch.autograd.grad(a.sum(), [x, *plain.parameters()])
        gb = torch.autograd.grad(b.sum(), [x, *fused.parameters()])
        for u, v in zip(ga, gb):
            assert (u - v).abs().max() <= 1e-13 * u.abs().max()
    # fused: fc1's output and the GELU's output are not kept (16 wide, float64, 3 rows)
    assert saved_activation_bytes(plain, x, mask) - saved_activation_bytes(fused, x, mask) == \
        2 * 3 * 16 * 8 == 3 * report.bytes_per_row


def test_a_keyword_into_kwargs_reaches_the_child_and_the_run_stays_fused():
    plain, fused, _ = _pair()
    x = torch.randn(3, 6, dtype=F64, requires_grad=True)
    a, b = plain(x, scale=0.5), fused(x, scale=0.5)
    assert (a - b).abs().max() <= 1e-14 * a.abs().max()
    assert not torch.equal(a, plain(x))  # the child used it
    assert saved_activation_bytes(fused, x, run=lambda v: fused(v, scale=0.5)) < \
        saved_activation_bytes(plain, x, run=lambda v: plain(v, scale=0.5))
    for copied in (copy.deepcopy(fused), pickle.loads(pickle.dumps(fused))):
        assert (copied(x, scale=0.5) - a).abs().max() <= 1e-14 * a.abs().max()


class TestsEncoderStates(Layer):
    """A decoder layer: cross-attention only when encoder states are given."""

    def forward(self, x, mask=None, enc=None, **kwargs):
        h = x + self.attn(x, mask=mask, **kwargs)
        if enc is not None:
            h = h + self.attn(enc)
        return h + self.fc2(self.act(self.fc1(h)))


def test_an_argument_tested_against_none_is_traced_given_and_guarded():
    torch.manual_seed(0)
    plain = TestsEncoderStates().double()
    fused = copy.deepcopy(plain)
    _, report = fuse(fused)
    assert [d.layers for d in report.fused] == [("fc1", "act", "fc2")], str(report)
    x = torch.randn(3, 6, dtype=F64)
    enc = torch.randn(3, 6, dtype=F64)
    given = (lambda m: m(x, enc=enc), lambda m: m(x, None, enc))
    for call in given:  # traced so: fused, within rounding
        a, b = call(plain), call(fused)
        assert (a - b).abs().max() <= 1e-14 * a.abs().max()
        assert saved_activation_bytes(fused, x, run=lambda v: call(fused)) < \
            saved_activation_bytes(plain, x, run=lambda v: call(plain))
    for call in (lambda m: m(x), lambda m: m(x, enc=None)):  # the class's forward: exact
        assert torch.equal(call(fused), call(plain))
        assert saved_activation_bytes(fused, x, run=lambda v: call(fused)) == \
            saved_activation_bytes(plain, x, run=lambda v: call(plain))


def test_an_optional_argument_the_forward_looks_at_is_reported():
    model = LooksAtMask()
    _, report = fuse(model)
    assert len(report.fused) == 0
    assert ("", "its forward looks at its optional argument mask=None (not only handing it to "
                "a child); fx would see only one value of it") in report.not_analysed


# -- OPT: transformers' GradientCheckpointingLayer ------------------------------------------------

def _opt():
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    return transformers.OPTModel(transformers.OPTConfig(
        vocab_size=50, hidden_size=16, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=32, word_embed_proj_dim=16)).double()


def _grads(model, ids):
    out = model(ids).last_hidden_state
    return [out] + list(torch.autograd.grad(out.square().sum(), list(model.parameters())))


def test_opt_with_gradient_checkpointing_switched_on_after_fuse_runs_unfused():
    plain = _opt()
    fused = copy.deepcopy(plain)
    _, report = fuse(fused)
    assert len(report.fused) == 2
    ids = torch.randint(1, 50, (2, 7))
    for m in (plain, fused):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
    torch.manual_seed(1)
    a = _grads(plain, ids)
    torch.manual_seed(1)
    b = _grads(fused, ids)
    assert all(torch.equal(u, v) for u, v in zip(a, b))  # the class's forward: exactly plain


def test_opt_fused_with_gradient_checkpointing_on_is_left_alone():
    model = _opt()
    model.gradient_checkpointing_enable()
    _, report = fuse(model)
    assert len(report.fused) == 0
    assert "gradient checkpointing is on" in str(report)
