"""Never silent: a fused unit that computes unfused warns ``FallbackWarning`` once per unit and
reason (naming the unit, the reason and the fix) and ``ckpt_ext.stats`` counts it; calls without
gradients count nothing; transformers' checkpointing switched on after fuse is seen at the call.

Models: the tiny transformers Llama of _lora_models (two gated-MLP units, owners' forwards set by
fuse), a Sequential run (computed by the Sequential itself), a module whose forward reads an
attribute (a guard), and Mixtral's experts. Outputs and gradients are compared with an unfused
copy in float64 wherever a call falls back: falling back is exact."""
from __future__ import annotations

import copy
import functools
import pickle
import warnings

import pytest
import torch
from torch import nn

import ckpt_ext
from ckpt_ext import FallbackWarning
import _lora_models as lm

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


def _llama():
    plain = lm.llama(F64)
    fused = copy.deepcopy(plain)
    _, report = ckpt_ext.fuse(fused)
    assert len(report) == 2, str(report)
    return plain, fused


def _steps(model, x, n=3):
    """n training steps' forward and backward; the FallbackWarnings they gave, and the last
    output and gradients."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(n):
            model.zero_grad(set_to_none=True)
            out = lm.output(model(x))
            out.square().sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return [w for w in caught if issubclass(w.category, FallbackWarning)], out.detach(), grads


def _same(a, b):
    (_, out_a, grads_a), (_, out_b, grads_b) = a, b
    assert grads_a.keys() == grads_b.keys()
    assert (out_a - out_b).abs().max() <= 1e-12 * out_a.abs().max()
    for k in grads_a:
        assert (grads_a[k] - grads_b[k]).abs().max() <= 1e-12 * grads_a[k].abs().max(), k


def _by_path(model):
    return {s.path: s for s in ckpt_ext.stats(model)}


# ---- counted, and quiet where fused -------------------------------------------------------------

def test_fused_calls_are_counted_and_nothing_warns():
    plain, fused = _llama()
    x = lm.ids()
    got = _steps(fused, x)
    assert got[0] == []
    _same(_steps(plain, x), got)
    stats = ckpt_ext.stats(fused)
    assert [s.path for s in stats] == ["layers.0.mlp", "layers.1.mlp"]
    assert [(s.fused_calls, s.unfused_calls, s.recomputed_calls, s.reasons) for s in stats] == \
        [(3, 0, 0, {})] * 2
    assert stats.fused_calls == 6 and stats.unfused_calls == 0
    text = str(stats)
    assert "2 fused unit(s)" in text and "6 fused, 0 unfused" in text, text


def test_the_report_shows_the_calls_once_counted():
    plain = lm.llama(F64)
    model, report = ckpt_ext.fuse(plain)
    assert "ckpt_ext.stats" not in str(report)
    _steps(model, lm.ids(), n=2)
    assert "ckpt_ext.stats: 2 fused unit(s); calls with gradients recorded: 4 fused, 0 unfused" \
        in str(report), str(report)


def test_calls_without_gradients_count_nothing_and_do_not_warn():
    _, fused = _llama()
    fused.layers[0].mlp.up_proj.register_forward_hook(lambda *a: None)
    x = lm.ids()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            fused(x)
        with torch.inference_mode():
            fused(x)
    assert not [w for w in caught if issubclass(w.category, FallbackWarning)]
    assert [(s.fused_calls, s.unfused_calls) for s in ckpt_ext.stats(fused)] == [(0, 0)] * 2


# ---- each way a call falls back: warned once per unit and reason, counted, exact ------------------

def test_a_hook_on_a_member_warns_once_with_the_unit_reason_and_fix():
    plain, fused = _llama()
    for model in (plain, fused):
        model.layers[1].mlp.down_proj.register_forward_pre_hook(lambda *a: None)
    x = lm.ids()
    got = _steps(fused, x)
    _same(_steps(plain, x), got)
    (w,) = got[0]
    stats = _by_path(fused)
    reason = "layers.1.mlp.down_proj has hooks, which the fused run would not call"
    assert stats["layers.1.mlp"].reasons == {reason: 3}, stats["layers.1.mlp"]
    assert (stats["layers.1.mlp"].fused_calls, stats["layers.1.mlp"].unfused_calls) == (0, 3)
    assert (stats["layers.0.mlp"].fused_calls, stats["layers.0.mlp"].unfused_calls) == (3, 0)
    msg = str(w.message)
    assert msg.startswith("ckpt_ext: the fused unit layers.1.mlp (layers.1.mlp.gate_proj"), msg
    assert f"computed unfused: {reason}. Fix: a hook of your own" in msg, msg
    assert w.filename == __file__, w.filename  # points at the user's call
    assert reason in str(ckpt_ext.stats(fused))


def test_a_sequential_run_with_a_hook_warns_once():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 9), nn.Tanh(),
                          nn.Linear(9, 3)).double()
    fused = copy.deepcopy(plain)
    assert len(ckpt_ext.fuse(fused)[1]) == 1
    x = torch.randn(5, 6, dtype=F64)
    assert _steps(fused, x)[0] == []
    for model in (plain, fused):
        model[2].register_forward_hook(lambda *a: None)
    got = _steps(fused, x)
    _same(_steps(plain, x), got)
    assert len(got[0]) == 1 and "the fused unit <model> (0 -> 1 -> 2 -> 3 -> 4) computed " \
        "unfused: 2 has hooks" in str(got[0][0].message), [str(w.message) for w in got[0]]
    (s,) = ckpt_ext.stats(fused)
    assert (s.fused_calls, s.unfused_calls) == (3, 3)


def test_a_hook_for_every_module_warns_once_per_unit():
    plain, fused = _llama()
    x = lm.ids()
    handle = nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        got = _steps(fused, x, n=2)
        want = _steps(plain, x, n=2)
    finally:
        handle.remove()
    _same(want, got)
    assert len(got[0]) == 2
    for s in ckpt_ext.stats(fused):
        (reason, n), = s.reasons.items()
        assert n == 2 and reason.startswith("a forward hook registered for every module"), reason


class _Scaled(nn.Module):
    """An MLP whose forward reads ``self.scale``: fuse guards its value."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.scale = nn.Linear(6, 12), nn.Linear(12, 6), 1.0

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))) * self.scale


