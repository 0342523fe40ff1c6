"""Higher-order gradients: create_graph=True through the fused ops (physics-informed training
differentiates the network output w.r.t. its input, then trains on that), while a plain
first-order backward keeps the fused backward kernel.

Covers: gradcheck and gradgradcheck in float64 of every op (so every op's backward, and the
backward of that, is checked against finite differences); the third order against stock PyTorch;
opcheck of the ops of the higher orders; the physics-informed step against the plain model, in
values (float64) and in exact bytes kept and peak (float32, the benchmark's network).
"""
from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ckpt_ext
from ckpt_ext import FusedLinearTanh, FusedTanhMLP, fuse
from ckpt_ext.memory import MemoryMeter
from _ecosys import Net, rel_err
from reference import linear_tanh_ref

OPS = torch.ops.ckpt_ext
DT = torch.float64


class OpCounter(TorchDispatchMode):
    """Counts every op that reaches the kernels (below autograd)."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _randn(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, dtype=DT, generator=g) * scale).requires_grad_()


# ------------------------------------------------------------------------------------------------
# gradcheck / gradgradcheck of every op, float64

@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("x_shape", [(5, 7), (2, 3, 7)])
def test_gradgradcheck_linear_tanh(x_shape, bias):
    x, w = _randn(*x_shape, seed=0), _randn(6, 7, seed=1)
    inputs = (x, w, _randn(6, seed=2)) if bias else (x, w)
    assert torch.autograd.gradcheck(ckpt_ext.linear_tanh, inputs)
    assert torch.autograd.gradgradcheck(ckpt_ext.linear_tanh, inputs)


@pytest.mark.parametrize("last_tanh", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_gradgradcheck_tanh_mlp(bias, last_tanh):
    x = _randn(2, 3, 4, seed=0)
    ws = [_randn(5, 4, seed=1, scale=0.7), _randn(3, 5, seed=2, scale=0.7),
          _randn(2, 3, seed=3, scale=0.7)]
    bs = [_randn(5, seed=4), None, _randn(2, seed=5)] if bias else [None, None, None]
    present = [b for b in bs if b is not None]

    def f(x, *params):
        it = iter(params[3:])
        biases = [next(it) if b is not None else None for b in bs]
        return ckpt_ext.tanh_mlp(x, params[:3], biases, last_tanh=last_tanh)

    inputs = (x, *ws, *present)
    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


MASKS3 = [(True, True, True), (True, False, False), (False, True, True), (False, False, True)]


MASKS4 = [(True, True, True, True), (True, True, False, False), (False, False, True, True),
          (False, True, False, True)]


def _gradgradcheck_second_order_op(op, given, rest, mask):
    """gradcheck and gradgradcheck of a second-order op taking (grad_grad_x, grad_grad_weight,
    grad_grad_bias, *rest, mask) for x (3, 5) and weight (4, 5): the grad-grads named in `given`
    ("ggx+ggw", "all", ...) are inputs, the others None."""
    made = {"ggx": _randn(3, 5, seed=4), "ggw": _randn(4, 5, seed=5), "ggb": _randn(4, seed=6)}
    gg_in = [made[k] if k in given or given == "all" else None for k in ("ggx", "ggw", "ggb")]
    present = [v for v in gg_in if v is not None]

    def f(*args):
        it = iter(args[:len(present)])
        gg = [next(it) if v is not None else None for v in gg_in]
        out = op(*gg, *args[len(present):], list(mask))
        return tuple(o for o in out if o is not None)

    inputs = (*present, *rest)
    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


@pytest.mark.parametrize("mask", MASKS3, ids=lambda m: "".join("1" if v else "0" for v in m))
def test_gradgradcheck_linear_tanh_backward_from_output(mask):
    # t is an input here (any tensor of the output's shape, not necessarily tanh(x·Wᵀ + b)):
    # gradcheck perturbs it independently.
    gy, x, t, w = (_randn(3, 4, seed=0), _randn(3, 5, seed=1), _randn(3, 4, seed=2, scale=0.5),
                   _randn(4, 5, seed=3))
    b = _randn(4, seed=4)

    def f(gy, x, t, w):
        out = OPS.linear_tanh_backward_from_output(gy, x, t, w, b.detach(), list(mask))
        return tuple(o for o in out if o is not None)

    assert torch.autograd.gradcheck(f, (gy, x, t, w))
    assert torch.autograd.gradgradcheck(f, (gy, x, t, w))


@pytest.mark.parametrize("given", ["ggx", "ggw", "ggx+ggb", "all"])
@pytest.mark.parametrize("mask", MASKS4, ids=lambda m: "".join("1" if v else "0" for v in m))
def test_gradgradcheck_linear_tanh_backward_from_output_backward(mask, given):
    gy, x, t, w = (_randn(3, 4, seed=0), _randn(3, 5, seed=1), _randn(3, 4, seed=2, scale=0.5),
                   _randn(4, 5, seed=3))
    _gradgradcheck_second_order_op(OPS.linear_tanh_backward_from_output_backward, given,
                                   (gy, x, t, w), mask)


# ------------------------------------------------------------------------------------------------
# the third order against stock PyTorch

def _third(f, x):
    y = f(x).sum()
    (g1,) = torch.autograd.grad(y, x, create_graph=True)
    (g2,) = torch.autograd.grad(g1.pow(2).sum(), x, create_graph=True)
    (g3,) = torch.autograd.grad(g2.sin().sum(), x)
    return g3


def test_third_order_matches_reference():
    # d³/dx³ of sum(tanh(x·w + b)) for a 1->1 layer, against stock PyTorch.
    x = _randn(11, 1, seed=0)
    w, b = _randn(1, 1, seed=1).detach(), _randn(1, seed=2).detach()
    got = _third(lambda t: ckpt_ext.linear_tanh(t, w, b), x)
    ref = _third(lambda t: linear_tanh_ref(t, w, b), x)
    assert rel_err(got, ref) <= 1e-12


@pytest.mark.parametrize("last_tanh", [True, False])
def test_third_order_through_stack_and_pairs_matches_reference(last_tanh):
    # A 3 -> 6 -> 5 -> 2 network: third derivatives w.r.t. the input and a mixed third-order
    # parameter gradient, as the fused stack, as pairs, and as stock modules.
    x = _randn(7, 3, seed=0)
    ws = [_randn(6, 3, seed=1, scale=0.8), _randn(5, 6, seed=2, scale=0.8),
          _randn(2, 5, seed=3, scale=0.8)]
    bs = [_randn(6, seed=4), _randn(5, seed=5), _randn(2, seed=6)]

    def ref(t):
        h = t
        for i, (w, b) in enumerate(zip(ws, bs)):
            h = F.linear(h, w, b)
            h = torch.tanh(h) if i < 2 or last_tanh else h
        return h

    def pairs(t):
        h = t
        for i, (w, b) in enumerate(zip(ws, bs)):
            h = ckpt_ext.linear_tanh(h, w, b) if i < 2 or last_tanh else F.linear(h, w, b)
        return h

    def stack(t):
        return ckpt_ext.tanh_mlp(t, ws, bs, last_tanh=last_tanh)

    def mixed(f):
        y = f(x).sum()
        (g1,) = torch.autograd.grad(y, x, create_graph=True)
        (g2,) = torch.autograd.grad(g1[:, 0].sum(), x, create_graph=True)
        return torch.autograd.grad(g2.pow(2).sum(), ws + bs, allow_unused=True,
                                   materialize_grads=True)  # the top bias, without tanh

    want3, want_mixed = _third(ref, x), mixed(ref)
    for f in (pairs, stack):
        assert rel_err(_third(f, x), want3) <= 5e-14  # measured 5.9e-15 (pairs, no last tanh)
        for got, want in zip(mixed(f), want_mixed):
            assert rel_err(got, want) <= 5e-15  # measured 7.0e-16


# ------------------------------------------------------------------------------------------------
# opcheck of the ops added for the higher orders (schema, fake/Meta kernels, autograd
# registration, AOT dispatch)

def _op_inputs(requires_grad):
    g = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g).requires_grad_(requires_grad)  # noqa: E731
    return mk(2, 3, 4), mk(2, 3, 5), mk(4, 5), mk(4), mk(2, 3, 4)  # gy, x, w, b, t


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("mask", MASKS4, ids=lambda m: "".join("1" if v else "0" for v in m))
def test_opcheck_double_backward_ops(mask, requires_grad):
    gy, x, w, b, t = _op_inputs(requires_grad)
    ggx, ggw, ggb = torch.randn(2, 3, 5), torch.randn(4, 5), torch.randn(4)
    for args in [(ggx, None, None, gy, x, t, w, list(mask)),
                 (None, ggw, ggb, gy, x, t, w, list(mask))]:
        torch.library.opcheck(OPS.linear_tanh_backward_from_output_backward.default, args)
    torch.library.opcheck(OPS.linear_tanh_backward_from_output.default,
                          (gy, x, t, w, b, list(mask[:3])))
    torch.library.opcheck(OPS.linear_tanh_backward_from_output.default,
                          (gy, x, t, w, None, list(mask[1:])))


def _triple_inputs(combo, dtype=DT, seed=0, m=9, k=5, n=4):
    """Inputs of linear_tanh_backward_from_output_double_backward; combo says which of the
    optional ones (ggx, ggW, ggb, u_grad_grad_out, u_grad_x, u_grad_output, u_grad_weight) are
    given."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, dtype=dtype, generator=g)  # noqa: E731
    ggx, ggw, ggb, ugy, ux, ut, uw = combo
    return [r(m, k) if ggx else None, r(n, k) if ggw else None, r(n) if ggb else None, r(m, n),
            r(m, k), torch.tanh(r(m, n)), r(n, k), r(m, n) if ugy else None,
            r(m, k) if ux else None, r(m, n) if ut else None, r(n, k) if uw else None]


