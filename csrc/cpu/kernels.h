// cpu/kernels.h — the vectorised CPU kernels, compiled once per ISA level (setup.py), and how the
// portable code (cpu/primitives.cpp, cpu/dispatch.cpp) reaches them: one table of function
// pointers per copy, kernels(). Included by both sides, so only types that mean the same under
// every set of flags: no Vectorized, no Tensor. Kernels work on raw pointers over rows r0..r1-1:
//   tanh(p, n)                    p: n contiguous values; z -> tanh(z) in place
//   backward_rows(acc, gy, sr, sc, r0, r1, N, pre, sums)   acc (M, N) contiguous: z (pre) or t ->
//       g in place; gy (M, N) strides (sr, sc), sc == 0 = one value per row; sums (N) += g or null
//   column_sums(gy, sr, sc, r0, r1, N, sums)               sums (N) += rows of gy
//   activate(src, dst, n, act, k) dst = f^(k)(src) (k = 0: f), n contiguous values (dst == src:
//                                 in place)
//   activation_backward_rows: backward_rows for any activation (activations.h), acc holding z
//   terms(p, out, i0, i1, act, t) out = add + Σ_j f^(k_j)(p)·Π F_j (activation_terms.h) over elements
//                                 [i0, i1) of n contiguous values (out may be t.add)
//   gated_rows(z, gh, r0, r1, I, act)  z (M, 2I) contiguous, [g | u] per row: with gh null,
//                                 z[:, :I] = h = f(g)·u; else gh (M, I) contiguous holds the
//                                 gradient w.r.t. h and one pass makes z = [gh·u·f'(g) | gh·f(g)],
//                                 gh = h (the gated product of primitives.h)
//   third_order(i0, i1, t, gy, dg, gbar, ugy, ut, dgbar, gybar, tbar)   float and double only (null
//       for the half types): the elementwise part of tanh's third-order kernel (cpu/third_order.cpp)
//       over elements [i0, i1) of (M·N) contiguous arrays; a null input is zero, a null output is
//       not made
// Sums in increasing row order, in acc_t (half types compute in float): docs/design.md.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#include "../activation_terms.h"
#include "../activations.h"

namespace ckpt_ext::cpu {

template <typename scalar_t>
using acc_type_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

template <typename scalar_t>
struct KernelsFor {
  using acc_t = acc_type_t<scalar_t>;
  void (*tanh)(scalar_t* p, int64_t n);
  void (*backward_rows)(scalar_t* acc, const scalar_t* grad_out, int64_t sr, int64_t sc,
                        int64_t r0, int64_t r1, int64_t N, bool pre_activation, acc_t* sums);
  void (*column_sums)(const scalar_t* grad_out, int64_t sr, int64_t sc, int64_t r0, int64_t r1,
                      int64_t N, acc_t* sums);
  void (*activate)(const scalar_t* src, scalar_t* dst, int64_t n, Activation act, int order);
  void (*activation_backward_rows)(scalar_t* acc, const scalar_t* grad_out, int64_t sr,
                                   int64_t sc, int64_t r0, int64_t r1, int64_t N, Activation act,
                                   acc_t* sums);
  void (*terms)(const scalar_t* p, scalar_t* out, int64_t i0, int64_t i1, Activation act,
                const ActivationTerms<scalar_t>& t);
  void (*gated_rows)(scalar_t* z, scalar_t* gh, int64_t r0, int64_t r1, int64_t I,
                     Activation act);
  void (*third_order)(int64_t i0, int64_t i1, const scalar_t* t, const scalar_t* gy,
                      const scalar_t* dg, const scalar_t* gbar, const scalar_t* ugy,
                      const scalar_t* ut, scalar_t* dgbar, scalar_t* gybar, scalar_t* tbar);
};

struct Kernels {
  KernelsFor<float> f32;
  KernelsFor<double> f64;
  KernelsFor<c10::BFloat16> bf16;
  KernelsFor<c10::Half> f16;
  int vector_bytes;  // the width of Vectorized<float> in this copy, for the record

  template <typename scalar_t>
  const KernelsFor<scalar_t>& of() const {
    if constexpr (std::is_same_v<scalar_t, float>) return f32;
    else if constexpr (std::is_same_v<scalar_t, double>) return f64;
    else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) return bf16;
    else return f16;
  }
};

// One per compiled copy of cpu/kernels.cpp. Only the ones setup.py built exist
// (CKPT_EXT_CPU_AVX2 / CKPT_EXT_CPU_AVX512 say so to cpu/dispatch.cpp).
namespace DEFAULT { const Kernels& kernels(); }
namespace AVX2 { const Kernels& kernels(); }
namespace AVX512 { const Kernels& kernels(); }

// cpu/dispatch.cpp. The table of the level in force: at::get_cpu_capability() (which honours
// ATEN_CPU_CAPABILITY), capped by the builds present and by CKPT_EXT_CPU_CAPABILITY.
const Kernels& kernels();

}  // namespace ckpt_ext::cpu
