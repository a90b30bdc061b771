// Continuous-batching scheduler: FCFS queues, token budget, chunked prefill, preemption.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "vpage/block_config.h"
#include "vpage/common.h"
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
  /// Speculative decoding by n-gram prompt lookup: draft tokens a decoding sequence may add
  /// to its row, verified by the same forward (0: off). See SchedulePlan::sample_num_drafts.
  int32_t num_speculative_tokens = 0;
  int32_t prompt_lookup_min = 5;  ///< shortest suffix n-gram looked up (>= 1)
  int32_t prompt_lookup_max = 5;  ///< longest suffix n-gram looked up (>= prompt_lookup_min)
  /// No drafts in a step that starts with more running sequences than this (0: no limit).
  int32_t speculative_disable_by_batch_size = 0;
  /// Drafts come from the caller (a draft model), not from n-gram lookup: a decoding
  /// sequence gets num_speculative_tokens placeholder drafts (within its limits), which
  /// fill_drafts() replaces before the forward.
  bool external_drafts = false;
  /// Distinct LoRA adapters among the running requests at most (0: no limit). A waiting or
  /// swapped request whose adapter would exceed it waits, and the requests behind it may go
  /// first; requests of the base model (lora_id 0) never count.
  int32_t max_loras = 0;
};

/// Running totals kept by the scheduler.
struct SchedulerStats {
  int64_t num_steps = 0;
  int64_t num_preempted_recompute = 0;
  int64_t num_preempted_swap = 0;
  int64_t num_prefill_tokens = 0;  ///< tokens computed in rows of more than one token
  int64_t num_decode_tokens = 0;
  int64_t num_cached_prompt_tokens = 0;  ///< prompt tokens served by the prefix cache
  int64_t num_drafts = 0;        ///< rows that carried draft tokens
  int64_t num_draft_tokens = 0;  ///< draft tokens planned
  int64_t num_accepted_tokens = 0;  ///< draft tokens accepted by commit()
};

class SchedulerImpl;  // the state and its rules, in the library's sources

/// Owns the sequence groups and the KV block pools. schedule() plans one step (it moves
/// groups between queues and assigns blocks, so the plan's block operations must be carried
/// out); only commit() changes tokens and computed counts, so a step whose forward fails
/// can simply be scheduled again. Not thread-safe. Movable, not copyable; a moved-from
/// Scheduler may only be destroyed or assigned to.
///
/// Error contract (every call): bad input from the caller throws CheckError (a
/// std::logic_error) before anything changes, so the Scheduler is exactly as it was
/// (strong guarantee) and stays usable: add_sequence_group, commit, fork_sequence and
/// finish_sequence work this way. schedule() takes no input; it throws only when an
/// internal invariant is broken (a bug), after which the Scheduler must be discarded.
/// Calls that look a request up by id return a "not found" value (false, std::nullopt)
/// rather than throwing.
class Scheduler {
 public:
  /// Throws CheckError when a budget of `config` is not positive.
  Scheduler(const SchedulerConfig& config, const BlockManagerConfig& block_config);
  ~Scheduler();
  Scheduler(Scheduler&&) noexcept;
  Scheduler& operator=(Scheduler&&) noexcept;

  /// Adds request `request_id` (unique among unfinished requests) with `num_seqs`
  /// sequences over `prompt` (n or best_of samples, or beams). Returns their ids. Throws
  /// CheckError (nothing added) on an empty prompt, num_seqs < 1, max_tokens < 1,
  /// min_tokens outside [0, max_tokens] or an id in use. Requests share prefix-cache
  /// blocks only when their `cache_salt`s are equal. With `speculate` false the request
  /// never gets draft tokens (beam search, grammars: whatever cannot verify several tokens).
  /// `lora_id` (> 0) names the LoRA adapter the request runs under (SchedulePlan::lora_ids;
  /// SchedulerConfig::max_loras); it does not key the prefix cache: a caller folds it into
  /// `cache_salt`. Throws CheckError for a negative lora_id.
  std::vector<SeqId> add_sequence_group(const std::string& request_id,
                                        std::vector<TokenId> prompt, int32_t num_seqs,
                                        const StopConditions& stop, double arrival_time,
                                        const std::string& cache_salt = "", bool speculate = true,
                                        int32_t lora_id = 0);
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
  /// their status), then applies EOS / stop tokens / max_tokens / max_model_len token by
  /// token. A sequence that was planned with d draft tokens may be given m <= d + 1
  /// consecutive entries: its first m - 1 drafts were accepted (they must be given as
  /// planned) and the last entry is the verified token after them; the K/V of the rejected
  /// drafts is dropped (computed count rolled back, lookahead blocks freed), and tokens after
  /// one that finishes the sequence are not appended. Finished groups free their blocks and
  /// are removed. Throws CheckError, changing nothing (the step can still be committed
  /// correctly), when an id was never issued or is given twice apart, a token id is
  /// negative, a live sequence was not scheduled to sample, or drafts are given wrongly.
  CommitResult commit(const SeqId* seq_ids, const TokenId* token_ids, int64_t count);
  /// With external_drafts, between schedule() and commit(): the draft tokens of the last
  /// plan, `count` == its num_draft_tokens of them in sample order (sample_num_drafts[i] for
  /// sample i), written into the sequences and into the plan's input_ids. Throws CheckError
  /// (nothing changed) on a wrong count or a negative token.
  void fill_drafts(const TokenId* tokens, int64_t count);
  /// The wall time of the step last planned (from schedule() to its commit, forward
  /// included). Decode steps of different row counts tell the draft policy what a row
  /// costs against the rest of a step; other steps are ignored. Optional: without it a
  /// step's fixed cost is taken as two rows'.
  void observe_step_time(double seconds);

