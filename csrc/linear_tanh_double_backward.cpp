// linear_tanh_double_backward.cpp — the higher-order backward ops of linear_tanh.
//
//   linear_tanh_double_backward(grad_grad_x?, grad_grad_weight?, grad_grad_bias?, grad_out, x,
//                               weight, bias?, output_mask[4])
//       -> (grad_grad_out?, grad_x?, grad_weight?, grad_bias?)
//   linear_tanh_backward_from_output(grad_out, x, output, weight, bias?, output_mask[3])
//       -> (grad_x?, grad_weight?, grad_bias?)
//   linear_tanh_backward_from_output_backward(grad_grad_x?, grad_grad_weight?, grad_grad_bias?,
//                                             grad_out, x, output, weight, output_mask[4])
//       -> (grad_grad_out?, grad_x?, grad_output?, grad_weight?)
//   linear_tanh_backward_from_output_double_backward(grad_grad_x?, grad_grad_weight?,
//       grad_grad_bias?, grad_out, x, output, weight, u_grad_grad_out?, u_grad_x?, u_grad_output?,
//       u_grad_weight?, output_mask[7])
//       -> (d_grad_grad_x?, d_grad_grad_weight?, d_grad_grad_bias?, d_grad_out?, d_x?, d_output?,
//           d_weight?)          CPU only
//
//   Shapes: x (..., K), weight (N, K), bias (N)?, grad_out and output (..., N); grad_grad_x like
//   x, grad_grad_weight like weight, grad_grad_bias (N) (each may be None: no gradient reached
//   that output). Only the results asked for in output_mask are computed; the others come back
//   undefined (None in Python; a bias gradient is None also when bias is None).
//
// Two ways to write linear_tanh's first-order backward as a function that autograd can record
// (create_graph=True: physics-informed losses take u_x, u_xx by autograd.grad):
//
// 1. Recomputing: linear_tanh_backward(grad_out, x, W, b) (linear_tanh.cpp) recomputes
//    t = tanh(x·Wᵀ + b) inside. Its node keeps (grad_out, x); its backward is
//    linear_tanh_double_backward, which recomputes t again. Used under torch.func and for direct
//    calls of the op.
// 2. From the output: linear_tanh_backward_from_output(grad_out, x, t, W, b) takes t as an input.
//    Its node keeps (grad_out, t) (x only for grad_W), and g = grad_out·(1 − t²) is rebuilt from
//    them: one elementwise pass, never a GEMM or a tanh. ckpt_ext/ops.py uses it with
//    create_graph=True in plain autograd, with t from one recompute that keeps its output, so
//    every gradient w.r.t. t from every order lands on that one node and is turned into x and
//    W gradients there, once per pass, as plain autograd does at its tanh node. Its backward is
//    linear_tanh_backward_from_output_backward, which needs no recompute at all.
//
// The math. The first-order backward, with x and grad_out flattened to (M, K) and (M, N):
//   z = x·Wᵀ + b,  t = tanh(z),  s = 1 − t²,  g = grad_out·s,
//   grad_x = g·W,  grad_W = gᵀ·x,  grad_b = Σ_rows g.
// Given ggx, ggW, ggb (the gradients w.r.t. grad_x, grad_W, grad_b), L = <ggx, g·W> +
// <ggW, gᵀ·x> + <ggb, Σ_rows g>, and its gradient w.r.t. g (x and W held) is
//   dg = ggx·Wᵀ + x·ggWᵀ + ggb                                     (M, N)
// Through g = grad_out·s:  grad_grad_out = dg·s.
// Through s = 1 − t²:      grad_t = −2·dg·grad_out·t                (M, N)
// and x and W also appear explicitly, in grad_W = gᵀ·x and grad_x = g·W:
//   explicit grad_x = g·ggW  (M, K),   explicit grad_W = gᵀ·ggx  (N, K).
// From the output (2.), t is an input: the results are grad_grad_out, the explicit terms and
// grad_t, period. Recomputing (1.), t = tanh(x·Wᵀ + b) is internal, so grad_t goes on through
// dt/dz = s to
//   dz = −2·dg·grad_out·t·s                                          (M, N)
//   grad_x = dz·W + g·ggW,   grad_W = dzᵀ·x + gᵀ·ggx,   grad_b = Σ_rows dz.
// (Checked: tests/test_double_backward.py runs gradcheck and gradgradcheck of these ops in
// float64, and compares the third order with stock PyTorch.)
//
// The third order of the output-based path, linear_tanh_backward_from_output_double_backward, is
// the vjp of linear_tanh_backward_from_output_backward: given the gradients u_* w.r.t. its four
// results, the gradients d_* w.r.t. its seven inputs. Written out (rows flattened as above):
//   s = 1 − t²,  g = grad_out·s,  dg = ggx·Wᵀ + x·ggWᵀ + ggb,
//   d̄g = u_gy·s − 2·u_t·grad_out·t,   ḡ = u_x·ggWᵀ + ggx·u_Wᵀ,   s̄ = u_gy·dg + ḡ·grad_out,
//   d_ggx = d̄g·W + g·u_W,   d_ggW = d̄gᵀ·x + gᵀ·u_x,   d_ggb = Σ_rows d̄g,
//   d_grad_out = ḡ·s − 2·u_t·dg·t,   d_t = −2·t·s̄ − 2·u_t·dg·grad_out,
//   d_x = d̄g·ggW,   d_W = d̄gᵀ·ggx.
// Its elementwise part (d̄g, d_grad_out, d_t) is one branch-free loop per result on the CPU
// (triple_pass below), where the same formulas written with ATen ops cost a dozen passes; other
// devices use that ATen composition (ckpt_ext/ops.py, _from_output_backward_vjp), which is also
// what autograd differentiates for the fourth order.
//
// The other three ops are device-generic (CPU and CUDA, one function each): the GEMMs and
// elementwise steps are ATen ops, tanh and the bias sums the primitives of linear_tanh.h (the
// documented summation order). float16/bfloat16 compute in float32 and round each result once,
// except linear_tanh_backward_from_output, which follows linear_tanh_backward (its GEMMs in the
// storage type).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <sstream>
#include <tuple>
#include <type_traits>

