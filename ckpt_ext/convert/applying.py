"""Applying a plan to the user's model in place, undoing what it no longer holds; :func:`undo_all`
takes everything fuse put in place out (``unfuse``)."""
from __future__ import annotations

from typing import List

from torch import nn

from ..modules import collapse_activations
from .facts import checkpointing_layers
from .fallback import attach
from .graph import ModelGraph
from .planning import Plan
from .plain import PLAIN
from .report import How
from .runtime import FusedSequential, PartRole, RunMember, _OwnerForward, _RunPart, member_class
from .units import Placement


def _set_parts(seq: nn.Module, parts: List[_RunPart]) -> None:
    """Give seq exactly these parts (in element order); leave it as it is if it has them."""
    if [p.key for p in getattr(seq, "_ckpt_ext_runs", ())] == [p.key for p in parts] or \
            not parts and type(seq) is nn.Sequential:
        return
    order = {name: i for i, name in enumerate(seq._modules)}
    if type(seq) is nn.Sequential:
        seq.__class__ = FusedSequential  # a subclass: same object, elements and keys
    seq._ckpt_ext_runs = tuple(sorted(parts, key=lambda p: order.get(p.names[0], -1)))


def apply_plan(graph: ModelGraph, plan: Plan) -> None:
    """Put the planned units in place, undo those no longer planned, set each owner's forward."""
    # by id: each Sequential's parts, each owner's runs, guards of the forwards they cross, source
    parts, owner_runs, crossed_guards, sources = {}, {}, {}, {}
    members, classes = set(), {}
    for p, d, run in plan.placed:
        if p.source is not None:
            sources[id(p.owner)] = p.source
            continue
        run = run if run is not None else p.kind.runtime(graph, p, d)
        attach(run, d, checkpointing_layers(graph.model, d.where))
        for m, k in p.members:
            if type(m) not in classes:
                classes[type(m)] = member_class(type(m))
            m.__class__ = classes[type(m)]  # a subclass: same object, parameters and keys
            m._ckpt_ext_run, m._ckpt_ext_index = run, k
            members.add(id(m))
        for seq, *fields in p.parts:  # a member Sequential's also computes its stretch alone
            part = _RunPart(run, *fields)
            if alone := p.alone.get(id(seq)):
                own = Placement(How.SEQUENTIAL, "", alone, collapse_activations(
                    [s.activation for s in alone[1::2]]), False, PLAIN, sequences=[seq])
                part.alone = _RunPart(PLAIN.runtime(graph, own, None), [s.name for s in alone],
                                      PartRole.WHOLE, 0, (), ())
            parts.setdefault(id(seq), []).append(part)
        if p.owner is not None:
            owner_runs.setdefault(id(p.owner), []).append(run)
            kept = crossed_guards.setdefault(id(p.owner), [])
            kept += [g for g in p.guards if g not in kept]
    for m in graph.model.modules():
        if isinstance(m, RunMember) and id(m) not in members:
            m.__class__ = type(m)._ckpt_ext_base
            for name in ("_ckpt_ext_run", "_ckpt_ext_index"):
                vars(m).pop(name, None)
        if graph.facts[id(m)].sequential:
            _set_parts(m, parts.get(id(m), []))
        t = graph.trace.get(id(m))
        method = t.method if t is not None else "forward"
        for name, wrapper in [(k, v) for k, v in vars(m).items() if isinstance(v, _OwnerForward)]:
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
    """Every module fuse changed gets back its class and loses the attributes fuse set."""
    for m in model.modules():
        if isinstance(m, (RunMember, FusedSequential)):
            m.__class__ = type(m)._ckpt_ext_base  # the user's class: nn.Sequential for a Sequential
        for name in ("_ckpt_ext_run", "_ckpt_ext_index", "_ckpt_ext_runs"):
            vars(m).pop(name, None)
        for name in [k for k, v in vars(m).items() if isinstance(v, _OwnerForward)]:
            del vars(m)[name]
