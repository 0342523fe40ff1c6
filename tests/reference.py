"""The suite's one plain-PyTorch reference, its input maker and its error measures.

Every kernel test (test_ops.py, test_property.py, test_modules.py; test_ops_cuda.py can) draws
inputs with make_inputs, runs the op with run_fused and compares with the float64 reference
through assert_matches_reference, so there is one formula for each.

The bound, on the float64 norm of out − ref per result (out, grad_x, grad_weight, grad_bias), is
the conditioned one: ‖out − ref‖ ≤ COND_TOL·‖s‖ + an underflow floor, where s =
conditioned_scales(...) are the magnitudes the rounding acts on. A sum that cancels (few rows,
saturated tanh, 1 − t² near 0) is only as exact as the sum of its terms' magnitudes allows, in any
implementation, so the bound holds for every shape, scale and seed (bounded by the conditioning
of the case); a wrong index or a dropped factor is still off by O(1) against it.

A relative bound ‖out − ref‖/‖ref‖ ≤ TOL cannot be held for every case: the relative error of any
implementation grows with κ = ‖s‖/‖ref‖ (the 1×1 float32 case with a saturated tanh; a bfloat16
weight gradient of 3 rows with κ = 27 is off by 6 % in stock nn.Linear too). It is measured (not
asserted) where κ ≤ 10, for docs/testing.md; TOL bounds the simpler fixed-shape comparisons.
"""
from __future__ import annotations

import math
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

# Conditioned bound, every case, per dtype of the computation: ~5x the largest scaled error
# measured over 280,000 seeded runs (pytest --seed-sweep=0:500 of test_ops, test_property,
# test_modules, test_autocast; CPU, AVX2 build): float64 1.07e-16, float32 1.09e-07, bfloat16
# 6.0e-03, float16 7.2e-04 (all four results: out, grad_x, grad_weight, grad_bias).
COND_TOL = {torch.float64: 5e-16, torch.float32: 5e-07, torch.bfloat16: 3e-02,
            torch.float16: 4e-03}

# Relative bound for fixed, well-conditioned comparisons. float64/float32: ~5x the largest
# measured in the same sweep by the comparisons that use it (FusedLinearTanh against
# nn.Sequential: float64 3.3e-16, float32 1.9e-07). bfloat16/float16: the previous bounds, used
# only by the GPU tests (test_ops_cuda.py), to be set from what a GPU run measures.
TOL = {torch.float64: 2e-15, torch.float32: 1e-06, torch.bfloat16: 1e-02, torch.float16: 2e-03}

# Relative errors are recorded (measured(), not asserted) for results with κ ≤ this.
KAPPA_MEASURE = 10

RESULTS = ("out", "grad_x", "grad_weight", "grad_bias")


def cuda_skip_reason():
    """Why GPU tests cannot run here, or None when they can."""
    import ckpt_ext
    if not torch.cuda.is_available():
        return "CUDA kernels need a GPU; none visible here"
    if not ckpt_ext.WITH_CUDA:
        return "ckpt_ext was built without CUDA kernels (ckpt_ext.WITH_CUDA is False)"
    return None


# What every GPU test carries besides the `cuda` marker (tests/conftest.py registers the marker).
requires_gpu = pytest.mark.skipif(cuda_skip_reason() is not None, reason=cuda_skip_reason() or "")

# The largest value of every measured figure in this session, by key (assert_matches_reference
# records its errors; other tests call measured() themselves). With CKPT_EXT_MEASURE=<file>,
# tests/conftest.py writes them there as JSON at the end of the run: this is how the figures in
# the comments next to the bounds were taken (pytest --seed-sweep=0:500).
MAXIMA: dict = {}


def measured(key: str, value: float) -> float:
    """Record value under key (keeping the maximum); returns it: `assert measured(k, e) <= b`."""
    if not value <= MAXIMA.get(key, -math.inf):
        MAXIMA[key] = value
    return value


# ------------------------------------------------------------------------------------------------
# reference

