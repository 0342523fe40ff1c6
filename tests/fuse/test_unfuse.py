"""``ckpt_ext.unfuse(model)`` undoes ``fuse`` in place: every module gets back its class and
forward, the state dict is unchanged, and tools that match exact types (``quantize_dynamic``,
``torch.jit.trace``) see the model they would see had it never been fused. ``torch.jit.trace`` of
a fused model works too (it records the unfused computation)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ckpt_ext
from ckpt_ext import fuse
from ckpt_ext.models import Net


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x))) + x


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh())
        self.block = Block()
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.block(self.trunk(x)))


def _models():
    torch.manual_seed(0)
    return {"model": Model(), "net": Net(in_features=8, hidden=16, depth=3, mode="plain")}


def _snapshot(model):
    return {path: (type(m), dict(vars(m))) for path, m in model.named_modules()}


@pytest.mark.parametrize("name", ["model", "net"])
def test_unfuse_restores_classes_forwards_and_attributes(name):
    model = _models()[name]
    twin = copy.deepcopy(model)
    before = _snapshot(model)
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    _, report = fuse(model)
    assert report.fused
    assert any(type(m) is not before[p][0] for p, m in model.named_modules())

    assert ckpt_ext.unfuse(model) is model

    after = _snapshot(model)
    assert set(after) == set(before)
    for path, (cls, attrs) in before.items():
        assert after[path][0] is cls, path
        assert set(after[path][1]) == set(attrs), path
        assert "forward" not in vars(model.get_submodule(path)) or "forward" in attrs
    state = model.state_dict()
    assert list(state) == list(keys)
    assert all(torch.equal(state[k], v) for k, v in keys.items())
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), twin(x), rtol=0, atol=0)
    assert ckpt_ext.unfuse(model) is model  # twice: nothing more to undo


def test_unfuse_then_quantize_dynamic_matches_a_never_fused_copy():
    model = _models()["model"]
    never = copy.deepcopy(model)
    fuse(model)
    ckpt_ext.unfuse(model)
    q_model = torch.ao.quantization.quantize_dynamic(model, {nn.Linear})
    q_never = torch.ao.quantization.quantize_dynamic(never, {nn.Linear})
    types = [type(m) for m in q_model.modules()]
    assert types == [type(m) for m in q_never.modules()]
    assert not any(t is nn.Linear for t in types)
    x = torch.randn(6, 8)
    assert torch.equal(q_model(x), q_never(x))


@pytest.mark.parametrize("name", ["model", "net"])
def test_jit_trace_after_unfuse_and_of_a_fused_model(name):
    model = _models()[name]
    twin = copy.deepcopy(model)
    fuse(model)
    x = torch.randn(4, 8)
    try:
        traced = torch.jit.trace(model, x, check_trace=False)
    except Exception as e:  # allowed only if it says how to get the model back
        assert "ckpt_ext.unfuse" in str(e)
    else:
        torch.testing.assert_close(traced(x), twin(x), rtol=1e-6, atol=1e-6)
    ckpt_ext.unfuse(model)
    traced = torch.jit.trace(model, x)
    torch.testing.assert_close(traced(x), twin(x), rtol=0, atol=0)


def test_unfuse_undoes_a_rewrite():
    class F(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(16, 8))
            self.w2 = nn.Parameter(torch.randn(4, 16))

        def forward(self, x):
            return torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(x, self.w1)),
                                              self.w2)

    model = F()
    twin = copy.deepcopy(model)
    _, report = fuse(model, rewrite=True)
    assert report.rewritten == [""]
    ckpt_ext.unfuse(model)
    assert "forward" not in vars(model)
    x = torch.randn(3, 8)
    torch.testing.assert_close(model(x), twin(x), rtol=0, atol=0)