def test_third_order_cpu_kernel_matches_its_aten_composition(level):
    # The fused CPU kernel (its elementwise part vectorised per ISA level) against
    # _from_output_backward_vjp (whose derivatives gradgradcheck checks above), every combination
    # of given inputs, float64 and float32; and all of them given over 4099 x 7 elements (parallel
    # chunks and a partial last vector), where the results summed over the 4099 rows (d_ggW, d_W)
    # differ by their GEMMs' order and get their own bound.
    from ckpt_ext import _derivatives
    worst = {(dtype, big): 0.0 for dtype in (DT, torch.float32) for big in (False, True)}
    cases = [(combo, {}) for combo in itertools.product([False, True], repeat=7)]
    cases.append(((True,) * 7, dict(m=4099, k=3, n=7)))
    for dtype in (DT, torch.float32):
        for combo, shape in cases:
            args = _triple_inputs(combo, dtype, **shape)
            got = OPS.linear_tanh_backward_from_output_double_backward(*args, [True] * 7)
            want = _derivatives._from_output_backward_vjp(*args, [True] * 7)
            for i, (g_, w_) in enumerate(zip(got, want)):
                if w_ is None:
                    assert torch.count_nonzero(g_) == 0
                else:
                    key = (dtype, bool(shape) and i in (1, 6))
                    worst[key] = max(worst[key], rel_err(g_, w_))
    assert worst[DT, False] <= 3e-15  # measured 2.9e-16
    assert worst[torch.float32, False] <= 3e-6  # measured 3.5e-7
    assert worst[DT, True] <= 3e-14  # measured 3.5e-15
    assert worst[torch.float32, True] <= 1e-5  # measured 9.3e-7


