"""torch.func over the fused ops: grad, vjp, vmap, jacrev, hessian, jvp, jacfwd and their nestings
give what the same function written with F.linear + torch.tanh gives, in float64.

Each case is a function of (x, W, b[, W2, b2]) written twice, once with ckpt_ext.linear_tanh or
ckpt_ext.tanh_mlp and once with stock ops; a transform is applied to both and the results are
compared by relative error. Before the fix, grad / jacrev / hessian raised "In order to use an
autograd.Function with functorch transforms ... it must override the setup_context staticmethod".
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap
from torch.utils._python_dispatch import TorchDispatchMode

import ckpt_ext
from reference import rel_err

# Measured largest relative error over every case below: 7.7e-16 (float64, third order through
# tanh_mlp). The bound leaves ~13x.
TOL = 1e-14
DT = torch.float64


def _args(n_layers: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 3, dtype=DT, generator=g)
    sizes = [3, 4, 2][:n_layers + 1]
    args = [x]
    for k, n in zip(sizes[:-1], sizes[1:]):
        args.append(torch.randn(n, k, dtype=DT, generator=g) * 0.8)
        args.append(torch.randn(n, dtype=DT, generator=g) if bias else None)
    return args


def _linear_tanh_pair(bias: bool):
    """(fused, reference, args) for one layer."""
    def fused(x, w, b):
        return ckpt_ext.linear_tanh(x, w, b)

    def ref(x, w, b):
        return torch.tanh(F.linear(x, w, b))

    return fused, ref, _args(1, bias)


def _tanh_mlp_pair(bias: bool, last_tanh: bool):
    """(fused, reference, args) for a two-layer stack."""
    def fused(x, w1, b1, w2, b2):
        return ckpt_ext.tanh_mlp(x, [w1, w2], [b1, b2], last_tanh=last_tanh)

    def ref(x, w1, b1, w2, b2):
        y = F.linear(torch.tanh(F.linear(x, w1, b1)), w2, b2)
        return torch.tanh(y) if last_tanh else y

    return fused, ref, _args(2, bias)


CASES = {
    "linear_tanh": lambda: _linear_tanh_pair(True),
    "linear_tanh-nobias": lambda: _linear_tanh_pair(False),
    "tanh_mlp": lambda: _tanh_mlp_pair(True, False),
    "tanh_mlp-last_tanh-nobias": lambda: _tanh_mlp_pair(False, True),
}


def _without_none(f, args):
    """f with its None arguments (absent biases) bound, and the remaining tensor arguments: the
    transforms take tensors only."""
    idx = [i for i, a in enumerate(args) if a is not None]

    def g(*ts):
        full = list(args)
        for i, t in zip(idx, ts):
            full[i] = t
        return f(*full)

    return g, [args[i] for i in idx]


def _scalar(f):
    return lambda *a: f(*a).sin().sum()


def _all(args):
    return tuple(range(len(args)))


def _grad_all(f, args):
    return grad(_scalar(f), argnums=_all(args))(*args)


def _vjp(f, args):
    out, pull = vjp(f, *args)
    cot = torch.linspace(-1, 1, out.numel(), dtype=DT).reshape(out.shape)
    return out, pull(cot)


def _vmap_x(f, args):
    xs = torch.stack([args[0], 2 * args[0], -args[0]])
    return vmap(f, in_dims=(0,) + (None,) * (len(args) - 1))(xs, *args[1:])


def _vmap_weight(f, args):
    # A batch of models (torch.func.stack_module_state style): the first weight batched.
    ws = torch.stack([args[1], 0.5 * args[1]])
    in_dims = (None, 0) + (None,) * (len(args) - 2)
    return vmap(f, in_dims=in_dims)(args[0], ws, *args[2:])


def _jacrev_all(f, args):
    return jacrev(f, argnums=_all(args))(*args)


def _hessian_x(f, args):
    return hessian(_scalar(f))(*args)


def _hessian_all(f, args):
    return hessian(_scalar(f), argnums=_all(args))(*args)


def _jvp(f, args):
    g = torch.Generator().manual_seed(1)
    tangents = tuple(torch.randn(a.shape, dtype=DT, generator=g) for a in args)
    return jvp(f, tuple(args), tangents)


def _jacfwd_all(f, args):
    return jacfwd(f, argnums=_all(args))(*args)


def _per_sample_grads(f, args):
    # vmap(grad) over the rows of x: one weight gradient per sample.
    def loss(w, row):
        return _scalar(f)(row.unsqueeze(0), w, *args[2:])

    return vmap(grad(loss), in_dims=(None, 0))(args[1], args[0])


def _grad_of_grad(f, args):
    return grad(lambda x: grad(_scalar(f))(x, *args[1:]).pow(2).sum())(args[0])


def _third_order(f, args):
    inner = lambda x: grad(_scalar(f))(x, *args[1:]).sum()  # noqa: E731
    return grad(lambda x: grad(inner)(x).pow(2).sum())(args[0])


def _jacrev_of_jacrev(f, args):
    return jacrev(jacrev(lambda x: f(x, *args[1:]).sum(0)))(args[0][:2])


def _vmap_of_jvp(f, args):
    ts = torch.stack([torch.ones_like(args[0]), -args[0]])
    return vmap(lambda t: jvp(lambda x: f(x, *args[1:]), (args[0],), (t,))[1])(ts)


TRANSFORMS = {
    "grad": _grad_all,
    "vjp": _vjp,
    "vmap-x": _vmap_x,
    "vmap-weight": _vmap_weight,
    "jacrev": _jacrev_all,
    "hessian-x": _hessian_x,
    "hessian-all": _hessian_all,
    "jvp": _jvp,
    "jacfwd": _jacfwd_all,
    "vmap-grad-per-sample": _per_sample_grads,
    "grad-grad": _grad_of_grad,
    "third-order": _third_order,
    "jacrev-jacrev": _jacrev_of_jacrev,
    "vmap-jvp": _vmap_of_jvp,
}


def _flatten(r):
    if isinstance(r, torch.Tensor):
        return [r]
    out = []
    for v in r:
        out += _flatten(v)
    return out


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("case", list(CASES))
def test_transform_matches_reference(case, transform):
    fused, ref, args = CASES[case]()
    fused, tensors = _without_none(fused, args)
    ref, _ = _without_none(ref, args)
    got = _flatten(TRANSFORMS[transform](fused, tensors))
    want = _flatten(TRANSFORMS[transform](ref, tensors))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert rel_err(g, w) <= TOL, (case, transform)


class _RecordOps(TorchDispatchMode):
    """Records (op name, shape of its first argument) of every op that reaches the dispatcher."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        self.calls.append((str(func.overloadpacket), None if first is None else tuple(first.shape)))
        return func(*args, **(kwargs or {}))

    @property
    def names(self):
        return [name for name, _ in self.calls]


