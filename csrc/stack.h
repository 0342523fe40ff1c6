// stack.h — the stack engine: one implementation of a stack of Linear layers with an activation,
// forward and recomputing backward, on every device, behind the mlp and lora_mlp ops (ops.cpp,
// lora_ops.cpp); a layer may carry a LoRA term (lora.h).
// Shapes: x (..., K_0); weights[i] (N_i, K_i), K_i = N_{i-1}; `biases` holds only the layers'
// biases that exist (has_bias[i]), each (N_i); inside, x is flattened to (M, K_0) and every
// activation buffer is (M, N_i) contiguous. GEMMs through ATen, elementwise passes the
// primitives of primitives.h. The memory schedule is in docs/design.md, "The stack engine".
#pragma once

#include <ATen/ATen.h>

#include "activations.h"
#include "lora.h"

#include <optional>
#include <vector>

namespace ckpt_ext {

// x (..., K) as (M, K), M = prod(x.shape[:-1]): a view where possible. Spelled out rather than
// reshape({-1, K}), which cannot infer M when K == 0 (nn.Linear allows in_features = 0).
at::Tensor flatten_rows(const at::Tensor& x);

// z = a (M, K) · weightᵀ + bias into a new (M, N) contiguous buffer, by one GEMM (addmm with the
// bias, so z is rounded to the storage type once, as in F.linear). The forward and the recompute
// in backward both use it, so the recomputed z equals the forward's to the bit.
at::Tensor pre_activation(const at::Tensor& a, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias);
// The same GEMM into `out` (M, N), which may be a column block of a wider buffer (row stride
// above N): the gated engine writes the gate's and the up projection's z side by side.
void linear_into(const at::Tensor& out, const at::Tensor& a, const at::Tensor& weight,
                 const std::optional<at::Tensor>& bias);

// The gradient gᵀ·a (N, K) of a weight (N, K), for its output's gradient g (M, N) and its input
// a (M, K), in the weight's layout: a weight that is the transpose of a contiguous (K, N) tensor
// (transformers' Conv1D stores x·W + b so) gets (aᵀ·g)ᵀ, so that the stored tensor's gradient is
// contiguous and autograd accumulates it without a copy. empty_weight_grad: the Meta kernels'.
at::Tensor weight_grad(const at::Tensor& g, const at::Tensor& a, const at::Tensor& weight);
at::Tensor empty_weight_grad(const at::Tensor& weight, const at::TensorOptions& options);

// The Meta kernels' outputs, sizes read as SymInts so dynamic shapes trace: (..., N) of x's
// leading dimensions and `out_features`; and the gradients asked for (need[i]) of the tensors
// ts, in order, in empty_weight_grad's layout when `weights`, else of ts[i]'s shape.
at::Tensor empty_output(const at::Tensor& x, const c10::SymInt& out_features);
std::vector<at::Tensor> empty_asked(at::TensorList ts, const std::vector<bool>& need,
                                    const at::TensorOptions& options, bool weights);

// (..., N): x's leading dimensions and `out_features`.
std::vector<int64_t> out_sizes(const at::Tensor& x, int64_t out_features);

// Only the gradients asked for, in order (the schemas' compact result lists).
std::vector<at::Tensor> asked(std::vector<at::Tensor>&& grads, const std::vector<bool>& need);

// Returns the output, (..., N_{L-1}), a fresh tensor (not a view of an internal buffer).
// acts[i] after layer i (one per layer; after the last only when last_act). lora: one term (or
// none) per layer, or empty: none anywhere.
at::Tensor stack_forward(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                         const std::vector<bool>& has_bias, bool last_act,
                         const std::vector<Activation>& acts, const LoraLayers& lora = {});

struct StackGrads {
  at::Tensor grad_x;                     // undefined when not asked for
  std::vector<at::Tensor> grad_weights;  // one per weight; undefined where not asked for
  std::vector<at::Tensor> grad_biases;   // one per entry of `biases`; undefined where not asked
  LoraGrads lora;                        // the LoRA terms' (their need_* say which); else empty
};
// grad_out and x are taken by value: this function drops its reference to grad_out right after
// the top layer's elementwise pass (before any GEMM allocates), and to x right after the last GEMM
// that reads it (before grad_x is allocated). A caller that moves its only references in (the
// autograd node, autograd_node.cpp) lets them be freed there, as plain autograd frees the
// gradient after the top activation's backward. The ops pass copies: their caller's tensors live
// on.
StackGrads stack_backward(at::Tensor grad_out, at::Tensor x, at::TensorList weights,
                          at::TensorList biases, const std::vector<bool>& has_bias, bool last_act,
                          bool need_x, const std::vector<bool>& need_weights,
                          const std::vector<bool>& need_biases,
                          const std::vector<Activation>& acts, const LoraLayers& lora = {});

}  // namespace ckpt_ext
