// schemas.cpp — every schema of the ckpt_ext op library, once, and typed handles to call the ops
// from C++. Each file of kernels registers them with registration.h's helpers.
// The kernels: ops.cpp (mlp and its backward), gated_ops.cpp, lora_ops.cpp, moe_ops.cpp,
// higher_order.cpp (tanh's orders above the first, from a layer's output), cpu/third_order.cpp,
// autocast.cpp; autograd from Python (ckpt_ext/_mlp_autograd.py, _gated_autograd.py,
// _lora_autograd.py, _moe_autograd.py, _autograd.py, _higher_order.py).
#include "schemas.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace ckpt_ext {

TORCH_LIBRARY(ckpt_ext, m) {
  // A stack of Linear layers with an activation of activations.h after each (after the last only
  // when last_activation): `activation` is one name for every layer, or one name per layer with
  // an activation, comma-separated ("relu,relu,tanh"). `biases` holds the biases of the layers
  // whose has_bias is true, in layer order (a list of Tensor, not Tensor?, so that autograd sees
  // every bias). mlp_backward's grad_weights / grad_biases hold only the gradients asked for
  // (need_weights[i] true, need_biases[j] true), in order; grad_x is undefined unless need_x.
  m.def("mlp(Tensor x, Tensor[] weights, Tensor[] biases, bool[] has_bias, str activation, "
        "bool last_activation) -> Tensor");
  m.def(
      "mlp_backward(Tensor grad_out, Tensor x, Tensor[] weights, Tensor[] biases, "
      "bool[] has_bias, str activation, bool last_activation, bool need_x, bool[] need_weights, "
      "bool[] need_biases) -> (Tensor grad_x, Tensor[] grad_weights, Tensor[] grad_biases)");
  // A gated MLP, down(f(gate(x)) · up(x)) with f one activation of activations.h: weights are
  // [gate, up, down], or [gate_up, down] with one weight holding the gate's rows then the up
  // projection's; has_bias one entry per weight, biases those that exist (gated_ops.cpp). The
  // backward's lists as mlp_backward's.
  m.def("gated_mlp(Tensor x, Tensor[] weights, Tensor[] biases, bool[] has_bias, str activation) "
        "-> Tensor");
  m.def(
      "gated_mlp_backward(Tensor grad_out, Tensor x, Tensor[] weights, Tensor[] biases, "
      "bool[] has_bias, str activation, bool need_x, bool[] need_weights, bool[] need_biases) -> "
      "(Tensor grad_x, Tensor[] grad_weights, Tensor[] grad_biases)");
  // mlp and gated_mlp with a LoRA term on any of their weights: z_i = a·W_iᵀ + b_i +
  // s·((a·Aᵀ)·Bᵀ + b_B) (lora_ops.cpp, lora.cpp). has_lora: one entry per weight; lora_A (r, K_i),
  // lora_B (N_i, r), lora_scaling and has_lora_bias: one entry per weight with a LoRA, in weight
  // order; lora_biases: those of the LoRAs whose has_lora_bias is true. The backward ops' masks and
  // result lists extend mlp_backward's with need_lora_A / need_lora_B (one per LoRA) and
  // need_lora_biases (one per LoRA bias).
  m.def("lora_mlp(Tensor x, Tensor[] weights, Tensor[] biases, bool[] has_bias, str activation, "
        "bool last_activation, Tensor[] lora_A, Tensor[] lora_B, Tensor[] lora_biases, "
        "bool[] has_lora, bool[] has_lora_bias, float[] lora_scaling) -> Tensor");
  m.def(
      "lora_mlp_backward(Tensor grad_out, Tensor x, Tensor[] weights, Tensor[] biases, "
      "bool[] has_bias, str activation, bool last_activation, Tensor[] lora_A, Tensor[] lora_B, "
      "Tensor[] lora_biases, bool[] has_lora, bool[] has_lora_bias, float[] lora_scaling, "
      "bool need_x, bool[] need_weights, bool[] need_biases, bool[] need_lora_A, "
      "bool[] need_lora_B, bool[] need_lora_biases) -> (Tensor grad_x, Tensor[] grad_weights, "
      "Tensor[] grad_biases, Tensor[] grad_lora_A, Tensor[] grad_lora_B, "
      "Tensor[] grad_lora_biases)");
  m.def("lora_gated_mlp(Tensor x, Tensor[] weights, Tensor[] biases, bool[] has_bias, "
        "str activation, Tensor[] lora_A, Tensor[] lora_B, Tensor[] lora_biases, "
        "bool[] has_lora, bool[] has_lora_bias, float[] lora_scaling) -> Tensor");
  m.def(
      "lora_gated_mlp_backward(Tensor grad_out, Tensor x, Tensor[] weights, Tensor[] biases, "
      "bool[] has_bias, str activation, Tensor[] lora_A, Tensor[] lora_B, "
      "Tensor[] lora_biases, bool[] has_lora, bool[] has_lora_bias, float[] lora_scaling, "
      "bool need_x, bool[] need_weights, bool[] need_biases, bool[] need_lora_A, "
      "bool[] need_lora_B, bool[] need_lora_biases) -> (Tensor grad_x, Tensor[] grad_weights, "
      "Tensor[] grad_biases, Tensor[] grad_lora_A, Tensor[] grad_lora_B, "
      "Tensor[] grad_lora_biases)");
  // The experts of a mixture of experts, as transformers stores them (3-D weights, top-k
  // routing): per (token, k) pair, expert top_k_index[t, k] applied to x[t], weighted by
  // top_k_weights[t, k] and summed per token (moe.h: shapes, layouts, the gated product). The
  // backward's results are the gradients w.r.t. x, top_k_weights, gate_up, down, gate_up_bias
  // and down_bias, each only where output_mask says (undefined otherwise, and for a bias that is
  // None).
  m.def("moe_experts(Tensor x, Tensor top_k_index, Tensor top_k_weights, Tensor gate_up, "
        "Tensor down, Tensor? gate_up_bias, Tensor? down_bias, str activation, str layout, "
        "float? limit, float up_offset) -> Tensor");
  m.def(
      "moe_experts_backward(Tensor grad_out, Tensor x, Tensor top_k_index, Tensor top_k_weights, "
      "Tensor gate_up, Tensor down, Tensor? gate_up_bias, Tensor? down_bias, str activation, "
      "str layout, float? limit, float up_offset, bool[6] output_mask) -> (Tensor grad_x, "
      "Tensor grad_top_k_weights, Tensor grad_gate_up, Tensor grad_down, Tensor grad_gate_up_bias, "
      "Tensor grad_down_bias)");
  // The orders above the first of one tanh layer, from its output t = tanh(x·Wᵀ + b)
  // (higher_order.cpp; the math in docs/design.md). A grad_grad_* input is None where no
  // gradient reached that output; only the results asked for in output_mask are computed, the
  // others come back undefined.
  m.def(
      "linear_tanh_backward_from_output(Tensor grad_out, Tensor x, Tensor output, Tensor weight, "
      "Tensor? bias, bool[3] output_mask) -> (Tensor grad_x, Tensor grad_weight, "
      "Tensor grad_bias)");
  m.def(
      "linear_tanh_backward_from_output_backward(Tensor? grad_grad_x, Tensor? grad_grad_weight, "
      "Tensor? grad_grad_bias, Tensor grad_out, Tensor x, Tensor output, Tensor weight, "
      "bool[4] output_mask) -> (Tensor grad_grad_out, Tensor grad_x, Tensor grad_output, "
      "Tensor grad_weight)");
  // CPU only (cpu/third_order.cpp).
  m.def(
      "linear_tanh_backward_from_output_double_backward(Tensor? grad_grad_x, "
      "Tensor? grad_grad_weight, Tensor? grad_grad_bias, Tensor grad_out, Tensor x, "
      "Tensor output, Tensor weight, Tensor? u_grad_grad_out, Tensor? u_grad_x, "
      "Tensor? u_grad_output, Tensor? u_grad_weight, bool[7] output_mask) -> "
      "(Tensor d_grad_grad_x, Tensor d_grad_grad_weight, Tensor d_grad_grad_bias, "
      "Tensor d_grad_out, Tensor d_x, Tensor d_output, Tensor d_weight)");
}

