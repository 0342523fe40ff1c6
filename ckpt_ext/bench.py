"""What recomputation costs and saves: the write-up's experiment, for stock checkpointing and ours.

    python -m ckpt_ext.bench                      # CUDA: the write-up's sizes; CPU: a 5-minute default
    python -m ckpt_ext.bench --preset writeup     # the write-up's sizes on any device
    python -m ckpt_ext.bench --preset tiny --out /tmp/b

For each network (the write-up's chain ``Net``, ``ResidualNet``, ``MLPNet``) and mode (plain,
checkpoint non-reentrant and reentrant, fused, ``torch.compile`` of plain) it measures one training
step (forward, ``loss = output.mean()``, backward):

* the write-up's four readings — before forward, after forward, after loss, after backward — in
  tensor bytes (CPU: exact, counted by ckpt_ext's allocator wrapper; CUDA: memory_allocated).
  The output is dropped after the loss, so "after loss" shows what autograd keeps for backward;
* activations alive after forward (after forward − before forward, the output included) and kept
  for backward (after loss − before forward − the loss itself);
* the peak in forward+backward, above "before forward" and absolute;
* the step time: median of ``--steps`` steps after warm-up, all modes interleaved in one loop, and
  its ratio to plain;
* gradient agreement with plain: max over parameters of ||g − g_plain|| / ||g_plain||;
* the largest batch whose peak fits ``--budget``, from the peaks at two batch sizes (every tensor
  of a step here scales with the batch, so the peak is a straight line in it).

It writes ``<out>/<device>-<preset>.md`` (the table, conditions above it), ``.json`` (raw figures,
timelines included) and ``.png`` (memory through one step per mode, overlaid, peaks marked).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from .memory import MemoryMeter, show_usage
from .models import NETWORKS

PRESETS = {
    # Seconds on a laptop core: for tests and a first look.
    "tiny": dict(batch=16, in_features=32, hidden=64, depth=3, steps=3, warmup=1,
                 budget="8MiB"),
    # About 3-4 minutes on 2 shared CPU cores, torch.compile included. A wide batch and a narrow
    # hidden size, so that activations (batch x hidden) outweigh the weights, as they do in
    # training at scale; with hidden >> batch the weights and their gradients fill the peak
    # whatever the mode.
    "cpu-default": dict(batch=1024, in_features=1024, hidden=512, depth=3, steps=7, warmup=2,
                        budget="512MiB"),
    # The write-up: input (512, 1024), linear1 1024 -> 10240, three 10240 x 10240 blocks.
    "writeup": dict(batch=512, in_features=1024, hidden=10240, depth=3, steps=10, warmup=3,
                    budget="40GiB"),
}

# mode name -> (model mode, use_reentrant, compiled)
MODES = {
    "plain": ("plain", False, False),
    "checkpoint": ("checkpoint", False, False),
    "checkpoint-reentrant": ("checkpoint", True, False),
    "fused": ("fused", False, False),
    "compile": ("plain", False, True),
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}

READINGS = ("before forward", "after forward", "after loss", "after backward")


def parse_bytes(s: str) -> int:
    """'512MiB', '40GiB', '1.5GB', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", s, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"budget must look like 512MiB, 40GiB or a byte count, "
                                         f"got {s!r}")
    value, unit, binary = m.groups()
    power = "KMGT".find(unit.upper()) + 1 if unit else 0
    return int(float(value) * (1024 if binary or not unit else 1000) ** power)


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "n/a"
    if abs(n) < 2**20:
        return f"{n / 2**10:,.1f} KiB"
    return f"{n / 2**20:,.2f} MiB"


# ------------------------------------------------------------------------------------------------
# One step, measured

def share_parameters(src: nn.Module, dst: nn.Module) -> None:
    """Make ``dst`` use ``src``'s Parameter objects (same names in every mode), so all modes run
    on one set of weights and only one set is held in memory."""
    for name, p in src.named_parameters():
        owner, _, attr = name.rpartition(".")
        setattr(dst.get_submodule(owner) if owner else dst, attr, p)


def clear_grads(net: nn.Module) -> None:
    for p in net.parameters():
        p.grad = None


