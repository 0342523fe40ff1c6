"""``ckpt_ext.plan`` and ``ckpt_ext.max_batch`` on a tiny transformers Llama (4 layers, built
from a config; 3 where every per-layer choice, with each of the head's options, is measured): the
choice is optimal against every choice measured, predictions agree
with ``measured_step`` and stay within the budget, a smaller budget never peaks higher or costs
fewer FLOPs, the planned model computes what the model computes (float64), ``unfuse`` takes the
plan out, bad input fails before anything changes, and planning alone changes nothing."""
from __future__ import annotations

import copy
import gc
import itertools
import math
import pickle
import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import ckpt_ext
from ckpt_ext.memory import MemoryMeter, clear_grads, measured_step
from ckpt_ext.planner import Option, measure_step
from ckpt_ext._head_loss import fuse_head_loss, undo_head_losses
from ckpt_ext.planner.units import BLOCK_OPTIONS, OPTIONS
from ckpt_ext.planner.choose import choose, survey
from ckpt_ext.planner.figures import simulate

from reference import TOL, rel_err

transformers = pytest.importorskip("transformers")

LAYERS, SEQ, VOCAB = 4, 64, 256
#: the layers of the model every per-layer choice is measured on (5^3 choices, each with the
#: head's two)
ENUMERATED = 3
HEAD_OPTIONS = (Option.NONE, Option.FUSED_LOSS)


def tiny_llama(dtype=torch.float32, layers=LAYERS):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=2 * SEQ)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


IDS = torch.randint(0, VOCAB, (64, SEQ), generator=torch.Generator().manual_seed(1))


def batch(n: int) -> dict:
    return dict(input_ids=IDS[:n], labels=IDS[:n], use_cache=False)


INPUTS = batch(4)
#: the inputs of the model every per-layer choice is measured on
SMALL_INPUTS = batch(2)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def surveyed(model):
    """The probes' figures of the model on INPUTS: (figures, units, notes, spread, device)."""
    return survey(model, INPUTS, None)


@pytest.fixture(scope="module")
def small():
    return tiny_llama(layers=ENUMERATED)


@pytest.fixture(scope="module")
def small_surveyed(small):
    return survey(small, SMALL_INPUTS, None)


def put(layer, option):
    """``option`` into one layer by hand, as its row of the options table says."""
    ckpt_ext.unfuse(layer)
    row = OPTIONS[option]
    if row.fuses:
        ckpt_ext.fuse(layer.mlp)
    if row.recompute is not None:
        row.recompute(layer)


@pytest.fixture(scope="module")
def every_choice(small, small_surveyed):
    """Every per-layer choice (5^3) with each of the head's options (2), each put into one copy
    of the model layer by layer and measured: choice (the layers', then the head's) -> (peak,
    FLOPs)."""
    net = copy.deepcopy(small)
    layers = net.model.layers
    current = [Option.NONE] * (ENUMERATED + 1)
    out = {}
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()  # no collection of earlier garbage inside a measured step
    try:
        with MemoryMeter("cpu") as meter:
            for choice in itertools.product(*[BLOCK_OPTIONS] * ENUMERATED, HEAD_OPTIONS):
                for layer, was, wanted in zip(layers, current, choice):
                    if wanted != was:
                        put(layer, wanted)
                if choice[-1] != current[-1]:
                    undo_head_losses(net)
                    if choice[-1] == Option.FUSED_LOSS:
                        fuse_head_loss(net)
                current = list(choice)
                clear_grads(net)
                peak = measured_step(lambda inputs: net(**inputs), SMALL_INPUTS, meter,
                                     loss_fn=lambda o, _: o.loss)["peak_above_before_forward"]
                clear_grads(net)
                with FlopCounterMode(display=False) as counter:
                    net(**SMALL_INPUTS).loss.backward()
                out[choice] = (peak, counter.get_total_flops())
    finally:
        if was_enabled:
            gc.enable()
    assert len(out) == len(BLOCK_OPTIONS) ** len(small_surveyed[1]) * 2 == 432
    return out


def as_plan(surveyed, choice):
    """A Plan of this choice (its figures predicted) for Plan.apply."""
    fig, units, notes, spread, device = surveyed
    p = choose(fig, units, notes, spread, 10**15, str(device))
    p.choices = {u.path: o.value for u, o in zip(units, choice)}
    if p.head is not None:
        p.choices[p.head.path] = (choice[len(units)] if len(choice) > len(units)
                                  else Option.NONE).value
    return p


