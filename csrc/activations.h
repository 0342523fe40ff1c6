// activations.h — the activations of the mlp op, each written once: its value f(z) and its
// derivative times the incoming gradient, gy·f'(z), as templates over the value type V (float or
// double registers on CUDA and the host, at::vec::Vectorized on the CPU), compiled by g++ and nvcc.
// Math<V> gives each V the functions the formulas use. PyTorch's own formulas and constants
// (aten/src/ATen/native/cpu/Activation.cpp); tanh keeps its own kernels (device_math.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "device_math.h"  // CKPT_HD

namespace ckpt_ext {

// The activations: X(enumerator, name) in the schema's spelling order. The enum, the names the ops
// take (checks.cpp) and the dispatch below are made from this one list; a row's formulas are its
// branches of activate and activation_grad.
#define CKPT_EXT_ACTIVATIONS(X) \
  X(kTanh, "tanh")              \
  X(kGelu, "gelu")              \
  X(kGeluTanh, "gelu_tanh")     \
  X(kSilu, "silu")              \
  X(kSigmoid, "sigmoid")        \
  X(kSoftplus, "softplus")      \
  X(kSin, "sin")                \
  X(kRelu, "relu")              \
  X(kQuickGelu, "quick_gelu")

#define CKPT_EXT_ENUMERATOR(e, name) e,
enum class Activation : int8_t { CKPT_EXT_ACTIVATIONS(CKPT_EXT_ENUMERATOR) };
#undef CKPT_EXT_ENUMERATOR
#define CKPT_EXT_COUNT(e, name) +1
constexpr int kNumActivations = 0 CKPT_EXT_ACTIVATIONS(CKPT_EXT_COUNT);
#undef CKPT_EXT_COUNT

// Math<V>: exp, erf, tanh, sin, cos, log1p of V, erf_with_gauss(x, g) = erf(x) given
// g = exp(−x²) (a formula that has g anyway lends it to an erf that would make its own), and
// where_gt(a, b, x, y) = (a > b ? x : y) and where_le(a, b, x, y) = (a <= b ? x : y) per element
// (a NaN compares false in both). The host/CUDA scalar ones here; the CPU kernels specialise it
// for Vectorized.
template <typename V>
struct Math {
  static CKPT_HD V exp(V v) { return ::exp(v); }
  static CKPT_HD V erf(V v) { return ::erf(v); }
  static CKPT_HD V erf_with_gauss(V v, V) { return ::erf(v); }
  static CKPT_HD V tanh(V v) { return ::tanh(v); }
  static CKPT_HD V sin(V v) { return ::sin(v); }
  static CKPT_HD V cos(V v) { return ::cos(v); }
  static CKPT_HD V log1p(V v) { return ::log1p(v); }
  static CKPT_HD V where_gt(V a, V b, V x, V y) { return a > b ? x : y; }
  static CKPT_HD V where_le(V a, V b, V x, V y) { return a <= b ? x : y; }
};
template <>
struct Math<float> {
  static CKPT_HD float exp(float v) { return ::expf(v); }
  static CKPT_HD float erf(float v) { return ::erff(v); }
  static CKPT_HD float erf_with_gauss(float v, float) { return ::erff(v); }
  static CKPT_HD float tanh(float v) { return ::tanhf(v); }
  static CKPT_HD float sin(float v) { return ::sinf(v); }
  static CKPT_HD float cos(float v) { return ::cosf(v); }
  static CKPT_HD float log1p(float v) { return ::log1pf(v); }
  static CKPT_HD float where_gt(float a, float b, float x, float y) { return a > b ? x : y; }
  static CKPT_HD float where_le(float a, float b, float x, float y) { return a <= b ? x : y; }
};

// Constants of PyTorch's GELU kernels: 1/√2, 1/√(2π), √(2/π), and the cubic coefficient.
constexpr double kSqrtHalf = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;
constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kGeluCubic = 0.044715;
// QuickGELU's (CLIP's) sigmoid scale: z·σ(1.702·z).
constexpr double kQuickGeluScale = 1.702;
// nn.Softplus's defaults (beta = 1): above the threshold softplus(z) = z.
constexpr double kSoftplusThreshold = 20.0;

template <Activation A, typename V>
CKPT_HD V activate(V z) {
  using M = Math<V>;
  if constexpr (A == Activation::kTanh) {
    return M::tanh(z);
  } else if constexpr (A == Activation::kGelu) {
    return z * V(0.5) * (V(1) + M::erf(z * V(kSqrtHalf)));
  } else if constexpr (A == Activation::kGeluTanh) {
    const V inner = V(kSqrt2OverPi) * (z + V(kGeluCubic) * z * z * z);
    return V(0.5) * z * (V(1) + M::tanh(inner));
  } else if constexpr (A == Activation::kSilu) {
    return z / (V(1) + M::exp(V(0) - z));
  } else if constexpr (A == Activation::kSigmoid) {
    return V(1) / (V(1) + M::exp(V(0) - z));
  } else if constexpr (A == Activation::kSoftplus) {
    return M::where_gt(z, V(kSoftplusThreshold), z, M::log1p(M::exp(z)));
  } else if constexpr (A == Activation::kSin) {
    return M::sin(z);
  } else if constexpr (A == Activation::kQuickGelu) {  // z·σ(a·z), as transformers spells it
    return z * (V(1) / (V(1) + M::exp(V(0) - V(kQuickGeluScale) * z)));
  } else {  // kRelu: 0 below zero, z (NaN included) otherwise
    return M::where_gt(V(0), z, V(0), z);
  }
}

// gy·f'(z). tanh's is taken from its output instead (tanh_grad_from_output).
template <Activation A, typename V>
CKPT_HD V activation_grad(V gy, V z) {
  using M = Math<V>;
  if constexpr (A == Activation::kTanh) {
    const V t = M::tanh(z);
    return tanh_grad_from_output(gy, t);
  } else if constexpr (A == Activation::kGelu) {
    const V gauss = M::exp(V(-0.5) * z * z);  // exp(−x²) at x = z/√2
    const V cdf = V(0.5) * (V(1) + M::erf_with_gauss(z * V(kSqrtHalf), gauss));
    return gy * (cdf + z * (gauss * V(kInvSqrt2Pi)));
  } else if constexpr (A == Activation::kGeluTanh) {
    const V z2 = z * z;
    const V th = M::tanh(V(kSqrt2OverPi) * (z + V(kGeluCubic) * z2 * z));
    const V left = V(0.5) * (V(1) + th);
    const V right = V(0.5) * z * (V(1) - th * th) * V(kSqrt2OverPi) * (V(1) + V(3 * kGeluCubic) * z2);
    return gy * (left + right);
  } else if constexpr (A == Activation::kSilu) {
    const V s = V(1) / (V(1) + M::exp(V(0) - z));
    return gy * s * (V(1) + z * (V(1) - s));
  } else if constexpr (A == Activation::kSigmoid) {
    const V s = V(1) / (V(1) + M::exp(V(0) - z));
    return gy * s * (V(1) - s);
  } else if constexpr (A == Activation::kSoftplus) {
    const V e = M::exp(z);
    return M::where_gt(z, V(kSoftplusThreshold), gy, gy * e / (e + V(1)));
  } else if constexpr (A == Activation::kSin) {
    return gy * M::cos(z);
  } else if constexpr (A == Activation::kQuickGelu) {  // σ(az)·(1 + a·z·(1 − σ(az)))
    const V az = V(kQuickGeluScale) * z;
    const V s = V(1) / (V(1) + M::exp(V(0) - az));
    return gy * s * (V(1) + az * (V(1) - s));
  } else {  // kRelu: stock autograd's threshold_backward, relu(z) <= 0 ? 0 : gy, so gy at z = NaN
    return M::where_le(z, V(0), V(0), gy);
  }
}

// f^(K)(z) for K = 0 (f itself), 1, 2, 3: the values the create_graph path of the higher orders
// multiplies by (ckpt_ext/_mlp_higher_order.py; its ATen spelling, for the orders it records,
// is the registry's d1, d2, d3 in ckpt_ext/_activations.py). s = σ(z), φ = exp(−z²/2)/√(2π);
// gelu_tanh with u = k(z + c·z³), th = tanh(u), S = 1 − th², P = u' + z·(u'' − 2·th·u'²)/2.
template <Activation A, int K, typename V>
CKPT_HD V activation_derivative(V z) {
  static_assert(K >= 0 && K <= 3, "the orders 0 to 3");
  using M = Math<V>;
  if constexpr (K == 0) {
    return activate<A>(z);
  } else if constexpr (K == 1) {
    return activation_grad<A>(V(1), z);
  } else if constexpr (A == Activation::kTanh) {
    const V t = M::tanh(z);
    const V s = V(1) - t * t;
    return K == 2 ? s * (V(-2) * t) : s * (V(6) * t * t - V(2));
  } else if constexpr (A == Activation::kGelu) {
    const V z2 = z * z;
    const V phi = M::exp(V(-0.5) * z2) * V(kInvSqrt2Pi);
    return K == 2 ? phi * (V(2) - z2) : phi * z * (z2 - V(4));
  } else if constexpr (A == Activation::kGeluTanh) {
    const V z2 = z * z;
    const V th = M::tanh(V(kSqrt2OverPi) * (z + V(kGeluCubic) * z2 * z));
    const V du = V(kSqrt2OverPi) * (V(1) + V(3 * kGeluCubic) * z2);
    const V d2u = V(6 * kSqrt2OverPi * kGeluCubic) * z;
    const V s = V(1) - th * th;
    const V p = du + V(0.5) * z * (d2u - V(2) * th * du * du);
    if constexpr (K == 2) {
      return s * p;
    } else {
      const V dp = V(1.5) * d2u - th * du * du +
                   V(0.5) * z * (V(6 * kSqrt2OverPi * kGeluCubic) - V(2) * s * du * du * du -
                                 V(4) * th * du * d2u);
      return s * (dp - V(2) * th * du * p);
    }
  } else if constexpr (A == Activation::kSilu || A == Activation::kQuickGelu) {
    // quick_gelu(z) = silu(a·z)/a, so its K-th derivative is a^(K−1)·silu^(K)(a·z)
    constexpr double kScale = A == Activation::kSilu ? 1.0 : kQuickGeluScale;
    const V x = A == Activation::kSilu ? z : V(kScale) * z;
    const V s = V(1) / (V(1) + M::exp(V(0) - x));
    const V ds = s * (V(1) - s);
    const V q = V(1) - V(2) * s;
    if constexpr (K == 2) {
      const V r = ds * (V(2) + x * q);
      return A == Activation::kSilu ? r : V(kScale) * r;
    } else {
      const V r = ds * (q * (V(3) + x * q) - V(2) * x * ds);
      return A == Activation::kSilu ? r : V(kScale * kScale) * r;
    }
  } else if constexpr (A == Activation::kSigmoid) {
    const V s = V(1) / (V(1) + M::exp(V(0) - z));
    const V ds = s * (V(1) - s);
    return K == 2 ? ds * (V(1) - V(2) * s) : ds * (V(1) - V(6) * s + V(6) * s * s);
  } else if constexpr (A == Activation::kSoftplus) {  // f(z) = z above the threshold
    const V s = V(1) / (V(1) + M::exp(V(0) - z));
    const V ds = s * (V(1) - s);
    return M::where_gt(z, V(kSoftplusThreshold), V(0), K == 2 ? ds : ds * (V(1) - V(2) * s));
  } else if constexpr (A == Activation::kSin) {
    return V(0) - (K == 2 ? M::sin(z) : M::cos(z));
  } else {  // kRelu: piecewise linear
    return V(0);
  }
}

// Calls fn(std::integral_constant<int, K>{}) for the runtime order k (0 to 3), as with_activation.
template <typename Fn>
inline auto with_order(int k, Fn&& fn) {
  switch (k) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    default: return fn(std::integral_constant<int, 0>{});
  }
}

// Calls fn(std::integral_constant<Activation, A>{}) for the runtime value a: one instantiation per
// activation, so each kernel loop is compiled for its formula.
template <typename Fn>
inline auto with_activation(Activation a, Fn&& fn) {
#define CKPT_EXT_CASE(e, name) \
  case Activation::e: return fn(std::integral_constant<Activation, Activation::e>{});
  switch (a) {
    CKPT_EXT_ACTIVATIONS(CKPT_EXT_CASE)
    default: return fn(std::integral_constant<Activation, Activation::kTanh>{});
  }
#undef CKPT_EXT_CASE
}

}  // namespace ckpt_ext
