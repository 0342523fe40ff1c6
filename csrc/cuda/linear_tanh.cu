// cuda/linear_tanh.cu — the CUDA primitives of the fused Linear+Tanh ops (declared in
// ../primitives.h; the CPU ones are in ../cpu/linear_tanh.cpp; the stack engine in ../stack.cpp).
//
//   tanh_cuda_(acc)                               acc (M, N) contiguous: z -> t = tanh(z) in place
//   tanh_backward_cuda_(acc, grad_out, holds, b)  acc (M, N) contiguous: z or t (holds) -> g =
//                                                 grad_out·(1 − t²) in place; grad_out (M, N), any
//                                                 strides; -> grad_b (N) = column sums of g, if b
//   bias_grad_cuda(grad_out)                      grad_out (M, N), any strides -> column sums (N)
//   activation_cuda_ / activation_backward_cuda_  the same for any activation (activations.h)
// Bandwidth-bound passes: 16-byte packs, loads first, no atomics (docs/design.md, "CUDA primitives").
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "../primitives.h"
#include "../activations.h"
#include "../linear_tanh_math.h"

namespace ckpt_ext {
namespace {

constexpr int kThreads = 256;      // threads per block, every kernel
constexpr int kPackBytes = 16;     // one vector load / store
constexpr int kTanhUnroll = 4;     // packs per thread in flight in the forward kernel
constexpr int kRowsPerBatch = 8;   // rows per thread in flight in the backward kernel
static_assert(kRowsPerChunk % kRowsPerBatch == 0, "a full chunk is a whole number of batches");
constexpr int kGroupChunks = 128;  // chunk sums one block combines in shared memory (2^7)
constexpr int kTileCols = 32;      // columns per block in the combine kernel (one per lane)
constexpr int kTileRows = kThreads / kTileCols;
static_assert((kGroupChunks & (kGroupChunks - 1)) == 0, "a group must be a complete subtree");
static_assert(kTileCols == 32, "one warp per tile row: conflict-free shared memory, coalesced");

// V values of type T loaded and stored as one unit; alignas makes the compiler emit one 16-byte
// access for a 16-byte pack (ATen's aligned_vector does the same).
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <typename T>
bool aligned_to(const T* p, int64_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

// tanh in the accumulate type; see the header comment for the bfloat16 choice.
template <typename scalar_t>
struct Tanh {
  __device__ __forceinline__ static float apply(float v) { return ::tanhf(v); }
};
template <>
struct Tanh<double> {
  __device__ __forceinline__ static double apply(double v) { return ::tanh(v); }
};
template <>
struct Tanh<c10::BFloat16> {
  __device__ __forceinline__ static float apply(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(v));
    return t;
#else
    return ::tanhf(v);
#endif
  }
};

// tanh where a derivative is taken from it; see the header comment.
__device__ __forceinline__ float exact_tanh(float v) { return ::tanhf(v); }
__device__ __forceinline__ double exact_tanh(double v) { return ::tanh(v); }

// Adds that are never contracted into an FMA with the multiply that produced an operand.
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

// A value whose every operation is rounded on its own (the _rn intrinsics are never contracted
// into an FMA). The shared formulas of linear_tanh_math.h are instantiated with it, so that their
// bits do not depend on where the compiler chose to contract: the vector and the scalar path, and
// every kernel that uses a formula, give the same bits.
template <typename T>
struct Rounded {
  T v;
  __device__ __forceinline__ Rounded(T x) : v(x) {}
};
__device__ __forceinline__ Rounded<float> operator*(Rounded<float> a, Rounded<float> b) {
  return __fmul_rn(a.v, b.v);
}
__device__ __forceinline__ Rounded<float> operator-(Rounded<float> a, Rounded<float> b) {
  return __fsub_rn(a.v, b.v);
}
__device__ __forceinline__ Rounded<double> operator*(Rounded<double> a, Rounded<double> b) {
  return __dmul_rn(a.v, b.v);
}
__device__ __forceinline__ Rounded<double> operator-(Rounded<double> a, Rounded<double> b) {
  return __dsub_rn(a.v, b.v);
}

// Blocks for a grid-stride loop over `items` items of `per_block` each: enough to fill every SM
// several times over, no more (the loop then needs no 2^31 limit on the item count). Never 0.
int64_t grid_for(int64_t items, int64_t per_block) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t wanted = (items + per_block - 1) / per_block;
  return std::max<int64_t>(1, std::min<int64_t>(wanted, sms * 16));
}

void check_launch(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "ckpt_ext: CUDA launch of ", kernel, " failed: ",
              cudaGetErrorName(err), ": ", cudaGetErrorString(err));
}

