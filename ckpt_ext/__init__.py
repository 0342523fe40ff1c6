"""ckpt_ext: a fused Linear+Tanh for PyTorch that keeps only its input and recomputes the
activation in its own backward — the memory of gradient checkpointing at less cost."""
import torch  # noqa: F401  (first: loads libc10/libtorch, which _C links against)

from ._native import _C  # refuses a _C built for another torch, naming both versions
from .modules import FusedLinearTanh, FusedTanhMLP
from .ops import linear_tanh, tanh_mlp

#: True when the CUDA kernels were compiled into this build.
WITH_CUDA: bool = bool(_C.WITH_CUDA)

__version__ = "0.1.0"

__all__ = ["linear_tanh", "tanh_mlp", "FusedLinearTanh", "FusedTanhMLP", "WITH_CUDA"]

# Ecosystem: the model converter (ckpt_ext/convert.py).
from .convert import FuseReport, fuse  # noqa: E402

# The write-up's network (ckpt_ext/models.py).
from .models import Net  # noqa: E402

__all__ += ["fuse", "FuseReport", "Net"]
