"""``ckpt_ext.fuse(model)``: in place, make a model's runs of Linear/Tanh layers compute through
the fused ops, which keep only their input and recompute activations in backward — without
changing what any caller of any of its modules gets. The contract: ``docs/converter.md``.

Stages, one module each: ``tracing`` (a :class:`ModelAnalysis`: fx graphs of each user forward,
traced on a meta copy, with the attributes it reads) → ``consumers`` (does the consumer of a value
keep it for backward?) → ``discovery`` (runs of layer calls) → ``policy`` (which units fuse, and
their figures) → ``planning`` (where each unit is computed: a :class:`ModelPlan`) → ``rewriting``
(code for ``rewrite=True``) → ``applying``; ``api.fuse`` runs them, ``report`` says what was done
and ``runtime`` holds what stays inside the user's model (and its pickles).

Glossary
--------
layer call (``LayerCall``)  one call of a Linear or Tanh module: a Sequential's element, or a
                            child that an analysed forward calls; its ``kind`` is a ``LayerKind``.
chain (``Chain``)           calls ``Linear, Tanh, Linear, ...`` where each value goes only to the
                            next; a *run* is a maximal one.
unit (``Unit``)             the stretch of a chain fused as one op (``tanh_mlp``, or
                            ``linear_tanh`` for a lone pair), with its ``Decision``.
fate (``Fate``)             what a value's consumers do with it: ``kept`` (True/False/None), why.
owner                       the module whose forward calls a run's members one after the other;
                            its instance gets an ``_OwnerForward`` that marks the run's *region*.
member                      a call of the owner's forward that a run goes through (``RunLinear``,
                            ``RunTanh``, or a ``FusedSequential``); the first computes the run.
part (``_RunPart``)         the elements of one ``FusedSequential`` a run covers, and its
                            ``PartRole``: the whole run, the first member, or a later one.
guard (``_Guard``)          an attribute the traced forward read and its value, checked at each
                            call: if it changed, that call runs the class's forward unfused.
"""
from .api import POLICIES, fuse
from .report import Decision, FuseReport, Fused
from .runtime import FusedSequential, RunLinear, RunTanh
# Pickles name the runtime classes at ``ckpt_ext.convert`` too; these keep such pickles loading.
from .runtime import _Guard, _OwnerForward, _Run, _RunPart  # noqa: F401

__all__ = ["fuse", "Fused", "FuseReport", "Decision", "FusedSequential", "RunLinear",
           "RunTanh", "POLICIES"]
