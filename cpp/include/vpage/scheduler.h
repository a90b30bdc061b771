// Continuous-batching scheduler: FCFS queues, token budget, chunked prefill, preemption.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "vpage/block_manager.h"
#include "vpage/schedule_plan.h"
#include "vpage/sequence.h"

namespace vpage {

/// How a running group is preempted when blocks run out.
enum class PreemptionMode : int32_t {
  kAuto = 0,       ///< recompute single-sequence groups, swap others (recompute if no CPU room)
  kRecompute = 1,  ///< always free the blocks and recompute later
  kSwap = 2,       ///< always swap to the CPU pool (recompute if no CPU room)
};

/// Budgets and policies of the scheduler.
struct SchedulerConfig {
  int32_t max_num_batched_tokens = 2048;  ///< tokens computed per step at most
  int32_t max_num_seqs = 256;             ///< running sequences at most
  int32_t max_model_len = 2048;           ///< prompt + output tokens at most
  bool enable_chunked_prefill = true;     ///< split prompts across steps under the budget
  PreemptionMode preemption_mode = PreemptionMode::kAuto;
};

/// Running totals kept by the scheduler.
struct SchedulerStats {
  int64_t num_steps = 0;
  int64_t num_preempted_recompute = 0;
  int64_t num_preempted_swap = 0;
  int64_t num_prefill_tokens = 0;  ///< tokens computed in rows of more than one token
  int64_t num_decode_tokens = 0;
  int64_t num_cached_prompt_tokens = 0;  ///< prompt tokens served by the prefix cache
};

/// Owns the sequence groups and the block manager. schedule() plans one step (it moves
/// groups between queues and assigns blocks, so the plan's block operations must be carried
/// out); only commit() changes tokens and computed counts, so a step whose forward fails
/// can simply be scheduled again. Not thread-safe.
///
/// Error contract (every call): bad input from the caller throws CheckError (a
/// std::logic_error) before anything changes, so the Scheduler is exactly as it was
/// (strong guarantee) and stays usable: add_sequence_group, commit, fork_sequence and
/// finish_sequence work this way. schedule() takes no input; it throws only when an
/// internal invariant is broken (a bug), after which the Scheduler must be discarded.
/// Calls that look a request up by id return a "not found" value (false, nullptr) rather
/// than throwing.
class Scheduler {
 public:
  Scheduler(const SchedulerConfig& config, const BlockManagerConfig& block_config);

  /// Adds request `request_id` (unique among unfinished requests) with `num_seqs`
  /// sequences over `prompt` (n or best_of samples, or beams). Returns their ids. Throws
  /// CheckError (nothing added) on an empty prompt, num_seqs < 1, max_tokens < 1,
  /// min_tokens outside [0, max_tokens] or an id in use. Requests share prefix-cache
  /// blocks only when their `cache_salt`s are equal.
  std::vector<SeqId> add_sequence_group(const std::string& request_id,
                                        std::vector<TokenId> prompt, int32_t num_seqs,
                                        const StopConditions& stop, double arrival_time,
                                        const std::string& cache_salt = "");
  /// Finishes the request as aborted from whichever queue holds it and frees its blocks.
  /// Returns false when no unfinished request has that id.
  bool abort(const std::string& request_id);

  /// Plans the next step. The caller may keep the returned plan; the Scheduler reuses its
  /// buffers only when nobody else holds it. Throws only on a broken internal invariant
  /// (then discard the Scheduler).
  std::shared_ptr<const SchedulePlan> schedule();
  /// Records the last planned step: advances computed counts of every scheduled sequence
  /// and appends `token_ids[i]` to `seq_ids[i]` ([count] arrays, borrowed for the call;
  /// sequences aborted or finished meanwhile are skipped and reported as aborted or with
  /// their status), then applies EOS / stop tokens / max_tokens / max_model_len. Finished
  /// groups free their blocks and are removed. Throws CheckError, changing nothing (the
  /// step can still be committed correctly), when an id was never issued or is given
  /// twice, a token id is negative, or a live sequence was not scheduled to sample.
  CommitResult commit(const SeqId* seq_ids, const TokenId* token_ids, int64_t count);

  /// New sequence in `parent`'s group sharing its tokens and blocks (beam search). Called
  /// between schedule() and commit(), the child also takes the parent's pending step.
  /// Throws CheckError (nothing changed) when `parent` is unknown or finished.
  SeqId fork_sequence(SeqId parent);
  /// Finishes one sequence (e.g. a stop string matched in Python) with a finished status.
  /// Returns true when that finished its whole group (which is then removed). Throws
  /// CheckError (nothing changed) for an unfinished `status` or an unknown sequence.
  bool finish_sequence(SeqId seq_id, SequenceStatus status);

  int32_t num_waiting() const { return static_cast<int32_t>(waiting_.size()); }
  int32_t num_running() const { return static_cast<int32_t>(running_.size()); }
  int32_t num_swapped() const { return static_cast<int32_t>(swapped_.size()); }
  bool has_unfinished() const { return !groups_.empty(); }
  /// Tokens whose K/V the running sequences hold in the GPU pool (a prompt shared by
  /// identical samples counted once): with used blocks, the KV-cache utilization.
  int64_t num_kv_tokens() const;
  /// The unfinished group `request_id`, or nullptr. The pointer is borrowed: it dangles
  /// once the group finishes or is aborted (any commit, abort, finish_sequence or schedule
  /// may do that); keep `find_group(id)->snapshot()` to read it later.
  const SequenceGroup* find_group(const std::string& request_id) const;
  /// The sequence `seq_id` of an unfinished group, or nullptr; borrowed like find_group's.
  const Sequence* find_sequence(SeqId seq_id) const;

  const SchedulerConfig& config() const { return config_; }
  const BlockManager& block_manager() const { return blocks_; }
  const SchedulerStats& stats() const { return stats_; }

  /// Throws CheckError unless: each group is in exactly one queue with matching statuses;
  /// waiting groups hold no blocks, running ones only GPU blocks, swapped ones only CPU
  /// blocks; finished sequences hold none; the pools match the tables.
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
  // Status of `seq` after appending `token`: kRunning or why it finished.
  // Throws CheckError unless commit(seq_ids, token_ids, count) can be applied whole.
  void check_commit(const SeqId* seq_ids, const TokenId* token_ids, int64_t count) const;
  SequenceStatus status_after_token(const SequenceGroup& group, const Sequence& seq,
                                    TokenId token) const;
  // What one schedule() can still hand out; its phases draw on it in turn.
  struct StepBudget {
    int32_t tokens = 0;      // tokens left to compute in this step
    int32_t num_seqs = 0;    // unfinished sequences of running groups (<= max_num_seqs)
    bool preempted = false;  // this step preempted a group: nothing swapped or new is admitted
  };
  // The phases of schedule(), in order.
  void schedule_running(StepBudget& budget, class StepBuilder& step, SchedulePlan& plan);
  void schedule_swapped(StepBudget& budget, StepBuilder& step, SchedulePlan& plan);
  void schedule_prefills(StepBudget& budget, StepBuilder& step);
  void schedule_waiting(StepBudget& budget, StepBuilder& step, SchedulePlan& plan);
  // Schedules as many of the group's uncomputed tokens as the budget allows.
  void schedule_group(SequenceGroup& group, StepBudget& budget, StepBuilder& step);
  // Moves a group into the running queue (arrival order) and counts its sequences.
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
};

}  // namespace vpage
