"""Probe steps: one training step of a configuration (an option per unit) on a copy of the model
that shares its parameters, marked at every unit's edges.

Marks, in step order: ``start``, ``pre i`` / ``post i`` (unit i's forward starts / ends, by module hooks on
the copy), ``loss`` (the loss made and the output dropped), ``grad i`` (the gradient of unit i's
output is complete: its backward starts; a tensor hook), ``end``. At each mark: tensor bytes
alive above the step's start, the peak since the previous mark (ckpt_ext.memory.MemoryMeter: exact
bytes on CPU, requested bytes on CUDA) and, in a step counted with ``FlopCounterMode``, the FLOPs
so far. Memory and FLOPs come from separate steps: the counter's module tracker holds gradients
in its hooks and moves the backward's memory. The forward and loss are the caller's (step.py:
inputs and a loss, or a step closure handed the copy), the backward the probe's. The user's model,
its gradients, buffers and the RNG are left as they were (docs/plan.md, "The probe"). A step that
runs the model's own units instead of the copy's, or none of the units, is an error that names
them and the forwards set on an instance on their way: nothing is planned from a step that was
not measured."""
from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from .. import _aten_flops  # noqa: F401  (the CPU attention counted)
from .._block_checkpoint import cache_argument
from ..convert import fuse, unfuse
from ..memory import MemoryMeter
from .rebind import describe_forward, probe_copy
from .step import TrainingStep, first_floating
from .units import OPTIONS, Option, Unit


@dataclass(frozen=True)
class Mark:
    label: str        # "start", "pre", "post", "loss", "grad", "end"
    unit: int         # the unit's index for pre/post/grad, else -1
    current: int      # bytes alive above the step's start
    peak: int         # the highest figure since the previous mark, above the step's start
    flops: int        # FLOPs counted so far (0 in a memory step)


@dataclass
class StepTrace:
    marks: List[Mark]
    loss_bytes: int
    #: per unit: the cache argument its call was handed ("" if none)
    cache_args: Dict[int, str]
    problems: Dict[int, str]  # units the step could not delimit, and why


