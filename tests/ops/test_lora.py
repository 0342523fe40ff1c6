"""LoRA terms on ckpt_ext.mlp and ckpt_ext.gated_mlp (ckpt_ext.LoRA; the lora_mlp and
lora_gated_mlp ops): values and gradients against the float64 reference in every dtype, odd
shapes and ranks, LoRA on some weights and not others, with and without the LoRA bias, frozen and
trainable base; within a few ulps of peft's formula where the arithmetic allows it; no
grad_W GEMM for a frozen base; gradcheck/gradgradcheck, torch.func, torch.compile, autocast,
opcheck, FLOPs; dropout masks drawn as peft draws them and redrawn in backward; what is
kept for backward, in bytes; bad input. (peft's own modules: test_lora_peft.py.)"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import ckpt_ext
from ckpt_ext import LoRA
from reference import (gated_inputs, lora_gated_ref, lora_leaves, lora_linear_ref, lora_mlp_ref,
                       lora_run, lora_terms, measured, mlp_inputs, rel_err, requires_gpu)
from _ecosys import saved_activation_bytes

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# Relative error bound of every result (out, grad_x, grad_W, grad_b, grad_A, grad_B, grad of B's
# bias) against the float64 reference, float32 and float64: ~4x the largest that
# test_mlp_matches_reference and test_gated_matches_reference measured over seeds 0-9
# (--seed-sweep=0:10, CKPT_EXT_MEASURE): float64 1.9e-15, float32 4.3e-06.
LORA_REL_TOL = {torch.float64: 1e-14, torch.float32: 1.5e-5}
# bfloat16 and float16: the same computation by stock PyTorch in that dtype (peft's) is off by as
# much where a sum cancels (bfloat16: 0.45 for both on one seed), so the bound is relative to it:
# 2x stock's error plus a floor, ~2.5x the largest excess over 2x stock measured over seeds 0-29
# (bfloat16 1.1e-2, float16 1.3e-2: one row, two intermediate units and r = 1, where
# t = h·Aᵀ cancels and a one-ulp difference of h, rounded once here and twice by stock, moves
# grad_B by 1.4 %).
HALF_FLOOR = {torch.bfloat16: 3e-2, torch.float16: 3e-2}


def check(got, want, act, dtype, what, stock=None):
    """Each result against the float64 reference (``stock``: the reference in ``dtype``, for
    the half types' bound)."""
    assert len(got) == len(want), what
    name = act if isinstance(act, str) else "mixed"
    for k, (o, r) in enumerate(zip(got, want)):
        assert o.dtype == dtype and o.shape == r.shape, (what, k, o.dtype, o.shape, r.shape)
        e = rel_err(o.cpu(), r)
        if dtype in LORA_REL_TOL:
            bound = LORA_REL_TOL[dtype]
        else:
            e_stock = rel_err(stock[k].cpu(), r)
            measured(f"lora_beyond_2x_stock/{str(dtype)[6:]}", e - 2 * e_stock)
            bound = 2 * e_stock + HALF_FLOOR[dtype]
        measured(f"lora/{str(dtype)[6:]}/{name}/{k}", e)
        assert e <= bound, f"{what} {act} {dtype} result {k}: rel err {e:.3g} > {bound:.3g}"


def stock_in(dtype, fn, *args):
    """The reference in ``dtype`` itself where the half types' bound needs it, else None."""
    return lora_run(fn, *args) if dtype not in LORA_REL_TOL else None


def mlp_call(act, last):
    return lambda x, ws, bs, loras: ckpt_ext.mlp(x, ws, bs, act, last, lora=loras)


def mlp_ref(act, last):
    return lambda x, ws, bs, loras: lora_mlp_ref(x, ws, bs, act, last, loras)


def gated_call(act):
    def call(x, ws, bs, loras):
        if len(ws) == 2:
            return ckpt_ext.gated_mlp(x, ws[0], None, ws[1], bs[0], None, bs[1], act, lora=loras)
        return ckpt_ext.gated_mlp(x, *ws, *bs, activation=act, lora=loras)
    return call


def gated_ref(act):
    return lambda x, ws, bs, loras: lora_gated_ref(x, ws, bs, act, loras)


# ---- the Linear/activation run -----------------------------------------------------------------

# (lead dims, sizes, rank per layer (None: no LoRA), LoRA bias, base bias, last_activation):
# in 6/42, out 123, r 1/3/8; LoRA on some layers only; zero rows; 65 rows.
MLP_CASES = [((7,), [6, 123], [1], True, True, False),
             ((3, 5), [42, 123, 17], [8, None], False, True, True),
             ((11,), [6, 42, 123, 5], [3, 8, 1], True, False, False),
             ((1,), [42, 6, 9], [None, 3], True, True, True),
             ((0,), [6, 8, 4], [2, 2], True, True, False),
             ((65,), [16, 40, 16], [8, 8], False, True, True)]
MLP_ACTS = ["tanh", "silu", "relu", ("relu", "gelu", "sin")]


def mlp_case(case, dtype, act, seed, dropout=0.0, device="cpu"):
    lead, sizes, ranks, lora_bias, bias, last = MLP_CASES[case]
    x, ws, bs, gy = mlp_inputs(lead, sizes, dtype, device=device, seed=seed, bias=bias)
    loras = lora_terms(ws, ranks, lora_bias, scaling=2.0, dropout=dropout, seed=seed)
    if not isinstance(act, str):  # one name per layer with an activation; none: any name
        layers = len(ws) if last else len(ws) - 1
        act = [act[i % len(act)] for i in range(layers)] if layers else act[0]
    return x, ws, bs, loras, gy, act, last


@pytest.mark.parametrize("base_grad", [False, True], ids=["frozen", "trainable"])
@pytest.mark.parametrize("act", MLP_ACTS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", range(len(MLP_CASES)))
def test_mlp_matches_reference(case, dtype, act, base_grad, poison, seed):
    x, ws, bs, loras, gy, acts, last = mlp_case(case, dtype, act, seed)
    got = lora_run(mlp_call(acts, last), x, ws, bs, loras, gy, base_grad)
    ref = mlp_ref(acts, last)
    want = lora_run(ref, x, ws, bs, loras, gy, base_grad, torch.float64, "cpu")
    check(got, want, act, dtype, f"case {case}",
          stock_in(dtype, ref, x, ws, bs, loras, gy, base_grad))


# ---- the gated MLP -----------------------------------------------------------------------------

# (lead dims, hidden, intermediate, out, packed, rank per weight, LoRA bias, base biases)
GATED_CASES = [((7,), 6, 13, 6, False, [8, 3, 1], True, (True, True, True)),
               ((2, 5), 42, 17, 42, False, [None, 3, None], False, (False, False, False)),
               ((33,), 9, 17, 4, True, [3, 8], True, (False, False, True)),
               ((1,), 3, 2, 3, True, [None, 1], False, (True, True, True)),
               ((0,), 4, 6, 4, False, [2, 2, 2], True, (True, True, True)),
               ((19,), 33, 45, 19, False, [8, None, 8], True, (True, False, True))]
GATED_ACTS = ["silu", "gelu_tanh", "relu"]


def gated_case(case, dtype, seed, dropout=0.0, device="cpu"):
    lead, h, i, o, packed, ranks, lora_bias, bias = GATED_CASES[case]
    x, ws, bs, gy = gated_inputs(lead, h, i, o, dtype, packed, bias, device=device, seed=seed)
    return x, ws, bs, lora_terms(ws, ranks, lora_bias, 0.5, dropout, seed), gy


@pytest.mark.parametrize("base_grad", [False, True], ids=["frozen", "trainable"])
@pytest.mark.parametrize("act", GATED_ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", range(len(GATED_CASES)))
def test_gated_matches_reference(case, dtype, act, base_grad, poison, seed):
    x, ws, bs, loras, gy = gated_case(case, dtype, seed)
    got = lora_run(gated_call(act), x, ws, bs, loras, gy, base_grad)
    want = lora_run(gated_ref(act), x, ws, bs, loras, gy, base_grad, torch.float64, "cpu")
    check(got, want, act, dtype, f"case {case}",
          stock_in(dtype, gated_ref(act), x, ws, bs, loras, gy, base_grad))


def test_no_lora_is_the_op_without():
    # lora=[None, ...]: the mlp and gated_mlp ops themselves, to the bit.
    x, ws, bs, _ = mlp_inputs((5,), [6, 9, 4], torch.float32, seed=1)
    assert torch.equal(ckpt_ext.mlp(x, ws, bs, "silu", lora=[None, None]),
                       ckpt_ext.mlp(x, ws, bs, "silu"))
    x, ws, bs, _ = gated_inputs((5,), 6, 9, 6, torch.float32, seed=2)
    assert torch.equal(ckpt_ext.gated_mlp(x, *ws, *bs, lora=[None] * 3),
                       ckpt_ext.gated_mlp(x, *ws, *bs))


# ---- against peft's formula --------------------------------------------------------------------

# Where the activation is exact, the forward is peft's ops in peft's order, one rounding per op,
# but not its GEMM calls: the fused op runs its GEMMs on other operand layouts (a packed gate_up,
# a transposed operand), for which MKL may pick other kernels. So within 4 ulps relative, not
# bitwise (docs/testing.md, "Bitwise or within a bound"): float32 ~4x the largest measured over
# seeds 0-29 (--seed-sweep=0:30), 9.8e-08 with this machine's kernels, 0 under the dispatch
# step's, 1.05e-07 with ATEN_CPU_CAPABILITY=default; the other dtypes measured 0.
PEFT_FORMULA_ULPS = 4


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_is_peft_formula(dtype, seed):
    # The activation exact (none, relu) or computed as stock PyTorch computes it (relu's product
    # f(g)·u): a single Linear with LoRA; a relu run; a relu gated MLP, packed too.
    bound = PEFT_FORMULA_ULPS * torch.finfo(dtype).eps
    dt = str(dtype).removeprefix("torch.")
    x, ws, bs, _ = mlp_inputs((2, 9), [42, 123, 17], dtype, seed=seed)
    loras = lora_terms(ws, [8, 3], bias=True, scaling=0.25, seed=seed)
    pairs = [("linear", ckpt_ext.mlp(x, ws[:1], bs[:1], last_activation=False, lora=loras[:1]),
              lora_linear_ref(x, ws[0], bs[0], loras[0])),
             ("relu run", ckpt_ext.mlp(x, ws, bs, "relu", False, lora=loras),
              lora_mlp_ref(x, ws, bs, "relu", False, loras))]
    for packed in (False, True):
        x, ws, bs, _ = gated_inputs((2, 9), 42, 30, 42, dtype, packed, seed=seed + 1)
        loras = lora_terms(ws, [8, 3, 1][:len(ws)], bias=True, scaling=2.0, seed=seed + 1)
        pairs.append((f"gated packed={packed}", gated_call("relu")(x, ws, bs, loras),
                      lora_gated_ref(x, ws, bs, "relu", loras)))
    for what, got, want in pairs:
        assert measured(f"lora_peft_formula/{dt}", rel_err(got, want)) <= bound, what


def test_transposed_base_weights():
    # transformers' Conv1D stores x·W + b with W (in, out): the ops take weight.t(), a view, with
    # LoRA too; the stored tensor's gradient comes back contiguous.
    x, ws, bs, gy = mlp_inputs((4, 3), [6, 42, 5], torch.float64, seed=5)
    stored = [w.t().contiguous() for w in ws]
    loras = lora_terms(ws, [3, 8], bias=True, seed=5)
    got = lora_run(mlp_call("gelu_tanh", False), x, [s.t() for s in stored], bs, loras, gy, True)
    want = lora_run(mlp_ref("gelu_tanh", False), x, ws, bs, loras, gy, True)
    check(got[:2] + got[4:], want[:2] + want[4:], "gelu_tanh", torch.float64, "conv1d")
    for g, w in zip(got[2:4], want[2:4]):
        assert rel_err(g, w) <= 1e-14
        assert g.t().is_contiguous()  # the (in, out) layout of the stored weight


# ---- what the backward runs --------------------------------------------------------------------

def _gemms(fn) -> int:
    """The aten::mm / aten::addmm calls the profiler sees while fn() runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm"))


@pytest.mark.parametrize("gated", [False, True])
def test_frozen_base_runs_no_weight_gradient_gemm(gated):
    # The backward op with every base weight trainable runs exactly one GEMM more per weight
    # (its grad_W) than with the base frozen; nothing else changes.
    if gated:
        x, ws, bs, loras, gy = gated_case(0, torch.float32, seed=6)
        call = gated_call("silu")
    else:
        x, ws, bs, loras, gy, acts, last = mlp_case(2, torch.float32, "silu", seed=6)
        call = mlp_call(acts, last)
    counts = {}
    for base_grad in (False, True):
        leaves = [x.requires_grad_()] + [t.requires_grad_() for lo in loras if lo is not None
                                         for t in lora_leaves(lo)]
        for w in ws:
            w.requires_grad_(base_grad)
        y = call(x, ws, bs, loras)
        counts[base_grad] = _gemms(lambda: torch.autograd.grad(
            y, leaves + (ws if base_grad else []), gy))
    assert counts[True] - counts[False] == len(ws), counts


def test_flops_count_the_lora_gemms():
    # FlopCounterMode: the fused step is stock autograd's plus the recompute (every recomputed
    # layer's base and LoRA GEMMs), plus t = a·Aᵀ of the top layer without activation, which the
    # recompute does not make (gated: of the down projection). Frozen base.
    from torch.utils.flop_counter import FlopCounterMode
    M = 10

    def count(fn, x, ws, bs, loras, gy):
        with FlopCounterMode(display=False) as c:
            lora_run(fn, x, ws, bs, loras, gy)
        return c.get_total_flops()

    def pair(w, r):
        return 2 * M * w.shape[1] * r + 2 * M * r * w.shape[0]

    x, ws, bs, gy = mlp_inputs((M,), [6, 12, 5], torch.float32, seed=1)
    loras = lora_terms(ws, [3, 2])
    extra = 2 * M * 12 * 6 + pair(ws[0], 3) + 2 * M * 12 * 2
    assert (count(mlp_call("silu", False), x, ws, bs, loras, gy)
            == count(mlp_ref("silu", False), x, ws, bs, loras, gy) + extra)
    x, ws, bs, gy = gated_inputs((M,), 6, 8, 5, torch.float32, seed=2)
    loras = lora_terms(ws, [3, 2, 4])
    extra = 2 * (2 * M * 6 * 8) + pair(ws[0], 3) + pair(ws[1], 2) + 2 * M * 8 * 4
    assert (count(gated_call("silu"), x, ws, bs, loras, gy)
            == count(gated_ref("silu"), x, ws, bs, loras, gy) + extra)


# ---- higher orders and the transforms ----------------------------------------------------------

@pytest.mark.parametrize("gated", [False, True])
def test_gradcheck_and_gradgradcheck(gated):
    if gated:
        x, ws, bs, gy = gated_inputs((4,), 3, 5, 2, torch.float64, seed=5)
        call = gated_call("silu")
        loras = lora_terms(ws, [2, None, 1], bias=True, seed=5)
    else:
        x, ws, bs, gy = mlp_inputs((4,), [3, 5, 2], torch.float64, seed=5)
        call = mlp_call(["gelu"], False)
        loras = lora_terms(ws, [2, 1], bias=True, seed=5)
    n, k = len(ws), sum(b is not None for b in bs)
    present = [i for i, lo in enumerate(loras) if lo is not None]

    def f(x, *p):
        it = iter(p[n + k:])
        ls = list(loras)
        for i in present:
            ls[i] = ls[i]._replace(A=next(it), B=next(it), bias=next(it))
        bi = iter(p[n:n + k])
        return call(x, list(p[:n]), [next(bi) if b is not None else None for b in bs], ls)

    args = tuple(t.detach().requires_grad_() for t in
                 (x, *ws, *(b for b in bs if b is not None),
                  *(t for i in present for t in lora_leaves(loras[i]))))
    assert torch.autograd.gradcheck(f, args)
    assert torch.autograd.gradgradcheck(f, args)


@pytest.mark.parametrize("gated", [False, True])
def test_torch_func(gated):
    from torch.func import grad, hessian, jacrev, jvp, vjp, vmap
    if gated:
        x, ws, bs, gy = gated_inputs((5,), 3, 6, 2, torch.float64, seed=9)
        fused, ref = gated_call("silu"), gated_ref("silu")
        loras = lora_terms(ws, [2, 3, 1], bias=True, seed=9)
    else:
        x, ws, bs, gy = mlp_inputs((5,), [3, 6, 2], torch.float64, seed=9)
        fused, ref = mlp_call("tanh", False), mlp_ref("tanh", False)
        loras = lora_terms(ws, [2, 1], bias=True, seed=9)
    f = lambda x: fused(x, ws, bs, loras)
    r = lambda x: ref(x, ws, bs, loras)
    tol = 1e-12
    assert rel_err(grad(lambda x: f(x).sum())(x), grad(lambda x: r(x).sum())(x)) <= tol
    assert rel_err(vjp(f, x)[1](gy)[0], vjp(r, x)[1](gy)[0]) <= tol
    t = torch.randn_like(x)
    assert rel_err(jvp(f, (x,), (t,))[1], jvp(r, (x,), (t,))[1]) <= tol
    assert rel_err(vmap(f)(x.unsqueeze(1)), vmap(r)(x.unsqueeze(1))) <= tol
    row = lambda fn: (lambda v: fn(v.unsqueeze(0)).squeeze(0))
    assert rel_err(vmap(jacrev(row(f)))(x), vmap(jacrev(row(r)))(x)) <= tol
    s = lambda fn: (lambda v: fn(v.unsqueeze(0)).sum())
    assert rel_err(hessian(s(f))(x[0]), hessian(s(r))(x[0])) <= tol
    # gradients and tangents w.r.t. the LoRA factors; per-sample gradients of A
    A, B = loras[0].A, loras[0].B
    with_ab = lambda fn: (lambda A, B: fn(x, ws, bs, [loras[0]._replace(A=A, B=B), *loras[1:]]))
    for fn_f, fn_r in ((grad(lambda A, B: with_ab(fused)(A, B).sum(), argnums=(0, 1)),
                        grad(lambda A, B: with_ab(ref)(A, B).sum(), argnums=(0, 1))),):
        for a, b in zip(fn_f(A, B), fn_r(A, B)):
            assert rel_err(a, b) <= tol
    tA, tB = torch.randn_like(A), torch.randn_like(B)
    assert rel_err(jvp(with_ab(fused), (A, B), (tA, tB))[1],
                   jvp(with_ab(ref), (A, B), (tA, tB))[1]) <= tol
    one = lambda fn: (lambda A, xi: fn(xi[None], ws, bs,
                                        [loras[0]._replace(A=A), *loras[1:]]).sum())
    per = vmap(grad(one(fused)), in_dims=(None, 0))(A, x)
    for i in range(x.shape[0]):
        assert rel_err(per[i], grad(one(ref))(A, x[i])) <= tol


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("gated", [False, True])
def test_compile_fullgraph(gated, backend):
    torch._dynamo.reset()
    if gated:
        x, ws, bs, loras, gy = gated_case(2, torch.float32, seed=11)
        call = gated_call("silu")
    else:
        x, ws, bs, loras, gy, acts, last = mlp_case(1, torch.float32, "gelu_tanh", seed=11)
        call = mlp_call(acts, last)
    compiled = torch.compile(call, fullgraph=True, backend=backend)
    got = lora_run(compiled, x, ws, bs, loras, gy, base_grad=True)
    want = lora_run(call, x, ws, bs, loras, gy, base_grad=True)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-6


@pytest.mark.parametrize("gated", [False, True])
def test_autocast_bfloat16(gated):
    # As peft's lora.Linear under autocast: every Linear (base, lora_A, lora_B) in bfloat16, the
    # gradients landing in the float32 parameters.
    if gated:
        x, ws, bs, loras, gy = gated_case(0, torch.float32, seed=13)
        fused, ref = gated_call("silu"), gated_ref("silu")
    else:
        x, ws, bs, loras, gy, acts, last = mlp_case(2, torch.float32, "silu", seed=13)
        fused, ref = mlp_call(acts, last), mlp_ref(acts, last)

    def run(fn):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return lora_run(fn, x, ws, bs, loras, gy, base_grad=True)

    got, want = run(fused), run(ref)
    assert got[0].dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for g in got[1:])
    for k, (a, b) in enumerate(zip(got, want)):
        assert rel_err(a, b) <= 0.05, k


@pytest.mark.parametrize("gated", [False, True])
def test_opcheck(gated):
    if gated:
        x, ws, bs, loras, gy = gated_case(0, torch.float64, seed=15)
        op, bop = torch.ops.ckpt_ext.lora_gated_mlp, torch.ops.ckpt_ext.lora_gated_mlp_backward
        head = ("silu",)
    else:
        x, ws, bs, loras, gy, acts, last = mlp_case(2, torch.float64, "silu", seed=15)
        op, bop = torch.ops.ckpt_ext.lora_mlp, torch.ops.ckpt_ext.lora_mlp_backward
        head = (acts, last)
    loras[1] = None  # a weight without LoRA between two with
    terms = [t for t in loras if t is not None]
    present = [b for b in bs if b is not None]
    lists = ([t.A for t in terms], [t.B for t in terms],
             [t.bias for t in terms if t.bias is not None], [t is not None for t in loras],
             [t.bias is not None for t in terms], [t.scaling for t in terms])
    grad_args = lambda ts: [t.detach().requires_grad_() for t in ts]
    torch.library.opcheck(op.default, (x.detach().requires_grad_(), grad_args(ws),
                                       grad_args(present), [b is not None for b in bs], *head,
                                       grad_args(lists[0]), grad_args(lists[1]),
                                       grad_args(lists[2]), *lists[3:]))
    torch.library.opcheck(
        bop.default,
        (gy, x, ws, present, [b is not None for b in bs], *head, *lists, True,
         [False] * len(ws), [True] * len(present), [True] * len(terms), [True] * len(terms),
         [True] * len(lists[2])),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


# ---- dropout -----------------------------------------------------------------------------------

@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("unit", ["mlp", "gated", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_dropout_draws_peft_masks_and_redraws_them(unit, p, dtype, seed):
    # One mask per LoRA Linear, on its input, in the unit's call order: the output is the
    # reference's under the same seed; the generator is left where the reference leaves it, to the
    # bit; the backward redraws the masks (other draws in between), so every gradient is the
    # reference's. Values within PEFT_FORMULA_ULPS (the reference's GEMMs run on other operand
    # layouts); another mask is off by O(1).
    if unit == "mlp":
        x, ws, bs, loras, gy, acts, last = mlp_case(2, dtype, "silu", seed, dropout=p)
        fused, ref = mlp_call(acts, last), mlp_ref(acts, last)
    else:
        x, ws, bs, loras, gy = gated_case(0 if unit == "gated" else 2, dtype, seed, dropout=p)
        fused, ref = gated_call("silu"), gated_ref("silu")

    def run(fn):
        torch.manual_seed(seed)
        xs = x.detach().requires_grad_()
        ls = [None if t is None else t._replace(A=t.A.detach().requires_grad_(),
                                                B=t.B.detach().requires_grad_()) for t in loras]
        y = fn(xs, ws, bs, ls)
        after = torch.get_rng_state()
        torch.rand(100)  # draws between forward and backward
        leaves = [xs] + [t for lo in ls if lo is not None for t in (lo.A, lo.B)]
        grads = torch.autograd.grad(y, leaves, gy)
        return y, after, grads, torch.get_rng_state()

    y, after, grads, end = run(fused)
    y_ref, after_ref, grads_ref, end_ref = run(ref)
    assert torch.equal(after, after_ref) and torch.equal(end, end_ref)
    bound = PEFT_FORMULA_ULPS * torch.finfo(dtype).eps
    dt = str(dtype).removeprefix("torch.")
    assert measured(f"lora_dropout/{dt}/out", rel_err(y, y_ref)) <= bound
    for k, (g, w) in enumerate(zip(grads, grads_ref)):
        assert measured(f"lora_dropout/{dt}/grad", rel_err(g, w)) <= bound, k
    no_dropout = fused(x, ws, bs, [t and t._replace(dropout=0.0) for t in loras])
    assert rel_err(no_dropout, y) > 1e3 * bound


def test_dropout_under_compile_and_func_runs_the_unfused_ops():
    # Where the recomputing Function cannot run, the same ATen ops run under stock autograd: the
    # reference's values and masks.
    x, ws, bs, loras, gy = gated_case(0, torch.float32, seed=21, dropout=0.2)
    torch.manual_seed(0)
    want = lora_gated_ref(x, ws, bs, "silu", loras)
    torch.manual_seed(0)
    f = lambda x: gated_call("silu")(x, ws, bs, loras)
    assert rel_err(torch.func.vmap(f, randomness="same")(x[None])[0], want) <= 1e-6
    # aot_eager runs the traced ATen ops eagerly, so their draws (inductor draws with its own
    # generator, as for any compiled dropout)
    torch._dynamo.reset()
    torch.manual_seed(0)
    xs = x.detach().requires_grad_()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(xs)
    assert torch.equal(got, want)
    (gx,) = torch.autograd.grad(got, xs, gy)
    torch.manual_seed(0)
    xr = x.detach().requires_grad_()
    assert torch.equal(gx, torch.autograd.grad(lora_gated_ref(xr, ws, bs, "silu", loras), xr,
                                               gy)[0])


# ---- memory ------------------------------------------------------------------------------------

class _Params(nn.Module):
    """A holder of the unit's parameters, so the meter tells them from what autograd saves."""

    def __init__(self, ws, bs, loras):
        super().__init__()
        ts = [*ws, *(b for b in bs if b is not None),
              *(t for lo in loras if lo is not None for t in lora_leaves(lo))]
        self.ps = nn.ParameterList([nn.Parameter(t, requires_grad=t.requires_grad) for t in ts])


def test_memory_keeps_only_x():
    # A Llama-shaped LoRA MLP (frozen base, LoRA on gate, up and down): the fused op saves x
    # alone (bytes of the saved storages that are not parameters); stock autograd saves the
    # gate's pre-activation, f(g), u, h, the three LoRA inputs' rank-wide A-outputs and more.
    M, H, I = 64, 16, 48
    x, ws, bs, _ = gated_inputs((M,), H, I, H, torch.float32, bias=(False, False, False), seed=2)
    loras = lora_terms(ws, [8, 8, 8], scaling=2.0, seed=2)
    for lo in loras:
        lo.A.requires_grad_()
        lo.B.requires_grad_()
    holder = _Params(ws, bs, loras)
    x.requires_grad_()
    fused = saved_activation_bytes(holder, x, run=lambda x: gated_call("silu")(x, ws, bs, loras))
    plain = saved_activation_bytes(holder, x, run=lambda x: lora_gated_ref(x, ws, bs, "silu",
                                                                          loras))
    assert fused == M * H * 4
    assert plain >= M * H * 4 + 4 * M * I * 4 + 2 * M * 8 * 4, plain


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_memory_kept_in_bytes_with_dropout(p):
    # The exact CPU meter: beyond its output, the fused unit keeps nothing with p = 0 and the
    # generator's state with p > 0 (torch.get_rng_state(): 5,056 bytes); stock autograd keeps
    # the activations and the masks.
    from reference import kept_and_peak
    M, H, I = 64, 16, 48
    x, ws, bs, gy = gated_inputs((M,), H, I, H, torch.float32, bias=(False, False, False), seed=3)
    loras = lora_terms(ws, [8, 8, 8], scaling=2.0, dropout=p, seed=3)
    leaves = [x.requires_grad_()] + [t.requires_grad_() for lo in loras for t in lora_leaves(lo)]
    kept, peak = kept_and_peak((("fused", lambda: gated_call("silu")(x, ws, bs, loras)),
                                ("plain", lambda: lora_gated_ref(x, ws, bs, "silu", loras))),
                               leaves, gy)
    state = torch.get_rng_state().numel() if p > 0 else 0
    assert kept["fused"] == state, kept
    assert kept["plain"] >= 4 * M * I * 4, kept


# ---- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_errors_name_expected_and_given(device, p):
    x, ws, bs, _ = mlp_inputs((5,), [6, 9, 4], torch.float32, device=device, seed=1)
    lo = lambda r, n, k, bias=None, s=2.0: LoRA(torch.randn(r, k, device=device),
                                                 torch.randn(n, r, device=device), s, bias, p)
    good = lo(3, 9, 6)
    cases = [
        (ValueError, r"lora\[1\]\.B must have shape \[4, 2\] \(out_features of weights\[1\], "
                     r"r = lora\[1\]\.A\.shape\[0\]\), got shape \[4, 3\]",
         lambda: ckpt_ext.mlp(x, ws, bs, lora=[good, good._replace(
             A=torch.randn(2, 9, device=device), B=torch.randn(4, 3, device=device))])),
        (ValueError, r"lora\[0\]\.A must have shape \[r, 6\] \(r, in_features of weights\[0\]\), "
                     r"got shape \[3, 5\]",
         lambda: ckpt_ext.mlp(x, ws, bs, lora=[lo(3, 9, 5), None])),
        (ValueError, r"lora\[0\]\.bias must have shape \[9\] \(out_features of weights\[0\]\), "
                     r"got shape \[8\]",
         lambda: ckpt_ext.mlp(x, ws, bs, lora=[lo(3, 9, 6, torch.zeros(8, device=device)), None])),
        (TypeError, r"lora\[0\]\.B must have the dtype of x \(Float\), got Double",
         lambda: ckpt_ext.mlp(x, ws, bs, lora=[good._replace(B=good.B.double()), None])),
        (ValueError, r"ckpt_ext.mlp: lora must have one entry \(a ckpt_ext.LoRA or None\) per "
                     r"layer \(2\), got 3",
         lambda: ckpt_ext.mlp(x, ws, bs, lora=[good, None, None])),
        (TypeError, r"lora\[1\] must be a ckpt_ext.LoRA or None, got tuple",
         lambda: ckpt_ext.mlp(x, ws, bs, lora=[None, (good.A, good.B, 1.0)])),
        (TypeError, r"lora must be None or a sequence .* got LoRA",
         lambda: ckpt_ext.mlp(x, ws, bs, lora=good)),
        (ValueError, r"lora\[0\]\.dropout must be a probability in \[0, 1\], got 1.5",
         lambda: ckpt_ext.mlp(x, ws, bs, lora=[good._replace(dropout=1.5), None])),
        (TypeError, r"lora\[0\]\.scaling must be a real number, got Tensor",
         lambda: ckpt_ext.mlp(x, ws, bs, lora=[good._replace(scaling=torch.tensor(2.0)), None])),
        (ValueError, r"lora\[2\] \(down\)\.B must have shape \[6, 3\]",
         lambda: ckpt_ext.gated_mlp(x, *[torch.randn(9, 6, device=device)] * 2,
                                    torch.randn(6, 9, device=device),
                                    lora=[None, None, lo(3, 5, 9)])),
        (ValueError, r"lora must have one entry \(a ckpt_ext.LoRA or None\) per weight "
                     r"\(gate_up, down: 2\), got 3",
         lambda: ckpt_ext.gated_mlp(x, torch.randn(18, 6, device=device), None,
                                    torch.randn(6, 9, device=device), lora=[None] * 3)),
    ]
    for exc, msg, call in cases:
        with pytest.raises(exc, match=msg):
            call()


# ---- CUDA (scripts/gpu_check.sh runs the `cuda`-marked tests) ------------------------------------

@pytest.mark.cuda
@requires_gpu
@pytest.mark.parametrize("base_grad", [False, True], ids=["frozen", "trainable"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("unit", ["mlp", "gated", "packed"])
def test_cuda_matches_reference(unit, dtype, base_grad, poison):
    if unit == "mlp":
        x, ws, bs, loras, gy, acts, last = mlp_case(2, dtype, "silu", 19, device="cuda")
        fused, ref, act = mlp_call(acts, last), mlp_ref(acts, last), "silu"
    else:
        x, ws, bs, loras, gy = gated_case(0 if unit == "gated" else 2, dtype, 19, device="cuda")
        fused, ref, act = gated_call("silu"), gated_ref("silu"), "silu"
    got = lora_run(fused, x, ws, bs, loras, gy, base_grad)
    want = lora_run(ref, x, ws, bs, loras, gy, base_grad, torch.float64, "cpu")
    check(got, want, act, dtype, f"cuda {unit}", stock_in(dtype, ref, x, ws, bs, loras, gy,
                                                          base_grad))


@pytest.mark.cuda
@requires_gpu
def test_cuda_dropout_redraws_masks():
    x, ws, bs, loras, gy = gated_case(0, torch.float32, 23, dropout=0.3, device="cuda")

    def run(fn):
        torch.cuda.manual_seed(5)
        ls = [t._replace(A=t.A.detach().requires_grad_()) for t in loras]
        y = fn(x, ws, bs, ls)
        after = torch.cuda.get_rng_state()
        torch.rand(100, device="cuda")
        return y, after, torch.autograd.grad(y, [t.A for t in ls], gy)

    y, after, grads = run(gated_call("silu"))
    y_ref, after_ref, grads_ref = run(gated_ref("silu"))
    assert torch.equal(y, y_ref) and torch.equal(after, after_ref)
    for g, w in zip(grads, grads_ref):
        assert torch.equal(g, w)
