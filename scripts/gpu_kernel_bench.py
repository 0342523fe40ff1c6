"""Achieved memory bandwidth of each elementwise CUDA kernel of ckpt_ext (torch.ops.ckpt_ext_kernels,
no GEMM) against a device-to-device copy of the same bytes, per dtype and size M·N = 2^20..2^27;
the targets (>= 80 % of copy at M·N >= 2^24) marked met or not. Run by scripts/gpu_check.sh; needs
a GPU and a CUDA build, except --dry-run. Bytes counted per kernel and timing method: docs/cuda.md.

    python scripts/gpu_kernel_bench.py [--json out.json] [--dtypes float32,bfloat16]
                                       [--log2-sizes 20-27] [--width 4096] [--samples 7]
                                       [--max-seconds S] [--dry-run]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

ROWS_PER_CHUNK = 32   # csrc/linear_tanh_math.h kRowsPerChunk
GROUP_CHUNKS = 128    # csrc/cuda/linear_tanh.cu kGroupChunks
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


def targets(rows) -> dict:
    """The target per (dtype, kernel): >= 80 % of copy at every M·N >= 2^24 measured."""
    out = {}
    for r in rows:
        if r["kernel"] not in TARGET_KERNELS or r["dtype"] not in ("float32", "bfloat16"):
            continue
        if r["M"] * r["N"] < (1 << TARGET_FROM_LOG2):
            continue
        key = f"{r['dtype']} {r['kernel']}"
        worst = min(out.get(key, {}).get("worst_frac", math.inf), r["frac_of_copy"])
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
        # the copy of the same bytes: nbytes / 2 read and written
        n_copy = max(1, nbytes // 2 // 4)
        copy_reps = max(1, min(64, -(-WORKING_SET // (2 * n_copy * 4))))
        srcs = [torch.empty(n_copy, device="cuda") for _ in range(copy_reps)]
        dsts = [torch.empty(n_copy, device="cuda") for _ in range(copy_reps)]
        copy_ms, _ = _time(lambda i: dsts[i].copy_(srcs[i]), copy_reps, samples)
        del srcs, dsts
        gbps = nbytes / (ms * 1e-3) / 1e9
        copy_gbps = 2 * n_copy * 4 / (copy_ms * 1e-3) / 1e9
        rows.append({"dtype": dtype_name, "kernel": name, "M": M, "N": N, "bytes": nbytes,
                     "ms": round(ms, 5), "GBps": round(gbps, 1), "copy_ms": round(copy_ms, 5),
                     "copy_GBps": round(copy_gbps, 1), "frac_of_copy": round(gbps / copy_gbps, 4),
                     "reps_per_sample": reps, "launch": how})
    del accs, grads
    torch.cuda.empty_cache()
    return rows


def parse_range(s: str) -> list[int]:
    """'20-27' -> 20..27; '20,24,27' -> those; the two forms mix ('20,24-27')."""
    out = []
    for part in s.split(","):
        lo, _, hi = part.strip().partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return sorted(set(out))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--log2-sizes", default="20-27", help="M·N = 2^a .. 2^b")
    ap.add_argument("--width", type=int, default=4096, help="N (out_features)")
    ap.add_argument("--samples", type=int, default=7)
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="start no new shape after this many seconds")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the shapes and bytes per kernel; no GPU needed")
    args = ap.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in DTYPES:
            ap.error(f"--dtypes: unknown dtype {d!r}; expected some of {', '.join(DTYPES)}")
    try:
        sizes = parse_range(args.log2_sizes)
    except ValueError:
        ap.error(f"--log2-sizes: expected a range like 20-27 or a list like 20,24,27, "
                 f"got {args.log2_sizes!r}")
    if args.dry_run:
        for d in dtypes:
            itemsize = torch.empty((), dtype=DTYPES[d]).element_size()
            acc = 8 if d == "float64" else 4
            for M, N in shapes(sizes, args.width):
                mib = ", ".join(f"{k} {kernel_bytes(k, M, N, itemsize, acc) / 2**20:.1f}"
                                for k in KERNEL_NAMES)
                print(f"{d} {M}x{N}: MiB moved: {mib}")
        return 0
    import ckpt_ext
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
                  "cudaMemcpyAsync D2D of bytes/2",
        "samples": args.samples, "results": [], "not_measured": [],
    }
    rows = res["results"]
    for d in dtypes:
        for M, N in shapes(sizes, args.width):
            if args.max_seconds is not None and time.perf_counter() - t0 > args.max_seconds:
                res["not_measured"].append(f"{d} {M}x{N}")
                continue
            rows += measure(d, M, N, args.samples)
            print(f"  {d} {M}x{N}: done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
                  flush=True)
            res.update(targets=targets(rows), wall_s=round(time.perf_counter() - t0, 1))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(res, f, indent=1)
    if res["not_measured"]:
        print(f"not measured (--max-seconds {args.max_seconds:g}): "
              f"{', '.join(res['not_measured'])}", file=sys.stderr)
    print(f"Conditions: {res['device']} (sm {res['capability']}), torch {res['torch']}, "
          f"CUDA {res['cuda']}; {res['method']}. Cells: % of copy bandwidth (kernel GB/s).\n")
    print(table(rows, dtypes))
    print("\ntargets (>= 80 % of copy at M·N >= 2^24):")
    for key, v in res.get("targets", {}).items():
        print(f"  {key}: worst {100 * v['worst_frac']:.0f}% -> {'met' if v['met'] else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
