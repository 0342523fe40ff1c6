"""Every Linear is accounted for: each ``nn.Linear`` of the model (attention projections and
``MultiheadAttention.out_proj`` included) and each transformers ``Conv1D`` appears in the report,
in a fused unit, a "left alone" decision or a ``not_analysed`` entry with the specific reason; and
``print(report)`` of a deep model groups identical decisions."""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from ckpt_ext import fuse
from _fuse_models import MODELS


def _linear_paths(model: nn.Module):
    out = []
    for path, m in model.named_modules():
        if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D":
            out.append(path)
    return out


def _accounted(report):
    """Path -> the reasons the report gives for it."""
    seen = {}
    for d in report.decisions:
        for layer in d.layers:
            seen.setdefault(layer, []).append(f"{d.action}: {d.why}")
    for path, why in report.not_analysed + getattr(report, "other_layers", []):
        seen.setdefault(path, []).append(why)
    return seen


class LoRALinear(nn.Module):
    """What peft's LoRA wraps a Linear in: base_layer(x) + lora_B(lora_A(dropout(x))) * scaling."""

    def __init__(self, base: nn.Linear, r: int = 2):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        self.scaling = 0.5

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling


class LoRAModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = LoRALinear(nn.Linear(8, 16))
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class SplitGated(nn.Module):
    """A gated MLP split by sizes, not chunk(2, dim=-1): a form fuse does not compute fused."""

    def __init__(self):
        super().__init__()
        self.gate_up, self.down = nn.Linear(8, 32), nn.Linear(16, 8)

    def forward(self, x):
        gate, up = self.gate_up(x).split(16, dim=-1)
        return self.down(torch.nn.functional.silu(gate) * up)


def _models():
    out = {name: make for name, make in MODELS.items()}
    out["torch TransformerEncoderLayer"] = lambda: (
        nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True), None, 0)
    out["lora wrapper"] = lambda: (LoRAModel(), None, 0)
    out["lone linear"] = lambda: (nn.Sequential(nn.Linear(8, 8)), None, 0)
    out["gated, split by sizes"] = lambda: (SplitGated(), None, 0)
    return out


MUST_SAY = {
    "gpt2": ("mlp.c_fc -> ", "as mlp gelu_tanh"),
    "phi3": ("gated_mlp silu", "packed gate_up"),
    "gated, split by sizes": ("gated product",),
    "lora wrapper": ("fc1.base_layer: its output goes to operator.add",),
    "torch TransformerEncoderLayer": ("linear1 -> F.relu -> linear2",
                                      "out_proj: its caller self_attn is "
                                      "torch.nn.MultiheadAttention"),
    "relu, dropout p=0.1, linear": ("2 draws its mask inside the unit",),
    "relu, dropout p=0, linear": ("through 2 (Dropout(p=0.0))",),
}


@pytest.mark.parametrize("name", list(_models()))
def test_every_linear_is_in_the_report(name):
    model, _, _ = _models()[name]()
    _, report = fuse(model, dry_run=True)
    seen = _accounted(report)
    missing = [p for p in _linear_paths(model) if p not in seen]
    assert not missing, f"{name}: not in the report: {missing}\n{report}"
    text = str(report)
    for phrase in MUST_SAY.get(name, ()):
        assert phrase in text, f"{name}: {phrase!r} not in\n{text}"


def test_multihead_attention_out_proj_is_accounted_for():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(self.attn(x, x, x, need_weights=False)[0])

    model = Attn()
    _, report = fuse(model, dry_run=True)
    seen = _accounted(report)
    assert "attn.out_proj" in seen and "fc" in seen, str(report)
    assert "torch.nn.MultiheadAttention" in " ".join(seen["attn.out_proj"])


def test_report_of_32_layers_groups_identical_decisions():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)

        def forward(self, x):
            return self.fc2(self.act(self.fc1(x))) + x

    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(32))
            self.heads = nn.ModuleList(nn.Linear(8, 8) for _ in range(32))

        def forward(self, x, scale=None):
            for layer in self.layers:
                x = layer(x)
            return x

    model = Deep()
    _, report = fuse(model)
    assert len(report.fused) == 32
    text = str(report)
    lines = text.splitlines()
    assert len(lines) <= 8, text
    assert "layers.{0..31}.fc1" in text, text
    assert re.search(r"heads\.\{0\.\.31\}", text), text


def test_grouped_lines_say_exactly_the_lines_they_stand_for():
    from ckpt_ext.convert.report import grouped
    every = [f"x b.{i}.l.{j}.n: why" for i in range(2) for j in range(3)]
    assert grouped(every) == ["x b.{0..1}.l.{0..2}.n: why"]
    tied = [f"f layers.{i}.fc1 -> layers.{i}.fc2: y" for i in (0, 1, 2, 5)]
    assert grouped(tied) == ["f layers.{0..2,5}.fc1 -> layers.{0..2,5}.fc2: y"]
    partial = ["x b.0.l.0.n", "x b.1.l.1.n", "x b.1.l.0.n"]  # not every combination
    assert grouped(partial) == partial
