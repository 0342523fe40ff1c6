"""What each mode of the benchmark's residual network holds at its step's peak: every allocation
alive at that moment, with its size and the op that made it (torch.profiler's allocation events,
which carry the allocating op), and the tensors autograd saved (saved_tensors_hooks). The peak is
cross-checked against ckpt_ext.memory.measured_step's exact figure. With --time, afterwards and
without the meter, fused and compile-checkpoint alternate in blocks of 5 steps: medians of
forward + loss, backward and the step, and their ratio. CPU, float32.

    python scripts/residual_peak.py                        # cpu-default sizes, every mode
    python scripts/residual_peak.py --preset small --modes fused,compile-checkpoint --time 6

docs/benchmark.md ("Residual network against compile + checkpoint") reads its output.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Optional

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from ckpt_ext.bench.measure import share_parameters
from ckpt_ext.bench.presets import MODES, PRESETS, model_mode
from ckpt_ext.memory import MemoryMeter, clear_grads, measured_step
from ckpt_ext.models import ResidualNet

MIB = 2 ** 20


def build(modes: list[str], in_features: int, hidden: int, depth: int
          ) -> tuple[ResidualNet, dict]:
    """Plain, and one model per mode on plain's weights, as the benchmark builds them."""
    plain = ResidualNet(in_features, hidden, depth, mode="plain")
    nets = {}
    for mode in modes:
        net, built = plain, model_mode("residual", mode)
        if built != "plain":
            net = ResidualNet(in_features, hidden, depth, mode=built, device="meta")
            share_parameters(plain, net)
        nets[mode] = (torch.compile(net, fullgraph=True, dynamic=False) if MODES[mode].compiled
                      else net)
    return plain, nets


def allocations(prof) -> list[tuple[int, int, int, str]]:
    """(time, pointer, bytes (negative: a free), allocating op chain) in time order."""
    out = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    parents: dict[int, list[str]] = {id(n): [] for n in stack}
    while stack:
        node = stack.pop()
        path = parents.pop(id(node))
        if node.typed[0] == _EventType.Allocation:
            a = node.typed[1]
            ops = [p for p in path if not p.startswith(("[", "## Call", "Torch-Compiled"))]
            out.append((node.start_time_ns, a.ptr, a.alloc_size, " > ".join(ops[-3:])))
        for child in node.children:
            parents[id(child)] = path + [node.name]
            stack.append(child)
    return sorted(out)


def alive_at_peak(allocs) -> tuple[int, list[tuple[int, str, int]]]:
    """The highest sum of bytes allocated and not yet freed, and what was alive then
    (bytes, op, index of the allocation)."""
    live: dict[int, tuple[int, str, int]] = {}
    cur = peak = 0
    at_peak: list = []
    for i, (_, ptr, nbytes, op) in enumerate(allocs):
        if nbytes > 0:
            live[ptr] = (nbytes, op, i)
            cur += nbytes
        elif ptr in live:
            cur -= live.pop(ptr)[0]
        if cur > peak:
            peak, at_peak = cur, sorted(live.values(), key=lambda v: v[2])
    return peak, at_peak


def step_at_peak(net, x: torch.Tensor, plain: ResidualNet, meter: MemoryMeter) -> dict:
    """One measured step of ``net`` (exact figures), then one profiled step: the allocations
    alive at its peak as (bytes, allocating op, saved by autograd), and the saved activations'
    shapes."""
    for _ in range(2):  # compiles, lazy initialisation
        net(x).mean().backward()
        clear_grads(plain)
    exact = measured_step(net, x, meter)
    clear_grads(plain)
    not_activations = {q.untyped_storage().data_ptr() for q in plain.parameters()}
    not_activations.add(x.untyped_storage().data_ptr())
    saved: dict[int, tuple] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in not_activations:
            saved.setdefault(ptr, tuple(t.shape))
        return t

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = net(x)
        loss = out.mean()
        del out
        loss.backward()
    del loss
    clear_grads(plain)
    allocs = allocations(prof)
    peak, alive = alive_at_peak(allocs)
    return {"kept": exact["kept_for_backward"], "peak": exact["peak_above_before_forward"],
            "profiled_peak": peak, "saved": list(saved.values()),
            "alive": [(nbytes, op, allocs[i][1] in saved) for nbytes, op, i in alive]}


def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu-default", choices=("tiny", "small", "cpu-default"))
    ap.add_argument("--modes", default="plain,checkpoint,compile,compile-checkpoint,fused,"
                    "compile-fused")
    ap.add_argument("--time", type=int, default=0, metavar="ROUNDS",
                    help="then time fused against compile-checkpoint, ROUNDS blocks of 5 steps each")
    args = ap.parse_args(argv)
    p = PRESETS[args.preset]
    torch.manual_seed(0)
    modes = args.modes.split(",")
    results = {}
    with MemoryMeter("cpu") as meter:
        plain, nets = build(modes, p["in_features"], p["hidden"], p["depth"])
        x = torch.randn(p["batch"], p["in_features"])
        print(f"residual, preset {args.preset}: batch {p['batch']}, {p['in_features']} -> "
              f"{p['hidden']}, depth {p['depth']}; torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads")
        for mode in modes:
            r = results[mode] = step_at_peak(nets[mode], x, plain, meter)
            print(f"\n{mode}: kept {r['kept'] / MIB:.2f} MiB, peak {r['peak'] / MIB:.2f} MiB above "
                  f"before forward (profiler: {r['profiled_peak'] / MIB:.2f}); saved "
                  f"activations: {', '.join(str(s) for s in r['saved']) or 'none'}")
            for nbytes, op, is_saved in r["alive"]:
                if nbytes >= 1024:
                    print(f"  {nbytes / MIB:7.3f} MiB  {'saved ' if is_saved else ''}{op}")
    if args.time:  # fresh models, built without the meter
        time_pair(*build(["fused", "compile-checkpoint"], p["in_features"], p["hidden"],
                         p["depth"]), x, args.time)
    return results


def time_pair(plain, nets: dict, x: torch.Tensor, rounds: int, block: int = 5) -> None:
    """fused and compile-checkpoint in alternating blocks of ``block`` steps (the first step
    after a switch is not counted: inductor's OpenMP threads may still be spinning)."""
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in nets}

    def step(net) -> tuple[float, float]:
        t0 = time.perf_counter()
        loss = net(x).mean()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        clear_grads(plain)
        return t1 - t0, t2 - t1

    for net in nets.values():  # compiles
        step(net)
    for _ in range(rounds):
        for mode, net in nets.items():
            step(net)
            times[mode] += [step(net) for _ in range(block)]
    med = {m: [statistics.median(v) for v in ([f for f, _ in t], [b for _, b in t],
                                              [f + b for f, b in t])] for m, t in times.items()}
    print(f"\ntimes, {rounds * block} steps each, medians (ms): forward + loss, backward, step")
    for mode, (f, b, s) in med.items():
        print(f"  {mode:20s} {f * 1e3:8.2f} {b * 1e3:8.2f} {s * 1e3:8.2f}")
    print(f"  fused / compile-checkpoint: {med['fused'][2] / med['compile-checkpoint'][2]:.3f}")


if __name__ == "__main__":
    main()
