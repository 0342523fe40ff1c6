// tanh_mlp.cpp — a whole stack of Linear layers with tanh, recomputed as one op; and the stack
// engine that linear_tanh (linear_tanh.cpp) is the one-layer case of.
//
//   tanh_mlp(x, weights, biases, has_bias, last_tanh)              ->  y (..., N_{L-1})
//       x (..., K_0); weights[i] (N_i, K_i), K_i = N_{i-1}; the biases of the layers with
//       has_bias[i], each (N_i). h = x; for each layer i: h = tanh(h·W_iᵀ + b_i) (no tanh after the
//       last layer unless last_tanh). Autograd (ckpt_ext/ops.py) keeps only x and references to the
//       parameters: this is the unit that saves memory. In a chain Linear, Tanh, Linear, Tanh, ...
//       every tanh output is also the next Linear's input, so recomputing one pair at a time frees
//       only the last activation; recomputing the run frees all but its input.
//   tanh_mlp_backward(grad_out, x, weights, biases, has_bias, last_tanh, need_x, need_weights,
//                     need_biases)  ->  (grad_x?, grad_weights asked for, grad_biases asked for)
//
// Forward: one GEMM per layer (bias in it, as F.linear) into a fresh (M, N_i) buffer, then the
// in-place tanh; each layer's input buffer is freed as soon as the next one exists, so at most two
// activations are alive and only the output survives.
//
// Backward: the recompute runs the forward once more, keeping the layers' inputs a_1..a_{L-1}
// (a_0 = x; a layer below the lowest one whose gradient is asked for keeps nothing) and, with
// last_tanh, the top layer's pre-activation z (one GEMM fewer without last_tanh: the top layer's
// output is not needed). Then, layer by layer from the top:
//   g = grad · (1 − t²), in place in the buffer that held t = a_{i+1} (or z on top), with the
//       bias gradient summed in the same pass (the documented order, linear_tanh.h); the incoming
//       gradient is dropped right after, before any GEMM allocates (and freed there when the
//       caller handed over its only reference: the autograd node does, autograd_node.cpp);
//   grad_W_i = gᵀ·a_i, and grad = g·W_i for the layer below (or grad_x), each only if needed;
//   g (the buffer that held a_{i+1}) is then freed.
// So no (M, N) buffer is ever allocated for g: at every point the backward holds at most what plain
// autograd holds at the same layer (its saved activations, the gradient and grad_W), one buffer
// fewer during the tanh derivative.
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include "linear_tanh.h"

namespace ckpt_ext {

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
                         const std::vector<bool>& has_bias, bool last_tanh) {
  const auto b = layer_biases(biases, has_bias);
  const int64_t L = static_cast<int64_t>(weights.size());
  at::Tensor a = flatten_rows(x);
  for (int64_t i = 0; i < L; ++i) {
    at::Tensor z = pre_activation(a, weights[i], b[i]);  // (M, N_i), the only new buffer
    if (i + 1 < L || last_tanh) tanh_in_place(z);
    a = std::move(z);  // the previous layer's output is freed here
  }
  // _unsafe_view: the result must not be an autograd view of an internal buffer, or in-place ops
  // on the output (`y += residual`, Dropout(inplace=True)) are refused by autograd.
  return at::_unsafe_view(a, out_sizes(x, weights[L - 1].size(0)));
}

