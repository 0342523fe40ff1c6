"""Fused models whose pickle the suite keeps (tests/fuse/data/fused_models.pkl): one of each
object fuse leaves in a model — a FusedSequential with its parts and an owner's region (the
write-up Net), a rewritten forward with a replayed count, a gated MLP with a Dropout, a run with
function calls between its Linears, a run through a Dropout and a mixed run with a member class
made at run time, a crossed forward with a guard and a forward with an argument tested against
None. The pickle holds each fused model beside an unfused copy; test_fuse_pickles.py loads it
and checks that every model still computes what the copy computes, fused.

    python tests/fuse/_pickled_models.py     # writes the pickle with the ckpt_ext of this tree
"""
from __future__ import annotations

import copy
import os
import pickle
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

PICKLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "fused_models.pkl")


class Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.w = nn.Linear(6, 8), nn.Parameter(torch.randn(5, 8) / 3)
        self.nfe = 0

    def forward(self, x):
        self.nfe += 1
        return torch.tanh(F.linear(torch.tanh(self.lin(x)), self.w))


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(6, 10), nn.Linear(6, 10), nn.Linear(10, 6)
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        return self.w2(self.drop(F.silu(self.w1(x)) * self.w3(x)))


class Inline(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 12), nn.Linear(12, 6)
        self.p = 0.0

    def forward(self, x):
        return self.fc2(F.dropout(F.relu(self.fc1(x)), p=self.p, training=self.training))


class Up(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act = nn.Linear(6, 9), nn.GELU()
        self.double_it = False

    def forward(self, x):
        h = self.act(self.fc(x))
        return h * 2 if self.double_it else h


class Crossed(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = Up(), nn.Linear(9, 6)
        self.mixed = nn.Sequential(nn.Linear(6, 7), nn.SiLU(), nn.Dropout(0.0), nn.Linear(7, 5),
                                   nn.ReLU(), nn.Linear(5, 3))

    def forward(self, x):
        return self.mixed(x + self.down(self.up(x)))


class Optional_(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6)

    def forward(self, x, scale=None):
        h = self.fc2(self.act(self.fc1(x)))
        if scale is not None:
            h = h + 1
        return h


def models() -> List[Tuple[str, nn.Module, Dict]]:
    """(name, unfused model in float64, fuse's keyword arguments)."""
    from ckpt_ext.models import Net

    torch.manual_seed(0)
    return [("writeup-net", Net(in_features=6, hidden=8, depth=3, mode="plain",
                                dtype=torch.float64), {}),
            ("rewritten-count", Counted().double(), {"rewrite": True}),
            ("gated", Gated().double(), {}),
            ("inline", Inline().double(), {}),
            ("crossed-mixed", Crossed().double(), {}),
            ("optional-argument", Optional_().double(), {})]


def inputs(name: str) -> Tuple:
    x = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return (x, torch.ones(1, dtype=torch.float64)) if name == "optional-argument" else (x,)


def write() -> None:
    import ckpt_ext

    out = []
    for name, model, kwargs in models():
        plain = copy.deepcopy(model)
        _, report = ckpt_ext.fuse(model, **kwargs)
        assert len(report.fused) >= 1, (name, str(report))
        out.append((name, plain, model, len(report.fused)))
    with open(PICKLE, "wb") as f:
        pickle.dump(out, f, protocol=4)


if __name__ == "__main__":
    write()
