"""What recomputation costs and saves: the write-up's experiment, with the tools a user would pick
side by side in one run.

    python -m ckpt_ext.bench                          # into bench_out/ (untracked)
    python -m ckpt_ext.bench --preset small           # the small-layer regime (RL policies, PINNs)
    python -m ckpt_ext.bench --preset tiny --out /tmp/b
    python -m ckpt_ext.bench --device cpu --preset cpu-default --out bench/results   # README tables

Networks (``ckpt_ext.models``): the write-up's chain ``Net``, ``ResidualNet``, ``MLPNet`` (loss
``output.mean()``) and the physics-informed ``PINNNet`` (a loss on ``u_xx`` from two
``torch.autograd.grad(create_graph=True)``, then backward). Modes:

* ``plain``; ``checkpoint`` (the write-up's placement in the chain: block1..block{depth-1}; every
  block elsewhere); ``checkpoint-stack`` (the chain's block1..block{depth} as one checkpoint; the
  other networks have no such row: their checkpoint already covers every block, or the whole MLP);
* ``compile`` (``torch.compile`` of plain), ``compile-checkpoint`` (of ``checkpoint-stack`` for the
  chain, of ``checkpoint`` elsewhere), ``fused``, ``compile-fused``;
* ``checkpoint-reentrant``, only when asked for: PyTorch recommends the non-reentrant variant, which
  keeps the same bytes, peaks no higher, runs no slower, and alone supports ``torch.autograd.grad``.

For each network and mode it measures, in separate steps:

* memory, with ckpt_ext's counting allocator installed (CPU: exact tensor bytes; CUDA:
  ``memory_allocated``): the write-up's four readings (before forward, after forward, after loss,
  after backward), what autograd keeps for backward (after loss − before forward − the loss; the
  output is dropped first), the peak above "before forward", a timeline, and the peak at half the
  batch for the largest batch that fits ``--budget`` (every tensor here grows linearly with it);
* the step time, with the counting allocator *uninstalled*: median of ``--steps`` steps after
  warm-up, all modes interleaved in one loop, as a ratio to plain, and against a *floor*: plain's
  step plus the GEMMs the mode recomputes (``ckpt_ext.models.recomputed_gemms``), timed alone on
  the same shapes inside the same loop;
* gradient agreement with plain on the same weights and input.

It writes ``<out>/<device>-<preset>.md`` (tables, conditions above them), ``.json`` (every raw
figure, timelines included) and ``.png`` (per network: step time against memory kept and peak, the
front of modes nothing beats on both marked; the memory timelines below, one mode per row).
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
import torch._dynamo
from torch import nn

from . import _C
from .memory import MemoryMeter, show_usage
from .models import NETWORKS, PINNNet, recomputed_gemms

PINN_SIZES = dict(batch=4096, hidden=64, depth=4)  # issue 9: 2 -> 64x4 -> 1 on 4096 points

PRESETS = {
    # Seconds: for tests and a first look.
    "tiny": dict(batch=16, in_features=32, hidden=64, depth=3, steps=3, warmup=1, budget="8MiB",
                 pinn=dict(batch=64, hidden=16, depth=3)),
    # The small-layer regime of RL policies and physics-informed nets: per-op overheads (Python,
    # autograd nodes, allocations) weigh as much as the GEMMs. Steps are short, so take many.
    "small": dict(batch=2048, in_features=64, hidden=64, depth=4, steps=41, warmup=3,
                  budget="64MiB", pinn=PINN_SIZES),
    # A wide batch and a narrow hidden size, so that activations (batch x hidden) outweigh the
    # weights, as they do in training at scale; with hidden >> batch the weights and their
    # gradients fill the peak whatever the mode. GEMMs dominate the step here.
    "cpu-default": dict(batch=1024, in_features=1024, hidden=512, depth=3, steps=15, warmup=2,
                        budget="512MiB", pinn=PINN_SIZES),
    # The write-up: input (512, 1024), linear1 1024 -> 10240, three 10240 x 10240 blocks.
    "writeup": dict(batch=512, in_features=1024, hidden=10240, depth=3, steps=15, warmup=3,
                    budget="40GiB", pinn=PINN_SIZES),
}


@dataclass(frozen=True)
class Mode:
    model_mode: str  #: the mode the model is built in (ckpt_ext.models)
    compiled: bool = False
    reentrant: bool = False
    doc: str = ""


MODES = {
    "plain": Mode("plain", doc="stock PyTorch"),
    "checkpoint": Mode("checkpoint", doc="torch.utils.checkpoint (non-reentrant): chain "
                       "block1..block{depth-1} (the write-up), every block elsewhere"),
    "checkpoint-stack": Mode("checkpoint-stack", doc="chain: block1..block{depth} as one "
                             "checkpoint"),
    "compile": Mode("plain", compiled=True, doc="torch.compile of plain"),
    "compile-checkpoint": Mode("checkpoint-stack", compiled=True,
                               doc="torch.compile of checkpoint-stack (chain) / checkpoint"),
    "fused": Mode("fused", doc="ckpt_ext: chain one tanh_mlp over the blocks, residual "
                  "FusedLinearTanh per block, mlp FusedTanhMLP per block, pinn one FusedTanhMLP"),
    "compile-fused": Mode("fused", compiled=True, doc="torch.compile of fused"),
    "checkpoint-reentrant": Mode("checkpoint", reentrant=True,
                                 doc="torch.utils.checkpoint(use_reentrant=True), as checkpoint"),
}
DEFAULT_MODES = [m for m in MODES if m != "checkpoint-reentrant"]

# Rows a network does not run because another row is the same thing.
SAME_AS = {
    ("residual", "checkpoint-stack"): ("checkpoint", "every block is already checkpointed"),
    ("mlp", "checkpoint-stack"): ("checkpoint", "every block is already checkpointed"),
    ("pinn", "checkpoint-stack"): ("checkpoint", "the whole MLP is already one checkpoint"),
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}

READINGS = ("before forward", "after forward", "after loss", "after backward")


def model_mode(net_name: str, mode: str) -> str:
    """The ckpt_ext.models mode that bench ``mode`` builds for network ``net_name``."""
    m = MODES[mode].model_mode
    if m not in NETWORKS[net_name].MODES and m == "checkpoint-stack":
        return "checkpoint"  # compile-checkpoint where the checkpoint already covers the stack
    return m


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


def mean_loss(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return out.mean()


def measured_step(net: Callable, x: torch.Tensor, meter: MemoryMeter, timeline: bool = False,
                  loss_fn: Callable = mean_loss) -> dict:
    """One step with the write-up's four readings, the peak and (optionally) the timeline.
    Gradients must be cleared before: "before forward" then holds weights and input only."""
    meter.readings.clear()
    r0 = meter.read("before forward")
    meter.reset_peak()
    t_ns = {}
    with meter.timeline() if timeline else contextlib.nullcontext():
        out = net(x)
        r1 = meter.read("after forward")
        loss = loss_fn(out, x)
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(net: Callable, x: torch.Tensor, device: torch.device,
               loss_fn: Callable = mean_loss) -> float:
    _sync(device)
    t = time.perf_counter()
    loss_fn(net(x), x).backward()
    _sync(device)
    return time.perf_counter() - t


def timed_gemms(operands: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                device: torch.device) -> float:
    """The recompute alone: ``addmm(b, x, W.T)`` per recomputed layer, output allocated as the
    recompute allocates it."""
    _sync(device)
    t = time.perf_counter()
    for x, w, b in operands:
        torch.addmm(b, x, w.t())
    _sync(device)
    return time.perf_counter() - t


@contextlib.contextmanager
def uninstrumented(device: torch.device):
    """Run on the stock CPU allocator: the counting wrapper adds work to every allocation and
    free, which would tax allocation-heavy modes in the timings. Tensors it counted stay counted
    (their frees are still subtracted); those allocated meanwhile are not counted at all."""
    if device.type != "cpu":
        yield
        return
    was_installed = _C.cpu_meter_uninstall()
    try:
        yield
    finally:
        if was_installed:
            _C.cpu_meter_install()


def grad_errors(net: nn.Module, ref: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for name, p in net.named_parameters():
        if p.grad is None:
            return math.inf
        g, r = p.grad.double(), ref[name].double()
        err = float((g - r).norm() / r.norm().clamp_min(1e-300))
        worst = max(worst, err if math.isfinite(err) else math.inf)
    return worst


def pareto_front(points: dict[str, tuple[float, float]]) -> list[str]:
    """The names whose (time, memory) no other point matches or beats on both with one strictly
    better: the modes that are cheapest for their memory."""
    front = []
    for name, (t, m) in points.items():
        if not any((t2 <= t and m2 <= m) and (t2 < t or m2 < m)
                   for other, (t2, m2) in points.items() if other != name):
            front.append(name)
    return sorted(front, key=lambda n: points[n])


# ------------------------------------------------------------------------------------------------
# The run

@dataclass
class Sizes:
    batch: int
    in_features: int
    hidden: int
    depth: int


@dataclass
class Config:
    device: torch.device
    dtype: torch.dtype
    preset: str
    sizes: Sizes  #: chain, residual, mlp
    pinn: Sizes
    steps: int
    warmup: int
    budget: int
    networks: list[str]
    modes: list[str]
    out: str
    compile_backend: str = "inductor"
    seed: int = 0
    progress: bool = True
    command: str = ""
    ratio: int = 4  #: MLP inner width / hidden

    def sizes_of(self, net_name: str) -> Sizes:
        return self.pinn if net_name == "pinn" else self.sizes


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
    # per mode: warm-up at 2 batch sizes, memory at 2, steps, agreement
    total = len(cfg.networks) * len(cfg.modes) * (2 * cfg.warmup + 2 + cfg.steps + 1)
    bar = tqdm(total=total, desc="bench", disable=not cfg.progress, file=sys.stderr,
               dynamic_ncols=True)
    try:
        # A compiled mode that hits the recompile limit would silently run eager: make it an error.
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            for net_name in cfg.networks:
                bar.set_postfix_str(net_name)
                torch._dynamo.reset()  # each network starts with empty compile caches
                results["networks"][net_name] = run_network(cfg, net_name, meter, bar)
                torch._dynamo.reset()
    finally:
        bar.close()
        meter.stop()
    return results


class NetworkRun:
    """One network in every mode asked for: its models and inputs, the measuring phases, and the
    per-mode results (figures, ``{"error": ...}`` or ``{"same_as": ..., "why": ...}``)."""

    def __init__(self, cfg: Config, net_name: str, meter: MemoryMeter, bar) -> None:
        self.cfg, self.net_name, self.meter, self.bar = cfg, net_name, meter, bar
        cls = NETWORKS[net_name]
        self.sizes = sz = cfg.sizes_of(net_name)
        self.loss_fn = cls.loss
        kw = dict(in_features=sz.in_features, hidden=sz.hidden, depth=sz.depth, dtype=cfg.dtype)
        self.plain = cls(mode="plain", device=cfg.device, **kw)
        self.res: dict[str, dict] = {}
        self.failed: dict[str, str] = {}
        self.nets: dict[str, Callable] = {}
        self.modes: list[str] = []  # those that run (not "same as" another)

        # One model per model mode, built on the meta device and given plain's parameters, so no
        # second set of weights is ever allocated; compiled modes wrap them.
        eager: dict[tuple[str, bool], nn.Module] = {("plain", False): self.plain}
        for mode in cfg.modes:
            if (net_name, mode) in SAME_AS:
                other, why = SAME_AS[(net_name, mode)]
                self.res[mode] = {"same_as": other, "why": why}
                continue
            self.modes.append(mode)
            self.res[mode] = {}
            m = MODES[mode]
            key = (model_mode(net_name, mode), m.reentrant)
            if key not in eager:
                net = cls(mode=key[0], use_reentrant=key[1], device=torch.device("meta"), **kw)
                share_parameters(self.plain, net)
                eager[key] = net
            # fullgraph: a graph break would time a partly eager model under the compile label.
            # dynamic=False: each batch size gets its own static graph, as a fixed-batch user's.
            self.nets[mode] = (torch.compile(eager[key], backend=cfg.compile_backend,
                                             fullgraph=True, dynamic=False)
                               if m.compiled else eager[key])

        gen = torch.Generator().manual_seed(cfg.seed)
        self.x = self._input(sz.batch, gen)
        self.x_half = self._input(max(1, sz.batch // 2), gen)

    def _input(self, batch: int, gen: torch.Generator) -> torch.Tensor:
        cfg = self.cfg
        if self.net_name == "pinn":
            return PINNNet.points(batch, gen, cfg.device, cfg.dtype)
        return torch.randn(batch, self.sizes.in_features, generator=gen).to(cfg.device, cfg.dtype)

    def guarded(self, mode: str, fn: Callable[[], None]) -> None:
        """Run ``fn``; an exception makes the mode n/a with the error as its reason (e.g.
        torch.compile refusing double backward). It is never swallowed silently: it is the row,
        and main() lists it on stderr."""
        if mode in self.failed:
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            self.failed[mode] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
            self.res[mode] = {"error": self.failed[mode]}

    def clear(self) -> None:
        clear_grads(self.plain)
        self.x.grad = self.x_half.grad = None

    def settle(self) -> None:
        """Gradients go, and so does garbage (a checkpoint's graph may sit in a reference cycle),
        so no collection happens inside a measured step. Cheap once the objects the warm-up left
        (dynamo's among them) are frozen out of the collector's scans (run_network)."""
        self.clear()
        gc.collect()

    def step(self, mode: str, x: torch.Tensor) -> float:
        return timed_step(self.nets[mode], x, self.cfg.device, self.loss_fn)

    # -- the phases ------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Both batch sizes (compiles, lazy initialisation, allocator caches), so none of it
        lands in a measured step."""
        with uninstrumented(self.cfg.device):
            for _ in range(self.cfg.warmup):
                for mode in self.modes:
                    for x in (self.x, self.x_half):
                        self.guarded(mode, lambda: self.step(mode, x))
                        self.clear()
                        self.bar.update(1)

    def measure_memory(self) -> None:
        """One step per mode with readings and timeline, one more at half the batch for the fit."""
        for mode in self.modes:
            def mem():
                self.settle()
                self.res[mode].update(measured_step(self.nets[mode], self.x, self.meter, True,
                                                    self.loss_fn))
                self.settle()
                self.res[mode]["peak_half_batch"] = measured_step(
                    self.nets[mode], self.x_half, self.meter, False, self.loss_fn)["peak"]
            self.guarded(mode, mem)
            self.bar.update(2)
        self.settle()

    def time_steps(self) -> None:
        """On the stock allocator, in two loops of interleaved modes, so drifts in machine load hit
        every mode of a loop alike: the eager modes with, after each round, the GEMMs each mode
        recomputes timed alone (the floor); then plain with the compiled modes. Each mode's ratio
        to plain is taken against plain in its own loop.

        Why two loops: inductor's compiled CPU kernels run on an OpenMP thread pool of their own,
        whose threads keep spinning for a while after a compiled step, so an eager step right
        after one competed with them for the cores (small preset, one loop: fused after
        compile-checkpoint at 0.97x checkpoint-stack; without the compiled modes, 0.79x).

        No gc.collect() between timed steps (the collector is off, run_network): a collection
        walks every object, evicts the caches and lets the intra-op threads go to sleep, and the
        step after it paid for that; garbage from the steps is collected after each loop."""
        cfg, sz = self.cfg, self.sizes
        self.times: dict[str, list[float]] = {m: [] for m in self.modes}
        self.plain_times: dict[str, list[float]] = {}  # mode -> plain's steps in its loop
        self.jobs: dict[tuple, list[float]] = {}
        self.job_of: dict[str, tuple] = {}
        for mode in self.modes:
            g = recomputed_gemms(self.net_name, model_mode(self.net_name, mode), sz.batch,
                                 sz.in_features, sz.hidden, sz.depth, cfg.ratio,
                                 MODES[mode].reentrant)
            if g:
                self.job_of[mode] = tuple(g)
                self.jobs.setdefault(tuple(g), [])
        eager = [m for m in self.modes if not MODES[m].compiled]
        compiled = [m for m in self.modes if MODES[m].compiled]
        loops = [eager] + ([["plain"] + compiled] if compiled else [])
        with uninstrumented(cfg.device):
            operands = {job: [(torch.randn(m, k, device=cfg.device, dtype=cfg.dtype),
                               torch.randn(n, k, device=cfg.device, dtype=cfg.dtype),
                               torch.randn(n, device=cfg.device, dtype=cfg.dtype))
                              for m, k, n in job] for job in self.jobs}
            for job in self.jobs:
                timed_gemms(operands[job], cfg.device)  # warm-up
            for n, loop in enumerate(loops):
                plain_here: list[float] = []
                for mode in loop:
                    if mode != "plain" or n == 0:  # plain's own row: its eager loop
                        self.plain_times[mode] = plain_here
                for _ in range(cfg.steps):
                    for mode in loop:
                        self.clear()
                        times = plain_here if mode == "plain" else self.times[mode]
                        self.guarded(mode, lambda: times.append(self.step(mode, self.x)))
                        if n == 0 or mode != "plain":
                            self.bar.update(1)
                    if n == 0:
                        for job in self.jobs:
                            self.jobs[job].append(timed_gemms(operands[job], cfg.device))
                if n == 0:
                    self.times["plain"] = plain_here
                self.settle()

    def check_gradients(self) -> None:
        """Gradient agreement with plain on the same weights and input."""
        with uninstrumented(self.cfg.device):
            self.settle()
            self.loss_fn(self.plain(self.x), self.x).backward()
            ref = {n: p.grad.detach().clone() for n, p in self.plain.named_parameters()}
            for mode in self.modes:
                def agree():
                    self.settle()
                    self.loss_fn(self.nets[mode](self.x), self.x).backward()
                    self.res[mode]["grad_rel_err"] = grad_errors(self.plain, ref)
                self.guarded(mode, agree)
                self.bar.update(1)
            del ref
            self.settle()

    def summarize(self) -> dict:
        times = self.times
        for mode in self.modes:
            res = self.res[mode]
            if mode in self.failed:
                continue
            plain_run = self.plain_times.get(mode)
            plain_ms = statistics.median(plain_run) * 1e3 if plain_run else None
            res["step_ms_all"] = [t * 1e3 for t in times[mode]]
            res["step_ms"] = statistics.median(times[mode]) * 1e3
            res["plain_ms_same_loop"] = plain_ms
            res["time_vs_plain"] = res["step_ms"] / plain_ms if plain_ms else None
            if mode in self.job_of:
                job = self.job_of[mode]
                res["recomputed_gemms"] = [list(s) for s in job]
                res["recompute_ms_all"] = [t * 1e3 for t in self.jobs[job]]
                res["recompute_ms"] = statistics.median(self.jobs[job]) * 1e3
                if plain_ms:
                    res["floor_ms"] = plain_ms + res["recompute_ms"]
                    res["time_vs_floor"] = res["step_ms"] / res["floor_ms"]
            res.update(max_batch(self.cfg.budget, self.sizes.batch, res["peak"],
                                 res["peak_half_batch"], self.x_half.shape[0]))
        return self.res


def run_network(cfg: Config, net_name: str, meter: MemoryMeter, bar) -> dict:
    r = NetworkRun(cfg, net_name, meter, bar)
    r.warm_up()
    # Everything alive now (models, compiled code, dynamo's caches) stays: freeze it out of the
    # collector's scans, which otherwise take ~0.5 s each once dynamo is loaded. And no automatic
    # collection during the measured steps: settle() collects between them.
    gc.collect()
    gc.freeze()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        r.measure_memory()
        r.time_steps()
        r.check_gradients()
    finally:
        if was_enabled:
            gc.enable()
        gc.unfreeze()
    return r.summarize()


def max_batch(budget: int, batch: int, peak_full: int, peak_half: int, half: int) -> dict:
    per_sample = (peak_full - peak_half) / (batch - half) if batch > half else None
    if not per_sample or per_sample <= 0:
        return {"per_sample_bytes": per_sample, "fixed_bytes": None, "max_batch": None}
    fixed = peak_full - per_sample * batch
    fit = math.floor((budget - fixed) / per_sample)
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
        "sizes": vars(cfg.sizes), "pinn_sizes": {**vars(cfg.pinn), "out_features": 1},
        "mlp_ratio": cfg.ratio, "steps": cfg.steps, "warmup": cfg.warmup,
        "budget_bytes": cfg.budget, "compile_backend": cfg.compile_backend,
        "torch": torch.__version__, "python": platform.python_version(),
        "memory_meter": ("exact bytes of every CPU tensor allocation (ckpt_ext counting allocator)"
                         if cfg.device.type == "cpu" else "torch.cuda.memory_allocated / "
                         "max_memory_allocated (512-byte blocks)"),
        "timing": ("median of interleaved steps on the stock allocator (counting allocator "
                   "uninstalled); memory from separate instrumented steps"),
        "command": cfg.command,
    }


def conditions_line(c: dict) -> str:
    s, p = c["sizes"], c["pinn_sizes"]
    return (
        f"Benchmark conditions: {c['device']}, {c['dtype']}, torch {c['torch']}; "
        f"chain/residual/mlp: batch {s['batch']}, in_features {s['in_features']}, hidden {s['hidden']}, depth "
        f"{s['depth']} (MLP inner {c['mlp_ratio']}×hidden); pinn: {p['in_features']} -> "
        f"{p['hidden']}x{p['depth']} -> {p['out_features']} tanh MLP on {p['batch']} points. "
        f"Step time = median of {c['steps']} steps after {c['warmup']} warm-up, modes interleaved, "
        f"counting allocator uninstalled; floor = plain's step + the GEMMs the mode recomputes, "
        f"timed alone in the same loop; memory = {c['memory_meter']}, from separate steps; "
        f"torch.compile backend {c['compile_backend']}; budget {fmt_bytes(c['budget_bytes'])}. "
        f"Command: `{c['command']}`.")


def _fronts(modes: dict) -> dict[str, list[str]]:
    ok = {m: r for m, r in modes.items() if r.get("time_vs_plain") is not None}
    return {what: pareto_front({m: (r["time_vs_plain"], r[key]) for m, r in ok.items()})
            for what, key in (("kept", "kept_for_backward"),
                              ("peak", "peak_above_before_forward"))}


def markdown(results: dict) -> str:
    lines = [conditions_line(results["conditions"]), "",
             "| network | mode | kept for bwd | peak (above before fwd) | step ms | × plain "
             "| floor ms | × floor | on the front | grad rel err | max batch in budget |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for net_name, modes in results["networks"].items():
        fronts = _fronts(modes)
        for mode, r in modes.items():
            if "same_as" in r:
                lines.append(f"| {net_name} | {mode} | = {r['same_as']} ({r['why']}) |"
                             + " |" * 8)
                continue
            if "error" in r:
                lines.append(f"| {net_name} | {mode} | n/a ({r['error']}) |" + " |" * 8)
                continue
            ratio = f"{r['time_vs_plain']:.2f}" if r.get("time_vs_plain") else "n/a"
            floor = f"{r['floor_ms']:.1f}" if "floor_ms" in r else "–"
            vs_floor = f"{r['time_vs_floor']:.2f}" if "time_vs_floor" in r else "–"
            front = ", ".join(w for w in ("kept", "peak") if mode in fronts[w])
            mb = r.get("max_batch")
            lines.append(
                f"| {net_name} | {mode} | {fmt_bytes(r['kept_for_backward'])}"
                f" | {fmt_bytes(r['peak_above_before_forward'])}"
                f" | {r['step_ms']:.2f} | {ratio} | {floor} | {vs_floor} | {front}"
                f" | {r['grad_rel_err']:.1e} | {mb if mb is not None else 'n/a'} |")
    lines += ["", "The write-up's four readings (tensor bytes alive; kept for bwd = after loss − "
              "before fwd − the loss):", "",
              "| network | mode | before fwd | after fwd | after loss | after bwd "
              "| activations after fwd |", "|---|---|---:|---:|---:|---:|---:|"]
    for net_name, modes in results["networks"].items():
        for mode, r in modes.items():
            if "readings" not in r:
                continue
            rd = r["readings"]
            lines.append(f"| {net_name} | {mode} | "
                         + " | ".join(fmt_bytes(rd[k]) for k in READINGS)
                         + f" | {fmt_bytes(r['activations_after_forward'])} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# The picture

# One colour per mode, the same in every panel; compiled modes share their eager mode's hue.
_COLOURS = {"plain": "#555555", "compile": "#999999", "checkpoint": "#1f77b4",
            "checkpoint-reentrant": "#17becf", "checkpoint-stack": "#6a3d9a",
            "compile-checkpoint": "#9e9ac8", "fused": "#d62728", "compile-fused": "#fc8d59"}


def _place_labels(ax, xy: list[tuple[float, float]], labels: list[str], colours: list[str]):
    """Annotate each point with its label at the first of a ring of offsets (growing outwards)
    where the text (and its leader line, for far offsets) overlaps no other label and no marker,
    and stays inside the axes."""
    from matplotlib.text import Text

    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    to_disp = ax.transData.transform
    ax_box = ax.get_window_extent(renderer)
    px = fig.dpi / 72.0
    # Points that land on one another (within 6 px) share one label, a name per line.
    groups: list[list[int]] = []
    for i, p in enumerate(xy):
        d = to_disp(p)
        for g in groups:
            if math.dist(d, to_disp(xy[g[0]])) < 6 * px:
                g.append(i)
                break
        else:
            groups.append([i])
    xy = [xy[g[0]] for g in groups]
    colours = [colours[g[0]] if len(g) == 1 else "#333333" for g in groups]
    labels = ["\n".join(labels[i] for i in g) for g in groups]
    markers = [to_disp(p) for p in xy]
    taken = []
    dirs = [(1, 0.3), (1, -1), (-1, 0.3), (-1, -1), (0, 1.2), (0, -1.8), (1, 1.2), (-1, 1.2),
            (1, -1.8), (-1, -1.8), (0.5, 2.2), (-0.5, 2.2), (0.5, -2.6), (-0.5, -2.6)]
    for i in sorted(range(len(xy)), key=lambda j: (xy[j][0], xy[j][1])):
        best = None
        for r in (6, 12, 20, 30, 42, 56, 72):
            for dx, dy in dirs:
                ha = "left" if dx > 0 else "right" if dx < 0 else "center"
                t = ax.annotate(labels[i], xy[i], xytext=(dx * r, dy * r * 0.8),
                                textcoords="offset points", ha=ha, va="center", fontsize=7.5,
                                color=colours[i],
                                arrowprops=(dict(arrowstyle="-", color=colours[i], lw=0.6,
                                                 shrinkA=0, shrinkB=3) if r >= 12 else None))
                # the text's own box (an Annotation's would include its leader line), once the
                # annotation has placed its text
                t.update_positions(renderer)
                bb = Text.get_window_extent(t, renderer).expanded(1.04, 1.15)
                inside = (bb.x0 >= ax_box.x0 and bb.x1 <= ax_box.x1 and bb.y0 >= ax_box.y0
                          and bb.y1 <= ax_box.y1)
                pad = 4 * px  # keep clear of every marker, the label's own included
                clear = not any(bb.overlaps(o) for o in taken) and not any(
                    bb.x0 - pad <= mx <= bb.x1 + pad and bb.y0 - pad <= my <= bb.y1 + pad
                    for mx, my in markers)
                if inside and clear:
                    best = (t, bb)
                    break
                t.remove()
            if best:
                break
        if best is None:  # nothing free: the nearest spot, still readable most of the time
            t = ax.annotate(labels[i], xy[i], xytext=(6, 4), textcoords="offset points",
                            fontsize=7.5, color=colours[i])
            t.update_positions(renderer)
            best = (t, Text.get_window_extent(t, renderer))
        taken.append(best[1])


def _unit(max_bytes: float) -> tuple[float, str]:
    return (2**20, "MiB") if max_bytes >= 2**20 else (2**10, "KiB")


def plot(results: dict, path: str) -> bool:
    """Writes the PNG; False (and a message) where matplotlib is not installed.

    One column per network. On top, step time (× plain) against memory kept for backward, and
    against the peak: one point per mode, filled where no other mode is both faster and smaller
    (the front, joined by a staircase: what each step up in time buys). Below, the memory
    timelines of one step, one mode per row, on shared axes."""
    try:
        import matplotlib
    except ImportError:
        print("bench: matplotlib is not installed; no plot written (pip install matplotlib)",
              file=sys.stderr)
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    nets = results["networks"]
    c = results["conditions"]
    mode_rows = [m for m in MODES if any(m in modes for modes in nets.values())]
    n_cols, n_tl = len(nets), len(mode_rows)
    height = 0.9 + 2 * 2.6 + 0.75 + 0.55 * n_tl + 0.45
    fig = plt.figure(figsize=(4.4 * n_cols, height), dpi=110)
    gs = fig.add_gridspec(4 + n_tl, n_cols,
                          height_ratios=[2.6, 0.22, 2.6, 0.75] + [0.55] * n_tl,
                          hspace=0.0, wspace=0.3, top=1 - 0.9 / height, bottom=0.45 / height,
                          left=0.055, right=0.985)
    for col, (net_name, modes) in enumerate(nets.items()):
        ok = {m: r for m, r in modes.items() if r.get("time_vs_plain") is not None}
        sz = c["pinn_sizes"] if net_name == "pinn" else c["sizes"]
        top = None
        for row, (key, what) in ((0, ("kept_for_backward", "kept for backward")),
                                 (2, ("peak_above_before_forward", "peak"))):
            ax = fig.add_subplot(gs[row, col], sharex=top)
            top = top or ax
            scale, unit = _unit(max([r[key] for r in ok.values()], default=1))
            pts = {m: (r["time_vs_plain"], r[key] / scale) for m, r in ok.items()}
            front = pareto_front(pts)
            xs = [p[0] for p in pts.values()] or [1.0]
            ys = [p[1] for p in pts.values()] or [1.0]
            span = max(max(xs) - min(xs), 0.2)
            ax.set_xlim(min(xs) - 0.3 * span, max(xs) + 0.45 * span)
            ax.set_ylim(0, max(ys) * 1.22 + 1e-9)
            if len(front) > 1:  # the front as a staircase: what each extra bit of time buys
                fx, fy = zip(*(pts[m] for m in front))
                ax.step(fx, fy, where="post", color="black", lw=0.8, alpha=0.45, zorder=1)
            for m, (t, mem) in pts.items():
                on = m in front
                ax.plot(t, mem, "o", ms=7.5 if on else 6, zorder=3,
                        mfc=_COLOURS.get(m, "k") if on else "white",
                        mec=_COLOURS.get(m, "k"), mew=1.5)
            ax.axvline(1.0, color="#bbbbbb", lw=0.7, ls=":", zorder=0)
            ax.grid(alpha=0.25)
            ax.tick_params(labelsize=7.5)
            ax.set_ylabel(f"{what}, {unit}", fontsize=8)
            if row == 0:
                ax.set_title(f"{net_name}  (batch {sz['batch']}, hidden {sz['hidden']}, depth "
                             f"{sz['depth']})", fontsize=10)
                ax.tick_params(labelbottom=False)
                missing = [m for m, r in modes.items() if "error" in r]
                if missing:
                    errs = sorted({modes[m]["error"] for m in missing})
                    ax.text(0.02, 0.97, "n/a: " + ", ".join(missing) + "\n" + "\n".join(
                        e[:70] + ("…" if len(e) > 70 else "") for e in errs),
                        transform=ax.transAxes, va="top", fontsize=6.5, color="#aa0000")
            else:
                ax.set_xlabel(f"step time × plain (median of {c['steps']})", fontsize=8)
            names = list(pts)
            _place_labels(ax, [pts[m] for m in names], names,
                          [_COLOURS.get(m, "k") for m in names])
        # the timelines: one mode per row, shared axes within the network
        first = None
        ymax = max((max(r["timeline"]["bytes_above_before_forward"]) for r in modes.values()
                    if "timeline" in r), default=1)
        scale, unit = _unit(ymax)
        for k, mode in enumerate(mode_rows):
            ax = fig.add_subplot(gs[4 + k, col], sharex=first, sharey=first)
            first = first or ax
            r = modes.get(mode)
            colour = _COLOURS.get(mode, "k")
            if r is not None and "timeline" in r:
                tl = r["timeline"]
                ys = [b / scale for b in tl["bytes_above_before_forward"]]
                ax.fill_between(tl["t_ms"], ys, step="post", color=colour, alpha=0.25, lw=0)
                ax.step(tl["t_ms"], ys, where="post", color=colour, lw=1.0)
                ax.axvline(tl["backward_starts_ms"], color=colour, ls=":", lw=0.8)
                note = f"peak {fmt_bytes(max(tl['bytes_above_before_forward']))}"
            else:
                note = ("not run" if r is None else f"= {r['same_as']}" if "same_as" in r
                        else "n/a (error)" if "error" in r else "")
            ax.text(0.01, 0.9, f"{mode}: {note}", transform=ax.transAxes, ha="left", va="top",
                    fontsize=7, color=colour,
                    bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none", alpha=0.75))
            ax.set_ylim(0, ymax / scale * 1.35 + 1e-9)
            ax.set_yticks([0, ymax / scale])
            ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.3g"))
            ax.tick_params(labelsize=6.5)
            ax.grid(alpha=0.2)
            if k < n_tl - 1:
                ax.tick_params(labelbottom=False)
            else:
                ax.set_xlabel("ms into the instrumented step", fontsize=7.5)
            if k == n_tl // 2:
                ax.set_ylabel(unit, fontsize=7.5)
    fig.text(0.5, 1 - (0.9 + 2 * 2.6 + 0.22 + 0.5) / height,
             "Memory above before-forward through one step, one mode per row, shared axes per "
             "network (dotted: backward starts; the step measured with the counting allocator)",
             ha="center", fontsize=8.5)
    handles = [Line2D([], [], ls="", marker="o", ms=7, mfc="k", mec="k",
                      label="on the front: no other mode is both faster and smaller"),
               Line2D([], [], ls="", marker="o", ms=6, mfc="white", mec="k",
                      label="beaten on both by some other mode"),
               Line2D([], [], color="black", alpha=0.45, lw=0.8, label="the front")]
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.38 / height),
               ncol=3, fontsize=8, frameon=False)
    fig.suptitle(f"Which mode to pick: step time against memory, per network  —  {c['device']}, "
                 f"{c['dtype']}, torch {c['torch']}, preset {c['preset']}", fontsize=10.5,
                 y=1 - 0.12 / height)
    fig.savefig(path)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------------
# CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ckpt_ext.bench",
                                description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--preset", default=None, choices=list(PRESETS),
                   help="sizes; default writeup on CUDA, cpu-default on CPU")
    for name in ("batch", "in-features", "hidden", "depth"):
        p.add_argument(f"--{name}", type=int, default=None,
                       help="overrides the preset (chain, residual, mlp)")
    for name in ("points", "hidden", "depth"):
        p.add_argument(f"--pinn-{name}", type=int, default=None, help="overrides the preset (pinn)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per mode (preset's)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--budget", type=parse_bytes, default=None,
                   help="memory budget for the max-batch column, e.g. 512MiB (default: preset's)")
    p.add_argument("--networks", default=",".join(NETWORKS),
                   help=f"comma-separated, from {', '.join(NETWORKS)}")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the compile* modes (inductor; aot_eager traces "
                        "the same graphs without code generation)")
    p.add_argument("--out", default="bench_out",
                   help="output folder (default bench_out/, untracked; the README's tables come "
                        "from --out bench/results)")
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
    steps = a.steps if a.steps is not None else ps["steps"]
    warmup = a.warmup if a.warmup is not None else ps["warmup"]
    networks = [n.strip() for n in a.networks.split(",") if n.strip()]
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
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
    if a.threads is not None:
        if a.threads < 1:
            p.error(f"--threads must be >= 1, got {a.threads}")
        torch.set_num_threads(a.threads)
    if steps < 1 or warmup < 0:
        p.error(f"--steps must be >= 1 and --warmup >= 0, got {steps} and {warmup}")
    return Config(device=device, dtype=DTYPES[a.dtype], preset=preset, sizes=sizes, pinn=pinn,
                  steps=steps, warmup=warmup,
                  budget=a.budget if a.budget is not None else parse_bytes(ps["budget"]),
                  networks=networks, modes=modes, out=a.out, compile_backend=a.compile_backend,
                  seed=a.seed, progress=not a.no_progress,
                  command=" ".join(["python -m ckpt_ext.bench"] + argv))


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
    written = [stem + ".md", stem + ".json"]
    if plot(results, stem + ".png"):
        written.append(stem + ".png")
    print(table)
    errors = [f"{n}/{m}: {r['error']}" for n, modes in results["networks"].items()
              for m, r in modes.items() if "error" in r]
    if errors:  # reported in the table as n/a; said here too, so no failure goes unseen
        print("bench: modes that could not run:\n  " + "\n  ".join(errors), file=sys.stderr)
    print(f"wrote {', '.join(written)} ({results['conditions']['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
