"""ckpt_ext.fuse with every activation of ckpt_ext.ACTIVATIONS: the recognition table against the
reference formulas, each module and functional spelling fused and computing what an unfused deep
copy computes (float64: outputs and every gradient), the bytes per row the report says each unit
frees against what autograd keeps, the member classes and their pickles, what is left alone and
why, and real models: transformers' BertModel and DeepXDE's FNN (test extras; skipped, with the
reason, where not installed)."""
from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ckpt_ext import fuse
from ckpt_ext.convert import RunActivation, RunLinear, member_class
from ckpt_ext.convert.runtime import _OwnerForward
from ckpt_ext.convert.facts import module_activation
from _ecosys import (assert_same_outputs_and_grads, kept_bytes, outputs_and_grads, rel_err,
                     saved_activation_bytes)
from _fuse_models import bert, distilbert
from reference import ACTIVATION_REF, measured

# Before transformers is imported: it reads these at import time.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

F64 = torch.float64
# Measured (CPU, float64; CKPT_EXT_MEASURE): outputs and every gradient within 3.6e-16 of the
# unfused copy's, relative. TOL is ~5x that.
TOL = 2e-15

MODULES = {  # id -> (activation, module factory)
    "nn.Tanh": ("tanh", nn.Tanh), "nn.GELU": ("gelu", nn.GELU),
    "nn.GELU(tanh)": ("gelu_tanh", lambda: nn.GELU(approximate="tanh")),
    "nn.SiLU": ("silu", nn.SiLU), "nn.Sigmoid": ("sigmoid", nn.Sigmoid),
    "nn.Softplus": ("softplus", nn.Softplus), "nn.ReLU": ("relu", nn.ReLU),
    "nn.ReLU(inplace)": ("relu", lambda: nn.ReLU(inplace=True)),
}
FUNCTIONS = {  # spelling -> (activation, function, the report's label: what fx records)
    "torch.tanh": ("tanh", torch.tanh, "torch.tanh"), "F.tanh": ("tanh", F.tanh, ".tanh()"),
    ".tanh()": ("tanh", lambda h: h.tanh(), ".tanh()"), "F.gelu": ("gelu", F.gelu, "F.gelu"),
    "F.gelu(tanh)": ("gelu_tanh", lambda h: F.gelu(h, approximate="tanh"), "F.gelu"),
    "F.silu": ("silu", F.silu, "F.silu"),
    "torch.sigmoid": ("sigmoid", torch.sigmoid, "torch.sigmoid"),
    "F.sigmoid": ("sigmoid", F.sigmoid, ".sigmoid()"),
    "F.softplus": ("softplus", F.softplus, "F.softplus"),
    "F.softplus(1, 20)": ("softplus", lambda h: F.softplus(h, 1, 20), "F.softplus"),
    "torch.relu": ("relu", torch.relu, "torch.relu"), "F.relu": ("relu", F.relu, "F.relu"),
    "F.relu(inplace)": ("relu", lambda h: F.relu(h, inplace=True), "F.relu"),
    ".relu()": ("relu", lambda h: h.relu(), ".relu()"),
    "torch.sin": ("sin", torch.sin, "torch.sin"), ".sin()": ("sin", lambda h: h.sin(), ".sin()"),
}
# What stock autograd keeps per inner layer of a run, in tensors of the layer's width: tanh,
# sigmoid and relu their output (the next Linear's input), the others z and act(z).
TENSORS_PER_LAYER = {"tanh": 1, "sigmoid": 1, "relu": 1, "gelu": 2, "gelu_tanh": 2, "silu": 2,
                     "softplus": 2, "sin": 2}


def _need(module: str):
    return pytest.importorskip(module, reason=f"{module} is not installed (pip install -r "
                                              f"requirements.txt installs it)")


def assert_same(before, after, *inputs, tol=TOL):
    assert_same_outputs_and_grads("fuse_activations.float64", tol, before, after, *inputs)


def freed(before, after, x):
    """Bytes plain autograd keeps that the fused model does not, by both meters (they agree)."""
    saved = saved_activation_bytes(before, x) - saved_activation_bytes(after, x)
    assert kept_bytes(before, x) - kept_bytes(after, x) == saved
    return saved


