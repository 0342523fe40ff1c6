// linear_tanh.cpp — op schemas, input checks and the CPU implementation of the fused Linear+Tanh.
//
//   linear_tanh(x, weight, bias)            x (..., K), weight (N, K), bias (N)?  ->  y (..., N)
//       y = tanh(x·Wᵀ + b): one GEMM (bias in it) into the output buffer, one in-place tanh pass.
//   linear_tanh_backward(grad_out, x, weight, bias, output_mask)  ->  (grad_x?, grad_W?, grad_b?)
//       Recomputes x·Wᵀ + b the same way into ONE (M, N) buffer, turns it in place into
//       g = grad_out · (1 − tanh(z)²) while summing the bias gradient in the same pass (fixed order,
//       bitwise reproducible), then grad_x = g·W and grad_W = gᵀ·x. Only the gradients asked for in
//       output_mask are computed; the others come back undefined (None in Python).
//
// The bias goes into the GEMM (addmm) rather than into the elementwise pass: for float16/bfloat16
// the GEMM output is rounded to the storage type, so adding b afterwards rounds z twice, and where
// x·Wᵀ and b nearly cancel that cost up to 5x the bfloat16 tolerance (measured on 1-element cases);
// in the GEMM, z is rounded once, as in F.linear.
//
// The scalar bodies are in linear_tanh_math.h, shared with the CUDA kernels. Autograd and the fake
// kernel are registered from Python (ckpt_ext/ops.py).
#include "linear_tanh.h"

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <atomic>
#include <limits>
#include <sstream>
#include <type_traits>

#include "linear_tanh_math.h"

namespace ckpt_ext {

// ----------------------------------------------------------------------------------------------
// input checks (shared with CUDA)

namespace {

std::string shape_str(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

bool supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

}  // namespace

void check_linear_tanh_inputs(const char* op, const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(x.dim() >= 1, "ckpt_ext.", op,
                    ": x must have shape (..., in_features) with at least 1 dimension, got a "
                    "0-d tensor");
  TORCH_CHECK_VALUE(weight.dim() == 2, "ckpt_ext.", op,
                    ": weight must be 2-D (out_features, in_features), got shape ",
                    shape_str(weight));
  TORCH_CHECK_VALUE(x.size(-1) == weight.size(1), "ckpt_ext.", op,
                    ": x.shape[-1] must equal weight.shape[1] (in_features) = ", weight.size(1),
                    ", got x of shape ", shape_str(x), " and weight of shape ", shape_str(weight));
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0), "ckpt_ext.", op,
                      ": bias must have shape [", weight.size(0),
                      "] (out_features), got shape ", shape_str(*bias));
  }
  TORCH_CHECK_TYPE(supported_dtype(x.scalar_type()), "ckpt_ext.", op,
                   ": x must be float32, float64, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK_TYPE(weight.scalar_type() == x.scalar_type(), "ckpt_ext.", op,
                   ": weight must have the dtype of x (", x.scalar_type(), "), got ",
                   weight.scalar_type());
  if (bias.has_value()) {
    TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), "ckpt_ext.", op,
                     ": bias must have the dtype of x (", x.scalar_type(), "), got ",
                     bias->scalar_type());
  }
  TORCH_CHECK_VALUE(weight.device() == x.device(), "ckpt_ext.", op,
                    ": weight must be on the device of x (", x.device(), "), got ",
                    weight.device());
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->device() == x.device(), "ckpt_ext.", op,
                      ": bias must be on the device of x (", x.device(), "), got ",
                      bias->device());
  }
}

void check_linear_tanh_grad_out(const char* op, const at::Tensor& grad_out, const at::Tensor& x,
                                const at::Tensor& weight) {
  const auto expected = linear_tanh_out_shape(x, weight);
  TORCH_CHECK_VALUE(grad_out.sizes() == at::IntArrayRef(expected), "ckpt_ext.", op,
                    ": grad_out must have shape ", at::IntArrayRef(expected), ", got ",
                    shape_str(grad_out));
  TORCH_CHECK_TYPE(grad_out.scalar_type() == x.scalar_type(), "ckpt_ext.", op,
                   ": grad_out must have the dtype of x (", x.scalar_type(), "), got ",
                   grad_out.scalar_type());
  TORCH_CHECK_VALUE(grad_out.device() == x.device(), "ckpt_ext.", op,
                    ": grad_out must be on the device of x (", x.device(), "), got ",
                    grad_out.device());
}

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

