"""``CkptExtCallback`` in transformers' Trainer and TRL's trainers (tiny Llama from a local config,
a word-level tokenizer made in memory, nothing downloaded): every unit fused on every step, the
trainer's checkpointing as the callback decided, losses and weights as without the callback; the
budget form plans on the trainer's own step and holds as measured inside ``train()``."""
from __future__ import annotations

import os
import warnings

import pytest
import torch

import ckpt_ext
from ckpt_ext import FallbackWarning
import _lora_models as lm

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")
from ckpt_ext.integrations.transformers import CkptExtCallback  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
VOCAB, STEPS = 50, 3


pytestmark = pytest.mark.usefixtures("one_thread")


def causal_lm(dtype=torch.float32, layers=2):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=128, use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def tokenizer():
    vocab = tokenizers.models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")
    tok = tokenizers.Tokenizer(vocab)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0",
                                                eos_token="t1", bos_token="t2")


def ids_data(rows=2 * STEPS, seq=16):
    return datasets.Dataset.from_dict({"input_ids": lm.ids(rows, seq).tolist()})


def lora_config(dropout=0.0):
    from peft import LoraConfig
    return LoraConfig(r=8, lora_alpha=16, target_modules=list(lm.LLAMA_TARGETS),
                      lora_dropout=dropout, init_lora_weights=False)


COMMON = dict(per_device_train_batch_size=2, max_steps=STEPS, report_to=[], use_cpu=True,
              save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0, data_seed=0)


def sft(model, tmp_path, callbacks=(), peft_config=None, **args):
    from trl import SFTConfig, SFTTrainer
    cfg = SFTConfig(output_dir=str(tmp_path), bf16=False, **COMMON, **args)
    return SFTTrainer(model=model, args=cfg, processing_class=tokenizer(),
                      train_dataset=ids_data(), peft_config=peft_config,
                      callbacks=list(callbacks))


def trainer(model, tmp_path, callbacks=(), **args):
    data = ids_data().map(lambda r: {"labels": r["input_ids"]})
    cfg = transformers.TrainingArguments(output_dir=str(tmp_path), **COMMON, **args)
    return transformers.Trainer(model=model, args=cfg, train_dataset=data,
                                callbacks=list(callbacks))


def losses(t):
    return [h["loss"] for h in t.state.log_history if "loss" in h]