// ----------------------------------------------------------------------------------------------
// forward: t = tanh(z) in place

// acc is (M, N) contiguous, numel = M·N, read as a flat array of packs of V elements (V = 1 when
// acc is not 16-byte aligned): on entry it holds z, on exit t. The packs are cut into tiles of
// kThreads·kTanhUnroll; block b takes tiles b, b + gridDim.x, ...; in a tile, thread i takes packs
// i, i + kThreads, ... (each of its kTanhUnroll accesses is coalesced across the warp) and issues
// all its loads before its first store. The numel % V elements after the last whole pack (the
// tail, < V) are done by the first threads of block 0.
// f(z) in the accumulate type: tanh's own (see the header comment), any other activation's
// formula from activations.h.
template <Activation kAct, typename scalar_t>
__device__ __forceinline__ at::opmath_type<scalar_t> activate_value(at::opmath_type<scalar_t> z) {
  if constexpr (kAct == Activation::kTanh) {
    return Tanh<scalar_t>::apply(z);
  } else {
    return activate<kAct>(z);
  }
}

template <typename scalar_t, int V, Activation kAct = Activation::kTanh>
__global__ void __launch_bounds__(kThreads) tanh_kernel(scalar_t* __restrict__ acc, int64_t numel) {
  using acc_t = at::opmath_type<scalar_t>;
  using PackT = Pack<scalar_t, V>;
  PackT* packs = reinterpret_cast<PackT*>(acc);
  const int64_t n_packs = numel / V;
  constexpr int64_t kTile = int64_t(kThreads) * kTanhUnroll;
  for (int64_t tile0 = int64_t(blockIdx.x) * kTile; tile0 < n_packs;
       tile0 += int64_t(gridDim.x) * kTile) {
    PackT z[kTanhUnroll];  // z in, t out, in registers
#pragma unroll
    for (int j = 0; j < kTanhUnroll; ++j) {
      const int64_t p = tile0 + threadIdx.x + int64_t(j) * kThreads;
      if (p < n_packs) z[j] = packs[p];
    }
#pragma unroll
    for (int j = 0; j < kTanhUnroll; ++j) {
      const int64_t p = tile0 + threadIdx.x + int64_t(j) * kThreads;
      if (p < n_packs) {
#pragma unroll
        for (int e = 0; e < V; ++e) {
          z[j].v[e] = static_cast<scalar_t>(activate_value<kAct, scalar_t>(static_cast<acc_t>(z[j].v[e])));
        }
        packs[p] = z[j];
      }
    }
  }
  if constexpr (V > 1) {
    const int64_t i = n_packs * V + threadIdx.x;  // tail: fewer than V <= kThreads elements
    if (blockIdx.x == 0 && i < numel) {
      acc[i] = static_cast<scalar_t>(activate_value<kAct, scalar_t>(static_cast<acc_t>(acc[i])));
    }
  }
}

// ----------------------------------------------------------------------------------------------
// backward: g = grad_out · (1 − t²) in place, with the per-chunk column sums of g

// What the backward kernel reads from acc and writes back.
enum class Pass {
  kFromPreActivation,  // acc holds z: t = tanh(z), then acc = g
  kFromTanhOutput,     // acc holds t: acc = g
  kSumOnly,            // no acc: only the column sums of grad_out (bias_grad_cuda)
};

// How grad_out is read.
enum class GradRead {
  kBroadcast,  // one value for every element (strides (0, 0)): loaded once per thread
  kStrided,    // element (r, c) at r·sr + c·sc; with V > 1, sc == 1 and 16-byte aligned rows
};