class Children(nn.Module):
    """fc1, act1, fc2, act2, fc3 called one after the other: a run of members."""

    def __init__(self, act, last_act=False):
        super().__init__()
        self.fc1, self.act1 = nn.Linear(6, 16), act()
        self.fc2, self.act2 = nn.Linear(16, 12), act()
        self.fc3 = nn.Linear(12, 3)
        self.act3 = act() if last_act else nn.Identity()

    def forward(self, x):
        return self.act3(self.fc3(self.act2(self.fc2(self.act1(self.fc1(x))))))


class Functional(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.act = act
        self.l1, self.l2, self.l3 = nn.Linear(6, 16), nn.Linear(16, 12), nn.Linear(12, 3)

    def forward(self, x):
        return self.l3(self.act(self.l2(self.act(self.l1(x)))))


# ------------------------------------------------------------------------------------------------
# The recognition table against the reference formulas


def _table_cases():
    cases = [(spelling, name, make) for spelling, (name, make) in MODULES.items()]
    try:
        import transformers.activations as ta
    except ImportError:
        return cases
    for key, name in (("gelu", "gelu"), ("gelu_python", "gelu"), ("gelu_new", "gelu_tanh"),
                      ("gelu_pytorch_tanh", "gelu_tanh"), ("gelu_python_tanh", "gelu_tanh"),
                      ("gelu_accurate", "gelu_tanh"), ("silu", "silu"), ("swish", "silu"),
                      ("relu", "relu"), ("sigmoid", "sigmoid"), ("tanh", "tanh")):
        cases.append((f"ACT2FN[{key!r}]", name, lambda key=key: ta.ACT2FN[key]))
    return cases


@pytest.mark.parametrize("spelling,name,make", _table_cases(), ids=lambda v: v
                         if isinstance(v, str) else "")
def test_recognised_module_computes_its_activation(spelling, name, make):
    m = make()
    assert module_activation(m) == (name, None)
    z = torch.cat([torch.linspace(-40, 40, 4001, dtype=F64), torch.randn(1000, dtype=F64)])
    # transformers' Python formulas round differently from ATen's: measured <= 2.1e-18.
    assert measured("fuse_activations.table", rel_err(m(z.clone()), ACTIVATION_REF[name](z))) \
        <= 1e-16, spelling


def test_transformers_near_matches_are_left_alone_with_the_reason():
    ta = _need("transformers.activations")
    z = torch.linspace(-6, 6, 1001, dtype=F64)
    fast = ta.FastGELUActivation()
    assert "rounded constant" in module_activation(fast).problem
    # Why "exactly" matters: FastGELU is gelu_tanh only to 1.7e-13, 1e5x the formulas above.
    assert rel_err(fast(z), ACTIVATION_REF["gelu_tanh"](z)) > 1e-14
    model = nn.Sequential(nn.Linear(4, 8), fast, nn.Linear(8, 2)).double()
    _, report = fuse(model)
    assert len(report) == 0 and "rounded constant" in report.near_misses[0].why


# ------------------------------------------------------------------------------------------------
# Each spelling fused: the same computation, the figures the report gives


@pytest.mark.parametrize("spelling", list(MODULES))
def test_module_run_in_a_sequential(spelling):
    name, act = MODULES[spelling]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), act(), nn.Linear(16, 12), act(),
                          nn.Linear(12, 3)).double()
    before = copy.deepcopy(model)
    _, report = fuse(model)
    (d,) = report.fused
    assert (d.layers, d.activation, d.how) == (tuple("01234"), name, "sequential")
    assert d.unit == ("tanh_mlp, 3 layers 6->16->12->3" if name == "tanh" else
                      f"mlp {name}, 3 layers 6->16->12->3")
    assert d.bytes_per_row == TENSORS_PER_LAYER[name] * (16 + 12) * 8
    x = torch.randn(7, 6, dtype=F64)
    assert_same(before, model, x)
    assert freed(before, model, x) == 7 * d.bytes_per_row


