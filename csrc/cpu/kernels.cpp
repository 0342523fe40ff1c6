// cpu/kernels.cpp — the vectorised CPU kernels of the fused ops, written
// once and compiled by setup.py once per ISA level (DEFAULT, AVX2, AVX512) with that level's
// flags and -DCPU_CAPABILITY=<level>; see cpu/kernels.h for the kernels and their shapes, and
// cpu/dispatch.cpp for the choice at run time. Everything sits in namespace
// ckpt_ext::cpu::CPU_CAPABILITY and uses no Tensor and no heap, so no symbol of one copy can stand
// in for another's. One tanh for every element (forward and recompute give the same bits); half
// types compute in float; no FMA contraction. The reasons: docs/design.md, "CPU primitives".
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <type_traits>

#include "../activations.h"
#include "../device_math.h"
#include "kernels.h"
#include "vector_math.h"

#ifndef CPU_CAPABILITY
#error "cpu/kernels.cpp is compiled once per ISA level with -DCPU_CAPABILITY=<level> (setup.py)"
#endif

namespace ckpt_ext::cpu {
namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

template <typename scalar_t>
constexpr bool kReduced = std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, c10::Half>;

// ------------------------------------------------------------------------------------------------
// Loads and stores of one "step": kStep<scalar_t> consecutive values as vectors of acc_t. For
// float/double a step is one Vectorized<acc_t>; for half types it is one Vectorized<scalar_t>
// (2 float vectors), so each memory access is a full vector. k < kStep loads zero-fill the rest.

template <typename scalar_t>
constexpr int64_t kStep = Vectorized<scalar_t>::size();

template <typename scalar_t>
struct Step {
  using acc_t = acc_type_t<scalar_t>;
  using V = Vectorized<acc_t>;
  static constexpr int kParts = kReduced<scalar_t> ? 2 : 1;
  V v[kParts];

