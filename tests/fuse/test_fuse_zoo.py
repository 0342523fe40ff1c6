"""The zoo (tests/fuse/_zoo.py): for each model, ``fuse`` keeps outputs and every gradient of the
unfused copy (float64, train with its dropouts and eval), and frees at least 90 % of the bytes
its MLPs keep for backward beyond their input (float32, measured with saved-tensor hooks), the
report's figures to the byte, or
leaves its MLPs alone for the reason listed here, which the report gives. The table in
docs/fuse-usage.md is scripts/zoo_table.py's; its rows must name each model and its fused MLPs."""
from __future__ import annotations

import copy
import os
import re

import pytest
import torch

from ckpt_ext import fuse

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import _zoo  # noqa: E402

# The models whose MLPs fuse leaves alone, and the reason the report gives.
LEFT_ALONE: dict = {}  # model -> why its MLPs are left alone: none is
DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "fuse-usage.md")


@pytest.mark.parametrize("name", list(_zoo.ZOO))
def test_zoo_model_frees_its_mlps_or_says_why(name):
    row, _, _ = _zoo.measure(name)
    assert row.mlps == 2 and row.mlp_kept > 0, row
    if name in LEFT_ALONE:
        assert row.units == 0 and row.freed == 0, row
        assert LEFT_ALONE[name] in row.why, row
    else:
        assert row.units == row.mlps, row
        assert row.share >= 0.9, row
        assert row.freed == row.claimed, row  # the report's figures, to the byte
        assert row.kept[1] < row.kept[0], row


@pytest.mark.parametrize("name", list(_zoo.LORA))
def test_zoo_model_with_lora_frees_its_mlps(name):
    pytest.importorskip("peft")
    row, _, _ = _zoo.measure(name, lora=True)
    assert row.units == row.mlps == 2, row
    assert row.share >= 0.9, row
    assert row.freed == row.claimed, row  # the report's figures, to the byte


# GPT-2 with LoRA: the fused output is 1 ulp (2e-16) from peft's where MKL rounds a GEMM on
# the op's buffer otherwise, which its final LayerNorm's backward amplifies in every gradient
# (measured <= 1.0e-11 over the LoRA weights); the other models: <= 1e-15.
TOL = {"GPT-2 + LoRA": 1e-10}


def _close_all(a, b, what, tol=1e-13):
    scale = max(x.abs().max() for x in a if x is not None).clamp_min(1e-300)
    for i, (x, y) in enumerate(zip(a, b)):
        assert (x is None) == (y is None), f"{what} {i}"
        if x is not None:
            err = (y - x).abs().max() / scale
            assert err <= tol, f"{what} {i}: {err:.3g}"


def _trained(model):
    return [p for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("name", list(_zoo.ZOO) + [f"{n} + LoRA" for n in _zoo.LORA])
def test_zoo_model_outputs_and_gradients_are_the_unfused_ones(name):
    tol = TOL.get(name, 1e-13)
    name, lora = name.removesuffix(" + LoRA"), name.endswith(" + LoRA")
    if lora:
        pytest.importorskip("peft")
    torch.manual_seed(0)
    plain = _zoo.make(name, lora).double()
    fused = copy.deepcopy(plain)
    fuse(fused)
    torch.manual_seed(1)
    inputs = tuple(x.double() if x.is_floating_point() else x for x in _zoo.ZOO[name].inputs())
    for train in (True, False):
        plain.train(train)
        fused.train(train)
        torch.manual_seed(2)  # the same dropout masks
        a = _zoo.call(name, plain, inputs)
        torch.manual_seed(2)
        b = _zoo.call(name, fused, inputs)
        _close_all([a], [b], f"output, train={train}")
        assert a.requires_grad == b.requires_grad
        if not a.requires_grad:  # torch's fast path of an encoder layer in eval: no graph
            continue
        ga = torch.autograd.grad(a.square().sum(), _trained(plain), allow_unused=True)
        gb = torch.autograd.grad(b.square().sum(), _trained(fused), allow_unused=True)
        _close_all(ga, gb, f"gradient, train={train}", tol)


def test_doc_table_names_every_zoo_model_and_its_fused_mlps():
    text = open(DOC, encoding="utf-8").read()
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\| (.+?) \| (\d+)/(\d+) \|", line)
        if m:
            rows[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    for name in _zoo.ZOO:
        assert name in rows, f"{name} is not in the zoo table of docs/fuse-usage.md"
        want = (0, 2) if name in LEFT_ALONE else (2, 2)
        assert rows[name] == want, (f"{name}: the table says {rows[name]}, fuse fuses {want}: "
                                    f"run scripts/zoo_table.py")
