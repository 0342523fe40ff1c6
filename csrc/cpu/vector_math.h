// cpu/vector_math.h — Math<Vectorized<T>>: the functions activations.h's formulas call (exp, erf,
// tanh, sin, ...), on the vectors of the ISA level being compiled. Included by cpu/kernels.cpp
// alone, so it is compiled once per level with that level's flags (Vectorized lives in an inline
// namespace named for the level, so each copy specialises its own type). Where a formula of our
// own replaces ATen's (Sleef's) function, the comment gives its accuracy and cost, measured;
// the reasons: docs/design.md, "CPU primitives".
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <type_traits>

#include "../activations.h"

#ifndef CPU_CAPABILITY
#error "cpu/vector_math.h is compiled once per ISA level with -DCPU_CAPABILITY=<level> (setup.py)"
#endif

namespace ckpt_ext {

template <typename T>
struct Math<at::vec::Vectorized<T>> {
  using V = at::vec::Vectorized<T>;
  static V exp(V v) { return v.exp(); }
  static V erf(V v) {
    if constexpr (std::is_same_v<T, float>) {
      return erf_float(v);
    } else {
      return v.erf();
    }
  }
  static V erf_with_gauss(V v, V g) {
    if constexpr (std::is_same_v<T, float>) {
      return erf_float_given(v, g);
    } else {
      return v.erf();
    }
  }
  static V tanh(V v) {
    if constexpr (std::is_same_v<T, float>) {
      return tanh_float(v);
    } else {
      return tanh_double(v);
    }
  }
  static V sin(V v) { return v.sin(); }
  static V cos(V v) { return v.cos(); }
  static V log1p(V v) { return v.log1p(); }
  static V where_gt(V a, V b, V x, V y) { return V::blendv(y, x, a > b); }
  static V where_le(V a, V b, V x, V y) { return V::blendv(y, x, a <= b); }

  // tanh of float vectors, Cephes' tanhf on vectors: below |x| = 0.625 its odd polynomial,
  // x + x³·P(x²); above, 1 − 2/(exp(2|x|) + 1) with exp_nonneg (|x| capped at 20, where tanh is 1
  // in float); the sign put back last. Within 1 ulp of the correctly rounded tanh on every positive
  // float (measured; as Sleef's tanhf_u10), at a third of Sleef's tanhf_u10 cost
  // (docs/benchmark.md, "The activation pass").
  static V tanh_float(V x) {
    const V sign = x & V(-0.f);
    const V a = x.abs();
    const V z = a * a;
    V p = at::vec::fmadd(V(-5.70498872745e-3f), z, V(2.06390887954e-2f));
    p = at::vec::fmadd(p, z, V(-5.37397155531e-2f));
    p = at::vec::fmadd(p, z, V(1.33314422036e-1f));
    p = at::vec::fmadd(p, z, V(-3.33332819422e-1f));
    p = at::vec::fmadd(p * z, a, a);
    const V c = at::vec::clamp_max(a, V(20.f));
    const V t = V(1) - V(2) / (exp_nonneg(c + c) + V(1));
    return sign ^ V::blendv(p, t, a >= V(0.625f));
  }

