"""Observers do not undo fusing: while torch's own observing module hooks are registered for
every module (``torch.utils.module_tracker.ModuleTracker``, the one ``FlopCounterMode`` uses, and
``torch.distributed._tools.mod_tracker.ModTracker`` with ``MemTracker``'s hooks), a fused run is
computed fused, so FLOPs and memory counted with torch's tools are the fused model's; any other
hook registered for every module still makes it compute member by member."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.module_tracker import ModuleTracker

import ckpt_ext
from ckpt_ext._observers import foreign_global_hooks

from _ecosys import saved_activation_bytes

transformers = pytest.importorskip("transformers")

ROWS = 2 * 16


def _mlp_model():
    """Two transformers LlamaMLPs (a gated MLP each) in a tiny Llama's decoder."""
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=88,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaModel(cfg)


IDS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


def _step_flops(model) -> int:
    with FlopCounterMode(display=False) as counter:
        model(IDS, use_cache=False).last_hidden_state.sum().backward()
    return counter.get_total_flops()


def test_flop_counter_counts_the_fused_model():
    plain = _mlp_model()
    fused, report = ckpt_ext.fuse(copy.deepcopy(plain))
    assert len(report.fused) == 2
    added = sum(d.flops_per_row for d in report.fused) * ROWS
    assert _step_flops(fused) - _step_flops(plain) == added


@pytest.mark.parametrize("tracker", ["ModuleTracker", "FlopCounterMode", "MemTracker"])
def test_torch_trackers_leave_runs_fused(tracker):
    plain = _mlp_model()
    fused = ckpt_ext.fuse(copy.deepcopy(plain))[0]
    bare = saved_activation_bytes(fused, IDS)
    assert bare < saved_activation_bytes(plain, IDS)
    if tracker == "ModuleTracker":
        context = ModuleTracker()
    elif tracker == "FlopCounterMode":
        context = FlopCounterMode(display=False)
    else:
        if not torch.distributed.is_available():
            pytest.skip("this torch build has no torch.distributed")
        from torch.distributed._tools.mem_tracker import MemTracker
        context = MemTracker()
    with context:
        assert foreign_global_hooks() is None
        assert saved_activation_bytes(fused, IDS) == bare


class _ActingTracker(ModuleTracker):
    """A ModuleTracker whose hook may do anything: not torch's observer."""

    def _fw_pre_hook(self, mod, input):
        super()._fw_pre_hook(mod, input)


def test_other_global_hooks_make_runs_fall_back():
    plain = _mlp_model()
    fused = ckpt_ext.fuse(copy.deepcopy(plain))[0]
    unfused_bytes = saved_activation_bytes(plain, IDS)
    handle = register_module_forward_hook(lambda m, i, o: None)
    try:
        with ModuleTracker():  # an observer beside it does not make it one
            assert "forward hook registered for every module" in foreign_global_hooks()
            assert saved_activation_bytes(fused, IDS) == unfused_bytes
    finally:
        handle.remove()
    with _ActingTracker():
        assert "_ActingTracker._fw_pre_hook" in foreign_global_hooks()
        assert saved_activation_bytes(fused, IDS) == unfused_bytes
    handle = register_module_forward_pre_hook(ModuleTracker()._fw_pre_hook)
    handle.remove()
    assert foreign_global_hooks() is None


def test_mod_tracker_with_hooks_of_its_user_is_not_an_observer():
    if not torch.distributed.is_available():
        pytest.skip("this torch build has no torch.distributed")
    from torch.distributed._tools.mod_tracker import ModTracker
    tracker = ModTracker()
    tracker.register_user_hooks(pre_fw_hook=lambda m, i: None)
    with tracker:
        assert foreign_global_hooks() is not None
    with ModTracker():
        assert foreign_global_hooks() is None
