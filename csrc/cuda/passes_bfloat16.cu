// cuda/passes_bfloat16.cu — the CUDA passes of passes.cuh for c10::BFloat16: one translation unit per
// dtype, so that the build compiles the dtypes' kernels in parallel.
#include "passes.cuh"

namespace ckpt_ext {

template void activation_pass_cuda<c10::BFloat16>(const at::Tensor&, const at::Tensor&,
                                        Activation, int);
template void terms_pass_cuda<c10::BFloat16>(const at::Tensor&, const at::Tensor&, Activation,
                                     const ActivationTerms<c10::BFloat16>&);
template at::Tensor backward_pass_cuda<c10::BFloat16>(const at::Tensor&, const at::Tensor&,
                                            BackwardPass, Activation, bool);

template void gated_pass_cuda<c10::BFloat16>(const at::Tensor&, const at::Tensor&, Activation);

}  // namespace ckpt_ext
