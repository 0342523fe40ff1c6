"""The targets a network's fused mode is held to, each met or missed from the same run's figures:
``targets(net_name, modes, sizes)`` -> {what: {"met": True/False/None, the figures behind it}},
None where a mode it reads did not run. The LoRA networks (llama-lora, llama-lora-dropout) and moe
have targets; the others none. What each target means: docs/benchmark.md.
"""
from __future__ import annotations

from typing import Optional

from ..models import NETWORKS, LlamaLoRANet, MoENet

#: Fused's step at most this many times the floor (plain's step + the GEMMs it recomputes).
FLOOR = 1.05


def _ok(modes: dict, *names: str) -> bool:
    return all(n in modes and "kept_for_backward" in modes[n] and "error" not in modes[n]
               for n in names)


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def _at_least(modes: dict, factor: float, other: str, note: str = "") -> dict:
    fused = modes["fused"].get("max_batch")
    theirs = modes[other].get("max_batch")
    ratio = _ratio(fused, theirs)
    out = {"met": None if ratio is None else ratio >= factor, "fused_max_batch": fused,
           f"{other}_max_batch": theirs, "ratio": ratio}
    return dict(out, against=note) if note else out


def _time(modes: dict) -> dict:
    """Fused's step against eager checkpoint's (the same loop) and against its floor."""
    fused = modes["fused"]
    ratio = _ratio(fused.get("step_ms"), modes["checkpoint"].get("step_ms"))
    vs_floor = fused.get("time_vs_floor")
    return {
        "step <= eager checkpoint's": {"met": None if ratio is None else ratio <= 1.0,
                                       "fused_ms": fused.get("step_ms"),
                                       "checkpoint_ms": modes["checkpoint"].get("step_ms"),
                                       "ratio": ratio},
        f"step <= {FLOOR}x the floor": {"met": None if vs_floor is None else vs_floor <= FLOOR,
                                        "fused_ms": fused.get("step_ms"),
                                        "floor_ms": fused.get("floor_ms"), "ratio": vs_floor},
    }


def _side_by_side(modes: dict, other: str) -> dict:
    """Fused's kept bytes and step beside mode ``other``'s (the unsloth mode, or plain where
    Unsloth runs peft's forward) and eager checkpoint's, all from the same loop: met where fused
    keeps no more than either."""
    rows = {m: modes[m] for m in ("fused", other, "checkpoint")}
    kept = {m: r["kept_for_backward"] for m, r in rows.items()}
    step = {m: r.get("step_ms") for m, r in rows.items()}
    out = {"met": kept["fused"] <= min(kept[other], kept["checkpoint"])}
    out.update({f"{m}_bytes": b for m, b in kept.items()})
    out.update({f"{m}_ms": t for m, t in step.items()})
    out.update({f"step_ratio_to_{m}": _ratio(step["fused"], step[m]) for m in (other,
                                                                              "checkpoint")})
    return out


def _lora(modes: dict) -> dict:
    """Kept beyond eager checkpoint's (the blocks' inputs, what the norms keep and an RNG state
    per call) at most a tenth of plain's beyond it; kept and step beside the unsloth mode's
    (plain's where Unsloth runs peft's forward) and checkpoint's; time; max batch >= 2x plain's
    and >= 1.5x the unsloth mode's."""
    fused, ckpt, plain = (modes[m]["kept_for_backward"] for m in ("fused", "checkpoint", "plain"))
    share = (fused - ckpt) / (plain - ckpt)
    out = {"kept beyond the blocks' inputs <= 10 % of plain's":
           {"met": share <= 0.10, "fused_bytes": fused, "checkpoint_bytes": ckpt,
            "plain_bytes": plain, "share": share}}
    unsloth = modes.get("unsloth", {})
    other, note = ((unsloth["same_as"], f"{unsloth['same_as']}: {unsloth['why']}")
                   if "same_as" in unsloth else ("unsloth", ""))
    if _ok(modes, other):
        side = _side_by_side(modes, other)
        out["kept <= the unsloth mode's and checkpoint's"] = \
            dict(side, against=note) if note else side
    out.update(_time(modes))
    out["max batch >= 2x plain's"] = _at_least(modes, 2.0, "plain")
    if _ok(modes, other):
        out["max batch >= 1.5x the unsloth mode's"] = _at_least(modes, 1.5, other, note)
    return out


def _moe(modes: dict, sizes: dict) -> dict:
    """Kept at most eager checkpoint's (the blocks' inputs, what the norms keep and an RNG state
    per call) plus the routing (:meth:`MoENet.routing_bytes`); time; max batch >= 2x plain's."""
    fused, ckpt = modes["fused"]["kept_for_backward"], modes["checkpoint"]["kept_for_backward"]
    routing = MoENet.routing_bytes(sizes["batch"], sizes["depth"])
    out = {"kept <= the blocks' inputs and the routing":
           {"met": fused <= ckpt + routing, "fused_bytes": fused, "checkpoint_bytes": ckpt,
            "routing_bytes": routing}}
    out.update(_time(modes))
    out["max batch >= 2x plain's"] = _at_least(modes, 2.0, "plain")
    return out


def targets(net_name: str, modes: dict, sizes: dict) -> dict:
    """The targets of network ``net_name`` from its modes' results (``sizes``: its sizes in the
    run's conditions); {} for a network without targets or where plain, checkpoint or fused did
    not run."""
    cls = NETWORKS[net_name]
    if not _ok(modes, "plain", "checkpoint", "fused"):
        return {}
    if issubclass(cls, LlamaLoRANet):
        return _lora(modes)
    if issubclass(cls, MoENet):
        return _moe(modes, sizes)
    return {}
