// Speculative decoding in the scheduler: n-gram drafts, lookahead slots, commit of accepted
// runs, rollback of rejected drafts, stops inside a run, the batch-size switch-off, the
// back-off after rejected drafts.
#include <vector>

#include "check.h"
#include "scheduler_fixtures.h"
#include "vpage/scheduler.h"

using namespace vpage;
using namespace vpage_test;

namespace {

SchedulerConfig speculating(int k, int lookup_min = 1, int lookup_max = 3) {
  SchedulerConfig cfg;
  cfg.num_speculative_tokens = k;
  cfg.prompt_lookup_min = lookup_min;
  cfg.prompt_lookup_max = lookup_max;
  return cfg;
}

CommitResult commit(Scheduler& s, std::vector<SeqId> ids, std::vector<TokenId> toks) {
  CommitResult r = s.commit(ids.data(), toks.data(), static_cast<int64_t>(ids.size()));
  s.check_invariants();
  return r;
}

// A request over 10 11 12 13 10 11 whose prompt is computed and whose first output is 12:
// the next step looks up [10 11 12] and drafts 13 10 11.
Scheduler prefilled(const SchedulerConfig& cfg, StopConditions st, int gpu_blocks = 64) {
  Scheduler s(cfg, pools(gpu_blocks, 0));
  s.add_sequence_group("r", {10, 11, 12, 13, 10, 11}, 1, st, 0.0);
  auto plan = s.schedule();
  EXPECT(plan->num_tokens() == 6 && plan->sample_num_drafts == std::vector<int32_t>{0});
  commit(s, {0}, {12});
  return s;
}

}  // namespace

TEST_CASE("n-gram drafts ride in the decode row with lookahead slots") {
  Scheduler s = prefilled(speculating(3), stop(20));
  auto plan = s.schedule();
  EXPECT(plan->input_ids == (std::vector<int64_t>{12, 13, 10, 11}));
  EXPECT(plan->positions == (std::vector<int64_t>{6, 7, 8, 9}));
  EXPECT(plan->sample_num_drafts == std::vector<int32_t>{3});
  EXPECT(plan->sample_token_indices == std::vector<int64_t>{3});
  EXPECT(plan->context_lens == std::vector<int32_t>{10});
  EXPECT(plan->num_decode_tokens == 4 && plan->num_draft_tokens == 3 && plan->num_prefill_tokens == 0);
  EXPECT(used_gpu_blocks(s) == 3);  // positions 0..9 of 4-token blocks
  s.check_invariants();
}

TEST_CASE("commit keeps accepted drafts and rolls back the rejected ones") {
  Scheduler s = prefilled(speculating(3), stop(20));
  s.schedule();
  CommitResult r = commit(s, {0, 0, 0}, {13, 10, 12});  // 13 and 10 accepted, 12 verified after them
  EXPECT(r.statuses == std::vector<int32_t>(3, static_cast<int32_t>(SequenceStatus::kRunning)));
  const auto seq = *s.find_sequence(0);
  EXPECT(seq.tokens == (std::vector<TokenId>{10, 11, 12, 13, 10, 11, 12, 13, 10, 12}));
  EXPECT(seq.num_computed_tokens == 9);  // everything but the new token
  EXPECT(seq.block_table.size() == 3);   // no block past the new token
  EXPECT(s.stats().num_drafts == 1 && s.stats().num_draft_tokens == 3 && s.stats().num_accepted_tokens == 2);
  // Nothing accepted: only the verified token, and the lookahead block goes back.
  auto plan = s.schedule();
  const int drafts = plan->sample_num_drafts[0];
  EXPECT(drafts >= 1);
  commit(s, {0}, {7});
  EXPECT(s.find_sequence(0)->num_computed_tokens == 10);
  EXPECT(used_gpu_blocks(s) == 3);
}

TEST_CASE("a draft given wrongly changes nothing") {
  Scheduler s = prefilled(speculating(3), stop(20));
  s.schedule();
  const auto bad = [&s](std::vector<SeqId> ids, std::vector<TokenId> toks) {
    s.commit(ids.data(), toks.data(), static_cast<int64_t>(ids.size()));
  };
  EXPECT_THROWS(bad({0, 0}, {14, 5}), CheckError);               // 14 was not the draft
  EXPECT_THROWS(bad({0, 0, 0, 0, 0}, {13, 10, 11, 4, 4}), CheckError);  // more than drafts + 1
  EXPECT_THROWS(bad({0, 0, 0}, {13, -1, 4}), CheckError);        // a negative token
  EXPECT(s.find_sequence(0)->num_computed_tokens == 6);
  commit(s, {0, 0, 0, 0}, {13, 10, 11, 4});  // all accepted, then the bonus token
  const auto seq = *s.find_sequence(0);
  EXPECT(seq.tokens.size() == 11 && seq.num_computed_tokens == 10);
}

TEST_CASE("a stop token inside an accepted run ends it there") {
  StopConditions st = stop(20);
  st.stop_token_ids = {13};
  Scheduler s = prefilled(speculating(3), st);
  s.schedule();
  CommitResult r = commit(s, {0, 0, 0}, {13, 10, 99});
  const int32_t stopped = static_cast<int32_t>(SequenceStatus::kFinishedStopped);
  EXPECT(r.statuses == std::vector<int32_t>(3, stopped));
  EXPECT(r.stop_token_ids == (std::vector<int32_t>{13, -1, -1}));
  EXPECT(r.finished_request_ids == std::vector<std::string>{"r"});
  EXPECT(used_gpu_blocks(s) == 0 && !s.has_unfinished());
}