def measured_step(net: Callable, x: torch.Tensor, meter: MemoryMeter,
                  timeline: bool = False) -> dict:
    """One step with the write-up's four readings, the peak and (optionally) the timeline.
    Gradients must be cleared before: "before forward" then holds weights and input only."""
    meter.readings.clear()
    r0 = meter.read("before forward")
    meter.reset_peak()
    t_ns = {}
    with meter.timeline() if timeline else contextlib.nullcontext():
        out = net(x)
        r1 = meter.read("after forward")
        loss = out.mean()
        loss_bytes = loss.numel() * loss.element_size()
        del out  # what is left is what autograd keeps for backward
        r2 = meter.read("after loss")
        t_ns["backward"] = meter.now_ns()
        loss.backward()
        r3 = meter.read("after backward")
    peak = meter.peak()
    res = {
        "readings": {r.label: r.bytes for r in (r0, r1, r2, r3)},
        "activations_after_forward": r1.bytes - r0.bytes,
        "kept_for_backward": r2.bytes - r0.bytes - loss_bytes,
        "peak": peak,
        "peak_above_before_forward": peak - r0.bytes,
        "loss": float(loss.detach().float()),
    }
    if timeline and meter.last_timeline is not None:
        tl = meter.last_timeline
        start = tl.t_ns[0]
        res["timeline"] = {
            "t_ms": [(t - start) / 1e6 for t in tl.t_ns],
            "bytes_above_before_forward": [b - r0.bytes for b in tl.bytes],
            "backward_starts_ms": (t_ns["backward"] - start) / 1e6,
            "exact": tl.exact,
        }
    return res


