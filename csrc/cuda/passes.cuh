// cuda/passes.cuh — the CUDA kernels of the elementwise passes and the bias sums, and their
// launchers (declared in passes.h; instantiated per dtype in passes_<dtype>.cu):
//
//   activation_kernel           src (M, N) -> dst = f^(K)(src) (f for K = 0), flat, in place when
//                               dst == src
//   terms_kernel                out = t.add + Σ_j f^(k_j)(p)·Π F_j (activation_terms.h), flat, one
//                               element per thread per step of a grid-stride loop
//   activation_backward_kernel  acc (M, N) contiguous holds z or t -> g = grad_out·f'(z) in place;
//                               grad_out (M, N), any strides; the column sums of g per 32-row
//                               chunk, and the last block to finish a group of chunks combines
//                               them (the bias gradient, no separate combine launch)
//   gated_kernel                z (M, 2I) holds [g | u] per row -> h = f(g)·u into z[:, :I], or
//                               with gh (the gradient w.r.t. h) -> z = [gh·u·f'(g) | gh·f(g)] and
//                               gh = h; one block per row, its threads across the row's packs
//
// Bandwidth-bound passes: 16-byte packs, loads first, bias sums in the documented order with no
// float atomics (docs/design.md, "CUDA primitives").
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>

#include <algorithm>
#include <cstdint>

#include "../activations.h"
#include "../device_math.h"
#include "../primitives.h"
#include "passes.h"

namespace ckpt_ext {
namespace {

constexpr int kThreads = 256;      // threads per block, every kernel
constexpr int kPackBytes = 16;     // one vector load / store
constexpr int kTanhUnroll = 4;     // packs per thread in flight in the forward kernel
constexpr int kRowsPerBatch = 8;   // rows per thread in flight in the backward kernel
static_assert(kRowsPerChunk % kRowsPerBatch == 0, "a full chunk is a whole number of batches");
constexpr int kGroupChunks = 128;  // children one block combines in shared memory (2^7)
constexpr int kTileCols = 32;      // columns per combine tile (one per lane)
constexpr int kTileRows = kThreads / kTileCols;
constexpr int kMaxLevels = 9;      // levels of the combine tree: 128^9 = 2^63 chunks
static_assert((kGroupChunks & (kGroupChunks - 1)) == 0, "a group must be a complete subtree");
static_assert(kTileCols == 32, "one warp per tile row: conflict-free shared memory, coalesced");
static_assert(kThreads % 32 == 0, "whole warps: the arrival counts use warp-wide votes");

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

// tanh in the accumulate type: libdevice's tanhf/tanh, and for bfloat16 the hardware's
// tanh.approx.f32, whose error (about 2^-11 relative) is below half a bfloat16 ulp.
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

// tanh where a derivative is taken from it (every dtype: the exact one).
__device__ __forceinline__ float exact_tanh(float v) { return ::tanhf(v); }
__device__ __forceinline__ double exact_tanh(double v) { return ::tanh(v); }

// Adds that are never contracted into an FMA with the multiply that produced an operand.
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

// A value whose every operation is rounded on its own (the _rn intrinsics are never contracted
// into an FMA). The shared formulas of device_math.h are instantiated with it, so that their
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
inline int64_t grid_for(int64_t items, int64_t per_block) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t wanted = (items + per_block - 1) / per_block;
  return std::max<int64_t>(1, std::min<int64_t>(wanted, sms * 16));
}

inline void check_launch(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "ckpt_ext: CUDA launch of ", kernel, " failed: ",
              cudaGetErrorName(err), ": ", cudaGetErrorString(err));
}

// ----------------------------------------------------------------------------------------------
// forward: dst = f(src)

// f(z) in the accumulate type: tanh's own (see Tanh), any other activation's formula from
// activations.h.
template <Activation kAct, typename scalar_t>
__device__ __forceinline__ at::opmath_type<scalar_t> activate_value(at::opmath_type<scalar_t> z) {
  if constexpr (kAct == Activation::kTanh) {
    return Tanh<scalar_t>::apply(z);
  } else {
    return activate<kAct>(z);
  }
}

