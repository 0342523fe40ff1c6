// higher_order.h — what the kernels of the orders above the first share (higher_order.cpp,
// cpu/third_order.cpp). Shapes: x, ggx (M, K) rows; weight, ggW (N, K); ggb (N); results (M, N).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace ckpt_ext {

// dg = ggx·Wᵀ + x·ggWᵀ + ggb (M, N) in a new buffer, the bias term in the GEMM where there is one;
// at least one of the three is given: the gradient reaching g = grad_out·(1 − t²).
at::Tensor grad_of_g(const std::optional<at::Tensor>& ggx, const std::optional<at::Tensor>& ggw,
                     const std::optional<at::Tensor>& ggb, const at::Tensor& x,
                     const at::Tensor& weight);

// t (..., C) as (M, C) rows; t in float32; float16 or bfloat16. None stays None.
std::optional<at::Tensor> rows_of(const std::optional<at::Tensor>& t);
std::optional<at::Tensor> to_float(const std::optional<at::Tensor>& t);
bool is_half(at::ScalarType t);

}  // namespace ckpt_ext
