// cuda/passes_half.cu — the CUDA passes of passes.cuh for c10::Half: one translation unit per
// dtype, so that the build compiles the dtypes' kernels in parallel.
#include "passes.cuh"

namespace ckpt_ext {

template void activation_pass_cuda<c10::Half>(const at::Tensor&, const at::Tensor&,
                                        Activation, int);
template void terms_pass_cuda<c10::Half>(const at::Tensor&, const at::Tensor&, Activation,
                                     const ActivationTerms<c10::Half>&);
template at::Tensor backward_pass_cuda<c10::Half>(const at::Tensor&, const at::Tensor&,
                                            BackwardPass, Activation, bool);

template void gated_pass_cuda<c10::Half>(const at::Tensor&, const at::Tensor&, Activation);

}  // namespace ckpt_ext