// f^(K)(z): f's own (activate_value) for K = 0.
template <Activation kAct, int K, typename scalar_t>
__device__ __forceinline__ at::opmath_type<scalar_t> derivative_value(at::opmath_type<scalar_t> z) {
  if constexpr (K == 0) {
    return activate_value<kAct, scalar_t>(z);
  } else {
    return activation_derivative<kAct, K>(z);
  }
}

// src and dst are (M, N) contiguous, numel = M·N, read as flat arrays of packs of V elements
// (V = 1 unless both are 16-byte aligned); dst may be src (in place: every element is read and
// written by the same thread, read first). The packs are cut into tiles of kThreads·kTanhUnroll;
// block b takes tiles b, b + gridDim.x, ...; in a tile, thread i takes packs i, i + kThreads, ...
// (each of its kTanhUnroll accesses is coalesced across the warp) and issues all its loads before
// its first store. The numel % V elements after the last whole pack (the tail, < V) are done by
// the first threads of block 0.
template <typename scalar_t, int V, Activation kAct, int K>
__global__ void __launch_bounds__(kThreads)
    activation_kernel(const scalar_t* src, scalar_t* dst, int64_t numel) {
  using acc_t = at::opmath_type<scalar_t>;
  using PackT = Pack<scalar_t, V>;
  const PackT* in = reinterpret_cast<const PackT*>(src);
  PackT* out = reinterpret_cast<PackT*>(dst);
  const int64_t n_packs = numel / V;
  constexpr int64_t kTile = int64_t(kThreads) * kTanhUnroll;
  for (int64_t tile0 = int64_t(blockIdx.x) * kTile; tile0 < n_packs;
       tile0 += int64_t(gridDim.x) * kTile) {
    PackT z[kTanhUnroll];  // z in, f(z) out, in registers
#pragma unroll
    for (int j = 0; j < kTanhUnroll; ++j) {
      const int64_t p = tile0 + threadIdx.x + int64_t(j) * kThreads;
      if (p < n_packs) z[j] = in[p];
    }
#pragma unroll
    for (int j = 0; j < kTanhUnroll; ++j) {
      const int64_t p = tile0 + threadIdx.x + int64_t(j) * kThreads;
      if (p < n_packs) {
#pragma unroll
        for (int e = 0; e < V; ++e) {
          z[j].v[e] = static_cast<scalar_t>(
              derivative_value<kAct, K, scalar_t>(static_cast<acc_t>(z[j].v[e])));
        }
        out[p] = z[j];
      }
    }
  }
  if constexpr (V > 1) {
    const int64_t i = n_packs * V + threadIdx.x;  // tail: fewer than V <= kThreads elements
    if (blockIdx.x == 0 && i < numel) {
      dst[i] = static_cast<scalar_t>(
          derivative_value<kAct, K, scalar_t>(static_cast<acc_t>(src[i])));
    }
  }
}

// ----------------------------------------------------------------------------------------------
// the higher orders' terms: out = t.add + Σ_j f^(k_j)(p)·F_j,1·...·F_j,m (activation_terms.h)

// Each order in `used` (bit k: f^(k)) made once per element, in the accumulate type; the products
// in the order the factors are given; rounded to scalar_t once. Plain loads: the formulas' inputs
// need no alignment.
template <typename scalar_t, Activation kAct>
__global__ void __launch_bounds__(kThreads)
    terms_kernel(const scalar_t* p, scalar_t* out, int64_t numel, ActivationTerms<scalar_t> t,
                 int used) {
  using acc_t = at::opmath_type<scalar_t>;
  using Terms = ActivationTerms<scalar_t>;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < numel;
       i += int64_t(gridDim.x) * kThreads) {
    const acc_t z = static_cast<acc_t>(p[i]);
    acc_t d[4] = {acc_t(0), acc_t(0), acc_t(0), acc_t(0)};
    if (used & 1) d[0] = derivative_value<kAct, 0, scalar_t>(z);
    if (used & 2) d[1] = derivative_value<kAct, 1, scalar_t>(z);
    if (used & 4) d[2] = derivative_value<kAct, 2, scalar_t>(z);
    if (used & 8) d[3] = derivative_value<kAct, 3, scalar_t>(z);
    acc_t acc = t.add != nullptr ? static_cast<acc_t>(t.add[i]) : acc_t(0);
#pragma unroll
    for (int j = 0; j < Terms::kMaxTerms; ++j) {
      if (j < t.count) {
        const int k = t.order[j];
        acc_t v = k == 0 ? d[0] : k == 1 ? d[1] : k == 2 ? d[2] : d[3];
#pragma unroll
        for (int f = 0; f < Terms::kMaxFactors; ++f) {
          if (f < t.factors[j]) v = v * static_cast<acc_t>(t.factor[j][f][i]);
        }
        acc = acc + v;
      }
    }
    out[i] = static_cast<scalar_t>(acc);
  }
}

