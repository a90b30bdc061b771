// vpage-bench-cuda-attention: decode paged attention (v1 one pass, v2 split) against the
// device's measured copy bandwidth in the same run, plus batched swap bandwidth.
//   vpage-bench-cuda-attention [--batch 1,8,64,256] [--context 512,2048,8192,16384]
//     [--dtype f16,bf16] [--heads 32] [--kv-heads 8] [--head-size 128] [--block-size 16]
//     [--repeats 20] [--max-gb 24] [--swap-mb 1,4] [--swap-blocks 64] [--format md|json]
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "vpage/cuda/attention.h"
#include "vpage/cuda/swap.h"

namespace {

#define BENCH_CHECK(call)                                                                    \
  do {                                                                                       \
    const cudaError_t err_ = (call);                                                         \
    if (err_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

struct Options {
  std::vector<int> batches{1, 8, 64, 256};
  std::vector<int> contexts{512, 2048, 8192, 16384};
  std::vector<std::string> dtypes{"f16", "bf16"};
  std::vector<int> swap_mb{1, 4};
  int heads = 32;
  int kv_heads = 8;
  int head_size = 128;
  int block_size = 16;
  int repeats = 20;
  int swap_blocks = 64;
  double max_gb = 24.0;
  std::string format = "md";
};

std::vector<int> parse_list(const char* text) {
  std::vector<int> out;
  for (const char* p = text; *p != '\0';) {
    out.push_back(std::atoi(p));
    const char* comma = std::strchr(p, ',');
    if (comma == nullptr) break;
    p = comma + 1;
  }
  return out;
}

std::vector<std::string> parse_words(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = text.find(',', start);
    out.push_back(text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const char* value = argv[i + 1];
    if (flag == "--batch") o.batches = parse_list(value);
    else if (flag == "--context") o.contexts = parse_list(value);
    else if (flag == "--dtype") o.dtypes = parse_words(value);
    else if (flag == "--swap-mb") o.swap_mb = parse_list(value);
    else if (flag == "--heads") o.heads = std::atoi(value);
    else if (flag == "--kv-heads") o.kv_heads = std::atoi(value);
    else if (flag == "--head-size") o.head_size = std::atoi(value);
    else if (flag == "--block-size") o.block_size = std::atoi(value);
    else if (flag == "--repeats") o.repeats = std::max(1, std::atoi(value));
    else if (flag == "--swap-blocks") o.swap_blocks = std::atoi(value);
    else if (flag == "--max-gb") o.max_gb = std::atof(value);
    else if (flag == "--format") o.format = value;
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      std::exit(2);
    }
  }
  return o;
}

/// Median, 10th and 90th percentile of the samples in milliseconds.
struct Timing {
  double median_ms;
  double p10_ms;
  double p90_ms;
};

Timing summarize(std::vector<float> ms) {
  std::sort(ms.begin(), ms.end());
  const auto at = [&](double q) { return static_cast<double>(ms[static_cast<size_t>(q * (ms.size() - 1))]); };
  return {at(0.5), at(0.1), at(0.9)};
}

/// Times `fn` (which enqueues work on `stream`) `repeats` times after two warm-ups.
template <typename Fn>
Timing time_it(Fn fn, int repeats, cudaStream_t stream) {
  cudaEvent_t start, stop;
  BENCH_CHECK(cudaEventCreate(&start));
  BENCH_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 2; ++i) fn();
  std::vector<float> ms;
  for (int i = 0; i < repeats; ++i) {
    BENCH_CHECK(cudaEventRecord(start, stream));
    fn();
    BENCH_CHECK(cudaEventRecord(stop, stream));
    BENCH_CHECK(cudaEventSynchronize(stop));
    float t = 0;
    BENCH_CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  BENCH_CHECK(cudaEventDestroy(start));
  BENCH_CHECK(cudaEventDestroy(stop));
  return summarize(ms);
}

template <typename T>
__global__ void fill_kernel(T* data, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    data[i] = static_cast<T>((static_cast<float>(h & 0xffff) / 65536.0f - 0.5f));
  }
}

void fill(void* data, size_t n, vpage::DType dtype, uint32_t seed) {
  if (dtype == vpage::DType::kFloat16) fill_kernel<<<1024, 256>>>(static_cast<__half*>(data), n, seed);
  else fill_kernel<<<1024, 256>>>(static_cast<__nv_bfloat16*>(data), n, seed);
  BENCH_CHECK(cudaGetLastError());
}

struct Row {
  std::string kind;  // "attention" or "swap"
  std::string dtype;
  std::string variant;
  int batch = 0;
  int context = 0;
  Timing t{};
  double bytes = 0;
};

double measure_copy_bandwidth(int repeats, cudaStream_t stream) {
  const size_t bytes = size_t{1} << 30;
  void *a, *b;
  BENCH_CHECK(cudaMalloc(&a, bytes));
  BENCH_CHECK(cudaMalloc(&b, bytes));
  const Timing t = time_it([&] { BENCH_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream)); },
                           repeats, stream);
  BENCH_CHECK(cudaFree(a));
  BENCH_CHECK(cudaFree(b));
  return 2.0 * bytes / (t.median_ms * 1e-3);  // read + write
}