#include "linear_tanh.h"

namespace ckpt_ext {

namespace {

constexpr const char* kDouble = "linear_tanh_double_backward";
constexpr const char* kFromOutput = "linear_tanh_backward_from_output";
constexpr const char* kFromOutputBackward = "linear_tanh_backward_from_output_backward";

std::string shape_of(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sym_sizes();
  return s.str();
}

// An argument that must match another tensor (`like`) in shape, dtype and device: a gradient
// flowing into one of the first-order backward's outputs (like x, weight or bias), or the output
// t (like grad_out).
void check_like(const char* op, const char* name, const std::optional<at::Tensor>& t,
                const at::Tensor& like, const char* like_name) {
  if (!t.has_value()) return;
  TORCH_CHECK_VALUE(t->sym_sizes() == like.sym_sizes(), "ckpt_ext.", op, ": ", name,
                    " must have the shape of ", like_name, " ", shape_of(like), ", got ",
                    shape_of(*t));
  TORCH_CHECK_TYPE(t->scalar_type() == like.scalar_type(), "ckpt_ext.", op, ": ", name,
                   " must have the dtype of ", like_name, " (", like.scalar_type(), "), got ",
                   t->scalar_type());
  TORCH_CHECK_VALUE(t->device() == like.device(), "ckpt_ext.", op, ": ", name,
                    " must be on the device of ", like_name, " (", like.device(), "), got ",
                    t->device());
}

// grad_grad_bias (N): given only where the layer has a bias (`has_bias`).
void check_ggb(const char* op, const std::optional<at::Tensor>& ggb, bool has_bias,
               const at::Tensor& x, const at::Tensor& weight) {
  if (!ggb.has_value()) return;
  TORCH_CHECK_VALUE(has_bias, "ckpt_ext.", op,
                    ": grad_grad_bias was given but bias is None (a layer without bias has no "
                    "grad_bias output to receive a gradient)");
  TORCH_CHECK_VALUE(ggb->dim() == 1 && ggb->sym_size(0) == weight.sym_size(0), "ckpt_ext.", op,
                    ": grad_grad_bias must have shape [", weight.sym_size(0),
                    "] (out_features), got shape ", shape_of(*ggb));
  TORCH_CHECK_TYPE(ggb->scalar_type() == x.scalar_type(), "ckpt_ext.", op,
                   ": grad_grad_bias must have the dtype of x (", x.scalar_type(), "), got ",
                   ggb->scalar_type());
  TORCH_CHECK_VALUE(ggb->device() == x.device(), "ckpt_ext.", op,
                    ": grad_grad_bias must be on the device of x (", x.device(), "), got ",
                    ggb->device());
}

void check_second_order_inputs(const char* op, const std::optional<at::Tensor>& ggx,
                               const std::optional<at::Tensor>& ggw,
                               const std::optional<at::Tensor>& ggb, const at::Tensor& grad_out,
                               const at::Tensor& x, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, bool has_bias) {
  check_linear_tanh_inputs(op, x, weight, bias);
  check_grad_out(op, grad_out, x, weight.sym_size(0));
  check_like(op, "grad_grad_x", ggx, x, "x");
  check_like(op, "grad_grad_weight", ggw, weight, "weight");
  check_ggb(op, ggb, has_bias, x, weight);
}

void check_from_output_inputs(const at::Tensor& grad_out, const at::Tensor& x,
                              const at::Tensor& output, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias) {
  check_linear_tanh_inputs(kFromOutput, x, weight, bias);
  check_grad_out(kFromOutput, grad_out, x, weight.sym_size(0));
  check_like(kFromOutput, "output", output, grad_out, "grad_out");
}

std::optional<at::Tensor> rows_of(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return std::nullopt;
  return flatten_rows(*t);
}

std::optional<at::Tensor> to_float(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return std::nullopt;
  return t->to(at::kFloat);
}

bool is_half(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// dg = ggx·Wᵀ + x·ggWᵀ + ggb (M, N) in a new buffer, the bias term in the GEMM where there is one;
// at least one of the three is given. x, ggx: (M, K).
at::Tensor grad_of_g(const std::optional<at::Tensor>& ggx, const std::optional<at::Tensor>& ggw,
                     const std::optional<at::Tensor>& ggb, const at::Tensor& x,
                     const at::Tensor& weight) {
  at::Tensor dg;
  if (ggx.has_value()) {
    dg = ggb.has_value() ? at::addmm(*ggb, *ggx, weight.t()) : at::mm(*ggx, weight.t());
    if (ggw.has_value()) dg.addmm_(x, ggw->t());
  } else if (ggw.has_value()) {
    dg = ggb.has_value() ? at::addmm(*ggb, x, ggw->t()) : at::mm(x, ggw->t());
  } else {
    dg = ggb->expand({x.size(0), weight.size(0)}).contiguous();
  }
  return dg;
}

// ----------------------------------------------------------------------------------------------
// linear_tanh_double_backward: the backward of linear_tanh_backward (recomputing)

// On (M, K) / (M, N) matrices of one dtype (float or double; the op upcasts half types first).
// Returns (dgy (M, N), dx (M, K), dW (N, K), db (N)), undefined where not asked.
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
  tanh_in_place(t);

  // g = grad_out·s, needed only for the explicit terms g·ggW (grad_x) and gᵀ·ggx (grad_W).
  at::Tensor g;
  if ((want_dx && ggw.has_value()) || (want_dw && ggx.has_value())) g = at::tanh_backward(gy, t);

  // dg·s, in place in dg's buffer: the grad_grad_out result, and a factor of dz.
  at::Tensor dg_s = grad_of_g(ggx, ggw, ggb, x, weight);
  at::tanh_backward_out(dg_s, dg_s, t);
  if (want_dgy) out[0] = dg_s;

  if (want_dx || want_dw || want_db) {
    // dz = −2·dg·grad_out·t·s = −2·(dg·s)·grad_out·t, in place in t's buffer.
    at::Tensor dz = t.mul_(gy).mul_(dg_s).mul_(-2);
    t = at::Tensor();
    dg_s = at::Tensor();
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
  check_second_order_inputs(kDouble, grad_grad_x, grad_grad_weight, grad_grad_bias, grad_out, x,
                            weight, bias, bias.has_value());
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  at::Tensor x2 = flatten_rows(x);
  at::Tensor gy2 = grad_out.reshape({x2.size(0), weight.size(0)});
  std::optional<at::Tensor> ggx2 = rows_of(grad_grad_x);
  std::array<at::Tensor, 4> r;
  const at::ScalarType dtype = x.scalar_type();
  if (is_half(dtype)) {
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
  check_second_order_inputs(kDouble, grad_grad_x, grad_grad_weight, grad_grad_bias, grad_out, x,
                            weight, bias, bias.has_value());
  return {output_mask[0] ? at::empty_symint(grad_out.sym_sizes(), x.options()) : at::Tensor(),
          output_mask[1] ? at::empty_symint(x.sym_sizes(), x.options()) : at::Tensor(),
          output_mask[2] ? at::empty_symint(weight.sym_sizes(), x.options()) : at::Tensor(),
          output_mask[3] && bias.has_value()
              ? at::empty_symint({weight.sym_size(0)}, x.options())
              : at::Tensor()};
}

// ----------------------------------------------------------------------------------------------
// linear_tanh_backward_from_output: linear_tanh_backward after its recompute, from t.

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_tanh_backward_from_output(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& output,
    const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    std::array<bool, 3> output_mask) {
  check_from_output_inputs(grad_out, x, output, weight, bias);
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  at::Tensor x2 = flatten_rows(x);
  const int64_t M = x2.size(0), N = weight.size(0);
  // g = grad_out·(1 − t²), t left as it is; the bias gradient as the column sums of g in the
  // documented order (linear_tanh.h), as linear_tanh_backward sums it.
  at::Tensor g = at::tanh_backward(grad_out.reshape({M, N}), output.reshape({M, N}));
  at::Tensor grad_b = output_mask[2] && bias.has_value() ? bias_grad(g) : at::Tensor();
  at::Tensor grad_x = output_mask[0] ? at::mm(g, weight).view(x.sizes()) : at::Tensor();
  at::Tensor grad_w = output_mask[1] ? at::mm(g.t(), x2) : at::Tensor();
  return {grad_x, grad_w, grad_b};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_tanh_backward_from_output_meta(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& output,
    const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    std::array<bool, 3> output_mask) {
  check_from_output_inputs(grad_out, x, output, weight, bias);
  return {output_mask[0] ? at::empty_symint(x.sym_sizes(), x.options()) : at::Tensor(),
          output_mask[1] ? at::empty_symint(weight.sym_sizes(), x.options()) : at::Tensor(),
          output_mask[2] && bias.has_value()
              ? at::empty_symint({weight.sym_size(0)}, x.options())
              : at::Tensor()};
}

// ----------------------------------------------------------------------------------------------
// linear_tanh_backward_from_output_backward: its backward (nothing to recompute)

// Returns (dgy (M, N), dx (M, K), dt (M, N), dW (N, K)), undefined where not asked.
std::array<at::Tensor, 4> from_output_backward_2d(const std::optional<at::Tensor>& ggx,
                                                  const std::optional<at::Tensor>& ggw,
                                                  const std::optional<at::Tensor>& ggb,
                                                  const at::Tensor& gy, const at::Tensor& x,
                                                  const at::Tensor& t, const at::Tensor& weight,
                                                  std::array<bool, 4> mask) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const bool want_dgy = mask[0], want_dx = mask[1], want_dt = mask[2], want_dw = mask[3];
  std::array<at::Tensor, 4> out;
  // The explicit terms g·ggW and gᵀ·ggx, with g = grad_out·(1 − t²).
  at::Tensor g;
  if ((want_dx && ggw.has_value()) || (want_dw && ggx.has_value())) g = at::tanh_backward(gy, t);
  if (want_dx) out[1] = ggw.has_value() ? at::mm(g, *ggw) : at::zeros({M, K}, x.options());
  if (want_dw) out[3] = ggx.has_value() ? at::mm(g.t(), *ggx) : at::zeros({N, K}, x.options());
  g = at::Tensor();
  if (!want_dgy && !want_dt) return out;
  if (!ggx.has_value() && !ggw.has_value() && !ggb.has_value()) {
    if (want_dgy) out[0] = at::zeros({M, N}, x.options());
    if (want_dt) out[2] = at::zeros({M, N}, x.options());
    return out;
  }
  at::Tensor dg = grad_of_g(ggx, ggw, ggb, x, weight);
  if (want_dt) out[2] = at::mul(dg, gy).mul_(t).mul_(-2);  // −2·dg·grad_out·t
  if (want_dgy) {
    at::tanh_backward_out(dg, dg, t);  // dg·(1 − t²), in place
    out[0] = dg;
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
linear_tanh_backward_from_output_backward(
    const std::optional<at::Tensor>& grad_grad_x, const std::optional<at::Tensor>& grad_grad_weight,
    const std::optional<at::Tensor>& grad_grad_bias, const at::Tensor& grad_out,
    const at::Tensor& x, const at::Tensor& output, const at::Tensor& weight,
    std::array<bool, 4> output_mask) {
  constexpr const char* op = kFromOutputBackward;
  check_second_order_inputs(op, grad_grad_x, grad_grad_weight, grad_grad_bias, grad_out, x,
                            weight, std::nullopt, /*has_bias=*/true);
  check_like(op, "output", output, grad_out, "grad_out");
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  at::Tensor x2 = flatten_rows(x);
  const int64_t M = x2.size(0), N = weight.size(0);
  at::Tensor gy2 = grad_out.reshape({M, N}), t2 = output.reshape({M, N});
  std::optional<at::Tensor> ggx2 = rows_of(grad_grad_x);
  std::array<at::Tensor, 4> r;
  const at::ScalarType dtype = x.scalar_type();
  if (is_half(dtype)) {
    r = from_output_backward_2d(to_float(ggx2), to_float(grad_grad_weight),
                                to_float(grad_grad_bias), gy2.to(at::kFloat), x2.to(at::kFloat),
                                t2.to(at::kFloat), weight.to(at::kFloat), output_mask);
    for (auto& t : r) {
      if (t.defined()) t = t.to(dtype);
    }
  } else {
    r = from_output_backward_2d(ggx2, grad_grad_weight, grad_grad_bias, gy2, x2, t2, weight,
                                output_mask);
  }
  if (r[0].defined()) r[0] = r[0].view(grad_out.sizes());
  if (r[1].defined()) r[1] = r[1].view(x.sizes());
  if (r[2].defined()) r[2] = r[2].view(output.sizes());
  return {r[0], r[1], r[2], r[3]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
linear_tanh_backward_from_output_backward_meta(
    const std::optional<at::Tensor>& grad_grad_x, const std::optional<at::Tensor>& grad_grad_weight,
    const std::optional<at::Tensor>& grad_grad_bias, const at::Tensor& grad_out,
    const at::Tensor& x, const at::Tensor& output, const at::Tensor& weight,
    std::array<bool, 4> output_mask) {
  constexpr const char* op = kFromOutputBackward;
  check_second_order_inputs(op, grad_grad_x, grad_grad_weight, grad_grad_bias, grad_out, x,
                            weight, std::nullopt, /*has_bias=*/true);
  check_like(op, "output", output, grad_out, "grad_out");
  return {output_mask[0] ? at::empty_symint(grad_out.sym_sizes(), x.options()) : at::Tensor(),
          output_mask[1] ? at::empty_symint(x.sym_sizes(), x.options()) : at::Tensor(),
          output_mask[2] ? at::empty_symint(output.sym_sizes(), x.options()) : at::Tensor(),
          output_mask[3] ? at::empty_symint(weight.sym_sizes(), x.options()) : at::Tensor()};
}

// ----------------------------------------------------------------------------------------------
// linear_tanh_backward_from_output_double_backward: the third order, CPU

// The elementwise part. Each result is its own loop over the M·N elements, templated on which
// inputs it reads are present (an absent one is zero), so that no loop has a branch and the
// compiler vectorizes each (a single loop with null checks per element ran 6x slower). All arrays
// are (M·N) contiguous; a null output pointer is not computed.
template <bool kUgy, bool kUt, typename T>
void dgbar_loop(int64_t n, const T* t, const T* gy, const T* ugy, const T* ut, T* out) {
  at::parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T v = T(0);
      if constexpr (kUgy) v += ugy[i] * (T(1) - t[i] * t[i]);      // u_gy·s
      if constexpr (kUt) v += T(-2) * ut[i] * gy[i] * t[i];           // − 2·u_t·gy·t
      out[i] = v;
    }
  });
}

template <bool kGbar, bool kUtDg, typename T>
void gybar_loop(int64_t n, const T* t, const T* dg, const T* gbar, const T* ut, T* out) {
  at::parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T v = T(0);
      if constexpr (kGbar) v += gbar[i] * (T(1) - t[i] * t[i]);     // ḡ·s
      if constexpr (kUtDg) v += T(-2) * ut[i] * dg[i] * t[i];         // − 2·u_t·dg·t
      out[i] = v;
    }
  });
}

template <bool kUgyDg, bool kGbar, bool kUtDg, typename T>
void tbar_loop(int64_t n, const T* t, const T* gy, const T* dg, const T* gbar, const T* ugy,
               const T* ut, T* out) {
  at::parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T sbar = T(0);
      if constexpr (kUgyDg) sbar += ugy[i] * dg[i];                   // u_gy·dg
      if constexpr (kGbar) sbar += gbar[i] * gy[i];                   // + ḡ·gy
      T v = T(-2) * t[i] * sbar;                                      // −2·t·s̄
      if constexpr (kUtDg) v += T(-2) * ut[i] * dg[i] * gy[i];        // − 2·u_t·dg·gy
      out[i] = v;
    }
  });
}

