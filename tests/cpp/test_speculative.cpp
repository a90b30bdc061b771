// Speculative decoding in the scheduler: n-gram drafts, lookahead slots, commit of accepted
// runs, rollback of rejected drafts, stops inside a run, the batch-size switch-off, the
// draft policy (acceptance rate against the measured cost of a row).
#include <cmath>
#include <limits>
#include <vector>

#include "check.h"
#include "draft_policy.h"
#include "scheduler_fixtures.h"
#include "vpage/scheduler.h"

using namespace vpage;
using namespace vpage_test;

namespace {

bool near(double a, double b) { return std::abs(a - b) <= 1e-6 * std::max(1.0, std::abs(b)); }

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

TEST_CASE("the number of drafts weighs the acceptance rate against what a draft row costs") {
  // A sequence's share of a step, in draft rows: ~2 where a row is half a single-stream step.
  EXPECT(best_num_drafts(0.97, 2.1, 4) == 4);
  EXPECT(best_num_drafts(0.88, 2.1, 4) == 3);
  EXPECT(best_num_drafts(0.6, 2.1, 4) == 1);
  EXPECT(best_num_drafts(0.4, 2.1, 4) == 0);
  // Where rows are cheap (~5), drafts kept a third of the time still pay.
  EXPECT(best_num_drafts(0.88, 5.3, 4) == 4);
  EXPECT(best_num_drafts(0.3, 5.3, 4) == 1);
  // A step that is all rows: nothing short of certainty pays; free rows: everything does.
  EXPECT(best_num_drafts(0.97, 1.0, 4) == 0);
  EXPECT(best_num_drafts(0.01, std::numeric_limits<double>::infinity(), 4) == 4);
  EXPECT(best_num_drafts(0.97, 2.1, 0) == 0);
}

TEST_CASE("the acceptance rate counts kept positions and the rejected one, recent steps first") {
  DraftAcceptance a;
  EXPECT(near(a.rate(), 0.8));  // the prior
  a.observe(4, 0);              // one position tried, rejected
  EXPECT(near(a.rate(), 0.8 / 2.0));
  a.observe(4, 4);  // four kept, none rejected
  EXPECT(near(a.rate(), (4.0 + 0.8) / (0.9 + 4.0 + 1.0)));
  a.observe(0, 0);  // no drafts: no news
  EXPECT(near(a.rate(), (4.0 + 0.8) / (0.9 + 4.0 + 1.0)));
}

TEST_CASE("the step cost model separates the fixed cost, the sequences and the drafts") {
  StepCostModel same_batch;
  EXPECT(near(same_batch.seq_share_in_drafts(1), 3.0) && near(same_batch.seq_share_in_drafts(2), 2.0));  // prior
  // One sequence, 0 or 4 drafts: 4 ms + 2 ms per sequence + 1 ms per draft.
  for (int i = 0; i < 10; ++i) same_batch.observe(1, 4 * (i % 2), 0.004 + 0.002 + 0.001 * 4 * (i % 2));
  EXPECT(near(same_batch.seq_share_in_drafts(1), 6.0));
  for (int i = 0; i < 50; ++i) same_batch.observe(1, 4, 0.010);  // drafts stop varying: the fit stays
  EXPECT(near(same_batch.seq_share_in_drafts(1), 6.0));

  StepCostModel batches;
  const int seqs[] = {1, 2, 4, 3}, drafts[] = {0, 3, 1, 4, 2};
  for (int i = 0; i < 40; ++i) {
    const int n = seqs[i % 4], d = drafts[i % 5];
    batches.observe(n, d, 0.004 + 0.002 * n + 0.001 * d);
  }
  EXPECT(near(batches.seq_share_in_drafts(1), 6.0));
  EXPECT(near(batches.seq_share_in_drafts(2), 4.0));
  EXPECT(near(batches.seq_share_in_drafts(8), 2.5));

  StepCostModel free_drafts;
  for (int i = 0; i < 10; ++i) free_drafts.observe(1, 4 * (i % 2), 0.005 - 0.0001 * (i % 2));
  EXPECT(std::isinf(free_drafts.seq_share_in_drafts(1)));
}

namespace {

// One decode step of the one-request scheduler `s` (external drafts, a request started by
// decoding_request): its number of drafts, committed with the first `kept` of them kept, and
// reported to take `fixed` + `per_row` seconds per row.
int32_t timed_draft_step(Scheduler& s, int32_t kept, double fixed, double per_row) {
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
  s.observe_step_time(fixed + per_row * (1 + d));
  return d;
}

// A scheduler with external drafts (k = 4) and one request whose prompt is computed.
Scheduler decoding_request() {
  SchedulerConfig cfg = speculating(4);
  cfg.external_drafts = true;
  Scheduler s(cfg, pools(64, 0));
  s.add_sequence_group("r", {1, 2, 3}, 1, stop(200), 0.0);
  s.schedule();
  commit(s, {0}, {4});
  return s;
}

}  // namespace

TEST_CASE("drafts stop where they do not pay, probe after 1, 3, 7 steps and resume when kept") {
  Scheduler s = decoding_request();
  // A step takes 5 ms + 5 ms per row: a draft row costs half a plain step.
  std::vector<int32_t> seen;
  for (int i = 0; i < 20; ++i) seen.push_back(timed_draft_step(s, 0, 0.005, 0.005));
  // Before any timing the prior (a step's fixed cost = two rows) lets the 0.8 prior rate
  // draft 3; after misses and four timed steps drafting stops, and single drafts probe.
  EXPECT(seen == (std::vector<int32_t>{3, 1, 1, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0}));
  seen.clear();
  for (int i = 0; i < 24; ++i) seen.push_back(timed_draft_step(s, 4, 0.005, 0.005));
  // The next probe, 16 steps after the last, is kept: drafting resumes and widens.
  const std::vector<int32_t> resumed{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2};
  EXPECT(seen == resumed);
  // Where rows are nearly free, the same misses keep a sequence drafting once that is measured.
  Scheduler cheap = decoding_request();
  int32_t drafted = 0;
  for (int i = 0; i < 20; ++i) drafted += timed_draft_step(cheap, 0, 0.010, 0.0001) > 0 && i >= 5;
  EXPECT(drafted == 15);
}

TEST_MAIN()
