"""ckpt_ext.mlp with one activation per layer (a run that mixes them, as RL actors and DeepXDE's
FNN write it): values and every gradient against the float64 reference in every dtype, the
recompute bitwise equal to the forward, a list of one name being that name to the bit,
gradcheck/gradgradcheck and the third order, torch.func, torch.compile, opcheck, the memory kept,
and the errors for a wrong list."""
from __future__ import annotations

import itertools

import pytest
import torch

import ckpt_ext
from reference import kept_and_peak, mlp_inputs, mlp_ref, mlp_tol, rel_err, requires_gpu

ACTS = list(ckpt_ext.ACTIVATIONS)
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
SIZES = [7, 13, 9, 5]  # three layers, odd widths


def _mixes():
    """Every activation in every position of a three-layer run at least once, next to each of
    the others (tanh's from-output pass beside the ones recomputed from z), and the RL actor."""
    out = [("relu", "relu", "tanh"), ("tanh", "gelu", "tanh")]
    for i, (a, b) in enumerate(itertools.permutations(ACTS, 2)):
        out.append((a, b, ACTS[i % len(ACTS)]))
    return sorted(set(out))


MIXES = _mixes()


def _leaves(x, ws, bs):
    x = x.detach().requires_grad_()
    ws = [w.detach().requires_grad_() for w in ws]
    bs = [None if b is None else b.detach().requires_grad_() for b in bs]
    return x, ws, bs


def _run(fn, x, ws, bs, gy):
    x, ws, bs = _leaves(x, ws, bs)
    y = fn(x, ws, bs)
    leaves = [x, *ws, *[b for b in bs if b is not None]]
    return [y.detach(), *torch.autograd.grad(y, leaves, gy)]


@pytest.mark.parametrize("mix", MIXES, ids="-".join)
@pytest.mark.parametrize("last", [True, False], ids=["last_act", "no_last_act"])
def test_matches_reference_float64_and_float32(mix, last):
    acts = list(mix if last else mix[:-1])
    for dtype in (torch.float64, torch.float32):
        x, ws, bs, gy = mlp_inputs((33,), SIZES, dtype, seed=len(mix))
        bs[1] = None  # a layer without bias
        got = _run(lambda x, ws, bs: ckpt_ext.mlp(x, ws, bs, activation=acts,
                                                  last_activation=last), x, ws, bs, gy)
        d = lambda t: None if t is None else t.double()
        ref = _run(lambda x, ws, bs: mlp_ref(x, ws, bs, acts, last), d(x), [d(w) for w in ws],
                   [d(b) for b in bs], d(gy))
        tol = max(mlp_tol(a, dtype) for a in acts)
        for i, (o, r) in enumerate(zip(got, ref)):
            assert not torch.isnan(o).any(), (mix, i)
            assert o.dtype == dtype
            assert rel_err(o, r) <= tol, (mix, dtype, i, rel_err(o, r))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_with_poisoned_buffers(dtype, poison):
    acts = ["relu", "tanh", "gelu"]
    x, ws, bs, gy = mlp_inputs((2, 17), SIZES, dtype, seed=4)
    got = _run(lambda x, ws, bs: ckpt_ext.mlp(x, ws, bs, activation=acts), x, ws, bs, gy)
    d = lambda t: t.double()
    ref = _run(lambda x, ws, bs: mlp_ref(x, ws, bs, acts), d(x), [d(w) for w in ws],
               [d(b) for b in bs], d(gy))
    tol = max(mlp_tol(a, dtype) for a in acts)
    for i, (o, r) in enumerate(zip(got, ref)):
        assert rel_err(o, r) <= tol, (dtype, i, rel_err(o, r))


@pytest.mark.parametrize("mix", [("tanh", "silu", "tanh"), ("sin", "tanh", "relu"),
                                 ("quick_gelu", "softplus", "sigmoid")], ids="-".join)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_recompute_is_bitwise_the_forward(mix, dtype):
    # grad_W of the top layer (no activation) is gyᵀ·a_2 with a_2 = f_1(z_1) recomputed inside
    # backward (kept as tanh's output, or made again from z_1); the same GEMM on the forward's
    # own a_2 must give the same bits.
    x, ws, bs, gy = mlp_inputs((37,), SIZES, dtype, seed=3)
    x, ws, bs = _leaves(x, ws, bs)
    y = ckpt_ext.mlp(x, ws, bs, activation=list(mix[:-1]), last_activation=False)
    (gw2,) = torch.autograd.grad(y, ws[2], gy)
    a2 = ckpt_ext.mlp(x.detach(), [w.detach() for w in ws[:2]], [b.detach() for b in bs[:2]],
                      activation=list(mix[:2]))
    assert torch.equal(gw2, gy.t() @ a2)
    # and the output is the layer-by-layer forward's, to the bit
    h = x.detach()
    for i in range(3):
        h = ckpt_ext.mlp(h, [ws[i].detach()], [bs[i].detach()], activation=mix[i],
                         last_activation=i < 2)
    assert torch.equal(y.detach(), h)


