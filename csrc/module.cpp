// module.cpp — the Python module ckpt_ext._C. The ops themselves are registered with the
// dispatcher (TORCH_LIBRARY in schemas.cpp) and reached as torch.ops.ckpt_ext.*; this module
// only carries build facts, helpers that are not ops, and the entry points of the eager autograd
// node that ckpt_ext/_autograd.py's Autograd kernels call (autograd_node.cpp).
#include <torch/extension.h>

#include "autograd_node.h"
#include "build_info.h"
#include "checks.h"
#include "device_math.h"
#include "memory.h"
#include "moe.h"
#include "primitives.h"

namespace {

// An elementwise helper's source tensor `what`: a CPU or CUDA tensor of a dtype the ops take.
void check_source(const char* op, const char* what, const at::Tensor& p) {
  TORCH_CHECK_VALUE(ckpt_ext::is_supported_dtype(p.scalar_type()) && (p.is_cpu() || p.is_cuda()),
                    op, ": ", what, " must be a CPU or CUDA tensor of ",
                    ckpt_ext::supported_dtypes_text(), "; got ", p.scalar_type(), " on ",
                    p.device());
#ifndef CKPT_EXT_WITH_CUDA
  TORCH_CHECK(!p.is_cuda(), op, ": got a CUDA tensor, but this build of ckpt_ext has no CUDA "
              "kernels");
#endif
}

// Another tensor `what` of that helper, after check_source(p): p's shape, dtype and device.
void check_like(const char* op, const char* what, const at::Tensor& t, const at::Tensor& p) {
  TORCH_CHECK_VALUE(t.sizes() == p.sizes() && t.scalar_type() == p.scalar_type() &&
                    t.device() == p.device(), op, ": ", what, " must have p's shape ", p.sizes(),
                    ", dtype ", p.scalar_type(), " and device ", p.device(), "; got ", t.sizes(),
                    " ", t.scalar_type(), " on ", t.device());
}

// A lora op's argument checks as a Python function of its arguments (the op's lists as Python
// lists): the weights' checks, then the LoRA terms' on the lists bundled as one LoraArgs.
template <auto check_weights, auto check_lora>
auto lora_checks(const char* op) {
  return [op](const at::Tensor& x, const std::vector<at::Tensor>& weights,
              const std::vector<at::Tensor>& biases, const std::vector<bool>& has_bias,
              const std::vector<at::Tensor>& lora_A, const std::vector<at::Tensor>& lora_B,
              const std::vector<at::Tensor>& lora_biases, const std::vector<bool>& has_lora,
              const std::vector<bool>& has_lora_bias, const std::vector<double>& scaling) {
    check_weights(op, x, weights, biases, has_bias);
    check_lora(op, x, weights, {lora_A, lora_B, lora_biases, has_lora, has_lora_bias, scaling});
  };
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ckpt_ext native module: fused Linear+activation runs that recompute in backward";
  m.attr("ROWS_PER_CHUNK") = ckpt_ext::kRowsPerChunk;
  // The dtypes the ops accept, as torch names ("float32", ...): ckpt_ext.ops reads them from
  // here, so the list is written once (csrc/checks.cpp).
  pybind11::list dtypes;
  for (at::ScalarType t : ckpt_ext::supported_dtypes()) dtypes.append(c10::getDtypeNames(t).first);
  m.attr("SUPPORTED_DTYPES") = dtypes;
  pybind11::list activations;  // the mlp op's activation names, likewise written once
  for (const std::string& name : ckpt_ext::activation_names()) activations.append(name);
  m.attr("ACTIVATIONS") = activations;
  // The moe_experts op's layouts (moe.h), name -> (gated, interleaved, transposed), in order.
  pybind11::dict moe_layouts;
  for (const std::string& name : ckpt_ext::moe_layout_names()) {
    const ckpt_ext::MoeLayout l = ckpt_ext::parse_moe_layout("_C", name);
    moe_layouts[pybind11::str(name)] = pybind11::make_tuple(l.gated, l.interleaved, l.transposed);
  }
  m.attr("MOE_LAYOUTS") = moe_layouts;
  m.def("_set_poison_buffers", &ckpt_ext::set_poison_buffers,
        "Test hook: fill every buffer the ops allocate with NaN before the kernels write it.");
  m.def("_poison_buffers", &ckpt_ext::poison_buffers);
  // Benchmark hooks: one activation pass alone, the primitive the ops run on their buffers
  // (scripts/bench_activation_pass.py times it against ATen's op). dst = f(src), in place when dst
  // is src; acc (M, N) holding z becomes g = grad_out·f'(z), returning the bias sums if asked.
  m.def("_activation_", [](const at::Tensor& src, const at::Tensor& dst, const std::string& name) {
    const ckpt_ext::Activation act = ckpt_ext::parse_activation("_C._activation_", name);
    TORCH_CHECK_VALUE(src.is_contiguous() && dst.is_contiguous() && src.sizes() == dst.sizes() &&
                      src.scalar_type() == dst.scalar_type() && src.device() == dst.device() &&
                      ckpt_ext::is_supported_dtype(dst.scalar_type()),
                      "_C._activation_: src and dst must be contiguous, of one shape, dtype (",
                      ckpt_ext::supported_dtypes_text(), ") and device; got ", src.sizes(), " ",
                      src.scalar_type(), " ", src.device(), " and ", dst.sizes(), " ",
                      dst.scalar_type(), " ", dst.device());
    if (src.data_ptr() == dst.data_ptr()) {
      ckpt_ext::activation_in_place(dst, act);
    } else {
      TORCH_CHECK_VALUE(!src.is_alias_of(dst), "_C._activation_: src must be dst or apart from it");
      ckpt_ext::activation_to(src, dst, act);
    }
  }, pybind11::arg("src"), pybind11::arg("dst"), pybind11::arg("activation"));
  m.def("_activation_backward_", [](const at::Tensor& acc, const at::Tensor& grad_out,
                                    const std::string& name, bool want_bias_grad) {
    const ckpt_ext::Activation act = ckpt_ext::parse_activation("_C._activation_backward_", name);
    TORCH_CHECK_VALUE(acc.dim() == 2 && acc.is_contiguous() && grad_out.sizes() == acc.sizes() &&
                      grad_out.scalar_type() == acc.scalar_type() &&
                      grad_out.device() == acc.device() && !grad_out.is_alias_of(acc) &&
                      ckpt_ext::is_supported_dtype(acc.scalar_type()),
                      "_C._activation_backward_: acc must be 2-D contiguous of a supported dtype ",
                      "and grad_out apart from it with its shape, dtype and device; got ",
                      acc.sizes(), " ", acc.scalar_type(), " and ", grad_out.sizes(), " ",
                      grad_out.scalar_type());
    return ckpt_ext::activation_backward_(acc, grad_out, act, want_bias_grad);
  }, pybind11::arg("acc"), pybind11::arg("grad_out"), pybind11::arg("activation"),
     pybind11::arg("want_bias_grad") = false);
  // f^(order)(src) (order 0 to 3) in a new contiguous buffer, one pass of the activation's kernel:
  // the values the create_graph formulas of the higher orders multiply by, where they record no
  // graph (ckpt_ext/_mlp_higher_order.py).
  m.def("_activation_derivative", [](const at::Tensor& src, const std::string& name, int order) {
    const ckpt_ext::Activation act =
        ckpt_ext::parse_activation("_C._activation_derivative", name);
    TORCH_CHECK_VALUE(order >= 0 && order <= 3,
                      "_C._activation_derivative: order must be 0, 1, 2 or 3; got ", order);
    check_source("_C._activation_derivative", "src", src);
    const at::Tensor in = src.contiguous();
    at::Tensor out = ckpt_ext::new_buffer(in.sizes(), in.options());
    if (in.numel() > 0) ckpt_ext::activation_to(in, out, act, order);
    return out;
  }, pybind11::arg("src"), pybind11::arg("activation"), pybind11::arg("order"));
  // add + Σ f^(order)(p)·Π factors over the terms [(order, [factors])], one pass
  // (activation_terms.h): the create_graph formulas' products with the activation's derivatives,
  // where they record no graph (ckpt_ext/_mlp_higher_order.py). Written into `out` when given
  // (it may be `add`), else into a new buffer.
  m.def("_activation_terms", [](const at::Tensor& p, const std::string& name,
                                const std::vector<std::pair<int, std::vector<at::Tensor>>>& terms,
                                const std::optional<at::Tensor>& add,
                                const std::optional<at::Tensor>& out) {
    const char* op = "_C._activation_terms";
    const ckpt_ext::Activation act = ckpt_ext::parse_activation(op, name);
    check_source(op, "p", p);
    constexpr size_t kMaxTerms = ckpt_ext::ActivationTerms<float>::kMaxTerms;
    constexpr size_t kMaxFactors = ckpt_ext::ActivationTerms<float>::kMaxFactors;
    TORCH_CHECK_VALUE(!terms.empty() && terms.size() <= kMaxTerms, op, ": takes 1 to ", kMaxTerms,
                      " terms; got ", terms.size());
    std::vector<ckpt_ext::TermTensors> ts;
    for (const auto& [order, factors] : terms) {
      TORCH_CHECK_VALUE(order >= 0 && order <= 3, op, ": a term's order must be 0, 1, 2 or 3; got ",
                        order);
      TORCH_CHECK_VALUE(factors.size() <= kMaxFactors, op, ": a term takes at most ",
                        kMaxFactors, " factors; got ", factors.size());
      ckpt_ext::TermTensors t{order, {}};
      for (const at::Tensor& f : factors) {
        check_like(op, "a factor", f, p);
        t.factors.push_back(f.contiguous());
      }
      ts.push_back(std::move(t));
    }
    at::Tensor a;
    if (add.has_value()) {
      check_like(op, "add", *add, p);
      a = add->contiguous();
    }
    at::Tensor o;
    if (out.has_value()) {
      check_like(op, "out", *out, p);
      TORCH_CHECK_VALUE(out->is_contiguous(), op, ": out must be contiguous");
      o = *out;
    } else {
      o = ckpt_ext::new_buffer(p.sizes(), p.options());
    }
    const at::Tensor src = p.contiguous();
    if (o.numel() > 0) ckpt_ext::activation_terms(src, act, ts, a, o);
    return o;
  }, pybind11::arg("p"), pybind11::arg("activation"), pybind11::arg("terms"),
     pybind11::arg("add") = std::nullopt, pybind11::arg("out") = std::nullopt);
  // linear_tanh's argument check, with its messages: ckpt_ext.linear_tanh runs it where the mlp
  // op rejected a one-layer call, so that the error names linear_tanh's arguments.
  m.def("_check_linear_tanh_inputs", [](const at::Tensor& x, const at::Tensor& weight,
                                        const std::optional<at::Tensor>& bias) {
    ckpt_ext::check_linear_tanh_inputs("linear_tanh", x, weight, bias);
  }, pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias"));
  // The lora ops' argument checks, with their messages: ckpt_ext.mlp and ckpt_ext.gated_mlp run
  // them before a LoRA with dropout computes from ATen ops (the ops run them themselves).
  m.def("_check_lora_mlp_inputs", lora_checks<&ckpt_ext::check_stack_inputs,
                                              &ckpt_ext::check_lora_stack_inputs>("lora_mlp"));
  m.def("_check_lora_gated_mlp_inputs",
        lora_checks<&ckpt_ext::check_gated_inputs, &ckpt_ext::check_lora_gated_inputs>(
            "lora_gated_mlp"));
  ckpt_ext::bind_cpu_meter(m);
  ckpt_ext::bind_build_info(m);  // TORCH_BUILD_VERSION, CPU level hooks (build_info.cpp)
  ckpt_ext::bind_autograd_node(m);  // the C++ first-order autograd node (autograd_node.cpp)
#ifdef CKPT_EXT_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
}
