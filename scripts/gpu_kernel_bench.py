"""Achieved memory bandwidth of each elementwise CUDA kernel of ckpt_ext against a device-to-device
copy of the same bytes, per dtype and size M·N = 2^20..2^27: the primitives themselves
(torch.ops.ckpt_ext_kernels, no GEMM), tanh's and the forward and backward kernels of every
activation of ckpt_ext.ACTIVATIONS; the targets (>= 80 % of copy at M·N >= 2^24) marked met or
not. Run by scripts/gpu_check.sh; needs a GPU and a CUDA build, except --dry-run/--list. Bytes
counted per kernel and timing method: docs/cuda.md.

    python scripts/gpu_kernel_bench.py [--json out.json] [--dtypes float32,bfloat16]
                                       [--log2-sizes 20-27] [--act-log2-sizes 24,27]
                                       [--width 4096] [--samples 7] [--max-seconds S] [--dry-run]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

ROWS_PER_CHUNK = 32   # csrc/device_math.h kRowsPerChunk
GROUP_CHUNKS = 128    # csrc/cuda/passes.cuh kGroupChunks
WORKING_SET = 256 << 20
TARGET = 0.80
TARGET_FROM_LOG2 = 24
TARGET_KERNELS = ("tanh", "bwd z bcast +b", "bwd z +b", "bwd t +b", "bwd z")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


# ------------------------------------------------------------------------------------------------
# bytes moved (no GPU needed)

def sums_bytes(M: int, N: int, itemsize: int, acc_size: int) -> int:
    """Bytes of the bias sums: chunk partials written, then each combine pass reads its input and
    writes its output (group sums, or grad_b in the storage type on the last pass)."""
    n = -(-M // ROWS_PER_CHUNK)
    if n == 0:
        return N * itemsize
    total = n * N * acc_size                     # the backward kernel writes the partials
    while n > GROUP_CHUNKS:
        n_out = -(-n // GROUP_CHUNKS)
        total += n * N * acc_size + n_out * N * acc_size
        n = n_out
    return total + n * N * acc_size + N * itemsize


def kernel_bytes(name: str, M: int, N: int, itemsize: int, acc_size: int) -> int:
    E = M * N * itemsize
    s = sums_bytes(M, N, itemsize, acc_size)
    return {
        "tanh": 2 * E,
        "bwd z bcast +b": 2 * E + s,
        "bwd z +b": 3 * E + s,
        "bwd t +b": 3 * E + s,
        "bwd z": 3 * E,
        "bias_grad": E + s,
    }[name]


KERNEL_NAMES = ("tanh", "bwd z bcast +b", "bwd z +b", "bwd t +b", "bwd z", "bias_grad")
# Every activation's kernels: the forward in place, the forward into another buffer, and the
# backward from z with grad_out (M, N) and the bias sums. -> the tanh kernel that moves the same
# bytes. Through ckpt_ext_kernels.activation_ / activation_backward_ where the build has them,
# else by difference through the mlp op (activation_rows_by_difference: no out-of-place form).
ACT_KERNELS = {"fwd": "tanh", "fwd to": "tanh", "bwd +b": "bwd z +b"}
ACT_K = 16  # in_features of the one-layer mlp: its GEMM writes z and reads next to nothing else


def shapes(log2_sizes, width):
    out = [(1 << p, width) for p in log2_sizes if (1 << p) >= width]
    if TARGET_FROM_LOG2 in log2_sizes:
        out.append((1 << TARGET_FROM_LOG2, 64))  # narrow: many chunks per column
    return [((size // n), n) for size, n in out]


def table(rows, dtypes) -> str:
    """% of copy bandwidth, one row per (dtype, kernel), one column per shape."""
    cols = sorted({(r["M"], r["N"]) for r in rows}, key=lambda s: (s[1] == 64, s[0] * s[1]))
    head = ["dtype", "kernel"] + [f"2^{int(math.log2(m * n))}" + (f" (N={n})" if n == 64 else "")
                                  for m, n in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * len(cols)]
    by = {(r["dtype"], r["kernel"], r["M"], r["N"]): r for r in rows}
    for dt in dtypes:
        copy_cells = []
        for m, n in cols:
            r = by.get((dt, "tanh", m, n))
            copy_cells.append(f"{r['copy_GBps']:.0f} GB/s" if r else "")
        lines.append(f"| {dt} | copy (same bytes as tanh) | " + " | ".join(copy_cells) + " |")
        for k in KERNEL_NAMES:
            cells = []
            for m, n in cols:
                r = by.get((dt, k, m, n))
                cells.append(f"{100 * r['frac_of_copy']:.0f}% ({r['GBps']:.0f})" if r else "")
            lines.append(f"| {dt} | {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def activation_table(rows, dtypes) -> str:
    """% of copy bandwidth of every activation's forward and backward kernels, one column per
    shape and kernel (timed by difference: the GEMM subtracted, in ms, in a column beside)."""
    cols = sorted({(r["M"], r["N"]) for r in rows}, key=lambda s: s[0] * s[1])
    kernels = [k for k in ACT_KERNELS if any(r["kernel"] == k for r in rows)]
    diff = any(r["method"] == "difference" for r in rows)
    head = ["dtype", "activation"]
    for m, n in cols:
        p = f"2^{int(math.log2(m * n))}"
        head += [f"{p} {k}" for k in kernels] + ([f"{p} GEMM ms"] if diff else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    by = {(r["dtype"], r["activation"], r["kernel"], r["M"], r["N"]): r for r in rows}
    for dt in dtypes:
        for act in sorted({r["activation"] for r in rows if r["dtype"] == dt},
                          key=lambda a: [r["activation"] for r in rows].index(a)):
            cells = []
            for m, n in cols:
                for k in kernels:
                    r = by.get((dt, act, k, m, n))
                    cells.append("" if r is None else f"{100 * r['frac_of_copy']:.0f}% "
                                 f"({r['GBps']:.0f})" + ("" if r["reliable"] else " ?"))
                if diff:
                    r = by.get((dt, act, "fwd", m, n))
                    cells.append("" if r is None else f"{r['base_ms']:.3f}")
            lines.append(f"| {dt} | {act} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(rows) -> dict:
    """The target per (dtype, kernel): >= 80 % of copy at every M·N >= 2^24 measured."""
    out = {}
    for r in rows:
        kernel = ACT_KERNELS.get(r["kernel"], r["kernel"]) if "activation" in r else r["kernel"]
        if kernel not in TARGET_KERNELS or r["dtype"] not in ("float32", "bfloat16"):
            continue
        if r["M"] * r["N"] < (1 << TARGET_FROM_LOG2):
            continue
        key = f"{r['dtype']} {r['kernel']}" + (f" {r['activation']}" if "activation" in r else "")
        frac = r["frac_of_copy"] if r["frac_of_copy"] >= 0 else 0.0  # NaN: no time measured
        worst = min(out.get(key, {}).get("worst_frac", math.inf), frac)
        out[key] = {"worst_frac": round(worst, 3), "met": worst >= TARGET}
    return out


# ------------------------------------------------------------------------------------------------
# timing (GPU)

def _graph_of(fn, reps: int):
    """A CUDA graph of fn(i) for i in range(reps); None if capture fails (then run eagerly)."""
    fn(0)  # warm-up outside capture (lazy init, allocator)
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(reps):
                fn(i)
        return g
    except Exception as e:  # noqa: BLE001 - reported, then timed eagerly
        print(f"  graph capture failed ({type(e).__name__}: {e}); timing eager launches",
              file=sys.stderr)
        return None


def _time(fn, reps: int, samples: int, restore=None) -> tuple[float, str]:
    """Median ms per launch of fn over `samples` runs of reps launches."""
    graph = _graph_of(fn, reps)
    times = []
    for s in range(samples + 1):
        if restore is not None:
            restore()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if graph is not None:
            graph.replay()
        else:
            for i in range(reps):
                fn(i)
        end.record()
        end.synchronize()
        if s > 0:  # the first is a warm-up
            times.append(start.elapsed_time(end) / reps)
    return statistics.median(times), ("graph" if graph is not None else "eager")


_COPY_MS: dict = {}


def copy_ms(nbytes: int, samples: int) -> tuple[float, int]:
    """ms of a D2D copy that moves nbytes (nbytes / 2 read and written), and the bytes it moved;
    measured once per size."""
    n_copy = max(1, nbytes // 2 // 4)
    if n_copy not in _COPY_MS:
        copy_reps = max(1, min(64, -(-WORKING_SET // (2 * n_copy * 4))))
        srcs = [torch.empty(n_copy, device="cuda") for _ in range(copy_reps)]
        dsts = [torch.empty(n_copy, device="cuda") for _ in range(copy_reps)]
        _COPY_MS[n_copy] = _time(lambda i: dsts[i].copy_(srcs[i]), copy_reps, samples)[0]
        del srcs, dsts
    return _COPY_MS[n_copy], 2 * n_copy * 4


def measure(dtype_name: str, M: int, N: int, samples: int) -> list[dict]:
    k = torch.ops.ckpt_ext_kernels
    dtype = DTYPES[dtype_name]
    itemsize = torch.empty((), dtype=dtype).element_size()
    acc_size = 8 if dtype == torch.float64 else 4
    E = M * N * itemsize
    reps = max(1, min(64, -(-WORKING_SET // (2 * E))))
    gen = torch.Generator(device="cuda").manual_seed(0)
    z = torch.randn(M, N, device="cuda", generator=gen).mul_(2).to(dtype)  # pre-activations
    t = torch.tanh(z.float()).to(dtype)
    accs = [torch.empty_like(z) for _ in range(reps)]
    grads = [torch.randn(M, N, device="cuda", generator=gen).to(dtype) for _ in range(reps)]
    bcast = torch.full((), 1.0 / (M * N), device="cuda", dtype=dtype).expand(M, N)

    def restore_from(src):
        return lambda: [a.copy_(src) for a in accs]

    calls = {
        "tanh": (lambda i: k.tanh_(accs[i]), restore_from(z)),
        "bwd z bcast +b": (lambda i: k.tanh_backward_(accs[i], bcast, True, True), restore_from(z)),
        "bwd z +b": (lambda i: k.tanh_backward_(accs[i], grads[i], True, True), restore_from(z)),
        "bwd t +b": (lambda i: k.tanh_backward_(accs[i], grads[i], False, True), restore_from(t)),
        "bwd z": (lambda i: k.tanh_backward_(accs[i], grads[i], True, False), restore_from(z)),
        "bias_grad": (lambda i: k.bias_grad(grads[i]), None),
    }
    rows = []
    for name, (fn, restore) in calls.items():
        if restore is not None:
            restore()
        ms, how = _time(fn, reps, samples, restore)
        nbytes = kernel_bytes(name, M, N, itemsize, acc_size)
        c_ms, c_bytes = copy_ms(nbytes, samples)  # the copy of the same bytes
        gbps = nbytes / (ms * 1e-3) / 1e9
        copy_gbps = c_bytes / (c_ms * 1e-3) / 1e9
        rows.append({"dtype": dtype_name, "kernel": name, "M": M, "N": N, "bytes": nbytes,
                     "ms": round(ms, 5), "GBps": round(gbps, 1), "copy_ms": round(c_ms, 5),
                     "copy_GBps": round(copy_gbps, 1), "frac_of_copy": round(gbps / copy_gbps, 4),
                     "reps_per_sample": reps, "launch": how})
    del accs, grads
    torch.cuda.empty_cache()
    return rows


def activation_rows(dtype_name: str, M: int, N: int, samples: int, acts) -> list[dict]:
    """Every activation's forward (in place and into another buffer) and backward kernel, through
    the primitives (ckpt_ext_kernels.activation_, activation_backward_), timed as the tanh ones."""
    k = torch.ops.ckpt_ext_kernels
    if not hasattr(k, "activation_"):
        return activation_rows_by_difference(dtype_name, M, N, samples, acts)
    dtype = DTYPES[dtype_name]
    itemsize = torch.empty((), dtype=dtype).element_size()
    acc_size = 8 if dtype == torch.float64 else 4
    E = M * N * itemsize
    reps = max(1, min(64, -(-WORKING_SET // (3 * E))))
    gen = torch.Generator(device="cuda").manual_seed(1)
    z = torch.randn(M, N, device="cuda", generator=gen).mul_(2).to(dtype)
    srcs = [z.clone() for _ in range(reps)]
    accs = [torch.empty_like(z) for _ in range(reps)]
    grads = [torch.randn(M, N, device="cuda", generator=gen).to(dtype) for _ in range(reps)]

    def restore():
        for a in accs:
            a.copy_(z)

    rows = []
    for act in acts:
        calls = {
            "fwd": (lambda i: k.activation_(accs[i], accs[i], act), restore),
            "fwd to": (lambda i: k.activation_(srcs[i], accs[i], act), None),
            "bwd +b": (lambda i: k.activation_backward_(accs[i], grads[i], act, True), restore),
        }
        for name, (fn, rst) in calls.items():
            if rst is not None:
                rst()
            ms, how = _time(fn, reps, samples, rst)
            nbytes = kernel_bytes(ACT_KERNELS[name], M, N, itemsize, acc_size)
            c_ms, c_bytes = copy_ms(nbytes, samples)
            gbps = nbytes / (ms * 1e-3) / 1e9
            copy_gbps = c_bytes / (c_ms * 1e-3) / 1e9
            rows.append({"dtype": dtype_name, "activation": act, "kernel": name, "M": M, "N": N,
                         "bytes": nbytes, "ms": round(ms, 5), "GBps": round(gbps, 1),
                         "copy_ms": round(c_ms, 5), "copy_GBps": round(copy_gbps, 1),
                         "frac_of_copy": round(gbps / copy_gbps, 4), "reliable": True,
                         "method": "kernel op", "reps_per_sample": reps, "launch": how})
    del srcs, accs, grads
    torch.cuda.empty_cache()
    return rows


def activation_rows_by_difference(dtype_name: str, M: int, N: int, samples: int,
                                  acts) -> list[dict]:
    """Every activation's forward and backward kernel, timed by difference: a one-layer
    torch.ops.ckpt_ext.mlp (x (M, ACT_K), weight (N, ACT_K), bias) forward with its activation, and
    its backward asked for the bias gradient alone (the recompute's GEMM, then the backward kernel
    with the bias sums), each minus the same layer's forward without the activation (the GEMM
    alone). Rows whose difference is under a tenth of the GEMM's time are marked not reliable."""
    ops = torch.ops.ckpt_ext
    dtype = DTYPES[dtype_name]
    itemsize = torch.empty((), dtype=dtype).element_size()
    acc_size = 8 if dtype == torch.float64 else 4
    E = M * N * itemsize
    reps = max(1, min(64, -(-WORKING_SET // (2 * E))))
    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(M, ACT_K, device="cuda", generator=gen).to(dtype) for _ in range(reps)]
    w = (torch.randn(N, ACT_K, device="cuda", generator=gen) / ACT_K ** 0.5).to(dtype)
    b = torch.randn(N, device="cuda", generator=gen).to(dtype)
    grads = [torch.randn(M, N, device="cuda", generator=gen).to(dtype) for _ in range(reps)]
    rows = []
    for act in acts:
        calls = {
            "gemm": lambda i: ops.mlp(xs[i], [w], [b], [True], act, False),
            "fwd": lambda i: ops.mlp(xs[i], [w], [b], [True], act, True),
            "bwd +b": lambda i: ops.mlp_backward(grads[i], xs[i], [w], [b], [True], act, True,
                                                 False, [False], [True]),
        }
        ms = {k: _time(fn, reps, samples) for k, fn in calls.items()}
        for k in ("fwd", "bwd +b"):
            nbytes = kernel_bytes(ACT_KERNELS[k], M, N, itemsize, acc_size)
            c_ms, c_bytes = copy_ms(nbytes, samples)
            diff = ms[k][0] - ms["gemm"][0]
            gbps = nbytes / (diff * 1e-3) / 1e9 if diff > 0 else math.nan
            copy_gbps = c_bytes / (c_ms * 1e-3) / 1e9
            rows.append({"dtype": dtype_name, "activation": act, "kernel": k, "M": M, "N": N,
                         "bytes": nbytes, "ms": round(diff, 5), "with_gemm_ms": round(ms[k][0], 5),
                         "base_ms": round(ms["gemm"][0], 5), "GBps": round(gbps, 1),
                         "copy_ms": round(c_ms, 5), "copy_GBps": round(copy_gbps, 1),
                         "frac_of_copy": round(gbps / copy_gbps, 4),
                         "reliable": bool(diff > 0.1 * ms["gemm"][0]), "method": "difference",
                         "reps_per_sample": reps, "launch": ms[k][1]})
    del xs, grads
    torch.cuda.empty_cache()
    return rows


def parse_range(s: str) -> list[int]:
    """'20-27' -> 20..27; '20,24,27' -> those; the two forms mix ('20,24-27')."""
    out = []
    for part in s.split(","):
        lo, _, hi = part.strip().partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return sorted(set(out))


def plan(dtypes, sizes, act_sizes, width):
    """The measurements in the order they run, (kind, dtype, M, N): per dtype, the tanh primitives
    at each shape ("kernels"), then every activation at each of its shapes ("activations")."""
    out = []
    for d in dtypes:
        out += [("kernels", d, M, N) for M, N in shapes(sizes, width)]
        out += [("activations", d, (1 << p) // width, width) for p in act_sizes
                if (1 << p) >= width]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--log2-sizes", default="20-27", help="M·N = 2^a .. 2^b (the tanh primitives)")
    ap.add_argument("--act-log2-sizes", default="24,27",
                    help="M·N of every activation's kernels (by difference; '' for none)")
    ap.add_argument("--width", type=int, default=4096, help="N (out_features)")
    ap.add_argument("--samples", type=int, default=7)
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="start no new shape after this many seconds")
    ap.add_argument("--dry-run", "--list", action="store_true",
                    help="print what would be measured and the bytes per kernel; no GPU needed")
    args = ap.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in DTYPES:
            ap.error(f"--dtypes: unknown dtype {d!r}; expected some of {', '.join(DTYPES)}")
    try:
        sizes = parse_range(args.log2_sizes)
        act_sizes = parse_range(args.act_log2_sizes) if args.act_log2_sizes.strip() else []
    except ValueError:
        ap.error(f"--log2-sizes, --act-log2-sizes: expected a range like 20-27 or a list like "
                 f"20,24,27, got {args.log2_sizes!r}, {args.act_log2_sizes!r}")
    import ckpt_ext
    acts = list(ckpt_ext.ACTIVATIONS)
    todo = plan(dtypes, sizes, act_sizes, args.width)
    if args.dry_run:
        for kind, d, M, N in todo:
            itemsize = torch.empty((), dtype=DTYPES[d]).element_size()
            acc = 8 if d == "float64" else 4
            moved = ({k: kernel_bytes(k, M, N, itemsize, acc) for k in KERNEL_NAMES}
                     if kind == "kernels" else
                     {f"each activation's {k}": kernel_bytes(ACT_KERNELS[k], M, N, itemsize, acc)
                      for k in ACT_KERNELS})
            print(f"{kind} {d} {M}x{N}: MiB moved: "
                  + ", ".join(f"{k} {b / 2**20:.1f}" for k, b in moved.items()))
        missing = [op for op in ("mlp", "mlp_backward") if not hasattr(torch.ops.ckpt_ext, op)]
        how = ("not known (a CPU-only build)" if not ckpt_ext.WITH_CUDA else
               "through the kernel ops" if hasattr(torch.ops.ckpt_ext_kernels, "activation_")
               else "by difference through the mlp op")
        print(f"{len(todo)} measurements; activations: {', '.join(acts)}, timed {how}"
              + (f"; ops missing: {missing}" if missing else ""))
        return 1 if missing else 0
    if not (torch.cuda.is_available() and ckpt_ext.WITH_CUDA):
        print("gpu_kernel_bench: needs a GPU and a CUDA build of ckpt_ext (cuda available: "
              f"{torch.cuda.is_available()}, ckpt_ext.WITH_CUDA: {ckpt_ext.WITH_CUDA})",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    props = torch.cuda.get_device_properties(0)
    res = {
        "device": torch.cuda.get_device_name(0), "capability": f"{props.major}.{props.minor}",
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "method": "CUDA graph of R launches over R distinct buffer sets (>= 256 MiB in all), "
                  "median over samples of event time / R after a warm-up replay; copy = "
                  "cudaMemcpyAsync D2D of bytes/2; activations: ckpt_ext_kernels.activation_ and "
                  "activation_backward_, or where the build lacks them one-layer mlp with its "
                  "activation minus the same layer without (forward), backward asked for grad_b "
                  "alone minus the same",
        "samples": args.samples, "results": [], "activations": [], "not_measured": [],
    }
    for kind, d, M, N in todo:
        if args.max_seconds is not None and time.perf_counter() - t0 > args.max_seconds:
            res["not_measured"].append(f"{kind} {d} {M}x{N}")
            continue
        if kind == "kernels":
            res["results"] += measure(d, M, N, args.samples)
        else:
            res["activations"] += activation_rows(d, M, N, args.samples, acts)
        print(f"  {kind} {d} {M}x{N}: done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
              flush=True)
        res.update(targets=targets(res["results"] + res["activations"]),
                   wall_s=round(time.perf_counter() - t0, 1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
    if res["not_measured"]:
        print(f"not measured (--max-seconds {args.max_seconds:g}): "
              f"{', '.join(res['not_measured'])}", file=sys.stderr)
    print(f"Conditions: {res['device']} (sm {res['capability']}), torch {res['torch']}, "
          f"CUDA {res['cuda']}; {res['method']}. Cells: % of copy bandwidth (kernel GB/s).\n")
    print(table(res["results"], dtypes))
    if res["activations"]:
        how = ("through ckpt_ext_kernels.activation_ / activation_backward_"
               if res["activations"][0]["method"] == "kernel op" else
               f"by difference, x (M, {ACT_K}) through one Linear with and without the "
               "activation; '?': the difference is under a tenth of the GEMM's time")
        print(f"\nEvery activation ({how}):\n")
        print(activation_table(res["activations"], dtypes))
    print("\ntargets (>= 80 % of copy at M·N >= 2^24):")
    for key, v in res.get("targets", {}).items():
        print(f"  {key}: worst {100 * v['worst_frac']:.0f}% -> {'met' if v['met'] else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
