"""Pickles of fused models keep loading: tests/fuse/data/fused_models.pkl holds fused models of
every kind fuse makes (written by _pickled_models.py with the converter of the time it was
committed), each beside an unfused copy. Loaded, each computes what its copy computes, value for
value and gradient for gradient, and is still fused: it keeps what a model fused now keeps."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

import ckpt_ext
from _ecosys import outputs_and_grads, saved_activation_bytes
import _pickled_models

with open(_pickled_models.PICKLE, "rb") as f:
    LOADED = pickle.load(f)


@pytest.mark.parametrize("index", range(len(LOADED)), ids=[e[0] for e in LOADED])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_pickled_fused_model_computes_as_unfused_and_stays_fused(index, mode):
    name, plain, fused, units = copy.deepcopy(LOADED[index])
    for m in (plain, fused):
        m.train(mode == "train")
    args = _pickled_models.inputs(name)
    out_p, gin_p, g_p = outputs_and_grads(plain, *args)
    out_f, gin_f, g_f = outputs_and_grads(fused, *args)
    for a, b in zip(out_p + gin_p, out_f + gin_f):
        assert (a is None and b is None) or torch.allclose(a, b, rtol=1e-13, atol=1e-14), name
    assert g_p.keys() == g_f.keys()
    for k in g_p:
        assert torch.allclose(g_p[k], g_f[k], rtol=1e-13, atol=1e-14), (name, k)
    fresh = copy.deepcopy(plain)
    _, report = ckpt_ext.fuse(fresh, **dict(_pickled_models.models()[index][2]))
    assert len(report.fused) == units
    assert saved_activation_bytes(fused, *args) == saved_activation_bytes(fresh, *args)
    assert saved_activation_bytes(fused, *args) < saved_activation_bytes(plain, *args)


def test_a_pickled_fused_model_unfuses_to_its_classes():
    for name, plain, fused, _ in copy.deepcopy(LOADED):
        ckpt_ext.unfuse(fused)
        assert [type(m) for m in fused.modules()] == [type(m) for m in plain.modules()], name
        assert not any(k.startswith("_ckpt_ext") for m in fused.modules() for k in vars(m)), name
