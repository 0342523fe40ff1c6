"""DeepSpeed ZeRO on CPU: 2 gloo ranks (DS_ACCELERATOR=cpu), launched by the test itself.

``fuse`` before ``deepspeed.initialize`` marks each unit's owner a ZeRO-3 leaf module, so ZeRO-3
gathers the unit's weights at its owner and hooks none of its members: every call of every unit
is fused (``ckpt_ext.stats``), and the gradients, averaged over the two half batches, equal
those of the unfused model on the whole batch in one process (float32: see TOL_GRADS). The same
for a model built under ``deepspeed.zero.Init``, whose weights are shape-[0] partitions at fuse
time: the report's figures are those of the whole model. The same for a mixture of experts
(Mixtral), whose experts module computes its own unit and is its own leaf. ZeRO-1/2 leave the
modules alone and stay fused. A unit whose owner the user keeps off the leaves falls back with
the fix; ``unfuse`` takes off the flags fuse set, and only those.

transformers' ``Trainer`` with a ZeRO-3 config, on a CPU: ``TrainingArguments(use_cpu=True,
deepspeed=...)`` makes accelerate's state MULTI_CPU over gloo (both ranks), and the Trainer's
``Accelerator``, given the DeepSpeed plugin, turns it to DEEPSPEED, so ``train()`` runs
``deepspeed.initialize`` on the fused model. (Without ``use_cpu`` accelerate finds no device
backend on a CPU and counts one process, and DeepSpeed's batch check refuses the config.) Each
step's loss and gradients equal the unfused model's whole-batch step in one process.

The launch of two ranks: _ranks.py.
"""
from __future__ import annotations

import copy
import importlib
import importlib.util
import os
import sys
import traceback
import warnings

import pytest
import torch

from _ranks import WORLD, finish, spawn

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed is not installed")

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where _ecosys.py is
BATCH, SEQ = 4, 9


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH // WORLD, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage}}


def _model(name: str):
    """The tiny Llama ("llama"), with peft LoRA ("lora"), or the tiny Mixtral ("moe"), float32."""
    import _lora_models as lm
    if name == "moe":
        import _zoo
        torch.manual_seed(0)
        return _zoo.make_moe("Mixtral", "eager")
    model = lm.llama(torch.float32)
    return lm.with_lora(model) if name == "lora" else model


def _figures(report) -> list:
    return [(d.layers, d.unit, d.bytes_per_row, d.flops_per_row) for d in report.decisions
            if d.action == "fused"]


