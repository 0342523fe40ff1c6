// primitives.h — the buffers and the three elementwise/reduction primitives the stack engine runs
// between its GEMMs: CPU ones in cpu/primitives.cpp, CUDA ones in cuda/primitives.cu; the
// generic ones (no device suffix, primitives.cpp) pick one by the buffer's device.
// Shapes: acc (M, N) contiguous (M rows of the flattened input, N = out_features); grad_out
// (M, N), any strides (out.mean() gives strides (0, 0)); bias sums (N), in the order of
// device_math.h (docs/design.md, "Bias sums").
#pragma once

#include <ATen/ATen.h>

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

// The column sums (N) of grad_out: the bias gradient of a layer with no tanh after it (the last
// layer of a stack with last_tanh = false).
at::Tensor bias_grad(const at::Tensor& grad_out);
at::Tensor bias_grad_cpu(const at::Tensor& grad_out);
at::Tensor bias_grad_cuda(const at::Tensor& grad_out);

}  // namespace ckpt_ext