// One row of one pack: `held` is what acc holds (z or t) and becomes g; gy is grad_out's pack (or
// the broadcast value); `sums` accumulates g per column (grad_out for kSumOnly), in row order.
template <Pass kPass, GradRead kRead, Activation kAct, typename scalar_t, int V>
__device__ __forceinline__ void backward_row(Pack<scalar_t, V>& held, const Pack<scalar_t, V>& gy,
                                             at::opmath_type<scalar_t> gy_bcast,
                                             at::opmath_type<scalar_t> (&sums)[V]) {
  using acc_t = at::opmath_type<scalar_t>;
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const acc_t grad = kRead == GradRead::kBroadcast ? gy_bcast : static_cast<acc_t>(gy.v[e]);
    if constexpr (kPass == Pass::kSumOnly) {
      sums[e] = add_rn(sums[e], grad);
    } else {
      acc_t g;
      if constexpr (kAct != Activation::kTanh) {  // held is z
        g = activation_grad<kAct>(grad, static_cast<acc_t>(held.v[e]));
      } else {
        acc_t t = static_cast<acc_t>(held.v[e]);
        if constexpr (kPass == Pass::kFromPreActivation) t = exact_tanh(t);
        g = tanh_grad_from_output(Rounded<acc_t>(grad), Rounded<acc_t>(t)).v;
      }
      held.v[e] = static_cast<scalar_t>(g);
      sums[e] = add_rn(sums[e], g);  // the unrounded g, as on the CPU (half types round on store)
    }
  }
}

// acc: (M, N) contiguous, holds z or t (kPass) and becomes g; nullptr for kSumOnly.
// grad_out: (M, N) at strides (sr, sc) (kRead). partial: (num_chunks(M), N) in acc_t, the column
// sums of g over each 32-row chunk, or nullptr when the bias gradient is not wanted.
// Work item = (chunk, pack of V adjacent columns), chunk-major: the threads of a warp take adjacent
// packs of the same rows, so every row step is one coalesced access per warp. The thread walks its
// chunk's rows in increasing order (the documented in-chunk order), kRowsPerBatch rows' loads at a
// time on a full chunk; only the last chunk can be partial and takes the plain loop.
template <typename scalar_t, int V, Pass kPass, GradRead kRead, Activation kAct>
__global__ void __launch_bounds__(kThreads)
    tanh_backward_kernel(scalar_t* __restrict__ acc, const scalar_t* __restrict__ grad_out,
                         int64_t sr, int64_t sc, int64_t M, int64_t N,
                         at::opmath_type<scalar_t>* __restrict__ partial) {
  using acc_t = at::opmath_type<scalar_t>;
  using PackT = Pack<scalar_t, V>;
  constexpr bool kHasAcc = kPass != Pass::kSumOnly;
  constexpr bool kLoadsGrad = kRead == GradRead::kStrided;
  const int64_t packs_per_row = N / V;
  const int64_t items = num_chunks(M) * packs_per_row;
  const acc_t gy_bcast = kLoadsGrad ? acc_t(0) : static_cast<acc_t>(grad_out[0]);
  PackT gy_unused{};  // what backward_row gets for gy when grad_out is broadcast
  for (int64_t item = int64_t(blockIdx.x) * kThreads + threadIdx.x; item < items;
       item += int64_t(gridDim.x) * kThreads) {
    const int64_t chunk = item / packs_per_row;
    const int64_t col = (item - chunk * packs_per_row) * V;
    const int64_t row0 = chunk * kRowsPerChunk;
    const int64_t rows = M - row0 < kRowsPerChunk ? M - row0 : kRowsPerChunk;
    // The thread's pack in the chunk's first row: row r of it is acc_row + r·N (z or t there, g
    // after) and grad_row + r·sr.
    scalar_t* acc_row = kHasAcc ? acc + row0 * N + col : nullptr;
    const scalar_t* grad_row = grad_out + row0 * sr + col * sc;
    acc_t sums[V];
#pragma unroll
    for (int e = 0; e < V; ++e) sums[e] = acc_t(0);

    if (rows == kRowsPerChunk) {
#pragma unroll 1
      for (int r0 = 0; r0 < kRowsPerChunk; r0 += kRowsPerBatch) {
        // r * N and r * sr below are loop-invariant (r is a constant after unrolling): one
        // multiply per batch here, none per row.
        scalar_t* const acc_batch = kHasAcc ? acc_row + r0 * N : nullptr;
        const scalar_t* const grad_batch = grad_row + r0 * sr;
        PackT held[kRowsPerBatch];  // z or t as loaded, then g
        PackT gy[kLoadsGrad ? kRowsPerBatch : 1];
#pragma unroll
        for (int r = 0; r < kRowsPerBatch; ++r) {  // every load of the batch first
          if constexpr (kHasAcc) held[r] = *reinterpret_cast<const PackT*>(acc_batch + r * N);
          if constexpr (kLoadsGrad) gy[r] = *reinterpret_cast<const PackT*>(grad_batch + r * sr);
        }
#pragma unroll
        for (int r = 0; r < kRowsPerBatch; ++r) {  // then the rows in order: g, sums, store
          if constexpr (kLoadsGrad) {
            backward_row<kPass, kRead, kAct>(held[r], gy[r], gy_bcast, sums);
          } else {
            backward_row<kPass, kRead, kAct>(held[r], gy_unused, gy_bcast, sums);
          }
          if constexpr (kHasAcc) *reinterpret_cast<PackT*>(acc_batch + r * N) = held[r];
        }
      }
    } else {
#pragma unroll 1
      for (int64_t r = 0; r < rows; ++r) {
        PackT held;  // z or t as loaded, then g
        PackT gy = gy_unused;
        if constexpr (kHasAcc) held = *reinterpret_cast<const PackT*>(acc_row + r * N);
        if constexpr (kLoadsGrad) gy = *reinterpret_cast<const PackT*>(grad_row + r * sr);
        backward_row<kPass, kRead, kAct>(held, gy, gy_bcast, sums);
        if constexpr (kHasAcc) *reinterpret_cast<PackT*>(acc_row + r * N) = held;
      }
    }

    if (partial != nullptr) {  // (chunk, col..col+V-1): V·sizeof(acc_t)-aligned since V | N
      Pack<acc_t, V> out;
#pragma unroll
      for (int e = 0; e < V; ++e) out.v[e] = sums[e];
      *reinterpret_cast<Pack<acc_t, V>*>(partial + chunk * N + col) = out;
    }
  }
}

