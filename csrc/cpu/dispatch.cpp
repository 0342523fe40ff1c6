// cpu/dispatch.cpp — which compiled copy of the CPU kernels (cpu/kernels.h) runs: the ISA level
// chosen at run time, the lowest of ATen's at::get_cpu_capability(), the highest copy this module
// was built with, and CKPT_EXT_CPU_CAPABILITY (default | avx2 | avx512) when set; a value outside
// those is an error raised at import. set_level() (ckpt_ext._C._set_cpu_capability) switches at
// run time; the tests use it to run every level in one process. Built portably, like everything
// outside cpu/kernels.cpp (docs/design.md, "CPU primitives").
#include "dispatch.h"

#include <ATen/Version.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "kernels.h"

namespace ckpt_ext::cpu {

namespace {

constexpr const char* kNames[] = {"default", "avx2", "avx512"};

int built_max() {
#if defined(CKPT_EXT_CPU_AVX512)
  return 2;
#elif defined(CKPT_EXT_CPU_AVX2)
  return 1;
#else
  return 0;
#endif
}

int aten_level() {
#if defined(__x86_64__) || defined(_M_X64)
  // ATen's exported form of at::native::get_cpu_capability(): "NO AVX", "AVX2" or "AVX512".
  static const std::string cap = at::get_cpu_capability();
  if (cap == "AVX512") return 2;
  if (cap == "AVX2") return 1;
  return 0;
#else
  return 0;  // other architectures: only the DEFAULT copy is built
#endif
}

std::string names_up_to(int max) {
  std::string s;
  for (int i = 0; i <= max; ++i) s += std::string(i ? ", " : "") + kNames[i];
  return s;
}

int parse(const std::string& name, const char* what) {
  for (int i = 0; i < 3; ++i) {
    if (name == kNames[i]) {
      if (i > max_level()) {
        throw std::invalid_argument(
            std::string(what) + "=" + name + " is above what this machine can run: ATen's CPU "
            "capability here is " + kNames[aten_level()] + " (ATEN_CPU_CAPABILITY lowers it) "
            "and this build of ckpt_ext has kernels up to " + kNames[built_max()] +
            "; use one of: " + names_up_to(max_level()));
      }
      return i;
    }
  }
  throw std::invalid_argument(std::string(what) + " must be one of default, avx2, avx512, got '" +
                              name + "' (allowed on this machine: " + names_up_to(max_level()) +
                              ")");
}

int initial_level() {
  const char* env = std::getenv("CKPT_EXT_CPU_CAPABILITY");
  if (env == nullptr || *env == '\0') return max_level();
  return parse(env, "CKPT_EXT_CPU_CAPABILITY");
}

std::atomic<int> g_level{-1};  // -1: not chosen yet

}  // namespace

int max_level() { return std::min(aten_level(), built_max()); }

std::vector<std::string> available_levels() {
  std::vector<std::string> out;
  for (int i = 0; i <= max_level(); ++i) out.emplace_back(kNames[i]);
  return out;
}

void init_level() {
  if (g_level.load() < 0) g_level.store(initial_level());
}

std::string level() {
  init_level();
  return kNames[g_level.load()];
}

void set_level(const std::string& name) { g_level.store(parse(name, "cpu capability")); }

const Kernels& kernels() {
  int l = g_level.load(std::memory_order_relaxed);
  if (l < 0) {
    init_level();
    l = g_level.load();
  }
  switch (l) {
#if defined(CKPT_EXT_CPU_AVX512)
    case 2:
      return AVX512::kernels();
#endif
#if defined(CKPT_EXT_CPU_AVX2)
    case 1:
      return AVX2::kernels();
#endif
    default:
      return DEFAULT::kernels();
  }
}

}  // namespace ckpt_ext::cpu