StackGrads stack_backward(at::Tensor grad_out, const at::Tensor& x, at::TensorList weights,
                          at::TensorList biases, const std::vector<bool>& has_bias, bool last_tanh,
                          bool need_x, const std::vector<bool>& need_weights,
                          const std::vector<bool>& need_biases) {
  const auto b = layer_biases(biases, has_bias);
  const int64_t L = static_cast<int64_t>(weights.size());
  StackGrads out;
  out.grad_weights.resize(L);
  out.grad_biases.resize(biases.size());

  // need_bias[i]: layer i has a bias and its gradient is asked for; bias_slot[i]: its index in
  // `biases`.
  std::vector<bool> need_bias(L, false);
  std::vector<int64_t> bias_slot(L, -1);
  for (int64_t i = 0, j = 0; i < L; ++i) {
    if (has_bias[i]) {
      bias_slot[i] = j;
      need_bias[i] = need_biases[j++];
    }
  }
  // The lowest layer whose backward has to run; layers below it only feed the recompute.
  int64_t lo = need_x ? 0 : L;
  for (int64_t i = 0; i < L && lo == L; ++i) {
    if (need_weights[i] || need_bias[i]) lo = i;
  }
  if (lo == L) return out;  // nothing asked for

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
  // below frees it when the caller handed over its own (see stack_backward in linear_tanh.h).
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

// ----------------------------------------------------------------------------------------------
// the ops

namespace {

// The registered kernels take bool[] as c10::List<bool> (what the dispatcher passes); the engine
// and the checks read std::vector<bool>.
at::Tensor tanh_mlp(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                    const c10::List<bool>& has_bias_list, bool last_tanh) {
  const std::vector<bool> has_bias = has_bias_list.vec();
  check_tanh_mlp_inputs("tanh_mlp", x, weights, biases, has_bias);
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  return stack_forward(x, weights, biases, has_bias, last_tanh);
}

void check_backward_masks(const char* op, at::TensorList weights, at::TensorList biases,
                          const std::vector<bool>& need_weights, const std::vector<bool>& need_biases) {
  TORCH_CHECK_VALUE(need_weights.size() == weights.size(), "ckpt_ext.", op,
                    ": need_weights must have one entry per weight (", weights.size(), "), got ",
                    need_weights.size());
  TORCH_CHECK_VALUE(need_biases.size() == biases.size(), "ckpt_ext.", op,
                    ": need_biases must have one entry per bias (", biases.size(), "), got ",
                    need_biases.size());
}

// Only the gradients asked for, in order (the schema's compact lists).
std::vector<at::Tensor> asked(std::vector<at::Tensor>&& grads, const std::vector<bool>& need) {
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (need[i]) out.push_back(std::move(grads[i]));
  }
  return out;
}

std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> tanh_mlp_backward(
    const at::Tensor& grad_out, const at::Tensor& x, at::TensorList weights,
    at::TensorList biases, const c10::List<bool>& has_bias_list, bool last_tanh, bool need_x,
    const c10::List<bool>& need_weights_list, const c10::List<bool>& need_biases_list) {
  constexpr const char* op = "tanh_mlp_backward";
  const std::vector<bool> has_bias = has_bias_list.vec(), need_weights = need_weights_list.vec(),
                          need_biases = need_biases_list.vec();
  check_tanh_mlp_inputs(op, x, weights, biases, has_bias);
  check_backward_masks(op, weights, biases, need_weights, need_biases);
  check_grad_out(op, grad_out, x, weights.back().sym_size(0));
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  StackGrads g = stack_backward(grad_out, x, weights, biases, has_bias, last_tanh, need_x,
                                need_weights, need_biases);
  return {g.grad_x, asked(std::move(g.grad_weights), need_weights),
          asked(std::move(g.grad_biases), need_biases)};
}

at::Tensor tanh_mlp_meta(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                         const c10::List<bool>& has_bias, bool last_tanh) {
  check_tanh_mlp_inputs("tanh_mlp", x, weights, biases, has_bias.vec());
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end() - 1);
  shape.push_back(weights.back().sym_size(0));
  return at::empty_symint(shape, x.options());
}

std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> tanh_mlp_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& x, at::TensorList weights,
    at::TensorList biases, const c10::List<bool>& has_bias, bool last_tanh, bool need_x,
    const c10::List<bool>& need_weights_list, const c10::List<bool>& need_biases_list) {
  constexpr const char* op = "tanh_mlp_backward";
  const std::vector<bool> need_weights = need_weights_list.vec(),
                          need_biases = need_biases_list.vec();
  check_tanh_mlp_inputs(op, x, weights, biases, has_bias.vec());
  check_backward_masks(op, weights, biases, need_weights, need_biases);
  check_grad_out(op, grad_out, x, weights.back().sym_size(0));
  std::vector<at::Tensor> gw, gb;
  for (size_t i = 0; i < weights.size(); ++i) {
    if (need_weights[i]) gw.push_back(at::empty_symint(weights[i].sym_sizes(), x.options()));
  }
  for (size_t j = 0; j < biases.size(); ++j) {
    if (need_biases[j]) gb.push_back(at::empty_symint(biases[j].sym_sizes(), x.options()));
  }
  return {need_x ? at::empty_symint(x.sym_sizes(), x.options()) : at::Tensor(), gw, gb};
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// registration (the schemas are defined in linear_tanh.cpp)

TORCH_LIBRARY_IMPL(ckpt_ext, CPU, m) {
  m.impl("tanh_mlp", &tanh_mlp);
  m.impl("tanh_mlp_backward", &tanh_mlp_backward);
}

#ifdef CKPT_EXT_WITH_CUDA
TORCH_LIBRARY_IMPL(ckpt_ext, CUDA, m) {
  m.impl("tanh_mlp", &tanh_mlp);
  m.impl("tanh_mlp_backward", &tanh_mlp_backward);
}
#endif

TORCH_LIBRARY_IMPL(ckpt_ext, Meta, m) {
  m.impl("tanh_mlp", &tanh_mlp_meta);
  m.impl("tanh_mlp_backward", &tanh_mlp_backward_meta);
}

}  // namespace ckpt_ext