@pytest.mark.parametrize("spelling", list(MODULES))
def test_module_run_of_children_with_its_trailing_activation(spelling):
    name, act = MODULES[spelling]
    torch.manual_seed(0)
    model = Children(act, last_act=True).double()
    before = copy.deepcopy(model)
    _, report = fuse(model)
    (d,) = report.fused
    assert d.layers == ("fc1", "act1", "fc2", "act2", "fc3", "act3") and d.how == "children"
    assert d.activation == name and d.unit.endswith(f"last {name}")
    # The trailing activation's output leaves the model: not kept; its own saved tensor is freed.
    assert d.bytes_per_row == (TENSORS_PER_LAYER[name] * (16 + 12) + 3) * 8
    for path in ("act1", "act2", "act3"):
        m, plain = model.get_submodule(path), before.get_submodule(path)
        assert type(m) is member_class(type(plain)) and isinstance(m, type(plain))
        assert isinstance(m, RunActivation) and type(m).__name__ == f"Run{type(plain).__name__}"
    assert type(model.fc1) is RunLinear
    x = torch.randn(5, 6, dtype=F64)
    assert_same(before, model, x)
    assert freed(before, model, x) == 5 * d.bytes_per_row
    widths = {"fc1": 6, "act1": 16, "fc2": 16, "act2": 12, "fc3": 12, "act3": 3}
    for path, width in widths.items():  # each called on its own: the module it was
        h = torch.randn(3, width, dtype=F64)
        assert torch.equal(model.get_submodule(path)(h.clone()), before.get_submodule(path)(h))


@pytest.mark.parametrize("spelling", list(FUNCTIONS))
def test_functional_spelling_fused_in_a_region_or_by_a_rewrite(spelling):
    name, fn, label = FUNCTIONS[spelling]
    torch.manual_seed(0)
    model = Functional(fn).double()
    before = copy.deepcopy(model)
    # plain fuse: the function calls run on a zero-width placeholder inside the forward's
    # region; a lambda is code whose paths fuse does not follow there
    in_region = copy.deepcopy(model)
    _, plain = fuse(in_region)
    if getattr(fn, "__name__", "") == "<lambda>":
        assert len(plain) == 0 and "calls " in str(plain) and "<lambda>" in str(plain)
    else:
        (d,) = plain.fused
        assert d.layers == ("l1", label, "l2", label, "l3") and d.how == "children"
        x = torch.randn(4, 6, dtype=F64)
        assert_same(before, in_region, x)
        assert freed(before, in_region, x) == 4 * d.bytes_per_row
    _, report = fuse(model, rewrite=True)
    (d,) = report.fused
    assert d.layers == ("l1", label, "l2", label, "l3") and d.activation == name
    op = "ckpt_ext_ops_tanh_mlp(" if name == "tanh" else "ckpt_ext_ops_mlp("
    assert report.rewritten == [""] and op in model.forward.source
    x = torch.randn(4, 6, dtype=F64)
    assert_same(before, model, x)
    assert freed(before, model, x) == 4 * d.bytes_per_row == \
        4 * TENSORS_PER_LAYER[name] * (16 + 12) * 8


@pytest.mark.parametrize("name", ["tanh", "gelu", "sigmoid", "silu", "relu"])
@pytest.mark.parametrize("policy", ["memory", "all"])
def test_lone_pairs_free_what_the_report_says(name, policy):
    """A lone Linear -> act pair before a LayerNorm (which keeps the pair's output): an
    activation that keeps its input (GELU, SiLU) frees that input fused; one that keeps its
    output (Tanh, Sigmoid, ReLU) frees nothing there, and is left alone under policy="memory"."""
    act = {"tanh": nn.Tanh, "gelu": nn.GELU, "sigmoid": nn.Sigmoid, "silu": nn.SiLU,
           "relu": nn.ReLU}[name]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), act(), nn.LayerNorm(10)).double()
    with torch.no_grad():  # else sum(out²) is constant in the input: its gradient is rounding
        model[2].weight.uniform_(0.5, 1.5)
        model[2].bias.uniform_(-1, 1)
    before = copy.deepcopy(model)
    _, report = fuse(model, policy=policy)
    keeps_input = TENSORS_PER_LAYER[name] == 2
    if keeps_input or policy == "all":
        (d,) = report.fused
        assert d.layers == ("0", "1") and d.bytes_per_row == (80 if keeps_input else 0)
    else:
        assert len(report) == 0 and "kept by 2 (LayerNorm keeps its input)" in \
            report.near_misses[0].why
    x = torch.randn(6, 6, dtype=F64)
    assert_same(before, model, x)
    assert freed(before, model, x) == 6 * report.bytes_per_row


# ------------------------------------------------------------------------------------------------
# Left alone, and why


