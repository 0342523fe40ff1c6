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

at::Tensor pre_activation(const at::Tensor& a, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias) {
  at::Tensor out = new_buffer({a.size(0), weight.size(0)}, a.options());
  if (bias.has_value()) {
    at::addmm_out(out, *bias, a, weight.t());
  } else {
    at::mm_out(out, a, weight.t());
  }
  return out;
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

std::vector<int64_t> out_sizes(const at::Tensor& x, int64_t out_features) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(out_features);
  return shape;
}

}  // namespace

at::Tensor stack_forward(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                         const std::vector<bool>& has_bias, bool last_tanh, Activation act) {
  const auto b = layer_biases(biases, has_bias);
  const int64_t L = static_cast<int64_t>(weights.size());
  at::Tensor a = flatten_rows(x);
  for (int64_t i = 0; i < L; ++i) {
    at::Tensor z = pre_activation(a, weights[i], b[i]);  // (M, N_i), the only new buffer
    if (i + 1 < L || last_tanh) activation_in_place(z, act);
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
               const std::vector<bool>& need_weights, const std::vector<bool>& need_biases) {
  Asked a{std::vector<bool>(L, false), std::vector<int64_t>(L, -1), need_x ? 0 : L};
  for (int64_t i = 0, j = 0; i < L; ++i) {
    if (has_bias[i]) {
      a.bias_slot[i] = j;
      a.need_bias[i] = need_biases[j++];
    }
  }
  for (int64_t i = 0; i < L && a.lo == L; ++i) {
    if (need_weights[i] || a.need_bias[i]) a.lo = i;
  }
  return a;
}

// The backward of an activation whose derivative needs z (every one but tanh): the recompute
// keeps z_i of the layers from lo up and the input a_lo; a_i = f(z_{i−1}) is made again, into a
// buffer of its own, only for the GEMM of grad_W_i (docs/design.md, "Other activations"). The top
// layer's input is made only where its z is recomputed (last_act): else the loop makes it.
StackGrads stack_backward_from_z(at::Tensor grad_out, const at::Tensor& x,
                                 at::TensorList weights, const std::vector<std::optional<at::Tensor>>& b,
                                 int64_t n_biases, bool last_act, bool need_x,
                                 const std::vector<bool>& need_weights, const Asked& asked,
                                 Activation act) {
  const int64_t L = static_cast<int64_t>(weights.size());
  const int64_t lo = asked.lo;
  StackGrads out;
  out.grad_weights.resize(L);
  out.grad_biases.resize(n_biases);
  // Recompute: zs[i] for i >= lo (the top one only with last_act); a_lo kept.
  std::vector<at::Tensor> zs(L);
  at::Tensor a = flatten_rows(x);
  const int64_t M = a.size(0);
  at::Tensor a_lo = lo == 0 ? a : at::Tensor();
  const int64_t top = last_act ? L : L - 1;  // the layers whose z is recomputed
  for (int64_t i = 0; i < top; ++i) {
    at::Tensor z = pre_activation(a, weights[i], b[i]);
    if (i + 1 < top || i + 1 == lo) {  // a_{i+1} = f(z_i), an input the recompute reads
      at::Tensor next = z;
      if (i >= lo) {
        next = new_buffer(z.sizes(), z.options());
        activation_to(z, next, act);
      } else {
        activation_in_place(next, act);
      }
      if (i + 1 == lo) a_lo = next;
      a = std::move(next);
    }
    if (i >= lo) zs[i] = std::move(z);
  }
  a = at::Tensor();

  at::Tensor grad = grad_out.reshape({M, weights[L - 1].size(0)});
  grad_out = at::Tensor();
  for (int64_t i = L - 1; i >= lo; --i) {
    at::Tensor g;  // the gradient w.r.t. z_i
    at::Tensor grad_b;
    if (i == L - 1 && !last_act) {
      g = std::move(grad);
      if (asked.need_bias[i]) grad_b = bias_grad(g);
    } else {
      g = std::move(zs[i]);  // z_i becomes g in place
      grad_b = activation_backward_(g, grad, act, asked.need_bias[i]);
      grad = at::Tensor();
    }
    if (asked.need_bias[i]) out.grad_biases[asked.bias_slot[i]] = std::move(grad_b);
    if (need_weights[i]) {
      at::Tensor a_i = a_lo;
      if (i > lo) {  // f(z_{i−1}), as the forward made it
        a_i = new_buffer(zs[i - 1].sizes(), zs[i - 1].options());
        activation_to(zs[i - 1], a_i, act);
      }
      out.grad_weights[i] = at::mm(g.t(), a_i);
    }
    if (i > lo || need_x) grad = at::mm(g, weights[i]);  // (M, K_i)
  }
  if (need_x) out.grad_x = grad.view(x.sizes());
  return out;
}

}  // namespace