def linear_tanh_ref(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """tanh(x @ weight.T + bias), computed by stock PyTorch in float64."""
    return torch.tanh(F.linear(x.double(), weight.double(),
                               None if bias is None else bias.double()))


def linear_tanh_ref_grads(x, weight, bias, grad_out):
    """Output and (grad_x, grad_weight, grad_bias) of the float64 reference, computed on the CPU
    whatever the inputs' device (the CUDA tests compare against it too)."""
    xs = x.detach().double().cpu().requires_grad_()
    ws = weight.detach().double().cpu().requires_grad_()
    bs = None if bias is None else bias.detach().double().cpu().requires_grad_()
    y = linear_tanh_ref(xs, ws, bs)
    y.backward(grad_out.detach().double().cpu())
    return y.detach(), xs.grad, ws.grad, (None if bs is None else bs.grad)


# ------------------------------------------------------------------------------------------------
# inputs and the op under test

def make_inputs(lead, k, n, dtype, device="cpu", bias=True, scale=1.0, seed=0):
    """x (*lead, k) ~ N(0, scale²), weight (n, k) ~ N(0, 1/k) (so x·Wᵀ has x's scale), bias (n) ~
    N(0, 1) or None, grad_out (*lead, n) ~ N(0, 1); drawn in float32 on the CPU from `seed`, then
    cast, so every device and dtype sees the same values up to rounding."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=g) * scale
    w = torch.randn(n, k, generator=g) / max(k, 1) ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    gy = torch.randn(*lead, n, generator=g)
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype)
    return cast(x), cast(w), cast(b), cast(gy)


def run_fused(x, w, b, gy):
    """(out, grad_x, grad_weight, grad_bias) of ckpt_ext.linear_tanh through autograd."""
    import ckpt_ext
    # detach(), not clone(): a view keeps its exact strides (clone would densify a strided bias)
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    b = None if b is None else b.detach().requires_grad_()
    y = ckpt_ext.linear_tanh(x, w, b)
    y.backward(gy)
    return y.detach(), x.grad, w.grad, (None if b is None else b.grad)


def tanh_layer_op_args(x, w, b):
    """The mlp op's arguments for one tanh layer (linear_tanh's form)."""
    has = b is not None
    return (x, [w], [b] if has else [], [has], "tanh", True)


def tanh_layer_op(x, w, b):
    """linear_tanh as the op runs it: torch.ops.ckpt_ext.mlp with one tanh layer."""
    return torch.ops.ckpt_ext.mlp(*tanh_layer_op_args(x, w, b))


def tanh_layer_backward_op(gy, x, w, b, mask):
    """(grad_x, grad_weight, grad_bias) of one tanh layer from torch.ops.ckpt_ext.mlp_backward,
    each None where mask (or a missing bias) says none is made."""
    has = b is not None
    gx, gws, gbs = torch.ops.ckpt_ext.mlp_backward(gy, *tanh_layer_op_args(x, w, b), bool(mask[0]),
                                                   [bool(mask[1])], [bool(mask[2])] if has else [])
    return (gx if mask[0] else None, gws[0] if mask[1] else None,
            gbs[0] if has and mask[2] else None)


# ------------------------------------------------------------------------------------------------
# error measures

def rel_err(out: Tensor, ref: Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64, on out's device (no copy of a large GPU result); inf when
    out has a NaN/inf or the shapes differ, so a non-finite result can never pass a bound."""
    if out.shape != ref.shape:
        return math.inf
    out = out.detach().double()
    ref = ref.detach().to(out.device, torch.float64)
    if not torch.isfinite(out).all():
        return math.inf
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    if denom == 0.0:
        return diff  # an all-zero reference (e.g. 0 rows): the output must be zero too
    return diff / denom


def scaled_err(out: Tensor, ref: Tensor, scale: Tensor) -> float:
    """‖out − ref‖ / ‖scale‖ in float64 (on the CPU); inf for NaN/inf or a shape mismatch."""
    if out.shape != ref.shape:
        return math.inf
    out = out.detach().double().cpu()
    if not torch.isfinite(out).all():
        return math.inf
    denom = scale.norm().item()
    diff = (out - ref.detach().double().cpu()).norm().item()
    return diff if denom == 0.0 else diff / denom


def conditioned_scales(x, w, b, gy):
    """The magnitudes the rounding acts on, per result (out, grad_x, grad_weight, grad_bias), from
    a first-order error analysis in float64 on the CPU:
      z = x·Wᵀ + b is off by at most ~u·za, za = |x|·|W|ᵀ + |b|, and tanh is 1-Lipschitz and
      rounds with |t| ≤ 1: out scale = za + 1;
      g = gy·(1 − t²) is off by |gy|·(2|δt| + few u) ≤ ~u·|gy|·(za + 1): gs = |gy|·(za + 1);
      grad_x = g·W, grad_W = gᵀ·x, grad_b = Σ g add their own sums of magnitudes:
      gs·|W|, gsᵀ·|x| and Σ gs.
    A constant factor per dtype (COND_TOL) then bounds the error for any shape and scale."""
    n, k = w.shape
    m = math.prod(x.shape[:-1])  # not reshape(-1, k): -1 is ambiguous for k = 0
    xa = x.detach().double().abs().cpu().reshape(m, k)
    wa = w.detach().double().abs().cpu()
    ga = gy.detach().double().abs().cpu().reshape(m, n)
    za = xa @ wa.t() + (0 if b is None else b.detach().double().abs().cpu())
    gs = ga * (za + 1)
    lead = x.shape[:-1]
    return ((za + 1).reshape(*lead, n), (gs @ wa).reshape(*lead, k), gs.t() @ xa, gs.sum(0))


