"""How often one ``fuse()`` switches between the files of ``ckpt_ext/convert/``: a
``sys.setprofile`` hook counts, at every Python call and return, a change of the innermost
convert/ file on the stack. The model holds one unit of each kind fuse makes without a rewrite
(a plain run in a Sequential, a run crossing two modules' forwards, a gated MLP, a run with
function calls between its Linears). A measure of how the converter's stages hand work on:
few switches mean each stage does its job in its own file.

    python scripts/convert_switches.py        # prints the count and the busiest file pairs
"""
from __future__ import annotations

import collections
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import ckpt_ext

CONVERT = os.path.join(os.path.dirname(os.path.abspath(ckpt_ext.__file__)), "convert", "")


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


if __name__ == "__main__":
    torch.manual_seed(0)
    model = FourKinds()
    out = {}
    n, pairs = count_switches(lambda: out.setdefault("r", ckpt_ext.fuse(model)))
    report = out["r"].report
    print(report)
    print(f"\n{len(report.fused)} units fused; {n} switches between convert/ files")
    for (a, b), k in pairs.most_common(12):
        print(f"  {k:5d}  {a} -> {b}")
