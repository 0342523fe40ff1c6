"""Which training engine put hooks or an instance forward on a module of a unit, and what to do so
that the unit runs fused under it: the fix a FallbackWarning and ``ckpt_ext.stats`` give with the
reason. One function per engine; ``fix_for`` asks each in turn. Docs: docs/fuse-usage.md,
"Distributed training"."""
from __future__ import annotations

import sys
from typing import Callable, List, Optional

from torch import nn

from .zero3 import registered


#: where torch exports FSDPModule: torch.distributed.fsdp from torch 2.6, _composable.fsdp before
_FSDP2_HOMES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")


def _fsdp2_module(m: nn.Module) -> bool:
    """Whether ``fully_shard`` made ``m`` an FSDP2 module (its class ``FSDP<class>``, with the
    hooks that unshard its parameters before its forward and reduce-scatter their gradients). Read
    without importing torch.distributed: where it was never imported, nothing is sharded."""
    classes = tuple(c for name in _FSDP2_HOMES
                    for c in [getattr(sys.modules.get(name), "FSDPModule", None)] if c is not None)
    return bool(classes) and isinstance(m, classes)


def _fsdp2(m: nn.Module) -> Optional[str]:
    """FSDP2's ``fully_shard`` on a member of a unit: its hooks gather and free the member's own
    parameters around its own call, which a unit computed in one op cannot honour, so the unit
    must lie inside one sharded module (a decoder layer or an MLP), not across several."""
    if not _fsdp2_module(m):
        return None
    return ("shard per decoder layer or per MLP: fully_shard on the module that holds the whole "
            "unit, not on each Linear or on a part of the unit (accelerate: "
            "fsdp_transformer_layer_cls_to_wrap=<the decoder layer class>, not Linear)")


def _zero3_hooked(m: nn.Module) -> bool:
    """Whether ``deepspeed.initialize`` registered ZeRO-3's hooks on ``m``: it sets the module's
    ``ds_id``, and its hooks are functions of deepspeed's own modules."""
    hooks = (*m._forward_pre_hooks.values(), *m._forward_hooks.values(),
             *m._backward_hooks.values(), *getattr(m, "_backward_pre_hooks", {}).values())
    return registered(m) and any(
        (getattr(h, "__module__", None) or "").startswith("deepspeed.") for h in hooks)


def _deepspeed(m: nn.Module) -> Optional[str]:
    """DeepSpeed ZeRO-3's parameter hooks on a member of a unit: ZeRO-3 gathers each module's
    parameters around its own call, so the unit must lie inside one ZeRO-3 leaf module."""
    if not _zero3_hooked(m):
        return None
    owner = getattr(getattr(m, "_ckpt_ext_run", None), "owner", None)
    name = type(owner).__name__ if owner is not None else "<the class whose forward computes it>"
    return ("import deepspeed, then call ckpt_ext.fuse before deepspeed.initialize (it marks each "
            "unit's module a ZeRO-3 leaf module where deepspeed is imported), or "
            f"deepspeed.utils.set_z3_leaf_modules(model, [{name}]) before it")


_ENGINES: List[Callable[[nn.Module], Optional[str]]] = [_fsdp2, _deepspeed]


def fix_for(m: nn.Module) -> Optional[str]:
    """The fix for the hooks an engine put on ``m``, or None where no engine known here did."""
    return next((fix for engine in _ENGINES if (fix := engine(m)) is not None), None)


def sharded(model: nn.Module) -> Optional[str]:
    """Why fuse leaves ``model`` as it is when an engine has already sharded it, else None. FSDP2:
    its modules refuse to be deep-copied (fuse analyses a meta copy), their classes are made by
    ``fully_shard`` and their parameters are shards between calls; fusing first, then sharding,
    keeps every unit inside one sharded module exact."""
    found = [path or "<model>" for path, m in model.named_modules() if _fsdp2_module(m)]
    if not found:
        return None
    where = found[0] if len(found) == 1 else f"{found[0]} and {len(found) - 1} more"
    return (f"the model is sharded by FSDP2 (fully_shard on {where}): fuse before sharding, then "
            f"shard per decoder layer or MLP")
