"""Small cases that reach every path of the CUDA kernels once, for compute-sanitizer (run by
scripts/gpu_check.sh: `--tool memcheck` on all of it, `--tool racecheck` on the bias sums' combine).

    python scripts/gpu_sanitize_case.py [--only combine] [--list] [--json F] [--deadline EPOCH]

Paths, in every dtype: the forward tanh with 16-byte packs (and a scalar tail) and scalar
(misaligned buffer); the backward from z and from t, with and without the bias sums, on the pack
path (grad_out contiguous, and broadcast) and the scalar path (grad_out at a storage offset,
column-major, broadcast with a width that is not a multiple of the pack, and a misaligned acc);
bias_grad on both paths; partial last chunks; 130 and 16388 chunks, so the chunk sums take two and
three combine levels; M = 0 and N = 0; and the ops themselves: linear_tanh, tanh_mlp at depth 3
with last_tanh on and off and mixed biases (Holds::kTanhOutput, bias_grad), forward and backward;
every activation of ckpt_ext.mlp (ckpt_ext.ACTIVATIONS), first order forward and backward, at widths
1 (the scalar path) and 8 (whole packs in every dtype), with a random and a broadcast incoming
gradient, the activation after the last layer on and off; ckpt_ext.gated_mlp with silu and
gelu_tanh (every activation takes the same memory path; the tests check each one's values), both
weight layouts, at intermediate widths 1 (the scalar path) and 16 (whole packs), forward and
backward, the down weight's gradient alone too (the forward pass inside the backward);
ckpt_ext.moe_experts in every layout and ckpt_ext.gated_mlp with LoRA terms, forward and backward.

Run it with PYTORCH_NO_CUDA_MEMORY_CACHING=1: then every buffer is its own cudaMalloc and an access
one element past a buffer is caught, instead of landing inside the caching allocator's block.
Exits non-zero if a result is not finite or far from a float64 reference (a check of the run,
not a substitute for the tests). --json records each case's seconds as it ends and the wall clock
at the script's start (the sanitizer's start-up is the time before it); --deadline (seconds since
the epoch) starts no case after it, so a sanitizer run ends with its summary instead of a kill.
"""
import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

import ckpt_ext

STARTED = time.time()  # before the imports: under a sanitizer, torch's start-up is slow too

PACK = {torch.float32: 4, torch.float64: 2, torch.bfloat16: 8, torch.float16: 8}
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]  # the most used first
OPS_USED = [("ckpt_ext_kernels", "tanh_"), ("ckpt_ext_kernels", "tanh_backward_"),
            ("ckpt_ext_kernels", "bias_grad"), ("ckpt_ext", "mlp"), ("ckpt_ext", "mlp_backward"),
            ("ckpt_ext", "gated_mlp"), ("ckpt_ext", "gated_mlp_backward"),
            ("ckpt_ext", "moe_experts"), ("ckpt_ext", "lora_gated_mlp")]
TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
# two layers of mlp: twice tests/ops/test_mlp.py's REL_TOL in the half types (the check of a run,
# not the test), and its RELU_HALF_TOL for relu there (a pre-activation within the GEMM's rounding
# of 0 takes the other side of the kink)
MLP_TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 2e-1, torch.float16: 3e-2}
RELU_HALF_TOL = 0.3
DEVICE = "cuda"


def misaligned(t):
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    return out


def check(name, got, ref, tol, scale=None):
    """‖got − ref‖ / ‖scale‖ <= tol (scale = ref by default; for sums that may cancel, the sum
    of the terms' magnitudes)."""
    got = got.detach().double().cpu()
    ref = ref.detach().double().cpu()
    scale = ref if scale is None else scale.detach().double().cpu()
    if not torch.isfinite(got).all():
        raise AssertionError(f"{name}: not finite")
    err = ((got - ref).norm() / scale.norm().clamp_min(1e-30)).item()
    if err > tol:
        raise AssertionError(f"{name}: relative error {err:.2e} > {tol:g}")


