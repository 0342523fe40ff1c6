"""ckpt_ext.fuse: what it swaps, what it leaves alone, and that the model computes the same thing.

Every converted model is compared against itself before the swap: outputs, input grads and every
parameter grad, in float64 (tight) and in the other supported dtypes (per-dtype bounds).
"""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import ckpt_ext
from ckpt_ext import FusedLinearTanh, fuse
from _ecosys import ActorCritic, BertPooler, Net, TinyBert, outputs_and_grads, rel_err

TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def assert_same_computation(before, after, inputs, dtype, grad_input=True):
    out_b, in_b, g_b = outputs_and_grads(before, *inputs, grad_input=grad_input)
    out_a, in_a, g_a = outputs_and_grads(after, *inputs, grad_input=grad_input)
    assert len(out_b) == len(out_a)
    for o_b, o_a in zip(out_b, out_a):
        assert o_a.dtype == o_b.dtype
        assert rel_err(o_a, o_b) <= TOL[dtype]
    for a, b in zip(in_a, in_b):
        assert rel_err(a, b) <= TOL[dtype]
    assert g_a.keys() == g_b.keys() and len(g_b) > 0
    for name in g_b:
        assert rel_err(g_a[name], g_b[name]) <= TOL[dtype] * 4, name


def count(model, cls):
    return sum(type(m) is cls for m in model.modules())


# ------------------------------------------------------------------------------------------------
# Real-world model shapes


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_actor_critic_mlp(dtype):
    torch.manual_seed(0)
    model = ActorCritic(dtype=dtype)
    before = copy.deepcopy(model)
    keys = list(model.state_dict())
    params = dict(model.named_parameters())

    fused, report = fuse(model)

    assert fused is model  # Sequential pairs are swapped in place
    assert len(report) == 4 and {s.how for s in report.swaps} == {"sequential"}
    assert [s.linear for s in report.swaps] == ["policy_net.0", "policy_net.2",
                                                "value_net.0", "value_net.2"]
    assert [type(m) for m in model.policy_net] == [FusedLinearTanh, nn.Identity] * 2
    assert list(model.state_dict()) == keys
    for name, p in model.named_parameters():
        assert p is params[name]  # shared, not copied
    obs = torch.randn(7, 11, dtype=dtype)
    assert_same_computation(before, model, [obs], dtype)


def test_bert_pooler_inside_untraceable_model():
    torch.manual_seed(0)
    model = TinyBert(dtype=torch.float64)
    before = copy.deepcopy(model)
    keys = list(model.state_dict())
    dense_w = model.pooler.dense.weight

    fused, report = fuse(model)

    assert fused is model
    assert [(s.where, s.linear, s.tanh, s.how) for s in report.swaps] == [
        ("pooler", "pooler.dense", "pooler.activation", "fx")]
    assert report.rewritten == ["pooler"]
    # The top-level forward has an optional mask and a data-dependent branch: reported, untouched.
    assert [p for p, _ in report.untraced] == [""]
    assert "TraceError" in report.untraced[0][1]
    assert isinstance(model.pooler, fx.GraphModule)
    assert type(model.pooler.dense) is FusedLinearTanh
    assert model.pooler.dense.weight is dense_w
    assert sorted(model.state_dict()) == sorted(keys)
    ids = torch.randint(0, 50, (3, 5))
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[0, 3:] = 0
    for args in ([ids], [ids, mask]):
        assert_same_computation(before, model, args, torch.float64, grad_input=False)


def test_bert_pooler_alone_is_a_graph_module():
    torch.manual_seed(0)
    pooler = BertPooler(16)
    before = copy.deepcopy(pooler)
    fused, report = fuse(pooler)
    # The pair is in the model's own forward: the returned model is a new GraphModule sharing
    # the parameters; the object passed in keeps computing the unfused forward.
    assert isinstance(fused, fx.GraphModule) and fused is not pooler
    assert report.rewritten == [""]
    assert fused.dense.weight is pooler.dense.weight and fused.dense.bias is pooler.dense.bias
    assert list(fused.state_dict()) == list(pooler.state_dict())
    assert_same_computation(before, fused, [torch.randn(4, 3, 16)], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_writeup_net(dtype):
    torch.manual_seed(0)
    model = Net(dtype=dtype)
    before = copy.deepcopy(model)
    fused, report = fuse(model)
    assert fused is model and len(report) == 3
    assert [s.linear for s in report.swaps] == ["block1.0", "block2.0", "block3.0"]
    assert type(model.linear1) is nn.Linear  # not followed by a tanh
    assert_same_computation(before, model, [torch.randn(9, 12, dtype=dtype)], dtype)


# ------------------------------------------------------------------------------------------------
# Sequential pass: checkpoints and optimizers


def test_old_checkpoint_loads_and_optimizer_keeps_updating():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
                          nn.Linear(8, 2))
    checkpoint = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built BEFORE the swap
    fuse(model)
    assert type(model[2][0]) is FusedLinearTanh and type(model[2][1]) is nn.Identity
    model.load_state_dict(checkpoint, strict=True)  # old keys load unchanged

    w0 = model[2][0].weight.detach().clone()
    model(torch.randn(5, 6)).pow(2).sum().backward()
    opt.step()
    assert not torch.equal(model[2][0].weight, w0)  # the optimizer's tensor is the fused one's
    # SGD's own update formula (one rounding: add with alpha), so the comparison can be exact
    assert torch.equal(model[2][0].weight, w0.add(model[2][0].weight.grad, alpha=-0.1))


