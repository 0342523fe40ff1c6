"""ckpt_ext.fuse: what it swaps, what it leaves alone, that the model computes the same thing, and
that the units it picks keep less.

Every converted model is compared against itself before the swap: outputs, input grads and every
parameter grad, in float64 (tight) and in the other supported dtypes (per-dtype bounds). The
"hazard" tests at the top each pin one way a converter can change what a model computes.
"""
from __future__ import annotations

import copy
import inspect
import io
import pickle
import pickletools
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ckpt_ext
from ckpt_ext import fuse
from ckpt_ext.convert import FusedSequential, RunLinear, RunTanh
from _ecosys import (ActorCritic, BertPooler, Net, TinyBert, kept_bytes, outputs_and_grads,
                     rel_err, saved_activation_bytes)

# Measured (this suite, CPU): outputs bit-identical; gradients <= 2e-16 (float64), 1.1e-7 (float32),
# 3.1e-3 (bfloat16), 5.2e-4 (float16) relative. TOL bounds outputs and input gradients, 4x TOL the
# parameter gradients.
TOL = {torch.float64: 1e-14, torch.float32: 1e-6, torch.bfloat16: 2e-2, torch.float16: 3e-3}


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


def kinds(model):
    return [(n, type(m)) for n, m in model.named_modules()]


def fused_layers(report):
    return [d.layers for d in report.fused]


# ------------------------------------------------------------------------------------------------
# Hazards: each pins one way a converter can change what a model computes


class Counting(nn.Module):
    """Side effects in forward: a call counter and a list of what it saw."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.seen = []
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                                 nn.Linear(16, 3))
        self.lin = nn.Linear(3, 3)
        self.act = nn.Tanh()

    def forward(self, x):
        self.calls += 1
        self.seen.append(x.shape[0])
        return self.act(self.lin(self.net(x)))


@pytest.mark.parametrize("dry_run", [True, False])
def test_hazard_tracing_leaves_no_side_effects(dry_run):
    torch.manual_seed(0)
    model = Counting().double()
    before = copy.deepcopy(model)
    _, report = fuse(model, dry_run=dry_run)
    # Tracing ran on a copy: the counter and the list are untouched (no fx Proxy in the list).
    assert model.calls == 0 and model.seen == []
    # The graph is analysed (what keeps which value), but a forward that changes a list it reads
    # may take another path next time: its pair is not made a run, and the report says why.
    assert report.not_analysed == []
    (miss,) = report.near_misses
    assert miss.layers == ("lin", "act") and "tracing its forward changed seen" in miss.why
    assert type(model.lin) is nn.Linear and type(model.act) is nn.Tanh  # its pair: not swapped
    # The Sequential's run does not depend on the parent's forward: fused (unless dry run).
    assert fused_layers(report) == [("net.0", "net.1", "net.2", "net.3", "net.4")]
    assert (type(model.net) is FusedSequential) is not dry_run
    if not dry_run:
        x = torch.randn(5, 4, dtype=torch.float64)
        assert_same_computation(before, model, [x], torch.float64)
        assert model.calls == before.calls == 1 and model.seen == before.seen == [5]


class ODEFunc(nn.Module):
    """A Neural-ODE dynamics function that counts its evaluations, with a functional tanh."""

    def __init__(self, dim=3, hidden=32):
        super().__init__()
        self.nfe = 0
        self.l1 = nn.Linear(dim, hidden)
        self.l2 = nn.Linear(hidden, hidden)
        self.l3 = nn.Linear(hidden, dim)

    def forward(self, t, y):
        self.nfe += 1
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(y)))))


def rk4(func, y, t0=0.0, t1=1.0, steps=4):
    """Fixed-step RK4, as odeint(method='rk4') runs it: 4 evaluations per step."""
    h = (t1 - t0) / steps
    t = t0
    for _ in range(steps):
        k1 = func(t, y)
        k2 = func(t + h / 2, y + h / 2 * k1)
        k3 = func(t + h / 2, y + h / 2 * k2)
        k4 = func(t + h, y + h * k3)
        y = y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        t += h
    return y


@pytest.mark.parametrize("rewrite", [False, True])
def test_hazard_ode_function_still_counts_its_evaluations(rewrite):
    torch.manual_seed(0)
    func = ODEFunc().double()
    before = copy.deepcopy(func)
    fused, report = fuse(func, rewrite=rewrite)
    y0 = torch.randn(5, 3, dtype=torch.float64)
    out, ref = rk4(fused, y0), rk4(before, y0)
    assert fused.nfe == before.nfe == 16  # a traced GraphModule in its place would count 0
    assert fused is func and report.not_analysed == []  # analysed: a pure count is no obstacle
    # one run either way: computed in the forward's region (the tanh calls run on a zero-width
    # placeholder, the class's forward counts), or by a rewritten forward that adds 1 to nfe
    # first, as the class's forward does
    assert [d.layers for d in report.fused] == [("l1", "torch.tanh", "l2", "torch.tanh", "l3")]
    assert [d.how for d in report.fused] == ["rewrite" if rewrite else "children"]
    assert report.rewritten == ([""] if rewrite else []) and "forward" in vars(func)
    assert rel_err(out, ref) <= 1e-13
    if not rewrite:
        return
    func.nfe = 5
    func(0.0, y0)
    assert func.nfe == 6
    clone = pickle.loads(pickle.dumps(func))
    clone(0.0, y0)
    assert clone.nfe == 7 and func.nfe == 6


class Policy(nn.Module):
    """A library's model: a forward whose pair is child modules, methods a training loop calls,
    attributes, and a functional pair that needs the opt-in rewrite."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(6, 6)
        self.activation = nn.Tanh()
        self.head = nn.Linear(6, 6)
        self.temperature = 2.0

    def forward(self, x):
        return torch.tanh(self.head(x)) + self.activation(self.dense(x))

    def predict(self, x):
        return self.forward(x).argmax(-1)

    def scaled(self, x):
        return self.forward(x) / self.temperature


@pytest.mark.parametrize("rewrite", [False, True])
def test_hazard_returns_the_users_object_class_and_methods(rewrite):
    torch.manual_seed(0)
    model = Policy().double()
    before = copy.deepcopy(model)
    fused, report = fuse(model, rewrite=rewrite)
    assert fused is model and type(model) is Policy and isinstance(model, Policy)
    assert type(model).forward is Policy.forward  # the class is untouched
    x = torch.randn(7, 6, dtype=torch.float64)
    # an argmax of outputs within 1e-12 (other kernels, not bitwise): the same index wherever the
    # two best outputs lie further apart than the bound lets them move
    top2 = before(x).topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 2e-12 * before(x).norm()
    assert clear.any() and torch.equal(model.predict(x)[clear], before.predict(x)[clear])
    assert rel_err(model.scaled(x), before.scaled(x)) <= 1e-12
    assert model.temperature == 2.0
    # dense -> activation: a run of children (the same objects, now RunLinear/RunTanh, computed
    # as one inside Policy.forward); head -> torch.tanh: only with the opt-in rewrite.
    assert type(model.dense) is RunLinear and type(model.activation) is RunTanh
    assert torch.equal(model.dense(x), before.dense(x))  # called alone: the Linear it was
    assert torch.equal(model.activation(x), torch.tanh(x))
    assert len(report) == (2 if rewrite else 1)
    assert "forward" in vars(model) and report.rewritten == ([""] if rewrite else [])
    assert (model.forward.source is not None) is rewrite
    assert "forward" not in vars(Policy())
    assert_same_computation(before, model, [x], torch.float64)


class TrainingBranch(nn.Module):
    def __init__(self, functional):
        super().__init__()
        self.functional = functional
        self.lin = nn.Linear(5, 5)
        self.act = nn.Tanh()

    def forward(self, x):
        h = self.lin(x)
        if self.training:
            return torch.tanh(h) if self.functional else self.act(h)
        return h * 0.5


@pytest.mark.parametrize("functional", [False, True])
def test_hazard_training_branch_is_not_baked_in(functional):
    torch.manual_seed(0)
    model = TrainingBranch(functional).double()
    before = copy.deepcopy(model)
    fused, report = fuse(model, rewrite=True)
    x = torch.randn(3, 5, dtype=torch.float64)
    for mode in (True, False):
        fused.train(mode)
        before.train(mode)
        assert torch.equal(fused(x), before(x)), f"train={mode}"
    assert len(report) == 0 and type(model.lin) is nn.Linear and "forward" not in vars(model)
    assert "different code in train() and eval()" in report.not_analysed[0][1]