def _step(deepspeed, ckpt_ext, model, stage: int, rank: int):
    """One step of ``model`` (fused before) under ZeRO-``stage`` on this rank's half batch: the
    full gradients by name, and the units' stats."""
    import _lora_models as lm
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, config=_config(stage),
                                      optimizer=torch.optim.SGD(params, lr=0.0))
    x = lm.ids(BATCH, SEQ)[rank * BATCH // WORLD:(rank + 1) * BATCH // WORLD]
    engine.backward(lm.output(engine(x)).square().mean())
    grads = {n: deepspeed.utils.safe_get_full_grad(p)
             for n, p in model.named_parameters() if p.requires_grad}
    return grads, ckpt_ext.stats(model)


def _reference(plain) -> dict:
    """The unfused model's gradients on the whole batch, in this process."""
    import _lora_models as lm
    plain.zero_grad()
    lm.output(plain(lm.ids(BATCH, SEQ))).square().mean().backward()
    return {n: p.grad for n, p in plain.named_parameters() if p.requires_grad}


def _compare(grads: dict, ref: dict) -> float:
    assert grads.keys() == ref.keys()
    return max(((g - ref[n]).norm() / ref[n].norm()).item() for n, g in grads.items())


def _case(deepspeed, ckpt_ext, rank: int, name: str, stage: int, under_init: bool) -> dict:
    plain = _model(name)
    whole = _figures(ckpt_ext.fuse(copy.deepcopy(plain), dry_run=True).report)
    if under_init:
        with deepspeed.zero.Init(config_dict_or_path=_config(stage)):  # float32: see TOL_GRADS
            model = _model(name)
        shapes = {tuple(p.shape) for p in model.parameters()}
        assert shapes == {(0,)}, shapes  # partitioned: each rank holds a flat share
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            if rank == 0:  # the reference's weights, which rank 0 scatters on leaving
                with torch.no_grad():
                    for (_, p), q in zip(model.named_parameters(), plain.parameters()):
                        p.copy_(q)
        with torch.no_grad():
            for b, c in zip(model.buffers(), plain.buffers()):
                b.copy_(c)
    else:
        model = copy.deepcopy(plain)
    model, report = ckpt_ext.fuse(model)
    owners = [m for m in model.modules() if vars(m).get("_z3_leaf")]
    grads, stats = _step(deepspeed, ckpt_ext, model, stage, rank)
    return {"figures": _figures(report) == whole, "units": len(report),
            "leaves": sorted(type(m).__name__ for m in owners),
            "calls": [(s.path, s.fused_calls, s.unfused_calls) for s in stats],
            "err": _compare(grads, _reference(plain))}


def _fallback(deepspeed, ckpt_ext, rank: int) -> dict:
    """One MLP kept off the leaves by the user after fuse: it computes unfused, with the fix;
    unfuse removes fuse's flags only."""
    model, _ = ckpt_ext.fuse(_model("lora"))
    mlps = [m for m in model.modules() if vars(m).get("_z3_leaf")]
    mlps[0]._z3_leaf = False  # the user's own decision: fuse's flag no longer
    vars(mlps[0]).pop("_ckpt_ext_z3_leaf")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, stats = _step(deepspeed, ckpt_ext, model, 3, rank)
    messages = [str(w.message) for w in caught if w.category is ckpt_ext.FallbackWarning]
    ckpt_ext.unfuse(model)
    return {"calls": [(s.path, s.fused_calls, s.unfused_calls) for s in stats],
            "warned": messages,
            "flags": [(vars(m).get("_z3_leaf"), "_ckpt_ext_z3_leaf" in vars(m)) for m in mlps]}


CASES = {"z3-fuse-first": ("llama", 3, False), "z3-fuse-first-lora": ("lora", 3, False),
         "z3-init": ("llama", 3, True), "z3-init-lora": ("lora", 3, True),
         "z1-lora": ("lora", 1, False), "z2": ("llama", 2, False),
         "z3-fuse-first-moe": ("moe", 3, False), "z3-init-moe": ("moe", 3, True)}


# -- transformers' Trainer -------------------------------------------------------------------------

LR, STEPS = 0.5, 2  # plain SGD, constant rate: the second step's weights are the first's update


def _trainer_config() -> dict:
    """A ZeRO-3 config as users give the Trainer: the sizes and clipping filled in by it."""
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 3}}


def _causal_lm(lora: bool):
    import transformers
    import _lora_models as lm
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(lm.llama(torch.float32).config)
    return lm.with_lora(model) if lora else model


def _reference_steps(plain, x) -> tuple:
    """(each step's loss, each step's gradients by name) of the unfused model on the whole batch,
    SGD as the Trainer's, in this process."""
    params = [p for p in plain.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR)
    losses, grads = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = plain(input_ids=x, labels=x).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in plain.named_parameters() if p.requires_grad})
        opt.step()
    return losses, grads