StackGrads stack_backward(at::Tensor grad_out, const at::Tensor& x, at::TensorList weights,
                          at::TensorList biases, const std::vector<bool>& has_bias, bool last_tanh,
                          bool need_x, const std::vector<bool>& need_weights,
                          const std::vector<bool>& need_biases, Activation act) {
  const auto b = layer_biases(biases, has_bias);
  const int64_t L = static_cast<int64_t>(weights.size());
  const Asked asked = asked_of(L, has_bias, need_x, need_weights, need_biases);
  const std::vector<bool>& need_bias = asked.need_bias;
  const std::vector<int64_t>& bias_slot = asked.bias_slot;
  const int64_t lo = asked.lo;
  StackGrads out;
  out.grad_weights.resize(L);
  out.grad_biases.resize(biases.size());
  if (lo == L) return out;  // nothing asked for
  if (act != Activation::kTanh) {
    return stack_backward_from_z(std::move(grad_out), x, weights, b,
                                 static_cast<int64_t>(biases.size()), last_tanh, need_x,
                                 need_weights, asked, act);
  }

  // Recompute. acts[i] = a_i, the input of layer i, (M, K_i); kept for i >= lo only.
  std::vector<at::Tensor> acts(L);
  acts[0] = flatten_rows(x);
  const int64_t M = acts[0].size(0);
  for (int64_t i = 0; i + 1 < L; ++i) {
    at::Tensor z = pre_activation(acts[i], weights[i], b[i]);
    tanh_in_place(z);
    acts[i + 1] = std::move(z);
    if (i < lo) acts[i] = at::Tensor();
  }
  at::Tensor top_z;  // the top layer's pre-activation, with last_tanh
  if (last_tanh) top_z = pre_activation(acts[L - 1], weights[L - 1], b[L - 1]);

  // grad: the gradient w.r.t. the current layer's output, (M, N_i); starts as grad_out (a view
  // where possible: out.mean() gives strides (0, 0), which the primitives read as they are).
  // From here `grad` is this function's only reference to the incoming gradient, so dropping it
  // below frees it when the caller handed over its own (see stack_backward in stack.h).
  at::Tensor grad = grad_out.reshape({M, weights[L - 1].size(0)});
  grad_out = at::Tensor();
  for (int64_t i = L - 1; i >= lo; --i) {
    at::Tensor g;  // the gradient w.r.t. z_i
    at::Tensor grad_b;
    if (i == L - 1 && !last_tanh) {
      g = std::move(grad);
      if (need_bias[i]) grad_b = bias_grad(g);
    } else {
      // z (top, last_tanh) or t = a_{i+1} becomes g in place.
      const bool top = i == L - 1;
      g = top ? std::move(top_z) : std::move(acts[i + 1]);
      grad_b = tanh_backward_(g, grad, top ? Holds::kPreActivation : Holds::kTanhOutput,
                              need_bias[i]);
      grad = at::Tensor();  // freed before the GEMMs allocate (if nobody else holds it)
    }
    if (need_bias[i]) out.grad_biases[bias_slot[i]] = std::move(grad_b);
    if (need_weights[i]) out.grad_weights[i] = at::mm(g.t(), acts[i]);
    if (i > lo || need_x) grad = at::mm(g, weights[i]);  // (M, K_i)
  }
  if (need_x) out.grad_x = grad.view(x.sizes());
  return out;
}

}  // namespace ckpt_ext
