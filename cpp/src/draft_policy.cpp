#include "draft_policy.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace vpage {

void DraftAcceptance::observe(int32_t num_drafts, int32_t num_accepted) {
  if (num_drafts <= 0) return;
  kept_ = kDecay * kept_ + num_accepted;
  tried_ = kDecay * tried_ + num_accepted + (num_accepted < num_drafts ? 1 : 0);
}

void StepCostModel::observe(int32_t num_seqs, int32_t num_drafts, double seconds) {
  if (num_seqs <= 0 || num_drafts < 0 || !(seconds > 0.0)) return;
  const double s = num_seqs, d = num_drafts, t = seconds;
  for (double* sum : {&w_, &s_, &d_, &t_, &ss_, &dd_, &sd_, &st_, &dt_}) *sum *= kDecay;
  w_ += 1.0;
  s_ += s;
  d_ += d;
  t_ += t;
  ss_ += s * s;
  dd_ += d * d;
  sd_ += s * d;
  st_ += s * t;
  dt_ += d * t;
  if (w_ < kMinWeight) return;
  const double ms = s_ / w_, md = d_ / w_, mt = t_ / w_;
  const double vss = ss_ / w_ - ms * ms, vdd = dd_ / w_ - md * md, vsd = sd_ / w_ - ms * md;
  const double cst = st_ / w_ - ms * mt, cdt = dt_ / w_ - md * mt;
  if (vdd < kMinVariance) return;  // the drafts have not varied lately: keep the last fit
  const double det = vss * vdd - vsd * vsd;
  if (vss >= kMinVariance && det > 0.1 * vss * vdd) {  // both vary, not in lockstep
    per_seq_ = (vdd * cst - vsd * cdt) / det;
    per_draft_ = (vss * cdt - vsd * cst) / det;
  } else {  // the batch stayed the same: the drafts alone explain the changes
    per_seq_ = 0.0;
    per_draft_ = cdt / vdd;
  }
  mean_s_ = ms;
  mean_d_ = md;
  mean_t_ = mt;
  fitted_ = true;
}

double StepCostModel::seq_share_in_drafts(int32_t num_seqs) const {
  const double n = std::max(num_seqs, 1);
  if (!fitted_) return 1.0 + kPriorFixedRows / n;
  if (per_draft_ <= 0.0) return std::numeric_limits<double>::infinity();
  const double plain_step = mean_t_ + per_seq_ * (n - mean_s_) - per_draft_ * mean_d_;
  return std::max(plain_step / (per_draft_ * n), 1.0);
}

int32_t best_num_drafts(double acceptance, double seq_share, int32_t max_drafts) {
  if (max_drafts <= 0) return 0;
  if (std::isinf(seq_share)) return max_drafts;
  int32_t best = 0;
  double tokens = 1.0, power = 1.0;  // expected tokens of d drafts: 1 + a + .. + a^d
  double best_rate = tokens / seq_share;
  for (int32_t d = 1; d <= max_drafts; ++d) {
    power *= acceptance;
    tokens += power;
    const double rate = tokens / (seq_share + d);
    if (rate > best_rate) {
      best_rate = rate;
      best = d;
    }
  }
  return best;
}

}  // namespace vpage