// Calls f(std::bool_constant<a>{}, std::bool_constant<b>{}) for runtime a, b.
template <typename F>
void with_bools(bool a, bool b, F&& f) {
  if (a) {
    if (b) f(std::true_type{}, std::true_type{}); else f(std::true_type{}, std::false_type{});
  } else {
    if (b) f(std::false_type{}, std::true_type{}); else f(std::false_type{}, std::false_type{});
  }
}

template <typename T>
void triple_pass(int64_t n, const T* t, const T* gy, const T* dg, const T* gbar, const T* ugy,
                 const T* ut, T* dgbar, T* gybar, T* tbar) {
  if (dgbar) {
    with_bools(ugy != nullptr, ut != nullptr, [&](auto u, auto v) {
      dgbar_loop<decltype(u)::value, decltype(v)::value>(n, t, gy, ugy, ut, dgbar);
    });
  }
  const bool ut_dg = ut != nullptr && dg != nullptr;
  if (gybar) {
    with_bools(gbar != nullptr, ut_dg, [&](auto u, auto v) {
      gybar_loop<decltype(u)::value, decltype(v)::value>(n, t, dg, gbar, ut, gybar);
    });
  }
  if (tbar) {
    const bool ugy_dg = ugy != nullptr && dg != nullptr;
    with_bools(ugy_dg, gbar != nullptr, [&](auto u, auto v) {
      if (ut_dg) {
        tbar_loop<decltype(u)::value, decltype(v)::value, true>(n, t, gy, dg, gbar, ugy, ut, tbar);
      } else {
        tbar_loop<decltype(u)::value, decltype(v)::value, false>(n, t, gy, dg, gbar, ugy, ut,
                                                                 tbar);
      }
    });
  }
}