def underflow_floor(dtype, numel: int) -> float:
    """The norm of one unit of the smallest subnormal spacing per element, twice: the absolute
    error a product or sum that underflows may add (float16: grad_W = g·x with g ~ 1e-5 and
    x ~ 1e-3 is 1e-8, below float16's smallest subnormal 6e-8, and rounds to 0, as in
    nn.Linear). Negligible for the other dtypes."""
    fi = torch.finfo(dtype)
    return 2 * fi.smallest_normal * fi.eps * math.sqrt(numel)


def check_result(name, out, ref, scale, dtype=None):
    """One result against its float64 reference under the conditioned bound (see the module
    docstring); records the scaled error, and the relative error where κ ≤ KAPPA_MEASURE."""
    dtype = dtype or out.dtype
    dt = str(dtype).removeprefix("torch.")
    assert out.shape == ref.shape, (name, out.shape, ref.shape)
    out = out.detach().double().cpu()
    ref = ref.detach().double().cpu()
    assert torch.isfinite(out).all(), f"{name}: not finite"
    diff = (out - ref).norm().item()
    s_norm, r_norm = scale.norm().item(), ref.norm().item()
    floor = underflow_floor(dtype, ref.numel())
    bound = COND_TOL[dtype] * s_norm + floor
    if s_norm > 0:
        measured(f"scaled/{dt}/{name}", max(diff - floor, 0.0) / s_norm)
    if r_norm > 0 and s_norm <= KAPPA_MEASURE * r_norm:
        measured(f"rel_kappa10/{dt}/{name}", max(diff - floor, 0.0) / r_norm)
    assert diff <= bound, (f"{name}: ‖out − ref‖ = {diff:.3g} > {COND_TOL[dtype]:g}·‖scale‖ + "
                           f"floor = {bound:.3g} (scaled error {diff / (s_norm or 1):.3g})")


def assert_matches_reference(x, w, b, gy, got=None):
    """The op's output and grads (run_fused, or `got`) against the float64 reference, each under
    the conditioned bound (check_result), in x's dtype and on x's device."""
    got = run_fused(x, w, b, gy) if got is None else got
    ref = linear_tanh_ref_grads(x, w, b, gy)
    scales = conditioned_scales(x, w, b, gy)
    for name, o, r, s in zip(RESULTS, got, ref, scales):
        if r is None:
            assert o is None, f"{name}: expected None"
            continue
        assert o.dtype == x.dtype and o.device == x.device, (name, o.dtype, o.device)
        check_result(name, o, r, s, x.dtype)


# ------------------------------------------------------------------------------------------------
# the documented bias-gradient summation order (docs/design.md, "Bias sums"), rebuilt in Python

ROWS_PER_CHUNK = 32  # kRowsPerChunk in csrc/device_math.h (tests check it against _C)


def _chunk_sums(g: Tensor, acc_dtype) -> list:
    """Per 32-row chunk, the column sums of g with rows added in increasing order, in acc_dtype,
    one rounding per add (elementwise float adds of whole rows: each column is its own scalar
    sum)."""
    g = g.detach().cpu().to(acc_dtype)
    M, N = g.shape
    sums = []
    for start in range(0, M, ROWS_PER_CHUNK):
        part = torch.zeros(N, dtype=acc_dtype)
        for r in range(start, min(start + ROWS_PER_CHUNK, M)):
            part = part + g[r]
        sums.append(part)
    return sums


def bias_grad_documented_order(g: Tensor, acc_dtype, out_dtype=None) -> Tensor:
    """Column sums of g (M, N) in the order docs/design.md ("Bias sums") documents: rows in
    increasing order within 32-row chunks, then the chunk sums combined pairwise level by level (at each level w =
    1, 2, 4, ... the chunk at i, a multiple of 2w, adds the one at i + w if any), in acc_dtype,
    rounded to out_dtype once at the end."""
    sums = _chunk_sums(g, acc_dtype)
    out_dtype = out_dtype or acc_dtype
    if not sums:
        return torch.zeros(g.shape[1], dtype=out_dtype)
    w = 1
    while w < len(sums):
        for i in range(0, len(sums) - w, 2 * w):
            sums[i] = sums[i] + sums[i + w]
        w *= 2
    return sums[0].to(out_dtype)


