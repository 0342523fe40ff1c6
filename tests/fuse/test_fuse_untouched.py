"""fuse touches nothing it does not fuse: the analysis, the report and a dry run never evaluate a
parametrized weight, a lazy parameter or anything with a side effect, and never draw from the
random number generators. After ``fuse(m, dry_run=True)`` every parameter and buffer is
bit-identical to a copy taken before, the RNG states are unchanged, and classes and attributes are
unchanged; after a real fuse the same holds for every module fuse did not fuse."""
from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

from ckpt_ext import fuse


def _state(model: nn.Module):
    """Every parameter and buffer (by name, bit for bit), and every module's class and attribute
    names."""
    tensors = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        tensors[name] = None if isinstance(t, nn.parameter.UninitializedParameter) else \
            t.detach().clone()
    modules = {path: (type(m), {k: _plain(v) for k, v in vars(m).items()})
               for path, m in model.named_modules()}
    return tensors, modules


def _plain(v):
    """A value compared as is (numbers, strings, ...), else by identity."""
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device)):
        return v
    if isinstance(v, (tuple, list)):
        return type(v)(_plain(x) for x in v)
    return ("object", id(v))


def _rng_states():
    states = [torch.random.get_rng_state(), random.getstate()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state_all())
    return states


def _assert_same_rng(before, after):
    assert torch.equal(before[0], after[0]), "fuse drew from torch's CPU generator"
    assert before[1] == after[1], "fuse drew from Python's random"
    if len(before) > 2:
        assert all(torch.equal(a, b) for a, b in zip(before[2], after[2])), \
            "fuse drew from a CUDA generator"


def _assert_bit_identical(before, model, fused=()):
    """Every tensor bit for bit (fuse never changes a value, fused or not); the class and
    attribute names of every module but those in ``fused`` (the modules of fused units, whose
    class fuse sets)."""
    tensors, modules = before
    now, now_modules = _state(model)
    assert set(now) == set(tensors)
    for name, t in tensors.items():
        if t is None:
            assert isinstance(dict(list(model.named_parameters()))[name],
                              nn.parameter.UninitializedParameter)
            continue
        assert torch.equal(now[name], t) and now[name].dtype == t.dtype, f"{name} changed"
    for path, (cls, attrs) in modules.items():
        if path in fused:
            continue
        assert now_modules[path] == (cls, attrs), f"{path or '<model>'} changed"


class Block(nn.Module):
    """A forward through child modules, as a user writes one: a run fc1 -> act -> fc2."""

    def __init__(self, fc1: nn.Module, fc2: nn.Module, d: int = 8, h: int = 16):
        super().__init__()
        self.fc1, self.act, self.fc2 = fc1, nn.Tanh(), fc2

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Drawing(nn.Module):
    """transformers' LayerDrop pattern: the forward draws a random number to skip its block."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 16), nn.Tanh(), nn.Linear(16, d)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        if self.training and torch.rand([]) < 0.0:  # never skips, but draws
            return x
        return self.drop(self.fc2(self.act(self.fc1(x)))) + x


def _spectral(train: bool):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), parametrizations.spectral_norm(nn.Linear(16, 16)),
                      nn.Tanh(), nn.Linear(16, 4))
    return m.train(train)


def _models():
    torch.manual_seed(0)
    yield "spectral_norm train", _spectral(True)
    yield "spectral_norm eval", _spectral(False)
    yield "spectral_norm in a forward", Block(parametrizations.spectral_norm(nn.Linear(8, 16)),
                                              nn.Linear(16, 8))
    yield "spectral_norm last, in a forward", Block(nn.Linear(8, 16),
                                                    parametrizations.spectral_norm(
                                                        nn.Linear(16, 8)))
    yield "weight_norm", nn.Sequential(parametrizations.weight_norm(nn.Linear(8, 16)), nn.Tanh(),
                                       nn.Linear(16, 4))
    yield "batchnorm", nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(),
                                     nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    yield "lazy", nn.Sequential(nn.LazyLinear(16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                                nn.Linear(16, 4))
    yield "lazy in a forward", Block(nn.LazyLinear(16), nn.Linear(16, 8))
    yield "draws random numbers", Drawing()


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry_run", "fuse"])
@pytest.mark.parametrize("trace", [True, False], ids=["trace", "no_trace"])
@pytest.mark.parametrize("case", [name for name, _ in _models()])
def test_fuse_changes_nothing_it_does_not_fuse(case, trace, dry_run):
    model = dict(_models())[case]
    before = _state(model)
    rng = _rng_states()
    _, report = fuse(model, dry_run=dry_run, trace=trace)
    str(report)
    _assert_same_rng(rng, _rng_states())
    # What a real fuse changes: the classes of its units' modules (and the forward of the module
    # holding them); a dry run changes nothing at all.
    fused = set()
    if not dry_run:
        for d in report.fused:
            fused.update(d.layers)
            fused.add(d.where)
    _assert_bit_identical(before, model, fused)


def test_spectral_norm_in_train_mode_computes_the_same_after_fuse():
    model = _spectral(True)
    twin = copy.deepcopy(model)
    x = torch.randn(5, 8)
    fuse(model, dry_run=True)
    fuse(model)
    torch.testing.assert_close(model(x), twin(x), rtol=0, atol=0)
    assert torch.equal(model[2].parametrizations.weight[0]._u, twin[2].parametrizations.weight[0]._u)


def test_lazy_linear_is_left_alone_with_the_reason():
    model = nn.Sequential(nn.LazyLinear(16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 4))
    _, report = fuse(model)
    text = str(report)
    assert "LazyLinear" in text
    model(torch.randn(3, 5))  # still initialises on first call
    assert model[0].in_features == 5


def test_analysis_draws_no_random_numbers_so_dropout_masks_match_the_unfused_run():
    torch.manual_seed(0)
    plain = Drawing()
    fused = copy.deepcopy(plain)
    x = torch.randn(64, 8)
    torch.manual_seed(123)
    want = plain(x)
    torch.manual_seed(123)
    fuse(fused, dry_run=True)
    fuse(fused)
    got = fused(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert torch.equal(got == 0, want == 0)  # the same dropout mask
