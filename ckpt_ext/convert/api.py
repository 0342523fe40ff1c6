"""``fuse(model)``: analyse the model, plan every unit, then apply the plan in place. The stages
are the package's modules; the contract is ``docs/converter.md``."""
from __future__ import annotations

from torch import nn

from .applying import apply_plan
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
    (a tanh, sigmoid or ReLU output kept anyway does not); ``policy="all"`` fuses every pair on
    its own. ``rewrite=True`` also rewrites forward code (``F.linear``, ``torch.tanh``,
    ``F.gelu``, ...) of modules whose forward is safe to rewrite. ``dry_run=True`` changes
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
    return Fused(model, report)
