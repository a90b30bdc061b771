// Sum of a tensor over the tensor-parallel ranks of one machine through a shared-memory
// segment that every rank has mapped (the caller creates, maps and unlinks it).
//
// Segment layout for W ranks:
//   [W control lines of kControlBytes]  rank r's published generation (atomic uint64)
//   [W x 2 slots of slot_stride bytes]  rank r's slot for parity p at (r * 2 + p): a header
//                                       (the operation's numel and dtype) then slot_bytes of data
// One generation moves one chunk of at most slot_bytes: each rank copies its chunk into its
// slot of the generation's parity, publishes the generation (release), waits until every rank
// published it or a later one (acquire), then sums the W slots in rank order 0..W-1, so every
// rank computes bitwise the same result.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "vpage/kernels/kernel_args.h"

namespace vpage {

/// Answer of ShmAllReduce::all_reduce.
enum class ShmWait : int32_t {
  kDone = 0,      ///< the tensor holds the sum
  kTimedOut = 1,  ///< a peer had not arrived by the deadline; call again with the same arguments
};

/// One rank's end of the shared segment. Not thread-safe: one call at a time per rank, and
/// every rank makes the same calls (same numel and dtype) in the same order.
class ShmAllReduce {
 public:
  static constexpr size_t kControlBytes = 128;  // two cache lines: no false sharing between ranks
  static constexpr size_t kHeaderBytes = 64;    // per slot, before its data

  /// Bytes of a segment for `world_size` ranks with `slot_bytes` of data per slot.
  static size_t segment_bytes(int world_size, size_t slot_bytes);

  /// `segment`: `segment_bytes` mapped bytes, zero-filled when the first rank attached (a new
  /// file), page-aligned, shared by the ranks and alive as long as this object.
  /// `slot_bytes`: a multiple of 64, the same on every rank. Throws CheckError on bad sizes.
  ShmAllReduce(void* segment, size_t segment_bytes, int rank, int world_size, size_t slot_bytes);

  /// data [numel] of `dtype`, contiguous: replaced in place by the sum over the ranks
  /// (float16/bfloat16 are summed in float32 and rounded once). Waits at most `timeout_s` for
  /// the peers; on kTimedOut the operation is still under way and the next call must pass the
  /// same arguments to resume it. Throws CheckError when the ranks' numel or dtype differ.
  ShmWait all_reduce(void* data, int64_t numel, DType dtype, double timeout_s);

 private:
  struct Pending {  // the operation a timed-out call left under way
    void* data = nullptr;
    int64_t numel = 0;
    DType dtype = DType::kFloat32;
    int64_t done = 0;        // elements already summed
    bool published = false;  // the chunk at `done` is in this rank's slot and published
  };

  char* slot(int rank, uint64_t generation) const;
  bool wait_for_peers(uint64_t generation, double timeout_s) const;

  char* segment_;
  int rank_;
  int world_size_;
  size_t slot_bytes_;
  size_t slot_stride_;
  uint64_t generation_ = 0;  // the last generation this rank published
  Pending pending_;
  bool in_progress_ = false;
  std::vector<const char*> sources_;  // the ranks' slots of the chunk being summed
};

}  // namespace vpage
