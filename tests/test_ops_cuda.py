"""GPU-only tests of the CUDA kernels (csrc/cuda/linear_tanh.cu), beyond the device-parametrized
suite of test_ops.py: float16/bfloat16 tolerances, a sweep of widths around the 16-byte packs,
non-contiguous inputs, the current (non-default) stream and CUDA-graph capture, bitwise
reproducibility of the bias grad, 64-bit indexing, and CPU-vs-CUDA agreement of the scalar bodies
both backends share (linear_tanh_math.h).

Two tests run on any machine: the build flag must match the kernels registered, and with
CKPT_EXT_EXPECT_CUDA=1 (set by CI, which has nvcc) the build must have compiled the CUDA kernels,
so a silent fallback to a CPU-only build fails."""
import math
import os

import pytest
import torch

import ckpt_ext
from reference import TOL, linear_tanh_ref, rel_err
from reference import linear_tanh_ref_grads as ref_grads
from test_ops import _run_fused as fused

HAS_GPU = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(
    not (HAS_GPU and ckpt_ext.WITH_CUDA),
    reason="CUDA kernels need a GPU; none visible" if not HAS_GPU
    else "ckpt_ext was built without CUDA kernels (ckpt_ext.WITH_CUDA is False)")

# TOL (reference.py): error bounds against float64, per dtype of the computation (relative, or
# scaled by the sums of magnitudes for gradients: see ref_scales).
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
ALL_GRADS = [True, True, True]


# ------------------------------------------------------------------------------------------------
# reference (plain PyTorch, float64, on the CPU)

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


def scaled_err(out, ref, scale):
    """‖out − ref‖ / ‖scale‖ in float64; inf for NaN/inf or a shape mismatch."""
    if out.shape != ref.shape:
        return math.inf
    out = out.detach().double().cpu()
    if not torch.isfinite(out).all():
        return math.inf
    denom = scale.norm().item()
    diff = (out - ref).norm().item()
    return diff if denom == 0.0 else diff / denom


def assert_matches_reference(x, w, b, gy, tol):
    got = fused(x, w, b, gy)
    ref = ref_grads(x, w, b, gy)
    for name, o, r, s in zip(("out", "grad_x", "grad_weight", "grad_bias"), got, ref,
                             ref_scales(x, w, gy, ref[0])):
        if r is None:
            assert o is None, name
            continue
        assert o.dtype == x.dtype and o.device == x.device, name
        err = scaled_err(o, r, s)
        assert err <= tol, f"{name}: error {err:.3g} > {tol:g} ({x.dtype})"


def make(lead, k, n, dtype, bias=True, device="cuda", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=g)
    w = torch.randn(n, k, generator=g) / max(k, 1) ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    gy = torch.randn(*lead, n, generator=g)
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype)
    return cast(x), cast(w), cast(b), cast(gy)


# ------------------------------------------------------------------------------------------------
# build facts (any machine)

OPS = ("linear_tanh", "linear_tanh_backward", "tanh_mlp", "tanh_mlp_backward")


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
    with pytest.raises(RuntimeError, match=r"ckpt_ext::linear_tanh: got CUDA tensors, but this "
                                           r"build of ckpt_ext has no CUDA kernels"):
        torch.ops.ckpt_ext.linear_tanh.default.redispatch(keys, x, w, None)


@pytest.mark.skipif(os.environ.get("CKPT_EXT_EXPECT_CUDA") != "1",
                    reason="CKPT_EXT_EXPECT_CUDA=1 not set: no CUDA build was requested")
def test_cuda_build_when_expected():
    assert ckpt_ext.WITH_CUDA, (
        "CKPT_EXT_EXPECT_CUDA=1 but ckpt_ext was built CPU-only; see the 'ckpt_ext setup:' lines "
        "of the build log for why")


# ------------------------------------------------------------------------------------------------
# accuracy

@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("lead,k,n", [((257,), 129, 65), ((3, 37), 256, 255), ((1,), 8, 1024),
                                      ((4099,), 64, 33)])
