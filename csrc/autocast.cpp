// autocast.cpp — the autocast kernels of ckpt_ext::mlp, gated_mlp, lora_mlp, lora_gated_mlp
// and moe_experts (CPU and CUDA autocast keys).
//
//   mlp(x, weights, biases, ...) under torch.autocast(device, dtype=D): x (..., K_0) and every
//       weight and bias are cast to D  ->  y (..., N_{L-1}) in D; gated_mlp likewise, and the
//       lora ops with their LoRA tensors (A, B, biases) cast too, as peft's lora_A and lora_B
//       Linears run under autocast; moe_experts likewise for x, gate_up, down and the biases,
//       while top_k_weights keep their dtype (routing probabilities, float32 in transformers'
//       routers: the weighted sum runs in the promoted dtype, as transformers' experts run it)
//
// The policy of nn.Linear (lower_precision_fp, the current context's dtype, cached casts); why C++
// and not torch.library.register_autocast: docs/design.md, "Autocast". The backward ops need no
// autocast kernel: they only see tensors the forward already cast.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "registration.h"
#include "schemas.h"

namespace ckpt_ext {

namespace {

std::vector<at::Tensor> cast_all(at::ScalarType dtype, at::TensorList ts,
                                 c10::DeviceType device_type) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const at::Tensor& t : ts) out.push_back(at::autocast::cached_cast(dtype, t, device_type));
  return out;
}

template <c10::DeviceType device_type>
at::Tensor mlp_autocast(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                        const c10::List<bool>& has_bias, c10::string_view activation,
                        bool last_activation) {
  // Below this point the op must not come back here: exclude this device's autocast key, then
  // re-dispatch to Autograd -> CPU/CUDA with the cast arguments.
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(device_type));
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(device_type);
  return call_mlp(at::autocast::cached_cast(dtype, x, device_type),
                  cast_all(dtype, weights, device_type), cast_all(dtype, biases, device_type),
                  has_bias, activation, last_activation);
}

template <c10::DeviceType device_type>
at::Tensor gated_mlp_autocast(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                              const c10::List<bool>& has_bias, c10::string_view activation) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(device_type));
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(device_type);
  return call_gated_mlp(at::autocast::cached_cast(dtype, x, device_type),
                        cast_all(dtype, weights, device_type),
                        cast_all(dtype, biases, device_type), has_bias, activation);
}

template <c10::DeviceType device_type>
at::Tensor lora_mlp_autocast(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                             const c10::List<bool>& has_bias, c10::string_view activation,
                             bool last_activation, at::TensorList lora_A, at::TensorList lora_B,
                             at::TensorList lora_biases, const c10::List<bool>& has_lora,
                             const c10::List<bool>& has_lora_bias,
                             c10::ArrayRef<double> scaling) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(device_type));
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(device_type);
  return call_lora_mlp(at::autocast::cached_cast(dtype, x, device_type),
                       cast_all(dtype, weights, device_type), cast_all(dtype, biases, device_type),
                       has_bias, activation, last_activation, cast_all(dtype, lora_A, device_type),
                       cast_all(dtype, lora_B, device_type),
                       cast_all(dtype, lora_biases, device_type), has_lora, has_lora_bias,
                       scaling);
}

template <c10::DeviceType device_type>
at::Tensor lora_gated_mlp_autocast(const at::Tensor& x, at::TensorList weights,
                                   at::TensorList biases, const c10::List<bool>& has_bias,
                                   c10::string_view activation, at::TensorList lora_A,
                                   at::TensorList lora_B, at::TensorList lora_biases,
                                   const c10::List<bool>& has_lora,
                                   const c10::List<bool>& has_lora_bias,
                                   c10::ArrayRef<double> scaling) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(device_type));
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(device_type);
  return call_lora_gated_mlp(at::autocast::cached_cast(dtype, x, device_type),
                             cast_all(dtype, weights, device_type),
                             cast_all(dtype, biases, device_type), has_bias, activation,
                             cast_all(dtype, lora_A, device_type),
                             cast_all(dtype, lora_B, device_type),
                             cast_all(dtype, lora_biases, device_type), has_lora, has_lora_bias,
                             scaling);
}

template <c10::DeviceType device_type>
at::Tensor moe_experts_autocast(const at::Tensor& x, const at::Tensor& top_k_index,
                                const at::Tensor& top_k_weights, const at::Tensor& gate_up,
                                const at::Tensor& down,
                                const std::optional<at::Tensor>& gate_up_bias,
                                const std::optional<at::Tensor>& down_bias,
                                c10::string_view activation, c10::string_view layout,
                                std::optional<double> limit, double up_offset) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(device_type));
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(device_type);
  auto cast = [&](const std::optional<at::Tensor>& t) -> std::optional<at::Tensor> {
    if (!t.has_value()) return std::nullopt;
    return at::autocast::cached_cast(dtype, *t, device_type);
  };
  return call_moe_experts(at::autocast::cached_cast(dtype, x, device_type), top_k_index,
                          top_k_weights, at::autocast::cached_cast(dtype, gate_up, device_type),
                          at::autocast::cached_cast(dtype, down, device_type), cast(gate_up_bias),
                          cast(down_bias), activation, layout, limit, up_offset);
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// registration

TORCH_LIBRARY_FRAGMENT(ckpt_ext, m) {
  register_autocast(m, "mlp", &mlp_autocast<c10::DeviceType::CPU>,
                    &mlp_autocast<c10::DeviceType::CUDA>);
  register_autocast(m, "gated_mlp", &gated_mlp_autocast<c10::DeviceType::CPU>,
                    &gated_mlp_autocast<c10::DeviceType::CUDA>);
  register_autocast(m, "lora_mlp", &lora_mlp_autocast<c10::DeviceType::CPU>,
                    &lora_mlp_autocast<c10::DeviceType::CUDA>);
  register_autocast(m, "lora_gated_mlp", &lora_gated_mlp_autocast<c10::DeviceType::CPU>,
                    &lora_gated_mlp_autocast<c10::DeviceType::CUDA>);
  register_autocast(m, "moe_experts", &moe_experts_autocast<c10::DeviceType::CPU>,
                    &moe_experts_autocast<c10::DeviceType::CUDA>);
}

}  // namespace ckpt_ext
