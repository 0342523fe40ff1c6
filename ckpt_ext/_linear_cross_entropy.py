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
multiplied into dh and dW a chunk of rows at a time, each chunk about h's size, inside one op of
its own (torch.compile keeps what it returns rather than recompute it). Backward multiplies the
kept gradients by the loss's gradient. Why and what it frees:
docs/plan.md, "The head's loss"."""
from __future__ import annotations

import math
from typing import List, Optional, Tuple, Union

import torch
import torch.utils.flop_counter  # not imported by `import torch`
from torch import Tensor
from torch.autograd.function import once_differentiable

@torch.library.custom_op("ckpt_ext::linear_cross_entropy", mutates_args=())
def _loss_and_grads(h: Tensor, weight: Tensor, bias: Optional[Tensor], logits: Tensor,
                    target: Tensor, ignore_index: int, divisor: Tensor, need: List[bool]
                    ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, dL/dh, dL/dW, dL/db), each gradient empty where ``need`` (h, W, b) says not; an op
    of its own, so that torch.compile keeps what it returns rather than recompute it."""
    n, v = logits.shape
    chunks = max(1, min(math.ceil(v / max(h.shape[1], 1)), n))  # each chunk about h's size
    rows = math.ceil(n / chunks) if n else 1
    counted = target != ignore_index
    grad_h = torch.empty_like(h) if need[0] else h.new_empty(0)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need[1] else None
    grad_b = torch.zeros(v, dtype=torch.float32, device=h.device) if need[2] else None
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    safe = torch.where(counted, target, 0)[:, None]
    scale = torch.where(counted, 1 / divisor, 0)[:, None]  # 0 where not counted, as 0/0 would not
    minus_one = torch.full((min(rows, n), 1), -1.0, dtype=torch.float32, device=h.device)
    for s in range(0, n, rows):
        z = logits[s:s + rows].to(torch.float32, copy=True)  # a copy: z is written in place
        t = safe[s:s + rows]
        lse = torch.logsumexp(z, 1, keepdim=True)
        total = total + torch.where(counted[s:s + rows, None], lse - z.gather(1, t), 0).sum()
        # z becomes the logits' gradient in place: softmax, less one at the target, scaled
        z.sub_(lse).exp_()
        z.scatter_add_(1, t, minus_one[:z.shape[0]])
        z.mul_(scale[s:s + rows])
        g = z.to(h.dtype)
        if need[0]:
            torch.mm(g, weight, out=grad_h[s:s + rows])
        if need[1]:
            grad_w.addmm_(g.t().float(), h[s:s + rows].float())
        if need[2]:
            grad_b.add_(g.float().sum(0))
    return (total / divisor, grad_h,
            grad_w.to(weight.dtype) if need[1] else weight.new_empty(0),
            grad_b.to(bias.dtype) if need[2] else h.new_empty(0))


@_loss_and_grads.register_fake
def _(h, weight, bias, logits, target, ignore_index, divisor, need):
    return (logits.new_empty((), dtype=torch.float32),
            torch.empty_like(h) if need[0] else h.new_empty(0),
            torch.empty_like(weight) if need[1] else weight.new_empty(0),
            torch.empty_like(bias) if need[2] else h.new_empty(0))


@torch.utils.flop_counter.register_flop_formula(torch.ops.ckpt_ext.linear_cross_entropy)
def _flops(h_shape, w_shape, bias_shape, logits_shape, target_shape, ignore_index, divisor_shape,
           need, *args, **kwargs) -> int:
    """dL/dh and dL/dW: a GEMM each (2·N·V·H), as the backward of the head's Linear counts."""
    n, v = logits_shape
    return 2 * n * v * h_shape[1] * (int(need[0]) + int(need[1]))


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, logits, target, ignore_index: int,
                divisor: Optional[Union[torch.Tensor, int, float]]):
        divisor = (target != ignore_index).sum() if divisor is None else divisor
        divisor = torch.as_tensor(divisor, device=h.device).to(torch.float32)
        need = [ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                bias is not None and ctx.needs_input_grad[2]]
        loss, *grads = torch.ops.ckpt_ext.linear_cross_entropy(
            h, weight, bias, logits, target, ignore_index, divisor, need)
        ctx.save_for_backward(*(g if wanted else None for g, wanted in zip(grads, need)))
        return loss

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
