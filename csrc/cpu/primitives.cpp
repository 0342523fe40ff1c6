// cpu/primitives.cpp — the CPU primitives of the fused ops (declared in
// ../primitives.h; the CUDA ones are in ../cuda/primitives.cu; the stack engine that calls them,
// with the GEMMs, in ../stack.cpp).
//
//   tanh_cpu_(acc)                                 acc (M, N) contiguous: z -> tanh(z) in place
//   tanh_backward_cpu_(acc, grad_out, holds, b)    acc (M, N): z or t -> g = grad_out·(1 − t²) in
//                                                  place; grad_out (M, N) any strides; -> grad_b (N)?
//   bias_grad_cpu(grad_out)                        grad_out (M, N) any strides -> column sums (N)
//   activation_cpu(src, dst, act, k)               dst = f^(k)(src), f for k = 0 (in place when
//                                                  dst is src)
//   activation_backward_cpu_                       tanh_backward_cpu_ for any activation
//   activation_terms_cpu(p, act, terms, add, out)  out = add + Σ f^(k)(p)·Π factors, one pass
//   gated_cpu(z, act), gated_backward_cpu_(z, gh, act)  the gated product and its gradients
// Built portably: threads and bias partial sums here, element arithmetic in cpu/kernels.cpp.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>

#include "../primitives.h"
#include "../device_math.h"
#include "kernels.h"

namespace ckpt_ext {
namespace {

// partial (C, N) in acc_t -> out (N) in scalar_t, combining each column's chunks pairwise.
template <typename scalar_t>
void combine_partials(at::opmath_type<scalar_t>* partial, int64_t C, int64_t N, scalar_t* out) {
  at::parallel_for(0, N, 256, [&](int64_t c0, int64_t c1) {
    for (int64_t col = c0; col < c1; ++col) {
      out[col] = static_cast<scalar_t>(combine_chunks_pairwise(partial, C, N, col));
    }
  });
}

template <typename scalar_t>
at::Tensor new_partials(const at::Tensor& like, int64_t C, int64_t N) {
  using acc_t = at::opmath_type<scalar_t>;
  static_assert(std::is_same_v<acc_t, cpu::acc_type_t<scalar_t>>);
  return at::zeros({C, N}, like.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
}

}  // namespace

void tanh_cpu_(const at::Tensor& acc) {
  TORCH_INTERNAL_ASSERT(acc.is_contiguous());
  const cpu::Kernels& kern = cpu::kernels();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, acc.scalar_type(), "tanh_cpu_", [&] {
    scalar_t* p = acc.data_ptr<scalar_t>();
    const auto tanh = kern.of<scalar_t>().tanh;
    // 32k-element grains keep thread start-up small against the work. The tanh is elementwise,
    // so where a grain ends (a partial vector or not) does not change a value.
    at::parallel_for(0, acc.numel(), 32768, [&](int64_t i0, int64_t i1) { tanh(p + i0, i1 - i0); });
  });
}

namespace {

// The backward pass over acc's rows, chunk by chunk in parallel: rows(a, gy, sr, sc, r0, r1, N,
// sums) turns acc's rows r0..r1-1 into g and adds them to sums (null: no bias gradient).
template <typename scalar_t, typename Rows>
at::Tensor backward_pass(const at::Tensor& acc, const at::Tensor& grad_out, bool want_bias_grad,
                         const Rows& rows) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t M = acc.size(0), N = acc.size(1), C = num_chunks(M);
  at::Tensor partial;
  if (want_bias_grad) partial = new_partials<scalar_t>(acc, C, N);
  scalar_t* a = acc.data_ptr<scalar_t>();
  const scalar_t* gy = grad_out.const_data_ptr<scalar_t>();
  const int64_t sr = grad_out.stride(0), sc = grad_out.stride(1);
  acc_t* part = want_bias_grad ? partial.data_ptr<acc_t>() : nullptr;
  at::parallel_for(0, C, 1, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      rows(a, gy, sr, sc, k * kRowsPerChunk, std::min(M, (k + 1) * kRowsPerChunk), N,
           part != nullptr ? part + k * N : nullptr);
    }
  });
  at::Tensor grad_b;
  if (want_bias_grad) {
    grad_b = new_buffer({N}, acc.options());
    combine_partials<scalar_t>(part, C, N, grad_b.data_ptr<scalar_t>());
  }
  return grad_b;
}

}  // namespace

at::Tensor tanh_backward_cpu_(const at::Tensor& acc, const at::Tensor& grad_out, Holds holds,
                              bool want_bias_grad) {
  TORCH_INTERNAL_ASSERT(acc.is_contiguous() && acc.dim() == 2 && grad_out.dim() == 2);
  const cpu::Kernels& kern = cpu::kernels();
  const bool pre = holds == Holds::kPreActivation;
  return AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, acc.scalar_type(),
                                         "tanh_backward_cpu_", [&] {
    const auto rows = kern.of<scalar_t>().backward_rows;
    return backward_pass<scalar_t>(acc, grad_out, want_bias_grad,
                                   [&](auto a, auto gy, auto sr, auto sc, auto r0, auto r1, auto N,
                                       auto sums) { rows(a, gy, sr, sc, r0, r1, N, pre, sums); });
  });
}

