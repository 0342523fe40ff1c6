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
// GEMMs into the two column blocks of one buffer. The backward's recompute runs this very call,
// so its z has the forward's bits.
at::Tensor gate_and_up(const at::Tensor& a, at::TensorList weights, const Biases& b) {
  if (weights.size() == 2) return pre_activation(a, weights[0], b.of[0]);
  const int64_t I = weights[0].size(0);
  at::Tensor z = new_buffer({a.size(0), 2 * I}, a.options());
  linear_into(z.narrow(1, 0, I), a, weights[0], b.of[0]);
  linear_into(z.narrow(1, I, I), a, weights[1], b.of[1]);
  return z;
}

}  // namespace

at::Tensor gated_forward(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                         const std::vector<bool>& has_bias, Activation act) {
  const Biases b = per_weight(biases, has_bias);
  const at::Tensor& down = weights.back();
  const int64_t I = down.size(1);
  at::Tensor z = gate_and_up(flatten_rows(x), weights, b);
  gated_in_place(z, act);  // h = f(g)·u in z's first I columns: the down GEMM reads them there
  at::Tensor y = pre_activation(z.narrow(1, 0, I), down, b.of.back());
  return at::_unsafe_view(y, out_sizes(x, down.size(0)));  // not an autograd view (stack.cpp)
}

GatedGrads gated_backward(at::Tensor grad_out, at::Tensor x, at::TensorList weights,
                          at::TensorList biases, const std::vector<bool>& has_bias, bool need_x,
                          const std::vector<bool>& need_weights,
                          const std::vector<bool>& need_biases, Activation act) {
  const Biases b = per_weight(biases, has_bias);
  const int64_t L = static_cast<int64_t>(weights.size());
  const bool packed = L == 2;
  std::vector<bool> need_b(L, false);
  for (int64_t i = 0; i < L; ++i) need_b[i] = b.slot[i] >= 0 && need_biases[b.slot[i]];
  bool need_in = need_x;  // anything below h: the gate's and up's gradients are made
  for (int64_t i = 0; i + 1 < L; ++i) need_in = need_in || need_weights[i] || need_b[i];
  const bool need_down_w = need_weights[L - 1], need_down_b = need_b[L - 1];
  GatedGrads out;
  out.grad_weights.resize(L);
  out.grad_biases.resize(biases.size());
  if (!need_in && !need_down_w && !need_down_b) return out;

  const at::Tensor& down = weights.back();
  const int64_t I = down.size(1);
  at::Tensor a = flatten_rows(x);
  const int64_t M = a.size(0);
  const std::vector<int64_t> x_sizes = x.sizes().vec();
  x = at::Tensor();  // `a` is this function's reference to x from here
  at::Tensor gy = grad_out.reshape({M, down.size(0)});
  grad_out = at::Tensor();
  if (need_down_b) out.grad_biases[b.slot[L - 1]] = bias_grad(gy);
  if (!need_in && !need_down_w) return out;

  at::Tensor z = gate_and_up(a, weights, b);
  if (!need_in) {  // only the down projection's weight: h, then its GEMM
    a = at::Tensor();
    gated_in_place(z, act);
    out.grad_weights[L - 1] = weight_grad(gy, z.narrow(1, 0, I), down);
    return out;
  }
  at::Tensor gh = at::mm(gy, down);  // the gradient w.r.t. h, (M, I); becomes h
  gated_backward_(z, gh, act);       // z = [dg | du]
  if (need_down_w) out.grad_weights[L - 1] = weight_grad(gy, gh, down);
  gy = at::Tensor();
  gh = at::Tensor();

  // The input projections, from dz = [dg | du]: one GEMM each with a gate_up weight, two without.
  const int64_t parts = packed ? 1 : 2, width = packed ? 2 * I : I;
  for (int64_t i = 0; i < parts; ++i) {
    const at::Tensor dz = packed ? z : z.narrow(1, i * I, width);
    if (need_b[i]) out.grad_biases[b.slot[i]] = bias_grad(dz);
    if (need_weights[i]) out.grad_weights[i] = weight_grad(dz, a, weights[i]);
  }
  a = at::Tensor();  // freed before grad_x exists
  if (need_x) {
    at::Tensor gx = at::mm(packed ? z : z.narrow(1, 0, I), weights[0]);
    if (!packed) gx.addmm_(z.narrow(1, I, I), weights[1]);
    out.grad_x = gx.view(x_sizes);
  }
  return out;
}

}  // namespace ckpt_ext
