// cpu/linear_tanh.cpp — the CPU primitives of the fused Linear+Tanh ops (declared in
// ../linear_tanh.h; the CUDA ones are in ../cuda/linear_tanh.cu; the ops that call them, with the
// GEMMs, in ../linear_tanh.cpp and ../tanh_mlp.cpp).
//
//   tanh_cpu_(acc)                                 acc (M, N) contiguous: z -> tanh(z) in place
//   tanh_backward_cpu_(acc, grad_out, holds, b)    acc (M, N): z or t -> g = grad_out·(1 − t²) in
//                                                  place; grad_out (M, N) any strides; -> grad_b (N)?
//   bias_grad_cpu(grad_out)                        grad_out (M, N) any strides -> column sums (N)
//
// Every element, tails included, goes through the one vectorised tanh (Vectorized<T>::tanh, with
// a partial load/store for the last < width columns), so the backward's recomputed t equals the
// forward's to the bit. Half types compute in float. The bias sums follow the documented order of
// ../linear_tanh_math.h: rows in increasing order per 32-row chunk (chunks in parallel), then the
// chunk sums pairwise per column (columns in parallel).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "../linear_tanh.h"
#include "../linear_tanh_math.h"

namespace ckpt_ext {
namespace {

template <typename scalar_t>
constexpr bool kVectorized = std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>;

template <typename T>
using Vec = at::vec::Vectorized<T>;

// n (1 <= n <= width) values at p through the vector tanh, in place.
template <typename scalar_t>
void tanh_span(scalar_t* p, int64_t n) {
  if constexpr (kVectorized<scalar_t>) {
    int64_t i = 0;
    for (; i + Vec<scalar_t>::size() <= n; i += Vec<scalar_t>::size()) {
      Vec<scalar_t>::loadu(p + i).tanh().store(p + i);
    }
    if (i < n) Vec<scalar_t>::loadu(p + i, n - i).tanh().store(p + i, n - i);
  } else {
    using acc_t = at::opmath_type<scalar_t>;
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<scalar_t>(std::tanh(static_cast<acc_t>(p[i])));
  }
}

// One row of the backward pass: row (n columns) holds z or t and becomes g; grad_row is the
// grad_out row, contiguous (gy_contig) or one value broadcast along the row (gy_bcast);
// sums (n, acc_t) accumulates g, or is nullptr.
template <typename scalar_t>
void backward_row(scalar_t* row, const scalar_t* grad_row, bool gy_bcast, int64_t n, Holds holds,
                  at::opmath_type<scalar_t>* sums) {
  using acc_t = at::opmath_type<scalar_t>;
  if constexpr (kVectorized<scalar_t>) {
    using V = Vec<scalar_t>;
    for (int64_t c = 0; c < n; c += V::size()) {
      const int64_t k = std::min<int64_t>(V::size(), n - c);
      const V gy = gy_bcast ? V(grad_row[0]) : V::loadu(grad_row + c, k);
      V t = V::loadu(row + c, k);
      if (holds == Holds::kPreActivation) t = t.tanh();
      const V g = tanh_grad_from_output(gy, t);
      g.store(row + c, k);
      if (sums != nullptr) (V::loadu(sums + c, k) + g).store(sums + c, k);
    }
  } else {
    for (int64_t c = 0; c < n; ++c) {
      acc_t t = static_cast<acc_t>(row[c]);
      if (holds == Holds::kPreActivation) t = std::tanh(t);
      const acc_t g = tanh_grad_from_output(static_cast<acc_t>(grad_row[gy_bcast ? 0 : c]), t);
      row[c] = static_cast<scalar_t>(g);
      if (sums != nullptr) sums[c] += g;
    }
  }
}

// partial (C, N) in acc_t -> out (N) in scalar_t, combining each column's chunks pairwise.
template <typename scalar_t>
void combine_partials(at::opmath_type<scalar_t>* partial, int64_t C, int64_t N, scalar_t* out) {
  at::parallel_for(0, N, 256, [&](int64_t c0, int64_t c1) {
    for (int64_t col = c0; col < c1; ++col) {
      out[col] = static_cast<scalar_t>(combine_chunks_pairwise(partial, C, N, col));
    }
  });
}

// The grad_out row r as a pointer the row kernels can read: the row itself when its columns are
// contiguous or broadcast (stride 0), else a copy in `scratch`.
template <typename scalar_t>
const scalar_t* grad_row_ptr(const scalar_t* gy, int64_t sr, int64_t sc, int64_t r, int64_t N,
                             std::vector<scalar_t>& scratch) {
  const scalar_t* p = gy + r * sr;
  if (sc == 0 || sc == 1) return p;
  scratch.resize(N);
  for (int64_t c = 0; c < N; ++c) scratch[c] = p[c * sc];
  return scratch.data();
}

}  // namespace

void tanh_cpu_(const at::Tensor& acc) {
  TORCH_INTERNAL_ASSERT(acc.is_contiguous());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, acc.scalar_type(), "tanh_cpu_", [&] {
    scalar_t* p = acc.data_ptr<scalar_t>();
    // 32k-element grains keep thread start-up small against the work. The tanh is elementwise,
    // so where a grain ends (a partial vector or not) does not change a value.
    at::parallel_for(0, acc.numel(), 32768, [&](int64_t i0, int64_t i1) {
      tanh_span(p + i0, i1 - i0);
    });
  });
}