def _mlp_policy(obs=8, hidden=64, act=4, dtype=torch.float32):
    return nn.Sequential(nn.Linear(obs, hidden, dtype=dtype), nn.Tanh(),
                         nn.Linear(hidden, hidden, dtype=dtype), nn.Tanh(),
                         nn.Linear(hidden, act, dtype=dtype))


def test_mlp_run_keeps_only_its_input_with_either_policy():
    """`Linear, Tanh, Linear, Tanh, Linear`: each tanh output is the next Linear's input, so
    fusing pair by pair would keep what plain keeps; the run keeps only its input, under
    policy="memory" and policy="all" alike. Exact bytes, two ways."""
    torch.manual_seed(0)
    plain = _mlp_policy()
    run, r_run = fuse(copy.deepcopy(plain))
    every, r_all = fuse(copy.deepcopy(plain), policy="all")
    rows = 256
    x = torch.randn(rows, 8)

    saved = {name: saved_activation_bytes(m, x) for name, m in
             (("plain", plain), ("run", run), ("all", every))}
    kept = {name: kept_bytes(m, x) for name, m in
            (("plain", plain), ("run", run), ("all", every))}
    act = rows * 64 * 4  # one float32 hidden activation
    assert saved["plain"] == rows * 8 * 4 + 2 * act  # input + 2 tanh outputs
    assert saved["run"] == saved["all"] == rows * 8 * 4  # the run's input only
    # The allocator meter agrees to the byte (it counts what forward allocated: not the input).
    assert kept == {k: v - rows * 8 * 4 for k, v in saved.items()}

    # The report's figures are these very bytes, and the cost of the recompute.
    assert len(r_run) == 1 and r_run.bytes_per_row * rows == saved["plain"] - saved["run"]
    (d,) = r_run.fused
    assert d.unit == "tanh_mlp, 3 layers 8->64->64->4" and d.how == "sequential"
    assert d.flops_per_row == 2 * (8 * 64 + 64 * 64)  # the two lower layers' forward GEMMs
    assert d.plain_flops_per_row == 6 * (8 * 64 + 64 * 64 + 64 * 4)
    assert [(e.layers, e.bytes_per_row, e.flops_per_row) for e in r_all.fused] == \
        [(d.layers, d.bytes_per_row, d.flops_per_row)]
    assert_same_computation(plain, run, [x.double().float()], torch.float32)
    assert_same_computation(plain, every, [x.double().float()], torch.float32)