def bias_grad_chunks_left_to_right(g: Tensor, acc_dtype, out_dtype=None) -> Tensor:
    """The same chunk sums, combined left to right: NOT the documented order (the tests use it to
    show that the bitwise check tells the two apart)."""
    sums = _chunk_sums(g, acc_dtype)
    total = torch.zeros(g.shape[1], dtype=acc_dtype)
    for s in sums:
        total = total + s
    return total.to(out_dtype or acc_dtype)


# ------------------------------------------------------------------------------------------------
# the mlp op: any activation

#: Stock PyTorch's form of each activation of ckpt_ext.ACTIVATIONS: the registry row's own op
#: (torch.tanh, F.gelu, ...); tests/ops/test_activation_registry.py checks each row's forms
#: against it.
def _activation_ref():
    from ckpt_ext._activations import REGISTRY
    return {name: row.f for name, row in REGISTRY.items()}


ACTIVATION_REF = _activation_ref()


def mlp_ref(x, weights, biases, activation, last_activation=True):
    """The run by stock PyTorch, in the inputs' dtype (call it with float64 tensors);
    ``activation``: one name, or one per layer with an activation."""
    h = x
    for i, (w, b) in enumerate(zip(weights, biases)):
        h = F.linear(h, w, b)
        if i + 1 < len(weights) or last_activation:
            h = ACTIVATION_REF[activation if isinstance(activation, str) else activation[i]](h)
    return h


# Relative error bound of the mlp op per dtype (every result: out, grad_x, each grad_W and grad_b)
# on random runs (x ~ N(0, 1), W ~ N(0, 1/k)): ~5x the largest measured by test_mlp.py's
# test_matches_reference over 30 seeds (pytest --seed-sweep=0:30, CKPT_EXT_MEASURE): float64
# 7.6e-15, float32 2.6e-06, bfloat16 2.1e-02, float16 3.4e-03 (every activation but relu in the
# half types).
MLP_REL_TOL = {torch.float64: 4e-14, torch.float32: 1.5e-5, torch.bfloat16: 1e-1,
               torch.float16: 1.5e-2}
# relu in bfloat16/float16: a pre-activation within the GEMM's rounding of 0 takes the other side
# of the kink, an O(1) change of that element's gradient; measured 6.6e-02 and 9.9e-02.
MLP_RELU_HALF_TOL = 0.3


def mlp_tol(activation, dtype):
    return MLP_RELU_HALF_TOL if activation == "relu" and dtype.itemsize == 2 else MLP_REL_TOL[dtype]


def mlp_inputs(lead, sizes, dtype, device="cpu", seed=0, bias=True):
    """x (*lead, sizes[0]) ~ N(0, 1), weights (sizes[i+1], sizes[i]) ~ N(0, 1/k), biases ~
    N(0, 1/4) (or None), grad_out (*lead, sizes[-1]) ~ N(0, 1); drawn in float32 on the CPU, then
    cast."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, sizes[0], generator=g)
    ws = [torch.randn(n, k, generator=g) / max(k, 1) ** 0.5 for k, n in zip(sizes, sizes[1:])]
    bs = [torch.randn(n, generator=g) * 0.5 if bias else None for n in sizes[1:]]
    gy = torch.randn(*lead, sizes[-1], generator=g)
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype)
    return cast(x), [cast(w) for w in ws], [cast(b) for b in bs], cast(gy)


def _mlp_run(fn, x, ws, bs, gy):
    """[out, grad_x, *grad_ws, *grad_bs] of fn(x, ws, bs) through autograd (None where no bias)."""
    x = x.detach().requires_grad_()
    ws = [w.detach().requires_grad_() for w in ws]
    bs = [None if b is None else b.detach().requires_grad_() for b in bs]
    out = fn(x, ws, bs)
    leaves = [x, *ws, *[b for b in bs if b is not None]]
    it = iter(torch.autograd.grad(out, leaves, gy))
    gx, *gws = [next(it) for _ in range(1 + len(ws))]
    return [out.detach(), gx, *gws, *[None if b is None else next(it) for b in bs]]


def mlp_grads(x, ws, bs, gy, activation, last_activation=True):
    """[out, grad_x, *grad_ws, *grad_bs] of ckpt_ext.mlp, on the inputs' device and dtype."""
    import ckpt_ext
    return _mlp_run(lambda x, ws, bs: ckpt_ext.mlp(x, ws, bs, activation=activation,
                                                   last_activation=last_activation), x, ws, bs, gy)


