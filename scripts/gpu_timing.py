"""Forward+backward time and kept memory of one Linear+Tanh block on a GPU, three ways:
the fused op (ckpt_ext.FusedLinearTanh), stock nn.Sequential(nn.Linear, nn.Tanh), and the same
Sequential under torch.utils.checkpoint (use_reentrant=False).

A stand-in for the full benchmark (python -m ckpt_ext.bench) that scripts/gpu_check.sh runs too:
small, no plots, CUDA-event timings. Writes a JSON with the device, torch and CUDA versions and
prints a markdown table.

    python scripts/gpu_timing.py [--json out.json] [--iters 20]

Timings: median over --iters of forward+backward between two CUDA events, after 5 warm-ups.
"kept" is the memory allocated after the forward minus before it, output included: what the block
holds for backward. Sizes (batch, in_features, out_features) follow the README quick start
(512, 1024, 10240) plus two square-ish training shapes.
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

SIZES = [(512, 1024, 10240), (8192, 4096, 4096), (16384, 1024, 4096)]
DTYPES = [torch.float32, torch.bfloat16]


def _variants(block: nn.Sequential, fused: nn.Module):
    return {
        "fused": lambda x: fused(x),
        "stock": lambda x: block(x),
        "checkpoint": lambda x: checkpoint(block, x, use_reentrant=False),
    }


def _measure(fn, x, gy, iters: int):
    for _ in range(5):
        fn(x).backward(gy)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    y = fn(x)
    kept = torch.cuda.memory_allocated() - base
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


def run(iters: int):
    rows = []
    for dtype in DTYPES:
        for batch, k, n in SIZES:
            torch.manual_seed(0)
            block = nn.Sequential(nn.Linear(k, n), nn.Tanh()).to("cuda", dtype)
            fused = ckpt_ext.FusedLinearTanh.from_linear(block[0])
            x = torch.randn(batch, k, device="cuda", dtype=dtype, requires_grad=True)
            gy = torch.randn(batch, n, device="cuda", dtype=dtype)
            with torch.no_grad():
                diff = (fused(x).float() - block(x).float()).abs().max().item()
            for name, fn in _variants(block, fused).items():
                ms, kept = _measure(fn, x, gy, iters)
                rows.append({"dtype": str(dtype).replace("torch.", ""), "batch": batch,
                             "in_features": k, "out_features": n, "variant": name,
                             "fwd_bwd_ms": round(ms, 4), "kept_bytes": kept,
                             "max_abs_diff_vs_stock": diff if name == "fused" else 0.0})
            del block, fused, x, gy
            torch.cuda.empty_cache()
    return rows


def table(rows) -> str:
    lines = ["| dtype | batch × in → out | variant | fwd+bwd ms | kept MiB | vs stock time |",
             "|---|---|---|---:|---:|---:|"]
    stock = {(r["dtype"], r["batch"], r["in_features"], r["out_features"]): r["fwd_bwd_ms"]
             for r in rows if r["variant"] == "stock"}
    for r in rows:
        key = (r["dtype"], r["batch"], r["in_features"], r["out_features"])
        lines.append(f"| {r['dtype']} | {r['batch']} × {r['in_features']} → {r['out_features']} | "
                     f"{r['variant']} | {r['fwd_bwd_ms']:.3f} | {r['kept_bytes'] / 2**20:.1f} | "
                     f"{r['fwd_bwd_ms'] / stock[key]:.2f}x |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    if not (torch.cuda.is_available() and ckpt_ext.WITH_CUDA):
        print("gpu_timing: needs a GPU and a CUDA build of ckpt_ext "
              f"(cuda available: {torch.cuda.is_available()}, WITH_CUDA: {ckpt_ext.WITH_CUDA})",
              file=sys.stderr)
        return 2
    rows = run(args.iters)
    props = torch.cuda.get_device_properties(0)
    result = {
        "device": torch.cuda.get_device_name(0),
        "capability": f"{props.major}.{props.minor}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "iters": args.iters,
        "timing": "median of fwd+bwd between CUDA events, after 5 warm-ups",
        "results": rows,
    }
    print(f"Conditions: {result['device']} (sm {result['capability']}), torch {result['torch']}, "
          f"CUDA {result['cuda']}, {result['timing']}, {args.iters} iterations\n")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
