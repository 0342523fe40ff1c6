"""FLOP formulas for the ATen ops that ``torch.utils.flop_counter.FlopCounterMode`` has none for
and a training step runs: the CPU flash attention that ``F.scaled_dot_product_attention`` calls on
a CPU (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward). Without them a CPU
step's attention counts 0 FLOPs, and so does its recompute: checkpointing a transformer layer
would look cheaper than it is next to fusing its MLP (docs/plan.md, "FLOPs"). Each is torch's own
formula for the CUDA kernels (``sdpa_flop_count``, ``sdpa_backward_flop_count``), registered only
where this torch has none."""
import torch
import torch.utils.flop_counter as _fc


def _register(op_name: str, formula) -> None:
    op = getattr(torch.ops.aten, op_name, None)
    if op is None or op in _fc.flop_registry or op.default in _fc.flop_registry:
        return  # this torch has no such op, or counts it already
    _fc.register_flop_formula(op)(formula)



def _broadcast_heads(query_shape, key_shape, value_shape):
    """Key and value shapes with the query's heads: grouped-query attention (fewer key/value
    heads) computes as if each were repeated, and the formulas of older torch take equal heads."""
    h = query_shape[1]
    return tuple((*s[:1], h, *s[2:]) for s in (key_shape, value_shape))

def _cpu_flash_attention_flop(query_shape, key_shape, value_shape, *args, out_shape=None,
                              **kwargs) -> int:
    return _fc.sdpa_flop_count(query_shape, *_broadcast_heads(query_shape, key_shape, value_shape))


def _cpu_flash_attention_backward_flop(grad_out_shape, query_shape, key_shape, value_shape,
                                       *args, out_shape=None, **kwargs) -> int:
    return _fc.sdpa_backward_flop_count(grad_out_shape, query_shape,
                                        *_broadcast_heads(query_shape, key_shape, value_shape))


_register("_scaled_dot_product_flash_attention_for_cpu", _cpu_flash_attention_flop)
_register("_scaled_dot_product_flash_attention_for_cpu_backward",
          _cpu_flash_attention_backward_flop)
