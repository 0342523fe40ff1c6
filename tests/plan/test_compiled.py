"""Plans and ``torch.compile`` on the CPU (inductor), on a tiny transformers Llama (2 layers): an
applied plan with every recomputing option compiles as one graph (``fullgraph=True``) and
computes what the eager plan computes, and ``plan(..., compiled=True)`` plans for the compiled
step: the faster of its own choice and compile's activation_memory_budget that fit, its compiled
step (``Plan.compile``), measured, within the budget and its prediction."""
from __future__ import annotations

import copy

import pytest
import torch

import ckpt_ext
from ckpt_ext.planner import Option, measure_step
from ckpt_ext.planner import compiled as compiled_mod
from ckpt_ext.planner.units import OPTIONS, find_units

transformers = pytest.importorskip("transformers")
import _llama  # noqa: E402
import torch._dynamo  # noqa: E402

LAYERS, SEQ, VOCAB = 2, 32, 128
IDS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
INPUTS = dict(input_ids=IDS, labels=IDS, use_cache=False)


def tiny_llama():
    return _llama.tiny_llama(LAYERS, SEQ, VOCAB)


def grads_of(net, compiled):
    net.zero_grad(set_to_none=True)
    compiled(**INPUTS).loss.backward()
    return [p.grad.clone() for p in net.parameters()]


@pytest.mark.parametrize("options", [(Option.POINTWISE, Option.FUSE_POINTWISE),
                                     (Option.CHECKPOINT, Option.FUSE),
                                     (Option.CHECKPOINT, Option.FUSE_POINTWISE,
                                      Option.FUSED_LOSS)])
def test_an_applied_plan_compiles_as_one_graph(options):
    """fullgraph=True raises at the first graph break: the applied plan has none, at its very
    first call (nothing made lazily inside a compiled checkpoint); then the eager step."""
    breaking = set(options) & set(compiled_mod.graph_breaking())
    if breaking:  # a compiled plan leaves it out on this torch (tested below)
        pytest.skip(compiled_mod.graph_breaking()[breaking.pop()])
    model = tiny_llama()
    p = ckpt_ext.plan(model, INPUTS, 10**15)
    p.choices = {u.path: o.value for u, o in zip(p.units, options)}
    if len(options) > len(p.units):
        p.choices[p.head.path] = options[-1].value
    net, _ = p.apply(copy.deepcopy(model))
    torch._dynamo.reset()
    try:
        compiled = grads_of(net, torch.compile(net, fullgraph=True, dynamic=False))
    finally:
        torch._dynamo.reset()
    eager = grads_of(net, net)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def measured_compiled(compiled) -> int:
    """The measured peak of a compiled step (compiled by its first step here)."""
    torch._dynamo.reset()
    try:
        compiled(**INPUTS).loss.backward()  # compiles
        return measure_step(compiled, INPUTS)["peak_above_before_forward"]
    finally:
        torch._dynamo.reset()


def planned_below_plain(monkeypatch, change):
    """(model, budget, plan): a compiled plan of the tiny Llama at 95 % of plain's compiled peak,
    each of the planner's compiled steps measured, then passed through ``change(got, fraction,
    budget, inductor)``."""
    real = compiled_mod.compiled_step

    def changed(probe, units, options, fraction=None, timed=0, budget=None, inductor=None):
        return change(real(probe, units, options, fraction, timed, budget, inductor),
                      fraction, budget, inductor)

    monkeypatch.setattr(compiled_mod, "compiled_step", changed)
    model = tiny_llama()
    plain = measured_compiled(torch.compile(copy.deepcopy(model), dynamic=False))
    budget = plain - plain // 20
    return model, budget, ckpt_ext.plan(model, INPUTS, budget, compiled=True)


def test_a_compiled_plan_leaves_out_what_breaks_the_graph():
    """Below torch 2.14 a fused MLP inside a recomputed block (fuse+pointwise, fuse+checkpoint)
    breaks a compiled step's graph: a compiled plan's units leave those out, with the reason;
    from 2.14 they keep every option."""
    breaking = {Option.FUSE_POINTWISE, Option.FUSE_CHECKPOINT}
    assert set(compiled_mod.graph_breaking("2.11.0+cu130")) == breaking
    assert compiled_mod.graph_breaking("2.14.1") == compiled_mod.graph_breaking("2.15.0") == {}
    units, _ = find_units(tiny_llama())
    assert any(breaking <= set(u.options) for u in units)
    old = compiled_mod.without_graph_breaks(units, "2.11.0")
    assert [u.path for u in old] == [u.path for u in units]
    for u, was in zip(old, units):
        assert u.options == tuple(o for o in was.options if o not in breaking)
        for o in breaking & set(was.options):
            assert "HOP: unsafe side effect" in u.why_not[o]
    assert compiled_mod.without_graph_breaks(units, "2.14.1") == units


