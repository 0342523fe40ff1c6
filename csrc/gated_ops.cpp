// gated_ops.cpp — the kernels of gated_mlp and gated_mlp_backward (schemas in schemas.cpp): checks
// (checks.cpp), device guard, then the gated engine (gated.cpp), one function for CPU and CUDA;
// and their Meta kernels, the same checks then fresh outputs.
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

using GatedBackwardResult =
    std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>>;

// The backward's checks, shared by the eager and the Meta kernel.
void check_backward(const at::Tensor& grad_out, const at::Tensor& x, at::TensorList weights,
                    at::TensorList biases, const std::vector<bool>& has_bias,
                    const std::vector<bool>& need_weights, const std::vector<bool>& need_biases,
                    c10::string_view activation) {
  constexpr const char* op = "gated_mlp_backward";
  check_gated_inputs(op, x, weights, biases, has_bias);
  check_stack_masks(op, weights, biases, need_weights, need_biases);
  check_grad_out(op, grad_out, x, weights.back().sym_size(0));
  parse_activation(op, activation);
}

at::Tensor gated_mlp(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                     const c10::List<bool>& has_bias_list, c10::string_view activation) {
  const std::vector<bool> has_bias = has_bias_list.vec();
  check_gated_inputs("gated_mlp", x, weights, biases, has_bias);
  const Activation act = parse_activation("gated_mlp", activation);
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  return gated_forward(x, weights, biases, has_bias, act);
}

GatedBackwardResult gated_mlp_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                       at::TensorList weights, at::TensorList biases,
                                       const c10::List<bool>& has_bias_list,
                                       c10::string_view activation, bool need_x,
                                       const c10::List<bool>& need_weights_list,
                                       const c10::List<bool>& need_biases_list) {
  const std::vector<bool> has_bias = has_bias_list.vec(), need_weights = need_weights_list.vec(),
                          need_biases = need_biases_list.vec();
  check_backward(grad_out, x, weights, biases, has_bias, need_weights, need_biases, activation);
  const Activation act = parse_activation("gated_mlp_backward", activation);
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  GatedGrads g = gated_backward(grad_out, x, weights, biases, has_bias, need_x, need_weights,
                                need_biases, act);
  return {g.grad_x, asked(std::move(g.grad_weights), need_weights),
          asked(std::move(g.grad_biases), need_biases)};
}

// Meta kernels: the same checks, then the outputs' metadata as SymInts (dynamic shapes trace).
at::Tensor gated_mlp_meta(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                          const c10::List<bool>& has_bias, c10::string_view activation) {
  check_gated_inputs("gated_mlp", x, weights, biases, has_bias.vec());
  parse_activation("gated_mlp", activation);
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end() - 1);
  shape.push_back(weights.back().sym_size(0));
  return at::empty_symint(shape, x.options());
}

GatedBackwardResult gated_mlp_backward_meta(const at::Tensor& grad_out, const at::Tensor& x,
                                            at::TensorList weights, at::TensorList biases,
                                            const c10::List<bool>& has_bias,
                                            c10::string_view activation, bool need_x,
                                            const c10::List<bool>& need_weights_list,
                                            const c10::List<bool>& need_biases_list) {
  const std::vector<bool> need_weights = need_weights_list.vec(),
                          need_biases = need_biases_list.vec();
  check_backward(grad_out, x, weights, biases, has_bias.vec(), need_weights, need_biases,
                 activation);
  std::vector<at::Tensor> gw, gb;
  for (size_t i = 0; i < weights.size(); ++i) {
    if (need_weights[i]) gw.push_back(empty_weight_grad(weights[i], x.options()));
  }
  for (size_t j = 0; j < biases.size(); ++j) {
    if (need_biases[j]) gb.push_back(at::empty_symint(biases[j].sym_sizes(), x.options()));
  }
  return {need_x ? at::empty_symint(x.sym_sizes(), x.options()) : at::Tensor(), gw, gb};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ckpt_ext, m) {
  register_kernels(m, "gated_mlp", &gated_mlp, &gated_mlp_meta);
  register_kernels(m, "gated_mlp_backward", &gated_mlp_backward, &gated_mlp_backward_meta);
}

}  // namespace ckpt_ext
