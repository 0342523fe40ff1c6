"""ckpt_ext.gated_mlp and FusedGatedMLP, every activation, both weight layouts ([gate, up, down]
and [gate_up, down]): values and gradients against the float64 reference in every dtype, odd
shapes, zero rows and poisoned buffers, at every CPU ISA level; the recompute bitwise equal to the
forward; gradcheck/gradgradcheck, torch.func, torch.compile, autocast, opcheck, FLOPs; the memory
kept; the module against a Llama-style MLP; bad input."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ckpt_ext
from reference import (GATED_REL_TOL, gated_call, gated_grads, gated_inputs, gated_ref,
                       gated_ref_grads, kept_and_peak, measured, rel_err, requires_gpu)

ACTS = list(ckpt_ext.ACTIVATIONS)
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
LAYOUTS = ["separate", "packed"]
# (lead dims, hidden, intermediate, out, biases (gate, up, down)): odd sizes, one row, zero rows,
# a 3-D x, no bias, one bias alone, 65 rows (bias sums over a partial chunk), widths that leave
# a tail at every vector width.
SHAPES = [((7,), 5, 13, 5, (True, True, True)),
          ((33,), 9, 17, 4, (False, False, False)),
          ((1,), 3, 2, 3, (True, False, True)),
          ((2, 5), 6, 11, 6, (False, False, True)),
          ((65,), 16, 40, 16, (True, True, False)),
          ((0,), 4, 6, 4, (True, True, True)),
          ((19,), 33, 45, 19, (False, True, False))]


def _names(ws, bs):
    return (["out", "grad_x"] + [f"grad_w{i}" for i in range(len(ws))]
            + [f"grad_b{i}" for i in range(len(bs))])


def _check(got, want, act, dtype, what):
    for name, o, r in zip(_names(got[2:2 + 3], got), got, want):
        if r is None:
            assert o is None, (what, name)
            continue
        assert o.dtype == dtype and o.shape == r.shape, (what, name)
        e = rel_err(o.cpu(), r)
        measured(f"gated/{str(dtype)[6:]}/{act}/{name}", e)
        assert e <= GATED_REL_TOL[dtype], f"{what} {act} {dtype} {name}: rel err {e:.3g}"


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", range(len(SHAPES)))
def test_matches_reference(act, dtype, layout, case, poison, seed):
    lead, h, i, o, bias = SHAPES[case]
    x, ws, bs, gy = gated_inputs(lead, h, i, o, dtype, layout == "packed", bias, seed=seed)
    got = gated_grads(x, ws, bs, gy, act)
    assert got[0].shape == (*lead, o)
    _check(got, gated_ref_grads(x, ws, bs, gy, act), act, dtype, f"{layout} case {case}")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_level_matches_reference_and_recomputes_bitwise(level, act, dtype, layout, poison):
    # 67 rows, widths with a tail at every vector width. grad of the down weight is gyᵀ·h with
    # h = f(g)·u recomputed inside backward: the same GEMM on the forward's h (the op with an
    # identity down projection, which returns h exactly) gives the same bits.
    x, ws, bs, gy = gated_inputs((67,), 33, 45, 19, dtype, layout == "packed", seed=17)
    got = gated_grads(x, ws, bs, gy, act)
    _check(got, gated_ref_grads(x, ws, bs, gy, act), act, dtype, f"{layout} {level}")
    eye = torch.eye(45, dtype=dtype)
    h = gated_call(x, ws[:-1] + [eye], bs[:-1] + [None], act)
    assert torch.equal(got[1 + len(ws)], gy.t() @ h)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_down_weight_alone_recomputes_bitwise(act, dtype):
    # Only the down projection's weight asked for: the backward makes h in place in its own
    # buffer (no gradient w.r.t. h); still the forward's bits.
    x, ws, bs, gy = gated_inputs((29,), 12, 21, 7, dtype, seed=3)
    wd = ws[-1].requires_grad_()
    (gw,) = torch.autograd.grad(gated_call(x, ws, bs, act), wd, gy)
    h = gated_call(x, ws[:-1] + [torch.eye(21, dtype=dtype)], bs[:-1] + [None], act)
    assert torch.equal(gw, gy.t() @ h)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradcheck_and_gradgradcheck(act, layout):
    x, ws, bs, _ = gated_inputs((4,), 3, 5, 2, torch.float64, layout == "packed",
                                (True, True, True), seed=5)
    n = len(ws)
    f = lambda x, *p: gated_call(x, list(p[:n]), list(p[n:]), act)
    args = tuple(t.requires_grad_() for t in (x, *ws, *bs))
    assert torch.autograd.gradcheck(f, args)
    assert torch.autograd.gradgradcheck(f, args)


@pytest.mark.parametrize("act", ["silu", "gelu", "sin"])
def test_third_order_matches_autograd(act):
    # d³/dx³ of a scalar through create_graph: the composite the op records from the second
    # order on, against stock autograd on the reference.
    x, ws, bs, _ = gated_inputs((3,), 2, 6, 1, torch.float64, seed=7)

    def third(fn):
        xs = x.detach().requires_grad_()
        (g1,) = torch.autograd.grad(fn(xs, ws, bs, act).sum(), xs, create_graph=True)
        (g2,) = torch.autograd.grad(g1[:, 0].sum(), xs, create_graph=True)
        (g3,) = torch.autograd.grad(g2[:, 1].sum(), xs)
        return g1, g2, g3

    for a, b in zip(third(gated_call), third(gated_ref)):
        assert rel_err(a, b) <= 1e-12


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("create_graph", [False, True])
def test_gradient_of_one_parameter_alone(layout, create_graph):
    # Each tensor's gradient asked alone equals the one from a call that asks for all of them.
    x, ws, bs, gy = gated_inputs((6,), 4, 7, 3, torch.float64, layout == "packed", seed=11)
    leaves = [t.requires_grad_() for t in (x, *ws, *bs)]
    want = torch.autograd.grad(gated_call(x, ws, bs, "silu"), leaves, gy)
    for t, w in zip(leaves, want):
        (got,) = torch.autograd.grad(gated_call(x, ws, bs, "silu"), t, gy,
                                     create_graph=create_graph)
        assert rel_err(got, w) <= 1e-13


def test_packed_is_separate_and_chunk_views_reach_the_weight():
    # [gate_up, down] computes what [gate, up, down] does; the two halves of gate_up given as
    # views (w.chunk(2)) give gate_up the packed call's gradient.
    x, ws, bs, gy = gated_inputs((10,), 6, 8, 5, torch.float64, packed=True, seed=13)
    w, b = ws[0].requires_grad_(), bs[0].requires_grad_()
    packed = torch.autograd.grad(gated_call(x, ws, bs, "silu"), [w, b], gy)
    views = torch.autograd.grad(
        gated_call(x, [*w.chunk(2), ws[1]], [*b.chunk(2), bs[1]], "silu"), [w, b], gy)
    for p, v in zip(packed, views):
        assert rel_err(v, p) <= 1e-14


@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "sigmoid"])
def test_torch_func(act):
    from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap
    x, ws, bs, gy = gated_inputs((5,), 3, 6, 2, torch.float64, seed=9)
    fused = lambda x: gated_call(x, ws, bs, act)
    ref = lambda x: gated_ref(x, ws, bs, act)
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
    # forward mode w.r.t. the weights too, and per-sample weight gradients
    wt = [torch.randn_like(w) for w in ws]
    pf = lambda *w: gated_call(x, list(w), bs, act)
    pr = lambda *w: gated_ref(x, list(w), bs, act)
    assert rel_err(jvp(pf, tuple(ws), tuple(wt))[1], jvp(pr, tuple(ws), tuple(wt))[1]) <= tol
    per = vmap(grad(lambda w, xi: gated_call(xi[None], [w, *ws[1:]], bs, act).sum()),
               in_dims=(None, 0))(ws[0], x)
    for i in range(x.shape[0]):
        one = grad(lambda w: gated_ref(x[i:i + 1], [w, *ws[1:]], bs, act).sum())(ws[0])
        assert rel_err(per[i], one) <= tol


@pytest.mark.parametrize("act,backend", [("silu", "aot_eager"), ("gelu_tanh", "aot_eager"),
                                         ("silu", "inductor")])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_compile_fullgraph(act, backend, layout):
    torch._dynamo.reset()
    x, ws, bs, gy = gated_inputs((8,), 4, 9, 3, torch.float32, layout == "packed", seed=11)
    n = len(ws)
    f = lambda x, *p: gated_call(x, list(p[:n]), list(p[n:]), act)
    cf = torch.compile(f, fullgraph=True, backend=backend)
    args = [t.requires_grad_() for t in (x, *ws, *bs)]
    y, yc = f(*args), cf(*args)
    assert rel_err(yc, y) <= 1e-6
    for a, b in zip(torch.autograd.grad(y, args, gy), torch.autograd.grad(yc, args, gy)):
        assert rel_err(b, a) <= 1e-6


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_autocast_bfloat16(act):
    x, ws, bs, gy = gated_inputs((16,), 8, 12, 8, torch.float32, seed=13)
    for t in ws:
        t.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = gated_call(x, ws, bs, act)
    assert y.dtype == torch.bfloat16
    d = lambda ts: [None if t is None else t.detach().double() for t in ts]
    assert rel_err(y, gated_ref(x.double(), d(ws), d(bs), act)) <= GATED_REL_TOL[torch.bfloat16]
    y.float().backward(gy)
    assert ws[0].grad is not None and ws[0].grad.dtype == torch.float32


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_opcheck(act, layout):
    x, ws, bs, gy = gated_inputs((6,), 3, 5, 2, torch.float64, layout == "packed",
                                 (True, True, False), seed=15)
    has = [b is not None for b in bs]
    present = [b for b in bs if b is not None]
    torch.library.opcheck(torch.ops.ckpt_ext.gated_mlp.default,
                          (x.requires_grad_(), [w.requires_grad_() for w in ws],
                           [b.requires_grad_() for b in present], has, act))
    torch.library.opcheck(
        torch.ops.ckpt_ext.gated_mlp_backward.default,
        (gy, x.detach(), [w.detach() for w in ws], [b.detach() for b in present], has, act, True,
         [True] * len(ws), [True] * len(present)),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_flops_count_the_gemms(layout):
    from torch.utils.flop_counter import FlopCounterMode
    M, H, I, O = 10, 4, 8, 3
    x, ws, bs, gy = gated_inputs((M,), H, I, O, torch.float32, layout == "packed", seed=1)
    leaves = [t.requires_grad_() for t in (x, *ws)]

    def count(fn):
        with FlopCounterMode(display=False) as c:
            fn(x, ws, bs, "silu").backward(gy)
        for t in leaves:
            t.grad = None
        return c.get_total_flops()

    assert count(gated_call) == count(gated_ref) + 2 * M * H * 2 * I  # gate and up again


@pytest.mark.parametrize("act", ACTS)
def test_memory_kept_and_peak_in_bytes(act):
    # Kept for backward, exact bytes (the CPU meter): the fused op nothing beyond its output;
    # stock autograd at least f(g), u and h (M x I each; g too where f's backward reads its
    # input). The fused backward's peak stays at or below plain's.
    M, H, I = 64, 16, 48
    x, ws, bs, gy = gated_inputs((M,), H, I, H, torch.float32, seed=2)
    leaves = [t.requires_grad_() for t in (x, *ws, *bs)]
    kept, peak = kept_and_peak((("fused", lambda: gated_call(x, ws, bs, act)),
                                ("plain", lambda: gated_ref(x, ws, bs, act))), leaves, gy)
    assert kept["fused"] == 0
    assert kept["plain"] >= 3 * M * I * 4, kept
    assert peak["fused"] <= peak["plain"], peak


def test_broadcast_and_padded_grad_out(poison):
    # out.mean() gives grad_out at strides (0, 0); a padded x and grad_out have row stride above
    # their width: both read in place, against the float64 reference.
    x, ws, bs, _ = gated_inputs((70,), 11, 24, 17, torch.float32, seed=4)
    gy = torch.full((), 1 / (70 * 17)).expand(70, 17)
    _check(gated_grads(x, ws, bs, gy, "silu"), gated_ref_grads(x, ws, bs, gy, "silu"), "silu",
           torch.float32, "broadcast")
    xp = torch.randn(70, 16)[:, :11].copy_(x)
    gyp = torch.randn(70, 20)[:, :17]
    _check(gated_grads(xp, ws, bs, gyp, "silu"), gated_ref_grads(x, ws, bs, gyp, "silu"), "silu",
           torch.float32, "padded")


# ---- FusedGatedMLP -----------------------------------------------------------------------------

class LlamaStyleMLP(nn.Module):
    """transformers' LlamaMLP, as its source writes it."""

    def __init__(self, hidden, inter, act=nn.SiLU(), bias=False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act_fn = act

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("act,module", [("silu", nn.SiLU()), ("gelu_tanh", nn.GELU("tanh"))])
@pytest.mark.parametrize("bias", [False, True])
def test_module_is_the_llama_mlp(act, module, bias):
    torch.manual_seed(0)
    ref = LlamaStyleMLP(6, 10, module, bias)
    torch.manual_seed(0)
    fused = ckpt_ext.FusedGatedMLP(6, 10, act, bias=bias)
    assert fused.state_dict().keys() == ref.state_dict().keys()
    for (k, a), b in zip(fused.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), k  # the same seeded initial values
    ref.double()
    fused.double().load_state_dict(ref.state_dict())
    x = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    y, yr = fused(x), ref(x)
    assert rel_err(y, yr) <= 1e-14
    gy = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, [x, *fused.parameters()], gy),
                    torch.autograd.grad(yr, [x, *ref.parameters()], gy)):
        assert rel_err(a, b) <= 1e-13
    shared = ckpt_ext.FusedGatedMLP.from_modules(ref.gate_proj, ref.up_proj, ref.down_proj, act)
    assert shared.gate_proj is ref.gate_proj and shared.down_proj is ref.down_proj
    assert torch.equal(shared(x), y)
    assert "intermediate_size=10" in repr(shared)


