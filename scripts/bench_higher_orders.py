"""The physics-informed step (ckpt_ext.models.PINNNet: u, u_t and u_xx by create_graph, then the
parameters' gradient, the third order) per activation, fused with the higher orders' products in
one pass (``_C._activation_terms``, as the package runs it) against the same formulas made of one
derivative pass per order and ATen products (``split``: _Input.terms' branch for tensors the
kernel cannot read, taken for every tensor), and against stock autograd (``plain``).
Steps interleaved in one process, medians; glibc's mmap threshold raised first (a child process),
so that no mode pays page faults the others do not (docs/benchmark.md, "Where the remaining time
goes"). ``--points`` small gives the step's fixed cost: what the Python nodes of the orders above
cost where the kernels cost next to nothing (docs/design.md, "Other activations").

    python scripts/bench_higher_orders.py                      # sin, silu, gelu; 4096 points
    python scripts/bench_higher_orders.py --points 16 --activations sin
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 31)}


def run(args) -> list:
    """Prints the table; returns one row per activation: medians (ms) by mode, and the largest
    relative difference between the parameters' gradients of the two fused forms."""
    import torch

    import ckpt_ext._mlp_higher_order as higher
    from ckpt_ext.models import PINNNet

    threads, kernel_reads = torch.get_num_threads(), higher._like
    torch.set_num_threads(args.threads)
    try:
        return _table(args, torch, higher, PINNNet)
    finally:
        torch.set_num_threads(threads)
        higher._like = kernel_reads


def _table(args, torch, higher, PINNNet) -> list:
    kernel_reads = higher._like
    split = (lambda t, p: False)  # the kernel reads nothing: _Input.terms' per-order branch
    print(f"torch {torch.__version__}, {args.threads} threads, {args.points} points, "
          f"2 -> {args.hidden}x{args.depth} -> 1, float32, {args.steps} steps each, medians (ms)")
    print("| activation | plain | fused, one pass | fused, split | one pass × plain | "
          "split × plain | one pass × split |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for act in args.activations:
        torch.manual_seed(0)
        plain = PINNNet(hidden=args.hidden, depth=args.depth, mode="plain", activation=act)
        fused = PINNNet(hidden=args.hidden, depth=args.depth, mode="fused", activation=act)
        fused.load_state_dict(plain.state_dict())
        pts = PINNNet.points(args.points, torch.Generator().manual_seed(1))
        times = {"plain": [], "one pass": [], "split": []}
        grads = {}
        for i in range(args.warmup + args.steps):
            for mode in times:
                higher._like = split if mode == "split" else kernel_reads
                net = plain if mode == "plain" else fused
                t0 = time.perf_counter()
                net.zero_grad(set_to_none=True)
                net.loss(net(pts), pts).backward()
                if i >= args.warmup:
                    times[mode].append(time.perf_counter() - t0)
                grads[mode] = [q.grad.clone() for q in net.parameters()]
        higher._like = kernel_reads
        diff = max(((a - b).norm() / b.norm()).item()
                   for a, b in zip(grads["one pass"], grads["split"]))
        m = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        rows.append({"activation": act, "ms": m, "grad_rel_diff": diff})
        print(f"| {act} | {m['plain']:.2f} | {m['one pass']:.2f} | {m['split']:.2f} | "
              f"{m['one pass'] / m['plain']:.2f} | {m['split'] / m['plain']:.2f} | "
              f"{m['one pass'] / m['split']:.2f} |")
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--activations", nargs="+", default=["sin", "silu", "gelu"])
    ap.add_argument("--points", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        run(args)
        return
    argv = sys.argv[1:] if argv is None else list(argv)
    env = {**os.environ, **MALLOC_ENV}
    sys.exit(subprocess.call([sys.executable, __file__, *argv, "--child"], env=env))


if __name__ == "__main__":
    main()
