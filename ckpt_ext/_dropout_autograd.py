"""Autograd of a fused unit whose Dropouts draw masks (p > 0, in training): computed with the ATen
ops the unfused model calls, in its order, keeping only x, the parameters and the state of the
generator the masks come from. Backward restores that state (and the forward's autocast
settings), recomputes the unit, so each Dropout draws its mask again bitwise, and differentiates
it; the generator is left as it was. Design: docs/converter.md, "Dropout inside a unit"."""
from __future__ import annotations

import functools
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ._activations import activate
from ._gated_autograd import _gate_and_up


def unsupported() -> Optional[str]:
    """Why a unit with active Dropouts cannot run recomputed now (the caller then computes it
    module by module), or None."""
    if torch.compiler.is_compiling():
        return "torch.compile is tracing it"
    if torch._C._are_functorch_transforms_active():
        return "a torch.func transform is running"
    if torch.autograd.forward_ad._current_level >= 0:
        return "forward-mode AD is active"
    return None


def gated(x: Tensor, gate_w: Tensor, up_w: Optional[Tensor], down_w: Tensor,
          gate_b: Optional[Tensor], up_b: Optional[Tensor], down_b: Optional[Tensor],
          activation: str, gate_second: bool, ps: Sequence[float]) -> Tensor:
    """``down(dropout_ps(act(gate(x)) * up(x)))``; ``up_w`` None: ``gate_w`` is the packed
    (2I, H) weight, its halves (gate, up), or (up, gate) with ``gate_second``."""
    compute = functools.partial(_gated, activation, gate_second, tuple(ps))
    return _Recomputed.apply(compute, x, gate_w, up_w, down_w, gate_b, up_b, down_b)


def plain(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Optional[Tensor]],
          activations: Sequence[str], masks: Dict[int, Tuple[float, ...]]) -> Tensor:
    """A run ``Linear, act, Linear, ...`` (``activations``: one per activated layer) with
    ``F.dropout`` of each p in ``masks[k]`` after item k (Linear j is item 2j, its activation
    2j + 1)."""
    compute = functools.partial(_plain, tuple(activations), len(weights),
                                {k: tuple(ps) for k, ps in masks.items()})
    return _Recomputed.apply(compute, x, *weights, *biases)


def _plain(acts, layers, masks, x, *params):
    h = x
    for j in range(layers):
        h = F.linear(h, params[j], params[layers + j])
        for k in (2 * j, 2 * j + 1)[:1 + (j < len(acts))]:
            if k % 2:
                h = activate(acts[j], h)
            for p in masks.get(k, ()):
                h = F.dropout(h, p, True)
    return h


def _gated(act, gate_second, ps, x, gate_w, up_w, down_w, gate_b, up_b, down_b):
    if up_w is None:
        g, u = _gate_and_up(x, [gate_w, down_w], [gate_b, down_b])
        g, u = (u, g) if gate_second else (g, u)
    else:
        g, u = _gate_and_up(x, [gate_w, up_w, down_w], [gate_b, up_b, down_b])
    h = activate(act, g) * u
    for p in ps:
        h = F.dropout(h, p, True)
    return F.linear(h, down_w, down_b)


class _Recomputed(torch.autograd.Function):
    """apply(compute, x, *params): compute(x, *params) keeping (x, params), the generator's state
    and the autocast settings; params may hold None."""

    @staticmethod
    def forward(ctx, compute, x, *params):
        ctx.compute, ctx.device = compute, x.device
        ctx.rng = _get_rng(x.device)
        kind = x.device.type
        ctx.autocast = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind),
                        torch.is_autocast_cache_enabled()) if kind in ("cpu", "cuda") else None
        ctx.save_for_backward(x, *params)
        with torch.no_grad():
            return compute(x, *params)

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        need = ctx.needs_input_grad[1:]
        create = torch.is_grad_enabled()  # create_graph: differentiate through the saved tensors
        inputs = [t if t is None or create else t.detach().requires_grad_(n)
                  for t, n in zip(saved, need)]
        device = ctx.device
        cuda = [device.index if device.index is not None else torch.cuda.current_device()] \
            if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda, device_type="cuda"), torch.enable_grad():
            _set_rng(device, ctx.rng)
            if ctx.autocast is None:
                out = ctx.compute(*inputs)
            else:
                enabled, dtype, cache = ctx.autocast
                with torch.autocast(device.type, dtype=dtype, enabled=enabled,
                                    cache_enabled=cache):
                    out = ctx.compute(*inputs)
        wanted = [t for t, n in zip(inputs, need) if n and t is not None]
        grads = iter(torch.autograd.grad(out, wanted, grad_out, create_graph=create,
                                         allow_unused=True) if wanted else ())
        return (None, *[next(grads) if n and t is not None else None
                        for t, n in zip(inputs, need)])


def _get_rng(device: torch.device) -> Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_rng(device: torch.device, state: Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)
