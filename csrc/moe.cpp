// moe.cpp — the mixture-of-experts engine of moe.h. The (token, k) pairs are sorted by expert
// once (a stable sort: the pairs of an expert keep their token order), so that each expert's rows
// are one contiguous block; each expert with rows runs its GEMMs on its block (ATen's mm on
// slices, addmm with the bias), an expert with none runs nothing. The forward keeps nothing; the
// backward routes again, recomputes the gate and up projections as the forward ran them and
// makes every gradient from the block buffers (docs/design.md, "Mixture of experts").
#include "moe.h"

#include "primitives.h"
#include "stack.h"

namespace ckpt_ext {

const std::vector<std::string>& moe_layout_names() {
#define CKPT_EXT_MOE_NAME(e, name, gated, interleaved, transposed) name,
  static const std::vector<std::string> names{CKPT_EXT_MOE_LAYOUTS(CKPT_EXT_MOE_NAME)};
#undef CKPT_EXT_MOE_NAME
  return names;
}

MoeLayout parse_moe_layout(const char* op, c10::string_view name) {
#define CKPT_EXT_MOE_ROW(e, n, gated, interleaved, transposed) \
  if (name == n) return MoeLayout{gated, interleaved, transposed};
  CKPT_EXT_MOE_LAYOUTS(CKPT_EXT_MOE_ROW)
#undef CKPT_EXT_MOE_ROW
  std::string allowed;
  for (const std::string& n : moe_layout_names()) {
    allowed += (allowed.empty() ? "\"" : ", \"") + n + "\"";
  }
  TORCH_CHECK_VALUE(false, "ckpt_ext.", op, ": layout must be one of ", allowed, "; got \"",
                    std::string(name.data(), name.size()), "\"");
}

namespace {

// ----------------------------------------------------------------------------------------------
// routing

// The pairs (t, k) grouped by expert. order[j] is the flat pair index t·K + k of row j, token[j]
// its token, expert[j] its expert; expert e's rows are [offsets[e], offsets[e + 1]). Pairs routed
// to no expert (index E) come last in the sort and are not rows.
struct Routing {
  at::Tensor order, token, expert;  // (R) int64 each
  std::vector<int64_t> offsets;     // (E + 1)
  int64_t rows() const { return offsets.back(); }
  int64_t count(int64_t e) const { return offsets[e + 1] - offsets[e]; }
};

Routing route(const char* op, const at::Tensor& top_k_index, int64_t E) {
  const int64_t S = top_k_index.numel();
  const int64_t K = top_k_index.dim() > 0 ? top_k_index.size(-1) : 1;
  Routing r;
  r.offsets.assign(E + 1, 0);
  at::Tensor idx = top_k_index.reshape({S}).to(at::kLong);
  if (S == 0) {
    r.order = r.token = r.expert = idx;
    return r;
  }
  auto [sorted, order] = at::sort(idx, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  // Each expert's first row, and E's (the number of routed pairs), then one copy to the host with
  // the smallest and largest index: the per-expert GEMMs need their row counts there.
  const at::Tensor firsts = at::searchsorted(sorted, at::arange(E + 1, idx.options()));
  const at::Tensor host =
      at::cat({sorted.narrow(0, 0, 1), sorted.narrow(0, S - 1, 1), firsts}).cpu();
  const int64_t* h = host.const_data_ptr<int64_t>();
  TORCH_CHECK_VALUE(h[0] >= 0 && h[1] <= E, "ckpt_ext.", op,
                    ": top_k_index must hold expert indices in [0, ", E, "] (", E,
                    " experts; the index ", E, " routes a pair to no expert), got values from ",
                    h[0], " to ", h[1]);
  for (int64_t e = 0; e <= E; ++e) r.offsets[e] = h[2 + e];
  const int64_t R = r.rows();
  r.order = order.narrow(0, 0, R);
  r.expert = sorted.narrow(0, 0, R);
  r.token = at::div(r.order, K, "trunc");
  return r;
}

// (T, C): row t = Σ_k rows[j] (· weights[j]) over the rows j of token t's pairs, in k order, in
// the promoted dtype of rows and weights, then cast to out_dtype. Deterministic on every device:
// the rows go back to their pair positions (zeros for pairs routed to no expert) and each token
// sums its K pairs, instead of a scatter-add.
at::Tensor combine(const at::Tensor& rows, const Routing& r, int64_t T, int64_t K,
                   const at::Tensor& weights, at::ScalarType out_dtype) {
  const int64_t C = rows.size(1), S = T * K;
  if (K == 0) return at::zeros({T, C}, rows.options().dtype(out_dtype));
  at::Tensor v = weights.defined() ? rows * weights.unsqueeze(1) : rows;
  at::Tensor full = r.rows() == S ? at::empty({S, C}, v.options()) : at::zeros({S, C}, v.options());
  full.index_copy_(0, r.order, v);
  return full.view({T, K, C}).sum(1).to(out_dtype);
}

// One value per pair (S), from one per row (R): zero for pairs routed to no expert.
at::Tensor per_pair(const at::Tensor& per_row, const Routing& r, int64_t S) {
  at::Tensor full = r.rows() == S ? at::empty({S}, per_row.options())
                                  : at::zeros({S}, per_row.options());
  return full.index_copy_(0, r.order, per_row);
}

// ----------------------------------------------------------------------------------------------
// per-expert GEMMs on the row blocks. W is (E, out, in), or (E, in, out) when transposed; W_e as
// nn.Linear reads it is (out, in).

at::Tensor linear_weight(const at::Tensor& W, int64_t e, bool transposed) {
  return transposed ? W[e].t() : W[e];
}

// (R, out): a_e · W_eᵀ + b_e per expert block.
at::Tensor experts_linear(const at::Tensor& a, const Routing& r, const at::Tensor& W,
                          const std::optional<at::Tensor>& bias, bool transposed) {
  const int64_t out_features = W.size(transposed ? 2 : 1);
  at::Tensor out = new_buffer({a.size(0), out_features}, a.options());
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(r.offsets.size()); ++e) {
    const int64_t n = r.count(e);
    if (n == 0) continue;
    const int64_t o = r.offsets[e];
    linear_into(out.narrow(0, o, n), a.narrow(0, o, n), linear_weight(W, e, transposed),
                bias.has_value() ? std::optional<at::Tensor>((*bias)[e]) : std::nullopt);
  }
  return out;
}

// (R, in): g_e · W_e per expert block, the gradient w.r.t. the input of experts_linear.
at::Tensor experts_input_grad(const at::Tensor& g, const Routing& r, const at::Tensor& W,
                              bool transposed) {
  at::Tensor out = new_buffer({g.size(0), W.size(transposed ? 1 : 2)}, g.options());
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(r.offsets.size()); ++e) {
    const int64_t n = r.count(e);
    if (n == 0) continue;
    at::Tensor dst = out.narrow(0, r.offsets[e], n);
    at::mm_out(dst, g.narrow(0, r.offsets[e], n), linear_weight(W, e, transposed));
  }
  return out;
}

// The gradient of W (its shape and layout): g_eᵀ · a_e per expert, stored as W stores W_e;
// zero for an expert without rows.
at::Tensor experts_weight_grad(const at::Tensor& g, const at::Tensor& a, const Routing& r,
                               const at::Tensor& W, bool transposed) {
  at::Tensor grad = new_buffer(W.sizes(), g.options());
  for (int64_t e = 0; e < W.size(0); ++e) {
    at::Tensor dst = grad[e];
    const int64_t n = r.count(e);
    if (n == 0) {
      dst.zero_();
      continue;
    }
    const at::Tensor ge = g.narrow(0, r.offsets[e], n), ae = a.narrow(0, r.offsets[e], n);
    if (transposed) {
      at::mm_out(dst, ae.t(), ge);
    } else {
      at::mm_out(dst, ge.t(), ae);
    }
  }
  return grad;
}

// (E, C): the column sums of each expert's block of g (bias_grad's order), zero without rows.
at::Tensor experts_bias_grad(const at::Tensor& g, const Routing& r, int64_t E) {
  at::Tensor grad = new_buffer({E, g.size(1)}, g.options());
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = r.count(e);
    if (n == 0) {
      grad[e].zero_();
    } else {
      grad[e].copy_(bias_grad(g.narrow(0, r.offsets[e], n)));
    }
  }
  return grad;
}

