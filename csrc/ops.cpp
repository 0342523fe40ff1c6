// ops.cpp — the kernels of mlp and mlp_backward (schemas in schemas.cpp): checks (checks.cpp),
// device guard, then the stack engine (stack.cpp), one function for CPU and CUDA; and their Meta
// kernels, the same checks then fresh outputs.
//   mlp(x (..., K_0), weights[i] (N_i, K_i), biases, has_bias, activation, last_activation)
//       -> y (..., N_{L-1}): the stack, with one activation or one per layer
// Each backward recomputes the activations and returns only the gradients asked for.
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "checks.h"
#include "registration.h"
#include "stack.h"

namespace ckpt_ext {

namespace {

// The registered kernels take bool[] as c10::List<bool> (what the dispatcher passes); the engine
// and the checks read std::vector<bool>.
// mlp: the checks, then the engine, with the op's activations (`spec`: one name or
// one per activated layer, comma-separated; see parse_activations).
at::Tensor run_forward(const char* op, const at::Tensor& x, at::TensorList weights,
                       at::TensorList biases, const c10::List<bool>& has_bias_list, bool last,
                       c10::string_view spec) {
  const std::vector<bool> has_bias = has_bias_list.vec();
  check_stack_inputs(op, x, weights, biases, has_bias);
  const std::vector<Activation> acts = parse_activations(op, spec, weights.size(), last);
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  return stack_forward(x, weights, biases, has_bias, last, acts);
}

using StackBackwardResult =
    std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>>;

StackBackwardResult run_backward(const char* op, const at::Tensor& grad_out, const at::Tensor& x,
                                 at::TensorList weights, at::TensorList biases,
                                 const c10::List<bool>& has_bias_list, bool last, bool need_x,
                                 const c10::List<bool>& need_weights_list,
                                 const c10::List<bool>& need_biases_list, c10::string_view spec) {
  const std::vector<bool> has_bias = has_bias_list.vec(), need_weights = need_weights_list.vec(),
                          need_biases = need_biases_list.vec();
  check_stack_inputs(op, x, weights, biases, has_bias);
  check_stack_masks(op, weights, biases, need_weights, need_biases);
  check_grad_out(op, grad_out, x, weights.back().sym_size(0));
  const std::vector<Activation> acts = parse_activations(op, spec, weights.size(), last);
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  StackGrads g = stack_backward(grad_out, x, weights, biases, has_bias, last, need_x,
                                need_weights, need_biases, acts);
  return {g.grad_x, asked(std::move(g.grad_weights), need_weights),
          asked(std::move(g.grad_biases), need_biases)};
}

// Meta kernels: what FakeTensor and torch.compile run. The same checks as the eager ops, then the
// output metadata (fresh contiguous tensors), read as SymInts so dynamic shapes trace.
at::Tensor stack_meta(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                      const c10::List<bool>& has_bias) {
  check_stack_inputs("mlp", x, weights, biases, has_bias.vec());
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end() - 1);
  shape.push_back(weights.back().sym_size(0));
  return at::empty_symint(shape, x.options());
}

std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> stack_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& x, at::TensorList weights,
    at::TensorList biases, const c10::List<bool>& has_bias, bool need_x,
    const c10::List<bool>& need_weights_list, const c10::List<bool>& need_biases_list) {
  constexpr const char* op = "mlp_backward";
  const std::vector<bool> need_weights = need_weights_list.vec(),
                          need_biases = need_biases_list.vec();
  check_stack_inputs(op, x, weights, biases, has_bias.vec());
  check_stack_masks(op, weights, biases, need_weights, need_biases);
  check_grad_out(op, grad_out, x, weights.back().sym_size(0));
  std::vector<at::Tensor> gw, gb;
  for (size_t i = 0; i < weights.size(); ++i) {
    if (need_weights[i]) gw.push_back(empty_weight_grad(weights[i], x.options()));
  }
  for (size_t j = 0; j < biases.size(); ++j) {
    if (need_biases[j]) gb.push_back(at::empty_symint(biases[j].sym_sizes(), x.options()));
  }
  return {need_x ? at::empty_symint(x.sym_sizes(), x.options()) : at::Tensor(), gw, gb};
}

// mlp and mlp_backward, with the activation named (checked before anything runs).
at::Tensor mlp(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
               const c10::List<bool>& has_bias, c10::string_view activation,
               bool last_activation) {
  return run_forward("mlp", x, weights, biases, has_bias, last_activation, activation);
}

StackBackwardResult mlp_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                 at::TensorList weights, at::TensorList biases,
                                 const c10::List<bool>& has_bias, c10::string_view activation,
                                 bool last_activation, bool need_x,
                                 const c10::List<bool>& need_weights,
                                 const c10::List<bool>& need_biases) {
  return run_backward("mlp_backward", grad_out, x, weights, biases, has_bias, last_activation,
                      need_x, need_weights, need_biases, activation);
}

at::Tensor mlp_meta(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                    const c10::List<bool>& has_bias, c10::string_view activation,
                    bool last_activation) {
  at::Tensor out = stack_meta(x, weights, biases, has_bias);
  parse_activations("mlp", activation, weights.size(), last_activation);
  return out;
}

StackBackwardResult mlp_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& x, at::TensorList weights,
    at::TensorList biases, const c10::List<bool>& has_bias, c10::string_view activation,
    bool last_activation, bool need_x, const c10::List<bool>& need_weights,
    const c10::List<bool>& need_biases) {
  StackBackwardResult out = stack_backward_meta(grad_out, x, weights, biases, has_bias, need_x,
                                                need_weights, need_biases);
  parse_activations("mlp_backward", activation, weights.size(), last_activation);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ckpt_ext, m) {
  register_kernels(m, "mlp", &mlp, &mlp_meta);
  register_kernels(m, "mlp_backward", &mlp_backward, &mlp_backward_meta);
}

}  // namespace ckpt_ext
