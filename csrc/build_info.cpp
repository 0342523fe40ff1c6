// build_info.cpp — what ckpt_ext._C says about its own build, and the CPU dispatch hooks.
//
// CKPT_EXT_TORCH_VERSION and CKPT_EXT_CUDA_ARCH_LIST are passed by setup.py (-D). The torch
// version also sits in the binary as a plain string (kTorchVersionMarker), so that
// ckpt_ext/_native.py can name it even when the module cannot be loaded at all (a torch of
// another major.minor usually fails with an undefined symbol before any of our code runs).
#include "build_info.h"

#include <pybind11/stl.h>

#include <stdexcept>

#include "cpu/dispatch.h"

#ifndef CKPT_EXT_TORCH_VERSION
#error "setup.py passes -DCKPT_EXT_TORCH_VERSION=\"<torch.__version__ of the build>\""
#endif
#ifndef CKPT_EXT_CUDA_ARCH_LIST
#define CKPT_EXT_CUDA_ARCH_LIST ""
#endif

namespace ckpt_ext {

// Read by ckpt_ext/_native.py from the file; `used` keeps it in the binary.
__attribute__((used)) extern const char kTorchVersionMarker[] =
    "ckpt_ext-built-with-torch=" CKPT_EXT_TORCH_VERSION;

void bind_build_info(pybind11::module_& m) {
  m.attr("TORCH_BUILD_VERSION") = CKPT_EXT_TORCH_VERSION;
  m.attr("CUDA_ARCH_LIST") = CKPT_EXT_CUDA_ARCH_LIST;
  cpu::init_level();  // a bad CKPT_EXT_CPU_CAPABILITY fails the import here, with its message
  m.def("_cpu_capability", &cpu::level,
        "The ISA level of the CPU kernels in force: default, avx2 or avx512.");
  m.def("_cpu_capabilities", &cpu::available_levels,
        "Every level this machine can run with this build, lowest first.");
  m.def("_set_cpu_capability", &cpu::set_level, pybind11::arg("level"),
        "Test hook: run the CPU kernels of another level (one of _cpu_capabilities()).");
}

}  // namespace ckpt_ext
