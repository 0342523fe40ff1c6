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

// Inside an autocast kernel: this device's autocast key excluded, so that the op, called again
// below this point, does not come back here but re-dispatches to Autograd -> CPU/CUDA with the
// cast arguments; and the casts to the context's dtype (cached, as nn.Linear's are).
template <c10::DeviceType device_type>
struct Autocast {
  c10::impl::ExcludeDispatchKeyGuard no_autocast{
      at::autocast::get_autocast_dispatch_key_from_device_type(device_type)};
  at::ScalarType dtype = at::autocast::get_autocast_dtype(device_type);

  at::Tensor operator()(const at::Tensor& t) const {
    return at::autocast::cached_cast(dtype, t, device_type);
  }
  std::optional<at::Tensor> operator()(const std::optional<at::Tensor>& t) const {
    if (!t.has_value()) return std::nullopt;
    return (*this)(*t);
  }
  std::vector<at::Tensor> operator()(at::TensorList ts) const {
    std::vector<at::Tensor> out;
    out.reserve(ts.size());
    for (const at::Tensor& t : ts) out.push_back((*this)(t));
    return out;
  }
};

template <c10::DeviceType device_type>
at::Tensor mlp_autocast(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                        const c10::List<bool>& has_bias, c10::string_view activation,
                        bool last_activation) {
  const Autocast<device_type> cast;
  return call_mlp(cast(x), cast(weights), cast(biases), has_bias, activation, last_activation);
}

template <c10::DeviceType device_type>
at::Tensor gated_mlp_autocast(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                              const c10::List<bool>& has_bias, c10::string_view activation) {
  const Autocast<device_type> cast;
  return call_gated_mlp(cast(x), cast(weights), cast(biases), has_bias, activation);
}

// The lora ops cast their LoRA tensors too: the LoraArgs passed on points at the cast copies.
template <c10::DeviceType device_type>
at::Tensor lora_mlp_autocast(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                             const c10::List<bool>& has_bias, c10::string_view activation,
                             bool last_activation, const LoraArgs& lora) {
  const Autocast<device_type> cast;
  const std::vector<at::Tensor> A = cast(lora.A), B = cast(lora.B), lb = cast(lora.biases);
  return call_lora_mlp(cast(x), cast(weights), cast(biases), has_bias, activation,
                       last_activation, {A, B, lb, lora.has_lora, lora.has_bias, lora.scaling});
}

template <c10::DeviceType device_type>
at::Tensor lora_gated_mlp_autocast(const at::Tensor& x, at::TensorList weights,
                                   at::TensorList biases, const c10::List<bool>& has_bias,
                                   c10::string_view activation, const LoraArgs& lora) {
  const Autocast<device_type> cast;
  const std::vector<at::Tensor> A = cast(lora.A), B = cast(lora.B), lb = cast(lora.biases);
  return call_lora_gated_mlp(cast(x), cast(weights), cast(biases), has_bias, activation,
                             {A, B, lb, lora.has_lora, lora.has_bias, lora.scaling});
}

template <c10::DeviceType device_type>
at::Tensor moe_experts_autocast(const at::Tensor& x, const at::Tensor& top_k_index,
                                const at::Tensor& top_k_weights, const at::Tensor& gate_up,
                                const at::Tensor& down,
                                const std::optional<at::Tensor>& gate_up_bias,
                                const std::optional<at::Tensor>& down_bias,
                                c10::string_view activation, c10::string_view layout,
                                std::optional<double> limit, double up_offset) {
  const Autocast<device_type> cast;
  return call_moe_experts(cast(x), top_k_index, top_k_weights, cast(gate_up), cast(down),
                          cast(gate_up_bias), cast(down_bias), activation, layout, limit,
                          up_offset);
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// registration

TORCH_LIBRARY_FRAGMENT(ckpt_ext, m) {
  register_autocast(m, "mlp", &mlp_autocast<c10::DeviceType::CPU>,
                    &mlp_autocast<c10::DeviceType::CUDA>);
  register_autocast(m, "gated_mlp", &gated_mlp_autocast<c10::DeviceType::CPU>,
                    &gated_mlp_autocast<c10::DeviceType::CUDA>);
  register_autocast(m, "lora_mlp", &lora_mlp_kernel<lora_mlp_autocast<c10::DeviceType::CPU>>,
                    &lora_mlp_kernel<lora_mlp_autocast<c10::DeviceType::CUDA>>);
  register_autocast(m, "lora_gated_mlp",
                    &lora_gated_mlp_kernel<lora_gated_mlp_autocast<c10::DeviceType::CPU>>,
                    &lora_gated_mlp_kernel<lora_gated_mlp_autocast<c10::DeviceType::CUDA>>);
  register_autocast(m, "moe_experts", &moe_experts_autocast<c10::DeviceType::CPU>,
                    &moe_experts_autocast<c10::DeviceType::CUDA>);
}

}  // namespace ckpt_ext