  /// New sequence in `parent`'s group sharing its tokens and blocks (beam search). Called
  /// between schedule() and commit(), the child also takes the parent's pending step.
  /// Throws CheckError (nothing changed) when `parent` is unknown or finished.
  SeqId fork_sequence(SeqId parent);
  /// Finishes one sequence (e.g. a stop string matched in Python) with a finished status.
  /// Returns true when that finished its whole group (which is then removed). Throws
  /// CheckError (nothing changed) for an unfinished `status` or an unknown sequence.
  bool finish_sequence(SeqId seq_id, SequenceStatus status);

  /// Groups in each queue.
  int32_t num_waiting() const;
  int32_t num_running() const;
  int32_t num_swapped() const;
  /// Whether any request is unfinished (in any queue).
  bool has_unfinished() const;
  /// Tokens whose K/V the running sequences hold in the GPU pool (a prompt shared by
  /// identical samples counted once; with a sliding window, from each one's first held
  /// block): with used blocks, the KV-cache utilization.
  int64_t num_kv_tokens() const;
  /// A copy of the unfinished group `request_id`, or std::nullopt; it stays readable after
  /// the request finishes or is aborted.
  std::optional<SequenceGroupSnapshot> find_group(const std::string& request_id) const;
  /// A copy of the sequence `seq_id` of an unfinished group, or std::nullopt.
  std::optional<SequenceSnapshot> find_sequence(SeqId seq_id) const;

  /// The configurations the Scheduler was built with.
  const SchedulerConfig& config() const;
  const BlockManagerConfig& block_config() const;
  /// Running totals since construction.
  const SchedulerStats& stats() const;
  /// Occupancy of both pools and the prefix-cache counters.
  BlockUsage usage() const;
  /// With BlockManagerConfig::enable_kv_cache_events (and prefix caching): the blocks that
  /// entered or left the GPU prefix cache since the last call, in order; else empty.
  std::vector<KvCacheEvent> take_kv_events();
  /// Empties the GPU prefix cache (vLLM's reset_prefix_cache) and its offloading tiers when no
  /// request holds GPU blocks (nothing running); returns false, changing nothing, otherwise.
  /// Later prompts miss until their blocks are computed again.
  bool reset_prefix_cache();
  /// The disk tier (BlockManagerConfig::num_disk_blocks): the kv_loads of earlier plans that
  /// finished, read (`done`) or not (`failed`: files missing, corrupt or of other content; the
  /// requests waiting for them compute those tokens instead). A request whose blocks are being
  /// read waits until each of its loads is reported here. Throws CheckError for a load not in
  /// flight.
  void complete_kv_loads(const std::vector<KvBlockLoad>& done, const std::vector<KvBlockLoad>& failed);
  /// The disk tier: indexes a block whose file an earlier engine wrote (its header's key, salt
  /// of a first block, tokens), as the most recent. Returns the keys pushed out of a full tier
  /// ((hash_hi, hash_lo)), whose files are to be deleted.
  std::vector<std::pair<uint64_t, uint64_t>> add_disk_block(uint64_t hash_hi, uint64_t hash_lo, bool first,
                                                            const std::string& salt,
                                                            const std::vector<TokenId>& tokens);

  /// Throws CheckError unless: each group is in exactly one queue with matching statuses;
  /// waiting groups hold no blocks, running ones only GPU blocks, swapped ones only CPU
  /// blocks; finished sequences hold none; the pools match the tables.
  void check_invariants() const;

 private:
  std::unique_ptr<SchedulerImpl> impl_;
};

}  // namespace vpage
