// moe_ops.cpp — the kernels of moe_experts and moe_experts_backward (schemas in schemas.cpp):
// checks (checks.cpp), device guard, then the mixture-of-experts engine (moe.cpp), one function
// for CPU and CUDA; and their Meta kernels, the same function up to the checks, then fresh
// outputs (registration.h's Kernel), whose shapes never depend on the routing's values.
//   moe_experts(x (..., H), top_k_index (..., K), top_k_weights (..., K), gate_up, down,
//               gate_up_bias?, down_bias?, activation, layout, limit?, up_offset) -> y (..., N)
// The backward recomputes and returns only the gradients asked for (output_mask), the others
// undefined.
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>

#include "checks.h"
#include "moe.h"
#include "registration.h"
#include "stack.h"

namespace ckpt_ext {

namespace {

using MoeBackwardResult =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

struct Parsed {
  MoeLayout layout;
  MoeGate gate;
};

// Every check of both ops' shared arguments, and the parsed layout and gated product.
Parsed check_and_parse(const char* op, const at::Tensor& x, const at::Tensor& top_k_index,
                       const at::Tensor& top_k_weights, const at::Tensor& gate_up,
                       const at::Tensor& down, const std::optional<at::Tensor>& gate_up_bias,
                       const std::optional<at::Tensor>& down_bias, c10::string_view activation,
                       c10::string_view layout_name, std::optional<double> limit,
                       double up_offset) {
  const MoeLayout layout = parse_moe_layout(op, layout_name);
  const Activation act = parse_activation(op, activation);
  check_moe_inputs(op, x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias,
                   layout, limit, up_offset);
  return {layout, MoeGate{act, limit, up_offset}};
}

c10::SymInt out_features(const at::Tensor& down, const MoeLayout& layout) {
  return down.sym_size(layout.transposed ? 2 : 1);
}

template <Kernel kernel>
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& top_k_index,
                       const at::Tensor& top_k_weights, const at::Tensor& gate_up,
                       const at::Tensor& down, const std::optional<at::Tensor>& gate_up_bias,
                       const std::optional<at::Tensor>& down_bias, c10::string_view activation,
                       c10::string_view layout, std::optional<double> limit, double up_offset) {
  const Parsed p = check_and_parse("moe_experts", x, top_k_index, top_k_weights, gate_up, down,
                                   gate_up_bias, down_bias, activation, layout, limit, up_offset);
  if constexpr (kernel == Kernel::kMeta) return empty_output(x, out_features(down, p.layout));
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  return moe_forward(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias,
                     p.layout, p.gate);
}

template <Kernel kernel>
MoeBackwardResult moe_experts_backward(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& top_k_index,
    const at::Tensor& top_k_weights, const at::Tensor& gate_up, const at::Tensor& down,
    const std::optional<at::Tensor>& gate_up_bias, const std::optional<at::Tensor>& down_bias,
    c10::string_view activation, c10::string_view layout, std::optional<double> limit,
    double up_offset, std::array<bool, 6> output_mask) {
  constexpr const char* op = "moe_experts_backward";
  const Parsed p = check_and_parse(op, x, top_k_index, top_k_weights, gate_up, down,
                                   gate_up_bias, down_bias, activation, layout, limit, up_offset);
  check_grad_out(op, grad_out, x, out_features(down, p.layout));
  if constexpr (kernel == Kernel::kMeta) {
    auto like = [&](bool need, const std::optional<at::Tensor>& t) {
      return need && t.has_value() ? at::empty_symint(t->sym_sizes(), t->options())
                                   : at::Tensor();
    };
    return {like(output_mask[0], x), like(output_mask[1], top_k_weights),
            like(output_mask[2], gate_up), like(output_mask[3], down),
            like(output_mask[4], gate_up_bias), like(output_mask[5], down_bias)};
  }
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  MoeGrads g = moe_backward(grad_out, x, top_k_index, top_k_weights, gate_up, down, gate_up_bias,
                            down_bias, p.layout, p.gate, output_mask);
  return {g[0], g[1], g[2], g[3], g[4], g[5]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ckpt_ext, m) {
  register_kernels(m, "moe_experts", &moe_experts<Kernel::kCompute>,
                   &moe_experts<Kernel::kMeta>);
  register_kernels(m, "moe_experts_backward", &moe_experts_backward<Kernel::kCompute>,
                   &moe_experts_backward<Kernel::kMeta>);
}

}  // namespace ckpt_ext
