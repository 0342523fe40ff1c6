"""What each fused unit computed, counted at its calls (the counts: ckpt_ext/_unit_stats.py):
fused, unfused (with the reason its warning gives: a :class:`Checked` unit's failing condition,
or why its region was not marked), or fused inside a checkpointed ancestor that recomputes it
whole. A unit computing otherwise than the report said warns ``FallbackWarning`` once per reason;
``ckpt_ext.stats(model)`` reads the counts. Only calls that record gradients count (under
``no_grad`` nothing is kept, fused or not). Docs: docs/fuse-usage.md, "Is it fused?"."""
from __future__ import annotations

import copy
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from .._unit_stats import FallbackWarning, SetByFuse, UnitStats, counting  # noqa: F401
from .facts import failing, first_failing


def unit_stats(run: Any) -> UnitStats:
    """The counts of a unit's run object (made at the first call where fuse made none)."""
    stats = run.__dict__.get("_ckpt_ext_stats")
    if stats is None:
        d = getattr(run, "decision", None)
        labels = getattr(run, "labels", None) or (getattr(run, "label", ""),)
        stats = run.__dict__["_ckpt_ext_stats"] = UnitStats(
            d.where if d is not None else labels[0], d.layers if d is not None else labels)
    return stats


def attach(run: Any, decision: Any, checkpointed) -> None:
    """Give a run fuse places its counts, named as ``decision`` names it; ``checkpointed``:
    (path, module) of its ancestors that transformers' checkpointing can recompute whole."""
    if "_ckpt_ext_stats" not in run.__dict__:
        run.__dict__["_ckpt_ext_stats"] = UnitStats(decision.where, decision.layers, checkpointed)


def count_fused(run: Any) -> None:
    """Count a fused call of ``run`` (nothing is touched where calls do not count: under
    torch.compile's tracing a new object or attribute would be a graph's side effect)."""
    if counting():
        unit_stats(run).fused()


def count_unfused(run: Any, reason: str, fix: Optional[str] = None) -> None:
    """Count an unfused call of ``run``, and warn the first time for ``reason``."""
    if counting():
        unit_stats(run).unfused(reason, fix)


def by_state(self, memo):
    """``__deepcopy__`` through ``__getstate__`` and ``__setstate__``."""
    new = type(self).__new__(type(self))
    memo[id(self)] = new
    new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
    return new


class Checked:
    """A unit's runtime object: the ``conditions`` (from ``_conditions()``) that must hold at a
    call for the fused op to compute it, made once (not by functools.cached_property, whose lock
    torch.compile cannot trace on Python 3.11); pickles and copies do not keep them."""

    @property
    def conditions(self) -> tuple:
        made = self.__dict__.get("_made_conditions")
        if made is None:
            made = tuple(self._conditions())
            # not kept while torch.compile traces: a write inside a compiled checkpoint (a first
            # call under pointwise recompute) is a side effect dynamo refuses
            if not torch.compiler.is_compiling():
                self.__dict__["_made_conditions"] = made
        return made

    def problem(self) -> Optional[str]:
        """None while the unit can be computed fused, else what changed since fuse."""
        return failing(self.conditions)

    def refused(self) -> bool:
        """At a call: False while every condition holds; else the call is counted unfused with
        the failing condition's reason, and True."""
        failed = first_failing(self.conditions)
        if failed is None:
            return False
        if counting():
            fix = getattr(failed, "fix", None)  # a Slot has none
            unit_stats(self).unfused(failed.describe(), fix() if fix is not None else None)
        return True

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_made_conditions", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)

    __deepcopy__ = by_state


def outside_region(run: Any) -> Tuple[str, str]:
    """(reason, fix) for a run whose first member was called with no region of its owner's."""
    owner = (run.decision.where if run.decision else "its owner") or "<model>"
    if not any(isinstance(v, SetByFuse) for v in vars(run.owner).values()):
        why = (f"{owner}'s forward is no longer the one fuse set on it (replaced on the "
               f"instance), so the run's region is not marked")
    else:
        why = (f"{run.calls[0]} was called outside {owner}'s forward as fuse set it (a forward "
               f"patched on {owner} as a closure over the method fuse replaced, or the member "
               f"called on its own)")
    return why, ("call ckpt_ext.fuse after what patches the forward (on the model the trainer "
                 "actually trains), or call the module itself rather than its old bound forward")


def _total(name: str) -> property:
    return property(lambda self: sum(getattr(s, name) for s in self))


class Stats(List[UnitStats]):
    """``ckpt_ext.stats(model)``: one :class:`UnitStats` per fused unit, in the model's order;
    each count's sum over them."""
    fused_calls, unfused_calls, recomputed_calls = map(
        _total, ("fused_calls", "unfused_calls", "recomputed_calls"))

    def __str__(self) -> str:
        lines = [f"ckpt_ext.stats: {len(self)} fused unit(s); calls with gradients recorded: "
                 f"{self.fused_calls:,} fused, {self.unfused_calls:,} unfused"
                 + (f", {self.recomputed_calls:,} recomputed by checkpointing around them"
                    if self.recomputed_calls else "")]
        for s in self:
            extra = f", {s.recomputed_calls:,} under checkpointing" if s.recomputed_calls else ""
            lines.append(f"  {s.name}: {s.fused_calls:,} fused, {s.unfused_calls:,} unfused{extra}")
            lines += [f"    {n:,} x {reason}" for reason, n in s.reasons.items()]
        return "\n".join(lines)


def _runs(model: nn.Module) -> Iterator[Any]:
    """Every run object fuse left in ``model`` (members', Sequentials' parts, owners' forwards)."""
    for m in model.modules():
        run = vars(m).get("_ckpt_ext_run")
        if run is not None:
            yield run
        for part in vars(m).get("_ckpt_ext_runs", ()):
            yield part.run
            if part.alone is not None:
                yield part.alone.run
        for v in vars(m).values():
            yield from getattr(v, "runs", ()) if isinstance(v, SetByFuse) else ()


def stats(model: nn.Module) -> Stats:
    """The calls of every unit fuse (or an applied plan) put in ``model``, counted since fuse."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"ckpt_ext.stats expects an nn.Module, got {type(model).__name__}")
    seen: Dict[int, Any] = {}
    for run in _runs(model):  # a Sequential's stretch computed alone counts once it runs
        if run.__dict__.get("decision") is not None or run.__dict__.get("_ckpt_ext_stats"):
            seen.setdefault(id(run), run)
    return Stats(unit_stats(run) for run in seen.values())
