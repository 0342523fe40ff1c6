"""ckpt_ext.fuse on runs that mix activations (one per layer): an RL actor ``Linear, ReLU, Linear,
ReLU, Linear, Tanh`` and ``Linear, Tanh, Linear, GELU`` are one unit each, computed by
``ckpt_ext.mlp`` with the list of names. Outputs and every gradient against an unfused deep copy
(float64) and bitwise against ``ckpt_ext.mlp`` itself; the report's text and figures against what
autograd keeps (saved-tensor hooks); one mixed unit against the same layers as two stretches;
member-by-member fallback, unfuse and pickles; stable-baselines3's TD3 actor (test extras)."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ckpt_ext
from ckpt_ext import fuse, unfuse
from ckpt_ext.convert import FusedSequential, RunLinear, member_class
from _ecosys import kept_bytes, outputs_and_grads, rel_err, saved_activation_bytes
from reference import measured

F64 = torch.float64
# Measured (CPU): outputs and gradients within 3.6e-16 (float64) of the unfused copy's, relative
# (the same figure as test_fuse_activations.py's), 1.1e-7 (float32, test_convert.py's). TOL is
# ~5x that, and 10x for float32.
TOL = {torch.float64: 2e-15, torch.float32: 1e-6}


def actor(obs: int = 11, hidden: int = 32, act: int = 3) -> nn.Sequential:
    """stable-baselines3's TD3/DDPG actor ``mu``: ReLU between, Tanh squashing the action."""
    return nn.Sequential(nn.Linear(obs, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, act), nn.Tanh())


def tanh_gelu() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 12), nn.GELU())


class Children(nn.Module):
    """fc1, act1, fc2, act2, fc3, act3 called one after the other, each activation its own."""

    def __init__(self, acts=(nn.SiLU, nn.Tanh, nn.ReLU)):
        super().__init__()
        self.fc1, self.act1 = nn.Linear(6, 16), acts[0]()
        self.fc2, self.act2 = nn.Linear(16, 12), acts[1]()
        self.fc3, self.act3 = nn.Linear(12, 3), acts[2]()

    def forward(self, x):
        return self.act3(self.fc3(self.act2(self.fc2(self.act1(self.fc1(x))))))


