// checks.cpp — every input check of the ckpt_ext ops (declared in checks.h), called by the eager
// kernels and the Meta kernels alike, so a traced program fails with the eager message.
#include "checks.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace ckpt_ext {

const std::vector<at::ScalarType>& supported_dtypes() {
  static const std::vector<at::ScalarType> dtypes{at::kFloat, at::kDouble, at::kBFloat16,
                                                  at::kHalf};
  return dtypes;
}

bool is_supported_dtype(at::ScalarType t) {
  const auto& d = supported_dtypes();
  return std::find(d.begin(), d.end(), t) != d.end();
}


// "float32, float64, bfloat16 or float16", from supported_dtypes().
std::string supported_dtypes_text() {
  const auto& d = supported_dtypes();
  std::ostringstream s;
  for (size_t i = 0; i < d.size(); ++i) {
    if (i > 0) s << (i + 1 == d.size() ? " or " : ", ");
    s << c10::getDtypeNames(d[i]).first;  // "float32"-style names, as torch prints them
  }
  return s.str();
}

const std::vector<std::string>& activation_names() {
#define CKPT_EXT_NAME(e, name) name,
  static const std::vector<std::string> names{CKPT_EXT_ACTIVATIONS(CKPT_EXT_NAME)};
#undef CKPT_EXT_NAME
  return names;
}

Activation parse_activation(const char* op, c10::string_view name) {
  const auto& names = activation_names();
  for (size_t i = 0; i < names.size(); ++i) {
    if (name == names[i]) return static_cast<Activation>(i);
  }
  std::ostringstream allowed;
  for (size_t i = 0; i < names.size(); ++i) allowed << (i ? ", " : "") << '"' << names[i] << '"';
  TORCH_CHECK_VALUE(false, "ckpt_ext.", op, ": activation must be one of ", allowed.str(),
                    "; got \"", std::string(name.data(), name.size()), "\"");
}

std::vector<Activation> parse_activations(const char* op, c10::string_view spec, size_t layers,
                                          bool last_activation) {
  std::vector<Activation> acts;
  size_t start = 0;
  while (true) {
    const size_t comma = spec.find(',', start);
    acts.push_back(parse_activation(
        op, spec.substr(start, comma == c10::string_view::npos ? c10::string_view::npos
                                                                 : comma - start)));
    if (comma == c10::string_view::npos) break;
    start = comma + 1;
  }
  const size_t activated = last_activation ? layers : layers - 1;
  if (acts.size() == 1) return std::vector<Activation>(layers, acts[0]);
  TORCH_CHECK_VALUE(acts.size() == activated, "ckpt_ext.", op, ": activation must be one name or ",
                    activated, " (one per layer with an activation: ", layers, " layers, ",
                    last_activation ? "the last one included" : "none after the last",
                    "); got ", acts.size(), " names");
  if (!last_activation) acts.push_back(acts.back());  // the top layer's entry, never applied
  return acts;
}

namespace {

std::string shape_str(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sym_sizes();
  return s.str();
}

void check_dtype_and_device(const char* op, const std::string& name, const at::Tensor& t,
                            const at::Tensor& x) {
  TORCH_CHECK_TYPE(t.scalar_type() == x.scalar_type(), "ckpt_ext.", op, ": ", name,
                   " must have the dtype of x (", x.scalar_type(), "), got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == x.device(), "ckpt_ext.", op, ": ", name,
                    " must be on the device of x (", x.device(), "), got ", t.device());
}

void check_x(const char* op, const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() >= 1, "ckpt_ext.", op,
                    ": x must have shape (..., in_features) with at least 1 dimension, got a "
                    "0-d tensor");
}

void check_x_dtype(const char* op, const at::Tensor& x) {
  TORCH_CHECK_TYPE(is_supported_dtype(x.scalar_type()), "ckpt_ext.", op, ": x must be ",
                   supported_dtypes_text(), ", got ", x.scalar_type());
}

}  // namespace

