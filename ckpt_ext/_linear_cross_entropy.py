"""The cross-entropy of a Linear head's logits whose gradient is computed in its forward: the loss
keeps ``dL/dh``, ``dL/dW`` and ``dL/db`` (a row of h per token and one weight's worth) for its
backward instead of the log-softmax of every logit (a row of the vocabulary per token).

Shapes: ``h`` (N, H) the head's input, ``weight`` (V, H), ``bias`` (V,) or None, ``logits`` (N, V)
the head's output ``h·Wᵀ + b`` as computed for the caller (read, not differentiated: no GEMM
recomputes it), ``target`` (N,) with ``ignore_index`` where no token counts. The loss is
transformers' ``ForCausalLMLoss`` of those logits: in float32 (``logits.float()``), the sum over
counted tokens of ``logsumexp(z) - z[target]``, divided by the count (or by ``divisor``, its
``num_items_in_batch``). The gradient of the logits, ``(softmax(z) - onehot(target)) / divisor``
on counted rows, is cast to h's dtype as autograd's backward of ``.float()`` casts it, then
multiplied into dh and dW a chunk of rows at a time: at most ``CHUNKS`` chunks, each about h's
size. Backward multiplies the kept gradients by the loss's gradient. Why and what it frees:
docs/plan.md, "The head's loss"."""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch.autograd.function import once_differentiable

#: The most chunks of rows the logits' gradient is made in (each is unrolled by torch.compile).
CHUNKS = 8


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, logits, target, ignore_index: int,
                divisor: Optional[Union[torch.Tensor, int, float]]):
        n, v = logits.shape
        chunks = max(1, min(CHUNKS, math.ceil(v / max(h.shape[1], 1)), n))
        rows = math.ceil(n / chunks) if n else 1
        counted = target != ignore_index
        divisor = counted.sum() if divisor is None else divisor
        divisor = torch.as_tensor(divisor, device=h.device).to(torch.float32)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) \
            if need_w else None
        grad_b = torch.zeros(v, dtype=torch.float32, device=h.device) if need_b else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        safe = torch.where(counted, target, 0)
        for s in range(0, n, rows):
            z = logits[s:s + rows].to(torch.float32, copy=True)  # a copy: z is written in place
            t, on = safe[s:s + rows, None], counted[s:s + rows, None]
            lse = torch.logsumexp(z, 1, keepdim=True)
            total = total + torch.where(on, lse - z.gather(1, t), 0).sum()
            # z becomes the logits' gradient in place: softmax, less one at the target, scaled
            z.sub_(lse).exp_()
            z.scatter_add_(1, t, torch.full(t.shape, -1.0, dtype=z.dtype, device=z.device))
            z.mul_(torch.where(on, 1 / divisor, 0))  # 0 where not counted, as 0/0 would not
            g = z.to(h.dtype)
            if need_h:
                torch.mm(g, weight, out=grad_h[s:s + rows])
            if need_w:  # addmm's out form: FlopCounterMode counts it (not addmm_)
                torch.addmm(grad_w, g.t().float(), h[s:s + rows].float(), out=grad_w)
            if need_b:
                grad_b.add_(g.float().sum(0))
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype) if need_w else None,
                              grad_b.to(bias.dtype) if need_b else None)
        return total / divisor

    @staticmethod
    @once_differentiable  # the kept gradients are numbers: no second derivative through them
    def backward(ctx, grad_loss):
        return tuple(None if g is None else g * grad_loss.to(g.dtype)
                     for g in ctx.saved_tensors) + (None,) * 4


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                         divisor=None) -> torch.Tensor:
    """The loss described above; ``logits`` is read detached (its own graph, if any, stays the
    caller's)."""
    if h.dim() != 2 or logits.dim() != 2 or target.dim() != 1 or \
            logits.shape != (h.shape[0], weight.shape[0]) or target.shape[0] != h.shape[0] or \
            weight.shape[1] != h.shape[1]:
        raise ValueError(f"ckpt_ext.linear_cross_entropy: expected h (N, H), weight (V, H), "
                         f"logits (N, V), target (N,); got h {tuple(h.shape)}, weight "
                         f"{tuple(weight.shape)}, logits {tuple(logits.shape)}, target "
                         f"{tuple(target.shape)}")
    return LinearCrossEntropy.apply(h, weight, bias, logits.detach(), target, ignore_index,
                                    divisor)
