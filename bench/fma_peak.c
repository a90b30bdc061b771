/* Float32 multiply-add peak of this machine: T threads (OpenMP) each run 12 independent chains
 * of fused multiply-adds on the widest vectors the compiler targets (-march=native: 8 lanes
 * on AVX2, 16 on AVX-512), best of R passes. Prints GFLOP/s (2 per lane per FMA), all threads.
 * On a CPU with AVX512-BF16 it then measures the same for bfloat16 dot products (vdpbf16ps:
 * two products per float32 lane, 4 FLOPs per lane) and prints that GFLOP/s too, else 0.
 *   cc -O3 -march=native -fopenmp fma_peak.c -o fma_peak && ./fma_peak R
 * Built and run by fma_peak.py. */
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
typedef float lanes __attribute__((vector_size(LANES * 4)));
enum { CHAINS = 12, STEPS = 50000000 };

#if defined(__AVX512BF16__)
/* Best GFLOP/s of `passes` runs of CHAINS vdpbf16ps chains per thread. */
static double bf16_dot_peak(int passes, float* sink_out) {
  double best = 0.0;
  float sink = 0.0f;
  for (int pass = 0; pass < passes; ++pass) {
    const double start = omp_get_wtime();
#pragma omp parallel reduction(+ : sink)
    {
      __m512 c[CHAINS];
      const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.5f), _mm512_set1_ps(0.25f));
      const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.001f), _mm512_set1_ps(0.002f));
      for (int i = 0; i < CHAINS; ++i) c[i] = _mm512_set1_ps((float)i);
      for (long s = 0; s < STEPS; ++s) {
        for (int i = 0; i < CHAINS; ++i) c[i] = _mm512_dpbf16_ps(c[i], a, b);
      }
      for (int i = 0; i < CHAINS; ++i) sink += _mm512_reduce_add_ps(c[i]);
    }
    const double seconds = omp_get_wtime() - start;
    const double flops = 4.0 * 16 * CHAINS * (double)STEPS * omp_get_max_threads();
    if (flops / seconds > best) best = flops / seconds;
  }
  *sink_out += sink;
  return best;
}
#endif

int main(int argc, char** argv) {
  const int passes = argc > 1 ? atoi(argv[1]) : 3;
  double best = 0.0, bf16_best = 0.0;
  float sink = 0.0f;
  for (int pass = 0; pass < passes; ++pass) {
    const double start = omp_get_wtime();
#pragma omp parallel reduction(+ : sink)
    {
      lanes c[CHAINS];
      const lanes zero = {0}, a = zero + 0.999f, b = zero + 0.001f;
      for (int i = 0; i < CHAINS; ++i) c[i] = zero + (float)i;
      for (long s = 0; s < STEPS; ++s) {
        for (int i = 0; i < CHAINS; ++i) c[i] = c[i] * a + b; /* contracted to an FMA */
      }
      for (int i = 0; i < CHAINS; ++i) sink += c[i][0];
    }
    const double seconds = omp_get_wtime() - start;
    const double flops = 2.0 * LANES * CHAINS * (double)STEPS * omp_get_max_threads();
    if (flops / seconds > best) best = flops / seconds;
  }
#if defined(__AVX512BF16__)
  bf16_best = bf16_dot_peak(passes, &sink);
#endif
  printf("%.1f %d %.3g %.1f\n", best / 1e9, LANES, sink, bf16_best / 1e9);
  return 0;
}
