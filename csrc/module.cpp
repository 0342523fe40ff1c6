// module.cpp — the Python module ckpt_ext._C. The ops themselves are registered with the
// dispatcher (TORCH_LIBRARY in schemas.cpp) and reached as torch.ops.ckpt_ext.*; this module
// only carries build facts, helpers that are not ops, and the entry points of the eager autograd
// node that ckpt_ext/_autograd.py's Autograd kernels call (autograd_node.cpp).
#include <torch/extension.h>

#include "autograd_node.h"
#include "build_info.h"
#include "checks.h"
#include "linear_tanh_math.h"
#include "memory.h"
#include "primitives.h"

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
  m.def("_set_poison_buffers", &ckpt_ext::set_poison_buffers,
        "Test hook: fill every buffer the ops allocate with NaN before the kernels write it.");
  m.def("_poison_buffers", &ckpt_ext::poison_buffers);
  ckpt_ext::bind_cpu_meter(m);
  ckpt_ext::bind_build_info(m);  // TORCH_BUILD_VERSION, CPU level hooks (build_info.cpp)
  ckpt_ext::bind_autograd_node(m);  // the C++ first-order autograd node (autograd_node.cpp)
#ifdef CKPT_EXT_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
}
