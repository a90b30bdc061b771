#include "scheduler_impl.h"

#include <algorithm>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "ngram_proposer.h"
#include "step_builder.h"

namespace vpage {
namespace {

// Inserts `group` after every group that arrived no later (FCFS order of the queue).
template <typename Queue>
void insert_by_arrival(Queue& queue, SequenceGroup* group) {
  const auto it = std::upper_bound(queue.begin(), queue.end(), group, [](const SequenceGroup* a, const SequenceGroup* b) {
    return a->arrival_time() < b->arrival_time();
  });
  queue.insert(it, group);
}

}  // namespace

SchedulerImpl::SchedulerImpl(const SchedulerConfig& config, const BlockManagerConfig& block_config)
    : config_(config),
      blocks_(block_config, std::max(config.max_num_batched_tokens, 1)),  // a bad budget is reported below
      plan_(std::make_shared<SchedulePlan>()) {
  VPAGE_CHECK(config.max_num_batched_tokens > 0, "max_num_batched_tokens must be > 0");
  VPAGE_CHECK(config.max_num_seqs > 0, "max_num_seqs must be > 0");
  VPAGE_CHECK(config.max_model_len > 0, "max_model_len must be > 0");
  VPAGE_CHECK(config.num_speculative_tokens >= 0, "num_speculative_tokens must be >= 0");
  VPAGE_CHECK(config.prompt_lookup_min >= 1 && config.prompt_lookup_max >= config.prompt_lookup_min,
              "need 1 <= prompt_lookup_min <= prompt_lookup_max, got " << config.prompt_lookup_min << " and "
                                                                       << config.prompt_lookup_max);
  VPAGE_CHECK(config.speculative_disable_by_batch_size >= 0, "speculative_disable_by_batch_size must be >= 0");
  plan_->step_id = -1;
}

std::vector<SeqId> SchedulerImpl::add_sequence_group(const std::string& request_id,
                                                     std::vector<TokenId> prompt, int32_t num_seqs,
                                                     const StopConditions& stop, double arrival_time,
                                                     const std::string& cache_salt, bool speculate,
                                                     int32_t lora_id) {
  VPAGE_CHECK(!prompt.empty(), "request '" << request_id << "' has an empty prompt");
  VPAGE_CHECK(num_seqs >= 1, "request '" << request_id << "' needs at least one sequence");
  VPAGE_CHECK(stop.max_tokens >= 1, "max_tokens must be >= 1, got " << stop.max_tokens);
  VPAGE_CHECK(stop.min_tokens >= 0 && stop.min_tokens <= stop.max_tokens,
              "min_tokens must be in [0, max_tokens], got " << stop.min_tokens);
  VPAGE_CHECK(!groups_.count(request_id), "request id '" << request_id << "' is already in use");
  VPAGE_CHECK(lora_id >= 0, "lora_id must be >= 0, got " << lora_id);
  auto group = std::make_unique<SequenceGroup>(request_id, arrival_time, stop, cache_salt,
                                               blocks_.hash_salt(cache_salt), speculate, lora_id);
  std::vector<SeqId> ids;
  for (int32_t i = 0; i < num_seqs; ++i) {
    group->seqs_.push_back(std::make_unique<Sequence>(next_seq_id_++, prompt));
    ids.push_back(group->seqs_.back()->seq_id());
    seqs_[ids.back()] = SeqRef{group->seqs_.back().get(), group.get()};
  }
  insert_by_arrival(waiting_, group.get());
  groups_.emplace(request_id, std::move(group));
  return ids;
}

SequenceGroup* SchedulerImpl::group_of(const std::string& request_id) const {
  const auto it = groups_.find(request_id);
  return it == groups_.end() ? nullptr : it->second.get();
}

std::optional<SequenceGroupSnapshot> SchedulerImpl::find_group(const std::string& request_id) const {
  const SequenceGroup* group = group_of(request_id);
  if (!group) return std::nullopt;
  return group->snapshot();
}

std::optional<SequenceSnapshot> SchedulerImpl::find_sequence(SeqId seq_id) const {
  const auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) return std::nullopt;
  return it->second.seq->snapshot();
}