at::Tensor tanh_backward_cpu_(const at::Tensor& acc, const at::Tensor& grad_out, Holds holds,
                              bool want_bias_grad) {
  TORCH_INTERNAL_ASSERT(acc.is_contiguous() && acc.dim() == 2 && grad_out.dim() == 2);
  const int64_t M = acc.size(0), N = acc.size(1), C = num_chunks(M);
  at::Tensor grad_b;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, acc.scalar_type(),
                                  "tanh_backward_cpu_", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    at::Tensor partial;
    if (want_bias_grad) {
      partial = at::zeros({C, N}, acc.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    }
    scalar_t* a = acc.data_ptr<scalar_t>();
    const scalar_t* gy = grad_out.const_data_ptr<scalar_t>();
    const int64_t sr = grad_out.stride(0), sc = grad_out.stride(1);
    acc_t* part = want_bias_grad ? partial.data_ptr<acc_t>() : nullptr;
    at::parallel_for(0, C, 1, [&](int64_t k0, int64_t k1) {
      std::vector<scalar_t> scratch;
      for (int64_t k = k0; k < k1; ++k) {
        const int64_t r_end = std::min(M, (k + 1) * kRowsPerChunk);
        for (int64_t r = k * kRowsPerChunk; r < r_end; ++r) {
          backward_row(a + r * N, grad_row_ptr(gy, sr, sc, r, N, scratch), sc == 0, N, holds,
                       part != nullptr ? part + k * N : nullptr);
        }
      }
    });
    if (want_bias_grad) {
      grad_b = new_buffer({N}, acc.options());
      combine_partials<scalar_t>(part, C, N, grad_b.data_ptr<scalar_t>());
    }
  });
  return grad_b;
}

at::Tensor bias_grad_cpu(const at::Tensor& grad_out) {
  TORCH_INTERNAL_ASSERT(grad_out.dim() == 2);
  const int64_t M = grad_out.size(0), N = grad_out.size(1), C = num_chunks(M);
  at::Tensor grad_b = new_buffer({N}, grad_out.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad_out.scalar_type(),
                                  "bias_grad_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    at::Tensor partial =
        at::zeros({C, N}, grad_out.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    acc_t* part = partial.data_ptr<acc_t>();
    const scalar_t* gy = grad_out.const_data_ptr<scalar_t>();
    const int64_t sr = grad_out.stride(0), sc = grad_out.stride(1);
    at::parallel_for(0, C, 1, [&](int64_t k0, int64_t k1) {
      for (int64_t k = k0; k < k1; ++k) {
        acc_t* sums = part + k * N;
        const int64_t r_end = std::min(M, (k + 1) * kRowsPerChunk);
        for (int64_t r = k * kRowsPerChunk; r < r_end; ++r) {
          for (int64_t c = 0; c < N; ++c) sums[c] += static_cast<acc_t>(gy[r * sr + c * sc]);
        }
      }
    });
    combine_partials<scalar_t>(part, C, N, grad_b.data_ptr<scalar_t>());
  });
  return grad_b;
}

}  // namespace ckpt_ext