TEST_CASE("drafts stop at max_tokens and max_model_len") {
  Scheduler s = prefilled(speculating(3), stop(3));  // one output so far: two more at most
  auto plan = s.schedule();
  EXPECT(plan->sample_num_drafts == std::vector<int32_t>{1});
  CommitResult r = commit(s, {0, 0}, {13, 5});
  EXPECT(r.statuses.back() == static_cast<int32_t>(SequenceStatus::kFinishedLength));
  SchedulerConfig cfg = speculating(3);
  cfg.max_model_len = 9;  // 7 tokens: room for two more
  Scheduler t = prefilled(cfg, stop(20));
  EXPECT(t.schedule()->sample_num_drafts == std::vector<int32_t>{1});
}

TEST_CASE("no drafts above the batch-size limit, for opted-out requests, or without blocks") {
  SchedulerConfig cfg = speculating(3);
  cfg.speculative_disable_by_batch_size = 1;
  Scheduler s(cfg, pools(64, 0));
  for (const char* id : {"a", "b"}) s.add_sequence_group(id, {10, 11, 12, 13, 10, 11}, 1, stop(20), 0.0);
  s.schedule();
  commit(s, {0, 1}, {12, 12});
  EXPECT(s.schedule()->num_draft_tokens == 0);
  commit(s, {0, 1}, {12, 12});

  Scheduler opted_out(speculating(3), pools(64, 0));
  opted_out.add_sequence_group("r", {10, 11, 12, 13, 10, 11}, 1, stop(20), 0.0, "", false);
  opted_out.schedule();
  commit(opted_out, {0}, {12});
  EXPECT(opted_out.schedule()->num_draft_tokens == 0);

  // Two blocks hold the 7 tokens; the drafts would need a third: they are dropped, not preempting.
  Scheduler tight = prefilled(speculating(3), stop(20), 2);
  auto plan = tight.schedule();
  EXPECT(plan->num_draft_tokens == 0 && plan->num_preempted_recompute == 0 && plan->num_tokens() == 1);
}

TEST_CASE("a step scheduled again drops the drafts of the plan that never ran") {
  Scheduler s = prefilled(speculating(3), stop(20));
  s.schedule();
  auto again = s.schedule();  // the first plan's forward failed
  EXPECT(again->sample_num_drafts == std::vector<int32_t>{3});
  commit(s, {0}, {4});
  EXPECT(used_gpu_blocks(s) == 2);
}

TEST_CASE("external drafts: placeholders in the plan, filled by the caller, then verified") {
  SchedulerConfig cfg = speculating(2);
  cfg.external_drafts = true;
  Scheduler s(cfg, pools(64, 0));
  s.add_sequence_group("r", {1, 2, 3}, 1, stop(20), 0.0);  // nothing to look up: drafts come from outside
  s.schedule();
  commit(s, {0}, {4});
  auto plan = s.schedule();
  EXPECT(plan->sample_num_drafts == std::vector<int32_t>{2} && plan->input_ids.size() == 3);
  EXPECT_THROWS(s.fill_drafts(std::vector<TokenId>{7}.data(), 1), CheckError);
  const std::vector<TokenId> drafts{7, 8};
  s.fill_drafts(drafts.data(), 2);
  EXPECT(plan->input_ids == (std::vector<int64_t>{4, 7, 8}));
  commit(s, {0, 0}, {7, 9});
  EXPECT(s.find_sequence(0)->tokens == (std::vector<TokenId>{1, 2, 3, 4, 7, 9}));
  EXPECT(s.find_sequence(0)->num_computed_tokens == 5);
}

TEST_CASE("drafts all rejected back off 1, 3, 7 steps, probe one at a time, then double; kept ones step back") {
  SchedulerConfig cfg = speculating(4);
  cfg.external_drafts = true;
  Scheduler s(cfg, pools(64, 0));
  s.add_sequence_group("r", {1, 2, 3}, 1, stop(200), 0.0);
  s.schedule();
  commit(s, {0}, {4});
  // One decode step: its number of drafts (all 7), committed with the first `kept` of them kept.
  const auto step = [&s](int32_t kept) {
    auto plan = s.schedule();
    const int32_t d = plan->sample_num_drafts[0];
    if (d > 0) {
      const std::vector<TokenId> drafts(static_cast<size_t>(d), 7);
      s.fill_drafts(drafts.data(), d);
    }
    kept = std::min(kept, d);
    std::vector<SeqId> ids(static_cast<size_t>(kept) + 1, 0);
    std::vector<TokenId> tokens(static_cast<size_t>(kept), 7);
    tokens.push_back(5);
    commit(s, ids, tokens);
    return d;
  };
  std::vector<int32_t> seen;
  for (int i = 0; i < 14; ++i) seen.push_back(step(0));
  // After a miss, one draft probes at a time.
  EXPECT(seen == (std::vector<int32_t>{4, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0}));
  // Back-off level 3 here; each kept draft lowers it by one, each miss raises it.
  EXPECT(step(1) == 1);  // the probe is kept (level 2): twice as many drafts next
  EXPECT(step(2) == 2);  // level 1
  EXPECT(step(1) == 4);  // all k again (level 0); one of them kept: two next
  EXPECT(step(0) == 2);  // a miss: level 1, one step skipped
  EXPECT(step(0) == 0);
  EXPECT(step(0) == 1);  // the probe misses: level 2, three steps
  for (int i = 0; i < 3; ++i) EXPECT(step(0) == 0);
  EXPECT(step(1) == 1);  // kept: back-off 1, two drafts next
  EXPECT(step(0) == 2);  // a miss: back-off 2 again (a cleared back-off would skip one step)
  for (int i = 0; i < 3; ++i) EXPECT(step(0) == 0);
  EXPECT(step(0) == 1);
}

TEST_MAIN()