class Functional(nn.Module):
    """The actor in forward code: fused by a rewrite."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(6, 16), nn.Linear(16, 12), nn.Linear(12, 3)

    def forward(self, x):
        return torch.tanh(self.l3(F.relu(self.l2(F.gelu(self.l1(x))))))


def assert_same(before, after, x):
    out_b, in_b, g_b = outputs_and_grads(before, x)
    out_a, in_a, g_a = outputs_and_grads(after, x)
    key, tol = f"fuse_mixed.{str(x.dtype).removeprefix('torch.')}", TOL[x.dtype]
    for a, b in zip(out_a + in_a, out_b + in_b):
        assert measured(key, rel_err(a, b)) <= tol
    assert g_a.keys() == g_b.keys() and len(g_b) > 0
    for name in g_b:
        assert measured(key, rel_err(g_a[name], g_b[name])) <= tol, name


def freed(before, after, x):
    """Bytes plain autograd keeps that the fused model does not, by both meters (they agree)."""
    saved = saved_activation_bytes(before, x) - saved_activation_bytes(after, x)
    assert kept_bytes(before, x) - kept_bytes(after, x) == saved
    return saved


def _linears(model):
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def assert_bitwise_mlp(model, x, names):
    """The fused model's output and every gradient are ckpt_ext.mlp's with the list, to the bit."""
    lins = _linears(model)
    model.zero_grad(set_to_none=True)
    xa = x.clone().requires_grad_()
    out = model(xa)
    out.square().sum().backward()
    got = [out.detach(), xa.grad] + [p.grad for lin in lins for p in (lin.weight, lin.bias)]
    ws = [lin.weight.detach().clone().requires_grad_() for lin in lins]
    bs = [lin.bias.detach().clone().requires_grad_() for lin in lins]
    xb = x.clone().requires_grad_()
    ref = ckpt_ext.mlp(xb, ws, bs, activation=list(names),
                       last_activation=len(names) == len(lins))
    ref.square().sum().backward()
    want = [ref.detach(), xb.grad] + [t.grad for pair in zip(ws, bs) for t in pair]
    for g, w in zip(got, want):
        assert torch.equal(g, w)


# ------------------------------------------------------------------------------------------------
# One unit, the report, the figures


@pytest.mark.parametrize("make,names,layers", [
    (actor, ("relu", "relu", "tanh"), "11->32->32->3"),
    (tanh_gelu, ("tanh", "gelu"), "6->16->12"),
], ids=["relu,relu,tanh", "tanh,gelu"])
def test_mixed_sequential_is_one_unit(make, names, layers):
    torch.manual_seed(0)
    model = make().double()
    before = copy.deepcopy(model)
    _, report = fuse(model)
    (d,) = report.fused
    assert d.layers == tuple(str(i) for i in range(2 * len(names))) and d.how == "sequential"
    assert d.activation == ", ".join(names)
    assert d.unit == (f"mlp mixed ({', '.join(names)}), {len(names)} layers {layers}, "
                      f"last {names[-1]}")
    assert f"a run of mixed activations ({', '.join(names)})" in d.why
    assert f"as mlp mixed ({', '.join(names)})" in str(report)
    assert report.near_misses == [] and report.other_layers == []
    assert type(model) is FusedSequential
    x = torch.randn(7, model[0].in_features, dtype=F64)
    assert_same(before, model, x)
    assert_bitwise_mlp(model, x, names)
    assert freed(before, model, x) == 7 * d.bytes_per_row


def test_figures_are_each_layers_own():
    """relu, relu, tanh: each inner relu keeps its output (the next Linear's input); the trailing
    tanh's output leaves the model. tanh, gelu: the inner tanh its output; gelu z and its output,
    the output freed too."""
    _, report = fuse(actor(obs=11, hidden=32, act=3), dry_run=True)
    assert report.bytes_per_row == (32 + 32 + 3) * 4
    _, report = fuse(tanh_gelu(), dry_run=True)
    assert report.bytes_per_row == (16 + 12) * 4  # gelu: z, not its output, which leaves


def test_one_mixed_unit_keeps_only_its_input_where_two_stretches_keep_their_joint():
    """What autograd keeps, by saved-tensor hooks: the mixed unit x alone; the same layers as two
    fused stretches (relu, relu | tanh) x and the relu output between them."""
    torch.manual_seed(0)
    model = actor().double()
    lins = _linears(model)
    ws, bs = [lin.weight for lin in lins], [lin.bias for lin in lins]
    x = torch.randn(9, 11, dtype=F64)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def kept(fn):
        saved = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        return out, sum(saved.values())

    xr = x.clone().requires_grad_()
    one, one_kept = kept(lambda: ckpt_ext.mlp(xr, ws, bs, ["relu", "relu", "tanh"]))
    two, two_kept = kept(lambda: ckpt_ext.mlp(
        ckpt_ext.mlp(xr, ws[:2], bs[:2], "relu"), ws[2:], bs[2:], "tanh"))
    assert torch.equal(one, two)
    assert one_kept == x.nbytes
    assert two_kept == x.nbytes + 9 * 32 * 8
    fused = copy.deepcopy(model)
    fuse(fused)
    assert saved_activation_bytes(fused, xr) == x.nbytes


def test_children_and_a_rewrite_build_mixed_runs():
    torch.manual_seed(0)
    model = Children().double()
    before = copy.deepcopy(model)
    _, report = fuse(model)
    (d,) = report.fused
    assert (d.layers, d.how, d.activation) == (
        ("fc1", "act1", "fc2", "act2", "fc3", "act3"), "children", "silu, tanh, relu")
    assert type(model.fc1) is RunLinear and type(model.act2) is member_class(nn.Tanh)
    x = torch.randn(5, 6, dtype=F64)
    assert_same(before, model, x)
    assert_bitwise_mlp(model, x, ("silu", "tanh", "relu"))
    assert freed(before, model, x) == 5 * d.bytes_per_row
    torch.manual_seed(0)
    model = Functional().double()
    before = copy.deepcopy(model)
    _, report = fuse(model, rewrite=True)
    (d,) = report.fused
    assert d.how == "rewrite" and d.activation == "gelu, relu, tanh"
    assert "activation = ['gelu', 'relu', 'tanh']" in vars(model)["forward"].source
    assert_same(before, model, x)
    assert freed(before, model, x) == 5 * d.bytes_per_row


def test_policy_all_fuses_the_run_with_its_trailing_activation():
    torch.manual_seed(0)
    model = actor().double()
    before = copy.deepcopy(model)
    _, memory = fuse(copy.deepcopy(model))
    _, report = fuse(model, policy="all")
    assert [(d.layers, d.activation) for d in report.fused] == [
        (("0", "1", "2", "3", "4", "5"), "relu, relu, tanh")]
    assert report.bytes_per_row >= memory.bytes_per_row
    x = torch.randn(4, 11, dtype=F64)
    assert_same(before, model, x)
    assert freed(before, model, x) == 4 * report.bytes_per_row


# ------------------------------------------------------------------------------------------------
# Every contract of a fused run, on a mixed one


def test_an_activation_that_changes_after_fuse_is_computed_member_by_member():
    """The run re-checks each layer's own activation at each call: nn.GELU switched to its tanh
    form in place (the same object, so the Sequential's elements are unchanged) makes the run fall
    back to its elements, which compute what the unfused copy computes."""
    torch.manual_seed(0)
    model = tanh_gelu().double()
    before = copy.deepcopy(model)
    fuse(model)
    x = torch.randn(5, 6, dtype=F64)
    model[3].approximate = before[3].approximate = "tanh"
    assert model._ckpt_ext_runs[0].run.problem() == "3 no longer computes gelu"
    assert_same(before, model, x)
    assert saved_activation_bytes(model, x) == saved_activation_bytes(before, x)
    model[3].approximate = before[3].approximate = "none"
    assert_same(before, model, x)
    assert saved_activation_bytes(model, x) == x.nbytes


def test_hooks_unfuse_and_pickles():
    torch.manual_seed(0)
    model = Children().double()
    before = copy.deepcopy(model)
    fuse(model)
    x = torch.randn(5, 6, dtype=F64)
    seen, ref_seen = [], []
    handles = [model.act2.register_forward_hook(lambda m, i, o: seen.append(o)),
               before.act2.register_forward_hook(lambda m, i, o: ref_seen.append(o))]
    assert_same(before, model, x)
    assert len(seen) == 1 and torch.equal(seen[0], ref_seen[0])
    for handle in handles:
        handle.remove()
    loaded = pickle.loads(pickle.dumps(model))
    assert loaded.fc1._ckpt_ext_run.activation == ("silu", "tanh", "relu")
    assert_same(before, loaded, x)
    assert saved_activation_bytes(loaded, x) == x.nbytes
    copied = copy.deepcopy(model)
    assert_same(before, copied, x)
    unfuse(model)
    assert [type(m) for m in model.modules()] == [type(m) for m in before.modules()]
    assert "forward" not in vars(model)
    assert_same(before, model, x)
    assert saved_activation_bytes(model, x) == saved_activation_bytes(before, x)


# ------------------------------------------------------------------------------------------------
# stable-baselines3's TD3 actor (test extras)


def _sb3():
    return pytest.importorskip("stable_baselines3", reason="stable_baselines3 is not installed "
                               "(pip install -r requirements.txt installs it)")


def test_stable_baselines3_squashed_mlp_is_one_mixed_unit():
    """sb3's own builder of actor networks, create_mlp(..., squash_output=True): Linear, ReLU,
    Linear, ReLU, Linear, Tanh, fused as one unit."""
    _sb3()
    from stable_baselines3.common.torch_layers import create_mlp
    torch.manual_seed(0)
    model = nn.Sequential(*create_mlp(3, 1, [32, 32], squash_output=True)).double()
    before = copy.deepcopy(model)
    _, report = fuse(model)
    (d,) = report.fused
    assert d.layers == tuple("012345") and d.activation == "relu, relu, tanh"
    assert "as mlp mixed (relu, relu, tanh), 3 layers 3->32->32->1, last tanh" in str(report)
    x = torch.randn(8, 3, dtype=F64)
    assert_same(before, model, x)
    assert_bitwise_mlp(model, x, ("relu", "relu", "tanh"))
    assert freed(before, model, x) == 8 * d.bytes_per_row


def test_stable_baselines3_td3_actor_trains_fused():
    """TD3's actor: torch.fx cannot trace Actor.forward (sb3's preprocessing asserts a real
    tensor), so where mu's output goes is not known: the trailing Tanh, whose backward keeps its
    output, is left out (fusing it frees nothing if that consumer keeps it) and the report says
    why; the relu layers fuse, and TD3's own loop trains the fused actor. float32: the actor casts
    its observations to float32."""
    sb3 = _sb3()
    from stable_baselines3.common.logger import Logger
    td3 = sb3.TD3("MlpPolicy", "Pendulum-v1", policy_kwargs={"net_arch": [32, 32]}, seed=0,
                  device="cpu", learning_starts=16, batch_size=16, train_freq=8)
    td3.set_logger(Logger(None, []))  # configure() would make a folder in /tmp
    plain = copy.deepcopy(td3.actor)
    model = copy.deepcopy(td3.actor)
    _, report = fuse(model)
    assert [(d.layers, d.activation) for d in report.fused] == [
        (tuple(f"mu.{i}" for i in range(5)), "relu")]
    assert [d.layers for d in report.near_misses] == [("mu.5",)]
    assert "the trailing Tanh is left out of the run (its output may be kept)" in \
        report.near_misses[0].why
    x = torch.randn(8, 3)
    assert_same(plain, model, x)
    assert freed(plain, model, x) == 8 * report.bytes_per_row
    fuse(td3.actor)
    start = [p.detach().clone() for p in td3.actor.parameters()]
    td3.learn(total_timesteps=48)
    assert type(td3.actor.mu) is FusedSequential
    after = list(td3.actor.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, start))
