// linear_tanh.h — what the device-generic ops (linear_tanh.cpp, tanh_mlp.cpp) and the device
// kernels (cpu/linear_tanh.cpp, cuda/linear_tanh.cu) share.
//
// Shapes. One layer: x is (..., K), weight is (N, K), bias is (N) or None, out and grad_out are
// (..., N). A stack of L layers: weights[i] is (N_i, K_i) with K_0 = x.shape[-1] and
// K_i = N_{i-1}; out is (..., N_{L-1}). Inside the ops x is flattened to (M, K), M = prod of the
// leading dims, and every activation buffer is (M, N_i) contiguous.
//
// Layering (as in flash-attention's fused_dense): the ops in linear_tanh.cpp / tanh_mlp.cpp do the
// checks, the GEMMs (ATen: MKL/oneDNN on CPU, cuBLAS on CUDA) and the buffer bookkeeping once, for
// every device; the device files only provide the three elementwise/reduction primitives below.
// (The generic primitive is tanh_in_place, not tanh_: an unqualified tanh_(t) on an at::Tensor
// would find at::tanh_ by argument-dependent lookup and silently run ATen's tanh instead.)
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace ckpt_ext {

// ------------------------------------------------------------------------------------------------
// dtypes and input checks (linear_tanh.cpp). Written once: the eager ops, the Meta kernels that
// FakeTensor / torch.compile run, and the Python package (ckpt_ext._C.SUPPORTED_DTYPES) all use
// these. Sizes are read as SymInts so the Meta kernels work under dynamic shapes.

// The dtypes the ops accept, in the order the messages list them.
const std::vector<at::ScalarType>& supported_dtypes();
bool is_supported_dtype(at::ScalarType t);

// Throws ValueError (shapes, ranks, devices) or TypeError (dtypes) naming the expected and the
// given values, prefixed with "ckpt_ext.<op>: ".
void check_linear_tanh_inputs(const char* op, const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias);
// grad_out must have shape x.shape[:-1] + (out_features,), x's dtype and device.
void check_grad_out(const char* op, const at::Tensor& grad_out, const at::Tensor& x,
                    c10::SymInt out_features);
// A stack: at least one weight; weights[i] 2-D with in_features = the previous layer's
// out_features; biases[j] belongs to the j-th layer whose has_bias is true and has length N_i;
// one dtype and one device. Messages name the layer index.
void check_tanh_mlp_inputs(const char* op, const at::Tensor& x, at::TensorList weights,
                           at::TensorList biases, const std::vector<bool>& has_bias);

// ------------------------------------------------------------------------------------------------
// Calling the ops through the dispatcher from C++ (linear_tanh.cpp): the autocast kernels and the
// autograd node re-enter the library this way, so every key below theirs still runs.
at::Tensor call_linear_tanh(const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias);
at::Tensor call_tanh_mlp(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                         const c10::List<bool>& has_bias, bool last_tanh);

#ifndef CKPT_EXT_WITH_CUDA
// The CUDA kernel of every op in a CPU-only build: an error that names the problem, instead of
// the dispatcher's generic "could not run with arguments from the 'CUDA' backend".
void no_cuda_kernels(const c10::OperatorHandle& op, torch::jit::Stack* stack);
#endif

// ------------------------------------------------------------------------------------------------
// Buffers (linear_tanh.cpp)

// Test hook: when on, every buffer the ops allocate is filled with NaN before a kernel writes it,
// so an element a kernel forgets to write shows up as NaN instead of passing by luck.
void set_poison_buffers(bool on);
bool poison_buffers();
// at::empty(sizes, options), NaN-filled when poisoning is on.
at::Tensor new_buffer(at::IntArrayRef sizes, const at::TensorOptions& options);

// x (..., K) as (M, K), M = prod(x.shape[:-1]): a view where possible. Spelled out rather than
// reshape({-1, K}), which cannot infer M when K == 0 (nn.Linear allows in_features = 0).
at::Tensor flatten_rows(const at::Tensor& x);

// z = a (M, K) · weightᵀ + bias into a new (M, N) contiguous buffer, by one GEMM (addmm with the
// bias, so z is rounded to the storage type once, as in F.linear). The forward and the recompute
// in backward both use it, so the recomputed z equals the forward's to the bit.
at::Tensor pre_activation(const at::Tensor& a, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias);

// ------------------------------------------------------------------------------------------------
// The device primitives. CPU: cpu/linear_tanh.cpp; CUDA: cuda/linear_tanh.cu. The generic
// versions (no device suffix, linear_tanh.cpp) pick one by the buffer's device.
//
// The documented order of every bias-gradient sum (shared by CPU and CUDA, bitwise reproducible,
// independent of thread count): for each column, rows are summed in increasing order in chunks
// of kRowsPerChunk (linear_tanh_math.h) rows starting from zero, in the accumulate type (float
// for half types); the chunk sums are then combined pairwise, level by level: at each level the
// value at chunk position i (i a multiple of 2·w) adds the one at i + w, if any, for
// w = 1, 2, 4, ...; the result is rounded to the storage type once.

// What an activation buffer holds when the backward pass starts on it.
enum class Holds {
  kPreActivation,  // z = a·Wᵀ + b: the pass computes t = tanh(z) itself (one read of z)
  kTanhOutput,     // t = tanh(z), as the forward left it (a stack keeps t: the next layer's input)
};

// acc: (M, N) contiguous, holds z; becomes t = tanh(z) in place. Every element goes through the
// same tanh, so the backward's recompute equals the forward's to the bit.
void tanh_in_place(const at::Tensor& acc);
void tanh_cpu_(const at::Tensor& acc);
void tanh_cuda_(const at::Tensor& acc);

// acc: (M, N) contiguous, holds z or t (see Holds); becomes g = grad_out · (1 − t²) in place.
// grad_out: (M, N), any strides (out.mean() gives strides (0, 0)), acc's dtype and device.
// Returns grad_b = the column sums of g (N), in acc's dtype, summed in the documented order,
// when want_bias_grad; an undefined tensor otherwise.
at::Tensor tanh_backward_(const at::Tensor& acc, const at::Tensor& grad_out, Holds holds,
                          bool want_bias_grad);
at::Tensor tanh_backward_cpu_(const at::Tensor& acc, const at::Tensor& grad_out, Holds holds,
                              bool want_bias_grad);
at::Tensor tanh_backward_cuda_(const at::Tensor& acc, const at::Tensor& grad_out, Holds holds,
                               bool want_bias_grad);

// grad_out: (M, N), any strides. Its column sums (N) in the documented order: the bias gradient
// of a layer with no tanh after it (the last layer of a stack with last_tanh = false).
at::Tensor bias_grad(const at::Tensor& grad_out);
at::Tensor bias_grad_cpu(const at::Tensor& grad_out);
at::Tensor bias_grad_cuda(const at::Tensor& grad_out);

// ------------------------------------------------------------------------------------------------
// The stack engine (tanh_mlp.cpp): one implementation for linear_tanh (one layer, last_tanh) and
// tanh_mlp (any depth), on every device. `biases` holds only the layers' biases that exist;
// layer_bias(i) in tanh_mlp.cpp maps them back by has_bias.

// Returns the output, (..., N_{L-1}), a fresh tensor (not a view of an internal buffer).
at::Tensor stack_forward(const at::Tensor& x, at::TensorList weights, at::TensorList biases,
                         const std::vector<bool>& has_bias, bool last_tanh);

struct StackGrads {
  at::Tensor grad_x;                  // undefined when not asked for
  std::vector<at::Tensor> grad_weights;  // one per weight; undefined where not asked for
  std::vector<at::Tensor> grad_biases;   // one per entry of `biases`; undefined where not asked
};
// grad_out is taken by value, and this function drops its reference right after the top layer's
// elementwise pass (before any GEMM allocates): a caller that moves its only reference in (the
// autograd node, autograd_node.cpp) lets the incoming gradient be freed there, as plain autograd
// frees it after the top TanhBackward. The ops pass a copy: their caller's tensor lives on.
StackGrads stack_backward(at::Tensor grad_out, const at::Tensor& x, at::TensorList weights,
                          at::TensorList biases, const std::vector<bool>& has_bias, bool last_tanh,
                          bool need_x, const std::vector<bool>& need_weights,
                          const std::vector<bool>& need_biases);

}  // namespace ckpt_ext
