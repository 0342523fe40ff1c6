"""The README's status figures, generated from committed benchmark results (bench/results/*.json):
per network and preset, what the fused mode keeps and peaks at against plain, its step time against
stock checkpoint and torch.compile of it, and the batch that fits the budget.

    python -m ckpt_ext.bench.headline --write README.md   # rewrite the block between the markers
    python -m ckpt_ext.bench.headline --check README.md   # exit 1 where the README differs
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .report import fmt_bytes

BEGIN = "<!-- headline:begin (python -m ckpt_ext.bench.headline --write README.md) -->"
END = "<!-- headline:end -->"
#: The committed runs the block is made of, in order.
RESULTS = ("bench/results/cpu-cpu-default.json", "bench/results/cpu-small.json")
#: The stock checkpoint a network's fused mode is compared with: the chain's whole stack.
STOCK = {"chain": "checkpoint-stack"}


def _ratio(a: dict, b: dict) -> str:
    if a.get("time_vs_plain") is None or b.get("time_vs_plain") is None:
        return "n/a"
    return f"{a['time_vs_plain'] / b['time_vs_plain']:.2f}×"


def _share(fused: float, plain: float) -> str:
    return f"{fmt_bytes(fused)} vs {fmt_bytes(plain)} ({100 * fused / plain:.0f} %)"


def block(results: list[dict]) -> str:
    """The markdown between the markers, from the results dicts of :data:`RESULTS`."""
    lines = ["| preset | network | kept for backward, fused vs plain | peak, fused vs plain "
             "| step time, fused × stock checkpoint | fused × compiled checkpoint "
             "| max batch in budget, fused vs plain |",
             "|---|---|---|---|---:|---:|---:|"]
    for res in results:
        preset = res["conditions"]["preset"]
        for net, modes in res["networks"].items():
            fused, plain = modes["fused"], modes["plain"]
            stock = modes[STOCK.get(net, "checkpoint")]
            compiled = modes.get("compile-checkpoint", {})
            lines.append(
                f"| {preset} | {net} | {_share(fused['kept_for_backward'], plain['kept_for_backward'])}"
                f" | {_share(fused['peak_above_before_forward'], plain['peak_above_before_forward'])}"
                f" | {_ratio(fused, stock)} | {_ratio(fused, compiled)}"
                f" | {fused['max_batch']:,} vs {plain['max_batch']:,} |")
    c = results[0]["conditions"]
    lines += ["", f"{c['device']}, {c['dtype']}, torch {c['torch']}; one run per preset "
              f"(`{c['command']}`, and `--preset small`), times as ratios of medians within the "
              "run; memory in exact bytes. Sizes, method and every table: "
              "[docs/benchmark.md](docs/benchmark.md)."]
    return "\n".join(lines)


def load(root: str) -> list[dict]:
    out = []
    for rel in RESULTS:
        with open(os.path.join(root, rel)) as f:
            out.append(json.load(f))
    return out


def replace(text: str, new_block: str) -> str:
    """``text`` with the block between the markers replaced; ValueError without both markers."""
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise ValueError(f"the README needs the lines {BEGIN!r} and {END!r}")
    return text[:i + len(BEGIN)] + "\n" + new_block + "\n" + text[j:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckpt_ext.bench.headline",
                                description="The README's status figures from bench/results.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--write", metavar="README", help="rewrite the block in this file")
    what.add_argument("--check", metavar="README", help="exit 1 if this file's block differs")
    a = p.parse_args(argv)
    path = a.write or a.check
    root = os.path.dirname(os.path.abspath(path))
    with open(path) as f:
        text = f.read()
    new = replace(text, block(load(root)))
    if a.write:
        with open(path, "w") as f:
            f.write(new)
        return 0
    if new != text:
        print(f"{path}: the figures block differs from {', '.join(RESULTS)}; run "
              f"python -m ckpt_ext.bench.headline --write {path}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