def _trainer_case(deepspeed, ckpt_ext, rank: int, lora: bool, out_dir: str) -> dict:
    """``STEPS`` steps of ``Trainer.train()`` on the fused model with a ZeRO-3 config: the units'
    stats on the model fused (the Trainer holds it in a DeepSpeedEngine), each step's gradients
    (taken as the engine steps) and loss against the unfused model's."""
    import transformers
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    import _lora_models as lm
    plain = _causal_lm(lora)
    x = lm.ids(BATCH, SEQ)
    ref_losses, ref_grads = _reference_steps(copy.deepcopy(plain), x)
    model, _ = ckpt_ext.fuse(plain)
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out_dir, f"trainer{rank}"), use_cpu=True,
        deepspeed=_trainer_config(), per_device_train_batch_size=BATCH // WORLD,
        max_steps=STEPS, optim="sgd", learning_rate=LR, lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=0.0, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args,
                                   train_dataset=[{"input_ids": r, "labels": r} for r in x])
    grads = []

    class Grads(transformers.TrainerCallback):
        """Each step's full gradients, taken when the engine steps (it zeroes them then)."""

        def on_train_begin(self, *args, **kwargs):
            engine = trainer.model_wrapped
            step = engine.step

            def recorded_step(*a, **k):
                grads.append({n: deepspeed.utils.safe_get_full_grad(p)
                              for n, p in model.named_parameters() if p.requires_grad})
                return step(*a, **k)
            engine.step = recorded_step

    trainer.add_callback(Grads())
    try:
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return {"engine": type(trainer.model_wrapped).__name__,
                "processes": trainer.accelerator.num_processes,
                "calls": [(s.path, s.fused_calls, s.unfused_calls) for s in
                          ckpt_ext.stats(model)],
                "err": [_compare(g, r) for g, r in zip(grads, ref_grads)],
                "steps": len(grads),
                "loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                "losses": losses}
    finally:  # the Trainer's global state, for whatever this process runs next
        unset_hf_deepspeed_config()
        AcceleratorState._reset_state(reset_partial_state=True)


TRAINER_CASES = {"trainer": False, "trainer-lora": True}


def _rank_main(rank: int, store_file: str, out_dir: str) -> None:
    import torch.distributed as dist
    result = {"rank": rank}
    try:
        # LOCAL_WORLD_SIZE as torchrun sets it: accelerate's MULTI_CPU state reads it
        os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), RANK=str(rank),
                          WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                          OMP_NUM_THREADS="1")
        torch.set_num_threads(1)
        sys.path[:0] = [HERE, os.path.join(HERE, "fuse")]
        dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank,
                                world_size=WORLD)
        # imported before zero.Init, which patches torch.Tensor.__new__ (torch._dynamo, imported
        # by transformers' generation code, refuses the patched one)
        for name in ("torch._dynamo", "transformers.models.llama.modeling_llama",
                     "transformers.models.mixtral.modeling_mixtral", "transformers.trainer",
                     "peft", "_zoo"):
            importlib.import_module(name)
        import deepspeed
        import ckpt_ext
        # the shared-memory all-reduce DeepSpeed compiles at its first use on a CPU: gloo's
        # collectives serve two ranks, without a compiler
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        result["cases"] = {name: _case(deepspeed, ckpt_ext, rank, *args)
                           for name, args in CASES.items()}
        result["fallback"] = _fallback(deepspeed, ckpt_ext, rank)
        result["trainer"] = {name: _trainer_case(deepspeed, ckpt_ext, rank, lora, out_dir)
                             for name, lora in TRAINER_CASES.items()}
        result["ok"] = True
    except Exception:  # reported to the test process, which fails with it
        result["ok"] = False
        result["error"] = traceback.format_exc()
    finish(result, out_dir, rank)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn(_rank_main, tmp_path_factory.mktemp("zero3"))


# float32, not float64: zero.Init takes only half, bfloat16 and float32 (and, passed dtype=, it
# keeps bfloat16 on a CPU), and ZeRO holds every gradient in a float32 partition. Relative norm
# error against the unfused float32 run in one process, measured max 4.6e-7 (ZeRO-1, LoRA) over
# all cases and ranks; ZeRO-3 2.4e-7 (4.0e-7 LoRA), the same with and without zero.Init.
TOL_GRADS = 1e-6