@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_third_order_op(requires_grad):
    for combo in [(True, False, False, True, False, True, False), (True,) * 7,
                  (False, True, True, False, True, False, True)]:
        args = _triple_inputs(combo, torch.float32)
        args = [a.requires_grad_(requires_grad) if a is not None else None for a in args]
        for mask in ([True] * 7, [True, False, False, True, False, True, False]):
            torch.library.opcheck(OPS.linear_tanh_backward_from_output_double_backward.default,
                                  (*args, mask))


def test_third_order_op_is_differentiable():
    # Called directly in grad mode it is differentiated through its ATen composition.
    args = _triple_inputs((True,) * 7)
    args = [a.requires_grad_() for a in args]

    def f(*a):
        return tuple(OPS.linear_tanh_backward_from_output_double_backward(*a, [True] * 7))

    assert torch.autograd.gradcheck(f, tuple(args))


def test_double_backward_ops_bad_input_messages():
    gy, x, w, b, t = _op_inputs(False)
    with pytest.raises(ValueError, match=r"linear_tanh_backward_from_output_backward: "
                                         r"grad_grad_x must have the shape of x \[2, 3, 5\], got "
                                         r"\[2, 3, 4\]"):
        OPS.linear_tanh_backward_from_output_backward(gy, None, None, gy, x, t, w, [True] * 4)
    with pytest.raises(ValueError, match=r"linear_tanh_backward_from_output: output must have "
                                         r"the shape of grad_out \[2, 3, 4\], got \[2, 3, 5\]"):
        OPS.linear_tanh_backward_from_output(gy, x, x, w, b, [True] * 3)
    with pytest.raises(TypeError, match=r"grad_grad_weight must have the dtype of weight "
                                        r"\(Float\), got Double"):
        OPS.linear_tanh_backward_from_output_backward(None, w.double(), None, gy, x, t, w,
                                                      [True] * 4)
    with pytest.raises(ValueError, match=r"linear_tanh_backward_from_output_double_backward: "
                                         r"u_grad_x must have the shape of x \[2, 3, 5\], got "
                                         r"\[2, 3, 4\]"):
        OPS.linear_tanh_backward_from_output_double_backward(
            None, None, None, gy, x, t, w, None, gy, None, None, [True] * 7)


