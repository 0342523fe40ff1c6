"""``ckpt_ext.plan(model, step=...)`` and ``ckpt_ext.max_batch(model, make_step=...)``: a step
closure ``step(m) -> loss`` plans as the equivalent inputs and loss do (same choices, peaks,
FLOPs, figures), a trainer's own loss (transformers' ``Trainer.compute_loss`` with label
smoothing, TRL's ``SFTTrainer.compute_loss``; built offline) gets a plan that fits when applied,
and what a caller hands in wrong is named before anything runs."""
from __future__ import annotations

import copy
import os
import re

import pytest
import torch

import ckpt_ext
from ckpt_ext.planner import measure_step

transformers = pytest.importorskip("transformers")
import _llama  # noqa: E402

LAYERS, SEQ, VOCAB = 4, 64, 256
IDS = torch.randint(0, VOCAB, (64, SEQ), generator=torch.Generator().manual_seed(1))


def tiny_llama():
    return _llama.tiny_llama(LAYERS, SEQ, VOCAB)


def batch(n: int) -> dict:
    return dict(input_ids=IDS[:n], labels=IDS[:n], use_cache=False)


def step_of(inputs: dict):
    return lambda m: m(**inputs).loss


def loss(out):
    return out.loss


INPUTS = batch(4)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def budget(model):
    """Halfway between the least peak any plan reaches and plain's."""
    first = ckpt_ext.plan(model, INPUTS, 10**15, loss_fn=loss)
    return (first.least_peak_bytes + first.plain_peak_bytes) // 2


def figures(p):
    return (p.choices, p.peak_bytes, p.kept_bytes, p.added_flops, p.plain_peak_bytes,
            p.plain_kept_bytes, p.plain_flops, p.least_peak_bytes, p.figures, p.spread_bytes)


# ------------------------------------------------------------------------------------------------
# The same step in both forms

def test_a_step_plans_as_its_inputs_and_loss(model, budget):
    want = ckpt_ext.plan(model, INPUTS, budget, loss_fn=loss)
    got = ckpt_ext.plan(model, step=step_of(INPUTS), budget_bytes=budget)
    assert set(want.choices.values()) != {"none"}
    assert figures(got) == figures(want)


def test_a_step_over_the_model_itself_is_called_on_the_copy(model, budget):
    """A step that closes over the model instead of using the module it is handed: the probe
    rebinds it to its copy, so the plan is the same."""
    want = ckpt_ext.plan(model, step=step_of(INPUTS), budget_bytes=budget)
    got = ckpt_ext.plan(model, step=lambda m: model(**INPUTS).loss, budget_bytes=budget)
    assert figures(got) == figures(want)


def test_measure_step_of_a_step_is_that_of_its_inputs(model):
    a = measure_step(model, INPUTS, loss)
    b = measure_step(model, step=step_of(INPUTS))
    assert a["peak_above_before_forward"] == b["peak_above_before_forward"]
    assert a["kept_for_backward"] == b["kept_for_backward"] and a["loss"] == b["loss"]


def test_max_batch_with_make_step_is_max_batch_with_make_inputs(model):
    budget = 6 * 2**20
    n, want = ckpt_ext.max_batch(model, batch, budget, loss_fn=loss)
    m, got = ckpt_ext.max_batch(model, make_step=lambda k: step_of(batch(k)),
                                budget_bytes=budget)
    assert n >= 4 and m == n and figures(got) == figures(want)
    net, _ = got.apply(copy.deepcopy(model))
    assert measure_step(net, step=step_of(batch(n)))["peak_above_before_forward"] <= budget


# ------------------------------------------------------------------------------------------------
# A trainer's own loss

@pytest.fixture(scope="module")
def trainer(model, tmp_path_factory):
    """A transformers Trainer whose compute_loss smooths the labels (its own loss, not the
    model's ``.loss``), built offline."""
    args = transformers.TrainingArguments(output_dir=str(tmp_path_factory.mktemp("trainer")),
                                          label_smoothing_factor=0.1, use_cpu=True,
                                          report_to=[], save_strategy="no")
    return transformers.Trainer(model=model, args=args)


