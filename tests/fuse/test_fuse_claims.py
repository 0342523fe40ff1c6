"""Every figure the report claims is measured: over every model of the registry
(tests/fuse/_fuse_models.py), the report's freed bytes per row × rows equal the drop in bytes
autograd keeps for backward (saved-tensor hooks, distinct storages, parameters not counted),
within 1 %; a near miss's "would free" figure is measured by fusing that near miss too
(``policy="all"``, which fuses every pair) where that is the only difference."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ckpt_ext import fuse
from _ecosys import saved_activation_bytes
from _fuse_models import FUSE_KWARGS, MODELS


def _saved(model: nn.Module, inputs: tuple) -> int:
    torch.manual_seed(0)  # the same dropout masks in both runs
    return saved_activation_bytes(model, *inputs)


@pytest.mark.parametrize("policy", ["memory", "all"])
@pytest.mark.parametrize("name", list(MODELS))
def test_report_frees_what_it_claims(name, policy):
    plain, inputs, rows = MODELS[name]()
    fused = copy.deepcopy(plain)
    _, report = fuse(fused, policy=policy, **FUSE_KWARGS.get(name, {}))
    measured = _saved(plain, inputs) - _saved(fused, inputs)
    claimed = report.bytes_per_row * rows
    message = f"{name}: the report claims {claimed:,} B freed, measured {measured:,} B\n{report}"
    if any("maybe kept" in d.why for d in report.fused):
        # a pair whose consumer fuse could not see (policy='all'): it claims nothing for that
        # output, which may be freed too; never more than is freed
        assert claimed <= measured * 1.01, message
    else:
        assert abs(measured - claimed) <= 0.01 * max(abs(claimed), 1), message


def test_dropout_p0_between_relu_and_linear_is_inside_the_run():
    """Dropout(p=0) returns its input: the run goes through it, and the ReLU output, kept
    unfused by the ReLU and the next Linear, is freed."""
    plain, inputs, rows = MODELS["relu, dropout p=0, linear"]()
    fused = copy.deepcopy(plain)
    _, report = fuse(fused)
    assert len(report.fused) == 1 and "through 2 (Dropout(p=0.0))" in report.fused[0].why, report
    assert report.bytes_per_row == 256 * 4
    assert _saved(plain, inputs) - _saved(fused, inputs) == report.bytes_per_row * rows


@pytest.mark.parametrize("name", list(MODELS))
def test_near_miss_would_free_figure(name):
    """A near miss of policy='memory' that policy='all' fuses (a pair whose output its consumer
    keeps anyway, or may keep) claims there what the near miss said fusing it would free: the
    claims test above measures that figure with policy='all'. A near miss claims bytes outright
    only where its consumer's fate is unknown, and says so."""
    plain, _, _ = MODELS[name]()
    kwargs = FUSE_KWARGS.get(name, {})
    _, memory = fuse(copy.deepcopy(plain), dry_run=True, **kwargs)
    _, every = fuse(copy.deepcopy(plain), dry_run=True, policy="all", **kwargs)
    fused_all = {d.layers: d for d in every.fused}
    for d in memory.near_misses:
        if d.layers in fused_all and "free nothing" in d.why:
            assert fused_all[d.layers].bytes_per_row == 0, (d, fused_all[d.layers])
        if d.bytes_per_row:
            assert "only if that consumer does not keep it" in d.why, d.why


@pytest.mark.parametrize("name", list(MODELS))
def test_policy_all_never_frees_less_than_memory(name):
    """policy='all' fuses what 'memory' fuses (each run with its trailing activation) and the
    near misses: on every model of the registry it claims at least as many bytes."""
    plain, _, _ = MODELS[name]()
    kwargs = FUSE_KWARGS.get(name, {})
    _, memory = fuse(copy.deepcopy(plain), dry_run=True, **kwargs)
    _, every = fuse(copy.deepcopy(plain), dry_run=True, policy="all", **kwargs)
    assert every.bytes_per_row >= memory.bytes_per_row, f"{memory}\n{every}"