// ----------------------------------------------------------------------------------------------
// the bias sums' tree: chunk sums, then groups of kGroupChunks combined level by level

// The buffers and arrival counters of one backward pass's bias sums. Level 0 is the chunk sums
// (n[0] = num_chunks(M) rows); the node g of level l >= 1 is the sum of rows 128g .. 128g + 127
// of level l − 1 (those that exist), combined as combine_chunks_pairwise does, so every node is a
// node of the documented tree and the one node of the top level L is the column's sum. Per column
// tile j (columns 32j .. 32j + 31), arrived[l][g·col_tiles + j] counts the children of node
// (l, g) that are written: level-0 items ((chunk, pack of V columns) of the backward kernel) for
// l = 1, finished nodes of level l − 1 above. The block whose arrival completes a count combines
// that node (the last-block-done pattern of the CUDA Programming Guide's memory-fence example).
template <typename scalar_t>
struct BiasSums {
  using acc_t = at::opmath_type<scalar_t>;
  int levels = 0;                       // L; 0: no bias gradient wanted
  int64_t n[kMaxLevels + 1] = {};       // nodes per column at each level; n[L] == 1
  acc_t* sums[kMaxLevels] = {};         // level l < L: (n[l], N) in acc_t
  int* arrived[kMaxLevels + 1] = {};    // level 1 <= l <= L: (n[l], col_tiles), zeroed
  scalar_t* grad_b = nullptr;           // (N): the top node, rounded to scalar_t once
};

// The node (l, g) of column tile j, and every ancestor whose last child it completes, combined by
// the whole block. group: kGroupChunks × kTileCols acc_t of shared memory. Block-uniform
// arguments: every __syncthreads here is reached by the whole block.
template <typename scalar_t>
__device__ void combine_upwards(const BiasSums<scalar_t>& s, int64_t N, int l, int64_t g,
                                int64_t j, at::opmath_type<scalar_t> (*group)[kTileCols]) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ int parent_done;
  const int lane = threadIdx.x % kTileCols;  // the column within the tile
  const int ty = threadIdx.x / kTileCols;    // a warp per ty
  const int64_t col_tiles = (N + kTileCols - 1) / kTileCols;
  const int64_t col = j * kTileCols + lane;
  for (;;) {
    const int64_t c0 = g * kGroupChunks;
    const int n = static_cast<int>(s.n[l - 1] - c0 < kGroupChunks ? s.n[l - 1] - c0 : kGroupChunks);
    const acc_t* in = s.sums[l - 1];
    // __ldcg: from L2, where other blocks' writes are (never a stale L1 line).
    for (int i = ty; i < n; i += kTileRows) {
      group[i][lane] = col < N ? __ldcg(in + (c0 + i) * N + col) : acc_t(0);
    }
    __syncthreads();
    // The levels w = 1, 2, 4, ... of combine_chunks_pairwise on the group: at level w, row i (a
    // multiple of 2w) adds row i + w if i + w < n. Rows of the group are rows c0 + i of the whole
    // level with c0 a multiple of kGroupChunks, so these are exactly the whole tree's pairs. The
    // rows read at a level (odd multiples of w) are never written at it: no race; the barrier
    // orders the levels.
    for (int w = 1; w < n; w *= 2) {
      for (int i = 2 * w * ty; i + w < n; i += 2 * w * kTileRows) {
        group[i][lane] = add_rn(group[i][lane], group[i + w][lane]);
      }
      __syncthreads();
    }
    const bool top = l == s.levels;
    if (ty == 0 && col < N) {
      if (top) {
        s.grad_b[col] = static_cast<scalar_t>(group[0][lane]);
      } else {
        s.sums[l][g * N + col] = group[0][lane];
      }
    }
    __threadfence();  // this node's sums visible device-wide before its parent counts it
    __syncthreads();  // and row 0 read before the group is refilled
    if (top) return;
    if (threadIdx.x == 0) {
      const int64_t pg = g / kGroupChunks;
      const int64_t left = s.n[l] - pg * kGroupChunks;  // children of the parent: its last group
      const int children = static_cast<int>(left < kGroupChunks ? left : kGroupChunks);
      parent_done = atomicAdd(s.arrived[l + 1] + pg * col_tiles + j, 1) == children - 1;
    }
    __syncthreads();
    if (!parent_done) return;
    __threadfence();  // the last arrival seen: the siblings' sums are read after it
    l += 1;
    g /= kGroupChunks;
  }
}

