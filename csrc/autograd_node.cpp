// autograd_node.cpp — the autograd node that eager mlp records (every activation; linear_tanh and
// tanh_mlp are mlp): a C++ torch::autograd::Node that owns the incoming gradient (why, with the
// figure: docs/design.md, "Autograd (first order)").
//   _mlp_with_node(x, weights, biases, has_bias, activation, last_activation)
//       -> y (..., N_{L-1}) with an MlpBackward node as grad_fn (saves x, weights, biases as
//       SavedVariables), or None where the node cannot be used (not plain dense tensors, a Python
//       mode active): ckpt_ext/_mlp_autograd.py then applies its autograd.Function.
//   MlpBackward::apply(grad (..., N_{L-1})) -> (grad_x, grad_W_i per layer, grad_b_j per bias),
//       undefined where unused. Native path (no create_graph, no mode, plain tensors): the stack
//       engine, owning the gradient; otherwise the Python path of ckpt_ext/_autograd_node.py.
#include "autograd_node.h"

#include "checks.h"
#include "schemas.h"
#include "stack.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/python.h>
#include <torch/version.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace ckpt_ext {

namespace {

namespace py = pybind11;
using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// Set by ckpt_ext._autograd_node at import (_set_node_python_backward) and held for the process's
// life: the node's Python path, and the type of the per-node state object (types.SimpleNamespace).
PyObject* g_python_backward = nullptr;
PyObject* g_state_type = nullptr;

// ------------------------------------------------------------------------------------------------
// when the node (and its native path) may be used

// Keys of tensors whose ops must go through Python or a wrapper: tensor subclasses and
// FakeTensor (Python), functorch wrappers, functionalization, ZeroTensor (no storage).
bool is_plain(const at::Tensor& t) {
  static const c10::DispatchKeySet not_plain({
      c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
      c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::FuncTorchBatched,
      c10::DispatchKey::Functionalize, c10::DispatchKey::ZeroTensor});
  return t.layout() == at::kStrided && (t.is_cpu() || t.is_cuda()) &&
         !t.key_set().has_any(not_plain);
}

bool all_plain(const at::Tensor& x, at::TensorList weights, at::TensorList biases) {
  if (!is_plain(x)) return false;
  for (const at::Tensor& w : weights) {
    if (!is_plain(w)) return false;
  }
  for (const at::Tensor& b : biases) {
    if (!is_plain(b)) return false;
  }
  return true;
}

// A TorchDispatchMode (FlopCounterMode, FakeTensorMode, a test's op counter) or a
// TorchFunctionMode must see the ops themselves, as they did with the Python Functions.
bool python_mode_active() {
  return c10::impl::TorchDispatchModeTLS::any_modes_set() ||
         at::impl::torch_function_mode_enabled();
}

// ------------------------------------------------------------------------------------------------
// the node

// `activation` is the op's (one name, or one per activated layer, comma-separated: checks.h,
// parse_activations).
class MlpBackward final : public Node {
 public:
  MlpBackward(std::vector<bool> has_bias, std::string activation, bool last_act)
      : has_bias_(std::move(has_bias)),
        activation_(std::move(activation)),
        acts_(parse_activations(kOp, activation_, has_bias_.size(), last_act)),
        last_act_(last_act) {}

  std::string name() const override { return "MlpBackward"; }

  // One tanh layer, tanh applied: linear_tanh's form, whose create_graph path chains through the
  // layers below (ckpt_ext/_autograd.py, _recompute_chain).
  bool one_tanh_layer() const {
    return acts_.size() == 1 && acts_[0] == Activation::kTanh && last_act_;
  }

  ~MlpBackward() override {
    // The state is a Python object: let it go under the GIL (the engine may destroy the graph on
    // any thread). At interpreter shutdown it is leaked rather than touched.
    if (state_ != nullptr && Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      Py_DECREF(state_);
    }
  }

  // Not retained (retain_graph=False): the saved tensors go, as in ATen's nodes; a second
  // backward then fails in unpack() with autograd's "backward through the graph a second time".
  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    x_.reset_data();
    for (SavedVariable& w : weights_) w.reset_data();
    for (SavedVariable& b : biases_) b.reset_data();
  }

  void save(const at::Tensor& x, at::TensorList weights, at::TensorList biases) {
    x_ = SavedVariable(x, /*is_output=*/false);
    for (const at::Tensor& w : weights) weights_.emplace_back(w, /*is_output=*/false);
    for (const at::Tensor& b : biases) biases_.emplace_back(b, /*is_output=*/false);
  }

  struct Saved {
    at::Tensor x;
    std::vector<at::Tensor> weights, biases;
  };