void check_linear_tanh_inputs(const char* op, const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias) {
  check_x(op, x);
  TORCH_CHECK_VALUE(weight.dim() == 2, "ckpt_ext.", op,
                    ": weight must be 2-D (out_features, in_features), got shape ",
                    shape_str(weight));
  TORCH_CHECK_VALUE(x.sym_size(-1) == weight.sym_size(1), "ckpt_ext.", op,
                    ": x.shape[-1] must equal weight.shape[1] (in_features) = ",
                    weight.sym_size(1), ", got x of shape ", shape_str(x),
                    " and weight of shape ", shape_str(weight));
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->sym_size(0) == weight.sym_size(0), "ckpt_ext.",
                      op, ": bias must have shape [", weight.sym_size(0),
                      "] (out_features), got shape ", shape_str(*bias));
  }
  check_x_dtype(op, x);
  check_dtype_and_device(op, "weight", weight, x);
  if (bias.has_value()) check_dtype_and_device(op, "bias", *bias, x);
}

void check_stack_inputs(const char* op, const at::Tensor& x, at::TensorList weights,
                           at::TensorList biases, const std::vector<bool>& has_bias) {
  const int64_t L = static_cast<int64_t>(weights.size());
  TORCH_CHECK_VALUE(L >= 1, "ckpt_ext.", op,
                    ": weights must hold at least one layer's weight, got an empty list");
  TORCH_CHECK_VALUE(static_cast<int64_t>(has_bias.size()) == L, "ckpt_ext.", op,
                    ": has_bias must have one entry per layer (", L, "), got ", has_bias.size());
  const int64_t with_bias = std::count(has_bias.begin(), has_bias.end(), true);
  TORCH_CHECK_VALUE(static_cast<int64_t>(biases.size()) == with_bias, "ckpt_ext.", op,
                    ": biases must hold one tensor per layer whose has_bias is true (", with_bias,
                    "), got ", biases.size());
  check_x(op, x);
  size_t j = 0;  // index into biases
  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor& w = weights[i];
    TORCH_CHECK_VALUE(w.dim() == 2, "ckpt_ext.", op, ": weights[", i,
                      "] must be 2-D (out_features, in_features), got shape ", shape_str(w));
    if (i == 0) {
      TORCH_CHECK_VALUE(w.sym_size(1) == x.sym_size(-1), "ckpt_ext.", op,
                        ": weights[0].shape[1] (in_features) must equal x.shape[-1] = ",
                        x.sym_size(-1), ", got weights[0] of shape ", shape_str(w),
                        " and x of shape ", shape_str(x));
    } else {
      TORCH_CHECK_VALUE(w.sym_size(1) == weights[i - 1].sym_size(0), "ckpt_ext.", op,
                        ": weights[", i, "].shape[1] (in_features) must equal weights[", i - 1,
                        "].shape[0] (out_features of layer ", i - 1, ") = ",
                        weights[i - 1].sym_size(0), ", got weights[", i, "] of shape ",
                        shape_str(w));
    }
    if (has_bias[i]) {
      const at::Tensor& b = biases[j++];
      TORCH_CHECK_VALUE(b.dim() == 1 && b.sym_size(0) == w.sym_size(0), "ckpt_ext.", op,
                        ": biases[", i, "] must have shape [", w.sym_size(0),
                        "] (out_features of layer ", i, "), got shape ", shape_str(b));
    }
  }
  check_x_dtype(op, x);
  j = 0;
  for (int64_t i = 0; i < L; ++i) {
    check_dtype_and_device(op, "weights[" + std::to_string(i) + "]", weights[i], x);
    if (has_bias[i]) check_dtype_and_device(op, "biases[" + std::to_string(i) + "]", biases[j++], x);
  }
}

namespace {

// The parts of a gated MLP, "gate", "up", "down" (or "gate_up", "down": `L` is 3 for [gate, up,
// down], 2 for [gate_up, down]), and its weights' names in the messages.
std::string gated_part(int64_t L, int64_t i) {
  if (L == 2) return i == 0 ? "gate_up" : "down";
  return i == 0 ? "gate" : i == 1 ? "up" : "down";
}

std::string gated_weight_name(int64_t L, int64_t i) {
  return gated_part(L, i) + "_weight (weights[" + std::to_string(i) + "])";
}

}  // namespace