# ------------------------------------------------------------------------------------------------
# fx pass: every way to write linear then tanh


class FunctionalForms(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.lin = nn.Linear(10, 7)
        self.act = nn.Tanh()
        self.w = nn.Parameter(torch.randn(5, 7) / 3)
        self.register_buffer("b", torch.randn(5))

    def forward(self, x):
        h = self.lin(x)
        if self.form == "torch.tanh":
            h = torch.tanh(h)
        elif self.form == "F.tanh":
            h = F.tanh(h)
        elif self.form == ".tanh()":
            h = h.tanh()
        else:
            h = self.act(h)
        return torch.tanh(F.linear(h, self.w, self.b))  # functional linear, buffer bias


@pytest.mark.parametrize("form", ["torch.tanh", "F.tanh", ".tanh()", "nn.Tanh"])
def test_fx_forms(form):
    torch.manual_seed(0)
    model = FunctionalForms(form).double()
    before = copy.deepcopy(model)
    fused, report = fuse(model)
    assert isinstance(fused, fx.GraphModule) and len(report) == 2
    assert report.swaps[0].linear == "lin" and report.swaps[1].linear == "F.linear"
    # F.tanh is `input.tanh()` in Python, so fx records it as the method call.
    assert report.swaps[0].tanh == {"nn.Tanh": "act", "F.tanh": ".tanh()"}.get(form, form)
    assert type(fused.lin) is FusedLinearTanh and fused.lin.weight is model.lin.weight
    assert fused.w is model.w and fused.b is model.b
    assert list(fused.state_dict()) == list(model.state_dict())
    # No tanh and no plain linear is left in the graph: both pairs run as the fused op.
    targets = [n.target for n in fused.graph.nodes]
    assert targets.count(ckpt_ext.linear_tanh) == 1 and "tanh" not in targets
    assert not any(t in (torch.tanh, F.tanh, F.linear) for t in targets)
    assert_same_computation(before, fused, [torch.randn(3, 4, 10, dtype=torch.float64)],
                            torch.float64)


def test_linear_called_twice_keeps_its_module():
    # The same Linear is called once before a tanh and once not: the module stays an nn.Linear
    # and the fused site calls the op on its weight and bias.
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x):
            return torch.tanh(self.lin(x)) + self.lin(x)

    torch.manual_seed(0)
    model = M().double()
    before = copy.deepcopy(model)
    fused, report = fuse(model)
    assert len(report) == 1 and type(fused.lin) is nn.Linear
    assert_same_computation(before, fused, [torch.randn(4, 6, dtype=torch.float64)],
                            torch.float64)


# ------------------------------------------------------------------------------------------------
# What is left alone


class UsedTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return torch.tanh(h) + h  # the Linear's output has a second user


class MyLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


@pytest.mark.parametrize("make,skip_reason", [
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU()), None),
    (lambda: nn.Sequential(nn.Tanh(), nn.Linear(4, 4)), None),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0), nn.Tanh()), None),
    (lambda: nn.Sequential(nn.Tanh()), None),
    (UsedTwice, "its output has 2 users"),
    (lambda: nn.Sequential(MyLinear(4, 4), nn.Tanh()), "MyLinear subclasses nn.Linear"),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh()).apply(_hook), "hooks"),
])
def test_leaves_non_matches_alone(make, skip_reason):
    torch.manual_seed(0)
    model = make()
    kinds = [type(m) for m in model.modules()]
    x = torch.randn(3, 4)
    ref = model(x)
    fused, report = fuse(model)
    assert fused is model and len(report) == 0 and report.rewritten == []
    assert [type(m) for m in model.modules()] == kinds
    assert torch.equal(fused(x), ref)
    if skip_reason is None:
        assert report.skipped == []
    else:
        assert len(report.skipped) == 1 and skip_reason in report.skipped[0].reason
        assert skip_reason in str(report)


def _hook(m):
    if type(m) is nn.Linear:
        m.register_forward_hook(lambda mod, inp, out: None)


def test_forward_with_optional_argument_is_not_rewritten():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, scale=None):
            y = torch.tanh(self.lin(x))
            return y if scale is None else y * scale

    model = M()
    fused, report = fuse(model)
    assert fused is model and len(report) == 0 and type(model.lin) is nn.Linear
    assert report.skipped[0].linear == "lin" and "scale=None" in report.skipped[0].reason
    x = torch.randn(2, 4)
    assert torch.equal(model(x, scale=3.0), torch.tanh(model.lin(x)) * 3.0)