template <typename T>
const T* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

template <typename T>
T* mut_ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.mutable_data_ptr<T>() : nullptr;
}

at::Tensor contiguous_or_undefined(const std::optional<at::Tensor>& t, int64_t rows) {
  if (!t.has_value()) return at::Tensor();
  return t->reshape({rows, t->size(-1)}).contiguous();
}

using Seven = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                         at::Tensor>;

void check_triple_inputs(const std::optional<at::Tensor>& ggx,
                         const std::optional<at::Tensor>& ggw,
                         const std::optional<at::Tensor>& ggb, const at::Tensor& grad_out,
                         const at::Tensor& x, const at::Tensor& output, const at::Tensor& weight,
                         const std::optional<at::Tensor>& u_gy,
                         const std::optional<at::Tensor>& u_x,
                         const std::optional<at::Tensor>& u_t,
                         const std::optional<at::Tensor>& u_w) {
  constexpr const char* op = "linear_tanh_backward_from_output_double_backward";
  check_second_order_inputs(op, ggx, ggw, ggb, grad_out, x, weight, std::nullopt,
                            /*has_bias=*/true);
  check_like(op, "output", output, grad_out, "grad_out");
  check_like(op, "u_grad_grad_out", u_gy, grad_out, "grad_out");
  check_like(op, "u_grad_x", u_x, x, "x");
  check_like(op, "u_grad_output", u_t, grad_out, "grad_out");
  check_like(op, "u_grad_weight", u_w, weight, "weight");
}

