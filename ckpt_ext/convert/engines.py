"""Which training engine put hooks or an instance forward on a module of a unit, and what to do so
that the unit runs fused under it: the fix a FallbackWarning and ``ckpt_ext.stats`` give with the
reason. One function per engine; ``fix_for`` asks each in turn. Docs: docs/fuse-usage.md,
"Distributed training"."""
from __future__ import annotations

from typing import Callable, List, Optional

from torch import nn


def _fsdp2(m: nn.Module) -> Optional[str]:
    """FSDP2's ``fully_shard`` on a member of a unit."""
    return None


def _deepspeed(m: nn.Module) -> Optional[str]:
    """DeepSpeed ZeRO-3's parameter hooks on a member of a unit."""
    return None


_ENGINES: List[Callable[[nn.Module], Optional[str]]] = [_fsdp2, _deepspeed]


def fix_for(m: nn.Module) -> Optional[str]:
    """The fix for the hooks an engine put on ``m``, or None where no engine known here did."""
    for engine in _ENGINES:
        fix = engine(m)
        if fix is not None:
            return fix
    return None