def budgets(p):
    """Five budgets from plain's peak down to the least any plan reaches."""
    return [round(p.least_peak_bytes + f * (p.plain_peak_bytes - p.least_peak_bytes))
            for f in (1.0, 0.75, 0.5, 0.25, 0.0)]


# ------------------------------------------------------------------------------------------------
# The units and the table

def test_units_are_the_layers_with_every_option(model):
    p = ckpt_ext.plan(model, INPUTS, 10**15)
    assert list(p.choices) == [f"model.layers.{i}" for i in range(LAYERS)] + ["lm_head"]
    assert all(u.options == BLOCK_OPTIONS and u.cls == "LlamaDecoderLayer" for u in p.units)
    assert p.head.options == HEAD_OPTIONS and p.head.cls == "Linear"
    text = str(p)
    assert "model.layers.{0..3}" in text and "LlamaDecoderLayer" in text
    assert all(f"{o.value} " in text for o in BLOCK_OPTIONS) and "head lm_head" in text


def test_the_options_table_is_the_options():
    """Every Option has its row, and the probe measures one step per row."""
    assert list(OPTIONS) == list(Option)
    assert len({row.short for row in OPTIONS.values()}) == len(OPTIONS)


def test_pointwise_recompute_adds_no_flops_and_frees_bytes(model):
    """Pointwise recompute adds no FLOPs as FlopCounterMode counts, keeps less than none, and
    fuse+pointwise keeps less than fuse at fuse's FLOPs."""
    p = ckpt_ext.plan(model, INPUTS, 10**15)
    for figs in p.figures:
        none, pw, fuse = figs[Option.NONE], figs[Option.POINTWISE], figs[Option.FUSE]
        both = figs[Option.FUSE_POINTWISE]
        assert pw.flops == none.flops and both.flops == fuse.flops
        assert pw.fwd_growth < none.fwd_growth and both.fwd_growth < fuse.fwd_growth


def test_a_budget_at_plain_peak_changes_nothing(model):
    p = ckpt_ext.plan(model, INPUTS, 10**15)
    at_plain = ckpt_ext.plan(model, INPUTS, p.plain_peak_bytes)
    assert at_plain.added_flops == 0 and set(at_plain.choices.values()) == {"none"}
    net = copy.deepcopy(model)
    net, report = at_plain.apply(net)
    assert report.fused == [] and report.checkpointed == []
    assert all("forward" not in vars(m) for m in net.modules())


def test_a_budget_at_plains_measured_peak_changes_nothing(model):
    """At exactly the peak measure_step measures for the plain model, nothing is recomputed and
    the predicted peak is that measurement (the other probes' spread does not raise it)."""
    measured = measure_step(model, INPUTS)["peak_above_before_forward"]
    p = ckpt_ext.plan(model, INPUTS, measured)
    assert p.added_flops == 0 and set(p.choices.values()) == {"none"}
    assert p.peak_bytes == p.plain_peak_bytes == measured
    below = ckpt_ext.plan(model, INPUTS, measured - 1)
    assert set(below.choices.values()) != {"none"} and below.peak_bytes <= measured - 1


# ------------------------------------------------------------------------------------------------
# Optimality, predictions, monotonicity

def test_choice_is_optimal_against_every_choice_measured(small, small_surveyed, every_choice):
    """At each budget the plan's FLOPs are the least of every per-layer choice whose measured
    peak fits (5^3 x 2 choices, each applied and measured), and the plan itself fits."""
    plain_flops = every_choice[(Option.NONE,) * (ENUMERATED + 1)][1]
    fig = small_surveyed[0]
    for b in budgets(ckpt_ext.plan(small, SMALL_INPUTS, 10**15)):
        p = choose(*small_surveyed[:4], b, "cpu")
        chosen = tuple(Option(p.choices[u.path]) for u in small_surveyed[1]) + \
            (p.head_option(),)
        fitting = [fl for peak, fl in every_choice.values() if peak <= b]
        assert every_choice[chosen][0] <= b
        assert every_choice[chosen][1] == min(fitting), b
        assert p.added_flops == every_choice[chosen][1] - plain_flops
        # the counted FLOPs are the probes' to the FLOP
        assert simulate(fig, chosen).flops == every_choice[chosen][1]