void SchedulerImpl::set_status(SequenceGroup& group, SequenceStatus status) {
  for (auto& s : group.seqs_) {
    if (!is_finished(s->status_)) s->status_ = status;
  }
}

void SchedulerImpl::finish_seq(SequenceGroup& group, Sequence& seq, SequenceStatus status) {
  // Only the first unfinished sequence computes a shared prefix for the others.
  const auto first = std::find_if(group.seqs_.begin(), group.seqs_.end(),
                                  [](const auto& s) { return !is_finished(s->status_); });
  const bool computes_shared = first != group.seqs_.end() && first->get() == &seq;
  blocks_.free(seq);
  seq.status_ = status;
  if (!computes_shared || group.shared_len_ == 0 || seq.num_computed_ >= group.shared_len_) return;
  // The sequence computing the shared blocks for the others ended before it was done: each
  // remaining one computes from where it left off (writing the same values into them).
  for (auto& s : group.seqs_) {
    if (is_finished(s->status_)) continue;
    s->num_computed_ = std::min(s->num_computed_, seq.num_computed_);
    s->block_cids_.resize(std::min<size_t>(s->block_cids_.size(), s->num_computed_ / blocks_.block_size()));
  }
  group.shared_len_ = 0;
}

void SchedulerImpl::remove_group(SequenceGroup& group) {
  SequenceGroup* g = &group;
  running_.erase(std::remove(running_.begin(), running_.end(), g), running_.end());
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), g), waiting_.end());
  swapped_.erase(std::remove(swapped_.begin(), swapped_.end(), g), swapped_.end());
  for (auto& s : group.seqs_) seqs_.erase(s->seq_id());
  groups_.erase(group.request_id());  // destroys the group
}

bool SchedulerImpl::abort(const std::string& request_id) {
  SequenceGroup* group = group_of(request_id);
  if (!group) return false;
  for (auto& s : group->seqs_) {
    if (!is_finished(s->status_)) finish_seq(*group, *s, SequenceStatus::kFinishedAborted);
  }
  remove_group(*group);
  return true;
}

void SchedulerImpl::ignore(SequenceGroup& group, const std::string& reason, SchedulePlan& plan) {
  for (auto& s : group.seqs_) {
    if (!is_finished(s->status_)) finish_seq(group, *s, SequenceStatus::kFinishedIgnored);
  }
  plan.ignored.emplace_back(group.request_id(), reason);
  remove_group(group);
}

void SchedulerImpl::preempt(SequenceGroup& group, SchedulePlan& plan) {
  for (auto& s : group.seqs_) s->draft_tokens_.clear();
  const PreemptionMode mode = config_.preemption_mode;
  bool swap = mode == PreemptionMode::kSwap ||
              (mode == PreemptionMode::kAuto && group.num_unfinished() > 1);
  if (swap && !blocks_.can_swap_out(group)) swap = false;  // CPU space short: recompute
  if (swap) {
    blocks_.swap_out(group, plan.blocks_to_swap_out);
    set_status(group, SequenceStatus::kSwapped);
    insert_by_arrival(swapped_, &group);
    ++plan.num_preempted_swap;
    ++stats_.num_preempted_swap;
  } else {
    for (auto& s : group.seqs_) {
      if (is_finished(s->status_)) continue;
      blocks_.free(*s);
      s->num_computed_ = 0;
      s->block_cids_.clear();
    }
    group.shared_len_ = 0;
    set_status(group, SequenceStatus::kWaiting);
    insert_by_arrival(waiting_, &group);
    ++plan.num_preempted_recompute;
    ++stats_.num_preempted_recompute;
  }
  ++group.num_preemptions_;
}

bool SchedulerImpl::is_decode(const SequenceGroup& group) {
  if (group.identical_) return false;
  for (const auto& s : group.seqs_) {
    if (!is_finished(s->status_) && s->num_uncomputed_tokens() != 1) return false;
  }
  return true;
}