def trained(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def run(make, tmp_path, callback=None):
    """(losses, trained weights, the FallbackWarnings) of one train()."""
    t = make([callback] if callback is not None else [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.train()
    ours = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    return t, losses(t), trained(t.model), ours


def assert_every_step_fused(cb, units, steps=STEPS):
    stats = ckpt_ext.stats(cb._model)
    assert len(cb.report) == units and len(stats) == units, str(cb.report)
    assert [(s.fused_calls, s.unfused_calls, s.recomputed_calls) for s in stats] == \
        [(steps, 0, 0)] * units, str(stats)


def assert_close_losses(a, b, rel=1e-5):
    assert len(a) == len(b) == STEPS
    for x, y in zip(a, b):
        assert abs(x - y) <= rel * abs(y), (a, b)


# ---- no budget: fuse every unit, checkpointing off --------------------------------------------

def test_sft_with_peft_config(tmp_path):
    pytest.importorskip("trl")
    base, with_cb = [], []
    _, base, _, _ = run(lambda cbs: sft(causal_lm(), tmp_path / "a", cbs,
                                       peft_config=lora_config()), tmp_path)
    cb = CkptExtCallback()
    t, with_cb, _, ours = run(lambda cbs: sft(causal_lm(), tmp_path / "b", cbs,
                                             peft_config=lora_config()), tmp_path, cb)
    assert ours == [], ours
    assert_every_step_fused(cb, 2)
    assert cb.plan is None and t.args.activation_checkpointing is False
    assert not t.model.is_gradient_checkpointing
    assert_close_losses(with_cb, base)


def test_sft_with_a_prepared_peft_model_float64_weights(tmp_path):
    pytest.importorskip("trl")
    from peft import get_peft_model

    def make(cbs, sub):
        return sft(get_peft_model(causal_lm(torch.float64), lora_config()), tmp_path / sub, cbs)
    _, base, w_base, _ = run(lambda cbs: make(cbs, "a"), tmp_path)
    cb = CkptExtCallback()
    _, got, w_got, ours = run(lambda cbs: make(cbs, "b"), tmp_path, cb)
    assert ours == []
    assert_every_step_fused(cb, 2)
    assert w_base.keys() == w_got.keys() and len(w_base) == 28
    for k in w_base:
        err = (w_got[k] - w_base[k]).abs().max() / w_base[k].abs().max()
        assert err <= 1e-12, (k, err.item())
    assert_close_losses(got, base, 1e-12)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_trainer(tmp_path, lora):
    from peft import get_peft_model

    def make(cbs, sub):
        model = causal_lm(torch.float64)
        return trainer(get_peft_model(model, lora_config()) if lora else model, tmp_path / sub,
                       cbs, activation_checkpointing=True)
    _, base, w_base, _ = run(lambda cbs: make(cbs, "a"), tmp_path)
    cb = CkptExtCallback()
    t, got, w_got, ours = run(lambda cbs: make(cbs, "b"), tmp_path, cb)
    assert ours == [] and t.args.activation_checkpointing is False
    assert_every_step_fused(cb, 2)
    for k in w_base:
        err = (w_got[k] - w_base[k]).abs().max() / w_base[k].abs().max()
        assert err <= 1e-12, (k, err.item())


def test_keep_checkpointing_says_recomputed_twice(tmp_path):
    pytest.importorskip("trl")
    cb = CkptExtCallback(keep_checkpointing=True)
    t, _, _, ours = run(lambda cbs: sft(causal_lm(), tmp_path, cbs, peft_config=lora_config()),
                        tmp_path, cb)
    assert t.args.activation_checkpointing is True
    assert "recomputed twice: base_model.model.model.layers.{0..1} runs under" in str(cb.report), str(cb.report)
    stats = ckpt_ext.stats(cb._model)
    assert stats.unfused_calls == 0 and stats.recomputed_calls == stats.fused_calls > 0
    # the per-unit warnings say it; the callback, asked to keep it, adds nothing
    assert len(ours) == 2 and all("recomputed twice" in m for m in ours), ours


def test_qlora(tmp_path):
    # QLoRA: 4-bit bases (bitsandbytes' CPU backend), LoRA terms, SFT's defaults but the callback
    pytest.importorskip("trl")
    pytest.importorskip("bitsandbytes")

    def make(cbs, sub):
        model = lm.four_bit(causal_lm(), skip=["lm_head"])
        return sft(model, tmp_path / sub, cbs, peft_config=lora_config())
    _, base, w_base, _ = run(lambda cbs: make(cbs, "a"), tmp_path)
    cb = CkptExtCallback()
    _, got, w_got, ours = run(lambda cbs: make(cbs, "b"), tmp_path, cb)
    assert ours == [], ours
    assert_every_step_fused(cb, 2)
    assert_close_losses(got, base)
    for k in w_base:
        err = (w_got[k] - w_base[k]).abs().max() / w_base[k].abs().max()
        assert err <= 1e-5, (k, err.item())


def test_dpo(tmp_path):
    trl = pytest.importorskip("trl")
    from peft import get_peft_model
    rows = {"prompt": ["t3 t4 t5", "t6 t7 t8", "t9 t10 t11", "t12 t13 t14"] * 2,
            "chosen": [" t20 t21", " t22 t23", " t24 t25", " t26 t27"] * 2,
            "rejected": [" t30 t31", " t32 t33", " t34 t35", " t36 t37"] * 2}

    def make(cbs, sub):
        cfg = trl.DPOConfig(output_dir=str(tmp_path / sub), bf16=False, **COMMON)
        return trl.DPOTrainer(model=get_peft_model(causal_lm(torch.float64), lora_config()),
                              args=cfg, processing_class=tokenizer(),
                              train_dataset=datasets.Dataset.from_dict(rows),
                              callbacks=list(cbs))
    _, base, w_base, _ = run(lambda cbs: make(cbs, "a"), tmp_path)
    cb = CkptExtCallback()
    _, got, w_got, ours = run(lambda cbs: make(cbs, "b"), tmp_path, cb)
    assert ours == []
    stats = ckpt_ext.stats(cb._model)
    # DPO steps the policy and, adapters disabled, the reference: both through the units
    assert stats.unfused_calls == 0 and all(s.fused_calls >= STEPS for s in stats), str(stats)
    assert_close_losses(got, base, 1e-12)
    for k in w_base:
        err = (w_got[k] - w_base[k]).abs().max() / w_base[k].abs().max()
        assert err <= 1e-12, (k, err.item())


# ---- what it refuses ----------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "lots"])
def test_a_budget_must_be_bytes_or_auto(bad):
    with pytest.raises(ValueError, match="budget_bytes must be None, a positive int or \"auto\""):
        CkptExtCallback(bad)


def test_keep_checkpointing_takes_no_budget():
    with pytest.raises(ValueError, match="keep_checkpointing=True takes no budget_bytes"):
        CkptExtCallback(10**9, keep_checkpointing=True)


def test_auto_needs_cuda(tmp_path):
    cb = CkptExtCallback("auto")
    t = trainer(causal_lm(), tmp_path, [cb])
    with pytest.raises(ValueError, match="budget_bytes=\"auto\" reads a CUDA device's free memory"):
        t.train()


# ---- a budget: plan on the trainer's own step -----------------------------------------------------

class StepPeak(transformers.TrainerCallback):
    """The allocator's peak (exact bytes on the CPU) from the start of the first step to its
    optimizer step: the step's forward and backward as the trainer runs them."""

    def __init__(self):
        self.meter, self.peak = ckpt_ext.memory.MemoryMeter("cpu"), None

    def on_step_begin(self, args, state, control, **kw):
        if self.peak is None and state.global_step == 0:
            self.meter.start()
            self.meter.reset_peak()

    def on_pre_optimizer_step(self, args, state, control, **kw):
        if self.peak is None:
            self.peak = self.meter.peak()
            self.meter.stop()


def test_a_budget_plans_on_the_trainers_step_and_holds_inside_train(tmp_path):
    pytest.importorskip("trl")
    make = lambda cbs, sub: sft(causal_lm(layers=4), tmp_path / sub, cbs,  # noqa: E731
                                peft_config=lora_config(), optim="sgd")
    wide = CkptExtCallback(10**12)
    _, base, _, _ = run(lambda cbs: make(cbs, "a"), tmp_path, wide)
    assert wide.plan.added_flops == 0 and set(wide.plan.choices.values()) == {"none"}
    plain, least = wide.plan.plain_peak_bytes, wide.plan.least_peak_bytes
    assert least < plain
    budget = (plain + least) // 2
    cb, peak = CkptExtCallback(budget), StepPeak()
    t, got, _, ours = run(lambda cbs: make(cbs + [peak], "b"), tmp_path, cb)
    assert ours == [], ours
    assert cb.plan is not None and cb.plan.added_flops > 0 and cb.report is not None
    assert t.args.activation_checkpointing is False
    assert peak.peak <= budget, (peak.peak, budget)
    assert abs(peak.peak - cb.plan.peak_bytes) <= 0.05 * cb.plan.peak_bytes, \
        (peak.peak, cb.plan.peak_bytes)
    assert_close_losses(got, base)
    fused = [p for p, c in cb.plan.choices.items() if c == "fuse"]
    stats = ckpt_ext.stats(cb._model)
    assert stats.unfused_calls == 0 and len(stats) == len(fused), (str(stats), cb.plan.choices)


def test_a_budget_below_the_least_plan_raises_before_training_changes_anything(tmp_path):
    pytest.importorskip("trl")
    cb = CkptExtCallback(1000)
    t = sft(causal_lm(), tmp_path, [cb], peft_config=lora_config())
    before = trained(t.model)
    with pytest.raises(ValueError, match="budget"):
        t.train()
    assert t.state.global_step == 0
    after = trained(t.model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert ckpt_ext.stats(t.model) == [] or not len(ckpt_ext.stats(t.model))


class _SwitchesCheckpointingOn(transformers.TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, **kw):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def test_checkpointing_switched_on_again_is_said_after_the_first_step(tmp_path):
    cb = CkptExtCallback()
    _, _, _, ours = run(lambda cbs: trainer(causal_lm(), tmp_path, cbs + [_SwitchesCheckpointingOn()]),
                        tmp_path, cb)
    after = [m for m in ours if m.startswith("ckpt_ext.CkptExtCallback, after the first step")]
    assert len(after) == 1 and "switched on again after the callback switched it off" in after[0], ours
    assert sum("recomputed twice" in m for m in ours) == 2  # and each unit said it at its call


def test_added_after_the_trainer_was_built_it_says_so(tmp_path):
    t = trainer(causal_lm(), tmp_path)
    t.add_callback(CkptExtCallback())
    with pytest.raises(RuntimeError, match="added after the Trainer was built"):
        t.train()
    assert t.state.global_step == 0
