// What a caller tells the scheduler about a request's end (stop conditions) and reads back
// about its sequences (statuses, snapshots).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "vpage/common.h"

namespace vpage {

/// Lifecycle of a sequence. The finished states say why it ended.
enum class SequenceStatus : int32_t {
  kWaiting = 0,
  kRunning = 1,
  kSwapped = 2,
  kFinishedStopped = 3,  ///< EOS, a stop token, or a stop string (from Python)
  kFinishedLength = 4,   ///< max_tokens or max_model_len reached
  kFinishedAborted = 5,  ///< abort(request_id)
  kFinishedIgnored = 6,  ///< the prompt can never be scheduled (too long for the model or pool)
};

/// True for the kFinished* statuses.
inline bool is_finished(SequenceStatus status) {
  return static_cast<int32_t>(status) >= static_cast<int32_t>(SequenceStatus::kFinishedStopped);
}

/// Name of a status as vLLM spells finish reasons ("stop", "length", "abort", "ignored"),
/// or the state name for unfinished statuses.
const char* status_name(SequenceStatus status);

/// When the C++ side finishes a sequence by itself (stop strings are checked in Python).
struct StopConditions {
  int32_t max_tokens = 16;  ///< new tokens at most (>= 1)
  int32_t min_tokens = 0;   ///< EOS and stop tokens do not stop before this many new tokens
  std::vector<TokenId> eos_token_ids;
  std::vector<TokenId> stop_token_ids;
  bool ignore_eos = false;
};

/// A copy of one sequence's state, safe to keep after its request ends.
struct SequenceSnapshot {
  SeqId seq_id = -1;
  SequenceStatus status = SequenceStatus::kWaiting;
  std::vector<TokenId> tokens;  ///< prompt followed by generated tokens
  int32_t prompt_len = 0;
  int32_t num_computed_tokens = 0;   ///< leading tokens whose K/V are in the cache
  std::vector<BlockId> block_table;  ///< physical blocks in logical order, in block_device's pool
  Device block_device = Device::kGpu;
  TokenId stop_token = -1;           ///< EOS or stop token id that finished it, else -1
};

/// A copy of one request's state (its sequences included), safe to keep after it ends.
struct SequenceGroupSnapshot {
  std::string request_id;
  double arrival_time = 0.0;
  int32_t num_unfinished = 0;
  int32_t num_preemptions = 0;
  int32_t num_cached_prompt_tokens = 0;  ///< served by the prefix cache at the last admission
  std::vector<SequenceSnapshot> seqs;
};

}  // namespace vpage