void SchedulerImpl::schedule_group(SequenceGroup& group, StepBudget& budget, StepBuilder& step) {
  std::vector<Sequence*> live;
  for (auto& s : group.seqs_) {
    if (!is_finished(s->status_)) live.push_back(s.get());
  }
  // Identical sequences: the first computes for all, the rest follow and share its row.
  // Diverged ones wait until the first has computed the blocks they share (shared_len_).
  const size_t num_computing = group.identical_ ? 1 : live.size();
  const bool shared_pending = !live.empty() && live[0]->num_computed_ < group.shared_len_;
  for (size_t i = 0; i < num_computing && budget.tokens > 0; ++i) {
    Sequence& seq = *live[i];
    if (i > 0 && shared_pending) break;
    if (seq.num_uncomputed_tokens() + static_cast<int32_t>(seq.draft_tokens_.size()) > budget.tokens) {
      seq.draft_tokens_.resize(static_cast<size_t>(std::max(0, budget.tokens - seq.num_uncomputed_tokens())));
    }
    const int32_t num_drafts = static_cast<int32_t>(seq.draft_tokens_.size());
    const int32_t n = std::min(seq.num_uncomputed_tokens() + num_drafts, budget.tokens);
    if (n == 0) continue;
    budget.tokens -= n;
    const int64_t last = step.add_row(seq, n, group.lora_id_);
    const bool samples = seq.num_computed_ + n - num_drafts == seq.num_tokens();
    const size_t followers_end = group.identical_ ? live.size() : i + 1;
    for (size_t j = i; j < followers_end; ++j) {
      pending_.emplace_back(live[j]->seq_id(), n);
      if (samples) step.add_sample(live[j]->seq_id(), last, num_drafts);
    }
    if (num_drafts > 0) {
      ++stats_.num_drafts;
      stats_.num_draft_tokens += num_drafts;
    }
  }
  group.last_step_ = plan_->step_id;
}

void SchedulerImpl::make_running(SequenceGroup& group, StepBudget& budget) {
  set_status(group, SequenceStatus::kRunning);
  insert_by_arrival(running_, &group);
  budget.num_seqs += group.num_unfinished();
  if (group.lora_id_ > 0 && std::find(budget.loras.begin(), budget.loras.end(), group.lora_id_) == budget.loras.end()) {
    budget.loras.push_back(group.lora_id_);
  }
}

bool SchedulerImpl::lora_fits(const SequenceGroup& group, const StepBudget& budget) const {
  return group.lora_id_ == 0 || config_.max_loras == 0 ||
         std::find(budget.loras.begin(), budget.loras.end(), group.lora_id_) != budget.loras.end() ||
         static_cast<int32_t>(budget.loras.size()) < config_.max_loras;
}

void SchedulerImpl::preempt_running(size_t index, StepBudget& budget, SchedulePlan& plan) {
  SequenceGroup* group = running_[index];
  running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(index));
  budget.num_seqs -= group->num_unfinished();
  budget.preempted = true;
  preempt(*group, plan);
}

void SchedulerImpl::propose_drafts(SequenceGroup& group, const StepBudget& budget) {
  const StopConditions& stop = group.stop_;
  int32_t spare = budget.tokens - group.num_unfinished();  // tokens left once each seq has its one
  const double seq_share = step_costs_.seq_share_in_drafts(budget.num_seqs);
  for (auto& s : group.seqs_) {
    if (is_finished(s->status_)) continue;
    // Every token a draft run appends must stay within max_tokens and max_model_len.
    const int32_t room = std::min(stop.max_tokens - s->num_output_tokens(), config_.max_model_len - s->num_tokens());
    const int32_t most = std::min({config_.num_speculative_tokens, room - 1, spare});
    if (most <= 0) continue;
    int32_t k = best_num_drafts(s->draft_acceptance_.rate(), seq_share, most);
    if (k > 0) {
      s->probe_gap_ = s->draft_skip_ = 0;
    } else {
      // Drafting does not pay at this sequence's rate; one draft after 1, 3, 7 ..
      // kMaxProbeGap decode steps keeps the rate current (a kept probe is followed by another
      // at once), so drafting resumes when the text starts to repeat.
      if (s->draft_skip_ > 0) {
        --s->draft_skip_;
        continue;
      }
      s->probe_gap_ = std::min(2 * s->probe_gap_ + 1, kMaxProbeGap);
      s->draft_skip_ = s->probe_gap_;
      k = 1;
    }
    if (config_.external_drafts) {
      s->draft_tokens_.assign(static_cast<size_t>(k), 0);  // fill_drafts() writes them
    } else {
      propose_ngram(s->tokens_.data(), s->num_tokens(), config_.prompt_lookup_min, config_.prompt_lookup_max, k,
                    s->draft_tokens_);
    }
    spare -= static_cast<int32_t>(s->draft_tokens_.size());
  }
}