# ------------------------------------------------------------------------------------------------
# Real-world model shapes


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_actor_critic_mlp(dtype):
    torch.manual_seed(0)
    model = ActorCritic(dtype=dtype)
    before = copy.deepcopy(model)
    keys = list(model.state_dict())
    params = dict(model.named_parameters())
    elements = [list(model.policy_net), list(model.value_net)]

    fused, report = fuse(model)

    assert fused is model
    # Each trunk is Linear, Tanh, Linear, Tanh and its output goes only to a Linear head that the
    # forward calls next: one run of 3 layers from the trunk into the head. The trunk computes it;
    # the head becomes a RunLinear holding its weight and bias.
    assert fused_layers(report) == [
        ("policy_net.0", "policy_net.1", "policy_net.2", "policy_net.3", "action_net"),
        ("value_net.0", "value_net.1", "value_net.2", "value_net.3", "value_head")]
    assert [d.how for d in report.fused] == ["across", "across"] and report.near_misses == []
    assert ("inside <model>.forward, policy_net computes the whole run and action_net passes its "
            "output on; called any other way, each computes its own layers") in report.fused[0].why
    assert type(model.policy_net) is FusedSequential and isinstance(model.policy_net, nn.Sequential)
    assert type(model.action_net) is RunLinear and type(model.value_head) is RunLinear
    assert isinstance(model.action_net, nn.Linear)
    assert [list(model.policy_net), list(model.value_net)] == elements  # same element objects
    assert list(model.state_dict()) == keys
    for name, p in model.named_parameters():
        assert p is params[name]  # shared, not copied
    isz = torch.finfo(dtype).bits // 8
    assert report.bytes_per_row == 2 * (2 * 64 * isz)  # per trunk, both tanh outputs
    obs = torch.randn(7, 11, dtype=dtype)
    assert_same_computation(before, model, [obs], dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_writeup_net(dtype):
    torch.manual_seed(0)
    model = Net(dtype=dtype)
    before = copy.deepcopy(model)
    fused, report = fuse(model)
    # Net.forward calls block1, block2, block3 one after another: one run across the three
    # Sequentials (each block's output is kept by the next block's Linear, so fusing block by
    # block freed only block3's output).
    assert fused is model and fused_layers(report) == [
        ("block1.0", "block1.1", "block2.0", "block2.1", "block3.0", "block3.1")]
    assert report.near_misses == [] and report.fused[0].how == "across"
    isz = torch.finfo(dtype).bits // 8
    assert report.bytes_per_row == 3 * 40 * isz and report.flops_per_row == 3 * 2 * 40 * 40
    assert "returned by the model" in report.fused[0].why
    assert type(model.linear1) is nn.Linear and type(model.block1) is FusedSequential
    assert_same_computation(before, model, [torch.randn(9, 12, dtype=dtype)], dtype)

    every = Net(dtype=dtype)
    every.load_state_dict(before.state_dict())
    _, report_all = fuse(every, policy="all")  # the same run: never less than "memory"
    assert fused_layers(report_all) == fused_layers(report)
    assert report_all.bytes_per_row == report.bytes_per_row
    assert_same_computation(before, every, [torch.randn(9, 12, dtype=dtype)], dtype)


def test_bert_pooler_inside_untraceable_model():
    torch.manual_seed(0)
    model = TinyBert(dtype=torch.float64)
    before = copy.deepcopy(model)
    keys = list(model.state_dict())
    dense_w = model.pooler.dense.weight

    # Default: the pooler's output leaves through a forward fx cannot use (an optional mask), so
    # whether it is kept is unknown: left alone, and the report says why. The encoder layer's
    # feed-forward block (torch's _ff_block) is a run.
    encoder_ff = (("encoder.linear1", "F.relu", "encoder.linear2"), "children")
    _, report = fuse(model)
    assert [(d.layers, d.how) for d in report.fused] == [encoder_ff]
    assert type(model.pooler.dense) is nn.Linear
    (miss,) = report.near_misses
    assert miss.layers == ("pooler.dense", "pooler.activation")
    assert "its caller <model> was not analysed" in miss.why and "attention_mask=None" in miss.why

    _, report = fuse(model, policy="all")
    assert [(d.layers, d.how) for d in report.fused] == [
        (("pooler.dense", "pooler.activation"), "children")]
    assert [(d.layers, d.how) for d in report.decisions if d.action == "already fused"] == \
        [encoder_ff]
    assert type(model.pooler) is BertPooler  # the pooler's own class
    assert type(model.pooler.dense) is RunLinear and type(model.pooler.activation) is RunTanh
    assert model.pooler.dense.weight is dense_w
    assert list(model.state_dict()) == keys
    ids = torch.randint(0, 50, (3, 5))
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[0, 3:] = 0
    for args in ([ids], [ids, mask]):
        assert_same_computation(before, model, args, torch.float64, grad_input=False)


def test_bert_pooler_alone_is_fused_in_place():
    torch.manual_seed(0)
    pooler = BertPooler(16)
    before = copy.deepcopy(pooler)
    fused, report = fuse(pooler)
    assert fused is pooler and type(fused) is BertPooler
    assert fused_layers(report) == [("dense", "activation")]
    assert list(fused.state_dict()) == list(before.state_dict())
    assert_same_computation(before, fused, [torch.randn(4, 3, 16)], torch.float32)


# ------------------------------------------------------------------------------------------------
# Child runs: in place, same keys, shared parameters


class Children(nn.Module):
    """A tanh MLP written as named children called one after the other (no Sequential)."""

    def __init__(self, bias_last=True):
        super().__init__()
        self.fc1, self.a1 = nn.Linear(3, 16), nn.Tanh()
        self.fc2, self.a2 = nn.Linear(16, 16), nn.Tanh()
        self.fc3 = nn.Linear(16, 2, bias=bias_last)

    def forward(self, x):
        return self.fc3(self.a2(self.fc2(self.a1(self.fc1(x)))))


def test_child_run_keeps_keys_parameters_and_trains():
    torch.manual_seed(0)
    model = Children(bias_last=False).double()
    before = copy.deepcopy(model)
    checkpoint = copy.deepcopy(model.state_dict())
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built BEFORE the swap

    _, report = fuse(model)

    assert fused_layers(report) == [("fc1", "a1", "fc2", "a2", "fc3")]
    assert [type(model._modules[n]) for n in ("fc1", "a1", "fc2", "a2", "fc3")] == [
        RunLinear, RunTanh, RunLinear, RunTanh, RunLinear]
    assert list(model.state_dict()) == list(checkpoint)
    assert all(p is params[n] for n, p in model.named_parameters())
    model.load_state_dict(checkpoint, strict=True)  # an old checkpoint loads unchanged
    x = torch.randn(6, 3, dtype=torch.float64)
    assert_same_computation(before, model, [x], torch.float64)

    w0 = model.fc2.weight.detach().clone()
    model.zero_grad()
    model(x).pow(2).sum().backward()
    opt.step()
    assert torch.equal(model.fc2.weight, w0.add(model.fc2.weight.grad, alpha=-0.1))

    # Parameters replaced wholesale (assign=True) are read at forward time by the head.
    new = {k: torch.randn_like(v) for k, v in checkpoint.items()}
    model.load_state_dict(new, assign=True)
    before.load_state_dict(new)
    assert rel_err(model(x), before(x)) <= 1e-12

    # A deep copy computes with its own parameters.
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.fc3.weight.zero_()
    assert torch.equal(twin(x), torch.zeros(6, 2, dtype=torch.float64))
    assert rel_err(model(x), before(x)) <= 1e-12


@pytest.mark.parametrize("overwrite", [False, True], ids=["in_place", "new_parameters"])
@pytest.mark.parametrize("make,width", [(Children, 3), (ActorCritic, 11)],
                         ids=["children", "across"])
def test_to_after_fusing_is_seen_by_the_fused_run(make, width, overwrite):
    """README: the run's head reads the later layers' parameters at every call, so `.to()` after
    fusing is seen. A float32 model fused, then `.to(torch.float64)` as a whole, computes what the
    unfused model converted the same way computes, to float64 precision. With
    torch.__future__'s overwrite flag `.to()` puts new Parameter objects in the modules: a run
    that had kept the old ones would compute in float32 (or fail on mixed dtypes)."""
    torch.manual_seed(0)
    model = make()
    before = copy.deepcopy(model)
    _, report = fuse(model)
    assert len(report) >= 1 and {d.how for d in report.fused} <= {"children", "across"}
    fused_kinds = kinds(model)
    assert {RunLinear, RunLinear} & {t for _, t in fused_kinds}
    model(torch.randn(2, width))  # used in float32 first
    old = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
    try:
        model.to(torch.float64)
        before.to(torch.float64)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(old)
    assert kinds(model) == fused_kinds  # still fused: the run computes the converted layers
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    x = torch.randn(6, width, dtype=torch.float64)
    assert_same_computation(before, model, [x], torch.float64)


def test_child_called_twice_held_twice_hooked_or_called_through_a_helper_is_not_swapped():
    class Twice(nn.Module):  # the same Tanh after two Linears
        def __init__(self):
            super().__init__()
            self.l1, self.l2, self.act = nn.Linear(4, 4), nn.Linear(4, 4), nn.Tanh()

        def forward(self, x):
            return self.act(self.l1(x)) + self.act(self.l2(x))

    class Through(Children):  # forward calls a child through a helper method
        def forward(self, x):
            return self.fc3(self.a2(self.fc2(self.a1(self.project(x)))))

        def project(self, x):
            return self.fc1(x)

    class Held(nn.Module):  # the Linear is also held (and called) by another module
        def __init__(self):
            super().__init__()
            self.lin, self.act = nn.Linear(4, 4), nn.Tanh()
            self.other = nn.ModuleList([self.lin])

        def forward(self, x):
            return self.act(self.lin(x))

    hooked = Children()
    calls = []
    hooked.fc2.register_forward_hook(lambda *a: calls.append(1))
    cases = [(Twice(), 4, "act", "act is called 2 times"),
             (Through(), 3, "fc1", "fc1 is called through test_convert.test_child_called_twice_"
              "held_twice_hooked_or_called_through_a_helper_is_not_swapped.<locals>.Through."
              "project, not by <model>.forward itself"),
             (Held(), 4, "lin", "lin is also held elsewhere: other.0"),
             (hooked, 3, "fc2", "the Linear has hooks")]
    for model, width, name, why in cases:
        child = model._modules[name]
        x = torch.randn(3, width)
        ref = model(x)
        _, report = fuse(model)
        assert model._modules[name] is child, why
        assert any(why in d.why for d in report.near_misses), (why, str(report))
        assert rel_err(model(x), ref) <= 1e-6
    # Through: fc1 stays a Linear (called through project()), the run after it is fused.
    assert fused_layers(report) == [] and type(cases[1][0].fc2) is RunLinear
    assert type(cases[1][0].fc1) is nn.Linear
    assert len(calls) == 2  # the hook still runs


def test_shared_module_fused_everywhere():
    class Shared(nn.Module):
        def __init__(self, pooler):
            super().__init__()
            self.a = pooler
            self.b = pooler

        def forward(self, x):
            return self.a(x) + self.b(x)

    torch.manual_seed(0)
    model = Shared(BertPooler(6)).double()
    before = copy.deepcopy(model)
    # The pooler sits at two places, so its output's fate is not followed: policy 'all' fuses it,
    # once, inside the one shared object.
    _, report = fuse(model)
    assert len(report) == 0 and "sits at 2 places" in report.near_misses[0].why
    _, report = fuse(model, policy="all")
    assert len(report) == 1 and model.a is model.b and type(model.a.dense) is RunLinear
    assert_same_computation(before, model, [torch.randn(2, 3, 6, dtype=torch.float64)],
                            torch.float64)


# ------------------------------------------------------------------------------------------------
# nn.Sequential: FusedSequential keeps indexing, slicing and hooks meaningful


def test_sequential_indexing_slicing_and_later_hooks():
    torch.manual_seed(0)
    model = _mlp_policy(dtype=torch.float64)
    ref = copy.deepcopy(model)
    fuse(model)
    x = torch.randn(5, 8, dtype=torch.float64)
    assert type(model) is FusedSequential and type(model[0]) is nn.Linear
    assert torch.equal(model[0](x), ref[0](x))  # an element alone is still itself
    assert type(model[:-1]) is FusedSequential and model[:-1]._ckpt_ext_runs == ()
    assert rel_err(model[:-1](x), ref[:-1](x)) <= 1e-12  # a slice runs unfused, correctly
    seen = []
    model[2].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    assert rel_err(model(x), ref(x)) <= 1e-12 and seen == [torch.Size([5, 64])]  # the hook runs
    with torch.no_grad():  # elements replaced after fusing: the run falls back to them
        model[4] = nn.Linear(64, 4, dtype=torch.float64)
        ref[4] = model[4]
    assert rel_err(model(x), ref(x)) <= 1e-12


def test_old_checkpoint_loads_and_optimizer_keeps_updating():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Sequential(nn.Linear(8, 8), nn.Tanh(),
                                                                    nn.Linear(8, 8), nn.Tanh()),
                          nn.Linear(8, 2))
    checkpoint = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built BEFORE the swap
    _, report = fuse(model)
    # One run through the nested Sequential: the outer one runs it whole, the inner one is left
    # as it is (so model[2] alone, or a slice, still computes its own layers).
    assert fused_layers(report) == [("0", "1", "2.0", "2.1", "2.2", "2.3", "3")]
    assert report.fused[0].how == "sequential"
    assert type(model) is FusedSequential and type(model[2]) is nn.Sequential
    assert type(model[2][0]) is nn.Linear
    model.load_state_dict(checkpoint, strict=True)  # old keys load unchanged

    w0 = model[2][0].weight.detach().clone()
    model(torch.randn(5, 6)).pow(2).sum().backward()
    opt.step()
    assert not torch.equal(model[2][0].weight, w0)  # the optimizer's tensor is the fused one's
    # SGD's own update formula (one rounding: add with alpha), so the comparison can be exact
    assert torch.equal(model[2][0].weight, w0.add(model[2][0].weight.grad, alpha=-0.1))


# ------------------------------------------------------------------------------------------------
# The opt-in forward rewrite: every way to write linear then tanh


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


