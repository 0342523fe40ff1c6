// checks.h — the supported dtypes and every input check of the ckpt_ext ops, written once: the
// eager kernels, the Meta kernels (FakeTensor, torch.compile) and ckpt_ext._C.SUPPORTED_DTYPES
// all use these. Sizes are read as SymInts so the Meta kernels trace dynamic shapes.
// Shapes: x (..., K), weight (N, K), bias (N), grad_out and output (..., N); a stack's weights[i]
// (N_i, K_i) with K_0 = x.shape[-1], K_i = N_{i-1}. A failed check throws ValueError (shapes,
// ranks, devices) or TypeError (dtypes) naming expected and given values, "ckpt_ext.<op>: ...".
#pragma once

#include <ATen/ATen.h>

#include "activations.h"
#include "lora.h"
#include "moe.h"

#include <optional>
#include <string>
#include <vector>

namespace ckpt_ext {

// The dtypes the ops accept, in the order the messages list them.
const std::vector<at::ScalarType>& supported_dtypes();
bool is_supported_dtype(at::ScalarType t);
// "float32, float64, bfloat16 or float16", from supported_dtypes().
std::string supported_dtypes_text();

// The activations the mlp op takes, in Activation's order ("tanh", "gelu", ...), and the one
// `name` names: a ValueError listing them all for any other name.
const std::vector<std::string>& activation_names();
Activation parse_activation(const char* op, c10::string_view name);
// The op's activation argument: one name for every layer, or comma-separated names, one per layer
// with an activation (`layers`, or layers − 1 without the last). One entry per layer (layers ≥ 1);
// without the last activation the top entry is a copy, never applied.
std::vector<Activation> parse_activations(const char* op, c10::string_view spec, size_t layers,
                                          bool last_activation);

// One layer: x at least 1-D, weight 2-D with weight.shape[1] == x.shape[-1], bias (N) or None;
// x of a supported dtype, the others of x's dtype and on x's device.
void check_linear_tanh_inputs(const char* op, const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias);
// grad_out must have shape x.shape[:-1] + (out_features,), x's dtype and device.
void check_grad_out(const char* op, const at::Tensor& grad_out, const at::Tensor& x,
                    c10::SymInt out_features);
// A stack: at least one weight; weights[i] 2-D with in_features = the previous layer's
// out_features; biases[j] belongs to the j-th layer whose has_bias is true and has length N_i;
// one dtype and one device. Messages name the layer index.
void check_stack_inputs(const char* op, const at::Tensor& x, at::TensorList weights,
                           at::TensorList biases, const std::vector<bool>& has_bias);
// need_weights: one entry per weight; need_biases: one per entry of biases.
void check_stack_masks(const char* op, at::TensorList weights, at::TensorList biases,
                          const std::vector<bool>& need_weights,
                          const std::vector<bool>& need_biases);

// A gated MLP: weights [gate (I, K), up (I, K), down (N, I)] or [gate_up (2I, K), down (N, I)]
// (the gate's rows first); has_bias one entry per weight, biases those that exist, each of its
// weight's out_features; one dtype and one device. Messages name the public arguments
// (gate_weight, ..., down_bias) with their position in the op's lists.
void check_gated_inputs(const char* op, const at::Tensor& x, at::TensorList weights,
                        at::TensorList biases, const std::vector<bool>& has_bias);

// The LoRA terms of a lora op (lora.h's LoraArgs), after its weights' checks: has_lora one entry
// per weight; A, B, scaling and has_bias one entry per LoRA; biases one per LoRA whose has_bias
// is true. Each term on a weight (N, K): A (r, K), B (N, r) with A's r, bias (N); x's dtype and
// device. Messages name the public lora=[...] entries: "lora[1].B" of a stack (its weights
// "weights[1]"), "lora[0] (gate).A" of a gated MLP (its weights as check_gated_inputs names them).
void check_lora_stack_inputs(const char* op, const at::Tensor& x, at::TensorList weights,
                             const LoraArgs& lora);
void check_lora_gated_inputs(const char* op, const at::Tensor& x, at::TensorList weights,
                             const LoraArgs& lora);
// masks.A and masks.B: one entry per LoRA; masks.lora_biases: one per LoRA bias.
void check_lora_masks(const char* op, const LoraArgs& lora, const LoraBackwardMasks& masks);

// The experts of a mixture of experts (moe.h): x (..., H); top_k_index (int64 or int32) and
// top_k_weights (a supported dtype, not necessarily x's) of one shape (..., K) over x's leading
// dimensions; gate_up and down 3-D as `layout` stores them, of E >= 1 experts, the hidden size
// H and one intermediate size I (gate_up's outputs even when gated); the biases (E, outputs);
// limit > 0 and up_offset only with a gated layout; every tensor on x's device, the weights and
// biases of x's dtype.
void check_moe_inputs(const char* op, const at::Tensor& x, const at::Tensor& top_k_index,
                      const at::Tensor& top_k_weights, const at::Tensor& gate_up,
                      const at::Tensor& down, const std::optional<at::Tensor>& gate_up_bias,
                      const std::optional<at::Tensor>& down_bias, MoeLayout layout,
                      std::optional<double> limit, double up_offset);

// An optional argument that must match `like` in shape, dtype and device (a gradient flowing
// into a first-order result, or the output t, like grad_out).
void check_like(const char* op, const char* name, const std::optional<at::Tensor>& t,
                const at::Tensor& like, const char* like_name);
// The inputs of a second-order op: the layer's (no bias), grad_out, and grad_grad_x (like x),
// grad_grad_weight (like weight), grad_grad_bias (N).
void check_second_order_inputs(const char* op, const std::optional<at::Tensor>& ggx,
                               const std::optional<at::Tensor>& ggw,
                               const std::optional<at::Tensor>& ggb, const at::Tensor& grad_out,
                               const at::Tensor& x, const at::Tensor& weight);

// linear_tanh_backward_from_output: the layer's inputs, grad_out, and output like grad_out.
void check_from_output_inputs(const at::Tensor& grad_out, const at::Tensor& x,
                              const at::Tensor& output, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias);
// linear_tanh_backward_from_output_backward: a second-order op's inputs (no bias), and output.
void check_from_output_backward_inputs(const std::optional<at::Tensor>& ggx,
                                       const std::optional<at::Tensor>& ggw,
                                       const std::optional<at::Tensor>& ggb,
                                       const at::Tensor& grad_out, const at::Tensor& x,
                                       const at::Tensor& output, const at::Tensor& weight);
// linear_tanh_backward_from_output_double_backward: those, and u_* like the results they are
// the gradients of (u_grad_grad_out and u_grad_output like grad_out, u_grad_x like x, u_grad_weight
// like weight).
void check_third_order_inputs(const std::optional<at::Tensor>& ggx,
                              const std::optional<at::Tensor>& ggw,
                              const std::optional<at::Tensor>& ggb, const at::Tensor& grad_out,
                              const at::Tensor& x, const at::Tensor& output,
                              const at::Tensor& weight, const std::optional<at::Tensor>& u_gy,
                              const std::optional<at::Tensor>& u_x,
                              const std::optional<at::Tensor>& u_t,
                              const std::optional<at::Tensor>& u_w);

}  // namespace ckpt_ext