void SchedulerImpl::observe_step_time(double seconds) {
  if (last_decode_seqs_ > 0) step_costs_.observe(last_decode_seqs_, last_decode_drafts_, seconds);
  last_decode_seqs_ = 0;
}

void SchedulerImpl::schedule_running(StepBudget& budget, StepBuilder& step, SchedulePlan& plan) {
  for (size_t i = 0; i < running_.size(); ++i) {
    SequenceGroup& group = *running_[i];
    for (auto& s : group.seqs_) s->draft_tokens_.clear();  // those of an earlier plan that never ran
    const bool decode = is_decode(group);
    // Groups still computing one shared prompt hold all their blocks since admission (with a
    // window, only those of their next step).
    if ((group.identical_ && !blocks_.windowed()) || (decode && group.num_unfinished() > budget.tokens)) continue;
    if (decode && budget.speculate && group.speculate_) {
      propose_drafts(group, budget);
      if (!blocks_.can_append_slots(group)) {  // drafts never cost a preemption
        for (auto& s : group.seqs_) s->draft_tokens_.clear();
      }
    }
    bool preempted_self = false;
    while (!blocks_.can_append_slots(group)) {
      // The latest arrival not scheduled in this step gives its blocks up; else this group.
      size_t victim = running_.size();
      for (size_t j = running_.size(); j-- > i + 1;) {
        if (!scheduled_now(*running_[j])) {
          victim = j;
          break;
        }
      }
      if (victim == running_.size()) {
        preempted_self = true;
        break;
      }
      preempt_running(victim, budget, plan);
    }
    if (preempted_self) {
      preempt_running(i--, budget, plan);
      continue;
    }
    blocks_.append_slots(group, plan.blocks_to_copy);
    if (decode) schedule_group(group, budget, step);
  }
}

void SchedulerImpl::schedule_swapped(StepBudget& budget, StepBuilder& step, SchedulePlan& plan) {
  while (!budget.preempted && !swapped_.empty()) {
    SequenceGroup& group = *swapped_.front();
    const AllocStatus status = blocks_.can_swap_in(group);
    if (status == AllocStatus::kNever) {
      swapped_.pop_front();
      ignore(group, "the swapped request no longer fits in the KV cache", plan);
      continue;
    }
    const int32_t k = group.num_unfinished();
    const bool decode = is_decode(group);
    if (status == AllocStatus::kLater || budget.num_seqs + k > config_.max_num_seqs ||
        budget.tokens < (decode ? k : 1) || !lora_fits(group, budget)) {
      break;
    }
    swapped_.pop_front();
    blocks_.swap_in(group, plan.blocks_to_swap_in);
    make_running(group, budget);
    blocks_.append_slots(group, plan.blocks_to_copy);
    if (decode) schedule_group(group, budget, step);
  }
}

void SchedulerImpl::schedule_prefills(StepBudget& budget, StepBuilder& step) {
  for (SequenceGroup* g : running_) {
    if (budget.tokens == 0) break;
    if (scheduled_now(*g) || is_decode(*g)) continue;
    if (!config_.enable_chunked_prefill) {
      int32_t uncomputed = 0;
      for (auto& s : g->seqs_) {
        if (!is_finished(s->status_)) uncomputed += s->num_uncomputed_tokens();
        if (g->identical_) break;
      }
      if (uncomputed > budget.tokens) continue;
    }
    schedule_group(*g, budget, step);
  }
}

AllocStatus SchedulerImpl::admission_status(SequenceGroup& group, int32_t len, std::string& reason) {
  if (len > config_.max_model_len) {
    reason = "prompt of " + std::to_string(len) + " tokens exceeds max_model_len " +
             std::to_string(config_.max_model_len);
    return AllocStatus::kNever;
  }
  if (!config_.enable_chunked_prefill && len > config_.max_num_batched_tokens) {
    reason = "prompt of " + std::to_string(len) + " tokens exceeds max_num_batched_tokens " +
             std::to_string(config_.max_num_batched_tokens) + " and chunked prefill is off";
    return AllocStatus::kNever;
  }
  const AllocStatus status = blocks_.can_allocate(group);
  if (status == AllocStatus::kNever) {
    reason = "prompt of " + std::to_string(len) + " tokens needs more KV blocks than the cache holds (" +
             std::to_string(blocks_.config().num_gpu_blocks) + " blocks of " +
             std::to_string(blocks_.block_size()) + " tokens, minus the watermark)";
  }
  return status;
}

