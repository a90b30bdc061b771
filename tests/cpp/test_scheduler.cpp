// Scheduler: FCFS, budgets, chunked prefill, preemption by recompute and swap, stops, abort.
#include <algorithm>
#include <memory>
#include <vector>

#include "check.h"
#include "scheduler_fixtures.h"
#include "vpage/scheduler.h"

using namespace vpage;
using namespace vpage_test;

namespace {

// Schedules one step and commits `token` for every sampling sequence.
std::shared_ptr<const SchedulePlan> step(Scheduler& s, TokenId token, CommitResult* out = nullptr) {
  auto plan = s.schedule();
  std::vector<SeqId> ids = plan->sample_seq_ids;
  std::vector<TokenId> toks(ids.size(), token);
  CommitResult r = s.commit(ids.data(), toks.data(), static_cast<int64_t>(ids.size()));
  if (out) *out = r;
  s.check_invariants();
  return plan;
}

}  // namespace

TEST_CASE("FCFS: earlier arrivals are admitted first") {
  SchedulerConfig cfg;
  cfg.max_num_seqs = 2;
  Scheduler s(cfg, pools(64, 0));
  s.add_sequence_group("late", tokens(3), 1, stop(4), 5.0);
  s.add_sequence_group("early", tokens(3), 1, stop(4), 1.0);
  s.add_sequence_group("middle", tokens(3), 1, stop(4), 3.0);
  auto plan = s.schedule();
  EXPECT(plan->num_seqs() == 2);
  EXPECT(s.find_group("early")->seqs[0].status == SequenceStatus::kRunning);
  EXPECT(s.find_group("middle")->seqs[0].status == SequenceStatus::kRunning);
  EXPECT(s.find_group("late")->seqs[0].status == SequenceStatus::kWaiting);
}

TEST_CASE("chunked prefill: the token budget holds and decodes go first") {
  SchedulerConfig cfg;
  cfg.max_num_batched_tokens = 8;
  Scheduler s(cfg, pools(64, 0));
  s.add_sequence_group("short", tokens(3), 1, stop(20), 0.0);
  s.add_sequence_group("long", tokens(30), 1, stop(20), 1.0);
  for (int steps = 0; steps < 100 && s.has_unfinished(); ++steps) {
    const auto before = s.find_group("short");
    const bool short_decoding = before && before->seqs[0].num_computed_tokens > 0;
    auto plan = step(s, 5);
    EXPECT(plan->num_tokens() <= 8);
    if (short_decoding && s.find_group("short")) {
      // The running decode gets its token in every step while the long prompt is prefilled.
      EXPECT(std::find(plan->seq_ids.begin(), plan->seq_ids.end(), 0) != plan->seq_ids.end());
    }
  }
  EXPECT(!s.has_unfinished());
  EXPECT(s.usage().free_gpu_blocks == 64);
}

TEST_CASE("chunked prefill off: a prompt is admitted whole or waits") {
  SchedulerConfig cfg;
  cfg.max_num_batched_tokens = 10;
  cfg.enable_chunked_prefill = false;
  Scheduler s(cfg, pools(64, 0));
  s.add_sequence_group("a", tokens(6), 1, stop(2), 0.0);
  s.add_sequence_group("b", tokens(6), 1, stop(2), 1.0);
  s.add_sequence_group("huge", tokens(11), 1, stop(2), 2.0);
  auto plan = step(s, 5);
  EXPECT(plan->num_tokens() == 6);
  plan = step(s, 5);
  EXPECT(plan->num_tokens() == 7);  // a's decode + b's whole prompt
  EXPECT(plan->ignored.size() == 1 && plan->ignored[0].first == "huge");
}

TEST_CASE("preemption by recompute picks the latest arrival") {
  SchedulerConfig cfg;
  cfg.preemption_mode = PreemptionMode::kRecompute;
  Scheduler s(cfg, pools(4, 0));
  s.add_sequence_group("first", tokens(4), 1, stop(8), 0.0);
  s.add_sequence_group("second", tokens(4), 1, stop(8), 1.0);
  step(s, 5);  // both prompts: 1 block each
  int preempted = 0;
  for (int i = 0; i < 30 && s.has_unfinished(); ++i) {
    auto plan = step(s, 5);
    preempted += plan->num_preempted_recompute;
    if (plan->num_preempted_recompute) {
      const auto second = s.find_group("second");
      EXPECT(second && second->num_preemptions == 1);
      EXPECT(s.find_group("first")->seqs[0].status == SequenceStatus::kRunning);
    }
  }
  EXPECT(preempted >= 1);
  EXPECT(!s.has_unfinished());
  EXPECT(s.usage().free_gpu_blocks == 4);
}

TEST_CASE("preemption by swap moves a block shared inside the group once, then swaps back") {
  Scheduler s(SchedulerConfig{}, pools(6, 8));
  s.add_sequence_group("a", tokens(7), 1, stop(12), 0.0);
  s.add_sequence_group("b", tokens(6), 2, stop(4), 1.0);
  bool swapped_out = false, swapped_in = false;
  for (int i = 0; i < 40 && s.has_unfinished(); ++i) {
    auto plan = step(s, 5);
    if (!plan->blocks_to_swap_out.empty()) {
      swapped_out = true;
      EXPECT(plan->num_preempted_swap == 1);
      EXPECT(s.num_swapped() == 1);
      const auto b = s.find_group("b");
      size_t entries = 0;
      for (const SequenceSnapshot& seq : b->seqs) entries += seq.block_table.size();
      EXPECT(entries == 4 && plan->blocks_to_swap_out.size() == 3);
    }
    if (!plan->blocks_to_swap_in.empty()) {
      swapped_in = true;
      EXPECT(plan->blocks_to_swap_in.size() == 3);
    }
  }
  EXPECT(swapped_out && swapped_in);
  EXPECT(!s.has_unfinished());
  EXPECT(s.usage().free_gpu_blocks == 6 && s.usage().free_cpu_blocks == 8);
}

