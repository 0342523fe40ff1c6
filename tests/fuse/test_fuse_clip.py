"""CLIP's MLP (``fc1 -> QuickGELUActivation -> fc2``, transformers' CLIPMLP) fused by ckpt_ext.fuse
as one quick_gelu run per encoder layer: outputs and every gradient against an unfused deep copy
(float64), the bytes the report says each run frees against what autograd keeps, and a plain
``Sequential(Linear, QuickGELU, Linear)``. transformers is a test extra (skipped, with the reason,
where not installed); tiny configs, nothing downloaded."""
from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from ckpt_ext import fuse
from ckpt_ext._activations import QuickGELU
from ckpt_ext.convert import RunLinear
from _ecosys import kept_bytes, outputs_and_grads, rel_err, saved_activation_bytes

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

F64 = torch.float64


def _freed(before, after, x):
    """Bytes of the tensors autograd saves that the fused model does not save; the allocator's
    meter agrees up to the 0-dim scalar (16 B per layer: 1.702) that QuickGELU's mul saves."""
    saved = saved_activation_bytes(before, x) - saved_activation_bytes(after, x)
    kept = kept_bytes(before, x) - kept_bytes(after, x)
    assert saved <= kept <= saved * 1.01
    return saved


def test_sequential_with_quick_gelu_fuses():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), QuickGELU(), nn.Linear(16, 12), QuickGELU(),
                          nn.Linear(12, 3)).double()
    before = copy.deepcopy(model)
    _, report = fuse(model)
    (d,) = report.fused
    assert d.activation == "quick_gelu" and d.layers == tuple("01234")
    # unfused, QuickGELU keeps z, sigmoid(1.702 z) and its output per layer
    assert d.bytes_per_row == 3 * (16 + 12) * 8
    x = torch.randn(7, 6, dtype=F64, requires_grad=True)
    out_b, in_b, g_b = outputs_and_grads(before, x)
    out_a, in_a, g_a = outputs_and_grads(model, x)
    for a, b in zip(out_a + in_a, out_b + in_b):
        assert rel_err(a, b) <= 2e-15
    for name in g_b:
        assert rel_err(g_a[name], g_b[name]) <= 2e-15, name
    assert _freed(before, model, x) == 7 * d.bytes_per_row


def _clip_vision():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                       "(pip install -r requirements.txt installs it)")
    config = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=2, num_attention_heads=2,
                                           image_size=16, patch_size=8, hidden_act="quick_gelu",
                                           attention_dropout=0.0)
    torch.manual_seed(0)
    return transformers.CLIPVisionModel(config).double()


class _Outputs(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixels):
        out = self.model(pixel_values=pixels)
        return torch.cat([out.last_hidden_state.flatten(), out.pooler_output.flatten()])


def test_clip_vision_mlps_fuse():
    model = _clip_vision()
    before = copy.deepcopy(model)
    _, report = fuse(model)
    runs = [(f"encoder.layers.{i}.mlp.fc1",
             f"encoder.layers.{i}.mlp.activation_fn",
             f"encoder.layers.{i}.mlp.fc2") for i in range(2)]
    assert sorted(d.layers for d in report.fused) == runs, str(report)
    assert all(d.activation == "quick_gelu" for d in report.fused)
    assert all(d.bytes_per_row == 3 * 64 * 8 for d in report.fused)
    for i in range(2):
        mlp = model.encoder.layers[i].mlp
        assert type(mlp.fc1) is RunLinear and type(mlp.fc2) is RunLinear
    pixels = torch.randn(2, 3, 16, 16, dtype=F64)
    plain, fused = _Outputs(before), _Outputs(model)
    out_b, _, g_b = outputs_and_grads(plain, pixels, grad_input=False)
    out_f, _, g_f = outputs_and_grads(fused, pixels, grad_input=False)
    for a, b in zip(out_f, out_b):
        assert rel_err(a, b) <= 1e-14
    floor = 1e-15 * max(g.norm().item() for g in g_b.values())
    assert g_f.keys() == g_b.keys()
    for n in g_b:
        assert (g_f[n] - g_b[n]).norm().item() <= 1e-12 * g_b[n].norm().item() + floor, n
    tokens = 2 * (1 + (16 // 8) ** 2)  # the class token and 4 patches per image
    assert _freed(plain, fused, pixels) == tokens * sum(d.bytes_per_row for d in report.fused)
