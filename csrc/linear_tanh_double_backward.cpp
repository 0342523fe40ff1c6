// linear_tanh_double_backward.cpp — the backward of linear_tanh_backward, as a recomputing op.
//
//   linear_tanh_double_backward(grad_grad_x?, grad_grad_weight?, grad_grad_bias?, grad_out, x,
//                               weight, bias?, output_mask[4])
//       -> (grad_grad_out?, grad_x?, grad_weight?, grad_bias?)
//
//   Shapes: x (..., K), weight (N, K), bias (N)?, grad_out (..., N) — the inputs of
//   linear_tanh_backward — and the gradients flowing back into its outputs: grad_grad_x like x,
//   grad_grad_weight like weight, grad_grad_bias like bias (each may be None: no gradient reached
//   that output). The results are the gradients w.r.t. linear_tanh_backward's inputs, shaped like
//   grad_out, x, weight and bias; only those asked for in output_mask are computed, the others
//   come back undefined (None in Python; grad_bias is None also when bias is None).
//
// Why an op: with create_graph=True (physics-informed losses: u_x, u_xx by autograd.grad), the
// first-order backward linear_tanh_backward is itself recorded by autograd (ckpt_ext/ops.py). Its
// node then keeps only its inputs (grad_out, x and references to the parameters), not the
// intermediates z, t, g that plain autograd keeps; this op recomputes them when the second-order
// pass reaches the node. Autograd for this op (the third order) is registered in ops.py.
//
// The math. linear_tanh_backward computes, with x and grad_out flattened to (M, K) and (M, N):
//   z = x·Wᵀ + b,  t = tanh(z),  s = 1 − t²,  g = grad_out·s,
//   grad_x = g·W,  grad_W = gᵀ·x,  grad_b = Σ_rows g.
// Given ggx, ggW, ggb (the gradients w.r.t. grad_x, grad_W, grad_b), L = <ggx, g·W> +
// <ggW, gᵀ·x> + <ggb, Σ_rows g>, and its gradient w.r.t. g (x and W held) is
//   dg = ggx·Wᵀ + x·ggWᵀ + ggb                                     (M, N)
// Through g = grad_out·s:  grad_grad_out = dg·s.
// Through s = 1 − tanh(z)²:  ∂L/∂t = −2·dg·grad_out·t, and dt/dz = s, so
//   dz = −2·dg·grad_out·t·s                                          (M, N)
// and z = x·Wᵀ + b gives x, W and b their share; x and W also appear explicitly in grad_W = gᵀ·x
// and grad_x = g·W:
//   grad_x      = dz·W + g·ggW                                       (M, K)
//   grad_W      = dzᵀ·x + gᵀ·ggx                                     (N, K)
//   grad_b      = Σ_rows dz                                          (N)
// (Checked: tests/test_double_backward.py runs gradcheck and gradgradcheck of this op in float64.)
//
// Cost: the recompute GEMM of z, one GEMM per defined input of dg, and per output asked for one
// GEMM (two where both ggx and ggW feed it). Device-generic: the GEMMs and elementwise steps are
// ATen ops, tanh and the bias sums the primitives of linear_tanh.h (the documented summation
// order); float16/bfloat16 compute in float32 and round each result once.
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <sstream>
#include <tuple>

#include "linear_tanh.h"

