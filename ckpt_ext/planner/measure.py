"""The probe steps a plan needs and the figures they give: the plain step (which also says which
units form a chain and which are handed a cache), then one step per row of the options table with
every unit that can take that option under it; each unit's figures under each of its options
from the step where it had that option; the head's under ``fused loss`` from a step with every
unit ``none``."""
from __future__ import annotations

from dataclasses import replace
from typing import List, Tuple

from .._head_loss import HeadForward
from .figures import (HeadFigures, StepFigures, chain_prediction, combine, head_figures, shared_figures,
                      spread, unit_figures)
from .probe import Probe, chain_problems
from .units import OPTIONS, Option, Unit, find_head, recomputing


def _without(units: List[Unit], options, why: dict) -> List[Unit]:
    """``units`` with unit i's ``options`` left out for the reason ``why[i]``."""
    out = []
    for i, u in enumerate(units):
        dropped = [o for o in options if o in u.options] if i in why else []
        if dropped:
            u = Unit(u.path, u.kind, tuple(o for o in u.options if o not in dropped),
                     u.fuse_targets, u.cls, {**u.why_not, **{o: why[i] for o in dropped}})
        out.append(u)
    return out


def figures_of(probe: Probe, units: List[Unit], notes: List[Tuple[str, str]]
               ) -> Tuple[StepFigures, List[Unit], List[Tuple[str, str]], int]:
    """(figures, the units kept, notes with what was dropped and why, spread in bytes)."""
    head, head_notes = find_head(probe.copy)
    notes = list(notes) + head_notes
    while True:  # the plain step: the units that form a chain
        memory, flops = probe.measure(units, [Option.NONE] * len(units))
        problems = {**chain_problems(flops, len(units)), **chain_problems(memory, len(units))}
        if not problems:
            break
        notes += [(units[i].path, why) for i, why in sorted(problems.items())]
        units = [u for i, u in enumerate(units) if i not in problems]
    caches = {i: f"its forward is handed a cache ({arg}), which a recompute would update "
                 f"twice; pass use_cache=False" for i, arg in memory.cache_args.items() if arg}
    units = _without(units, [o for o in OPTIONS if recomputing(o)], caches)
    n = len(units)
    traces = {Option.NONE: (memory, flops)}
    for option in OPTIONS:
        if option == Option.NONE:
            continue
        if any(option in u.options for u in units):
            config = [option if option in u.options else Option.NONE for u in units]
            traces[option] = probe.measure(units, config)
            problems = chain_problems(traces[option][0], n)
            if problems:  # that option moves the unit out of the chain: not an option
                units = _without(units, [option], {
                    i: f"with it the step is no chain ({why})" for i, why in problems.items()})
    shared = [shared_figures(m, f, n) for m, f in traces.values()]
    fig = combine(shared)
    fig.units = [{o: unit_figures(*traces[o], i, n) for o in u.options}
                 for i, u in enumerate(units)]
    # every unit none in plain's own figures: its probe's peak and kept bytes, exactly
    plain = chain_prediction(replace(shared[0], units=fig.units), [Option.NONE] * n)
    fig.plain_peak, fig.plain_kept = plain.peak, plain.kept
    if head is not None:
        fused = probe.measure(units, [Option.NONE] * n + [Option.FUSED_LOSS])
        why = _head_problem(probe, head) or "; ".join(chain_problems(fused[0], n).values())
        if why:
            notes.append((head.path, f"its loss is not fused with it: {why}"))
        else:
            fig.head = head
            # its change from plain's head, on the head every configuration's steps give
            got, was = head_figures(shared_figures(*fused, n)), head_figures(shared[0])
            fig.heads = {Option.FUSED_LOSS: HeadFigures(
                fig.head_excess + got.excess - was.excess,
                fig.head_growth + got.growth - was.growth, fig.head_kept + got.kept - was.kept,
                got.other_flops)}
    return fig, units, notes, spread(shared)


def _head_problem(probe: Probe, head: Unit) -> str:
    """Why the probe steps did not compute the head's loss fused (its counts), or ""."""
    forward = vars(probe.copy.get_submodule(head.path)).get("forward")
    stats = forward.__dict__["_ckpt_ext_stats"] if isinstance(forward, HeadForward) else None
    if stats is None or stats.fused_calls == 0:
        return "the step never computed the model's loss from its output"
    return "; ".join(stats.reasons)
