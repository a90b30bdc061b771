// Sliding window: blocks before a sequence's window are freed (-1 in its table), admission and
// growth need only the window, and prefix caching, samples, forks, swap and recompute keep
// exact reference counts.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "check.h"
#include "scheduler_fixtures.h"
#include "vpage/scheduler.h"

using namespace vpage;
using namespace vpage_test;

namespace {

BlockManagerConfig window_pools(int gpu, int cpu, int window, bool caching = false) {
  BlockManagerConfig c = pools(gpu, cpu, caching);
  c.sliding_window = window;
  return c;
}

SchedulerConfig budget(int tokens, PreemptionMode mode = PreemptionMode::kAuto) {
  SchedulerConfig c;
  c.max_num_batched_tokens = tokens;
  c.max_model_len = 4096;
  c.preemption_mode = mode;
  return c;
}

// Schedules one step, checks the plan's tables against the window and commits token
// `token + i` for the i-th sampling sequence (so samples diverge). `peak`: the most blocks in
// use, after the schedule (before commit releases any).
std::shared_ptr<const SchedulePlan> step(Scheduler& s, TokenId token, int* peak = nullptr) {
  auto plan = s.schedule();
  if (peak) *peak = std::max(*peak, used_gpu_blocks(s));
  const int32_t bs = s.block_config().block_size, window = s.block_config().sliding_window;
  for (int32_t r = 0; r < plan->num_seqs(); ++r) {
    const int64_t first_query = plan->positions[plan->query_start_loc[r]];
    const int64_t first = window ? std::max<int64_t>(0, first_query - window + 1) / bs : 0;
    const int32_t used = (plan->context_lens[r] + bs - 1) / bs;
    for (int32_t b = 0; b < used; ++b) {
      const int32_t entry = plan->block_tables[static_cast<size_t>(r) * plan->max_blocks + b];
      EXPECT_MSG(b < first ? entry == -1 : entry >= 0,
                 "row " + std::to_string(r) + " block " + std::to_string(b) + " entry " + std::to_string(entry));
    }
  }
  std::vector<SeqId> ids = plan->sample_seq_ids;
  std::vector<TokenId> toks(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) toks[i] = token + static_cast<TokenId>(i);
  s.commit(ids.data(), toks.data(), static_cast<int64_t>(ids.size()));
  s.check_invariants();
  return plan;
}

int held_blocks(const SequenceSnapshot& seq) {
  return static_cast<int>(std::count_if(seq.block_table.begin(), seq.block_table.end(), [](BlockId b) { return b >= 0; }));
}

int peak_blocks(Scheduler& s, int max_steps) {
  int peak = 0;
  for (int i = 0; i < max_steps && s.has_unfinished(); ++i) step(s, 5, &peak);
  return peak;
}

}  // namespace

TEST_CASE("window: a long chunked prompt holds its window and one chunk, not its length") {
  // Window 8, blocks of 4, chunks of 8 (bound: ceil((8 - 1 + 8) / 4) + 1 = 5 blocks). Chunk
  // k + 1 computes 8k..8k+7 and reads keys from 8k - 7: blocks 2k - 2 .. 2k + 1.
  Scheduler windowed(budget(8), window_pools(64, 0, 8));
  windowed.add_sequence_group("r", tokens(40), 1, stop(20), 0.0);
  EXPECT(peak_blocks(windowed, 100) == 4);
  EXPECT(!windowed.has_unfinished() && windowed.usage().free_gpu_blocks == 64);

  Scheduler full(budget(8), pools(64, 0));
  full.add_sequence_group("r", tokens(40), 1, stop(20), 0.0);
  EXPECT(peak_blocks(full, 100) == 15);  // (40 + 20) / 4
}