// After one sweep of the backward kernel's block over its items: each thread that wrote chunk
// sums (active, item (chunk, col)) counts them at its level-1 node, one atomic per node per warp;
// the block then combines every node whose count it completed. Called by the whole block.
template <typename scalar_t, int V>
__device__ void arrive_and_combine(const BiasSums<scalar_t>& s, int64_t N, bool active,
                                   int64_t chunk, int64_t col,
                                   at::opmath_type<scalar_t> (*group)[kTileCols]) {
  __shared__ int64_t done[kThreads];  // level-1 nodes this sweep completed (one per item at most)
  __shared__ int n_done;
  const int64_t col_tiles = (N + kTileCols - 1) / kTileCols;
  if (threadIdx.x == 0) n_done = 0;
  __syncthreads();
  const unsigned writers = __ballot_sync(0xffffffffu, active);
  if (active) {
    __threadfence();  // this thread's chunk sums visible device-wide before they are counted
    const int64_t g = chunk / kGroupChunks, j = col / kTileCols;
    const int64_t node = g * col_tiles + j;
    const unsigned peers = __match_any_sync(writers, node);
    if (threadIdx.x % 32 == __ffs(peers) - 1) {  // one lane per node in this warp counts for all
      const int count = __popc(peers);
      // Items of the node: its chunks × its packs (V divides N and kTileCols).
      const int64_t chunks_left = s.n[0] - g * kGroupChunks, cols_left = N - j * kTileCols;
      const int64_t chunks = chunks_left < kGroupChunks ? chunks_left : kGroupChunks;
      const int64_t packs = (cols_left < kTileCols ? cols_left : kTileCols) / V;
      if (atomicAdd(s.arrived[1] + node, count) + count == chunks * packs) {
        done[atomicAdd(&n_done, 1)] = node;
      }
    }
  }
  __syncthreads();
  const int finished = n_done;
  if (finished > 0) __threadfence();  // the last arrivals seen: the chunk sums are read after them
  for (int k = 0; k < finished; ++k) {
    combine_upwards(s, N, 1, done[k] / col_tiles, done[k] % col_tiles, group);
  }
  __syncthreads();  // done and n_done read before the next sweep resets them
}

// ----------------------------------------------------------------------------------------------
// backward: g = grad_out · f'(z) in place, with the per-chunk column sums of g

// How grad_out is read.
enum class GradRead {
  kBroadcast,  // one value for every element (strides (0, 0)): loaded once per thread
  kStrided,    // element (r, c) at r·sr + c·sc; with V > 1, sc == 1 and 16-byte aligned rows
};

