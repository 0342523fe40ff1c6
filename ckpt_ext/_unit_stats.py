"""A unit's calls counted: fused, unfused (with the reason, the same string its
``FallbackWarning`` gives, once per reason), or fused inside a checkpointed ancestor that
recomputes it whole; :class:`SetByFuse`, the base of a forward that fuse or an applied plan sets on
an instance, whose ``runs`` ``ckpt_ext.stats`` counts. Shared by fuse's units (convert/fallback.py)
and the plan's fused head and loss (_head_loss.py). Docs: docs/fuse-usage.md, "Is it fused?"."""
from __future__ import annotations

import os
import sys
import warnings
from typing import Dict, Optional, Tuple

import torch
from torch import nn


class SetByFuse:
    """The base of what fuse sets on an instance: any other instance ``forward`` is foreign."""


class FallbackWarning(UserWarning):
    """A fused unit computed unfused (or recomputed by checkpointing around it): warned once per
    unit and reason, with the fix where there is one."""


class UnitStats:
    """One unit's calls with gradients recorded: ``fused_calls``, ``unfused_calls`` and their
    ``reasons`` (reason -> count), ``recomputed_calls`` (fused calls inside a module that gradient
    checkpointing recomputes whole). ``path``: the module holding the unit, as the report names it;
    ``layers``: its layers in call order."""

    __slots__ = ("path", "layers", "fused_calls", "unfused_calls", "recomputed_calls", "reasons",
                 "_warned", "_checkpointed")

    def __init__(self, path: str, layers: Tuple[str, ...], checkpointed=()) -> None:
        self.path, self.layers = path, tuple(layers)
        self.fused_calls = self.unfused_calls = self.recomputed_calls = 0
        self.reasons: Dict[str, int] = {}
        self._warned: set = set()
        # (path, module): the unit's ancestors that transformers' checkpointing can recompute whole
        self._checkpointed = tuple(checkpointed)

    @property
    def name(self) -> str:
        """The unit as warnings and tables name it: its path and, if more than one, its layers."""
        where = self.path or "<model>"
        if len(self.layers) == 1 and self.layers[0] == self.path:
            return where
        return f"{where} ({' -> '.join(self.layers)})"

    def fused(self) -> None:
        if not counting():
            return
        self.fused_calls += 1
        for path, m in self._checkpointed:
            if m.training and getattr(m, "gradient_checkpointing", False) is True:
                self.recomputed_calls += 1
                self._warn(_RECOMPUTED.format(path=path or "<model>"), _RECOMPUTED_FIX, "is")
                return

    def unfused(self, reason: str, fix: Optional[str] = None) -> None:
        if not counting():
            return
        self.unfused_calls += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        self._warn(reason, fix, "computed unfused:")

    def _warn(self, reason: str, fix: Optional[str], what: str) -> None:
        if reason in self._warned:
            return
        self._warned.add(reason)
        warnings.warn(f"ckpt_ext: the fused unit {self.name} {what} {reason}" +
                      (f". Fix: {fix}" if fix else ""), FallbackWarning, stacklevel=_caller())

    def __repr__(self) -> str:
        return (f"UnitStats(path={self.path!r}, fused_calls={self.fused_calls}, "
                f"unfused_calls={self.unfused_calls}, recomputed_calls={self.recomputed_calls}, "
                f"reasons={self.reasons!r})")

    # pickles and copies start counting afresh
    def __reduce__(self):
        return (UnitStats, (self.path, self.layers, self._checkpointed))


_RECOMPUTED = ("recomputed twice: {path} runs under transformers' gradient checkpointing "
               "(switched on after fuse, as Trainer.train() and TRL do), which recomputes it "
               "whole in backward, so the unit computes its forward GEMMs a third time")
_RECOMPUTED_FIX = ("switch checkpointing off where the batch fits: TrainingArguments("
                   "activation_checkpointing=False) (TRL's configs, SFTConfig and the others, set "
                   "it on by default); model.gradient_checkpointing_disable() alone is undone by "
                   "train()")


_OURS = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


_WRAPPERS = ("forward", "__call__", "wrapper", "wrapped_func", "inner")


def _caller() -> int:
    """The stacklevel of the first frame outside ckpt_ext, torch and modules' forwards: the call
    of the model."""
    frame, level = sys._getframe(2), 2
    while frame is not None and (frame.f_code.co_filename.startswith((_OURS, _TORCH)) or
                                 frame.f_code.co_name in _WRAPPERS or
                                 isinstance(frame.f_locals.get("self"), nn.Module)):
        frame, level = frame.f_back, level + 1
    return level


def counting() -> bool:
    """Calls count where gradients are recorded, outside torch.compile's tracing (a count read in
    a compiled graph would be a guard that recompiles it at every call)."""
    return torch.is_grad_enabled() and not torch.compiler.is_compiling()