at::Tensor pre_activation(const at::Tensor& x2, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias) {
  at::Tensor out = new_buffer({x2.size(0), weight.size(0)}, x2.options());
  if (bias.has_value()) {
    at::addmm_out(out, *bias, x2, weight.t());
  } else {
    at::mm_out(out, x2, weight.t());
  }
  return out;
}

BackwardState recompute_for_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                     const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias,
                                     std::array<bool, 3> output_mask) {
  BackwardState s;
  s.N = weight.size(0);
  s.x2 = flatten_rows(x);
  s.M = s.x2.size(0);
  s.gy = grad_out.reshape({s.M, s.N});
  s.num_chunks = (s.M + kRowsPerChunk - 1) / kRowsPerChunk;
  s.need_bias = output_mask[2] && bias.has_value();
  s.g = pre_activation(s.x2, weight, bias);
  return s;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> grad_gemms(const BackwardState& s,
                                                          const at::Tensor& x,
                                                          const at::Tensor& weight,
                                                          at::Tensor grad_b,
                                                          std::array<bool, 3> output_mask) {
  at::Tensor grad_x = output_mask[0] ? at::mm(s.g, weight).view(x.sizes()) : at::Tensor();
  at::Tensor grad_w = output_mask[1] ? at::mm(s.g.t(), s.x2) : at::Tensor();
  return {grad_x, grad_w, grad_b};
}

at::Tensor flatten_rows(const at::Tensor& x) {
  int64_t m = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) m *= x.size(d);
  return x.reshape({m, x.size(-1)});
}

std::vector<int64_t> linear_tanh_out_shape(const at::Tensor& x, const at::Tensor& weight) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(weight.size(0));
  return shape;
}

// ----------------------------------------------------------------------------------------------
// CPU kernels

namespace {

template <typename scalar_t>
constexpr bool kVectorized = std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>;

// acc (M, N) contiguous, holds z: acc = tanh(acc), in place.
template <typename scalar_t>
void tanh_cpu_kernel(scalar_t* acc, int64_t numel) {
  using acc_t = at::opmath_type<scalar_t>;
  // A grain of 32k elements keeps thread start-up small against the work.
  at::parallel_for(0, numel, 32768, [&](int64_t i0, int64_t i1) {
    int64_t i = i0;
    if constexpr (kVectorized<scalar_t>) {
      using Vec = at::vec::Vectorized<scalar_t>;
      for (; i + Vec::size() <= i1; i += Vec::size()) Vec::loadu(acc + i).tanh().store(acc + i);
    }
    for (; i < i1; ++i) tanh_at<scalar_t, acc_t>(acc, i);
  });
}

// acc (M, N) contiguous holds z; becomes g in place. partial (num_chunks, N) or nullptr.
template <typename scalar_t>
void tanh_backward_cpu_kernel(scalar_t* acc, const scalar_t* gy,
                              int64_t gy_sr, int64_t gy_sc, int64_t M, int64_t N,
                              at::opmath_type<scalar_t>* partial) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t num_chunks = (M + kRowsPerChunk - 1) / kRowsPerChunk;
  at::parallel_for(0, num_chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t chunk = c0; chunk < c1; ++chunk) {
      if constexpr (kVectorized<scalar_t>) {
        if (gy_sc == 1 || gy_sc == 0) {
          // Rows outer, columns inner, so loads are contiguous; per column the rows are still
          // summed in increasing order from zero — the same order as tanh_backward_chunk_column.
          // gy_sc == 0 is a grad broadcast along the row (the grad of `out.mean()` is all one
          // value): a broadcast vector instead of a load.
          using Vec = at::vec::Vectorized<scalar_t>;
          const int64_t r_end = std::min(M, (chunk + 1) * kRowsPerChunk);
          acc_t* p = partial != nullptr ? partial + chunk * N : nullptr;
          if (p != nullptr) std::fill(p, p + N, acc_t(0));
          for (int64_t r = chunk * kRowsPerChunk; r < r_end; ++r) {
            scalar_t* row = acc + r * N;
            const scalar_t* grow = gy + r * gy_sr;
            int64_t c = 0;
            for (; c + Vec::size() <= N; c += Vec::size()) {
              const Vec gyv = gy_sc == 1 ? Vec::loadu(grow + c) : Vec(grow[0]);
              Vec g = tanh_grad_from_output(gyv, Vec::loadu(row + c).tanh());
              g.store(row + c);
              if (p != nullptr) (Vec::loadu(p + c) + g).store(p + c);
            }
            for (; c < N; ++c) {
              const acc_t g = tanh_grad_from_output<acc_t>(grow[c * gy_sc], ckpt_tanh(acc_t(row[c])));
              row[c] = g;
              if (p != nullptr) p[c] += g;
            }
          }
          continue;
        }
      }
      // Generic path (half types, strided grad_out): the shared body, one column at a time.
      for (int64_t col = 0; col < N; ++col) {
        const acc_t s = tanh_backward_chunk_column<scalar_t, acc_t>(acc, gy, gy_sr, gy_sc, M, N,
                                                                     chunk, col);
        if (partial != nullptr) partial[chunk * N + col] = s;
      }
    }
  });
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// CPU ops

