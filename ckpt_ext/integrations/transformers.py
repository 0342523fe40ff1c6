"""``CkptExtCallback``: ckpt_ext in transformers' ``Trainer`` and TRL's trainers in one argument,
``Trainer(..., callbacks=[CkptExtCallback()])``. Before the first step, on the model the trainer
trains (after TRL's peft wrapping, casts and forward patches) and before the launcher shards it,
it fuses every unit, or plans within a byte budget on the trainer's own step; it keeps the
trainer's checkpointing off; after the first step it checks that the units ran fused. Docs:
docs/trainers.md."""
from __future__ import annotations

import sys
import warnings
from typing import Any, Optional, Union

import torch
from transformers import Trainer, TrainerCallback
from transformers.utils import logging

import ckpt_ext
from ckpt_ext.convert.facts import checkpointings
from ckpt_ext.convert.fallback import FallbackWarning
from ckpt_ext.convert.report import checkpointed

logger = logging.get_logger("transformers.trainer")

#: the share of a CUDA device's free memory budget_bytes="auto" leaves unplanned (the allocator's
#: fragmentation, the optimizer's first state, what other processes take meanwhile)
AUTO_MARGIN = 0.10


class CkptExtCallback(TrainerCallback):
    """Fuse the trainer's model before its first step (``budget_bytes=None``), or apply
    ``ckpt_ext.plan`` within ``budget_bytes`` (an int, or ``"auto"`` on CUDA: the device's free
    memory less ``AUTO_MARGIN``) measured on the trainer's own step (its first batch and its
    ``compute_loss``). The trainer's checkpointing is switched off, unless ``keep_checkpointing``
    (and no budget: a plan owns recompute). After ``train()`` starts: ``report`` (the fuse report
    or the plan's) and ``plan`` (the ``Plan``, or None)."""

    def __init__(self, budget_bytes: Union[int, str, None] = None, *,
                 keep_checkpointing: bool = False) -> None:
        if budget_bytes is not None and budget_bytes != "auto" and (
                isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or
                budget_bytes <= 0):
            raise ValueError(f"CkptExtCallback: budget_bytes must be None, a positive int or "
                             f"\"auto\", got {budget_bytes!r}")
        if keep_checkpointing and budget_bytes is not None:
            raise ValueError("CkptExtCallback: keep_checkpointing=True takes no budget_bytes (a "
                             f"plan chooses what to recompute itself), got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self.keep_checkpointing = bool(keep_checkpointing)
        self.report: Optional[Any] = None
        self.plan: Optional[ckpt_ext.Plan] = None
        self._model = None
        self._checked = False

    # -- before the first step ----------------------------------------------------------------

    def on_init_end(self, args, state, control, **kwargs):
        trainer = _trainer_of(self)
        if not self.keep_checkpointing:
            _checkpointing_off(args)  # what train() reads to switch it on
        # train() prepares (wraps, shards) the model in _prepare_for_training: act just before
        prepare = trainer._prepare_for_training

        def prepare_after_ckpt_ext(max_steps, train_dataloader, resume_from_checkpoint):
            if self._model is None:
                self._act(trainer, train_dataloader)
            return prepare(max_steps, train_dataloader, resume_from_checkpoint)

        trainer._prepare_for_training = prepare_after_ckpt_ext
        return control

    def _act(self, trainer: Trainer, dataloader) -> None:
        model = trainer.model
        if not self.keep_checkpointing and getattr(model, "is_gradient_checkpointing", False):
            model.gradient_checkpointing_disable()  # TRL switches it on in __init__ for peft
        if self.budget_bytes is None:
            model, self.report = ckpt_ext.fuse(model)
        else:
            budget = _budget(self.budget_bytes, model)
            batch = trainer._prepare_inputs(next(iter(dataloader)))
            model.train()  # as the training loop calls it: the probe steps are training steps

            def step(m):
                return trainer.compute_loss(m, batch)

            with trainer.compute_loss_context_manager():
                self.plan = ckpt_ext.plan(model, budget_bytes=budget, step=step)
            model, self.report = self.plan.apply(model)
        self._model = model
        logger.info(f"CkptExtCallback:\n{self.report}")

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self._model is None:
            raise RuntimeError("CkptExtCallback did not act before train(): it was added after "
                               "the Trainer was built (trainer.add_callback), when the Trainer no "
                               "longer calls on_init_end; pass it as Trainer(..., callbacks="
                               "[CkptExtCallback()])")
        if self.keep_checkpointing and self.report is not None and self.plan is None:
            # the trainer switched checkpointing on after fuse: the report says what that costs
            self.report.checkpointed[:] = checkpointed(self._model, self.report.decisions,
                                                       checkpointings)
        return control

    # -- after the first step -----------------------------------------------------------------

    def on_step_end(self, args, state, control, **kwargs):
        if self._checked or self._model is None:
            return control
        self._checked = True
        stats = ckpt_ext.stats(self._model)
        problems = []
        if len(stats) and stats.fused_calls == 0:
            problems.append("no fused unit ran in the first step (the step does not reach the "
                            "units fuse placed)")
        if stats.unfused_calls:
            reasons = {r: n for s in stats for r, n in s.reasons.items()}
            problems.append(f"{stats.unfused_calls} call(s) computed unfused: " +
                            "; ".join(f"{n} x {r}" for r, n in reasons.items()))
        if stats.recomputed_calls and not self.keep_checkpointing:
            problems.append(f"{stats.recomputed_calls} fused call(s) ran under transformers' "
                            f"checkpointing, switched on again after the callback switched it "
                            f"off (the units recompute twice)")
        if problems:
            warnings.warn("ckpt_ext.CkptExtCallback, after the first step: " +
                          "; ".join(problems), FallbackWarning, stacklevel=2)
        return control


def _trainer_of(callback: CkptExtCallback) -> Trainer:
    """The Trainer whose __init__ is calling ``on_init_end``: callbacks are not handed it."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer) and callback in getattr(
                getattr(owner, "callback_handler", None), "callbacks", ()):
            return owner
        frame = frame.f_back
    raise RuntimeError("CkptExtCallback acts from inside the Trainer it is given to: pass it as "
                       "Trainer(..., callbacks=[CkptExtCallback()]) (or trainer.add_callback "
                       "before train(), after which on_init_end has passed: not supported)")


def _checkpointing_off(args) -> None:
    for name in ("activation_checkpointing", "gradient_checkpointing"):
        if hasattr(args, name):
            setattr(args, name, False)


def _budget(budget: Union[int, str], model) -> int:
    if budget != "auto":
        return int(budget)
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError(f"CkptExtCallback: budget_bytes=\"auto\" reads a CUDA device's free "
                         f"memory; the model is on {device}: give budget_bytes in bytes")
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * (1 - AUTO_MARGIN)) + torch.cuda.memory_allocated(device)