@pytest.mark.parametrize("policy", ["memory", "all"])
@pytest.mark.parametrize("form", ["torch.tanh", "F.tanh", ".tanh()", "nn.Tanh"])
def test_rewrite_forms(form, policy):
    torch.manual_seed(0)
    model = FunctionalForms(form).double()
    before = copy.deepcopy(model)

    _, plain_report = fuse(copy.deepcopy(model), policy=policy)  # no opt-in: nothing rewritten
    assert plain_report.rewritten == [] and {d.how for d in plain_report.fused} <= {"children"}
    assert any("pass rewrite=True" in d.why for d in plain_report.near_misses)

    _, report = fuse(model, policy=policy, rewrite=True)
    # F.tanh is `input.tanh()` in Python, so fx records it as the method call.
    tanh = {"nn.Tanh": "act", "F.tanh": ".tanh()"}.get(form, form)
    # one run under either policy: lin, tanh, F.linear, tanh (the model's output)
    assert fused_layers(report) == [("lin", tanh, "F.linear", "torch.tanh")]
    assert {d.how for d in report.fused} == {"rewrite"} and report.rewritten == [""]
    assert type(model) is FunctionalForms and type(model.lin) is nn.Linear
    source = model.forward.source
    assert source.count("ckpt_ext_ops_tanh_mlp(") == 1
    assert "torch.tanh(" not in source and ".tanh()" not in source and "linear(" not in \
        source.replace("linear_tanh(", "")
    assert list(model.state_dict()) == list(before.state_dict())
    assert_same_computation(before, model, [torch.randn(3, 4, 10, dtype=torch.float64)],
                            torch.float64)
    # A rewritten forward is a plain attribute of the instance: it deep-copies and pickles.
    x = torch.randn(2, 10, dtype=torch.float64)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.w.zero_()
    assert not torch.equal(twin(x), model(x)) and rel_err(model(x), before(x)) <= 1e-12
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=False)(x), model(x))


def test_rewrite_linear_called_twice_keeps_its_module():
    # The same Linear is called once before a tanh and once not: not a child swap; the rewrite
    # calls the op on its weight and bias at the fused site only.
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x):
            return torch.tanh(self.lin(x)) + self.lin(x)

    torch.manual_seed(0)
    model = M().double()
    before = copy.deepcopy(model)
    _, report = fuse(model)
    assert len(report) == 0 and "lin is called 2 times" in report.near_misses[0].why
    _, report = fuse(model, rewrite=True)
    assert len(report) == 1 and type(model.lin) is nn.Linear
    assert "residual add" in report.fused[0].why
    assert_same_computation(before, model, [torch.randn(4, 6, dtype=torch.float64)],
                            torch.float64)


class LinearsInModuleList(nn.Module):
    """Linears held in a ModuleList and called in a loop, with Tanh modules (also in a
    ModuleList) or torch.tanh between them."""

    def __init__(self, tanh_modules: bool) -> None:
        super().__init__()
        self.tanh_modules = tanh_modules
        self.layers = nn.ModuleList([nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)])
        self.acts = nn.ModuleList([nn.Tanh(), nn.Tanh()])

    def forward(self, x):
        for i, layer in enumerate(self.layers[:-1]):
            x = self.acts[i](layer(x)) if self.tanh_modules else torch.tanh(layer(x))
        return self.layers[-1](x)


@pytest.mark.parametrize("tanh_modules", [True, False], ids=["nn.Tanh", "torch.tanh"])
def test_rewrite_fuses_linears_called_in_a_module_list_loop(tanh_modules):
    """README: Linears called in a ModuleList loop can only be fused by rewriting the forward;
    rewrite=True does it (one run, the modules and their parameters kept)."""
    torch.manual_seed(0)
    model = LinearsInModuleList(tanh_modules).double()
    before = copy.deepcopy(model)
    keys = list(model.state_dict())
    params = dict(model.named_parameters())
    module_kinds = kinds(model)

    _, plain = fuse(copy.deepcopy(model))  # no opt-in: left alone, and the report says why
    assert len(plain) == 0 and plain.rewritten == []
    assert any("layers.0 is not a direct child of <model>" in d.why for d in plain.near_misses)

    _, report = fuse(model, rewrite=True)
    act = "acts.{}" if tanh_modules else "torch.tanh"
    assert fused_layers(report) == [
        ("layers.0", act.format(0), "layers.1", act.format(1), "layers.2")]
    assert report.fused[0].how == "rewrite" and report.rewritten == [""]
    assert "forward" in vars(model) and type(model).forward is LinearsInModuleList.forward
    assert model.forward.source.count("ckpt_ext_ops_tanh_mlp(") == 1
    assert kinds(model) == module_kinds  # the Linears stay nn.Linear in their ModuleList
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    rows = 5
    x = torch.randn(rows, 4, dtype=torch.float64)
    assert_same_computation(before, model, [x], torch.float64)
    assert saved_activation_bytes(before, x) - saved_activation_bytes(model, x) == \
        rows * report.bytes_per_row == rows * 2 * 8 * 8  # the two tanh outputs


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


def _hook(m):
    if type(m) is nn.Linear:
        m.register_forward_hook(lambda mod, inp, out: None)


@pytest.mark.parametrize("make,skip_reason", [
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.LeakyReLU()), None),
    (lambda: nn.Sequential(nn.Tanh(), nn.Linear(4, 4)), None),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Tanh()), None),
    (lambda: nn.Sequential(nn.Tanh()), None),
    (UsedTwice, "its output has 2 users"),
    (lambda: nn.Sequential(MyLinear(4, 4), nn.Tanh()), "MyLinear subclasses nn.Linear"),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh()).apply(_hook), "hooks"),
])
@pytest.mark.parametrize("policy", ["memory", "all"])
def test_leaves_non_matches_alone(make, skip_reason, policy):
    torch.manual_seed(0)
    model = make()
    before = kinds(model)
    x = torch.randn(3, 4)
    ref = model(x)
    fused, report = fuse(model, policy=policy, rewrite=True)
    assert fused is model and len(report) == 0 and report.rewritten == []
    assert kinds(model) == before
    assert torch.equal(fused(x), ref)
    if skip_reason is None:
        assert report.near_misses == []
    else:
        assert len(report.near_misses) == 1 and skip_reason in report.near_misses[0].why
        assert skip_reason in str(report)


def test_forward_with_optional_argument_is_not_used():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.act = nn.Tanh()

        def forward(self, x, scale=None):
            y = self.act(self.lin(x))
            return y if scale is None else y * scale

    model = M()
    fused, report = fuse(model, rewrite=True)
    assert fused is model and len(report) == 0 and type(model.lin) is nn.Linear
    assert report.not_analysed == [("", "its forward looks at its optional argument scale=None "
                                        "(not only handing it to a child); fx would see only one "
                                        "value of it")]
    x = torch.randn(2, 4)
    assert torch.equal(model(x, scale=3.0), torch.tanh(model.lin(x)) * 3.0)


class VarArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.Tanh()

    def forward(self, *xs):
        h = xs[0]
        for extra in xs[1:]:
            h = h + extra
        return self.act(self.lin(h))


class VarKwargs(VarArgs):
    def forward(self, x, **options):
        return self.act(self.lin(x)) * options.get("scale", 1.0)