TEST_CASE("window: released entries are -1 and the table keeps its length") {
  Scheduler s(budget(8), window_pools(64, 0, 6));
  const SeqId id = s.add_sequence_group("r", tokens(21), 1, stop(8), 0.0)[0];
  for (int i = 0; i < 3; ++i) step(s, 5);  // 8 + 8 + 5 prompt tokens, then a sampled one
  const SequenceSnapshot seq = *s.find_sequence(id);
  EXPECT(seq.num_computed_tokens == 21 && seq.tokens.size() == 22);
  // The next query (position 21) reads keys 16..21: blocks 0..3 are released.
  EXPECT(seq.block_table.size() == 6);
  for (int b = 0; b < 4; ++b) EXPECT(seq.block_table[b] == -1);
  EXPECT(seq.block_table[4] >= 0 && seq.block_table[5] >= 0);
  EXPECT(used_gpu_blocks(s) == 2);
  EXPECT(s.num_kv_tokens() == 5);  // tokens 16..20 are still held
}

TEST_CASE("window: a prompt longer than the pool is admitted and runs to the end") {
  // 8 blocks of 4 tokens hold 32 tokens; the request has 60 + 10.
  Scheduler windowed(budget(4), window_pools(8, 0, 8));
  windowed.add_sequence_group("r", tokens(60), 1, stop(10), 0.0);
  EXPECT(peak_blocks(windowed, 200) <= 4);  // ceil((8 - 1 + 4) / 4) + 1
  EXPECT(!windowed.has_unfinished());

  Scheduler full(budget(4), pools(8, 0));
  full.add_sequence_group("r", tokens(60), 1, stop(10), 0.0);
  EXPECT(full.schedule()->ignored.size() == 1);
}

TEST_CASE("window: released cached blocks stay findable; a hit holds only its window") {
  Scheduler s(budget(16), window_pools(64, 0, 8, true));
  s.add_sequence_group("a", tokens(32), 1, stop(6), 0.0);
  step(s, 5);
  step(s, 5);  // "a" has computed its prompt and released blocks 0..5 (cached, free)
  const SeqId b = s.add_sequence_group("b", tokens(32), 1, stop(4), 1.0)[0];
  step(s, 5);
  const SequenceGroupSnapshot g = *s.find_group("b");
  EXPECT(g.num_cached_prompt_tokens == 28);  // 7 full blocks; the last token is computed
  const SequenceSnapshot seq = *s.find_sequence(b);
  // Computed 28 from the cache + 4: its next query (32) reads 25..32: blocks 6 and 7 held.
  EXPECT(seq.num_computed_tokens == 32);
  for (int i = 0; i < 6; ++i) EXPECT(seq.block_table[i] == -1);
  EXPECT(seq.block_table.size() == 8 && held_blocks(seq) == 2);
  while (s.has_unfinished()) step(s, 5);
  EXPECT(s.usage().free_gpu_blocks == 64 && s.usage().prefix_cache.hits == 7);
}

TEST_CASE("window: samples share their released entries; a fork shares them too") {
  Scheduler s(budget(16), window_pools(64, 0, 5));
  const std::vector<SeqId> ids = s.add_sequence_group("r", tokens(18), 2, stop(10), 0.0);
  step(s, 5);
  step(s, 5);
  const SeqId child = s.fork_sequence(ids[0]);
  const SequenceSnapshot parent = *s.find_sequence(ids[0]), forked = *s.find_sequence(child);
  EXPECT(parent.block_table == forked.block_table);
  EXPECT(parent.block_table[0] == -1 && parent.block_table[1] == -1);
  for (int i = 0; i < 30 && s.has_unfinished(); ++i) {
    step(s, 5);
    for (SeqId id : {ids[0], ids[1], child}) {
      // 5 keys and the new token's slot span at most 3 blocks of 4.
      if (const auto seq = s.find_sequence(id)) EXPECT(held_blocks(*seq) <= 3);
    }
  }
  EXPECT(!s.has_unfinished() && s.usage().free_gpu_blocks == 64);
}

