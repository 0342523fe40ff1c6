"""ckpt_ext: a fused Linear+Tanh for PyTorch that keeps only its input and recomputes the
activation in its own backward — the memory of gradient checkpointing at less cost."""
import torch  # noqa: F401  (loads libtorch/libc10, which _C links against, before _C)

from . import _C
from .modules import FusedLinearTanh
from .ops import linear_tanh

#: True when the CUDA kernels were compiled into this build.
WITH_CUDA: bool = bool(_C.WITH_CUDA)

__version__ = "0.1.0"

__all__ = ["linear_tanh", "FusedLinearTanh", "WITH_CUDA"]