void bench_attention(const Options& o, const std::string& dtype_name, cudaStream_t stream, std::vector<Row>* rows) {
  const vpage::DType dtype = dtype_name == "bf16" ? vpage::DType::kBFloat16 : vpage::DType::kFloat16;
  std::mt19937 rng(1234);
  for (int batch : o.batches) {
    for (int context : o.contexts) {
      const int blocks_per_seq = (context + o.block_size - 1) / o.block_size;
      const int64_t num_blocks = int64_t{batch} * blocks_per_seq;
      const size_t cache_elems = size_t(num_blocks) * o.kv_heads * o.head_size * o.block_size;
      const double kv_bytes = 2.0 * batch * context * o.kv_heads * o.head_size * 2;
      if (2.0 * cache_elems * 2 > o.max_gb * 1e9) continue;
      void *key_cache, *value_cache, *query, *out;
      int32_t *block_tables, *context_lens;
      BENCH_CHECK(cudaMalloc(&key_cache, cache_elems * 2));
      BENCH_CHECK(cudaMalloc(&value_cache, cache_elems * 2));
      BENCH_CHECK(cudaMalloc(&query, size_t(batch) * o.heads * o.head_size * 2));
      BENCH_CHECK(cudaMalloc(&out, size_t(batch) * o.heads * o.head_size * 2));
      fill(key_cache, cache_elems, dtype, 1);
      fill(value_cache, cache_elems, dtype, 2);
      fill(query, size_t(batch) * o.heads * o.head_size, dtype, 3);
      std::vector<int32_t> table(static_cast<size_t>(num_blocks));
      std::iota(table.begin(), table.end(), 0);
      std::shuffle(table.begin(), table.end(), rng);  // paged: blocks scattered in the pool
      std::vector<int32_t> lens(size_t(batch), context);
      BENCH_CHECK(cudaMalloc(&block_tables, table.size() * 4));
      BENCH_CHECK(cudaMalloc(&context_lens, lens.size() * 4));
      BENCH_CHECK(cudaMemcpy(block_tables, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
      BENCH_CHECK(cudaMemcpy(context_lens, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));

      vpage::PagedAttentionArgs a;
      a.out = out;
      a.query = query;
      a.key_cache = key_cache;
      a.value_cache = value_cache;
      a.block_tables = block_tables;
      a.context_lens = context_lens;
      a.num_seqs = batch;
      a.num_query_tokens = batch;
      a.num_heads = o.heads;
      a.max_blocks_per_seq = blocks_per_seq;
      a.max_context_len = context;
      a.query_stride = int64_t{o.heads} * o.head_size;
      a.scale = 1.0f / std::sqrt(static_cast<float>(o.head_size));
      a.cache = vpage::CacheShape{num_blocks, o.kv_heads, o.head_size, o.block_size, dtype};
      const bool auto_v2 = vpage::cuda::paged_attention_workspace_bytes(a) > 0;
      for (auto version : {vpage::cuda::AttentionVersion::kV1, vpage::cuda::AttentionVersion::kV2}) {
        const size_t ws_bytes = vpage::cuda::paged_attention_workspace_bytes(a, version);
        void* ws = nullptr;
        if (ws_bytes > 0) BENCH_CHECK(cudaMalloc(&ws, ws_bytes));
        const bool is_v2 = version == vpage::cuda::AttentionVersion::kV2;
        if (vpage::cuda::paged_attention_decode(a, ws, ws_bytes, stream, version) == cudaSuccess) {
          Row r;
          r.kind = "attention";
          r.dtype = dtype_name;
          r.variant = std::string(is_v2 ? "v2" : "v1") + (is_v2 == auto_v2 ? " (auto)" : "");
          r.batch = batch;
          r.context = context;
          r.bytes = kv_bytes;
          r.t = time_it([&] { BENCH_CHECK(vpage::cuda::paged_attention_decode(a, ws, ws_bytes, stream, version)); },
                        o.repeats, stream);
          rows->push_back(r);
        }
        if (ws != nullptr) BENCH_CHECK(cudaFree(ws));
      }
      for (void* p : {key_cache, value_cache, query, out, static_cast<void*>(block_tables),
                      static_cast<void*>(context_lens)}) {
        BENCH_CHECK(cudaFree(p));
      }
    }
  }
}

void bench_swap(const Options& o, cudaStream_t stream, std::vector<Row>* rows) {
  for (int mb : o.swap_mb) {
    const int64_t block_bytes = int64_t{mb} << 20;
    const int64_t pool = 2 * int64_t{o.swap_blocks};
    void *device, *host;
    BENCH_CHECK(cudaMalloc(&device, size_t(pool * block_bytes)));
    BENCH_CHECK(cudaMallocHost(&host, size_t(pool * block_bytes)));
    std::vector<int64_t> mapping;
    for (int64_t i = 0; i < o.swap_blocks; ++i) {  // every other block: no two pairs merge
      mapping.push_back(2 * i);
      mapping.push_back(2 * i);
    }
    for (bool to_host : {true, false}) {
      vpage::SwapBlocksArgs a;
      a.src = to_host ? device : host;
      a.dst = to_host ? host : device;
      a.block_bytes = block_bytes;
      a.block_mapping = mapping.data();
      a.num_pairs = o.swap_blocks;
      Row r;
      r.kind = "swap";
      r.variant = to_host ? "D2H" : "H2D";
      r.batch = o.swap_blocks;
      r.context = mb;
      r.bytes = double(o.swap_blocks) * block_bytes;
      r.t = time_it([&] { BENCH_CHECK(vpage::cuda::swap_blocks(a, stream)); }, o.repeats, stream);
      rows->push_back(r);
    }
    BENCH_CHECK(cudaFree(device));
    BENCH_CHECK(cudaFreeHost(host));
  }
}

void print(const Options& o, const cudaDeviceProp& prop, int runtime, double copy_bw, const std::vector<Row>& rows) {
  const bool json = o.format == "json";
  if (json) {
    std::printf("{\"device\": \"%s\", \"sms\": %d, \"cuda_runtime\": %d, \"copy_gbps\": %.1f, \"heads\": %d, "
                "\"kv_heads\": %d, \"head_size\": %d, \"block_size\": %d, \"repeats\": %d, \"rows\": [\n",
                prop.name, prop.multiProcessorCount, runtime, copy_bw / 1e9, o.heads, o.kv_heads, o.head_size,
                o.block_size, o.repeats);
  } else {
    std::printf("device: %s, %d SMs, CUDA runtime %d; heads %d, kv heads %d, head size %d, block size %d, "
                "%d repeats\nmeasured copy bandwidth (D2D 1 GiB, read+write): %.1f GB/s\n\n",
                prop.name, prop.multiProcessorCount, runtime, o.heads, o.kv_heads, o.head_size, o.block_size,
                o.repeats, copy_bw / 1e9);
    std::printf("| kind | dtype | variant | batch/blocks | context/MB | KV blocks | median us | p10-p90 us | GB/s | of copy bw |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    const double gbps = r.bytes / (r.t.median_ms * 1e-3) / 1e9;
    const int64_t kv_blocks = r.kind == "attention" ? int64_t{r.batch} * ((r.context + o.block_size - 1) / o.block_size) : 0;
    if (json) {
      std::printf("  {\"kind\": \"%s\", \"dtype\": \"%s\", \"variant\": \"%s\", \"batch\": %d, \"context\": %d, "
                  "\"kv_blocks\": %lld, \"median_us\": %.2f, \"p10_us\": %.2f, \"p90_us\": %.2f, \"gbps\": %.1f, "
                  "\"fraction_of_copy\": %.3f}%s\n",
                  r.kind.c_str(), r.dtype.c_str(), r.variant.c_str(), r.batch, r.context, static_cast<long long>(kv_blocks),
                  r.t.median_ms * 1e3, r.t.p10_ms * 1e3, r.t.p90_ms * 1e3, gbps, gbps * 1e9 / copy_bw,
                  i + 1 < rows.size() ? "," : "");
    } else {
      std::printf("| %s | %s | %s | %d | %d | %lld | %.1f | %.1f-%.1f | %.1f | %.2f |\n", r.kind.c_str(),
                  r.dtype.c_str(), r.variant.c_str(), r.batch, r.context, static_cast<long long>(kv_blocks),
                  r.t.median_ms * 1e3, r.t.p10_ms * 1e3, r.t.p90_ms * 1e3, gbps, gbps * 1e9 / copy_bw);
    }
  }
  if (json) std::printf("]}\n");
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  int device = 0;
  BENCH_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  BENCH_CHECK(cudaGetDeviceProperties(&prop, device));
  int runtime = 0;
  BENCH_CHECK(cudaRuntimeGetVersion(&runtime));
  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const double copy_bw = measure_copy_bandwidth(o.repeats, stream);
  std::vector<Row> rows;
  for (const std::string& dtype : o.dtypes) bench_attention(o, dtype, stream, &rows);
  bench_swap(o, stream, &rows);
  print(o, prop, runtime, copy_bw, rows);
  BENCH_CHECK(cudaStreamDestroy(stream));
  return 0;
}
