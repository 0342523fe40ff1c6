// autograd_node.h — the eager autograd node of mlp (autograd_node.cpp).
// Declares the Python binding hook that module.cpp calls; everything else is in the .cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace ckpt_ext {

// Adds ckpt_ext._C._mlp_with_node, _tanh_layer_node_state and _set_node_python_backward to m.
void bind_autograd_node(pybind11::module_& m);

}  // namespace ckpt_ext
