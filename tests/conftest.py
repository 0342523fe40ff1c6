import pytest
import torch

import ckpt_ext

_NO_GPU = "CUDA kernels need a GPU; none visible here"
_NO_CUDA_BUILD = "ckpt_ext was built without CUDA kernels (ckpt_ext.WITH_CUDA is False)"


def _cuda_skip_reason():
    if not torch.cuda.is_available():
        return _NO_GPU
    if not ckpt_ext.WITH_CUDA:
        return _NO_CUDA_BUILD
    return None


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(_cuda_skip_reason() is not None,
                                                  reason=_cuda_skip_reason() or "")),
]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture
def poison():
    """Every buffer the ops allocate starts as NaN, so unwritten elements fail the comparison."""
    ckpt_ext._C._set_poison_buffers(True)
    try:
        yield
    finally:
        ckpt_ext._C._set_poison_buffers(False)
