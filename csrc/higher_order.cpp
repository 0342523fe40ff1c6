// higher_order.cpp — the kernels of the orders above the first of one tanh layer
// t = tanh(x·Wᵀ + b), from t (schemas in schemas.cpp; the math in docs/design.md, "Higher
// orders"), one function each for CPU and CUDA:
//   linear_tanh_backward_from_output            the layer's first-order backward from t, an input
//   linear_tanh_backward_from_output_backward   its backward (nothing to recompute)
// Shapes: x (..., K), weight (N, K), grad_out and output (..., N), rows flattened to (M, ·).
// GEMMs and elementwise steps are ATen ops, the bias sums the primitives (primitives.h);
// from_output computes in the storage type, as mlp_backward does; its backward computes
// float16/bfloat16 in float32 and rounds each result once. The Meta kernels are the same
// functions up to the checks (checks.cpp), then fresh outputs (registration.h's Kernel).
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>

#include "checks.h"
#include "higher_order.h"
#include "primitives.h"
#include "registration.h"
#include "stack.h"

namespace ckpt_ext {

std::optional<at::Tensor> rows_of(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return std::nullopt;
  return flatten_rows(*t);
}

std::optional<at::Tensor> to_float(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return std::nullopt;
  return t->to(at::kFloat);
}

bool is_half(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

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

namespace {

// fn(args...) -> std::array<at::Tensor, 4>; for a half dtype, run in float32 on float32 copies of
// the tensor arguments, each result rounded once to dtype, as the other ops do.
at::Tensor float_of(const at::Tensor& t) { return t.to(at::kFloat); }
std::optional<at::Tensor> float_of(const std::optional<at::Tensor>& t) { return to_float(t); }
template <typename T>
const T& float_of(const T& v) { return v; }

template <typename Fn, typename... Args>
std::array<at::Tensor, 4> in_float_if_half(at::ScalarType dtype, Fn&& fn, const Args&... args) {
  if (!is_half(dtype)) return fn(args...);
  std::array<at::Tensor, 4> r = fn(float_of(args)...);
  for (auto& t : r) {
    if (t.defined()) t = t.to(dtype);
  }
  return r;
}

// ----------------------------------------------------------------------------------------------
// linear_tanh_backward_from_output: the layer's mlp_backward after its recompute, from t.

template <Kernel kernel>
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_tanh_backward_from_output(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& output,
    const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    std::array<bool, 3> output_mask) {
  check_from_output_inputs(grad_out, x, output, weight, bias);
  if constexpr (kernel == Kernel::kMeta) {
    return {output_mask[0] ? at::empty_symint(x.sym_sizes(), x.options()) : at::Tensor(),
            output_mask[1] ? empty_weight_grad(weight, x.options()) : at::Tensor(),
            output_mask[2] && bias.has_value()
                ? at::empty_symint({weight.sym_size(0)}, x.options())
                : at::Tensor()};
  }
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  at::Tensor x2 = flatten_rows(x);
  const int64_t M = x2.size(0), N = weight.size(0);
  // g = grad_out·(1 − t²), t left as it is; the bias gradient as the column sums of g in the
  // documented order (device_math.h), as mlp_backward sums it.
  at::Tensor g = at::tanh_backward(grad_out.reshape({M, N}), output.reshape({M, N}));
  at::Tensor grad_b = output_mask[2] && bias.has_value() ? bias_grad(g) : at::Tensor();
  at::Tensor grad_x = output_mask[0] ? at::mm(g, weight).view(x.sizes()) : at::Tensor();
  at::Tensor grad_w = output_mask[1] ? weight_grad(g, x2, weight) : at::Tensor();
  return {grad_x, grad_w, grad_b};
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

template <Kernel kernel>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
linear_tanh_backward_from_output_backward(
    const std::optional<at::Tensor>& grad_grad_x, const std::optional<at::Tensor>& grad_grad_weight,
    const std::optional<at::Tensor>& grad_grad_bias, const at::Tensor& grad_out,
    const at::Tensor& x, const at::Tensor& output, const at::Tensor& weight,
    std::array<bool, 4> output_mask) {
  check_from_output_backward_inputs(grad_grad_x, grad_grad_weight, grad_grad_bias, grad_out, x,
                                    output, weight);
  if constexpr (kernel == Kernel::kMeta) {
    return {output_mask[0] ? at::empty_symint(grad_out.sym_sizes(), x.options()) : at::Tensor(),
            output_mask[1] ? at::empty_symint(x.sym_sizes(), x.options()) : at::Tensor(),
            output_mask[2] ? at::empty_symint(output.sym_sizes(), x.options()) : at::Tensor(),
            output_mask[3] ? at::empty_symint(weight.sym_sizes(), x.options()) : at::Tensor()};
  }
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  at::Tensor x2 = flatten_rows(x);
  const int64_t M = x2.size(0), N = weight.size(0);
  at::Tensor gy2 = grad_out.reshape({M, N}), t2 = output.reshape({M, N});
  std::optional<at::Tensor> ggx2 = rows_of(grad_grad_x);
  std::array<at::Tensor, 4> r =
      in_float_if_half(x.scalar_type(), from_output_backward_2d, ggx2, grad_grad_weight,
                       grad_grad_bias, gy2, x2, t2, weight, output_mask);
  if (r[0].defined()) r[0] = r[0].view(grad_out.sizes());
  if (r[1].defined()) r[1] = r[1].view(x.sizes());
  if (r[2].defined()) r[2] = r[2].view(output.sizes());
  return {r[0], r[1], r[2], r[3]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ckpt_ext, m) {
  register_kernels(m, "linear_tanh_backward_from_output",
                   &linear_tanh_backward_from_output<Kernel::kCompute>,
                   &linear_tanh_backward_from_output<Kernel::kMeta>);
  register_kernels(m, "linear_tanh_backward_from_output_backward",
                   &linear_tanh_backward_from_output_backward<Kernel::kCompute>,
                   &linear_tanh_backward_from_output_backward<Kernel::kMeta>);
}

}  // namespace ckpt_ext
