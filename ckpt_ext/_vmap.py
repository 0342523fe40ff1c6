"""vmap rules of the ckpt_ext ops (torch.vmap, and the vmaps inside torch.func.jacrev / jacfwd /
hessian). A rule gets the tensors without their batch dimension and ``in_dims`` saying where it was
(None: unbatched).

Every rule calls the ops themselves, so each derivative formula is the op's own. With unbatched
parameters the batch is folded into the rows and the op runs once, unless a result that sums over
rows (a weight or bias gradient) is asked: it differs per sample, so the op runs once per sample
(batched weights: model ensembles, tangents of jacfwd/hessian w.r.t. the weights; per-sample weight
gradients), and the results are stacked. torch.vmap cannot be called inside a rule (functorch
asserts), hence the loop.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
from torch import Tensor

from ._derivatives import _OPS


def _bdim_first(t: Optional[Tensor], bdim: Optional[int], batch: int) -> Optional[Tensor]:
    """t with its batch dimension first; an unbatched t expanded to the batch (a view)."""
    if t is None:
        return None
    return t.movedim(bdim, 0) if bdim is not None else t.expand(batch, *t.shape)


def _one_layer_vmap(op, params: Sequence[int], sums: Sequence[int], info, in_dims, *args):
    """A one-layer op under vmap. ``params``: the positions of the parameter-shaped arguments
    (weight, bias, grad_grad_weight, ...); the others are rows (..., C), or the output mask last.
    ``sums``: the positions of the results that sum over rows (each asked where the mask says)."""
    B = info.batch_size
    mask = args[-1] if sums else ()
    if all(in_dims[i] is None for i in params) and not any(mask[j] for j in sums):
        # The op takes any leading row dimensions: (B, ..., C) is B times the rows.
        folded = [a if i in params or not isinstance(a, Tensor) else _bdim_first(a, d, B)
                  for i, (a, d) in enumerate(zip(args, in_dims))]
        r = op(*folded)
    else:
        cols = [a.unbind(d) if isinstance(a, Tensor) and d is not None else None
                for a, d in zip(args, in_dims)]
        samples = [[a if c is None else c[i] for a, c in zip(args, cols)] for i in range(B)]
        if B == 0:  # one sample of zeros gives the results' shapes; none of it is kept
            samples = [[a.new_zeros(a.shape[:d] + a.shape[d + 1:])
                        if isinstance(a, Tensor) and d is not None else a
                        for a, d in zip(args, in_dims)]]
        per = [op(*a) for a in samples]
        if isinstance(per[0], Tensor):
            r = torch.stack(per)[:B]
        else:
            r = tuple(None if v is None else torch.stack([p[j] for p in per])[:B]
                      for j, v in enumerate(per[0]))
    if isinstance(r, Tensor):
        return r, 0
    return tuple(r), tuple(None if v is None else 0 for v in r)


# (op, parameter-shaped arguments, results summed over rows)
_ONE_LAYER = {
    "linear_tanh_backward_from_output": ((3, 4), (1, 2)),
    "linear_tanh_backward_from_output_backward": ((1, 2, 6), (3,)),
}
for _name, (_params, _sums) in _ONE_LAYER.items():
    torch.library.register_vmap(
        f"ckpt_ext::{_name}",
        functools.partial(_one_layer_vmap, getattr(_OPS, _name).default, _params, _sums))


def _slices(args, dims, i):
    """Sample i of each (possibly nested) argument, by its batch dimension; i None: a sample of
    zeros of a sample's shape (for an empty batch, whose results still need their shapes)."""
    out = []
    for a, d in zip(args, dims):
        if isinstance(a, (list, tuple)):
            out.append(type(a)(_slices(a, d, i)))
        elif isinstance(a, Tensor) and d is not None:
            out.append(a.select(d, i) if i is not None
                       else a.new_zeros(a.shape[:d] + a.shape[d + 1:]))
        else:
            out.append(a)
    return out


def _per_sample(op, args, dims, batch: int) -> list:
    """op on each sample; with no sample, on one sample of zeros (the caller keeps [:batch])."""
    return [op(*_slices(args, dims, i)) for i in (range(batch) if batch else [None])]


def _all_none(dims) -> bool:
    return all(_all_none(d) if isinstance(d, (list, tuple)) else d is None for d in dims)


def _stack_vmap(op, info, in_dims, x, *rest):
    """mlp, gated_mlp or their lora forms (``rest``: the parameter lists and the non-tensor
    arguments) under vmap: unbatched parameters fold the batch into the rows, one call; else one
    call per sample."""
    B = info.batch_size
    if _all_none(in_dims[1:]):
        return op(_bdim_first(x, in_dims[0], B), *rest), 0
    return torch.stack(_per_sample(op, (x, *rest), in_dims, B))[:B], 0


def _stack_backward_vmap(op, lists, info, in_dims, grad_out, x, *rest):
    """The backward of one of those (``rest`` ends with need_x and one mask per result list,
    ``lists`` of them) under vmap, likewise."""
    B = info.batch_size
    need_x, *masks = rest[-1 - lists:]
    counts = [sum(map(bool, m)) for m in masks]
    if _all_none(in_dims[2:]) and not any(counts):
        gx, *_ = op(_bdim_first(grad_out, in_dims[0], B), _bdim_first(x, in_dims[1], B), *rest)
        return (gx, *([] for _ in masks)), (0 if need_x else None, *([] for _ in masks))
    per = _per_sample(op, (grad_out, x, *rest), in_dims, B)
    gx = torch.stack([p[0] for p in per])[:B] if need_x else None
    grads = [[torch.stack([p[k][j] for p in per])[:B] for j in range(n)]
             for k, n in enumerate(counts, start=1)]
    return (gx, *grads), (0 if need_x else None, *([0] * n for n in counts))


# (forward op, its backward, the backward's result lists after grad_x)
for _fwd, _bwd, _lists in (("mlp", "mlp_backward", 2), ("gated_mlp", "gated_mlp_backward", 2),
                           ("lora_mlp", "lora_mlp_backward", 5),
                           ("lora_gated_mlp", "lora_gated_mlp_backward", 5)):
    torch.library.register_vmap(f"ckpt_ext::{_fwd}",
                                functools.partial(_stack_vmap, getattr(_OPS, _fwd).default))
    torch.library.register_vmap(f"ckpt_ext::{_bwd}",
                                functools.partial(_stack_backward_vmap,
                                                  getattr(_OPS, _bwd).default, _lists))