// One row of one pack: `held` is what acc holds (z or t) and becomes g; gy is grad_out's pack (or
// the broadcast value); `sums` accumulates g per column (grad_out for kSumOnly), in row order.
template <BackwardPass kPass, GradRead kRead, Activation kAct, typename scalar_t, int V>
__device__ __forceinline__ void backward_row(Pack<scalar_t, V>& held, const Pack<scalar_t, V>& gy,
                                             at::opmath_type<scalar_t> gy_bcast,
                                             at::opmath_type<scalar_t> (&sums)[V]) {
  using acc_t = at::opmath_type<scalar_t>;
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const acc_t grad = kRead == GradRead::kBroadcast ? gy_bcast : static_cast<acc_t>(gy.v[e]);
    if constexpr (kPass == BackwardPass::kSumOnly) {
      sums[e] = add_rn(sums[e], grad);
    } else {
      acc_t g;
      if constexpr (kAct != Activation::kTanh) {  // held is z
        g = activation_grad<kAct>(grad, static_cast<acc_t>(held.v[e]));
      } else {
        acc_t t = static_cast<acc_t>(held.v[e]);
        if constexpr (kPass == BackwardPass::kFromPreActivation) t = exact_tanh(t);
        g = tanh_grad_from_output(Rounded<acc_t>(grad), Rounded<acc_t>(t)).v;
      }
      held.v[e] = static_cast<scalar_t>(g);
      sums[e] = add_rn(sums[e], g);  // the unrounded g, as on the CPU (half types round on store)
    }
  }
}

// acc: (M, N) contiguous, holds z or t (kPass) and becomes g; nullptr for kSumOnly.
// grad_out: (M, N) at strides (sr, sc) (kRead). sums.levels > 0: the bias gradient is wanted;
// sums.sums[0] is then (num_chunks(M), N) in acc_t, the column sums of g over each 32-row chunk,
// and the kernel combines them into sums.grad_b (arrive_and_combine).
// Work item = (chunk, pack of V adjacent columns), chunk-major: the threads of a warp take adjacent
// packs of the same rows, so every row step is one coalesced access per warp. The thread walks its
// chunk's rows in increasing order (the documented in-chunk order), kRowsPerBatch rows' loads at a
// time on a full chunk; only the last chunk can be partial and takes the plain loop. The block
// sweeps its items kThreads at a time, the whole block in step (the combine needs it whole).
// Dynamic shared memory: kGroupChunks × kTileCols acc_t when the bias gradient is wanted, else 0.
template <typename scalar_t, int V, BackwardPass kPass, GradRead kRead, Activation kAct>
__global__ void __launch_bounds__(kThreads)
    activation_backward_kernel(scalar_t* __restrict__ acc, const scalar_t* __restrict__ grad_out,
                               int64_t sr, int64_t sc, int64_t M, int64_t N,
                               const BiasSums<scalar_t> bias_sums) {
  using acc_t = at::opmath_type<scalar_t>;
  using PackT = Pack<scalar_t, V>;
  extern __shared__ __align__(16) unsigned char combine_smem[];
  constexpr bool kHasAcc = kPass != BackwardPass::kSumOnly;
  constexpr bool kLoadsGrad = kRead == GradRead::kStrided;
  const bool want_sums = bias_sums.levels > 0;
  acc_t* const partial = want_sums ? bias_sums.sums[0] : nullptr;
  const int64_t packs_per_row = N / V;
  const int64_t items = num_chunks(M) * packs_per_row;
  const acc_t gy_bcast = kLoadsGrad ? acc_t(0) : static_cast<acc_t>(grad_out[0]);
  PackT gy_unused{};  // what backward_row gets for gy when grad_out is broadcast
  for (int64_t sweep = int64_t(blockIdx.x) * kThreads; sweep < items;
       sweep += int64_t(gridDim.x) * kThreads) {
    const int64_t item = sweep + threadIdx.x;
    const bool active = item < items;
    const int64_t chunk = active ? item / packs_per_row : 0;
    const int64_t col = active ? (item - chunk * packs_per_row) * V : 0;
    if (active) {
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

      if (want_sums) {  // (chunk, col..col+V-1): V·sizeof(acc_t)-aligned since V | N
        Pack<acc_t, V> out;
#pragma unroll
        for (int e = 0; e < V; ++e) out.v[e] = sums[e];
        *reinterpret_cast<Pack<acc_t, V>*>(partial + chunk * N + col) = out;
      }
    }
    if (want_sums) {
      arrive_and_combine<scalar_t, V>(bias_sums, N, active, chunk, col,
                                      reinterpret_cast<acc_t (*)[kTileCols]>(combine_smem));
    }
  }
}

