// linear_tanh.cpp — the op schemas, the input checks, and the fused Linear+Tanh op on every device.
//
//   linear_tanh(x, weight, bias)            x (..., K), weight (N, K), bias (N)?  ->  y (..., N)
//       y = tanh(x·Wᵀ + b): one GEMM (bias in it) into the output buffer, one in-place tanh pass.
//   linear_tanh_backward(grad_out, x, weight, bias, output_mask)  ->  (grad_x?, grad_W?, grad_b?)
//       Recomputes z = x·Wᵀ + b the same way into ONE (M, N) buffer, turns it in place into
//       g = grad_out · (1 − tanh(z)²) while summing the bias gradient in the same pass (fixed order,
//       bitwise reproducible), then grad_x = g·W and grad_W = gᵀ·x. Only the gradients asked for in
//       output_mask are computed; the others come back undefined (None in Python).
//
// Both are the one-layer case of the stack engine in tanh_mlp.cpp (stack_forward /
// stack_backward), which does the GEMMs through ATen and calls the device primitives of
// cpu/linear_tanh.cpp and cuda/linear_tanh.cu. The same function is registered for CPU and CUDA;
// the Meta kernels below (what FakeTensor and torch.compile run) call the same checks, so a traced
// program fails with the eager message. Autograd and the FLOP formulas are registered from Python
// (ckpt_ext/ops.py).
//
// The bias goes into the GEMM (addmm) rather than into the elementwise pass: for float16/bfloat16
// the GEMM output is rounded to the storage type, so adding b afterwards rounds z twice, and where
// x·Wᵀ and b nearly cancel that cost up to 5x the bfloat16 tolerance (measured on 1-element cases);
// in the GEMM, z is rounded once, as in F.linear.
#include "linear_tanh.h"

#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <sstream>

namespace ckpt_ext {

// ----------------------------------------------------------------------------------------------
// dtypes and input checks

const std::vector<at::ScalarType>& supported_dtypes() {
  static const std::vector<at::ScalarType> dtypes{at::kFloat, at::kDouble, at::kBFloat16,
                                                  at::kHalf};
  return dtypes;
}

bool is_supported_dtype(at::ScalarType t) {
  const auto& d = supported_dtypes();
  return std::find(d.begin(), d.end(), t) != d.end();
}

namespace {

// "float32, float64, bfloat16 or float16", from supported_dtypes().
std::string supported_dtypes_text() {
  const auto& d = supported_dtypes();
  std::ostringstream s;
  for (size_t i = 0; i < d.size(); ++i) {
    if (i > 0) s << (i + 1 == d.size() ? " or " : ", ");
    s << c10::getDtypeNames(d[i]).first;  // "float32"-style names, as torch prints them
  }
  return s.str();
}

std::string shape_str(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sym_sizes();
  return s.str();
}

void check_dtype_and_device(const char* op, const std::string& name, const at::Tensor& t,
                            const at::Tensor& x) {
  TORCH_CHECK_TYPE(t.scalar_type() == x.scalar_type(), "ckpt_ext.", op, ": ", name,
                   " must have the dtype of x (", x.scalar_type(), "), got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == x.device(), "ckpt_ext.", op, ": ", name,
                    " must be on the device of x (", x.device(), "), got ", t.device());
}

void check_x(const char* op, const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() >= 1, "ckpt_ext.", op,
                    ": x must have shape (..., in_features) with at least 1 dimension, got a "
                    "0-d tensor");
}

void check_x_dtype(const char* op, const at::Tensor& x) {
  TORCH_CHECK_TYPE(is_supported_dtype(x.scalar_type()), "ckpt_ext.", op, ": x must be ",
                   supported_dtypes_text(), ", got ", x.scalar_type());
}

}  // namespace

void check_linear_tanh_inputs(const char* op, const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias) {
  check_x(op, x);
  TORCH_CHECK_VALUE(weight.dim() == 2, "ckpt_ext.", op,
                    ": weight must be 2-D (out_features, in_features), got shape ",
                    shape_str(weight));
  TORCH_CHECK_VALUE(x.sym_size(-1) == weight.sym_size(1), "ckpt_ext.", op,
                    ": x.shape[-1] must equal weight.shape[1] (in_features) = ",
                    weight.sym_size(1), ", got x of shape ", shape_str(x),
                    " and weight of shape ", shape_str(weight));
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->sym_size(0) == weight.sym_size(0), "ckpt_ext.",
                      op, ": bias must have shape [", weight.sym_size(0),
                      "] (out_features), got shape ", shape_str(*bias));
  }
  check_x_dtype(op, x);
  check_dtype_and_device(op, "weight", weight, x);
  if (bias.has_value()) check_dtype_and_device(op, "bias", *bias, x);
}

