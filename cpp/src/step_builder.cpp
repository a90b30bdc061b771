#include "step_builder.h"

#include <algorithm>

namespace vpage {

void SchedulePlan::clear() {
  step_id = 0;
  seq_ids.clear();
  query_start_loc.clear();
  context_lens.clear();
  lora_ids.clear();
  block_tables.clear();
  max_blocks = max_context_len = max_query_len = 0;
  input_ids.clear();
  positions.clear();
  slot_mapping.clear();
  sample_seq_ids.clear();
  sample_token_indices.clear();
  sample_num_drafts.clear();
  blocks_to_swap_out.clear();
  blocks_to_swap_in.clear();
  blocks_to_copy.clear();
  kv_saves.clear();
  kv_loads.clear();
  kv_deletes.clear();
  ignored.clear();
  num_prefill_tokens = num_decode_tokens = num_draft_tokens = 0;
  num_preempted_recompute = num_preempted_swap = 0;
}

int64_t StepBuilder::add_row(const Sequence& seq, int32_t num_tokens, int32_t lora_id) {
  if (plan_.query_start_loc.empty()) plan_.query_start_loc.push_back(0);
  const int32_t start = seq.num_computed_tokens();
  const int32_t end = start + num_tokens;
  const auto& tokens = seq.tokens();
  const auto& drafts = seq.draft_tokens();
  const auto& table = seq.block_table();
  VPAGE_CHECK(static_cast<int64_t>(table.size()) * block_size_ >= end,
              "sequence " << seq.seq_id() << " has no slot for token " << end - 1);
  VPAGE_CHECK(drafts.empty() || end == seq.num_tokens() + static_cast<int32_t>(drafts.size()),
              "sequence " << seq.seq_id() << " computes only part of its drafts");
  for (int32_t pos = start; pos < end; ++pos) {
    plan_.input_ids.push_back(pos < seq.num_tokens() ? tokens[pos] : drafts[pos - seq.num_tokens()]);
    plan_.positions.push_back(pos);
    plan_.slot_mapping.push_back(static_cast<int64_t>(table[pos / block_size_]) * block_size_ +
                                 pos % block_size_);
  }
  plan_.seq_ids.push_back(seq.seq_id());
  plan_.query_start_loc.push_back(static_cast<int32_t>(plan_.input_ids.size()));
  plan_.context_lens.push_back(end);
  plan_.lora_ids.push_back(lora_id);
  plan_.max_context_len = std::max(plan_.max_context_len, end);
  plan_.max_query_len = std::max(plan_.max_query_len, num_tokens);
  (num_tokens > 1 && drafts.empty() ? plan_.num_prefill_tokens : plan_.num_decode_tokens) += num_tokens;
  plan_.num_draft_tokens += static_cast<int32_t>(drafts.size());
  rows_.push_back(&seq);
  return static_cast<int64_t>(plan_.input_ids.size()) - 1;
}

void StepBuilder::add_sample(SeqId seq_id, int64_t token_index, int32_t num_drafts) {
  plan_.sample_seq_ids.push_back(seq_id);
  plan_.sample_token_indices.push_back(token_index);
  plan_.sample_num_drafts.push_back(num_drafts);
}

void StepBuilder::finish() {
  if (plan_.query_start_loc.empty()) plan_.query_start_loc.push_back(0);
  int32_t max_blocks = 0;
  for (int32_t len : plan_.context_lens) max_blocks = std::max(max_blocks, (len + block_size_ - 1) / block_size_);
  plan_.max_blocks = max_blocks;
  plan_.block_tables.assign(rows_.size() * static_cast<size_t>(max_blocks), 0);
  for (size_t r = 0; r < rows_.size(); ++r) {
    const auto& table = rows_[r]->block_table();
    const int32_t used = (plan_.context_lens[r] + block_size_ - 1) / block_size_;
    std::copy(table.begin(), table.begin() + used, plan_.block_tables.begin() + r * max_blocks);
  }
}

}  // namespace vpage
