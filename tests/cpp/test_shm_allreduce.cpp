// The shared-memory all-reduce: 3 forked ranks on random non-zero data of awkward sizes (one
// element, a few, larger than the slot so it goes in chunks) against a float64 sum, bitwise
// the same result on every rank, float32/bfloat16/float16; a timed-out call that resumes; ranks
// that disagree on the size; bad arguments.
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "check.h"
#include "vpage/common.h"
#include "vpage/kernels/half.h"
#include "vpage/shm_allreduce.h"

using vpage::DType;
using vpage::ShmAllReduce;
using vpage::ShmWait;

namespace {

constexpr size_t kSlotBytes = 256;  // 64 float32: most sizes below need several chunks
const std::vector<int64_t> kSizes = {1, 7, 64, 65, 1000, 0, 4099};
const std::vector<DType> kDTypes = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

struct Mapping {  // anonymous shared memory that survives fork()
  void* data;
  size_t bytes;
  explicit Mapping(size_t n) : bytes(n) {
    data = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (data == MAP_FAILED) throw vpage_test::Failure("mmap failed");
  }
  ~Mapping() { munmap(data, bytes); }
};

// Rank `rank`'s input of one case, as float values exactly representable in `dtype`.
std::vector<float> inputs(int rank, int64_t numel, DType dtype) {
  std::mt19937 rng(static_cast<uint32_t>(rank * 7919 + numel * 31 + static_cast<int>(dtype)));
  std::uniform_real_distribution<float> magnitude(0.1f, 4.0f);
  std::vector<float> out(static_cast<size_t>(numel));
  for (float& v : out) {
    v = (rng() & 1 ? -1.0f : 1.0f) * magnitude(rng);
    if (dtype == DType::kBFloat16) v = vpage::bfloat16_to_float(vpage::float_to_bfloat16(v));
    if (dtype == DType::kFloat16) v = vpage::half_to_float(vpage::float_to_half(v));
  }
  return out;
}

std::vector<uint8_t> encode(const std::vector<float>& values, DType dtype) {
  std::vector<uint8_t> bytes(values.size() * vpage::dtype_size(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kFloat32) {
      std::memcpy(bytes.data() + 4 * i, &values[i], 4);
    } else {
      const uint16_t h = dtype == DType::kBFloat16 ? vpage::float_to_bfloat16(values[i]) : vpage::float_to_half(values[i]);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
  }
  return bytes;
}

float decode(const uint8_t* bytes, size_t i, DType dtype) {
  if (dtype == DType::kFloat32) {
    float v;
    std::memcpy(&v, bytes + 4 * i, 4);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, bytes + 2 * i, 2);
  return dtype == DType::kBFloat16 ? vpage::bfloat16_to_float(h) : vpage::half_to_float(h);
}

size_t result_bytes_per_rank() {
  size_t n = 0;
  for (int64_t size : kSizes) n += static_cast<size_t>(size) * 4 * kDTypes.size();
  return n;
}

// One rank's whole run: every (dtype, size) case in the same order, results copied out. A
// forked rank reports through its exit code (the harness lives in the parent): 0 done, 2 a
// peer timed out, 3 a call threw.
int run_rank(void* segment, size_t segment_bytes, int rank, int world_size, uint8_t* results) {
  try {
    ShmAllReduce comm(segment, segment_bytes, rank, world_size, kSlotBytes);
    for (DType dtype : kDTypes) {
      for (int64_t numel : kSizes) {
        std::vector<uint8_t> data = encode(inputs(rank, numel, dtype), dtype);
        if (comm.all_reduce(data.data(), numel, dtype, 20.0) != ShmWait::kDone) return 2;
        if (!data.empty()) std::memcpy(results, data.data(), data.size());
        results += static_cast<size_t>(numel) * 4;
      }
    }
  } catch (const std::exception&) {
    return 3;
  }
  return 0;
}

}  // namespace

TEST_CASE("three forked ranks sum awkward sizes in chunks, bitwise equal on every rank") {
  const int world_size = 3;
  const size_t segment_bytes = ShmAllReduce::segment_bytes(world_size, kSlotBytes);
  Mapping segment(segment_bytes);
  Mapping results(result_bytes_per_rank() * world_size);
  std::vector<pid_t> children;
  for (int rank = 0; rank < world_size; ++rank) {
    const pid_t pid = fork();
    if (pid == 0) {
      auto* out = static_cast<uint8_t*>(results.data) + rank * result_bytes_per_rank();
      _exit(run_rank(segment.data, segment_bytes, rank, world_size, out));
    }
    children.push_back(pid);
  }
  for (pid_t pid : children) {
    int status = 0;
    EXPECT(waitpid(pid, &status, 0) == pid);
    EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  const auto* all = static_cast<const uint8_t*>(results.data);
  size_t offset = 0;
  for (DType dtype : kDTypes) {
    const double tolerance = dtype == DType::kFloat32 ? 1e-6 : dtype == DType::kBFloat16 ? 8e-3 : 1e-3;
    for (int64_t numel : kSizes) {
      std::vector<std::vector<float>> in;
      for (int r = 0; r < world_size; ++r) in.push_back(inputs(r, numel, dtype));
      for (int64_t i = 0; i < numel; ++i) {
        double expected = 0.0;
        for (int r = 0; r < world_size; ++r) expected += in[r][i];
        const float got = decode(all + offset, i, dtype);
        EXPECT(std::fabs(got - expected) <= tolerance * 12.0);  // |sum| < 12
      }
      const size_t bytes = static_cast<size_t>(numel) * vpage::dtype_size(dtype);
      for (int r = 1; r < world_size; ++r) {
        EXPECT(std::memcmp(all + offset, all + r * result_bytes_per_rank() + offset, bytes) == 0);
      }
      offset += static_cast<size_t>(numel) * 4;
    }
  }
}

TEST_CASE("a call that times out waiting for a peer resumes where it stopped") {
  const size_t segment_bytes = ShmAllReduce::segment_bytes(2, kSlotBytes);
  Mapping segment(segment_bytes);
  ShmAllReduce rank0(segment.data, segment_bytes, 0, 2, kSlotBytes);
  ShmAllReduce rank1(segment.data, segment_bytes, 1, 2, kSlotBytes);
  std::vector<float> a(100, 1.5f), b(100, 2.25f);  // two chunks
  EXPECT(rank1.all_reduce(b.data(), 100, DType::kFloat32, 0.01) == ShmWait::kTimedOut);
  EXPECT_THROWS(rank1.all_reduce(b.data(), 99, DType::kFloat32, 0.01), vpage::CheckError);  // must resume the same call
  // rank 0 sums the first chunk, then waits for rank 1's second one.
  EXPECT(rank0.all_reduce(a.data(), 100, DType::kFloat32, 0.01) == ShmWait::kTimedOut);
  EXPECT(rank1.all_reduce(b.data(), 100, DType::kFloat32, 0.01) == ShmWait::kDone);
  EXPECT(rank0.all_reduce(a.data(), 100, DType::kFloat32, 0.01) == ShmWait::kDone);
  for (int i = 0; i < 100; ++i) EXPECT(a[i] == 3.75f && b[i] == 3.75f);
}

TEST_CASE("ranks that disagree on the size or dtype throw") {
  const size_t segment_bytes = ShmAllReduce::segment_bytes(2, kSlotBytes);
  Mapping segment(segment_bytes);
  ShmAllReduce rank0(segment.data, segment_bytes, 0, 2, kSlotBytes);
  ShmAllReduce rank1(segment.data, segment_bytes, 1, 2, kSlotBytes);
  std::vector<float> a(5, 1.0f), b(6, 1.0f);
  EXPECT(rank1.all_reduce(b.data(), 6, DType::kFloat32, 0.01) == ShmWait::kTimedOut);
  EXPECT_THROWS(rank0.all_reduce(a.data(), 5, DType::kFloat32, 0.01), vpage::CheckError);
}

TEST_CASE("bad arguments throw") {
  Mapping segment(4096);
  EXPECT_THROWS(ShmAllReduce(segment.data, 4096, 2, 2, 256), vpage::CheckError);  // rank out of range
  EXPECT_THROWS(ShmAllReduce(segment.data, 4096, 0, 2, 100), vpage::CheckError);  // slot not a multiple of 64
  EXPECT_THROWS(ShmAllReduce(segment.data, 4096, 0, 2, 4096), vpage::CheckError);  // segment too small
  EXPECT_THROWS(ShmAllReduce(nullptr, 4096, 0, 2, 256), vpage::CheckError);
  ShmAllReduce one(segment.data, 4096, 0, 1, 256);
  std::vector<float> x = {1.0f, -2.0f};
  EXPECT(one.all_reduce(x.data(), 2, DType::kFloat32, 0.0) == ShmWait::kDone);
  EXPECT(x[0] == 1.0f && x[1] == -2.0f);
}

TEST_MAIN()
