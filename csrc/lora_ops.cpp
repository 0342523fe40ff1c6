// lora_ops.cpp — the kernels of lora_mlp, lora_gated_mlp and their backward ops (schemas in
// schemas.cpp): the mlp and gated_mlp ops with a LoRA term on any of their weights (lora.h).
// Checks (checks.cpp), device guard, then the stack or gated engine with the terms, one function
// for CPU and CUDA; and their Meta kernels, the same function up to the checks, then fresh
// outputs (registration.h's Kernel). Past the schema the LoRA lists travel as one LoraArgs, the
// backward's masks as one LoraBackwardMasks (schemas.h's lora_*_kernel).
//   lora_mlp(x (..., K_0), weights, biases, has_bias, activation, last_activation, lora_A[j]
//            (r_j, K_i), lora_B[j] (N_i, r_j), lora_biases, has_lora, has_lora_bias,
//            lora_scaling) -> y (..., N_{L-1})
//   lora_gated_mlp(x (..., K), weights [gate, up, down] or [gate_up, down], biases, has_bias,
//                  activation, the same LoRA lists) -> y (..., N)
// Each backward recomputes and returns only the gradients asked for.
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "checks.h"
#include "gated.h"
#include "lora.h"
#include "registration.h"
#include "schemas.h"
#include "stack.h"

