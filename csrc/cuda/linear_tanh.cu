// cuda/linear_tanh.cu — the CUDA primitives of the fused Linear+Tanh ops (declared in
// ../linear_tanh.h; the CPU ones are in ../cpu/linear_tanh.cpp; the ops that call them, with the
// cuBLAS GEMMs, in ../linear_tanh.cpp and ../tanh_mlp.cpp).
//
//   tanh_cuda_(acc)                               acc (M, N) contiguous: z -> tanh(z) in place,
//                                                 16 bytes per thread and step
//   tanh_backward_cuda_(acc, grad_out, holds, b)  acc (M, N): z or t -> g = grad_out·(1 − t²) in
//                                                 place; grad_out (M, N) any strides; -> grad_b (N)?
//   bias_grad_cuda(grad_out)                      grad_out (M, N) any strides -> column sums (N)
//
// The bias sums follow the documented order of ../linear_tanh_math.h (rows in increasing order per
// 32-row chunk, then the chunk sums pairwise per column): no atomics, so two runs give the same
// bits. float16 and bfloat16 compute in float32 and round once. No --use_fast_math: its tanh
// approximation would cost the accuracy the tests hold us to.
//
// M = prod(x.shape[:-1]) rows, N = out_features. All indices are 64-bit, so buffers past 2^31
// elements are fine. Every launch goes on at::cuda::getCurrentCUDAStream() (the caller holds the
// device guard) and is followed by a launch-error check naming the kernel.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>

#include <cstdint>

#include "../linear_tanh.h"
#include "../linear_tanh_math.h"

namespace ckpt_ext {
namespace {

constexpr int kThreads = 256;

// One 16-byte (or, for V = 1, one-element) group of values, loaded and stored as a unit.
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

__device__ __forceinline__ float device_tanh(float v) { return ::tanhf(v); }
__device__ __forceinline__ double device_tanh(double v) { return ::tanh(v); }

// Blocks for `work` items with grid-stride loops: enough to fill every SM several times over,
// no more (a grid-stride loop is then as fast as one item per thread and needs no 2^31 limit).
int64_t num_blocks(int64_t work) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t wanted = (work + kThreads - 1) / kThreads;
  return std::max<int64_t>(1, std::min<int64_t>(wanted, sms * 32));
}

void check_launch(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "ckpt_ext: CUDA launch of ", kernel, " failed: ",
              cudaGetErrorName(err), ": ", cudaGetErrorString(err));
}

// ----------------------------------------------------------------------------------------------
// kernels

// acc is (M, N) contiguous, numel = M * N; acc = tanh(acc) in place. Thread t takes packs
// t, t + stride, ...: pack p is elements [p*V, p*V + V) of the flat buffer. The numel % V elements
// after the last whole pack are the scalar tail. V = 1 is the plain path, for an unaligned acc.
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
    for (int j = 0; j < V; ++j) {
      pk.v[j] = static_cast<scalar_t>(device_tanh(static_cast<acc_t>(pk.v[j])));
    }
    packs[p] = pk;
  }
  for (int64_t i = num_packs * V + tid; i < numel; i += stride) {
    acc[i] = static_cast<scalar_t>(device_tanh(static_cast<acc_t>(acc[i])));
  }
}

// acc (M, N) contiguous holds z (from_pre_activation) or t and becomes g in place; grad_out is
// (M, N) with strides (sr, sc); partial is (num_chunks, N) in acc_t, or nullptr when the bias grad
// is not wanted. Item t is (chunk, col) = (t / N, t % N): adjacent threads take adjacent columns,
// so each of the chunk's rows is read and written coalesced. With acc == nullptr the item only
// sums grad_out (bias_grad_cuda).
template <typename scalar_t>
__global__ void tanh_backward_kernel(scalar_t* __restrict__ acc,
                                     const scalar_t* __restrict__ grad_out, int64_t sr, int64_t sc,
                                     int64_t M, int64_t N, bool from_pre_activation,
                                     at::opmath_type<scalar_t>* __restrict__ partial) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t items = num_chunks(M) * N;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; item < items;
       item += stride) {
    const int64_t chunk = item / N;
    const int64_t col = item - chunk * N;
    const int64_t r_end = min((chunk + 1) * kRowsPerChunk, M);
    acc_t sum = acc_t(0);
    for (int64_t r = chunk * kRowsPerChunk; r < r_end; ++r) {
      const acc_t gy = static_cast<acc_t>(grad_out[r * sr + col * sc]);
      if (acc == nullptr) {
        sum += gy;
        continue;
      }
      acc_t t = static_cast<acc_t>(acc[r * N + col]);
      if (from_pre_activation) t = device_tanh(t);
      const acc_t g = tanh_grad_from_output(gy, t);
      acc[r * N + col] = static_cast<scalar_t>(g);
      sum += g;
    }
    if (partial != nullptr) partial[item] = sum;  // item == chunk * N + col
  }
}

