"""Step times of a benchmark results file read in its uncontended steps: on a machine whose cores
other jobs take now and then, a mode's steps fall into two groups (the slow ones 2.5-4x the
others), and the file's medians mix them. Per mode this prints the file's median, its fastest step,
and the median of its steps within --within (default 1.5) times its fastest, with how many steps
that is; the floor (plain + the GEMMs the mode recomputes) and the ratios to plain, checkpoint and
the floor read the same way. Input: a .json that python -m ckpt_ext.bench wrote.

    python scripts/bench_uncontended.py bench/results/llama-lora/cpu-cpu-default.json

docs/benchmark.md ("LoRA on a gated MLP", "A mixture of experts") reads its output.
"""
from __future__ import annotations

import argparse
import json
import statistics


def uncontended(times: list[float], within: float) -> tuple[float, int]:
    """The median of the times within ``within`` x the fastest, and how many they are."""
    fast = [t for t in times if t <= within * min(times)]
    return statistics.median(fast), len(fast)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", help="a .json written by python -m ckpt_ext.bench")
    p.add_argument("--within", type=float, default=1.5)
    a = p.parse_args(argv)
    res = json.load(open(a.results))
    for net, modes in res["networks"].items():
        rows = {m: r for m, r in modes.items() if "step_ms_all" in r}
        fast = {m: uncontended(r["step_ms_all"], a.within) for m, r in rows.items()}
        plain = fast["plain"][0]
        print(f"\n{net} (uncontended: steps within {a.within}x the mode's fastest)\n")
        print("| mode | median, file | fastest | uncontended (n) | × plain | × checkpoint "
              "| floor | × floor |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for m, r in rows.items():
            t, n = fast[m]
            vs_ckpt = f"{t / fast['checkpoint'][0]:.2f}" if "checkpoint" in fast else "–"
            floor = vs_floor = "–"
            if r.get("recompute_ms_all"):
                f = plain + uncontended(r["recompute_ms_all"], a.within)[0]
                floor, vs_floor = f"{f:.0f}", f"{t / f:.2f}"
            print(f"| {m} | {r['step_ms']:.0f} | {min(r['step_ms_all']):.0f} | {t:.0f} ({n}) "
                  f"| {t / plain:.2f} | {vs_ckpt} | {floor} | {vs_floor} |")


if __name__ == "__main__":
    main()
