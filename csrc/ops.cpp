// ops.cpp — the kernels of mlp and mlp_backward (schemas in schemas.cpp): checks (checks.cpp),
// device guard, then the stack engine (stack.cpp), one function for CPU and CUDA; and their Meta
// kernels, the same function up to the checks, then fresh outputs (registration.h's Kernel).
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
// mlp: the checks and the op's activations (`activation`: one name or one per activated layer,
// comma-separated; see parse_activations), then the engine, or the output's metadata.
template <Kernel kernel>
at::Tensor mlp(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
               const c10::List<bool>& has_bias_list, c10::string_view activation,
               bool last_activation) {
  constexpr const char* op = "mlp";
  const std::vector<bool> has_bias = has_bias_list.vec();
  check_stack_inputs(op, x, weights, biases, has_bias);
  const std::vector<Activation> acts =
      parse_activations(op, activation, weights.size(), last_activation);
  if constexpr (kernel == Kernel::kMeta) return empty_output(x, weights.back().sym_size(0));
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  return stack_forward(x, weights, biases, has_bias, last_activation, acts);
}

using StackBackwardResult =
    std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>>;

template <Kernel kernel>
StackBackwardResult mlp_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                 at::TensorList weights, at::TensorList biases,
                                 const c10::List<bool>& has_bias_list, c10::string_view activation,
                                 bool last_activation, bool need_x,
                                 const c10::List<bool>& need_weights_list,
                                 const c10::List<bool>& need_biases_list) {
  constexpr const char* op = "mlp_backward";
  const std::vector<bool> has_bias = has_bias_list.vec(), need_weights = need_weights_list.vec(),
                          need_biases = need_biases_list.vec();
  check_stack_inputs(op, x, weights, biases, has_bias);
  check_stack_masks(op, weights, biases, need_weights, need_biases);
  check_grad_out(op, grad_out, x, weights.back().sym_size(0));
  const std::vector<Activation> acts =
      parse_activations(op, activation, weights.size(), last_activation);
  if constexpr (kernel == Kernel::kMeta) {
    return {need_x ? at::empty_symint(x.sym_sizes(), x.options()) : at::Tensor(),
            empty_asked(weights, need_weights, x.options(), true),
            empty_asked(biases, need_biases, x.options(), false)};
  }
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  StackGrads g = stack_backward(grad_out, x, weights, biases, has_bias, last_activation, need_x,
                                need_weights, need_biases, acts);
  return {g.grad_x, asked(std::move(g.grad_weights), need_weights),
          asked(std::move(g.grad_biases), need_biases)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ckpt_ext, m) {
  register_kernels(m, "mlp", &mlp<Kernel::kCompute>, &mlp<Kernel::kMeta>);
  register_kernels(m, "mlp_backward", &mlp_backward<Kernel::kCompute>,
                   &mlp_backward<Kernel::kMeta>);
}

}  // namespace ckpt_ext