class ForwardOnInstance(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.Tanh()

    def forward(self, x):  # not what runs: the instance's forward below skips the tanh
        return self.act(self.lin(x))


def _forward_on_instance():
    model = ForwardOnInstance()
    model.forward = lambda x: model.lin(x)
    return model


@pytest.mark.parametrize("make,why", [
    (VarArgs, "its forward takes *xs; fx would see only the traced arity"),
    (VarKwargs, "its forward uses **options other than to hand it to a child module; fx would "
                "see only the traced keys"),
    (_forward_on_instance, "its forward is set on the instance (fx would trace its class's "
                           "forward, not what runs)"),
], ids=["star_args", "star_kwargs", "forward_on_instance"])
def test_forward_taking_star_args_or_replaced_on_the_instance_is_not_analysed(make, why):
    """README: a forward with `*args` arguments, or a `forward` replaced on the instance, is not
    used: the report lists the module under "not analysed" with the reason, and its children are
    neither swapped nor its code rewritten."""
    torch.manual_seed(0)
    model = make()
    before = copy.deepcopy(model)
    forward = vars(model).get("forward")
    fused, report = fuse(model, rewrite=True)
    assert fused is model and len(report) == 0 and report.rewritten == []
    assert report.not_analysed == [("", why)]
    assert f"not analysed: <model>: {why}" in str(report)
    assert type(model.lin) is nn.Linear and type(model.act) is nn.Tanh
    assert vars(model).get("forward") is forward
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    if make is VarArgs:
        assert torch.equal(model(x), before(x)) and torch.equal(model(x, y), before(x, y))
    elif make is VarKwargs:
        assert torch.equal(model(x, scale=2.0), before(x, scale=2.0))
    else:
        assert torch.equal(model(x), model.lin(x))  # still the instance's forward: no tanh


def test_untraceable_model_keeps_sequential_runs_and_reports_why():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.seq = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > 0:  # fx cannot trace a branch on data
                return torch.tanh(self.lin(self.seq(x)))
            return self.seq(x)

    torch.manual_seed(0)
    model = DataDependent().double()
    before = copy.deepcopy(model)
    _, report = fuse(model)
    assert fused_layers(report) == [("seq.0", "seq.1", "seq.2")]
    assert report.near_misses[0].layers == ("seq.3",)
    assert "<model>.forward calls seq after it branches on a traced value (line" in \
        report.near_misses[0].why
    assert report.not_analysed[0][0] == "" and \
        "where it branches on a traced value" in report.not_analysed[0][1]
    x = torch.randn(3, 4, dtype=torch.float64).abs()
    assert_same_computation(before, model, [x], torch.float64)
    assert_same_computation(before, model, [-x], torch.float64)


class PairInto(nn.Module):
    """A Linear -> Tanh pair (or, with run=True, a run whose trailing Tanh is a child) whose tanh
    output goes to one consumer."""

    def __init__(self, consumer: str, run: bool = False) -> None:
        super().__init__()
        self.consumer = consumer
        self.fc = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)) if run else \
            nn.Linear(6, 6)
        self.act = nn.Tanh()
        self.norm = nn.LayerNorm(6)
        # A random affine: with weight 1 and bias 0, sum(LayerNorm(h)²) hardly depends on h, so the
        # gradients compared below would be rounding noise around 0 (1e-12 apart across two tanh
        # implementations that agree to 1 ulp).
        nn.init.normal_(self.norm.weight)
        nn.init.normal_(self.norm.bias)
        self.w = nn.Parameter(torch.randn(6, 5))
        self.scale = nn.Parameter(torch.randn(6))  # a learned tensor: mul saves h for its grad

    def forward(self, x):
        h = self.act(self.fc(x))
        if self.consumer == "LayerNorm":
            return self.norm(h)
        if self.consumer == "F.layer_norm":
            return F.layer_norm(h, (6,), self.norm.weight, self.norm.bias)
        if self.consumer == "matmul":
            return h @ self.w
        if self.consumer == "multiply by a tensor":
            return h * self.scale
        if self.consumer == "F.mse_loss":
            return F.mse_loss(h, x)
        return h * 2.0  # multiply by a constant: does not keep h


KEPT_BY = {"LayerNorm": "kept by norm (LayerNorm keeps its input)",
           "F.layer_norm": "kept by F.layer_norm", "matmul": "kept by operator.matmul",
           "multiply by a tensor": "kept by operator.mul with another tensor",
           "F.mse_loss": "kept by F.mse_loss"}


@pytest.mark.parametrize("run", [False, True], ids=["lone_pair", "trailing_tanh"])
@pytest.mark.parametrize("consumer", list(KEPT_BY) + ["multiply by a constant"])
def test_tanh_output_kept_by_its_consumer_is_left_alone_under_memory_policy(consumer, run):
    """README (policy="memory"): a lone Linear -> Tanh pair, and a run's trailing Tanh, are left
    alone before a LayerNorm, a matmul or a multiply by another tensor (and an mse_loss), with
    the reason in the report: that consumer keeps the output anyway. Fusing it (policy="all")
    frees nothing there. A multiply by a constant does not keep it: fused."""
    torch.manual_seed(0)
    model = PairInto(consumer, run).double()
    before = copy.deepcopy(model)
    _, report = fuse(model)
    rows = 4
    x = torch.randn(rows, 6, dtype=torch.float64)
    head = ("fc.0", "fc.1", "fc.2") if run else ("fc",)
    if consumer == "multiply by a constant":
        assert fused_layers(report) == [head + ("act",)] and report.near_misses == []
        assert "operator.mul by a constant does not keep it" in report.fused[0].why
        assert type(model.act) is RunTanh
    else:
        (miss,) = report.near_misses
        if run:  # the run is fused without its trailing Tanh
            assert fused_layers(report) == [head]
            assert miss.layers == ("act",)
            what = "the trailing Tanh is left out of the run (its output is kept anyway)"
            assert type(model.fc) is FusedSequential
        else:
            assert len(report) == 0 and miss.layers == ("fc", "act")
            what = "a lone pair whose output is kept anyway"
            assert type(model.fc) is nn.Linear
        assert miss.why.startswith(f"{what}: {KEPT_BY[consumer]}; fusing it would free nothing")
        assert f"left alone  {' -> '.join(miss.layers)}: {what}" in str(report)
        assert type(model.act) is nn.Tanh
    assert_same_computation(before, model, [x], torch.float64)
    if not run:
        # What "kept anyway" means: fused regardless (policy="all"), the pair frees nothing.
        every = copy.deepcopy(before)
        _, r_all = fuse(every, policy="all")
        assert len(r_all) == 1
        freed = saved_activation_bytes(before, x) - saved_activation_bytes(every, x)
        assert freed == rows * r_all.bytes_per_row == \
            (rows * 6 * 8 if consumer == "multiply by a constant" else 0)