namespace ckpt_ext {

namespace {

constexpr const char* kOp = "linear_tanh_double_backward";

std::string shape_of(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sym_sizes();
  return s.str();
}

// A gradient flowing into one of linear_tanh_backward's outputs must match that output (the
// tensor `like`: x, weight or bias) in shape, dtype and device.
void check_like(const char* name, const std::optional<at::Tensor>& grad, const at::Tensor& like,
                const char* like_name) {
  if (!grad.has_value()) return;
  TORCH_CHECK_VALUE(grad->sym_sizes() == like.sym_sizes(), "ckpt_ext.", kOp, ": ", name,
                    " must have the shape of ", like_name, " ", shape_of(like), ", got ",
                    shape_of(*grad));
  TORCH_CHECK_TYPE(grad->scalar_type() == like.scalar_type(), "ckpt_ext.", kOp, ": ", name,
                   " must have the dtype of ", like_name, " (", like.scalar_type(), "), got ",
                   grad->scalar_type());
  TORCH_CHECK_VALUE(grad->device() == like.device(), "ckpt_ext.", kOp, ": ", name,
                    " must be on the device of ", like_name, " (", like.device(), "), got ",
                    grad->device());
}

void check_inputs(const std::optional<at::Tensor>& ggx, const std::optional<at::Tensor>& ggw,
                  const std::optional<at::Tensor>& ggb, const at::Tensor& grad_out,
                  const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias) {
  check_linear_tanh_inputs(kOp, x, weight, bias);
  check_grad_out(kOp, grad_out, x, weight.sym_size(0));
  check_like("grad_grad_x", ggx, x, "x");
  check_like("grad_grad_weight", ggw, weight, "weight");
  if (ggb.has_value()) {
    TORCH_CHECK_VALUE(bias.has_value(), "ckpt_ext.", kOp,
                      ": grad_grad_bias was given but bias is None (a layer without bias has no "
                      "grad_bias output to receive a gradient)");
    check_like("grad_grad_bias", ggb, *bias, "bias");
  }
}

std::optional<at::Tensor> rows_of(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return std::nullopt;
  return flatten_rows(*t);
}

std::optional<at::Tensor> to_float(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return std::nullopt;
  return t->to(at::kFloat);
}

// The computation, on (M, K) / (M, N) matrices of one dtype (float or double; the op upcasts half
// types first). Returns (dgy (M, N), dx (M, K), dW (N, K), db (N)), undefined where not asked.
std::array<at::Tensor, 4> double_backward_2d(const std::optional<at::Tensor>& ggx,
                                             const std::optional<at::Tensor>& ggw,
                                             const std::optional<at::Tensor>& ggb,
                                             const at::Tensor& gy, const at::Tensor& x,
                                             const at::Tensor& weight,
                                             const std::optional<at::Tensor>& bias,
                                             std::array<bool, 4> mask) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const bool want_dgy = mask[0], want_dx = mask[1], want_dw = mask[2];
  const bool want_db = mask[3] && bias.has_value();
  std::array<at::Tensor, 4> out;
  const bool any_input = ggx.has_value() || ggw.has_value() || ggb.has_value();
  if (!any_input || !(want_dgy || want_dx || want_dw || want_db)) {
    // No gradient reached linear_tanh_backward's outputs: every result is zero.
    if (want_dgy) out[0] = at::zeros({M, N}, x.options());
    if (want_dx) out[1] = at::zeros({M, K}, x.options());
    if (want_dw) out[2] = at::zeros({N, K}, x.options());
    if (want_db) out[3] = at::zeros({N}, x.options());
    return out;
  }

  // t = tanh(x·Wᵀ + b), recomputed the way the forward computes it (one GEMM, bias in it).
  at::Tensor t = pre_activation(x, weight, bias);  // (M, N): z, then t in place
  // Qualified: an unqualified tanh_(t) on a non-const at::Tensor finds at::tanh_(Tensor&) by
  // argument-dependent lookup, a better match than our tanh_(const Tensor&), and runs ATen's tanh
  // instead of the primitive the forward uses.
  ckpt_ext::tanh_(t);

  // g = grad_out·s, needed only for the explicit terms g·ggW (grad_x) and gᵀ·ggx (grad_W).
  at::Tensor g;
  if ((want_dx && ggw.has_value()) || (want_dw && ggx.has_value())) g = at::tanh_backward(gy, t);

  // dg = ggx·Wᵀ + x·ggWᵀ + ggb, bias in the GEMM where there is one.
  at::Tensor dg;
  if (ggx.has_value()) {
    dg = ggb.has_value() ? at::addmm(*ggb, *ggx, weight.t()) : at::mm(*ggx, weight.t());
    if (ggw.has_value()) dg.addmm_(x, ggw->t());
  } else if (ggw.has_value()) {
    dg = ggb.has_value() ? at::addmm(*ggb, x, ggw->t()) : at::mm(x, ggw->t());
  } else {
    dg = ggb->expand({M, N}).contiguous();
  }
  // dg·s: the grad_grad_out result, and the factor of dz.
  at::Tensor dg_s = at::tanh_backward(dg, t);
  dg = at::Tensor();  // freed (dg·s is all that is needed from here)
  if (want_dgy) out[0] = dg_s;