void check_gated_inputs(const char* op, const at::Tensor& x, at::TensorList weights,
                        at::TensorList biases, const std::vector<bool>& has_bias) {
  const int64_t L = static_cast<int64_t>(weights.size());
  TORCH_CHECK_VALUE(L == 2 || L == 3, "ckpt_ext.", op,
                    ": weights must be [gate_weight, up_weight, down_weight] or "
                    "[gate_up_weight, down_weight], got ", L, " tensors");
  TORCH_CHECK_VALUE(static_cast<int64_t>(has_bias.size()) == L, "ckpt_ext.", op,
                    ": has_bias must have one entry per weight (", L, "), got ", has_bias.size());
  const int64_t with_bias = std::count(has_bias.begin(), has_bias.end(), true);
  TORCH_CHECK_VALUE(static_cast<int64_t>(biases.size()) == with_bias, "ckpt_ext.", op,
                    ": biases must hold one tensor per weight whose has_bias is true (", with_bias,
                    "), got ", biases.size());
  check_x(op, x);
  const bool packed = L == 2;
  auto name = [&](int64_t i, const std::string& what) {
    return what == "weight" ? gated_weight_name(L, i)
                            : gated_part(L, i) + "_bias (the bias of weights[" +
                                  std::to_string(i) + "])";
  };
  for (int64_t i = 0; i < L; ++i) {
    TORCH_CHECK_VALUE(weights[i].dim() == 2, "ckpt_ext.", op, ": ", name(i, "weight"),
                      " must be 2-D (out_features, in_features), got shape ",
                      shape_str(weights[i]));
  }
  const at::Tensor& w0 = weights[0];
  const at::Tensor& down = weights[L - 1];
  TORCH_CHECK_VALUE(w0.sym_size(1) == x.sym_size(-1), "ckpt_ext.", op, ": ", name(0, "weight"),
                    ".shape[1] (hidden size) must equal x.shape[-1] = ", x.sym_size(-1),
                    ", got ", name(0, "weight"), " of shape ", shape_str(w0), " and x of shape ",
                    shape_str(x));
  c10::SymInt inter = w0.sym_size(0);
  if (packed) {
    TORCH_CHECK_VALUE(w0.sym_size(0) % 2 == 0, "ckpt_ext.", op, ": ", name(0, "weight"),
                      " must have an even number of rows (the gate's, then the up projection's), "
                      "got shape ", shape_str(w0));
    inter = w0.sym_size(0) / 2;
  } else {
    TORCH_CHECK_VALUE(weights[1].sym_sizes() == w0.sym_sizes(), "ckpt_ext.", op, ": ",
                      name(1, "weight"), " must have the shape of ", name(0, "weight"), " ",
                      shape_str(w0), ", got shape ", shape_str(weights[1]));
  }
  TORCH_CHECK_VALUE(down.sym_size(1) == inter, "ckpt_ext.", op, ": ", name(L - 1, "weight"),
                    ".shape[1] must equal the intermediate size ", inter, ", got ",
                    name(L - 1, "weight"), " of shape ", shape_str(down));
  size_t j = 0;
  for (int64_t i = 0; i < L; ++i) {
    if (!has_bias[i]) continue;
    const at::Tensor& b = biases[j++];
    TORCH_CHECK_VALUE(b.dim() == 1 && b.sym_size(0) == weights[i].sym_size(0), "ckpt_ext.", op,
                      ": ", name(i, "bias"), " must have shape [", weights[i].sym_size(0),
                      "] (out_features of ", name(i, "weight"), "), got shape ", shape_str(b));
  }
  check_x_dtype(op, x);
  j = 0;
  for (int64_t i = 0; i < L; ++i) {
    check_dtype_and_device(op, name(i, "weight"), weights[i], x);
    if (has_bias[i]) check_dtype_and_device(op, name(i, "bias"), biases[j++], x);
  }
}

