// Run-time choice of the CPU kernels' instruction set level (cpu_isa / set_cpu_isa, first
// from VPAGE_CPU_ISA): the attention build, which quant_matmul.cpp's choice follows by name.
#include <atomic>
#include <cstdlib>
#include <string>
#include <vector>

#include "attention_task.h"
#include "vpage/common.h"
#include "vpage/kernels/cpu_kernels.h"

#if defined(VPAGE_X86_KERNELS)
#include <cpuid.h>
#endif

namespace vpage::cpu {
namespace {

#if defined(VPAGE_X86_KERNELS)
bool has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
// AVX-VNNI (CPUID leaf 7 subleaf 1, EAX bit 4), read directly: not every compiler's
// __builtin_cpu_supports knows "avxvnni". The OS's AVX state support is part of has_avx2.
bool has_avx_vnni() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax & (1u << 4)) != 0;
}
#endif

struct Level {
  const char* name;
  const AttentionKernels* kernels;
  bool (*supported)();
};

// Best first. A VNNI level is its base level plus VNNI's vpdpbusd in the quantized matmul.
const std::vector<Level>& levels() {
  static const std::vector<Level> all = {
#if defined(VPAGE_X86_KERNELS)
      {"avx512vnni", &avx512vnni::kKernels,
       [] { return has_avx512() && __builtin_cpu_supports("avx512vnni"); }},
      {"avx512", &avx512::kKernels, [] { return has_avx512(); }},
#if defined(VPAGE_AVX2VNNI_KERNELS)
      {"avx2vnni", &avx2vnni::kKernels, [] { return has_avx2() && has_avx_vnni(); }},
#endif
      {"avx2", &avx2::kKernels, [] { return has_avx2(); }},
#endif
      {"generic", &generic::kKernels, [] { return true; }},
  };
  return all;
}

const AttentionKernels* best_kernels() {
  for (const Level& level : levels()) {
    if (level.supported()) return level.kernels;
  }
  return &generic::kKernels;
}

// The level named by `isa` ("auto" = the best this CPU has); throws on an unknown or
// unsupported name.
const AttentionKernels* kernels_named(const std::string& isa, const char* who) {
  if (isa == "auto") return best_kernels();
  std::string names = "auto";
  for (const Level& level : levels()) {
    names += std::string(", ") + level.name;
    if (isa != level.name) continue;
    VPAGE_CHECK(level.supported(), who << ": this CPU does not support " << isa);
    return level.kernels;
  }
  VPAGE_CHECK(false, who << ": unknown instruction set '" << isa << "' (expected " << names << ")");
  return nullptr;
}

// The first use reads VPAGE_CPU_ISA (like oneDNN's ONEDNN_MAX_CPU_ISA); a bad value throws
// from that first use, and the next use tries again.
std::atomic<const AttentionKernels*>& current() {
  static std::atomic<const AttentionKernels*> kernels{[] {
    const char* isa = std::getenv("VPAGE_CPU_ISA");
    return isa != nullptr && *isa != '\0' ? kernels_named(isa, "VPAGE_CPU_ISA") : best_kernels();
  }()};
  return kernels;
}

}  // namespace

const AttentionKernels& selected_kernels() { return *current().load(std::memory_order_acquire); }

std::string cpu_isa() { return selected_kernels().name; }

void set_cpu_isa(const std::string& isa) {
  current().store(kernels_named(isa, "set_cpu_isa"), std::memory_order_release);
}

}  // namespace vpage::cpu