def test_half_types_within_dtype_tolerance(dtype, bias, lead, k, n):
    x, w, b, gy = make(lead, k, n, dtype, bias)
    assert_matches_reference(x, w, b, gy, TOL[dtype])


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 33, 67])
@pytest.mark.parametrize("n", range(1, 34))
def test_widths_around_vector_packs(dtype, rows, n):
    # 1..33 columns cover packs of 2, 4 and 8 that straddle rows, and every length of scalar tail;
    # odd row counts leave the last 32-row chunk of the backward partial.
    x, w, b, gy = make((rows,), 5, n, dtype, bias=(n % 2 == 1), seed=n)
    assert_matches_reference(x, w, b, gy, TOL[dtype])


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_noncontiguous_inputs_and_grads(dtype):
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
def test_leading_dims_and_empty():
    for lead in [(2, 3, 5), (0,), (4, 0, 2)]:
        x, w, b, gy = make(lead, 7, 9, torch.float32)
        assert_matches_reference(x, w, b, gy, TOL[torch.float32])


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_and_cuda_run_the_same_bodies(dtype):
    # Inputs on a grid of quarters, so x·Wᵀ + b is exact in every dtype and both GEMMs agree
    # exactly; what is left to differ is tanh's last bit (libm vs CUDA's) and the gradient GEMMs'
    # summation order. The index mapping of the kernels is the thing under test: a wrong row,
    # column or chunk would be off by far more than a unit in the last place.
    g = torch.Generator().manual_seed(1)
    q = lambda *s: torch.randint(-4, 5, s, generator=g).double() / 4
    x, w, b = q(2, 37, 8), q(45, 8), q(45)
    gy = q(2, 37, 45)
    cpu = [t.to(dtype) for t in (x, w, b, gy)]
    out_c = torch.ops.ckpt_ext.linear_tanh(*cpu[:3])
    grads_c = torch.ops.ckpt_ext.linear_tanh_backward(cpu[3], *cpu[:3], ALL_GRADS)
    gpu = [t.cuda() for t in cpu]
    out_g = torch.ops.ckpt_ext.linear_tanh(*gpu[:3])
    grads_g = torch.ops.ckpt_ext.linear_tanh_backward(gpu[3], *gpu[:3], ALL_GRADS)
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
        y = torch.ops.ckpt_ext.linear_tanh(xs, w, b)
        gx, gw, gb = torch.ops.ckpt_ext.linear_tanh_backward(gy, xs, w, b, ALL_GRADS)
    main.wait_stream(side)
    ry, rgx, rgw, rgb = ref_grads(x * 2, w, b, gy)
    for name, o, r in (("out", y, ry), ("grad_x", gx, rgx), ("grad_weight", gw, rgw),
                       ("grad_bias", gb, rgb)):
        assert rel_err(o, r) <= TOL[torch.float32], name


@requires_cuda
def test_captures_into_a_cuda_graph():
    # Capture fails if any launch goes to the legacy default stream; replay must recompute.
    x, w, b, gy = make((70,), 32, 48, torch.float32)
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture, as torch.cuda.graphs asks
        for _ in range(2):
            torch.ops.ckpt_ext.linear_tanh_backward(gy, static_x, w, b, ALL_GRADS)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.ckpt_ext.linear_tanh(static_x, w, b)
        grads = torch.ops.ckpt_ext.linear_tanh_backward(gy, static_x, w, b, ALL_GRADS)
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
    first = torch.ops.ckpt_ext.linear_tanh_backward(gy, x, w, b, [False, False, True])[2]
    for _ in range(3):
        torch.ops.ckpt_ext.linear_tanh_backward(gy * 3, x, w, b, ALL_GRADS)  # disturb the pool
        again = torch.ops.ckpt_ext.linear_tanh_backward(gy, x, w, b, [False, False, True])[2]
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
    gx, gw, gb = torch.ops.ckpt_ext.linear_tanh_backward(gy, x, w, b, ALL_GRADS)
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
        torch.ops.ckpt_ext.linear_tanh(x, w.cpu(), b)
    with pytest.raises(ValueError, match=r"bias must be on the device of x \(cpu\), got cuda:0"):
        torch.ops.ckpt_ext.linear_tanh(x.cpu(), w.cpu(), b)
