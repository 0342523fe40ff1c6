"""ckpt_ext.fuse and the callers of the modules it changed, as users meet them: a child called on
its own, from a method or from outside code, hooks registered after fusing, torch.compile and
torch.func, an attribute the forward reads set after fusing, a forward that counts its calls, and
what the report lists as not analysed.

Every case is compared against an unfused ``copy.deepcopy`` of the model in float64: the values and
the gradient of every input and parameter (``same_as_unfused``: within 1e-14 relative; most are
bit-identical). Each test also checks that the fused run is really in place where it claims one, so
that it cannot pass by fusing nothing.
"""
from __future__ import annotations

import copy
import io
import threading

import pytest
import torch
from torch import nn

from ckpt_ext import fuse
from ckpt_ext.convert import FusedSequential, RunLinear, RunTanh
from _ecosys import (ActorCritic, BertPooler, outputs_and_grads, rel_err,
                     saved_activation_bytes)

TOL = 1e-14
F64 = torch.float64


class Call(nn.Module):
    """``fn(model, *inputs)`` as a module, so that outputs_and_grads sees model's parameters."""

    def __init__(self, model: nn.Module, fn) -> None:
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, *inputs):
        return self.fn(self.model, *inputs)


def same_as_unfused(ref: nn.Module, fused: nn.Module, *inputs, fn=None) -> None:
    """fn(fused, *inputs) against fn(ref, *inputs) (the modules themselves when fn is None): the
    outputs, the inputs' gradients and every parameter's gradient of sum(outputs²)."""
    a, b = (Call(ref, fn), Call(fused, fn)) if fn is not None else (ref, fused)
    out_r, in_r, g_r = outputs_and_grads(a, *inputs)
    out_f, in_f, g_f = outputs_and_grads(b, *inputs)
    assert len(out_r) == len(out_f) and len(in_r) == len(in_f)
    for o_f, o_r in zip(out_f, out_r):
        assert o_f.shape == o_r.shape and rel_err(o_f, o_r) <= TOL
    for i_f, i_r in zip(in_f, in_r):
        assert rel_err(i_f, i_r) <= TOL
    assert g_f.keys() == g_r.keys() and (len(g_r) > 0 or not list(a.parameters()))
    for name in g_r:
        assert rel_err(g_f[name], g_r[name]) <= TOL, name


def _writeup_net(mode: str = "plain"):
    from ckpt_ext.models import Net

    torch.manual_seed(0)
    return Net(in_features=16, hidden=32, depth=3, mode=mode, dtype=F64)


def _actor_critic():
    torch.manual_seed(0)
    return ActorCritic(dtype=F64)


# ------------------------------------------------------------------------------------------------
# A child called on its own, from outside code and from a method


def test_actor_critic_trunks_and_heads_called_on_their_own():
    """The default fuse makes one run value_net.0 .. value_net.3 -> value_head (and the same for
    the policy): inside ActorCritic.forward the trunk computes the run. Called on its own, the
    trunk returns its (B, 64) features and the head its own Linear, as unfused."""
    model = _actor_critic()
    ref = copy.deepcopy(model)
    _, report = fuse(model)
    assert [d.how for d in report.fused] == ["across", "across"]
    assert type(model.value_head) is RunLinear and type(model.value_net) is FusedSequential
    obs, h = torch.randn(5, 11, dtype=F64), torch.randn(5, 64, dtype=F64)
    same_as_unfused(ref, model, obs)
    for name, x in (("value_net", obs), ("policy_net", obs), ("value_head", h),
                    ("action_net", h)):
        same_as_unfused(getattr(ref, name), getattr(model, name), x)
    assert model.value_net(obs).shape == (5, 64)
    # Outside code calling the members in the forward's order, in another order, or twice.
    for fn in (lambda m, x: m.value_head(m.value_net(x)),
               lambda m, x: (m.value_net(x), m.value_head(m.value_net(x))),
               lambda m, x: m.policy_net(x) + m.value_net(x)):
        same_as_unfused(ref, model, obs, fn=fn)
    # ... and the model itself still computes the run fused: only the trunks' inputs are kept.
    assert saved_activation_bytes(model, obs) == 5 * 11 * 8
    # Called on its own, a trunk computes Linear, Tanh, Linear as a run of its own: it keeps its
    # input and its last tanh output, not the inner one.
    assert saved_activation_bytes(ref.value_net, obs) == 5 * (11 + 2 * 64) * 8
    assert saved_activation_bytes(model.value_net, obs) == 5 * (11 + 64) * 8
    assert "otherwise 0..2 as one run" in repr(model.value_net)


