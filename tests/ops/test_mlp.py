"""ckpt_ext.mlp and FusedMLP, every activation: values and gradients against the float64 reference
in every dtype, odd shapes and poisoned buffers; the recompute bitwise equal to the forward;
gradcheck/gradgradcheck, third and fourth orders, torch.func, torch.compile, autocast, opcheck,
FLOPs; the memory kept; the module's keys and initial values; bad input."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ckpt_ext
from ckpt_ext._activations import REGISTRY
from reference import (ACTIVATION_REF, MLP_REL_TOL, aligned_pad, assert_mlp_matches_reference,
                       kept_and_peak,
                       check_relu_nan_gradient_is_stock_autograds, measured, mlp_grads,
                       mlp_inputs, mlp_ref, mlp_ref_grads, mlp_tol, padded_rows, rel_err)

ACTS = list(ckpt_ext.ACTIVATIONS)
OTHER_ACTS = [a for a in ACTS if a != "tanh"]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# (lead dims of x, sizes, biases present, last_activation): odd sizes, one row, a 3-D x, no bias,
# a Linear on top, 33 rows (a partial chunk of the bias sums).
SHAPES = [((7,), [5, 13, 3], (True, True), True),
          ((33,), [9, 17, 17, 4], (True, False, True), False),
          ((1,), [3, 2], (True,), True),
          ((2, 5), [6, 11, 7], (False, False), True),
          ((65,), [16, 40, 8], (True, True), False)]


def _params(sizes, has_bias, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(n, k, generator=g) / math.sqrt(k) for k, n in zip(sizes[:-1], sizes[1:])]
    bs = [torch.randn(n, generator=g) * 0.5 if hb else None for n, hb in zip(sizes[1:], has_bias)]
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype).requires_grad_()
    return [cast(w) for w in ws], [cast(b) for b in bs]


def _inputs(lead, sizes, has_bias, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(*lead, sizes[0], generator=g).to(dtype).requires_grad_()
    gy = torch.randn(*lead, sizes[-1], generator=g).to(dtype)
    ws, bs = _params(sizes, has_bias, dtype, seed)
    return x, ws, bs, gy


def _grads(out, inputs, gy):
    leaves = [t for t in inputs if t is not None]
    got = torch.autograd.grad(out, leaves, gy)
    it = iter(got)
    return [None if t is None else next(it) for t in inputs]


def _double(ts):
    return [None if t is None else t.detach().double().requires_grad_() for t in ts]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", range(len(SHAPES)))
def test_matches_reference(act, dtype, case, poison, seed):
    lead, sizes, has_bias, last = SHAPES[case]
    x, ws, bs, gy = _inputs(lead, sizes, has_bias, dtype, seed=seed)
    y = ckpt_ext.mlp(x, ws, bs, activation=act, last_activation=last)
    assert y.dtype == dtype and y.shape == (*lead, sizes[-1])
    got = _grads(y, [x, *ws, *bs], gy)
    x64, ws64, bs64 = _double([x]), _double(ws), _double(bs)
    y64 = mlp_ref(x64[0], ws64, bs64, act, last)
    want = _grads(y64, [*x64, *ws64, *bs64], gy.double())
    names = ["out", "grad_x"] + [f"grad_w{i}" for i in range(len(ws))] + \
        [f"grad_b{i}" for i in range(len(bs))]
    for name, o, r in zip(names, [y, *got], [y64, *want]):
        if r is None:
            assert o is None
            continue
        e = rel_err(o, r)
        measured(f"mlp/{str(dtype)[6:]}/{act}/{name}", e)
        tol = mlp_tol(act, dtype)
        assert e <= tol, f"{act} {dtype} {name}: rel err {e:.3g}"


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_recompute_is_bitwise_the_forward(act, dtype):
    # grad_W of the second layer is gᵀ·a_1 with a_1 = f(z_0) recomputed inside backward; the same
    # GEMM on the forward's own a_1 must give the same bits.
    x, ws, bs, gy = _inputs((37,), [11, 24, 5], (True, True), dtype, seed=3)
    y = ckpt_ext.mlp(x, ws, bs, activation=act, last_activation=False)
    gw1 = torch.autograd.grad(y, ws[1], gy)[0]
    a1 = ckpt_ext.mlp(x.detach(), [ws[0].detach()], [bs[0].detach()], activation=act)
    assert torch.equal(gw1, gy.t() @ a1)


def test_tanh_is_tanh_mlp_bitwise():
    x, ws, bs, gy = _inputs((9,), [4, 8, 3], (True, True), torch.float32)
    a = ckpt_ext.mlp(x, ws, bs, activation="tanh")
    b = ckpt_ext.tanh_mlp(x, ws, bs)
    assert torch.equal(a, b)
    assert all(torch.equal(p, q) for p, q in zip(_grads(a, [x, *ws], gy), _grads(b, [x, *ws], gy)))


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("last", [True, False])
def test_gradcheck_and_gradgradcheck(act, last):
    x, ws, bs, _ = _inputs((4,), [3, 5, 2], (True, False), torch.float64, seed=5)
    f = lambda x, w0, w1, b0: ckpt_ext.mlp(x, [w0, w1], [b0, None], activation=act,
                                           last_activation=last)
    args = (x, ws[0], ws[1], bs[0])
    assert torch.autograd.gradcheck(f, args)
    assert torch.autograd.gradgradcheck(f, args)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("create_graph", [False, True])
def test_gradient_of_one_parameter_alone(act, create_graph):
    # Asked for one weight only (a leaf, or reached through a non-leaf), the backward must still
    # make that weight's gradient: the same as from a call that asks for every input.
    x, ws, bs, gy = _inputs((6,), [3, 5, 4, 2], (True, True, True), torch.float64, seed=11)
    want = _grads(ckpt_ext.mlp(x, ws, bs, activation=act), [x, *ws, *bs], gy)
    for i in range(len(ws)):
        y = ckpt_ext.mlp(x, ws, bs, activation=act)
        (got,) = torch.autograd.grad(y, ws[i], gy, create_graph=create_graph)
        assert rel_err(got, want[1 + i]) <= 1e-13, i
        v = ws[i].detach().requires_grad_()
        y = ckpt_ext.mlp(x, ws[:i] + [v * 1.0] + ws[i + 1:], bs, activation=act)
        (got,) = torch.autograd.grad(y, v, gy, create_graph=create_graph)
        assert rel_err(got, want[1 + i]) <= 1e-13, i


@pytest.mark.parametrize("act", OTHER_ACTS)
def test_third_order_matches_autograd(act):
    # u(p) and u_xx as a PINN builds them (create_graph twice), then a loss's gradient: the
    # third order, against the same through stock modules.
    x, ws, bs, _ = _inputs((6,), [2, 7, 7, 1], (True, True, True), torch.float64, seed=7)

    def loss(fn, x, ws, bs):
        u = fn(x, ws, bs)
        (ux,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        (uxx,) = torch.autograd.grad(ux[:, 1].sum(), x, create_graph=True)
        return (uxx[:, 1] - ux[:, 0]).pow(2).mean() + u.pow(2).mean()

    fused = lambda x, ws, bs: ckpt_ext.mlp(x, ws, bs, activation=act, last_activation=False)
    ref = lambda x, ws, bs: mlp_ref(x, ws, bs, act, last_activation=False)
    lf = loss(fused, x, ws, bs)
    gf = torch.autograd.grad(lf, [*ws, *bs])
    x2, ws2, bs2 = _double([x])[0], _double(ws), _double(bs)
    lr = loss(ref, x2, ws2, bs2)
    gr = torch.autograd.grad(lr, [*ws2, *bs2])
    assert rel_err(lf, lr) <= 1e-13
    for a, b in zip(gf, gr):
        assert rel_err(a, b) <= 1e-12


@pytest.mark.parametrize("act", OTHER_ACTS)
@pytest.mark.parametrize("last", [True, False])
def test_fourth_order_and_weight_penalty_match_autograd(act, last):
    # The orders above a PINN's: u_xxx then the parameters' gradient (the fourth order, autograd
    # through the third order's formula), and a penalty on the gradient w.r.t. the weights and x
    # (create_graph asks for grad_W and grad_b), differentiated twice more (the weights' terms of
    # every formula); a 3-D x and a layer without bias.
    g = torch.Generator().manual_seed(13)
    sizes, has_bias = [2, 5, 6, 3], (True, False, True)
    x0 = torch.randn(4, 3, 2, generator=g, dtype=torch.float64)
    ws0, bs0 = _params(sizes, has_bias, torch.float64, seed=13)

    def losses(fn):
        x = x0.clone().requires_grad_()
        ws, bs = _double(ws0), _double(bs0)
        params = ws + [b for b in bs if b is not None]
        u = fn(x, ws, bs)
        (d1,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        (d2,) = torch.autograd.grad(d1[..., 1].sum(), x, create_graph=True)
        (d3,) = torch.autograd.grad(d2[..., 1].sum(), x, create_graph=True)
        out = list(torch.autograd.grad((d3 ** 2).sum() + (d2 ** 2).sum() + (u ** 2).sum(), params))
        u = fn(x, ws, bs)
        first = torch.autograd.grad((u ** 2).sum(), params + [x], create_graph=True)
        second = torch.autograd.grad(sum((t ** 2).sum() for t in first), params + [x],
                                     create_graph=True)
        third = sum((t * t.detach().sign()).sum() for t in second)
        return out + list(torch.autograd.grad(third, params + [x]))

    got = losses(lambda x, ws, bs: ckpt_ext.mlp(x, ws, bs, activation=act, last_activation=last))
    want = losses(lambda x, ws, bs: mlp_ref(x, ws, bs, act, last_activation=last))
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-12


@pytest.mark.parametrize("act", OTHER_ACTS)
def test_torch_func(act):
    from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap
    x, ws, bs, gy = _inputs((5,), [3, 6, 2], (True, True), torch.float64, seed=9)
    ws = [w.detach() for w in ws]
    bs = [b.detach() for b in bs]
    x = x.detach()
    fused = lambda x: ckpt_ext.mlp(x, ws, bs, activation=act)
    ref = lambda x: mlp_ref(x, ws, bs, act)
    tol = 1e-12
    assert rel_err(grad(lambda x: fused(x).sum())(x), grad(lambda x: ref(x).sum())(x)) <= tol
    assert rel_err(vjp(fused, x)[1](gy)[0], vjp(ref, x)[1](gy)[0]) <= tol
    t = torch.randn_like(x)
    assert rel_err(jvp(fused, (x,), (t,))[1], jvp(ref, (x,), (t,))[1]) <= tol
    assert rel_err(vmap(fused)(x.unsqueeze(1)), vmap(ref)(x.unsqueeze(1))) <= tol
    row = lambda f: (lambda r: f(r.unsqueeze(0)).squeeze(0))
    assert rel_err(vmap(jacrev(row(fused)))(x), vmap(jacrev(row(ref)))(x)) <= tol
    assert rel_err(vmap(jacfwd(row(fused)))(x), vmap(jacfwd(row(ref)))(x)) <= tol
    s = lambda f: (lambda r: f(r.unsqueeze(0)).sum())
    assert rel_err(hessian(s(fused))(x[0]), hessian(s(ref))(x[0])) <= tol
    # per-sample gradients of the weights: vmap over the batch with the parameters
    model = ckpt_ext.FusedMLP([3, 6, 2], activation=act, dtype=torch.float64)
    params = dict(model.named_parameters())

    def loss(p, xi):
        return functional_call(model, p, (xi.unsqueeze(0),)).sum()

    per = vmap(grad(loss), in_dims=(None, 0))(params, x)
    for i in range(x.shape[0]):
        one = grad(loss)(params, x[i])
        for k in params:
            assert rel_err(per[k][i], one[k]) <= tol


@pytest.mark.parametrize("act,backend", [(a, "aot_eager") for a in OTHER_ACTS] +
                         [("gelu", "inductor"), ("sin", "inductor")])
def test_compile_fullgraph(act, backend):
    torch._dynamo.reset()  # one lambda's code object for every case: no recompile limit
    x, ws, bs, gy = _inputs((8,), [4, 9, 3], (True, True), torch.float32, seed=11)
    f = lambda x, w0, w1, b0, b1: ckpt_ext.mlp(x, [w0, w1], [b0, b1], activation=act)
    cf = torch.compile(f, fullgraph=True, backend=backend)
    args = (x, *ws, *bs)
    y, yc = f(*args), cf(*args)
    assert rel_err(yc, y) <= 1e-6
    for a, b in zip(_grads(y, list(args), gy), _grads(yc, list(args), gy)):
        assert rel_err(b, a) <= 1e-6


@pytest.mark.parametrize("act", OTHER_ACTS)
def test_autocast_bfloat16(act):
    x, ws, bs, gy = _inputs((16,), [8, 12, 4], (True, True), torch.float32, seed=13)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ckpt_ext.mlp(x, ws, bs, activation=act)
    assert y.dtype == torch.bfloat16
    ref = mlp_ref(*(_double([x]) + [_double(ws), _double(bs)]), act)
    assert rel_err(y, ref) <= MLP_REL_TOL[torch.bfloat16]
    y.float().backward(gy)
    assert ws[0].grad is not None and ws[0].grad.dtype == torch.float32


@pytest.mark.parametrize("act", ACTS)
def test_opcheck(act):
    x, ws, bs, gy = _inputs((6,), [3, 5, 2], (True, False), torch.float64, seed=15)
    torch.library.opcheck(torch.ops.ckpt_ext.mlp.default,
                          (x, ws, [bs[0]], [True, False], act, True))
    torch.library.opcheck(
        torch.ops.ckpt_ext.mlp_backward.default,
        (gy, x.detach(), [w.detach() for w in ws], [bs[0].detach()], [True, False], act, True,
         True, [True, True], [True]),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.parametrize("act", OTHER_ACTS)
def test_flops_count_the_gemms(act):
    from torch.utils.flop_counter import FlopCounterMode
    x, ws, bs, gy = _inputs((10,), [4, 8, 8, 3], (True, True, True), torch.float32)

    def count(fn):
        with FlopCounterMode(display=False) as c:
            fn(x, ws, bs).backward(gy)
        return c.get_total_flops()

    plain = count(lambda x, ws, bs: mlp_ref(x, ws, bs, act))
    fused = count(lambda x, ws, bs: ckpt_ext.mlp(x, ws, bs, activation=act))
    recompute = 2 * 10 * (4 * 8 + 8 * 8 + 8 * 3)  # every forward GEMM again
    assert fused == plain + recompute


@pytest.mark.parametrize("act", ACTS)
def test_memory_kept_and_peak_in_bytes(act):
    # Kept for backward, in exact bytes (the CPU meter): the fused run nothing beyond its output;
    # stock autograd per layer the registry's count: its activation's output (tanh, sigmoid,
    # relu: also the next Linear's input), or z and its output, or z, an intermediate and its
    # output (quick_gelu): docs/design.md's table. The
    # fused backward's peak stays at or below plain's.
    B, widths = 64, [32, 32, 8]
    x, ws, bs, gy = _inputs((B,), [8, *widths], (True, True, True), torch.float32)
    per_layer = REGISTRY[act].tensors_per_layer
    # the top layer's output is the run's output (not counted): its z alone, if kept
    expected = (sum(per_layer * n for n in widths[:-1]) + (per_layer - 1) * widths[-1]) * B * 4
    kept, peak = kept_and_peak((("fused", lambda: ckpt_ext.mlp(x, ws, bs, activation=act)),
                                ("plain", lambda: mlp_ref(x, ws, bs, act))), [x, *ws, *bs], gy)
    assert kept["fused"] == 0
    # (quick_gelu's 1.702·z also keeps its 0-dim scalar, 8 B a layer)
    assert expected <= kept["plain"] <= expected + 8 * len(widths)
    assert peak["fused"] <= peak["plain"], peak


# ---- FusedMLP ----------------------------------------------------------------------------------

@pytest.mark.parametrize("act", ACTS)
def test_fused_mlp_is_the_sequential(act):
    torch.manual_seed(0)
    m = ckpt_ext.FusedMLP([5, 7, 3], activation=act, last_activation=False)
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(5, 7), nn.Identity(), nn.Linear(7, 3))
    assert list(m.state_dict()) == list(seq.state_dict())
    for k, v in seq.state_dict().items():
        assert torch.equal(m.state_dict()[k], v)
    x = torch.randn(4, 5, dtype=torch.float64)
    m64 = m.double()
    ref = mlp_ref(x, [m64._modules["0"].weight, m64._modules["2"].weight],
                  [m64._modules["0"].bias, m64._modules["2"].bias], act, False)
    assert rel_err(m64(x), ref) <= 1e-14
    s = m64.to_sequential()
    assert rel_err(s(x), ref) <= 1e-15
    back = ckpt_ext.FusedMLP.from_modules(s)
    assert back.activation == act and not back.last_activation
    assert back._modules["0"] is s[0]


def test_from_modules_refuses_non_default():
    # a run mixing activation modules is taken: tests/ops/test_modules_mixed.py
    with pytest.raises(ValueError, match="entry 1"):
        ckpt_ext.FusedMLP.from_modules([nn.Linear(2, 3), nn.Softplus(beta=2), nn.Linear(3, 3)])


# ---- bad input -----------------------------------------------------------------------------------

def test_unknown_activation_names_the_choices():
    x, ws, bs, _ = _inputs((2,), [3, 4], (True,), torch.float32)
    with pytest.raises(ValueError, match=r"activation must be one of 'tanh', 'gelu'.*got 'swish'"):
        ckpt_ext.mlp(x, ws, bs, activation="swish")
    with pytest.raises(ValueError, match=r'activation must be one of "tanh".*got "swish"'):
        torch.ops.ckpt_ext.mlp(x, ws, bs, [True], "swish", True)
    with pytest.raises(ValueError, match=r'activation must be one of "tanh".*got "swish"'):
        torch.ops.ckpt_ext.mlp(x.to("meta"), [w.to("meta") for w in ws],
                               [b.to("meta") for b in bs], [True], "swish", True)
    with pytest.raises(ValueError, match="FusedMLP: activation must be one of"):
        ckpt_ext.FusedMLP([2, 3], activation="gelu_erf")


def test_shape_errors_name_the_layer():
    x, ws, bs, _ = _inputs((2,), [3, 4, 5], (True, True), torch.float32)
    ws[1] = torch.randn(5, 6)
    with pytest.raises(ValueError, match="ckpt_ext.mlp: .*4"):
        ckpt_ext.mlp(x, ws, bs, activation="gelu")


def test_activation_modules_compute_what_the_names_say():
    from ckpt_ext._activations import MODULE_OF
    from ckpt_ext.modules import module_activation
    z = torch.randn(50, dtype=torch.float64) * 4
    for name, make in MODULE_OF.items():
        m = make()
        assert module_activation(m) == name
        assert torch.equal(m(z), ACTIVATION_REF[name](z))
    assert module_activation(nn.Softplus(threshold=10)) is None
    assert module_activation(nn.GELU(approximate="tanh")) == "gelu_tanh"
    assert F.gelu is ACTIVATION_REF["gelu"]


# ---- every CPU ISA level (the `level` fixture, conftest.py) --------------------------------------

# widths that leave a tail at every vector width (8/16 floats, 4/8 doubles, 16/32 halves), rows
# over several 32-row bias chunks and a partial one
@pytest.mark.parametrize("act", OTHER_ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_level_matches_reference_and_recomputes_bitwise(level, act, dtype, poison):
    x, ws, bs, gy = _inputs((67,), [33, 45, 19], (True, True), dtype, seed=17)
    y = ckpt_ext.mlp(x, ws, bs, activation=act, last_activation=False)
    got = _grads(y, [x, *ws, *bs], gy)
    x64, ws64, bs64 = _double([x]), _double(ws), _double(bs)
    y64 = mlp_ref(x64[0], ws64, bs64, act, False)
    want = _grads(y64, [*x64, *ws64, *bs64], gy.double())
    tol = mlp_tol(act, dtype)
    for o, r in zip([y, *got], [y64, *want]):
        assert rel_err(o, r) <= tol, (level, act, dtype)
    a1 = ckpt_ext.mlp(x.detach(), [ws[0].detach()], [bs[0].detach()], activation=act)
    assert torch.equal(got[2], gy.t() @ a1)


# ---- grad_out and input layouts; relu at NaN (test_ops_cuda.py has the same on CUDA) -----------

@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("last", [True, False], ids=["last_act", "no_last_act"])
def test_broadcast_grad_of_mean_loss(act, dtype, last, poison):
    # out.mean(): grad_out is one value at strides (0, 0). The top layer's bias gradient comes from
    # the backward kernels alone (their broadcast read): the same bits as with the materialised
    # grad_out; everything against the float64 reference.
    for width in (16, 17):  # a whole number of every vector length, and a tail
        x, ws, bs, _ = mlp_inputs((70,), [11, 24, width], dtype, seed=width)
        gy = torch.full((), 1 / (70 * width), dtype=dtype).expand(70, width)
        got = mlp_grads(x, ws, bs, gy, act, last)
        dense = mlp_grads(x, ws, bs, gy.contiguous(), act, last)
        assert torch.equal(got[-1], dense[-1]), "top bias gradient: broadcast vs dense"
        assert_mlp_matches_reference(got, mlp_ref_grads(x, ws, bs, gy, act, last), act, dtype,
                                     f"width {width}")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_padded_row_stride_inputs_and_grads(act, dtype, poison):
    # x and grad_out as (rows, n) views of (rows, n + pad) buffers, rows 16-byte aligned: read in
    # place, everything against the float64 reference. The top layer's bias gradient (the backward
    # kernels alone) from a padded grad_out has the same bits as from a contiguous one, on the same
    # x: a padded x is another GEMM operand layout, which may run other BLAS kernels.
    x, ws, bs, gy = mlp_inputs((67,), [13, 24, 16], dtype, seed=5)
    xp = padded_rows(x, aligned_pad(13, dtype))
    gyp = padded_rows(gy, aligned_pad(16, dtype))
    assert xp.stride(0) > 13 and gyp.stride(0) > 16 and xp.stride(0) * dtype.itemsize % 16 == 0
    for last in (True, False):
        got = mlp_grads(xp, ws, bs, gyp, act, last)
        assert_mlp_matches_reference(got, mlp_ref_grads(x, ws, bs, gy, act, last), act, dtype)
        padded_gy = mlp_grads(x, ws, bs, gyp, act, last)
        dense = mlp_grads(x, ws, bs, gy, act, last)
        assert torch.equal(padded_gy[-1], dense[-1]), "top bias gradient: padded grad_out"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [16, 19])
def test_relu_nan_pre_activation_gradient_is_stock_autograds(dtype, n, poison):
    check_relu_nan_gradient_is_stock_autograds("cpu", dtype, n)


# ---- CUDA (scripts/gpu_check.sh runs the `cuda`-marked tests) ------------------------------------

from reference import requires_gpu  # noqa: E402


def _to(ts, device):
    return [None if t is None else t.detach().to(device).requires_grad_() for t in ts]


@pytest.mark.cuda
@requires_gpu
@pytest.mark.parametrize("act", OTHER_ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [1, 7, 8, 17, 64])
def test_cuda_matches_reference_and_recomputes_bitwise(act, dtype, width, poison):
    # widths below, at and past the 16-byte pack; 67 rows: two full 32-row chunks and a partial
    x, ws, bs, gy = _inputs((67,), [13, width, 9], (True, True), dtype, seed=19)
    xc, wc, bc = _to([x], "cuda"), _to(ws, "cuda"), _to(bs, "cuda")
    y = ckpt_ext.mlp(xc[0], wc, bc, activation=act, last_activation=False)
    got = _grads(y, [*xc, *wc, *bc], gy.cuda())
    x64, ws64, bs64 = _double([x]), _double(ws), _double(bs)
    y64 = mlp_ref(x64[0], ws64, bs64, act, False)
    want = _grads(y64, [*x64, *ws64, *bs64], gy.double())
    tol = mlp_tol(act, dtype)
    for o, r in zip([y, *got], [y64, *want]):
        assert rel_err(o.cpu(), r) <= tol, (act, dtype, width)
    a1 = ckpt_ext.mlp(xc[0].detach(), [wc[0].detach()], [bc[0].detach()], activation=act)
    assert torch.equal(got[2], gy.cuda().t() @ a1)


@pytest.mark.cuda
@requires_gpu
@pytest.mark.parametrize("act", OTHER_ACTS)
def test_cuda_double_backward_matches_cpu(act):
    x, ws, bs, _ = _inputs((33,), [2, 16, 16, 1], (True, True, True), torch.float64, seed=23)

    def u_xx(device):
        xd, wd, bd = _to([x], device)[0], _to(ws, device), _to(bs, device)
        u = ckpt_ext.mlp(xd, wd, bd, activation=act, last_activation=False)
        (ux,) = torch.autograd.grad(u.sum(), xd, create_graph=True)
        (uxx,) = torch.autograd.grad(ux[:, 1].sum(), xd, create_graph=True)
        loss = uxx.pow(2).mean()
        return [loss, *torch.autograd.grad(loss, wd)]

    for c, g in zip(u_xx("cpu"), u_xx("cuda")):
        assert rel_err(g.cpu(), c) <= 1e-12


# ---- memory of the orders above the first ------------------------------------------------------

# kept and peak of a physics-informed step (u, u_x, u_xx by create_graph, then the parameters'
# gradient: the third order) as a fraction of stock autograd's, exact bytes at these sizes
# (512 points, 2 -> 32 x 3 -> 1): gelu 0.33/0.43, gelu_tanh 0.15/0.19, silu 0.24/0.35, sigmoid
# 0.46/0.59, softplus 0.39/0.47, sin 0.37/0.51, relu 1.00/1.00 (relu's higher orders keep next to
# nothing in stock autograd; the fused op then records what it records), quick_gelu 0.28/0.36.
PINN_BOUNDS = {"gelu": (0.34, 0.44), "gelu_tanh": (0.16, 0.2), "silu": (0.25, 0.36),
               "sigmoid": (0.47, 0.6), "softplus": (0.4, 0.48), "sin": (0.37, 0.52),
               "relu": (1.0, 1.0), "quick_gelu": (0.29, 0.37)}


@pytest.mark.parametrize("act", OTHER_ACTS)
def test_pinn_step_keeps_less_than_stock_autograd(act):
    from ckpt_ext.memory import MemoryMeter, measured_step
    from ckpt_ext.models import PINNNet
    r = {}
    for mode in ("plain", "fused"):
        torch.manual_seed(0)
        net = PINNNet(hidden=32, depth=3, mode=mode, activation=act)
        points = torch.rand(512, 2, generator=torch.Generator().manual_seed(1))
        with MemoryMeter("cpu") as meter:
            s = measured_step(net, points.requires_grad_(), meter, loss_fn=net.loss)
        r[mode] = s["kept_for_backward"], s["peak_above_before_forward"], s["loss"]
    kept_bound, peak_bound = PINN_BOUNDS[act]
    assert r["fused"][0] <= kept_bound * r["plain"][0], r
    assert r["fused"][1] <= peak_bound * r["plain"][1], r
    assert r["fused"][2] == pytest.approx(r["plain"][2], rel=1e-5)
