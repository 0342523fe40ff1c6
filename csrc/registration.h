// registration.h — one row registers an op's kernels: the device-generic kernel for CPU and CUDA
// and its Meta kernel (FakeTensor, torch.compile), or its two autocast kernels, inside a
// TORCH_LIBRARY_FRAGMENT(ckpt_ext, m) block of the file that holds them (schemas in schemas.cpp).
//   register_kernels(m, "mlp", &mlp<Kernel::kCompute>, &mlp<Kernel::kMeta>);
// In a CPU-only build the CUDA key gets an error that names the problem instead of the
// dispatcher's generic "could not run with arguments from the 'CUDA' backend". An op with a CPU
// kernel only (Devices::kCpu) registers nothing for CUDA, in either build.
#pragma once

#include <torch/library.h>

namespace ckpt_ext {

// The devices an op has a computing kernel for.
enum class Devices { kCpuAndCuda, kCpu };

// Which of an op's two kernels a kernel template is instantiated as. Both run one prologue (the
// checks, the parsed arguments, the shapes read), then kCompute, the device-generic kernel (CPU
// and CUDA), computes, and kMeta, its Meta twin, returns fresh outputs of the right metadata.
enum class Kernel { kCompute, kMeta };

#ifndef CKPT_EXT_WITH_CUDA
inline void no_cuda_kernels(const c10::OperatorHandle& op, torch::jit::Stack*) {
  TORCH_CHECK(false, op.schema().name(), ": got CUDA tensors, but this build of ckpt_ext has no "
              "CUDA kernels (ckpt_ext.WITH_CUDA is False); rebuild it where nvcc and a CUDA build "
              "of torch are present (CKPT_EXT_CUDA=1 makes a missing toolkit an error)");
}
#endif

template <typename Fn, typename MetaFn>
void register_kernels(torch::Library& m, const char* name, Fn* kernel, MetaFn* meta,
                      Devices devices = Devices::kCpuAndCuda) {
  m.impl(name, torch::dispatch(c10::DispatchKey::CPU, kernel));
  if (devices == Devices::kCpuAndCuda) {
#ifdef CKPT_EXT_WITH_CUDA
    m.impl(name, torch::dispatch(c10::DispatchKey::CUDA, kernel));
#else
    m.impl(name, torch::dispatch(c10::DispatchKey::CUDA,
                                 torch::CppFunction::makeFromBoxedFunction<&no_cuda_kernels>()));
#endif
  }
  m.impl(name, torch::dispatch(c10::DispatchKey::Meta, meta));
}

// An op's autocast kernels (autocast.cpp), one per device's autocast key. AutocastCUDA is
// registered in CPU-only builds too: it is only a dispatcher key and costs nothing.
template <typename Cpu, typename Cuda>
void register_autocast(torch::Library& m, const char* name, Cpu* cpu, Cuda* cuda) {
  m.impl(name, torch::dispatch(c10::DispatchKey::AutocastCPU, cpu));
  m.impl(name, torch::dispatch(c10::DispatchKey::AutocastCUDA, cuda));
}

}  // namespace ckpt_ext