// ----------------------------------------------------------------------------------------------
// the gated product of a gated MLP

// Row r of z (M, 2I) holds g in its first I values and u in the rest; gh (M, I) is the gradient
// w.r.t. h in the backward pass (kBackward). Block b takes rows b, b + gridDim.x, ...; thread i
// packs i, i + kThreads, ... of the row (V values each: V divides I and every row start is
// 16-byte aligned, or V = 1). h = f(g)·u is the same expression in both passes, so the backward's
// h has the forward's bits.
template <typename scalar_t, int V, Activation kAct, bool kBackward>
__global__ void __launch_bounds__(kThreads)
    gated_kernel(scalar_t* __restrict__ z, scalar_t* __restrict__ gh, int64_t M, int64_t I) {
  using acc_t = at::opmath_type<scalar_t>;
  using PackT = Pack<scalar_t, V>;
  const int64_t packs = I / V;
  for (int64_t r = blockIdx.x; r < M; r += gridDim.x) {
    PackT* g_row = reinterpret_cast<PackT*>(z + r * 2 * I);
    PackT* u_row = reinterpret_cast<PackT*>(z + r * 2 * I + I);
    PackT* d_row = kBackward ? reinterpret_cast<PackT*>(gh + r * I) : nullptr;
    for (int64_t p = threadIdx.x; p < packs; p += kThreads) {
      PackT g = g_row[p];
      PackT u = u_row[p];
      if constexpr (!kBackward) {
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const acc_t fg = activate_value<kAct, scalar_t>(static_cast<acc_t>(g.v[e]));
          g.v[e] = static_cast<scalar_t>(fg * static_cast<acc_t>(u.v[e]));
        }
        g_row[p] = g;
      } else {
        PackT d = d_row[p];
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const acc_t gv = static_cast<acc_t>(g.v[e]), uv = static_cast<acc_t>(u.v[e]);
          const acc_t dh = static_cast<acc_t>(d.v[e]);
          const acc_t fg = activate_value<kAct, scalar_t>(gv);
          d.v[e] = static_cast<scalar_t>(fg * uv);
          g.v[e] = static_cast<scalar_t>(activation_grad<kAct>(dh * uv, gv));
          u.v[e] = static_cast<scalar_t>(dh * fg);
        }
        g_row[p] = g;
        u_row[p] = u;
        d_row[p] = d;
      }
    }
  }
}

// ----------------------------------------------------------------------------------------------
// launchers

// The buffers of the bias sums of a (C chunks, N) pass: the levels' sums in one acc_t workspace,
// the arrival counters zeroed (one memset). C > 0, N > 0.
template <typename scalar_t>
BiasSums<scalar_t> plan_bias_sums(int64_t C, int64_t N, const at::Tensor& grad_b,
                                  at::Tensor& workspace, at::Tensor& counters) {
  using acc_t = at::opmath_type<scalar_t>;
  BiasSums<scalar_t> s;
  s.n[0] = C;
  int64_t rows = C, nodes = 0;
  do {
    TORCH_INTERNAL_ASSERT(s.levels < kMaxLevels);
    s.n[s.levels + 1] = (s.n[s.levels] + kGroupChunks - 1) / kGroupChunks;
    s.levels += 1;
    nodes += s.n[s.levels];
    if (s.n[s.levels] > 1) rows += s.n[s.levels];
  } while (s.n[s.levels] > 1);
  const int64_t col_tiles = (N + kTileCols - 1) / kTileCols;
  workspace = new_buffer({rows, N}, grad_b.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
  counters = at::zeros({nodes * col_tiles}, grad_b.options().dtype(at::kInt));
  acc_t* w = workspace.data_ptr<acc_t>();
  int* c = counters.data_ptr<int>();
  for (int l = 0; l < s.levels; ++l) {
    s.sums[l] = w;
    w += s.n[l] * N;
  }
  for (int l = 1; l <= s.levels; ++l) {
    s.arrived[l] = c;
    c += s.n[l] * col_tiles;
  }
  s.grad_b = grad_b.data_ptr<scalar_t>();
  return s;
}

template <typename scalar_t, int V, BackwardPass kPass, GradRead kRead, Activation kAct>
void launch_backward(scalar_t* acc, const at::Tensor& grad_out, int64_t M, int64_t N,
                     const BiasSums<scalar_t>& sums, cudaStream_t stream) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t items = num_chunks(M) * (N / V);
  const size_t smem = sums.levels > 0 ? sizeof(acc_t) * kGroupChunks * kTileCols : 0;
  activation_backward_kernel<scalar_t, V, kPass, kRead, kAct>
      <<<grid_for(items, kThreads), kThreads, smem, stream>>>(
          acc, grad_out.const_data_ptr<scalar_t>(), grad_out.stride(0), grad_out.stride(1), M, N,
          sums);
  check_launch("activation_backward_kernel");
}