class WithMethods(ActorCritic):
    """The methods RL libraries call on a policy (stable-baselines3: forward_critic,
    predict_values), besides forward."""

    def forward_critic(self, obs):
        return self.value_net(obs)

    def predict_values(self, obs):
        return self.value_head(self.forward_critic(obs))

    def features(self, obs):
        return self.policy_net(obs), self.value_net(obs)


def test_members_called_from_a_method_compute_their_own_output():
    torch.manual_seed(0)
    model = WithMethods(dtype=F64)
    ref = copy.deepcopy(model)
    _, report = fuse(model)
    assert [d.how for d in report.fused] == ["across", "across"]  # fused, methods or not
    obs = torch.randn(6, 11, dtype=F64)
    for method in ("forward_critic", "predict_values", "features", "forward"):
        same_as_unfused(ref, model, obs, fn=lambda m, x, method=method: getattr(m, method)(x))


@pytest.mark.parametrize("name", ["block1", "block2", "block3"])
def test_writeup_blocks_called_on_their_own(name):
    """After fuse(Net), block1 alone returns block1's output (not the run's), block2 and block3
    their own (not their input): values and gradients, alone and chained outside Net.forward."""
    model = _writeup_net()
    ref = copy.deepcopy(model)
    _, report = fuse(model)
    assert [d.how for d in report.fused] == ["across"]
    h = torch.randn(7, 32, dtype=F64)
    same_as_unfused(getattr(ref, name), getattr(model, name), h)
    same_as_unfused(ref, model, h, fn=lambda m, x: m.block3(m.block2(m.block1(x))))
    same_as_unfused(ref, model, h, fn=lambda m, x: m.block1(m.block3(x)) + m.block2(x))
    x = torch.randn(7, 16, dtype=F64)
    same_as_unfused(ref, model, x)
    # The chain still keeps one activation: x (kept by linear1) and linear1's output.
    assert saved_activation_bytes(model, x) == 7 * (16 + 32) * 8


class Nested(nn.Module):
    """A run that starts inside one nested Sequential and ends inside another, all in one
    Sequential, next to a run of children that a forward calls."""

    def __init__(self):
        super().__init__()
        self.seq = nn.Sequential(nn.Sequential(nn.ReLU(), nn.Linear(4, 8), nn.Tanh()),
                                 nn.Linear(8, 8), nn.Tanh(),
                                 nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8),
                                               nn.ReLU()))
        self.fc, self.act = nn.Linear(8, 8), nn.Tanh()
        self.out = nn.Sequential(nn.Linear(8, 3), nn.Tanh(), nn.Linear(3, 3))

    def forward(self, x):
        return self.out(self.act(self.fc(self.seq(x) * 0.5)))


def test_nested_sequentials_and_child_runs_called_on_their_own():
    torch.manual_seed(0)
    model = Nested().double()
    ref = copy.deepcopy(model)
    _, report = fuse(model)
    assert [d.layers for d in report.fused] == [
        ("fc", "act", "out.0", "out.1", "out.2"),
        ("seq.0.1", "seq.0.2", "seq.1", "seq.2", "seq.3.0", "seq.3.1", "seq.3.2", "seq.3.3")]
    assert type(model.seq) is FusedSequential and type(model.seq[0]) is nn.Sequential
    x = torch.randn(5, 4, dtype=F64)
    same_as_unfused(ref, model, x)
    for path, width in (("seq.0", 4), ("seq.3", 8), ("fc", 8), ("act", 8), ("out", 8),
                        ("out.0", 8)):
        same_as_unfused(ref.get_submodule(path), model.get_submodule(path),
                        torch.randn(5, width, dtype=F64))
    same_as_unfused(ref, model, torch.randn(5, 8, dtype=F64),
                    fn=lambda m, h: m.out(m.act(m.fc(h))))


# ------------------------------------------------------------------------------------------------
# Hooks registered after fuse


