#include "vpage/shm_allreduce.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "vpage/common.h"
#include "vpage/kernels/half.h"

namespace vpage {
namespace {

// The counters live in memory mapped by several processes. A lock-free std::atomic is
// address-free ([atomics.lockfree]), so it works across processes, and its representation is
// the plain integer: the zero-filled segment holds generation 0 for every rank.
using Generation = std::atomic<uint64_t>;
static_assert(Generation::is_always_lock_free, "the generation counters must be lock-free");

// Waiting: spin (a peer arriving within microseconds is the common case), then yield (ranks may
// outnumber the cores), then, once the wait has lasted a while, sleep in short naps so that a
// slow peer sharing this core, or other work on the machine, gets the CPU.
constexpr int kSpinsBeforeYield = 4096;
constexpr auto kYieldFor = std::chrono::milliseconds(1);
constexpr auto kNap = std::chrono::microseconds(50);
constexpr int64_t kBlock = 512;          // elements summed at a time in a float32 stack buffer

struct SlotHeader {  // the operation a slot's chunk belongs to (checked equal over the ranks)
  int64_t numel;
  int32_t dtype;
};
static_assert(sizeof(SlotHeader) <= ShmAllReduce::kHeaderBytes, "slot header too large");

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

Generation& generation_of(char* segment, int rank) {
  return *reinterpret_cast<Generation*>(segment + static_cast<size_t>(rank) * ShmAllReduce::kControlBytes);
}

struct F32 {
  using T = float;
  static float load(float v) { return v; }
  static float store(float v) { return v; }
};
struct BF16 {
  using T = uint16_t;
  static float load(uint16_t v) { return bfloat16_to_float(v); }
  static uint16_t store(float v) { return float_to_bfloat16(v); }
};
struct F16 {
  using T = uint16_t;
  static float load(uint16_t v) { return half_to_float(v); }
  static uint16_t store(float v) { return float_to_half(v); }
};

// out[i] = ((src[0][i] + src[1][i]) + ...) + src[w-1][i] in float32, rounded once to E::T.
// Plain loops over a block the compiler vectorises; one thread (memory-bound, and each rank
// already has a core of its own).
template <class E>
void sum_in_rank_order(void* out, const char* const* src, int w, int64_t n) {
  using T = typename E::T;
  T* dst = static_cast<T*>(out);
  float acc[kBlock];
  for (int64_t begin = 0; begin < n; begin += kBlock) {
    const int64_t m = std::min(kBlock, n - begin);
    const T* s0 = reinterpret_cast<const T*>(src[0]) + begin;
    for (int64_t i = 0; i < m; ++i) acc[i] = E::load(s0[i]);
    for (int r = 1; r < w; ++r) {
      const T* s = reinterpret_cast<const T*>(src[r]) + begin;
      for (int64_t i = 0; i < m; ++i) acc[i] += E::load(s[i]);
    }
    for (int64_t i = 0; i < m; ++i) dst[begin + i] = E::store(acc[i]);
  }
}

void sum(DType dtype, void* out, const char* const* src, int w, int64_t n) {
  switch (dtype) {
    case DType::kFloat32: return sum_in_rank_order<F32>(out, src, w, n);
    case DType::kBFloat16: return sum_in_rank_order<BF16>(out, src, w, n);
    case DType::kFloat16: return sum_in_rank_order<F16>(out, src, w, n);
  }
  VPAGE_CHECK(false, "unknown dtype code " << static_cast<int>(dtype));
}

}  // namespace

size_t ShmAllReduce::segment_bytes(int world_size, size_t slot_bytes) {
  return static_cast<size_t>(world_size) * (kControlBytes + 2 * (kHeaderBytes + slot_bytes));
}

ShmAllReduce::ShmAllReduce(void* segment, size_t segment_bytes, int rank, int world_size, size_t slot_bytes)
    : segment_(static_cast<char*>(segment)), rank_(rank), world_size_(world_size), slot_bytes_(slot_bytes),
      slot_stride_(kHeaderBytes + slot_bytes) {
  VPAGE_CHECK(world_size >= 1 && rank >= 0 && rank < world_size,
              "rank " << rank << " out of range for world size " << world_size);
  VPAGE_CHECK(slot_bytes > 0 && slot_bytes % 64 == 0, "slot_bytes must be a positive multiple of 64, got " << slot_bytes);
  VPAGE_CHECK(segment != nullptr && reinterpret_cast<uintptr_t>(segment) % 64 == 0, "segment must be 64-byte aligned");
  VPAGE_CHECK(segment_bytes >= ShmAllReduce::segment_bytes(world_size, slot_bytes),
              "segment of " << segment_bytes << " bytes is smaller than the "
                            << ShmAllReduce::segment_bytes(world_size, slot_bytes) << " needed");
  sources_.resize(world_size);
}

// Rank r's slot for `generation` is one of two, by parity. Reusing it for generation g + 2 is
// safe: rank r writes it only after its wait for g + 1 returned, i.e. after every rank
// published g + 1, and a rank publishes g + 1 only after it has finished summing g.
char* ShmAllReduce::slot(int rank, uint64_t generation) const {
  const size_t index = static_cast<size_t>(rank) * 2 + (generation & 1);
  return segment_ + static_cast<size_t>(world_size_) * kControlBytes + index * slot_stride_;
}

// Peers may already be one generation ahead (they publish g + 1 once they have summed g),
// never two (g + 2 needs this rank's g + 1): hence ">=".
bool ShmAllReduce::wait_for_peers(uint64_t generation, double timeout_s) const {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  for (int r = 0; r < world_size_; ++r) {
    const Generation& peer = generation_of(segment_, r);
    for (int spins = 0; peer.load(std::memory_order_acquire) < generation; ++spins) {
      if (spins < kSpinsBeforeYield) {
        cpu_relax();
        continue;
      }
      const auto now = Clock::now();
      if (now > deadline) return false;
      if (now - start < kYieldFor) {
        sched_yield();
      } else {
        std::this_thread::sleep_for(kNap);
      }
    }
  }
  return true;
}

ShmWait ShmAllReduce::all_reduce(void* data, int64_t numel, DType dtype, double timeout_s) {
  if (in_progress_) {
    VPAGE_CHECK(data == pending_.data && numel == pending_.numel && dtype == pending_.dtype,
                "a timed-out shm all-reduce must be resumed with the same arguments");
  } else {
    VPAGE_CHECK(numel >= 0 && (data != nullptr || numel == 0), "bad tensor: numel " << numel);
    pending_ = Pending{data, numel, dtype, 0, false};
    in_progress_ = true;
  }
  const size_t element = static_cast<size_t>(dtype_size(dtype));
  const int64_t chunk = static_cast<int64_t>(slot_bytes_ / element);
  char* bytes = static_cast<char*>(data);
  const SlotHeader header{numel, static_cast<int32_t>(dtype)};
  while (pending_.done < numel) {
    const int64_t n = std::min(chunk, numel - pending_.done);
    char* chunk_data = bytes + static_cast<size_t>(pending_.done) * element;
    if (!pending_.published) {
      const uint64_t g = generation_ + 1;
      char* own = slot(rank_, g);
      std::memcpy(own, &header, sizeof(header));
      std::memcpy(own + kHeaderBytes, chunk_data, static_cast<size_t>(n) * element);
      generation_of(segment_, rank_).store(g, std::memory_order_release);
      generation_ = g;
      pending_.published = true;
    }
    if (!wait_for_peers(generation_, timeout_s)) return ShmWait::kTimedOut;
    for (int r = 0; r < world_size_; ++r) {
      const char* s = slot(r, generation_);
      SlotHeader theirs;
      std::memcpy(&theirs, s, sizeof(theirs));
      if (theirs.numel != header.numel || theirs.dtype != header.dtype) {
        in_progress_ = false;
        VPAGE_CHECK(false, "shm all-reduce: rank " << r << " sums " << theirs.numel << " elements of dtype code "
                                                   << theirs.dtype << ", rank " << rank_ << " " << numel
                                                   << " of dtype code " << header.dtype);
      }
      sources_[r] = s + kHeaderBytes;
    }
    sum(dtype, chunk_data, sources_.data(), world_size_, n);
    pending_.done += n;
    pending_.published = false;
  }
  in_progress_ = false;
  return ShmWait::kDone;
}

}  // namespace vpage
