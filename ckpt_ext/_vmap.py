"""vmap rules of the ckpt_ext ops (torch.vmap, and the vmaps inside torch.func.jacrev / jacfwd /
hessian). A rule gets the tensors without their batch dimension and ``in_dims`` saying where it was
(None: unbatched).

Fast path: when only the row tensors (x, grad_out, grad_grad_x) are batched and only row results
(y, grad_x, grad_grad_out) are asked for, the batch is folded into the rows and the op runs once,
recomputing as usual. Otherwise (batched weights: model ensembles, tangents of jacfwd/hessian
w.r.t. the weights; or per-sample weight gradients) the one-layer ops are computed from the batched
formulas of ``_derivatives``, and the stack ops loop over the batch. torch.vmap cannot be called
inside a rule (functorch asserts), hence the explicit batch dimension.
"""
from __future__ import annotations

import functools

import math
from typing import Optional

import torch
from torch import Tensor

from ._derivatives import (_OPS, _batched_backward, _batched_backward_from_output,
                           _batched_double_backward, _batched_from_output_backward, _batched_tanh,
                           linear_tanh_backward, linear_tanh_double_backward)

def _bdim_first(t: Optional[Tensor], bdim: Optional[int], batch: int) -> Optional[Tensor]:
    """t with its batch dimension first; an unbatched t expanded to the batch (a view)."""
    if t is None:
        return None
    return t.movedim(bdim, 0) if bdim is not None else t.expand(batch, *t.shape)


def _batched_rows(t: Optional[Tensor]) -> Optional[Tensor]:
    """(B, ..., C) as (B, rows, C)."""
    return None if t is None else t.reshape(t.shape[0], math.prod(t.shape[1:-1]), t.shape[-1])


def _unrows(t: Optional[Tensor], like_shape) -> Optional[Tensor]:
    """(B, R, C) back to (B, *like_shape[:-1], C)."""
    return None if t is None else t.reshape(t.shape[0], *like_shape[:-1], t.shape[-1])


@torch.library.register_vmap("ckpt_ext::linear_tanh")
def _linear_tanh_vmap(info, in_dims, x, weight, bias):
    bx, bw, bb = in_dims
    if bw is None and bb is None:
        return _OPS.linear_tanh.default(x.movedim(bx, 0), weight, bias), 0
    B = info.batch_size
    x, weight, bias = (_bdim_first(t, d, B) for t, d in zip((x, weight, bias), in_dims))
    return _unrows(_batched_tanh(_batched_rows(x), weight, bias), x.shape[1:]), 0


@torch.library.register_vmap("ckpt_ext::linear_tanh_backward")
def _linear_tanh_backward_vmap(info, in_dims, grad_out, x, weight, bias, output_mask):
    bgy, bx, bw, bb, _ = in_dims
    B = info.batch_size
    grad_out, x = _bdim_first(grad_out, bgy, B), _bdim_first(x, bx, B)
    mask = [bool(m) for m in output_mask]
    if bw is None and bb is None and not mask[1] and not mask[2]:
        gx = linear_tanh_backward(grad_out, x, weight, bias, mask)[0]
        return (gx, None, None), (0 if mask[0] else None, None, None)
    weight, bias = _bdim_first(weight, bw, B), _bdim_first(bias, bb, B)
    gx, gw, gb = _batched_backward(_batched_rows(grad_out), _batched_rows(x), weight, bias, mask)
    return (_unrows(gx, x.shape[1:]), gw, gb), tuple(None if r is None else 0 for r in (gx, gw, gb))


@torch.library.register_vmap("ckpt_ext::linear_tanh_double_backward")
def _linear_tanh_double_backward_vmap(info, in_dims, ggx, ggw, ggb, grad_out, x, weight, bias,
                                      output_mask):
    b_ggx, b_ggw, b_ggb, bgy, bx, bw, bb, _ = in_dims
    B = info.batch_size
    ggx, grad_out, x = (_bdim_first(t, d, B) for t, d in ((ggx, b_ggx), (grad_out, bgy), (x, bx)))
    mask = [bool(m) for m in output_mask]
    if all(d is None for d in (b_ggw, b_ggb, bw, bb)) and not mask[2] and not mask[3]:
        r = linear_tanh_double_backward(ggx, ggw, ggb, grad_out, x, weight, bias, mask)
        return (r[0], r[1], None, None), (0 if mask[0] else None, 0 if mask[1] else None, None,
                                          None)
    ggw, ggb, weight, bias = (_bdim_first(t, d, B)
                              for t, d in ((ggw, b_ggw), (ggb, b_ggb), (weight, bw), (bias, bb)))
    r = _batched_double_backward(_batched_rows(ggx), ggw, ggb, _batched_rows(grad_out),
                                 _batched_rows(x), weight, bias, mask)
    r = (_unrows(r[0], grad_out.shape[1:]), _unrows(r[1], x.shape[1:]), r[2], r[3])
    return r, tuple(None if t is None else 0 for t in r)