void SchedulerImpl::schedule_waiting(StepBudget& budget, StepBuilder& step, SchedulePlan& plan) {
  size_t next = 0;  // groups before it wait for an adapter slot (max_loras); later ones may go first
  while (!budget.preempted && swapped_.empty() && next < waiting_.size() && budget.tokens > 0) {
    SequenceGroup& group = *waiting_[next];
    if (!lora_fits(group, budget)) {
      ++next;
      continue;
    }
    int32_t len = 0, total = 0;
    for (auto& s : group.seqs_) {
      if (is_finished(s->status_)) continue;
      len = std::max(len, s->num_tokens());
      total += group.identical_ && total > 0 ? 0 : s->num_tokens();
    }
    // Admitted once its disk blocks are in the CPU pool.
    if (blocks_.fetch_from_disk(group) > 0 || blocks_.waits_for_disk(group)) {
      ++next;
      continue;
    }
    std::string reason;
    const AllocStatus status = admission_status(group, len, reason);
    if (status == AllocStatus::kNever) {
      ignore(group, reason, plan);  // leaves waiting_
      continue;
    }
    if (status == AllocStatus::kLater) break;
    if (budget.num_seqs + group.num_unfinished() > config_.max_num_seqs) break;
    if (!config_.enable_chunked_prefill && total > budget.tokens) break;
    waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(next));
    blocks_.allocate(group);
    stats_.num_cached_prompt_tokens += group.num_cached_tokens_;
    make_running(group, budget);
    schedule_group(group, budget, step);
  }
}

std::shared_ptr<const SchedulePlan> SchedulerImpl::schedule() {
  if (plan_.use_count() > 1) {
    plan_ = std::make_shared<SchedulePlan>();
  } else {
    plan_->clear();
  }
  SchedulePlan& plan = *plan_;
  plan.step_id = next_step_id_++;
  pending_.clear();
  StepBuilder step(plan, blocks_.block_size());
  StepBudget budget;
  budget.tokens = config_.max_num_batched_tokens;
  for (const SequenceGroup* g : running_) budget.num_seqs += g->num_unfinished();
  budget.speculate = config_.num_speculative_tokens > 0 &&
                     (config_.speculative_disable_by_batch_size == 0 ||
                      budget.num_seqs <= config_.speculative_disable_by_batch_size);

  // 1. Slots for the newest tokens of running groups, FCFS, preempting the latest arrivals
  //    when blocks run out; decodes are scheduled right away.
  schedule_running(budget, step, plan);
  for (const SequenceGroup* g : running_) {  // the adapters of the groups that stay running
    if (g->lora_id_ > 0 && std::find(budget.loras.begin(), budget.loras.end(), g->lora_id_) == budget.loras.end()) {
      budget.loras.push_back(g->lora_id_);
    }
  }
  // 2. Swapped groups come back (FCFS) before any new prompt, unless this step preempted.
  schedule_swapped(budget, step, plan);
  // 3. Prefill chunks of running groups.
  schedule_prefills(budget, step);
  // 4. New prompts (FCFS) while the budgets and the KV cache allow.
  schedule_waiting(budget, step, plan);
  blocks_.finish_step(plan);

  step.finish();
  last_decode_seqs_ = plan.num_prefill_tokens == 0 ? static_cast<int32_t>(plan.sample_seq_ids.size()) : 0;
  last_decode_drafts_ = plan.num_draft_tokens;
  ++stats_.num_steps;
  stats_.num_prefill_tokens += plan.num_prefill_tokens;
  stats_.num_decode_tokens += plan.num_decode_tokens;
  return plan_;
}