void check_tanh_mlp_inputs(const char* op, const at::Tensor& x, at::TensorList weights,
                           at::TensorList biases, const std::vector<bool>& has_bias) {
  const int64_t L = static_cast<int64_t>(weights.size());
  TORCH_CHECK_VALUE(L >= 1, "ckpt_ext.", op,
                    ": weights must hold at least one layer's weight, got an empty list");
  TORCH_CHECK_VALUE(static_cast<int64_t>(has_bias.size()) == L, "ckpt_ext.", op,
                    ": has_bias must have one entry per layer (", L, "), got ", has_bias.size());
  const int64_t with_bias = std::count(has_bias.begin(), has_bias.end(), true);
  TORCH_CHECK_VALUE(static_cast<int64_t>(biases.size()) == with_bias, "ckpt_ext.", op,
                    ": biases must hold one tensor per layer whose has_bias is true (", with_bias,
                    "), got ", biases.size());
  check_x(op, x);
  size_t j = 0;  // index into biases
  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor& w = weights[i];
    TORCH_CHECK_VALUE(w.dim() == 2, "ckpt_ext.", op, ": weights[", i,
                      "] must be 2-D (out_features, in_features), got shape ", shape_str(w));
    if (i == 0) {
      TORCH_CHECK_VALUE(w.sym_size(1) == x.sym_size(-1), "ckpt_ext.", op,
                        ": weights[0].shape[1] (in_features) must equal x.shape[-1] = ",
                        x.sym_size(-1), ", got weights[0] of shape ", shape_str(w),
                        " and x of shape ", shape_str(x));
    } else {
      TORCH_CHECK_VALUE(w.sym_size(1) == weights[i - 1].sym_size(0), "ckpt_ext.", op,
                        ": weights[", i, "].shape[1] (in_features) must equal weights[", i - 1,
                        "].shape[0] (out_features of layer ", i - 1, ") = ",
                        weights[i - 1].sym_size(0), ", got weights[", i, "] of shape ",
                        shape_str(w));
    }
    if (has_bias[i]) {
      const at::Tensor& b = biases[j++];
      TORCH_CHECK_VALUE(b.dim() == 1 && b.sym_size(0) == w.sym_size(0), "ckpt_ext.", op,
                        ": biases[", i, "] must have shape [", w.sym_size(0),
                        "] (out_features of layer ", i, "), got shape ", shape_str(b));
    }
  }
  check_x_dtype(op, x);
  j = 0;
  for (int64_t i = 0; i < L; ++i) {
    check_dtype_and_device(op, "weights[" + std::to_string(i) + "]", weights[i], x);
    if (has_bias[i]) check_dtype_and_device(op, "biases[" + std::to_string(i) + "]", biases[j++], x);
  }
}

void check_grad_out(const char* op, const at::Tensor& grad_out, const at::Tensor& x,
                    c10::SymInt out_features) {
  std::vector<c10::SymInt> expected(x.sym_sizes().begin(), x.sym_sizes().end() - 1);
  expected.push_back(out_features);
  TORCH_CHECK_VALUE(grad_out.sym_sizes() == c10::SymIntArrayRef(expected), "ckpt_ext.", op,
                    ": grad_out must have shape ", c10::SymIntArrayRef(expected), ", got ",
                    shape_str(grad_out));
  check_dtype_and_device(op, "grad_out", grad_out, x);
}

// ----------------------------------------------------------------------------------------------
// buffers

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

// ----------------------------------------------------------------------------------------------
// the device primitives, by the buffer's device

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

at::Tensor bias_grad(const at::Tensor& grad_out) {
  return CKPT_EXT_ON_DEVICE(grad_out, bias_grad_cpu(grad_out), bias_grad_cuda(grad_out));
}

#undef CKPT_EXT_ON_DEVICE

// ----------------------------------------------------------------------------------------------
// calling the ops through the dispatcher

at::Tensor call_linear_tanh(const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ckpt_ext::linear_tanh", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&)>();
  return op.call(x, weight, bias);
}

at::Tensor call_tanh_mlp(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                         const c10::List<bool>& has_bias, bool last_tanh) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ckpt_ext::tanh_mlp", "")
                       .typed<at::Tensor(const at::Tensor&, at::TensorList, at::TensorList,
                                         const c10::List<bool>&, bool)>();
  return op.call(x, weights, biases, has_bias, last_tanh);
}

// ----------------------------------------------------------------------------------------------
// the ops