def test_non_default_softplus_is_left_alone_with_the_reason():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Softplus(beta=2), nn.Linear(8, 8),
                          nn.Softplus(threshold=10), nn.Linear(8, 2)).double()
    before = copy.deepcopy(model)
    _, report = fuse(model)
    assert len(report) == 0 and type(model) is nn.Sequential
    assert [(d.layers, d.why) for d in report.near_misses] == [
        (("0", "1"), "nn.Softplus(beta=2, threshold=20.0): the fused op computes softplus "
                     "with beta=1, threshold=20 only"),
        (("2", "3"), "nn.Softplus(beta=1.0, threshold=10): the fused op computes softplus "
                     "with beta=1, threshold=20 only")]
    functional = Functional(lambda h: F.softplus(h, beta=2)).double()
    _, report = fuse(functional, rewrite=True)
    assert len(report) == 0 and report.rewritten == []
    assert "called with beta=2, threshold=20" in report.near_misses[0].why
    x = torch.randn(3, 4, dtype=F64)
    assert torch.equal(model(x), before(x))


def test_subclass_with_its_own_forward_is_not_an_activation():
    class ScaledGELU(nn.GELU):
        def forward(self, x):
            return 2 * super().forward(x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), ScaledGELU(), nn.Linear(8, 2)).double()
    _, report = fuse(model)
    assert len(report) == 0 and type(model[1]) is ScaledGELU
    assert "ScaledGELU subclasses nn.GELU" in report.near_misses[0].why


def test_a_run_mixes_activations():
    """Each layer's activation is its own: one unit, not a stretch per activation (more:
    test_fuse_mixed.py)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    before = copy.deepcopy(model)
    _, report = fuse(model)
    assert [(d.layers, d.activation) for d in report.fused] == [
        (tuple("0123456"), "gelu, tanh, tanh")]
    assert report.fused[0].unit == "mlp mixed (gelu, tanh, tanh), 4 layers 4->8->8->8->2"
    x = torch.randn(5, 4, dtype=F64)
    assert_same(before, model, x)
    assert freed(before, model, x) == 5 * report.bytes_per_row


def test_activation_changed_after_fuse_computes_member_by_member():
    torch.manual_seed(0)
    model = Children(nn.GELU).double()
    before = copy.deepcopy(model)
    fuse(model)
    for m in (model, before):
        m.act2.approximate = "tanh"  # no longer the run's gelu
    x = torch.randn(5, 6, dtype=F64)
    assert_same(before, model, x)
    assert freed(before, model, x) == 0
    for m in (model, before):
        m.act2.approximate = "none"
    assert freed(before, model, x) == 5 * 2 * (16 + 12) * 8  # fused again


# ------------------------------------------------------------------------------------------------
# Member classes: pickles, copies, undoing


def _members_model():
    acts = [nn.GELU, nn.SiLU, nn.Softplus, nn.Sigmoid, nn.ReLU]
    try:
        import transformers.activations as ta
        acts += [ta.GELUActivation, ta.NewGELUActivation, ta.SiLUActivation]
    except ImportError:
        pass
    return nn.ModuleList(Children(act) for act in acts).double()


_LOAD = """
import pickle, sys, torch
import ckpt_ext.convert.runtime as runtime
assert not any(c.__name__ == "RunGELU" for c in runtime._MEMBER_CLASSES.values())
models, x, want = pickle.loads(sys.stdin.buffer.read())
for m, w in zip(models, want):
    assert type(m.act1).__module__ == "ckpt_ext.convert.runtime", type(m.act1)
    assert torch.equal(m(x), w)