def test_model_output_is_freed_unless_the_loss_keeps_it():
    """README: a pair whose output is the model's output is fused under policy="memory": that
    output is freed unless the loss keeps it (.mean()/.sum() do not, mse_loss does), as the report
    says."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh()).double()
    plain = copy.deepcopy(model)
    _, report = fuse(model)
    assert len(report) == 1 and ("returned by the model (freed unless the loss keeps it: "
                                 ".mean()/.sum() do not, mse_loss does)") in report.fused[0].why
    rows = 4
    x, target = torch.randn(rows, 6, dtype=torch.float64), torch.randn(rows, 6, dtype=torch.float64)

    class WithLoss(nn.Module):
        def __init__(self, net, loss):
            super().__init__()
            self.net, self.loss = net, loss

        def forward(self, inp):
            return self.loss(self.net(inp))

    def freed(loss):
        return saved_activation_bytes(WithLoss(plain, loss), x) - \
            saved_activation_bytes(WithLoss(model, loss), x)

    assert freed(lambda out: out.sum()) == freed(lambda out: out.mean()) == \
        rows * report.bytes_per_row == rows * 6 * 8
    assert freed(lambda out: F.mse_loss(out, target)) == 0  # mse_loss keeps the output itself


# ------------------------------------------------------------------------------------------------
# dry run, idempotence, trace=False, devices, serialisation


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                                   nn.Linear(8, 8))
        self.pooler = BertPooler(8)
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        h = self.trunk(x)
        return torch.tanh(self.head(h[:, 0])) + self.pooler(h)  # residual adds


def _mixed_model():
    torch.manual_seed(0)
    return Mixed()


def test_mixed_model_units():
    model = _mixed_model().double()
    before = copy.deepcopy(model)
    _, report = fuse(model, rewrite=True)
    assert [(d.layers, d.how) for d in report.fused] == [
        (("head", "torch.tanh"), "rewrite"),
        (("trunk.0", "trunk.1", "trunk.2", "trunk.3", "trunk.4"), "sequential"),
        (("pooler.dense", "pooler.activation"), "children")]
    assert report.bytes_per_row == 8 * 8 * 2 + 8 * 8 * 2  # 2 tanh outputs in the run; 2 pairs
    assert_same_computation(before, model, [torch.randn(2, 3, 5, dtype=torch.float64)],
                            torch.float64)


@pytest.mark.parametrize("rewrite", [False, True])
def test_dry_run_reports_without_changing(rewrite):
    model = _mixed_model()
    before = kinds(model)
    dry = fuse(model, dry_run=True, rewrite=rewrite)
    assert dry.model is model and dry.report.dry_run
    assert kinds(model) == before and "forward" not in vars(model)
    assert f"would fuse {2 + rewrite} unit(s)" in str(dry.report)
    real = fuse(model, rewrite=rewrite).report
    assert dry.report.decisions == real.decisions and dry.report.rewritten == real.rewritten


@pytest.mark.parametrize("policy", ["memory", "all"])
def test_running_twice_changes_nothing(policy):
    model = _mixed_model()
    x = torch.randn(2, 3, 5)
    once, report1 = fuse(model, policy=policy, rewrite=True)
    assert len(report1) == 3
    after_once = kinds(model)
    forward = vars(model)["forward"]
    runs = model.trunk._ckpt_ext_runs
    ref = once(x)
    twice, report2 = fuse(once, policy=policy, rewrite=True)
    assert twice is once and len(report2) == 0 and report2.rewritten == []
    assert kinds(twice) == after_once
    assert vars(model)["forward"] is forward and model.trunk._ckpt_ext_runs is runs
    assert torch.equal(twice(x), ref)


def test_trace_false_only_sequential():
    model = _mixed_model()
    fused, report = fuse(model, trace=False)
    assert fused is model and [d.how for d in report.fused] == ["sequential"]
    assert type(model.pooler.dense) is nn.Linear


def test_model_that_cannot_be_copied_says_why():
    """A model fuse cannot copy for analysis (it holds a lock): each Linear's line gives that
    reason, not trace=False, which the caller did not pass."""
    class Locked(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)
            self.lock = threading.Lock()

        def forward(self, x):
            return self.fc2(self.act(self.fc1(x)))

    _, report = fuse(Locked())
    assert len(report) == 0 and "trace=False" not in str(report), str(report)
    assert [path for path, _ in report.other_layers] == ["fc1", "fc2"]
    for _, why in report.other_layers:
        assert why.startswith("its caller <model> was not analysed: the model could not be "
                              "copied for analysis (TypeError: "), why


def test_meta_device_and_whole_model_pickle():
    model = _mixed_model()
    fuse(model)
    buf = io.BytesIO()
    torch.save(model, buf)  # FusedSequential and the swapped children pickle
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(2, 3, 5)
    assert torch.equal(loaded(x), model(x))
    # A model on the meta device (deferred init) converts and runs shapes without memory.
    meta = _mixed_model().to("meta")
    _, report = fuse(meta)
    assert len(report) == 2
    assert meta(torch.empty(2, 3, 5, device="meta")).shape == (2, 8)


@pytest.mark.filterwarnings("ignore:Complex modules")
def test_unsupported_dtype_left_alone():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh()).to(torch.complex64)
    fused, report = fuse(model, policy="all")
    assert len(report) == 0 and type(model[0]) is nn.Linear
    assert "complex64 is not supported" in report.near_misses[0].why


@pytest.fixture(scope="module")
def lazy_device():
    """A device this build of the op does not support that runs without special hardware: the
    lazy-tensor device (TorchScript backend, CPU)."""
    try:
        import torch._lazy
        import torch._lazy.ts_backend

        torch._lazy.ts_backend.init()
        torch.zeros(1, device="lazy").cpu()
    except Exception as e:  # a torch build without the lazy TorchScript backend
        pytest.skip(f"no lazy tensor device in this torch build ({type(e).__name__}: {e})")
    return "lazy"


@pytest.mark.parametrize("make,width,misses", [
    (lambda: _mlp_policy(8, 16, 4), 8, [("0", "1"), ("2", "3"), ("4",)]),
    (Children, 3, [("fc1", "a1"), ("fc2", "a2"), ("fc3",)]),
], ids=["sequential", "children"])
@pytest.mark.parametrize("policy", ["memory", "all"])
def test_unsupported_device_left_alone(make, width, misses, policy, lazy_device):
    """README: a model on a device the op does not support (here: 'lazy'; this build supports
    cpu, meta and, in a CUDA build, cuda) is left alone, with the reason in the report."""
    torch.manual_seed(0)
    model = make().double()
    x = torch.randn(5, width, dtype=torch.float64)
    ref = model(x)
    model.to(lazy_device)
    module_kinds = kinds(model)
    fused, report = fuse(model, policy=policy)
    assert fused is model and len(report) == 0 and kinds(model) == module_kinds
    assert [d.layers for d in report.near_misses] == misses and report.not_analysed == []
    assert all("device lazy:0 is not supported by this build of the fused op" in d.why
               for d in report.near_misses), str(report)
    assert rel_err(model(x.to(lazy_device)).cpu(), ref) <= 1e-14


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and ckpt_ext.WITH_CUDA),
                    reason="CUDA variant: needs a GPU and a CUDA build of ckpt_ext")
def test_cuda_model():
    torch.manual_seed(0)
    model = nn.Sequential(Net(), _mlp_policy(40, 64, 4)).cuda()
    before = copy.deepcopy(model)
    _, report = fuse(model)
    assert len(report) == 1 and model[1][0].weight.is_cuda
    assert_same_computation(before, model, [torch.randn(9, 12, device="cuda")], torch.float32)


def test_rejects_bad_arguments():
    with pytest.raises(TypeError, match="expects an nn.Module, got function"):
        fuse(lambda x: x)
    with pytest.raises(ValueError, match="policy must be one of 'memory', 'all', got 'pairs'"):
        fuse(nn.Linear(2, 2), policy="pairs")


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
    _, report = fuse(model)
    # Dropout(0) returns its input: what counts is the residual add after it
    assert len(report) == 1 and "(a residual add)" in report.fused[0].why
    assert_same_computation(ref, model, [x], torch.float64)


def test_twice_with_a_rewritten_caller_keeps_the_plan():
    # The trunk's trailing Tanh is fused because the caller adds its output (not kept). After the
    # caller's forward is rewritten, a second fuse still reads the caller's code: same plan.
    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
            self.head = nn.Linear(4, 8)

        def forward(self, x, /):
            return self.trunk(x) + torch.tanh(self.head(x))

    torch.manual_seed(0)
    model = Root().double()
    before = copy.deepcopy(model)
    _, report = fuse(model, rewrite=True)
    assert [d.layers for d in report.fused] == [
        ("head", "torch.tanh"), ("trunk.0", "trunk.1", "trunk.2", "trunk.3")]
    runs = model.trunk._ckpt_ext_runs
    assert runs[0].last_tanh
    assert list(inspect.signature(model.forward).parameters) == ["x"]
    _, again = fuse(model, rewrite=True)
    assert len(again) == 0 and model.trunk._ckpt_ext_runs is runs
    assert [d.action for d in again.decisions] == ["already fused"]
    assert_same_computation(before, model, [torch.randn(3, 4, dtype=torch.float64)],
                            torch.float64)


def test_rewritten_and_swapped_models_compile_without_graph_breaks():
    import torch._dynamo

    for model, kw, x in ((_mixed_model(), {"rewrite": True}, torch.randn(2, 3, 5)),
                         (Children(), {}, torch.randn(4, 3))):
        fuse(model, **kw)
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(model)(x)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1
    torch._dynamo.reset()


def test_sequentials_in_a_module_list_are_followed_to_their_caller():
    class Blocks(nn.Module):  # residual blocks held in a ModuleList, called by the owner's forward
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(
                [nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 6), nn.Tanh())
                 for _ in range(2)])

        def forward(self, x):
            for block in self.blocks:
                x = x + block(x)
            return x

    torch.manual_seed(0)
    model = Blocks().double()
    before = copy.deepcopy(model)
    _, report = fuse(model)
    # Each block's last tanh output only goes into the residual add: the whole block is one run.
    assert fused_layers(report) == [tuple(f"blocks.{b}.{i}" for i in range(4)) for b in (0, 1)]
    assert all("residual add" in d.why for d in report.fused)
    assert report.bytes_per_row == 2 * (12 + 6) * 8
    assert_same_computation(before, model, [torch.randn(5, 6, dtype=torch.float64)],
                            torch.float64)


# ------------------------------------------------------------------------------------------------
# Runs across containers: Sequentials called one after another, nested, or next to child modules


def _writeup_net(dtype=torch.float64):
    from ckpt_ext.models import Net as WriteupNet

    torch.manual_seed(0)
    return WriteupNet(in_features=16, hidden=32, depth=3, mode="plain", dtype=dtype)


def test_writeup_net_is_one_run_across_its_blocks():
    """The write-up's Net: linear1, then block1..block3 = Sequential(Linear, Tanh) that
    Net.forward calls in sequence. The maximal run block1.0 .. block3.1 spans three Sequentials;
    fused as one tanh_mlp it keeps only linear1's output (fusing block3 alone, with block1/block2
    as near misses, would also keep what block1 and block2 keep)."""
    model = _writeup_net()
    plain = copy.deepcopy(model)
    keys = list(model.state_dict())
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built BEFORE fusing

    dry = fuse(model, dry_run=True).report
    assert type(model.block1) is nn.Sequential  # the dry run changed nothing
    _, report = fuse(model)

    assert dry.decisions == report.decisions
    (d,) = report.decisions
    assert d.layers == ("block1.0", "block1.1", "block2.0", "block2.1", "block3.0", "block3.1")
    assert (d.action, d.how, d.where) == ("fused", "across", "")
    assert d.unit == "tanh_mlp, 3 layers 32->32->32->32, last tanh"
    assert d.bytes_per_row == 3 * 32 * 8  # block1's, block2's and block3's outputs (float64)
    assert d.flops_per_row == 3 * 2 * 32 * 32  # +3 GEMMs: the recompute of the 3 layers
    assert ("it crosses block1, block2, block3 in <model>: inside <model>.forward, block1 computes "
            "the whole run and block2, block3 pass its output on; called any other way, each "
            "computes its own layers" in d.why)
    assert type(model.linear1) is nn.Linear
    assert all(type(b) is FusedSequential for b in (model.block1, model.block2, model.block3))
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())

    # Outputs, the input's and every parameter's gradient as unfused (float64).
    rows = 64
    x = torch.randn(rows, 16, dtype=torch.float64)
    assert_same_computation(plain, model, [x], torch.float64)
    out_p, in_p, g_p = outputs_and_grads(plain, x)
    out_f, in_f, g_f = outputs_and_grads(model, x)
    assert rel_err(out_f[0], out_p[0]) <= 1e-14 and rel_err(in_f[0], in_p[0]) <= 1e-14
    assert g_f.keys() == g_p.keys() and len(g_p) == 8
    assert all(rel_err(g_f[n], g_p[n]) <= 1e-14 for n in g_p)

    # Exact bytes, two ways: the report's figure is what is no longer kept.
    saved_plain, saved_fused = saved_activation_bytes(plain, x), saved_activation_bytes(model, x)
    assert saved_plain == rows * (16 + 4 * 32) * 8  # x, linear1's output, 3 tanh outputs
    assert saved_fused == rows * (16 + 32) * 8  # x (kept by linear1), linear1's output (the run)
    assert saved_plain - saved_fused == rows * report.bytes_per_row
    kept_plain, kept_fused = kept_bytes(plain, x), kept_bytes(model, x)
    assert kept_fused == rows * 32 * 8 and kept_plain - kept_fused == rows * report.bytes_per_row

    # The optimizer built before fusing trains the fused model (SGD's own update, exactly).
    w0 = model.block2[0].weight.detach().clone()
    model.zero_grad()
    model(x).pow(2).sum().backward()
    opt.step()
    assert torch.equal(model.block2[0].weight, w0.add(model.block2[0].weight.grad, alpha=-0.1))

    # Idempotent: the same parts, the same objects.
    parts = [b._ckpt_ext_runs for b in (model.block1, model.block2, model.block3)]
    _, again = fuse(model)
    assert len(again) == 0 and [x.action for x in again.decisions] == ["already fused"]
    assert [b._ckpt_ext_runs for b in (model.block1, model.block2, model.block3)] == parts
    assert all(a is b for a, b in zip(
        [b._ckpt_ext_runs for b in (model.block1, model.block2, model.block3)], parts))


def test_residual_net_keeps_its_lone_pairs():
    """ResidualNet: each block's output goes into a residual add, not into the next block, so
    nothing links the blocks: three lone pairs."""
    from ckpt_ext.models import ResidualNet

    torch.manual_seed(0)
    model = ResidualNet(in_features=16, hidden=32, depth=3, dtype=torch.float64)
    before = copy.deepcopy(model)
    _, report = fuse(model)
    assert fused_layers(report) == [(f"blocks.{i}.0", f"blocks.{i}.1") for i in range(3)]
    assert {d.how for d in report.fused} == {"sequential"} and report.near_misses == []
    assert all("residual add" in d.why for d in report.fused)
    assert report.bytes_per_row == 3 * 32 * 8
    assert_same_computation(before, model, [torch.randn(5, 16, dtype=torch.float64)],
                            torch.float64)


def test_a_block_called_on_its_own_after_fusing():
    """A container the run crosses computes the run only inside Net.forward: called on its own
    (or in any order outside it) each block computes its own layers, values and gradients as the
    unfused copy. Its elements are untouched."""
    model = _writeup_net()
    ref = copy.deepcopy(model)
    fuse(model)
    h = torch.randn(4, 32, dtype=torch.float64)
    for name in ("block1", "block2", "block3"):
        assert_same_computation(getattr(ref, name), getattr(model, name), [h], torch.float64)
        assert torch.equal(getattr(model, name)(h), getattr(ref, name)(h))
    assert torch.equal(model.block2(model.block1(h)), ref.block2(ref.block1(h)))
    assert torch.equal(model.block2[0](h), ref.block2[0](h))  # the Linear is still itself
    assert torch.equal(model.block2[:](h), ref.block2(h))  # a slice has no plan
    assert "passes the run from block1.0 on inside <model>.forward" in repr(model.block2)
    assert "computes the run block1.0..block3.1 inside <model>.forward" in repr(model.block1)


def test_writeup_net_in_checkpoint_mode_stays_exact():
    """Net's checkpoint mode calls block1 and block2 through torch.utils.checkpoint, which re-runs
    each on its own in backward: the run does not cross them (a block re-run alone must compute
    what it computed in the forward), only block3, a lone pair before the model's output, is
    fused; the report says why."""
    from ckpt_ext.models import Net as WriteupNet

    for reentrant in (False, True):
        torch.manual_seed(0)
        model = WriteupNet(16, 32, 3, mode="checkpoint", use_reentrant=reentrant,
                           dtype=torch.float64)
        before = copy.deepcopy(model)
        _, report = fuse(model)
        assert [(d.layers, d.how) for d in report.fused] == [(("block3.0", "block3.1"),
                                                              "sequential")]
        assert any("is called through torch.utils.checkpoint" in d.why
                   for d in report.near_misses), str(report)
        assert_same_computation(before, model, [torch.randn(5, 16, dtype=torch.float64)],
                                torch.float64)


def test_run_across_containers_falls_back_when_changed_after_fusing():
    x = torch.randn(5, 16, dtype=torch.float64)
    ref = _writeup_net()
    # A hook on an element, or on a block the run crosses: every block runs element by element,
    # so the hook runs and sees the unfused values.
    for where in ("block2.0", "block2"):
        model = _writeup_net()
        fuse(model)
        seen = []
        model.get_submodule(where).register_forward_hook(lambda m, i, o: seen.append(o))
        assert rel_err(model(x), ref(x)) <= 1e-14
        assert len(seen) == 1 and rel_err(seen[0], ref.get_submodule(where)(
            ref.block1(ref.linear1(x)))) <= 1e-14
    # An element or a whole block replaced after fusing.
    for where in ("block3.0", "block2"):
        model, other = _writeup_net(), _writeup_net()
        fuse(model)
        new = nn.Sequential(nn.Linear(32, 32), nn.ReLU()) if where == "block2" else \
            nn.Linear(32, 32)
        new = new.double()
        for m in (model, other):
            parent, _, name = where.rpartition(".")
            setattr(m.get_submodule(parent), name, new)
        assert rel_err(model(x), other(x)) <= 1e-14, where


def test_run_of_children_after_changes_and_a_later_fuse():
    """A hook registered after fusing on a member of a run of children runs on that member's own
    output (the run falls back to computing member by member); a later fuse changes nothing,
    with policy="all" too (the same runs: it never frees less)."""
    torch.manual_seed(0)
    model = ActorCritic(dtype=torch.float64)
    before = copy.deepcopy(model)
    _, first = fuse(model)
    obs = torch.randn(3, 11, dtype=torch.float64)
    _, again = fuse(model)
    assert len(again) == 0 and [(d.layers, d.action) for d in again.decisions] == [
        (d.layers, "already fused") for d in first.fused]
    seen = []
    handle = model.action_net.register_forward_hook(lambda m, i, o: seen.append(o))
    assert_same_computation(before, model, [obs], torch.float64)
    assert len(seen) == 1 and rel_err(seen[0], before.action_net(before.policy_net(obs))) <= 1e-14
    handle.remove()
    _, every = fuse(model, policy="all")
    assert [(d.layers, d.action) for d in every.decisions] == [
        (d.layers, "already fused") for d in first.fused]
    assert_same_computation(before, model, [obs], torch.float64)


class TwiceCalled(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.b = nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    def forward(self, x):
        return self.b(self.a(self.b(x)))


class Chain(TwiceCalled):
    def forward(self, x):
        return self.b(self.a(x))


class HeldTwice(Chain):
    def __init__(self):
        super().__init__()
        self.also = nn.ModuleList([self.b])


class Through(Chain):
    def forward(self, x):
        return self.b(self.first(x))

    def first(self, x):
        return self.a(x)


def _hooked(where):
    def make():
        m = Chain()
        m.get_submodule(where).register_forward_hook(lambda *a: None)
        return m
    return make


@pytest.mark.parametrize("make,why", [
    (TwiceCalled, "b is called 2 times"),
    (HeldTwice, "b is also held elsewhere: also.0"),
    (Through, "a is called through test_convert.Through.first, not by <model>.forward itself"),
    (_hooked("b"), "b has hooks, which a run computed across it would not call"),
    (_hooked("a.1"), "the Tanh has hooks"),
])
def test_run_stops_at_a_container_called_twice_held_twice_called_through_a_helper_or_hooked(
        make, why):
    torch.manual_seed(0)
    model = make().double()
    before = copy.deepcopy(model)
    _, report = fuse(model)
    assert all(d.how != "across" for d in report.decisions), str(report)
    assert any(why in d.why for d in report.decisions), str(report)
    x = torch.randn(3, 4, dtype=torch.float64)
    assert rel_err(model(x), before(x)) <= 1e-14


class BodyThenChildren(nn.Module):
    """A Sequential whose run starts inside it, then sibling children, then a Sequential the run
    ends inside."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.ReLU(), nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))
        self.act = nn.Tanh()
        self.out = nn.Linear(8, 6)
        self.tail = nn.Sequential(nn.Tanh(), nn.Linear(6, 3), nn.ReLU())

    def forward(self, x):
        return self.tail(self.out(self.act(self.body(x))))


