"""``fuse(model)``: trace, build the value graph, plan, apply in place and report; ``unfuse``:
take it out again. The contract: docs/converter.md."""
from __future__ import annotations

from torch import nn

from .._block_checkpoint import undo_checkpoints
from .._head_loss import undo_head_losses
from .accounting import unaccounted
from .applying import apply_plan, undo_all
from .engines import mark_leaves, sharded, unmark
from .facts import LayerKind, checkpointings, survey
from .fallback import Stats, stats
from .graph import ModelGraph
from .planning import make_plan
from .policy import Policy
from .report import FuseReport, Fused, checkpointed
from .tracing import trace_model
from .units import Options

POLICIES = tuple(p.value for p in Policy)


def fuse(model: nn.Module, *, policy: str = "memory", rewrite: bool = False,
         dry_run: bool = False, trace: bool = True) -> Fused:
    """Fuse ``model``'s runs of Linear/activation layers where that frees memory, in place; returns
    ``(model, report)``, ``model`` the very object passed in. ``policy="memory"`` fuses maximal
    runs and what else frees memory, ``"all"`` every lone pair too; ``rewrite=True`` also rewrites
    forward code where that is safe; ``dry_run=True`` changes nothing; ``trace=False`` looks only
    inside ``nn.Sequential``. ``print(report)`` shows every decision and why: docs/converter.md."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"ckpt_ext.fuse expects an nn.Module, got {type(model).__name__}")
    if policy not in POLICIES:
        raise ValueError(f"ckpt_ext.fuse: policy must be one of {', '.join(map(repr, POLICIES))},"
                         f" got {policy!r}")
    facts = survey(model)
    refused = sharded(model)  # sharded by an engine already: nothing changes, each Linear says why
    if refused is not None:
        return Fused(model, FuseReport(dry_run, policy, rewrite, not_analysed=[("", refused)],
                                       other_layers=[(p, refused) for p, m in model.named_modules()
                                                     if facts[id(m)].kind is LayerKind.LINEAR]))
    traces, not_analysed = trace_model(model, facts) if trace else ({}, [])  # on a meta copy
    graph = ModelGraph(model, facts, traces)
    plan = make_plan(graph, Options(Policy(policy), rewrite))  # before anything changes
    if not dry_run:
        apply_plan(graph, plan)
        # each unit's owner a ZeRO-3 leaf: DeepSpeed gathers its weights there, hooks none inside
        mark_leaves(model, [model.get_submodule(p.placement.where) for p in plan.placed])
    decisions = plan.decisions(model)
    not_analysed += plan.not_analysed
    named = [layer for d in decisions for layer in d.layers] + [p for p, _ in not_analysed]
    return Fused(model, FuseReport(dry_run, policy, rewrite, decisions, not_analysed,
                                   plan.rewritten, unaccounted(graph, named),
                                   checkpointed(model, decisions, checkpointings),
                                   Stats() if dry_run else stats(model)))


def unfuse(model: nn.Module) -> nn.Module:
    """Undo ``fuse`` in place and return ``model``: every module fuse changed gets back its own
    class and forward; parameters, buffers and ``state_dict`` are untouched; a block that
    ``ckpt_ext.plan(...).apply`` checkpointed loses its checkpoint (docs/fuse-usage.md)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"ckpt_ext.unfuse expects an nn.Module, got {type(model).__name__}")
    undo_all(model)
    for m in model.modules():
        unmark(m)  # the ZeRO-3 leaf flags fuse set
    undo_checkpoints(model)  # the checkpoint wrappers ckpt_ext.plan(...).apply sets
    undo_head_losses(model)  # and its fused head and loss
    return model