# ------------------------------------------------------------------------------------------------
# the physics-informed step

class PINN(nn.Module):
    """u(t, x): the usual tanh MLP of physics-informed networks."""

    def __init__(self, width=20):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, width),
                                  nn.Tanh(), nn.Linear(width, width), nn.Tanh())
        self.out = nn.Linear(width, 1)

    def forward(self, tx):
        return self.out(self.body(tx))


def pinn_loss(model, tx):
    """Residual of the heat equation u_t = 0.1·u_xx at collocation points: needs du/d(t,x) with
    create_graph=True, then a second derivative, then the parameter gradient of it all; plus
    u = 0 on the boundary and u = sin(pi x) at t = 0 (the first quarter and the next of the
    points), so the parameter gradient also flows through the forward directly."""
    tx = tx.detach().requires_grad_()
    u = model(tx)
    (du,) = torch.autograd.grad(u.sum(), tx, create_graph=True)
    u_t, u_x = du[:, 0], du[:, 1]
    (du_x,) = torch.autograd.grad(u_x.sum(), tx, create_graph=True)
    u_xx = du_x[:, 1]
    nb = tx.shape[0] // 4
    u = u[:, 0]
    return (((u_t - 0.1 * u_xx) ** 2).mean() + (u[:nb] ** 2).mean()
            + ((u[nb:2 * nb] - torch.sin(math.pi * tx[nb:2 * nb, 1].detach())) ** 2).mean())


def _stack_model(plain: PINN) -> nn.Module:
    """The same network with body + out as one FusedTanhMLP (what fuse() picks for the run)."""
    return FusedTanhMLP.from_modules([*plain.body, plain.out])


def _pairs_model(plain: PINN) -> nn.Module:
    """The same network with each Linear -> Tanh as a FusedLinearTanh sharing the Linear."""
    body = [FusedLinearTanh.from_linear(plain.body[i]) for i in range(0, len(plain.body), 2)]
    return nn.Sequential(*body, plain.out)


@pytest.mark.parametrize("fused_as", ["pairs", "stack"])
def test_physics_informed_training_step_matches_plain_model(fused_as):
    torch.manual_seed(0)
    plain = PINN().double()
    copy_ = copy.deepcopy(plain)
    fused = _pairs_model(copy_) if fused_as == "pairs" else _stack_model(copy_)
    tx = torch.rand(64, 2, dtype=torch.float64)

    opt_p = torch.optim.Adam(plain.parameters(), lr=1e-3)
    opt_f = torch.optim.Adam(fused.parameters(), lr=1e-3)
    assert len(list(fused.parameters())) == len(list(plain.parameters()))
    for _ in range(3):  # a few steps, so the second one starts from trained weights
        for model, opt in ((plain, opt_p), (fused, opt_f)):
            opt.zero_grad()
            loss = pinn_loss(model, tx)
            loss.backward()
            opt.step()
        for p_p, p_f in zip(plain.parameters(), fused.parameters()):
            assert rel_err(p_f.grad, p_p.grad) <= 5e-15  # measured 4.8e-16
            assert rel_err(p_f, p_p) <= 5e-16  # measured 2.2e-17


def _pinn_net(dtype=torch.float32):
    """The benchmark's physics-informed network: 2 -> 64 x 4 -> 1, tanh."""
    torch.manual_seed(0)
    layers = [nn.Linear(2, 64, dtype=dtype), nn.Tanh()]
    for _ in range(3):
        layers += [nn.Linear(64, 64, dtype=dtype), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(64, 1, dtype=dtype))