TEST_CASE("swap preemption falls back to recompute when CPU space is short") {
  SchedulerConfig cfg;
  cfg.preemption_mode = PreemptionMode::kSwap;
  Scheduler s(cfg, pools(4, 0));
  s.add_sequence_group("first", tokens(4), 1, stop(8), 0.0);
  s.add_sequence_group("second", tokens(4), 1, stop(8), 1.0);
  int64_t recomputed = 0;
  for (int i = 0; i < 40 && s.has_unfinished(); ++i) recomputed += step(s, 5)->num_preempted_recompute;
  EXPECT(recomputed >= 1 && s.stats().num_preempted_swap == 0);
  EXPECT(!s.has_unfinished());
}

TEST_CASE("stop conditions: EOS after min_tokens, ignore_eos, max_tokens, max_model_len") {
  SchedulerConfig cfg;
  cfg.max_model_len = 10;
  Scheduler s(cfg, pools(64, 0));
  StopConditions eos = stop(8);
  eos.min_tokens = 2;
  s.add_sequence_group("eos", tokens(3), 1, eos, 0.0);
  StopConditions ign = stop(3);
  ign.ignore_eos = true;
  s.add_sequence_group("ignore", tokens(3), 1, ign, 1.0);
  s.add_sequence_group("len", tokens(8), 1, stop(100), 2.0);
  CommitResult r;
  step(s, 0, &r);  // EOS as the first token: min_tokens keeps "eos" going
  EXPECT(s.find_group("eos").has_value());
  step(s, 0, &r);  // second EOS: stops
  EXPECT(!s.find_group("eos"));
  EXPECT(std::find(r.finished_request_ids.begin(), r.finished_request_ids.end(), "eos") != r.finished_request_ids.end());
  EXPECT(!s.find_group("len"));  // 8 + 2 = max_model_len
  step(s, 0, &r);
  EXPECT(!s.find_group("ignore"));  // max_tokens 3, EOS ignored
  EXPECT(r.statuses.size() == 1 && r.statuses[0] == static_cast<int32_t>(SequenceStatus::kFinishedLength));
}

TEST_CASE("abort from every queue frees everything") {
  SchedulerConfig cfg;
  cfg.max_num_seqs = 3;
  Scheduler s(cfg, pools(6, 8));
  s.add_sequence_group("a", tokens(7), 1, stop(12), 0.0);
  s.add_sequence_group("b", tokens(6), 2, stop(12), 1.0);
  s.add_sequence_group("w", tokens(3), 1, stop(12), 2.0);
  for (int i = 0; i < 6 && s.num_swapped() == 0; ++i) step(s, 5);
  EXPECT(s.num_swapped() == 1 && s.num_waiting() == 1 && s.num_running() == 1);
  EXPECT(s.abort("b") && s.abort("w") && s.abort("a"));
  EXPECT(!s.abort("a"));
  s.check_invariants();
  EXPECT(s.usage().free_gpu_blocks == 6 && s.usage().free_cpu_blocks == 8);
}

TEST_CASE("a step that is never committed is planned again") {
  Scheduler s(SchedulerConfig{}, pools(16, 0));
  s.add_sequence_group("r", tokens(5), 1, stop(4), 0.0);
  auto first = s.schedule();
  const std::vector<int64_t> ids = first->input_ids;
  auto again = s.schedule();  // the forward of the first plan failed
  EXPECT(again->input_ids == ids);
  s.check_invariants();
}

TEST_CASE("max_loras: a request whose adapter has no slot waits, later ones go first") {
  SchedulerConfig cfg;
  cfg.max_loras = 2;
  Scheduler s(cfg, pools(64, 0));
  s.add_sequence_group("a1", tokens(3), 1, stop(2), 0.0, "", true, 1);
  s.add_sequence_group("b2", tokens(3), 1, stop(8), 1.0, "", true, 2);
  s.add_sequence_group("c3", tokens(3), 1, stop(8), 2.0, "", true, 3);  // a third adapter: waits
  s.add_sequence_group("d0", tokens(3), 1, stop(8), 3.0);              // the base model: never counts
  s.add_sequence_group("e1", tokens(3), 1, stop(8), 4.0, "", true, 1);  // adapter 1 runs already
  auto plan = s.schedule();
  EXPECT((plan->lora_ids == std::vector<int32_t>{1, 2, 0, 1}));
  EXPECT(s.num_running() == 4 && s.num_waiting() == 1);
  s.check_invariants();
  step(s, 5);  // commits plan's samples
  step(s, 5);  // a1 ends (max_tokens 2); adapter 1 still runs in e1
  EXPECT(!s.find_group("a1") && s.num_waiting() == 1);
  s.abort("e1");  // adapter 1 has no running request left: c3 gets its slot
  plan = s.schedule();
  EXPECT((plan->lora_ids == std::vector<int32_t>{2, 0, 3}));
  EXPECT(s.num_waiting() == 0);
  bool threw = false;
  try {
    s.add_sequence_group("bad", tokens(3), 1, stop(2), 5.0, "", true, -1);
  } catch (const CheckError&) {
    threw = true;
  }
  EXPECT(threw && !s.find_group("bad"));
}

TEST_MAIN()
