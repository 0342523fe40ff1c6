"""GPU-only tests of the CUDA kernels (csrc/cuda/), beyond the device-parametrized suite of
test_ops.py. Every test here carries the `cuda` marker (`pytest -m cuda` selects them;
scripts/gpu_check.sh does) and, where it needs a GPU, skips with the reason when none is visible.

What is covered:
* accuracy against the float64 reference: the one-layer op in every dtype (half types at their
  tolerance), the stack op (ckpt_ext.tanh_mlp, ckpt_ext.FusedTanhMLP) at depths 1-4 with odd
  widths, last_tanh on and off, with and without biases; every buffer the ops allocate poisoned;
* the kernels' paths: the 16-byte-pack path and the scalar path (misaligned storage offsets of acc
  and of grad_out, strided, column-major and broadcast grad_out, widths that are not a multiple of
  the pack) must give the same bits, and the profiler must see the path the rules pick;
* the bias gradient bitwise equal to the documented summation order (docs/design.md, "Bias
  sums") rebuilt in plain torch from the kernel's own g. Through the public ops g is read exactly with x = the
  identity (M = K rows): grad_W = gᵀ·I = gᵀ, a GEMM with one nonzero per dot product, so exact;
  row counts span many 32-row chunks plus a partial one, and enough chunks for the pairwise
  combination to take two and three passes; widths span several packs plus a tail;
* every activation of ckpt_ext.ACTIVATIONS (mlp; "tanh" is tanh_mlp): bfloat16/float16 at depths
  2-3 against float64; out.mean()'s broadcast grad_out and a padded, 16-byte-aligned row stride
  of x and grad_out; relu at NaN pre-activations bitwise equal to stock autograd; the backward
  kernel's paths giving the same bits; the bias sums the backward kernel combines itself (the
  last block to finish a node of the tree) bitwise the documented order over one to three levels;
  the out-of-place forward kernel (activation_to) bitwise the in-place one;
* CPU-vs-CUDA agreement (bitwise where no tanh is involved: both follow the same order);
* the current (non-default) stream, CUDA-graph capture, bitwise reproducibility, 64-bit indexing.

Three tests run on any machine: the build flag must match the kernels registered, and with
CKPT_EXT_EXPECT_CUDA=1 (set by CI, which has nvcc) the build must have compiled the CUDA kernels,
so a silent fallback to a CPU-only build fails."""
import contextlib
import math
import os
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ckpt_ext
from reference import (ACTIVATION_REF, TOL, aligned_pad, assert_mlp_matches_reference,
                       check_relu_nan_gradient_is_stock_autograds, linear_tanh_ref, mlp_grads,
                       mlp_inputs, mlp_ref_grads, padded_rows, rel_err, run_fused, scaled_err,
                       tanh_layer_backward_op, tanh_layer_op)
from reference import linear_tanh_ref_grads as ref_grads

pytestmark = pytest.mark.cuda

HAS_GPU = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(
    not (HAS_GPU and ckpt_ext.WITH_CUDA),
    reason="CUDA kernels need a GPU; none visible" if not HAS_GPU
    else "ckpt_ext was built without CUDA kernels (ckpt_ext.WITH_CUDA is False)")

# TOL (reference.py): error bounds against float64, per dtype of the computation (relative, or
# scaled by the sums of magnitudes for gradients: see ref_scales).
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
ALL_GRADS = [True, True, True]
ROWS = ckpt_ext._C.ROWS_PER_CHUNK                 # 32 rows per chunk of the bias sums
PACK = {torch.float32: 4, torch.float64: 2, torch.bfloat16: 8, torch.float16: 8}  # 16 bytes
GROUP = 128  # chunks one node of the combine tree sums (kGroupChunks in cuda/passes.cuh): > GROUP
             # chunks take two levels


def kernels():
    """torch.ops.ckpt_ext_kernels: the raw CUDA primitives (tanh_, tanh_backward_, bias_grad,
    activation_, activation_backward_)."""
    return torch.ops.ckpt_ext_kernels


def acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------------------------------------
# references (plain PyTorch, on the CPU)

def ref_scales(x, w, gy, y):
    """The float64 reference computed on absolute values: |y|, |g|·|W|, |g|ᵀ·|x|, Σ|g|. A gradient
    that is a sum with cancellation (few rows or columns, random-sign grad_out) is only as exact as
    the sum of its terms' magnitudes allows, in any implementation; measuring the error against
    these scales keeps the per-dtype bounds meaningful for a single row or column, while a wrong
    index still shows as an error of order 1."""
    x2 = x.detach().double().cpu().reshape(-1, x.shape[-1])
    g = (gy.detach().double().cpu() * (1 - y ** 2)).reshape(x2.shape[0], w.shape[0])
    wa = w.detach().double().cpu().abs()
    return y.abs(), (g.abs() @ wa).reshape(x.shape), g.abs().t() @ x2.abs(), g.abs().sum(0)


def assert_matches_reference(x, w, b, gy, tol):
    got = run_fused(x, w, b, gy)
    ref = ref_grads(x, w, b, gy)
    for name, o, r, s in zip(("out", "grad_x", "grad_weight", "grad_bias"), got, ref,
                             ref_scales(x, w, gy, ref[0])):
        if r is None:
            assert o is None, name
            continue
        assert o.dtype == x.dtype and o.device == x.device, name
        err = scaled_err(o, r, s)
        assert err <= tol, f"{name}: error {err:.3g} > {tol:g} ({x.dtype})"


