"""Applying a plan to the user's model, in place: each run is made (or the one an earlier fuse put
in place is kept), its child Linear/activation members get their member class, each Sequential
exactly its parts, each owner an :class:`_OwnerForward` with its runs, guards and rewritten
source; what an earlier fuse put in place and this plan no longer holds is undone.
:func:`undo_all` takes everything fuse put in place out again (``ckpt_ext.unfuse``)."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from torch import nn

from ..modules import LayerActivations, collapse_activations
from .discovery import LayerCall
from .planning import PlannedRun, RunPlan
from .report import Decision
from .runtime import (FusedSequential, PartRole, RunLinear, RunMember, _GatedRun, _Guard,
                      _InlineRun,
                      _OwnerForward, _Run, _RunPart, is_sequential, member_class, owner_wrappers,
                      parts_of)
from .tracing import ModelAnalysis


def _apply_run(analysis: ModelAnalysis, plan: RunPlan, decision: Decision,
               run: Optional[_Run]) -> Tuple[_Run, list]:
    """Make the plan's run (or keep ``run``, the same run already in place), give its child
    Linear/activation members their member class; returns the run and its (Sequential, part)s."""
    layer_calls = plan.layer_calls
    g = plan.gated
    if run is None and g is not None:
        run = _GatedRun(
            labels=g.labels, members=[s.module for s in layer_calls], gate=g.gate, up=g.up,
            down=g.down, activation=g.act.name, act_module=g.act_module,
            dropouts=[g.child(n) for n in g.dropouts], gate_second=g.gate_second,
            slots=plan.slots, unhooked=[(m, analysis.path_of(m)) for m in plan.unhooked],
            owner=plan.owner, calls=plan.calls, decision=decision)
    elif run is None and plan.inline is not None:
        c = plan.inline
        run = _InlineRun(
            labels=c.labels, members=[s.module for s in layer_calls],
            activation=plan.activation,
            acts=[(sub, analysis.path_of(sub), found.name) for found, _, sub in c.acts
                  if sub is not None],
            drops=c.drops, slots=plan.slots,
            unhooked=[(m, analysis.path_of(m)) for m in plan.unhooked], owner=plan.owner,
            calls=plan.calls, decision=decision)
    elif run is None:
        run = _Run(
            labels=[s.label for s in layer_calls], members=[s.module for s in layer_calls],
            layers=[s.module for s in layer_calls[0::2]], last_activation=plan.last_act,
            activation=plan.activation,
            sequences=[(seq, analysis.path_of(seq)) for seq in plan.sequences], slots=plan.slots,
            unhooked=[(m, analysis.path_of(m)) for m in plan.unhooked]
            + [(s.module, s.label) for s in layer_calls],
            owner=plan.owner, calls=plan.calls,
            elements=[(s.container, s.name) for s in layer_calls if s.node is None],
            decision=decision, passes=[(slot.module, slot.label, k) for slot, k in plan.passes])
    for call, k in plan.members:
        m = call.module
        m.__class__ = member_class(type(m))  # a subclass: same object, parameters and keys
        m._ckpt_ext_run, m._ckpt_ext_index = run, k
    parts = []
    for seq, names, role, index, before, after in plan.parts:
        part = _RunPart(run, names, role, index, before, after)
        alone = plan.alone.get(id(seq))
        if alone:
            part.alone = _RunPart(_Run(
                labels=[s.label for s in alone], members=[s.module for s in alone],
                layers=[s.module for s in alone[0::2]], last_activation=False,
                activation=_activations_of(alone),
                sequences=[(seq, analysis.path_of(seq))], slots=(),
                unhooked=[(s.module, s.label) for s in alone], owner=None, calls=(),
                elements=[(seq, s.name) for s in alone]), [s.name for s in alone], PartRole.WHOLE,
                0, (), ())
        parts.append((seq, part))
    return run, parts


def _activations_of(layer_calls: Sequence[LayerCall]) -> LayerActivations:
    """What a stretch of a run's calls computes after its layers (their activation calls')."""
    return collapse_activations([s.activation for s in layer_calls[1::2]])


def _set_parts(seq: nn.Module, parts: List[_RunPart]) -> None:
    """Give seq exactly these parts (in element order); leave it as it is if it has them."""
    if [p.key for p in parts_of(seq)] == [p.key for p in parts]:
        return
    if not parts and type(seq) is nn.Sequential:
        return
    order = {name: i for i, name in enumerate(seq._modules)}
    if type(seq) is nn.Sequential:
        seq.__class__ = FusedSequential  # a subclass: same object, elements and keys
    seq._ckpt_ext_runs = tuple(sorted(parts, key=lambda p: order.get(p.names[0], -1)))


def apply_plan(analysis: ModelAnalysis, planned: Sequence[PlannedRun],
               sources: Dict[int, str]) -> None:
    """Put the planned runs in place (keeping those already in place as they are), undo the runs
    of an earlier fuse that are no longer planned, and set each owner's forward."""
    parts: Dict[int, List[_RunPart]] = {}
    owner_runs: Dict[int, List[_Run]] = {}
    crossed_guards: Dict[int, List[_Guard]] = {}
    members = set()
    for plan, d, run in planned:
        run, plan_parts = _apply_run(analysis, plan, d, run)
        for seq, part in plan_parts:
            parts.setdefault(id(seq), []).append(part)
        if plan.owner is not None:
            owner_runs.setdefault(id(plan.owner), []).append(run)
            kept = crossed_guards.setdefault(id(plan.owner), [])
            kept += [g for g in plan.guards if g not in kept]
        members.update(id(call.module) for call, _ in plan.members)
    for m in analysis.model.modules():
        if isinstance(m, (RunLinear, RunMember)) and id(m) not in members:
            m.__class__ = type(m)._ckpt_ext_base
            for name in ("_ckpt_ext_run", "_ckpt_ext_index"):
                vars(m).pop(name, None)
        if is_sequential(m):
            _set_parts(m, parts.get(id(m), []))
        t = analysis.trace_of(m)
        method = t.method if t is not None else "forward"
        for name, wrapper in owner_wrappers(m).items():
            if name != method or (id(m) not in owner_runs and wrapper.source is None):
                del vars(m)[name]  # a region no run of this plan needs
        fwd = vars(m).get(method)
        runs = tuple(owner_runs.get(id(m), ()))
        source = sources.get(id(m), fwd.source if isinstance(fwd, _OwnerForward) else None)
        if not runs and source is None:
            continue
        guards = tuple(t.guards if t is not None else fwd.guards) + \
            tuple(crossed_guards.get(id(m), ()))
        arg_guard = t.arg_guard if t is not None else fwd.arg_guard
        if isinstance(fwd, _OwnerForward) and (fwd.runs, fwd.guards, fwd.source,
                                               fwd.arg_guard) == (runs, guards, source, arg_guard):
            continue  # as it is: keep the very object
        setattr(m, method, _OwnerForward(m, runs, guards, source, method, arg_guard))


def undo_all(model: nn.Module) -> None:
    """Every module fuse changed gets back its class (``RunLinear`` -> ``nn.Linear``, a member
    class -> its activation class, ``FusedSequential`` -> ``nn.Sequential``) and loses the
    attributes fuse set (its run, its place in it, the forward or method set on its instance)."""
    for m in model.modules():
        if isinstance(m, (RunLinear, RunMember)):
            m.__class__ = type(m)._ckpt_ext_base
        elif isinstance(m, FusedSequential):
            m.__class__ = nn.Sequential
        for name in ("_ckpt_ext_run", "_ckpt_ext_index", "_ckpt_ext_runs"):
            vars(m).pop(name, None)
        for name in owner_wrappers(m):
            del vars(m)[name]