def mlp_ref_grads(x, ws, bs, gy, activation, last_activation=True):
    """The same by stock PyTorch in float64 on the CPU."""
    d = lambda t: None if t is None else t.detach().double().cpu()
    return _mlp_run(lambda x, ws, bs: mlp_ref(x, ws, bs, activation, last_activation),
                    d(x), [d(w) for w in ws], [d(b) for b in bs], d(gy))


def assert_mlp_matches_reference(got, ref, activation, dtype, what=""):
    names = ["out", "grad_x"] + [f"grad_{i}" for i in range(len(got) - 2)]
    for name, o, r in zip(names, got, ref):
        if r is None:
            assert o is None, name
            continue
        assert o.dtype == dtype, (name, o.dtype)
        e = rel_err(o.cpu(), r)
        assert e <= mlp_tol(activation, dtype), f"{activation} {dtype} {what} {name}: {e:.3g}"


def padded_rows(t, pad):
    """t (*, rows, n) as a view of a (*, rows, n + pad) buffer, same values: row stride n + pad.
    The padding holds the dtype's largest value, so a kernel that reads it as data gives results
    far off (or inf). Not NaN: oneDNN's AMX bfloat16 GEMM, behind ATen's on CPUs that have AMX,
    multiplies the padding by zero weights, which is 0 for a finite value and NaN for NaN."""
    buf = torch.full((*t.shape[:-1], t.shape[-1] + pad), torch.finfo(t.dtype).max, dtype=t.dtype,
                     device=t.device)
    out = buf[..., :t.shape[-1]]
    out.copy_(t)
    return out


def aligned_pad(n, dtype):
    """The least pad > 0 that keeps rows of n + pad elements 16-byte aligned."""
    per = 16 // dtype.itemsize
    return per - n % per if n % per else per