// ----------------------------------------------------------------------------------------------
// the pairwise combination of the chunk sums

// sums_in: (n_in, N) acc_t, the sums of consecutive aligned subtrees of the documented pairwise
// tree (the chunk sums on the first pass, the group sums after). A tile is (kGroupChunks rows of
// sums_in, kTileCols columns); block b takes tiles b, b + gridDim.x, ... For each tile it loads the
// group into shared memory and runs the levels w = 1, 2, 4, ... of combine_chunks_pairwise on it:
// at level w, row i (a multiple of 2w) adds row i + w if i + w < n (the group's row count); rows of
// the group are rows c0 + i of the whole column with c0 a multiple of kGroupChunks, so these are
// exactly the whole tree's pairs at that level, and the group's sum (row 0) is the tree's node at
// c0. Out: group sum g goes to row g of sums_out (acc_t, for the next pass), or, on the last pass
// (n_in <= kGroupChunks: one group), to grad_b rounded to scalar_t.
template <typename scalar_t, bool kLastPass>
__global__ void __launch_bounds__(kThreads)
    combine_chunks_kernel(const at::opmath_type<scalar_t>* __restrict__ sums_in, int64_t n_in,
                          int64_t N, at::opmath_type<scalar_t>* __restrict__ sums_out,
                          scalar_t* __restrict__ grad_b) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t group[kGroupChunks][kTileCols];
  const int lane = threadIdx.x % kTileCols;  // the column within the tile
  const int ty = threadIdx.x / kTileCols;    // a warp per ty
  const int64_t col_tiles = (N + kTileCols - 1) / kTileCols;
  const int64_t tiles = col_tiles * ((n_in + kGroupChunks - 1) / kGroupChunks);
  // The loop bounds and n depend on blockIdx only: every __syncthreads below is block-uniform.
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t g = tile / col_tiles;
    const int64_t col = (tile - g * col_tiles) * kTileCols + lane;
    const int64_t c0 = g * kGroupChunks;
    const int n = static_cast<int>(n_in - c0 < kGroupChunks ? n_in - c0 : kGroupChunks);
    for (int i = ty; i < n; i += kTileRows) {
      group[i][lane] = col < N ? sums_in[(c0 + i) * N + col] : acc_t(0);
    }
    __syncthreads();
    for (int w = 1; w < n; w *= 2) {
      // Pairs (i, i + w), i a multiple of 2w: the rows read (i + w, an odd multiple of w) are
      // never written at this level, so the level has no race; the barrier orders the levels.
      for (int i = 2 * w * ty; i + w < n; i += 2 * w * kTileRows) {
        group[i][lane] = add_rn(group[i][lane], group[i + w][lane]);
      }
      __syncthreads();
    }
    if (ty == 0 && col < N) {
      if constexpr (kLastPass) {
        grad_b[col] = static_cast<scalar_t>(group[0][lane]);
      } else {
        sums_out[g * N + col] = group[0][lane];
      }
    }
    __syncthreads();  // row 0 is read before the next tile overwrites the group
  }
}