def kernel_paths(dtype):
    k = torch.ops.ckpt_ext_kernels
    tol = TOL[dtype]
    g = torch.Generator().manual_seed(0)
    for M, N in ((37, PACK[dtype] * 3), (37, PACK[dtype] * 3 + 1), (1, 1), (0, 8), (5, 0)):
        z = torch.randn(M, N, generator=g).to("cuda", dtype)
        gy = torch.randn(M, N, generator=g).to("cuda", dtype)
        z64 = z.double().cpu()
        t64 = torch.tanh(z64)
        for acc0 in (z.clone(), misaligned(z)):                       # pack / scalar forward
            k.tanh_(acc0)
            check(f"tanh_ {dtype} {M}x{N}", acc0, t64, tol)
        layouts = {"contiguous": gy, "offset": misaligned(gy), "column-major": gy.t().contiguous().t()}
        if M * N:
            layouts["broadcast"] = gy[:1, :1].expand(M, N)
        for lname, grad_out in layouts.items():
            g64 = grad_out.double().cpu()
            for pre in (True, False):
                for acc_kind in ("aligned", "misaligned"):
                    src = z if pre else torch.tanh(z.float()).to(dtype)
                    acc = src.clone() if acc_kind == "aligned" else misaligned(src)
                    gb = k.tanh_backward_(acc, grad_out, pre, True)
                    t = t64 if pre else src.double().cpu()
                    ref = g64 * (1 - t ** 2)
                    if M * N:
                        check(f"tanh_backward_ {dtype} {M}x{N} {lname} pre={pre} {acc_kind}",
                              acc, ref, tol)
                        check(f"grad_b {dtype} {M}x{N} {lname}", gb, ref.sum(0), tol,
                              scale=ref.abs().sum(0))
                    acc = src.clone()
                    assert k.tanh_backward_(acc, grad_out, pre, False) is None
            if N:
                gb = k.bias_grad(grad_out)
                check(f"bias_grad {dtype} {M}x{N} {lname}", gb, g64.sum(0), tol,
                      scale=g64.abs().sum(0))


def combine_levels(dtype):
    """130 and 16388 chunks of 32 rows: the bias sums combined over two and three levels, on both
    paths."""
    k = torch.ops.ckpt_ext_kernels
    for M, N in ((32 * 129 + 5, 4), (32 * (128 * 128 + 3) + 5, 3), (32 * 129 + 5, 1)):
        gy = torch.randn(M, N, device="cuda").to(dtype)
        g64 = gy.double()
        check(f"bias_grad {dtype} {M}x{N}", k.bias_grad(gy), g64.sum(0), TOL[dtype],
              scale=g64.abs().sum(0))
        acc = torch.randn(M, N, device="cuda").to(dtype)  # z, then g
        gb = k.tanh_backward_(acc, gy, True, True)
        check(f"tanh_backward_ grad_b {dtype} {M}x{N}", gb, acc.double().sum(0), TOL[dtype],
              scale=acc.double().abs().sum(0))


