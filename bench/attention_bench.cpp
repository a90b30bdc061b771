// vpage-bench-attention: CPU paged decode attention sweep (vpage::cpu::paged_attention).
//
//   vpage-bench-attention --batch 1,32,64 --context 512,2048 --heads 9:3,32:8 --head-size 64
//                         --block-size 16 --dtype f32,bf16 --repeats 20 --threads 2 --format md
//
// For each case: median, p10 and p90 of the wall time, KV bytes read per second and its
// fraction of the machine's copy bandwidth (memcpy of a --copy-mib MiB buffer, read + write
// bytes, measured in the same run; --copy-mib 0 skips it, e.g. under a profiler). Block
// tables are shuffled (physical blocks not in order), or with --tables ordered each
// sequence's blocks follow each other, as the engine's allocator mostly leaves a batch's
// sequences (the hardware prefetchers then help). --layers N gives every case N caches
// and times one call per cache in turn, as a decode step calls one per layer: with enough
// layers the K/V come from DRAM, as in the engine, instead of from the L3 one cache can stay
// in (times and rates are per call).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.h"
#include "vpage/kernels/cpu_kernels.h"

namespace {

struct Options {
  std::vector<int> batch = {1, 32, 64};
  std::vector<int> context = {512, 2048};
  std::vector<std::pair<int, int>> heads = {{9, 3}};
  std::vector<int> head_size = {64};
  std::vector<int> block_size = {16};
  std::vector<std::string> dtype = {"f32", "bf16"};
  int repeats = 20;
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::string format = "md";
  std::string isa = "auto";
  int copy_mib = 512;
  int layers = 1;
  bool shuffled = true;  // --tables shuffled|ordered
};

using vpage_bench::int_list;
using vpage_bench::split_list;

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || i + 1 >= argc) {
      std::printf("usage: %s [--batch L] [--context L] [--heads Q:KV,...] [--head-size L] [--block-size L]\n"
                  "          [--dtype f32,f16,bf16] [--repeats N] [--threads N] [--format md|json]\n"
                  "          [--isa auto|avx512|avx2|generic] [--copy-mib N (0: skip)] [--layers N]\n"
                  "          [--tables shuffled|ordered]\n", argv[0]);
      std::exit(flag == "--help" ? 0 : 2);
    }
    const std::string value = argv[++i];
    if (flag == "--batch") o.batch = int_list(value);
    else if (flag == "--context") o.context = int_list(value);
    else if (flag == "--head-size") o.head_size = int_list(value);
    else if (flag == "--block-size") o.block_size = int_list(value);
    else if (flag == "--dtype") o.dtype = split_list(value);
    else if (flag == "--repeats") o.repeats = std::stoi(value);
    else if (flag == "--threads") o.threads = std::stoi(value);
    else if (flag == "--format") o.format = value;
    else if (flag == "--isa") o.isa = value;
    else if (flag == "--copy-mib") o.copy_mib = std::stoi(value);
    else if (flag == "--layers") o.layers = std::max(1, std::stoi(value));
    else if (flag == "--tables") {
      if (value != "shuffled" && value != "ordered") throw std::invalid_argument("--tables wants shuffled or ordered");
      o.shuffled = value == "shuffled";
    } else if (flag == "--heads") {
      o.heads.clear();
      for (const std::string& pair : split_list(value)) {
        const size_t colon = pair.find(':');
        if (colon == std::string::npos) throw std::invalid_argument("--heads wants Q:KV pairs, got " + pair);
        o.heads.emplace_back(std::stoi(pair.substr(0, colon)), std::stoi(pair.substr(colon + 1)));
      }
    } else {
      throw std::invalid_argument("unknown flag " + flag);
    }
  }
  return o;
}

