// gated.h — the gated engine: a gated MLP y = down(f(gate(x)) · up(x)) (SwiGLU, GeGLU, any
// activation of activations.h), forward and recomputing backward, on every device, behind the
// gated_mlp and lora_gated_mlp ops (gated_ops.cpp, lora_ops.cpp); each weight may carry a LoRA
// term (lora.h).
// Shapes: x (..., K); weights [gate (I, K), up (I, K), down (N, I)] or [gate_up (2I, K), down
// (N, I)] (one weight holding the gate's rows, then the up projection's); `biases` holds only the
// biases that exist (has_bias, one entry per weight). Inside, x is (M, K) and the gate's and the
// up projection's pre-activations share one (M, 2I) buffer, [g | u] per row. The memory schedule:
// docs/design.md, "Gated MLPs".
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "activations.h"
#include "lora.h"

namespace ckpt_ext {

// Returns y (..., N), a fresh tensor. lora: one term (or none) per weight, or empty: none.
at::Tensor gated_forward(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                         const std::vector<bool>& has_bias, Activation act,
                         const LoraLayers& lora = {});

struct GatedGrads {
  at::Tensor grad_x;                     // undefined when not asked for
  std::vector<at::Tensor> grad_weights;  // one per weight; undefined where not asked for
  std::vector<at::Tensor> grad_biases;   // one per entry of `biases`; undefined where not asked
  LoraGrads lora;                        // the LoRA terms' (their need_* say which); else empty
};
// grad_out and x by value, as stack_backward takes them (stack.h): the references are dropped as
// soon as their last reader is done.
GatedGrads gated_backward(at::Tensor grad_out, at::Tensor x, at::TensorList weights,
                          at::TensorList biases, const std::vector<bool>& has_bias, bool need_x,
                          const std::vector<bool>& need_weights,
                          const std::vector<bool>& need_biases, Activation act,
                          const LoraLayers& lora = {});

}  // namespace ckpt_ext