def test_predictions_of_every_choice_within_half_a_percent(small_surveyed, every_choice):
    """The memory model (a chain of units' segments) against all 250 measured steps."""
    fig = small_surveyed[0]
    worst = max(abs(simulate(fig, c).peak - peak) / peak for c, (peak, _) in every_choice.items())
    assert worst <= 5e-3, worst


def test_applied_plan_fits_its_budget_and_prediction_monotonically(model):
    """Public API end to end at five budgets: the measured peak is within the budget and within
    5 % of peak_bytes, kept within 5 % of kept_bytes, and a smaller budget never gives a larger
    measured peak or fewer added FLOPs."""
    first = ckpt_ext.plan(model, INPUTS, 10**15)
    last_peak, last_flops = math.inf, -1
    seen = set()
    for b in budgets(first):
        p = ckpt_ext.plan(model, INPUTS, b)
        net, _ = p.apply(copy.deepcopy(model))
        measured = measure_step(net, INPUTS)
        peak = measured["peak_above_before_forward"]
        assert peak <= b
        assert abs(peak - p.peak_bytes) <= 0.05 * p.peak_bytes
        assert abs(measured["kept_for_backward"] - p.kept_bytes) <= 0.05 * p.kept_bytes
        assert peak <= last_peak and p.added_flops >= last_flops
        last_peak, last_flops = peak, p.added_flops
        seen.update(p.choices.values())
    # the budgets exercise the options on the front (fuse+pointwise keeps less than fuse at
    # fuse's FLOPs: fuse alone is never the cheaper choice)
    assert {"none", "pointwise", "fuse+pointwise", "checkpoint"} <= seen


def test_below_the_least_budget_names_it(model):
    p = ckpt_ext.plan(model, INPUTS, 10**15)
    with pytest.raises(ValueError, match=re.escape(f"{p.least_peak_bytes:,} bytes")):
        ckpt_ext.plan(model, INPUTS, p.least_peak_bytes - 1)
    assert ckpt_ext.plan(model, INPUTS, p.least_peak_bytes).peak_bytes <= p.least_peak_bytes


# ------------------------------------------------------------------------------------------------
# What the planned model computes, and undoing it

def _outputs_and_grads(net, inputs):
    net.zero_grad(set_to_none=True)
    out = net(**inputs)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad.clone()
                                                    for n, p in net.named_parameters()}


@pytest.mark.parametrize("mixed", [
    (Option.FUSE, Option.CHECKPOINT, Option.NONE, Option.FUSE),
    (Option.FUSE_POINTWISE, Option.POINTWISE, Option.CHECKPOINT, Option.NONE),
    (Option.FUSE_CHECKPOINT, Option.POINTWISE, Option.FUSE_CHECKPOINT, Option.FUSE),
])
def test_planned_model_computes_what_the_model_computes_float64(mixed):
    """A plan mixing the options applied to a float64 model: logits, loss and every parameter
    gradient equal to the unchanged model's; keys and classes as they were, and a hook on the
    recomputed layer runs once per step, outside the recompute."""
    ref = tiny_llama(torch.float64)
    inputs = batch(2)
    p = as_plan(survey(ref, inputs, None), mixed)
    net = copy.deepcopy(ref)
    calls = []
    net.model.layers[1].register_forward_hook(lambda m, a, o: calls.append(1))
    keys, classes = list(net.state_dict()), [type(m) for m in net.modules()]
    net, report = p.apply(net)
    recomputed = [f"model.layers.{i}" for i, o in enumerate(mixed) if OPTIONS[o].recompute]
    assert report.checkpointed == recomputed
    assert len(report.fused) == sum(OPTIONS[o].fuses for o in mixed)
    assert list(net.state_dict()) == keys
    assert [type(m) for m in net.model.layers[1].modules()] == \
        [type(m) for m in ref.model.layers[1].modules()]
    assert len(classes) == len(list(net.modules()))
    logits, loss, grads = _outputs_and_grads(net, inputs)
    ref_logits, ref_loss, ref_grads = _outputs_and_grads(ref, inputs)
    assert calls == [1]
    # measured: logits and loss equal to the bit, gradients within 2.0e-16 (bounded, not bitwise:
    # the fused MLPs run other GEMM calls than the unchanged model)
    assert rel_err(logits, ref_logits) <= TOL[torch.float64]
    assert rel_err(loss, ref_loss) <= TOL[torch.float64]
    for name, g in ref_grads.items():
        assert rel_err(grads[name], g) <= TOL[torch.float64], name


