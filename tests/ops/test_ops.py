"""Kernel-vs-reference tests of one tanh layer (ckpt_ext.linear_tanh: the ops
torch.ops.ckpt_ext.mlp and mlp_backward with one layer), on every device that can run them (the `device` fixture: the CPU always,
CUDA where a GPU is visible; GPU cases carry the `cuda` marker).

* forward and all three gradients against the float64 reference (tests/reference.py) over odd
  shapes, every dtype, both tanh regimes, 1..33 columns around the vector lengths, strided,
  sliced, column-major and expanded inputs, with every buffer the ops allocate poisoned;
* gradcheck in float64 (tight enough to see a bias gradient off by 1e-4), opcheck on both ops;
* the documented bias-gradient summation order, bitwise, against a Python rebuild from the op's
  own g, and bitwise reproducibility;
* the half-precision policy (float32 arithmetic, bias inside the GEMM) on deterministic
  near-cancellation cases.

Every random test takes the `seed` fixture (tests/conftest.py): its inputs are fixed per test id
and CKPT_EXT_TEST_SEED offset."""
import itertools

import pytest
import torch

import ckpt_ext
from reference import (RESULTS, ROWS_PER_CHUNK, assert_matches_reference,
                       bias_grad_chunks_left_to_right, bias_grad_documented_order, check_result,
                       conditioned_scales, linear_tanh_ref, linear_tanh_ref_grads, make_inputs,
                       measured, rel_err, requires_gpu, run_fused, tanh_layer_backward_op,
                       tanh_layer_op, tanh_layer_op_args)

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
HALF = [torch.bfloat16, torch.float16]
MASKS = [list(m) for m in itertools.product([True, False], repeat=3)]
mask_id = lambda m: "".join("1" if v else "0" for v in m)


# ------------------------------------------------------------------------------------------------
# against the float64 reference

# (leading dims, in_features, out_features): 0..3 leading dims, 0 rows, odd and vector-unfriendly
# widths (1, 3, 17), a long batch (1000), in_features 0 (y = tanh(b), as nn.Linear allows).
SHAPES = [
    ((), 17, 3),
    ((0,), 5, 7),
    ((1,), 1, 1),
    ((3,), 1, 1),
    ((3,), 17, 1000),
    ((17,), 3, 17),
    ((1000,), 17, 3),
    ((2, 3), 33, 19),
    ((2, 0, 5), 4, 6),
    ((3, 1, 17), 17, 9),
    ((4,), 0, 3),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead,k,n", SHAPES, ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_matches_float64_reference(device, poison, seed, lead, k, n, bias, dtype):
    x, w, b, gy = make_inputs(lead, k, n, dtype, device, bias, seed=seed)
    assert_matches_reference(x, w, b, gy)


# Scale 30 saturates tanh (1 − t² rounds to ~0 in float32 where float64 still has 1e-26), 1e-3
# keeps it linear (and float16 products underflow): both ends of the activation, where only the
# conditioned bound is fair.
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [1e-3, 30.0])
@pytest.mark.parametrize("lead,k,n", [((1,), 1, 1), ((2, 5), 7, 3), ((300,), 17, 9)], ids=str)
def test_saturated_and_linear_regimes(device, poison, seed, lead, k, n, scale, dtype):
    x, w, b, gy = make_inputs(lead, k, n, dtype, device, scale=scale, seed=seed)
    assert_matches_reference(x, w, b, gy)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 33, 67])