@pytest.mark.parametrize("where", ["value_net", "value_net.2", "value_net.3", "value_head"])
@pytest.mark.parametrize("kind", ["forward", "forward_pre", "full_backward"])
def test_hook_registered_after_fuse_runs_on_the_modules_own_output(where, kind):
    """Logging activations with a hook, after fusing: nothing raises, the hook sees what it sees
    on the unfused copy (the run is computed member by member while the hook is there), the model
    computes the same values and gradients, and the run is fused again once the hook is removed."""
    model, ref = _actor_critic(), None
    ref = copy.deepcopy(model)
    fuse(model)
    seen = {"fused": [], "ref": []}

    def register(m, key):
        if kind == "forward":
            return m.get_submodule(where).register_forward_hook(
                lambda mod, inp, out: seen[key].append(out.detach().clone()))
        if kind == "forward_pre":  # a pre-hook that changes the input
            return m.get_submodule(where).register_forward_pre_hook(
                lambda mod, inp: (seen[key].append(inp[0].detach().clone()), (inp[0] * 0.5,))[1])
        return m.get_submodule(where).register_full_backward_hook(
            lambda mod, gin, gout: seen[key].append(gout[0].detach().clone()))

    handles = [register(model, "fused"), register(ref, "ref")]
    obs = torch.randn(4, 11, dtype=F64)
    same_as_unfused(ref, model, obs)
    assert len(seen["fused"]) == len(seen["ref"]) == 1
    assert rel_err(seen["fused"][0], seen["ref"][0]) <= TOL
    for h in handles:
        h.remove()
    same_as_unfused(ref, model, obs)
    assert saved_activation_bytes(model, obs) == 4 * 11 * 8  # fused again


def test_hook_on_a_writeup_block_and_on_a_child_run_member():
    for make, where, width in ((_writeup_net, "block2", 16), (_writeup_net, "block1.1", 16),
                               (lambda: Nested().double(), "act", 4),
                               (lambda: Nested().double(), "seq.3", 4)):
        torch.manual_seed(0)
        model = make()
        ref = copy.deepcopy(model)
        fuse(model)
        seen = []
        model.get_submodule(where).register_forward_hook(lambda m, i, o: seen.append(o))
        ref_seen = []
        ref.get_submodule(where).register_forward_hook(lambda m, i, o: ref_seen.append(o))
        same_as_unfused(ref, model, torch.randn(3, width, dtype=F64))
        # within rounding, not bitwise: a fused run before it computes tanh with ckpt_ext's
        # kernel, 1 ulp from torch.tanh (Sleef's where torch dispatches to AVX-512)
        assert len(seen) == 1 and rel_err(seen[0], ref_seen[0]) <= TOL, where


# ------------------------------------------------------------------------------------------------
# torch.compile and torch.func


def test_members_and_model_under_torch_compile():
    import torch._dynamo

    model = _actor_critic()
    ref = copy.deepcopy(model)
    fuse(model)
    obs, h = torch.randn(5, 11, dtype=F64), torch.randn(5, 64, dtype=F64)
    torch._dynamo.reset()
    try:
        for name, x in (("value_net", obs), ("value_head", h)):
            compiled = torch.compile(getattr(model, name), fullgraph=True, backend="aot_eager")
            same_as_unfused(getattr(ref, name), compiled, x)
        seen = []
        model.value_net.register_forward_hook(lambda m, i, o: seen.append(o.shape))
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        same_as_unfused(ref, compiled, obs)
        assert seen == [torch.Size([5, 64])]
    finally:
        torch._dynamo.reset()


def test_members_and_model_under_torch_func():
    from torch.func import functional_call, grad, jacrev, vmap

    model = _writeup_net()
    ref = copy.deepcopy(model)
    fuse(model)
    x, h = torch.randn(6, 16, dtype=F64), torch.randn(6, 32, dtype=F64)
    for m_f, m_r, inp in ((model, ref, x), (model.block1, ref.block1, h),
                          (model.block2, ref.block2, h)):
        params_f, params_r = dict(m_f.named_parameters()), dict(m_r.named_parameters())
        out_f = functional_call(m_f, params_f, (inp,))
        assert rel_err(out_f, functional_call(m_r, params_r, (inp,))) <= TOL
        assert rel_err(vmap(m_f)(inp), vmap(m_r)(inp)) <= TOL
        g_f = grad(lambda p: functional_call(m_f, p, (inp,)).pow(2).sum())(params_f)
        g_r = grad(lambda p: functional_call(m_r, p, (inp,)).pow(2).sum())(params_r)
        assert g_f.keys() == g_r.keys()
        assert all(rel_err(g_f[k], g_r[k]) <= TOL for k in g_r)
        assert rel_err(jacrev(m_f)(inp[0]), jacrev(m_r)(inp[0])) <= TOL


