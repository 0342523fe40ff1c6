// cuda/linear_tanh.cu — the CUDA primitives of the fused Linear+Tanh ops (declared in
// ../linear_tanh.h; the CPU ones are in ../cpu/linear_tanh.cpp; the ops that call them, with the
// cuBLAS GEMMs, in ../linear_tanh.cpp and ../tanh_mlp.cpp).
//
//   tanh_cuda_(acc)                               acc (M, N) contiguous: z -> t = tanh(z) in place
//   tanh_backward_cuda_(acc, grad_out, holds, b)  acc (M, N) contiguous: z or t (holds) -> g =
//                                                 grad_out·(1 − t²) in place; grad_out (M, N), any
//                                                 strides; -> grad_b (N) = column sums of g, if b
//   bias_grad_cuda(grad_out)                      grad_out (M, N), any strides -> column sums (N)
//
// M = prod(x.shape[:-1]) rows, N = out_features. These passes move M·N elements and do a few flops
// each, so they are bound by memory bandwidth; everything here is shaped by that:
//
// * 16-byte packs. A thread loads and stores 16 bytes at a time (4 floats, 2 doubles, 8 halves)
//   when every pointer involved and every row stride allow it: the buffer, grad_out (its storage
//   offset included) and grad_out's row stride all 16-byte aligned, N a multiple of the pack, and
//   grad_out either contiguous along the row or broadcast (strides (0, 0), what out.mean() gives:
//   one value, loaded once per thread). Anything else takes the scalar path, one column per thread.
// * Loads first. The backward thread walks the 32 rows of a chunk (it must: that is the summation
//   order); a full chunk is a loop with a compile-time trip count that issues the loads of
//   kRowsPerBatch rows before the first store, since the compiler may not move a load of row r + 1
//   above the store to row r of the same buffer. (All 32 rows at once would need 256 registers.)
//   The forward thread likewise loads kTanhUnroll packs before its first store.
// * No atomics, one summation order. The bias sums follow the documented order of
//   ../linear_tanh_math.h bit for bit: each thread sums its columns over its chunk's rows in
//   increasing order (the chunk partials, (C, N) in the accumulate type), then the chunk partials
//   are combined pairwise, level by level. An aligned group of 2^k chunks is a complete subtree of
//   that tree, so a block combines a group of kGroupChunks chunks in shared memory with the same
//   pairing, and further passes combine the groups' sums the same way (an odd one moves up
//   unchanged, as in combine_chunks_pairwise). Every pass is parallel over (group, column): a small
//   N with a large M is not one thread looping over thousands of chunks.
// * Sums use __fadd_rn/__dadd_rn, which nvcc never fuses with the multiply that made g into an
//   FMA: the value added is the value stored, so the sum is the documented one applied to the very
//   g the kernel wrote (the tests rebuild it from g and compare bits). g itself comes from the
//   shared formula evaluated with every product and difference rounded on its own (Rounded<T>), so
//   the pack and scalar paths and both Holds give the same bits wherever the compiler contracts.
//
// tanh, forward: tanhf/tanh for float32, float16 and float64, computed in float (double). For
// bfloat16 the hardware approximation tanh.approx.f32 (sm_75+; one MUFU op instead of ~20),
// because its error is below half a unit in the last place of bfloat16: the PTX ISA gives its
// maximum relative error as about 2^-11, and an exhaustive measurement of the MUFU.TANH
// instruction behind it found 1.113e-5 (about 2^-16.5; N. Juffa, "Hardware-accelerated tanh() on
// Turing", NVIDIA developer forums, 2021), while half an ulp of bfloat16 (8 significant bits) is
// at least 2^-9 of the value. So the stored bfloat16 t is the correctly rounded one or its
// neighbour, and the recompute calls the same function on the same z, so its bits equal the
// forward's. For float16 (11 bits) the bound does not hold: float16 keeps tanhf.
// tanh, for a derivative (the backward pass from z): always the exact tanhf/tanh of the accumulate
// type. The derivative 1 − t² amplifies t's relative error by 2t²/(1 − t²), about 1500x at z = 4,
// so the approximation's 2^-16.5 would become ~94 bfloat16 ulps of g instead of the 1 the tests
// allow; stock autograd's g comes from a correctly rounded t.
// No --use_fast_math: it would change every other function too.
//
// All indices are 64-bit. Every launch goes on at::cuda::getCurrentCUDAStream() (the caller holds
// the device guard) and is followed by a launch-error check naming the kernel.
//
// The primitives are also registered, CUDA only, as torch.ops.ckpt_ext_kernels.* (bottom of this
// file): raw access for the tests (misaligned buffers, both Holds) and for the bandwidth
// microbenchmark (scripts/gpu_kernel_bench.py). Not an API.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "../linear_tanh.h"
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
template <typename scalar_t, int V>
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
          z[j].v[e] = static_cast<scalar_t>(Tanh<scalar_t>::apply(static_cast<acc_t>(z[j].v[e])));
        }
        packs[p] = z[j];
      }
    }
  }
  if constexpr (V > 1) {
    const int64_t i = n_packs * V + threadIdx.x;  // tail: fewer than V <= kThreads elements
    if (blockIdx.x == 0 && i < numel) {
      acc[i] = static_cast<scalar_t>(Tanh<scalar_t>::apply(static_cast<acc_t>(acc[i])));
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
template <Pass kPass, GradRead kRead, typename scalar_t, int V>
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
      acc_t t = static_cast<acc_t>(held.v[e]);
      if constexpr (kPass == Pass::kFromPreActivation) t = exact_tanh(t);
      const acc_t g = tanh_grad_from_output(Rounded<acc_t>(grad), Rounded<acc_t>(t)).v;
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
template <typename scalar_t, int V, Pass kPass, GradRead kRead>
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
            backward_row<kPass, kRead>(held[r], gy[r], gy_bcast, sums);
          } else {
            backward_row<kPass, kRead>(held[r], gy_unused, gy_bcast, sums);
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
        backward_row<kPass, kRead>(held, gy, gy_bcast, sums);
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

template <typename scalar_t, int V, Pass kPass, GradRead kRead>
void launch_backward(scalar_t* acc, const at::Tensor& grad_out, int64_t M, int64_t N,
                     at::opmath_type<scalar_t>* partial, cudaStream_t stream) {
  const int64_t items = num_chunks(M) * (N / V);
  tanh_backward_kernel<scalar_t, V, kPass, kRead>
      <<<grid_for(items, kThreads), kThreads, 0, stream>>>(
          acc, grad_out.const_data_ptr<scalar_t>(), grad_out.stride(0), grad_out.stride(1), M, N,
          partial);
  check_launch("tanh_backward_kernel");
}

template <typename scalar_t, Pass kPass>
void launch_backward(scalar_t* acc, const at::Tensor& grad_out, int64_t M, int64_t N,
                     at::opmath_type<scalar_t>* partial, bool vector, bool broadcast,
                     cudaStream_t stream) {
  constexpr int V = kPackBytes / sizeof(scalar_t);
  if (vector && broadcast) {
    launch_backward<scalar_t, V, kPass, GradRead::kBroadcast>(acc, grad_out, M, N, partial, stream);
  } else if (vector) {
    launch_backward<scalar_t, V, kPass, GradRead::kStrided>(acc, grad_out, M, N, partial, stream);
  } else if (broadcast) {
    launch_backward<scalar_t, 1, kPass, GradRead::kBroadcast>(acc, grad_out, M, N, partial, stream);
  } else {
    launch_backward<scalar_t, 1, kPass, GradRead::kStrided>(acc, grad_out, M, N, partial, stream);
  }
}

// The backward pass over acc (undefined: kSumOnly, the sums of grad_out alone); -> grad_b (N), or
// undefined when !want_bias_grad.
at::Tensor backward_pass(const at::Tensor& acc, const at::Tensor& grad_out, Pass pass,
                         bool want_bias_grad) {
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
          launch_backward<scalar_t, Pass::kFromPreActivation>(acc_ptr, grad_out, M, N, partial_ptr,
                                                              vector, broadcast, stream);
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

void tanh_cuda_(const at::Tensor& acc) {
  TORCH_INTERNAL_ASSERT(acc.is_cuda() && acc.is_contiguous());
  const int64_t numel = acc.numel();
  if (numel == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, acc.scalar_type(), "tanh_cuda_", [&] {
    constexpr int V = kPackBytes / sizeof(scalar_t);
    constexpr int64_t kTile = int64_t(kThreads) * kTanhUnroll;
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    scalar_t* z = acc.data_ptr<scalar_t>();  // becomes t
    if (aligned_to(z, kPackBytes)) {
      tanh_kernel<scalar_t, V><<<grid_for(numel / V, kTile), kThreads, 0, stream>>>(z, numel);
    } else {
      tanh_kernel<scalar_t, 1><<<grid_for(numel, kTile), kThreads, 0, stream>>>(z, numel);
    }
    check_launch("tanh_kernel");
  });
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

// ----------------------------------------------------------------------------------------------
// torch.ops.ckpt_ext_kernels: the primitives themselves, CUDA only, for the tests and the
// bandwidth microbenchmark. The ops of ckpt_ext (linear_tanh.cpp) always hand the primitives fresh,
// aligned buffers; these take any acc the checks below allow, so a test can reach every path.

namespace {

void check_kernel_args(const char* op, const at::Tensor& acc, const at::Tensor* grad_out) {
  TORCH_CHECK_VALUE(acc.is_cuda() && acc.dim() == 2 && acc.is_contiguous(), "ckpt_ext_kernels.",
                    op, ": acc must be a 2-D contiguous CUDA tensor, got ", acc.dim(),
                    "-D on ", acc.device(), (acc.is_contiguous() ? "" : ", not contiguous"));
  TORCH_CHECK_TYPE(is_supported_dtype(acc.scalar_type()), "ckpt_ext_kernels.", op,
                   ": acc must be float32, float64, bfloat16 or float16, got ", acc.scalar_type());
  if (grad_out != nullptr) {
    TORCH_CHECK_VALUE(grad_out->sizes() == acc.sizes() && grad_out->device() == acc.device(),
                      "ckpt_ext_kernels.", op, ": grad_out must have acc's shape ", acc.sizes(),
                      " and device ", acc.device(), ", got ", grad_out->sizes(), " on ",
                      grad_out->device());
    TORCH_CHECK_TYPE(grad_out->scalar_type() == acc.scalar_type(), "ckpt_ext_kernels.", op,
                     ": grad_out must have acc's dtype ", acc.scalar_type(), ", got ",
                     grad_out->scalar_type());
    // The kernel reads grad_out through a __restrict__ pointer while it writes acc.
    TORCH_CHECK_VALUE(!grad_out->is_alias_of(acc), "ckpt_ext_kernels.", op,
                      ": grad_out must not share acc's storage");
  }
}

void kernels_tanh_(const at::Tensor& acc) {
  check_kernel_args("tanh_", acc, nullptr);
  const c10::cuda::CUDAGuard guard(acc.device());
  tanh_cuda_(acc);
}

at::Tensor kernels_tanh_backward_(const at::Tensor& acc, const at::Tensor& grad_out,
                                  bool holds_pre_activation, bool want_bias_grad) {
  check_kernel_args("tanh_backward_", acc, &grad_out);
  const c10::cuda::CUDAGuard guard(acc.device());
  return tanh_backward_cuda_(acc, grad_out,
                             holds_pre_activation ? Holds::kPreActivation : Holds::kTanhOutput,
                             want_bias_grad);
}

at::Tensor kernels_bias_grad(const at::Tensor& grad_out) {
  TORCH_CHECK_VALUE(grad_out.is_cuda() && grad_out.dim() == 2, "ckpt_ext_kernels.bias_grad: "
                    "grad_out must be a 2-D CUDA tensor, got ", grad_out.dim(), "-D on ",
                    grad_out.device());
  TORCH_CHECK_TYPE(is_supported_dtype(grad_out.scalar_type()), "ckpt_ext_kernels.bias_grad: "
                   "grad_out must be float32, float64, bfloat16 or float16, got ",
                   grad_out.scalar_type());
  const c10::cuda::CUDAGuard guard(grad_out.device());
  return bias_grad_cuda(grad_out);
}

}  // namespace

TORCH_LIBRARY(ckpt_ext_kernels, m) {
  // acc: (M, N) contiguous; z -> tanh(z) in place.
  m.def("tanh_(Tensor(a!) acc) -> ()");
  // acc holds z (holds_pre_activation) or t and becomes g = grad_out·(1 − t²); returns the column
  // sums of g in the documented order when want_bias_grad, else None.
  m.def("tanh_backward_(Tensor(a!) acc, Tensor grad_out, bool holds_pre_activation, "
        "bool want_bias_grad) -> Tensor");
  // The column sums of grad_out (M, N) in the documented order.
  m.def("bias_grad(Tensor grad_out) -> Tensor");
}

TORCH_LIBRARY_IMPL(ckpt_ext_kernels, CUDA, m) {
  m.impl("tanh_", &kernels_tanh_);
  m.impl("tanh_backward_", &kernels_tanh_backward_);
  m.impl("bias_grad", &kernels_bias_grad);
}

}  // namespace ckpt_ext
