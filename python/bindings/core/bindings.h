// Registration functions of the vpage._core module, one per binding file.
#pragma once

#include <pybind11/pybind11.h>

namespace vpage::bindings {

void bind_cpu_kernels(pybind11::module_& m);  // bind_cpu_kernels.cpp

}  // namespace vpage::bindings
