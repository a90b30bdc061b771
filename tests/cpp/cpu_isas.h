// The instruction set levels of the CPU kernels that this CPU runs, for tests that cover each.
#pragma once

#include <string>
#include <vector>

#include "vpage/common.h"
#include "vpage/kernels/cpu_kernels.h"

namespace vpage_test {

/// Whether set_cpu_isa accepts `isa` on this CPU; the kernels are left at "auto".
inline bool has_isa(const std::string& isa) {
  bool supported = true;
  try {
    vpage::cpu::set_cpu_isa(isa);
  } catch (const vpage::CheckError&) {
    supported = false;
  }
  vpage::cpu::set_cpu_isa("auto");
  return supported;
}

/// "generic" and every higher level this CPU runs, lowest first.
inline std::vector<std::string> supported_isas() {
  std::vector<std::string> isas = {"generic"};
  for (const char* isa : {"avx2", "avx2vnni", "avx512", "avx512vnni"}) {
    if (has_isa(isa)) isas.push_back(isa);
  }
  return isas;
}

/// Puts the kernels back on "auto" when a case ends, passed or failed.
struct AutoIsaOnExit {
  AutoIsaOnExit() = default;
  AutoIsaOnExit(const AutoIsaOnExit&) = delete;
  AutoIsaOnExit& operator=(const AutoIsaOnExit&) = delete;
  ~AutoIsaOnExit() { vpage::cpu::set_cpu_isa("auto"); }
};

}  // namespace vpage_test
