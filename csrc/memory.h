// memory.h — the exact CPU memory meter: a counting wrapper around c10's CPU allocator.
// Declares the Python binding hook that module.cpp calls; everything else is in memory.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace ckpt_ext {

// Adds ckpt_ext._C.cpu_meter_* functions (install, uninstall, stats, reset_peak, timeline) to m.
void bind_cpu_meter(pybind11::module_& m);

}  // namespace ckpt_ext
