// stack.cpp — the stack engine of stack.h: forward, and backward that recomputes the stack once
// and walks it back freeing each buffer as soon as it is used (docs/design.md, "The stack engine").
#include "stack.h"

#include "primitives.h"

namespace ckpt_ext {

at::Tensor flatten_rows(const at::Tensor& x) {
  int64_t m = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) m *= x.size(d);
  return x.reshape({m, x.size(-1)});
}

void linear_into(const at::Tensor& dst, const at::Tensor& a, const at::Tensor& weight,
                 const std::optional<at::Tensor>& bias) {
  at::Tensor out = dst;  // the _out ops take a mutable handle; the storage is dst's
  if (bias.has_value()) {
    at::addmm_out(out, *bias, a, weight.t());
  } else {
    at::mm_out(out, a, weight.t());
  }
}

at::Tensor pre_activation(const at::Tensor& a, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias) {
  at::Tensor out = new_buffer({a.size(0), weight.size(0)}, a.options());
  linear_into(out, a, weight, bias);
  return out;
}

namespace {

bool transposed_layout(const at::Tensor& weight) {
  return !weight.is_contiguous() && weight.t().is_contiguous();
}

}  // namespace

at::Tensor weight_grad(const at::Tensor& g, const at::Tensor& a, const at::Tensor& weight) {
  return transposed_layout(weight) ? at::mm(a.t(), g).t() : at::mm(g.t(), a);
}

at::Tensor empty_weight_grad(const at::Tensor& weight, const at::TensorOptions& options) {
  if (transposed_layout(weight)) {
    return at::empty_symint({weight.sym_size(1), weight.sym_size(0)}, options).t();
  }
  return at::empty_symint(weight.sym_sizes(), options);
}

at::Tensor empty_output(const at::Tensor& x, const c10::SymInt& out_features) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end() - 1);
  shape.push_back(out_features);
  return at::empty_symint(shape, x.options());
}

std::vector<at::Tensor> empty_asked(at::TensorList ts, const std::vector<bool>& need,
                                    const at::TensorOptions& options, bool weights) {
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < ts.size(); ++i) {
    if (!need[i]) continue;
    out.push_back(weights ? empty_weight_grad(ts[i], options)
                          : at::empty_symint(ts[i].sym_sizes(), options));
  }
  return out;
}

std::vector<int64_t> out_sizes(const at::Tensor& x, int64_t out_features) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(out_features);
  return shape;
}

namespace {

// The bias of each layer (nullopt where has_bias is false), from the compact `biases` list.
std::vector<std::optional<at::Tensor>> layer_biases(at::TensorList biases,
                                                    const std::vector<bool>& has_bias) {
  std::vector<std::optional<at::Tensor>> out(has_bias.size());
  size_t j = 0;
  for (size_t i = 0; i < has_bias.size(); ++i) {
    if (has_bias[i]) out[i] = biases[j++];
  }
  return out;
}

// z = a·Wᵀ + b of one layer into a new (M, N) buffer, plus its LoRA term where it has one (`t`,
// where given, receives that term's a·Aᵀ). The forward and the recompute both make z here, so
// the recomputed z has the forward's bits.
at::Tensor layer_pre_activation(const at::Tensor& a, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias, const LoraTerm* lora,
                                at::Tensor* t = nullptr) {
  at::Tensor z = pre_activation(a, weight, bias);
  if (lora != nullptr) {
    at::Tensor lora_t = add_lora(z, a, *lora);
    if (t != nullptr) *t = std::move(lora_t);
  }
  return z;
}

}  // namespace

std::vector<at::Tensor> asked(std::vector<at::Tensor>&& grads, const std::vector<bool>& need) {
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (need[i]) out.push_back(std::move(grads[i]));
  }
  return out;
}

