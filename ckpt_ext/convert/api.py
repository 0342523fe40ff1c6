"""``fuse(model)``: analyse the model, plan every unit, then apply the plan in place;
``unfuse(model)``: take it out again. The stages are the package's modules; the contract is
``docs/converter.md``."""
from __future__ import annotations

from torch import nn

from .._block_checkpoint import undo_checkpoints
from .accounting import unaccounted
from .applying import apply_plan, undo_all
from .planning import plan_model
from .report import FuseReport, Fused
from .rewriting import rewrite_forwards
from .tracing import ModelAnalysis

POLICIES = ("memory", "all")


def fuse(model: nn.Module, *, policy: str = "memory", rewrite: bool = False,
         dry_run: bool = False, trace: bool = True) -> Fused:
    """Fuse ``model``'s runs of Linear/activation layers where that frees memory, in place; returns
    ``(model, report)`` with ``model`` the very object passed in.

    ``policy="memory"`` (default) fuses maximal runs, and lone pairs only where that frees memory
    (an activation output its backward reads, kept anyway, does not); ``policy="all"`` fuses the
    same runs with their trailing activation and every lone pair, so it never frees less.
    ``rewrite=True`` also rewrites forward code (``F.linear``, ``torch.tanh``, ``F.gelu``, ...)
    of modules whose forward is safe to rewrite. ``dry_run=True`` changes
    nothing and reports what would be done. ``trace=False`` skips the fx analysis: only the
    insides of ``nn.Sequential`` are considered. ``print(report)`` shows every decision with its
    activation, the bytes it frees and the FLOPs it costs per row, every near miss and why, and
    every module whose forward was not used. The full contract: ``docs/converter.md``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"ckpt_ext.fuse expects an nn.Module, got {type(model).__name__}")
    if policy not in POLICIES:
        raise ValueError(f"ckpt_ext.fuse: policy must be one of {', '.join(map(repr, POLICIES))},"
                         f" got {policy!r}")
    report = FuseReport(dry_run=dry_run, policy=policy, rewrite=rewrite)
    analysis = ModelAnalysis(model, trace, report)  # traces on a meta copy; model untouched
    plan = plan_model(analysis, policy, rewrite)     # every decision, before anything changes
    report.rewritten = [r.path for r in plan.rewrites]
    if not dry_run:
        sources = rewrite_forwards(plan, report)     # a rewrite that fails is left alone
        apply_plan(analysis, plan.runs, sources)
    report.decisions = plan.decisions(model)
    named = [layer for d in report.decisions for layer in d.layers]
    report.other_layers = unaccounted(analysis, named + [p for p, _ in report.not_analysed])
    return Fused(model, report)


def unfuse(model: nn.Module) -> nn.Module:
    """Undo ``fuse`` in place and return ``model``: every module fuse changed gets back its own
    class (``type(m) is nn.Linear`` again) and forward, and loses the attributes fuse set; the
    parameters, buffers and ``state_dict`` are untouched; a block that ``ckpt_ext.plan(...).apply``
    checkpointed loses its checkpoint. For tools that match exact types
    (``torch.ao.quantization.quantize_dynamic``, ``torch.jit.script``): docs/fuse-usage.md."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"ckpt_ext.unfuse expects an nn.Module, got {type(model).__name__}")
    undo_all(model)
    undo_checkpoints(model)  # the checkpoint wrappers ckpt_ext.plan(...).apply sets
    return model