# ------------------------------------------------------------------------------------------------
# State the forward reads, set after fusing


class FNN(nn.Module):
    """DeepXDE's FNN, reduced: a tanh MLP written with torch.tanh, and an output transform that
    DeepXDE sets after building the network to impose hard boundary conditions."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(1, 16), nn.Linear(16, 16), nn.Linear(16, 1)
        self._output_transform = None

    def forward(self, x):
        y = self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))
        if self._output_transform is not None:
            y = self._output_transform(x, y)
        return y


def _hard_zero_boundary(x, y):
    return (1 - x ** 2) * y  # u(-1) = u(1) = 0 exactly


def test_rewritten_forward_reads_an_output_transform_set_after_fuse():
    torch.manual_seed(0)
    net = FNN().double()
    ref = copy.deepcopy(net)
    _, report = fuse(net, rewrite=True)
    assert report.rewritten == [""] and [d.how for d in report.fused] == ["rewrite"]
    assert "ckpt_ext_ops_tanh_mlp(" in net.forward.source
    x = torch.linspace(-1, 1, 9, dtype=F64).unsqueeze(1)
    same_as_unfused(ref, net, x)
    for m in (net, ref):
        m._output_transform = _hard_zero_boundary
    same_as_unfused(ref, net, x)
    u = net(x).detach()
    assert u[0].item() == 0.0 and u[-1].item() == 0.0  # was ±0.998 with the value baked in
    for m in (net, ref):  # and back
        m._output_transform = None
    same_as_unfused(ref, net, x)
    assert saved_activation_bytes(net, x) < saved_activation_bytes(ref, x)  # fused again


def test_writeup_net_with_its_mode_changed_after_fuse():
    """Net.forward branches on self.mode: fused in plain mode, then switched to checkpoint mode
    (block1 and block2 re-run on their own in backward) it computes as the unfused copy."""
    model = _writeup_net()
    ref = copy.deepcopy(model)
    fuse(model)
    x = torch.randn(5, 16, dtype=F64)
    for mode, reentrant in (("checkpoint", False), ("checkpoint", True),
                            ("checkpoint-stack", False), ("plain", False)):
        for m in (model, ref):
            m.mode, m.use_reentrant = mode, reentrant
        same_as_unfused(ref, model, x)
    assert saved_activation_bytes(model, x) == 5 * (16 + 32) * 8  # plain again: fused


FLAGS = {"scale": False}


class ReadsAGlobal(nn.Module):
    """A forward whose path depends on state outside the module, which fuse cannot see."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.b = nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    def forward(self, x):
        h = self.a(x)
        if FLAGS["scale"]:
            h = h * 2
        return self.b(h)


def test_a_path_the_analysis_did_not_see_raises_instead_of_a_wrong_result():
    torch.manual_seed(0)
    model = ReadsAGlobal().double()
    ref = copy.deepcopy(model)
    _, report = fuse(model)
    assert [d.how for d in report.fused] == ["across"]
    x = torch.randn(3, 4, dtype=F64)
    same_as_unfused(ref, model, x)
    FLAGS["scale"] = True
    try:
        with pytest.raises(RuntimeError, match="took a path its analysis did not see"):
            model(x)
        same_as_unfused(ref.a, model.a, x)  # the members alone are still right
    finally:
        FLAGS["scale"] = False
    same_as_unfused(ref, model, x)  # and the region was left clean


# ------------------------------------------------------------------------------------------------
# A forward that counts its calls


class Dynamics(nn.Module):
    """A Neural-ODE dynamics function as torchdiffeq users write it: it counts its evaluations."""

    def __init__(self, steer: bool = False):
        super().__init__()
        self.nfe = 0
        self.steer = steer
        self.fc, self.act = nn.Linear(16, 16), nn.Tanh()

    def forward(self, t, y):
        self.nfe += 1
        if self.steer and self.nfe > 3:  # a count the forward branches on
            return y
        return -y + self.act(self.fc(y))