def test_a_trainers_compute_loss_plans_and_fits(model, trainer):
    """``compute_loss`` pops the labels from the dict it is handed: the step hands it a new one
    each time. Plain's peak is the trainer's step as measured, not the model's ``.loss`` step;
    the plan at a budget between the least peak and plain's fits when applied."""
    def step(m):
        return trainer.compute_loss(m, dict(INPUTS))

    assert trainer.label_smoother is not None
    measured = measure_step(model, step=step)["peak_above_before_forward"]
    first = ckpt_ext.plan(model, step=step, budget_bytes=10**15)
    assert first.plain_peak_bytes == measured
    assert measured != measure_step(model, INPUTS, loss)["peak_above_before_forward"]
    budget = (first.least_peak_bytes + first.plain_peak_bytes) // 2
    p = ckpt_ext.plan(model, step=step, budget_bytes=budget)
    assert set(p.choices.values()) != {"none"}
    net, _ = p.apply(copy.deepcopy(model))
    peak = measure_step(net, step=lambda m: trainer.compute_loss(m, dict(INPUTS)))
    peak = peak["peak_above_before_forward"]
    assert peak <= budget and abs(peak - p.peak_bytes) <= 0.05 * p.peak_bytes


# ------------------------------------------------------------------------------------------------
# What is handed in wrong

def test_arguments_are_checked_before_anything_runs(model):
    ran = []

    def step(m):
        ran.append(1)
        return m(**INPUTS).loss

    cases = [
        (dict(step=step), TypeError, "budget_bytes is required: an int (bytes), got none"),
        (dict(example_inputs=2**30, step=step), TypeError,
         "budget_bytes is required: an int (bytes), got none (1073741824 came as the second "
         "argument: pass budget_bytes=... with step)"),
        (dict(budget_bytes=10**6), TypeError, "expects example_inputs or step, got neither"),
        (dict(example_inputs=INPUTS, budget_bytes=10**6, step=step), TypeError,
         "expects example_inputs or step, not both (got example_inputs of type dict and step)"),
        (dict(step=step, budget_bytes=10**6, loss_fn=loss), TypeError,
         "loss_fn goes with example_inputs; with step the step computes its own loss"),
        (dict(step="loss", budget_bytes=10**6), TypeError,
         "step must be callable (model -> scalar loss tensor), got str"),
        (dict(step=step, budget_bytes=1.5e6), TypeError, "budget_bytes must be an int"),
    ]
    for kwargs, kind, message in cases:
        with pytest.raises(kind, match=re.escape(f"ckpt_ext.plan: {message}")):
            ckpt_ext.plan(model, **kwargs)
    batch_cases = [
        (dict(make_step=lambda n: step), TypeError, "budget_bytes is required"),
        (dict(make_inputs=batch, make_step=lambda n: step, budget_bytes=10**6), TypeError,
         "expects make_inputs or make_step, not both"),
        (dict(budget_bytes=10**6), TypeError, "expects make_inputs or make_step, got neither"),
        (dict(make_step=torch.ones(1), budget_bytes=10**6), TypeError,
         "make_step must be callable (n -> a step), got Tensor"),
        (dict(make_step=lambda n: step, loss_fn=loss, budget_bytes=10**6), TypeError,
         "loss_fn goes with make_inputs; with make_step the step computes its own loss"),
    ]
    ran.clear()
    for kwargs, kind, message in batch_cases:
        with pytest.raises(kind, match=re.escape(f"ckpt_ext.max_batch: {message}")):
            ckpt_ext.max_batch(model, **kwargs)
    assert ran == []
    with pytest.raises(TypeError, match=re.escape(
            "ckpt_ext.max_batch: make_step(1): step must be callable (model -> scalar loss "
            "tensor), got NoneType")):
        ckpt_ext.max_batch(model, make_step=lambda n: None, budget_bytes=10**6)


