"""``fuse(model)``: trace each forward, build the model's value graph, plan every unit, then apply
the plan in place and report it; ``unfuse(model)``: take it out again. The contract is
``docs/converter.md``."""
from __future__ import annotations

from torch import nn

from .accounting import unaccounted
from .applying import apply_plan, undo_all
from .facts import survey
from .graph import ModelGraph
from .planning import make_plan
from .policy import Policy
from .report import FuseReport, Fused
from .tracing import trace_model
from .units import Options

POLICIES = tuple(p.value for p in Policy)


def fuse(model: nn.Module, *, policy: str = "memory", rewrite: bool = False,
         dry_run: bool = False, trace: bool = True) -> Fused:
    """Fuse ``model``'s runs of Linear/activation layers where that frees memory, in place; returns
    ``(model, report)`` with ``model`` the very object passed in.

    ``policy="memory"`` (default) fuses maximal runs, and lone pairs only where that frees memory
    (an activation output its backward reads, kept anyway, does not); ``policy="all"`` fuses the
    same runs with their trailing activation and every lone pair, so it never frees less.
    ``rewrite=True`` also rewrites forward code (``F.linear``, ``torch.tanh``, ``F.gelu``, ...)
    of modules whose forward is safe to rewrite. ``dry_run=True`` changes nothing and reports
    what would be done. ``trace=False`` skips the fx analysis: only the insides of
    ``nn.Sequential`` are considered. ``print(report)`` shows every decision with its
    activation, the bytes it frees and the FLOPs it costs per row, every near miss and why, and
    every module whose forward was not used. The full contract: ``docs/converter.md``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"ckpt_ext.fuse expects an nn.Module, got {type(model).__name__}")
    if policy not in POLICIES:
        raise ValueError(f"ckpt_ext.fuse: policy must be one of {', '.join(map(repr, POLICIES))},"
                         f" got {policy!r}")
    facts = survey(model)
    traces, not_analysed = trace_model(model, facts) if trace else ({}, [])  # on a meta copy
    graph = ModelGraph(model, facts, traces)
    plan = make_plan(graph, Options(Policy(policy), rewrite))  # before anything changes
    if not dry_run:
        apply_plan(graph, plan)
    decisions = plan.decisions(model)
    not_analysed += plan.not_analysed
    named = [layer for d in decisions for layer in d.layers] + [p for p, _ in not_analysed]
    report = FuseReport(dry_run, Policy(policy).value, rewrite, decisions, not_analysed,
                        plan.rewritten, unaccounted(graph, named))
    return Fused(model, report)


def unfuse(model: nn.Module) -> nn.Module:
    """Undo ``fuse`` in place and return ``model``: every module fuse changed gets back its own
    class (``type(m) is nn.Linear`` again) and forward, and loses the attributes fuse set; the
    parameters, buffers and ``state_dict`` are untouched. For tools that match exact types
    (``torch.ao.quantization.quantize_dynamic``, ``torch.jit.script``): docs/fuse-usage.md."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"ckpt_ext.unfuse expects an nn.Module, got {type(model).__name__}")
    undo_all(model)
    return model