class SequentialDynamics(nn.Module):
    """The same with the layers in a Sequential: -y + Sequential(Linear, Tanh)(y). Whether the
    pair's output is kept depends on the forward (a residual add: it is not)."""

    def __init__(self):
        super().__init__()
        self.nfe = 0
        self.net = nn.Sequential(nn.Linear(16, 16), nn.Tanh())

    def forward(self, t, y):
        self.nfe += 1
        return -y + self.net(y)


def rk4(func, y, steps=4):
    h = 1.0 / steps
    t = 0.0
    for _ in range(steps):
        k1 = func(t, y)
        k2 = func(t + h / 2, y + h / 2 * k1)
        k3 = func(t + h / 2, y + h / 2 * k2)
        k4 = func(t + h, y + h * k3)
        y = y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        t += h
    return y


@pytest.mark.parametrize("make,layers", [(Dynamics, ("fc", "act")),
                                         (SequentialDynamics, ("net.0", "net.1"))],
                         ids=["children", "sequential"])
def test_ode_function_with_a_counter_is_analysed_and_still_counts(make, layers):
    torch.manual_seed(0)
    func = make().double()
    ref = copy.deepcopy(func)
    _, report = fuse(func)
    assert report.not_analysed == [] and func.nfe == 0  # traced on a copy
    (d,) = report.fused
    assert d.layers == layers and "residual add" in d.why
    if make is Dynamics:  # the children became the run's members, inside the counting forward
        assert type(func.fc) is RunLinear and type(func.act) is RunTanh and d.how == "children"
    rows = 32
    y0 = torch.randn(rows, 16, dtype=F64)
    same_as_unfused(ref, func, y0, fn=lambda m, y: rk4(m, y))
    assert func.nfe == ref.nfe == 16
    saved_f = saved_activation_bytes(Call(func, lambda m, y: rk4(m, y)), y0)
    saved_r = saved_activation_bytes(Call(ref, lambda m, y: rk4(m, y)), y0)
    assert saved_r - saved_f == 16 * rows * 16 * 8  # each evaluation's tanh output
    assert func.nfe == ref.nfe == 32


def test_a_counter_the_forward_branches_on_is_left_alone():
    torch.manual_seed(0)
    func = Dynamics(steer=True).double()
    ref = copy.deepcopy(func)
    _, report = fuse(func)
    assert len(report) == 0 and type(func.fc) is nn.Linear
    assert "changed nfe, which it also reads other than to count" in report.near_misses[0].why
    same_as_unfused(ref, func, torch.randn(4, 16, dtype=F64), fn=lambda m, y: rk4(m, y))
    assert func.nfe == ref.nfe


# ------------------------------------------------------------------------------------------------
# The report; copies, pickles and threads


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.scale if x.sum() > 0 else x  # a branch on data: fx cannot trace it


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = Untraceable()
        self.mlp = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())

    def forward(self, x, mask=None):
        h = self.pre(x)
        return self.mlp(h if mask is None else h * mask)


def test_not_analysed_lists_every_forward_not_analysed():
    torch.manual_seed(0)
    model = Outer().double()
    ref = copy.deepcopy(model)
    _, report = fuse(model)
    assert [p for p, _ in report.not_analysed] == ["", "pre"]
    assert "optional argument mask=None" in report.not_analysed[0][1]
    assert "where it branches on a traced value" in report.not_analysed[1][1]
    assert "its caller <model> was not analysed" in report.near_misses[0].why
    same_as_unfused(ref, model, torch.randn(3, 4, dtype=F64).abs())