print("ok", len(models))
"""


def test_member_classes_pickle_copy_and_undo():
    torch.manual_seed(0)
    models = _members_model()
    before = copy.deepcopy(models)
    for m in models:
        fuse(m)
    x = torch.randn(4, 6, dtype=F64)
    want = [m(x).detach() for m in models]
    data = pickle.dumps((models, x, want))
    assert b"_new_member" in data  # a member class made at run time pickles as its base's
    for loaded in (pickle.loads(data)[0], copy.deepcopy(models)):
        for m, b, w in zip(loaded, before, want):
            assert type(m.act1) is member_class(type(b.act1)) and torch.equal(m(x), w)
            assert_same(b, m, x)
    # In a process where no member class was made yet, the pickle loads and computes the same.
    here = os.path.dirname(os.path.abspath(__file__))  # Children, by module and name
    path = os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _LOAD], input=data, capture_output=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 0 and done.stdout.split()[0] == b"ok", done.stderr.decode()[-2000:]
    for m, b in zip(models, before):  # fuse without the analysis: the members are undone
        fuse(m, trace=False)
        assert [type(c) for c in m.children()] == [type(c) for c in b.children()]
        assert "forward" not in vars(m)


# ------------------------------------------------------------------------------------------------
# Real models: transformers' BertModel, DeepXDE's FNN


def _bert(hidden_act: str, chunk: int = 0):
    _need("transformers")
    return bert(hidden_act=hidden_act, chunk_size_feed_forward=chunk).double()


class _BertOutputs(nn.Module):
    """Both of BERT's outputs, as one tensor."""

    def __init__(self, bert, mask):
        super().__init__()
        self.bert, self.mask = bert, mask

    def forward(self, ids):
        out = self.bert(input_ids=ids, attention_mask=self.mask)
        return torch.cat([out.last_hidden_state.flatten(), out.pooler_output.flatten()])


class _LastHidden(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).last_hidden_state


def _bert_matches(plain_model, fused_model, ids):
    """The fused BertModel's outputs and gradients against the unfused copy's (float64)."""
    mask = torch.ones(ids.shape, dtype=torch.long)
    mask[1, 5:] = 0
    plain, fused = _BertOutputs(plain_model, mask), _BertOutputs(fused_model, mask)
    out_b, _, g_b = outputs_and_grads(plain, ids, grad_input=False)
    out_f, _, g_f = outputs_and_grads(fused, ids, grad_input=False)
    _same_transformer(out_f, g_f, out_b, g_b)
    return plain, fused


def _same_transformer(out_f, g_f, out_b, g_b):
    for a, b in zip(out_f, out_b):
        assert rel_err(a, b) <= 1e-14  # measured: bit-identical
    # As in test_libraries: each gradient within 1e-12 of its own norm, with a floor of 1e-15 of
    # the largest (attention's key bias has a zero gradient up to rounding).
    floor = 1e-15 * max(g.norm().item() for g in g_b.values())
    assert g_f.keys() == g_b.keys()
    for n in g_b:
        assert (g_f[n] - g_b[n]).norm().item() <= 1e-12 * g_b[n].norm().item() + floor, n


_BERT_MLP = [(f"encoder.layer.{i}.intermediate.dense",
              f"encoder.layer.{i}.intermediate.intermediate_act_fn",
              f"encoder.layer.{i}.output.dense") for i in range(2)]


@pytest.mark.parametrize("hidden_act,name,formula", [
    ("gelu", "gelu", False), ("gelu_python", "gelu", True), ("gelu_new", "gelu_tanh", True),
    ("gelu_pytorch_tanh", "gelu_tanh", False), ("silu", "silu", False)])
def test_bert_mlp_fused(hidden_act, name, formula):
    """BERT's MLP, BertIntermediate's dense and activation then BertOutput's dense, is one run.
    BertLayer.forward (optional arguments) is not analysed; the method it hands to
    apply_chunking_to_forward, feed_forward_chunk, is, and marks the region. The run crosses
    BertIntermediate.forward (its output) and BertOutput.forward (its first argument); dropout,
    the residual add and LayerNorm follow in BertOutput. It frees z and act(z). An activation
    written as a Python formula (``formula``) keeps more than that unfused, and the report counts
    what it keeps: fusing frees the report's figure either way."""
    model = _bert(hidden_act)
    before = copy.deepcopy(model)
    _, report = fuse(model)
    assert [(d.layers, d.how, d.activation) for d in report.fused] == [
        (run, "across", name) for run in _BERT_MLP]
    assert all(d.bytes_per_row > 2 * 64 * 8 if formula else d.bytes_per_row == 2 * 64 * 8
               for d in report.fused)
    assert all("inside encoder.layer." in d.why and ".feed_forward_chunk" in d.why
               for d in report.fused)
    for i in range(2):
        layer, plain = model.encoder.layer[i], before.encoder.layer[i]
        assert type(layer) is type(plain) and type(layer.intermediate) is type(plain.intermediate)
        assert type(layer.intermediate.dense) is RunLinear and type(layer.output.dense) is RunLinear
        assert type(layer.intermediate.intermediate_act_fn) is \
            member_class(type(plain.intermediate.intermediate_act_fn))
        assert isinstance(vars(layer)["feed_forward_chunk"], _OwnerForward)
        assert "forward" not in vars(layer) and "forward" not in vars(layer.intermediate)
    assert [d.layers for d in report.near_misses] == [("pooler.dense", "pooler.activation")]
    ids = torch.randint(0, 99, (3, 7))
    plain, fused = _bert_matches(before, model, ids)
    # a formula also keeps 0-dim scalars, which the allocator meter counts: saved tensors only
    saved = saved_activation_bytes(plain, ids) - saved_activation_bytes(fused, ids)
    assert saved == 3 * 7 * report.bytes_per_row
    if not formula:
        assert freed(plain, fused, ids) == saved