def check_relu_nan_gradient_is_stock_autograds(device, dtype, n):
    """relu's backward at NaN and zero pre-activations, bitwise against stock autograd's
    threshold_backward (relu(z) <= 0 ? 0 : grad: grad at NaN). x = I (M = K rows) and finite W, so
    z = Wᵀ + b exactly (one nonzero product per dot product, in every dtype and GEMM; NaN where b
    is) and grad_W = gᵀ·I = gᵀ is the kernel's own g to the bit; grad_b is its documented-order
    sum."""
    import ckpt_ext
    M = 3 * ROWS_PER_CHUNK + 5  # three full chunks and a partial one
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, M, generator=g)
    w[torch.rand(n, M, generator=g) < 0.2] = 0.0
    b = torch.zeros(n)
    b[[0, n // 2]] = float("nan")  # whole columns of NaN
    gy = torch.randn(M, n, generator=g)
    x = torch.eye(M)
    x, w, b, gy = (t.to(device=device, dtype=dtype) for t in (x, w, b, gy))
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # exact products for the identity
    try:
        xs, ws, bs = (t.detach().requires_grad_() for t in (x, w, b))
        out = ckpt_ext.mlp(xs, [ws], [bs], activation="relu")
        gw, gb = torch.autograd.grad(out, [ws, bs], gy)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    z = (w.t() + b).detach().cpu()  # the same z, exact
    assert torch.equal(out.detach().cpu().isnan(), z.isnan()) and (z == 0).any()
    zs = z.clone().requires_grad_()
    (g_stock,) = torch.autograd.grad(torch.relu(zs), zs, gy.cpu())
    assert torch.equal(gw.t().cpu(), g_stock), "relu's g differs from stock autograd's"
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert torch.equal(gb.cpu(), bias_grad_documented_order(g_stock, acc, dtype))


def kept_and_peak(runs, leaves, gy):
    """{name: bytes kept for backward beyond the output} and {name: peak of its backward above
    the start}, exact CPU meter, for each ``(name, fn)`` of ``runs`` (fn() -> the output, backward
    with ``gy``); the leaves' gradients cleared after each."""
    from ckpt_ext.memory import MemoryMeter
    kept, peak = {}, {}
    with MemoryMeter("cpu") as meter:
        for name, fn in runs:
            base = meter.current()
            y = fn()
            kept[name] = meter.current() - base - y.numel() * y.element_size()
            meter.reset_peak()
            y.backward(gy)
            peak[name] = meter.peak() - base
            del y
            for t in leaves:
                if t is not None:
                    t.grad = None
    return kept, peak


# ------------------------------------------------------------------------------------------------
# the gated_mlp op

def gated_ref(x, weights, biases, activation):
    """down(f(gate(x)) · up(x)) by stock PyTorch, in the inputs' dtype. ``weights``: [gate, up,
    down] or [gate_up, down] (the gate's rows first), ``biases`` one entry (or None) per weight."""
    f = ACTIVATION_REF[activation]
    if len(weights) == 2:
        g, u = F.linear(x, weights[0], biases[0]).chunk(2, dim=-1)
    else:
        g, u = F.linear(x, weights[0], biases[0]), F.linear(x, weights[1], biases[1])
    return F.linear(f(g) * u, weights[-1], biases[-1])


# Relative error bound of the gated_mlp op per dtype (every result), on random inputs as
# gated_inputs draws them, 2-8x the largest that test_gated_mlp.py's test_matches_reference
# measured over seeds 0-29 (--seed-sweep, CKPT_EXT_MEASURE), every activation: float64 1.3e-15,
# float32 3.3e-06, bfloat16 1.2e-01, float16 3.4e-03. The bfloat16 worst is the one-row case with
# two intermediate units, where gy·W_down nearly cancels; relu needs no wider bound here (its kink
# moves one element of dg, small against the whole gradient).
GATED_REL_TOL = {torch.float64: 1e-14, torch.float32: 1.5e-5, torch.bfloat16: 0.25,
                 torch.float16: 1.5e-2}


def gated_call(x, weights, biases, activation):
    """ckpt_ext.gated_mlp on the same lists."""
    import ckpt_ext
    if len(weights) == 2:
        return ckpt_ext.gated_mlp(x, weights[0], None, weights[1], biases[0], None, biases[1],
                                  activation)
    return ckpt_ext.gated_mlp(x, *weights, *biases, activation=activation)


def gated_grads(x, ws, bs, gy, activation):
    """[out, grad_x, *grad_ws, *grad_bs] of ckpt_ext.gated_mlp, on the inputs' device and dtype."""
    return _mlp_run(lambda x, ws, bs: gated_call(x, ws, bs, activation), x, ws, bs, gy)


def gated_ref_grads(x, ws, bs, gy, activation):
    """The same by stock PyTorch in float64 on the CPU."""
    d = lambda t: None if t is None else t.detach().double().cpu()
    return _mlp_run(lambda x, ws, bs: gated_ref(x, ws, bs, activation), d(x), [d(w) for w in ws],
                    [d(b) for b in bs], d(gy))


def gated_inputs(lead, hidden, inter, out, dtype, packed=False, bias=(True, True, True),
                 device="cpu", seed=0):
    """x (*lead, hidden) ~ N(0, 1); weights ~ N(0, 1/k) as [gate, up, down] or [gate_up, down]
    (``packed``: bias[0] then stands for both halves); biases ~ N(0, 1/4) where ``bias`` says;
    grad_out (*lead, out) ~ N(0, 1). Drawn in float32 on the CPU, then cast."""
    if packed:
        bias = (bias[0], bias[0], bias[2])
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, hidden, generator=g)
    wg, wu = (torch.randn(inter, hidden, generator=g) / max(hidden, 1) ** 0.5 for _ in range(2))
    wd = torch.randn(out, inter, generator=g) / max(inter, 1) ** 0.5
    bg, bu, bd = (torch.randn(n, generator=g) * 0.5 if b else None
                  for n, b in zip((inter, inter, out), bias))
    gy = torch.randn(*lead, out, generator=g)
    if packed:
        ws, bs = [torch.cat([wg, wu]), wd], [None if bg is None else torch.cat([bg, bu]), bd]
    else:
        ws, bs = [wg, wu, wd], [bg, bu, bd]
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype)
    return cast(x), [cast(w) for w in ws], [cast(b) for b in bs], cast(gy)


# ------------------------------------------------------------------------------------------------
# LoRA terms (ckpt_ext.LoRA on the mlp and gated_mlp ops)

def lora_linear_ref(a, weight, bias, lora):
    """peft's vanilla lora.Linear in stock PyTorch: ``result = F.linear(a, W, b)``, then
    ``result + lora_B(lora_A(dropout(a))) * scaling`` (F.dropout as nn.Dropout draws it);
    ``lora`` a ckpt_ext.LoRA or None."""
    z = F.linear(a, weight, bias)
    if lora is None:
        return z
    d = F.dropout(a, lora.dropout, True) if lora.dropout > 0 else a
    return z + F.linear(F.linear(d, lora.A), lora.B, lora.bias) * lora.scaling


