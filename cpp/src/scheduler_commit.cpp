// SchedulerImpl, recording a step: commit() (stop rules, accepted draft runs, rollback of
// rejected drafts) and fill_drafts().
#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "scheduler_impl.h"

namespace vpage {
namespace {

// Entries of a commit given to the sequence of entry i: it and the ones right after it with
// the same id (a speculating sequence's accepted drafts and its verified token).
int64_t run_length(const SeqId* seq_ids, int64_t count, int64_t i) {
  int64_t m = 1;
  while (i + m < count && seq_ids[i + m] == seq_ids[i]) ++m;
  return m;
}

}  // namespace

SequenceStatus SchedulerImpl::status_after_token(const SequenceGroup& group, const Sequence& seq,
                                                 TokenId token) const {
  const StopConditions& stop = group.stop_;
  const int32_t num_out = seq.num_output_tokens();
  if (num_out >= stop.min_tokens) {
    const auto has = [token](const std::vector<TokenId>& ids) {
      return std::find(ids.begin(), ids.end(), token) != ids.end();
    };
    if ((!stop.ignore_eos && has(stop.eos_token_ids)) || has(stop.stop_token_ids)) {
      return SequenceStatus::kFinishedStopped;
    }
  }
  if (num_out >= stop.max_tokens || seq.num_tokens() >= config_.max_model_len) {
    return SequenceStatus::kFinishedLength;
  }
  return SequenceStatus::kRunning;
}

void SchedulerImpl::check_commit(const SeqId* seq_ids, const TokenId* token_ids, int64_t count) const {
  VPAGE_CHECK(count >= 0 && (count == 0 || (seq_ids && token_ids)), "commit of " << count << " tokens without arrays");
  std::unordered_map<SeqId, int32_t> computing;  // tokens each sequence computes in this step
  for (const auto& [id, n] : pending_) computing[id] += n;
  std::unordered_set<SeqId> seen;
  for (int64_t i = 0, m = 1; i < count; i += m) {
    const SeqId id = seq_ids[i];
    m = run_length(seq_ids, count, i);
    VPAGE_CHECK(id >= 0 && id < next_seq_id_, "commit: sequence id " << id << " was never issued");
    VPAGE_CHECK(seen.insert(id).second, "commit: sequence " << id << " given twice");
    for (int64_t j = i; j < i + m; ++j) {
      VPAGE_CHECK(token_ids[j] >= 0, "commit: negative token id " << token_ids[j] << " for sequence " << id);
    }
    const auto it = seqs_.find(id);
    if (it == seqs_.end() || is_finished(it->second.seq->status_)) continue;  // aborted meanwhile
    const Sequence& seq = *it->second.seq;
    const auto& drafts = seq.draft_tokens_;
    const auto c = computing.find(id);
    VPAGE_CHECK(c != computing.end() &&
                    seq.num_computed_ + c->second - static_cast<int32_t>(drafts.size()) == seq.num_tokens(),
                "commit: sequence " << id << " was not scheduled to sample in this step");
    VPAGE_CHECK(m <= static_cast<int64_t>(drafts.size()) + 1,
                "commit: sequence " << id << " given " << m << " tokens for " << drafts.size() << " drafts");
    for (int64_t j = 0; j + 1 < m; ++j) {
      VPAGE_CHECK(token_ids[i + j] == drafts[j], "commit: token " << j << " of sequence " << id
                                                                  << " is not its draft token");
    }
  }
}

CommitResult SchedulerImpl::commit(const SeqId* seq_ids, const TokenId* token_ids, int64_t count) {
  check_commit(seq_ids, token_ids, count);
  // Draft tokens accepted per speculating sequence: all its entries but the last.
  std::unordered_map<SeqId, int32_t> accepted;
  for (int64_t i = 0, m = 1; i < count; i += m) {
    m = run_length(seq_ids, count, i);
    accepted[seq_ids[i]] = static_cast<int32_t>(m - 1);
  }
  for (const auto& [id, n] : pending_) {
    const auto it = seqs_.find(id);
    if (it == seqs_.end() || is_finished(it->second.seq->status_)) continue;
    Sequence& seq = *it->second.seq;
    int32_t computed = n;
    if (!seq.draft_tokens_.empty()) {
      // The K/V of the accepted drafts is kept (they join the tokens, so that their blocks can
      // be registered); that of the rejected ones is dropped. The statuses come below.
      const auto a = accepted.find(id);
      const int32_t num_accepted = a == accepted.end() ? 0 : a->second;
      computed = n - static_cast<int32_t>(seq.draft_tokens_.size()) + num_accepted;
      seq.tokens_.insert(seq.tokens_.end(), seq.draft_tokens_.begin(), seq.draft_tokens_.begin() + num_accepted);
      stats_.num_accepted_tokens += num_accepted;
      seq.draft_acceptance_.observe(static_cast<int32_t>(seq.draft_tokens_.size()), num_accepted);
      if (num_accepted > 0) seq.probe_gap_ = seq.draft_skip_ = 0;  // a kept probe: probe again next step
    }
    seq.num_computed_ += computed;
    blocks_.register_computed_blocks(*it->second.group, seq);
  }
  if (blocks_.windowed()) {
    // Hand over shared prefixes first: they are released from the sequence that computed them.
    for (const auto& [id, n] : pending_) {
      const auto it = seqs_.find(id);
      if (it != seqs_.end() && it->second.group->shared_len_ > 0) blocks_.share_computed_prefix(*it->second.group);
    }
    for (const auto& [id, n] : pending_) {
      const auto it = seqs_.find(id);
      if (it != seqs_.end() && !is_finished(it->second.seq->status_)) blocks_.release_out_of_window(*it->second.seq);
    }
  }

  CommitResult result;
  result.statuses.resize(static_cast<size_t>(count));
  result.stop_token_ids.assign(static_cast<size_t>(count), -1);
  std::vector<SequenceGroup*> touched;
  for (int64_t i = 0, m = 1; i < count; i += m) {
    m = run_length(seq_ids, count, i);
    const auto it = seqs_.find(seq_ids[i]);
    if (it == seqs_.end()) {
      for (int64_t j = i; j < i + m; ++j) result.statuses[j] = static_cast<int32_t>(SequenceStatus::kFinishedAborted);
      continue;
    }
    Sequence& seq = *it->second.seq;
    SequenceGroup& group = *it->second.group;
    const bool speculated = !seq.draft_tokens_.empty();
    if (speculated && !is_finished(seq.status_)) {
      seq.tokens_.resize(seq.tokens_.size() - static_cast<size_t>(m - 1));  // re-appended one by one
    }
    for (int64_t j = i; j < i + m; ++j) {
      if (!is_finished(seq.status_)) {
        seq.tokens_.push_back(token_ids[j]);
        group.identical_ = false;
        const SequenceStatus status = status_after_token(group, seq, token_ids[j]);
        if (is_finished(status)) {
          const auto& ids = group.stop_.stop_token_ids;
          seq.stop_token_ = status == SequenceStatus::kFinishedStopped ? token_ids[j] : -1;
          if (seq.stop_token_ >= 0 && std::find(ids.begin(), ids.end(), seq.stop_token_) != ids.end()) {
            result.stop_token_ids[j] = seq.stop_token_;
          }
          // Accepted tokens after this one are not appended: neither are their computed counts.
          seq.num_computed_ = std::min(seq.num_computed_, seq.num_tokens());
          finish_seq(group, seq, status);
        }
        touched.push_back(&group);
      }
      result.statuses[j] = static_cast<int32_t>(seq.status_);
    }
  }
  for (const auto& [id, n] : pending_) {
    const auto it = seqs_.find(id);
    if (it == seqs_.end() || it->second.seq->draft_tokens_.empty()) continue;
    Sequence& seq = *it->second.seq;
    if (!is_finished(seq.status_)) blocks_.free_lookahead(seq);  // rejected drafts' blocks
    seq.draft_tokens_.clear();
  }
  pending_.clear();
  std::sort(touched.begin(), touched.end());
  touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
  for (SequenceGroup* g : touched) {
    if (!g->is_finished()) continue;
    result.finished_request_ids.push_back(g->request_id());
    remove_group(*g);
  }
  return result;
}

void SchedulerImpl::fill_drafts(const TokenId* tokens, int64_t count) {
  SchedulePlan& plan = *plan_;
  VPAGE_CHECK(count == plan.num_draft_tokens && (count == 0 || tokens),
              "fill_drafts: " << count << " tokens for a plan of " << plan.num_draft_tokens << " draft tokens");
  for (int64_t i = 0; i < count; ++i) VPAGE_CHECK(tokens[i] >= 0, "fill_drafts: negative token id " << tokens[i]);
  int64_t next = 0;
  for (size_t i = 0; i < plan.sample_seq_ids.size(); ++i) {
    const int32_t d = plan.sample_num_drafts[i];
    if (d == 0) continue;
    const int64_t first = plan.sample_token_indices[i] - d + 1;
    const auto it = seqs_.find(plan.sample_seq_ids[i]);
    for (int32_t j = 0; j < d; ++j) plan.input_ids[first + j] = tokens[next + j];
    if (it != seqs_.end()) it->second.seq->draft_tokens_.assign(tokens + next, tokens + next + d);
    next += d;
  }
}

}  // namespace vpage
