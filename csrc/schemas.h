// schemas.h — calling the ckpt_ext ops through the dispatcher from C++ (schemas.cpp): the autocast
// kernels and the autograd node re-enter the library this way, so every key below theirs runs.
// Shapes: x (..., K_0); weights[i] (N_i, K_i); biases those of the layers whose has_bias is true.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/List.h>

#include <optional>

namespace ckpt_ext {

at::Tensor call_mlp(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                    const c10::List<bool>& has_bias, c10::string_view activation,
                    bool last_activation);
at::Tensor call_gated_mlp(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                          const c10::List<bool>& has_bias, c10::string_view activation);
// The lora ops: the same, then the LoRA lists (lora_A, lora_B, lora_biases, has_lora,
// has_lora_bias, lora_scaling; schemas.cpp).
at::Tensor call_lora_mlp(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                         const c10::List<bool>& has_bias, c10::string_view activation,
                         bool last_activation, at::TensorList lora_A, at::TensorList lora_B,
                         at::TensorList lora_biases, const c10::List<bool>& has_lora,
                         const c10::List<bool>& has_lora_bias, c10::ArrayRef<double> scaling);
at::Tensor call_lora_gated_mlp(const at::Tensor& x, at::TensorList weights,
                               at::TensorList biases, const c10::List<bool>& has_bias,
                               c10::string_view activation, at::TensorList lora_A,
                               at::TensorList lora_B, at::TensorList lora_biases,
                               const c10::List<bool>& has_lora,
                               const c10::List<bool>& has_lora_bias,
                               c10::ArrayRef<double> scaling);
// moe.h's shapes.
at::Tensor call_moe_experts(const at::Tensor& x, const at::Tensor& top_k_index,
                            const at::Tensor& top_k_weights, const at::Tensor& gate_up,
                            const at::Tensor& down, const std::optional<at::Tensor>& gate_up_bias,
                            const std::optional<at::Tensor>& down_bias,
                            c10::string_view activation, c10::string_view layout,
                            std::optional<double> limit, double up_offset);

}  // namespace ckpt_ext