Seven linear_tanh_backward_from_output_double_backward(
    const std::optional<at::Tensor>& ggx, const std::optional<at::Tensor>& ggw,
    const std::optional<at::Tensor>& ggb, const at::Tensor& grad_out, const at::Tensor& x,
    const at::Tensor& output, const at::Tensor& weight, const std::optional<at::Tensor>& u_gy,
    const std::optional<at::Tensor>& u_x, const std::optional<at::Tensor>& u_t,
    const std::optional<at::Tensor>& u_w, std::array<bool, 7> mask) {
  check_triple_inputs(ggx, ggw, ggb, grad_out, x, output, weight, u_gy, u_x, u_t, u_w);
  const at::ScalarType dtype = x.scalar_type();
  const bool half = is_half(dtype);
  auto up = [&](const std::optional<at::Tensor>& t) -> std::optional<at::Tensor> {
    return half ? to_float(t) : t;
  };
  const at::Tensor x2 = flatten_rows(half ? x.to(at::kFloat) : x);
  const at::Tensor w = half ? weight.to(at::kFloat) : weight;
  const int64_t M = x2.size(0), K = x2.size(1), N = w.size(0);
  const std::optional<at::Tensor> ggw_ = up(ggw), ggb_ = up(ggb), u_w_ = up(u_w);
  const std::optional<at::Tensor> ggx2 = rows_of(up(ggx)), ux2 = rows_of(up(u_x));
  const at::Tensor t2 = (half ? output.to(at::kFloat) : output).reshape({M, N}).contiguous();
  const at::Tensor gy2 = (half ? grad_out.to(at::kFloat) : grad_out).reshape({M, N}).contiguous();
  const at::Tensor ugy2 = contiguous_or_undefined(up(u_gy), M);
  const at::Tensor ut2 = contiguous_or_undefined(up(u_t), M);
  const at::TensorOptions opts = x2.options();

  const bool any_q = ggx2.has_value() || ggw_.has_value() || ggb_.has_value();
  // d̄g feeds d_ggx, d_ggW, d_ggb, d_x, d_W; ḡ feeds d_grad_out and d_t; dg feeds d_grad_out,
  // d_t (and nothing else).
  const bool want_dgbar = (mask[0] || mask[1] || mask[2] || mask[4] || mask[6]) &&
                          (ugy2.defined() || ut2.defined());
  const bool want_g = (mask[0] && u_w_.has_value()) || (mask[1] && ux2.has_value());
  at::Tensor dg = any_q && (mask[3] || mask[5]) && (ugy2.defined() || ut2.defined())
                      ? grad_of_g(ggx2, ggw_, ggb_, x2, w)
                      : at::Tensor();
  at::Tensor gbar;
  if (mask[3] || mask[5]) {
    if (ux2.has_value() && ggw_.has_value()) gbar = at::mm(*ux2, ggw_->t());
    if (u_w_.has_value() && ggx2.has_value()) {
      gbar = gbar.defined() ? gbar.addmm_(*ggx2, u_w_->t()) : at::mm(*ggx2, u_w_->t());
    }
  }
  at::Tensor dgbar = want_dgbar ? at::empty({M, N}, opts) : at::Tensor();
  at::Tensor gybar = mask[3] ? at::empty({M, N}, opts) : at::Tensor();
  at::Tensor tbar = mask[5] ? at::empty({M, N}, opts) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(t2.scalar_type(), "from_output_triple_pass", [&] {
    triple_pass<scalar_t>(M * N, t2.const_data_ptr<scalar_t>(), gy2.const_data_ptr<scalar_t>(),
                          ptr_or_null<scalar_t>(dg), ptr_or_null<scalar_t>(gbar),
                          ptr_or_null<scalar_t>(ugy2), ptr_or_null<scalar_t>(ut2),
                          mut_ptr_or_null<scalar_t>(dgbar), mut_ptr_or_null<scalar_t>(gybar),
                          mut_ptr_or_null<scalar_t>(tbar));
  });
  // g = grad_out·s, only for the terms g·u_W and gᵀ·u_x.
  const at::Tensor g = want_g ? at::tanh_backward(gy2, t2) : at::Tensor();
  dg = at::Tensor();
  gbar = at::Tensor();

  // The GEMMs of the results (each a sum of the terms whose inputs are given), zeros where a
  // result is asked for and nothing contributes.
  auto sum_mm = [&](std::initializer_list<std::pair<at::Tensor, at::Tensor>> terms,
                    at::IntArrayRef shape) {
    at::Tensor out;
    for (const auto& [a, b] : terms) {
      if (!a.defined() || !b.defined()) continue;
      out = out.defined() ? out.addmm_(a, b) : at::mm(a, b);
    }
    return out.defined() ? out : at::zeros(shape, opts);
  };
  const at::Tensor none;
  auto val = [&](const std::optional<at::Tensor>& t) { return t.has_value() ? *t : none; };
  auto tr = [&](const at::Tensor& t) { return t.defined() ? t.t() : t; };
  std::array<at::Tensor, 7> r;
  if (mask[0]) r[0] = sum_mm({{dgbar, w}, {g, val(u_w_)}}, {M, K}).view(x.sizes());
  if (mask[1]) r[1] = sum_mm({{tr(dgbar), x2}, {tr(g), val(ux2)}}, {N, K});
  if (mask[2]) r[2] = dgbar.defined() ? dgbar.sum(0) : at::zeros({N}, opts);
  if (mask[3]) r[3] = gybar.view(grad_out.sizes());
  if (mask[4]) r[4] = sum_mm({{dgbar, val(ggw_)}}, {M, K}).view(x.sizes());
  if (mask[5]) r[5] = tbar.view(output.sizes());
  if (mask[6]) r[6] = sum_mm({{tr(dgbar), val(ggx2)}}, {N, K});
  if (half) {
    for (auto& v : r) {
      if (v.defined()) v = v.to(dtype);
    }
  }
  return {r[0], r[1], r[2], r[3], r[4], r[5], r[6]};
}

