"""The ``plan`` section (``python -m ckpt_ext.bench --section plan``): ``ckpt_ext.plan`` against the
other ways to fit a training step into a memory budget, side by side in one run, on a Llama-shaped
network (transformers' ``LlamaForCausalLM`` from a config: 8 decoder layers, attention included,
the loss on next-token labels). Budgets: from plain's peak down to the least any plan reaches.

Per budget: the plan (eager, every option of the options table); the plan for the compiled step
(``plan(..., compiled=True)``, applied, then ``torch.compile``); transformers' checkpointing of
every layer; of every n-th layer, with the fewest layers checkpointed that fits (the largest n);
``torch.compile`` with ``activation_memory_budget`` (one compile per fraction of a grid,
``torch._dynamo.reset()`` between: the largest fraction that fits). Every
configuration is measured once (memory: ``ckpt_ext.planner.measure_step``; FLOPs:
``FlopCounterMode``, a compiled graph's counted on the same partition run eagerly), and timed in
interleaved loops. Method, results and targets: docs/benchmark.md, "Planning within a budget".
"""
from __future__ import annotations

import copy
import gc
import statistics
import time
import warnings
from typing import Callable, Dict, List, Optional

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from .. import fuse
from ..planner import measure_step, plan
from ..planner.compiled import compiled_flops
from ..planner.units import OPTIONS, Option
from ..memory import uninstrumented

#: The network per benchmark preset: decoder layers of Llama's shape (gated SiLU MLP at
#: intermediate = 2.75 x hidden, multi-head attention, RMSNorm, rotary embeddings), a batch of
#: ``batch`` sequences of ``seq`` tokens.
PLAN_SIZES = {
    "tiny": dict(hidden=32, intermediate=88, layers=8, heads=4, vocab=128, batch=2, seq=32,
                 steps=2, warmup=1),
    "small": dict(hidden=128, intermediate=352, layers=8, heads=4, vocab=2048, batch=4, seq=256,
                  steps=7, warmup=1),
    "cpu-default": dict(hidden=128, intermediate=352, layers=8, heads=4, vocab=2048, batch=4,
                        seq=256, steps=7, warmup=1),
    "writeup": dict(hidden=2048, intermediate=5632, layers=8, heads=16, vocab=32000, batch=4,
                    seq=1024, steps=5, warmup=2),
}
#: Where the budgets sit between the least any plan reaches (0) and plain's peak (1).
BUDGET_POSITIONS = (1.0, 0.75, 0.5, 0.25, 0.0)
#: torch.compile's activation_memory_budget, one compile each.
COMPILE_FRACTIONS = (1.0, 0.75, 0.5, 0.25, 0.0)
METHODS = ("plan", "plan-compiled", "hf-every-layer", "hf-every-n", "compile")
#: The plan's targets: seconds per call of ``plan``, and the share of every-n-th-layer
#: checkpointing's recompute the eager plan saves at least.
PLAN_SECONDS, LESS_RECOMPUTE = 15.0, 0.30
#: The compiled plan's step time at most this times compile's own budget's.
COMPILED_TIME_RATIO = 1.05


def llama(sizes: dict, device: torch.device, dtype: torch.dtype) -> nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=sizes["vocab"], hidden_size=sizes["hidden"],
        intermediate_size=sizes["intermediate"], num_hidden_layers=sizes["layers"],
        num_attention_heads=sizes["heads"], num_key_value_heads=sizes["heads"],
        max_position_embeddings=sizes["seq"])
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(device, dtype).train()


def inputs_of(sizes: dict, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, sizes["vocab"], (sizes["batch"], sizes["seq"]), generator=g)
    ids = ids.to(device)
    return dict(input_ids=ids, labels=ids, use_cache=False)


def sharing_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with the same Parameter objects: no second set of weights."""
    return copy.deepcopy(model, {id(p): p for p in model.parameters()})


def hf_checkpointing(model: nn.Module, every_n: int) -> None:
    """transformers' own activation checkpointing (non-reentrant) of every n-th layer."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=every_n)
        return
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for i, layer in enumerate(model.model.layers):  # older transformers: no every_n_layers
        layer.gradient_checkpointing = i % every_n == 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(model: Callable, inputs: dict) -> None:
    model(**inputs).loss.backward()


def _flops(model: Callable, inputs: dict) -> int:
    with FlopCounterMode(display=False) as counter:
        _step(model, inputs)
    return int(counter.get_total_flops())


