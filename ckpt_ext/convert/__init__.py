"""``ckpt_ext.fuse(model)``: in place, make a model's runs of Linear/activation layers (tanh,
GELU, SiLU, ...; one per layer, a run may mix them), gated MLPs and the runs a forward computes
with function calls between its Linears compute through the fused ops, which keep only their
input and recompute activations in backward, without changing what any caller of any of its
modules gets. Contract and design: docs/converter.md.

Stages: tracing (a Trace per forward) → graph (the model's values as one graph) → planning (one
loop over the kinds of unit: gated, inline, rewrite, plain; each one file implementing
units.UnitKind) → applying; the report is made once from the plan (report, accounting).
``runtime`` and ``conditions`` hold what stays in the user's model (and its pickles)."""
from .api import POLICIES, fuse, unfuse
from .report import Decision, FuseReport, Fused
from .runtime import FusedSequential, RunActivation, RunLinear, RunMember, RunTanh, member_class
# Pickles name the runtime classes at ``ckpt_ext.convert`` too; these keep such pickles loading.
from .runtime import _GatedRun, _Guard, _OwnerForward, _Run, _RunPart  # noqa: F401

__all__ = ["fuse", "unfuse", "Fused", "FuseReport", "Decision", "FusedSequential", "RunLinear",
           "RunTanh", "RunActivation", "RunMember", "member_class", "POLICIES"]