Seven linear_tanh_backward_from_output_double_backward_meta(
    const std::optional<at::Tensor>& ggx, const std::optional<at::Tensor>& ggw,
    const std::optional<at::Tensor>& ggb, const at::Tensor& grad_out, const at::Tensor& x,
    const at::Tensor& output, const at::Tensor& weight, const std::optional<at::Tensor>& u_gy,
    const std::optional<at::Tensor>& u_x, const std::optional<at::Tensor>& u_t,
    const std::optional<at::Tensor>& u_w, std::array<bool, 7> mask) {
  check_triple_inputs(ggx, ggw, ggb, grad_out, x, output, weight, u_gy, u_x, u_t, u_w);
  auto like = [&](bool want, c10::SymIntArrayRef shape) {
    return want ? at::empty_symint(shape, x.options()) : at::Tensor();
  };
  const std::vector<c10::SymInt> n{weight.sym_size(0)};
  return {like(mask[0], x.sym_sizes()),        like(mask[1], weight.sym_sizes()),
          like(mask[2], n),                    like(mask[3], grad_out.sym_sizes()),
          like(mask[4], x.sym_sizes()),        like(mask[5], output.sym_sizes()),
          like(mask[6], weight.sym_sizes())};
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
  m.def(
      "linear_tanh_backward_from_output(Tensor grad_out, Tensor x, Tensor output, Tensor weight, "
      "Tensor? bias, bool[3] output_mask) -> (Tensor grad_x, Tensor grad_weight, "
      "Tensor grad_bias)");
  m.def(
      "linear_tanh_backward_from_output_backward(Tensor? grad_grad_x, Tensor? grad_grad_weight, "
      "Tensor? grad_grad_bias, Tensor grad_out, Tensor x, Tensor output, Tensor weight, "
      "bool[4] output_mask) -> (Tensor grad_grad_out, Tensor grad_x, Tensor grad_output, "
      "Tensor grad_weight)");
  m.def(
      "linear_tanh_backward_from_output_double_backward(Tensor? grad_grad_x, "
      "Tensor? grad_grad_weight, Tensor? grad_grad_bias, Tensor grad_out, Tensor x, "
      "Tensor output, Tensor weight, Tensor? u_grad_grad_out, Tensor? u_grad_x, "
      "Tensor? u_grad_output, Tensor? u_grad_weight, bool[7] output_mask) -> "
      "(Tensor d_grad_grad_x, Tensor d_grad_grad_weight, Tensor d_grad_grad_bias, "
      "Tensor d_grad_out, Tensor d_x, Tensor d_output, Tensor d_weight)");
}