int64_t SchedulerImpl::num_kv_tokens() const {
  int64_t tokens = 0;
  for (const SequenceGroup* g : running_) {
    for (const auto& s : g->seqs_) {
      if (is_finished(s->status_)) continue;
      // With a window, the tokens before its first held block are gone.
      tokens += s->num_computed_ - blocks_.first_window_block(s->num_computed_) * blocks_.block_size();
      if (g->identical_) break;
    }
  }
  return tokens;
}

SeqId SchedulerImpl::fork_sequence(SeqId parent_id) {
  const auto it = seqs_.find(parent_id);
  VPAGE_CHECK(it != seqs_.end(), "fork of unknown sequence " << parent_id);
  const Sequence& parent = *it->second.seq;
  SequenceGroup& group = *it->second.group;
  VPAGE_CHECK(!is_finished(parent.status_), "fork of finished sequence " << parent_id);
  auto child = std::make_unique<Sequence>(next_seq_id_++, parent.tokens_);
  child->prompt_len_ = parent.prompt_len_;
  child->num_computed_ = parent.num_computed_;
  child->status_ = parent.status_;
  child->draft_tokens_ = parent.draft_tokens_;  // with the pending step, its drafts and their slots
  child->draft_acceptance_ = parent.draft_acceptance_;
  blocks_.fork(parent, *child);
  const SeqId child_id = child->seq_id();
  for (size_t i = 0, n = pending_.size(); i < n; ++i) {
    if (pending_[i].first == parent_id) pending_.emplace_back(child_id, pending_[i].second);
  }
  seqs_[child_id] = SeqRef{child.get(), &group};
  group.seqs_.push_back(std::move(child));
  return child_id;
}

bool SchedulerImpl::finish_sequence(SeqId seq_id, SequenceStatus status) {
  VPAGE_CHECK(is_finished(status), "finish_sequence needs a finished status");
  const auto it = seqs_.find(seq_id);
  VPAGE_CHECK(it != seqs_.end(), "finish of unknown sequence " << seq_id);
  Sequence& seq = *it->second.seq;
  SequenceGroup& group = *it->second.group;
  if (!is_finished(seq.status_)) finish_seq(group, seq, status);
  if (!group.is_finished()) return false;
  remove_group(group);
  return true;
}

void SchedulerImpl::check_invariants() const {
  std::unordered_set<const SequenceGroup*> seen;
  std::vector<const Sequence*> holders;
  size_t num_seqs = 0;
  const auto check_queue = [&](const auto& queue, SequenceStatus expected, const char* name) {
    for (const SequenceGroup* g : queue) {
      VPAGE_CHECK(seen.insert(g).second, "group '" << g->request_id() << "' is in two queues");
      VPAGE_CHECK(groups_.count(g->request_id()) && group_of(g->request_id()) == g,
                  "queued group '" << g->request_id() << "' is not registered");
      VPAGE_CHECK(!g->is_finished(), "finished group '" << g->request_id() << "' is still queued");
      for (const auto& s : g->seqs_) {
        ++num_seqs;
        VPAGE_CHECK(s->num_computed_ <= s->num_tokens(), "sequence " << s->seq_id() << " over-computed");
        if (is_finished(s->status_)) {
          VPAGE_CHECK(s->block_table_.empty(), "finished sequence " << s->seq_id() << " holds blocks");
          continue;
        }
        VPAGE_CHECK(s->status_ == expected, "sequence " << s->seq_id() << " in the " << name
                                                        << " queue has status " << status_name(s->status_));
        if (expected == SequenceStatus::kWaiting) {
          VPAGE_CHECK(s->block_table_.empty() && s->num_computed_ == 0,
                      "waiting sequence " << s->seq_id() << " holds blocks or computed tokens");
        } else {
          const Device want = expected == SequenceStatus::kSwapped ? Device::kCpu : Device::kGpu;
          VPAGE_CHECK(s->block_device_ == want, "sequence " << s->seq_id() << " in the " << name
                                                            << " queue holds blocks of the wrong pool");
        }
        holders.push_back(s.get());
      }
    }
  };
  check_queue(waiting_, SequenceStatus::kWaiting, "waiting");
  check_queue(running_, SequenceStatus::kRunning, "running");
  check_queue(swapped_, SequenceStatus::kSwapped, "swapped");
  VPAGE_CHECK(seen.size() == groups_.size(), "a registered group is in no queue");
  VPAGE_CHECK(num_seqs == seqs_.size(), "sequence index out of sync");
  blocks_.check_invariants(holders);
}

