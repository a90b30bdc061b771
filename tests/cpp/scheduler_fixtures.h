// Small builders shared by the scheduler and block-manager tests.
#pragma once

#include <vector>

#include "vpage/scheduler.h"

namespace vpage_test {

/// Token ids start, start + 1, ... (n of them).
inline std::vector<vpage::TokenId> tokens(int n, int start = 1) {
  std::vector<vpage::TokenId> t(n);
  for (int i = 0; i < n; ++i) t[i] = start + i;
  return t;
}

/// Pools of 4-token blocks, no watermark unless given.
inline vpage::BlockManagerConfig pools(int gpu, int cpu, bool caching = false, double watermark = 0.0) {
  vpage::BlockManagerConfig c;
  c.block_size = 4;
  c.num_gpu_blocks = gpu;
  c.num_cpu_blocks = cpu;
  c.watermark = watermark;
  c.enable_prefix_caching = caching;
  return c;
}

/// GPU blocks in use.
inline int used_gpu_blocks(const vpage::Scheduler& s) {
  const vpage::BlockUsage usage = s.usage();
  return usage.num_gpu_blocks - usage.free_gpu_blocks;
}

/// At most `max_tokens` new tokens; token 0 is EOS.
inline vpage::StopConditions stop(int max_tokens) {
  vpage::StopConditions s;
  s.max_tokens = max_tokens;
  s.eos_token_ids = {0};
  return s;
}

}  // namespace vpage_test
