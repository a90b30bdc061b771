// Run-time choice of the attention kernel build (cpu_isa / set_cpu_isa).
#include <atomic>
#include <stdexcept>
#include <string>

#include "attention_task.h"
#include "vpage/kernels/cpu_kernels.h"

namespace vpage::cpu {
namespace {

bool cpu_has(const std::string& isa) {
#if defined(VPAGE_X86_KERNELS)
  if (isa == "avx512vnni") return cpu_has("avx512") && __builtin_cpu_supports("avx512vnni");
  if (isa == "avx512") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }
  if (isa == "avx2") {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
#endif
  return isa == "generic";
}

const AttentionKernels* best_kernels() {
#if defined(VPAGE_X86_KERNELS)
  if (cpu_has("avx512vnni")) return &avx512vnni::kKernels;
  if (cpu_has("avx512")) return &avx512::kKernels;
  if (cpu_has("avx2")) return &avx2::kKernels;
#endif
  return &generic::kKernels;
}

std::atomic<const AttentionKernels*>& current() {
  static std::atomic<const AttentionKernels*> kernels{best_kernels()};
  return kernels;
}

}  // namespace

const AttentionKernels& selected_kernels() { return *current().load(std::memory_order_acquire); }

std::string cpu_isa() { return selected_kernels().name; }

void set_cpu_isa(const std::string& isa) {
  const AttentionKernels* kernels = nullptr;
  if (isa == "auto") {
    kernels = best_kernels();
  } else if (isa == "generic") {
    kernels = &generic::kKernels;
#if defined(VPAGE_X86_KERNELS)
  } else if (isa == "avx2" || isa == "avx512" || isa == "avx512vnni") {
    if (!cpu_has(isa)) throw std::invalid_argument("set_cpu_isa: this CPU does not support " + isa);
    kernels = isa == "avx2" ? &avx2::kKernels : isa == "avx512" ? &avx512::kKernels : &avx512vnni::kKernels;
#endif
  } else {
    throw std::invalid_argument("set_cpu_isa: unknown or unavailable instruction set '" + isa +
                                "' (expected auto, generic, avx2, avx512 or avx512vnni)");
  }
  current().store(kernels, std::memory_order_release);
}

}  // namespace vpage::cpu
