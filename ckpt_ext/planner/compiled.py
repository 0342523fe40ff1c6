"""Planning for a compiled step (``plan(..., compiled=True)``): compiled probes (one compiled step
per row of the options table, the head's among them, and plain's under each of torch.compile's
own memory budgets), the plan's own choice checked compiled until it fits (with inductor's
buffer reuse off where it fits only so), then the faster of it and compile's budget. Why and
how: docs/plan.md, "Compiled steps"."""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.torch_version import TorchVersion

from ..memory import measured_step, uninstrumented
from .figures import HeadFigures, OptionFigures, StepFigures
from .probe import Probe
from .units import OPTIONS, Option, Unit

#: How many chosen configurations are compiled and measured before giving up on a budget.
MAX_CHECKS = 4
#: torch.compile's own ``activation_memory_budget`` fractions a compiled plan weighs, largest
#: first (1.0, the default, is plain's compiled probe).
FRACTIONS = (0.75, 0.5, 0.25, 0.0)
#: Steps timed per compiled candidate (their median), after the measured one.
TIMED_STEPS = 5
#: Inductor's options under which a compiled check that did not fit is measured again: a freed
#: buffer is not held for a later one of its size (docs/plan.md, "Inductor's buffer reuse").
REUSE_OFF = {"allow_buffer_reuse": False}


def graph_breaking(version: str = torch.__version__) -> Dict[Option, str]:
    """Options whose applied block ``torch.compile`` of this torch ``version`` cannot take as one
    graph, and why: a compiled plan leaves them out."""
    if TorchVersion(version) < (2, 14):
        return {o: (f"torch {version}'s dynamo refuses the fused MLP's region state written "
                    f"inside a checkpoint (HOP: unsafe side effect): the compiled step would "
                    f"break its graph there (torch 2.14 compiles it as one)")
                for o, row in OPTIONS.items() if row.fuses_inside_recompute}
    return {}


def without_graph_breaks(units: Sequence[Unit], version: str = torch.__version__) -> List[Unit]:
    """``units`` without the options :func:`graph_breaking` names, each with its reason."""
    refused = graph_breaking(version)
    return [replace(u, options=tuple(o for o in u.options if o not in refused),
                    why_not={**u.why_not, **{o: refused[o] for o in refused if o in u.options}})
            for u in units]


def compile_backend(fraction: Optional[float], options: Optional[Dict[str, object]] = None):
    """``torch.compile``'s backend for a step under ``activation_memory_budget = fraction`` and
    inductor's ``options`` (both set while it compiles, the backward's compile included; None and
    no options: inductor as configured)."""
    if fraction is None and not options:
        return "inductor"

    def inductor_planned(gm, example_inputs):
        import torch._functorch.config as functorch_config
        from torch._inductor.compile_fx import compile_fx

        budget = functorch_config.activation_memory_budget if fraction is None else fraction
        with functorch_config.patch(activation_memory_budget=budget):
            return compile_fx(gm, example_inputs, config_patches=dict(options or {}) or None)

    return inductor_planned


def compiled_step(probe: Probe, units: Sequence[Unit], options: Sequence[Option],
                  fraction: Optional[float] = None, timed: int = 0,
                  budget: Optional[int] = None, inductor: Optional[Dict[str, object]] = None
                  ) -> dict:
    """One compiled step of the probe's copy in this configuration (under compile's budget
    ``fraction`` and ``inductor``'s options): compiled and run once, then measured (``peak``,
    ``kept``: ``measured_step``'s figures), then, with ``timed`` and a peak within ``budget``
    (if given), that many steps timed on the stock allocator (``seconds``: their median)."""
    import torch._dynamo

    probe.configure(units, options)
    torch._dynamo.reset()
    compiled = torch.compile(probe.copy, backend=compile_backend(fraction, inductor),
                             dynamic=False)
    how, where = probe.training_step, probe.where
    probe.run(compiled)  # compiles forward and backward
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        got = measured_step(lambda _: how.forward(compiled), None, probe.meter,
                            loss_fn=lambda out, _: how.loss(out, where))
        for p, _ in probe._grads:
            p.grad = None
        out = {"peak": got["peak_above_before_forward"], "kept": got["kept_for_backward"]}
        if timed and (budget is None or out["peak"] <= budget):
            out["seconds"] = _median_seconds(lambda: probe.run(compiled), timed, probe.device)
    finally:
        if was_enabled:
            gc.enable()
        for p, _ in probe._grads:
            p.grad = None
        torch._dynamo.reset()
    return out


def _median_seconds(step: Callable[[], None], n: int, device: torch.device) -> float:
    seconds = []
    with uninstrumented(device):
        for _ in range(n):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - t)
    return statistics.median(seconds)


