// Basic types, the exception type and the precondition macro of the vpage core and its
// CPU kernels.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace vpage {

using BlockId = int32_t;  ///< physical block index inside one pool
using SeqId = int64_t;    ///< sequence id, unique within one scheduler
using TokenId = int32_t;

/// Which pool a block lives in: the accelerator's KV cache or the CPU swap space.
enum class Device : int32_t { kGpu = 0, kCpu = 1 };

/// (source block, destination block) of one block copy or swap.
using BlockPair = std::pair<BlockId, BlockId>;

/// What every vpage call (scheduler, CPU kernels, shared-memory all-reduce) throws when its
/// preconditions are broken: a caller bug, not a normal outcome. Python sees it as
/// vpage._core.CheckError, a ValueError.
class CheckError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

namespace detail {
[[noreturn]] inline void check_failed(const char* expr, const char* file, int line,
                                      const std::string& message) {
  std::string name(file);  // file name only: no build-machine paths in messages
  const size_t slash = name.find_last_of("/\\");
  if (slash != std::string::npos) name = name.substr(slash + 1);
  std::ostringstream os;
  os << message << " [check '" << expr << "' failed at " << name << ":" << line << "]";
  throw CheckError(os.str());
}
}  // namespace detail

}  // namespace vpage

/// Throws vpage::CheckError with `message` (a stream expression) when `cond` is false.
#define VPAGE_CHECK(cond, message)                                                \
  do {                                                                            \
    if (!(cond)) {                                                                \
      std::ostringstream vpage_check_os_;                                         \
      vpage_check_os_ << message;                                                 \
      ::vpage::detail::check_failed(#cond, __FILE__, __LINE__, vpage_check_os_.str()); \
    }                                                                             \
  } while (0)