namespace {

void check_lora_inputs(const char* op, const at::Tensor& x, at::TensorList weights,
                       const LoraArgs& lora, const std::vector<std::string>& names,
                       const std::vector<std::string>& weight_names) {
  const size_t L = weights.size();
  TORCH_CHECK_VALUE(lora.has_lora.size() == L, "ckpt_ext.", op,
                    ": has_lora must have one entry per weight (", L, "), got ",
                    lora.has_lora.size());
  const size_t terms = std::count(lora.has_lora.begin(), lora.has_lora.end(), true);
  TORCH_CHECK_VALUE(lora.A.size() == terms && lora.B.size() == terms &&
                        lora.scaling.size() == terms && lora.has_bias.size() == terms,
                    "ckpt_ext.", op, ": lora_A, lora_B, lora_scaling and has_lora_bias must "
                    "have one entry per weight whose has_lora is true (", terms, "), got ",
                    lora.A.size(), ", ", lora.B.size(), ", ", lora.scaling.size(), " and ",
                    lora.has_bias.size());
  const size_t with_bias = std::count(lora.has_bias.begin(), lora.has_bias.end(), true);
  TORCH_CHECK_VALUE(lora.biases.size() == with_bias, "ckpt_ext.", op,
                    ": lora_biases must hold one tensor per LoRA whose has_lora_bias is true (",
                    with_bias, "), got ", lora.biases.size());
  size_t j = 0, k = 0;  // indices into the per-LoRA lists and into the biases
  for (size_t i = 0; i < L; ++i) {
    if (!lora.has_lora[i]) continue;
    const at::Tensor &A = lora.A[j], &B = lora.B[j], &w = weights[i];
    const std::string& n = names[i];
    TORCH_CHECK_VALUE(A.dim() == 2 && A.sym_size(1) == w.sym_size(1), "ckpt_ext.", op, ": ", n,
                      ".A must have shape [r, ", w.sym_size(1), "] (r, in_features of ",
                      weight_names[i], "), got shape ", shape_str(A));
    TORCH_CHECK_VALUE(B.dim() == 2 && B.sym_size(0) == w.sym_size(0) &&
                          B.sym_size(1) == A.sym_size(0),
                      "ckpt_ext.", op, ": ", n, ".B must have shape [", w.sym_size(0), ", ",
                      A.sym_size(0), "] (out_features of ", weight_names[i], ", r = ", n,
                      ".A.shape[0]), got shape ", shape_str(B));
    if (lora.has_bias[j]) {
      const at::Tensor& b = lora.biases[k++];
      TORCH_CHECK_VALUE(b.dim() == 1 && b.sym_size(0) == w.sym_size(0), "ckpt_ext.", op, ": ",
                        n, ".bias must have shape [", w.sym_size(0), "] (out_features of ",
                        weight_names[i], "), got shape ", shape_str(b));
    }
    ++j;
  }
  j = k = 0;
  for (size_t i = 0; i < L; ++i) {
    if (!lora.has_lora[i]) continue;
    check_dtype_and_device(op, names[i] + ".A", lora.A[j], x);
    check_dtype_and_device(op, names[i] + ".B", lora.B[j], x);
    if (lora.has_bias[j]) check_dtype_and_device(op, names[i] + ".bias", lora.biases[k++], x);
    ++j;
  }
}

}  // namespace

void check_lora_stack_inputs(const char* op, const at::Tensor& x, at::TensorList weights,
                             const LoraArgs& lora) {
  std::vector<std::string> names, weight_names;
  for (size_t i = 0; i < weights.size(); ++i) {
    names.push_back("lora[" + std::to_string(i) + "]");
    weight_names.push_back("weights[" + std::to_string(i) + "]");
  }
  check_lora_inputs(op, x, weights, lora, names, weight_names);
}

void check_lora_gated_inputs(const char* op, const at::Tensor& x, at::TensorList weights,
                             const LoraArgs& lora) {
  const auto L = static_cast<int64_t>(weights.size());
  std::vector<std::string> names, weight_names;
  for (int64_t i = 0; i < L; ++i) {
    names.push_back("lora[" + std::to_string(i) + "] (" + gated_part(L, i) + ")");
    weight_names.push_back(gated_weight_name(L, i));
  }
  check_lora_inputs(op, x, weights, lora, names, weight_names);
}

