"""The CPU activation pass of ckpt_ext against ATen's own op, per element: for every activation of
ckpt_ext.ACTIVATIONS (read from the registry), ours is the primitive the fused ops run on their
buffers (``_C._activation_``: dst = f(src); ``_C._activation_backward_``: z -> g = gy·f'(z) in
place, recomputing f where it needs it), ATen's is the registry row's ``f`` and its ``backward``
(gy, z) -> gy·f'(z): PyTorch's backward op, after f where that op reads f(z), or several ops where
PyTorch has no single one (SiLU's and QuickGELU's rows). Per activation, dtype, buffer shape,
thread count and ISA level; every level runs in a child process with ATEN_CPU_CAPABILITY and
CKPT_EXT_CPU_CAPABILITY set to it, and glibc's mmap threshold raised so that the output ATen
allocates on each call reuses freed memory instead of faulting fresh pages in (ours writes into a
buffer made once). Calls interleaved, medians; the backward's figure is a copy of z into the
buffer and the pass, less the copy alone. Method: docs/benchmark.md, "The activation pass".

    python scripts/bench_activation_pass.py                  # markdown table, then JSON
    python scripts/bench_activation_pass.py --levels avx512 --threads 1 --dtypes float32
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

import ckpt_ext
from ckpt_ext import _C
from ckpt_ext._activations import REGISTRY

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float64": torch.float64}
# glibc: blocks below this come from the heap and stay there when freed (no trim below it).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 31)}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def median_s(fns, inner: int, warmup: int, repeats: int) -> list[float]:
    """Median seconds per call of each fn in fns (each sample: `inner` calls), interleaved."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times[i].append((time.perf_counter() - t0) / inner)
    return [statistics.median(t) for t in times]


