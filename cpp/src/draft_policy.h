// Internal: how many draft tokens pay for themselves (speculative decoding).
//
// A draft step adds one row per draft to every matmul of the forward. Whether that pays
// depends on two things the scheduler can only measure: how often the sequence's drafts are
// kept (DraftAcceptance) and what a draft row costs against the rest of a step on this machine
// (StepCostModel: where weights stream from DRAM a row is cheap; where the matmuls are
// compute-bound a row costs about half a single-stream step, and at a large batch nearly a
// sequence's whole share of it).
#pragma once

#include <cstdint>

namespace vpage {

/// A sequence's rate of kept drafts per position, from its recent draft steps. A step that
/// drafted d tokens and kept a of them saw a kept positions and, when a < d, one rejected one
/// (the positions after a rejection are never tried). Older steps weigh less (each step
/// multiplies the past by kDecay), and a prior of kPriorRate over kPriorWeight positions keeps
/// a new sequence drafting until its own steps say otherwise.
class DraftAcceptance {
 public:
  void observe(int32_t num_drafts, int32_t num_accepted);
  double rate() const { return (kept_ + kPriorRate * kPriorWeight) / (tried_ + kPriorWeight); }

 private:
  static constexpr double kDecay = 0.9;
  static constexpr double kPriorRate = 0.8;
  static constexpr double kPriorWeight = 1.0;
  double kept_ = 0.0;
  double tried_ = 0.0;
};

/// A decode step's wall time fitted as c0 + c_seq * sequences + c_draft * draft rows by least
/// squares over recent decode steps (each observation multiplies the past by kDecay). Only
/// steps with different numbers of drafts can tell what a draft costs, so the last fit that
/// could is kept while they do not vary (sequences that stop drafting still probe now and
/// then); before the first, a step's fixed cost is taken as kPriorFixedRows rows.
class StepCostModel {
 public:
  static constexpr double kPriorFixedRows = 2.0;
  void observe(int32_t num_seqs, int32_t num_drafts, double seconds);
  /// One sequence's share of a step that decodes `num_seqs` sequences without drafts, in
  /// units of one draft row's cost (at least 1: its own row); infinite when draft rows
  /// measured as free.
  double seq_share_in_drafts(int32_t num_seqs) const;

 private:
  static constexpr double kDecay = 0.98;
  static constexpr double kMinWeight = 4.0;     // observations (decayed) before any fit
  static constexpr double kMinVariance = 0.02;  // of a regressor for it to be fitted
  // Decayed sums of 1, sequences (s), drafts (d), seconds (t) and their products.
  double w_ = 0.0, s_ = 0.0, d_ = 0.0, t_ = 0.0, ss_ = 0.0, dd_ = 0.0, sd_ = 0.0, st_ = 0.0, dt_ = 0.0;
  // The last fit: means it was centred on, and the costs of a sequence and of a draft.
  bool fitted_ = false;
  double mean_s_ = 0.0, mean_d_ = 0.0, mean_t_ = 0.0, per_seq_ = 0.0, per_draft_ = 0.0;
};

/// The number of drafts in [0, max_drafts] with the most expected tokens per unit of cost for
/// a sequence whose drafts are kept at `acceptance` per position (independently): d drafts
/// yield 1 + a + .. + a^d tokens for (seq_share + d) draft rows' worth of time, seq_share
/// being StepCostModel::seq_share_in_drafts (infinite: all max_drafts pay).
int32_t best_num_drafts(double acceptance, double seq_share, int32_t max_drafts);

}  // namespace vpage
