// build_info.h — facts of this build and the CPU dispatch hooks, added to ckpt_ext._C by
// module.cpp (implemented in build_info.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace ckpt_ext {

// Adds to m: TORCH_BUILD_VERSION (torch.__version__ of the build), CUDA_ARCH_LIST (the
// TORCH_CUDA_ARCH_LIST of a CUDA build, "" otherwise), and the CPU level hooks
// _cpu_capability(), _cpu_capabilities(), _set_cpu_capability(name). Reads
// CKPT_EXT_CPU_CAPABILITY, so a bad value fails the import (ImportError with the message).
void bind_build_info(pybind11::module_& m);

}  // namespace ckpt_ext