def timed_step(net: Callable, x: torch.Tensor, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    net(x).mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t


def grad_errors(net: nn.Module, ref: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for name, p in net.named_parameters():
        if p.grad is None:
            return math.inf
        g, r = p.grad.double(), ref[name].double()
        err = float((g - r).norm() / r.norm().clamp_min(1e-300))
        worst = max(worst, err if math.isfinite(err) else math.inf)
    return worst


# ------------------------------------------------------------------------------------------------
# The run

@dataclass
class Config:
    device: torch.device
    dtype: torch.dtype
    preset: str
    batch: int
    in_features: int
    hidden: int
    depth: int
    steps: int
    warmup: int
    budget: int
    networks: list[str]
    modes: list[str]
    out: str
    seed: int = 0
    progress: bool = True


class _PlainProgress:
    """Stand-in for tqdm where it is not installed (e.g. an offline GPU machine): a line per
    network on stderr, so the run still shows where it is."""

    def __init__(self, total: int, disable: bool = False, **_) -> None:
        self.total, self.n, self.disable = total, 0, disable

    def update(self, k: int = 1) -> None:
        self.n += k

    def set_postfix_str(self, text: str) -> None:
        if not self.disable:
            print(f"bench: {self.n}/{self.total} {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self.set_postfix_str("done")


def run(cfg: Config) -> dict:
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = _PlainProgress

    meter = MemoryMeter(cfg.device)
    meter.start()
    torch.manual_seed(cfg.seed)
    results: dict = {"conditions": conditions(cfg), "networks": {}}
    # memory, fit, warm-up, steps, agreement: one tick each per mode
    total = len(cfg.networks) * len(cfg.modes) * (3 + cfg.warmup + cfg.steps + 1)
    bar = tqdm(total=total, desc="bench", disable=not cfg.progress, file=sys.stderr,
               dynamic_ncols=True)
    try:
        for net_name in cfg.networks:
            bar.set_postfix_str(net_name)
            results["networks"][net_name] = run_network(cfg, net_name, meter, bar)
    finally:
        bar.close()
        meter.stop()
    return results


def run_network(cfg: Config, net_name: str, meter: MemoryMeter, bar) -> dict:
    cls = NETWORKS[net_name]
    kw = dict(in_features=cfg.in_features, hidden=cfg.hidden, depth=cfg.depth,
              device=cfg.device, dtype=cfg.dtype)
    gen = torch.Generator().manual_seed(cfg.seed)
    plain = cls(mode="plain", **kw)
    nets: dict[str, Callable] = {}
    failed: dict[str, str] = {}
    for mode in cfg.modes:
        model_mode, reentrant, compiled = MODES[mode]
        if compiled:
            nets[mode] = torch.compile(plain)
        elif model_mode == "plain" and not reentrant:
            nets[mode] = plain
        else:
            # Built on the meta device: no second set of weights is ever allocated.
            net = cls(mode=model_mode, use_reentrant=reentrant,
                      **{**kw, "device": torch.device("meta")})
            share_parameters(plain, net)
            nets[mode] = net

    def x_of(batch: int) -> torch.Tensor:
        return torch.randn(batch, cfg.in_features, generator=gen).to(cfg.device, cfg.dtype)

    x = x_of(cfg.batch)
    x_half = x[: max(1, cfg.batch // 2)].clone()
    res: dict = {mode: {} for mode in cfg.modes}

    def guarded(mode: str, fn: Callable[[], None]) -> None:
        if mode in failed:
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported as n/a (reason), e.g. compile failing
            failed[mode] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            res[mode] = {"error": failed[mode]}

    def settle() -> None:
        clear_grads(plain)
        gc.collect()

    # Warm-up first (compiles, lazy initialisation, allocator caches), so none of it is measured.
    for _ in range(cfg.warmup):
        for mode in cfg.modes:
            settle()
            guarded(mode, lambda: timed_step(nets[mode], x, cfg.device))
            bar.update(1)

    # Memory: one step per mode with readings and timeline, one more at half the batch for the fit.
    for mode in cfg.modes:
        def mem():
            settle()
            res[mode].update(measured_step(nets[mode], x, meter, timeline=True))
            settle()
            half = measured_step(nets[mode], x_half, meter)
            res[mode]["peak_half_batch"] = half["peak"]
        guarded(mode, mem)
        bar.update(2)
    settle()

    # Time: modes interleaved, so drifts in machine load hit every mode alike.
    times: dict[str, list[float]] = {m: [] for m in cfg.modes}
    for _ in range(cfg.steps):
        for mode in cfg.modes:
            settle()
            guarded(mode, lambda: times[mode].append(timed_step(nets[mode], x, cfg.device)))
            bar.update(1)

    # Gradient agreement with plain on the same weights and input.
    settle()
    plain(x).mean().backward()
    ref = {n: p.grad.detach().clone() for n, p in plain.named_parameters()}
    for mode in cfg.modes:
        def agree():
            settle()
            nets[mode](x).mean().backward()
            res[mode]["grad_rel_err"] = grad_errors(plain, ref)
        guarded(mode, agree)
        bar.update(1)
    del ref
    settle()

    plain_ms = statistics.median(times["plain"]) * 1e3 if times.get("plain") else None
    for mode in cfg.modes:
        r = res[mode]
        if mode in failed:
            r["error"] = failed[mode]
            continue
        r["step_ms_all"] = [t * 1e3 for t in times[mode]]
        r["step_ms"] = statistics.median(times[mode]) * 1e3
        r["time_vs_plain"] = r["step_ms"] / plain_ms if plain_ms else None
        r.update(max_batch(cfg, r["peak"], r["peak_half_batch"], x_half.shape[0]))
    return res


def max_batch(cfg: Config, peak_full: int, peak_half: int, half: int) -> dict:
    per_sample = (peak_full - peak_half) / (cfg.batch - half) if cfg.batch > half else None
    if not per_sample or per_sample <= 0:
        return {"per_sample_bytes": per_sample, "fixed_bytes": None, "max_batch": None}
    fixed = peak_full - per_sample * cfg.batch
    fit = math.floor((cfg.budget - fixed) / per_sample)
    return {"per_sample_bytes": per_sample, "fixed_bytes": fixed, "max_batch": max(fit, 0)}


# ------------------------------------------------------------------------------------------------
# Report

def conditions(cfg: Config) -> dict:
    dev = str(cfg.device)
    if cfg.device.type == "cuda":
        dev += f" ({torch.cuda.get_device_name(cfg.device)})"
    else:
        dev += (f" ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                f"{torch.get_num_threads()} torch threads, {torch.backends.cpu.get_cpu_capability()})")
    return {
        "device": dev, "dtype": str(cfg.dtype).replace("torch.", ""), "preset": cfg.preset,
        "batch": cfg.batch, "in_features": cfg.in_features, "hidden": cfg.hidden,
        "depth": cfg.depth, "mlp_ratio": 4, "steps": cfg.steps, "warmup": cfg.warmup,
        "budget_bytes": cfg.budget, "torch": torch.__version__, "python": platform.python_version(),
        "memory_meter": ("exact bytes of every CPU tensor allocation (ckpt_ext counting allocator)"
                         if cfg.device.type == "cpu" else "torch.cuda.memory_allocated / "
                         "max_memory_allocated (512-byte blocks)"),
    }


def markdown(results: dict) -> str:
    c = results["conditions"]
    lines = [
        f"Benchmark conditions: {c['device']}, {c['dtype']}, torch {c['torch']}, batch "
        f"{c['batch']}, in_features {c['in_features']}, hidden {c['hidden']}, depth "
        f"{c['depth']} (MLP inner {c['mlp_ratio']}×hidden), step time = median of {c['steps']} "
        f"steps after {c['warmup']} warm-up, modes interleaved; memory = {c['memory_meter']}; "
        f"budget {fmt_bytes(c['budget_bytes'])}.",
        "",
        "| network | mode | before fwd | after fwd | after loss | after bwd | activations after "
        "fwd | kept for bwd | peak fwd+bwd (above before fwd) | step ms | × plain | grad rel err "
        "| max batch in budget |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for net_name, modes in results["networks"].items():
        for mode, r in modes.items():
            if "error" in r:
                lines.append(f"| {net_name} | {mode} | n/a ({r['error']}) |" + " |" * 11)
                continue
            rd = r["readings"]
            ratio = f"{r['time_vs_plain']:.2f}" if r.get("time_vs_plain") else "n/a"
            mb = r.get("max_batch")
            lines.append(
                f"| {net_name} | {mode} | " + " | ".join(fmt_bytes(rd[k]) for k in READINGS)
                + f" | {fmt_bytes(r['activations_after_forward'])}"
                f" | {fmt_bytes(r['kept_for_backward'])}"
                f" | {fmt_bytes(r['peak_above_before_forward'])}"
                f" | {r['step_ms']:.1f} | {ratio} | {r['grad_rel_err']:.1e}"
                f" | {mb if mb is not None else 'n/a'} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: str) -> bool:
    """Writes the PNG; False (and a message) where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print("bench: matplotlib is not installed; no plot written (pip install matplotlib)",
              file=sys.stderr)
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nets = results["networks"]
    fig, axes = plt.subplots(len(nets), 1, figsize=(9, 3.6 * len(nets)), squeeze=False)
    c = results["conditions"]
    for ax, (net_name, modes) in zip(axes[:, 0], nets.items()):
        for mode, r in modes.items():
            tl = r.get("timeline")
            if tl is None:
                continue
            ys = [b / 2**20 for b in tl["bytes_above_before_forward"]]
            (line,) = ax.step(tl["t_ms"], ys, where="post", label=mode, linewidth=1.4)
            i = max(range(len(ys)), key=ys.__getitem__)
            ax.plot(tl["t_ms"][i], ys[i], "o", color=line.get_color())
            ax.annotate(f"{ys[i]:.1f}", (tl["t_ms"][i], ys[i]), textcoords="offset points",
                        xytext=(4, 4), fontsize=8, color=line.get_color())
            ax.axvline(tl["backward_starts_ms"], color=line.get_color(), linestyle=":",
                       linewidth=0.8)
        ax.set_title(f"{net_name}: memory through one step")
        ax.set_xlabel("ms since the step started (dotted: backward starts)")
        ax.set_ylabel("MiB above 'before forward'")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{c['device']}, {c['dtype']}, batch {c['batch']}, hidden {c['hidden']}, "
                 f"depth {c['depth']}, torch {c['torch']} (dots: peaks)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------------
# CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ckpt_ext.bench", description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="sizes; default writeup on CUDA, cpu-default on CPU")
    for name in ("batch", "in-features", "hidden", "depth", "steps", "warmup"):
        p.add_argument(f"--{name}", type=int, default=None, help="overrides the preset")
    p.add_argument("--budget", type=parse_bytes, default=None,
                   help="memory budget for the max-batch column, e.g. 512MiB (default: preset's)")
    p.add_argument("--networks", default=",".join(NETWORKS),
                   help=f"comma-separated, from {', '.join(NETWORKS)}")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--out", default=os.path.join("bench", "results"), help="output folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    return p


def config_from_args(argv=None) -> Config:
    p = build_parser()
    a = p.parse_args(argv)
    if a.device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False on this machine "
                "(no NVIDIA driver or GPU, or a CPU-only torch); use --device cpu")
    preset = a.preset or ("writeup" if device.type == "cuda" else "cpu-default")
    sizes = dict(PRESETS[preset])
    for k in ("batch", "in_features", "hidden", "depth", "steps", "warmup"):
        if getattr(a, k) is not None:
            sizes[k] = getattr(a, k)
    networks = [n.strip() for n in a.networks.split(",") if n.strip()]
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    for n in networks:
        if n not in NETWORKS:
            p.error(f"--networks: unknown network {n!r}; expected some of {', '.join(NETWORKS)}")
    for m in modes:
        if m not in MODES:
            p.error(f"--modes: unknown mode {m!r}; expected some of {', '.join(MODES)}")
    if "plain" not in modes:
        modes.insert(0, "plain")  # the reference for time ratios and gradient agreement
    if sizes["batch"] < 2 or sizes["steps"] < 1:
        p.error(f"--batch must be >= 2 and --steps >= 1, got {sizes['batch']} and {sizes['steps']}")
    return Config(device=device, dtype=DTYPES[a.dtype], preset=preset, batch=sizes["batch"],
                  in_features=sizes["in_features"], hidden=sizes["hidden"], depth=sizes["depth"],
                  steps=sizes["steps"], warmup=sizes["warmup"],
                  budget=a.budget if a.budget is not None else parse_bytes(sizes["budget"]),
                  networks=networks, modes=modes, out=a.out, seed=a.seed,
                  progress=not a.no_progress)


def main(argv=None) -> int:
    cfg = config_from_args(argv)
    if cfg.device.type == "cuda":
        show_usage("GPU before the benchmark", cfg.device.index or 0)
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
    written = [stem + ".md", stem + ".json"] + ([stem + ".png"] if plot(results, stem + ".png") else [])
    print(table)
    print(f"wrote {', '.join(written)} ({results['conditions']['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