at::Tensor call_mlp(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                    const c10::List<bool>& has_bias, c10::string_view activation,
                    bool last_activation) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ckpt_ext::mlp", "")
                       .typed<at::Tensor(const at::Tensor&, at::TensorList, at::TensorList,
                                         const c10::List<bool>&, c10::string_view, bool)>();
  return op.call(x, weights, biases, has_bias, activation, last_activation);
}

at::Tensor call_gated_mlp(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                          const c10::List<bool>& has_bias, c10::string_view activation) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ckpt_ext::gated_mlp", "")
                       .typed<at::Tensor(const at::Tensor&, at::TensorList, at::TensorList,
                                         const c10::List<bool>&, c10::string_view)>();
  return op.call(x, weights, biases, has_bias, activation);
}

namespace {

c10::List<bool> bool_list(const std::vector<bool>& v) {
  c10::List<bool> out;
  out.reserve(v.size());
  for (bool b : v) out.push_back(b);
  return out;
}

}  // namespace

at::Tensor call_lora_mlp(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                         const c10::List<bool>& has_bias, c10::string_view activation,
                         bool last_activation, const LoraArgs& lora) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("ckpt_ext::lora_mlp", "")
          .typed<at::Tensor(const at::Tensor&, at::TensorList, at::TensorList,
                            const c10::List<bool>&, c10::string_view, bool, at::TensorList,
                            at::TensorList, at::TensorList, const c10::List<bool>&,
                            const c10::List<bool>&, c10::ArrayRef<double>)>();
  return op.call(x, weights, biases, has_bias, activation, last_activation, lora.A, lora.B,
                 lora.biases, bool_list(lora.has_lora), bool_list(lora.has_bias), lora.scaling);
}

at::Tensor call_lora_gated_mlp(const at::Tensor& x, at::TensorList weights,
                               at::TensorList biases, const c10::List<bool>& has_bias,
                               c10::string_view activation, const LoraArgs& lora) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("ckpt_ext::lora_gated_mlp", "")
          .typed<at::Tensor(const at::Tensor&, at::TensorList, at::TensorList,
                            const c10::List<bool>&, c10::string_view, at::TensorList,
                            at::TensorList, at::TensorList, const c10::List<bool>&,
                            const c10::List<bool>&, c10::ArrayRef<double>)>();
  return op.call(x, weights, biases, has_bias, activation, lora.A, lora.B, lora.biases,
                 bool_list(lora.has_lora), bool_list(lora.has_bias), lora.scaling);
}

at::Tensor call_moe_experts(const at::Tensor& x, const at::Tensor& top_k_index,
                            const at::Tensor& top_k_weights, const at::Tensor& gate_up,
                            const at::Tensor& down, const std::optional<at::Tensor>& gate_up_bias,
                            const std::optional<at::Tensor>& down_bias,
                            c10::string_view activation, c10::string_view layout,
                            std::optional<double> limit, double up_offset) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("ckpt_ext::moe_experts", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            const std::optional<at::Tensor>&, c10::string_view, c10::string_view,
                            std::optional<double>, double)>();
  return op.call(x, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias,
                 activation, layout, limit, up_offset);
}

}  // namespace ckpt_ext
