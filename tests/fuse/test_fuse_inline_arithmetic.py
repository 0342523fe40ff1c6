"""Activations written as arithmetic inside a forward, between child Linears
(``_activation_arithmetic.written_after``, read by ``facts.node_facts``): an inline run, and with
``rewrite=True`` a rewritten forward, computing what an unfused deep copy computes (float64),
counted by ``ckpt_ext.stats``, freeing the report's figure by the allocator's meter; a rounded
constant is no activation."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import ckpt_ext
from ckpt_ext import fuse
from test_fuse_activation_arithmetic import F64, assert_claims_what_it_frees, assert_same


class WrittenInForward(nn.Module):
    """Activations written as arithmetic between child Linears, in the forward itself."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 16), nn.Linear(16, 12), nn.Linear(12, 3)

    def forward(self, x):
        h = self.fc1(x)
        h = self.fc2(h * torch.sigmoid(h))
        return self.fc3(0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) *
                                                     (h + 0.044715 * torch.pow(h, 3.0)))))


class RoundedInForward(WrittenInForward):
    def forward(self, x):
        h = self.fc2(self.fc1(x))
        return self.fc3(h * 0.5 * (1 + torch.tanh(0.79788456 * h * (1 + 0.044715 * h * h))))


# What stock autograd keeps per row that the unit does not: x * sigmoid(x) keeps x, sigmoid(x) and
# its output (fc2's input), 16 wide; the tanh GELU's formula keeps h, 0.5 * h, the tanh, 1 + tanh
# and its output, 12 wide: float64.
FORMULAS_KEEP = (3 * 16 + 5 * 12) * 8
FORM = "0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))"


@pytest.mark.parametrize("rewrite", [False, True], ids=["inline", "rewrite"])
def test_written_in_a_forward_is_fused(rewrite):
    """Several nodes computing a row from one Linear's output alone, holding all its uses, are
    that activation: the run's function calls, run on a zero-width placeholder (inline), or
    erased with the Linears from the rewritten forward. The figure counts what the formula keeps,
    as the allocator measures it."""
    torch.manual_seed(0)
    model = WrittenInForward().double()
    before = copy.deepcopy(model)
    _, report = fuse(model, rewrite=rewrite)
    (d,) = report.fused
    assert d.layers == ("fc1", "x * torch.sigmoid(x)", "fc2", FORM, "fc3")
    assert (d.activation, d.how) == ("silu, gelu_tanh", "rewrite" if rewrite else "children")
    assert d.bytes_per_row == FORMULAS_KEEP
    x = torch.randn(7, 6, dtype=F64)
    assert_same(before, model, x)
    if not rewrite:  # a rewritten forward calls the op itself
        (s,) = ckpt_ext.stats(model)
        assert (s.fused_calls, s.unfused_calls) == (1, 0)
    assert_claims_what_it_frees(before, model, x, d)


def test_written_in_a_forward_not_a_row_is_not_an_activation():
    _, report = fuse(RoundedInForward().double())
    assert len(report) == 0
