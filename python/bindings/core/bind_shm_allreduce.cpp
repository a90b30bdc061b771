// vpage._core._ShmAllReduce: private to vpage.distributed.shm_comm, which maps the segment and
// checks the tensors (CPU, contiguous, dtype) before it passes their data pointers.
#include <cstdint>

#include "bindings.h"
#include "vpage/shm_allreduce.h"

namespace py = pybind11;

namespace vpage::bindings {

void bind_shm_allreduce(py::module_& m) {
  py::class_<ShmAllReduce>(m, "_ShmAllReduce")
      .def(py::init([](uintptr_t segment, size_t segment_bytes, int rank, int world_size, size_t slot_bytes) {
             return new ShmAllReduce(reinterpret_cast<void*>(segment), segment_bytes, rank, world_size, slot_bytes);
           }),
           py::arg("segment"), py::arg("segment_bytes"), py::arg("rank"), py::arg("world_size"),
           py::arg("slot_bytes"))
      .def_static("segment_bytes", &ShmAllReduce::segment_bytes, py::arg("world_size"), py::arg("slot_bytes"))
      .def(
          "all_reduce",
          [](ShmAllReduce& self, uintptr_t data, int64_t numel, int32_t dtype, double timeout_s) {
            py::gil_scoped_release release;
            return self.all_reduce(reinterpret_cast<void*>(data), numel, static_cast<DType>(dtype), timeout_s) ==
                   ShmWait::kDone;
          },
          py::arg("data"), py::arg("numel"), py::arg("dtype"), py::arg("timeout_s"),
          "Sums data in place over the ranks; False when a peer had not arrived within timeout_s\n"
          "(call again with the same arguments to keep waiting).");
}

}  // namespace vpage::bindings