  const bool need_dz = want_dx || want_dw || want_db;
  if (need_dz) {
    // dz = −2·dg·grad_out·t·s = −2·(dg·s)·grad_out·t, in place in t's buffer.
    at::Tensor dz = t.mul_(gy).mul_(dg_s).mul_(-2);
    t = at::Tensor();
    if (!want_dgy) dg_s = at::Tensor();
    if (want_db) out[3] = bias_grad(dz);
    if (want_dx) {
      out[1] = at::mm(dz, weight);
      if (ggw.has_value()) out[1].addmm_(g, *ggw);
    }
    if (want_dw) {
      out[2] = at::mm(dz.t(), x);
      if (ggx.has_value()) out[2].addmm_(g.t(), *ggx);
    }
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_tanh_double_backward(
    const std::optional<at::Tensor>& grad_grad_x, const std::optional<at::Tensor>& grad_grad_weight,
    const std::optional<at::Tensor>& grad_grad_bias, const at::Tensor& grad_out,
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    std::array<bool, 4> output_mask) {
  check_inputs(grad_grad_x, grad_grad_weight, grad_grad_bias, grad_out, x, weight, bias);
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  const int64_t N = weight.size(0);
  at::Tensor x2 = flatten_rows(x);
  at::Tensor gy2 = grad_out.reshape({x2.size(0), N});
  std::optional<at::Tensor> ggx2 = rows_of(grad_grad_x);
  std::array<at::Tensor, 4> r;
  const at::ScalarType dtype = x.scalar_type();
  if (dtype == at::kHalf || dtype == at::kBFloat16) {
    // Half types: compute in float32 and round each result once, as the other ops do.
    r = double_backward_2d(to_float(ggx2), to_float(grad_grad_weight), to_float(grad_grad_bias),
                           gy2.to(at::kFloat), x2.to(at::kFloat), weight.to(at::kFloat),
                           to_float(bias), output_mask);
    for (auto& t : r) {
      if (t.defined()) t = t.to(dtype);
    }
  } else {
    r = double_backward_2d(ggx2, grad_grad_weight, grad_grad_bias, gy2, x2, weight, bias,
                           output_mask);
  }
  if (r[0].defined()) r[0] = r[0].view(grad_out.sizes());
  if (r[1].defined()) r[1] = r[1].view(x.sizes());
  return {r[0], r[1], r[2], r[3]};
}

// Meta kernel (FakeTensor, torch.compile): the same checks, then the result metadata.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_tanh_double_backward_meta(
    const std::optional<at::Tensor>& grad_grad_x, const std::optional<at::Tensor>& grad_grad_weight,
    const std::optional<at::Tensor>& grad_grad_bias, const at::Tensor& grad_out,
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    std::array<bool, 4> output_mask) {
  check_inputs(grad_grad_x, grad_grad_weight, grad_grad_bias, grad_out, x, weight, bias);
  return {output_mask[0] ? at::empty_symint(grad_out.sym_sizes(), x.options()) : at::Tensor(),
          output_mask[1] ? at::empty_symint(x.sym_sizes(), x.options()) : at::Tensor(),
          output_mask[2] ? at::empty_symint(weight.sym_sizes(), x.options()) : at::Tensor(),
          output_mask[3] && bias.has_value()
              ? at::empty_symint({weight.sym_size(0)}, x.options())
              : at::Tensor()};
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// registration (a fragment of the library whose other schemas are in linear_tanh.cpp)

TORCH_LIBRARY_FRAGMENT(ckpt_ext, m) {
  m.def(
      "linear_tanh_double_backward(Tensor? grad_grad_x, Tensor? grad_grad_weight, "
      "Tensor? grad_grad_bias, Tensor grad_out, Tensor x, Tensor weight, Tensor? bias, "
      "bool[4] output_mask) -> (Tensor grad_grad_out, Tensor grad_x, Tensor grad_weight, "
      "Tensor grad_bias)");
}

TORCH_LIBRARY_IMPL(ckpt_ext, CPU, m) {
  m.impl("linear_tanh_double_backward", &linear_tanh_double_backward);
}

#ifdef CKPT_EXT_WITH_CUDA
TORCH_LIBRARY_IMPL(ckpt_ext, CUDA, m) {
  m.impl("linear_tanh_double_backward", &linear_tanh_double_backward);
}
#else
namespace {
void no_cuda_kernels(const c10::OperatorHandle& op, torch::jit::Stack*) {
  TORCH_CHECK(false, op.schema().name(), ": got CUDA tensors, but this build of ckpt_ext has no "
              "CUDA kernels (ckpt_ext.WITH_CUDA is False); rebuild it where nvcc and a CUDA build "
              "of torch are present (CKPT_EXT_CUDA=1 makes a missing toolkit an error)");
}
}  // namespace

TORCH_LIBRARY_IMPL(ckpt_ext, CUDA, m) {
  m.impl("linear_tanh_double_backward",
         torch::CppFunction::makeFromBoxedFunction<&no_cuda_kernels>());
}
#endif

TORCH_LIBRARY_IMPL(ckpt_ext, Meta, m) {
  m.impl("linear_tanh_double_backward", &linear_tanh_double_backward_meta);
}

}  // namespace ckpt_ext
