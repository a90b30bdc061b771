// Internal: sequences (one stream of tokens with its block table) and sequence groups (one
// request), the state the scheduler and the block manager share.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "draft_policy.h"
#include "prefix_hash.h"
#include "vpage/common.h"
#include "vpage/sequence.h"

namespace vpage {

/// One token stream and its KV blocks. Tokens = prompt followed by generated tokens;
/// tokens [0, num_computed_tokens) have their K/V in the cache.
class Sequence {
 public:
  Sequence(SeqId seq_id, std::vector<TokenId> prompt);

  SeqId seq_id() const { return seq_id_; }
  SequenceStatus status() const { return status_; }
  int32_t num_tokens() const { return static_cast<int32_t>(tokens_.size()); }
  int32_t prompt_len() const { return prompt_len_; }
  int32_t num_output_tokens() const { return num_tokens() - prompt_len_; }
  int32_t num_computed_tokens() const { return num_computed_; }
  /// Tokens still to compute before a new token can be sampled.
  int32_t num_uncomputed_tokens() const { return num_tokens() - num_computed_; }
  /// Draft tokens of the planned step (computed after the uncomputed ones), usually none.
  const std::vector<TokenId>& draft_tokens() const { return draft_tokens_; }
  const std::vector<TokenId>& tokens() const { return tokens_; }
  /// Token that stopped the sequence (EOS or a stop token id), or -1.
  TokenId stop_token() const { return stop_token_; }

  /// Physical blocks, logical order; in the GPU pool unless the sequence is swapped out.
  const std::vector<BlockId>& block_table() const { return block_table_; }
  /// Pool of the blocks in block_table().
  Device block_device() const { return block_device_; }
  SequenceSnapshot snapshot() const;

 private:
  friend class BlockManager;
  friend class SchedulerImpl;

  SeqId seq_id_;
  std::vector<TokenId> tokens_;
  int32_t prompt_len_;
  int32_t num_computed_ = 0;
  SequenceStatus status_ = SequenceStatus::kWaiting;
  TokenId stop_token_ = -1;
  // Draft tokens the planned step computes after tokens_ (speculative decoding); they hold
  // slots in block_table_ until commit() accepts or drops them.
  std::vector<TokenId> draft_tokens_;
  // How often this sequence's drafts are kept, and while drafting does not pay at that rate,
  // the decode steps left before the next one-token probe and the gap after it (see
  // SchedulerImpl::propose_drafts).
  DraftAcceptance draft_acceptance_;
  int32_t draft_skip_ = 0;
  int32_t probe_gap_ = 0;
  std::vector<BlockId> block_table_;
  Device block_device_ = Device::kGpu;
  std::vector<BlockHash> block_hashes_;  // chained hashes of full blocks of tokens_
  // Per leading block offered to the prefix cache: the content id of the cache entry that
  // holds it (kNoContent when none does, or not known yet for a block another sequence of
  // the group computes).
  std::vector<uint64_t> block_cids_;
};

/// One request: `n`/`best_of` samples or beams over one prompt, scheduled together.
class SequenceGroup {
 public:
  SequenceGroup(std::string request_id, double arrival_time, StopConditions stop,
                std::string cache_salt, const BlockHash& cache_salt_hash, bool speculate, int32_t lora_id = 0);
  SequenceGroup(const SequenceGroup&) = delete;
  SequenceGroup& operator=(const SequenceGroup&) = delete;

  const std::string& request_id() const { return request_id_; }
  double arrival_time() const { return arrival_time_; }
  int32_t num_seqs() const { return static_cast<int32_t>(seqs_.size()); }
  Sequence& seq(int32_t i) { return *seqs_[i]; }
  const Sequence& seq(int32_t i) const { return *seqs_[i]; }
  /// Sequences that have not finished.
  int32_t num_unfinished() const;
  bool is_finished() const { return num_unfinished() == 0; }
  /// Number of preemptions this group went through.
  int32_t num_preemptions() const { return num_preemptions_; }
  /// Prompt tokens served from the prefix cache at the last admission.
  int32_t num_cached_prompt_tokens() const { return num_cached_tokens_; }
  /// The LoRA adapter the request runs under (0: the base model).
  int32_t lora_id() const { return lora_id_; }
  SequenceGroupSnapshot snapshot() const;

 private:
  friend class BlockManager;
  friend class SchedulerImpl;

  std::string request_id_;
  double arrival_time_;
  StopConditions stop_;
  std::string cache_salt_;
  BlockHash cache_salt_hash_;
  std::vector<std::unique_ptr<Sequence>> seqs_;
  // Diverged sequences re-admitted after a recompute share the blocks of their first
  // shared_len_ tokens: the first unfinished sequence computes them while the others, which
  // start at shared_len_, wait (0 when nothing is shared that way).
  int32_t shared_len_ = 0;
  // All unfinished sequences hold identical tokens and one set of blocks (a fresh prompt):
  // only the first unfinished one computes; the others follow its progress and sample from
  // its last row. Cleared when the first tokens are sampled.
  bool identical_ = true;
  int32_t num_preemptions_ = 0;
  int32_t num_cached_tokens_ = 0;
  bool speculate_ = true;  // may get draft tokens
  int32_t lora_id_ = 0;
  bool disk_fetched_ = false;  // its prompt's disk blocks were read for this admission
  std::vector<BlockId> loading_blocks_;  // CPU blocks of those reads, until they finish
  int64_t last_step_ = -1;  // last step that scheduled this group
};

}  // namespace vpage
