// schemas.h — calling the ckpt_ext ops through the dispatcher from C++ (schemas.cpp): the autocast
// kernels and the autograd node re-enter the library this way, so every key below theirs runs.
// And the lora ops' side of the schema boundary: their kernels take the six LoRA lists of the
// schemas as one LoraArgs (lora.h), the backward ops' masks as one LoraBackwardMasks.
// Shapes: x (..., K_0); weights[i] (N_i, K_i); biases those of the layers whose has_bias is true.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/List.h>

#include <optional>
#include <tuple>
#include <vector>

#include "lora.h"

namespace ckpt_ext {

at::Tensor call_mlp(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                    const c10::List<bool>& has_bias, c10::string_view activation,
                    bool last_activation);
at::Tensor call_gated_mlp(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                          const c10::List<bool>& has_bias, c10::string_view activation);
// The lora ops: the same, then the LoRA lists.
at::Tensor call_lora_mlp(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                         const c10::List<bool>& has_bias, c10::string_view activation,
                         bool last_activation, const LoraArgs& lora);
at::Tensor call_lora_gated_mlp(const at::Tensor& x, at::TensorList weights,
                               at::TensorList biases, const c10::List<bool>& has_bias,
                               c10::string_view activation, const LoraArgs& lora);
// moe.h's shapes.
at::Tensor call_moe_experts(const at::Tensor& x, const at::Tensor& top_k_index,
                            const at::Tensor& top_k_weights, const at::Tensor& gate_up,
                            const at::Tensor& down, const std::optional<at::Tensor>& gate_up_bias,
                            const std::optional<at::Tensor>& down_bias,
                            c10::string_view activation, c10::string_view layout,
                            std::optional<double> limit, double up_offset);

// ----------------------------------------------------------------------------------------------
// The lora ops' kernels as the dispatcher calls them: lora_mlp_kernel<body> is the kernel of
// lora_mlp whose work is body(x, weights, biases, has_bias, activation, last_activation, lora);
// the backward ops' bodies take (grad_out, the forward's arguments, masks). lora_gated_mlp's
// lists are lora_mlp's without last_activation.

using LoraBackwardResult =
    std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>,
               std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>>;

template <auto body>
at::Tensor lora_mlp_kernel(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                           const c10::List<bool>& has_bias, c10::string_view activation,
                           bool last_activation, at::TensorList lora_A, at::TensorList lora_B,
                           at::TensorList lora_biases, const c10::List<bool>& has_lora,
                           const c10::List<bool>& has_lora_bias, c10::ArrayRef<double> scaling) {
  return body(x, weights, biases, has_bias, activation, last_activation,
              lora_args(lora_A, lora_B, lora_biases, has_lora, has_lora_bias, scaling));
}

template <auto body>
at::Tensor lora_gated_mlp_kernel(const at::Tensor& x, at::TensorList weights,
                                 at::TensorList biases, const c10::List<bool>& has_bias,
                                 c10::string_view activation, at::TensorList lora_A,
                                 at::TensorList lora_B, at::TensorList lora_biases,
                                 const c10::List<bool>& has_lora,
                                 const c10::List<bool>& has_lora_bias,
                                 c10::ArrayRef<double> scaling) {
  return body(x, weights, biases, has_bias, activation,
              lora_args(lora_A, lora_B, lora_biases, has_lora, has_lora_bias, scaling));
}

template <auto body>
LoraBackwardResult lora_mlp_backward_kernel(
    const at::Tensor& grad_out, const at::Tensor& x, at::TensorList weights,
    at::TensorList biases, const c10::List<bool>& has_bias, c10::string_view activation,
    bool last_activation, at::TensorList lora_A, at::TensorList lora_B,
    at::TensorList lora_biases, const c10::List<bool>& has_lora,
    const c10::List<bool>& has_lora_bias, c10::ArrayRef<double> scaling, bool need_x,
    const c10::List<bool>& need_weights, const c10::List<bool>& need_biases,
    const c10::List<bool>& need_A, const c10::List<bool>& need_B,
    const c10::List<bool>& need_lora_biases) {
  return body(grad_out, x, weights, biases, has_bias, activation, last_activation,
              lora_args(lora_A, lora_B, lora_biases, has_lora, has_lora_bias, scaling),
              LoraBackwardMasks{need_x, need_weights.vec(), need_biases.vec(), need_A.vec(),
                                need_B.vec(), need_lora_biases.vec()});
}

template <auto body>
LoraBackwardResult lora_gated_mlp_backward_kernel(
    const at::Tensor& grad_out, const at::Tensor& x, at::TensorList weights,
    at::TensorList biases, const c10::List<bool>& has_bias, c10::string_view activation,
    at::TensorList lora_A, at::TensorList lora_B, at::TensorList lora_biases,
    const c10::List<bool>& has_lora, const c10::List<bool>& has_lora_bias,
    c10::ArrayRef<double> scaling, bool need_x, const c10::List<bool>& need_weights,
    const c10::List<bool>& need_biases, const c10::List<bool>& need_A,
    const c10::List<bool>& need_B, const c10::List<bool>& need_lora_biases) {
  return body(grad_out, x, weights, biases, has_bias, activation,
              lora_args(lora_A, lora_B, lora_biases, has_lora, has_lora_bias, scaling),
              LoraBackwardMasks{need_x, need_weights.vec(), need_biases.vec(), need_A.vec(),
                                need_B.vec(), need_lora_biases.vec()});
}

}  // namespace ckpt_ext