// partial: (C, N) chunk sums in acc_t (overwritten: it serves as a scratch buffer of later passes).
// grad_b: (N) scalar_t, receives each column's pairwise sum. N > 0.
template <typename scalar_t>
void combine_partials(at::Tensor& partial, int64_t C, int64_t N, const at::Tensor& grad_b,
                      cudaStream_t stream) {
  using acc_t = at::opmath_type<scalar_t>;
  if (C == 0) {  // M == 0: every column sums nothing
    grad_b.zero_();
    return;
  }
  at::Tensor sums_in = partial;  // ping-pong: no pass writes the buffer it reads
  at::Tensor sums_out;
  int64_t n_in = C;
  const int64_t col_tiles = (N + kTileCols - 1) / kTileCols;
  while (n_in > kGroupChunks) {
    const int64_t n_out = (n_in + kGroupChunks - 1) / kGroupChunks;
    if (!sums_out.defined()) sums_out = new_buffer({n_out, N}, partial.options());
    combine_chunks_kernel<scalar_t, false>
        <<<grid_for(col_tiles * n_out, 1), kThreads, 0, stream>>>(
            sums_in.const_data_ptr<acc_t>(), n_in, N, sums_out.data_ptr<acc_t>(), nullptr);
    check_launch("combine_chunks_kernel");
    std::swap(sums_in, sums_out);  // the old input (>= n_out rows) is the next pass's output
    n_in = n_out;
  }
  combine_chunks_kernel<scalar_t, true><<<grid_for(col_tiles, 1), kThreads, 0, stream>>>(
      sums_in.const_data_ptr<acc_t>(), n_in, N, nullptr, grad_b.data_ptr<scalar_t>());
  check_launch("combine_chunks_kernel");
}

template <typename scalar_t, int V, Pass kPass, GradRead kRead, Activation kAct>
void launch_backward(scalar_t* acc, const at::Tensor& grad_out, int64_t M, int64_t N,
                     at::opmath_type<scalar_t>* partial, cudaStream_t stream) {
  const int64_t items = num_chunks(M) * (N / V);
  tanh_backward_kernel<scalar_t, V, kPass, kRead, kAct>
      <<<grid_for(items, kThreads), kThreads, 0, stream>>>(
          acc, grad_out.const_data_ptr<scalar_t>(), grad_out.stride(0), grad_out.stride(1), M, N,
          partial);
  check_launch("tanh_backward_kernel");
}

template <typename scalar_t, Pass kPass, Activation kAct = Activation::kTanh>
void launch_backward(scalar_t* acc, const at::Tensor& grad_out, int64_t M, int64_t N,
                     at::opmath_type<scalar_t>* partial, bool vector, bool broadcast,
                     cudaStream_t stream) {
  constexpr int V = kPackBytes / sizeof(scalar_t);
  if (vector && broadcast) {
    launch_backward<scalar_t, V, kPass, GradRead::kBroadcast, kAct>(acc, grad_out, M, N, partial,
                                                                     stream);
  } else if (vector) {
    launch_backward<scalar_t, V, kPass, GradRead::kStrided, kAct>(acc, grad_out, M, N, partial,
                                                                   stream);
  } else if (broadcast) {
    launch_backward<scalar_t, 1, kPass, GradRead::kBroadcast, kAct>(acc, grad_out, M, N, partial,
                                                                     stream);
  } else {
    launch_backward<scalar_t, 1, kPass, GradRead::kStrided, kAct>(acc, grad_out, M, N, partial,
                                                                   stream);
  }
}