at::Tensor stack_forward(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                         const std::vector<bool>& has_bias, bool last_act,
                         const std::vector<Activation>& acts, const LoraLayers& lora) {
  const auto b = layer_biases(biases, has_bias);
  const int64_t L = static_cast<int64_t>(weights.size());
  at::Tensor a = flatten_rows(x);
  for (int64_t i = 0; i < L; ++i) {
    // (M, N_i), the only new buffer of N_i columns
    at::Tensor z = layer_pre_activation(a, weights[i], b[i], lora_of(lora, i));
    if (i + 1 < L || last_act) activation_in_place(z, acts[i]);
    a = std::move(z);  // the previous layer's output is freed here
  }
  // _unsafe_view: the result must not be an autograd view of an internal buffer, or in-place ops
  // on the output (`y += residual`, Dropout(inplace=True)) are refused by autograd.
  return at::_unsafe_view(a, out_sizes(x, weights[L - 1].size(0)));
}

namespace {

// What a backward pass is asked for, per layer.
struct Asked {
  std::vector<bool> need_bias;     // layer i has a bias and its gradient is asked for
  std::vector<int64_t> bias_slot;  // its index in `biases`, or -1
  int64_t lo;                      // the lowest layer whose backward runs; L: none
};

Asked asked_of(int64_t L, const std::vector<bool>& has_bias, bool need_x,
               const std::vector<bool>& need_weights, const std::vector<bool>& need_biases,
               const LoraLayers& lora) {
  Asked a{std::vector<bool>(L, false), std::vector<int64_t>(L, -1), need_x ? 0 : L};
  for (int64_t i = 0, j = 0; i < L; ++i) {
    if (has_bias[i]) {
      a.bias_slot[i] = j;
      a.need_bias[i] = need_biases[j++];
    }
  }
  for (int64_t i = 0; i < L && a.lo == L; ++i) {
    const LoraTerm* term = lora_of(lora, i);
    if (need_weights[i] || a.need_bias[i] || (term != nullptr && term->needs_any())) a.lo = i;
  }
  return a;
}

}  // namespace