// ----------------------------------------------------------------------------------------------
// the gate and up projections

// (R, W) with W = 2I, alternating gate and up columns -> [gate | up], and back.
at::Tensor deinterleave(const at::Tensor& z) {
  const int64_t R = z.size(0), I = z.size(1) / 2;
  return z.view({R, I, 2}).transpose(1, 2).contiguous().view({R, 2 * I});
}

at::Tensor interleave(const at::Tensor& z) {
  const int64_t R = z.size(0), I = z.size(1) / 2;
  return z.view({R, 2, I}).transpose(1, 2).contiguous().view({R, 2 * I});
}

// z (R, 2I or I) contiguous: the gate and up projections of every row as [g | u] (gated), or
// the up projection (ungated). The backward's recompute runs this very call: the forward's bits.
at::Tensor gate_and_up(const at::Tensor& xs, const Routing& r, const at::Tensor& gate_up,
                       const std::optional<at::Tensor>& bias, MoeLayout layout) {
  at::Tensor z = experts_linear(xs, r, gate_up, bias, layout.transposed);
  return layout.interleaved ? deinterleave(z) : z;
}

// Where the clamps let the gradient through (the gate's g <= limit, the up projection's
// −limit <= u <= limit, as torch.clamp's backward: a NaN lets none through), read before
// clamp_limits changes z; undefined without a limit.
struct ClampMasks {
  at::Tensor gate, up;
};

