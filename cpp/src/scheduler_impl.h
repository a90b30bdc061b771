// Internal: the state behind vpage::Scheduler (queues, groups, block manager, pending step)
// and the rules of each call; scheduler.h documents the calls.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "block_manager.h"
#include "draft_policy.h"
#include "sequence_group.h"
#include "vpage/scheduler.h"

namespace vpage {

class StepBuilder;

class SchedulerImpl {
 public:
  SchedulerImpl(const SchedulerConfig& config, const BlockManagerConfig& block_config);

  std::vector<SeqId> add_sequence_group(const std::string& request_id,
                                        std::vector<TokenId> prompt, int32_t num_seqs,
                                        const StopConditions& stop, double arrival_time,
                                        const std::string& cache_salt, bool speculate, int32_t lora_id);
  bool abort(const std::string& request_id);
  std::shared_ptr<const SchedulePlan> schedule();
  CommitResult commit(const SeqId* seq_ids, const TokenId* token_ids, int64_t count);
  void fill_drafts(const TokenId* tokens, int64_t count);
  SeqId fork_sequence(SeqId parent);
  bool finish_sequence(SeqId seq_id, SequenceStatus status);

  int32_t num_waiting() const { return static_cast<int32_t>(waiting_.size()); }
  int32_t num_running() const { return static_cast<int32_t>(running_.size()); }
  int32_t num_swapped() const { return static_cast<int32_t>(swapped_.size()); }
  bool has_unfinished() const { return !groups_.empty(); }
  void observe_step_time(double seconds);
  int64_t num_kv_tokens() const;
  std::optional<SequenceGroupSnapshot> find_group(const std::string& request_id) const;
  std::optional<SequenceSnapshot> find_sequence(SeqId seq_id) const;

  const SchedulerConfig& config() const { return config_; }
  const BlockManager& block_manager() const { return blocks_; }
  BlockManager& block_manager() { return blocks_; }
  std::vector<KvCacheEvent> take_kv_events() { return blocks_.take_events(); }
  bool reset_prefix_cache() { return blocks_.reset_prefix_cache(); }
  const SchedulerStats& stats() const { return stats_; }
  void check_invariants() const;

 private:
  struct SeqRef {
    Sequence* seq;
    SequenceGroup* group;
  };
  SequenceGroup* group_of(const std::string& request_id) const;
  void set_status(SequenceGroup& group, SequenceStatus status);
  void finish_seq(SequenceGroup& group, Sequence& seq, SequenceStatus status);
  void remove_group(SequenceGroup& group);
  void preempt(SequenceGroup& group, SchedulePlan& plan);
  void ignore(SequenceGroup& group, const std::string& reason, SchedulePlan& plan);
  // Throws CheckError unless commit(seq_ids, token_ids, count) can be applied whole.
  void check_commit(const SeqId* seq_ids, const TokenId* token_ids, int64_t count) const;
  // Status of `seq` after appending `token`: kRunning or why it finished.
  SequenceStatus status_after_token(const SequenceGroup& group, const Sequence& seq,
                                    TokenId token) const;
  // What one schedule() can still hand out; its phases draw on it in turn.
  struct StepBudget {
    int32_t tokens = 0;      // tokens left to compute in this step
    int32_t num_seqs = 0;    // unfinished sequences of running groups (<= max_num_seqs)
    bool preempted = false;  // this step preempted a group: nothing swapped or new is admitted
    bool speculate = false;  // decoding sequences may get draft tokens in this step
    std::vector<int32_t> loras;  // distinct adapters (lora_id > 0) of the running groups
  };
  // Whether `group` may join the running groups without exceeding max_loras distinct adapters.
  bool lora_fits(const SequenceGroup& group, const StepBudget& budget) const;
  // The phases of schedule(), in order.
  void schedule_running(StepBudget& budget, StepBuilder& step, SchedulePlan& plan);
  void schedule_swapped(StepBudget& budget, StepBuilder& step, SchedulePlan& plan);
  void schedule_prefills(StepBudget& budget, StepBuilder& step);
  void schedule_waiting(StepBudget& budget, StepBuilder& step, SchedulePlan& plan);
  // Gives each sequence of a decoding group the draft tokens that pay at its acceptance rate
  // and fit its limits and the budget (none when nothing matches).
  void propose_drafts(SequenceGroup& group, const StepBudget& budget);
  static constexpr int32_t kMaxProbeGap = 32;  // decode steps between probes at most
  // Schedules as many of the group's uncomputed tokens (and drafts) as the budget allows.
  void schedule_group(SequenceGroup& group, StepBudget& budget, StepBuilder& step);
  // Moves a group into the running queue (arrival order) and counts its sequences (and adapter).
  void make_running(SequenceGroup& group, StepBudget& budget);
  // Preempts running_[index] (it leaves the queue).
  void preempt_running(size_t index, StepBudget& budget, SchedulePlan& plan);
  // Can a waiting group of `len` tokens be admitted: kNever with the reason, or the pool's answer.
  AllocStatus admission_status(SequenceGroup& group, int32_t len, std::string& reason);
  // Every unfinished sequence computes exactly one token (no prompt left).
  static bool is_decode(const SequenceGroup& group);
  bool scheduled_now(const SequenceGroup& group) const { return group.last_step_ == plan_->step_id; }

  SchedulerConfig config_;
  BlockManager blocks_;
  std::deque<SequenceGroup*> waiting_;
  std::vector<SequenceGroup*> running_;
  std::deque<SequenceGroup*> swapped_;
  std::unordered_map<std::string, std::unique_ptr<SequenceGroup>> groups_;
  std::unordered_map<SeqId, SeqRef> seqs_;
  std::shared_ptr<SchedulePlan> plan_;
  // Tokens each sequence of the last plan computes (followers included); applied by commit().
  std::vector<std::pair<SeqId, int32_t>> pending_;
  SeqId next_seq_id_ = 0;
  int64_t next_step_id_ = 0;
  SchedulerStats stats_;
  // What a decode step's rows cost here; the sequences and drafts of the last plan when it
  // was a decode step (no sequences otherwise, or once observed).
  StepCostModel step_costs_;
  int32_t last_decode_seqs_ = 0;
  int32_t last_decode_drafts_ = 0;
};

}  // namespace vpage
