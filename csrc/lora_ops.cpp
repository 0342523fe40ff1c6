// lora_ops.cpp — the kernels of lora_mlp, lora_gated_mlp and their backward ops (schemas in
// schemas.cpp): the mlp and gated_mlp ops with a LoRA term on any of their weights (lora.h).
// Checks (checks.cpp), device guard, then the stack or gated engine with the terms, one function
// for CPU and CUDA; and their Meta kernels, the same checks then fresh outputs.
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
#include "stack.h"

namespace ckpt_ext {

namespace {

using LoraBackwardResult =
    std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>,
               std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>>;

LoraArgs lora_args(at::TensorList A, at::TensorList B, at::TensorList biases,
                   const c10::List<bool>& has_lora, const c10::List<bool>& has_bias,
                   c10::ArrayRef<double> scaling) {
  return {A, B, biases, has_lora.vec(), has_bias.vec(), scaling};
}

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
                         const std::vector<bool>& need_weights,
                         const std::vector<bool>& need_biases, const std::vector<bool>& need_A,
                         const std::vector<bool>& need_B, const std::vector<bool>& need_lb) {
  check_stack_masks(op, weights, biases, need_weights, need_biases);
  check_lora_masks(op, lora, need_A, need_B, need_lb);
  check_grad_out(op, grad_out, x, weights.back().sym_size(0));
}

template <typename Grads>
LoraBackwardResult results(Grads&& g, const std::vector<bool>& need_weights,
                           const std::vector<bool>& need_biases, const std::vector<bool>& need_A,
                           const std::vector<bool>& need_B, const std::vector<bool>& need_lb) {
  return {g.grad_x,
          asked(std::move(g.grad_weights), need_weights),
          asked(std::move(g.grad_biases), need_biases),
          asked(std::move(g.lora.A), need_A),
          asked(std::move(g.lora.B), need_B),
          asked(std::move(g.lora.biases), need_lb)};
}

// ---- lora_mlp -----------------------------------------------------------------------------------

at::Tensor lora_mlp(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                    const c10::List<bool>& has_bias_list, c10::string_view activation,
                    bool last_activation, at::TensorList lora_A, at::TensorList lora_B,
                    at::TensorList lora_biases, const c10::List<bool>& has_lora,
                    const c10::List<bool>& has_lora_bias, c10::ArrayRef<double> scaling) {
  constexpr const char* op = "lora_mlp";
  const std::vector<bool> has_bias = has_bias_list.vec();
  const LoraArgs la = lora_args(lora_A, lora_B, lora_biases, has_lora, has_lora_bias, scaling);
  check_stack(op, x, weights, biases, has_bias, la);
  const auto acts = parse_activations(op, activation, weights.size(), last_activation);
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  return stack_forward(x, weights, biases, has_bias, last_activation, acts, lora_layers(la));
}

LoraBackwardResult lora_mlp_backward(
    const at::Tensor& grad_out, const at::Tensor& x, at::TensorList weights,
    at::TensorList biases, const c10::List<bool>& has_bias_list, c10::string_view activation,
    bool last_activation, at::TensorList lora_A, at::TensorList lora_B,
    at::TensorList lora_biases, const c10::List<bool>& has_lora,
    const c10::List<bool>& has_lora_bias, c10::ArrayRef<double> scaling, bool need_x,
    const c10::List<bool>& need_weights_list, const c10::List<bool>& need_biases_list,
    const c10::List<bool>& need_A_list, const c10::List<bool>& need_B_list,
    const c10::List<bool>& need_lb_list) {
  constexpr const char* op = "lora_mlp_backward";
  const std::vector<bool> has_bias = has_bias_list.vec(), need_weights = need_weights_list.vec(),
                          need_biases = need_biases_list.vec(), need_A = need_A_list.vec(),
                          need_B = need_B_list.vec(), need_lb = need_lb_list.vec();
  const LoraArgs la = lora_args(lora_A, lora_B, lora_biases, has_lora, has_lora_bias, scaling);
  check_stack(op, x, weights, biases, has_bias, la);
  check_backward_rest(op, grad_out, x, weights, biases, la, need_weights, need_biases, need_A,
                      need_B, need_lb);
  const auto acts = parse_activations(op, activation, weights.size(), last_activation);
  LoraLayers lora = lora_layers(la);
  ask_lora(lora, need_A, need_B, need_lb);
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  return results(stack_backward(grad_out, x, weights, biases, has_bias, last_activation, need_x,
                                need_weights, need_biases, acts, lora),
                 need_weights, need_biases, need_A, need_B, need_lb);
}

// ---- lora_gated_mlp -----------------------------------------------------------------------------

at::Tensor lora_gated_mlp(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                          const c10::List<bool>& has_bias_list, c10::string_view activation,
                          at::TensorList lora_A, at::TensorList lora_B,
                          at::TensorList lora_biases, const c10::List<bool>& has_lora,
                          const c10::List<bool>& has_lora_bias, c10::ArrayRef<double> scaling) {
  constexpr const char* op = "lora_gated_mlp";
  const std::vector<bool> has_bias = has_bias_list.vec();
  const LoraArgs la = lora_args(lora_A, lora_B, lora_biases, has_lora, has_lora_bias, scaling);
  check_gated(op, x, weights, biases, has_bias, la);
  const Activation act = parse_activation(op, activation);
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  return gated_forward(x, weights, biases, has_bias, act, lora_layers(la));
}

LoraBackwardResult lora_gated_mlp_backward(
    const at::Tensor& grad_out, const at::Tensor& x, at::TensorList weights,
    at::TensorList biases, const c10::List<bool>& has_bias_list, c10::string_view activation,
    at::TensorList lora_A, at::TensorList lora_B, at::TensorList lora_biases,
    const c10::List<bool>& has_lora, const c10::List<bool>& has_lora_bias,
    c10::ArrayRef<double> scaling, bool need_x, const c10::List<bool>& need_weights_list,
    const c10::List<bool>& need_biases_list, const c10::List<bool>& need_A_list,
    const c10::List<bool>& need_B_list, const c10::List<bool>& need_lb_list) {
  constexpr const char* op = "lora_gated_mlp_backward";
  const std::vector<bool> has_bias = has_bias_list.vec(), need_weights = need_weights_list.vec(),
                          need_biases = need_biases_list.vec(), need_A = need_A_list.vec(),
                          need_B = need_B_list.vec(), need_lb = need_lb_list.vec();
  const LoraArgs la = lora_args(lora_A, lora_B, lora_biases, has_lora, has_lora_bias, scaling);
  check_gated(op, x, weights, biases, has_bias, la);
  check_backward_rest(op, grad_out, x, weights, biases, la, need_weights, need_biases, need_A,
                      need_B, need_lb);
  const Activation act = parse_activation(op, activation);
  LoraLayers lora = lora_layers(la);
  ask_lora(lora, need_A, need_B, need_lb);
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  return results(gated_backward(grad_out, x, weights, biases, has_bias, need_x, need_weights,
                                need_biases, act, lora),
                 need_weights, need_biases, need_A, need_B, need_lb);
}

// ---- Meta kernels: the same checks, then the outputs' metadata as SymInts ------------------------

at::Tensor output_meta(const at::Tensor& x, at::TensorList weights) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end() - 1);
  shape.push_back(weights.back().sym_size(0));
  return at::empty_symint(shape, x.options());
}