def activations(dtype):
    """Every activation of ckpt_ext.mlp: two layers of width 1 or 8 on 37 rows (a partial chunk
    of the bias sums), forward and first-order backward against ckpt_ext.mlp in float64 on the CPU
    (the CPU kernels are the tests' concern); incoming gradient random, and broadcast (strides
    (0, 0), as out.mean() gives it)."""
    g = torch.Generator().manual_seed(2)
    for act in ckpt_ext.ACTIVATIONS:
        tol = RELU_HALF_TOL if act == "relu" and dtype.itemsize == 2 else MLP_TOL[dtype]
        for width in (1, 8):
            sizes = [5, width, width]
            x = torch.randn(37, sizes[0], generator=g).to(dtype)
            ws = [(torch.randn(o, i, generator=g) / i ** 0.5).to(dtype)
                  for i, o in zip(sizes, sizes[1:])]
            bs = [torch.randn(width, generator=g).to(dtype) for _ in ws]
            random = torch.randn(37, width, generator=g).to(dtype)
            # made on the device: a copy of an expanded tensor is contiguous
            grads = {"random": lambda device: random.to(device),
                     "broadcast": lambda device: torch.full((), 1 / 37, dtype=dtype,
                                                            device=device).expand(37, width)}
            for last in (True, False):
                for gname, grad_of in grads.items():
                    name = f"mlp {act} {dtype} width {width} last={last} grad {gname}"
                    leaves = [t.to(DEVICE).requires_grad_() for t in [x, *ws, *bs]]
                    y = ckpt_ext.mlp(leaves[0], leaves[1:3], leaves[3:], activation=act,
                                     last_activation=last)
                    gy = grad_of(DEVICE)
                    assert gname != "broadcast" or gy.stride() == (0, 0)
                    got = torch.autograd.grad(y, leaves, gy)
                    leaves64 = [t.double().requires_grad_() for t in [x, *ws, *bs]]
                    y64 = ckpt_ext.mlp(leaves64[0], leaves64[1:3], leaves64[3:], activation=act,
                                       last_activation=last)
                    want = torch.autograd.grad(y64, leaves64, grad_of("cpu").double())
                    check(f"{name}: out", y, y64, tol)
                    for i, (o, r) in enumerate(zip(got, want)):
                        check(f"{name}: grad {i}", o, r, tol, scale=r.abs() + r.abs().mean())


def gated(dtype):
    """ckpt_ext.gated_mlp with silu and gelu_tanh on 37 rows, hidden 5, intermediate 1 or 16, with
    [gate, up, down] and [gate_up, down] weights and biases: forward and every gradient, and the
    down weight's gradient alone, against the op in float64 on the CPU."""
    g = torch.Generator().manual_seed(5)
    for act in ("silu", "gelu_tanh"):
        for inter in (1, 16):
            x = torch.randn(37, 5, generator=g).to(dtype)
            wi = (torch.randn(2 * inter, 5, generator=g) / 5 ** 0.5).to(dtype)
            wd = (torch.randn(5, inter, generator=g) / inter ** 0.5).to(dtype)
            bi, bd = torch.randn(2 * inter, generator=g).to(dtype), torch.randn(5, generator=g).to(dtype)
            gy = torch.randn(37, 5, generator=g).to(dtype)
            for packed in (False, True):
                def call(x, wi, wd, bi, bd):
                    if packed:
                        return ckpt_ext.gated_mlp(x, wi, None, wd, bi, None, bd, act)
                    return ckpt_ext.gated_mlp(x, wi[:inter], wi[inter:], wd, bi[:inter],
                                              bi[inter:], bd, act)
                name = f"gated_mlp {act} {dtype} inter {inter} packed={packed}"
                leaves = [t.to(DEVICE).requires_grad_() for t in (x, wi, wd, bi, bd)]
                y = call(*leaves)
                got = torch.autograd.grad(y, leaves, gy.to(DEVICE))
                leaves64 = [t.double().requires_grad_() for t in (x, wi, wd, bi, bd)]
                y64 = call(*leaves64)
                want = torch.autograd.grad(y64, leaves64, gy.double())
                check(f"{name}: out", y, y64, MLP_TOL[dtype] * 2)
                for i, (o, r) in enumerate(zip(got, want)):
                    check(f"{name}: grad {i}", o, r, MLP_TOL[dtype] * 2,
                          scale=r.abs() + r.abs().mean())
                wd_only = leaves[2].detach().requires_grad_()
                (gw,) = torch.autograd.grad(call(leaves[0].detach(), leaves[1].detach(), wd_only,
                                                 leaves[3].detach(), leaves[4].detach()),
                                            wd_only, gy.to(DEVICE))
                check(f"{name}: down weight alone", gw, want[2], MLP_TOL[dtype] * 2,
                      scale=want[2].abs() + want[2].abs().mean())


