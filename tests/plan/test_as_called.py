"""``ckpt_ext.plan`` measures the model as it is called: a forward set on an instance as a closure
over the model's own bound forward (TRL's ``SFTTrainer``, ``functools.wraps`` wrappers),
accelerate's hooked forward and a hook that runs the blocks all reach the probe's copy, and the
plan's figures are the step's; where the step still runs the model's own units, or none of them,
``plan`` raises an error that names them and the forward set on the way."""
from __future__ import annotations

import copy
import functools
import os
import re
import types

import pytest
import torch
from torch import nn

import ckpt_ext
from ckpt_ext.planner import Option, measure_step
from ckpt_ext.planner.units import OPTIONS

transformers = pytest.importorskip("transformers")
import _llama  # noqa: E402

LAYERS, SEQ, VOCAB = 4, 64, 256
IDS = torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(1))
INPUTS = dict(input_ids=IDS[:2], labels=IDS[:2], use_cache=False)


def tiny_llama():
    return _llama.tiny_llama(LAYERS, SEQ, VOCAB)


LAYER_PATHS = [f"model.layers.{i}" for i in range(LAYERS)]


@pytest.fixture(scope="module")
def unpatched():
    """The plan of the unpatched model at a budget between its least peak and plain's."""
    model = tiny_llama()
    first = ckpt_ext.plan(model, INPUTS, 10**15)
    budget = (first.least_peak_bytes + first.plain_peak_bytes) // 2
    return budget, ckpt_ext.plan(model, INPUTS, budget), first


def closure_over_bound_forward(model: nn.Module) -> None:
    """TRL's patch of the model's forward (``trl.trainer.utils``, fused LM head): a method bound
    to the model whose function is a closure over the model's original bound forward."""
    original_forward = model.forward

    @functools.wraps(type(model).forward)
    def _fused_forward(self, *args, fused_lm_head=False, **kwargs):
        return original_forward(*args, **kwargs)

    model.forward = types.MethodType(_fused_forward, model)


def wrapped_layer_forward(model: nn.Module, i: int) -> None:
    """A layer's forward replaced on its instance by a ``functools.wraps`` wrapper of its bound
    forward."""
    layer = model.model.layers[i]
    inner = layer.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        return inner(*args, **kwargs)

    layer.forward = forward


def assert_measured_as_called(model, budget, unpatched_plan):
    """The patched model's plan: its units and choices the unpatched model's, plain's peak its
    measured step, and the plan applied fits the budget and its prediction."""
    plain = measure_step(model, INPUTS)["peak_above_before_forward"]
    p = ckpt_ext.plan(model, INPUTS, budget)
    assert list(p.choices) == LAYER_PATHS + ["lm_head"] and p.notes == []
    if all(u.options == unpatched_plan.units[0].options for u in p.units):
        assert p.choices == unpatched_plan.choices
        assert p.added_flops == unpatched_plan.added_flops
    assert p.plain_peak_bytes == plain == unpatched_plan.plain_peak_bytes
    net, _ = p.apply(model)
    peak = measure_step(net, INPUTS)["peak_above_before_forward"]
    assert peak <= budget and abs(peak - p.peak_bytes) <= 0.05 * p.peak_bytes


def test_a_forward_patched_as_a_closure_is_measured_as_called(unpatched):
    budget, want, _ = unpatched
    model = tiny_llama()
    closure_over_bound_forward(model)
    assert_measured_as_called(model, budget, want)


def test_layer_forwards_wrapped_on_the_instance_are_measured_as_called(unpatched):
    """One layer wrapped with functools.wraps, another hooked by accelerate's
    ``add_hook_to_module`` (a partial over a closure, the bound forward kept on the instance)."""
    budget, want, _ = unpatched
    model = tiny_llama()
    wrapped_layer_forward(model, 1)
    hooks = pytest.importorskip("accelerate.hooks")
    hooks.add_hook_to_module(model.model.layers[2], hooks.ModelHook())
    assert "forward" in vars(model.model.layers[1]) and "forward" in vars(model.model.layers[2])
    # a recompute set on those two layers would bypass their forwards: they offer none, and the
    # least peak is higher than the unpatched model's
    first = ckpt_ext.plan(model, INPUTS, 10**15)
    assert not {o for o in Option if OPTIONS[o].recompute is not None} & \
        {o for u in first.units[1:3] for o in u.options}
    assert "would bypass" in str(first)
    assert_measured_as_called(model, max(budget, first.least_peak_bytes), want)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(self.up(x).softmax(-1))  # nothing fuse makes a unit of