def stack_ref(x, weights, biases, last_tanh, grad_out):
    """Output, grad_x, [grad_W], [grad_b] of a Linear/Tanh stack by stock autograd in float64 on
    the CPU; biases has one entry per layer (None where absent)."""
    xs = x.detach().double().cpu().requires_grad_()
    ws = [w.detach().double().cpu().requires_grad_() for w in weights]
    bs = [None if b is None else b.detach().double().cpu().requires_grad_() for b in biases]
    h = xs
    for i, (w, b) in enumerate(zip(ws, bs)):
        h = F.linear(h, w, b)
        if i + 1 < len(ws) or last_tanh:
            h = torch.tanh(h)
    h.backward(grad_out.detach().double().cpu())
    return h.detach(), xs.grad, [w.grad for w in ws], [None if b is None else b.grad for b in bs]


def documented_column_sums(g, dtype):
    """The column sums of g (M, N) in the order docs/design.md ("Bias sums") documents, rebuilt
    in plain torch on the CPU: in the accumulate type (float64 for float64, else float32), rows in
    increasing order within chunks of 32 rows starting from zero, then the chunk sums combined
    pairwise level by level (at level w = 1, 2, 4, ..., chunk i, a multiple of 2w, adds chunk
    i + w if it exists); rounded to dtype once. CPU float adds are IEEE round-to-nearest, as the
    kernel's __fadd_rn."""
    acc = acc_dtype(dtype)
    g = g.detach().to("cpu", acc)
    M, N = g.shape
    C = -(-M // ROWS)
    if C == 0:
        return torch.zeros(N, dtype=dtype)
    # Zero rows pad the last chunk: s + 0.0 is s exactly, as s is never -0.0 (it starts at +0.0).
    rows = torch.cat([g, g.new_zeros(C * ROWS - M, N)]).view(C, ROWS, N)
    sums = g.new_zeros(C, N)
    for r in range(ROWS):
        sums = sums + rows[:, r]
    w = 1
    while w < C:
        i = torch.arange(0, C - w, 2 * w)
        sums[i] = sums[i] + sums[i + w]
        w *= 2
    return sums[0].to(dtype)


def make(lead, k, n, dtype, bias=True, device="cuda", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=g)
    w = torch.randn(n, k, generator=g) / max(k, 1) ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    gy = torch.randn(*lead, n, generator=g)
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype)
    return cast(x), cast(w), cast(b), cast(gy)