def test_grad_runs_the_fused_forward():
    # The transforms run our op (not a silent fallback to something else): count it. The
    # backward under a transform is the op's composite (ATen ops the transforms see through).
    fused, _, args = CASES["linear_tanh"]()
    with _RecordOps() as c:
        grad(_scalar(fused))(*args)
    assert c.names.count("ckpt_ext.mlp") == 1
    assert "ckpt_ext.mlp_backward" not in c.names


def test_vmap_over_rows_folds_the_batch_into_one_call():
    # The vmap rule for a batch of inputs with shared weights runs the op once on all rows.
    fused, _, args = CASES["linear_tanh"]()
    xs = torch.stack([args[0]] * 4)
    with _RecordOps() as s:
        vmap(fused, in_dims=(0, None, None))(xs, *args[1:])
    assert [shape for name, shape in s.calls if name == "ckpt_ext.mlp"] == [(4, 5, 3)]


@pytest.mark.parametrize("case", list(CASES))
def test_vmap_over_an_empty_batch(case):
    # Batched weights and per-sample weight gradients run the op once per sample: with no
    # sample, the results still have the reference's shapes.
    fused, ref, args = CASES[case]()
    fused, tensors = _without_none(fused, args)
    ref, _ = _without_none(ref, args)
    x, w = tensors[0], tensors[1]
    ws = w.new_empty(0, *w.shape)
    in_dims = (None, 0) + (None,) * (len(tensors) - 2)
    got = vmap(fused, in_dims=in_dims)(x, ws, *tensors[2:])
    assert got.shape == vmap(ref, in_dims=in_dims)(x, ws, *tensors[2:]).shape
    rows = x.new_empty(0, x.shape[-1])
    per = [_per_sample_grads(f, [rows, *tensors[1:]]) for f in (fused, ref)]
    assert per[0].shape == per[1].shape == (0, *w.shape)