def test_bert_mlp_fused_in_chunks():
    """With chunk_size_feed_forward set, apply_chunking_to_forward calls feed_forward_chunk once
    per chunk of the sequence: each call computes its chunk's run, and keeps its input only."""
    model = _bert("gelu", chunk=4)
    before = copy.deepcopy(model)
    _, report = fuse(model)
    assert [d.layers for d in report.fused] == _BERT_MLP
    ids = torch.randint(0, 99, (3, 8))  # two chunks of 4 tokens
    plain, fused = _bert_matches(before, model, ids)
    assert freed(plain, fused, ids) == 3 * 8 * report.bytes_per_row


def test_bert_mlp_with_a_hook_is_computed_layer_by_layer():
    """A forward hook on BertIntermediate, registered after fusing, must see act(z): the run
    crosses BertIntermediate.forward, so each call with the hook computes layer by layer (and
    fused again once the hook is removed)."""
    model = _bert("gelu")
    before = copy.deepcopy(model)
    fuse(model)
    seen = []
    handle = model.encoder.layer[0].intermediate.register_forward_hook(
        lambda m, args, out: seen.append(out.shape[-1]))
    ids = torch.randint(0, 99, (2, 5))
    plain, fused = _bert_matches(before, model, ids)
    assert seen and set(seen) == {64}  # the intermediate width, every call
    hooked = saved_activation_bytes(fused, ids)
    handle.remove()
    assert saved_activation_bytes(fused, ids) == hooked - 2 * 5 * 2 * 64 * 8  # layer 0: z, act(z)


def test_distilbert_ffn_fused():
    """DistilBERT's FFN.forward calls its layers only through ff_chunk, the method it hands to
    apply_chunking_to_forward: that method is analysed in its place and marks the region of the
    run lin1 -> GELU -> lin2."""
    _need("transformers")
    model = distilbert().double()
    before = copy.deepcopy(model)
    _, report = fuse(model)
    runs = [tuple(f"transformer.layer.{i}.ffn.{n}" for n in ("lin1", "activation", "lin2"))
            for i in range(2)]
    assert [(d.layers, d.how, d.activation) for d in report.fused] == [
        (run, "children", "gelu") for run in runs]
    assert dict(report.not_analysed)["transformer.layer.0.ffn"].startswith(
        "its forward calls its children only through ff_chunk")
    ids = torch.randint(0, 99, (3, 7))
    plain, fused = _LastHidden(before), _LastHidden(model)
    out_b, _, g_b = outputs_and_grads(plain, ids, grad_input=False)
    out_f, _, g_f = outputs_and_grads(fused, ids, grad_input=False)
    _same_transformer(out_f, g_f, out_b, g_b)
    assert freed(plain, fused, ids) == 3 * 7 * report.bytes_per_row == 3 * 7 * 2 * (2 * 64 * 8)


def test_bert_with_a_near_gelu_is_left_alone():
    model = _bert("gelu_fast")
    _, report = fuse(model)
    assert len(report) == 0
    assert any("rounded constant" in d.why and d.layers[0].endswith("intermediate.dense")
               for d in report.near_misses)


def _deepxde():
    os.environ.setdefault("DDE_BACKEND", "pytorch")
    device = torch.get_default_device()
    try:  # deepxde makes a visible GPU torch's default device on import
        dde = _need("deepxde")
    finally:
        torch.set_default_device(device)
    if dde.backend.backend_name != "pytorch":
        pytest.skip(f"deepxde runs on {dde.backend.backend_name}, not pytorch (DDE_BACKEND)")
    return dde


