"""Forward+backward time (CUDA events, median after warm-up) and kept requested bytes of
FusedLinearTanh and FusedTanhMLP against nn.Sequential(Linear, Tanh...) and that Sequential under
torch.utils.checkpoint, at the write-up's block size and two training shapes. Run by
scripts/gpu_check.sh; needs a GPU and a CUDA build, except --dry-run (CPU, 1/64 sizes). Method:
docs/cuda.md.

    python scripts/gpu_timing.py [--json out.json] [--iters 20] [--dtypes float32,bfloat16]
                                 [--dry-run]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import ckpt_ext
from ckpt_ext.memory import cuda_requested_bytes

BLOCK_SIZES = [(512, 1024, 10240), (8192, 4096, 4096), (16384, 1024, 4096)]
STACK_SIZES = [(8192, 2048, 4), (16384, 1024, 4)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _measure(fn, x, gy, iters: int):
    for _ in range(5):
        fn(x).backward(gy)
    torch.cuda.synchronize()
    base = cuda_requested_bytes()[0]
    y = fn(x)
    torch.cuda.synchronize()
    kept = cuda_requested_bytes()[0] - base
    y.backward(gy)
    del y
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x).backward(gy)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), kept


def _variants(seq: nn.Sequential, fused: nn.Module):
    return {
        "fused": lambda x: fused(x),
        "stock": lambda x: seq(x),
        "checkpoint": lambda x: checkpoint(seq, x, use_reentrant=False),
    }


def _run_case(kind, dtype_name, batch, k, n, depth, seq, fused, iters):
    dtype = DTYPES[dtype_name]
    x = torch.randn(batch, k, device="cuda", dtype=dtype, requires_grad=True)
    gy = torch.randn(batch, n, device="cuda", dtype=dtype)
    with torch.no_grad():
        diff = (fused(x).float() - seq(x).float()).abs().max().item()
    rows = []
    for name, fn in _variants(seq, fused).items():
        for p in seq.parameters():
            p.grad = None
        ms, kept = _measure(fn, x, gy, iters)
        rows.append({"kind": kind, "dtype": dtype_name, "batch": batch, "in_features": k,
                     "out_features": n, "depth": depth, "variant": name,
                     "fwd_bwd_ms": round(ms, 4), "kept_bytes": kept,
                     "max_abs_diff_vs_stock": diff if name == "fused" else 0.0})
    return rows


def cases(dtype, device="cuda", scale=1):
    """(kind, batch, in, out, depth, seq, fused) of every case, sizes divided by ``scale``."""
    for batch, k, n in BLOCK_SIZES:
        batch, k, n = batch // scale, k // scale, n // scale
        torch.manual_seed(0)
        seq = nn.Sequential(nn.Linear(k, n), nn.Tanh()).to(device, dtype)
        yield "block", batch, k, n, 1, seq, ckpt_ext.FusedLinearTanh.from_linear(seq[0])
    for batch, h, depth in STACK_SIZES:
        batch, h = batch // scale, h // scale
        torch.manual_seed(0)
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(h, h), nn.Tanh()]
        seq = nn.Sequential(*layers).to(device, dtype)
        # shares the Linear modules
        yield "stack", batch, h, h, depth, seq, ckpt_ext.FusedTanhMLP.from_modules(seq)


def run(iters: int, dtypes) -> list[dict]:
    rows = []
    for dtype_name in dtypes:
        for kind, batch, k, n, depth, seq, fused in cases(DTYPES[dtype_name]):
            rows += _run_case(kind, dtype_name, batch, k, n, depth, seq, fused, iters)
            del seq, fused
            torch.cuda.empty_cache()
    return rows


def dry_run(dtypes) -> int:
    """Every case at 1/64 of its size on the CPU: the fused module against the Sequential."""
    for dtype_name in dtypes:
        for kind, batch, k, n, depth, seq, fused in cases(DTYPES[dtype_name], "cpu", 64):
            x = torch.randn(batch, k, dtype=DTYPES[dtype_name])
            with torch.no_grad():
                diff = (fused(x).float() - seq(x).float()).abs().max().item()
            print(f"{kind} {dtype_name} {batch} x {k} -> {n} ({depth}): max |fused - stock| "
                  f"{diff:.1e}")
            if not diff < 0.05:
                return 1
    return 0


def table(rows) -> str:
    lines = ["| kind | dtype | batch × in → out (depth) | variant | fwd+bwd ms | kept MiB | "
             "time vs stock | time vs checkpoint |", "|---|---|---|---|---:|---:|---:|---:|"]
    key = lambda r: (r["kind"], r["dtype"], r["batch"], r["in_features"], r["out_features"],
                     r["depth"])
    ms = {(key(r), r["variant"]): r["fwd_bwd_ms"] for r in rows}
    for r in rows:
        k = key(r)
        lines.append(
            f"| {r['kind']} | {r['dtype']} | {r['batch']} × {r['in_features']} → "
            f"{r['out_features']} ({r['depth']}) | {r['variant']} | {r['fwd_bwd_ms']:.3f} | "
            f"{r['kept_bytes'] / 2**20:.1f} | {r['fwd_bwd_ms'] / ms[(k, 'stock')]:.2f}x | "
            f"{r['fwd_bwd_ms'] / ms[(k, 'checkpoint')]:.2f}x |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--dry-run", action="store_true",
                    help="every case at 1/64 size on the CPU, fused vs stock; no GPU needed")
    args = ap.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in DTYPES:
            ap.error(f"--dtypes: unknown dtype {d!r}; expected some of {', '.join(DTYPES)}")
    if args.dry_run:
        return dry_run(dtypes)
    if not (torch.cuda.is_available() and ckpt_ext.WITH_CUDA):
        print("gpu_timing: needs a GPU and a CUDA build of ckpt_ext "
              f"(cuda available: {torch.cuda.is_available()}, WITH_CUDA: {ckpt_ext.WITH_CUDA})",
              file=sys.stderr)
        return 2
    rows = run(args.iters, dtypes)
    props = torch.cuda.get_device_properties(0)
    result = {
        "device": torch.cuda.get_device_name(0),
        "capability": f"{props.major}.{props.minor}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "tf32": torch.backends.cuda.matmul.allow_tf32,
        "iters": args.iters,
        "timing": "median of fwd+bwd between CUDA events, after 5 warm-ups",
        "results": rows,
    }
    print(f"Conditions: {result['device']} (sm {result['capability']}), torch {result['torch']}, "
          f"CUDA {result['cuda']}, TF32 {'on' if result['tf32'] else 'off'}, {result['timing']}, "
          f"{args.iters} iterations\n")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