namespace {

at::Tensor linear_tanh(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias) {
  check_linear_tanh_inputs("linear_tanh", x, weight, bias);
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  const bool has_bias = bias.has_value();
  return stack_forward(x, {weight}, has_bias ? at::TensorList(*bias) : at::TensorList(),
                       std::vector<bool>{has_bias}, /*last_tanh=*/true);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_tanh_backward(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, std::array<bool, 3> output_mask) {
  constexpr const char* op = "linear_tanh_backward";
  check_linear_tanh_inputs(op, x, weight, bias);
  check_grad_out(op, grad_out, x, weight.sym_size(0));
  const c10::OptionalDeviceGuard guard(at::device_of(x));
  const bool has_bias = bias.has_value();
  StackGrads g = stack_backward(grad_out, x, {weight},
                                has_bias ? at::TensorList(*bias) : at::TensorList(),
                                std::vector<bool>{has_bias}, /*last_tanh=*/true, output_mask[0],
                                std::vector<bool>{output_mask[1]},
                                has_bias ? std::vector<bool>{output_mask[2]} : std::vector<bool>{});
  return {g.grad_x, g.grad_weights[0], has_bias ? g.grad_biases[0] : at::Tensor()};
}

// Meta kernels: what FakeTensor and torch.compile run. The same checks as the eager ops, then the
// output metadata (fresh contiguous tensors), read as SymInts so dynamic shapes trace.
std::vector<c10::SymInt> out_shape(const at::Tensor& x, c10::SymInt out_features) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end() - 1);
  shape.push_back(std::move(out_features));
  return shape;
}

at::Tensor linear_tanh_meta(const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
  check_linear_tanh_inputs("linear_tanh", x, weight, bias);
  return at::empty_symint(out_shape(x, weight.sym_size(0)), x.options());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_tanh_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, std::array<bool, 3> output_mask) {
  constexpr const char* op = "linear_tanh_backward";
  check_linear_tanh_inputs(op, x, weight, bias);
  check_grad_out(op, grad_out, x, weight.sym_size(0));
  return {output_mask[0] ? at::empty_symint(x.sym_sizes(), x.options()) : at::Tensor(),
          output_mask[1] ? at::empty_symint(weight.sym_sizes(), x.options()) : at::Tensor(),
          output_mask[2] && bias.has_value()
              ? at::empty_symint({weight.sym_size(0)}, x.options())
              : at::Tensor()};
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// registration. Every schema of the library is defined here, once.

TORCH_LIBRARY(ckpt_ext, m) {
  m.def("linear_tanh(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def(
      "linear_tanh_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor? bias, "
      "bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  // A stack of Linear layers with tanh after each (after the last only when last_tanh).
  // `biases` holds the biases of the layers whose has_bias is true, in layer order (a list of
  // Tensor, not Tensor?, so that autograd sees every bias).
  m.def("tanh_mlp(Tensor x, Tensor[] weights, Tensor[] biases, bool[] has_bias, bool last_tanh)"
        " -> Tensor");
  // grad_weights / grad_biases hold only the gradients asked for (need_weights[i] true,
  // need_biases[j] true), in order; grad_x is undefined unless need_x.
  m.def(
      "tanh_mlp_backward(Tensor grad_out, Tensor x, Tensor[] weights, Tensor[] biases, "
      "bool[] has_bias, bool last_tanh, bool need_x, bool[] need_weights, bool[] need_biases) "
      "-> (Tensor grad_x, Tensor[] grad_weights, Tensor[] grad_biases)");
}

TORCH_LIBRARY_IMPL(ckpt_ext, CPU, m) {
  m.impl("linear_tanh", &linear_tanh);
  m.impl("linear_tanh_backward", &linear_tanh_backward);
}

#ifdef CKPT_EXT_WITH_CUDA
TORCH_LIBRARY_IMPL(ckpt_ext, CUDA, m) {
  m.impl("linear_tanh", &linear_tanh);
  m.impl("linear_tanh_backward", &linear_tanh_backward);
}
#else
void no_cuda_kernels(const c10::OperatorHandle& op, torch::jit::Stack*) {
  TORCH_CHECK(false, op.schema().name(), ": got CUDA tensors, but this build of ckpt_ext has no "
              "CUDA kernels (ckpt_ext.WITH_CUDA is False); rebuild it where nvcc and a CUDA build "
              "of torch are present (CKPT_EXT_CUDA=1 makes a missing toolkit an error)");
}

TORCH_LIBRARY_IMPL(ckpt_ext, CUDA, m) {
  for (const char* name : {"linear_tanh", "linear_tanh_backward", "tanh_mlp", "tanh_mlp_backward"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&no_cuda_kernels>());
  }
}
#endif

TORCH_LIBRARY_IMPL(ckpt_ext, Meta, m) {
  m.impl("linear_tanh", &linear_tanh_meta);
  m.impl("linear_tanh_backward", &linear_tanh_backward_meta);
}

}  // namespace ckpt_ext
