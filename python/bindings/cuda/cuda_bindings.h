// Shared helpers and registration functions of the vpage._cuda module. Device pointers and
// streams arrive from Python as ints (tensor.data_ptr(), stream.cuda_stream).
#pragma once

#include <cuda_runtime_api.h>
#include <pybind11/pybind11.h>

#include <cstdint>

#include "vpage/kernels/kernel_args.h"

namespace vpage::cuda_bindings {

/// Throws RuntimeError("<what>: <cudaGetErrorString>") when `err` is not cudaSuccess.
void check(cudaError_t err, const char* what);

/// Validated dtype code: 0 float32, 1 float16, 2 bfloat16 (ValueError otherwise).
DType to_dtype(int code);

/// A Python int holding a device pointer or stream handle, as a typed pointer.
template <typename T>
T as_ptr(std::uintptr_t address) {
  return reinterpret_cast<T>(address);
}

void bind_device(pybind11::module_& m);     // module.cpp
void bind_attention(pybind11::module_& m);  // bind_attention.cpp
void bind_cache_ops(pybind11::module_& m);  // bind_cache_ops.cpp
void bind_token_bitmask(pybind11::module_& m);  // bind_token_bitmask.cpp
void bind_moe(pybind11::module_& m);            // bind_moe.cpp
void bind_layer_ops(pybind11::module_& m);      // bind_layer_ops.cpp
void bind_lora(pybind11::module_& m);           // bind_lora.cpp

}  // namespace vpage::cuda_bindings
