// gated.cpp — the gated engine of gated.h: the forward keeps nothing but its output; the backward
// recomputes the gate and up projections (their GEMMs, as the forward ran them) and makes h, the
// gradients w.r.t. g and u in one pass over the buffers it already holds
// (docs/design.md, "Gated MLPs").
#include "gated.h"

#include <optional>

#include "primitives.h"
#include "stack.h"

namespace ckpt_ext {

namespace {

// The bias of each weight (nullopt where has_bias is false) and its index in `biases` (or -1).
struct Biases {
  std::vector<std::optional<at::Tensor>> of;
  std::vector<int64_t> slot;
};

Biases per_weight(at::TensorList biases, const std::vector<bool>& has_bias) {
  Biases b{std::vector<std::optional<at::Tensor>>(has_bias.size()),
           std::vector<int64_t>(has_bias.size(), -1)};
  int64_t j = 0;
  for (size_t i = 0; i < has_bias.size(); ++i) {
    if (!has_bias[i]) continue;
    b.slot[i] = j;
    b.of[i] = biases[j++];
  }
  return b;
}

// z = [g | u] (M, 2I): one GEMM with a gate_up weight, or the gate's and the up projection's
// GEMMs into the two column blocks of one buffer; each input projection's LoRA term added to its
// block (the gate_up weight's to the whole of z). `lora_t`, where given (one entry per weight),
// receives the a·Aᵀ of each term whose B gradient is asked. The backward's recompute runs this
// very call, so its z has the forward's bits.
at::Tensor gate_and_up(const at::Tensor& a, at::TensorList weights, const Biases& b,
                       const LoraLayers& lora, std::vector<at::Tensor>* lora_t = nullptr) {
  auto add_term = [&](const at::Tensor& block, size_t i) {
    const LoraTerm* term = lora_of(lora, i);
    if (term == nullptr) return;
    at::Tensor t = add_lora(block, a, *term);
    if (lora_t != nullptr && term->need_B) (*lora_t)[i] = std::move(t);
  };
  if (weights.size() == 2) {
    at::Tensor z = pre_activation(a, weights[0], b.of[0]);
    add_term(z, 0);
    return z;
  }
  const int64_t I = weights[0].size(0);
  at::Tensor z = new_buffer({a.size(0), 2 * I}, a.options());
  linear_into(z.narrow(1, 0, I), a, weights[0], b.of[0]);
  add_term(z.narrow(1, 0, I), 0);
  linear_into(z.narrow(1, I, I), a, weights[1], b.of[1]);
  add_term(z.narrow(1, I, I), 1);
  return z;
}

}  // namespace

at::Tensor gated_forward(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                         const std::vector<bool>& has_bias, Activation act,
                         const LoraLayers& lora) {
  const Biases b = per_weight(biases, has_bias);
  const at::Tensor& down = weights.back();
  const int64_t I = down.size(1);
  at::Tensor z = gate_and_up(flatten_rows(x), weights, b, lora);
  gated_in_place(z, act);  // h = f(g)·u in z's first I columns: the down GEMM reads them there
  const at::Tensor h = z.narrow(1, 0, I);
  at::Tensor y = pre_activation(h, down, b.of.back());
  if (const LoraTerm* term = lora_of(lora, weights.size() - 1)) add_lora(y, h, *term);
  return at::_unsafe_view(y, out_sizes(x, down.size(0)));  // not an autograd view (stack.cpp)
}

GatedGrads gated_backward(at::Tensor grad_out, at::Tensor x, at::TensorList weights,
                          at::TensorList biases, const std::vector<bool>& has_bias, bool need_x,
                          const std::vector<bool>& need_weights,
                          const std::vector<bool>& need_biases, Activation act,
                          const LoraLayers& lora) {
  const Biases b = per_weight(biases, has_bias);
  const int64_t L = static_cast<int64_t>(weights.size());
  const bool packed = L == 2;
  std::vector<bool> need_b(L, false);
  for (int64_t i = 0; i < L; ++i) need_b[i] = b.slot[i] >= 0 && need_biases[b.slot[i]];
  bool need_in = need_x;  // anything below h: the gate's and up's gradients are made
  for (int64_t i = 0; i + 1 < L; ++i) {
    const LoraTerm* term = lora_of(lora, i);
    need_in = need_in || need_weights[i] || need_b[i] || (term != nullptr && term->needs_any());
  }
  const LoraTerm* down_lora = lora_of(lora, L - 1);
  const bool need_down_w = need_weights[L - 1], need_down_b = need_b[L - 1];
  const bool need_down_sum = need_down_b || (down_lora != nullptr && down_lora->need_bias);
  const bool down_reads_h = need_down_w || (down_lora != nullptr && down_lora->reads_input());
  GatedGrads out;
  out.grad_weights.resize(L);
  out.grad_biases.resize(biases.size());
  out.lora = lora_grads_for(lora);
  if (!need_in && !down_reads_h && !need_down_sum) return out;

  const at::Tensor& down = weights.back();
  const int64_t I = down.size(1);
  at::Tensor a = flatten_rows(x);
  const int64_t M = a.size(0);
  const std::vector<int64_t> x_sizes = x.sizes().vec();
  x = at::Tensor();  // `a` is this function's reference to x from here
  at::Tensor gy = grad_out.reshape({M, down.size(0)});
  grad_out = at::Tensor();
  at::Tensor gy_sum;  // Σ gy: the down bias's gradient, and s·Σ gy its LoRA bias's
  if (need_down_sum) gy_sum = bias_grad(gy);
  if (need_down_b) out.grad_biases[b.slot[L - 1]] = gy_sum;
  if (!need_in && !down_reads_h) {
    if (down_lora != nullptr) lora_param_grads(gy, {}, {}, {}, gy_sum, *down_lora, out.lora);
    return out;
  }

  std::vector<at::Tensor> lora_t(L);  // the input projections' a·Aᵀ, where B's gradient is asked
  at::Tensor z = gate_and_up(a, weights, b, lora, &lora_t);
  if (!need_in) {  // only the down projection's parameters: h, then their GEMMs
    a = at::Tensor();
    gated_in_place(z, act);
    const at::Tensor h = z.narrow(1, 0, I);
    if (need_down_w) out.grad_weights[L - 1] = weight_grad(gy, h, down);
    if (down_lora != nullptr) lora_param_grads(gy, h, {}, {}, gy_sum, *down_lora, out.lora);
    return out;
  }
  at::Tensor gh = at::mm(gy, down);  // the gradient w.r.t. h, (M, I); becomes h
  at::Tensor down_gt;                // s·gy·B_down (M, r): the down LoRA term's share of gh
  if (down_lora != nullptr) {
    down_gt = lora_grad_t(gy, *down_lora);
    gh.addmm_(down_gt, down_lora->A);
  }
  gated_backward_(z, gh, act);       // z = [dg | du]
  if (need_down_w) out.grad_weights[L - 1] = weight_grad(gy, gh, down);
  if (down_lora != nullptr) {
    lora_param_grads(gy, gh, {}, std::move(down_gt), gy_sum, *down_lora, out.lora);
  }
  gy = at::Tensor();
  gh = at::Tensor();

  // The input projections, from dz = [dg | du]: one GEMM each with a gate_up weight, two without;
  // their LoRA terms' share of grad_x is s·dz·B (M, r) times A.
  const int64_t parts = packed ? 1 : 2, width = packed ? 2 * I : I;
  std::vector<at::Tensor> in_gt(parts);
  for (int64_t i = 0; i < parts; ++i) {
    const at::Tensor dz = packed ? z : z.narrow(1, i * I, width);
    const LoraTerm* term = lora_of(lora, i);
    at::Tensor dz_sum;
    if (need_b[i] || (term != nullptr && term->need_bias)) dz_sum = bias_grad(dz);
    if (need_b[i]) out.grad_biases[b.slot[i]] = dz_sum;
    if (need_weights[i]) out.grad_weights[i] = weight_grad(dz, a, weights[i]);
    if (term != nullptr) {
      if (need_x) in_gt[i] = lora_grad_t(dz, *term);
      lora_param_grads(dz, a, std::move(lora_t[i]), in_gt[i], dz_sum, *term, out.lora);
    }
  }
  a = at::Tensor();  // freed before grad_x exists
  if (need_x) {
    at::Tensor gx = at::mm(packed ? z : z.narrow(1, 0, I), weights[0]);
    if (!packed) gx.addmm_(z.narrow(1, I, I), weights[1]);
    for (int64_t i = 0; i < parts; ++i) {
      if (in_gt[i].defined()) gx.addmm_(in_gt[i], lora_of(lora, i)->A);
    }
    out.grad_x = gx.view(x_sizes);
  }
  return out;
}

}  // namespace ckpt_ext
