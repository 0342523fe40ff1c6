"""ckpt_ext: fused Linear+activation ops for PyTorch that keep only their input and recompute the
activations in their own backward — the memory of gradient checkpointing at less cost — with the
modules, the converter ``fuse``, the planner ``plan`` / ``max_batch`` (the least recompute
within a memory budget), the write-up's networks (``Net``, ``ckpt_ext.models``) and the
memory meter (``ckpt_ext.memory``). The benchmark, ``python -m ckpt_ext.bench``, is not imported."""
import torch  # noqa: F401  (first: loads libc10/libtorch, which _C links against)

from ._native import _C  # refuses a _C built for another torch, naming both versions
from .modules import FusedGatedMLP, FusedLinearTanh, FusedMLP, FusedTanhMLP
from .ops import (ACTIVATIONS, MOE_LAYOUTS, LoRA, gated_mlp, linear_tanh, mlp, moe_experts,
                  moe_layout, tanh_mlp)

#: True when the CUDA kernels were compiled into this build.
WITH_CUDA: bool = bool(_C.WITH_CUDA)

__version__ = "0.1.0"

from . import memory  # noqa: E402  (the meter: ckpt_ext.memory.MemoryMeter, measured_step)
from .convert import FallbackWarning, FuseReport, fuse, stats, unfuse  # noqa: E402
from .models import Net  # noqa: E402  (the write-up's network; the others in ckpt_ext.models)
from .planner import Plan, max_batch, plan  # noqa: E402  (the least recompute within a budget)

__all__ = ["linear_tanh", "tanh_mlp", "mlp", "gated_mlp", "LoRA", "moe_experts", "moe_layout",
           "MOE_LAYOUTS", "ACTIVATIONS", "FusedLinearTanh", "FusedTanhMLP", "FusedMLP",
           "FusedGatedMLP", "WITH_CUDA",
           "fuse", "unfuse", "FuseReport", "FallbackWarning", "stats", "Net", "plan",
           "max_batch", "Plan"]