template <typename scalar_t, BackwardPass kPass, Activation kAct>
void launch_backward(scalar_t* acc, const at::Tensor& grad_out, int64_t M, int64_t N,
                     const BiasSums<scalar_t>& sums, bool vector, bool broadcast,
                     cudaStream_t stream) {
  constexpr int V = kPackBytes / sizeof(scalar_t);
  if (vector && broadcast) {
    launch_backward<scalar_t, V, kPass, GradRead::kBroadcast, kAct>(acc, grad_out, M, N, sums,
                                                                     stream);
  } else if (vector) {
    launch_backward<scalar_t, V, kPass, GradRead::kStrided, kAct>(acc, grad_out, M, N, sums,
                                                                   stream);
  } else if (broadcast) {
    launch_backward<scalar_t, 1, kPass, GradRead::kBroadcast, kAct>(acc, grad_out, M, N, sums,
                                                                     stream);
  } else {
    launch_backward<scalar_t, 1, kPass, GradRead::kStrided, kAct>(acc, grad_out, M, N, sums,
                                                                   stream);
  }
}

}  // namespace

template <typename scalar_t>
void activation_pass_cuda(const at::Tensor& src, const at::Tensor& dst, Activation act,
                          int order) {
  const int64_t numel = dst.numel();
  if (numel == 0) return;
  constexpr int V = kPackBytes / sizeof(scalar_t);
  constexpr int64_t kTile = int64_t(kThreads) * kTanhUnroll;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const scalar_t* s = src.const_data_ptr<scalar_t>();
  scalar_t* d = dst.data_ptr<scalar_t>();
  with_activation(act, [&](auto a) {
    with_order(order, [&](auto o) {
      constexpr Activation kAct = decltype(a)::value;
      constexpr int K = decltype(o)::value;
      if (aligned_to(s, kPackBytes) && aligned_to(d, kPackBytes)) {
        activation_kernel<scalar_t, V, kAct, K>
            <<<grid_for(numel / V, kTile), kThreads, 0, stream>>>(s, d, numel);
      } else {
        activation_kernel<scalar_t, 1, kAct, K><<<grid_for(numel, kTile), kThreads, 0, stream>>>(
            s, d, numel);
      }
    });
  });
  check_launch("activation_kernel");
}

template <typename scalar_t>
void terms_pass_cuda(const at::Tensor& p, const at::Tensor& out, Activation act,
                     const ActivationTerms<scalar_t>& t) {
  const int64_t numel = out.numel();
  if (numel == 0) return;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const scalar_t* src = p.const_data_ptr<scalar_t>();
  scalar_t* dst = out.data_ptr<scalar_t>();
  with_activation(act, [&](auto a) {
    terms_kernel<scalar_t, decltype(a)::value>
        <<<grid_for(numel, kThreads), kThreads, 0, stream>>>(src, dst, numel, t, t.orders_used());
  });
  check_launch("terms_kernel");
}