// Scheduler: the public face, every call forwarded to the state.

Scheduler::Scheduler(const SchedulerConfig& config, const BlockManagerConfig& block_config)
    : impl_(std::make_unique<SchedulerImpl>(config, block_config)) {}
Scheduler::~Scheduler() = default;
Scheduler::Scheduler(Scheduler&&) noexcept = default;
Scheduler& Scheduler::operator=(Scheduler&&) noexcept = default;

std::vector<SeqId> Scheduler::add_sequence_group(const std::string& request_id, std::vector<TokenId> prompt,
                                                 int32_t num_seqs, const StopConditions& stop,
                                                 double arrival_time, const std::string& cache_salt,
                                                 bool speculate, int32_t lora_id) {
  return impl_->add_sequence_group(request_id, std::move(prompt), num_seqs, stop, arrival_time, cache_salt,
                                   speculate, lora_id);
}
bool Scheduler::abort(const std::string& request_id) { return impl_->abort(request_id); }
std::shared_ptr<const SchedulePlan> Scheduler::schedule() { return impl_->schedule(); }
CommitResult Scheduler::commit(const SeqId* seq_ids, const TokenId* token_ids, int64_t count) {
  return impl_->commit(seq_ids, token_ids, count);
}
void Scheduler::fill_drafts(const TokenId* tokens, int64_t count) { impl_->fill_drafts(tokens, count); }
void Scheduler::observe_step_time(double seconds) { impl_->observe_step_time(seconds); }
SeqId Scheduler::fork_sequence(SeqId parent) { return impl_->fork_sequence(parent); }
bool Scheduler::finish_sequence(SeqId seq_id, SequenceStatus status) {
  return impl_->finish_sequence(seq_id, status);
}

int32_t Scheduler::num_waiting() const { return impl_->num_waiting(); }
int32_t Scheduler::num_running() const { return impl_->num_running(); }
int32_t Scheduler::num_swapped() const { return impl_->num_swapped(); }
bool Scheduler::has_unfinished() const { return impl_->has_unfinished(); }
int64_t Scheduler::num_kv_tokens() const { return impl_->num_kv_tokens(); }
std::optional<SequenceGroupSnapshot> Scheduler::find_group(const std::string& request_id) const {
  return impl_->find_group(request_id);
}
std::optional<SequenceSnapshot> Scheduler::find_sequence(SeqId seq_id) const {
  return impl_->find_sequence(seq_id);
}

const SchedulerConfig& Scheduler::config() const { return impl_->config(); }
const BlockManagerConfig& Scheduler::block_config() const { return impl_->block_manager().config(); }
const SchedulerStats& Scheduler::stats() const { return impl_->stats(); }
BlockUsage Scheduler::usage() const { return impl_->block_manager().usage(); }
std::vector<KvCacheEvent> Scheduler::take_kv_events() { return impl_->take_kv_events(); }
bool Scheduler::reset_prefix_cache() { return impl_->reset_prefix_cache(); }
void Scheduler::complete_kv_loads(const std::vector<KvBlockLoad>& done, const std::vector<KvBlockLoad>& failed) {
  impl_->block_manager().complete_kv_loads(done, failed);
}
std::vector<std::pair<uint64_t, uint64_t>> Scheduler::add_disk_block(uint64_t hash_hi, uint64_t hash_lo, bool first,
                                                                     const std::string& salt,
                                                                     const std::vector<TokenId>& tokens) {
  VPAGE_CHECK(static_cast<int32_t>(tokens.size()) == impl_->block_manager().block_size(),
              "a disk block holds " << tokens.size() << " tokens, not block_size");
  std::vector<std::pair<uint64_t, uint64_t>> gone;
  for (const BlockHash& h : impl_->block_manager().add_disk_record(DiskRecord{BlockHash{hash_lo, hash_hi}, first, salt, tokens})) {
    gone.emplace_back(h.hi, h.lo);
  }
  return gone;
}
void Scheduler::check_invariants() const { impl_->check_invariants(); }

}  // namespace vpage
