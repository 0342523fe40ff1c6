"""``ckpt_ext.fuse(model)``: in place, make a model's runs of Linear/activation layers (tanh,
GELU, SiLU, ..., see ``activations``; one per layer, a run may mix them) compute through the
fused ops, which keep only their input and recompute activations in backward, without changing
what any caller of any of its modules gets. Contract and design: docs/converter.md.

Stages, one module each: tracing → consumers → discovery → policy → planning → rewriting →
applying, then accounting (why each Linear no decision names is left alone); ``api.fuse`` runs
them and ``api.unfuse`` undoes them, ``report`` says what was done, ``runtime`` holds what stays
in the user's model (and its pickles).

Glossary: a *layer call* (``LayerCall``) is one call of a Linear or activation module, of a
``LayerKind``; a *chain* (``Chain``) is calls ``Linear, Act, Linear, ...`` where each value goes
only to the next, a *run* a maximal one; a *unit* (``Unit``) is the stretch of a chain fused as
one op, with its ``Decision``; a value's *fate* (``Fate``) says whether its consumers keep it for
backward. The *owner* is the module whose forward calls a run's *members* in turn, inside the
run's *region*; a *part* (``_RunPart``, with a ``PartRole``) is what one ``FusedSequential`` does
with the run; a *guard* (``_Guard``) is an attribute the traced forward read, checked at each
call.
"""
from .api import POLICIES, fuse, unfuse
from .report import Decision, FuseReport, Fused
from .runtime import FusedSequential, RunActivation, RunLinear, RunMember, RunTanh, member_class
# Pickles name the runtime classes at ``ckpt_ext.convert`` too; these keep such pickles loading.
from .runtime import _GatedRun, _Guard, _OwnerForward, _Run, _RunPart  # noqa: F401

__all__ = ["fuse", "unfuse", "Fused", "FuseReport", "Decision", "FusedSequential", "RunLinear",
           "RunTanh", "RunActivation", "RunMember", "member_class", "POLICIES"]
