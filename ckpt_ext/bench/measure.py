"""Timing one step, timing the GEMMs a mode recomputes (the floor), and what is derived per mode:
gradient agreement with plain, the largest batch in a budget.

Timings run on the stock allocator (:func:`ckpt_ext.memory.uninstrumented`); the memory of a step is measured
separately by :func:`ckpt_ext.memory.measured_step`.
"""
from __future__ import annotations

import math
import time
from typing import Callable

import torch
from torch import nn



def share_parameters(src: nn.Module, dst: nn.Module) -> None:
    """Make ``dst`` use ``src``'s Parameter objects (same names in every mode), so all modes run
    on one set of weights and only one set is held in memory."""
    for name, p in src.named_parameters():
        owner, _, attr = name.rpartition(".")
        setattr(dst.get_submodule(owner) if owner else dst, attr, p)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(net: Callable, x: torch.Tensor, device: torch.device,
               loss_fn: Callable) -> float:
    """Seconds of one forward, loss and backward."""
    _sync(device)
    t = time.perf_counter()
    loss_fn(net(x), x).backward()
    _sync(device)
    return time.perf_counter() - t


def timed_gemms(operands: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                device: torch.device) -> float:
    """The recompute alone: ``addmm(b, x, W.T)`` per recomputed layer, output allocated as the
    recompute allocates it."""
    _sync(device)
    t = time.perf_counter()
    for x, w, b in operands:
        torch.addmm(b, x, w.t())
    _sync(device)
    return time.perf_counter() - t


def grad_errors(net: nn.Module, ref: dict[str, torch.Tensor]) -> float:
    """The largest relative error of a parameter gradient of ``net`` against ``ref`` (every
    trainable parameter's; frozen ones have none)."""
    worst = 0.0
    for name, p in net.named_parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            return math.inf
        g, r = p.grad.double(), ref[name].double()
        err = float((g - r).norm() / r.norm().clamp_min(1e-300))
        worst = max(worst, err if math.isfinite(err) else math.inf)
    return worst


def max_batch(budget: int, batch: int, peak_full: int, peak_half: int, half: int) -> dict:
    """The largest batch whose peak fits ``budget``, from the peaks at two batch sizes (every
    tensor of these networks grows linearly with the batch)."""
    per_sample = (peak_full - peak_half) / (batch - half) if batch > half else None
    if not per_sample or per_sample <= 0:
        return {"per_sample_bytes": per_sample, "fixed_bytes": None, "max_batch": None}
    fixed = peak_full - per_sample * batch
    fit = math.floor((budget - fixed) / per_sample)
    return {"per_sample_bytes": per_sample, "fixed_bytes": fixed, "max_batch": max(fit, 0)}