class PairThenSequential(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act = nn.Linear(3, 8), nn.Tanh()
        self.seq = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))

    def forward(self, x):
        return self.seq(self.act(self.fc(x)))


class LoopOverBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.sum(-1)


def _nested():
    return nn.Sequential(nn.Sequential(nn.ReLU(), nn.Linear(4, 8), nn.Tanh()), nn.Linear(8, 8),
                         nn.Tanh(), nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)),
                         nn.ReLU())


@pytest.mark.parametrize("make,width,layers,kinds_after", [
    (_nested, 4, ("0.1", "0.2", "1", "2", "3.0", "3.1", "3.2", "4"),  # tanh x3, relu: mixed
     {"": FusedSequential, "0": nn.Sequential, "3": nn.Sequential}),
    (BodyThenChildren, 4, ("body.1", "body.2", "body.3", "act", "out", "tail.0", "tail.1",
                           "tail.2"),
     {"body": FusedSequential, "act": RunTanh, "out": RunLinear, "tail": FusedSequential}),
    (PairThenSequential, 3, ("fc", "act", "seq.0", "seq.1", "seq.2"),
     {"fc": RunLinear, "act": RunTanh, "seq": FusedSequential}),
    (LoopOverBlocks, 6, tuple(f"blocks.{i}.{j}" for i in range(3) for j in range(2)),
     {f"blocks.{i}": FusedSequential for i in range(3)}),
], ids=["nested", "sequential_then_children", "children_then_sequential", "module_list"])
def test_runs_across_nested_sequentials_and_sibling_children(make, width, layers, kinds_after):
    torch.manual_seed(0)
    model = make().double()
    before = copy.deepcopy(model)
    keys = list(model.state_dict())
    params = dict(model.named_parameters())
    _, report = fuse(model)
    assert fused_layers(report) == [layers] and report.fused[0].how == "across"
    assert {p: type(model.get_submodule(p)) for p in kinds_after} == kinds_after
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    rows = 7
    x = torch.randn(rows, width, dtype=torch.float64)
    assert_same_computation(before, model, [x], torch.float64)
    assert saved_activation_bytes(before, x) - saved_activation_bytes(model, x) == \
        rows * report.bytes_per_row
    after = kinds(model)
    _, again = fuse(model)
    assert len(again) == 0 and kinds(model) == after
    assert [d.action for d in again.decisions if d.layers == layers] == ["already fused"]
    assert_same_computation(before, model, [x], torch.float64)


