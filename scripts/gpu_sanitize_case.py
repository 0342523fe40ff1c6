"""A small workload for `compute-sanitizer --tool memcheck` (run by scripts/gpu_check.sh): every
dtype, widths around the 16-byte packs, partial row chunks, no bias, and a stride-0 grad_out, so
each kernel's edges (scalar tail, last chunk, last column) are touched once.

Run it with PYTORCH_NO_CUDA_MEMORY_CACHING=1: then every buffer is its own cudaMalloc and an access
one element past a buffer is caught, instead of landing inside the caching allocator's block.
Exits non-zero if an output is not finite or far from a float64 reference (a check of the run,
not a substitute for the tests).
"""
import sys

import torch
import torch.nn.functional as F

import ckpt_ext


def main():
    assert torch.cuda.is_available() and ckpt_ext.WITH_CUDA, "needs a GPU and a CUDA build"
    worst = 0.0
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for m, k, n in ((1, 3, 1), (33, 5, 7), (65, 8, 33), (3, 16, 9)):
            for bias in (True, False):
                g = torch.Generator().manual_seed(m * 100 + n)
                x = torch.randn(m, k, generator=g).to("cuda", dtype)
                w = (torch.randn(n, k, generator=g) / k ** 0.5).to("cuda", dtype)
                b = torch.randn(n, generator=g).to("cuda", dtype) if bias else None
                gy = torch.ones((), dtype=dtype, device="cuda").expand(m, n)
                y = torch.ops.ckpt_ext.linear_tanh(x, w, b)
                gx, gw, gb = torch.ops.ckpt_ext.linear_tanh_backward(gy, x, w, b,
                                                                      [True, True, True])
                ref = torch.tanh(F.linear(x.double(), w.double(),
                                          None if b is None else b.double()))
                for t in (y, gx, gw) + ((gb,) if bias else ()):
                    if not torch.isfinite(t).all():
                        print(f"non-finite output: {dtype} m={m} k={k} n={n} bias={bias}")
                        return 1
                worst = max(worst, ((y.double() - ref).abs().max() / ref.abs().max()).item())
    torch.cuda.synchronize()
    print(f"sanitize case done; worst forward error vs float64 (max-norm relative): {worst:.2e}")
    return 0 if worst < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
