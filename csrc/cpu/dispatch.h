// cpu/dispatch.h — the CPU kernels' ISA level, chosen at run time (cpu/dispatch.cpp); the table of
// kernels itself is reached through cpu/kernels.h.
#pragma once

#include <string>
#include <vector>

namespace ckpt_ext::cpu {

// Levels are "default" < "avx2" < "avx512".
// The highest level this process may run: ATen's (honouring ATEN_CPU_CAPABILITY), capped by the
// copies of the kernels this module was built with.
int max_level();
// Names of every level up to max_level(), lowest first.
std::vector<std::string> available_levels();
// Reads CKPT_EXT_CPU_CAPABILITY once (throws std::invalid_argument on a bad value) and sets the
// level; later calls do nothing. Called when ckpt_ext._C is imported.
void init_level();
// The level in force.
std::string level();
// Test hook: switch level; std::invalid_argument naming the allowed values on a bad one.
void set_level(const std::string& name);

}  // namespace ckpt_ext::cpu
