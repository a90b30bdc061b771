// vpage._core: thin pybind11 translation layer over the C++ core.
#include "bindings.h"
#include "vpage/common.h"

PYBIND11_MODULE(_core, m) {
  m.doc() = "vpage C++ core: block manager, prefix cache, scheduler and CPU kernels";
  // C++ precondition failures (vpage::CheckError) become ValueError with their message.
  pybind11::register_exception<vpage::CheckError>(m, "CheckError", PyExc_ValueError);
  vpage::bindings::bind_types(m);
  vpage::bindings::bind_scheduler(m);
  vpage::bindings::bind_cpu_kernels(m);
  vpage::bindings::bind_quant(m);
  vpage::bindings::bind_dense(m);
  vpage::bindings::bind_moe(m);
  vpage::bindings::bind_shm_allreduce(m);
  vpage::bindings::bind_decoder(m);
}
