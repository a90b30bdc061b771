// The plan of one engine step: what runs, the block operations, and the flat model inputs.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "vpage/common.h"

namespace vpage {

/// A block of the CPU pool to write to the disk tier, as the file named by its key.
struct KvBlockSave {
  BlockId cpu_block = -1;
  uint64_t hash_hi = 0, hash_lo = 0;  ///< its key
  bool first = false;                 ///< a sequence's first block: `salt` is its cache salt
  std::string salt;
  std::vector<TokenId> tokens;        ///< [block_size]
};

/// A block to read from the disk tier into the CPU pool.
struct KvBlockLoad {
  uint64_t hash_hi = 0, hash_lo = 0;
  BlockId cpu_block = -1;
};

/// Output of Scheduler::schedule(). Rows ("computing sequences") are the sequences that
/// compute at least one token this step; tokens are flattened over rows with no padding.
/// The engine performs disk saves, swap-out, disk loads, swap-in and copies (in that order)
/// before the forward.
struct SchedulePlan {
  int64_t step_id = 0;

  // Per computing sequence (num_seqs rows).
  std::vector<SeqId> seq_ids;               ///< [num_seqs]
  std::vector<int32_t> query_start_loc;     ///< [num_seqs + 1] token offsets of each row
  std::vector<int32_t> context_lens;        ///< [num_seqs] tokens in cache after this step
  std::vector<int32_t> lora_ids;            ///< [num_seqs] LoRA adapter of each row (0: the base model)
  /// [num_seqs, max_blocks] row-major, padded with 0; with a sliding window the entries of
  /// blocks wholly before the window of a row's first query are -1 (never read).
  std::vector<int32_t> block_tables;
  int32_t max_blocks = 0;                   ///< columns of block_tables
  int32_t max_context_len = 0;
  int32_t max_query_len = 0;                ///< 1 for a decode-only step

  // Per token (num_tokens entries).
  std::vector<int64_t> input_ids;           ///< [num_tokens]
  std::vector<int64_t> positions;           ///< [num_tokens]
  std::vector<int64_t> slot_mapping;        ///< [num_tokens] block_id * block_size + offset

  // Sequences that get a new token after this step, and the token row whose logits they
  // sample from (several sequences can share a row: n samples of one prompt).
  std::vector<SeqId> sample_seq_ids;        ///< [num_samples]
  std::vector<int64_t> sample_token_indices;  ///< [num_samples] index into the token arrays
  /// [num_samples] draft tokens verified with each sample (speculative decoding, else 0):
  /// a sample with d drafts has them at token indices [index - d + 1, index] and samples
  /// from the logits of tokens [index - d, index], one per position.
  std::vector<int32_t> sample_num_drafts;

  std::vector<BlockPair> blocks_to_swap_out;  ///< (gpu, cpu)
  std::vector<BlockPair> blocks_to_swap_in;   ///< (cpu, gpu)
  std::vector<BlockPair> blocks_to_copy;      ///< (src gpu, dst gpu) copy-on-write
  // The disk tier: CPU blocks to write out (before their blocks are reused), files to read
  // into CPU blocks (their requests are admitted once complete_kv_loads reports them), and
  // keys whose files to delete.
  std::vector<KvBlockSave> kv_saves;
  std::vector<KvBlockLoad> kv_loads;
  std::vector<std::pair<uint64_t, uint64_t>> kv_deletes;  ///< (hash_hi, hash_lo)

  /// Requests finished as ignored in this step, with the reason.
  std::vector<std::pair<std::string, std::string>> ignored;
  int32_t num_prefill_tokens = 0;  ///< tokens of rows computing more than one token
  int32_t num_decode_tokens = 0;   ///< tokens of one-token rows and of draft-carrying rows
  int32_t num_draft_tokens = 0;    ///< draft tokens among the decode tokens
  int32_t num_preempted_recompute = 0;
  int32_t num_preempted_swap = 0;

  int32_t num_seqs() const { return static_cast<int32_t>(seq_ids.size()); }
  int32_t num_tokens() const { return static_cast<int32_t>(input_ids.size()); }
  bool empty() const { return seq_ids.empty(); }
  /// Empties every field, keeping the capacity (plans are reused when nobody holds them).
  void clear();
};

/// What commit() did to the sequences it was given tokens for.
struct CommitResult {
  std::vector<int32_t> statuses;  ///< per given (seq, token): SequenceStatus after commit
  /// Per given (seq, token): the token id when it is one of the request's stop_token_ids
  /// and finished the sequence in this commit (vLLM's stop_reason), else -1 (EOS too).
  std::vector<int32_t> stop_token_ids;
  std::vector<std::string> finished_request_ids;  ///< groups that finished in this commit
};

}  // namespace vpage