def misaligned_copy(t):
    """A contiguous copy of t whose storage offset is one element: its data pointer is not 16-byte
    aligned, so the kernels must take their scalar path."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 16 != 0 and out.is_contiguous()
    return out


def grad_out_layouts(gy):
    """grad_out (M, N) laid out every way the kernels distinguish, same values: name ->
    (tensor, pack path expected when acc is aligned and N is a multiple of the pack)."""
    M, N = gy.shape
    return {
        "contiguous": (gy.contiguous(), True),
        "offset": (misaligned_copy(gy), False),                  # storage offset 1
        "column-major": (gy.t().contiguous().t(), False),        # strides (1, M)
        "row stride N+1": (padded_rows(gy, 1), False),
        "row stride N+pad, aligned": (padded_rows(gy, aligned_pad(N, gy.dtype)), True),
    }


@contextlib.contextmanager
def exact_fp32_matmul():
    """No TF32 in float32 GEMMs: the identity trick needs exact products."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def kernel_names(fn):
    """Names of the CUDA kernels fn launches, from the profiler; skips when the profiler records
    no CUDA kernel at all (no CUPTI), rather than failing on the tool."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not names:
        pytest.skip("the profiler recorded no CUDA kernel at all (CUPTI unavailable?)")
    return names


def pack_width(names, kernel):
    """The pack width V (second template argument) of each launch of `kernel` in names."""
    return {int(m.group(1)) for n in names for m in [re.search(kernel + r"<[^,<>]+, (\d+)", n)]
            if m}


# ------------------------------------------------------------------------------------------------
# build facts (any machine)

OPS = ("mlp", "mlp_backward", "linear_tanh_backward_from_output",
       "linear_tanh_backward_from_output_backward", "moe_experts", "moe_experts_backward")


def test_every_op_has_cpu_cuda_and_meta_kernels():
    for op in OPS:
        for key in ("CPU", "CUDA", "Meta"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"ckpt_ext::{op}", key), (op, key)


@pytest.mark.skipif(ckpt_ext.WITH_CUDA, reason="a CUDA build has the real CUDA kernels")
def test_cpu_only_build_says_so_for_cuda_tensors():
    # The CUDA kernel of a CPU-only build is a stub that names the problem; reach it without a
    # GPU by redispatching CPU tensors to the CUDA key.
    x, w = torch.randn(2, 3), torch.randn(4, 3)
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    with pytest.raises(RuntimeError, match=r"ckpt_ext::mlp: got CUDA tensors, but this "
                                           r"build of ckpt_ext has no CUDA kernels"):
        torch.ops.ckpt_ext.mlp.default.redispatch(keys, x, [w], [], [False], "tanh", True)


@pytest.mark.skipif(os.environ.get("CKPT_EXT_EXPECT_CUDA") != "1",
                    reason="CKPT_EXT_EXPECT_CUDA=1 not set: no CUDA build was requested")
def test_cuda_build_when_expected():
    assert ckpt_ext.WITH_CUDA, (
        "CKPT_EXT_EXPECT_CUDA=1 but ckpt_ext was built CPU-only; see the 'ckpt_ext setup:' lines "
        "of the build log for why")
    for op in ("tanh_", "tanh_backward_", "bias_grad", "activation_", "activation_backward_"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"ckpt_ext_kernels::{op}", "CUDA")


# ------------------------------------------------------------------------------------------------
# accuracy: one layer

@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("lead,k,n", [((257,), 129, 65), ((3, 37), 256, 255), ((1,), 8, 1024),
                                      ((4099,), 64, 33)])
def test_half_types_within_dtype_tolerance(poison, dtype, bias, lead, k, n):
    x, w, b, gy = make(lead, k, n, dtype, bias)
    assert_matches_reference(x, w, b, gy, TOL[dtype])


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 33, 67])
@pytest.mark.parametrize("n", range(1, 34))
def test_widths_around_vector_packs(poison, dtype, rows, n):
    # 1..33 columns: multiples of the 2-, 4- and 8-wide packs take the pack path, the others the
    # scalar path; odd row counts leave a partial last 32-row chunk.
    x, w, b, gy = make((rows,), 5, n, dtype, bias=(n % 2 == 1), seed=n)
    assert_matches_reference(x, w, b, gy, TOL[dtype])


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_noncontiguous_inputs_and_grads(poison, dtype):
    x, w, b, gy = make((40,), 34, 18, dtype)
    xt = x.t().contiguous().t()[:, ::2]              # (40, 17), strides (1, 80)
    wt = w.t().contiguous().t()[:, ::2]              # (18, 17), transposed layout
    bt = torch.stack([b, b], 1)[:, 0]                # (18,), stride 2
    gyt = gy.t().contiguous().t()                    # (40, 18), column-major
    assert not (xt.is_contiguous() or wt.is_contiguous() or bt.is_contiguous()
                or gyt.is_contiguous())
    assert_matches_reference(xt, wt, bt, gyt, TOL[dtype])
    # the grad of out.mean(): an expanded, stride-(0, 0) grad_out
    gy0 = torch.full((), 1 / gy.numel(), dtype=dtype, device="cuda").expand_as(gy)
    assert_matches_reference(xt, wt, bt, gy0, TOL[dtype])


@requires_cuda
def test_leading_dims_and_empty(poison):
    for lead in [(2, 3, 5), (0,), (4, 0, 2)]:
        x, w, b, gy = make(lead, 7, 9, torch.float32)
        assert_matches_reference(x, w, b, gy, TOL[torch.float32])


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_and_cuda_agree(dtype):
    # Inputs on a grid of quarters, so x·Wᵀ + b is exact in every dtype and both GEMMs agree
    # exactly; what is left to differ is tanh's last bit (libm vs CUDA's; tanh.approx for
    # bfloat16) and the gradient GEMMs' summation order. A wrong row, column or chunk in a kernel
    # would be off by far more than a unit in the last place.
    g = torch.Generator().manual_seed(1)
    q = lambda *s: torch.randint(-4, 5, s, generator=g).double() / 4
    x, w, b = q(2, 37, 8), q(45, 8), q(45)
    gy = q(2, 37, 45)
    cpu = [t.to(dtype) for t in (x, w, b, gy)]
    out_c = tanh_layer_op(*cpu[:3])
    grads_c = tanh_layer_backward_op(cpu[3], *cpu[:3], ALL_GRADS)
    gpu = [t.cuda() for t in cpu]
    out_g = tanh_layer_op(*gpu[:3])
    grads_g = tanh_layer_backward_op(gpu[3], *gpu[:3], ALL_GRADS)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out_g.cpu(), out_c, rtol=4 * eps, atol=4 * eps)
    # The grads are sums of a few dozen terms: bound the difference by the largest magnitude.
    for name, c, d in zip(("grad_x", "grad_weight", "grad_bias"), grads_c, grads_g):
        diff = (d.cpu().double() - c.double()).abs().max().item()
        assert diff <= 16 * eps * c.double().abs().max().item(), f"{name}: max difference {diff}"


@requires_cuda
def test_output_allows_in_place_ops():
    # The output must not be an autograd view of an internal buffer (y += residual after a block).
    x, w, b, gy = make((6, 5), 8, 7, torch.float32)
    x.requires_grad_()
    y = ckpt_ext.linear_tanh(x, w, b)
    y.mul_(2)
    y.backward(gy)
    ref = ref_grads(x, w, b, 2 * gy)
    assert rel_err(y.detach(), 2 * ref[0]) <= TOL[torch.float32]
    assert rel_err(x.grad, ref[1]) <= TOL[torch.float32]


# ------------------------------------------------------------------------------------------------
# accuracy: the stack op (tanh_mlp), whose backward runs Holds::kTanhOutput on every layer but the
# top one, and bias_grad on the top layer without tanh

STACK_WIDTHS = [37, 33, 17, 65, 9]  # in_features, then out_features per layer: odd, unaligned


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
@pytest.mark.parametrize("last_tanh", [True, False], ids=["last_tanh", "no_last_tanh"])
@pytest.mark.parametrize("bias", ["all", "none", "some"])
def test_stack_matches_float64_reference(poison, dtype, depth, last_tanh, bias):
    gen = torch.Generator().manual_seed(depth * 10 + last_tanh)
    sizes = STACK_WIDTHS[:depth + 1]
    # 3·43 = 129 rows: four full 32-row chunks and a partial one
    x = torch.randn(3, 43, sizes[0], generator=gen)
    weights = [torch.randn(n, k, generator=gen) / k ** 0.5 for k, n in zip(sizes, sizes[1:])]
    has = {"all": [True] * depth, "none": [False] * depth,
           "some": [i % 2 == 0 for i in range(depth)]}[bias]
    biases = [torch.randn(n, generator=gen) if h else None for n, h in zip(sizes[1:], has)]
    gy = torch.randn(3, 43, sizes[-1], generator=gen)
    ref = stack_ref(x, weights, biases, last_tanh, gy)

    cast = lambda t: None if t is None else t.to("cuda", dtype).requires_grad_()
    xc, wc, bc = cast(x), [cast(w) for w in weights], [cast(b) for b in biases]
    y = ckpt_ext.tanh_mlp(xc, wc, bc, last_tanh=last_tanh)
    y.backward(gy.to("cuda", dtype))
    tol = TOL[dtype]
    assert rel_err(y, ref[0]) <= tol, "out"
    assert rel_err(xc.grad, ref[1]) <= tol, "grad_x"
    for i in range(depth):
        assert rel_err(wc[i].grad, ref[2][i]) <= tol, f"grad of weights[{i}]"
        if has[i]:
            assert rel_err(bc[i].grad, ref[3][i]) <= tol, f"grad of biases[{i}]"


@requires_cuda
@pytest.mark.parametrize("last_tanh", [True, False], ids=["last_tanh", "no_last_tanh"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_fused_tanh_mlp_module_matches_sequential(poison, last_tanh, bias):
    torch.manual_seed(3)
    sizes = [19, 40, 33, 8]
    fused = ckpt_ext.FusedTanhMLP(sizes, bias=bias, last_tanh=last_tanh, device="cuda",
                                  dtype=torch.float32)
    layers = []
    for i, (k, n) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(k, n, bias=bias, dtype=torch.float64))
        if i + 2 < len(sizes) or last_tanh:
            layers.append(nn.Tanh())
    seq = nn.Sequential(*layers)
    seq.load_state_dict({k: v.double().cpu() for k, v in fused.state_dict().items()})
    x = torch.randn(5, 67, sizes[0])
    xs = x.double().requires_grad_()
    xc = x.clone().cuda().requires_grad_()
    gy = torch.randn(5, 67, sizes[-1])
    y = fused(xc)
    y.backward(gy.cuda())
    ys = seq(xs)
    ys.backward(gy.double())
    tol = TOL[torch.float32]
    assert rel_err(y, ys) <= tol
    assert rel_err(xc.grad, xs.grad) <= tol
    ref_params = dict(seq.named_parameters())
    for name, p in fused.named_parameters():
        assert rel_err(p.grad, ref_params[name].grad) <= tol, name


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stack_top_bias_grad_cpu_and_cuda_bitwise(dtype):
    # Without last_tanh the top layer's bias gradient is the column sums of grad_out alone
    # (bias_grad): no tanh, so CPU and CUDA, following the same order, give the same bits; and
    # both equal the documented order rebuilt here. 9617 rows: 301 chunks, two combine passes.
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9617, 6, generator=gen).to(dtype)
    weights = [(torch.randn(10, 6, generator=gen) / 3).to(dtype),
               (torch.randn(13, 10, generator=gen) / 3).to(dtype)]
    biases = [torch.randn(10, generator=gen).to(dtype), torch.randn(13, generator=gen).to(dtype)]
    gy = torch.randn(9617, 13, generator=gen).to(dtype)
    got = {}
    for dev in ("cpu", "cuda"):
        args = [t.to(dev) for t in (gy, x)]
        _, _, gb = torch.ops.ckpt_ext.mlp_backward(
            args[0], args[1], [w.to(dev) for w in weights], [b.to(dev) for b in biases],
            [True, True], "tanh", False, False, [False, False], [False, True])
        got[dev] = gb[0].cpu()
    ref = documented_column_sums(gy, dtype)
    assert torch.equal(got["cuda"], ref)
    assert torch.equal(got["cpu"], got["cuda"])


# ------------------------------------------------------------------------------------------------
# the kernels' paths (torch.ops.ckpt_ext_kernels): pack and scalar paths give the same bits, and
# the rules pick the path they say

@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("extra", [0, 3])
def test_tanh_pack_and_scalar_paths_give_the_same_bits(dtype, extra):
    # numel = 97·(pack·5 + extra): with extra = 3 a scalar tail after the last whole pack
    n = PACK[dtype] * 5 + extra
    z = (torch.randn(97, n, generator=torch.Generator().manual_seed(n)) * 3).to("cuda", dtype)
    t_pack = z.clone()
    kernels().tanh_(t_pack)
    t_scalar = misaligned_copy(z)
    kernels().tanh_(t_scalar)
    assert torch.equal(t_pack, t_scalar)
    assert rel_err(t_pack, torch.tanh(z.double().cpu())) <= TOL[dtype]
    names = kernel_names(lambda: kernels().tanh_(z.clone()))
    assert pack_width(names, "activation_kernel") == {PACK[dtype]}
    names = kernel_names(lambda: kernels().tanh_(misaligned_copy(z)))
    assert pack_width(names, "activation_kernel") == {1}


@requires_cuda
def test_bfloat16_tanh_is_the_correctly_rounded_value_or_its_neighbour():
    # bfloat16 uses tanh.approx.f32, whose error bound (about 2^-11 relative) is below half a
    # bfloat16 ulp: the rounded result must then be one of the two bfloat16 values around the true
    # tanh, as the correctly rounded one is. Every normal bfloat16 value and ±0 (subnormal inputs
    # are left out: the bound is not documented for them).
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    keep = torch.isfinite(x) & ((x.float().abs() >= torch.finfo(torch.bfloat16).tiny) | (x == 0))
    x = x[keep]
    ref = torch.tanh(x.double()).to(torch.bfloat16)
    t = x.reshape(1, -1).to("cuda", copy=True)
    kernels().tanh_(t)
    # tanh keeps the sign, so the distance in bit patterns is the distance in ulps
    ulps = (t.cpu().reshape(-1).view(torch.int16).int() - ref.view(torch.int16).int()).abs()
    assert ulps.max().item() <= 1, f"{int((ulps > 1).sum())} values off by more than one ulp"


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("holds", ["z", "t"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_backward_pack_and_scalar_paths_give_the_same_bits(poison, dtype, holds, bias):
    # (M, N) = (32·4 + 5, 5 packs): four full chunks, a partial one; N a multiple of the pack, so
    # only the layouts decide the path.
    M, N = ROWS * 4 + 5, PACK[dtype] * 5
    gen = torch.Generator().manual_seed(11)
    z = (torch.randn(M, N, generator=gen) * 2).to("cuda", dtype)
    held = z.clone()
    if holds == "t":
        kernels().tanh_(held)
    gy = torch.randn(M, N, generator=gen).to("cuda", dtype)
    pre = holds == "z"

    def run(acc, grad_out):
        acc = acc.clone() if acc.data_ptr() % 16 == 0 else misaligned_copy(acc)
        gb = kernels().tanh_backward_(acc, grad_out, pre, bias)
        return acc, gb

    g_ref, gb_ref = run(held, gy)
    # g against float64: t from z (or the stored t), g = gy·(1 − t²)
    t64 = torch.tanh(z.double().cpu()) if pre else held.double().cpu()
    g64 = gy.double().cpu() * (1 - t64 ** 2)
    assert scaled_err(g_ref, g64, gy.double().cpu()) <= TOL[dtype]
    if bias:
        assert scaled_err(gb_ref, g64.sum(0), g64.abs().sum(0)) <= TOL[dtype]
        if dtype in (torch.float32, torch.float64):  # g stored = g summed (half types round g)
            assert torch.equal(gb_ref.cpu(), documented_column_sums(g_ref, dtype))
    else:
        assert gb_ref is None

    for name, (grad_out, packed) in grad_out_layouts(gy).items():
        g, gb = run(held, grad_out)
        assert torch.equal(g, g_ref), name
        assert (gb is None) if not bias else torch.equal(gb, gb_ref), name
        want = {PACK[dtype] if packed else 1}
        got = pack_width(kernel_names(lambda: run(held, grad_out)), "activation_backward_kernel")
        assert got == want, f"{name}: pack width {got}, expected {want}"
    # acc misaligned: scalar path, same bits
    g, gb = run(misaligned_copy(held), gy)
    assert torch.equal(g, g_ref) and (gb is None or torch.equal(gb, gb_ref))
    assert pack_width(kernel_names(lambda: run(misaligned_copy(held), gy)),
                      "activation_backward_kernel") == {1}


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tail", [0, 3], ids=["packs", "packs+tail"])
def test_broadcast_grad_out_is_read_once_and_gives_the_same_bits(poison, dtype, tail):
    # out.mean() gives grad_out = one value expanded, strides (0, 0). With a tail (N not a
    # multiple of the pack) both the broadcast and the materialised grad_out take the scalar path.
    M, N = ROWS * 3 + 7, PACK[dtype] * 4 + tail
    z = torch.randn(M, N, generator=torch.Generator().manual_seed(2)).to("cuda", dtype)
    gy0 = torch.full((), 0.37, dtype=dtype, device="cuda").expand(M, N)
    assert gy0.stride() == (0, 0)
    g_b = z.clone()
    gb_b = kernels().tanh_backward_(g_b, gy0, True, True)
    g_d = z.clone()
    gb_d = kernels().tanh_backward_(g_d, gy0.contiguous(), True, True)
    assert torch.equal(g_b, g_d) and torch.equal(gb_b, gb_d)
    names = kernel_names(lambda: kernels().tanh_backward_(z.clone(), gy0, True, True))
    assert pack_width(names, "activation_backward_kernel") == {1 if tail else PACK[dtype]}
    reads = {m.group(1) for n in names for m in [re.search(r"GradRead\)(\d)", n)] if m}
    assert reads in (set(), {"0"}), f"broadcast grad_out read as {reads}, expected kBroadcast (0)"


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bias_grad_kernel_is_the_documented_order(poison, dtype):
    # Column sums of grad_out: bitwise the documented order in every dtype, on every layout.
    # 9617 rows = 300 full chunks + 17 rows: 301 chunks, two combine passes.
    M = ROWS * 300 + 17
    for N in (PACK[dtype] * 3, PACK[dtype] * 3 + 1):
        gy = torch.randn(M, N, generator=torch.Generator().manual_seed(N)).to("cuda", dtype)
        ref = documented_column_sums(gy, dtype)
        for name, (grad_out, _) in grad_out_layouts(gy).items():
            assert torch.equal(kernels().bias_grad(grad_out).cpu(), ref), (N, name)
        gy0 = gy[:1, :1].expand(M, N)
        assert torch.equal(kernels().bias_grad(gy0).cpu(),
                           documented_column_sums(gy0, dtype)), (N, "broadcast")


@requires_cuda
@pytest.mark.parametrize("N", [3, 8, 37])
def test_many_chunks_small_width_three_combine_passes(poison, N):
    # 16388 chunks of 32 rows for a narrow layer: the chunk sums take three combine passes
    # (16388 -> 129 -> 2 -> 1); bitwise the documented order, in the backward and in bias_grad.
    M = ROWS * (GROUP * GROUP + 3) + 5
    gen = torch.Generator().manual_seed(N)
    gy = torch.randn(M, N, generator=gen).cuda()
    assert torch.equal(kernels().bias_grad(gy).cpu(), documented_column_sums(gy, torch.float32))
    acc = torch.randn(M, N, generator=gen).cuda()
    gb = kernels().tanh_backward_(acc, gy, True, True)  # acc: z -> g
    assert torch.equal(gb.cpu(), documented_column_sums(acc, torch.float32))


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_pre_activation_and_tanh_output_passes_agree(dtype):
    # The backward from z computes t with the forward kernel's tanh: same g, same bits, as the
    # backward from t = tanh_(z).
    z = (torch.randn(ROWS * 2 + 9, 24, generator=torch.Generator().manual_seed(4)) * 2).to(
        "cuda", dtype)
    gy = torch.randn_like(z)
    g_from_z = z.clone()
    gb_z = kernels().tanh_backward_(g_from_z, gy, True, True)
    g_from_t = z.clone()
    kernels().tanh_(g_from_t)
    gb_t = kernels().tanh_backward_(g_from_t, gy, False, True)
    assert torch.equal(g_from_z, g_from_t) and torch.equal(gb_z, gb_t)


@requires_cuda
def test_kernel_ops_reject_bad_input():
    acc = torch.zeros(4, 6, device="cuda")
    with pytest.raises(ValueError, match=r"acc must be a 2-D contiguous CUDA tensor"):
        kernels().tanh_(acc.t())
    with pytest.raises(ValueError, match=r"grad_out must have acc's shape"):
        kernels().tanh_backward_(acc, torch.zeros(4, 5, device="cuda"), True, True)
    with pytest.raises(TypeError, match=r"grad_out must have acc's dtype"):
        kernels().tanh_backward_(acc, torch.zeros(4, 6, device="cuda", dtype=torch.float64),
                                 True, True)
    with pytest.raises(ValueError, match=r"grad_out must not share acc's storage"):
        kernels().tanh_backward_(acc, acc, True, True)


# ------------------------------------------------------------------------------------------------
# the bias gradient through the public ops, read exactly with x = identity

@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("M", [ROWS * 5 + 7, ROWS * (GROUP + 2) + 5], ids=["6chunks", "131chunks"])
@pytest.mark.parametrize("N", [37, 40], ids=["tail", "packs"])
def test_bias_grad_is_the_documented_order_of_the_kernels_g(poison, dtype, M, N):
    # x = I (M = K rows): grad_W = gᵀ·x = gᵀ exactly (one nonzero product per dot product), so
    # grad_W.t() is the kernel's own g to the bit. (float32 and float64 only: for half types the
    # kernel sums g before rounding it to the storage type, as the CPU does.)
    gen = torch.Generator().manual_seed(M + N)
    x = torch.eye(M, dtype=dtype, device="cuda")
    w1 = (torch.randn(N, M, generator=gen) * 2).to("cuda", dtype)
    b1 = torch.randn(N, generator=gen).to("cuda", dtype)
    gy = torch.randn(M, N, generator=gen).to("cuda", dtype)
    with exact_fp32_matmul():
        # one layer with tanh: Holds::kPreActivation
        _, gw, gb = tanh_layer_backward_op(gy, x, w1, b1, [False, True, True])
        assert torch.equal(gb.cpu(), documented_column_sums(gw.t(), dtype))
        # the lower layer of a stack: Holds::kTanhOutput (its g is in the buffer that held t)
        w2 = (torch.randn(23, N, generator=gen) / 4).to("cuda", dtype)
        gy2 = torch.randn(M, 23, generator=gen).to("cuda", dtype)
        _, gws, gbs = torch.ops.ckpt_ext.mlp_backward(
            gy2, x, [w1, w2], [b1], [True, False], "tanh", True, False, [True, False], [True])
        assert torch.equal(gbs[0].cpu(), documented_column_sums(gws[0].t(), dtype))


# ------------------------------------------------------------------------------------------------
# streams, graphs, determinism

@requires_cuda
def test_runs_on_the_current_stream():
    # The side stream first sleeps ~50 ms, then makes the input. A kernel launched on any other
    # stream than the current one would run before the GEMM that feeds it and give garbage.
    x, w, b, gy = make((300,), 64, 96, torch.float32)
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        xs = x * 2
        y = tanh_layer_op(xs, w, b)
        gx, gw, gb = tanh_layer_backward_op(gy, xs, w, b, ALL_GRADS)
    main.wait_stream(side)
    ry, rgx, rgw, rgb = ref_grads(x * 2, w, b, gy)
    for name, o, r in (("out", y, ry), ("grad_x", gx, rgx), ("grad_weight", gw, rgw),
                       ("grad_bias", gb, rgb)):
        assert rel_err(o, r) <= TOL[torch.float32], name


@requires_cuda
def test_captures_into_a_cuda_graph():
    # Capture fails if any launch goes to the legacy default stream; replay must recompute.
    # 4133 rows: 130 chunks, so the bias sums take two combine passes inside the graph too.
    x, w, b, gy = make((4133,), 32, 48, torch.float32)
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture, as torch.cuda.graphs asks
        for _ in range(2):
            tanh_layer_backward_op(gy, static_x, w, b, ALL_GRADS)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = tanh_layer_op(static_x, w, b)
        grads = tanh_layer_backward_op(gy, static_x, w, b, ALL_GRADS)
    x_new = torch.randn_like(x)
    static_x.copy_(x_new)
    graph.replay()
    torch.cuda.synchronize()
    ref = ref_grads(x_new, w, b, gy)
    for name, o, r in zip(("out", "grad_x", "grad_weight", "grad_bias"), (y, *grads), ref):
        assert rel_err(o, r) <= TOL[torch.float32], name


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bias_grad_is_bitwise_reproducible(dtype):
    x, w, b, gy = make((4099,), 64, 257, dtype)  # 129 row chunks
    first = tanh_layer_backward_op(gy, x, w, b, [False, False, True])[2]
    for _ in range(3):
        tanh_layer_backward_op(gy * 3, x, w, b, ALL_GRADS)  # disturb the pool
        again = tanh_layer_backward_op(gy, x, w, b, [False, False, True])[2]
        assert torch.equal(first, again)
    ref = ref_grads(x, w, b, gy)
    assert scaled_err(first, ref[3], ref_scales(x, w, gy, ref[0])[3]) <= TOL[dtype]


# ------------------------------------------------------------------------------------------------
# 64-bit indexing

@requires_cuda
def test_buffers_past_2_pow_31_elements():
    N, K = 1024, 4
    M = 2**31 // N + 33                          # the last 33 rows sit past element 2^31
    need = 3 * M * N * 4                         # out, g and the reference chunks, float32
    free = torch.cuda.mem_get_info()[0]
    if free < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory, {free / 2**30:.0f} free")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=gen)
    w = torch.randn(N, K, device="cuda", generator=gen) / 2
    b = torch.randn(N, device="cuda", generator=gen)
    y = ckpt_ext.linear_tanh(x, w, b)
    rows = 1 << 18
    for r0 in range(0, M, rows):
        ref = linear_tanh_ref(x[r0:r0 + rows], w, b)
        err = rel_err(y[r0:r0 + rows], ref)
        assert err <= TOL[torch.float32], f"rows {r0}..: {err:.3g}"
    del y
    gy = torch.ones((1, 1), device="cuda").expand(M, N)  # stride (0, 0): no 8 GiB grad_out
    gx, gw, gb = tanh_layer_backward_op(gy, x, w, b, ALL_GRADS)
    rgw = torch.zeros(N, K, dtype=torch.float64, device="cuda")
    rgb = torch.zeros(N, dtype=torch.float64, device="cuda")
    for r0 in range(0, M, rows):
        xs = x[r0:r0 + rows].double()
        g = 1 - linear_tanh_ref(xs, w, b) ** 2
        assert rel_err(gx[r0:r0 + rows], g @ w.double()) <= TOL[torch.float32], f"rows {r0}.."
        rgw += g.t() @ xs
        rgb += g.sum(0)
    # These two sum 2^21 rows in float32; rounding grows like sqrt(rows)·eps, hence 1e-4. An
    # indexing error would be off by O(1).
    assert rel_err(gw, rgw) <= 1e-4
    assert rel_err(gb, rgb) <= 1e-4


# ------------------------------------------------------------------------------------------------
# errors

@requires_cuda
def test_mixed_devices_name_both():
    x, w, b, _ = make((3,), 4, 5, torch.float32)
    with pytest.raises(ValueError, match=r"weight must be on the device of x \(cuda:0\), got cpu"):
        ckpt_ext.linear_tanh(x, w.cpu(), b)
    with pytest.raises(ValueError, match=r"bias must be on the device of x \(cpu\), got cuda:0"):
        ckpt_ext.linear_tanh(x.cpu(), w.cpu(), b)


# ------------------------------------------------------------------------------------------------
# every activation of ckpt_ext.ACTIVATIONS (mlp; "tanh" is tanh_mlp): half types at depth, the
# broadcast and padded grad_out, relu at NaN, the kernels' paths, the bias sums' combine tree and
# the out-of-place forward kernel

ACTS = list(ckpt_ext.ACTIVATIONS)


@requires_cuda
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("depth", [2, 3])
def test_half_types_mlp_and_tanh_mlp_match_float64(poison, act, dtype, depth):
    # 67 rows (two full 32-row chunks and a partial one), odd widths and one of a whole number of
    # packs; the top layer with and without its activation (bias_grad on top).
    sizes = [13, 24, 17, 9][:depth + 1]
    for last in (True, False):
        x, ws, bs, gy = mlp_inputs((67,), sizes, dtype, "cuda", seed=depth)
        assert_mlp_matches_reference(mlp_grads(x, ws, bs, gy, act, last),
                                     mlp_ref_grads(x, ws, bs, gy, act, last), act, dtype,
                                     f"depth {depth} last {last}")
    if act == "tanh":  # the named form, the same engine
        y = ckpt_ext.tanh_mlp(x, ws, bs, last_tanh=True)
        assert torch.equal(y, ckpt_ext.mlp(x, ws, bs, activation="tanh"))


@requires_cuda
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("last", [True, False], ids=["last_act", "no_last_act"])
def test_broadcast_grad_of_mean_loss_every_activation(poison, act, dtype, last):
    # out.mean(): grad_out one value at strides (0, 0), read once per thread (GradRead::kBroadcast)
    # by the top layer's backward kernel (the activation's, or bias_grad's without it). Its bias
    # gradient comes from the kernels alone: the same bits as with the materialised grad_out.
    for width in (PACK[dtype] * 2, 17):  # the pack path and the scalar path
        x, ws, bs, _ = mlp_inputs((70,), [11, 24, width], dtype, "cuda", seed=width)
        gy = torch.full((), 1 / (70 * width), dtype=dtype, device="cuda").expand(70, width)
        got = mlp_grads(x, ws, bs, gy, act, last)
        dense = mlp_grads(x, ws, bs, gy.contiguous(), act, last)
        assert torch.equal(got[-1], dense[-1]), f"width {width}: top bias gradient"
        assert_mlp_matches_reference(got, mlp_ref_grads(x, ws, bs, gy, act, last), act, dtype,
                                     f"width {width}")


@requires_cuda
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_padded_row_stride_inputs_and_grads(poison, act, dtype):
    # x and grad_out as (rows, n) views of (rows, n + pad) buffers whose rows stay 16-byte aligned:
    # grad_out takes the pack path at row stride n + pad. Same top bias gradient bits as a
    # contiguous grad_out; everything against the float64 reference.
    x, ws, bs, gy = mlp_inputs((67,), [13, 24, 16], dtype, "cuda", seed=5)
    xp = padded_rows(x, aligned_pad(13, dtype))
    gyp = padded_rows(gy, aligned_pad(16, dtype))
    assert xp.stride(0) > 13 and gyp.stride(0) > 16 and gyp.stride(0) * dtype.itemsize % 16 == 0
    for last in (True, False):
        got = mlp_grads(xp, ws, bs, gyp, act, last)
        dense = mlp_grads(x, ws, bs, gy, act, last)
        assert torch.equal(got[-1], dense[-1]), "top bias gradient: padded grad_out vs contiguous"
        assert_mlp_matches_reference(got, mlp_ref_grads(x, ws, bs, gy, act, last), act, dtype)
    z = torch.randn(67, 16, generator=torch.Generator().manual_seed(6)).to("cuda", dtype)
    names = kernel_names(lambda: kernels().activation_backward_(z.clone(), gyp, act, True))
    assert pack_width(names, "activation_backward_kernel") == {PACK[dtype]}


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [PACK[torch.bfloat16] * 2, 19], ids=["packs", "tail"])
def test_relu_nan_pre_activation_gradient_is_stock_autograds(poison, dtype, n):
    check_relu_nan_gradient_is_stock_autograds("cuda", dtype, n)


@requires_cuda
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_activation_backward_paths_give_the_same_bits(poison, act, dtype):
    # The backward kernel of every activation on every grad_out layout, acc aligned and not, the
    # broadcast grad_out: one g and one bias gradient, to the bit; g against float64 autograd; the
    # bias gradient the documented order of g (float32/float64: g stored = g summed).
    M, N = ROWS * 4 + 5, PACK[dtype] * 5
    gen = torch.Generator().manual_seed(ACTS.index(act))
    z = (torch.randn(M, N, generator=gen) * 2).to("cuda", dtype)
    gy = torch.randn(M, N, generator=gen).to("cuda", dtype)

    def run(acc, grad_out):
        acc = acc.clone() if acc.data_ptr() % 16 == 0 else misaligned_copy(acc)
        return acc, kernels().activation_backward_(acc, grad_out, act, True)

    g_ref, gb_ref = run(z, gy)
    z64 = z.double().cpu().requires_grad_()
    (g64,) = torch.autograd.grad(ACTIVATION_REF[act](z64), z64, gy.double().cpu())
    assert scaled_err(g_ref, g64, gy.double().cpu()) <= TOL[dtype]
    if dtype in (torch.float32, torch.float64):
        assert torch.equal(gb_ref.cpu(), documented_column_sums(g_ref, dtype))
    for name, (grad_out, _) in grad_out_layouts(gy).items():
        g, gb = run(z, grad_out)
        assert torch.equal(g, g_ref) and torch.equal(gb, gb_ref), name
    g, gb = run(misaligned_copy(z), gy)
    assert torch.equal(g, g_ref) and torch.equal(gb, gb_ref), "acc misaligned"
    gy0 = gy[:1, :1].expand(M, N)
    g_b, gb_b = run(z, gy0)
    g_d, gb_d = run(z, gy0.contiguous())
    assert torch.equal(g_b, g_d) and torch.equal(gb_b, gb_d), "broadcast"


@requires_cuda
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("M,N", [(ROWS * (GROUP + 3) + 5, 37), (ROWS * (GROUP + 3) + 5, 1000),
                                 (ROWS * 300 + 17, 8)],
                         ids=["132chunks-tail", "132chunks-wide", "301chunks-packs"])
def test_bias_sums_combined_in_the_kernel_are_the_documented_order(poison, act, M, N):
    # The last block to finish a group of 128 chunks (per 32 columns) combines it, and the last
    # group of a column combines the groups: the documented tree, bitwise, whichever block ends
    # last; many column tiles (N = 1000), partial ones (N = 37), every activation.
    gen = torch.Generator().manual_seed(N)
    z = torch.randn(M, N, generator=gen).cuda()
    gy = torch.randn(M, N, generator=gen).cuda()
    g = z.clone()
    gb = kernels().activation_backward_(g, gy, act, True)
    assert torch.equal(gb.cpu(), documented_column_sums(g, torch.float32))
    for _ in range(2):  # bitwise the same on reruns, whatever the blocks' order
        again = kernels().activation_backward_(z.clone(), gy, act, True)
        assert torch.equal(again, gb)
    assert torch.equal(kernels().bias_grad(gy).cpu(), documented_column_sums(gy, torch.float32))


@requires_cuda
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_activation_out_of_place_is_the_in_place_bits(act, dtype):
    # activation_to on CUDA is one pass of activation_kernel from src into dst: the same bits as
    # the in-place pass (which the forward runs), src untouched; packs only when both are aligned.
    n = PACK[dtype] * 5 + 3  # a scalar tail after the last whole pack
    z = (torch.randn(97, n, generator=torch.Generator().manual_seed(n)) * 3).to("cuda", dtype)
    z_before = z.clone()
    in_place = z.clone()
    kernels().activation_(in_place, in_place, act)
    dst = torch.empty_like(z)
    kernels().activation_(z, dst, act)
    assert torch.equal(z, z_before) and torch.equal(dst, in_place)
    z64 = z.double().cpu()
    assert scaled_err(dst, ACTIVATION_REF[act](z64), z64.abs() + 1) <= TOL[dtype]
    for src, out in ((misaligned_copy(z), torch.empty_like(z)), (z, misaligned_copy(z))):
        kernels().activation_(src, out, act)
        assert torch.equal(out, in_place)
    run = lambda s, d: lambda: kernels().activation_(s, d, act)
    assert pack_width(kernel_names(run(z, dst)), "activation_kernel") == {PACK[dtype]}
    assert pack_width(kernel_names(run(misaligned_copy(z), dst)), "activation_kernel") == {1}


@requires_cuda
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_recomputed_activation_is_the_forward_bitwise(act, dtype):
    # The backward recomputes a_1 = f(z_0) out of place (activation_to, one pass); grad_W of the
    # second layer = gᵀ·a_1 must equal the same GEMM on the forward's own a_1.
    x, ws, bs, gy = mlp_inputs((37,), [11, 24, 5], dtype, "cuda", seed=3)
    got = mlp_grads(x, ws, bs, gy, act, last_activation=False)
    a1 = ckpt_ext.mlp(x, ws[:1], bs[:1], activation=act)
    assert torch.equal(got[3], gy.t() @ a1)