#: per model: each unit's path (of layer i) and the class of its owner, the leaf fuse marks
UNITS = {"llama": ("layers.{}.mlp", "LlamaMLP"),
         "lora": ("base_model.model.layers.{}.mlp", "LlamaMLP"),
         "moe": ("layers.{}.mlp.experts", "RunMixtralExperts")}  # fuse's class


@pytest.mark.parametrize("case", list(CASES))
def test_every_call_fused_and_exact(ranks, case):
    name, stage, _ = CASES[case]
    path, owner = UNITS[name]
    for r in ranks:
        c = r["cases"][case]
        assert c["units"] == 2, c  # one gated MLP, or one experts module, per decoder layer
        assert c["calls"] == [[path.format(i), 1, 0] for i in range(2)], c
        assert c["err"] < TOL_GRADS, c
        assert c["leaves"] == [owner] * 2, c  # the owners, and nothing else


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][2]])
def test_report_of_the_whole_model_under_zero_init(ranks, case):
    for r in ranks:
        assert r["cases"][case]["figures"], r["cases"][case]


def test_kept_off_the_leaves_falls_back_with_the_fix(ranks):
    for r in ranks:
        f = r["fallback"]
        assert [calls[1:] for calls in f["calls"]] == [[0, 1], [1, 0]], f
        assert any("call ckpt_ext.fuse before deepspeed.initialize" in m and
                   "set_z3_leaf_modules(model, [LlamaMLP])" in m for m in f["warned"]), f
        assert f["flags"] == [[False, False], [None, False]], f  # the user's flag stays


# The loss: the mean of the ranks' losses the Trainer logs against the whole batch's, float32:
# measured max 2.4e-7. The first step's gradients: 6.6e-7 (LoRA), within TOL_GRADS. The second
# step starts from weights the first step's rounding moved (SGD at LR): measured 2.3e-6 (LoRA,
# the smallest adapters, norm 1e-2), where in one process the unfused model on the two half
# batches already differs from the whole batch by 9e-7 and the fused from the unfused by 1.3e-6.
TOL_LOSS = 1e-5
TOL_GRADS_SECOND_STEP = 1e-5


@pytest.mark.parametrize("case", list(TRAINER_CASES))
def test_trainer_with_a_zero3_config_every_call_fused_and_exact(ranks, case):
    path = ("base_model.model.model.layers.{}.mlp" if TRAINER_CASES[case] else
            "model.layers.{}.mlp")
    for r in ranks:
        t = r["trainer"][case]
        assert t["engine"] == "DeepSpeedEngine" and t["processes"] == WORLD, t
        assert t["calls"] == [[path.format(i), STEPS, 0] for i in range(2)], t
        assert t["steps"] == len(t["err"]) == STEPS == 2, t
        assert t["err"][0] < TOL_GRADS and t["err"][1] < TOL_GRADS_SECOND_STEP, t
        assert t["loss_err"] < TOL_LOSS, t


_MARKS = """
import sys, torch
sys.path[:0] = [{here!r}, {fuse!r}]
import ckpt_ext, _lora_models as lm
def flagged(model):
    return sorted(p for p, m in model.named_modules() if "_z3_leaf" in vars(m))
model = lm.llama(torch.float32)
ckpt_ext.fuse(model)
print(flagged(model))
import deepspeed
ckpt_ext.fuse(model)
print(flagged(model))
ckpt_ext.unfuse(model)
print(flagged(model))
"""


def test_leaf_flags_only_where_deepspeed_is_imported():
    # a model that never meets DeepSpeed keeps its attributes; once it is imported, fuse flags
    # each unit's module, and unfuse takes the flags off
    import subprocess
    code = _MARKS.format(here=HERE, fuse=os.path.join(HERE, "fuse"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "DS_ACCELERATOR": "cpu"}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()[-3:]
    assert lines == ["[]", "['layers.0.mlp', 'layers.1.mlp']", "[]"], out.stdout[-2000:]