def against_float64(name, call, host, gy, dtype):
    """call's output and every input's gradient on DEVICE in dtype against call in float64 on
    the CPU, from the host tensors host and the incoming gradient gy."""
    leaves = [t.to(DEVICE, dtype).requires_grad_() for t in host]
    y = call(*leaves)
    got = torch.autograd.grad(y, leaves, gy.to(DEVICE))
    leaves64 = [t.double().requires_grad_() for t in host]
    y64 = call(*leaves64)
    want = torch.autograd.grad(y64, leaves64, gy.double())
    check(f"{name}: out", y, y64, MLP_TOL[dtype] * 2, scale=y64.abs() + 1)
    for i, (o, r) in enumerate(zip(got, want)):
        check(f"{name}: grad {i}", o, r, MLP_TOL[dtype] * 2, scale=r.abs() + r.abs().mean())


def routed(dtype):
    """ckpt_ext.moe_experts in every layout (ckpt_ext.MOE_LAYOUTS, biases on and off, gpt-oss's
    clamp on the interleaved transposed one) on 23 tokens, hidden 5, intermediate 1 or 8 (the
    scalar path and whole packs), 4 experts top-2 with expert 3 given no token and one pair
    routed to no expert (index E); and ckpt_ext.gated_mlp with a LoRA term (r=3) on each weight,
    dropout 0: forward and every gradient against the same op in float64 on the CPU."""
    g = torch.Generator().manual_seed(6)
    E, H, T = 4, 5, 23
    for inter in (1, 8):
        x = torch.randn(T, H, generator=g).to(dtype)
        idx = torch.randint(0, 3, (T, 2), generator=g)
        idx[0, 1] = E
        wts = torch.rand(T, 2, generator=g).to(dtype)
        gy = torch.randn(T, H, generator=g).to(dtype)
        for layout in ckpt_ext.MOE_LAYOUTS:
            gated_rows = 1 if layout.startswith("ungated") else 2
            tr = layout.endswith("transposed")
            gu = torch.randn(E, gated_rows * inter, H, generator=g) / H ** 0.5
            dn = torch.randn(E, H, inter, generator=g) / inter ** 0.5
            if tr:
                gu, dn = gu.transpose(1, 2).contiguous(), dn.transpose(1, 2).contiguous()
            for bias in (False, True):
                bgu = torch.randn(E, gated_rows * inter, generator=g) if bias else None
                bdn = torch.randn(E, H, generator=g) if bias else None
                clamp = dict(limit=0.5, up_offset=1.0) if layout == "interleaved_transposed" else {}
                act = "quick_gelu" if clamp else "silu"
                name = f"moe_experts {layout} {dtype} inter {inter} bias={bias}"
                host = [t for t in (x, wts, gu, dn, bgu, bdn) if t is not None]

                def call(x, w, gu, dn, *b):
                    return ckpt_ext.moe_experts(x, idx.to(x.device), w, gu, dn, activation=act,
                                                gate_up_bias=b[0] if b else None,
                                                down_bias=b[1] if b else None, layout=layout,
                                                **clamp)
                against_float64(name, call, host, gy, dtype)
    x = torch.randn(T, H, generator=g).to(dtype)
    ws = [torch.randn(o, i, generator=g) / i ** 0.5 for o, i in ((8, H), (8, H), (H, 8))]
    ab = [(torch.randn(3, w.shape[1], generator=g), torch.randn(w.shape[0], 3, generator=g))
          for w in ws]
    gy = torch.randn(T, H, generator=g).to(dtype)
    host = [x] + ws + [t for pair in ab for t in pair]

    def lora_call(x, wg, wu, wd, *factors):
        terms = [ckpt_ext.LoRA(factors[2 * i], factors[2 * i + 1], 2.0) for i in range(3)]
        return ckpt_ext.gated_mlp(x, wg, wu, wd, activation="silu", lora=terms)
    against_float64(f"gated_mlp with LoRA {dtype}", lora_call, host, gy, dtype)