def test_fused_writeup_net_compiles_fullgraph_to_one_stack_op():
    import torch._dynamo

    model = _writeup_net(torch.float32)
    eager = copy.deepcopy(model)
    fuse(model)
    fuse(eager)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)  # raises on a graph break
    x = torch.randn(6, 16)
    out_c, in_c, g_c = outputs_and_grads(compiled, x)
    out_e, in_e, g_e = outputs_and_grads(eager, x)
    torch._dynamo.reset()
    assert len(graphs) == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("ckpt_ext.mlp" in str(t) for t in targets) == 1  # block1..block3 as one op
    assert not any("tanh" in str(t) for t in targets)
    assert rel_err(out_c[0], out_e[0]) <= 1e-6 and rel_err(in_c[0], in_e[0]) <= 1e-6
    assert all(rel_err(g_c[n], g_e[n]) <= 1e-6 for n in g_e)


def test_run_across_blocks_of_a_rewritten_forward_is_kept_by_a_second_fuse():
    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
            self.b = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
            self.w = nn.Parameter(torch.randn(8, 4))

        def forward(self, x, /):
            return self.b(self.a(x)) + torch.tanh(F.linear(x, self.w))

    torch.manual_seed(0)
    model = Root().double()
    before = copy.deepcopy(model)
    _, report = fuse(model, rewrite=True)
    assert [(d.layers, d.how) for d in report.fused] == [
        (("F.linear", "torch.tanh"), "rewrite"), (("a.0", "a.1", "b.0", "b.1"), "across")]
    parts = (model.a._ckpt_ext_runs, model.b._ckpt_ext_runs)
    _, again = fuse(model, rewrite=True)  # the forward is now the rewritten one
    assert len(again) == 0 and [d.action for d in again.decisions] == ["already fused"]
    assert model.a._ckpt_ext_runs is parts[0] and model.b._ckpt_ext_runs is parts[1]
    assert_same_computation(before, model, [torch.randn(3, 4, dtype=torch.float64)],
                            torch.float64)


# ------------------------------------------------------------------------------------------------
# Pickles: what fuse leaves in a model lives at one module path

# The classes of the objects fuse leaves in a model (and so in its pickles), by the module that
# holds them; ckpt_ext.convert names each of them too.
PICKLED = {"ckpt_ext.convert.runtime": ("FusedSequential", "RunLinear", "RunTanh", "_Run",
                                        "_RunPart", "_OwnerForward", "_Guard"),
           "ckpt_ext.convert.report": ("Decision",)}


def _pickled_classes():
    import importlib

    return [getattr(importlib.import_module(module), name)
            for module, names in PICKLED.items() for name in names]


def test_pickled_classes_live_at_their_module_path():
    from ckpt_ext.convert import runtime

    for module, names in PICKLED.items():
        for name in names:
            cls = getattr(ckpt_ext.convert, name)
            assert (cls.__module__, cls.__qualname__) == (module, name)
    assert runtime.PartRole.__module__ == "ckpt_ext.convert.runtime"


def _dumps_naming(obj, module):
    """pickle.dumps(obj), the pickled classes named at ``module`` (None: where they live)."""
    classes = _pickled_classes()
    homes = [cls.__module__ for cls in classes]
    try:
        for cls in classes:
            cls.__module__ = module or cls.__module__
        return pickle.dumps(obj)
    finally:
        for cls, home in zip(classes, homes):
            cls.__module__ = home


@pytest.mark.parametrize("module", [None, "ckpt_ext.convert"])
def test_pickled_fused_model_loads_and_computes_the_same(module):
    """A fused model (a run across blocks with an owner, a FusedSequential, a rewritten forward
    with a guard) pickles, and loads from a pickle that names its classes where they live or at
    ckpt_ext.convert, computing what the unfused model computes."""
    torch.manual_seed(0)
    models = [_writeup_net(), FunctionalForms("torch.tanh").double()]
    inputs = [torch.randn(4, 16, dtype=torch.float64), torch.randn(4, 10, dtype=torch.float64)]
    plain = copy.deepcopy(models)
    fuse(models[0])
    fuse(models[1], rewrite=True)
    assert type(vars(models[1])["forward"]).__name__ == "_OwnerForward"
    data = _dumps_naming(models, module)
    names = {arg for op, arg, _ in pickletools.genops(data) if isinstance(arg, str)}
    assert {"ckpt_ext.convert.runtime", "ckpt_ext.convert.report"} <= names if module is None \
        else module in names
    loaded = pickle.loads(data)
    for before, fused, after, x in zip(plain, models, loaded, inputs):
        assert kinds(after) == kinds(fused)
        assert_same_computation(before, after, [x], torch.float64)