def _clear(params) -> None:
    for p in params:
        p.grad = None


class Section:
    """One run of the section: the network, its budgets, every configuration measured."""

    def __init__(self, device: torch.device, dtype: torch.dtype, preset: str,
                 methods=METHODS, compile_backend: str = "inductor",
                 log: Callable[[str], None] = print, sizes: Optional[dict] = None) -> None:
        self.device, self.dtype, self.preset = device, dtype, preset
        self.sizes = dict(PLAN_SIZES[preset], **(sizes or {}))
        self.methods, self.backend, self.log = tuple(methods), compile_backend, log
        self.base = llama(self.sizes, device, dtype)
        self.params = list(self.base.parameters())
        self.inputs = inputs_of(self.sizes, device)
        self.configs: Dict[str, dict] = {}
        self.models: Dict[str, nn.Module] = {}

    # -- configurations ------------------------------------------------------------------------
    def add(self, name: str, model: nn.Module, flops: Optional[int] = None, **info) -> None:
        """Measure a configuration once: its memory, and its FLOPs (counted here unless given)."""
        if name in self.configs:
            return
        self.log(f"plan section: {name}")
        _clear(self.params)
        memory = measure_step(model, self.inputs)
        _clear(self.params)
        self.configs[name] = dict(info, peak=memory["peak_above_before_forward"],
                                  kept=memory["kept_for_backward"],
                                  flops=_flops(model, self.inputs) if flops is None else flops)
        _clear(self.params)
        self.models[name] = model

    def time_loop(self, names: List[str]) -> None:
        """Median step time of each configuration, interleaved (plain first in each round), on
        the stock allocator; its ratio to plain is the median over rounds of its step over
        plain's step in the same round, so that others' work on a shared machine, which comes and
        goes between rounds, hits both sides of each ratio alike."""
        s = self.sizes
        times: Dict[str, List[float]] = {n: [] for n in names}
        with uninstrumented(self.device):
            for _ in range(s["warmup"]):
                for n in names:
                    _step(self.models[n], self.inputs)
                    _clear(self.params)
            gc.collect()
            for _ in range(s["steps"]):
                for n in names:
                    _sync(self.device)
                    t = time.perf_counter()
                    _step(self.models[n], self.inputs)
                    _sync(self.device)
                    times[n].append(time.perf_counter() - t)
                    _clear(self.params)
        plain_ms = statistics.median(times["plain"]) * 1e3
        for n in names:
            if n == "plain" and "step_ms" in self.configs[n]:
                continue  # plain's own row: its first loop
            ms = statistics.median(times[n]) * 1e3
            ratio = statistics.median(t / p for t, p in zip(times[n], times["plain"]))
            self.configs[n].update(step_ms=ms, step_ms_all=[t * 1e3 for t in times[n]],
                                   plain_ms_same_loop=plain_ms, time_vs_plain=ratio)

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> dict:
        base, inputs = self.base, self.inputs
        self.add("plain", base)
        t = time.perf_counter()
        surveyed = plan(base, inputs, 2**62)
        survey_s = time.perf_counter() - t
        least, plain_peak = surveyed.least_peak_bytes, surveyed.plain_peak_bytes
        budgets = [round(least + f * (plain_peak - least)) for f in BUDGET_POSITIONS]
        self.log(f"plan section: plain peak {plain_peak:,} B, least {least:,} B")
        self.add("fuse-all", fuse(sharing_copy(base))[0])
        plans = []
        for b in budgets:
            t = time.perf_counter()
            p = plan(base, inputs, b)
            seconds = time.perf_counter() - t
            name = "plan " + short(p.choices)
            self.add(name, p.apply(sharing_copy(base))[0], choices=p.choices,
                     predicted_peak=p.peak_bytes, predicted_kept=p.kept_bytes,
                     predicted_added_flops=p.added_flops)
            plans.append((b, name, seconds, p))
        if {"hf-every-layer", "hf-every-n"} & set(self.methods):
            for n in range(1, self.sizes["layers"] + 1):
                model = sharing_copy(base)
                hf_checkpointing(model, n)
                self.add(f"hf every {n}", model, every_n=n)
        self.time_loop(list(self.configs))
        if "compile" in self.methods:
            for f in COMPILE_FRACTIONS:
                self.compiled(f)
        compiled_plans = {}
        if "plan-compiled" in self.methods:
            for b in budgets:
                compiled_plans[b] = self.compiled_plan(b)
        return self.results(budgets, plans, survey_s, compiled_plans)

    def compiled_plan(self, budget: int):
        """``plan(..., compiled=True)`` at ``budget``, applied and compiled: its memory and time
        (``self.backend``) and its FLOPs from the same partition run eagerly; (name, seconds),
        and its predicted peak; (None, seconds, None) where no compiled plan fits. Where the plan
        chose compile's own budget, that configuration's name ("compile budget f")."""
        import torch._dynamo

        t = time.perf_counter()
        try:
            p = plan(self.base, self.inputs, budget, compiled=True)
        except ValueError as e:
            self.log(f"plan section: compiled plan at {budget:,} B: {e}")
            return None, time.perf_counter() - t, None
        seconds = time.perf_counter() - t
        if set(p.choices.values()) == {"none"}:  # plain, compiled: compile's configuration
            fraction = 1.0 if p.compile_memory_budget is None else p.compile_memory_budget
            name = f"compile budget {fraction:g}"
            if name not in self.configs:
                self.compiled(fraction)
            self.configs[name]["chosen_by_compiled_plan"] = p.compiled_seconds
            return name, seconds, p.peak_bytes
        name = " ".join(["plan compiled", short(p.choices)]
                        + [f"{k}={v}" for k, v in p.compile_options.items()])
        if name in self.configs:
            return name, seconds, p.peak_bytes
        with warnings.catch_warnings():  # applied to count FLOPs: compiled with its options below
            warnings.simplefilter("ignore")
            flops = compiled_flops(p.apply(sharing_copy(self.base))[0],
                                   lambda m: _step(m, self.inputs))
        torch._dynamo.reset()
        model = (p.compile(sharing_copy(self.base), dynamic=False) if self.backend == "inductor"
                 else torch.compile(p.apply(sharing_copy(self.base))[0], backend=self.backend,
                                    dynamic=False))
        t = time.perf_counter()
        _step(model, self.inputs)  # compiles forward and backward
        compile_s = time.perf_counter() - t
        _clear(self.params)
        self.add(name, model, flops=flops, choices=p.choices, predicted_peak=p.peak_bytes,
                 predicted_kept=p.kept_bytes, predicted_added_flops=p.added_flops,
                 compile_s=compile_s, plan_seconds=seconds, compiled_seconds=p.compiled_seconds)
        self.time_loop(["plain", name])
        del self.models[name]
        torch._dynamo.reset()
        return name, seconds, p.peak_bytes

    def compiled(self, fraction: float) -> None:
        """torch.compile of the plain model with activation_memory_budget = fraction: its memory
        and time (``self.backend``), and its FLOPs from the same partition run eagerly."""
        import torch._dynamo
        import torch._functorch.config as functorch_config

        name = f"compile budget {fraction:g}"
        flops = compiled_flops(sharing_copy(self.base), lambda m: _step(m, self.inputs),
                               fraction)
        with functorch_config.patch(activation_memory_budget=fraction):
            torch._dynamo.reset()  # else the compile below reuses the previous fraction's graph
            model = torch.compile(sharing_copy(self.base), backend=self.backend, dynamic=False)
            t = time.perf_counter()
            _step(model, self.inputs)  # compiles forward and backward
            compile_s = time.perf_counter() - t
            _clear(self.params)
            self.add(name, model, flops=flops, fraction=fraction, compile_s=compile_s)
            self.time_loop(["plain", name])
            del self.models[name]
        torch._dynamo.reset()

    # -- results ------------------------------------------------------------------------------
    def results(self, budgets: List[int], plans: list, survey_s: float,
                compiled_plans: Optional[dict] = None) -> dict:
        c = self.configs
        plain_flops = c["plain"]["flops"]
        for r in c.values():
            r["added_flops"] = r["flops"] - plain_flops
        rows = []
        for (b, name, seconds, p) in plans:
            fits = {n: r["peak"] <= b for n, r in c.items()}
            every_n = [n for n in c if n.startswith("hf every ") and fits[n]]
            compiled = [n for n in c if n.startswith("compile ") and fits[n]]
            rows.append({
                "budget": b, "plan": name, "plan_seconds": seconds,
                "hf-every-layer": "hf every 1" if "hf every 1" in c else None,
                "hf-every-n": max(every_n, key=lambda n: c[n]["every_n"]) if every_n else None,
                "compile": max(compiled, key=lambda n: c[n]["fraction"]) if compiled else None,
                "fuse-all fits": fits.get("fuse-all", False),
            })
            if compiled_plans:
                (rows[-1]["plan-compiled"], rows[-1]["plan-compiled_seconds"],
                 rows[-1]["plan-compiled_predicted"]) = compiled_plans[b]
        return {"sizes": self.sizes, "budgets": budgets, "rows": rows, "configs": c,
                "plan_survey_s": survey_s, "methods": list(self.methods),
                "targets": targets(rows, c, survey_s)}