void check_lora_masks(const char* op, const LoraArgs& lora, const LoraBackwardMasks& masks) {
  TORCH_CHECK_VALUE(masks.A.size() == lora.A.size() && masks.B.size() == lora.B.size(),
                    "ckpt_ext.", op, ": need_lora_A and need_lora_B must have one entry per LoRA (",
                    lora.A.size(), "), got ", masks.A.size(), " and ", masks.B.size());
  TORCH_CHECK_VALUE(masks.lora_biases.size() == lora.biases.size(), "ckpt_ext.", op,
                    ": need_lora_biases must have one entry per LoRA bias (", lora.biases.size(),
                    "), got ", masks.lora_biases.size());
}

void check_grad_out(const char* op, const at::Tensor& grad_out, const at::Tensor& x,
                    c10::SymInt out_features) {
  std::vector<c10::SymInt> expected(x.sym_sizes().begin(), x.sym_sizes().end() - 1);
  expected.push_back(out_features);
  TORCH_CHECK_VALUE(grad_out.sym_sizes() == c10::SymIntArrayRef(expected), "ckpt_ext.", op,
                    ": grad_out must have shape ", c10::SymIntArrayRef(expected), ", got ",
                    shape_str(grad_out));
  check_dtype_and_device(op, "grad_out", grad_out, x);
}

void check_stack_masks(const char* op, at::TensorList weights, at::TensorList biases,
                          const std::vector<bool>& need_weights,
                          const std::vector<bool>& need_biases) {
  TORCH_CHECK_VALUE(need_weights.size() == weights.size(), "ckpt_ext.", op,
                    ": need_weights must have one entry per weight (", weights.size(), "), got ",
                    need_weights.size());
  TORCH_CHECK_VALUE(need_biases.size() == biases.size(), "ckpt_ext.", op,
                    ": need_biases must have one entry per bias (", biases.size(), "), got ",
                    need_biases.size());
}