class Stem(nn.Module):
    """A stem and a run of blocks; with ``direct`` its forward runs them, else nothing in it
    does."""

    def __init__(self, d: int = 32, n: int = 3, direct: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.direct = direct

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks if self.direct else ():
            x = b(x)
        return x


def run_blocks_in_a_hook(net: Stem) -> None:
    """A forward hook on the stem, a closure over the model's blocks, that runs them on its
    output: the blocks are called from a hook, not from a forward."""
    blocks = net.blocks

    def through_blocks(module, args, out):
        for b in blocks:
            out = b(out)
        return out

    net.stem.register_forward_hook(through_blocks)


def test_a_hook_that_runs_the_blocks_is_measured_as_called():
    """The plan of blocks run by a hook is the plan of the same blocks run by the forward."""
    net, direct = Stem(), Stem(direct=True)
    run_blocks_in_a_hook(net)
    x = (torch.randn(64, 32),)
    plain = measure_step(net, x)["peak_above_before_forward"]
    first = ckpt_ext.plan(net, x, 10**15)
    assert list(first.choices) == ["blocks.0", "blocks.1", "blocks.2"] and first.notes == []
    assert first.plain_peak_bytes == plain
    budget = (first.least_peak_bytes + plain) // 2
    p, want = ckpt_ext.plan(net, x, budget), ckpt_ext.plan(direct, x, budget)
    assert p.added_flops > 0 and p.figures == want.figures
    assert (p.choices, p.peak_bytes, p.added_flops) == \
        (want.choices, want.peak_bytes, want.added_flops)
    applied, _ = p.apply(copy.deepcopy(net))
    assert measure_step(applied, x)["peak_above_before_forward"] <= budget


class Trainer:
    """Holds the model's bound forward where no copy can reach it (an object the probe does not
    rebind, as a training framework's own state is)."""


def test_a_step_that_runs_the_models_own_layers_is_an_error():
    """A forward that reaches the model's own forward through an object the copy cannot rebind:
    the probe step ran the model's layers, not the copy's, and plan says so, naming the layers
    and the forward set on the model's instance."""
    model = tiny_llama()
    holder = Trainer()
    holder.forward = model.forward

    def redirected(self, *args, **kwargs):
        return holder.forward(*args, **kwargs)

    model.forward = types.MethodType(redirected, model)
    with pytest.raises(RuntimeError) as info:
        ckpt_ext.plan(model, INPUTS, 10**15)
    text = str(info.value)
    assert "ran the model's own " + ", ".join(LAYER_PATHS) + " instead of the copy's" in text
    assert re.search(r"<model>\.forward is set on its instance \(.*redirected at .*"
                     r"test_as_called\.py:\d+", text), text
    assert "cannot measure them" in text
    assert "forward" in vars(model) and all(p.grad is None for p in model.parameters())


def test_units_the_step_never_runs_are_an_error():
    """Blocks the model's forward does not call: no figures of theirs, so no plan."""
    net = Stem()
    with pytest.raises(RuntimeError, match=re.escape(
            "the probe step on a copy of the model never ran blocks.0, blocks.1, blocks.2, so it "
            "cannot measure them (no forward is set on an instance on their way): the model's "
            "forward does not call them")):
        ckpt_ext.plan(net, (torch.randn(4, 32),), 10**15)


def test_the_model_of_trls_sft_trainer(unpatched, tmp_path):
    """TRL's SFTTrainer (trl 1.16) on a tiny Llama: the trainer patches the model's forward on
    its instance, a closure over its original bound forward; the plan of the trainer's model is
    the model's, and it fits when applied."""
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tokenizers = pytest.importorskip("tokenizers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from trl import SFTConfig, SFTTrainer
    budget, want, _ = unpatched
    model = tiny_llama()
    vocab = tokenizers.models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(vocab), pad_token="t0", eos_token="t1")
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1,
                     report_to=[], use_cpu=True, save_strategy="no")
    trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer,
                         train_dataset=datasets.Dataset.from_dict({"input_ids": IDS.tolist()}))
    patched = vars(trainer.model).get("forward")
    assert patched is not None and patched.__func__.__code__.co_freevars  # a closure
    assert_measured_as_called(trainer.model, budget, want)