  // The saved tensors. Throws autograd's errors: released (backward twice), or modified in place
  // since the forward ("... modified by an inplace operation").
  Saved unpack() {
    std::lock_guard<std::mutex> lock(mutex_);
    Saved s;
    s.x = x_.unpack();
    for (const SavedVariable& w : weights_) s.weights.push_back(w.unpack());
    for (const SavedVariable& b : biases_) s.biases.push_back(b.unpack());
    return s;
  }

  // The per-node Python state (a new reference), created on first use. GIL held.
  py::object state() {
    {
      std::lock_guard<std::mutex> lock(state_mutex_);
      if (state_ != nullptr) return py::reinterpret_borrow<py::object>(state_);
    }
    TORCH_CHECK(g_state_type != nullptr, "ckpt_ext: the autograd node's Python side is not "
                "registered (import ckpt_ext.ops)");
    py::object fresh = py::reinterpret_borrow<py::object>(g_state_type)();
    std::lock_guard<std::mutex> lock(state_mutex_);
    if (state_ == nullptr) state_ = fresh.inc_ref().ptr();
    return py::reinterpret_borrow<py::object>(state_);
  }

  // GIL held.
  void drop_state() {
    PyObject* s = nullptr;
    {
      std::lock_guard<std::mutex> lock(state_mutex_);
      std::swap(s, state_);
    }
    Py_XDECREF(s);
  }

 protected:
  variable_list apply(variable_list&& grads) override {
    TORCH_INTERNAL_ASSERT(grads.size() == 1);
    // Own the gradient: the engine moved its input buffer into `grads`, so after this move `grad`
    // is the only reference (unless a post hook or a profiler recording inputs keeps a copy), and
    // stack_backward can let it go after the top layer's elementwise pass.
    at::Tensor grad = std::move(grads[0]);
    Saved s = unpack();

    const size_t L = has_bias_.size(), n_b = biases_.size();
    const bool need_x = task_should_compute_output(0);
    std::vector<bool> need_w(L), need_b(n_b);
    bool any = need_x;
    for (size_t i = 0; i < L; ++i) any |= need_w[i] = task_should_compute_output(1 + i);
    for (size_t j = 0; j < n_b; ++j) any |= need_b[j] = task_should_compute_output(1 + L + j);

    variable_list out(num_outputs());
    // Nothing used, or a zero gradient (undefined, as ATen's nodes pass it): all results are
    // zero, returned undefined as ATen's nodes do.
    if (!any || !grad.defined()) return out;

    bool python = torch::autograd::GradMode::is_enabled() || python_mode_active() ||
                  !is_plain(grad) || !all_plain(s.x, s.weights, s.biases);
    if (!python) {
      std::lock_guard<std::mutex> lock(state_mutex_);
      python = state_ != nullptr;
    }
    StackGrads g = python ? python_backward(std::move(grad), s, need_x, need_w, need_b)
                          : native_backward(std::move(grad), std::move(s), need_x, need_w, need_b);
    out[0] = std::move(g.grad_x);
    for (size_t i = 0; i < L; ++i) out[1 + i] = std::move(g.grad_weights[i]);
    for (size_t j = 0; j < n_b; ++j) out[1 + L + j] = std::move(g.grad_biases[j]);
    return out;
  }

 private:
  static constexpr const char* kOp = "mlp_backward";

  StackGrads native_backward(at::Tensor grad, Saved s, bool need_x,
                             const std::vector<bool>& need_w, const std::vector<bool>& need_b) {
    const char* op = kOp;
    const c10::OptionalDeviceGuard device_guard(at::device_of(s.x));
    // Grad mode is off here (create_graph goes the Python way), so the ATen calls record
    // nothing: skip their autograd kernels, as the op's own kernel runs below autograd.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    // The op's checks, with its messages: a saved tensor can change shape behind the version
    // counter (`x.data = ...`).
    check_stack_inputs(op, s.x, s.weights, s.biases, has_bias_);
    check_grad_out(op, grad, s.x, s.weights.back().sym_size(0));

    // The profiler sees the backward op's name, as when the op ran through the dispatcher. With
    // record_shapes the inputs are read on entry; the gradient is then dropped from the record so
    // that it does not outlive the top layer's pass. (record_inputs is declared first: the record
    // refers to it until its end callbacks have run.)
    std::vector<c10::IValue> record_inputs;
    at::RecordFunction record(at::RecordScope::FUNCTION);
    if (record.isActive()) {
      const std::string qualified = std::string("ckpt_ext::") + op;
      if (record.needsInputs()) {
        record_inputs.reserve(4);
        record_inputs.emplace_back(grad);
        record_inputs.emplace_back(s.x);
        record_inputs.emplace_back(s.weights);
        record_inputs.emplace_back(s.biases);
        record.before(qualified, c10::ArrayRef<const c10::IValue>(record_inputs.data(),
                                                                record_inputs.size()));
        record_inputs[0] = c10::IValue();
      } else {
        record.before(qualified);
      }
    }
    // Without retain_graph the node lets its saved input go now rather than after apply, and
    // hands the engine the only reference it holds: the walk then frees x after the last GEMM
    // that reads it, before it allocates grad_x, as ATen's own backward frees a block's input.
    if (!torch::autograd::get_current_graph_task_keep_graph()) {
      std::lock_guard<std::mutex> lock(mutex_);
      x_.reset_data();
    }
    return stack_backward(std::move(grad), std::move(s.x), s.weights, s.biases, has_bias_,
                          last_act_, need_x, need_w, need_b, acts_);
  }