// The backward pass over acc (undefined: kSumOnly, the sums of grad_out alone); -> grad_b (N), or
// undefined when !want_bias_grad.
// act: the activation of a kFromPreActivation pass.
at::Tensor backward_pass(const at::Tensor& acc, const at::Tensor& grad_out, Pass pass,
                         bool want_bias_grad, Activation act = Activation::kTanh) {
  const int64_t M = grad_out.size(0), N = grad_out.size(1), C = num_chunks(M);
  const int64_t sr = grad_out.stride(0), sc = grad_out.stride(1);
  at::Tensor grad_b;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad_out.scalar_type(),
                                  "tanh_backward_cuda_", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    constexpr int V = kPackBytes / sizeof(scalar_t);
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    if (want_bias_grad) grad_b = new_buffer({N}, grad_out.options());
    if (N == 0) return;  // nothing to do, and a grid of 0 blocks is an invalid launch
    at::Tensor partial;  // (C, N) chunk sums: 1/32 of g, in the accumulate type
    if (want_bias_grad) {
      partial = new_buffer({C, N}, grad_out.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    }
    if (M > 0) {
      // A size-1 dimension's stride is never used (only index 0 is), so it does not count.
      const bool broadcast = (M == 1 || sr == 0) && (N == 1 || sc == 0);
      scalar_t* acc_ptr = acc.defined() ? acc.data_ptr<scalar_t>() : nullptr;
      const bool vector =
          N % V == 0 && (acc_ptr == nullptr || aligned_to(acc_ptr, kPackBytes)) &&
          (broadcast || (sc == 1 && (M == 1 || sr % V == 0) &&
                         aligned_to(grad_out.const_data_ptr<scalar_t>(), kPackBytes)));
      acc_t* partial_ptr = want_bias_grad ? partial.data_ptr<acc_t>() : nullptr;
      switch (pass) {
        case Pass::kFromPreActivation:
          with_activation(act, [&](auto a) {
            launch_backward<scalar_t, Pass::kFromPreActivation, decltype(a)::value>(
                acc_ptr, grad_out, M, N, partial_ptr, vector, broadcast, stream);
          });
          break;
        case Pass::kFromTanhOutput:
          launch_backward<scalar_t, Pass::kFromTanhOutput>(acc_ptr, grad_out, M, N, partial_ptr,
                                                           vector, broadcast, stream);
          break;
        case Pass::kSumOnly:
          launch_backward<scalar_t, Pass::kSumOnly>(acc_ptr, grad_out, M, N, partial_ptr, vector,
                                                    broadcast, stream);
          break;
      }
    }
    if (want_bias_grad) combine_partials<scalar_t>(partial, C, N, grad_b, stream);
  });
  return grad_b;
}

}  // namespace

namespace {

template <Activation kAct>
void activation_pass(const at::Tensor& acc) {
  TORCH_INTERNAL_ASSERT(acc.is_cuda() && acc.is_contiguous());
  const int64_t numel = acc.numel();
  if (numel == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, acc.scalar_type(), "tanh_cuda_", [&] {
    constexpr int V = kPackBytes / sizeof(scalar_t);
    constexpr int64_t kTile = int64_t(kThreads) * kTanhUnroll;
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    scalar_t* z = acc.data_ptr<scalar_t>();  // becomes t
    if (aligned_to(z, kPackBytes)) {
      tanh_kernel<scalar_t, V, kAct><<<grid_for(numel / V, kTile), kThreads, 0, stream>>>(z, numel);
    } else {
      tanh_kernel<scalar_t, 1, kAct><<<grid_for(numel, kTile), kThreads, 0, stream>>>(z, numel);
    }
    check_launch("tanh_kernel");
  });
}

}  // namespace

void tanh_cuda_(const at::Tensor& acc) { activation_pass<Activation::kTanh>(acc); }

void activation_cuda_(const at::Tensor& acc, Activation act) {
  with_activation(act, [&](auto a) { activation_pass<decltype(a)::value>(acc); });
}

at::Tensor activation_backward_cuda_(const at::Tensor& acc, const at::Tensor& grad_out,
                                     Activation act, bool want_bias_grad) {
  TORCH_INTERNAL_ASSERT(acc.is_cuda() && acc.is_contiguous() && acc.dim() == 2 &&
                        grad_out.sizes() == acc.sizes());
  return backward_pass(acc, grad_out, Pass::kFromPreActivation, want_bias_grad, act);
}

at::Tensor tanh_backward_cuda_(const at::Tensor& acc, const at::Tensor& grad_out, Holds holds,
                               bool want_bias_grad) {
  TORCH_INTERNAL_ASSERT(acc.is_cuda() && acc.is_contiguous() && acc.dim() == 2 &&
                        grad_out.sizes() == acc.sizes());
  return backward_pass(acc, grad_out,
                       holds == Holds::kPreActivation ? Pass::kFromPreActivation
                                                      : Pass::kFromTanhOutput,
                       want_bias_grad);
}

at::Tensor bias_grad_cuda(const at::Tensor& grad_out) {
  TORCH_INTERNAL_ASSERT(grad_out.is_cuda() && grad_out.dim() == 2);
  return backward_pass(at::Tensor(), grad_out, Pass::kSumOnly, true);
}

}  // namespace ckpt_ext
