#include "vpage/sequence.h"

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

int32_t Sequence::num_filled_in_last_block(int32_t block_size) const {
  if (tokens_.empty()) return 0;
  return (num_tokens() - 1) % block_size + 1;
}

SequenceGroup::SequenceGroup(std::string request_id, double arrival_time, StopConditions stop,
                             uint64_t cache_salt_hash)
    : request_id_(std::move(request_id)), arrival_time_(arrival_time), stop_(std::move(stop)),
      cache_salt_hash_(cache_salt_hash) {}

int32_t SequenceGroup::num_unfinished() const {
  int32_t count = 0;
  for (const auto& s : seqs_) count += !vpage::is_finished(s->status());
  return count;
}

}  // namespace vpage