  StackGrads python_backward(at::Tensor grad, const Saved& s, bool need_x,
                             const std::vector<bool>& need_w, const std::vector<bool>& need_b) {
    py::gil_scoped_acquire gil;
    TORCH_CHECK(g_python_backward != nullptr, "ckpt_ext: the autograd node's Python side is not "
                "registered (import ckpt_ext.ops)");
    StackGrads g;
    try {
      py::object state = this->state();
      py::object grad_obj = py::cast(grad);
      grad = at::Tensor();  // from here the Python objects hold it, as a Function's would
      py::tuple r = py::reinterpret_borrow<py::object>(g_python_backward)(
          state, grad_obj, s.x, s.weights, s.biases, has_bias_,
          activation_, last_act_, need_x, need_w, need_b);
      // (grad_x, [grad_W_i or None per layer], [grad_b_j or None per bias], keep_state)
      TORCH_CHECK(r.size() == 4, "ckpt_ext: the node's Python backward returned ", r.size(),
                  " values, expected 4");
      auto tensor = [](const py::handle& h) {
        return h.is_none() ? at::Tensor() : h.cast<at::Tensor>();
      };
      g.grad_x = tensor(r[0]);
      for (const py::handle& h : r[1].cast<py::sequence>()) g.grad_weights.push_back(tensor(h));
      for (const py::handle& h : r[2].cast<py::sequence>()) g.grad_biases.push_back(tensor(h));
      TORCH_CHECK(g.grad_weights.size() == has_bias_.size() &&
                      g.grad_biases.size() == biases_.size(),
                  "ckpt_ext: the node's Python backward returned ", g.grad_weights.size(),
                  " weight and ", g.grad_biases.size(), " bias gradients, expected ",
                  has_bias_.size(), " and ", biases_.size());
      // The state is kept only while it holds something for a later pass (recomputed outputs of
      // a create_graph pass); otherwise later passes go the native way again.
      if (!r[3].cast<bool>()) drop_state();
    } catch (py::error_already_set& e) {
      // As autograd's own Python nodes do: a python_error carries the exception across the
      // engine's threads to the caller of backward().
      e.restore();
      python_error err;
      err.persist();
      throw std::move(err);
    }
    return g;
  }

  const std::vector<bool> has_bias_;  // per layer
  const std::string activation_;      // the op's argument
  const std::vector<Activation> acts_;  // one per layer
  const bool last_act_;
  SavedVariable x_;
  std::vector<SavedVariable> weights_, biases_;  // biases_: only the layers that have one
  std::mutex state_mutex_;                       // guards state_ (never held into Python)
  PyObject* state_ = nullptr;                    // owned; created by the Python path
};

// Its Python type, as ATen's nodes have (python_functions.cpp): y.grad_fn prints as
// <ckpt_ext._C.MlpBackward object ...>, and ckpt_ext/_autograd_node.py registers it as
// torch.autograd.graph.Node (a Python Function's node is one too).
PyTypeObject mlp_backward_type;

template <typename T>
void add_node_type(py::module_& m, PyTypeObject& type, const char* qualified_name,
                   const char* name) {
  torch::autograd::_initFunctionPyTypeObject(type, qualified_name, nullptr, nullptr);
  Py_INCREF(&type);
  m.add_object(name, py::handle(reinterpret_cast<PyObject*>(&type)));
  torch::autograd::registerCppFunction(typeid(T), &type);
}

// ------------------------------------------------------------------------------------------------
// torch releases: the two internals the node uses that differ between supported releases

// Ownership of autograd nodes: torch 2.13 and later derive Node from c10::intrusive_ptr_target
// and hand nodes around as c10::intrusive_ptr; earlier releases as std::shared_ptr. Detected
// from the type itself, so a release in between needs no table.
constexpr bool kIntrusiveNodes = std::is_base_of_v<c10::intrusive_ptr_target, Node>;
template <typename T>
using NodeRef = std::conditional_t<kIntrusiveNodes, c10::intrusive_ptr<T>, std::shared_ptr<T>>;