TEST_CASE("window: swap moves only the held blocks and keeps the -1 entries") {
  Scheduler s(budget(16, PreemptionMode::kSwap), window_pools(7, 16, 8));
  s.add_sequence_group("a", tokens(14), 1, stop(30), 0.0);
  s.add_sequence_group("b", tokens(14), 2, stop(30), 1.0);
  bool swapped_out = false, swapped_in = false;
  for (int i = 0; i < 200 && s.has_unfinished(); ++i) {
    auto plan = step(s, 5);
    if (!plan->blocks_to_swap_out.empty()) {
      swapped_out = true;
      size_t held = 0, entries = 0;
      const auto group = s.find_group("b");  // a named copy: the loop reads into it
      for (const SequenceSnapshot& seq : group->seqs) {
        held += held_blocks(seq);
        entries += seq.block_table.size();
        EXPECT(seq.block_device == Device::kCpu);
      }
      EXPECT(held < entries && plan->blocks_to_swap_out.size() <= held);
    }
    swapped_in = swapped_in || !plan->blocks_to_swap_in.empty();
  }
  EXPECT(swapped_out && swapped_in);
  EXPECT(!s.has_unfinished());
  EXPECT(s.usage().free_gpu_blocks == 7 && s.usage().free_cpu_blocks == 16);
}

TEST_CASE("window: diverged samples recomputed wait for the shared prefix, then take its window") {
  // "b"'s two samples diverge, then "a"'s growth preempts them by recompute: re-admitted, the
  // first recomputes the shared prompt (4 tokens a step) while the other holds nothing.
  Scheduler s(budget(4, PreemptionMode::kRecompute), window_pools(8, 0, 6));
  s.add_sequence_group("a", tokens(4), 1, stop(60), 0.0);
  s.add_sequence_group("b", tokens(24, 20), 2, stop(60), 1.0);
  bool waited = false, shared = false;
  for (int i = 0; i < 400 && s.has_unfinished(); ++i) {
    step(s, 5);
    const auto group = s.find_group("b");
    if (!group || group->seqs[0].status != SequenceStatus::kRunning || group->num_preemptions == 0) continue;
    const SequenceSnapshot &first = group->seqs[0], &other = group->seqs[1];
    if (other.block_table.empty() && other.num_computed_tokens == 0 && first.num_computed_tokens < 24) waited = true;
    if (waited && other.num_computed_tokens >= 24) {
      shared = true;
      EXPECT(held_blocks(other) <= 4);  // ceil((6 - 1 + 4) / 4) + 1
    }
  }
  EXPECT(waited && shared);
  EXPECT(!s.has_unfinished() && s.usage().free_gpu_blocks == 8);
}

TEST_CASE("window: diverged samples recomputed take a cached shared prefix at once") {
  // As above, but "a" ends soon after preempting "b", whose prompt blocks stay cached.
  Scheduler s(budget(16, PreemptionMode::kRecompute), window_pools(8, 0, 16, true));
  s.add_sequence_group("a", tokens(4), 1, stop(6), 0.0);
  s.add_sequence_group("b", tokens(12, 20), 2, stop(40), 1.0);
  bool readmitted = false;
  for (int i = 0; i < 200 && s.has_unfinished(); ++i) {
    auto plan = s.schedule();
    const auto group = s.find_group("b");
    if (!readmitted && group && group->num_preemptions == 1 && group->seqs[0].status == SequenceStatus::kRunning) {
      readmitted = true;
      const SequenceSnapshot &first = group->seqs[0], &other = group->seqs[1];
      EXPECT(group->num_cached_prompt_tokens >= 12 && other.num_computed_tokens == 12);
      EXPECT(std::equal(first.block_table.begin(), first.block_table.begin() + 3, other.block_table.begin()));
    }
    std::vector<SeqId> ids = plan->sample_seq_ids;
    std::vector<TokenId> toks(ids.size());
    for (size_t k = 0; k < ids.size(); ++k) toks[k] = 5 + static_cast<TokenId>(k);
    s.commit(ids.data(), toks.data(), static_cast<int64_t>(ids.size()));
    s.check_invariants();
  }
  EXPECT(readmitted);
  EXPECT(!s.has_unfinished() && s.usage().free_gpu_blocks == 8);
}

TEST_MAIN()