# The output-based ops serve create_graph=True in plain autograd (torch.func uses the recomputing
# ones); their rules are the batched formulas, for completeness.
@torch.library.register_vmap("ckpt_ext::linear_tanh_backward_from_output")
def _linear_tanh_backward_from_output_vmap(info, in_dims, grad_out, x, output, weight, bias,
                                           output_mask):
    B = info.batch_size
    grad_out, x, output, weight, bias = (_bdim_first(t, d, B) for t, d in
                                         zip((grad_out, x, output, weight, bias), in_dims))
    x3 = _batched_rows(x)
    gx, gw, gb = _batched_backward_from_output(_batched_rows(grad_out), x3, _batched_rows(output),
                                               weight, bias is not None, output_mask)
    r = (_unrows(gx, x.shape[1:]), gw, gb)
    return r, tuple(None if v is None else 0 for v in r)


@torch.library.register_vmap("ckpt_ext::linear_tanh_backward_from_output_backward")
def _linear_tanh_backward_from_output_backward_vmap(info, in_dims, ggx, ggw, ggb, grad_out, x,
                                                    output, weight, output_mask):
    B = info.batch_size
    ggx, ggw, ggb, grad_out, x, output, weight = (
        _bdim_first(t, d, B) for t, d in zip((ggx, ggw, ggb, grad_out, x, output, weight), in_dims))
    r = _batched_from_output_backward(_batched_rows(ggx), ggw, ggb, _batched_rows(grad_out),
                                      _batched_rows(x), _batched_rows(output), weight, output_mask)
    r = (_unrows(r[0], grad_out.shape[1:]), _unrows(r[1], x.shape[1:]),
         _unrows(r[2], output.shape[1:]), r[3])
    return r, tuple(None if v is None else 0 for v in r)


def _slices(args, dims, i):
    """Sample i of each (possibly nested) argument, by its batch dimension."""
    out = []
    for a, d in zip(args, dims):
        if isinstance(a, (list, tuple)):
            out.append(type(a)(_slices(a, d, i)))
        else:
            out.append(a.select(d, i) if isinstance(a, Tensor) and d is not None else a)
    return out


def _all_none(dims) -> bool:
    return all(_all_none(d) if isinstance(d, (list, tuple)) else d is None for d in dims)


def _stack_vmap(op, info, in_dims, x, weights, biases, *rest):
    """tanh_mlp / mlp (``rest``: their trailing non-tensor arguments) under vmap: unbatched
    parameters fold the batch into the rows, one call; else one call per sample."""
    bx, bws, bbs = in_dims[:3]
    B = info.batch_size
    if _all_none(bws) and _all_none(bbs):
        return op(_bdim_first(x, bx, B), weights, biases, *rest), 0
    args = (x, weights, biases, *rest)
    return torch.stack([op(*_slices(args, in_dims, i)) for i in range(B)]), 0


def _stack_backward_vmap(op, info, in_dims, grad_out, x, weights, biases, *rest):
    """tanh_mlp_backward / mlp_backward (``rest`` ends with need_x, need_weights, need_biases)
    under vmap, likewise."""
    bgy, bx, bws, bbs = in_dims[:4]
    B = info.batch_size
    need_x, need_weights, need_biases = rest[-3:]
    n_w, n_b = sum(map(bool, need_weights)), sum(map(bool, need_biases))
    if _all_none(bws) and _all_none(bbs) and n_w == 0 and n_b == 0:
        gx, _, _ = op(_bdim_first(grad_out, bgy, B), _bdim_first(x, bx, B), weights, biases,
                      *rest)
        return (gx, [], []), (0 if need_x else None, [], [])
    args = (grad_out, x, weights, biases, *rest)
    per = [op(*_slices(args, in_dims, i)) for i in range(B)]
    gx = torch.stack([p[0] for p in per]) if need_x else None
    gw = [torch.stack([p[1][j] for p in per]) for j in range(n_w)]
    gb = [torch.stack([p[2][j] for p in per]) for j in range(n_b)]
    return (gx, gw, gb), (0 if need_x else None, [0] * n_w, [0] * n_b)


for _name in ("tanh_mlp", "mlp"):
    _op = getattr(_OPS, _name).default
    torch.library.register_vmap(f"ckpt_ext::{_name}", functools.partial(_stack_vmap, _op))
    _op = getattr(_OPS, f"{_name}_backward").default
    torch.library.register_vmap(f"ckpt_ext::{_name}_backward",
                                functools.partial(_stack_backward_vmap, _op))