template <typename T, typename... Args>
NodeRef<T> make_node(Args&&... args) {
  if constexpr (kIntrusiveNodes) {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  } else {
    return std::make_shared<T>(std::forward<Args>(args)...);
  }
}

// torch.autograd.graph.node_creation_hook (torch 2.14 and later) sees every node once its saved
// tensors are stored; before 2.14 there is no such hook to fire.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 14)
constexpr bool kNodeCreationHooks = true;
void fire_creation_hooks(const NodeRef<Node>& node) {
  torch::autograd::fire_node_creation_hooks(node);
}
#else
constexpr bool kNodeCreationHooks = false;
void fire_creation_hooks(const NodeRef<Node>&) {}
#endif

// ------------------------------------------------------------------------------------------------
// recording the node

// y's grad_fn becomes an MlpBackward saving (x, weights, biases). Called after the forward ran,
// as a Function saves after its forward (a rejected input packs nothing).
void record_node(at::Tensor& y, NodeRef<MlpBackward> node, const at::Tensor& x,
                 at::TensorList weights, at::TensorList biases) {
  node->set_next_edges(torch::autograd::collect_next_edges(x, weights, biases));
  node->save(x, weights, biases);
  torch::autograd::set_history(y, node);
  fire_creation_hooks(node);
}

bool node_usable(const at::Tensor& x, at::TensorList weights, at::TensorList biases) {
  return torch::autograd::GradMode::is_enabled() && !python_mode_active() &&
         all_plain(x, weights, biases);
}

std::optional<at::Tensor> mlp_with_node(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                        const std::vector<at::Tensor>& biases,
                                        const std::vector<bool>& has_bias,
                                        const std::string& activation, bool last_activation) {
  if (!node_usable(x, weights, biases)) return std::nullopt;
  c10::List<bool> has_bias_list;
  for (bool b : has_bias) has_bias_list.push_back(b);
  at::Tensor y;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    y = call_mlp(x, weights, biases, has_bias_list, activation, last_activation);
  }
  record_node(y, make_node<MlpBackward>(has_bias, activation, last_activation), x, weights,
              biases);
  return y;
}

// For the create_graph path of a chain of tanh layers (_autograd._recompute_chain): when x is the
// output of a one-tanh-layer MlpBackward node whose saved tensors are still there,
// (state, (x, W, b)) of that node, the state created if need be; else None.
py::object tanh_layer_node_state(const at::Tensor& x) {
  auto fn = x.grad_fn();
  auto* node = dynamic_cast<MlpBackward*>(fn.get());
  if (node == nullptr || !node->one_tanh_layer()) return py::none();
  std::optional<MlpBackward::Saved> s;
  {
    // Unpacking may run a Python unpack hook under the node's mutex: not with the GIL held here.
    py::gil_scoped_release no_gil;
    try {
      s = node->unpack();
    } catch (const c10::Error&) {  // released, or modified in place: no chain through it
    }
  }
  if (!s) return py::none();
  py::object b = s->biases.empty() ? py::none() : py::cast(s->biases[0]);
  return py::make_tuple(node->state(), py::make_tuple(s->x, s->weights[0], b));
}

void set_node_python_backward(py::object backward, py::object state_type) {
  Py_XDECREF(g_python_backward);
  Py_XDECREF(g_state_type);
  g_python_backward = backward.inc_ref().ptr();
  g_state_type = state_type.inc_ref().ptr();
}

}  // namespace

void bind_autograd_node(pybind11::module_& m) {
  add_node_type<MlpBackward>(m, mlp_backward_type, "ckpt_ext._C.MlpBackward", "MlpBackward");
  // The forward releases the GIL: the op runs as it would through torch.ops.
  m.def("_mlp_with_node", &mlp_with_node, py::call_guard<py::gil_scoped_release>(),
        "mlp recorded with the C++ autograd node; None where it cannot be used.");
  m.def("_tanh_layer_node_state", &tanh_layer_node_state);
  // Which of the release-dependent paths above this build compiled.
  m.attr("AUTOGRAD_NODE_OWNERSHIP") = kIntrusiveNodes ? "intrusive_ptr" : "shared_ptr";
  m.attr("AUTOGRAD_NODE_CREATION_HOOKS") = kNodeCreationHooks;
  m.def("_set_node_python_backward", &set_node_python_backward,
        "Register the node's Python path: backward(state, grad_out, x, weights, "
        "biases, has_bias, activation, last_activation, need_x, need_w, need_b) -> (grad_x, "
        "grad_ws, grad_bs, keep_state), and the type of the per-node state.");
}

}  // namespace ckpt_ext
