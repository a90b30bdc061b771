// Drives the vpage scheduler (and its KV block pools) from a C++ server loop: requests arrive,
// each step is planned, a stand-in "model" picks tokens, and the step is committed.
#include <cstdio>
#include <vector>

#include <vpage/scheduler.h>

int main() {
  vpage::BlockManagerConfig blocks;
  blocks.block_size = 16;
  blocks.num_gpu_blocks = 64;  // a deliberately small KV cache: preemption will happen
  blocks.num_cpu_blocks = 64;
  vpage::SchedulerConfig config;
  config.max_num_batched_tokens = 256;
  config.max_num_seqs = 16;
  config.max_model_len = 1024;
  vpage::Scheduler scheduler(config, blocks);

  vpage::StopConditions stop;
  stop.max_tokens = 48;
  stop.eos_token_ids = {2};
  for (int r = 0; r < 12; ++r) {
    std::vector<vpage::TokenId> prompt(40 + 25 * r);
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<vpage::TokenId>(3 + (i * 31 + r) % 5000);
    const int samples = r % 3 == 0 ? 2 : 1;  // some requests ask for two samples
    scheduler.add_sequence_group("request-" + std::to_string(r), prompt, samples, stop, r);
  }

  int64_t tokens = 0;
  while (scheduler.has_unfinished()) {
    auto plan = scheduler.schedule();
    // A real server would now swap/copy blocks and run the model on plan->input_ids.
    std::vector<vpage::TokenId> next(plan->sample_seq_ids.size());
    for (size_t i = 0; i < next.size(); ++i) next[i] = static_cast<vpage::TokenId>(3 + (plan->step_id + i) % 5000);
    const vpage::CommitResult result = scheduler.commit(plan->sample_seq_ids.data(), next.data(),
                                                        static_cast<int64_t>(next.size()));
    scheduler.check_invariants();
    tokens += plan->num_tokens();
    for (const auto& id : result.finished_request_ids) std::printf("finished %s at step %lld\n", id.c_str(), static_cast<long long>(plan->step_id));
  }
  const vpage::SchedulerStats& stats = scheduler.stats();
  const vpage::BlockUsage usage = scheduler.usage();
  std::printf("steps %lld, tokens computed %lld, preempted: %lld by recompute, %lld by swap\n",
              static_cast<long long>(stats.num_steps), static_cast<long long>(tokens),
              static_cast<long long>(stats.num_preempted_recompute), static_cast<long long>(stats.num_preempted_swap));
  std::printf("free blocks at the end: %d/%d GPU, %d/%d CPU\n", usage.free_gpu_blocks, usage.num_gpu_blocks,
              usage.free_cpu_blocks, usage.num_cpu_blocks);
  return usage.free_gpu_blocks == usage.num_gpu_blocks && usage.free_cpu_blocks == usage.num_cpu_blocks ? 0 : 1;
}