def test_an_attribute_the_forward_read_changed_is_counted_with_its_guard():
    torch.manual_seed(0)
    plain = _Scaled().double()
    fused = copy.deepcopy(plain)
    assert len(ckpt_ext.fuse(fused)[1]) == 1
    x = torch.randn(4, 6, dtype=F64)
    for model in (plain, fused):
        model.scale = 2.0
    got = _steps(fused, x)
    _same(_steps(plain, x), got)
    (s,) = ckpt_ext.stats(fused)
    (reason, n), = s.reasons.items()
    assert n == 3 and s.fused_calls == 0, s
    assert reason.startswith("<model>.forward read scale = 1.0 when fuse analysed it"), reason
    assert len(got[0]) == 1


def test_a_forward_patched_as_a_closure_over_the_class_method_is_counted():
    # A trainer that wraps the owner's forward by the class's method, not by the module's own
    # forward (fuse's): the members are called with no region marked.
    plain, fused = _llama()
    for model in (plain, fused):
        mlp = model.layers[0].mlp
        mlp.forward = functools.wraps(type(mlp).forward)(
            functools.partial(type(mlp).forward, mlp))
    x = lm.ids()
    got = _steps(fused, x)
    _same(_steps(plain, x), got)
    s = _by_path(fused)["layers.0.mlp"]
    (reason, n), = s.reasons.items()
    assert n == 3 and s.fused_calls == 0
    assert reason.startswith("layers.0.mlp's forward is no longer the one fuse set on it"), reason
    assert "Fix: call ckpt_ext.fuse after what patches the forward" in str(got[0][0].message)


def test_the_experts_falling_back_are_counted():
    from _zoo import make_moe
    torch.manual_seed(0)
    plain = make_moe("Mixtral", "eager").double()
    fused = copy.deepcopy(plain)
    ckpt_ext.fuse(fused)
    x = torch.randint(1, 50, (2, 5))
    assert _steps(fused, x, n=1)[0] == []
    experts = [s for s in ckpt_ext.stats(fused) if s.path.endswith("experts")]
    assert experts and all((s.fused_calls, s.unfused_calls) == (1, 0) for s in experts)
    for model in (plain, fused):
        for m in model.modules():
            if hasattr(m, "_is_expert_parallel"):
                m._is_expert_parallel = True
    got = _steps(fused, x, n=2)
    _same(_steps(plain, x, n=2), got)
    experts = [s for s in ckpt_ext.stats(fused) if s.path.endswith("experts")]
    assert len(got[0]) == len(experts)
    for s in experts:
        (reason, n), = s.reasons.items()
        assert n == 2 and "computes expert parallel" in reason, reason


# ---- transformers' checkpointing switched on after fuse -----------------------------------------

def test_checkpointing_switched_on_after_fuse_is_seen_at_the_call():
    plain, fused = _llama()
    x = lm.ids()
    for model in (plain, fused):
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    got = _steps(fused, x, n=2)
    _same(_steps(plain, x, n=2), got)
    assert len(got[0]) == 2, [str(w.message) for w in got[0]]
    msg = str(got[0][0].message)
    assert "layers.0.mlp" in msg and "is recomputed twice: layers.0 runs under transformers' " \
        "gradient checkpointing" in msg and "activation_checkpointing=False" in msg, msg
    # each step calls the unit twice (forward, and the recompute in backward), both fused
    assert [(s.fused_calls, s.recomputed_calls, s.unfused_calls) for s in
            ckpt_ext.stats(fused)] == [(4, 4, 0)] * 2
    fused.gradient_checkpointing_disable()
    assert _steps(fused, x, n=1)[0] == []
    assert [(s.fused_calls, s.recomputed_calls) for s in ckpt_ext.stats(fused)] == [(5, 4)] * 2