def derivatives(dtype):
    """The derivative pass (_C._activation_derivative, orders 0 to 3) of every activation on 37
    rows of width 9, from an aligned and a misaligned input (the pack and one-element paths),
    against the registry's float64 spelling on the CPU."""
    from ckpt_ext import _C
    from ckpt_ext._activations import REGISTRY
    g = torch.Generator().manual_seed(3)
    z = (torch.randn(37, 9, generator=g) * 4).to(dtype)
    z64 = z.double()
    layouts = (("aligned", z.to(DEVICE)), ("misaligned", misaligned(z.to(DEVICE))))
    for act in ckpt_ext.ACTIVATIONS:
        row = REGISTRY[act]
        refs = (row.f(z64), row.derivative(z64), row.d2(z64), row.d3(z64))
        for k, ref in enumerate(refs):
            for layout, src in layouts:
                got = _C._activation_derivative(src, act, k)
                check(f"derivative {act} order {k} {dtype} {layout}", got, ref, TOL[dtype],
                      scale=ref.abs() + ref.abs().mean() + 1e-30)


def terms(dtype):
    """The higher orders' terms pass (_C._activation_terms) of every activation: every order, up to
    three factors and an add, on 37 rows of width 9, aligned and misaligned, out of place and in
    place into add, against the registry's float64 spelling on the CPU."""
    from ckpt_ext import _C
    from ckpt_ext._activations import REGISTRY
    g = torch.Generator().manual_seed(4)
    z, a, b, c, add = ((torch.randn(37, 9, generator=g) * s).to(dtype) for s in (4, 1, 1, 1, 1))
    spec = ((2, (a, b)), (3, (a, b, c)), (1, (c,)), (0, ()))
    for act in ckpt_ext.ACTIVATIONS:
        row = REGISTRY[act]
        orders = (row.f, row.derivative, row.d2, row.d3)
        ref = add.double()
        for k, fs in spec:
            term = orders[k](z.double())
            for f in fs:
                term = term * f.double()
            ref = ref + term
        for layout, put in (("aligned", lambda t: t.to(DEVICE)),
                            ("misaligned", lambda t: misaligned(t.to(DEVICE)))):
            dev = [(k, [put(f) for f in fs]) for k, fs in spec]
            got = _C._activation_terms(put(z), act, dev, put(add))
            check(f"terms {act} {dtype} {layout}", got, ref, TOL[dtype], scale=ref.abs() + 1)
            acc = put(add.clone())  # a buffer of its own, written in place
            _C._activation_terms(put(z), act, dev, acc, acc)
            check(f"terms in place {act} {dtype} {layout}", acc, ref, TOL[dtype],
                  scale=ref.abs() + 1)


def ops(dtype):
    tol = TOL[dtype]
    g = torch.Generator().manual_seed(1)
    for m, kk, n in ((33, 5, 7), (65, 8, 32), (1, 3, 1)):
        for bias in (True, False):
            x = torch.randn(m, kk, generator=g).to("cuda", dtype)
            w = (torch.randn(n, kk, generator=g) / kk ** 0.5).to("cuda", dtype)
            b = torch.randn(n, generator=g).to("cuda", dtype) if bias else None
            y = ckpt_ext.linear_tanh(x, w, b)
            ref = torch.tanh(F.linear(x.double(), w.double(), None if b is None else b.double()))
            check(f"linear_tanh {dtype} {m}x{kk}->{n}", y, ref, tol)
            for gy in (torch.randn(m, n, generator=g).to("cuda", dtype),
                       torch.ones((), dtype=dtype, device="cuda").expand(m, n)):
                gx, gws, gbs = torch.ops.ckpt_ext.mlp_backward(
                    gy, x, [w], [b] if bias else [], [bias], "tanh", True, True, [True],
                    [True] if bias else [])
                for t in (gx, *gws, *gbs):
                    if not torch.isfinite(t).all():
                        raise AssertionError(f"mlp_backward (one tanh layer) {dtype}: not finite")
    sizes = [9, 16, 7, 12]
    for last_tanh in (True, False):
        x = torch.randn(41, sizes[0], generator=g).to("cuda", dtype).requires_grad_()
        ws = [(torch.randn(o, i, generator=g) / i ** 0.5).to("cuda", dtype).requires_grad_()
              for i, o in zip(sizes, sizes[1:])]
        bs = [torch.randn(sizes[1], generator=g).to("cuda", dtype).requires_grad_(), None,
              torch.randn(sizes[3], generator=g).to("cuda", dtype).requires_grad_()]
        y = ckpt_ext.tanh_mlp(x, ws, bs, last_tanh=last_tanh)
        y.mean().backward()
        for t in [y, x.grad] + [w.grad for w in ws] + [bs[0].grad, bs[2].grad]:
            if not torch.isfinite(t).all():
                raise AssertionError(f"tanh_mlp {dtype} last_tanh={last_tanh}: not finite")


