// device_math.h — the arithmetic the CPU and CUDA passes share, written once, compiled by g++
// (cpu/*.cpp) and nvcc (cuda/passes.cuh): per-value formulas as templates over the value type
// V (SIMD vectors on the CPU, registers on CUDA), and the bias gradient's summation order.
// Shapes (M = rows of the flattened input, N = out_features):
//   acc     : (M, N) contiguous, holds z = a·Wᵀ + b (or t = tanh(z)); overwritten in place by g
//   grad_out: (M, N), any 2-D strides (sr, sc) — `out.mean()` gives strides (0, 0)
//   partial : (num_chunks(M), N) per-chunk column sums of g, in the accumulate type
// The order (independent of threads and device): docs/design.md, "Bias sums".
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define CKPT_HD __host__ __device__ __forceinline__
#else
#define CKPT_HD inline
#endif

namespace ckpt_ext {

// Rows summed together before a partial bias sum is written. Shared by CPU and CUDA so that both
// produce the same summation tree. 32 keeps the workspace at 1/32 of the activation.
constexpr int64_t kRowsPerChunk = 32;

CKPT_HD int64_t num_chunks(int64_t M) { return (M + kRowsPerChunk - 1) / kRowsPerChunk; }

// d/dz tanh(z) = 1 - tanh(z)^2, times the incoming gradient: g = grad_out · (1 − t²).
// V is a scalar or a SIMD vector type with the usual operators.
template <typename V>
CKPT_HD V tanh_grad_from_output(V grad_out, V t) {
  return grad_out * (V(1) - t * t);
}

// The second stage of every bias-gradient sum, for one column `col` of partial (num_chunks, N):
// the chunk sums combined pairwise, level by level, in place:
//   for w = 1, 2, 4, ... while w < num_chunks:
//     for every i that is a multiple of 2w with i + w < num_chunks:  partial[i] += partial[i + w]
// and the result is partial[0]. Pairwise rather than left to right: the rounding error grows with
// log2(M / 32) instead of M / 32, and the levels can run in parallel on a GPU (an aligned group of
// 2^k chunks is a complete subtree, so a block can reduce it alone and get the same bits).
template <typename acc_t>
CKPT_HD acc_t combine_chunks_pairwise(acc_t* partial, int64_t n_chunks, int64_t N, int64_t col) {
  if (n_chunks == 0) return acc_t(0);
  for (int64_t w = 1; w < n_chunks; w *= 2) {
    for (int64_t i = 0; i + w < n_chunks; i += 2 * w) {
      partial[i * N + col] += partial[(i + w) * N + col];
    }
  }
  return partial[col];
}

}  // namespace ckpt_ext