  // tanh of double vectors, Cephes' tanh with one division: below |x| = 0.625 its rational form,
  // x + x·s·P(s)/Q(s) with s = x²; above, 1 − 2/(e + 1) with e = exp(2|x|) as Cephes' exp makes it,
  // 2ⁿ·(q + p)/(q − p) (n = round(2|x|/ln 2), p and q its Padé polynomials of the rest r), written
  // 1 − 2(q − p)/(2ⁿ(q + p) + (q − p)). Both branches share the one division; |x| is capped at 20
  // (tanh is 1 in double there) and the sign put back last. 1.53 ulp from the exact value at most
  // (measured against long double on 10M points of [0, 20]), at a third of Sleef's tanh_u10 cost
  // (docs/benchmark.md, "The activation pass").
  static V tanh_double(V x) {
    using I = at::vec::Vectorized<int64_t>;
    const V sign = x & V(-0.);
    const V a = x.abs();
    const V s = a * a;
    V p = at::vec::fmadd(V(-9.64399179425052238628e-1), s, V(-9.92877231001918586564e1));
    p = at::vec::fmadd(p, s, V(-1.61468768441708447952e3));
    V q = s + V(1.12811678491632931402e2);
    q = at::vec::fmadd(q, s, V(2.23548839060100448583e3));
    q = at::vec::fmadd(q, s, V(4.84406305325125486048e3));
    const V c = at::vec::clamp_max(a, V(20.));
    const V y = c + c;
    const V n = (y * V(1.44269504088896340736)).round();
    V r = at::vec::fmadd(n, V(-6.93145751953125e-1), y);
    r = at::vec::fmadd(n, V(-1.42860682030941723212e-6), r);
    const V rr = r * r;
    V pe = at::vec::fmadd(V(1.26177193074810590878e-4), rr, V(3.02994407707441961300e-2));
    pe = at::vec::fmadd(pe, rr, V(9.99999999999999999910e-1)) * r;
    V qe = at::vec::fmadd(V(3.00198505138664455042e-6), rr, V(2.52448340349684104192e-3));
    qe = at::vec::fmadd(qe, rr, V(2.27265548208155028766e-1));
    qe = at::vec::fmadd(qe, rr, V(2.00000000000000000009e0));
    const I bits = (at::vec::convert_to_int_of_same_size(n) + I(1023)) << I(52);
    const V lo = qe - pe;
    const V hi = (qe + pe) * at::vec::cast<double>(bits);
    const auto big = a >= V(0.625);
    const V num = V::blendv(a * s * p, V(-2) * lo, big);
    const V den = V::blendv(q, hi + lo, big);
    return sign ^ (V::blendv(a, V(1), big) + num / den);
  }

  // exp(x) of float vectors for x in [0, 40] (no overflow, no underflow, no NaN to handle): Cephes'
  // expf, exp(x) = 2ⁿ·exp(r) with n = round(x/ln 2), r = x − n·ln 2 in two parts, exp(r) its
  // degree-6 polynomial, 2ⁿ made from n's bits. 1.26 ulp from the exact value at most (measured on
  // every third float of [0, 40]), without the range checks of Sleef's expf.
  static V exp_nonneg(V x) {
    using I = at::vec::Vectorized<int32_t>;
    const V n = (x * V(1.44269504088896341f)).round();
    V r = at::vec::fmadd(n, V(-0.693359375f), x);
    r = at::vec::fmadd(n, V(2.12194440e-4f), r);
    V q = at::vec::fmadd(V(1.9875691500e-4f), r, V(1.3981999507e-3f));
    q = at::vec::fmadd(q, r, V(8.3334519073e-3f));
    q = at::vec::fmadd(q, r, V(4.1665795894e-2f));
    q = at::vec::fmadd(q, r, V(1.6666665459e-1f));
    q = at::vec::fmadd(q, r, V(5.0000001201e-1f));
    q = at::vec::fmadd(q * r, r, r + V(1));
    const I bits = (at::vec::convert_to_int_of_same_size(n) + I(127)) << I(23);
    return q * at::vec::cast<float>(bits);
  }

  // erf of float vectors: Abramowitz and Stegun 7.1.26, the polynomial of ATen's
  // Vectorized<float>::erf (absolute error 1.5e-7), with exp(−x²) from ATen's exp_u20 (a degree-5
  // polynomial; 2.3e-7 relative at most on [−30, 0], measured) where that one calls Sleef's expf:
  // a fifth less work, which brings GELU's pass to oneDNN's, the kernel behind F.gelu on float
  // tensors (docs/benchmark.md, "The activation pass"). The error stays the polynomial's.
  //   erf(x) = sign(x)·(1 − r(t)·t·exp(−x²)),  t = 1/(1 + p·|x|)
  static V erf_float(V x) { return erf_float_given(x, (V(0) - x * x).exp_u20()); }

  // The same polynomial given g = exp(−x²) (GELU's derivative has it from its density: one exp
  // fewer, a fifth to a quarter off that pass, docs/benchmark.md, "The activation pass").
  static V erf_float_given(V x, V g) {
    const V sign = x & V(-0.f);
    const V a = x.abs();
    const V t = V(1) / at::vec::fmadd(V(0.3275911f), a, V(1));
    V r = at::vec::fmadd(V(1.061405429f), t, V(-1.453152027f));
    r = at::vec::fmadd(r, t, V(1.421413741f));
    r = at::vec::fmadd(r, t, V(-0.284496736f));
    r = at::vec::fmadd(r, t, V(0.254829592f));
    return sign ^ at::vec::fmadd(V(0) - r * t, g, V(1));
  }
};

}  // namespace ckpt_ext
