"""A computation that draws random masks (Dropout), kept for backward as its inputs and the state
of the generator the masks come from: backward restores that state (and the autocast settings of
the forward) in a forked generator, recomputes, so each mask is drawn again bitwise, and
differentiates; the generator is left as the forward left it. The units of the converter with
Dropouts inside (_dropout_autograd.py) and the ops' LoRA terms with dropout (_lora_dropout.py)
run through it; a unit the ops cannot compute (a 4-bit base) through :class:`RecomputedModules`,
which recomputes with the modules' own parameters. Design: docs/converter.md, "Dropout inside a
unit"."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def unsupported() -> Optional[str]:
    """Why such a computation cannot run recomputed now (the caller then computes it with
    stock autograd), or None."""
    if torch.compiler.is_compiling():
        return "torch.compile is tracing it"
    if torch._C._are_functorch_transforms_active():
        return "a torch.func transform is running"
    if torch.autograd.forward_ad._current_level >= 0:
        return "forward-mode AD is active"
    return None


class RecomputedWithGenerator(torch.autograd.Function):
    """apply(compute, x, *params): compute(x, *params) keeping (x, params), the generator's state
    and the autocast settings; params may hold None."""

    @staticmethod
    def forward(ctx, compute, x, *params):
        ctx.compute, ctx.device = compute, x.device
        ctx.rng = _get_rng(x.device)
        kind = x.device.type
        ctx.autocast = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind),
                        torch.is_autocast_cache_enabled()) if kind in ("cpu", "cuda") else None
        own = ctx.own_params = getattr(compute, "own_params", False)
        ctx.save_for_backward(x, *([] if own else params))
        ctx.params = params if own else None
        if own:
            return _as_in_a_step(compute, x)
        with torch.no_grad():
            return compute(x, *params)

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        need = ctx.needs_input_grad[1:]
        create = torch.is_grad_enabled()  # create_graph: differentiate through the saved tensors
        inputs = [t if t is None or create else t.detach().requires_grad_(n)
                  for t, n in zip(saved, need)]
        if ctx.own_params:  # compute reads the modules' parameters: differentiate w.r.t. them
            inputs += list(ctx.params)
        device = ctx.device
        cuda = [device.index if device.index is not None else torch.cuda.current_device()] \
            if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda, device_type="cuda"), torch.enable_grad():
            _set_rng(device, ctx.rng)
            args = inputs[:1] if ctx.own_params else inputs
            if ctx.autocast is None:
                out = ctx.compute(*args)
            else:
                enabled, dtype, cache = ctx.autocast
                with torch.autocast(device.type, dtype=dtype, enabled=enabled,
                                    cache_enabled=cache):
                    out = ctx.compute(*args)
        wanted = [t for t, n in zip(inputs, need) if n and t is not None]
        grads = iter(torch.autograd.grad(out, wanted, grad_out, create_graph=create,
                                         allow_unused=True) if wanted else ())
        return (None, *[next(grads) if n and t is not None else None
                        for t, n in zip(inputs, need)])


def recomputed_modules(compute, x: Tensor, params) -> Tensor:
    """``compute(x)``, a function of x through modules holding ``params`` (their parameters that
    require grad), kept as x and the generator's state: backward recomputes it with those very
    parameters and differentiates w.r.t. x and them. Where it cannot run recomputed
    (:func:`unsupported`), compute(x) under stock autograd: the same values and draws."""
    if unsupported() is not None or not torch.is_grad_enabled():
        return compute(x)

    def run(h):
        return compute(h)
    run.own_params = True
    return RecomputedWithGenerator.apply(run, x, *params)


def _as_in_a_step(compute, x: Tensor) -> Tensor:
    """compute(x) with grad enabled and its graph keeping nothing, then dropped: modules see what
    they see in a step, tensors that require grad. bitsandbytes' Linear4bit, in eval() on a CPU
    with AVX512-BF16, repacks its weight for inference at a call whose input does not; under
    no_grad the unit's inner Linears would take that path (which fails for widths that are not a
    multiple of 32, and leaves the weight packed for the backward's recompute)."""
    h = x.detach().requires_grad_(x.requires_grad)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_kept_as_nothing, _never):
        return compute(h).detach()


def _kept_as_nothing(t: Tensor) -> None:
    return None


def _never(_) -> Tensor:
    raise RuntimeError("ckpt_ext: a graph recorded to be dropped was differentiated")


def _get_rng(device: torch.device) -> Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_rng(device: torch.device, state: Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)