def compiled_figures(probe: Probe, fig: StepFigures, units: List[Unit]
                     ) -> Tuple[StepFigures, Dict[str, dict]]:
    """Figures whose chain prediction is the compiled step's peak, and each whole-step compiled
    probe's measurement by option: the head's options measured with every unit none; then each
    unit option's change of the compiled peak, measured with the head under its least-peak
    option (where the loss bounds the peak, the options that recompute more differ only there),
    is shared among the units under it in proportion to their change of the eager bytes kept
    (equal shares for identical units), so the compiled peak of any choice is a sum."""
    n = len(units)
    measured = {Option.NONE.value: compiled_step(probe, units, [Option.NONE] * n)}
    plain = measured[Option.NONE.value]
    heads = {}
    for option, eager in fig.heads.items():  # the head's options, every unit none
        got = measured[option.value] = compiled_step(probe, units, [Option.NONE] * n + [option])
        heads[option] = HeadFigures(got["peak"], 0, got["kept"], eager.other_flops)
    head = min((o for o in heads if heads[o].excess < plain["peak"]),
               key=lambda o: heads[o].excess, default=None)
    tail, base = ([], plain) if head is None else ([head], measured[head.value])
    shares: List[Dict[Option, int]] = [{Option.NONE: 0} for _ in units]
    for option in OPTIONS:
        having = [i for i, u in enumerate(units) if option in u.options]
        if option == Option.NONE or not having:
            continue
        config = [option if i in having else Option.NONE for i in range(n)] + tail
        got = measured[option.value] = compiled_step(probe, units, config)
        eager = {i: fig.units[i][option].fwd_growth - fig.units[i][Option.NONE].fwd_growth
                 for i in having}
        total = sum(eager.values())
        for i in having:
            weight = eager[i] / total if total else 1 / len(having)
            shares[i][option] = round((got["peak"] - base["peak"]) * weight)
    compiled = StepFigures(
        first_excess=0, first_growth=0, gaps=[(0, 0)] * max(n - 1, 0),
        head_excess=plain["peak"], head_growth=0, head_kept=plain["kept"],
        other_flops=fig.other_flops,
        units=[{o: OptionFigures(fwd_growth=s, fwd_excess=0, bwd_growth=-s, bwd_excess=0,
                                 flops=fig.units[i][o].flops)
                for o, s in shares[i].items()} for i in range(n)],
        plain_peak=plain["peak"], plain_kept=plain["kept"], head=fig.head, heads=heads)
    return compiled, measured


def checked_step(probe: Probe, units: Sequence[Unit], options: Sequence[Option], budget: int
                 ) -> Tuple[dict, Dict[str, object]]:
    """(its timed compiled step, inductor's options it ran under) of a choice: inductor as
    configured, or, where that step does not fit ``budget``, with :data:`REUSE_OFF` where that
    one fits; the configured step where neither does."""
    got = compiled_step(probe, units, options, timed=TIMED_STEPS, budget=budget)
    if got["peak"] <= budget:
        return got, {}
    off = compiled_step(probe, units, options, timed=TIMED_STEPS, budget=budget,
                        inductor=REUSE_OFF)
    return (off, dict(REUSE_OFF)) if off["peak"] <= budget else (got, {})


def compile_budget_fit(probe: Probe, units: Sequence[Unit], budget: int
                       ) -> Optional[Tuple[float, dict]]:
    """(fraction, its timed compiled step) of the largest of compile's own :data:`FRACTIONS`
    whose plain compiled step fits ``budget``, or None."""
    for fraction in FRACTIONS:
        got = compiled_step(probe, units, [Option.NONE] * len(units), fraction, TIMED_STEPS,
                            budget)
        if got["peak"] <= budget:
            return fraction, got
    return None


def compiled_flops(model: nn.Module, step: Callable[[nn.Module], None],
                   fraction: Optional[float] = None) -> int:
    """FLOPs of a compiled step (``step(compiled)`` runs forward, loss and backward): AOTAutograd's
    forward and backward graphs, partitioned as inductor partitions them (min-cut, inductor's
    decompositions, compile's budget ``fraction`` or the configured one), run eagerly under
    ``FlopCounterMode``."""
    import torch._dynamo
    import torch._functorch.config as functorch_config
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    from torch.utils.flop_counter import FlopCounterMode

    counted = [0]

    def compiler(gm, example_inputs):
        def run(args):
            # detached: no output aliases a tensor that requires grad, so the counter's module
            # tracker hooks no gradient of a graph AOTAutograd runs without recording
            args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
            with FlopCounterMode(display=False) as counter:
                out = gm(*args)
            counted[0] += counter.get_total_flops()
            return out
        run._boxed_call = True
        return run

    backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler,
                           partition_fn=min_cut_rematerialization_partition,
                           decompositions=select_decomp_table())
    budget = functorch_config.activation_memory_budget if fraction is None else fraction
    torch._dynamo.reset()
    try:
        with functorch_config.patch(activation_memory_budget=budget):
            compiled = torch.compile(model, backend=backend, dynamic=False)
            step(compiled)  # compiles
        counted[0] = 0
        step(compiled)
    finally:
        torch._dynamo.reset()
    return int(counted[0])