// partial (num_chunks, N) in acc_t -> grad_b (N): each column's chunks combined pairwise, in
// place. One thread per column; consecutive columns are consecutive addresses, so coalesced.
template <typename scalar_t>
__global__ void combine_partials_kernel(at::opmath_type<scalar_t>* __restrict__ partial,
                                        scalar_t* __restrict__ grad_b, int64_t n_chunks,
                                        int64_t N) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; col < N;
       col += stride) {
    grad_b[col] = static_cast<scalar_t>(combine_chunks_pairwise(partial, n_chunks, N, col));
  }
}

// The backward pass over acc (or, acc undefined, the sums of grad_out alone): -> grad_b or
// undefined.
at::Tensor backward_pass(const at::Tensor& acc, const at::Tensor& grad_out, Holds holds,
                         bool want_bias_grad) {
  const int64_t M = grad_out.size(0), N = grad_out.size(1), C = num_chunks(M);
  at::Tensor grad_b;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad_out.scalar_type(),
                                  "tanh_backward_cuda_", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    at::Tensor partial;  // (C, N): 1/32 of g, in the accumulate type
    if (want_bias_grad) {
      partial = new_buffer({C, N}, grad_out.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    }
    if (C * N > 0) {
      tanh_backward_kernel<scalar_t><<<num_blocks(C * N), kThreads, 0, stream>>>(
          acc.defined() ? acc.data_ptr<scalar_t>() : nullptr, grad_out.const_data_ptr<scalar_t>(),
          grad_out.stride(0), grad_out.stride(1), M, N, holds == Holds::kPreActivation,
          want_bias_grad ? partial.data_ptr<acc_t>() : nullptr);
      check_launch("tanh_backward_kernel");
    }
    if (want_bias_grad) {
      grad_b = new_buffer({N}, grad_out.options());
      if (N > 0) {
        combine_partials_kernel<scalar_t><<<num_blocks(N), kThreads, 0, stream>>>(
            partial.data_ptr<acc_t>(), grad_b.data_ptr<scalar_t>(), C, N);
        check_launch("combine_partials_kernel");
      }
    }
  });
  return grad_b;
}

}  // namespace

void tanh_cuda_(const at::Tensor& acc) {
  TORCH_INTERNAL_ASSERT(acc.is_cuda() && acc.is_contiguous());
  const int64_t numel = acc.numel();
  if (numel == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, acc.scalar_type(), "tanh_cuda_", [&] {
    constexpr int V = 16 / sizeof(scalar_t);  // 4 floats, 2 doubles, 8 halves per 16 bytes
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    scalar_t* p = acc.data_ptr<scalar_t>();
    if (reinterpret_cast<std::uintptr_t>(p) % 16 == 0) {
      tanh_kernel<scalar_t, V><<<num_blocks(numel / V + 1), kThreads, 0, stream>>>(p, numel);
    } else {
      tanh_kernel<scalar_t, 1><<<num_blocks(numel), kThreads, 0, stream>>>(p, numel);
    }
    check_launch("tanh_kernel");
  });
}

at::Tensor tanh_backward_cuda_(const at::Tensor& acc, const at::Tensor& grad_out, Holds holds,
                               bool want_bias_grad) {
  TORCH_INTERNAL_ASSERT(acc.is_cuda() && acc.is_contiguous() && acc.dim() == 2);
  return backward_pass(acc, grad_out, holds, want_bias_grad);
}

at::Tensor bias_grad_cuda(const at::Tensor& grad_out) {
  TORCH_INTERNAL_ASSERT(grad_out.is_cuda() && grad_out.dim() == 2);
  return backward_pass(at::Tensor(), grad_out, Holds::kTanhOutput, true);
}

}  // namespace ckpt_ext