vpage::DType parse_dtype(const std::string& name) {
  if (name == "f32") return vpage::DType::kFloat32;
  if (name == "f16") return vpage::DType::kFloat16;
  if (name == "bf16") return vpage::DType::kBFloat16;
  throw std::invalid_argument("unknown dtype " + name + " (f32, f16, bf16)");
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    o = parse(argc, argv);
    vpage::cpu::set_cpu_isa(o.isa);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  const double bandwidth =
      o.copy_mib > 0 ? vpage_bench::copy_bandwidth(static_cast<size_t>(o.copy_mib) << 20, std::max(3, o.repeats / 4))
                     : NAN;
  const std::string machine = vpage_bench::machine_description();
  const bool json = o.format == "json";
  if (json) {
    std::printf("{\"machine\": \"%s\", \"isa\": \"%s\", \"threads\": %d, \"copy_bandwidth_gbs\": %.2f, "
                "\"cases\": [",
                machine.c_str(), vpage::cpu::cpu_isa().c_str(), o.threads, o.copy_mib > 0 ? bandwidth / 1e9 : 0.0);
  } else {
    std::printf("machine: %s\nisa %s, threads %d, copy bandwidth %.1f GB/s (memcpy %d MiB, read + write)\n\n",
                machine.c_str(), vpage::cpu::cpu_isa().c_str(), o.threads, bandwidth / 1e9, o.copy_mib);
    std::printf("| dtype | batch | context | heads | head size | block size | KV blocks | median ms | p10 ms | p90 ms "
                "| KV read GB/s | of copy bw |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  }
  std::mt19937 rng(0);
  bool first = true;
  for (const std::string& dtype_name : o.dtype) {
    const vpage::DType dtype = parse_dtype(dtype_name);
    const int elem = vpage::dtype_size(dtype);
    for (const auto& [heads, kv_heads] : o.heads) {
      for (int hs : o.head_size) {
        for (int bs : o.block_size) {
          for (int batch : o.batch) {
            for (int context : o.context) {
              const int blocks_per_seq = (context + bs - 1) / bs;
              const int64_t num_blocks = static_cast<int64_t>(batch) * blocks_per_seq;
              const size_t cache_bytes = static_cast<size_t>(num_blocks) * kv_heads * hs * bs * elem;
              // One K and one V cache per layer, every element 0x3c00 (1.0 in f16, 0.0078 in bf16,
              // a small float32 value).
              std::vector<std::vector<uint8_t>> key_caches, value_caches;
              for (int layer = 0; layer < o.layers; ++layer) {
                key_caches.emplace_back(cache_bytes);
                value_caches.emplace_back(cache_bytes);
                for (size_t i = 0; i < cache_bytes; i += 2) key_caches.back()[i + 1] = value_caches.back()[i + 1] = 0x3c;
              }
              std::vector<int32_t> tables(num_blocks);
              std::iota(tables.begin(), tables.end(), 0);
              if (o.shuffled) std::shuffle(tables.begin(), tables.end(), rng);
              std::vector<int32_t> lens(batch, context);
              std::vector<uint8_t> query(static_cast<size_t>(batch) * heads * hs * elem, 0);
              std::vector<uint8_t> out(query.size());
              vpage::PagedAttentionArgs a;
              a.out = out.data();
              a.query = query.data();
              a.block_tables = tables.data();
              a.context_lens = lens.data();
              a.num_seqs = batch;
              a.num_query_tokens = batch;
              a.num_heads = heads;
              a.max_blocks_per_seq = blocks_per_seq;
              a.max_context_len = context;
              a.query_stride = static_cast<int64_t>(heads) * hs;
              a.scale = 1.0f / std::sqrt(static_cast<float>(hs));
              a.dtype = dtype;  // query and out in the cache's dtype (their buffers are sized so)
              a.cache = {num_blocks, kv_heads, hs, bs, dtype};
              std::vector<double> samples = vpage_bench::time_calls(o.repeats, [&] {
                for (int layer = 0; layer < o.layers; ++layer) {
                  a.key_cache = key_caches[layer].data();
                  a.value_cache = value_caches[layer].data();
                  vpage::cpu::paged_attention(a, o.threads);
                }
              });
              for (double& t : samples) t /= o.layers;
              const vpage_bench::Stats s = vpage_bench::summarize(samples);
              const double kv_bytes = 2.0 * batch * kv_heads * static_cast<double>(context) * hs * elem;
              const double rate = kv_bytes / s.median;
              if (json) {
                std::printf("%s\n  {\"dtype\": \"%s\", \"batch\": %d, \"context\": %d, \"heads\": %d, \"kv_heads\": %d, "
                            "\"head_size\": %d, \"block_size\": %d, \"kv_blocks\": %lld, \"median_ms\": %.4f, "
                            "\"p10_ms\": %.4f, \"p90_ms\": %.4f, \"kv_read_gbs\": %.3f, \"fraction_of_copy_bw\": %s}",
                            first ? "" : ",", dtype_name.c_str(), batch, context, heads, kv_heads, hs, bs,
                            static_cast<long long>(num_blocks), s.median * 1e3, s.p10 * 1e3, s.p90 * 1e3, rate / 1e9,
                            o.copy_mib > 0 ? std::to_string(rate / bandwidth).c_str() : "null");
              } else {
                std::printf("| %s | %d | %d | %d:%d | %d | %d | %lld | %.3f | %.3f | %.3f | %.1f | %.0f%% |\n",
                            dtype_name.c_str(), batch, context, heads, kv_heads, hs, bs,
                            static_cast<long long>(num_blocks), s.median * 1e3, s.p10 * 1e3, s.p90 * 1e3, rate / 1e9,
                            100.0 * rate / bandwidth);
              }
              std::fflush(stdout);
              first = false;
            }
          }
        }
      }
    }
  }
  if (json) std::printf("\n]}\n");
  return 0;
}