def _trainer(model, tmp_path, **args):
    import transformers as t
    from datasets import Dataset
    ids = lm.ids(4, 16)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    cfg = t.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                              max_steps=2, report_to=[], use_cpu=True, save_strategy="no",
                              logging_strategy="no", disable_tqdm=True, **args)
    return t.Trainer(model=model, args=cfg, train_dataset=data)


def _causal_lm():
    import transformers as t
    cfg = t.LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=128, use_cache=False)
    torch.manual_seed(0)
    model = t.LlamaForCausalLM(cfg)
    assert len(ckpt_ext.fuse(model)[1]) == 2
    return model


@pytest.mark.parametrize("checkpointing", [True, False])
def test_the_trainer_switching_checkpointing_on_in_train_is_seen(tmp_path, checkpointing):
    # Trainer.train() switches transformers' checkpointing on after fuse when its arguments ask;
    # TrainingArguments(activation_checkpointing=False) keeps it off through train().
    pytest.importorskip("datasets")
    model = _causal_lm()
    model.gradient_checkpointing_disable()  # what train() undoes where its arguments ask
    trainer = _trainer(model, tmp_path, activation_checkpointing=checkpointing)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    ours = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    stats = ckpt_ext.stats(model)
    assert stats.unfused_calls == 0 and stats.fused_calls >= 4, str(stats)
    if checkpointing:
        assert len(ours) == 2 and all("recomputed twice" in m for m in ours), ours
        assert stats.recomputed_calls == stats.fused_calls
    else:
        assert ours == [] and stats.recomputed_calls == 0, ours


# ---- what the counting costs nothing of -----------------------------------------------------------

def test_compiled_calls_do_not_recompile():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 4))
    ckpt_ext.fuse(model)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    from torch._dynamo.utils import counters
    counters.clear()
    x = torch.randn(5, 8)
    for _ in range(3):
        compiled(x).sum().backward()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    model(x).sum().backward()  # eager calls count
    assert ckpt_ext.stats(model)[0].fused_calls == 1


def test_copies_and_pickles_count_afresh():
    _, fused = _llama()
    x = lm.ids()
    _steps(fused, x, n=1)
    for other in (copy.deepcopy(fused), pickle.loads(pickle.dumps(fused))):
        assert [s.fused_calls for s in ckpt_ext.stats(other)] == [0, 0]
        _steps(other, x, n=1)
        assert [s.fused_calls for s in ckpt_ext.stats(other)] == [1, 1]
    assert [s.fused_calls for s in ckpt_ext.stats(fused)] == [1, 1]


def test_stats_takes_a_module():
    with pytest.raises(TypeError, match="ckpt_ext.stats expects an nn.Module, got int"):
        ckpt_ext.stats(3)
    assert list(ckpt_ext.stats(nn.Linear(2, 2))) == []


@pytest.mark.parametrize("checkpointing", [None, False])
def test_trls_default_checkpointing_is_seen_and_its_config_switches_it_off(tmp_path,
                                                                           checkpointing):
    # TRL's configs set checkpointing on by default and SFTTrainer switches it on in train(),
    # after fuse; SFTConfig(activation_checkpointing=False) keeps it off.
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tokenizers = pytest.importorskip("tokenizers")
    import transformers as t
    from trl import SFTConfig, SFTTrainer
    model = _causal_lm()
    vocab = tokenizers.models.WordLevel({f"t{i}": i for i in range(50)}, unk_token="t0")
    tokenizer = t.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(vocab),
                                          pad_token="t0", eos_token="t1")
    switch = {} if checkpointing is None else {"activation_checkpointing": checkpointing}
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2,
                     report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
                     disable_tqdm=True, bf16=False, **switch)
    trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer,
                         train_dataset=datasets.Dataset.from_dict(
                             {"input_ids": lm.ids(4, 16).tolist()}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    ours = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    stats = ckpt_ext.stats(model)
    assert stats.unfused_calls == 0 and stats.fused_calls >= 4, str(stats)
    if checkpointing is None:
        assert len(ours) == 2 and all("recomputed twice" in m and "activation_checkpointing="
                                      "False" in m for m in ours), ours
        assert stats.recomputed_calls == stats.fused_calls
    else:
        assert ours == [] and stats.recomputed_calls == 0, ours
