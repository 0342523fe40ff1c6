"""Recording every mask ``F.dropout`` draws: the tests compare the fused model's masks with the
unfused model's bitwise; and a float32 step on a device that checks the device's generator."""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.nn.functional as F


def record_masks(monkeypatch) -> List[Tuple[Tuple[int, ...], torch.Tensor]]:
    """Patch ``F.dropout`` (nn.Dropout and ckpt_ext's units call it) to append (input shape,
    where the output is 0) for each call that draws a mask on a non-empty input."""
    drawn: List[Tuple[Tuple[int, ...], torch.Tensor]] = []
    depth = [0]
    real = F.dropout

    def recording(x, p=0.5, training=True, inplace=False):
        depth[0] += 1  # F.dropout calls itself again under a torch function mode
        try:
            out = real(x, p, training, inplace)
        finally:
            depth[0] -= 1
        if not depth[0] and training and p > 0 and x.numel():
            drawn.append((tuple(x.shape), out == 0))
        return out
    monkeypatch.setattr(F, "dropout", recording)
    return drawn


def same_draws_on_device(plain, fused, x, device: str) -> None:
    """A float32 step of each model under one seed: the device's generator ends where the
    unfused model leaves it, after forward and after backward, and outputs and gradients agree
    to float32 rounding."""
    state = torch.cuda.get_rng_state if device == "cuda" else torch.get_rng_state
    runs = []
    for model in (plain, fused):
        torch.manual_seed(7)
        y = model(x)
        after_forward = state()
        grads = torch.autograd.grad(y.square().sum(), list(model.parameters()))
        runs.append((y, grads, after_forward, state()))
    (a, ga, fa, ba), (b, gb, fb, bb) = runs
    assert torch.equal(fa, fb) and torch.equal(ba, bb)
    assert (b - a).abs().max() <= 1e-5 * a.abs().max()
    for r, g in zip(ga, gb):
        assert (g - r).abs().max() <= 1e-5 * r.abs().max()
