// cuda/linear_tanh.cu — the CUDA implementation of the fused Linear+Tanh ops (schemas and CPU
// implementation: ../linear_tanh.cpp; the scalar bodies both run: ../linear_tanh_math.h).
//
//   linear_tanh(x, weight, bias)            x (..., K), weight (N, K), bias (N)?  ->  y (..., N)
//       cuBLAS GEMM with the bias in its epilogue (at::addmm_out on the current stream) writes
//       z = x·Wᵀ + b into the output; tanh_kernel then applies tanh in place, 16 bytes at a time.
//   linear_tanh_backward(grad_out, x, weight, bias, output_mask)  ->  (grad_x?, grad_W?, grad_b?)
//       Recomputes z = x·Wᵀ + b the same way into one (M, N) buffer; tanh_backward_kernel turns it
//       in place into g = grad_out · (1 − tanh(z)²) and writes per-(row chunk, column) partial sums;
//       bias_grad_sum_kernel adds the partials of each column in chunk order (no atomics: two runs
//       give bitwise identical grad_b); then grad_x = g·W and grad_W = gᵀ·x with cuBLAS.
//
// Why the bias goes into the GEMM rather than into the elementwise kernels (the CPU path does the
// same): for float16/bfloat16 the GEMM output is rounded to the storage type, so adding b
// afterwards rounds z twice; where z and b nearly cancel, tanh(z + b) then lost up to 5x the
// bfloat16 tolerance against float64 in the width sweep (1 row, 1 column), where stock
// F.linear (bias inside the GEMM, one rounding) stayed at 0.15x. The kernels still call the shared
// bodies of linear_tanh_math.h.
//
// M = prod(x.shape[:-1]) rows, N = out_features, K = in_features. All indices are 64-bit, so
// buffers past 2^31 elements are fine. Every launch goes on at::cuda::getCurrentCUDAStream() under
// a CUDAGuard for x's device and is followed by a launch-error check naming the op.
//
// Build: setup.py compiles this file when torch is a CUDA build and nvcc is found (see README).
#include "linear_tanh.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>

#include "linear_tanh_math.h"

namespace ckpt_ext {
namespace {

constexpr int kThreads = 256;

// One 16-byte (or, for V = 1, one-element) group of values, loaded and stored as a unit.
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// Blocks for `work` items with grid-stride loops: enough to fill every SM several times over,
// no more (a grid-stride loop is then as fast as one item per thread and needs no 2^31 limit).
int64_t num_blocks(int64_t work) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t wanted = (work + kThreads - 1) / kThreads;
  return std::max<int64_t>(1, std::min<int64_t>(wanted, sms * 32));
}

void check_launch(const char* op, const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "ckpt_ext.", op, ": CUDA launch of ", kernel, " failed: ",
              cudaGetErrorName(err), ": ", cudaGetErrorString(err));
}

// ----------------------------------------------------------------------------------------------
// kernels

// acc is (M, N) contiguous, holds z = x·Wᵀ + b; numel = M * N. acc = tanh(acc) in place.
// Thread t takes packs t, t + stride, ...: pack p is elements [p*V, p*V + V) of the flat buffer
// (rows do not matter: no bias here). The numel % V elements after the last whole pack are the
// scalar tail. V = 1 is the plain path, for an acc that is not 16-byte aligned.
template <typename scalar_t, int V>
__global__ void tanh_kernel(scalar_t* __restrict__ acc, int64_t numel) {
  using acc_t = at::opmath_type<scalar_t>;
  using PackT = Pack<scalar_t, V>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t num_packs = numel / V;
  PackT* packs = reinterpret_cast<PackT*>(acc);
  for (int64_t p = tid; p < num_packs; p += stride) {
    PackT pk = packs[p];
#pragma unroll
    for (int j = 0; j < V; ++j) pk.v[j] = tanh_value<scalar_t, acc_t>(pk.v[j]);
    packs[p] = pk;
  }
  for (int64_t i = num_packs * V + tid; i < numel; i += stride) {
    tanh_at<scalar_t, acc_t>(acc, i);
  }
}

// acc is (M, N) contiguous, holds z = x·Wᵀ + b and becomes g in place; gy is (M, N) with strides
// (gy_sr, gy_sc); partial is (num_chunks, N) in acc_t, or nullptr when the
// bias grad is not wanted. Item t is (chunk, col) = (t / N, t % N): adjacent threads take adjacent
// columns, so each of the chunk's rows is read and written coalesced.
template <typename scalar_t>
__global__ void tanh_backward_kernel(scalar_t* __restrict__ acc, const scalar_t* __restrict__ gy,
                                     int64_t gy_sr, int64_t gy_sc,
                                     int64_t M, int64_t N, int64_t num_chunks,
                                     at::opmath_type<scalar_t>* __restrict__ partial) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t items = num_chunks * N;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < items;
       t += stride) {
    const int64_t chunk = t / N;
    const int64_t col = t - chunk * N;
    const acc_t s = tanh_backward_chunk_column<scalar_t, acc_t>(acc, gy, gy_sr, gy_sc, M,
                                                                 N, chunk, col);
    if (partial != nullptr) partial[t] = s;  // t == chunk * N + col
  }
}

