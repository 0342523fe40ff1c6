"""CPU kernels of ckpt_ext against stock PyTorch at the same ISA level, ours and stock interleaved:
forward ``linear_tanh`` vs ``tanh(F.linear)``, and our recomputing backward vs stock autograd's
backward alone and vs stock forward + backward (what stock pays when it recomputes). Per shape
(M rows, K -> N), dtype, thread count and level; each level below ATen's runs in a child process
with ATEN_CPU_CAPABILITY and CKPT_EXT_CPU_CAPABILITY set to it. Method: docs/benchmark.md.

    python scripts/bench_cpu_kernels.py                      # markdown table, then JSON
    python scripts/bench_cpu_kernels.py --json out.json --levels avx2,avx512 --threads 1
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import ckpt_ext
from ckpt_ext import _C

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float64": torch.float64}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def median_ms(fns, warmup: int, repeats: int) -> list[float]:
    """Median wall time in ms of each fn in fns, calls interleaved (a, b, a, b, ...)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(t) for t in times]


def bench_case(M, K, N, dtype, warmup, repeats):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    gy = torch.randn(M, N, generator=g).to(dtype)

    ours_fwd = lambda: torch.ops.ckpt_ext.mlp(x, [w], [b], [True], "tanh", True)  # noqa: E731
    stock_fwd = lambda: torch.tanh(F.linear(x, w, b))  # noqa: E731
    ours_bwd = lambda: torch.ops.ckpt_ext.mlp_backward(  # noqa: E731
        gy, x, [w], [b], [True], "tanh", True, True, [True], [True])
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
    ys = torch.tanh(F.linear(xs, ws, bs))
    stock_bwd = lambda: torch.autograd.grad(ys, (xs, ws, bs), gy, retain_graph=True)  # noqa: E731

    fwd_ours, fwd_stock = median_ms([ours_fwd, stock_fwd], warmup, repeats)
    bwd_ours, bwd_stock = median_ms([ours_bwd, stock_bwd], warmup, repeats)
    return {"fwd_ours_ms": fwd_ours, "fwd_stock_ms": fwd_stock, "fwd_ratio": fwd_ours / fwd_stock,
            "bwd_ours_ms": bwd_ours, "bwd_stock_ms": bwd_stock, "bwd_ratio": bwd_ours / bwd_stock,
            "bwd_vs_recompute_ratio": bwd_ours / (fwd_stock + bwd_stock)}


def run_child(level: str, a) -> list[dict]:
    """The same benchmark at `level` in a child process whose ATen runs at that level too."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        env = dict(os.environ, ATEN_CPU_CAPABILITY=level, CKPT_EXT_CPU_CAPABILITY=level)
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--json", out,
               "--levels", level, "--shapes", a.shapes, "--dtypes", a.dtypes,
               "--threads", a.threads, "--warmup", str(a.warmup), "--repeats", str(a.repeats)]
        subprocess.run(cmd, env=env, check=True)
        with open(out) as f:
            return json.load(f)


def parse_shape(s: str):
    m, rest = s.split("x")
    k, n = rest.split("->") if "->" in rest else rest.split(":")
    return int(m), int(k), int(n)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1024x64->2048,4096x256->256,256x1024->1024",
                   help="comma-separated MxK->N (x is M x K, W is N x K)")
    p.add_argument("--dtypes", default="bfloat16,float16,float32")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--levels", default="all",
                   help="ckpt_ext CPU levels to time (all = every one this machine runs)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", default=None, help="also write the JSON here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)

    shapes = [parse_shape(s) for s in a.shapes.split(",")]
    dtypes = [DTYPES[d] for d in a.dtypes.split(",")]
    threads = [int(t) for t in a.threads.split(",")]
    available = list(_C._cpu_capabilities())
    levels = available if a.levels == "all" else [lv for lv in a.levels.split(",")]
    for lv in levels:
        if lv not in available:
            p.error(f"level {lv!r} not available here; available: {', '.join(available)}")

    conditions = {
        "cpu": cpu_name(), "machine": platform.machine(), "cores": os.cpu_count(),
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__, "ckpt_ext_build_torch": _C.TORCH_BUILD_VERSION,
        "warmup": a.warmup, "repeats": a.repeats,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    rows = []
    here = _C._cpu_capability()
    for lv in levels:
        if lv != here and not a.child:
            rows += run_child(lv, a)
            continue
        before_threads = torch.get_num_threads()
        try:
            for nt in threads:
                torch.set_num_threads(nt)
                for (M, K, N) in shapes:
                    for dt in dtypes:
                        r = bench_case(M, K, N, dt, a.warmup, a.repeats)
                        r.update(shape=f"{M}x{K}->{N}", dtype=str(dt).replace("torch.", ""),
                                 threads=nt, level=lv,
                                 aten_level=torch.backends.cpu.get_cpu_capability())
                        rows.append(r)
                        print(f"  {r['shape']:>16} {r['dtype']:>8} threads={nt} {lv:>7}: fwd "
                              f"{r['fwd_ratio']:.2f}x bwd {r['bwd_ratio']:.2f}x", flush=True)
        finally:
            torch.set_num_threads(before_threads)
    if a.child:
        with open(a.json, "w") as f:
            json.dump(rows, f)
        return rows

    print()
    print(f"Benchmark conditions: {conditions['cpu']} ({conditions['machine']}, "
          f"{conditions['cores']} cores, ATen capability {conditions['aten_cpu_capability']}), "
          f"torch {conditions['torch']}, median of {a.repeats} calls after {a.warmup} warm-up, "
          f"ours and stock interleaved, both at the row's ISA level (ATEN_CPU_CAPABILITY and "
          f"CKPT_EXT_CPU_CAPABILITY); stock = torch.tanh(F.linear(x, W, b)) and its autograd "
          f"backward; ours recomputes z and tanh(z) in backward (one GEMM and one tanh more). "
          f"{conditions['date']}.")
    print()
    print("| shape (M×K→N) | dtype | threads | ISA level | fwd ours ms | fwd stock ms | "
          "fwd ours/stock | bwd ours ms | bwd stock ms | bwd ours/stock | "
          "bwd ours/(stock fwd+bwd) |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['dtype']} | {r['threads']} | {r['level']} | "
              f"{r['fwd_ours_ms']:.3f} | {r['fwd_stock_ms']:.3f} | {r['fwd_ratio']:.2f} | "
              f"{r['bwd_ours_ms']:.3f} | {r['bwd_stock_ms']:.3f} | {r['bwd_ratio']:.2f} | "
              f"{r['bwd_vs_recompute_ratio']:.2f} |")
    out = {"conditions": conditions, "results": rows}
    print()
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
