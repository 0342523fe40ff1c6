// moe.h — the mixture-of-experts engine: transformers' experts (3-D expert weights, top-k
// routing) forward and recomputing backward on every device, behind the moe_experts ops
// (moe_ops.cpp). Routing, what is kept and the backward: docs/design.md, "Mixture of experts".
// Shapes: x (..., H), top_k_index and top_k_weights (..., K) over x's leading dimensions (T
// tokens); E experts; for a gated layout gate_up holds 2I outputs per expert (the gate's and the
// up projection's), for an ungated one the up projection's I; gate_up (E, 2I or I, H), down
// (E, N, I), or transposed (E, H, 2I or I) and (E, I, N); gate_up_bias (E, 2I or I) in
// gate_up's output order, down_bias (E, N). The output is (..., N).
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <string>
#include <vector>

#include "activations.h"

namespace ckpt_ext {

// How the expert weights are stored: X(enumerator, name, gated, interleaved, transposed).
// gated: gate_up's outputs are the gate's and the up projection's ([gate; up] when not
// interleaved, gate and up alternating, g0 u0 g1 u1 ..., when interleaved); ungated: the up
// projection's only, and the expert is down(f(up(x))). transposed: each expert's matrices are
// stored (in, out), as x·W reads them, instead of nn.Linear's (out, in).
#define CKPT_EXT_MOE_LAYOUTS(X)                                            \
  X(kConcatenated, "concatenated", true, false, false)                    \
  X(kConcatenatedTransposed, "concatenated_transposed", true, false, true) \
  X(kInterleaved, "interleaved", true, true, false)                       \
  X(kInterleavedTransposed, "interleaved_transposed", true, true, true)   \
  X(kUngated, "ungated", false, false, false)                             \
  X(kUngatedTransposed, "ungated_transposed", false, false, true)

struct MoeLayout {
  bool gated;
  bool interleaved;
  bool transposed;
};

// The layout names, in the list's order, and the layout `name` names: a ValueError listing them
// all for any other name.
const std::vector<std::string>& moe_layout_names();
MoeLayout parse_moe_layout(const char* op, c10::string_view name);

// The expert's hidden activation: h = f(min(g, limit)) · (clamp(u, −limit, limit) + up_offset)
// when gated (no clamp when limit is nullopt: h = f(g)·(u + up_offset)), h = f(u) when not.
struct MoeGate {
  Activation act;
  std::optional<double> limit;
  double up_offset;
};

// y (..., N): Σ_k top_k_weights[t, k] · expert_{top_k_index[t, k]}(x[t]), a fresh tensor of x's
// dtype; the products and the sum over k in the promoted dtype of x and top_k_weights. An index
// equal to E routes its pair to no expert (it adds nothing); any other index outside [0, E) is a
// ValueError.
at::Tensor moe_forward(const at::Tensor& x, const at::Tensor& top_k_index,
                       const at::Tensor& top_k_weights, const at::Tensor& gate_up,
                       const at::Tensor& down, const std::optional<at::Tensor>& gate_up_bias,
                       const std::optional<at::Tensor>& down_bias, MoeLayout layout,
                       const MoeGate& gate);

// The gradients w.r.t. x, top_k_weights, gate_up, down, gate_up_bias, down_bias, in that order;
// each only where need[i] (else undefined), of its input's shape and dtype.
using MoeGrads = std::array<at::Tensor, 6>;
MoeGrads moe_backward(const at::Tensor& grad_out, const at::Tensor& x,
                      const at::Tensor& top_k_index, const at::Tensor& top_k_weights,
                      const at::Tensor& gate_up, const at::Tensor& down,
                      const std::optional<at::Tensor>& gate_up_bias,
                      const std::optional<at::Tensor>& down_bias, MoeLayout layout,
                      const MoeGate& gate, const std::array<bool, 6>& need);

}  // namespace ckpt_ext