ClampMasks clamp_masks(const at::Tensor& z, const MoeGate& gate) {
  if (!gate.limit.has_value()) return {};
  const int64_t I = z.size(1) / 2;
  const double L = *gate.limit;
  const at::Tensor u = z.narrow(1, I, I);
  return {z.narrow(1, 0, I).le(L), u.ge(-L).logical_and_(u.le(L))};
}

// z = [g | u] becomes [min(g, limit) | clamp(u, −limit, limit) + up_offset] in place.
void clamp_limits(const at::Tensor& z, const MoeGate& gate) {
  const int64_t I = z.size(1) / 2;
  at::Tensor g = z.narrow(1, 0, I), u = z.narrow(1, I, I);
  if (gate.limit.has_value()) {
    g.clamp_max_(*gate.limit);
    u.clamp_(-*gate.limit, *gate.limit);
  }
  if (gate.up_offset != 0.0) u.add_(gate.up_offset);
}

// h (R, I), from z as gate_and_up made it: in place in z's first I columns (gated) or in z.
at::Tensor hidden_in_place(const at::Tensor& z, MoeLayout layout, const MoeGate& gate) {
  if (!layout.gated) {
    activation_in_place(z, gate.act);
    return z;
  }
  clamp_limits(z, gate);
  gated_in_place(z, gate.act);
  return z.narrow(1, 0, z.size(1) / 2);
}

// Σ_c a[j, c]·b[j, c] per row, in `dtype`.
at::Tensor row_dot(const at::Tensor& a, const at::Tensor& b, at::ScalarType dtype) {
  return (a.to(dtype) * b.to(dtype)).sum(1);
}

int64_t num_tokens(const at::Tensor& x) {
  int64_t T = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) T *= x.size(d);
  return T;
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// forward

at::Tensor moe_forward(const at::Tensor& x, const at::Tensor& top_k_index,
                       const at::Tensor& top_k_weights, const at::Tensor& gate_up,
                       const at::Tensor& down, const std::optional<at::Tensor>& gate_up_bias,
                       const std::optional<at::Tensor>& down_bias, MoeLayout layout,
                       const MoeGate& gate) {
  const int64_t T = num_tokens(x), K = top_k_index.size(-1);
  const Routing r = route("moe_experts", top_k_index, gate_up.size(0));
  at::Tensor y;
  {
    at::Tensor z = gate_and_up(flatten_rows(x).index_select(0, r.token), r, gate_up,
                               gate_up_bias, layout);
    const at::Tensor h = hidden_in_place(z, layout, gate);
    y = experts_linear(h, r, down, down_bias, layout.transposed);  // (R, N); z freed here
  }
  const at::Tensor wp = top_k_weights.reshape({T * K}).index_select(0, r.order);
  at::Tensor out = combine(y, r, T, K, wp, x.scalar_type());
  return at::_unsafe_view(out, out_sizes(x, out.size(1)));  // not an autograd view (stack.cpp)
}

// ----------------------------------------------------------------------------------------------
// backward
//
// With dy_j = w_j·gy_t the gradient reaching row j's expert output (t its token, w_j its weight)
// and g0_j = gy_t·W_down,e the unweighted gradient w.r.t. its h:
//   grad_w_j = ⟨y_j, gy_t⟩ = ⟨h_j, g0_j⟩ + ⟨b_down,e, gy_t⟩    (no second down GEMM)
//   grad_W_down,e = Σ_j dy_jᵀ·h_j          grad_b_down,e = Σ_j dy_j
//   gh_j = w_j·g0_j, then [dg | du] (or dz) through the gated product and the clamps
//   grad_W_gate_up,e = Σ_j dz_jᵀ·x_t       grad_b_gate_up,e = Σ_j dz_j
//   grad_x_t = Σ_{j of t} dz_j·W_gate_up,e

