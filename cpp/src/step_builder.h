// Internal: fills a SchedulePlan's flat model inputs row by row.
#pragma once

#include <utility>
#include <vector>

#include "vpage/schedule_plan.h"
#include "sequence_group.h"

namespace vpage {

/// Appends rows (a sequence computing some of its tokens) to a plan, then writes the block
/// table matrix once every row is known. Sequences must outlive finish().
class StepBuilder {
 public:
  StepBuilder(SchedulePlan& plan, int32_t block_size) : plan_(plan), block_size_(block_size) {}

  /// Row for `seq` computing `num_tokens` tokens from its first uncomputed one (its draft
  /// tokens, when it has any, follow its tokens and must all be in the row).
  /// `lora_id`: the adapter of its request. Returns the flat index of the row's last token.
  int64_t add_row(const Sequence& seq, int32_t num_tokens, int32_t lora_id = 0);
  /// `seq_id` samples its next token from the logits of token `token_index`, verifying the
  /// `num_drafts` draft tokens that end there.
  void add_sample(SeqId seq_id, int64_t token_index, int32_t num_drafts = 0);
  /// Writes block_tables / max_blocks.
  void finish();

 private:
  SchedulePlan& plan_;
  int32_t block_size_;
  std::vector<const Sequence*> rows_;
};

}  // namespace vpage