class Probe:
    """A copy of ``model`` sharing its Parameter objects (no second set of weights; its buffers
    its own, so a probe step never moves the model's), with everything ``fuse`` or a plan put
    in taken out: configurations are relative to plain. Use as a context manager: it stashes the
    gradients of the parameters (and of leaf inputs that require grad) and the RNG state on
    entry and puts them back on exit. ``step`` is called on the copy (a step closure rebound to
    it); ``where`` begins its errors ("ckpt_ext.plan")."""

    def __init__(self, model: nn.Module, step: TrainingStep, device: torch.device,
                 where: str) -> None:
        self.model, self.device, self.where = model, device, where
        copy, rebind = probe_copy(model)
        self.copy, self.training_step = unfuse(copy), step.rebound(rebind)
        self.meter = MemoryMeter(device)
        self.stepped = False  # a step ran: the model takes the inputs, or the step runs

    def __enter__(self) -> "Probe":
        leaves = self.training_step.leaves()
        self._grads = [(p, p.grad) for p in list(self.model.parameters()) + leaves]
        for p, _ in self._grads:
            p.grad = None
        devices = [self.device] if self.device.type == "cuda" else []
        self._rng = torch.random.fork_rng(devices=devices)
        self._rng.__enter__()
        self.meter.start()
        return self

    def __exit__(self, *exc) -> None:
        self.meter.stop()
        self._rng.__exit__(*exc)
        for p, g in self._grads:
            p.grad = g
        self._grads = []

    # -- configurations ----------------------------------------------------------------------
    def configure(self, units: Sequence[Unit], options: Sequence[Option]) -> None:
        """Put the copy in this configuration (from plain): an option per unit, then, if given,
        the head's."""
        unfuse(self.copy)
        for unit, option in zip(units, options):
            row = OPTIONS[option]
            if row.fuses:
                for where, _ in unit.fuse_targets:
                    fuse(self.copy.get_submodule(where))
            if row.recompute is not None:
                row.recompute(self.copy.get_submodule(unit.path))
        if len(options) > len(units) and OPTIONS[options[-1]].head is not None:
            OPTIONS[options[-1]].head(self.copy)  # the head's option, after the units'

    def run(self, module) -> None:
        """One unrecorded training step of ``module`` (the copy, or a compiled copy): forward,
        loss, backward; the gradients cleared after."""
        how = self.training_step
        try:
            how.loss(how.forward(module), self.where).backward()
        finally:
            for p, _ in self._grads:
                p.grad = None

    # -- one step ----------------------------------------------------------------------------
    def step(self, units: Sequence[Unit], count_flops: bool) -> StepTrace:
        """One marked step of the copy as configured (memory, or FLOPs with count_flops)."""
        meter = self.meter
        marks: List[Mark] = []
        state = {"base": 0, "counter": None}
        cache_args: Dict[int, str] = {}
        calls: Dict[int, int] = {}
        escaped: Dict[int, int] = {}  # calls of the model's own units (not the copy's)
        problems: Dict[int, str] = {}

        def mark(label: str, unit: int = -1) -> None:
            counter = state["counter"]
            flops = int(counter.get_total_flops()) if counter is not None else 0
            marks.append(Mark(label, unit, meter.current() - state["base"],
                              meter.peak() - state["base"], flops))
            meter.reset_peak()

        def in_backward() -> bool:
            return torch._C._current_graph_task_id() != -1

        def pre(i: int):
            def hook(module, args, kwargs):
                if in_backward():
                    return
                calls[i] = calls.get(i, 0) + 1
                cache_args[i] = cache_argument(kwargs)
                mark("pre", i)
            return hook

        def post(i: int):
            def hook(module, args, kwargs, out):
                if in_backward():
                    return
                mark("post", i)
                t = first_floating(out)
                if t is None or not t.requires_grad:
                    problems.setdefault(i, "its output holds no floating tensor that requires "
                                           "grad")
                    return
                t.register_hook(lambda grad: mark("grad", i))
            return hook

        def model_pre(i: int):
            def hook(module, args):
                if not in_backward():
                    escaped[i] = escaped.get(i, 0) + 1
            return hook

        handles = []
        for i, unit in enumerate(units):
            m = self.copy.get_submodule(unit.path)
            handles.append(m.register_forward_pre_hook(pre(i), with_kwargs=True))
            handles.append(m.register_forward_hook(post(i), with_kwargs=True))
            handles.append(self.model.get_submodule(unit.path).register_forward_pre_hook(
                model_pre(i)))
        for p, _ in self._grads:
            p.grad = None
        was_enabled = gc.isenabled()
        gc.disable()  # no collection of earlier garbage inside the step: it is not the step's
        counter = FlopCounterMode(display=False) if count_flops else None
        try:
            if counter is not None:
                counter.__enter__()
                state["counter"] = counter
            state["base"] = meter.current()
            meter.reset_peak()
            mark("start")
            how = self.training_step
            try:
                out = how.forward(self.copy)
            except Exception as e:
                if self.stepped or isinstance(e, (MemoryError, torch.OutOfMemoryError)):
                    raise  # not the inputs' or the step's fault
                raise how.refused(self.where, e) from e
            self.stepped = True
            loss = how.loss(out, self.where)
            loss_bytes = loss.numel() * loss.element_size()
            del out
            mark("loss")
            loss.backward()
            mark("end")
            del loss
        finally:
            if counter is not None:
                counter.__exit__(None, None, None)
            for h in handles:
                h.remove()
            if was_enabled:
                gc.enable()
            for p, _ in self._grads:
                p.grad = None
        if escaped:
            raise RuntimeError(self._unmeasured(
                [units[i] for i in sorted(escaped)], "ran the model's own {} instead of the "
                "copy's", self.training_step.escaped))
        if units and not calls:
            raise RuntimeError(self._unmeasured(units, "never ran {}",
                                                self.training_step.none_ran))
        for i in range(len(units)):
            if calls.get(i, 0) != 1:
                problems.setdefault(i, f"its forward ran {calls.get(i, 0)} times in the step "
                                       f"(a unit runs once)")
        return StepTrace(marks, loss_bytes, cache_args, problems)

    def _unmeasured(self, units: Sequence[Unit], what: str, why: str) -> str:
        """The error for a step that did not measure ``units``: ``what`` it did to them, the
        forwards set on an instance from the model down to them, and ``why``."""
        paths = [u.path for u in units]
        patched: List[str] = []
        for path in paths:
            parts = path.split(".") if path else []
            for k in range(len(parts) + 1):
                at = ".".join(parts[:k])
                found = describe_forward(self.model.get_submodule(at))
                line = f"{at or '<model>'}.forward is set on its instance ({found})"
                if found and line not in patched:
                    patched.append(line)
        on_the_way = "; ".join(patched) if patched else "no forward is set on an instance on " \
                                                         "their way"
        return (f"{self.where}: the probe step on a copy of the model "
                f"{what.format(', '.join(paths))}, so it cannot measure them ({on_the_way}): "
                f"{why}")

    def measure(self, units: Sequence[Unit], options: Sequence[Option]
                ) -> Tuple[StepTrace, StepTrace]:
        """(memory trace, FLOP trace) of a configuration: the FLOP-counted step first, which also
        warms up (lazy state, caches), then the memory step."""
        self.configure(units, options)
        flops = self.step(units, count_flops=True)
        memory = self.step(units, count_flops=False)
        return memory, flops


def chain_problems(trace: StepTrace, n_units: int) -> Dict[int, str]:
    """Units the trace does not show as a chain (each unit's forward once, one after another;
    their backwards in the reverse order), and why. The first unit of an overlapping pair is
    the one named."""
    problems = dict(trace.problems)
    order = [m.unit for m in trace.marks if m.label in ("pre", "post")]
    for k in range(0, len(order) - 1, 2):
        a, b = order[k], order[k + 1]
        if a != b:
            problems.setdefault(a, "another unit runs inside its forward")
    grads = [m.unit for m in trace.marks if m.label == "grad"]
    fwd = [u for k, u in enumerate(order) if k % 2 == 0]
    expected = [u for u in reversed(fwd) if u not in problems]
    got = [u for u in grads if u not in problems]
    if got != expected:
        for u in set(expected) - set(got):
            problems.setdefault(u, "its output's gradient is never computed in the step")
        for a, b in zip(got, expected):
            if a != b:
                problems.setdefault(a, "its backward does not run between its neighbours' (the "
                                       "units do not form a chain)")
    return problems
