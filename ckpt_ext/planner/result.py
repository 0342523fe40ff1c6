"""What ``ckpt_ext.plan`` returns: the choice per unit with its predicted peak, kept bytes and added
FLOPs, printed as a table, and :meth:`Plan.apply`, which puts it into a model in place under
fuse's contract (docs/converter.md), each option as its row of the options table (units.py)
says: the units of an option that fuses through ``ckpt_ext.fuse`` of the module holding them,
then a block's recomputing forward (``checkpoint``: ``ckpt_ext._block_checkpoint``; pointwise:
recompute.py) set on its instance, then the head's loss fused where chosen
(``ckpt_ext._head_loss``). ``ckpt_ext.unfuse`` takes them out."""
from __future__ import annotations

import dataclasses
import re
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Tuple

from torch import nn

from .._block_checkpoint import is_checkpointed
from .._head_loss import head_refusal, is_head_fused
from ..convert import Decision, FusedSequential, RunLinear, RunMember, fuse, unfuse
from ..convert import _OwnerForward  # the forward fuse sets on an owner's instance
from .figures import OptionFigures
from .units import OPTIONS, Kind, Option, Unit, fuses_alone, join_path


@dataclass
class Plan:
    """An option per unit for a step that peaks within ``budget_bytes``, at the least added FLOPs.

    Bytes are tensor bytes above what was allocated before the step, as
    ``ckpt_ext.memory.measured_step`` reports them (``peak_above_before_forward``,
    ``kept_for_backward``); FLOPs are per step, as ``torch.utils.flop_counter.FlopCounterMode``
    counts them."""
    budget_bytes: int
    peak_bytes: int          #: predicted peak of a step with the plan applied
    kept_bytes: int          #: predicted bytes kept for backward after the loss
    added_flops: int         #: FLOPs per step above the plain model's
    choices: Dict[str, str]  #: unit path -> an Option's value ("none", "fuse", "pointwise", ...)
    plain_peak_bytes: int    #: the plain model's step, as measured by the probe
    plain_kept_bytes: int
    plain_flops: int
    least_peak_bytes: int    #: the least peak any choice reaches
    units: List[Unit] = field(default_factory=list)
    #: per unit: option -> its figures in the probe (bytes, FLOPs)
    figures: List[Dict[Option, OptionFigures]] = field(default_factory=list)
    #: (path, why) for what could not be a unit, or an option it could not take
    notes: List[Tuple[str, str]] = field(default_factory=list)
    device: str = "cpu"
    #: the largest difference in bytes between the probes' figures of what lies outside the
    #: units (0 when the step decomposes into independent units, as the prediction assumes)
    spread_bytes: int = 0
    #: planned for the step of ``torch.compile`` of the model after apply (the figures above
    #: are that compiled step's, ``peak_bytes`` its check's measurement; FLOPs as the eager
    #: step counts them)
    compiled: bool = False
    #: the compiled step of this choice as the planner measured it (compiled plans only)
    measured_peak_bytes: Optional[int] = None
    #: torch.compile's own ``activation_memory_budget`` the step is compiled under, where the
    #: plan chose it (its step was faster than the plan's own choice, or that did not fit):
    #: :meth:`compile` sets it; None: compile as configured
    compile_memory_budget: Optional[float] = None
    #: inductor's options the step is compiled with, where its check fit only with them
    #: (``compiled.REUSE_OFF``): :meth:`compile` sets them; empty: inductor as configured
    compile_options: Dict[str, object] = field(default_factory=dict)
    #: the compiled candidates' measured step seconds (median), by name (compiled plans only)
    compiled_seconds: Dict[str, float] = field(default_factory=dict)
    #: the head unit (its choice in ``choices``), where the model has one
    head: Optional[Unit] = None

    # -- reading -------------------------------------------------------------------------------
    def __str__(self) -> str:
        share = 100 * self.added_flops / self.plain_flops if self.plain_flops else 0.0
        step = " (compiled step)" if self.compiled else ""
        lines = [f"ckpt_ext.plan on {self.device}{step}: budget {_b(self.budget_bytes)} -> predicted "
                 f"peak {_b(self.peak_bytes)} (plain {_b(self.plain_peak_bytes)}; the least any "
                 f"plan reaches {_b(self.least_peak_bytes)}), kept {_b(self.kept_bytes)} "
                 f"(plain {_b(self.plain_kept_bytes)}), +{self.added_flops:,} FLOPs per step "
                 f"(+{share:.1f} % of plain's {self.plain_flops:,})"]
        rows = []
        for unit, figs in zip(self.units, self.figures):
            kept = " / ".join(f"{o.value} {_b(f.fwd_growth)}" for o, f in figs.items())
            base = figs[Option.NONE].flops
            choice = Option(self.choices[unit.path])
            added = f"+{figs[choice].flops - base:,}"
            rows.append((unit.path or "<model>",
                         f"{unit.cls:<22s} {choice.value:<14s} {added:>16s}  {kept}"))
        if rows:
            rows = _grouped(rows)
            w = max(len(path) for path, _ in rows)
            lines.append(f"  {'unit':<{w}s} {'class':<22s} {'choice':<14s} {'added FLOPs':>16s}"
                         f"  kept in its forward, per option")
            lines += [f"  {path:<{w}s} {rest}" for path, rest in rows]
        if self.head is not None:
            lines.append(f"  head {self.head.path} ({self.head.cls}): "
                         f"{self.head_option().value}")
        for unit in self.units:
            for option, why in unit.why_not.items():
                if not OPTIONS[option].fuses or unit.kind is not Kind.BLOCK or "no unit" not in why:
                    lines.append(f"  {unit.path or '<model>'}: no {option.value}: {why}")
        lines += [f"  not planned: {path or '<model>'}: {why}" for path, why in self.notes]
        if self.compile_memory_budget is not None:
            lines.append(f"  compile under activation_memory_budget = "
                         f"{self.compile_memory_budget:g} (Plan.compile sets it)")
        if self.compile_options:
            lines.append(f"  compile with inductor's options {self.compile_options} "
                         f"(Plan.compile sets them)")
        if self.compiled_seconds:
            lines.append("  compiled step, measured: " + ", ".join(
                f"{name} {s * 1e3:.1f} ms" for name, s in self.compiled_seconds.items()))
        return "\n".join(lines)

    def head_option(self) -> Option:
        """The head's option (``none`` where the model has no head unit)."""
        if self.head is None:
            return Option.NONE
        return Option(self.choices.get(self.head.path, Option.NONE.value))

    # -- applying ------------------------------------------------------------------------------
    def compile(self, model: nn.Module, **compile_kwargs) -> nn.Module:
        """:meth:`apply` the plan to ``model``, then ``torch.compile`` it (``compile_kwargs``
        passed on) under the plan's :attr:`compile_memory_budget` and :attr:`compile_options`:
        the compiled step it measured."""
        import torch

        if "backend" in compile_kwargs and (self.compile_memory_budget is not None
                                            or self.compile_options):
            raise ValueError(f"Plan.compile: this plan compiles with inductor under "
                             f"{self._compiled_under()}; got "
                             f"backend={compile_kwargs['backend']!r}")
        from .compiled import compile_backend, graph_breaking

        for option, why in graph_breaking().items():
            if option.value in self.choices.values():
                warnings.warn(f"Plan.compile: a block under {option.value}: {why} (plan with "
                              f"compiled=True leaves it out)", stacklevel=2)
        net = self._applied(model).model
        backend = compile_backend(self.compile_memory_budget, self.compile_options)
        return torch.compile(net, **{"backend": backend, **compile_kwargs})

    def _compiled_under(self) -> str:
        under = []
        if self.compile_memory_budget is not None:
            under.append(f"activation_memory_budget = {self.compile_memory_budget:g}")
        if self.compile_options:
            under.append(f"inductor's options {self.compile_options}")
        return " and ".join(under)

    def apply(self, model: nn.Module) -> "Applied":
        """Put the plan into ``model`` in place; returns ``(model, report)``. ``model`` must be
        the planned model (or one of the same structure) without fuse's runs or checkpoint
        wrappers (``ckpt_ext.unfuse`` takes them out). Every check runs before anything in the
        model changes. A plan with a :attr:`compile_memory_budget` or :attr:`compile_options`
        warns: its step fits only compiled under them (:meth:`compile`)."""
        if self.compile_memory_budget is not None or self.compile_options:
            warnings.warn(f"Plan.apply: this plan's step fits the budget only compiled with "
                          f"inductor under {self._compiled_under()}: use "
                          f"Plan.compile(model)", stacklevel=2)
        return self._applied(model)

    def _applied(self, model: nn.Module) -> "Applied":
        if not isinstance(model, nn.Module):
            raise TypeError(f"Plan.apply expects an nn.Module, got {type(model).__name__}")
        targets = self._checked_targets(model)
        fused: List[Decision] = []
        checkpointed: List[str] = []
        try:
            for unit in self.units:
                row = OPTIONS[Option(self.choices[unit.path])]
                if row.fuses:
                    for where, runs in unit.fuse_targets:
                        report = fuse(model.get_submodule(where)).report
                        made = [dataclasses.replace(d, where=join_path(where, d.where),
                                                    layers=tuple(join_path(where, la)
                                                                 for la in d.layers))
                                for d in report.decisions if d.action == "fused"]
                        if sorted(d.layers for d in made) != sorted(runs):
                            raise RuntimeError(f"Plan.apply: fuse({where}) fused "
                                               f"{[d.layers for d in made]}, not {list(runs)}")
                        fused += made
                if row.recompute is not None:
                    row.recompute(targets[unit.path])
                    checkpointed.append(unit.path)
            head = OPTIONS[self.head_option()].head
            if head is not None:
                head(model)
        except BaseException:
            unfuse(model)  # all or nothing
            raise
        return Applied(model, PlanReport(self, fused, checkpointed))

    def _checked_targets(self, model: nn.Module) -> Dict[str, nn.Module]:
        """Each unit's module in ``model``, after checking that the plan can go in."""
        for name, m in model.named_modules():
            if isinstance(m, (RunLinear, RunMember, FusedSequential)) or is_checkpointed(m) or \
                    is_head_fused(m) or \
                    any(isinstance(v, _OwnerForward) for v in vars(m).values()):
                raise ValueError(f"Plan.apply: {name or '<model>'} holds what ckpt_ext.fuse or "
                                 f"an applied plan put in; call ckpt_ext.unfuse(model) first")
        targets: Dict[str, nn.Module] = {}
        for unit in self.units:
            try:
                m = model.get_submodule(unit.path)
            except AttributeError:
                raise ValueError(f"Plan.apply: the model has no module {unit.path!r}: it is not "
                                 f"the model that was planned") from None
            if type(m).__name__ != unit.cls:
                raise ValueError(f"Plan.apply: {unit.path or '<model>'} is a "
                                 f"{type(m).__name__}, the planned model's a {unit.cls}")
            option = Option(self.choices[unit.path])
            if OPTIONS[option].fuses:
                for where, runs in unit.fuse_targets:
                    problem = fuses_alone(model, where, list(runs))
                    if problem:
                        raise ValueError(f"Plan.apply: {problem}")
            if OPTIONS[option].recompute is not None and "forward" in vars(m):
                raise ValueError(f"Plan.apply: {unit.path} has a forward set on its instance "
                                 f"({type(vars(m)['forward']).__name__}); recomputing it "
                                 f"({option.value}) would bypass that")
            targets[unit.path] = m
        if OPTIONS[self.head_option()].head is not None:
            why = head_refusal(model)
            if why is not None:
                raise ValueError(f"Plan.apply: the head's loss cannot be fused: {why}")
        return targets


