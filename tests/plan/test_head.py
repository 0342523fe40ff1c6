"""The head's ``fused loss`` (ckpt_ext._head_loss) on a tiny transformers Llama: what the model
computes is unchanged (float64: the loss, every gradient, the logits returned, a caller's own use
of them), what it keeps is the log-softmax less the kept gradients (to the byte), logits other
than the head's are counted and warned, unfuse takes it out, copies carry it; the planner takes it
as the head's option, its least peak lower with it, its prediction what the step measures, and
torch.compile takes the fused model as one graph."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch._dynamo as dynamo

import ckpt_ext
from ckpt_ext._head_loss import (FusedLoss, HeadForward, fuse_head_loss, head_refusal,
                                 is_head_fused)
from ckpt_ext.convert.fallback import FallbackWarning
from ckpt_ext.planner import measure_step
from ckpt_ext.planner.units import find_head

from reference import rel_err

transformers = pytest.importorskip("transformers")
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

LAYERS, SEQ, VOCAB, HIDDEN = 2, 24, 320, 32
# The loss is made in float32 from the logits in both (transformers' ``logits.float()``): the
# largest relative difference measured here is 8.4e-08 (loss and gradients, float64 model).
LOSS_TOL = 8e-07
# Compiled against eager, float32: the loss equal, gradients 4.8e-07 apart (inductor's kernels).
COMPILED_TOL = 5e-06


def tiny_llama(dtype=torch.float64):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=88,
                                   num_hidden_layers=LAYERS, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=2 * SEQ)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


IDS = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(1))
LABELS = IDS.clone()
LABELS[:, :5] = -100  # a prompt not counted, as fine-tuning on answers masks it


def step(model, **extra):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=IDS, labels=LABELS, use_cache=False, **extra)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out.loss.detach(), out.logits.detach(), grads


def assert_same_step(a, b):
    assert torch.isfinite(a[0]) and rel_err(b[0], a[0]) <= LOSS_TOL
    assert torch.equal(a[1], b[1])  # the logits the caller gets: the very same GEMM
    for name in a[2]:
        assert rel_err(b[2][name], a[2][name]) <= LOSS_TOL, name


@pytest.mark.parametrize("items", [None, 40])
def test_fused_loss_computes_what_the_model_computes(items):
    """float64: loss, logits and every gradient as transformers' own loss gives them, with the
    prompt masked and with a given num_items_in_batch (Trainer's)."""
    model = tiny_llama()
    extra = {} if items is None else {"num_items_in_batch": torch.tensor(items)}
    want = step(model, **extra)
    fuse_head_loss(model)
    got = step(model, **extra)
    assert_same_step(want, got)
    counts = ckpt_ext.stats(model)
    assert counts.fused_calls == 1 and counts.unfused_calls == 0


def test_the_logits_returned_are_the_heads_float32():
    """float32: the logits the model returns are the head's output, untouched by the loss made
    from them (the loss reads them chunk by chunk into copies of its own)."""
    model = tiny_llama(torch.float32)
    want = step(model)[1]
    fuse_head_loss(model)
    assert torch.equal(step(model)[1], want)


def test_a_callers_own_use_of_the_logits_keeps_its_gradient():
    """The logits returned keep their graph: a loss of the caller's on them adds its gradient."""
    model = tiny_llama()

    def both(m):
        m.zero_grad(set_to_none=True)
        out = m(input_ids=IDS, labels=LABELS, use_cache=False)
        (out.loss + out.logits.square().mean()).backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    want = both(model)
    fuse_head_loss(model)
    got = both(model)
    for name in want:
        assert rel_err(got[name], want[name]) <= LOSS_TOL, name


def test_frees_the_log_softmax_to_the_byte():
    """Kept after the loss: transformers' loss keeps the log-softmax (N x V float32), its
    target, its total weight (a float32) and the head's input; the fused loss keeps dL/dh and
    dL/dW (the head's input is freed with the logits' graph)."""
    model = tiny_llama(torch.float32)
    inputs = dict(input_ids=IDS, labels=LABELS, use_cache=False)
    plain = measure_step(model, inputs)["kept_for_backward"]
    fuse_head_loss(model)
    fused = measure_step(model, inputs)["kept_for_backward"]
    n = IDS.numel()
    log_softmax, target, total_weight = n * VOCAB * 4, n * 8, 4
    grad_w = VOCAB * HIDDEN * 4  # dL/dh replaces the head's input: the same bytes
    assert plain - fused == log_softmax + target + total_weight - grad_w, (plain, fused)


def test_other_logits_run_transformers_loss_counted_and_warned():
    model = tiny_llama()
    fuse_head_loss(model)
    logits = torch.randn(3, SEQ, VOCAB, dtype=torch.float64)
    with pytest.warns(FallbackWarning, match="other than the head's output"):
        got = model.loss_function(logits=logits, labels=LABELS, vocab_size=VOCAB)
    assert torch.equal(got, ForCausalLMLoss(logits, LABELS, VOCAB))
    counts = ckpt_ext.stats(model)
    assert counts.unfused_calls == 1 and counts.fused_calls == 0


def test_an_output_that_never_reaches_the_loss_is_counted():
    model = tiny_llama()
    fuse_head_loss(model)
    with pytest.warns(FallbackWarning, match="never reached the model's loss"):
        for _ in range(2):  # no labels: no loss; the second call finds the first's output
            model(input_ids=IDS, use_cache=False)
    assert ckpt_ext.stats(model).unfused_calls == 1
    vars(model.lm_head)["forward"].pending = None
    with torch.no_grad():  # nothing noted without gradients
        model(input_ids=IDS, use_cache=False)
    assert vars(model.lm_head)["forward"].pending is None


def test_unfuse_takes_it_out_and_puts_back_the_models_own():
    model = tiny_llama()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fuse_head_loss(model)
    assert is_head_fused(model) and is_head_fused(model.lm_head)
    ckpt_ext.unfuse(model)
    assert "forward" not in vars(model.lm_head) and "_loss_function" not in vars(model)
    assert model.loss_function is ForCausalLMLoss
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    model.loss_function = ForCausalLMLoss  # one of the model's own, set on it
    fuse_head_loss(model)
    ckpt_ext.unfuse(model)
    assert vars(model)["_loss_function"] is ForCausalLMLoss


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_carry_it_on_their_own_head(how):
    model = tiny_llama()
    fuse_head_loss(model)
    want = step(model)
    other = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    forward = vars(other.lm_head)["forward"]
    assert isinstance(forward, HeadForward) and forward.head is other.lm_head
    assert isinstance(vars(other)["_loss_function"], FusedLoss)
    assert vars(other)["_loss_function"].forward is forward
    assert_same_step(want, step(other))
    assert ckpt_ext.stats(other).fused_calls == 1


def test_what_it_refuses_is_named():
    model = tiny_llama()
    model.loss_function = lambda logits, labels, vocab_size, **kw: ForCausalLMLoss(
        logits, labels, vocab_size, **kw)
    assert "not transformers' ForCausalLMLoss" in head_refusal(model)
    unit, notes = find_head(model)
    assert unit is None and notes and notes[0][0] == "lm_head"
    with pytest.raises(ValueError, match="ForCausalLMLoss"):
        fuse_head_loss(model)
    model = tiny_llama()
    model.lm_head.forward = model.lm_head.forward  # a forward set on its instance
    assert "forward set on its instance" in head_refusal(model)
    assert find_head(torch.nn.Linear(2, 2)) == (None, [])
    model = tiny_llama()
    model.lm_head.weight.ds_id = 7  # as DeepSpeed ZeRO-3 marks a partitioned parameter
    assert "sharded by DeepSpeed ZeRO-3" in head_refusal(model)


def test_plan_fuses_the_loss_where_it_lowers_the_least_peak():
    """The head's option in the plan: the least peak with it below the least without (a model
    whose loss cannot be fused), the applied plan's measured peak its prediction, the choice at
    a budget only it meets fusing the loss."""
    model = tiny_llama(torch.float32)
    inputs = dict(input_ids=IDS, labels=LABELS, use_cache=False)
    with_head = ckpt_ext.plan(model, inputs, 10**15)
    assert with_head.head is not None and with_head.choices["lm_head"] == "none"
    refused = tiny_llama(torch.float32)
    refused.loss_function = lambda *a, **kw: ForCausalLMLoss(*a, **kw)
    without = ckpt_ext.plan(refused, inputs, 10**15)
    assert without.head is None and "lm_head" not in without.choices
    assert with_head.least_peak_bytes < without.least_peak_bytes
    p = ckpt_ext.plan(model, inputs, with_head.least_peak_bytes)
    assert p.choices["lm_head"] == "fused loss"
    net, report = p.apply(model)
    assert "the head's loss fused" in str(report)
    measured = measure_step(net, inputs)["peak_above_before_forward"]
    assert measured <= p.budget_bytes and abs(measured - p.peak_bytes) <= 0.05 * p.peak_bytes
    with pytest.raises(ValueError, match="unfuse"):
        p.apply(net)  # already in
    ckpt_ext.unfuse(net)
    assert not is_head_fused(net) and not is_head_fused(net.lm_head)


def test_compiles_as_one_graph():
    """torch.compile(fullgraph=True) of the fused model: loss and gradients as eager's."""
    model = tiny_llama(torch.float32)
    fuse_head_loss(model)
    want = step(model)
    dynamo.reset()
    try:
        got = step(torch.compile(model, fullgraph=True, dynamic=False))
    finally:
        dynamo.reset()
    assert rel_err(got[0], want[0]) <= COMPILED_TOL
    grads = {name.replace("_orig_mod.", ""): g for name, g in got[2].items()}
    for name in want[2]:
        assert rel_err(grads[name], want[2][name]) <= COMPILED_TOL, name