def cases(only=None):
    """(name, function, dtype) of every case, in the order they run: each group in every dtype
    before the next group, the kernels' own paths first (a run stopped at its time limit has
    covered the most)."""
    groups = [combine_levels] if only == "combine" else [kernel_paths, activations, gated, routed,
                                                            derivatives, terms, ops,
                                                            combine_levels]
    return [(f"{fn.__name__} {dtype}", fn, dtype) for fn in groups for dtype in DTYPES]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["combine"], help="only the bias sums' combine (racecheck)")
    ap.add_argument("--list", action="store_true",
                    help="print the cases and exit (no GPU needed: gpu_check.sh's dry run)")
    ap.add_argument("--json", help="each case's seconds, written as it ends")
    ap.add_argument("--deadline", type=float, default=None,
                    help="start no case after this time (seconds since the epoch)")
    args = ap.parse_args(argv)
    todo = cases(args.only)
    record = {"started_epoch": round(STARTED, 1), "cases": len(todo), "seconds": {},
              "not_run": [], "activations": list(ckpt_ext.ACTIVATIONS)}

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1)

    if args.list:
        record["listed"] = True
        save()
        print("\n".join(name for name, _, _ in todo))
        missing = [f"{ns}.{op}" for ns, op in OPS_USED
                   if not hasattr(getattr(torch.ops, ns), op)] if ckpt_ext.WITH_CUDA else []
        print(f"{len(todo)} cases; ops the cases call "
              + (f"missing from this CUDA build: {missing}" if missing else "all registered"
                 if ckpt_ext.WITH_CUDA else "not checked (a CPU-only build)"))
        return 1 if missing else 0
    if not (torch.cuda.is_available() and ckpt_ext.WITH_CUDA):
        print("gpu_sanitize_case: needs a GPU and a CUDA build of ckpt_ext (cuda available: "
              f"{torch.cuda.is_available()}, WITH_CUDA: {ckpt_ext.WITH_CUDA})", file=sys.stderr)
        return 2
    record["first_case_epoch"] = round(time.time(), 1)
    t0 = time.perf_counter()
    for name, fn, dtype in todo:
        if args.deadline is not None and time.time() > args.deadline:
            record["not_run"].append(name)
            continue
        t = time.perf_counter()
        fn(dtype)
        torch.cuda.synchronize()
        record["seconds"][name] = round(time.perf_counter() - t, 2)
        save()
        print(f"sanitize case: {name} done ({time.perf_counter() - t0:.1f} s)", flush=True)
    save()
    if record["not_run"]:
        print(f"sanitize case: stopped at the deadline: {len(record['seconds'])} of {len(todo)} "
              f"cases ran; not run: {', '.join(record['not_run'])}")
    else:
        print("sanitize case: all paths ran, results finite and near float64")
    return 0


if __name__ == "__main__":
    sys.exit(main())
