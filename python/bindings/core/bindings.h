// Registration functions of the vpage._core module, one per binding file.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

namespace vpage::bindings {

/// A data pointer passed from Python as an int (tensor.data_ptr()).
template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

void bind_types(pybind11::module_& m);        // bind_types.cpp
void bind_scheduler(pybind11::module_& m);    // bind_scheduler.cpp
void bind_cpu_kernels(pybind11::module_& m);  // bind_cpu_kernels.cpp
void bind_quant(pybind11::module_& m);        // bind_quant.cpp
void bind_dense(pybind11::module_& m);        // bind_dense.cpp
void bind_moe(pybind11::module_& m);          // bind_moe.cpp
void bind_shm_allreduce(pybind11::module_& m);  // bind_shm_allreduce.cpp
void bind_decoder(pybind11::module_& m);      // bind_decoder.cpp

}  // namespace vpage::bindings
