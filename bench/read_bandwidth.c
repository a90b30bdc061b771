/* Read bandwidth of this machine: T threads (OpenMP) each sum their share of a buffer far
 * larger than the caches with the widest vectors the compiler targets (-march=native), four
 * independent accumulators, best of R passes. Prints GB/s (1e9 bytes per second).
 *   cc -O2 -march=native -fopenmp read_bandwidth.c -o read_bandwidth && ./read_bandwidth MiB R
 * Built and run by memory_bandwidth.py. */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t lanes __attribute__((vector_size(64)));

int main(int argc, char** argv) {
  const size_t bytes = (size_t)(argc > 1 ? atol(argv[1]) : 1024) << 20;
  const int passes = argc > 2 ? atoi(argv[2]) : 5;
  char* buffer = aligned_alloc(4096, bytes);
  if (!buffer) return 1;
  memset(buffer, 1, bytes); /* touch every page before timing */
  double best = 0.0;
  int64_t check = 0;
  for (int pass = 0; pass < passes; ++pass) {
    const double start = omp_get_wtime();
#pragma omp parallel reduction(+ : check)
    {
      const size_t share = bytes / omp_get_num_threads() / 256 * 256;
      const lanes* p = (const lanes*)(buffer + share * omp_get_thread_num());
      lanes a = {0}, b = {0}, c = {0}, d = {0};
      for (size_t i = 0; i < share / sizeof(lanes); i += 4) {
        a += p[i];
        b += p[i + 1];
        c += p[i + 2];
        d += p[i + 3];
      }
      a += b + c + d;
      for (int j = 0; j < 8; ++j) check += a[j];
    }
    const double rate = bytes / (omp_get_wtime() - start) / 1e9;
    if (rate > best) best = rate;
  }
  printf("%.2f %lld\n", best, (long long)check);
  free(buffer);
  return 0;
}