// partial is (num_chunks, N) in acc_t, grad_b is (N): grad_b[col] = sum over chunks, in chunk
// order. One thread per column; consecutive columns are consecutive addresses, so coalesced.
template <typename scalar_t>
__global__ void bias_grad_sum_kernel(const at::opmath_type<scalar_t>* __restrict__ partial,
                                     scalar_t* __restrict__ grad_b, int64_t num_chunks,
                                     int64_t N) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; col < N;
       col += stride) {
    grad_b[col] = static_cast<scalar_t>(sum_partials_column(partial, num_chunks, N, col));
  }
}

// ----------------------------------------------------------------------------------------------
// launchers

template <typename scalar_t>
void launch_tanh(const char* op, scalar_t* acc, int64_t numel) {
  constexpr int V = 16 / sizeof(scalar_t);  // 4 floats, 2 doubles, 8 halves per 16 bytes
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (reinterpret_cast<std::uintptr_t>(acc) % 16 == 0) {
    tanh_kernel<scalar_t, V><<<num_blocks(numel / V + 1), kThreads, 0, stream>>>(acc, numel);
  } else {
    tanh_kernel<scalar_t, 1><<<num_blocks(numel), kThreads, 0, stream>>>(acc, numel);
  }
  check_launch(op, "tanh_kernel");
}

void check_on_cuda(const char* op, const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.is_cuda(), "ckpt_ext.", op,
                    ": the CUDA kernel needs x on a CUDA device, got x on ", x.device());
}

}  // namespace

at::Tensor linear_tanh_cuda(const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
  check_linear_tanh_inputs("linear_tanh", x, weight, bias);
  check_on_cuda("linear_tanh", x);
  const c10::cuda::CUDAGuard guard(x.device());
  // (M, N), contiguous: the only full-size buffer; the GEMM writes straight into it.
  at::Tensor out = pre_activation(flatten_rows(x), weight, bias);
  if (out.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "linear_tanh_cuda",
                                    [&] {
      launch_tanh<scalar_t>("linear_tanh", out.data_ptr<scalar_t>(), out.numel());
    });
  }
  // _unsafe_view, as on the CPU: the result must not be an autograd view of the internal buffer,
  // or in-place ops on the output (`y += residual`, Dropout(inplace=True)) are refused.
  return at::_unsafe_view(out, linear_tanh_out_shape(x, weight));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_tanh_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, std::array<bool, 3> output_mask) {
  constexpr const char* op = "linear_tanh_backward";
  check_linear_tanh_inputs(op, x, weight, bias);
  check_linear_tanh_grad_out(op, grad_out, x, weight);
  check_on_cuda(op, x);
  const c10::cuda::CUDAGuard guard(x.device());
  const BackwardState s = recompute_for_backward(grad_out, x, weight, bias, output_mask);
  const int64_t M = s.M, N = s.N, num_chunks = s.num_chunks;
  at::Tensor grad_b;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(),
                                  "linear_tanh_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    at::Tensor partial;  // (num_chunks, N): 1/32 of g, in the accumulate type
    if (s.need_bias) {
      partial = new_buffer({num_chunks, N},
                          x.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    }
    if (num_chunks * N > 0) {
      tanh_backward_kernel<scalar_t><<<num_blocks(num_chunks * N), kThreads, 0, stream>>>(
          s.g.data_ptr<scalar_t>(), s.gy.const_data_ptr<scalar_t>(), s.gy.stride(0),
          s.gy.stride(1), M, N, num_chunks, s.need_bias ? partial.data_ptr<acc_t>() : nullptr);
      check_launch(op, "tanh_backward_kernel");
    }
    if (s.need_bias) {
      grad_b = new_buffer({N}, x.options());
      if (N > 0) {
        bias_grad_sum_kernel<scalar_t><<<num_blocks(N), kThreads, 0, stream>>>(
            partial.const_data_ptr<acc_t>(), grad_b.data_ptr<scalar_t>(), num_chunks, N);
        check_launch(op, "bias_grad_sum_kernel");
      }
    }
  });
  return grad_gemms(s, x, weight, grad_b, output_mask);
}

// ----------------------------------------------------------------------------------------------
// registration (the schemas are defined once, in ../linear_tanh.cpp)

TORCH_LIBRARY_IMPL(ckpt_ext, CUDA, m) {
  m.impl("linear_tanh", &linear_tanh_cuda);
  m.impl("linear_tanh_backward", &linear_tanh_backward_cuda);
}

}  // namespace ckpt_ext