def _pinn_step_bytes(model, points):
    """(kept, peak) of one physics-informed step, exact tensor bytes: kept = bytes alive after the
    loss minus before the forward (what the graphs of the three passes hold), peak = the highest
    figure over forward, both create_graph passes and the parameter backward, above "before"."""
    for p in model.parameters():
        p.grad = None
    with MemoryMeter("cpu") as meter:
        tx = points.clone()
        before = meter.reset_peak()
        loss = pinn_loss(model, tx)
        kept = meter.current() - before
        loss.backward()
        peak = meter.peak() - before
        del loss
    return kept, peak


@pytest.mark.parametrize("fused_as", ["pairs", "stack"])
def test_physics_informed_step_keeps_and_peaks_less_than_plain(fused_as):
    # The network (2 -> 64x4 -> 1, 4096 points, float32), exact bytes. Measured: plain
    # keeps 36,769,808 B and peaks at 41,009,676 B; the stack keeps 15,798,288 B (43 %) and peaks
    # at 24,248,844 B (59 %); pairs keep 19,992,592 B (54 %) and peak at 28,443,148 B (69 %).
    plain = _pinn_net()
    seq = copy.deepcopy(plain)
    if fused_as == "stack":
        fused = FusedTanhMLP.from_modules(seq)
    else:
        fused = nn.Sequential(*[FusedLinearTanh.from_linear(seq[i]) for i in range(0, 8, 2)],
                              seq[8])
    points = torch.rand(4096, 2, generator=torch.Generator().manual_seed(0))
    _pinn_step_bytes(plain, points)  # warm-up: first-call allocations are not the step's
    _pinn_step_bytes(fused, points)
    kept_p, peak_p = _pinn_step_bytes(plain, points)
    kept_f, peak_f = _pinn_step_bytes(fused, points)
    assert kept_f <= kept_p
    assert peak_f <= peak_p
    # and what the recompute buys: well under plain (bounds ~10 % above the measured ratios)
    bound = {"stack": (0.48, 0.65), "pairs": (0.6, 0.76)}[fused_as]
    assert kept_f <= bound[0] * kept_p and peak_f <= bound[1] * peak_p


# ------------------------------------------------------------------------------------------------
# which kernels run

@pytest.mark.parametrize("policy,count", [("all", 1), ("memory", 1)])
def test_first_order_backward_keeps_the_fused_kernel(policy, count):
    torch.manual_seed(0)
    model, _ = fuse(Net(d_in=12, d_hidden=16), policy=policy)
    x = torch.randn(5, 12, requires_grad=True)
    y = model(x).sum()
    with OpCounter() as counter:
        y.backward()
    calls = counter.calls
    # 3 blocks fused as one run under either policy (one stack backward); no tanh and no
    # tanh_backward outside it, and the only mm calls are the 2 of the plain linear1 (grad_x,
    # grad_W).
    assert calls.get("ckpt_ext.mlp_backward") == count
    assert "aten.tanh" not in calls and "aten.tanh_backward" not in calls
    assert "ckpt_ext.mlp" not in calls
    assert calls.get("aten.mm", 0) == 2


def test_first_order_grad_skips_gradients_the_engine_will_not_use():
    # torch.autograd.grad w.r.t. the input only: the weight gradient (a GEMM) is not computed.
    torch.manual_seed(0)
    layer = FusedLinearTanh(4, 3)
    x = torch.randn(5, 4, requires_grad=True)
    y = layer(x).sum()
    calls = []

    class Masks(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func.overloadpacket) == "ckpt_ext.mlp_backward":
                calls.append([args[7], *args[8], *args[9]])  # need_x, need_weights, need_biases
            return func(*args, **(kwargs or {}))

    with Masks():
        torch.autograd.grad(y, x)
    assert calls == [[True, False, False]]