@pytest.mark.parametrize("act", ACTS)
def test_a_list_of_one_name_is_that_name_bitwise(act):
    x, ws, bs, gy = mlp_inputs((9,), SIZES, torch.float32, seed=7)
    one = _run(lambda x, ws, bs: ckpt_ext.mlp(x, ws, bs, activation=act), x, ws, bs, gy)
    lst = _run(lambda x, ws, bs: ckpt_ext.mlp(x, ws, bs, activation=[act] * 3), x, ws, bs, gy)
    assert all(torch.equal(a, b) for a, b in zip(one, lst))


@pytest.mark.parametrize("mix", [("relu", "relu", "tanh"), ("tanh", "sin", "gelu_tanh"),
                                 ("quick_gelu", "tanh", "softplus")], ids="-".join)
def test_gradcheck_gradgradcheck_and_third_order(mix):
    x, ws, bs, gy = mlp_inputs((4,), [3, 5, 4, 2], torch.float64, seed=5)
    x, ws, bs = _leaves(x, ws, bs)
    f = lambda x, w0, w1, w2, b0: ckpt_ext.mlp(x, [w0, w1, w2], [b0, None, None],
                                               activation=list(mix))
    args = (x, *ws, bs[0])
    assert torch.autograd.gradcheck(f, args)
    assert torch.autograd.gradgradcheck(f, args)
    # the third derivative in x of a PINN-style loss, against stock autograd
    ref = lambda x: mlp_ref(x, ws, [bs[0], None, None], list(mix))
    fused = lambda x: f(x, *ws, bs[0])

    def third(fn):
        xx = x.detach().requires_grad_()
        g = xx
        out = fn(xx).sum()
        for _ in range(3):
            (g,) = torch.autograd.grad(out, xx, create_graph=True)
            out = g.sum()
        return g

    assert rel_err(third(fused), third(ref)) <= 1e-12


def test_torch_func_and_compile():
    from torch.func import grad, jacrev, vmap
    acts = ["relu", "gelu", "tanh"]
    x, ws, bs, gy = mlp_inputs((5,), [3, 6, 4, 2], torch.float64, seed=9)
    fused = lambda x: ckpt_ext.mlp(x, ws, bs, activation=acts)
    ref = lambda x: mlp_ref(x, ws, bs, acts)
    assert rel_err(grad(lambda x: fused(x).sum())(x), grad(lambda x: ref(x).sum())(x)) <= 1e-12
    row = lambda f: (lambda r: f(r.unsqueeze(0)).squeeze(0))
    assert rel_err(vmap(jacrev(row(fused)))(x), vmap(jacrev(row(ref)))(x)) <= 1e-12
    torch._dynamo.reset()
    x32, ws32, bs32, gy32 = mlp_inputs((8,), [4, 9, 3], torch.float32, seed=11)
    f = lambda x, w0, w1, b0, b1: ckpt_ext.mlp(x, [w0, w1], [b0, b1], activation=["sin", "silu"])
    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    args = [t.requires_grad_() for t in (x32, *ws32, *bs32)]
    y, yc = f(*args), cf(*args)
    assert rel_err(yc, y) <= 1e-6
    for a, b in zip(torch.autograd.grad(y, args, gy32), torch.autograd.grad(yc, args, gy32)):
        assert rel_err(b, a) <= 1e-6