def lora_mlp_ref(x, weights, biases, activation, last_activation, loras):
    """mlp_ref with a LoRA term (or None) per layer."""
    h = x
    for i, (w, b, lora) in enumerate(zip(weights, biases, loras)):
        h = lora_linear_ref(h, w, b, lora)
        if i + 1 < len(weights) or last_activation:
            h = ACTIVATION_REF[activation if isinstance(activation, str) else activation[i]](h)
    return h


def lora_gated_ref(x, weights, biases, activation, loras):
    """gated_ref with a LoRA term (or None) per weight, computed as LlamaMLP's forward orders it
    (``down(act(gate(x)) * up(x))``: masks drawn for gate, up, down in turn)."""
    f = ACTIVATION_REF[activation]
    if len(weights) == 2:
        g, u = lora_linear_ref(x, weights[0], biases[0], loras[0]).chunk(2, dim=-1)
        h = f(g) * u
    else:
        h = f(lora_linear_ref(x, weights[0], biases[0], loras[0]))
        h = h * lora_linear_ref(x, weights[1], biases[1], loras[1])
    return lora_linear_ref(h, weights[-1], biases[-1], loras[-1])


def lora_terms(weights, ranks, bias=False, scaling=0.5, dropout=0.0, seed=0):
    """A ckpt_ext.LoRA per weight (N, K) of ``ranks`` (None: no term): A (r, K) ~ N(0, 1/K),
    B (N, r) ~ N(0, 1/r) (not peft's zero start, so the term is there to check), bias (N) ~
    N(0, 1/4) where ``bias``; drawn in float32 on the CPU, then cast to each weight's dtype and
    device."""
    import ckpt_ext
    g = torch.Generator().manual_seed(seed + 7919)
    out = []
    for w, r in zip(weights, ranks):
        if r is None:
            out.append(None)
            continue
        n, k = w.shape
        A = torch.randn(r, k, generator=g) / max(k, 1) ** 0.5
        B = torch.randn(n, r, generator=g) / max(r, 1) ** 0.5
        b = torch.randn(n, generator=g) * 0.5 if bias else None
        cast = lambda t: None if t is None else t.to(device=w.device, dtype=w.dtype)
        out.append(ckpt_ext.LoRA(cast(A), cast(B), scaling, cast(b), dropout))
    return out


def lora_leaves(lora) -> list:
    """A LoRA's tensors, in the order lora_run returns their gradients (A, B, bias)."""
    return [t for t in (lora.A, lora.B, lora.bias) if t is not None]


def lora_run(fn, x, ws, bs, loras, gy, base_grad=False, dtype=None, device=None):
    """[out, grad_x, (grad_W_i..., grad_b_i... where base_grad), then each LoRA's grad_A, grad_B,
    grad_bias] of ``fn(x, ws, bs, loras)`` through autograd, on detached copies (cast to dtype
    and device where given: the reference runs in float64 on the CPU). The base weights and
    biases are frozen (no requires_grad) unless base_grad."""
    def conv(t, grad):
        if t is None:
            return None
        return t.detach().to(device=device or t.device, dtype=dtype or t.dtype).requires_grad_(grad)

    x = conv(x, True)
    ws = [conv(w, base_grad) for w in ws]
    bs = [conv(b, base_grad) for b in bs]
    loras = [None if t is None else t._replace(A=conv(t.A, True), B=conv(t.B, True),
                                               bias=conv(t.bias, True)) for t in loras]
    out = fn(x, ws, bs, loras)
    leaves = [x] + ([*ws, *(b for b in bs if b is not None)] if base_grad else [])
    leaves += [t for lora in loras if lora is not None for t in lora_leaves(lora)]
    grads = torch.autograd.grad(out, leaves, gy.to(device=device or gy.device,
                                                   dtype=dtype or gy.dtype))
    return [out.detach(), *grads]


# the moe_experts op

