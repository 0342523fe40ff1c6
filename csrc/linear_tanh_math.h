// linear_tanh_math.h — the scalar math of the fused Linear+Tanh op, written once.
//
// Compiled by both g++ (csrc/linear_tanh.cpp) and nvcc (csrc/cuda/linear_tanh.cu): every
// elementwise or reduction body below is a function of an index, so the CPU loops and the CUDA
// launchers call the very same arithmetic; only the mapping of indices to threads differs.
//
// Shapes (M = rows of the flattened input, N = out_features):
//   acc  : (M, N) contiguous, holds z = x·Wᵀ + b as the GEMM left it; overwritten in place
//   gy   : (M, N) grad of the output, any 2-D strides (sr, sc) — `out.mean()` gives strides (0, 0)
//   partial : (ceil(M / kRowsPerChunk), N) per-chunk column sums of g, in the accumulate type
//
// Determinism: the bias gradient is summed in a fixed order that does not depend on the thread
// count or the device: rows in increasing order inside a chunk of kRowsPerChunk rows, then the
// chunks in increasing order. Two runs therefore give bitwise identical results.
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
// produce the same summation tree. 32 keeps the workspace at 1/32 of the output.
constexpr int64_t kRowsPerChunk = 32;

CKPT_HD float ckpt_tanh(float v) { return ::tanhf(v); }
CKPT_HD double ckpt_tanh(double v) { return ::tanh(v); }

// d/dz tanh(z) = 1 - tanh(z)^2, times the incoming gradient. V may be a scalar or a SIMD vector
// type with the usual operators (the CPU path passes at::vec::Vectorized<T>).
template <typename V>
CKPT_HD V tanh_grad_from_output(V gy, V t) {
  return gy * (V(1) - t * t);
}

// ---------------------------------------------------------------------------------------------
// Forward body for one value v = z[r, col]: tanh(v), computed in acc_t, rounded once. The CUDA
// kernel calls it on values held in registers (a 16-byte pack); tanh_at calls it in place.
template <typename scalar_t, typename acc_t>
CKPT_HD scalar_t tanh_value(scalar_t v) {
  return static_cast<scalar_t>(ckpt_tanh(static_cast<acc_t>(v)));
}

// Forward body: element i of the (M, N) buffer becomes tanh of itself.
template <typename scalar_t, typename acc_t>
CKPT_HD void tanh_at(scalar_t* acc, int64_t i) {
  acc[i] = tanh_value<scalar_t, acc_t>(acc[i]);
}

// ---------------------------------------------------------------------------------------------
// Backward body for one (row chunk, column): for each row r of the chunk, in increasing order,
//   g = gy[r, col] * (1 - tanh(z[r, col])^2);  acc[r, col] = g
// and the chunk's column sum of g is returned (the caller stores it in partial[chunk, col]).
// g is summed before it is rounded to scalar_t, so half types lose nothing in the bias grad.
template <typename scalar_t, typename acc_t>
CKPT_HD acc_t tanh_backward_chunk_column(scalar_t* acc, const scalar_t* gy, int64_t gy_sr,
                                         int64_t gy_sc, int64_t M, int64_t N, int64_t chunk,
                                         int64_t col) {
  const int64_t r_end = (chunk + 1) * kRowsPerChunk < M ? (chunk + 1) * kRowsPerChunk : M;
  acc_t sum = acc_t(0);
  for (int64_t r = chunk * kRowsPerChunk; r < r_end; ++r) {
    const acc_t z = static_cast<acc_t>(acc[r * N + col]);
    const acc_t g = tanh_grad_from_output(static_cast<acc_t>(gy[r * gy_sr + col * gy_sc]),
                                          ckpt_tanh(z));
    acc[r * N + col] = static_cast<scalar_t>(g);
    sum += g;
  }
  return sum;
}

// Final bias-gradient body for one column: the chunk partials summed in increasing chunk order.
template <typename acc_t>
CKPT_HD acc_t sum_partials_column(const acc_t* partial, int64_t num_chunks, int64_t N,
                                  int64_t col) {
  acc_t sum = acc_t(0);
  for (int64_t c = 0; c < num_chunks; ++c) sum += partial[c * N + col];
  return sum;
}

}  // namespace ckpt_ext
