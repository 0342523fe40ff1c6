"""Transformers' gradient checkpointing with `fuse`, on or off: a peft LoRA Llama (frozen base,
r=16 on all seven projections) stepped four ways side by side in one run: plain, checkpointing,
fused, fused inside checkpointing. Prints, per way, what the step keeps for backward and its peak
(CPU allocator meter, one step) and the median step time (separate steps, no meter installed).

    PYTHONPATH=$PWD .venv/bin/python scripts/checkpointing_choice.py [--layers 4 --seq 512 ...]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ckpt_ext import fuse  # noqa: E402
from ckpt_ext.memory import MemoryMeter, clear_grads, measured_step  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model(args, checkpointing: bool, fused: bool):
    import transformers as t
    from peft import LoraConfig, get_peft_model
    cfg = t.LlamaConfig(vocab_size=1000, hidden_size=args.hidden, intermediate_size=args.inter,
                        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                        num_key_value_heads=args.hidden // 128, head_dim=64,
                        max_position_embeddings=args.seq, attn_implementation="sdpa")
    torch.manual_seed(0)
    m = t.LlamaModel(cfg)
    m = get_peft_model(m, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS,
                                     lora_dropout=args.dropout))
    if checkpointing:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.train()
    if fused:
        report = fuse(m)[1]
        assert len(report) == args.layers, report
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=1408)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(3)
    ids = torch.randint(1, 1000, (args.batch, args.seq))
    ways = {"plain": (False, False), "checkpointing": (True, False),
            "fused": (False, True), "fused inside checkpointing": (True, True)}
    nets = {name: model(args, *how) for name, how in ways.items()}

    def step(net, x=ids):
        return net(input_ids=x).last_hidden_state

    rows = {}
    for name, net in nets.items():
        with MemoryMeter("cpu") as meter:
            clear_grads(net)
            r = measured_step(lambda x: step(net, x), ids, meter)
        rows[name] = {"kept": r["kept_for_backward"], "peak": r["peak_above_before_forward"],
                      "times": []}
    for _ in range(args.steps):  # interleaved, so shared-machine load hits every way alike
        for name, net in nets.items():
            clear_grads(net)
            t0 = time.perf_counter()
            step(net).mean().backward()
            rows[name]["times"].append(time.perf_counter() - t0)
    base = statistics.median(rows["plain"]["times"])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, CPU; Llama "
          f"hidden {args.hidden}, MLP {args.inter}, {args.layers} layers, {args.batch}x{args.seq} "
          f"tokens; peft LoRA r=16 on {', '.join(TARGETS)}, dropout {args.dropout}, bases frozen; "
          f"median of {args.steps} steps")
    print("| way | kept for backward | peak of a step | step time | vs plain |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        t = statistics.median(r["times"])
        print(f"| {name} | {r['kept'] / 2**20:,.1f} MiB | {r['peak'] / 2**20:,.1f} MiB | "
              f"{t * 1e3:,.0f} ms | {t / base:.2f}x |")


if __name__ == "__main__":
    main()