def test_opcheck_mixed():
    x, ws, bs, gy = mlp_inputs((6,), [3, 5, 2], torch.float64, seed=15)
    x, ws, bs = _leaves(x, ws, bs)
    torch.library.opcheck(torch.ops.ckpt_ext.mlp.default,
                          (x, ws, [bs[0]], [True, False], "relu,tanh", True))
    torch.library.opcheck(
        torch.ops.ckpt_ext.mlp_backward.default,
        (gy, x.detach(), [w.detach() for w in ws], [bs[0].detach()], [True, False], "silu", False,
         True, [True, True], [True]),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_memory_kept_is_nothing_and_the_peak_not_above_plain():
    acts = ["relu", "relu", "tanh"]
    x, ws, bs, gy = mlp_inputs((64,), [8, 32, 32, 8], torch.float32, seed=1)
    x, ws, bs = _leaves(x, ws, bs)
    kept, peak = kept_and_peak((("fused", lambda: ckpt_ext.mlp(x, ws, bs, activation=acts)),
                                ("plain", lambda: mlp_ref(x, ws, bs, acts))), [x, *ws, *bs], gy)
    assert kept["fused"] == 0
    # plain keeps relu's output twice over two layers and tanh's output (the run's): 2·(64·32)
    assert kept["plain"] == 2 * 64 * 32 * 4
    assert peak["fused"] <= peak["plain"], peak


@pytest.mark.parametrize("activation,last,message", [
    (["relu", "tanh"], True, "one name or 3"),
    (["relu", "tanh", "gelu"], False, "one name or 2"),
    (["relu", "swish", "gelu"], True, "'swish'"),
    ([], True, "one name or 3"),
    (3, True, "one name or 3"),
])
def test_a_wrong_list_is_refused_before_any_kernel(activation, last, message):
    x, ws, bs, _ = mlp_inputs((2,), SIZES, torch.float32)
    with pytest.raises(ValueError, match=message):
        ckpt_ext.mlp(x, ws, bs, activation=activation, last_activation=last)


def test_the_op_names_a_wrong_count():
    x, ws, bs, _ = mlp_inputs((2,), SIZES, torch.float32)
    with pytest.raises(ValueError, match=r"ckpt_ext.mlp: activation must be one name or 3"):
        torch.ops.ckpt_ext.mlp.default(x, ws, bs, [True] * 3, "relu,tanh", True)
    with pytest.raises(ValueError, match=r"activation must be one of"):
        torch.ops.ckpt_ext.mlp.default(x, ws, bs, [True] * 3, "relu,,tanh", True)


@pytest.mark.cuda
@requires_gpu
@pytest.mark.parametrize("mix", [("relu", "relu", "tanh"), ("tanh", "gelu", "quick_gelu"),
                                 ("sin", "tanh", "silu")], ids="-".join)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("last", [True, False], ids=["last_act", "no_last_act"])
def test_cuda_matches_reference_and_recomputes_bitwise(mix, dtype, last, poison):
    # 67 rows: two full 32-row chunks of the bias sums and a partial one
    acts = list(mix if last else mix[:-1])
    x, ws, bs, gy = mlp_inputs((67,), [13, 17, 8, 9], dtype, seed=19)
    to = lambda t: None if t is None else t.cuda()
    got = _run(lambda x, ws, bs: ckpt_ext.mlp(x, ws, bs, activation=acts, last_activation=last),
               to(x), [to(w) for w in ws], [to(b) for b in bs], to(gy))
    d = lambda t: None if t is None else t.double()
    ref = _run(lambda x, ws, bs: mlp_ref(x, ws, bs, acts, last), d(x), [d(w) for w in ws],
               [d(b) for b in bs], d(gy))
    tol = max(mlp_tol(a, dtype) for a in acts)
    for i, (o, r) in enumerate(zip(got, ref)):
        assert o.is_cuda and rel_err(o.cpu(), r) <= tol, (mix, dtype, i)
    if not last:  # the top layer's grad_W reads its input as the recompute made it
        a2 = ckpt_ext.mlp(to(x), [to(w) for w in ws[:2]], [to(b) for b in bs[:2]],
                          activation=acts[:2])
        assert torch.equal(got[4], to(gy).t() @ a2)


@pytest.mark.parametrize("mix", [("tanh", "gelu", "tanh", "relu"), ("silu", "tanh", "tanh", "sin")],
                         ids="-".join)
@pytest.mark.parametrize("last", [True, False], ids=["last_act", "no_last_act"])
def test_gradient_of_one_parameter_alone(mix, last):
    # Asked for one weight or bias only, the walk starts at that layer (below it only its input is
    # made): the same bits as from a call that asks for every input.
    acts = list(mix if last else mix[:-1])
    x, ws, bs, gy = mlp_inputs((6,), [3, 5, 4, 6, 2], torch.float64, seed=11)
    x, ws, bs = _leaves(x, ws, bs)
    run = lambda: ckpt_ext.mlp(x, ws, bs, activation=acts, last_activation=last)
    want = torch.autograd.grad(run(), [x, *ws, *bs], gy)
    for i, t in enumerate([*ws, *bs]):
        (got,) = torch.autograd.grad(run(), t, gy)
        assert torch.equal(got, want[1 + i]), i
