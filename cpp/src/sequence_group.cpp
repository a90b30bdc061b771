#include "sequence_group.h"

#include <utility>

namespace vpage {

const char* status_name(SequenceStatus status) {
  switch (status) {
    case SequenceStatus::kWaiting: return "waiting";
    case SequenceStatus::kRunning: return "running";
    case SequenceStatus::kSwapped: return "swapped";
    case SequenceStatus::kFinishedStopped: return "stop";
    case SequenceStatus::kFinishedLength: return "length";
    case SequenceStatus::kFinishedAborted: return "abort";
    case SequenceStatus::kFinishedIgnored: return "ignored";
  }
  return "unknown";
}

Sequence::Sequence(SeqId seq_id, std::vector<TokenId> prompt)
    : seq_id_(seq_id), tokens_(std::move(prompt)), prompt_len_(static_cast<int32_t>(tokens_.size())) {
  VPAGE_CHECK(prompt_len_ > 0, "a sequence needs at least one prompt token");
}

SequenceSnapshot Sequence::snapshot() const {
  return SequenceSnapshot{seq_id_, status_, tokens_, prompt_len_, num_computed_, block_table_, block_device_,
                          stop_token_};
}

SequenceGroupSnapshot SequenceGroup::snapshot() const {
  SequenceGroupSnapshot s{request_id_, arrival_time_, num_unfinished(), num_preemptions_, num_cached_tokens_, {}};
  for (const auto& seq : seqs_) s.seqs.push_back(seq->snapshot());
  return s;
}

SequenceGroup::SequenceGroup(std::string request_id, double arrival_time, StopConditions stop,
                             std::string cache_salt, const BlockHash& cache_salt_hash, bool speculate,
                             int32_t lora_id)
    : request_id_(std::move(request_id)), arrival_time_(arrival_time), stop_(std::move(stop)),
      cache_salt_(std::move(cache_salt)), cache_salt_hash_(cache_salt_hash), speculate_(speculate), lora_id_(lora_id) {}

int32_t SequenceGroup::num_unfinished() const {
  int32_t count = 0;
  for (const auto& s : seqs_) count += !vpage::is_finished(s->status());
  return count;
}

}  // namespace vpage