template <typename scalar_t>
at::Tensor backward_pass_cuda(const at::Tensor& acc, const at::Tensor& grad_out, BackwardPass pass,
                              Activation act, bool want_bias_grad) {
  constexpr int V = kPackBytes / sizeof(scalar_t);
  const int64_t M = grad_out.size(0), N = grad_out.size(1), C = num_chunks(M);
  const int64_t sr = grad_out.stride(0), sc = grad_out.stride(1);
  at::Tensor grad_b;
  if (want_bias_grad) grad_b = new_buffer({N}, grad_out.options());
  if (N == 0) return grad_b;  // nothing to do, and a grid of 0 blocks is an invalid launch
  if (M == 0) {               // every column sums nothing
    if (want_bias_grad) grad_b.zero_();
    return grad_b;
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  at::Tensor workspace, counters;  // held until the kernel is enqueued (the caching allocator
                                   // keeps them for the stream's work after that)
  BiasSums<scalar_t> sums;
  if (want_bias_grad) sums = plan_bias_sums<scalar_t>(C, N, grad_b, workspace, counters);
  // A size-1 dimension's stride is never used (only index 0 is), so it does not count.
  const bool broadcast = (M == 1 || sr == 0) && (N == 1 || sc == 0);
  scalar_t* acc_ptr = acc.defined() ? acc.data_ptr<scalar_t>() : nullptr;
  const bool vector =
      N % V == 0 && (acc_ptr == nullptr || aligned_to(acc_ptr, kPackBytes)) &&
      (broadcast || (sc == 1 && (M == 1 || sr % V == 0) &&
                     aligned_to(grad_out.const_data_ptr<scalar_t>(), kPackBytes)));
  switch (pass) {
    case BackwardPass::kFromPreActivation:
      with_activation(act, [&](auto a) {
        launch_backward<scalar_t, BackwardPass::kFromPreActivation, decltype(a)::value>(
            acc_ptr, grad_out, M, N, sums, vector, broadcast, stream);
      });
      break;
    case BackwardPass::kFromTanhOutput:
      launch_backward<scalar_t, BackwardPass::kFromTanhOutput, Activation::kTanh>(
          acc_ptr, grad_out, M, N, sums, vector, broadcast, stream);
      break;
    case BackwardPass::kSumOnly:
      launch_backward<scalar_t, BackwardPass::kSumOnly, Activation::kTanh>(
          acc_ptr, grad_out, M, N, sums, vector, broadcast, stream);
      break;
  }
  return grad_b;
}

template <typename scalar_t>
void gated_pass_cuda(const at::Tensor& z, const at::Tensor& gh, Activation act) {
  const int64_t M = z.size(0), I = z.size(1) / 2;
  if (M == 0 || I == 0) return;
  constexpr int V = kPackBytes / sizeof(scalar_t);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  scalar_t* zp = z.data_ptr<scalar_t>();
  scalar_t* ghp = gh.defined() ? gh.data_ptr<scalar_t>() : nullptr;
  const bool packed = I % V == 0 && aligned_to(zp, kPackBytes) &&
                      (ghp == nullptr || aligned_to(ghp, kPackBytes));
  const int64_t blocks = grid_for(M, 1);
  with_activation(act, [&](auto a) {
    constexpr Activation kAct = decltype(a)::value;
    if (ghp == nullptr && packed) {
      gated_kernel<scalar_t, V, kAct, false><<<blocks, kThreads, 0, stream>>>(zp, ghp, M, I);
    } else if (ghp == nullptr) {
      gated_kernel<scalar_t, 1, kAct, false><<<blocks, kThreads, 0, stream>>>(zp, ghp, M, I);
    } else if (packed) {
      gated_kernel<scalar_t, V, kAct, true><<<blocks, kThreads, 0, stream>>>(zp, ghp, M, I);
    } else {
      gated_kernel<scalar_t, 1, kAct, true><<<blocks, kThreads, 0, stream>>>(zp, ghp, M, I);
    }
  });
  check_launch("gated_kernel");
}

}  // namespace ckpt_ext