MoeGrads moe_backward(const at::Tensor& grad_out, const at::Tensor& x,
                      const at::Tensor& top_k_index, const at::Tensor& top_k_weights,
                      const at::Tensor& gate_up, const at::Tensor& down,
                      const std::optional<at::Tensor>& gate_up_bias,
                      const std::optional<at::Tensor>& down_bias, MoeLayout layout,
                      const MoeGate& gate, const std::array<bool, 6>& need) {
  const auto [need_x, need_w, need_gu, need_d, need_gub, need_db] = need;
  MoeGrads grads;
  const bool need_up_b = need_gub && gate_up_bias.has_value();
  const bool need_down_b = need_db && down_bias.has_value();
  const bool need_in = need_x || need_gu || need_up_b;  // dz: below the gated product
  if (!(need_in || need_w || need_d || need_down_b)) return grads;

  const int64_t E = gate_up.size(0), T = num_tokens(x), K = top_k_index.size(-1);
  const int64_t N = down.size(layout.transposed ? 2 : 1);
  const Routing r = route("moe_experts_backward", top_k_index, E);
  const at::Tensor xf = flatten_rows(x);
  at::Tensor gyp = grad_out.reshape({T, N}).index_select(0, r.token);  // (R, N)
  const at::Tensor wp = top_k_weights.reshape({T * K}).index_select(0, r.order);
  // dy = w·gy, the gradient w.r.t. the expert outputs: the down projection's gradients
  auto down_grads = [&](const at::Tensor& h) {
    const at::Tensor dy = (gyp * wp.unsqueeze(1)).to(x.scalar_type());  // (R, N)
    if (need_down_b) grads[5] = experts_bias_grad(dy, r, E);
    if (need_d) grads[3] = experts_weight_grad(dy, h, r, down, layout.transposed);
  };
  if (!(need_in || need_w || need_d)) {
    down_grads(at::Tensor());
    return grads;
  }

  // The recompute; its (R, H) copy of x's rows is taken again where grad_gate_up needs it.
  at::Tensor z = gate_and_up(xf.index_select(0, r.token), r, gate_up, gate_up_bias, layout);
  const int64_t I = layout.gated ? z.size(1) / 2 : z.size(1);
  // g0: the unweighted gradient w.r.t. h, (R, I)
  at::Tensor g0 = (need_in || need_w) ? experts_input_grad(gyp, r, down, layout.transposed)
                                      : at::Tensor();
  at::Tensor h;
  if (!need_in) {
    h = hidden_in_place(z, layout, gate);
  } else {
    // gh = w·g0, in its own buffer when g0 is still needed for grad_w; it becomes h (gated).
    at::Tensor gh = need_w ? (g0 * wp.unsqueeze(1)).to(x.scalar_type())
                           : g0.mul_(wp.unsqueeze(1));
    if (!need_w) g0 = at::Tensor();
    if (layout.gated) {
      const ClampMasks masks = clamp_masks(z, gate);
      clamp_limits(z, gate);
      gated_backward_(z, gh, gate.act);  // z = [dg | du] w.r.t. the clamped g, u; gh = h
      h = gh;
      if (masks.gate.defined()) {
        z.narrow(1, 0, I).masked_fill_(masks.gate.logical_not(), 0);
        z.narrow(1, I, I).masked_fill_(masks.up.logical_not(), 0);
      }
    } else {
      if (need_d || need_w) {
        h = new_buffer(z.sizes(), z.options());
        activation_to(z, h, gate.act);
      }
      activation_backward_(z, gh, gate.act, /*want_bias_grad=*/false);  // z = dz
    }
  }
  if (need_w) {
    const at::ScalarType promoted =
        at::promote_types(x.scalar_type(), top_k_weights.scalar_type());
    at::Tensor gw = row_dot(h, g0, promoted);
    g0 = at::Tensor();
    if (down_bias.has_value()) gw += row_dot(gyp, down_bias->index_select(0, r.expert), promoted);
    grads[1] = per_pair(gw.to(top_k_weights.scalar_type()), r, T * K).view(top_k_weights.sizes());
  }
  if (need_d || need_down_b) down_grads(h);
  gyp = at::Tensor();
  h = at::Tensor();
  if (!need_in) return grads;

  at::Tensor dz = layout.interleaved ? interleave(z) : z;  // gate_up's output order
  z = at::Tensor();
  if (need_up_b) grads[4] = experts_bias_grad(dz, r, E);
  if (need_gu) {
    grads[2] = experts_weight_grad(dz, xf.index_select(0, r.token), r, gate_up,
                                   layout.transposed);
  }
  if (need_x) {
    at::Tensor gxs = experts_input_grad(dz, r, gate_up, layout.transposed);  // (R, H)
    dz = at::Tensor();
    grads[0] = combine(gxs, r, T, K, at::Tensor(), x.scalar_type()).view(x.sizes());
  }
  return grads;
}

}  // namespace ckpt_ext
