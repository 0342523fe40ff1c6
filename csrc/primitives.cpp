// primitives.cpp — the buffers (with the NaN-poisoning test hook) and the device-generic
// primitives of primitives.h, each routed to its CPU or CUDA version by the buffer's device.
#include "primitives.h"

#include <atomic>
#include <limits>

namespace ckpt_ext {

namespace {
std::atomic<bool> g_poison_buffers{false};
}  // namespace

void set_poison_buffers(bool on) { g_poison_buffers.store(on); }
bool poison_buffers() { return g_poison_buffers.load(); }

at::Tensor new_buffer(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
  if (poison_buffers()) t.fill_(std::numeric_limits<double>::quiet_NaN());
  return t;
}

#ifdef CKPT_EXT_WITH_CUDA
#define CKPT_EXT_ON_DEVICE(t, cpu_call, cuda_call) ((t).is_cuda() ? (cuda_call) : (cpu_call))
#else
#define CKPT_EXT_ON_DEVICE(t, cpu_call, cuda_call) (cpu_call)
#endif

void tanh_in_place(const at::Tensor& acc) {
  CKPT_EXT_ON_DEVICE(acc, tanh_cpu_(acc), tanh_cuda_(acc));
}

at::Tensor tanh_backward_(const at::Tensor& acc, const at::Tensor& grad_out, Holds holds,
                          bool want_bias_grad) {
  return CKPT_EXT_ON_DEVICE(acc, tanh_backward_cpu_(acc, grad_out, holds, want_bias_grad),
                            tanh_backward_cuda_(acc, grad_out, holds, want_bias_grad));
}

void activation_in_place(const at::Tensor& acc, Activation act) {
  if (act == Activation::kTanh) return tanh_in_place(acc);
  CKPT_EXT_ON_DEVICE(acc, activation_cpu(acc, acc, act), activation_cuda(acc, acc, act));
}

void activation_to(const at::Tensor& src, const at::Tensor& dst, Activation act, int order) {
#ifdef CKPT_EXT_WITH_CUDA
  if (dst.is_cuda()) return activation_cuda(src, dst, act, order);  // one pass, tanh's included
#endif
  // tanh included: the activate kernel's tanh is tanh_cpu_'s, element for element
  activation_cpu(src, dst, act, order);
}

at::Tensor activation_backward_(const at::Tensor& acc, const at::Tensor& grad_out, Activation act,
                                bool want_bias_grad) {
  if (act == Activation::kTanh) {
    return tanh_backward_(acc, grad_out, Holds::kPreActivation, want_bias_grad);
  }
  return CKPT_EXT_ON_DEVICE(acc, activation_backward_cpu_(acc, grad_out, act, want_bias_grad),
                            activation_backward_cuda_(acc, grad_out, act, want_bias_grad));
}

// relu: its pass from z is its pass from t = relu(z), to the bit: relu(z) <= 0 exactly where
// z <= 0 (−0 included), and t is NaN where z is.
bool backward_from_output(Activation act) {
  return act == Activation::kTanh || act == Activation::kRelu;
}

at::Tensor activation_backward_from_output_(const at::Tensor& acc, const at::Tensor& grad_out,
                                            Activation act, bool want_bias_grad) {
  TORCH_INTERNAL_ASSERT(backward_from_output(act));
  if (act == Activation::kRelu) return activation_backward_(acc, grad_out, act, want_bias_grad);
  return tanh_backward_(acc, grad_out, Holds::kTanhOutput, want_bias_grad);
}

void activation_terms(const at::Tensor& p, Activation act, const std::vector<TermTensors>& terms,
                      const at::Tensor& add, const at::Tensor& out) {
  CKPT_EXT_ON_DEVICE(out, activation_terms_cpu(p, act, terms, add, out),
                     activation_terms_cuda(p, act, terms, add, out));
}

void gated_in_place(const at::Tensor& z, Activation act) {
  CKPT_EXT_ON_DEVICE(z, gated_cpu(z, act), gated_cuda(z, act));
}

void gated_backward_(const at::Tensor& z, const at::Tensor& gh, Activation act) {
  CKPT_EXT_ON_DEVICE(z, gated_backward_cpu_(z, gh, act), gated_backward_cuda_(z, gh, act));
}

at::Tensor bias_grad(const at::Tensor& grad_out) {
  return CKPT_EXT_ON_DEVICE(grad_out, bias_grad_cpu(grad_out), bias_grad_cuda(grad_out));
}

#undef CKPT_EXT_ON_DEVICE

}  // namespace ckpt_ext