def short(choices: Dict[str, str]) -> str:
    """A choice in a configuration's name: the options table's letters, one group per unit."""
    return ",".join(OPTIONS[Option(v)].short for v in choices.values())


def targets(rows: List[dict], c: Dict[str, dict], survey_s: float = 0.0) -> dict:
    """The section's targets, each with met (True/False, or None where no budget tests it) and
    the figures behind it (``survey_s``: the first call of ``plan``)."""
    within, le_all, le_compile, less, honest, seconds = [], [], [], [], [], [survey_s]
    c_fits, c_flops, c_time = [], [], []
    for row in rows:
        b, mine = row["budget"], c[row["plan"]]
        within.append(mine["peak"] <= b)
        honest.append(abs(mine["peak"] - mine["predicted_peak"]) / mine["predicted_peak"])
        seconds.append(row["plan_seconds"])
        eager = [row[m] for m in ("hf-every-layer", "hf-every-n") if row[m]]
        le_all.append(all(mine["flops"] <= c[n]["flops"] for n in eager if c[n]["peak"] <= b))
        comp = row["compile"]
        if comp:
            le_compile.append(mine["flops"] <= c[comp]["flops"])
        every_n = row["hf-every-n"]
        if every_n and c[every_n]["added_flops"] > 0:
            less.append(1 - mine["added_flops"] / c[every_n]["added_flops"])
        name = row.get("plan-compiled")
        if "plan-compiled" in row:
            ok = name is not None and c[name]["peak"] <= b
            c_fits.append(ok)
            if name is not None:
                predicted = row["plan-compiled_predicted"]
                honest.append(abs(c[name]["peak"] - predicted) / predicted)
            if comp and ok:
                c_flops.append(c[name]["flops"] <= c[comp]["flops"])
                c_time.append(round(c[name]["time_vs_plain"] / c[comp]["time_vs_plain"], 3))
    out = {
        "eager plan FLOPs <= every fitting eager alternative's, every budget":
            {"met": all(le_all), "per_budget": le_all},
        "eager plan FLOPs <= compile's budget's, where compile fits":
            {"met": all(le_compile) if le_compile else None, "per_budget": le_compile},
        f">= {LESS_RECOMPUTE:.0%} less recompute than every-n-th-layer checkpointing, where "
        f"both fit": {"met": (min(less) >= LESS_RECOMPUTE) if less else None,
                      "less_recompute": less},
        "measured peak never above the budget": {"met": all(within), "per_budget": within},
        "measured peak within 5 % of the prediction (eager and compiled plans)":
            {"met": max(honest) <= 0.05, "worst": max(honest)},
        f"plan() <= {PLAN_SECONDS:g} s per call": {"met": max(seconds) <= PLAN_SECONDS,
                                                    "seconds": seconds},
    }
    if c_fits:
        out.update({
            "compiled plan fits every budget": {"met": all(c_fits), "per_budget": c_fits},
            "compiled plan FLOPs <= compile's budget's, where compile fits":
                {"met": all(c_flops) if c_flops else None, "per_budget": c_flops},
            f"compiled plan step <= {COMPILED_TIME_RATIO:g}x compile's budget's, where compile "
            f"fits": {"met": (max(c_time) <= COMPILED_TIME_RATIO) if c_time else None,
                      "ratio": c_time},
        })
    return out


def conditions(cfg) -> dict:
    """The run's conditions (cfg: the CLI's Config)."""
    import transformers

    from .orchestrate import conditions as main_conditions

    c = main_conditions(cfg)
    keep = ("device", "dtype", "preset", "compile_backend", "torch", "python", "memory_meter",
            "command")
    return dict({k: c[k] for k in keep}, transformers=transformers.__version__)
