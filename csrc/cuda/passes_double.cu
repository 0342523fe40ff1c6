// cuda/passes_double.cu — the CUDA passes of passes.cuh for double: one translation unit per
// dtype, so that the build compiles the dtypes' kernels in parallel.
#include "passes.cuh"

namespace ckpt_ext {

template void activation_pass_cuda<double>(const at::Tensor&, const at::Tensor&,
                                        Activation, int);
template void terms_pass_cuda<double>(const at::Tensor&, const at::Tensor&, Activation,
                                     const ActivationTerms<double>&);
template at::Tensor backward_pass_cuda<double>(const at::Tensor&, const at::Tensor&,
                                            BackwardPass, Activation, bool);

template void gated_pass_cuda<double>(const at::Tensor&, const at::Tensor&, Activation);

}  // namespace ckpt_ext