def test_a_compiled_plan_at_plain_compiled_peak_changes_nothing():
    model = tiny_llama()
    first = ckpt_ext.plan(model, INPUTS, 10**15, compiled=True)
    assert first.compiled and set(first.choices.values()) == {"none"}
    assert first.compile_memory_budget is None and first.compile_options == {}
    assert first.measured_peak_bytes == first.plain_peak_bytes == first.peak_bytes


@pytest.mark.parametrize("faster", ["plan", "compile"])
def test_a_compiled_plan_fits_and_takes_the_faster_step(monkeypatch, faster):
    """At a budget between the least compiled peak and plain's, where both the plan's own choice
    and one of compile's activation_memory_budget fractions fit: the candidate whose timed step
    is faster is chosen (the timings set here, so both branches run), and ``Plan.compile`` of it
    peaks within the budget and within 5 % of the prediction."""
    def timed_so(got, fraction, budget, inductor):
        if "seconds" in got:
            got["seconds"] = 0.5 if (fraction is not None) == (faster == "compile") else 1.0
        return got

    model, budget, p = planned_below_plain(monkeypatch, timed_so)
    assert p.measured_peak_bytes == p.peak_bytes <= budget
    assert "plan" in p.compiled_seconds and len(p.compiled_seconds) == 2  # both fit, both timed
    if faster == "compile":
        assert p.compile_memory_budget in compiled_mod.FRACTIONS
        assert set(p.choices.values()) == {"none"} and p.added_flops >= 0
        with pytest.warns(UserWarning, match="activation_memory_budget"):
            p.apply(copy.deepcopy(model))
        with pytest.raises(ValueError, match="backend='eager'"):
            p.compile(copy.deepcopy(model), backend="eager")
    else:
        assert p.compile_memory_budget is None and set(p.choices.values()) != {"none"}
        assert p.compile_options == {}  # it fit as inductor is configured
        assert all(Option(o) in OPTIONS for o in p.choices.values())
    breaking = compiled_mod.graph_breaking()
    assert not any(o in u.options for u in p.units for o in breaking)
    peak = measured_compiled(p.compile(copy.deepcopy(model), dynamic=False))
    assert peak <= budget and abs(peak - p.peak_bytes) <= 0.05 * p.peak_bytes


def test_a_check_that_fits_only_without_buffer_reuse_is_compiled_so(monkeypatch):
    """Where a choice's compiled check does not fit with inductor as configured (made so here),
    it is measured again with buffer reuse off (``compiled.REUSE_OFF``): the plan says so
    (``Plan.compile_options``, printed); ``Plan.compile`` compiles forward and backward with it
    (the peak as under the global setting, within the budget and the prediction);
    ``Plan.apply`` warns."""
    def over_as_configured(got, fraction, budget, inductor):
        if budget is not None and not inductor:  # a check or compile's budget: over it
            got = {**got, "peak": budget + 1}
        return got

    model, budget, p = planned_below_plain(monkeypatch, over_as_configured)
    assert p.compile_options == compiled_mod.REUSE_OFF and p.compile_memory_budget is None
    assert set(p.choices.values()) != {"none"} and p.peak_bytes <= budget
    assert "allow_buffer_reuse" in str(p)
    with pytest.warns(UserWarning, match="allow_buffer_reuse"):
        net, _ = p.apply(copy.deepcopy(model))
    with torch._inductor.config.patch(compiled_mod.REUSE_OFF):
        globally = measured_compiled(torch.compile(net, dynamic=False))
    planned = measured_compiled(p.compile(copy.deepcopy(model), dynamic=False))
    assert planned == globally <= budget
    assert abs(planned - p.peak_bytes) <= 0.05 * p.peak_bytes
    with pytest.raises(ValueError, match="allow_buffer_reuse"):
        p.compile(copy.deepcopy(model), backend="eager")