at::Tensor linear_tanh_cpu(const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias) {
  check_linear_tanh_inputs("linear_tanh", x, weight, bias);
  // (M, N), contiguous: the only full-size buffer; the GEMM writes straight into it.
  at::Tensor out = pre_activation(flatten_rows(x), weight, bias);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "linear_tanh_cpu", [&] {
    tanh_cpu_kernel<scalar_t>(out.data_ptr<scalar_t>(), out.numel());
  });
  // _unsafe_view: the result must not be an autograd view of the internal buffer, or in-place ops
  // on the output (`y += residual`, Dropout(inplace=True)) are refused by autograd.
  return at::_unsafe_view(out, linear_tanh_out_shape(x, weight));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_tanh_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, std::array<bool, 3> output_mask) {
  check_linear_tanh_inputs("linear_tanh_backward", x, weight, bias);
  check_linear_tanh_grad_out("linear_tanh_backward", grad_out, x, weight);
  const BackwardState s = recompute_for_backward(grad_out, x, weight, bias, output_mask);
  const int64_t M = s.M, N = s.N, num_chunks = s.num_chunks;
  at::Tensor grad_b;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "linear_tanh_backward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    at::Tensor partial;
    if (s.need_bias) {
      partial = new_buffer({num_chunks, N}, x.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    }
    tanh_backward_cpu_kernel<scalar_t>(
        s.g.data_ptr<scalar_t>(), s.gy.const_data_ptr<scalar_t>(), s.gy.stride(0), s.gy.stride(1),
        M, N, s.need_bias ? partial.data_ptr<acc_t>() : nullptr);
    if (s.need_bias) {
      grad_b = new_buffer({N}, x.options());
      const acc_t* p = partial.const_data_ptr<acc_t>();
      scalar_t* gb = grad_b.data_ptr<scalar_t>();
      at::parallel_for(0, N, 1024, [&](int64_t c0, int64_t c1) {
        for (int64_t col = c0; col < c1; ++col) {
          gb[col] = static_cast<scalar_t>(sum_partials_column(p, num_chunks, N, col));
        }
      });
    }
  });
  return grad_gemms(s, x, weight, grad_b, output_mask);
}

// ----------------------------------------------------------------------------------------------
// registration

TORCH_LIBRARY(ckpt_ext, m) {
  m.def("linear_tanh(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def(
      "linear_tanh_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor? bias, "
      "bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ckpt_ext, CPU, m) {
  m.impl("linear_tanh", &linear_tanh_cpu);
  m.impl("linear_tanh_backward", &linear_tanh_backward_cpu);
}

}  // namespace ckpt_ext