StackGrads stack_backward(at::Tensor grad_out, at::Tensor x, at::TensorList weights,
                          at::TensorList biases, const std::vector<bool>& has_bias, bool last_act,
                          bool need_x, const std::vector<bool>& need_weights,
                          const std::vector<bool>& need_biases,
                          const std::vector<Activation>& acts, const LoraLayers& lora) {
  const auto b = layer_biases(biases, has_bias);
  const int64_t L = static_cast<int64_t>(weights.size());
  const Asked asked = asked_of(L, has_bias, need_x, need_weights, need_biases, lora);
  const int64_t lo = asked.lo;
  StackGrads out;
  out.grad_weights.resize(L);
  out.grad_biases.resize(biases.size());
  out.lora = lora_grads_for(lora);
  if (lo == L) return out;  // nothing asked for

  // Recompute the layers with an activation (all, or all but the top without last_act). held[i],
  // for i >= lo, is what layer i's backward pass starts from: t_i = f(z_i) where the primitives
  // take the derivative from the output and t_i is also the next layer's input (it is kept
  // anyway); z_i otherwise, and a_{i+1} = f(z_i) is made again, into a buffer of its own, where a
  // GEMM reads it. a_lo, the input of the lowest layer asked for, is kept.
  const int64_t top = last_act ? L : L - 1;
  std::vector<at::Tensor> held(L);
  std::vector<bool> holds_output(L, false);  // held[i] is t_i (else z_i)
  // lora_t[i]: a_i·A_iᵀ of layer i's LoRA term, kept from the recompute where B's gradient is
  // asked (M × r: small); the top layer without an activation makes its own in the walk.
  std::vector<at::Tensor> lora_t(L);
  at::Tensor a = flatten_rows(x);
  const int64_t M = a.size(0);
  const std::vector<int64_t> x_sizes = x.sizes().vec();
  x = at::Tensor();  // from here `a` (then a_lo, if it is x) is this function's reference to x
  at::Tensor a_lo = lo == 0 ? a : at::Tensor();
  for (int64_t i = 0; i < top; ++i) {
    const LoraTerm* term = lora_of(lora, i);
    const bool keep_t = i >= lo && term != nullptr && term->need_B;
    at::Tensor z = layer_pre_activation(a, weights[i], b[i], term, keep_t ? &lora_t[i] : nullptr);
    // a_{i+1} is read by the recompute (layer i+1's input) or kept as a_lo.
    const bool makes_input = i + 1 < top || i + 1 == lo;
    if (i < lo) {  // below the layers asked for: only its output matters (makes_input holds)
      activation_in_place(z, acts[i]);
      if (i + 1 == lo) a_lo = z;
      a = std::move(z);
    } else if (i + 1 < L && backward_from_output(acts[i])) {
      activation_in_place(z, acts[i]);
      holds_output[i] = true;
      held[i] = z;
      a = std::move(z);
    } else {
      if (makes_input) {
        at::Tensor next = new_buffer(z.sizes(), z.options());
        activation_to(z, next, acts[i]);
        a = std::move(next);
      }
      held[i] = std::move(z);
    }
  }
  a = at::Tensor();

  // grad: the gradient w.r.t. the current layer's output, (M, N_i); starts as grad_out (a view
  // where possible: out.mean() gives strides (0, 0), which the primitives read as they are).
  // From here `grad` is this function's only reference to the incoming gradient, so dropping it
  // below frees it when the caller handed over its own (see stack_backward in stack.h).
  at::Tensor grad = grad_out.reshape({M, weights[L - 1].size(0)});
  grad_out = at::Tensor();
  for (int64_t i = L - 1; i >= lo; --i) {
    const LoraTerm* term = lora_of(lora, i);
    at::Tensor g;  // the gradient w.r.t. z_i
    at::Tensor grad_b;  // Σ g: the bias's gradient, and s_i·Σ g the LoRA bias's
    const bool need_bias = asked.need_bias[i];
    const bool need_sum = need_bias || (term != nullptr && term->need_bias);
    if (i == top) {  // the top layer without an activation
      g = std::move(grad);
      if (need_sum) grad_b = bias_grad(g);
    } else {
      g = std::move(held[i]);  // z_i or t_i becomes g in place
      grad_b = holds_output[i] ? activation_backward_from_output_(g, grad, acts[i], need_sum)
                               : activation_backward_(g, grad, acts[i], need_sum);
      grad = at::Tensor();  // freed before the GEMMs allocate (if nobody else holds it)
    }
    if (need_bias) out.grad_biases[asked.bias_slot[i]] = grad_b;
    const bool need_below = i > lo || need_x;
    at::Tensor a_i;  // the layer's input, as the forward made it, where a GEMM reads it
    if (need_weights[i] || (term != nullptr && term->reads_input())) {
      a_i = a_lo;
      if (i > lo && holds_output[i - 1]) {
        a_i = held[i - 1];
      } else if (i > lo) {
        a_i = new_buffer(held[i - 1].sizes(), held[i - 1].options());
        activation_to(held[i - 1], a_i, acts[i - 1]);
      }
    }
    if (need_weights[i]) out.grad_weights[i] = weight_grad(g, a_i, weights[i]);
    at::Tensor lora_gt;  // s·g·B (M, r), the LoRA term's share of the gradient below
    if (term != nullptr) {
      if (need_below) lora_gt = lora_grad_t(g, *term);
      lora_param_grads(g, a_i, std::move(lora_t[i]), lora_gt, grad_b, *term, out.lora);
    }
    a_i = at::Tensor();
    if (i == lo) a_lo = at::Tensor();  // its last reader is done: freed before grad_x exists
    if (need_below) {
      grad = at::mm(g, weights[i]);  // (M, K_i)
      if (lora_gt.defined()) grad.addmm_(lora_gt, term->A);
    }
  }
  if (need_x) out.grad_x = grad.view(x_sizes);
  return out;
}

}  // namespace ckpt_ext