class DropoutBlock(torch.nn.Module):
    """A residual block with dropout among its pointwise ops (what pointwise recompute
    recomputes) and in its attention (which it keeps)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.RMSNorm(width)
        self.up = torch.nn.Linear(width, 3 * width)
        self.down = torch.nn.Linear(3 * width, width)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x):
        n = self.norm(x)
        a = torch.nn.functional.scaled_dot_product_attention(n, n, n, dropout_p=0.2)
        return x + a + self.drop(self.down(self.drop(torch.nn.functional.gelu(self.up(n)))))


def test_dropout_masks_are_redrawn_alike_under_every_option():
    """Blocks with dropout in float64, each option on some block: the step's outputs and
    gradients equal those of the unchanged model run from the same RNG state (the masks the
    recompute draws are the forward's)."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[DropoutBlock(16) for _ in range(len(Option))]).double()
    x = torch.randn(3, 8, 16, dtype=torch.float64)

    def step(m):
        return (m(x) ** 2).sum()

    p = ckpt_ext.plan(ref, step=step, budget_bytes=10**15)
    assert all(u.options == (Option.NONE, Option.CHECKPOINT, Option.POINTWISE) for u in p.units)
    p.choices = {u.path: o.value for u, o in zip(p.units, itertools.cycle(p.units[0].options))}
    net, _ = p.apply(copy.deepcopy(ref))
    results = []
    for m in (ref, net):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        loss = step(m)
        loss.backward()
        results.append((loss.detach(), [q.grad.clone() for q in m.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)


def test_unfuse_takes_the_plan_out(model):
    p = ckpt_ext.plan(model, INPUTS, budgets(ckpt_ext.plan(model, INPUTS, 10**15))[2])
    net = copy.deepcopy(model)
    before = ({n: type(m) for n, m in net.named_modules()},
              {n: set(vars(m)) for n, m in net.named_modules()},
              {k: v.clone() for k, v in net.state_dict().items()})
    p.apply(net)
    assert any("forward" in vars(m) for m in net.modules())
    assert pickle.loads(pickle.dumps(net)) is not None  # a planned model pickles
    ckpt_ext.unfuse(net)
    after = ({n: type(m) for n, m in net.named_modules()},
             {n: set(vars(m)) for n, m in net.named_modules()}, net.state_dict())
    assert after[0] == before[0] and after[1] == before[1]
    assert all(torch.equal(after[2][k], v) for k, v in before[2].items())


# ------------------------------------------------------------------------------------------------
# Planning alone, and bad input

def test_plan_alone_changes_nothing(model):
    net = copy.deepcopy(model)
    torch.manual_seed(3)
    for prm in net.parameters():
        prm.grad = torch.randn_like(prm)
    grads = {n: (prm.grad, prm.grad.clone()) for n, prm in net.named_parameters()}
    state = {k: v.clone() for k, v in net.state_dict().items()}
    attrs = {n: (type(m), dict(vars(m))) for n, m in net.named_modules()}
    rng = torch.get_rng_state()
    ckpt_ext.plan(net, INPUTS, budgets(ckpt_ext.plan(model, INPUTS, 10**15))[3])
    assert torch.equal(torch.get_rng_state(), rng)
    for n, prm in net.named_parameters():
        assert prm.grad is grads[n][0] and torch.equal(prm.grad, grads[n][1])
    assert all(torch.equal(net.state_dict()[k], v) for k, v in state.items())
    for n, m in net.named_modules():
        assert type(m) is attrs[n][0] and vars(m).keys() == attrs[n][1].keys()


def test_bad_input_is_refused_before_anything_changes(model):
    with pytest.raises(TypeError, match="nn.Module"):
        ckpt_ext.plan("model", INPUTS, 10**6)
    with pytest.raises(TypeError, match="tuple of positional arguments or a dict"):
        ckpt_ext.plan(model, [IDS[:2]], 10**6)
    with pytest.raises(TypeError, match="budget_bytes must be an int"):
        ckpt_ext.plan(model, INPUTS, 1.5e6)
    with pytest.raises(ValueError, match="budget_bytes must be > 0, got 0"):
        ckpt_ext.plan(model, INPUTS, 0)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        ckpt_ext.plan(model, INPUTS, 10**6, loss_fn="sum")
    with pytest.raises(ValueError, match="scalar tensor that requires grad"):
        ckpt_ext.plan(model, INPUTS, 10**6, loss_fn=lambda out: out.logits)
    with pytest.raises(TypeError, match="make_inputs must be callable"):
        ckpt_ext.max_batch(model, INPUTS, 10**6)
    p = ckpt_ext.plan(model, INPUTS, budgets(ckpt_ext.plan(model, INPUTS, 10**15))[2])
    with pytest.raises(TypeError, match="nn.Module"):
        p.apply(None)
    fused = ckpt_ext.fuse(copy.deepcopy(model))[0]
    kinds = [type(m) for m in fused.modules()]
    with pytest.raises(ValueError, match="unfuse"):
        p.apply(fused)
    assert [type(m) for m in fused.modules()] == kinds
    other = tiny_llama(layers=2)
    with pytest.raises(ValueError, match="no module 'model.layers.2'"):
        p.apply(other)
    assert all("forward" not in vars(m) for m in other.modules())


def test_inputs_the_model_cannot_take_are_named(model):
    """Inputs the model's forward refuses: the error names example_inputs and what was given
    (each argument's dtype and shape), and the model is as it was."""
    grads = [prm.grad for prm in model.parameters()]
    misspelled = dict(inputs_ids=IDS[:2], labels=IDS[:2], use_cache=False)
    with pytest.raises(ValueError, match=re.escape(
            "ckpt_ext.plan: the model cannot take example_inputs (a dict: inputs_ids=int64 "
            "tensor (2, 64), labels=int64 tensor (2, 64), use_cache=False): "
            "model(**example_inputs) raised ValueError: ")):
        ckpt_ext.plan(model, misspelled, 10**15)
    with pytest.raises(TypeError, match=re.escape(
            "ckpt_ext.plan: the model cannot take example_inputs (a tuple: int64 tensor (2, 64), "
            "'x', 3.5, list" + ", None" * 15 + "): model(*example_inputs) raised TypeError: ")):
        ckpt_ext.plan(model, (IDS[:2], "x", 3.5, [1]) + (None,) * 15, 10**15)
    out_of_range = dict(input_ids=IDS[:2] + VOCAB, use_cache=False)
    with pytest.raises(ValueError, match=r"cannot take example_inputs \(a dict: input_ids=int64 "
                                         r"tensor \(2, 64\), use_cache=False\): .* raised "
                                         r"IndexError"):
        ckpt_ext.plan(model, out_of_range, 10**15)
    with pytest.raises(ValueError, match=re.escape(
            "ckpt_ext.max_batch: make_inputs(1): the model cannot take example_inputs (a dict: "
            "inputs_ids=int64 tensor (1, 64))")):
        ckpt_ext.max_batch(model, lambda n: dict(inputs_ids=IDS[:n]), 10**15)
    assert [prm.grad for prm in model.parameters()] == grads


def test_a_layer_handed_a_cache_is_not_checkpointed(model):
    """With use_cache=True each layer updates a cache, which a recompute would update twice: the
    plan leaves checkpoint out and says why."""
    p = ckpt_ext.plan(model, dict(input_ids=IDS[:2], labels=IDS[:2]), 10**15)
    assert all(u.options == (Option.NONE, Option.FUSE) for u in p.units)
    assert "cache" in str(p) and "use_cache=False" in str(p)


# ------------------------------------------------------------------------------------------------
# The largest batch

def test_max_batch_fits_at_n_and_not_at_105_percent(model):
    budget = 6 * 2**20
    n, p = ckpt_ext.max_batch(model, batch, budget)
    assert n >= 4
    net, _ = p.apply(copy.deepcopy(model))
    peak = measure_step(net, batch(n))["peak_above_before_forward"]
    assert peak <= budget and abs(peak - p.peak_bytes) <= 0.05 * p.peak_bytes
    bigger = math.ceil(1.05 * n) if math.ceil(1.05 * n) > n else n + 1
    with pytest.raises(ValueError, match="no plan fits"):
        ckpt_ext.plan(model, batch(bigger), budget)
    least = ckpt_ext.plan(model, batch(bigger), 10**15).least_peak_bytes
    net, _ = ckpt_ext.plan(model, batch(bigger), least).apply(copy.deepcopy(model))
    assert measure_step(net, batch(bigger))["peak_above_before_forward"] > budget
