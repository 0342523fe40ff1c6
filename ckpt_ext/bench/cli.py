"""``python -m ckpt_ext.bench``: the flags, the configuration they give, and the files a run writes
(``<out>/<device>-<preset>.md``, ``.json`` with every raw figure, ``.png``; the plan section
``<out>/<device>-<preset>-plan.*``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch._dynamo

from ..memory import show_usage
from ..models import NETWORKS, is_pinn
from . import headline, plan_plot, plan_report, plan_section
from .orchestrate import run
from .plan_section import METHODS as PLAN_METHODS
from .plot import plot
from .presets import (BERT_WIDTHS, DEFAULT_MODES, DTYPES, HEADLINE_MODES, HEADLINE_NETWORKS,
                      MODES, PRESETS, Config, Sizes, parse_bytes)
from .report import markdown

DESCRIPTION = ("What recomputation costs and saves: the write-up's experiment, with the tools a "
               "user would pick side by side in one run.")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ckpt_ext.bench",
                                description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--preset", default=None, choices=list(PRESETS),
                   help="sizes; default writeup on CUDA, cpu-default on CPU")
    for name in ("batch", "in-features", "hidden", "depth"):
        p.add_argument(f"--{name}", type=int, default=None,
                       help="overrides the preset (chain, residual, mlp)")
    for name in ("points", "hidden", "depth"):
        p.add_argument(f"--pinn-{name}", type=int, default=None,
                       help=f"overrides the preset "
                            f"({', '.join(n for n in NETWORKS if is_pinn(n))})")
    for name in ("tokens", "depth"):
        p.add_argument(f"--bert-{name}", type=int, default=None,
                       help="overrides the preset (bert-mlp; widths 768 -> 3072 -> 768)")
    for name in ("tokens", "depth"):
        p.add_argument(f"--llama-{name}", type=int, default=None,
                       help="overrides the preset (llama-mlp, llama-lora, llama-lora-dropout; "
                            "widths the preset's)")
    for name in ("tokens", "depth"):
        p.add_argument(f"--moe-{name}", type=int, default=None,
                       help="overrides the preset (moe; widths the preset's)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per mode (preset's)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--budget", type=parse_bytes, default=None,
                   help="memory budget for the max-batch column of every network, e.g. 512MiB "
                        "(default: the preset's; bert-mlp, the llama networks and moe have "
                        "their own)")
    p.add_argument("--full", action="store_true",
                   help="the full matrix: every network and every default mode (without it: the "
                        f"README's figures, networks {','.join(HEADLINE_NETWORKS)} in modes "
                        f"{','.join(HEADLINE_MODES)})")
    p.add_argument("--networks", default=None,
                   help=f"comma-separated, from {', '.join(NETWORKS)}")
    p.add_argument("--modes", default=None,
                   help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--section", default="main", choices=("main", "plan"),
                   help="main: the networks and modes above; plan: ckpt_ext.plan against "
                        "transformers' checkpointing and torch.compile's activation_memory_budget "
                        "at budgets from plain's peak down, on an 8-layer Llama (docs/benchmark.md)")
    p.add_argument("--plan-methods", default=",".join(PLAN_METHODS),
                   help=f"--section plan: comma-separated, from {', '.join(PLAN_METHODS)} "
                        "(the plan always runs)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the compile* modes (inductor; aot_eager traces "
                        "the same graphs without code generation)")
    p.add_argument("--out", default="bench_out",
                   help="output folder (default bench_out/, untracked; the committed results "
                        "come from --out bench/results)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads for the run (default: torch's own choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    return p


def config_from_args(argv=None) -> Config:
    p = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(argv)
    if a.device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False on this machine "
                "(no NVIDIA driver or GPU, or a CPU-only torch); use --device cpu")
    preset = a.preset or ("writeup" if device.type == "cuda" else "cpu-default")
    ps = PRESETS[preset]
    sizes = Sizes(*(getattr(a, k) if getattr(a, k) is not None else ps[k]
                    for k in ("batch", "in_features", "hidden", "depth")))
    def pinn_size(flag: str, key: str) -> int:
        v = getattr(a, f"pinn_{flag}")
        return v if v is not None else ps["pinn"][key]

    pinn = Sizes(pinn_size("points", "batch"), 2, pinn_size("hidden", "hidden"),
                 pinn_size("depth", "depth"))
    bert = Sizes(a.bert_tokens if a.bert_tokens is not None else ps["bert"]["batch"],
                 BERT_WIDTHS["in_features"], BERT_WIDTHS["hidden"],
                 a.bert_depth if a.bert_depth is not None else ps["bert"]["depth"])
    pl, pm = ps["llama"], ps["moe"]
    llama = Sizes(a.llama_tokens if a.llama_tokens is not None else pl["batch"],
                  pl["in_features"], pl["hidden"],
                  a.llama_depth if a.llama_depth is not None else pl["depth"])
    moe = Sizes(a.moe_tokens if a.moe_tokens is not None else pm["batch"],
                pm["in_features"], pm["hidden"],
                a.moe_depth if a.moe_depth is not None else pm["depth"])
    steps = a.steps if a.steps is not None else ps["steps"]
    warmup = a.warmup if a.warmup is not None else ps["warmup"]
    networks = [n.strip() for n in (a.networks or ",".join(
        NETWORKS if a.full else HEADLINE_NETWORKS)).split(",") if n.strip()]
    modes = [m.strip() for m in (a.modes or ",".join(
        DEFAULT_MODES if a.full else HEADLINE_MODES)).split(",") if m.strip()]
    plan_methods = [m.strip() for m in a.plan_methods.split(",") if m.strip()]
    for m in plan_methods:
        if m not in PLAN_METHODS:
            p.error(f"--plan-methods: unknown method {m!r}; expected some of "
                    f"{', '.join(PLAN_METHODS)}")
    for n in networks:
        if n not in NETWORKS:
            p.error(f"--networks: unknown network {n!r}; expected some of {', '.join(NETWORKS)}")
    for m in modes:
        if m not in MODES:
            p.error(f"--modes: unknown mode {m!r}; expected some of {', '.join(MODES)}")
    if "plain" not in modes:
        modes.insert(0, "plain")  # the reference for time ratios, floors and gradient agreement
    for what, s in (("", sizes), ("pinn-", pinn)):
        if s.batch < 2 or s.hidden < 1 or s.depth < 1:
            p.error(f"--{what}{'points' if what else 'batch'} must be >= 2 and --{what}hidden, "
                    f"--{what}depth >= 1, got {s.batch}, {s.hidden}, {s.depth}")
    for what, s in (("bert", bert), ("llama", llama), ("moe", moe)):
        if s.batch < 2 or s.depth < 1:
            p.error(f"--{what}-tokens must be >= 2 and --{what}-depth >= 1, got {s.batch}, "
                    f"{s.depth}")
    if a.threads is not None:
        if a.threads < 1:
            p.error(f"--threads must be >= 1, got {a.threads}")
        torch.set_num_threads(a.threads)
    if steps < 1 or warmup < 0:
        p.error(f"--steps must be >= 1 and --warmup >= 0, got {steps} and {warmup}")
    return Config(device=device, dtype=DTYPES[a.dtype], preset=preset, sizes=sizes, pinn=pinn,
                  bert=bert, steps=steps, warmup=warmup,
                  budget=a.budget if a.budget is not None else parse_bytes(ps["budget"]),
                  bert_budget=(a.budget if a.budget is not None
                               else parse_bytes(ps["bert"]["budget"])),
                  llama=llama, llama_budget=(a.budget if a.budget is not None
                                             else parse_bytes(pl["budget"])),
                  moe=moe, moe_budget=(a.budget if a.budget is not None
                                       else parse_bytes(pm["budget"])),
                  networks=networks, modes=modes, out=a.out, compile_backend=a.compile_backend,
                  seed=a.seed, progress=not a.no_progress,
                  command=" ".join(["python -m ckpt_ext.bench"] + argv), section=a.section,
                  plan_methods=plan_methods)


def main(argv=None) -> int:
    cfg = config_from_args(argv)
    if cfg.device.type == "cuda":
        show_usage("GPU before the benchmark", cfg.device.index or 0)
    if cfg.section == "plan":
        return plan_main(cfg)
    t = time.perf_counter()
    results = run(cfg)
    results["conditions"]["wall_s"] = round(time.perf_counter() - t, 1)
    os.makedirs(cfg.out, exist_ok=True)
    stem = os.path.join(cfg.out, f"{cfg.device.type}-{cfg.preset}")
    table = markdown(results)
    with open(stem + ".md", "w") as f:
        f.write(table)
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1)
    written = [stem + ".md", stem + ".json"]
    if plot(results, stem + ".png"):
        written.append(stem + ".png")
    print(table)
    try:  # the README's figures block, for this run's networks
        table_only = headline.block([results]).split("\n\n")[0]  # its caption is the README's
        print("The README's figures, from this run:\n\n" + table_only + "\n")
    except KeyError:  # a mode the block reads did not run (--modes) or failed: the table has it
        pass
    errors = [f"{n}/{m}: {r['error']}" for n, modes in results["networks"].items()
              for m, r in modes.items() if "error" in r]
    if errors:  # reported in the table as n/a; said here too, so no failure goes unseen
        print("bench: modes that could not run:\n  " + "\n  ".join(errors), file=sys.stderr)
    print(f"wrote {', '.join(written)} ({results['conditions']['wall_s']} s)")
    return 0


def plan_main(cfg: Config) -> int:
    """The plan section: ``<out>/<device>-<preset>-plan.md``, ``.json`` and ``.png``."""
    t = time.perf_counter()
    torch.manual_seed(cfg.seed)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        results = plan_section.Section(
            cfg.device, cfg.dtype, cfg.preset, cfg.plan_methods, cfg.compile_backend,
            log=(lambda msg: print(msg, file=sys.stderr, flush=True)) if cfg.progress
            else (lambda msg: None)).run()
    results["conditions"] = plan_section.conditions(cfg)
    results["conditions"]["wall_s"] = round(time.perf_counter() - t, 1)
    os.makedirs(cfg.out, exist_ok=True)
    stem = os.path.join(cfg.out, f"{cfg.device.type}-{cfg.preset}-plan")
    table = plan_report.markdown(results)
    with open(stem + ".md", "w") as f:
        f.write(table)
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1)
    written = [stem + ".md", stem + ".json"]
    if plan_plot.plot(results, stem + ".png"):
        written.append(stem + ".png")
    print(table)
    print(f"wrote {', '.join(written)} ({results['conditions']['wall_s']} s)")
    return 0