void activation_cpu(const at::Tensor& src, const at::Tensor& dst, Activation act, int order) {
  TORCH_INTERNAL_ASSERT(src.is_contiguous() && dst.is_contiguous() &&
                        src.numel() == dst.numel() && src.scalar_type() == dst.scalar_type());
  const cpu::Kernels& kern = cpu::kernels();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dst.scalar_type(), "activation_cpu",
                                  [&] {
    const scalar_t* s = src.const_data_ptr<scalar_t>();
    scalar_t* d = dst.data_ptr<scalar_t>();
    const auto activate = kern.of<scalar_t>().activate;
    // Elementwise, as tanh_cpu_: where a grain ends does not change a value.
    at::parallel_for(0, dst.numel(), 32768,
                     [&](int64_t i0, int64_t i1) {
                       activate(s + i0, d + i0, i1 - i0, act, order);
                     });
  });
}

void activation_terms_cpu(const at::Tensor& p, Activation act,
                          const std::vector<TermTensors>& terms, const at::Tensor& add,
                          const at::Tensor& out) {
  const cpu::Kernels& kern = cpu::kernels();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(),
                                  "activation_terms_cpu", [&] {
    const ActivationTerms<scalar_t> t = terms_of<scalar_t>(terms, add);
    const scalar_t* src = p.const_data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    const auto run = kern.of<scalar_t>().terms;
    // Elementwise: where a grain ends does not change a value.
    at::parallel_for(0, out.numel(), 16384, [&](int64_t i0, int64_t i1) {
      run(src, dst, i0, i1, act, t);
    });
  });
}

at::Tensor activation_backward_cpu_(const at::Tensor& acc, const at::Tensor& grad_out,
                                    Activation act, bool want_bias_grad) {
  TORCH_INTERNAL_ASSERT(acc.is_contiguous() && acc.dim() == 2 && grad_out.dim() == 2);
  const cpu::Kernels& kern = cpu::kernels();
  return AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, acc.scalar_type(),
                                         "activation_backward_cpu_", [&] {
    const auto rows = kern.of<scalar_t>().activation_backward_rows;
    return backward_pass<scalar_t>(acc, grad_out, want_bias_grad,
                                   [&](auto a, auto gy, auto sr, auto sc, auto r0, auto r1, auto N,
                                       auto sums) { rows(a, gy, sr, sc, r0, r1, N, act, sums); });
  });
}

namespace {

// The gated pass over z's rows in parallel, grains of about 32k elements of h (elementwise: where
// a grain ends does not change a value).
void gated_pass_cpu(const at::Tensor& z, const at::Tensor& gh, Activation act) {
  TORCH_INTERNAL_ASSERT(z.is_contiguous() && z.dim() == 2 && z.size(1) % 2 == 0);
  const int64_t M = z.size(0), I = z.size(1) / 2;
  if (M == 0 || I == 0) return;
  if (gh.defined()) {
    TORCH_INTERNAL_ASSERT(gh.is_contiguous() && gh.size(0) == M && gh.size(1) == I &&
                          gh.scalar_type() == z.scalar_type());
  }
  const cpu::Kernels& kern = cpu::kernels();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, z.scalar_type(), "gated_cpu", [&] {
    scalar_t* zp = z.data_ptr<scalar_t>();
    scalar_t* ghp = gh.defined() ? gh.data_ptr<scalar_t>() : nullptr;
    const auto rows = kern.of<scalar_t>().gated_rows;
    const int64_t grain = std::max<int64_t>(1, 32768 / I);
    at::parallel_for(0, M, grain, [&](int64_t r0, int64_t r1) { rows(zp, ghp, r0, r1, I, act); });
  });
}

}  // namespace

void gated_cpu(const at::Tensor& z, Activation act) { gated_pass_cpu(z, at::Tensor(), act); }

void gated_backward_cpu_(const at::Tensor& z, const at::Tensor& gh, Activation act) {
  TORCH_INTERNAL_ASSERT(gh.defined());
  gated_pass_cpu(z, gh, act);
}

at::Tensor bias_grad_cpu(const at::Tensor& grad_out) {
  TORCH_INTERNAL_ASSERT(grad_out.dim() == 2);
  const int64_t M = grad_out.size(0), N = grad_out.size(1), C = num_chunks(M);
  const cpu::Kernels& kern = cpu::kernels();
  at::Tensor grad_b = new_buffer({N}, grad_out.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad_out.scalar_type(),
                                  "bias_grad_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    at::Tensor partial = new_partials<scalar_t>(grad_out, C, N);
    acc_t* part = partial.data_ptr<acc_t>();
    const scalar_t* gy = grad_out.const_data_ptr<scalar_t>();
    const int64_t sr = grad_out.stride(0), sc = grad_out.stride(1);
    const auto sums = kern.of<scalar_t>().column_sums;
    at::parallel_for(0, C, 1, [&](int64_t k0, int64_t k1) {
      for (int64_t k = k0; k < k1; ++k) {
        sums(gy, sr, sc, k * kRowsPerChunk, std::min(M, (k + 1) * kRowsPerChunk), N,
             part + k * N);
      }
    });
    combine_partials<scalar_t>(part, C, N, grad_b.data_ptr<scalar_t>());
  });
  return grad_b;
}

}  // namespace ckpt_ext