void check_moe_inputs(const char* op, const at::Tensor& x, const at::Tensor& top_k_index,
                      const at::Tensor& top_k_weights, const at::Tensor& gate_up,
                      const at::Tensor& down, const std::optional<at::Tensor>& gate_up_bias,
                      const std::optional<at::Tensor>& down_bias, MoeLayout layout,
                      std::optional<double> limit, double up_offset) {
  check_x(op, x);
  // the routing
  TORCH_CHECK_TYPE(top_k_index.scalar_type() == at::kLong || top_k_index.scalar_type() == at::kInt,
                   "ckpt_ext.", op, ": top_k_index must be int64 or int32 (expert indices), got ",
                   top_k_index.scalar_type());
  std::vector<c10::SymInt> lead(x.sym_sizes().begin(), x.sym_sizes().end() - 1);
  TORCH_CHECK_VALUE(top_k_index.dim() == x.dim() &&
                        top_k_index.sym_sizes().slice(0, lead.size()) == c10::SymIntArrayRef(lead),
                    "ckpt_ext.", op, ": top_k_index must have shape x.shape[:-1] + (top_k,) = ",
                    c10::SymIntArrayRef(lead), " + (top_k,), got shape ", shape_str(top_k_index));
  TORCH_CHECK_VALUE(top_k_weights.sym_sizes() == top_k_index.sym_sizes(), "ckpt_ext.", op,
                    ": top_k_weights must have the shape of top_k_index ",
                    shape_str(top_k_index), ", got shape ", shape_str(top_k_weights));
  TORCH_CHECK_TYPE(is_supported_dtype(top_k_weights.scalar_type()), "ckpt_ext.", op,
                   ": top_k_weights must be ", supported_dtypes_text(), ", got ",
                   top_k_weights.scalar_type());
  TORCH_CHECK_VALUE(top_k_index.device() == x.device(), "ckpt_ext.", op,
                    ": top_k_index must be on the device of x (", x.device(), "), got ",
                    top_k_index.device());
  TORCH_CHECK_VALUE(top_k_weights.device() == x.device(), "ckpt_ext.", op,
                    ": top_k_weights must be on the device of x (", x.device(), "), got ",
                    top_k_weights.device());
  // the expert weights, as the layout stores them
  const bool tr = layout.transposed;
  const char* outputs = layout.gated ? "2·intermediate" : "intermediate";
  const std::string gate_up_shape = tr ? std::string("(num_experts, hidden, ") + outputs + ")"
                                       : std::string("(num_experts, ") + outputs + ", hidden)";
  const char* down_shape =
      tr ? "(num_experts, intermediate, out)" : "(num_experts, out, intermediate)";
  TORCH_CHECK_VALUE(gate_up.dim() == 3 && gate_up.sym_size(0) >= 1, "ckpt_ext.", op,
                    ": gate_up must be 3-D ", gate_up_shape,
                    " with at least one expert for this layout, got shape ", shape_str(gate_up));
  const c10::SymInt E = gate_up.sym_size(0);
  TORCH_CHECK_VALUE(gate_up.sym_size(tr ? 1 : 2) == x.sym_size(-1), "ckpt_ext.", op,
                    ": gate_up ", gate_up_shape, " must have hidden = x.shape[-1] = ",
                    x.sym_size(-1), ", got gate_up of shape ", shape_str(gate_up));
  const c10::SymInt P = gate_up.sym_size(tr ? 2 : 1);
  if (layout.gated) {
    TORCH_CHECK_VALUE(P % 2 == 0, "ckpt_ext.", op, ": gate_up ", gate_up_shape,
                      " must have an even number of outputs (the gate's and the up "
                      "projection's), got shape ", shape_str(gate_up));
  }
  const c10::SymInt I = layout.gated ? P / 2 : P;
  TORCH_CHECK_VALUE(down.dim() == 3 && down.sym_size(0) == E && down.sym_size(tr ? 1 : 2) == I,
                    "ckpt_ext.", op, ": down must be 3-D ", down_shape, " with num_experts = ", E,
                    " and intermediate = ", I, " (from gate_up of shape ", shape_str(gate_up),
                    "), got shape ", shape_str(down));
  const c10::SymInt N = down.sym_size(tr ? 2 : 1);
  if (gate_up_bias.has_value()) {
    TORCH_CHECK_VALUE(gate_up_bias->dim() == 2 && gate_up_bias->sym_size(0) == E &&
                          gate_up_bias->sym_size(1) == P,
                      "ckpt_ext.", op, ": gate_up_bias must have shape [", E, ", ", P,
                      "] (num_experts, gate_up's outputs), got shape ", shape_str(*gate_up_bias));
  }
  if (down_bias.has_value()) {
    TORCH_CHECK_VALUE(down_bias->dim() == 2 && down_bias->sym_size(0) == E &&
                          down_bias->sym_size(1) == N,
                      "ckpt_ext.", op, ": down_bias must have shape [", E, ", ", N,
                      "] (num_experts, out), got shape ", shape_str(*down_bias));
  }
  // the gated product's form
  if (limit.has_value()) {
    TORCH_CHECK_VALUE(layout.gated, "ckpt_ext.", op, ": limit clamps the gate and up "
                      "projections, so it needs a gated layout; got limit=", *limit,
                      " with an ungated one");
    TORCH_CHECK_VALUE(*limit > 0, "ckpt_ext.", op, ": limit must be a number > 0 (or None: "
                      "no clamp), got ", *limit);
  }
  TORCH_CHECK_VALUE(up_offset == 0.0 || layout.gated, "ckpt_ext.", op, ": up_offset is added "
                    "to the up projection of a gated layout; got up_offset=", up_offset,
                    " with an ungated one");
  TORCH_CHECK_VALUE(std::isfinite(up_offset), "ckpt_ext.", op, ": up_offset must be finite, got ",
                    up_offset);
  check_x_dtype(op, x);
  check_dtype_and_device(op, "gate_up", gate_up, x);
  check_dtype_and_device(op, "down", down, x);
  if (gate_up_bias.has_value()) check_dtype_and_device(op, "gate_up_bias", *gate_up_bias, x);
  if (down_bias.has_value()) check_dtype_and_device(op, "down_bias", *down_bias, x);
}