  static Step load(const scalar_t* p, int64_t k) {
    Step s;
    if constexpr (kReduced<scalar_t>) {
      auto [a, b] = at::vec::convert_to_float<scalar_t>(Vectorized<scalar_t>::loadu(p, k));
      s.v[0] = a;
      s.v[1] = b;
    } else {
      s.v[0] = V::loadu(p, k);
    }
    return s;
  }
  static Step broadcast(scalar_t x) {
    Step s;
    for (int i = 0; i < kParts; ++i) s.v[i] = V(static_cast<acc_t>(x));
    return s;
  }
  void store(scalar_t* p, int64_t k) const {
    if constexpr (kReduced<scalar_t>) {
      at::vec::convert_from_float<scalar_t>(v[0], v[1]).store(p, k);
    } else {
      v[0].store(p, k);
    }
  }
  // sums[0..k) += these values, in acc_t.
  void add_to(acc_t* sums, int64_t k) const {
    for (int i = 0; i < kParts; ++i) {
      const int64_t lo = i * V::size(), n = std::min<int64_t>(V::size(), k - lo);
      if (n <= 0) break;
      (V::loadu(sums + lo, n) + v[i]).store(sums + lo, n);
    }
  }
};

// k values of a row of grad_out starting at column c: contiguous (sc == 1), one value broadcast
// along the row (sc == 0), or gathered from a stride into a small stack buffer.
template <typename scalar_t>
Step<scalar_t> load_grad(const scalar_t* row, int64_t sc, int64_t c, int64_t k) {
  if (sc == 1) return Step<scalar_t>::load(row + c, k);
  if (sc == 0) return Step<scalar_t>::broadcast(row[0]);
  scalar_t tmp[kStep<scalar_t>];
  for (int64_t j = 0; j < k; ++j) tmp[j] = row[(c + j) * sc];
  return Step<scalar_t>::load(tmp, k);
}

// ------------------------------------------------------------------------------------------------
// The kernels

template <typename scalar_t>
void tanh_kernel(scalar_t* p, int64_t n) {
  constexpr int64_t W = kStep<scalar_t>;
  for (int64_t i = 0; i < n; i += W) {
    const int64_t k = std::min(W, n - i);
    Step<scalar_t> s = Step<scalar_t>::load(p + i, k);
    for (auto& v : s.v) v = Math<Vectorized<acc_type_t<scalar_t>>>::tanh(v);
    s.store(p + i, k);
  }
}

template <typename scalar_t>
void backward_rows_kernel(scalar_t* acc, const scalar_t* grad_out, int64_t sr, int64_t sc,
                          int64_t r0, int64_t r1, int64_t N, bool pre_activation,
                          acc_type_t<scalar_t>* sums) {
  constexpr int64_t W = kStep<scalar_t>;
  for (int64_t r = r0; r < r1; ++r) {
    scalar_t* row = acc + r * N;
    const scalar_t* grad_row = grad_out + r * sr;
    for (int64_t c = 0; c < N; c += W) {
      const int64_t k = std::min(W, N - c);
      Step<scalar_t> t = Step<scalar_t>::load(row + c, k);  // z or t, becomes g
      const Step<scalar_t> gy = load_grad(grad_row, sc, c, k);
      for (int i = 0; i < Step<scalar_t>::kParts; ++i) {
        if (pre_activation) t.v[i] = Math<Vectorized<acc_type_t<scalar_t>>>::tanh(t.v[i]);
        t.v[i] = tanh_grad_from_output(gy.v[i], t.v[i]);
      }
      t.store(row + c, k);
      if (sums != nullptr) t.add_to(sums + c, k);
    }
  }
}

template <typename scalar_t>
void column_sums_kernel(const scalar_t* grad_out, int64_t sr, int64_t sc, int64_t r0, int64_t r1,
                        int64_t N, acc_type_t<scalar_t>* sums) {
  constexpr int64_t W = kStep<scalar_t>;
  for (int64_t r = r0; r < r1; ++r) {
    const scalar_t* grad_row = grad_out + r * sr;
    for (int64_t c = 0; c < N; c += W) {
      const int64_t k = std::min(W, N - c);
      load_grad(grad_row, sc, c, k).add_to(sums + c, k);
    }
  }
}

// The activations of activations.h: dst = f^(order)(src) (f itself for order 0; in place when
// dst == src), and z -> g = gy·f'(z) in place.
template <typename scalar_t>
void activate_kernel(const scalar_t* src, scalar_t* dst, int64_t n, Activation act, int order) {
  constexpr int64_t W = kStep<scalar_t>;
  with_activation(act, [&](auto a) {
    with_order(order, [&](auto o) {
      for (int64_t i = 0; i < n; i += W) {
        const int64_t k = std::min(W, n - i);
        Step<scalar_t> s = Step<scalar_t>::load(src + i, k);
        for (auto& v : s.v) v = activation_derivative<decltype(a)::value, decltype(o)::value>(v);
        s.store(dst + i, k);
      }
    });
  });
}

template <typename scalar_t>
void activation_backward_rows_kernel(scalar_t* acc, const scalar_t* grad_out, int64_t sr,
                                     int64_t sc, int64_t r0, int64_t r1, int64_t N,
                                     Activation act, acc_type_t<scalar_t>* sums) {
  constexpr int64_t W = kStep<scalar_t>;
  with_activation(act, [&](auto a) {
    for (int64_t r = r0; r < r1; ++r) {
      scalar_t* row = acc + r * N;
      const scalar_t* grad_row = grad_out + r * sr;
      for (int64_t c = 0; c < N; c += W) {
        const int64_t k = std::min(W, N - c);
        Step<scalar_t> z = Step<scalar_t>::load(row + c, k);  // becomes g
        const Step<scalar_t> gy = load_grad(grad_row, sc, c, k);
        for (int i = 0; i < Step<scalar_t>::kParts; ++i) {
          z.v[i] = activation_grad<decltype(a)::value>(gy.v[i], z.v[i]);
        }
        z.store(row + c, k);
        if (sums != nullptr) z.add_to(sums + c, k);
      }
    }
  });
}

// The gated product (kernels.h): per row, g = z[c], u = z[I + c]; h = f(g)·u into z[c], or with
// gh, the gradients into z and h into gh. h is f's value times u in acc_t, rounded once, the same
// expression in both passes.
template <Activation A, typename scalar_t>
void gated_row(scalar_t* g_row, int64_t I) {
  using S = Step<scalar_t>;
  constexpr int64_t W = kStep<scalar_t>;
  const scalar_t* u_row = g_row + I;
  for (int64_t c = 0; c < I; c += W) {
    const int64_t k = std::min(W, I - c);
    S g = S::load(g_row + c, k);
    const S u = S::load(u_row + c, k);
    for (int i = 0; i < S::kParts; ++i) g.v[i] = activate<A>(g.v[i]) * u.v[i];
    g.store(g_row + c, k);
  }
}

template <Activation A, typename scalar_t>
void gated_backward_row(scalar_t* g_row, scalar_t* gh_row, int64_t I) {
  using S = Step<scalar_t>;
  using V = Vectorized<acc_type_t<scalar_t>>;
  constexpr int64_t W = kStep<scalar_t>;
  scalar_t* u_row = g_row + I;
  for (int64_t c = 0; c < I; c += W) {
    const int64_t k = std::min(W, I - c);
    const S g = S::load(g_row + c, k);
    const S u = S::load(u_row + c, k);
    const S d = S::load(gh_row + c, k);  // the gradient w.r.t. h
    S dg, du, h;
    for (int i = 0; i < S::kParts; ++i) {
      const V fg = activate<A>(g.v[i]);
      h.v[i] = fg * u.v[i];
      dg.v[i] = activation_grad<A>(d.v[i] * u.v[i], g.v[i]);
      du.v[i] = d.v[i] * fg;
    }
    dg.store(g_row + c, k);
    du.store(u_row + c, k);
    h.store(gh_row + c, k);
  }
}

template <typename scalar_t>
void gated_rows_kernel(scalar_t* z, scalar_t* gh, int64_t r0, int64_t r1, int64_t I,
                       Activation act) {
  with_activation(act, [&](auto a) {
    constexpr Activation A = decltype(a)::value;
    for (int64_t r = r0; r < r1; ++r) {
      if (gh == nullptr) {
        gated_row<A>(z + r * 2 * I, I);
      } else {
        gated_backward_row<A>(z + r * 2 * I, gh + r * I, I);
      }
    }
  });
}

// out = add + Σ_j f^(k_j)(p)·F_j,1·...·F_j,m (activation_terms.h), a block of kTermsBlock
// elements at a time: each order some term uses made over the block into a buffer of acc_t (one
// loop per order, the activation's functions called as in activate_kernel), then the terms summed
// from those buffers, the products in the order the factors are given.
constexpr int64_t kTermsBlock = 512;

template <typename scalar_t>
void terms_kernel(const scalar_t* p, scalar_t* out, int64_t i0, int64_t i1, Activation act,
                  const ActivationTerms<scalar_t>& t) {
  using S = Step<scalar_t>;
  using acc_t = acc_type_t<scalar_t>;
  using V = Vectorized<acc_t>;
  constexpr int64_t W = kStep<scalar_t>;
  static_assert(kTermsBlock % W == 0, "whole steps per block");
  alignas(64) acc_t made[4][kTermsBlock];
  const int used = t.orders_used();
  for (int64_t b0 = i0; b0 < i1; b0 += kTermsBlock) {
    const int64_t n = std::min(kTermsBlock, i1 - b0);
    for (int order = 0; order < 4; ++order) {
      if (!(used & (1 << order))) continue;
      with_activation(act, [&](auto a) {
        with_order(order, [&](auto o) {
          for (int64_t i = 0; i < n; i += W) {
            S z = S::load(p + b0 + i, std::min(W, n - i));
            for (int q = 0; q < S::kParts; ++q) {
              activation_derivative<decltype(a)::value, decltype(o)::value>(z.v[q])
                  .store(made[order] + i + q * V::size());
            }
          }
        });
      });
    }
    for (int64_t i = 0; i < n; i += W) {
      const int64_t k = std::min(W, n - i);
      const int64_t e = b0 + i;
      S acc = t.add != nullptr ? S::load(t.add + e, k) : S::broadcast(scalar_t(0));
      for (int j = 0; j < t.count; ++j) {
        S term;
        const acc_t* d = made[t.order[j]] + i;
        for (int q = 0; q < S::kParts; ++q) term.v[q] = V::loadu(d + q * V::size());
        for (int f = 0; f < t.factors[j]; ++f) {
          const S x = S::load(t.factor[j][f] + e, k);
          for (int q = 0; q < S::kParts; ++q) term.v[q] = term.v[q] * x.v[q];
        }
        for (int q = 0; q < S::kParts; ++q) acc.v[q] = acc.v[q] + term.v[q];
      }
      acc.store(out + e, k);
    }
  }
}

// The elementwise part of tanh's third order (cpu/third_order.cpp; the formulas in docs/design.md,
// "Higher orders"), s = 1 − t², one pass over [i0, i1) making the results asked for (a null
// output), each input read once per vector; an absent input is a zero term (the test is per
// vector, the same every time):
//   dgbar = ugy·s − 2·ut·gy·t,   gybar = gbar·s − 2·ut·dg·t,
//   tbar = −2·t·(ugy·dg + gbar·gy) − 2·ut·dg·gy
template <typename T>
void third_order_kernel(int64_t i0, int64_t i1, const T* t, const T* gy, const T* dg,
                        const T* gbar, const T* ugy, const T* ut, T* dgbar, T* gybar, T* tbar) {
  using V = Vectorized<T>;
  constexpr int64_t W = V::size();
  const bool ut_dg = ut != nullptr && dg != nullptr;
  for (int64_t i = i0; i < i1; i += W) {
    const int64_t k = std::min(W, i1 - i);
    const V tv = V::loadu(t + i, k), gyv = V::loadu(gy + i, k);
    const V s = V(T(1)) - tv * tv;
    const V utv = ut != nullptr ? V::loadu(ut + i, k) : V(T(0));
    const V dgv = dg != nullptr ? V::loadu(dg + i, k) : V(T(0));
    const V gbarv = gbar != nullptr ? V::loadu(gbar + i, k) : V(T(0));
    const V ugyv = ugy != nullptr ? V::loadu(ugy + i, k) : V(T(0));
    if (dgbar != nullptr) {
      V v(T(0));
      if (ugy != nullptr) v = v + ugyv * s;
      if (ut != nullptr) v = v + V(T(-2)) * utv * gyv * tv;
      v.store(dgbar + i, k);
    }
    if (gybar != nullptr) {
      V v(T(0));
      if (gbar != nullptr) v = v + gbarv * s;
      if (ut_dg) v = v + V(T(-2)) * utv * dgv * tv;
      v.store(gybar + i, k);
    }
    if (tbar != nullptr) {
      V sbar(T(0));
      if (ugy != nullptr && dg != nullptr) sbar = sbar + ugyv * dgv;
      if (gbar != nullptr) sbar = sbar + gbarv * gyv;
      V v = V(T(-2)) * tv * sbar;
      if (ut_dg) v = v + V(T(-2)) * utv * dgv * gyv;
      v.store(tbar + i, k);
    }
  }
}

template <typename scalar_t>
constexpr KernelsFor<scalar_t> kernels_for() {
  if constexpr (kReduced<scalar_t>) {
    return {&tanh_kernel<scalar_t>, &backward_rows_kernel<scalar_t>,
            &column_sums_kernel<scalar_t>, &activate_kernel<scalar_t>,
            &activation_backward_rows_kernel<scalar_t>, &terms_kernel<scalar_t>,
            &gated_rows_kernel<scalar_t>, nullptr};
  } else {
    return {&tanh_kernel<scalar_t>, &backward_rows_kernel<scalar_t>,
            &column_sums_kernel<scalar_t>, &activate_kernel<scalar_t>,
            &activation_backward_rows_kernel<scalar_t>, &terms_kernel<scalar_t>,
            &gated_rows_kernel<scalar_t>, &third_order_kernel<scalar_t>};
  }
}

constexpr Kernels kKernels{kernels_for<float>(), kernels_for<double>(),
                           kernels_for<c10::BFloat16>(), kernels_for<c10::Half>(),
                           static_cast<int>(Vectorized<float>::size() * sizeof(float))};

}  // namespace

const Kernels& kernels() { return kKernels; }

}  // namespace CPU_CAPABILITY
}  // namespace ckpt_ext::cpu
