"""Bad input to a fused model raises what the unfused model raises: the same exception type (a
``RuntimeError`` from ``F.linear`` for a dtype mismatch or a wrong feature size), with the same
message."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ckpt_ext import fuse


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _models():
    torch.manual_seed(0)
    return {"sequential": nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)),
            "children": Block(),
            "pair": nn.Sequential(nn.Linear(8, 16), nn.SiLU())}


BAD = {"dtype": lambda: torch.randn(3, 8, dtype=torch.float64),
       "features": lambda: torch.randn(3, 5),
       "scalar": lambda: torch.tensor(1.0)}


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("name", ["sequential", "children", "pair"])
def test_bad_input_raises_as_unfused(name, bad):
    plain = _models()[name]
    model = copy.deepcopy(plain)
    _, report = fuse(model)
    assert report.fused
    x = BAD[bad]()
    with pytest.raises(Exception) as want:
        plain(x)
    with pytest.raises(Exception) as got:
        model(x)
    assert type(got.value) is type(want.value)
    assert str(got.value) == str(want.value)