// An argument that must match another tensor (`like`) in shape, dtype and device: a gradient
// flowing into one of the first-order backward's outputs (like x, weight or bias), or the output
// t (like grad_out).
void check_like(const char* op, const char* name, const std::optional<at::Tensor>& t,
                const at::Tensor& like, const char* like_name) {
  if (!t.has_value()) return;
  TORCH_CHECK_VALUE(t->sym_sizes() == like.sym_sizes(), "ckpt_ext.", op, ": ", name,
                    " must have the shape of ", like_name, " ", shape_str(like), ", got ",
                    shape_str(*t));
  TORCH_CHECK_TYPE(t->scalar_type() == like.scalar_type(), "ckpt_ext.", op, ": ", name,
                   " must have the dtype of ", like_name, " (", like.scalar_type(), "), got ",
                   t->scalar_type());
  TORCH_CHECK_VALUE(t->device() == like.device(), "ckpt_ext.", op, ": ", name,
                    " must be on the device of ", like_name, " (", like.device(), "), got ",
                    t->device());
}

namespace {

// grad_grad_bias (N).
void check_ggb(const char* op, const std::optional<at::Tensor>& ggb, const at::Tensor& x,
               const at::Tensor& weight) {
  if (!ggb.has_value()) return;
  TORCH_CHECK_VALUE(ggb->dim() == 1 && ggb->sym_size(0) == weight.sym_size(0), "ckpt_ext.", op,
                    ": grad_grad_bias must have shape [", weight.sym_size(0),
                    "] (out_features), got shape ", shape_str(*ggb));
  TORCH_CHECK_TYPE(ggb->scalar_type() == x.scalar_type(), "ckpt_ext.", op,
                   ": grad_grad_bias must have the dtype of x (", x.scalar_type(), "), got ",
                   ggb->scalar_type());
  TORCH_CHECK_VALUE(ggb->device() == x.device(), "ckpt_ext.", op,
                    ": grad_grad_bias must be on the device of x (", x.device(), "), got ",
                    ggb->device());
}

}  // namespace

void check_second_order_inputs(const char* op, const std::optional<at::Tensor>& ggx,
                               const std::optional<at::Tensor>& ggw,
                               const std::optional<at::Tensor>& ggb, const at::Tensor& grad_out,
                               const at::Tensor& x, const at::Tensor& weight) {
  check_linear_tanh_inputs(op, x, weight, std::nullopt);
  check_grad_out(op, grad_out, x, weight.sym_size(0));
  check_like(op, "grad_grad_x", ggx, x, "x");
  check_like(op, "grad_grad_weight", ggw, weight, "weight");
  check_ggb(op, ggb, x, weight);
}

void check_from_output_inputs(const at::Tensor& grad_out, const at::Tensor& x,
                              const at::Tensor& output, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "linear_tanh_backward_from_output";
  check_linear_tanh_inputs(op, x, weight, bias);
  check_grad_out(op, grad_out, x, weight.sym_size(0));
  check_like(op, "output", output, grad_out, "grad_out");
}

void check_from_output_backward_inputs(const std::optional<at::Tensor>& ggx,
                                       const std::optional<at::Tensor>& ggw,
                                       const std::optional<at::Tensor>& ggb,
                                       const at::Tensor& grad_out, const at::Tensor& x,
                                       const at::Tensor& output, const at::Tensor& weight) {
  constexpr const char* op = "linear_tanh_backward_from_output_backward";
  check_second_order_inputs(op, ggx, ggw, ggb, grad_out, x, weight);
  check_like(op, "output", output, grad_out, "grad_out");
}

void check_third_order_inputs(const std::optional<at::Tensor>& ggx,
                              const std::optional<at::Tensor>& ggw,
                              const std::optional<at::Tensor>& ggb, const at::Tensor& grad_out,
                              const at::Tensor& x, const at::Tensor& output,
                              const at::Tensor& weight, const std::optional<at::Tensor>& u_gy,
                              const std::optional<at::Tensor>& u_x,
                              const std::optional<at::Tensor>& u_t,
                              const std::optional<at::Tensor>& u_w) {
  constexpr const char* op = "linear_tanh_backward_from_output_double_backward";
  check_second_order_inputs(op, ggx, ggw, ggb, grad_out, x, weight);
  check_like(op, "output", output, grad_out, "grad_out");
  check_like(op, "u_grad_grad_out", u_gy, grad_out, "grad_out");
  check_like(op, "u_grad_x", u_x, x, "x");
  check_like(op, "u_grad_output", u_t, grad_out, "grad_out");
  check_like(op, "u_grad_weight", u_w, weight, "weight");
}

}  // namespace ckpt_ext
