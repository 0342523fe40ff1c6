// cuda/primitives.cu — the CUDA primitives of the fused ops (declared in ../primitives.h; the CPU
// ones are in ../cpu/primitives.cpp; the stack engine in ../stack.cpp): checks and the dtype
// dispatch to the passes of passes.h (kernels in passes.cuh, compiled per dtype).
//
//   tanh_cuda_(acc)                               acc (M, N) contiguous: z -> t = tanh(z) in place
//   tanh_backward_cuda_(acc, grad_out, holds, b)  acc (M, N) contiguous: z or t (holds) -> g =
//                                                 grad_out·(1 − t²) in place; grad_out (M, N), any
//                                                 strides; -> grad_b (N) = column sums of g, if b
//   bias_grad_cuda(grad_out)                      grad_out (M, N), any strides -> column sums (N)
//   activation_cuda(src, dst, act, k)             dst = f^(k)(src), f for k = 0, one pass (in place
//                                                 when dst is src)
//   activation_backward_cuda_                     tanh_backward_cuda_ for any activation, from z
//   activation_terms_cuda(p, act, terms, add, out) out = add + Σ f^(k)(p)·Π factors, one pass
//   gated_cuda(z, act), gated_backward_cuda_(z, gh, act)  the gated product and its gradients
#include <ATen/Dispatch.h>

#include "../primitives.h"
#include "passes.h"

namespace ckpt_ext {

namespace {

at::Tensor backward(const at::Tensor& acc, const at::Tensor& grad_out, BackwardPass pass,
                    Activation act, bool want_bias_grad) {
  at::Tensor grad_b;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad_out.scalar_type(),
                                  "activation_backward_cuda_", [&] {
    grad_b = backward_pass_cuda<scalar_t>(acc, grad_out, pass, act, want_bias_grad);
  });
  return grad_b;
}

}  // namespace

void activation_cuda(const at::Tensor& src, const at::Tensor& dst, Activation act, int order) {
  TORCH_INTERNAL_ASSERT(src.is_cuda() && dst.is_cuda() && src.is_contiguous() &&
                        dst.is_contiguous() && src.numel() == dst.numel() &&
                        src.scalar_type() == dst.scalar_type());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dst.scalar_type(), "activation_cuda",
                                  [&] { activation_pass_cuda<scalar_t>(src, dst, act, order); });
}

void activation_terms_cuda(const at::Tensor& p, Activation act,
                           const std::vector<TermTensors>& terms, const at::Tensor& add,
                           const at::Tensor& out) {
  TORCH_INTERNAL_ASSERT(p.is_cuda() && out.is_cuda() && p.is_contiguous() && out.is_contiguous());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(),
                                  "activation_terms_cuda", [&] {
    terms_pass_cuda<scalar_t>(p, out, act, terms_of<scalar_t>(terms, add));
  });
}

void tanh_cuda_(const at::Tensor& acc) { activation_cuda(acc, acc, Activation::kTanh); }

at::Tensor activation_backward_cuda_(const at::Tensor& acc, const at::Tensor& grad_out,
                                     Activation act, bool want_bias_grad) {
  TORCH_INTERNAL_ASSERT(acc.is_cuda() && acc.is_contiguous() && acc.dim() == 2 &&
                        grad_out.sizes() == acc.sizes());
  return backward(acc, grad_out, BackwardPass::kFromPreActivation, act, want_bias_grad);
}

at::Tensor tanh_backward_cuda_(const at::Tensor& acc, const at::Tensor& grad_out, Holds holds,
                               bool want_bias_grad) {
  TORCH_INTERNAL_ASSERT(acc.is_cuda() && acc.is_contiguous() && acc.dim() == 2 &&
                        grad_out.sizes() == acc.sizes());
  return backward(acc, grad_out,
                  holds == Holds::kPreActivation ? BackwardPass::kFromPreActivation
                                                 : BackwardPass::kFromTanhOutput,
                  Activation::kTanh, want_bias_grad);
}

at::Tensor bias_grad_cuda(const at::Tensor& grad_out) {
  TORCH_INTERNAL_ASSERT(grad_out.is_cuda() && grad_out.dim() == 2);
  return backward(at::Tensor(), grad_out, BackwardPass::kSumOnly, Activation::kTanh, true);
}

namespace {

void gated(const at::Tensor& z, const at::Tensor& gh, Activation act) {
  TORCH_INTERNAL_ASSERT(z.is_cuda() && z.is_contiguous() && z.dim() == 2 && z.size(1) % 2 == 0);
  if (gh.defined()) {
    TORCH_INTERNAL_ASSERT(gh.is_cuda() && gh.is_contiguous() && gh.size(0) == z.size(0) &&
                          gh.size(1) == z.size(1) / 2 && gh.scalar_type() == z.scalar_type());
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, z.scalar_type(), "gated_cuda",
                                  [&] { gated_pass_cuda<scalar_t>(z, gh, act); });
}

}  // namespace

void gated_cuda(const at::Tensor& z, Activation act) { gated(z, at::Tensor(), act); }

void gated_backward_cuda_(const at::Tensor& z, const at::Tensor& gh, Activation act) {
  TORCH_INTERNAL_ASSERT(gh.defined());
  gated(z, gh, act);
}

}  // namespace ckpt_ext