namespace ckpt_ext {

namespace {

void check_stack(const char* op, const at::Tensor& x, at::TensorList weights,
                 at::TensorList biases, const std::vector<bool>& has_bias, const LoraArgs& lora) {
  check_stack_inputs(op, x, weights, biases, has_bias);
  check_lora_stack_inputs(op, x, weights, lora);
}

void check_gated(const char* op, const at::Tensor& x, at::TensorList weights,
                 at::TensorList biases, const std::vector<bool>& has_bias, const LoraArgs& lora) {
  check_gated_inputs(op, x, weights, biases, has_bias);
  check_lora_gated_inputs(op, x, weights, lora);
}

// The backward's masks and grad_out, after the forward's checks.
void check_backward_rest(const char* op, const at::Tensor& grad_out, const at::Tensor& x,
                         at::TensorList weights, at::TensorList biases, const LoraArgs& lora,
                         const LoraBackwardMasks& masks) {
  check_stack_masks(op, weights, biases, masks.weights, masks.biases);
  check_lora_masks(op, lora, masks);
  check_grad_out(op, grad_out, x, weights.back().sym_size(0));
}

// The engine's gradients, only those asked for (the schema's compact result lists).
template <typename Grads>
LoraBackwardResult results(Grads&& g, const LoraBackwardMasks& masks) {
  return {g.grad_x,
          asked(std::move(g.grad_weights), masks.weights),
          asked(std::move(g.grad_biases), masks.biases),
          asked(std::move(g.lora.A), masks.A),
          asked(std::move(g.lora.B), masks.B),
          asked(std::move(g.lora.biases), masks.lora_biases)};
}

// The Meta kernel's: fresh tensors of those gradients' metadata.
LoraBackwardResult empty_results(const at::Tensor& x, at::TensorList weights,
                                 at::TensorList biases, const LoraArgs& lora,
                                 const LoraBackwardMasks& masks) {
  const at::TensorOptions options = x.options();
  return {masks.x ? at::empty_symint(x.sym_sizes(), options) : at::Tensor(),
          empty_asked(weights, masks.weights, options, true),
          empty_asked(biases, masks.biases, options, false),
          empty_asked(lora.A, masks.A, options, true),
          empty_asked(lora.B, masks.B, options, true),
          empty_asked(lora.biases, masks.lora_biases, options, false)};
}

// ---- lora_mlp -----------------------------------------------------------------------------------

template <Kernel kernel>
at::Tensor lora_mlp(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                    const c10::List<bool>& has_bias_list, c10::string_view activation,
                    bool last_activation, const LoraArgs& lora) {
  constexpr const char* op = "lora_mlp";
  const std::vector<bool> has_bias = has_bias_list.vec();
  check_stack(op, x, weights, biases, has_bias, lora);
  const auto acts = parse_activations(op, activation, weights.size(), last_activation);
  if constexpr (kernel == Kernel::kMeta) return empty_output(x, weights.back().sym_size(0));
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  return stack_forward(x, weights, biases, has_bias, last_activation, acts, lora_layers(lora));
}

template <Kernel kernel>
LoraBackwardResult lora_mlp_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                     at::TensorList weights, at::TensorList biases,
                                     const c10::List<bool>& has_bias_list,
                                     c10::string_view activation, bool last_activation,
                                     const LoraArgs& lora, const LoraBackwardMasks& masks) {
  constexpr const char* op = "lora_mlp_backward";
  const std::vector<bool> has_bias = has_bias_list.vec();
  check_stack(op, x, weights, biases, has_bias, lora);
  check_backward_rest(op, grad_out, x, weights, biases, lora, masks);
  const auto acts = parse_activations(op, activation, weights.size(), last_activation);
  if constexpr (kernel == Kernel::kMeta) return empty_results(x, weights, biases, lora, masks);
  LoraLayers terms = lora_layers(lora);
  ask_lora(terms, masks);
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  return results(stack_backward(grad_out, x, weights, biases, has_bias, last_activation, masks.x,
                                masks.weights, masks.biases, acts, terms),
                 masks);
}

// ---- lora_gated_mlp -----------------------------------------------------------------------------

template <Kernel kernel>
at::Tensor lora_gated_mlp(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                          const c10::List<bool>& has_bias_list, c10::string_view activation,
                          const LoraArgs& lora) {
  constexpr const char* op = "lora_gated_mlp";
  const std::vector<bool> has_bias = has_bias_list.vec();
  check_gated(op, x, weights, biases, has_bias, lora);
  const Activation act = parse_activation(op, activation);
  if constexpr (kernel == Kernel::kMeta) return empty_output(x, weights.back().sym_size(0));
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  return gated_forward(x, weights, biases, has_bias, act, lora_layers(lora));
}

template <Kernel kernel>
LoraBackwardResult lora_gated_mlp_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                           at::TensorList weights, at::TensorList biases,
                                           const c10::List<bool>& has_bias_list,
                                           c10::string_view activation, const LoraArgs& lora,
                                           const LoraBackwardMasks& masks) {
  constexpr const char* op = "lora_gated_mlp_backward";
  const std::vector<bool> has_bias = has_bias_list.vec();
  check_gated(op, x, weights, biases, has_bias, lora);
  check_backward_rest(op, grad_out, x, weights, biases, lora, masks);
  const Activation act = parse_activation(op, activation);
  if constexpr (kernel == Kernel::kMeta) return empty_results(x, weights, biases, lora, masks);
  LoraLayers terms = lora_layers(lora);
  ask_lora(terms, masks);
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  return results(gated_backward(grad_out, x, weights, biases, has_bias, masks.x, masks.weights,
                                masks.biases, act, terms),
                 masks);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ckpt_ext, m) {
  register_kernels(m, "lora_mlp", &lora_mlp_kernel<lora_mlp<Kernel::kCompute>>,
                   &lora_mlp_kernel<lora_mlp<Kernel::kMeta>>);
  register_kernels(m, "lora_mlp_backward",
                   &lora_mlp_backward_kernel<lora_mlp_backward<Kernel::kCompute>>,
                   &lora_mlp_backward_kernel<lora_mlp_backward<Kernel::kMeta>>);
  register_kernels(m, "lora_gated_mlp", &lora_gated_mlp_kernel<lora_gated_mlp<Kernel::kCompute>>,
                   &lora_gated_mlp_kernel<lora_gated_mlp<Kernel::kMeta>>);
  register_kernels(m, "lora_gated_mlp_backward",
                   &lora_gated_mlp_backward_kernel<lora_gated_mlp_backward<Kernel::kCompute>>,
                   &lora_gated_mlp_backward_kernel<lora_gated_mlp_backward<Kernel::kMeta>>);
}

}  // namespace ckpt_ext
