// lora.cpp — the LoRA term of lora.h: its forward in peft's order and its backward GEMMs (ATen
// mm/addmm on every device; no elementwise pass of its own beyond two scalings and one add).
#include "lora.h"

#include "stack.h"

namespace ckpt_ext {

LoraArgs lora_args(at::TensorList A, at::TensorList B, at::TensorList biases,
                   const c10::List<bool>& has_lora, const c10::List<bool>& has_bias,
                   c10::ArrayRef<double> scaling) {
  return {A, B, biases, has_lora.vec(), has_bias.vec(), scaling};
}

LoraLayers lora_layers(const LoraArgs& args) {
  LoraLayers out(args.has_lora.size());
  int64_t j = 0, k = 0;  // indices into the per-LoRA lists and into the biases
  for (size_t i = 0; i < args.has_lora.size(); ++i) {
    if (!args.has_lora[i]) continue;
    LoraTerm t{args.A[j], args.B[j], std::nullopt, args.scaling[j], j, -1};
    if (args.has_bias[j]) {
      t.bias = args.biases[k];
      t.bias_slot = k++;
    }
    out[i] = std::move(t);
    ++j;
  }
  return out;
}

const LoraTerm* lora_of(const LoraLayers& lora, size_t i) {
  return i < lora.size() && lora[i].has_value() ? &*lora[i] : nullptr;
}

void ask_lora(LoraLayers& lora, const LoraBackwardMasks& masks) {
  for (auto& t : lora) {
    if (!t.has_value()) continue;
    t->need_A = masks.A[t->slot];
    t->need_B = masks.B[t->slot];
    t->need_bias = t->bias_slot >= 0 && masks.lora_biases[t->bias_slot];
  }
}

at::Tensor add_lora(const at::Tensor& z, const at::Tensor& a, const LoraTerm& term) {
  // F.linear(F.linear(a, A), B, b_B) * s, then z + that: peft's `result + lora_B(lora_A(x)) *
  // scaling` op for op, so that each intermediate is rounded where peft rounds it.
  at::Tensor t = at::mm(a, term.A.t());
  at::Tensor l = term.bias.has_value() ? at::addmm(*term.bias, t, term.B.t())
                                       : at::mm(t, term.B.t());
  l.mul_(term.scaling);
  at::Tensor acc = z;  // add_ takes a mutable handle; the storage is z's
  acc.add_(l);
  return t;
}

LoraGrads lora_grads_for(const LoraLayers& lora) {
  size_t terms = 0, biases = 0;
  for (const auto& t : lora) {
    terms += t.has_value();
    biases += t.has_value() && t->bias.has_value();
  }
  LoraGrads g;
  g.A.resize(terms);
  g.B.resize(terms);
  g.biases.resize(biases);
  return g;
}

at::Tensor lora_grad_t(const at::Tensor& g, const LoraTerm& term) {
  return at::mm(g, term.B).mul_(term.scaling);
}

void lora_param_grads(const at::Tensor& g, const at::Tensor& a, at::Tensor t, at::Tensor gt,
                      const at::Tensor& g_sum, const LoraTerm& term, LoraGrads& out) {
  if (term.need_A) {
    if (!gt.defined()) gt = lora_grad_t(g, term);
    out.A[term.slot] = weight_grad(gt, a, term.A);
  }
  if (term.need_B) {
    // s scales the (M, r) factor, not the (M, N) one: the gradient of B is gᵀ·(s·t).
    at::Tensor st = t.defined() ? t.mul(term.scaling) : at::mm(a, term.A.t()).mul_(term.scaling);
    out.B[term.slot] = weight_grad(g, st, term.B);
  }
  if (term.need_bias) out.biases[term.bias_slot] = g_sum.mul(term.scaling);
}

}  // namespace ckpt_ext
