"""``ckpt_ext.fuse(model)``: in place, runs of Linear/activation layers and gated MLPs computed by
the fused ops; tracing -> graph -> planning -> applying. Contract and design: docs/converter.md."""
from .api import POLICIES, fuse, unfuse
from .fallback import FallbackWarning, Stats, UnitStats, stats
from .report import Decision, FuseReport, Fused
from .runtime import FusedSequential, RunActivation, RunLinear, RunMember, RunTanh, member_class
# Pickles name the runtime classes at ``ckpt_ext.convert`` too; these keep such pickles loading.
from .gated import _GatedRun  # noqa: F401
from .runtime import _Guard, _OwnerForward, _Run, _RunPart  # noqa: F401

__all__ = ["fuse", "unfuse", "Fused", "FuseReport", "Decision", "FusedSequential", "RunLinear",
           "RunTanh", "RunActivation", "RunMember", "member_class", "POLICIES", "stats",
           "FallbackWarning", "Stats", "UnitStats"]
