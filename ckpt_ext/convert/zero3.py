"""DeepSpeed ZeRO-3 as fuse meets it: a partitioned parameter's real shape (and the meta copy at
it that tracing works on), and the ``_z3_leaf`` marks on each unit's owner that make ZeRO-3
gather its weights there. Nothing here imports deepspeed. Why: docs/fuse-usage.md, "DeepSpeed
ZeRO"."""
from __future__ import annotations

import sys
from typing import Dict, Iterable

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