def bench_case(name, shape, dtype, warmup, repeats):
    row = REGISTRY[name]
    g = torch.Generator().manual_seed(0)
    z = (3 * torch.randn(*shape, generator=g)).to(dtype)
    gy = torch.randn(*shape, generator=g).to(dtype)
    out = torch.empty_like(z)
    acc = torch.empty_like(z)
    numel = z.numel()
    inner = max(1, min(256, (1 << 22) // numel))  # ~4M elements a sample, 256 calls at most

    ours_fwd = lambda: _C._activation_(z, out, name)  # noqa: E731
    aten_fwd = lambda: row.f(z)  # noqa: E731
    aten_bwd = lambda: row.backward(gy, z)  # noqa: E731
    copy = lambda: acc.copy_(z)  # noqa: E731
    ours_bwd = lambda: (acc.copy_(z), _C._activation_backward_(acc, gy, name, False))  # noqa: E731

    f_ours, f_aten = median_s([ours_fwd, aten_fwd], inner, warmup, repeats)
    b_ours_copy, b_copy, b_aten = median_s([ours_bwd, copy, aten_bwd], inner, warmup, repeats)
    ns = 1e9 / numel
    r = {"fwd_ours_ns": f_ours * ns, "fwd_aten_ns": f_aten * ns,
         "bwd_ours_ns": max(b_ours_copy - b_copy, 0.0) * ns, "bwd_aten_ns": b_aten * ns}
    r["fwd_ratio"] = r["fwd_ours_ns"] / r["fwd_aten_ns"]
    r["bwd_ratio"] = r["bwd_ours_ns"] / r["bwd_aten_ns"]
    return r


def run_child(level: str, a) -> list[dict]:
    """The benchmark at `level` in a child process whose ATen runs at that level too."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        env = dict(os.environ, ATEN_CPU_CAPABILITY=level, CKPT_EXT_CPU_CAPABILITY=level,
                   **MALLOC_ENV)
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--json", out,
               "--levels", level, "--shapes", a.shapes, "--dtypes", a.dtypes,
               "--activations", a.activations, "--threads", a.threads,
               "--warmup", str(a.warmup), "--repeats", str(a.repeats)]
        subprocess.run(cmd, env=env, check=True)
        with open(out) as f:
            return json.load(f)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="2048x4096,64x1024", help="comma-separated MxN buffers")
    p.add_argument("--dtypes", default="float32,float64,bfloat16")
    p.add_argument("--activations", default="all", help="comma-separated, or all (ACTIVATIONS)")
    p.add_argument("--threads", default=f"1,{torch.get_num_threads()}")
    p.add_argument("--levels", default=_C._cpu_capability(),
                   help="ckpt_ext CPU levels to time, or all (every one this machine runs); "
                        "default: the level in force")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--json", default=None, help="also write the JSON here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)

    shapes = [tuple(int(d) for d in s.split("x")) for s in a.shapes.split(",")]
    dtypes = [DTYPES[d] for d in a.dtypes.split(",")]
    names = list(ckpt_ext.ACTIVATIONS) if a.activations == "all" else a.activations.split(",")
    for n in names:
        if n not in REGISTRY:
            p.error(f"activation {n!r} unknown; one of {', '.join(ckpt_ext.ACTIVATIONS)}")
    threads = sorted({int(t) for t in a.threads.split(",")})
    available = list(_C._cpu_capabilities())
    levels = available if a.levels == "all" else a.levels.split(",")
    for lv in levels:
        if lv not in available:
            p.error(f"level {lv!r} not available here; available: {', '.join(available)}")

    if not a.child:
        rows = [r for lv in levels for r in run_child(lv, a)]
    else:
        rows = []
        before = torch.get_num_threads()
        try:
            for nt in threads:
                torch.set_num_threads(nt)
                for shape in shapes:
                    for dt in dtypes:
                        for n in names:
                            r = bench_case(n, shape, dt, a.warmup, a.repeats)
                            r.update(activation=n, shape="x".join(map(str, shape)),
                                     dtype=str(dt).replace("torch.", ""), threads=nt,
                                     level=_C._cpu_capability(),
                                     aten_level=torch.backends.cpu.get_cpu_capability())
                            rows.append(r)
                            print(f"  {n:>10} {r['dtype']:>8} {r['shape']:>9} threads={nt} "
                                  f"{r['level']:>7}: fwd {r['fwd_ratio']:.2f}x "
                                  f"bwd {r['bwd_ratio']:.2f}x", flush=True)
        finally:
            torch.set_num_threads(before)
        with open(a.json, "w") as f:
            json.dump(rows, f)
        return rows

    conditions = {
        "cpu": cpu_name(), "machine": platform.machine(), "cores": os.cpu_count(),
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__, "ckpt_ext_build_torch": _C.TORCH_BUILD_VERSION,
        "warmup": a.warmup, "repeats": a.repeats,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    print()
    print(f"Benchmark conditions: {conditions['cpu']} ({conditions['machine']}, "
          f"{conditions['cores']} cores), torch {conditions['torch']}, median of {a.repeats} "
          f"samples of ~4M elements (256 calls at most) after {a.warmup} warm-up, ours and ATen's interleaved at the "
          f"row's ISA level (ATEN_CPU_CAPABILITY and CKPT_EXT_CPU_CAPABILITY); fwd: dst = f(z) "
          f"into a buffer (ours) vs the registry's f(z) (ATen); bwd: z -> gy·f'(z) in place, "
          f"recomputing f, less a copy's time (ours) vs the registry's backward(gy, z) (ATen). "
          f"{conditions['date']}.")
    print()
    print("| activation | dtype | buffer | threads | ISA level | fwd ours ns/el | fwd ATen ns/el | "
          "fwd ours/ATen | bwd ours ns/el | bwd ATen ns/el | bwd ours/ATen |")
    print("|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['activation']} | {r['dtype']} | {r['shape']} | {r['threads']} | {r['level']} | "
              f"{r['fwd_ours_ns']:.3f} | {r['fwd_aten_ns']:.3f} | {r['fwd_ratio']:.2f} | "
              f"{r['bwd_ours_ns']:.3f} | {r['bwd_aten_ns']:.3f} | "
              f"{r['bwd_ratio']:.2f} |")
    out = {"conditions": conditions, "results": rows}
    print()
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
