"""Which hooks registered for every module (``torch.nn.modules.module``'s global hooks) only
observe: torch's own module trackers, whose hooks record which module runs and change nothing a
module computes. A fused run skips its members' own computation, so a global hook that might act
on a member's output makes the run fall back; an observer does not (docs/plan.md, "Observers").

Observers, identified by the hook's bound instance and its function (never by a name a user's
class could take):
- ``torch.utils.module_tracker.ModuleTracker._fw_pre_hook`` / ``_fw_post_hook``, what
  ``torch.utils.flop_counter.FlopCounterMode`` registers (through its ``mod_tracker``);
- ``torch.distributed._tools.mod_tracker.ModTracker._fw_pre_hook`` / ``_fw_post_hook``, what
  ``torch.distributed._tools.mem_tracker.MemTracker`` registers (through its ``_mod_tracker``),
  while the tracker's user hooks are none or MemTracker's own.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch.nn.modules.module as _module_hooks

_TRACKER_HOOKS = ("_fw_pre_hook", "_fw_post_hook")
_MEM_TRACKER_HOOKS = {"_user_pre_fw_hook": "_pre_fw_hook", "_user_post_fw_hook": "_post_fw_hook",
                      "_user_pre_bw_hook": "_pre_bw_hook", "_user_post_bw_hook": "_post_bw_hook"}


def _loaded_class(module: str, name: str) -> Optional[type]:
    """The class if its module is imported (a tracker's hook can only exist once it is)."""
    mod = sys.modules.get(module)
    return getattr(mod, name, None) if mod is not None else None


def _bound_to(hook: Callable, cls: Optional[type], names) -> bool:
    """Whether ``hook`` is ``cls``'s own function ``names[i]`` bound to an instance of ``cls``."""
    owner = getattr(hook, "__self__", None)
    func = getattr(hook, "__func__", None)
    return cls is not None and isinstance(owner, cls) and \
        any(func is vars(cls).get(n) for n in names)


def _observer(hook: Any) -> bool:
    module_tracker = _loaded_class("torch.utils.module_tracker", "ModuleTracker")
    if _bound_to(hook, module_tracker, _TRACKER_HOOKS):
        return True
    mod_tracker = _loaded_class("torch.distributed._tools.mod_tracker", "ModTracker")
    if not _bound_to(hook, mod_tracker, _TRACKER_HOOKS):
        return False
    mem_tracker = _loaded_class("torch.distributed._tools.mem_tracker", "MemTracker")
    for attr, method in _MEM_TRACKER_HOOKS.items():
        user = getattr(hook.__self__, attr, None)
        if user is not None and not _bound_to(user, mem_tracker, (method,)):
            return False
    return True


def foreign_global_hooks() -> Optional[str]:
    """None when every hook registered for every module is one of torch's observers (above),
    else what the first other one is."""
    registries = (("forward", _module_hooks._global_forward_hooks),
                  ("forward pre", _module_hooks._global_forward_pre_hooks),
                  ("backward", _module_hooks._global_backward_hooks),
                  ("backward pre", _module_hooks._global_backward_pre_hooks))
    for kind, hooks in registries:
        for hook in hooks.values():
            if not _observer(hook):
                name = getattr(hook, "__qualname__", type(hook).__name__)
                return f"a {kind} hook registered for every module ({name})"
    return None