@dataclass
class PlanReport:
    """What :meth:`Plan.apply` did: fuse's decisions (paths from the model) and the blocks it
    set a recomputing forward on (a row with ``recompute``)."""
    plan: Plan
    fused: List[Decision]
    checkpointed: List[str]

    def __str__(self) -> str:
        loss = ", the head's loss fused" if self.plan.head_option() == Option.FUSED_LOSS else ""
        return (f"{self.plan}\napplied: fused {len(self.fused)} unit(s), recomputing "
                f"{len(self.checkpointed)} block(s) (checkpoint or pointwise){loss}")


class Applied(NamedTuple):
    model: nn.Module
    report: PlanReport


def _b(n: float) -> str:
    if abs(n) < 2**20:
        return f"{n / 2**10:,.1f} KiB"
    if abs(n) < 2**30:
        return f"{n / 2**20:,.2f} MiB"
    return f"{n / 2**30:,.2f} GiB"


_LAST_INDEX = re.compile(r"^(.*\.)(\d+)$")


def _grouped(rows: List[Tuple[str, str]]) -> List[Tuple[str, str]]:
    """Consecutive rows that differ only in their path's last index, as ``layers.{0..7}``."""
    out: List[Tuple[str, str]] = []
    k = 0
    while k < len(rows):
        path, rest = rows[k]
        m = _LAST_INDEX.match(path)
        j = k + 1
        if m:
            while j < len(rows) and rows[j][1] == rest and \
                    rows[j][0] == f"{m.group(1)}{int(m.group(2)) + j - k}":
                j += 1
        if j - k > 1:
            out.append((f"{m.group(1)}{{{m.group(2)}..{int(m.group(2)) + j - k - 1}}}", rest))
        else:
            out.append((path, rest))
        k = j
    return out
