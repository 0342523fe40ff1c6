// cuda/test_kernels.cu — test-only: the CUDA primitives themselves as torch.ops.ckpt_ext_kernels.*
// (tanh_, tanh_backward_, bias_grad; activation_, activation_backward_ for every activation), for
// the tests and the bandwidth microbenchmark. The ops of ckpt_ext always hand the primitives fresh,
// aligned buffers; these take any acc the checks below allow, so a test can reach every path.
// acc, src, dst: (M, N) contiguous; grad_out: (M, N), any strides.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../checks.h"
#include "../primitives.h"

namespace ckpt_ext {

namespace {

void check_kernel_args(const char* op, const at::Tensor& acc, const at::Tensor* grad_out) {
  TORCH_CHECK_VALUE(acc.is_cuda() && acc.dim() == 2 && acc.is_contiguous(), "ckpt_ext_kernels.",
                    op, ": acc must be a 2-D contiguous CUDA tensor, got ", acc.dim(),
                    "-D on ", acc.device(), (acc.is_contiguous() ? "" : ", not contiguous"));
  TORCH_CHECK_TYPE(is_supported_dtype(acc.scalar_type()), "ckpt_ext_kernels.", op,
                   ": acc must be ", supported_dtypes_text(), ", got ", acc.scalar_type());
  if (grad_out != nullptr) {
    TORCH_CHECK_VALUE(grad_out->sizes() == acc.sizes() && grad_out->device() == acc.device(),
                      "ckpt_ext_kernels.", op, ": grad_out must have acc's shape ", acc.sizes(),
                      " and device ", acc.device(), ", got ", grad_out->sizes(), " on ",
                      grad_out->device());
    TORCH_CHECK_TYPE(grad_out->scalar_type() == acc.scalar_type(), "ckpt_ext_kernels.", op,
                     ": grad_out must have acc's dtype ", acc.scalar_type(), ", got ",
                     grad_out->scalar_type());
    // The kernel reads grad_out through a __restrict__ pointer while it writes acc.
    TORCH_CHECK_VALUE(!grad_out->is_alias_of(acc), "ckpt_ext_kernels.", op,
                      ": grad_out must not share acc's storage");
  }
}

void kernels_tanh_(const at::Tensor& acc) {
  check_kernel_args("tanh_", acc, nullptr);
  const c10::cuda::CUDAGuard guard(acc.device());
  tanh_cuda_(acc);
}

at::Tensor kernels_tanh_backward_(const at::Tensor& acc, const at::Tensor& grad_out,
                                  bool holds_pre_activation, bool want_bias_grad) {
  check_kernel_args("tanh_backward_", acc, &grad_out);
  const c10::cuda::CUDAGuard guard(acc.device());
  return tanh_backward_cuda_(acc, grad_out,
                             holds_pre_activation ? Holds::kPreActivation : Holds::kTanhOutput,
                             want_bias_grad);
}

void kernels_activation_(const at::Tensor& src, const at::Tensor& dst, c10::string_view name) {
  const Activation act = parse_activation("ckpt_ext_kernels.activation_", name);
  check_kernel_args("activation_", dst, nullptr);
  TORCH_CHECK_VALUE(src.sizes() == dst.sizes() && src.device() == dst.device() &&
                    src.is_contiguous(), "ckpt_ext_kernels.activation_: src must be contiguous "
                    "with dst's shape ", dst.sizes(), " and device ", dst.device(), ", got ",
                    src.sizes(), " on ", src.device(),
                    (src.is_contiguous() ? "" : ", not contiguous"));
  TORCH_CHECK_TYPE(src.scalar_type() == dst.scalar_type(), "ckpt_ext_kernels.activation_: src "
                   "must have dst's dtype ", dst.scalar_type(), ", got ", src.scalar_type());
  // In place (the same elements) or apart: the kernel reads each element before writing it only
  // where src and dst are the same element.
  TORCH_CHECK_VALUE(src.data_ptr() == dst.data_ptr() || !src.is_alias_of(dst),
                    "ckpt_ext_kernels.activation_: src must be dst or not share its storage");
  const c10::cuda::CUDAGuard guard(dst.device());
  activation_cuda(src, dst, act);
}

at::Tensor kernels_activation_backward_(const at::Tensor& acc, const at::Tensor& grad_out,
                                        c10::string_view name, bool want_bias_grad) {
  const Activation act = parse_activation("ckpt_ext_kernels.activation_backward_", name);
  check_kernel_args("activation_backward_", acc, &grad_out);
  const c10::cuda::CUDAGuard guard(acc.device());
  return activation_backward_cuda_(acc, grad_out, act, want_bias_grad);
}

at::Tensor kernels_bias_grad(const at::Tensor& grad_out) {
  TORCH_CHECK_VALUE(grad_out.is_cuda() && grad_out.dim() == 2, "ckpt_ext_kernels.bias_grad: "
                    "grad_out must be a 2-D CUDA tensor, got ", grad_out.dim(), "-D on ",
                    grad_out.device());
  TORCH_CHECK_TYPE(is_supported_dtype(grad_out.scalar_type()), "ckpt_ext_kernels.bias_grad: "
                   "grad_out must be ", supported_dtypes_text(), ", got ", grad_out.scalar_type());
  const c10::cuda::CUDAGuard guard(grad_out.device());
  return bias_grad_cuda(grad_out);
}

}  // namespace

TORCH_LIBRARY(ckpt_ext_kernels, m) {
  // acc: (M, N) contiguous; z -> tanh(z) in place.
  m.def("tanh_(Tensor(a!) acc) -> ()");
  // acc holds z (holds_pre_activation) or t and becomes g = grad_out·(1 − t²); returns the column
  // sums of g in the documented order when want_bias_grad, else None.
  m.def("tanh_backward_(Tensor(a!) acc, Tensor grad_out, bool holds_pre_activation, "
        "bool want_bias_grad) -> Tensor");
  // The column sums of grad_out (M, N) in the documented order.
  m.def("bias_grad(Tensor grad_out) -> Tensor");
  // dst = f(src) for an activation of ckpt_ext.ACTIVATIONS; dst may be src (in place).
  m.def("activation_(Tensor src, Tensor(a!) dst, str activation) -> ()");
  // acc holds z and becomes g = grad_out·f'(z); returns the column sums of g in the documented
  // order when want_bias_grad, else None.
  m.def("activation_backward_(Tensor(a!) acc, Tensor grad_out, str activation, "
        "bool want_bias_grad) -> Tensor");
}

TORCH_LIBRARY_IMPL(ckpt_ext_kernels, CUDA, m) {
  m.impl("tanh_", &kernels_tanh_);
  m.impl("tanh_backward_", &kernels_tanh_backward_);
  m.impl("bias_grad", &kernels_bias_grad);
  m.impl("activation_", &kernels_activation_);
  m.impl("activation_backward_", &kernels_activation_backward_);
}

}  // namespace ckpt_ext