TORCH_LIBRARY_IMPL(ckpt_ext, CPU, m) {
  m.impl("linear_tanh_double_backward", &linear_tanh_double_backward);
  m.impl("linear_tanh_backward_from_output", &linear_tanh_backward_from_output);
  m.impl("linear_tanh_backward_from_output_backward", &linear_tanh_backward_from_output_backward);
  m.impl("linear_tanh_backward_from_output_double_backward",
         &linear_tanh_backward_from_output_double_backward);
}

#ifdef CKPT_EXT_WITH_CUDA
TORCH_LIBRARY_IMPL(ckpt_ext, CUDA, m) {
  m.impl("linear_tanh_double_backward", &linear_tanh_double_backward);
  m.impl("linear_tanh_backward_from_output", &linear_tanh_backward_from_output);
  m.impl("linear_tanh_backward_from_output_backward", &linear_tanh_backward_from_output_backward);
}
#else
TORCH_LIBRARY_IMPL(ckpt_ext, CUDA, m) {
  for (const char* name : {"linear_tanh_double_backward", "linear_tanh_backward_from_output",
                           "linear_tanh_backward_from_output_backward"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&no_cuda_kernels>());
  }
}
#endif

TORCH_LIBRARY_IMPL(ckpt_ext, Meta, m) {
  m.impl("linear_tanh_double_backward", &linear_tanh_double_backward_meta);
  m.impl("linear_tanh_backward_from_output", &linear_tanh_backward_from_output_meta);
  m.impl("linear_tanh_backward_from_output_backward",
         &linear_tanh_backward_from_output_backward_meta);
  m.impl("linear_tanh_backward_from_output_double_backward",
         &linear_tanh_backward_from_output_double_backward_meta);
}

}  // namespace ckpt_ext