def test_from_modules_refuses_what_it_cannot_run():
    g, u, d = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 4)
    with pytest.raises(TypeError, match="up_proj must be exactly nn.Linear"):
        ckpt_ext.FusedGatedMLP.from_modules(g, nn.Identity(), d)
    with pytest.raises(ValueError, match="up_proj must have gate_proj's shape"):
        ckpt_ext.FusedGatedMLP.from_modules(g, nn.Linear(4, 5), d)
    with pytest.raises(ValueError, match="down_proj.in_features must equal the intermediate "
                                         "size 6, got 5"):
        ckpt_ext.FusedGatedMLP.from_modules(g, u, nn.Linear(5, 4))
    with pytest.raises(ValueError, match="activation must be one of"):
        ckpt_ext.FusedGatedMLP(4, 6, "swish")


# ---- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_errors_name_the_argument(device):
    x = torch.randn(5, 4, device=device)
    wg, wu, wd = (torch.randn(6, 4, device=device), torch.randn(6, 4, device=device),
                  torch.randn(4, 6, device=device))
    cases = [
        (ValueError, r"up_weight \(weights\[1\]\) must have the shape of gate_weight "
                     r"\(weights\[0\]\) \[6, 4\], got shape \[5, 4\]",
         lambda: ckpt_ext.gated_mlp(x, wg, wu[:5], wd)),
        (ValueError, r"gate_weight \(weights\[0\]\).shape\[1\] \(hidden size\) must equal "
                     r"x.shape\[-1\] = 3",
         lambda: ckpt_ext.gated_mlp(x[:, :3], wg, wu, wd)),
        (ValueError, r"down_weight \(weights\[2\]\).shape\[1\] must equal the intermediate "
                     r"size 6, got down_weight \(weights\[2\]\) of shape \[4, 5\]",
         lambda: ckpt_ext.gated_mlp(x, wg, wu, wd[:, :5])),
        (ValueError, r"up_bias \(the bias of weights\[1\]\) must have shape \[6\]",
         lambda: ckpt_ext.gated_mlp(x, wg, wu, wd, up_bias=torch.zeros(5, device=device))),
        (ValueError, r"gate_up_weight \(weights\[0\]\) must have an even number of rows",
         lambda: ckpt_ext.gated_mlp(x, torch.randn(7, 4, device=device), None, wd)),
        (ValueError, r"up_bias must be None when up_weight is None",
         lambda: ckpt_ext.gated_mlp(x, torch.cat([wg, wu]), None, wd,
                                    up_bias=torch.zeros(6, device=device))),
        (TypeError, r"up_weight \(weights\[1\]\) must have the dtype of x \(Float\), got Double",
         lambda: ckpt_ext.gated_mlp(x, wg, wu.double(), wd)),
        (TypeError, r"x must be float32, float64, bfloat16 or float16, got Int",
         lambda: ckpt_ext.gated_mlp(x.int(), wg.int(), wu.int(), wd.int())),
        (ValueError, r"activation must be one of .*got 'swish'",
         lambda: ckpt_ext.gated_mlp(x, wg, wu, wd, activation="swish")),
    ]
    for exc, msg, call in cases:
        with pytest.raises(exc, match=msg):
            call()


# ---- CUDA (scripts/gpu_check.sh runs the `cuda`-marked tests) ------------------------------------

@pytest.mark.cuda
@requires_gpu
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("inter", [1, 7, 8, 17, 64])
def test_cuda_matches_reference_and_recomputes_bitwise(act, dtype, layout, inter, poison):
    # intermediate widths below, at and past the 16-byte pack; 67 rows
    x, ws, bs, gy = gated_inputs((67,), 13, inter, 9, dtype, layout == "packed", device="cuda",
                                 seed=19)
    got = gated_grads(x, ws, bs, gy, act)
    _check(got, gated_ref_grads(x, ws, bs, gy, act), act, dtype, f"cuda {layout} {inter}")
    eye = torch.eye(inter, dtype=dtype, device="cuda")
    h = gated_call(x, ws[:-1] + [eye], bs[:-1] + [None], act)
    assert torch.equal(got[1 + len(ws)], gy.t() @ h)
