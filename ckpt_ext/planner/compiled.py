"""Planning for a compiled step (``plan(..., compiled=True)``): the step of
``torch.compile(model)`` after ``Plan.apply``.

Inside a compiled graph there are no marks to cut the step at (a hook that reads the meter would
break the graph), and inductor's partitioner moves the peak (it recomputes pointwise work of its
own, and frees what it can earlier), so the eager figures do not predict a compiled step. The
compiled probe measures whole steps instead: one compiled step per row of the options table, with
every unit that can take that option under it (``torch._dynamo.reset()`` before each compile).
Each option's change of the compiled peak from plain's is shared among the units in proportion to
their change of the eager bytes kept (equal shares for identical units), which makes the compiled
peak of any choice a sum: plain's compiled peak plus each unit's share. The solver (solver.py)
chooses on these sums as on eager figures, and the chosen configuration is compiled and measured;
where it does not fit, the budget the solver sees is lowered by the excess and it chooses again
(the choice of least predicted peak where none is left; at most :data:`MAX_CHECKS` checks), so
the plan returned has a measured compiled peak within the budget. FLOPs are the eager step's (``FlopCounterMode``): a compiled graph recomputes the GEMMs
its eager checkpoint recomputes."""
from __future__ import annotations

import gc
from dataclasses import replace
from typing import Dict, List, Sequence, Tuple

from ..memory import measured_step
from .figures import OptionFigures, StepFigures
from .probe import Probe
from .units import OPTIONS, Option, Unit

#: How many chosen configurations are compiled and measured before giving up on a budget.
MAX_CHECKS = 4


def compiled_step(probe: Probe, units: Sequence[Unit], options: Sequence[Option]) -> dict:
    """(peak, kept) of one compiled step of the probe's copy in this configuration: compiled
    and run once, then measured (``measured_step``'s figures)."""
    import torch._dynamo

    probe.configure(units, options)
    torch._dynamo.reset()
    compiled = torch.compile(probe.copy, dynamic=False)
    how, where = probe.training_step, probe.where

    def clear():
        for p, _ in probe._grads:
            p.grad = None

    clear()
    how.loss(how.forward(compiled), where).backward()  # compiles forward and backward
    clear()
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        got = measured_step(lambda _: how.forward(compiled), None, probe.meter,
                            loss_fn=lambda out, _: how.loss(out, where))
    finally:
        if was_enabled:
            gc.enable()
        clear()
        torch._dynamo.reset()
    return {"peak": got["peak_above_before_forward"], "kept": got["kept_for_backward"]}


def compiled_figures(probe: Probe, fig: StepFigures, units: List[Unit]
                     ) -> Tuple[StepFigures, Dict[str, dict]]:
    """Figures whose chain prediction is the compiled step's peak (see the module's note), and
    each whole-step compiled probe's measurement by option."""
    n = len(units)
    measured = {Option.NONE.value: compiled_step(probe, units, [Option.NONE] * n)}
    plain = measured[Option.NONE.value]
    shares: List[Dict[Option, int]] = [{Option.NONE: 0} for _ in units]
    for option in OPTIONS:
        having = [i for i, u in enumerate(units) if option in u.options]
        if option == Option.NONE or not having:
            continue
        config = [option if i in having else Option.NONE for i in range(n)]
        got = measured[option.value] = compiled_step(probe, units, config)
        eager = {i: fig.units[i][option].fwd_growth - fig.units[i][Option.NONE].fwd_growth
                 for i in having}
        total = sum(eager.values())
        for i in having:
            weight = eager[i] / total if total else 1 / len(having)
            shares[i][option] = round((got["peak"] - plain["peak"]) * weight)
    compiled = StepFigures(
        first_excess=0, first_growth=0, gaps=[(0, 0)] * max(n - 1, 0),
        head_excess=plain["peak"], head_growth=0, head_kept=plain["kept"],
        other_flops=fig.other_flops,
        units=[{o: OptionFigures(fwd_growth=s, fwd_excess=0, bwd_growth=-s, bwd_excess=0,
                                 flops=fig.units[i][o].flops)
                for o, s in shares[i].items()} for i in range(n)],
        plain_peak=plain["peak"], plain_kept=plain["kept"])
    return compiled, measured


def lowered(fig: StepFigures, by: int) -> StepFigures:
    """``fig`` with every prediction ``by`` bytes higher (the solver then keeps that much
    further below a budget)."""
    return replace(fig, head_excess=fig.head_excess + by, plain_peak=fig.plain_peak + by)
