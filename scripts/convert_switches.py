"""How often one ``fuse()`` switches between the files of ``ckpt_ext/convert/``: a
``sys.setprofile`` hook counts, at every Python call and return, a change of the innermost
convert/ file on the stack. Two models: one unit of each kind fuse makes without a rewrite (a
plain run in a Sequential, a run crossing two modules' forwards, a gated MLP, a run with function
calls between its Linears), and transformers' tiny Qwen2-MoE with peft LoRA on its shared experts'
Linears (a gated MLP of LoRA Linears and an experts unit per layer). Each is counted after a
warm-up ``fuse()`` of a copy, so one-time work (imports, caches) is not counted. A measure of how
the converter's stages hand work on: few switches mean each stage does its job in its own file.

    python scripts/convert_switches.py                            # the counts, busiest file pairs
    python scripts/convert_switches.py --write docs/converter.md  # the counts between its markers
"""
from __future__ import annotations

import collections
import copy
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import ckpt_ext

CONVERT = os.path.join(os.path.dirname(os.path.abspath(ckpt_ext.__file__)), "convert", "")
BEGIN = "<!-- switches:begin (python scripts/convert_switches.py --write docs/converter.md) -->"
END = "<!-- switches:end -->"


class Up(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act = nn.Linear(16, 32), nn.GELU()

    def forward(self, x):
        return self.act(self.fc(x))


class Down(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 16)

    def forward(self, h):
        return self.fc(h)


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(16, 24), nn.Linear(16, 24), nn.Linear(24, 16)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Inline(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class FourKinds(nn.Module):
    def __init__(self):
        super().__init__()
        self.plain = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))
        self.up, self.down = Up(), Down()
        self.gated, self.inline = Gated(), Inline()

    def forward(self, x):
        x = x + self.plain(x)
        x = x + self.down(self.up(x))
        x = x + self.gated(x)
        return x + self.inline(x)


def count_switches(fn):
    """(switches, Counter of (from, to) file pairs) while ``fn()`` runs."""
    switches = 0
    pairs = collections.Counter()
    last = [None]

    def innermost(frame):
        while frame is not None:
            f = frame.f_code.co_filename
            if f.startswith(CONVERT):
                return os.path.basename(f)
            frame = frame.f_back
        return None

    def hook(frame, event, arg):
        nonlocal switches
        if event not in ("call", "return"):
            return
        now = innermost(frame if event == "call" else frame.f_back) if event == "return" \
            else innermost(frame)
        if now != last[0]:
            if last[0] is not None and now is not None:
                switches += 1
                pairs[(last[0], now)] += 1
            last[0] = now if now is not None else last[0]

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return switches, pairs


def lora_experts() -> nn.Module:
    import peft
    import transformers
    config = transformers.Qwen2MoeConfig(
        vocab_size=50, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=32, num_experts_per_tok=2,
        moe_intermediate_size=32, num_experts=4, shared_expert_intermediate_size=32,
        use_cache=False)
    model = transformers.Qwen2MoeModel(config)
    return peft.get_peft_model(model, peft.LoraConfig(
        r=4, target_modules=["gate_proj", "up_proj", "down_proj"], init_lora_weights=False))


MODELS = {"one unit of each kind": FourKinds,
          "Qwen2-MoE, LoRA on its shared experts": lora_experts}


def measure(make):
    """(report, switches, pairs) of one fuse() of a fresh model, after a warm-up fuse()."""
    torch.manual_seed(0)
    model = make()
    ckpt_ext.fuse(copy.deepcopy(model))
    out = {}
    n, pairs = count_switches(lambda: out.setdefault("r", ckpt_ext.fuse(model)))
    return out["r"].report, n, pairs


def block(counts) -> str:
    """The markdown the docs hold between BEGIN and END."""
    rows = "\n".join(f"| {name} | {units} | {n} |" for name, (units, n) in counts.items())
    return (f"Python {sys.version_info[0]}.{sys.version_info[1]}, torch {torch.__version__.split('+')[0]}:\n\n"
            f"| model | units fused | switches |\n|---|---|---|\n{rows}")


def replace(text: str, new_block: str) -> str:
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise ValueError(f"the file needs the lines {BEGIN!r} and {END!r}")
    return text[:i + len(BEGIN)] + "\n" + new_block + "\n" + text[j:]


def counts():
    """{model: (units fused, switches)} for every model of MODELS."""
    out = {}
    for name, make in MODELS.items():
        report, n, _ = measure(make)
        out[name] = (len(report.fused), n)
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"]:
        path = sys.argv[2]
        with open(path) as f:
            text = f.read()
        with open(path, "w") as f:
            f.write(replace(text, block(counts())))
        sys.exit(0)
    for name, make in MODELS.items():
        report, n, pairs = measure(make)
        print(f"{name}: {len(report.fused)} units fused; {n} switches between convert/ files")
        for (a, b), k in pairs.most_common(12):
            print(f"  {k:5d}  {a} -> {b}")
