// vpage._core: thin pybind11 translation layer over the C++ core.
#include "bindings.h"

PYBIND11_MODULE(_core, m) {
  m.doc() = "vpage C++ core: block manager, prefix cache, scheduler and CPU kernels";
  vpage::bindings::bind_cpu_kernels(m);
}