LoraBackwardResult backward_meta(const at::Tensor& x, at::TensorList weights,
                                 at::TensorList biases, const LoraArgs& la, bool need_x,
                                 const std::vector<bool>& need_weights,
                                 const std::vector<bool>& need_biases,
                                 const std::vector<bool>& need_A, const std::vector<bool>& need_B,
                                 const std::vector<bool>& need_lb) {
  auto like = [&](at::TensorList ts, const std::vector<bool>& need, bool weight_layout) {
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < ts.size(); ++i) {
      if (!need[i]) continue;
      out.push_back(weight_layout ? empty_weight_grad(ts[i], x.options())
                                  : at::empty_symint(ts[i].sym_sizes(), x.options()));
    }
    return out;
  };
  return {need_x ? at::empty_symint(x.sym_sizes(), x.options()) : at::Tensor(),
          like(weights, need_weights, true),
          like(biases, need_biases, false),
          like(la.A, need_A, true),
          like(la.B, need_B, true),
          like(la.biases, need_lb, false)};
}

at::Tensor lora_mlp_meta(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                         const c10::List<bool>& has_bias, c10::string_view activation,
                         bool last_activation, at::TensorList lora_A, at::TensorList lora_B,
                         at::TensorList lora_biases, const c10::List<bool>& has_lora,
                         const c10::List<bool>& has_lora_bias, c10::ArrayRef<double> scaling) {
  constexpr const char* op = "lora_mlp";
  check_stack(op, x, weights, biases, has_bias.vec(),
              lora_args(lora_A, lora_B, lora_biases, has_lora, has_lora_bias, scaling));
  parse_activations(op, activation, weights.size(), last_activation);
  return output_meta(x, weights);
}

