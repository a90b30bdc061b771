// Registration functions of the vpage._core module, one per binding file.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <utility>

namespace vpage::bindings {

/// A 128-bit block hash as 16 big-endian bytes (how vLLM's KV events carry block hashes, and
/// the names of the disk tier's files).
inline pybind11::bytes hash_bytes(uint64_t hi, uint64_t lo) {
  char out[16];
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<char>(hi >> (56 - 8 * i));
    out[8 + i] = static_cast<char>(lo >> (56 - 8 * i));
  }
  return pybind11::bytes(out, sizeof(out));
}

/// (hi, lo) of a hash given as 16 big-endian bytes; ValueError for another length.
inline std::pair<uint64_t, uint64_t> hash_words(const std::string& bytes) {
  if (bytes.size() != 16) throw pybind11::value_error("a block hash is 16 bytes, got " + std::to_string(bytes.size()));
  uint64_t hi = 0, lo = 0;
  for (int i = 0; i < 8; ++i) {
    hi = hi << 8 | static_cast<uint8_t>(bytes[i]);
    lo = lo << 8 | static_cast<uint8_t>(bytes[8 + i]);
  }
  return {hi, lo};
}

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
