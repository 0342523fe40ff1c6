"""A benchmark run: every network in every mode, in phases that each measure one thing (warm-up,
memory with the counting allocator, step times without it, gradient agreement), then per-mode
figures. Returns a results dict (``conditions``, ``networks``: name -> mode -> figures,
``{"error": ...}`` or ``{"same_as": ..., "why": ...}``, and ``targets``: name -> what -> met and
figures, for the networks that have targets); the method is in docs/benchmark.md.
"""
from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import platform
import statistics
import sys
from typing import Callable

import torch
import torch._dynamo
from torch import nn

from ..memory import MemoryMeter, clear_grads, measured_step, uninstrumented
from ..models import NETWORKS, PINNNet, is_pinn, recomputed_gemms
from .measure import grad_errors, max_batch, share_parameters, timed_gemms, timed_step
from .presets import MODES, SAME_AS, Config, model_mode, runs_mode, sizes_in
from .targets import targets


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
    results: dict = {"conditions": conditions(cfg), "networks": {}, "targets": {}}
    # per mode: warm-up at 2 batch sizes, memory at 2, steps, agreement
    total = len(cfg.networks) * len(cfg.modes) * (2 * cfg.warmup + 2 + cfg.steps + 1)
    bar = tqdm(total=total, desc="bench", disable=not cfg.progress, file=sys.stderr,
               dynamic_ncols=True)
    try:
        # A compiled mode that hits the recompile limit would silently run eager: make it an error.
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            for net_name in cfg.networks:
                bar.set_postfix_str(net_name)
                missing = missing_requirements(net_name)
                if missing:  # every row says why, and main() lists them
                    results["networks"][net_name] = {
                        m: {"error": f"needs {missing}, which is not installed"}
                        for m in cfg.modes if runs_mode(net_name, m)}
                    continue
                torch._dynamo.reset()  # each network starts with empty compile caches
                modes = results["networks"][net_name] = run_network(cfg, net_name, meter, bar)
                torch._dynamo.reset()
                met = targets(net_name, modes, sizes_in(results["conditions"], net_name))
                if met:
                    results["targets"][net_name] = met
    finally:
        bar.close()
        meter.stop()
    return results


def missing_requirements(net_name: str) -> str:
    """The packages network ``net_name`` builds on (its class's ``REQUIRES``) that are not
    installed, comma-separated, or ""."""
    return ", ".join(m for m in getattr(NETWORKS[net_name], "REQUIRES", ())
                     if importlib.util.find_spec(m) is None)


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
            if not runs_mode(net_name, mode):  # a mode of another network family: no row
                continue
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
        if is_pinn(self.net_name):
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

    @contextlib.contextmanager
    def same_draws(self):
        """The generator seeded alike for each step it wraps, and left as it was: random masks
        (LoRA dropout) drawn the same in every mode."""
        cfg = self.cfg
        with torch.random.fork_rng(devices=[cfg.device.index or 0]
                                   if cfg.device.type == "cuda" else []):
            torch.manual_seed(cfg.seed)
            yield

    def check_gradients(self) -> None:
        """Gradient agreement with plain on the same weights, input and random draws (a compiled
        mode's draws come from its own generator code; inductor's differ from eager's)."""
        with uninstrumented(self.cfg.device):
            self.settle()
            with self.same_draws():
                self.loss_fn(self.plain(self.x), self.x).backward()
            ref = {n: p.grad.detach().clone() for n, p in self.plain.named_parameters()
                   if p.grad is not None}
            for mode in self.modes:
                def agree():
                    self.settle()
                    with self.same_draws():
                        self.loss_fn(self.nets[mode](self.x), self.x).backward()
                    self.res[mode]["grad_rel_err"] = grad_errors(self.plain, ref)
                self.guarded(mode, agree)
                self.bar.update(1)
            ref.clear()  # agree() reads it: emptied, not unbound
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
            res.update(max_batch(self.cfg.budget_of(self.net_name), self.sizes.batch,
                                 res["peak"], res["peak_half_batch"], self.x_half.shape[0]))
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
        "bert_sizes": vars(cfg.bert), "llama_sizes": vars(cfg.llama), "moe_sizes": vars(cfg.moe),
        "mlp_ratio": cfg.ratio, "steps": cfg.steps, "warmup": cfg.warmup,
        "budget_bytes": cfg.budget, "bert_budget_bytes": cfg.bert_budget,
        "llama_budget_bytes": cfg.llama_budget, "moe_budget_bytes": cfg.moe_budget,
        "compile_backend": cfg.compile_backend,
        "torch": torch.__version__, "python": platform.python_version(),
        "memory_meter": ("exact bytes of every CPU tensor allocation (ckpt_ext counting allocator)"
                         if cfg.device.type == "cpu" else "requested bytes of the CUDA caching "
                         "allocator (memory_stats requested_bytes.all.current/.peak)"),
        "timing": ("median of interleaved steps on the stock allocator (counting allocator "
                   "uninstalled); memory from separate instrumented steps"),
        "command": cfg.command,
    }