def test_a_step_that_fails_is_named(model):
    """A step that raises, or returns what is no scalar loss requiring grad: the error names
    step, and the model is as it was."""
    grads = [prm.grad for prm in model.parameters()]
    with pytest.raises(ValueError, match=re.escape(
            "ckpt_ext.plan: step(model) raised ValueError: ")):
        ckpt_ext.plan(model, step=lambda m: m(inputs_ids=IDS[:2]).loss, budget_bytes=10**15)
    with pytest.raises(TypeError, match=re.escape(
            "ckpt_ext.plan: step(model) raised TypeError: ")):
        ckpt_ext.plan(model, step=lambda: 0, budget_bytes=10**15)
    with pytest.raises(ValueError, match=re.escape(
            "ckpt_ext.max_batch: make_step(1): step(model) raised ValueError: ")):
        ckpt_ext.max_batch(model, make_step=lambda n: lambda m: m(inputs_ids=IDS[:n]).loss,
                           budget_bytes=10**15)
    returns = [
        (lambda m: m(**INPUTS).logits, "a tensor of shape (4, 64, 256), requires_grad=True"),
        (lambda m: m(**INPUTS).loss.item(), "float"),
        (lambda m: m(**INPUTS).loss.detach(), "a tensor of shape (), requires_grad=False"),
    ]
    for step, got in returns:
        with pytest.raises(ValueError, match=re.escape(
                f"ckpt_ext.plan: step(model) must return a scalar tensor that requires grad, got "
                f"{got}")):
            ckpt_ext.plan(model, step=step, budget_bytes=10**15)
    assert all(a is b for a, b in zip([prm.grad for prm in model.parameters()], grads))


class Holder:
    """Holds the model where no copy can reach it (as a trainer's own state)."""


def test_a_step_that_runs_the_models_own_layers_is_an_error(model):
    grads = [prm.grad for prm in model.parameters()]
    holder = Holder()
    holder.model = model
    with pytest.raises(RuntimeError, match=re.escape(
            "ran the model's own model.layers.0, model.layers.1, model.layers.2, model.layers.3 "
            "instead of the copy's")) as info:
        ckpt_ext.plan(model, step=lambda m: holder.model(**INPUTS).loss, budget_bytes=10**15)
    assert "step(m), or a forward or hook on its way, reaches the model's own modules" in \
        str(info.value)
    free = torch.ones(2, requires_grad=True)
    with pytest.raises(RuntimeError, match=re.escape(
            "never ran model.layers.0, model.layers.1, model.layers.2, model.layers.3, so it "
            "cannot measure them (no forward is set on an instance on their way): step(m) does "
            "not call them in the module m it is handed")):
        ckpt_ext.plan(model, step=lambda m: (free * 2).sum(), budget_bytes=10**15)
    assert all(a is b for a, b in zip([prm.grad for prm in model.parameters()], grads))


def test_trls_sft_trainer_compute_loss_plans_and_fits(tmp_path):
    """TRL's SFTTrainer (trl 1.16) computes its own loss and metrics in compute_loss, and sets a
    forward on the model's instance: a step closure over its compute_loss on a collated batch
    plans the trainer's model, and the plan fits when applied."""
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tokenizers = pytest.importorskip("tokenizers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from trl import SFTConfig, SFTTrainer
    vocab = tokenizers.models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(vocab), pad_token="t0", eos_token="t1")
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1,
                     report_to=[], use_cpu=True, save_strategy="no")
    trainer = SFTTrainer(model=tiny_llama(), args=args, processing_class=tokenizer,
                         train_dataset=datasets.Dataset.from_dict({"input_ids": IDS[:8].tolist()}))
    collated = next(iter(trainer.get_train_dataloader()))

    def step(m):
        return trainer.compute_loss(m, dict(collated))

    model = trainer.model
    first = ckpt_ext.plan(model, step=step, budget_bytes=10**15)
    assert first.plain_peak_bytes == measure_step(model, step=step)["peak_above_before_forward"]
    budget = (first.least_peak_bytes + first.plain_peak_bytes) // 2
    p = ckpt_ext.plan(model, step=step, budget_bytes=budget)
    assert set(p.choices.values()) != {"none"}
    net, _ = p.apply(copy.deepcopy(model))
    peak = measure_step(net, step=step)["peak_above_before_forward"]
    assert peak <= budget and abs(peak - p.peak_bytes) <= 0.05 * p.peak_bytes