# DeepXDE's activation names (deepxde.nn.activations.get) -> what fuse computes them as.
DEEPXDE_ACTIVATIONS = {"tanh": "tanh", "sin": "sin", "silu": "silu", "swish": "silu",
                       "gelu": "gelu", "sigmoid": "sigmoid", "relu": "relu"}


@pytest.mark.parametrize("activation", list(DEEPXDE_ACTIVATIONS))
def test_deepxde_fnn_trains_like_the_unfused_copy(activation):
    """DeepXDE's FNN calls its Linears from a ModuleList and its activation as a function
    (torch.sin, F.silu, ...): fused by a rewrite. A PINN loss (u'' through the fused op, twice
    differentiated) trained 5 SGD steps moves every parameter as the unfused copy."""
    dde = _deepxde()
    torch.manual_seed(0)
    net = dde.nn.FNN([1, 16, 16, 1], activation, "Glorot normal").double()
    plain = copy.deepcopy(net)
    _, report = fuse(net, rewrite=True)
    name = DEEPXDE_ACTIVATIONS[activation]
    assert [(d.how, d.activation) for d in report.fused] == [("rewrite", name)]
    assert report.fused[0].layers[::2] == ("linears.0", "linears.1", "linears.2")
    x = torch.linspace(-1, 1, 33, dtype=F64).unsqueeze(1)
    for m in (net, plain):
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        for _ in range(5):
            xx = x.clone().requires_grad_(True)
            u = m(xx)
            du = torch.autograd.grad(u.sum(), xx, create_graph=True)[0]
            d2u = torch.autograd.grad(du.sum(), xx, create_graph=True)[0]
            residual = d2u + torch.pi ** 2 * torch.sin(torch.pi * xx)
            loss = residual.pow(2).mean() + u[[0, -1]].pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    # sin's biases stay ~1e-19 (the problem is odd): each parameter within 1e-12 of its norm,
    # with a floor of 1e-15 of the largest. Measured: 2e-18 absolute.
    floor = 1e-15 * max(p.norm().item() for p in plain.parameters())
    for (n, p), q in zip(net.named_parameters(), plain.parameters()):
        assert (p - q).norm().item() <= 1e-12 * q.norm().item() + floor, n
    assert freed(plain, net, x) == 33 * report.bytes_per_row == \
        33 * 2 * TENSORS_PER_LAYER[name] * 16 * 8


@pytest.mark.parametrize("activation", ["elu", "selu"])
def test_deepxde_fnn_with_an_activation_fuse_has_not_is_left_alone(activation):
    dde = _deepxde()
    net = dde.nn.FNN([1, 16, 16, 1], activation, "Glorot normal").double()
    _, report = fuse(net, rewrite=True)
    assert len(report) == 0 and not report.rewritten
    assert type(net.linears[0]) is nn.Linear


def test_deepxde_fnn_with_one_activation_per_layer_is_one_mixed_run():
    """FNN with a list of activations (one per hidden layer) reads that list at each call: the
    guard holds a copy of it, so the rewritten forward runs while the list holds the same
    functions, and the class's forward once an entry is replaced in place."""
    dde = _deepxde()
    torch.manual_seed(0)
    net = dde.nn.FNN([1, 16, 16, 16, 1], ["tanh", "sin", "silu", "tanh"], "Glorot normal").double()
    plain = copy.deepcopy(net)
    _, report = fuse(net, rewrite=True)
    assert [(d.how, d.activation) for d in report.fused] == [("rewrite", "tanh, sin, silu")], \
        str(report)
    x = torch.linspace(-1, 1, 33, dtype=F64).unsqueeze(1).requires_grad_(True)
    a, b = plain(x), net(x)
    assert rel_err(b, a) <= 1e-14
    ga = torch.autograd.grad(a.sum(), [x, *plain.parameters()])
    gb = torch.autograd.grad(b.sum(), [x, *net.parameters()])
    assert all(rel_err(v, u) <= 1e-13 for u, v in zip(ga, gb))
    assert freed(plain, net, x.detach()) == 33 * report.bytes_per_row > 0
    net.activation[1] = torch.cos  # in place: the same list, another function
    plain.activation[1] = torch.cos
    assert torch.equal(net(x), plain(x))  # the class's forward: exactly the unfused model
