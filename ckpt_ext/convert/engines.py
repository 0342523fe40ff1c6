"""The training engines fuse meets: DeepSpeed ZeRO-3 (a partitioned parameter's real shape, the
meta copy at it that tracing works on, and the ``_z3_leaf`` marks on each unit's owner that make
ZeRO-3 gather its weights there) and FSDP2; which engine put hooks or an instance forward on a
module of a unit, and the fix a FallbackWarning and ``ckpt_ext.stats`` give with the reason. Nothing
here imports deepspeed or torch.distributed. Docs: docs/fuse-usage.md, "Distributed training" and
"DeepSpeed ZeRO"."""
from __future__ import annotations

import sys
from typing import Dict, Iterable, Optional

import torch
from torch import nn
from torch.nn.parameter import is_lazy

LEAF = "_z3_leaf"               # DeepSpeed's flag (deepspeed/utils/z3_leaf_module.py)
MARKED = "_ckpt_ext_z3_leaf"    # set beside it where fuse set the flag, for unfuse


def real_shape(t: torch.Tensor) -> torch.Size:
    """The shape of ``t``, or of the whole parameter where ZeRO-3 holds a partition of it."""
    shape = getattr(t, "ds_shape", None)
    return shape if isinstance(shape, torch.Size) else t.shape


def meta_memo(model: nn.Module) -> Dict[int, torch.Tensor]:
    """A deepcopy memo putting each parameter and buffer of ``model`` on the meta device, at its
    real shape (lazy ones stay uninitialized), so a copy of the model costs no memory."""
    memo: Dict[int, torch.Tensor] = {}
    for p in model.parameters():
        memo[id(p)] = nn.UninitializedParameter(p.requires_grad, device="meta") if is_lazy(p) \
            else nn.Parameter(torch.empty(real_shape(p), dtype=p.dtype, device="meta"),
                              requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = nn.UninitializedBuffer(device="meta") if is_lazy(b) else \
            torch.empty_like(b, device="meta")
    return memo


def registered(m: nn.Module) -> bool:
    """Whether ``deepspeed.initialize`` gave ``m`` ZeRO-3's hooks (its ``ds_id`` is set then)."""
    return isinstance(getattr(m, "ds_id", None), int)


def mark_leaves(model: nn.Module, owners: Iterable[nn.Module]) -> None:
    """Flag each of ``owners`` a ZeRO-3 leaf, where deepspeed is imported and neither the user
    (any value of the flag) nor ZeRO-3 (hooks already registered under it) has decided; drop the
    flags an earlier fuse set on modules that own no unit now."""
    owners = {id(m): m for m in owners}
    for m in model.modules():
        if vars(m).get(MARKED) and id(m) not in owners:
            unmark(m)
    if "deepspeed" not in sys.modules:
        return
    for m in owners.values():
        if LEAF in vars(m) or any(registered(sub) for sub in m.modules()):
            continue
        setattr(m, LEAF, True)
        setattr(m, MARKED, True)


def unmark(m: nn.Module) -> None:
    """Take the flag off ``m`` where fuse set it."""
    if vars(m).pop(MARKED, False):
        vars(m).pop(LEAF, None)


#: where torch exports FSDPModule: torch.distributed.fsdp from torch 2.6, _composable.fsdp before
_FSDP2_HOMES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")


def _fsdp2_module(m: nn.Module) -> bool:
    """Whether ``fully_shard`` made ``m`` an FSDP2 module (its class ``FSDP<class>``, with the
    hooks that unshard its parameters before its forward and reduce-scatter their gradients). Read
    without importing torch.distributed: where it was never imported, nothing is sharded."""
    classes = tuple(c for name in _FSDP2_HOMES
                    for c in [getattr(sys.modules.get(name), "FSDPModule", None)] if c is not None)
    return bool(classes) and isinstance(m, classes)


def fix_for(m: nn.Module) -> Optional[str]:
    """The fix for the hooks an engine put on ``m``, a member of a unit, or None where no engine
    known here did. FSDP2's ``fully_shard`` and DeepSpeed ZeRO-3 (``deepspeed.initialize`` set
    ``ds_id``, and hooks of deepspeed's own modules) gather a member's own parameters around its
    own call, which a unit computed in one op cannot honour: the unit must lie inside one sharded
    module (a decoder layer or an MLP) or ZeRO-3 leaf module, not across several."""
    if _fsdp2_module(m):
        return ("shard per decoder layer or per MLP: fully_shard on the module that holds the "
                "whole unit, not on each Linear or on a part of the unit (accelerate: "
                "fsdp_transformer_layer_cls_to_wrap=<the decoder layer class>, not Linear)")
    hooks = (*m._forward_pre_hooks.values(), *m._forward_hooks.values(),
             *m._backward_hooks.values(), *getattr(m, "_backward_pre_hooks", {}).values())
    if not registered(m) or not any(
            (getattr(h, "__module__", None) or "").startswith("deepspeed.") for h in hooks):
        return None
    owner = getattr(getattr(m, "_ckpt_ext_run", None), "owner", None)
    name = type(owner).__name__ if owner is not None else "<the class whose forward computes it>"
    return ("import deepspeed, then call ckpt_ext.fuse before deepspeed.initialize (it marks each "
            "unit's module a ZeRO-3 leaf module where deepspeed is imported), or "
            f"deepspeed.utils.set_z3_leaf_modules(model, [{name}]) before it")


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
