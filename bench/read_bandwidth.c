/* Read bandwidth of this machine: T threads (OpenMP) each sum their share of a buffer far
 * larger than the caches, read as kStreams sequential streams side by side (the share's
 * quarters, one 64-byte line of each per step, each line into its own accumulators), best of R
 * passes, each pass once as plain loads and once with a software prefetch kPrefetch lines ahead
 * in every stream (as the decode kernels do). Prints GB/s (1e9 bytes per second). One stream per
 * thread reads less on some CPUs (2-vCPU Zen 1: ~15-19 GB/s against ~20-21 with four), and the
 * prefetch read more in runs on another (2-vCPU Zen 3: 27-31 GB/s against 21-26 without, minutes
 * apart on a VM whose bandwidth drifts), so the limit is the best of these.
 *   cc -O2 -march=native -fopenmp read_bandwidth.c -o read_bandwidth && ./read_bandwidth MiB R
 * Built and run by memory_bandwidth.py. */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int32_t lanes __attribute__((vector_size(32)));
enum { kStreams = 4, kLine = 64, kPrefetch = 8 };

int main(int argc, char** argv) {
  const size_t bytes = (size_t)(argc > 1 ? atol(argv[1]) : 1024) << 20;
  const int passes = argc > 2 ? atoi(argv[2]) : 5;
  char* buffer = aligned_alloc(4096, bytes);
  if (!buffer) return 1;
  memset(buffer, 1, bytes); /* touch every page before timing */
  double best = 0.0;
  int64_t check = 0;
  for (int pass = 0; pass < 2 * passes; ++pass) {
    const int prefetch = pass % 2;
    const double start = omp_get_wtime();
#pragma omp parallel reduction(+ : check)
    {
      const size_t share = bytes / omp_get_num_threads();
      const size_t per_stream = share / kStreams / kLine * kLine;
      const char* base = buffer + share * omp_get_thread_num();
      lanes acc[2 * kStreams];
      memset(acc, 0, sizeof(acc));
      for (size_t offset = 0; offset < per_stream; offset += kLine) {
        for (int s = 0; s < kStreams; ++s) {
          const char* line_start = base + s * per_stream + offset;
          if (prefetch) __builtin_prefetch(line_start + kPrefetch * kLine, 0, 0);
          const lanes* line = (const lanes*)line_start;
          acc[2 * s] += line[0];
          acc[2 * s + 1] += line[1];
        }
      }
      for (int s = 1; s < 2 * kStreams; ++s) acc[0] += acc[s];
      for (int j = 0; j < 8; ++j) check += acc[0][j];
    }
    const double rate = bytes / (omp_get_wtime() - start) / 1e9;
    if (rate > best) best = rate;
  }
  printf("%.2f %lld\n", best, (long long)check);
  free(buffer);
  return 0;
}
