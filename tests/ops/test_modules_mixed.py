"""FusedMLP with one activation per layer (``activation=["relu", "relu", "tanh"]``): the equivalent
nn.Sequential's keys and seeded values, output and every gradient against the reference
(float64) and bitwise against ckpt_ext.mlp with the list, a list of one name throughout being
that name, bad lists refused naming expected and given, from_modules over a mixed run, the
repr, and pickles (mixed, and the single-activation modules as before)."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import ckpt_ext
from ckpt_ext import FusedLinearTanh, FusedMLP, FusedTanhMLP
from reference import mlp_ref, rel_err

F64 = torch.float64
ACTOR = ["relu", "relu", "tanh"]  # stable-baselines3's TD3/DDPG actor: a squashed output


def _sequential(sizes, names):
    mods = []
    for i, (k, n) in enumerate(zip(sizes[:-1], sizes[1:])):
        mods.append(nn.Linear(k, n))
        if i < len(names):
            mods.append({"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU,
                         "silu": nn.SiLU}[names[i]]())
    return nn.Sequential(*mods)


def _params(m):
    lins = m.layers()
    return [lin.weight for lin in lins], [lin.bias for lin in lins]


def _run(m, x):
    """(out, grad_x, grads of every parameter by name) of sum(out²)."""
    x = x.clone().requires_grad_()
    m.zero_grad(set_to_none=True)
    out = m(x)
    out.square().sum().backward()
    return [out.detach(), x.grad] + [p.grad for _, p in sorted(m.named_parameters())]


@pytest.mark.parametrize("sizes,names,last", [
    ([11, 32, 32, 3], ACTOR, True),
    ([6, 16, 12], ["tanh", "gelu"], True),
    ([5, 9, 7, 4], ["silu", "tanh"], False),
], ids=["relu,relu,tanh", "tanh,gelu", "silu,tanh,no-last"])
def test_fused_mlp_with_a_list_is_the_sequential(sizes, names, last):
    torch.manual_seed(0)
    m = FusedMLP(sizes, activation=names, last_activation=last)
    torch.manual_seed(0)
    seq = _sequential(sizes, names)
    assert m.activation == tuple(names) and m.last_activation is last
    assert list(m.state_dict()) == list(seq.state_dict())
    for k, v in seq.state_dict().items():
        assert torch.equal(m.state_dict()[k], v)
    m = m.double()
    x = torch.randn(7, sizes[0], dtype=F64)
    ws, bs = _params(m)
    # Measured: 2.2e-16 at most (outputs and gradients); 10x that.
    assert rel_err(m(x), mlp_ref(x, ws, bs, names, last)) <= 2e-15
    back = m.to_sequential()
    assert [type(e) for e in back] == [type(e) for e in seq]
    got, want = _run(m, x), _run(back, x)
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 2e-15
    # to the bit: the module is ckpt_ext.mlp with the list
    wd = [w.detach().clone().requires_grad_() for w in ws]
    bd = [b.detach().clone().requires_grad_() for b in bs]
    xd = x.clone().requires_grad_()
    out = ckpt_ext.mlp(xd, wd, bd, activation=names, last_activation=last)
    out.square().sum().backward()
    named = dict(zip(m._layer_names, zip(wd, bd)))
    ref = [out.detach(), xd.grad] + [
        named[n.split(".")[0]][0 if n.endswith("weight") else 1].grad
        for n, _ in sorted(m.named_parameters())]
    for g, w in zip(got, ref):
        assert torch.equal(g, w)


def test_a_list_of_one_name_is_that_name():
    torch.manual_seed(0)
    listed = FusedMLP([5, 8, 8, 3], activation=["gelu"] * 3)
    torch.manual_seed(0)
    named = FusedMLP([5, 8, 8, 3], activation="gelu")
    assert listed.activation == "gelu" and repr(listed) == repr(named)
    x = torch.randn(4, 5)
    for a, b in zip(_run(listed, x), _run(named, x)):
        assert torch.equal(a, b)
    assert FusedMLP([5, 8, 3], activation=("tanh",), last_activation=False).activation == "tanh"


@pytest.mark.parametrize("sizes,names,last,pattern", [
    ([5, 8, 8, 3], ["relu", "tanh"], True, r"activation must be one name or 3 \(one per layer "
                                           r"with an activation: 3 layers, the last one "
                                           r"included\); got 2 names"),
    ([5, 8, 8, 3], ACTOR, False, r"activation must be one name or 2 .*none after the last\); "
                                 r"got 3 names"),
    ([5, 8, 3], ["relu", "swish"], True, r"activation must be one of 'tanh'.*got 'swish'"),
    ([5, 8, 3], ["relu", None], True, r"activation must be one of 'tanh'.*got None"),
], ids=["short", "long", "unknown", "none"])
def test_bad_lists_name_expected_and_given(sizes, names, last, pattern):
    with pytest.raises(ValueError, match="FusedMLP: " + pattern):
        FusedMLP(sizes, activation=names, last_activation=last)


def test_from_modules_over_a_mixed_run():
    torch.manual_seed(0)
    seq = _sequential([11, 32, 32, 3], ACTOR).double()
    m = FusedMLP.from_modules(seq)
    assert m.activation == tuple(ACTOR) and m.last_activation
    assert all(m._modules[str(i)] is seq[i] for i in (0, 2, 4))  # shared, not copied
    x = torch.randn(6, 11, dtype=F64)
    for a, b in zip(_run(m, x), _run(seq, x)):
        assert rel_err(a, b) <= 2e-15
    open_end = FusedMLP.from_modules(list(seq)[:5])  # Linear, ReLU, Linear, ReLU, Linear
    assert open_end.activation == "relu" and not open_end.last_activation
    mixed = FusedMLP.from_modules({"fc1": nn.Linear(4, 6), "act1": nn.GELU(),
                                   "fc2": nn.Linear(6, 2), "act2": nn.Sigmoid()})
    assert mixed.activation == ("gelu", "sigmoid")
    assert list(mixed.state_dict()) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    with pytest.raises(ValueError, match=r"FusedMLP.from_modules: entry 3 must be exactly an "
                                         r"activation module of ckpt_ext.ACTIVATIONS.*Softplus"):
        FusedMLP.from_modules([nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 3), nn.Softplus(beta=2)])
    with pytest.raises(ValueError, match="FusedTanhMLP.from_modules: entry 3 must be exactly Tanh"):
        FusedTanhMLP.from_modules([nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 3), nn.ReLU()])


def test_repr_shows_the_list():
    m = FusedMLP([3, 4, 5, 2], activation=ACTOR)
    assert repr(m).splitlines()[1].strip() == \
        "sizes=[3, 4, 5, 2], activation=('relu', 'relu', 'tanh'), last_activation=True"


def test_pickles_and_copies():
    """A mixed FusedMLP pickles with its tuple; the single-activation modules keep their layout
    (the attributes their pickles hold) and load as before."""
    torch.manual_seed(0)
    modules = [FusedMLP([5, 8, 8, 3], activation=ACTOR), FusedMLP([5, 8, 3], activation="gelu"),
               FusedTanhMLP([5, 8, 3]), FusedLinearTanh(5, 3)]
    assert vars(modules[1])["activation"] == "gelu"
    assert {k for k in vars(modules[2]) if not k.startswith("_")} >= {"last_tanh"}
    x = torch.randn(4, 5)
    for m in modules:
        for loaded in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m)):
            assert type(loaded) is type(m) and repr(loaded) == repr(m)
            for a, b in zip(_run(loaded, x), _run(m, x)):
                assert torch.equal(a, b)
