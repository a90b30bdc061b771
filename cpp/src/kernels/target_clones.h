// VPAGE_TARGET_CLONES: compile a plain C++ loop function for AVX-512, AVX2 and baseline x86-64
// and let the loader pick the best for this CPU (GCC's target_clones); elsewhere a no-op.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VPAGE_TARGET_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VPAGE_TARGET_CLONES
#endif