def test_copies_pickles_and_threads():
    model = _actor_critic()
    ref = copy.deepcopy(model)
    fuse(model)
    obs = torch.randn(8, 11, dtype=F64)
    twin = copy.deepcopy(model)  # computes with its own parameters
    with torch.no_grad():
        twin.value_head.weight.zero_()
        twin.value_head.bias.zero_()
    assert torch.equal(twin(obs)[1], torch.zeros(8, 1, dtype=F64))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    same_as_unfused(ref, loaded, obs)
    assert type(loaded.value_head) is RunLinear and type(loaded.value_net[3]) is nn.Tanh

    # One model called from several threads at once (an inference server): each call has its
    # own region, so every thread gets what one thread alone gets.
    with torch.no_grad():
        want = list(model(obs)) + [model.value_net(obs)]
    assert rel_err(want[2], ref.value_net(obs)) <= TOL
    errors = []

    def work(i):
        with torch.no_grad():
            for _ in range(50):
                got = list(model(obs)) if i % 2 else [None, None, model.value_net(obs)]
                for g, w in zip(got, want if i % 2 else [None, None, want[2]]):
                    if g is not None and not torch.equal(g, w):
                        errors.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_pooler_pair_members_called_on_their_own():
    """BERT's pooler: dense -> activation, fused as a pair inside BertPooler.forward. Called on
    its own, dense is the Linear and activation the Tanh."""
    torch.manual_seed(0)
    pooler = BertPooler(6).double()
    ref = copy.deepcopy(pooler)
    _, report = fuse(pooler)
    assert [d.layers for d in report.fused] == [("dense", "activation")]
    assert type(pooler.dense) is RunLinear and type(pooler.activation) is RunTanh
    hidden = torch.randn(2, 3, 6, dtype=F64)
    same_as_unfused(ref, pooler, hidden)
    x = torch.randn(2, 6, dtype=F64)
    same_as_unfused(ref.dense, pooler.dense, x)
    same_as_unfused(ref, pooler, x, fn=lambda m, h: m.activation(m.dense(h) + 1))
    assert torch.equal(pooler.activation(x), torch.tanh(x))


def test_hooks_registered_for_every_module_after_fuse():
    """A global module hook (torch.nn.modules.module.register_module_forward_hook, as activation
    loggers and module trackers use) sees each module's own output: while one is registered the
    run is computed member by member."""
    from torch.nn.modules.module import register_module_forward_hook

    model = _writeup_net()
    ref = copy.deepcopy(model)
    fuse(model)
    outputs = {"fused": {}, "ref": {}}
    names = {id(m): ("fused", n) for n, m in model.named_modules()}
    names.update({id(m): ("ref", n) for n, m in ref.named_modules()})

    def log(module, inputs, output):
        key, name = names[id(module)]
        outputs[key][name] = output.detach()

    handle = register_module_forward_hook(log)
    try:
        same_as_unfused(ref, model, torch.randn(3, 16, dtype=F64))
    finally:
        handle.remove()
    assert outputs["fused"].keys() == outputs["ref"].keys() and "block1" in outputs["ref"]
    for name, out in outputs["ref"].items():
        assert rel_err(outputs["fused"][name], out) <= TOL, name
    assert saved_activation_bytes(model, torch.randn(3, 16, dtype=F64)) == 3 * (16 + 32) * 8


class ClassFlag(nn.Module):
    """A forward that branches on a class attribute, which a user may set on the instance (or the
    class) later."""

    DOUBLE = False

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = torch.tanh(self.lin(x))
        return y * 2 if self.DOUBLE else y


def test_rewritten_forward_reads_a_class_attribute_at_call_time():
    torch.manual_seed(0)
    model = ClassFlag().double()
    ref = copy.deepcopy(model)
    _, report = fuse(model, rewrite=True)
    assert report.rewritten == [""] and "ckpt_ext_ops_linear_tanh(" in model.forward.source
    x = torch.randn(3, 4, dtype=F64)
    same_as_unfused(ref, model, x)
    for m in (model, ref):
        m.DOUBLE = True
    same_as_unfused(ref, model, x)
    assert rel_err(model(x), 2 * torch.tanh(model.lin(x))) <= TOL


@pytest.mark.parametrize("reentrant", [False, True])
def test_fused_model_and_members_under_torch_utils_checkpoint(reentrant):
    """Checkpointing a fused model re-runs its forward in backward (the region is marked again);
    checkpointing a member on its own re-runs it outside any region, where it computes its own
    output both times."""
    from torch.utils.checkpoint import checkpoint

    model = _writeup_net()
    ref = copy.deepcopy(model)
    fuse(model)
    x, h = torch.randn(4, 16, dtype=F64), torch.randn(4, 32, dtype=F64)
    same_as_unfused(ref, model, x, fn=lambda m, v: checkpoint(m, v, use_reentrant=reentrant))
    same_as_unfused(ref, model, h, fn=lambda m, v: checkpoint(m.block2, checkpoint(
        m.block1, v, use_reentrant=reentrant), use_reentrant=reentrant))
