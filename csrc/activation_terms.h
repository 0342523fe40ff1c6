// activation_terms.h — one elementwise pass of the higher orders' formulas (the create_graph nodes
// of ckpt_ext/_mlp_higher_order.py): over n contiguous values of one dtype,
//   out = add + Σ_j f^(k_j)(p) · F_j,1 · ... · F_j,m_j      (k_j in 0..3, m_j <= kMaxFactors)
// each f^(k)(p) made once per element whatever the number of terms that use it, in the accumulate
// type (float for the half types), rounded to the dtype once at the end. Plain data, so that the
// CPU kernels (cpu/kernels.cpp, one copy per ISA level) and the CUDA kernel (cuda/passes.cuh) take
// it as it is. The formulas: docs/design.md, "Other activations".
#pragma once

namespace ckpt_ext {

template <typename T>
struct ActivationTerms {
  static constexpr int kMaxTerms = 4;
  static constexpr int kMaxFactors = 3;
  int count = 0;                              // terms used
  int order[kMaxTerms] = {};                  // k_j
  int factors[kMaxTerms] = {};                // m_j (0: the term is f^(k_j)(p) alone)
  const T* factor[kMaxTerms][kMaxFactors] = {};
  const T* add = nullptr;                     // null: no add (it may be out itself)
  // Which orders some term uses, bit k for f^(k).
  int orders_used() const {
    int mask = 0;
    for (int j = 0; j < count; ++j) mask |= 1 << order[j];
    return mask;
  }
};

}  // namespace ckpt_ext
