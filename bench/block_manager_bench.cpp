// vpage-bench-block-manager: costs of the block-level operations on the host.
//
//   vpage-bench-block-manager --blocks 1024,65536 --block-size 16 --context 2000 --repeats 200
//
// pool: one allocate + one decref (O(1) free queue). admit: can_allocate + allocate of a
// prompt whose full blocks are all in the prefix cache, and of one that misses. cow: fork
// 4 samples of a prompt, then the first decode step (copy-on-write of the shared block).
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_common.h"
#include "block_pool.h"  // private header (cpp/src): the pool alone
#include "vpage/scheduler.h"

namespace {

struct Options {
  std::vector<int> blocks = {1024, 65536};
  int block_size = 16;
  int context = 2000;
  int repeats = 200;
  std::string format = "md";
};

Options parse(int argc, char** argv) {
  Options o;
  vpage_bench::parse_flags(argc, argv, "[--blocks L] [--block-size N] [--context N] [--repeats N] [--format md|json]", {
      {"--blocks", [&](const std::string& v) { o.blocks = vpage_bench::int_list(v); }},
      {"--block-size", [&](const std::string& v) { o.block_size = std::stoi(v); }},
      {"--context", [&](const std::string& v) { o.context = std::stoi(v); }},
      {"--repeats", [&](const std::string& v) { o.repeats = std::stoi(v); }},
      {"--format", [&](const std::string& v) { o.format = v; }},
  });
  return o;
}

struct Row {
  std::string op;
  int blocks;
  vpage_bench::Stats us;
};

std::vector<vpage::TokenId> prompt_of(int n, int seed) {
  std::vector<vpage::TokenId> p(n);
  for (int i = 0; i < n; ++i) p[i] = 2 + (i * 7919 + seed * 104729) % 30000;
  return p;
}

vpage::StopConditions long_stop() {
  vpage::StopConditions s;
  s.max_tokens = 1 << 20;
  s.ignore_eos = true;
  return s;
}

vpage::Scheduler make(const Options& o, int blocks, int cpu_blocks) {
  vpage::BlockManagerConfig bc;
  bc.block_size = o.block_size;
  bc.num_gpu_blocks = blocks;
  bc.num_cpu_blocks = cpu_blocks;
  vpage::SchedulerConfig sc;
  sc.max_model_len = o.context * 2;
  sc.max_num_batched_tokens = o.context * 2;
  return vpage::Scheduler(sc, bc);
}

void commit_all(vpage::Scheduler& s, const vpage::SchedulePlan& plan) {
  std::vector<vpage::TokenId> t(plan.sample_seq_ids.size(), 1);
  s.commit(plan.sample_seq_ids.data(), t.data(), static_cast<int64_t>(t.size()));
}

std::vector<Row> run(const Options& o, int blocks) {
  std::vector<Row> rows;
  std::vector<double> samples;

  vpage::BlockPool pool(vpage::Device::kGpu, blocks, false);
  for (int r = 0; r < o.repeats; ++r) {
    const int n = 1000;
    const double t0 = vpage_bench::now_seconds();
    for (int i = 0; i < n; ++i) pool.decref(pool.allocate());
    samples.push_back((vpage_bench::now_seconds() - t0) * 1e6 / n);
  }
  rows.push_back({"pool allocate+free (per block)", blocks, vpage_bench::summarize(samples)});

  for (const bool hit : {true, false}) {
    samples.clear();
    vpage::Scheduler s = make(o, blocks, 0);
    const auto prompt = prompt_of(o.context, 1);
    s.add_sequence_group("warm", prompt, 1, long_stop(), 0);
    commit_all(s, *s.schedule());  // computes and caches the prompt's blocks
    s.abort("warm");
    for (int r = 0; r < o.repeats; ++r) {
      const std::string id = "r" + std::to_string(r);
      s.add_sequence_group(id, hit ? prompt : prompt_of(o.context, 2 + r), 1, long_stop(), 1 + r);
      const double t0 = vpage_bench::now_seconds();
      auto plan = s.schedule();
      samples.push_back((vpage_bench::now_seconds() - t0) * 1e6);
      s.abort(id);
    }
    rows.push_back({hit ? "admit + schedule, prefix-cache hit" : "admit + schedule, cache miss", blocks,
                    vpage_bench::summarize(samples)});
  }

  samples.clear();
  for (int r = 0; r < o.repeats / 10 + 1; ++r) {
    vpage::Scheduler s = make(o, blocks, 0);
    s.add_sequence_group("g", prompt_of(o.context - 1, 3), 4, long_stop(), 0);
    commit_all(s, *s.schedule());
    const double t0 = vpage_bench::now_seconds();
    auto plan = s.schedule();  // first decode: the shared last block is copied on write
    samples.push_back((vpage_bench::now_seconds() - t0) * 1e6);
  }
  rows.push_back({"first decode of 4 samples (CoW)", blocks, vpage_bench::summarize(samples)});
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  std::vector<Row> rows;
  for (int b : o.blocks) {
    if (b * o.block_size < o.context * 6) {
      std::fprintf(stderr, "skipping %d blocks: too few for a %d-token context\n", b, o.context);
      continue;
    }
    for (Row& r : run(o, b)) rows.push_back(r);
  }
  if (o.format == "json") {
    std::printf("{\"machine\": \"%s\", \"block_size\": %d, \"context\": %d, \"results\": [",
                vpage_bench::machine_description().c_str(), o.block_size, o.context);
    for (size_t i = 0; i < rows.size(); ++i) {
      std::printf("%s{\"op\": \"%s\", \"kv_blocks\": %d, \"median_us\": %.3f, \"p10_us\": %.3f, \"p90_us\": %.3f}",
                  i ? ", " : "", rows[i].op.c_str(), rows[i].blocks, rows[i].us.median, rows[i].us.p10, rows[i].us.p90);
    }
    std::printf("]}\n");
    return 0;
  }
  std::printf("machine: %s\nblock size %d, context %d tokens, %d repeats\n\n", vpage_bench::machine_description().c_str(),
              o.block_size, o.context, o.repeats);
  std::printf("| operation | KV blocks | median (us) | p10-p90 (us) |\n|---|---:|---:|---:|\n");
  for (const Row& r : rows) {
    std::printf("| %s | %d | %.3f | %.3f-%.3f |\n", r.op.c_str(), r.blocks, r.us.median, r.us.p10, r.us.p90);
  }
  return 0;
}