@pytest.mark.parametrize("n", range(1, 34))
def test_widths_around_vector_lengths(poison, seed, dtype, rows, n):
    # 1..33 columns: every vector length of the CPU (4/8/16 lanes), with every length of tail; odd
    # row counts leave the last 32-row chunk of the bias sum partial. (On the CPU only: CUDA's
    # 16-byte packs, the same sweep, are test_ops_cuda.py's test_widths_around_vector_packs.)
    x, w, b, gy = make_inputs((rows,), 5, n, dtype, "cpu", bias=(n % 2 == 1), seed=seed)
    assert_matches_reference(x, w, b, gy)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_sliced_and_column_major_inputs(device, poison, seed, dtype):
    x, w, b, gy = make_inputs((40,), 34, 18, dtype, device, seed=seed)
    xt = x.t().contiguous().t()[:, ::2]              # (40, 17), strides (1, 80)
    wt = w.t().contiguous().t()[:, ::2]              # (18, 17), transposed layout, sliced
    bt = torch.stack([b, b], 1)[:, 0]                # (18,), stride 2
    gyt = gy.t().contiguous().t()                    # (40, 18), column-major
    gys = torch.stack([gy, gy], 2)[..., 1]           # (40, 18), column stride 2
    assert not any(t.is_contiguous() for t in (xt, wt, bt, gyt, gys))
    assert_matches_reference(xt, wt, bt, gyt)
    assert_matches_reference(xt, wt, bt, gys)
    # leading dims that cannot be viewed as (M, K): x (4, 5, 17) sliced from (4, 10, 17)
    x3 = make_inputs((4, 10), 17, 18, dtype, device, seed=seed + 1)[0][:, ::2]
    gy3 = make_inputs((4, 5), 17, 18, dtype, device, seed=seed + 2)[3]
    assert_matches_reference(x3, wt, bt, gy3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expanded_grad_of_mean_loss(device, poison, seed, dtype):
    # out.mean() hands backward a stride-0 (expanded) grad; it must not be mis-read.
    x, w, b, _ = make_inputs((2, 31), 8, 5, dtype, device, seed=seed)
    gy = torch.full((1, 1, 1), 1.0 / (2 * 31 * 5), device=device, dtype=dtype).expand(2, 31, 5)
    assert gy.stride() == (0, 0, 0)
    assert_matches_reference(x, w, b, gy)


# ------------------------------------------------------------------------------------------------
# gradcheck, opcheck, masks

# gradcheck compares with central differences (eps 1e-6): measured max |analytical − numerical|
# 4.3e-10 over these cases and 200 seeds. atol 5e-9 (rtol 1e-7) keeps the bound ~10x above that,
# so a bias gradient off by 1e-4 (relative) fails, which gradcheck's defaults (atol 1e-5,
# rtol 1e-3) let through.
GRADCHECK_TOL = dict(atol=5e-9, rtol=1e-7)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("lead,k,n", [((), 3, 2), ((4,), 5, 3), ((2, 3), 2, 33), ((2,), 0, 3)])
def test_gradcheck_float64(device, seed, lead, k, n, bias):
    x, w, b, _ = make_inputs(lead, k, n, torch.float64, device, bias, seed=seed)
    args = tuple(t.requires_grad_() for t in (x, w, b) if t is not None)
    fn = (lambda x, w, b: ckpt_ext.linear_tanh(x, w, b)) if bias else \
         (lambda x, w: ckpt_ext.linear_tanh(x, w, None))
    assert torch.autograd.gradcheck(fn, args, **GRADCHECK_TOL)


# opcheck checks the registration (schema, fake kernel, autograd, aot dispatch), which no input
# value changes: fixed inputs, left out of the seed sweep.
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_opcheck_tanh_layer(device, bias):
    for lead, k, n in [((5,), 7, 3), ((2, 3), 4, 9), ((0,), 3, 2)]:
        x, w, b, _ = make_inputs(lead, k, n, torch.float32, device, bias, seed=0)
        torch.library.opcheck(torch.ops.ckpt_ext.mlp.default, tanh_layer_op_args(x, w, b))
        x.requires_grad_()
        w.requires_grad_()
        torch.library.opcheck(torch.ops.ckpt_ext.mlp.default, tanh_layer_op_args(x, w, b))


@pytest.mark.parametrize("mask", MASKS, ids=mask_id)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_opcheck_tanh_layer_backward(device, mask, bias):
    x, w, b, gy = make_inputs((2, 5), 7, 3, torch.float32, device, bias, seed=0)
    has = b is not None
    torch.library.opcheck(torch.ops.ckpt_ext.mlp_backward.default,
                          (gy, *tanh_layer_op_args(x, w, b), mask[0], [mask[1]],
                           [mask[2]] if has else []))


@pytest.mark.parametrize("mask", MASKS, ids=mask_id)
def test_backward_computes_only_requested_grads(device, poison, seed, mask):
    x, w, b, gy = make_inputs((37,), 6, 5, torch.float64, device, seed=seed)
    gx, gw, gb = tanh_layer_backward_op(gy, x, w, b, mask)
    _, rx, rw, rb = linear_tanh_ref_grads(x, w, b, gy)
    scales = conditioned_scales(x, w, b, gy)[1:]
    for name, want, got, ref, scale in zip(RESULTS[1:], mask, (gx, gw, gb), (rx, rw, rb), scales):
        if want:
            check_result(name, got, ref, scale)
        else:
            assert got is None, name


def test_autograd_skips_grads_not_needed(device, seed):
    x, w, b, _ = make_inputs((4,), 3, 2, torch.float32, device, seed=seed)
    w.requires_grad_()  # x and b do not need grads
    ckpt_ext.linear_tanh(x, w, b).sum().backward()
    assert x.grad is None and b.grad is None and w.grad is not None


def test_backward_recomputes_from_this_calls_inputs(device, seed):
    # Two calls of the same shape and dtype with different values: a backward that reused a
    # recomputed buffer of an earlier call (a stale cache) would return the first call's grads.
    first = make_inputs((45,), 11, 13, torch.float32, device, seed=seed)
    second = make_inputs((45,), 11, 13, torch.float32, device, seed=seed + 1)
    for x, w, b, gy in (first, second, first):
        assert_matches_reference(x, w, b, gy)


def test_output_allows_in_place_ops(device, seed):
    # The output must not be an autograd view of an internal buffer (y += residual after a block).
    x, w, b, gy = make_inputs((6, 5), 8, 7, torch.float32, device, seed=seed)
    x.requires_grad_()
    y = ckpt_ext.linear_tanh(x, w, b)
    y.mul_(2)
    y.backward(gy)
    ref = linear_tanh_ref_grads(x, w, b, 2 * gy)
    scales = conditioned_scales(x, w, b, 2 * gy)
    check_result("out", y.detach(), 2 * ref[0], 2 * scales[0])
    check_result("grad_x", x.grad, ref[1], scales[1])


def test_forward_output_shape_and_dtype_follow_input(device, seed):
    x, w, b, _ = make_inputs((2, 3, 4), 5, 6, torch.float64, device, seed=seed)
    y = ckpt_ext.linear_tanh(x, w, b)
    assert y.shape == (2, 3, 4, 6) and y.dtype == torch.float64 and y.is_contiguous()
    ref = linear_tanh_ref(x, w, b)
    check_result("out", y, ref, conditioned_scales(x, w, b, torch.ones_like(ref))[0])


# ------------------------------------------------------------------------------------------------
# the bias-gradient summation order (documented in docs/design.md, "Bias sums"), bitwise

# N = 53 columns: several vectors of every CPU width (4/8 lanes of float64, 8/16 of float32) plus
# a tail; M = 173 rows: 5 full 32-row chunks and a partial one (6 chunks, so pairwise and
# left-to-right combination differ).
ORDER_M, ORDER_N = 5 * ROWS_PER_CHUNK + 13, 53


def test_rows_per_chunk_is_the_documented_32():
    assert ckpt_ext._C.ROWS_PER_CHUNK == ROWS_PER_CHUNK == 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_bias_grad_follows_the_documented_summation_order(device, seed, dtype):
    # Read the op's own g = grad_out·(1 − tanh(z)²) exactly: with x = I (M = K rows),
    # grad_W = gᵀ·I = gᵀ, every product by 1 or 0 and every sum with zeros exact. Then rebuild the
    # bias gradient from g in the documented order in the accumulate type, one rounding per add.
    M, N = ORDER_M, ORDER_N
    _, w, b, gy = make_inputs((M,), M, N, dtype, device, seed=seed)
    x = torch.eye(M, dtype=dtype, device=device)
    _, gw, gb = tanh_layer_backward_op(gy, x, w, b, [False, True, True])
    g = gw.t().cpu()
    # g really is the gradient w.r.t. z (so the rebuild starts from the right numbers)
    t = linear_tanh_ref(x, w, b).cpu()
    # (measured at most 0.5 eps of the dtype: 5.8e-08 float32, 8.4e-17 float64)
    err = measured(f"order/{str(dtype)[6:]}/g", rel_err(g, gy.double().cpu() * (1 - t ** 2)))
    assert err <= 4 * torch.finfo(dtype).eps
    expected = bias_grad_documented_order(g, dtype)
    assert torch.equal(gb.cpu(), expected), \
        f"{(gb.cpu() != expected).sum().item()} of {N} columns differ from the documented order"
    # The check can fail: ATen's sum(0) and a left-to-right sum of the same chunks give other bits
    # on these inputs, so a kernel that summed either way would not pass the assertion above.
    assert not torch.equal(g.sum(0), expected)
    assert not torch.equal(bias_grad_chunks_left_to_right(g, dtype), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bias_grad_without_tanh_follows_the_documented_order(device, seed, dtype):
    # The other bias-gradient sum: the last layer of a stack with last_tanh=False sums grad_out
    # itself (known exactly), in the accumulate type (float32 for half types), rounded once.
    M, N = ORDER_M, ORDER_N
    x, w, b, _ = make_inputs((M,), 7, N, dtype, device, seed=seed)
    # grad_out with every bit of the dtype used (make_inputs draws in float32: in float64 those
    # values would sum exactly in any order)
    gen = torch.Generator().manual_seed(seed)
    gy = torch.randn(M, N, dtype=torch.float64, generator=gen).to(device=device, dtype=dtype)
    _, _, (gb,) = torch.ops.ckpt_ext.mlp_backward(gy, x, [w], [b], [True], "tanh", False, False,
                                                   [False], [True])
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    expected = bias_grad_documented_order(gy, acc, out_dtype=dtype)
    assert torch.equal(gb.cpu(), expected), \
        f"{(gb.cpu() != expected).sum().item()} of {N} columns differ from the documented order"
    if dtype in (torch.float32, torch.float64):  # (a half result hides the order in its rounding)
        assert not torch.equal(gy.cpu().sum(0), expected)
        assert not torch.equal(bias_grad_chunks_left_to_right(gy, acc), expected)
    else:  # but not the accumulate type: a sum in the storage type is far off
        in_storage = bias_grad_documented_order(gy, dtype)
        assert not torch.equal(in_storage, expected)


def test_bias_grad_independent_of_thread_count(seed):
    # Chunks are summed in parallel but combined in a fixed order, so the thread count cannot
    # change a bit of the result.
    x, w, b, gy = make_inputs((1000,), 16, 40, torch.float32, "cpu", seed=seed)
    mask = [False, False, True]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = tanh_layer_backward_op(gy, x, w, b, mask)[2]
        torch.set_num_threads(max(2, threads))
        many = tanh_layer_backward_op(gy, x, w, b, mask)[2]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bias_grad_is_bitwise_reproducible(device, seed, dtype):
    x, w, b, gy = make_inputs((4099,), 64, 257, dtype, device, seed=seed)  # 129 row chunks
    first = tanh_layer_backward_op(gy, x, w, b, [False, False, True])[2]
    for _ in range(3):
        tanh_layer_backward_op(gy * 3, x, w, b, [True] * 3)  # disturb the pool
        again = tanh_layer_backward_op(gy, x, w, b, [False, False, True])[2]
        assert torch.equal(first, again)
    ref = linear_tanh_ref_grads(x, w, b, gy)
    check_result("grad_bias", first, ref[3], conditioned_scales(x, w, b, gy)[3])


def test_repeated_backward_is_bitwise_identical(device, seed):
    x, w, b, gy = make_inputs((257,), 64, 96, torch.float32, device, seed=seed)
    first = run_fused(x, w, b, gy)
    for _ in range(3):
        again = run_fused(x, w, b, gy)
        for name, a, c in zip(RESULTS, first, again):
            assert torch.equal(a, c), name


# ------------------------------------------------------------------------------------------------
# the half-precision policy: float32 arithmetic, one rounding of z (bias inside the GEMM)

def _ulp_err(got, ref):
    """Elementwise |got − ref| in units of the dtype's eps·|ref| (float64, on the CPU)."""
    eps = torch.finfo(got.dtype).eps
    ref = ref.double().cpu()
    return ((got.double().cpu() - ref).abs() / (eps * ref.abs())).max().item()


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_types_round_z_once_with_the_bias_in_the_gemm(device, dtype):
    # x·Wᵀ = A + d and b = c − A, with A large: z = c + d is exact in the dtype, but A + d is not.
    # Rounded once (bias inside the GEMM, float accumulation) z is exact; rounding x·Wᵀ to the
    # dtype first and then adding b loses d (error up to half an ulp of A).
    #   columns 0..7:  A = 1,  c = 0, d = (2j + 1)·eps/8: z ~ 0, where y = tanh(z) ≈ z shows it;
    #   columns 8..15: A = 64, c = 2, d = 2·eps·(j + 1): z ~ 2, where g = 1 − t² (steep) shows it.
    eps = torch.finfo(dtype).eps
    A = torch.tensor([1.0] * 8 + [64.0] * 8, dtype=torch.float64)
    c = torch.tensor([0.0] * 8 + [2.0] * 8, dtype=torch.float64)
    d = torch.tensor([(2 * j + 1) * eps / 8 for j in range(8)] +
                     [2 * eps * (j + 1) for j in range(8)], dtype=torch.float64)
    w = torch.stack([A, d], 1)                   # (16, 2)
    x = torch.ones(1, 2, dtype=torch.float64)    # one row: grad_b is that row's g, rounded once
    b = c - A
    z = c + d
    cast = lambda t: t.to(device=device, dtype=dtype)
    assert torch.equal(cast(z).double().cpu(), z) and torch.equal(cast(w).double().cpu(), w)
    assert not torch.equal(cast(A + d).double().cpu(), A + d)  # x·Wᵀ itself is not representable
    y = ckpt_ext.linear_tanh(cast(x), cast(w), cast(b))
    gy = torch.ones(1, 16, dtype=dtype, device=device)
    _, _, gb = tanh_layer_backward_op(gy, cast(x), cast(w), cast(b),
                                                       [False, False, True])
    # One rounding of an exact z: y and g within 0.5 ulp (measured: see _ulp_err's keys). Rounding
    # z twice (simulated in float64): y off by 8.5-128 ulp (bfloat16) / 68-1024 ulp (float16) in
    # columns 0..7, g by 4.2-35 ulp / 4.3-32 ulp in columns 8..15.
    dt = str(dtype).removeprefix("torch.")
    assert measured(f"half_policy/{dt}/y_ulp", _ulp_err(y[0], torch.tanh(z))) <= 1.0
    assert measured(f"half_policy/{dt}/g_ulp", _ulp_err(gb, 1 - torch.tanh(z) ** 2)) <= 1.0


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_types_compute_the_tanh_derivative_in_float32(device, dtype):
    # g = grad_out·(1 − t²) for z on a grid in [1, 4], exact in the dtype: t ≈ 0.76..0.9993, so
    # 1 − t² cancels. In float32 then rounded once, g is within 0.5 ulp of the float64 value
    # (measured 0.39 ulp bfloat16, 0.47 float16); computed in the storage type (t, t·t, 1 − t·t
    # each rounded; simulated) it is off by up to 128 ulp (bfloat16) / 323 ulp (float16), median
    # 7. Read exactly: with x = [[1]], grad_W = gᵀ·1 = gᵀ and grad_b = g (one row).
    z = torch.linspace(1, 4, 97, dtype=torch.float64).to(dtype).double().unique()
    n = z.numel()
    x = torch.ones(1, 1, dtype=dtype, device=device)
    w = z.reshape(n, 1).to(device=device, dtype=dtype)
    b = torch.zeros(n, dtype=dtype, device=device)
    gy = torch.ones(1, n, dtype=dtype, device=device)
    _, gw, gb = tanh_layer_backward_op(gy, x, w, b, [False, True, True])
    g64 = 1 - torch.tanh(z) ** 2
    dt = str(dtype).removeprefix("torch.")
    assert measured(f"half_policy/{dt}/gw_ulp", _ulp_err(gw[:, 0], g64)) <= 1.0
    assert measured(f"half_policy/{dt}/gb_ulp", _ulp_err(gb, g64)) <= 1.0


# ------------------------------------------------------------------------------------------------
# CUDA only

@pytest.mark.cuda
@requires_gpu
def test_runs_on_the_current_stream(seed):
    # Deterministic, no sleeps: capture the ops into a CUDA graph on a side stream made current,
    # then replay on new inputs. A kernel launched on any other stream is either refused during
    # capture (the legacy default stream) or runs once at capture time and is missing from the
    # graph, so the replayed results would be stale and fail the comparison.
    x, w, b, gy = make_inputs((70,), 32, 48, torch.float32, "cuda", seed=seed)
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up outside capture, as torch.cuda.graphs asks
            tanh_layer_backward_op(gy, static_x, w, b, [True] * 3)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            y = tanh_layer_op(static_x, w, b)
            grads = tanh_layer_backward_op(gy, static_x, w, b, [True] * 3)
    torch.cuda.current_stream().wait_stream(side)
    for new_seed in (seed + 1, seed + 2):
        x_new = make_inputs((70,), 32, 48, torch.float32, "cuda", seed=new_seed)[0]
        static_x.copy_(x_new)
        graph.replay()
        torch.cuda.synchronize()
        ref = linear_tanh_ref_grads(x_new, w, b, gy)
        for name, o, r, s in zip(RESULTS, (y, *grads), ref, conditioned_scales(x_new, w, b, gy)):
            check_result(name, o, r, s)
