// vpage-bench-scheduler: cost of one scheduler step (schedule() + commit()) on the host.
//
//   vpage-bench-scheduler --seqs 64,256,1024 --block-size 16 --context 500:2000
//                         --steps 200 --repeats 5 --format md|json
//
// "decode": N running sequences, each decoding one token per step (contexts drawn uniformly
// from the range, prefix caching on). "mixed": the same decodes plus a 1500-token prompt
// always being prefilled in chunks under a budget of N + 512 tokens.
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "bench_common.h"
#include "vpage/scheduler.h"

namespace {

struct Options {
  std::vector<int> seqs = {64, 256, 1024};
  int block_size = 16;
  int min_context = 500, max_context = 2000;
  int steps = 200;
  int repeats = 5;
  std::string format = "md";
};

Options parse(int argc, char** argv) {
  Options o;
  vpage_bench::parse_flags(argc, argv, "[--seqs L] [--block-size N] [--context MIN:MAX] [--steps N] [--repeats N] [--format md|json]", {
      {"--seqs", [&](const std::string& v) { o.seqs = vpage_bench::int_list(v); }},
      {"--block-size", [&](const std::string& v) { o.block_size = std::stoi(v); }},
      {"--context", [&](const std::string& v) {
         o.min_context = std::stoi(v.substr(0, v.find(':')));
         o.max_context = std::stoi(v.substr(v.find(':') + 1));
       }},
      {"--steps", [&](const std::string& v) { o.steps = std::stoi(v); }},
      {"--repeats", [&](const std::string& v) { o.repeats = std::stoi(v); }},
      {"--format", [&](const std::string& v) { o.format = v; }},
  });
  return o;
}

struct Result {
  std::string mode;
  int seqs = 0;
  int32_t num_blocks = 0;
  double tokens_per_step = 0;
  std::vector<double> step_us;  // one sample per step
};

// Commits token 1 for every sampling sequence of `plan`.
void commit_all(vpage::Scheduler& s, const vpage::SchedulePlan& plan, std::vector<vpage::TokenId>& tokens) {
  tokens.assign(plan.sample_seq_ids.size(), 1);
  s.commit(plan.sample_seq_ids.data(), tokens.data(), static_cast<int64_t>(tokens.size()));
}

Result run(const Options& o, const std::string& mode, int num_seqs, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> context(o.min_context, o.max_context);
  std::uniform_int_distribution<int> token(2, 30000);
  const int prompt_len = 1500;
  const int32_t blocks_per_seq = (o.max_context + o.steps * 2 + o.block_size - 1) / o.block_size + 1;
  vpage::BlockManagerConfig bc;
  bc.block_size = o.block_size;
  bc.num_gpu_blocks = blocks_per_seq * (num_seqs + 8);
  bc.num_cpu_blocks = 0;
  bc.enable_prefix_caching = true;
  vpage::SchedulerConfig sc;
  sc.max_num_seqs = num_seqs + 8;
  sc.max_model_len = o.max_context + o.steps * 4 + prompt_len;
  sc.max_num_batched_tokens = mode == "mixed" ? num_seqs + 512 : 1 << 20;
  vpage::Scheduler s(sc, bc);
  vpage::StopConditions stop;
  stop.max_tokens = 1 << 20;
  stop.ignore_eos = true;
  for (int i = 0; i < num_seqs; ++i) {
    std::vector<vpage::TokenId> prompt(context(rng));
    for (auto& t : prompt) t = token(rng);
    s.add_sequence_group("d" + std::to_string(i), prompt, 1, stop, i);
  }
  std::vector<vpage::TokenId> tokens;
  while (s.num_waiting() > 0 || s.stats().num_steps == 0) commit_all(s, *s.schedule(), tokens);
  // Every sequence is now decoding. Finish all prefills (the last chunk may still be pending).
  for (int i = 0; i < 4; ++i) commit_all(s, *s.schedule(), tokens);

  int next_prompt = 0;
  double total_tokens = 0;
  std::vector<double> samples;
  for (int step = 0; step < o.steps; ++step) {
    if (mode == "mixed" && s.num_waiting() == 0 && s.num_running() <= num_seqs) {
      std::vector<vpage::TokenId> prompt(prompt_len);
      for (auto& t : prompt) t = token(rng);
      vpage::StopConditions one = stop;
      one.max_tokens = 1;
      s.add_sequence_group("p" + std::to_string(next_prompt++), prompt, 1, one, 1e9 + step);
    }
    const double t0 = vpage_bench::now_seconds();
    auto plan = s.schedule();
    commit_all(s, *plan, tokens);
    const double t1 = vpage_bench::now_seconds();
    samples.push_back((t1 - t0) * 1e6);
    total_tokens += plan->num_tokens();
  }
  Result r;
  r.mode = mode;
  r.seqs = num_seqs;
  r.num_blocks = bc.num_gpu_blocks;
  r.tokens_per_step = total_tokens / o.steps;
  r.step_us = std::move(samples);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  std::vector<Result> results;
  std::vector<vpage_bench::Stats> stats;
  for (const char* mode : {"decode", "mixed"}) {
    for (int n : o.seqs) {
      // Repeats are independent runs (other random contexts); statistics over all their steps.
      Result merged = run(o, mode, n, 1234u);
      for (int r = 1; r < o.repeats; ++r) {
        const Result one = run(o, mode, n, 1234u + r);
        merged.step_us.insert(merged.step_us.end(), one.step_us.begin(), one.step_us.end());
      }
      stats.push_back(vpage_bench::summarize(merged.step_us));
      results.push_back(std::move(merged));
    }
  }
  if (o.format == "json") {
    std::printf("{\"machine\": \"%s\", \"block_size\": %d, \"context\": [%d, %d], \"steps\": %d, \"repeats\": %d, \"results\": [",
                vpage_bench::machine_description().c_str(), o.block_size, o.min_context, o.max_context, o.steps, o.repeats);
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      const vpage_bench::Stats& t = stats[i];
      std::printf("%s{\"mode\": \"%s\", \"seqs\": %d, \"kv_blocks\": %d, \"tokens_per_step\": %.1f, \"median_us\": %.2f, \"p10_us\": %.2f, \"p90_us\": %.2f}",
                  i ? ", " : "", r.mode.c_str(), r.seqs, r.num_blocks, r.tokens_per_step, t.median, t.p10, t.p90);
    }
    std::printf("]}\n");
    return 0;
  }
  std::printf("machine: %s\nblock size %d, contexts %d-%d tokens, prefix caching on, %d steps x %d runs\n\n",
              vpage_bench::machine_description().c_str(), o.block_size, o.min_context, o.max_context, o.steps, o.repeats);
  std::printf("| step | running seqs | KV blocks | tokens/step | schedule+commit median (us) | p10-p90 (us) |\n");
  std::printf("|---|---:|---:|---:|---:|---:|\n");
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    std::printf("| %s | %d | %d | %.0f | %.1f | %.1f-%.1f |\n", r.mode.c_str(), r.seqs, r.num_blocks, r.tokens_per_step,
                stats[i].median, stats[i].p10, stats[i].p90);
  }
  return 0;
}