def moe_ref(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, activation,
            layout, limit=None, up_offset=0.0):
    """transformers' experts by stock PyTorch, in the inputs' dtype, pair by pair as its
    batched_mm form runs them: every (token, k) pair gathers its expert's matrices, its gated MLP
    runs by bmm, is weighted and summed over k. A pair whose index is the number of experts adds
    nothing. ``layout`` as ckpt_ext.moe_experts takes it."""
    f = ACTIVATION_REF[activation]
    gated, tr = not layout.startswith("ungated"), layout.endswith("_transposed")
    H, K, E = x.shape[-1], top_k_index.shape[-1], gate_up.shape[0]
    xf = x.reshape(-1, H)
    pairs = top_k_index.reshape(-1).long()
    routed = (pairs < E).unsqueeze(1)
    e = pairs.clamp(max=E - 1)
    linear = lambda w: w[e].transpose(1, 2) if tr else w[e]  # (S, out, in) per pair
    z = torch.bmm(linear(gate_up), xf.repeat_interleave(K, 0).unsqueeze(-1)).squeeze(-1)
    if gate_up_bias is not None:
        z = z + gate_up_bias[e]
    if gated:
        g, u = (z[:, 0::2], z[:, 1::2]) if "interleaved" in layout else z.chunk(2, dim=-1)
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        h = f(g) * (u + up_offset)
    else:
        h = f(z)
    y = torch.bmm(linear(down), h.unsqueeze(-1)).squeeze(-1)
    if down_bias is not None:
        y = y + down_bias[e]
    y = torch.where(routed, y * top_k_weights.reshape(-1, 1), 0.0)
    return y.view(-1, K, y.shape[-1]).sum(1).to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


def moe_inputs(lead, hidden, inter, experts, top_k, dtype, layout="concatenated", out=None,
               bias=(True, True), device="cpu", seed=0, experts_used=None):
    """(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, grad_out) for
    ckpt_ext.moe_experts: x (*lead, hidden) ~ N(0, 1); each token's top_k distinct experts drawn
    from ``experts_used`` (default: all ``experts``), weights softmax-normalised as a router's;
    expert weights ~ N(0, 1/in) stored as ``layout`` stores them, biases ~ N(0, 1/4) where
    ``bias`` (gate_up's, down's) says; grad_out ~ N(0, 1). Drawn in float32 on the CPU, then
    cast."""
    out = hidden if out is None else out
    gated, tr = not layout.startswith("ungated"), layout.endswith("_transposed")
    width = 2 * inter if gated else inter
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, hidden, generator=g)
    used = torch.arange(experts) if experts_used is None else torch.tensor(experts_used)
    scores = torch.rand(*lead, len(used), generator=g)
    top_k_index = used[scores.topk(top_k, dim=-1).indices]
    top_k_weights = torch.randn(*lead, top_k, generator=g).softmax(-1)
    gate_up = torch.randn(experts, width, hidden, generator=g) / max(hidden, 1) ** 0.5
    down = torch.randn(experts, out, inter, generator=g) / max(inter, 1) ** 0.5
    if tr:
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    gate_up_bias = torch.randn(experts, width, generator=g) * 0.5 if bias[0] else None
    down_bias = torch.randn(experts, out, generator=g) * 0.5 if bias[1] else None
    gy = torch.randn(*lead, out, generator=g)
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype)
    return (cast(x), top_k_index.to(device), cast(top_k_weights), cast(gate_up), cast(down),
            cast(gate_up_bias), cast(down_bias), cast(gy))


def moe_run(fn, x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, gy,
            **kw):
    """[out, grad_x, grad_top_k_weights, grad_gate_up, grad_down, grad_gate_up_bias,
    grad_down_bias] of fn(...) through autograd (None where a bias is None)."""
    leaves = [t if t is None else t.detach().requires_grad_()
              for t in (x, top_k_weights, gate_up, down, gate_up_bias, down_bias)]
    x, top_k_weights, gate_up, down, gate_up_bias, down_bias = leaves
    out = fn(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, **kw)
    present = [t for t in leaves if t is not None]
    it = iter(torch.autograd.grad(out, present, gy))
    return [out.detach()] + [None if t is None else next(it) for t in leaves]


def moe_grads(*inputs, activation, layout, **kw):
    """moe_run of ckpt_ext.moe_experts, on the inputs' device and dtype."""
    import ckpt_ext
    fn = lambda x, i, w, gu, d, gub, db: ckpt_ext.moe_experts(
        x, i, w, gu, d, activation=activation, gate_up_bias=gub, down_bias=db, layout=layout, **kw)
    return moe_run(fn, *inputs)


def moe_ref_grads(*inputs, activation, layout, **kw):
    """The same by moe_ref in float64 on the CPU."""
    d = lambda t: None if t is None else (t.cpu() if not t.is_floating_point()
                                          else t.detach().double().cpu())
    fn = lambda *a: moe_ref(*a, activation, layout, **kw)
    return moe_run(fn, *(d(t) for t in inputs))
