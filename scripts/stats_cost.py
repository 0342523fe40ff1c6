"""What counting each fused unit's calls (ckpt_ext.stats) costs a training step: a fused
transformers Llama stepped with counting on and off, interleaved, in one run; and one count's cost
alone. Prints a markdown table with its conditions (docs/benchmark.md, "What counting costs").

    python scripts/stats_cost.py [--layers 4] [--hidden 512] [--tokens 2x512] [--steps 15]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--tokens", default="2x512")
    ap.add_argument("--steps", type=int, default=15)
    args = ap.parse_args()
    import transformers as t
    import ckpt_ext
    from ckpt_ext.convert import fallback

    cfg = t.LlamaConfig(vocab_size=1000, hidden_size=args.hidden,
                        intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
                        num_attention_heads=8, num_key_value_heads=4,
                        max_position_embeddings=4096, use_cache=False)
    torch.manual_seed(0)
    model = t.LlamaModel(cfg)
    model, report = ckpt_ext.fuse(model)
    batch, seq = map(int, args.tokens.split("x"))
    ids = torch.randint(0, 1000, (batch, seq))

    def step() -> float:
        t0 = time.perf_counter()
        model(ids).last_hidden_state.mean().backward()
        return time.perf_counter() - t0

    counting_fused = fallback.UnitStats.fused
    times = {"on": [], "off": []}
    step()  # warm-up
    # in pairs, each pair's order the other way round from the last (on off, off on, ...): the
    # first step of a pair runs ~3 % slower here whichever way it counts
    for i in range(2 * args.steps):
        mode = "on" if (i % 2 == 0) == (i // 2 % 2 == 0) else "off"
        fallback.UnitStats.fused = counting_fused if mode == "on" else (lambda self: None)
        times[mode].append(step())
    fallback.UnitStats.fused = counting_fused
    stats = ckpt_ext.stats(model)
    assert stats.unfused_calls == 0 and all(s.fused_calls == args.steps + 1 for s in stats), \
        str(stats)

    one = stats[0]
    n = 1_000_000
    t0 = time.perf_counter()
    for _ in range(n):
        one.fused()
    per_count = (time.perf_counter() - t0) / n

    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, CPU; "
          f"transformers LlamaModel hidden {args.hidden}, {args.layers} layers "
          f"({len(report)} fused units), {batch}x{seq} tokens; median of {args.steps} steps "
          f"each way, in pairs of alternating order\n")
    print("| counting | step (median) | x counting off |\n|---|---:|---:|")
    print(f"| off | {off * 1e3:.1f} ms | 1.000x |")
    print(f"| on | {on * 1e3:.1f} ms | {on / off:.3f}x |")
    print(f"\none count (UnitStats.fused, {n:,} calls): {per_count * 1e9:.0f} ns; "
          f"{len(report)} per step: {len(report) * per_count / off * 100:.5f} % of the step")


if __name__ == "__main__":
    main()
