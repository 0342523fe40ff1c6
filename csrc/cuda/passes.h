// cuda/passes.h — the CUDA passes that the entry points (primitives.cu) call, one function per
// job, templates over the storage type. Bodies in passes.cuh, instantiated once per dtype in
// passes_<dtype>.cu so that nvcc compiles the dtypes in parallel. Shapes (M rows, N columns):
//   activation_pass_cuda<T>(src, dst, act, k)  src, dst (M, N) contiguous: dst = f^(k)(src), f
//                                            for k = 0; dst may be src (in place)
//   terms_pass_cuda<T>(p, out, act, t)      p, out and t's tensors (numel) contiguous: out = t.add +
//                                            Σ_j f^(k_j)(p)·Π F_j (activation_terms.h)
//   backward_pass_cuda<T>(acc, grad_out, pass, act, want_bias_grad)
//                                            acc (M, N) contiguous (undefined for kSumOnly) -> g in
//                                            place; grad_out (M, N) any strides; -> grad_b (N) or
//                                            undefined
//   gated_pass_cuda<T>(z, gh, act)          z (M, 2I) contiguous, [g | u] per row: h = f(g)·u into
//                                            z[:, :I] (gh undefined), or with gh (M, I)
//                                            contiguous (the gradient w.r.t. h) z = [gh·u·f'(g) |
//                                            gh·f(g)] and gh = h, in one pass
#pragma once

#include <ATen/ATen.h>

#include "../activation_terms.h"
#include "../activations.h"

namespace ckpt_ext {

// What the backward pass reads from acc and writes back.
enum class BackwardPass {
  kFromPreActivation,  // acc holds z: f'(z) (tanh: t = tanh(z) first), then acc = g
  kFromTanhOutput,     // acc holds t = tanh(z): acc = g = grad_out·(1 − t²)
  kSumOnly,            // no acc: only the column sums of grad_out (bias_grad_cuda)
};

template <typename scalar_t>
void activation_pass_cuda(const at::Tensor& src, const at::Tensor& dst, Activation act,
                          int order);

template <typename scalar_t>
void terms_pass_cuda(const at::Tensor& p, const at::Tensor& out, Activation act,
                     const ActivationTerms<scalar_t>& t);

template <typename scalar_t>
at::Tensor backward_pass_cuda(const at::Tensor& acc, const at::Tensor& grad_out, BackwardPass pass,
                              Activation act, bool want_bias_grad);

template <typename scalar_t>
void gated_pass_cuda(const at::Tensor& z, const at::Tensor& gh, Activation act);

}  // namespace ckpt_ext
