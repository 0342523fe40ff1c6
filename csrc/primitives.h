// primitives.h — the buffers and the elementwise/reduction primitives the stack engine runs
// between its GEMMs (and the higher orders' products, activation_terms): CPU ones in
// cpu/primitives.cpp, CUDA ones in cuda/primitives.cu; the generic ones (no device suffix,
// primitives.cpp) pick one by the buffer's device.
// Shapes: acc (M, N) contiguous (M rows of the flattened input, N = out_features); grad_out
// (M, N), any strides (out.mean() gives strides (0, 0)); bias sums (N), in the order of
// device_math.h (docs/design.md, "Bias sums").
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "activation_terms.h"
#include "activations.h"

namespace ckpt_ext {

// Test hook: when on, every buffer the ops allocate is filled with NaN before a kernel writes it,
// so an element a kernel forgets to write shows up as NaN instead of passing by luck.
void set_poison_buffers(bool on);
bool poison_buffers();
// at::empty(sizes, options), NaN-filled when poisoning is on.
at::Tensor new_buffer(at::IntArrayRef sizes, const at::TensorOptions& options);

// What an activation buffer holds when the backward pass starts on it.
enum class Holds {
  kPreActivation,  // z = a·Wᵀ + b: the pass computes t = tanh(z) itself (one read of z)
  kTanhOutput,     // t = tanh(z), as the forward left it (a stack keeps t: the next layer's input)
};

// acc holds z; becomes t = tanh(z) in place. Every element goes through the same tanh, so the
// backward's recompute equals the forward's to the bit. (Not tanh_: an unqualified tanh_(t) on an
// at::Tensor would find at::tanh_ by argument-dependent lookup.)
void tanh_in_place(const at::Tensor& acc);
void tanh_cpu_(const at::Tensor& acc);
void tanh_cuda_(const at::Tensor& acc);

// acc holds z or t (see Holds); becomes g = grad_out · (1 − t²) in place. Returns grad_b = the
// column sums of g (N), in acc's dtype, when want_bias_grad; an undefined tensor otherwise.
at::Tensor tanh_backward_(const at::Tensor& acc, const at::Tensor& grad_out, Holds holds,
                          bool want_bias_grad);
at::Tensor tanh_backward_cpu_(const at::Tensor& acc, const at::Tensor& grad_out, Holds holds,
                              bool want_bias_grad);
at::Tensor tanh_backward_cuda_(const at::Tensor& acc, const at::Tensor& grad_out, Holds holds,
                               bool want_bias_grad);

// Any activation of activations.h (in place and backward, kTanh goes to the tanh primitives
// above). acc holds z and becomes f(z), or g = grad_out·f'(z) with grad_b as tanh_backward_
// returns it. activation_to writes f(src) into dst (same shape, dtype and device; contiguous),
// leaving src as it is: one pass, each element's arithmetic that of the in-place kernel; with
// order k = 1, 2, 3 it writes the k-th derivative f^(k)(src) instead (activations.h).
void activation_in_place(const at::Tensor& acc, Activation act);
void activation_to(const at::Tensor& src, const at::Tensor& dst, Activation act, int order = 0);
void activation_cpu(const at::Tensor& src, const at::Tensor& dst, Activation act, int order = 0);
void activation_cuda(const at::Tensor& src, const at::Tensor& dst, Activation act, int order = 0);
at::Tensor activation_backward_(const at::Tensor& acc, const at::Tensor& grad_out, Activation act,
                                bool want_bias_grad);
// The activations whose backward pass can read the output t = f(z) (tanh: g = gy·(1 − t²); relu:
// t <= 0 ? 0 : gy), so that a stack keeping t as the next layer's input needs no z;
// activation_backward_from_output_ is that pass, acc holding t.
bool backward_from_output(Activation act);
at::Tensor activation_backward_from_output_(const at::Tensor& acc, const at::Tensor& grad_out,
                                            Activation act, bool want_bias_grad);
at::Tensor activation_backward_cpu_(const at::Tensor& acc, const at::Tensor& grad_out,
                                    Activation act, bool want_bias_grad);
at::Tensor activation_backward_cuda_(const at::Tensor& acc, const at::Tensor& grad_out,
                                     Activation act, bool want_bias_grad);

// The gated product of a gated MLP, z (M, 2I) contiguous holding [g | u] per row (the gate's
// and the up projection's pre-activations side by side). gated_in_place: z[:, :I] becomes
// h = f(g)·u (z[:, I:] is left as it is). gated_backward_: with gh (M, I) contiguous, the
// gradient w.r.t. h, one pass makes z = [gh·u·f'(g) | gh·f(g)] (the gradients w.r.t. g and u)
// and gh = h = f(g)·u, each h with the bits gated_in_place gives it. Half types compute in
// float and round once per result.
void gated_in_place(const at::Tensor& z, Activation act);
void gated_cpu(const at::Tensor& z, Activation act);
void gated_cuda(const at::Tensor& z, Activation act);
void gated_backward_(const at::Tensor& z, const at::Tensor& gh, Activation act);
void gated_backward_cpu_(const at::Tensor& z, const at::Tensor& gh, Activation act);
void gated_backward_cuda_(const at::Tensor& z, const at::Tensor& gh, Activation act);

// out = add + Σ_j f^(orders[j])(p)·Π factors[j] in one pass (activation_terms.h): p, every
// factor, add (undefined: none; it may be out) and out contiguous, of one shape, dtype and device;
// at most ActivationTerms' kMaxTerms terms of kMaxFactors factors, orders 0 to 3 (checked by the
// caller, module.cpp).
struct TermTensors {
  int order;
  std::vector<at::Tensor> factors;
};
void activation_terms(const at::Tensor& p, Activation act, const std::vector<TermTensors>& terms,
                      const at::Tensor& add, const at::Tensor& out);
void activation_terms_cpu(const at::Tensor& p, Activation act,
                          const std::vector<TermTensors>& terms, const at::Tensor& add,
                          const at::Tensor& out);
void activation_terms_cuda(const at::Tensor& p, Activation act,
                           const std::vector<TermTensors>& terms, const at::Tensor& add,
                           const at::Tensor& out);
// The kernels' view of them, for dtype scalar_t.
template <typename scalar_t>
ActivationTerms<scalar_t> terms_of(const std::vector<TermTensors>& terms, const at::Tensor& add) {
  ActivationTerms<scalar_t> t;
  TORCH_INTERNAL_ASSERT(terms.size() <= static_cast<size_t>(t.kMaxTerms));
  t.count = static_cast<int>(terms.size());
  for (int j = 0; j < t.count; ++j) {
    TORCH_INTERNAL_ASSERT(terms[j].factors.size() <= static_cast<size_t>(t.kMaxFactors));
    t.order[j] = terms[j].order;
    t.factors[j] = static_cast<int>(terms[j].factors.size());
    for (int f = 0; f < t.factors[j]; ++f) {
      t.factor[j][f] = terms[j].factors[f].template const_data_ptr<scalar_t>();
    }
  }
  t.add = add.defined() ? add.template const_data_ptr<scalar_t>() : nullptr;
  return t;
}

// The column sums (N) of grad_out: the bias gradient of a layer with no tanh after it (the last
// layer of a stack with last_tanh = false).
at::Tensor bias_grad(const at::Tensor& grad_out);
at::Tensor bias_grad_cpu(const at::Tensor& grad_out);
at::Tensor bias_grad_cuda(const at::Tensor& grad_out);

}  // namespace ckpt_ext
