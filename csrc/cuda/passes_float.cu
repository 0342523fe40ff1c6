// cuda/passes_float.cu — the CUDA passes of passes.cuh for float: one translation unit per
// dtype, so that the build compiles the dtypes' kernels in parallel.
#include "passes.cuh"

namespace ckpt_ext {

template void activation_pass_cuda<float>(const at::Tensor&, const at::Tensor&,
                                        Activation, int);
template void terms_pass_cuda<float>(const at::Tensor&, const at::Tensor&, Activation,
                                     const ActivationTerms<float>&);
template at::Tensor backward_pass_cuda<float>(const at::Tensor&, const at::Tensor&,
                                            BackwardPass, Activation, bool);

template void gated_pass_cuda<float>(const at::Tensor&, const at::Tensor&, Activation);

}  // namespace ckpt_ext
