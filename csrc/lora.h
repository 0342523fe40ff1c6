// lora.h — the LoRA term of a Linear, z = a·Wᵀ + b + s·((a·Aᵀ)·Bᵀ + b_B) (peft's vanilla LoRA
// without dropout): its forward in peft's order of operations and its backward GEMMs, for the
// stack and gated engines (stack.cpp, gated.cpp); the per-weight terms from the lora ops' lists.
// Shapes: a (M, K), the Linear's input; A (r, K), B (N, r), b_B (N) or none; z and g (M, N);
// t = a·Aᵀ and gt = s·g·B (M, r). The design: docs/design.md, "LoRA".
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace ckpt_ext {

// The lora ops' LoRA arguments, the six lists of their schemas (lora_A, lora_B, lora_biases,
// has_lora, has_lora_bias, lora_scaling; schemas.cpp) as one value that the kernels pass on:
// has_lora one entry per weight; A, B, scaling and has_bias one entry per weight with a LoRA, in
// weight order; biases those of the LoRAs whose has_bias is true. A, B, biases and scaling point
// into the lists it was made from.
struct LoraArgs {
  at::TensorList A, B, biases;
  std::vector<bool> has_lora, has_bias;
  c10::ArrayRef<double> scaling;
};
// From the lists as the dispatcher passes them.
LoraArgs lora_args(at::TensorList A, at::TensorList B, at::TensorList biases,
                   const c10::List<bool>& has_lora, const c10::List<bool>& has_bias,
                   c10::ArrayRef<double> scaling);

// What a lora backward op is asked for, its schema's need_x, need_weights, need_biases (as
// mlp_backward's), need_lora_A and need_lora_B (one per LoRA), need_lora_biases (one per LoRA
// bias).
struct LoraBackwardMasks {
  bool x;
  std::vector<bool> weights, biases, A, B, lora_biases;
};

struct LoraTerm {
  at::Tensor A, B;
  std::optional<at::Tensor> bias;
  double scaling;
  int64_t slot;       // its index in the op's A, B and scaling lists
  int64_t bias_slot;  // its bias's index in the op's biases list, or -1
  // What the running backward asks for (ask_lora); false in the forward.
  bool need_A = false, need_B = false, need_bias = false;
  // The input a is read: A's gradient is gtᵀ·a, B's is gᵀ·(s·a·Aᵀ).
  bool reads_input() const { return need_A || need_B; }
  bool needs_any() const { return need_A || need_B || need_bias; }
};

// One entry per weight (nullopt: no LoRA on it); empty: no LoRA anywhere (the mlp and gated_mlp
// ops). Entry i of `args.has_lora` says whether weight i has one (the checks have run).
using LoraLayers = std::vector<std::optional<LoraTerm>>;
LoraLayers lora_layers(const LoraArgs& args);
// The term of weight i, or nullptr.
const LoraTerm* lora_of(const LoraLayers& lora, size_t i);
// Set what a backward is asked for (masks.A, masks.B, masks.lora_biases).
void ask_lora(LoraLayers& lora, const LoraBackwardMasks& masks);

// z += s·((a·Aᵀ)·Bᵀ + b_B), in peft's order: t = a·Aᵀ (one GEMM), l = t·Bᵀ + b_B (one addmm, as
// F.linear), l·s, then z + l·s, each rounded to the storage type as peft's ops round it. z may be
// a column block of a wider buffer. Returns t (M, r).
at::Tensor add_lora(const at::Tensor& z, const at::Tensor& a, const LoraTerm& term);

// The LoRA gradients in the op's list order: one per LoRA (A, B), one per LoRA bias; undefined
// where not asked for.
struct LoraGrads {
  std::vector<at::Tensor> A, B, biases;
};
LoraGrads lora_grads_for(const LoraLayers& lora);

// gt = s·(g·B) (M, r): the gradient w.r.t. t, from g = ∂L/∂z (M, N). The input's share of the
// gradient is gt·A (the caller adds it to g·W).
at::Tensor lora_grad_t(const at::Tensor& g, const LoraTerm& term);
// The term's parameter gradients where asked, into out: grad_A = gtᵀ·a (gt: given, or made here
// when undefined), grad_B = gᵀ·(s·t) with t = a·Aᵀ (given where the recompute kept it, or made
// here from a), grad_b_B = s·Σg from g_sum = Σg (the column sums the caller made for the bias).
// Each in its tensor's layout (weight_grad, stack.h).
void lora_param_grads(const at::Tensor& g, const at::Tensor& a, at::Tensor t, at::Tensor gt,
                      const at::Tensor& g_sum, const LoraTerm& term, LoraGrads& out);

}  // namespace ckpt_ext