LoraBackwardResult lora_mlp_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& x, at::TensorList weights,
    at::TensorList biases, const c10::List<bool>& has_bias, c10::string_view activation,
    bool last_activation, at::TensorList lora_A, at::TensorList lora_B,
    at::TensorList lora_biases, const c10::List<bool>& has_lora,
    const c10::List<bool>& has_lora_bias, c10::ArrayRef<double> scaling, bool need_x,
    const c10::List<bool>& need_weights, const c10::List<bool>& need_biases,
    const c10::List<bool>& need_A, const c10::List<bool>& need_B,
    const c10::List<bool>& need_lb) {
  constexpr const char* op = "lora_mlp_backward";
  const LoraArgs la = lora_args(lora_A, lora_B, lora_biases, has_lora, has_lora_bias, scaling);
  check_stack(op, x, weights, biases, has_bias.vec(), la);
  check_backward_rest(op, grad_out, x, weights, biases, la, need_weights.vec(), need_biases.vec(),
                      need_A.vec(), need_B.vec(), need_lb.vec());
  parse_activations(op, activation, weights.size(), last_activation);
  return backward_meta(x, weights, biases, la, need_x, need_weights.vec(), need_biases.vec(),
                       need_A.vec(), need_B.vec(), need_lb.vec());
}

at::Tensor lora_gated_mlp_meta(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                               const c10::List<bool>& has_bias, c10::string_view activation,
                               at::TensorList lora_A, at::TensorList lora_B,
                               at::TensorList lora_biases, const c10::List<bool>& has_lora,
                               const c10::List<bool>& has_lora_bias,
                               c10::ArrayRef<double> scaling) {
  constexpr const char* op = "lora_gated_mlp";
  check_gated(op, x, weights, biases, has_bias.vec(),
              lora_args(lora_A, lora_B, lora_biases, has_lora, has_lora_bias, scaling));
  parse_activation(op, activation);
  return output_meta(x, weights);
}

LoraBackwardResult lora_gated_mlp_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& x, at::TensorList weights,
    at::TensorList biases, const c10::List<bool>& has_bias, c10::string_view activation,
    at::TensorList lora_A, at::TensorList lora_B, at::TensorList lora_biases,
    const c10::List<bool>& has_lora, const c10::List<bool>& has_lora_bias,
    c10::ArrayRef<double> scaling, bool need_x, const c10::List<bool>& need_weights,
    const c10::List<bool>& need_biases, const c10::List<bool>& need_A,
    const c10::List<bool>& need_B, const c10::List<bool>& need_lb) {
  constexpr const char* op = "lora_gated_mlp_backward";
  const LoraArgs la = lora_args(lora_A, lora_B, lora_biases, has_lora, has_lora_bias, scaling);
  check_gated(op, x, weights, biases, has_bias.vec(), la);
  check_backward_rest(op, grad_out, x, weights, biases, la, need_weights.vec(), need_biases.vec(),
                      need_A.vec(), need_B.vec(), need_lb.vec());
  parse_activation(op, activation);
  return backward_meta(x, weights, biases, la, need_x, need_weights.vec(), need_biases.vec(),
                       need_A.vec(), need_B.vec(), need_lb.vec());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ckpt_ext, m) {
  register_kernels(m, "lora_mlp", &lora_mlp, &lora_mlp_meta);
  register_kernels(m, "lora_mlp_backward", &lora_mlp_backward, &lora_mlp_backward_meta);
  register_kernels(m, "lora_gated_mlp", &lora_gated_mlp, &lora_gated_mlp_meta);
  register_kernels(m, "lora_gated_mlp_backward", &lora_gated_mlp_backward,
                   &lora_gated_mlp_backward_meta);
}

}  // namespace ckpt_ext