def test_untraceable_model_falls_back_to_sequential_pass():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.seq = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > 0:  # fx cannot trace a branch on data
                return torch.tanh(self.lin(self.seq(x)))
            return self.seq(x)

    torch.manual_seed(0)
    model = DataDependent().double()
    before = copy.deepcopy(model)
    fused, report = fuse(model)
    assert fused is model
    assert [s.linear for s in report.swaps] == ["seq.0"]
    assert len(report.untraced) == 1 and report.untraced[0][0] == ""
    assert "TraceError" in report.untraced[0][1]
    assert "not traced by torch.fx, only its nn.Sequential pairs are fused" in str(report)
    x = torch.randn(3, 4, dtype=torch.float64).abs()
    assert_same_computation(before, model, [x], torch.float64)
    assert_same_computation(before, model, [-x], torch.float64)


# ------------------------------------------------------------------------------------------------
# dry run, idempotence, sharing, devices, serialisation


def _mixed_model():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk = nn.Sequential(nn.Linear(5, 8), nn.Tanh())
            self.pooler = BertPooler(8)
            self.head = nn.Linear(8, 8)

        def forward(self, x):
            return torch.tanh(self.head(self.pooler(self.trunk(x))))

    torch.manual_seed(0)
    return Mixed()


def test_dry_run_reports_without_changing():
    model = _mixed_model()
    modules = [(n, m) for n, m in model.named_modules()]
    dry = fuse(model, dry_run=True)
    assert dry.model is model and dry.report.dry_run
    assert [(n, m) for n, m in model.named_modules()] == modules  # same objects, same places
    assert "would fuse 3 Linear->Tanh pair(s)" in str(dry.report)
    real = fuse(model).report
    assert dry.report.swaps == real.swaps and dry.report.rewritten == real.rewritten


def test_running_twice_changes_nothing():
    model = _mixed_model()
    x = torch.randn(2, 3, 5)
    once, report1 = fuse(model)
    assert len(report1) == 3 and isinstance(once, fx.GraphModule)
    ref = once(x)
    twice, report2 = fuse(once)
    assert twice is once and len(report2) == 0 and report2.rewritten == []
    assert [type(m) for m in twice.modules()] == [type(m) for m in once.modules()]
    assert torch.equal(twice(x), ref)


def test_shared_module_fused_everywhere():
    class Shared(nn.Module):
        def __init__(self, pooler):
            super().__init__()
            self.a = pooler
            self.b = pooler

        def forward(self, x):
            return self.a(x) + self.b(x)

    model = Shared(BertPooler(6))
    fused, report = fuse(model)
    assert fused is model and len(report) == 1
    assert model.a is model.b and isinstance(model.a, fx.GraphModule)


def test_trace_false_only_sequential():
    model = _mixed_model()
    fused, report = fuse(model, trace=False)
    assert fused is model and [s.how for s in report.swaps] == ["sequential"]
    assert type(model.pooler) is BertPooler


def test_meta_device_and_whole_model_pickle():
    model = _mixed_model()
    fused, _ = fuse(model)
    # torch.save of the whole converted model (a GraphModule) round-trips.
    buf = io.BytesIO()
    torch.save(fused, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(2, 3, 5)
    assert torch.equal(loaded(x), fused(x))
    # A model on the meta device (deferred init) converts and traces shapes without memory.
    meta = _mixed_model().to("meta")
    fused_meta, report = fuse(meta)
    assert len(report) == 3
    assert fused_meta(torch.empty(2, 3, 5, device="meta")).shape == (2, 8)


@pytest.mark.filterwarnings("ignore:Complex modules")
def test_unsupported_dtype_left_alone():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh()).to(torch.complex64)
    fused, report = fuse(model)
    assert len(report) == 0 and type(model[0]) is nn.Linear
    assert "complex64 is not supported" in report.skipped[0].reason


@pytest.mark.skipif(not (torch.cuda.is_available() and ckpt_ext.WITH_CUDA),
                    reason="CUDA variant: needs a GPU and a CUDA build of ckpt_ext")
def test_cuda_model():
    torch.manual_seed(0)
    model = Net().cuda()
    before = copy.deepcopy(model)
    fused, report = fuse(model)
    assert len(report) == 3 and model.block1[0].weight.is_cuda
    assert_same_computation(before, model, [torch.randn(9, 12, device="cuda")], torch.float32)


def test_rejects_non_module():
    with pytest.raises(TypeError, match="expects an nn.Module, got function"):
        fuse(lambda x: x)


def test_in_place_ops_after_a_fused_pair():
    # Models modify activations in place (residual `h += x`, Dropout(inplace=True)); the fused
    # op's output must allow it, as a plain tanh output does when nothing saved it.
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Dropout(0.0, inplace=True))

        def forward(self, x):
            h = self.block(x)
            h += x
            return h

    torch.manual_seed(0)
    model = Residual().double()
    x = torch.randn(4, 3, 6, dtype=torch.float64)
    # The reference clones tanh's output: stock tanh saves it for backward, so an in-place op on
    # it is an autograd error there; the fused op saves only x, so it needs no clone.
    ref = copy.deepcopy(model)
    ref.forward = lambda inp: ref.block[:2](inp).clone().add_(inp)
    fused, report = fuse(model)
    assert len(report) == 1
    assert_same_computation(ref, fused, [x], torch.float64)
