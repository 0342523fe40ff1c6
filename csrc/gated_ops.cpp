// gated_ops.cpp — the kernels of gated_mlp and gated_mlp_backward (schemas in schemas.cpp): checks
// (checks.cpp), device guard, then the gated engine (gated.cpp), one function for CPU and CUDA;
// and their Meta kernels, the same function up to the checks, then fresh outputs (registration.h's
// Kernel).
//   gated_mlp(x (..., K), weights [gate (I, K), up (I, K), down (N, I)] or [gate_up (2I, K),
//             down (N, I)], biases, has_bias, activation) -> y (..., N)
// The backward recomputes and returns only the gradients asked for.
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "checks.h"
#include "gated.h"
#include "registration.h"
#include "stack.h"

namespace ckpt_ext {

namespace {

template <Kernel kernel>
at::Tensor gated_mlp(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                     const c10::List<bool>& has_bias_list, c10::string_view activation) {
  constexpr const char* op = "gated_mlp";
  const std::vector<bool> has_bias = has_bias_list.vec();
  check_gated_inputs(op, x, weights, biases, has_bias);
  const Activation act = parse_activation(op, activation);
  if constexpr (kernel == Kernel::kMeta) return empty_output(x, weights.back().sym_size(0));
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  return gated_forward(x, weights, biases, has_bias, act);
}

using GatedBackwardResult =
    std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>>;

template <Kernel kernel>
GatedBackwardResult gated_mlp_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                       at::TensorList weights, at::TensorList biases,
                                       const c10::List<bool>& has_bias_list,
                                       c10::string_view activation, bool need_x,
                                       const c10::List<bool>& need_weights_list,
                                       const c10::List<bool>& need_biases_list) {
  constexpr const char* op = "gated_mlp_backward";
  const std::vector<bool> has_bias = has_bias_list.vec(), need_weights = need_weights_list.vec(),
                          need_biases = need_biases_list.vec();
  check_gated_inputs(op, x, weights, biases, has_bias);
  check_stack_masks(op, weights, biases, need_weights, need_biases);
  check_grad_out(op, grad_out, x, weights.back().sym_size(0));
  const Activation act = parse_activation(op, activation);
  if constexpr (kernel == Kernel::kMeta) {
    return {need_x ? at::empty_symint(x.sym_sizes(), x.options()) : at::Tensor(),
            empty_asked(weights, need_weights, x.options(), true),
            empty_asked(biases, need_biases, x.options(), false)};
  }
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  GatedGrads g = gated_backward(grad_out, x, weights, biases, has_bias, need_x, need_weights,
                                need_biases, act);
  return {g.grad_x, asked(std::move(g.grad_weights), need_weights),
          asked(std::move(g.grad_biases), need_biases)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ckpt_ext, m) {
  register_kernels(m, "gated_mlp", &gated_mlp<Kernel::kCompute>, &gated_mlp<Kernel::kMeta>);
  register_kernels(m, "gated_mlp_backward", &gated_mlp_backward<Kernel::kCompute>,
                   &gated_mlp_backward<Kernel::kMeta>);
}

}  // namespace ckpt_ext
