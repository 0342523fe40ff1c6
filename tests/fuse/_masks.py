"""Recording every mask ``F.dropout`` draws: the tests compare the fused model's masks with the
unfused model's bitwise."""
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
