// linear_tanh.h — host-side declarations shared by the CPU (linear_tanh.cpp) and CUDA
// (cuda/linear_tanh.cu) implementations of the fused Linear+Tanh ops.
//
// Shapes: x is (..., K), weight is (N, K), bias is (N) or None, out and grad_out are (..., N).
// The input checks live here so that both backends reject bad input with the same message,
// before any kernel runs.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <tuple>

namespace ckpt_ext {

// Throws (ValueError for shapes, ranks and devices; TypeError for dtypes) naming the expected and
// the given values. `op` is the op name used as the message prefix.
void check_linear_tanh_inputs(const char* op, const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias);
void check_linear_tanh_grad_out(const char* op, const at::Tensor& grad_out, const at::Tensor& x,
                                const at::Tensor& weight);

// Test hook: when on, every buffer the ops allocate is filled with NaN before a kernel writes it,
// so an element a kernel forgets to write shows up as NaN instead of passing by luck.
void set_poison_buffers(bool on);
bool poison_buffers();
// at::empty(sizes, options), NaN-filled when poisoning is on.
at::Tensor new_buffer(at::IntArrayRef sizes, const at::TensorOptions& options);

// z = x2 (M, K) · weightᵀ + bias into a new (M, N) contiguous buffer, by one GEMM (addmm with the
// bias, so z is rounded to the storage type once). Forward and the recompute in backward both use
// it, so the recomputed z equals the forward's to the bit. Dispatches to the tensors' device.
at::Tensor pre_activation(const at::Tensor& x2, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias);

// What the CPU and CUDA backward share around their elementwise kernels. Call
// check_linear_tanh_inputs and check_linear_tanh_grad_out first (and, on CUDA, set the device).
struct BackwardState {
  at::Tensor x2;  // (M, K): x flattened
  at::Tensor gy;  // (M, N): grad_out, a view where possible (out.mean() gives strides (0, 0))
  at::Tensor g;   // (M, N) contiguous: z = x·Wᵀ + b recomputed, to become g in place
  int64_t M, N, num_chunks;
  bool need_bias;  // output_mask[2] and there is a bias
};
// The flattened views and the recompute GEMM into the backward's one (M, N) buffer.
BackwardState recompute_for_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                     const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias,
                                     std::array<bool, 3> output_mask);
// grad_x = g·W (shaped like x) and grad_W = gᵀ·x, each only where output_mask asks; grad_b as given.
std::tuple<at::Tensor, at::Tensor, at::Tensor> grad_gemms(const BackwardState& s,
                                                          const at::Tensor& x,
                                                          const at::Tensor& weight,
                                                          at::Tensor grad_b,
                                                          std::array<bool, 3> output_mask);

// x (..., K) as (M, K), M = prod(x.shape[:-1]): a view where possible. Spelled out rather than
// reshape({-1, K}), which cannot infer M when K == 0 (nn.Linear allows in_features = 0).
at::Tensor flatten_rows(const at::Tensor& x);

// x.shape[:-1] + (N,)
std::vector<int64_t> linear_tanh_out_shape(const at::Tensor& x, const at::Tensor& weight);

at::Tensor linear_tanh_cpu(const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias);
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_tanh_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, std::array<bool, 3> output_mask);

// Defined in cuda/linear_tanh.cu, compiled only into CUDA builds (CKPT_EXT_WITH_CUDA).
at::Tensor linear_tanh_cuda(const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias);
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_tanh_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, std::array<bool, 3> output_mask);

}  // namespace ckpt_ext