def test_create_graph_records_the_output_based_backward():
    # With create_graph=True the first-order backward is recorded as one node per layer that keeps
    # (grad_out, x, t) — t from one recompute by a node that keeps its output — never z or g.
    torch.manual_seed(0)
    layer = FusedLinearTanh(4, 3)
    x = torch.randn(5, 4, requires_grad=True)
    y = layer(x).sum()
    with OpCounter() as counter:
        (gx,) = torch.autograd.grad(y, x, create_graph=True)
    assert gx.requires_grad
    assert counter.calls.get("ckpt_ext.mlp") == 1  # the one recompute of t
    assert counter.calls.get("ckpt_ext.linear_tanh_backward_from_output") == 1
    node = gx.grad_fn
    assert [tuple(t.shape) for t in node.saved_tensors] == [(5, 3), (5, 4), (5, 3), (3, 4)]
    t = node.saved_tensors[2]
    assert rel_err(t, torch.tanh(F.linear(x, layer.weight, layer.bias))) <= 1e-6
    # a second create_graph pass through the same layer reuses that t: no recompute
    with OpCounter() as counter:
        torch.autograd.grad(gx.pow(2).sum(), x, create_graph=True)
    assert "ckpt_ext.mlp" not in counter.calls


def test_chain_of_pairs_recomputes_each_layer_once_for_all_orders():
    # Three FusedLinearTanh in a chain, u_x and u_xx by create_graph, then the parameter gradient:
    # each layer's t is recomputed once (3 mlp calls besides the forward's 3), the
    # recompute of a layer takes its input from the recompute below, and no pass after the first
    # runs a recomputing kernel again.
    torch.manual_seed(0)
    layers = nn.Sequential(FusedLinearTanh(2, 8), FusedLinearTanh(8, 8), FusedLinearTanh(8, 1))
    tx = torch.rand(16, 2, requires_grad=True)
    with OpCounter() as counter:
        u = layers(tx)
        (du,) = torch.autograd.grad(u.sum(), tx, create_graph=True)
        (ddu,) = torch.autograd.grad(du[:, 1].sum(), tx, create_graph=True)
        ((ddu[:, 1] ** 2).mean() + (u ** 2).mean()).backward()
    calls = counter.calls
    assert calls.get("ckpt_ext.mlp") == 6
    assert "ckpt_ext.mlp_backward" not in calls
    # The graph of u_x reaches the recompute nodes only, never the forward nodes: walk it.
    from ckpt_ext import _autograd
    u = layers(tx)
    assert u.grad_fn.name() == "MlpBackward"  # eager: the C++ forward nodes
    (du,) = torch.autograd.grad(u.sum(), tx, create_graph=True)
    seen, stack, kinds = set(), [du.grad_fn], {"forward": 0, "recompute": 0}
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        # a forward node: the C++ node eager autograd records, or the mlp Function's
        kinds["forward"] += node.name() in ("MlpBackward", "_MlpBackward")
        kinds["recompute"] += isinstance(node, _autograd._LinearTanhKeep._backward_cls)
        stack.extend(n for n, _ in node.next_functions)
    assert kinds == {"forward": 0, "recompute": 3}


def test_flop_formulas_of_the_higher_order_ops():
    # FlopCounterMode counts what each kernel runs, in GEMMs of 2·M·K·N (M = 6 rows, K = 5, N = 4).
    from torch.utils.flop_counter import FlopCounterMode
    gy, x, w, b, t = (torch.randn(6, 4), torch.randn(6, 5), torch.randn(4, 5), torch.randn(4),
                      torch.randn(6, 4))
    ggx, ggw, u = torch.randn(6, 5), torch.randn(4, 5), torch.randn(6, 4)
    gemm = 2 * 6 * 5 * 4
    cases = [
        (lambda: OPS.linear_tanh_backward_from_output(gy, x, t, w, b, [True, True, True]), 2),
        (lambda: OPS.linear_tanh_backward_from_output(gy, x, t, w, b, [True, False, True]), 1),
        # dg from ggx and ggW, grad_x = g·ggW, grad_W = gᵀ·ggx
        (lambda: OPS.linear_tanh_backward_from_output_backward(ggx, ggw, None, gy, x, t, w,
                                                               [True] * 4), 4),
        # dg (ggx), ḡ (ggx·u_Wᵀ), d_ggx = d̄g·W + g·u_W, d_W = d̄gᵀ·ggx
        (lambda: OPS.linear_tanh_backward_from_output_double_backward(
            ggx, None, None, gy, x, t, w, u, None, u, ggw,
            [True, False, False, True, False, True, True]), 5),
    ]
    for run, n_gemms in cases:
        with FlopCounterMode(display=False) as counter:
            run()
        assert counter.get_total_flops() == n_gemms * gemm
