// cpu/third_order.cpp — linear_tanh_backward_from_output_double_backward, CPU only: the vjp of
// linear_tanh_backward_from_output_backward (schema in ../schemas.cpp; the formulas in
// docs/design.md, "Higher orders"). Its elementwise part is one vectorised pass for all its
// results (cpu/kernels.cpp, per ISA level), where the same formulas as ATen ops (ckpt_ext/_derivatives.py,
// used on other devices and to differentiate it again) cost a dozen passes. Shapes: rows (M, K)
// and (M, N), weight (N, K).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>

#include "../checks.h"
#include "../higher_order.h"
#include "../registration.h"
#include "../stack.h"
#include "kernels.h"

namespace ckpt_ext {

namespace {

// The elementwise part: the vectorised kernel of the ISA level in force (cpu/kernels.cpp), over
// chunks of the M·N elements in parallel.
template <typename T>
void triple_pass(int64_t n, const T* t, const T* gy, const T* dg, const T* gbar, const T* ugy,
                 const T* ut, T* dgbar, T* gybar, T* tbar) {
  const auto third_order = cpu::kernels().of<T>().third_order;
  at::parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) {
    third_order(begin, end, t, gy, dg, gbar, ugy, ut, dgbar, gybar, tbar);
  });
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

template <Kernel kernel>
Seven linear_tanh_backward_from_output_double_backward(
    const std::optional<at::Tensor>& ggx, const std::optional<at::Tensor>& ggw,
    const std::optional<at::Tensor>& ggb, const at::Tensor& grad_out, const at::Tensor& x,
    const at::Tensor& output, const at::Tensor& weight, const std::optional<at::Tensor>& u_gy,
    const std::optional<at::Tensor>& u_x, const std::optional<at::Tensor>& u_t,
    const std::optional<at::Tensor>& u_w, std::array<bool, 7> mask) {
  check_third_order_inputs(ggx, ggw, ggb, grad_out, x, output, weight, u_gy, u_x, u_t, u_w);
  if constexpr (kernel == Kernel::kMeta) {
    auto like = [&](bool want, c10::SymIntArrayRef shape) {
      return want ? at::empty_symint(shape, x.options()) : at::Tensor();
    };
    const std::vector<c10::SymInt> n{weight.sym_size(0)};
    return {like(mask[0], x.sym_sizes()),        like(mask[1], weight.sym_sizes()),
            like(mask[2], n),                    like(mask[3], grad_out.sym_sizes()),
            like(mask[4], x.sym_sizes()),        like(mask[5], output.sym_sizes()),
            like(mask[6], weight.sym_sizes())};
  }
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(ckpt_ext, m) {
  register_kernels(m, "linear_tanh_backward_from_output_double_backward",
                   &linear_tanh_backward_from_output_double_backward<Kernel::kCompute>,
                   &linear_tanh_backward_from_output_double_backward<Kernel::kMeta>,
                   Devices::kCpu);
}

}  // namespace ckpt_ext
