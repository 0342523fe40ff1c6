"""fuse under FSDP2 (``fully_shard``), on 2 gloo ranks on the CPU, at each granularity a user
shards at: per decoder layer and per MLP every unit's every call is fused; per Linear each unit
computes unfused, exactly, and warns once with the fix; accelerate's FSDP2 preparation by the
decoder layer's class and by "Linear" does the same; fuse after fully_shard changes nothing and
says why. Gradients everywhere equal the single-process unfused model's on the whole batch.

One launch of two ranks (_ranks.py) runs every case in each rank, on the tiny peft LoRA Llama of _lora_models in
float64; the tests read its results. Docs: docs/fuse-usage.md, "Distributed training".
"""
from __future__ import annotations

import os
import sys
import traceback
import types
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _ranks import WORLD, finish, spawn

from reference import measured

pytest.importorskip("peft")
pytest.importorskip("transformers")
try:
    from torch.distributed.fsdp import FSDPModule, fully_shard
except ImportError as e:  # the reason, not a silent pass
    pytest.skip(f"FSDP2 fully_shard is not available in torch {torch.__version__}: {e}",
                allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
CASES = ("layer", "mlp", "linear", "accelerate-layer", "accelerate-mlp", "accelerate-linear")
# where each unit's calls are fused; per Linear (by hand or accelerate's "Linear") they fall back
FUSED = {"layer": True, "mlp": True, "linear": False, "accelerate-layer": True,
         "accelerate-mlp": True, "accelerate-linear": False}
STEPS = 2  # the second step shows the warning is given once per unit


def _model():
    sys.path[:0] = [HERE, os.path.dirname(HERE)]
    import _lora_models as lm
    return lm.with_lora(lm.llama(torch.float64))


def _batch():
    torch.manual_seed(1)
    return torch.randint(1, 50, (8, 9)), torch.randn(8, 9, 64, dtype=torch.float64)


def _loss(model, x, target):
    return nn.functional.mse_loss(model(x).last_hidden_state, target)


def _accelerate(model, wrap: str):
    """accelerate's FSDP2 preparation (what Accelerator.prepare calls), wrapping by class name."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=[wrap], cpu_ram_efficient_loading=False)
    accelerator = types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin),
                                        mixed_precision="no", torch_device_mesh=None,
                                        is_main_process=True, device=torch.device("cpu"))
    return fsdp2_prepare_model(accelerator, model)


def _shard(model, case: str):
    layers = model.base_model.model.layers
    if case.startswith("accelerate"):
        return _accelerate(model, {"accelerate-layer": "LlamaDecoderLayer",
                                   "accelerate-mlp": "LlamaMLP"}.get(case, "Linear"))
    for layer in layers:
        if case == "layer":
            fully_shard(layer)
        elif case == "mlp":
            fully_shard(layer.mlp)
        else:
            for name in MLP_LINEARS:
                fully_shard(getattr(layer.mlp, name))
    fully_shard(model)
    return model


def _run_case(case: str, rank: int, ref: dict, x, target) -> dict:
    import ckpt_ext
    model, report = ckpt_ext.fuse(_model())
    assert len(report) == 2, str(report)  # one unit per MLP
    model = _shard(model, case)
    shard = slice(rank * 4, rank * 4 + 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # each unit's own once-only is what is counted
        for _ in range(STEPS):
            model.zero_grad()
            _loss(model, x[shard], target[shard]).backward()
    errs = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            g = p.grad.full_tensor()  # gather the sharded gradient
            errs[n] = ((g - ref[n]).norm() / ref[n].norm()).item()
    return {"rel_errs": errs,
            "wrapped": sorted({type(m).__name__ for m in model.modules()
                               if isinstance(m, FSDPModule)}),
            "stats": [{"path": s.path, "fused": s.fused_calls, "unfused": s.unfused_calls,
                       "reasons": s.reasons} for s in ckpt_ext.stats(model)],
            "warnings": [str(w.message) for w in caught
                         if issubclass(w.category, ckpt_ext.FallbackWarning)]}


def _after_sharding() -> dict:
    """fuse on a model fully_shard has sharded (per decoder layer and the root)."""
    import ckpt_ext
    model = _model()
    for layer in model.base_model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    _, report = ckpt_ext.fuse(model)
    return {"units": len(report), "text": str(report), "not_analysed": report.not_analysed,
            "other_layers": report.other_layers,
            "changed": sorted({type(m).__name__ for m in model.modules()
                               if type(m).__name__.startswith(("Run", "Fused"))})}


def _rank_main(rank: int, store_file: str, out_dir: str) -> None:
    result = {"rank": rank}
    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank,
                                world_size=WORLD)
        x, target = _batch()
        plain = _model()
        _loss(plain, x, target).backward()  # the unfused model on the whole batch, one process
        ref = {n: p.grad.clone() for n, p in plain.named_parameters() if p.requires_grad}
        for case in CASES:
            result[case] = _run_case(case, rank, ref, x, target)
        result["after"] = _after_sharding()
        result["ok"] = True
    except Exception:  # reported to the test process, which fails with it
        result["ok"] = False
        result["error"] = traceback.format_exc()
    finish(result, out_dir, rank)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("accelerate")
    return spawn(_rank_main, tmp_path_factory.mktemp("fsdp2"))


# float64; the all-reduced half-batch gradients differ from the full-batch ones by the order of
# their sums only (test_distributed.py's bound). Measured max over the 28 LoRA weights: 5.0e-16
# (per layer, per MLP, accelerate by either), 3.3e-16 (per Linear, fused nowhere); fixed seeds.
TOL_GRADS = 2e-15


@pytest.mark.parametrize("case", CASES)
def test_gradients_equal_unfused(ranks, case):
    for r in ranks:
        errs = r[case]["rel_errs"]
        assert len(errs) == 28, sorted(errs)
        for name, err in errs.items():
            assert measured(f"distributed/fsdp2-{case}", err) <= TOL_GRADS, (r["rank"], name, err)


@pytest.mark.parametrize("case", [c for c in CASES if FUSED[c]])
def test_per_layer_and_mlp_every_call_fused(ranks, case):
    for r in ranks:
        stats, caught = r[case]["stats"], r[case]["warnings"]
        assert [s["path"] for s in stats] == [f"base_model.model.layers.{i}.mlp" for i in (0, 1)]
        for s in stats:
            assert (s["fused"], s["unfused"], s["reasons"]) == (STEPS, 0, {}), s
        assert not caught, caught


@pytest.mark.parametrize("case", [c for c in CASES if not FUSED[c]])
def test_per_linear_warns_once_per_unit_with_the_fix(ranks, case):
    for r in ranks:
        assert "FSDPRunLoraLinear" in r[case]["wrapped"], r[case]["wrapped"]
        stats, caught = r[case]["stats"], r[case]["warnings"]
        assert len(caught) == len(stats) == 2, caught
        for i, (s, message) in enumerate(zip(stats, caught)):
            unit = f"base_model.model.layers.{i}.mlp"
            reason = f"{unit}.gate_proj has hooks"
            assert s["path"] == unit and (s["fused"], s["unfused"]) == (0, STEPS), s
            assert [k for k in s["reasons"] if k.startswith(reason)] == list(s["reasons"]), s
            assert unit in message and reason in message, message
            assert "Fix: shard per decoder layer or per MLP" in message, message
            assert "fsdp_transformer_layer_cls_to_wrap" in message, message


def test_fuse_after_fully_shard_says_why(ranks):
    for r in ranks:
        after = r["after"]
        assert after["units"] == 0 and after["changed"] == [], after
        assert [path for path, _ in after["not_analysed"]] == [""], after["not_analysed"]
        why = after["not_analysed"][0][1]
        assert "sharded by FSDP2" in why and "fuse before sharding" in why, why
        assert len(after["other_layers"]) == 14  # 7 LoRA Linears per layer, each says why
        assert all(reason == why for _, reason in after["other_layers"]), after["other_layers"]
        assert "trace=False" not in after["text"], after["text"]


def test_accelerate_linear_wrap_with_every_linear_a_member():
    """accelerate finds the class to wrap by its name among the model's modules: where fuse made
    every Linear a unit's member (RunLinear), no module's class is named Linear."""
    pytest.importorskip("accelerate")
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    import ckpt_ext

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)

        def forward(self, x):
            return self.fc2(self.act(self.fc1(x)))

    model, report = ckpt_ext.fuse(MLP())
    assert len(report) == 1 and type(model.fc1).__name__ == "RunLinear", str(report)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Linear"], cpu_ram_efficient_loading=False)
    with pytest.raises(ValueError, match="Could not find the transformer layer class Linear"):
        fsdp2_prepare_auto_wrap_policy(plugin, model)
    plugin.transformer_cls_names_to_wrap = ["MLP"]  # the class holding the unit: found
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    assert policy(model) and not policy(model.fc1)
