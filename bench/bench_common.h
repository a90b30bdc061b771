// Shared helpers of the microbenchmark binaries: list flags, timing statistics, machine info.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace vpage_bench {

/// "1,32,64" -> {"1", "32", "64"}.
inline std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> parts;
  std::stringstream stream(text);
  for (std::string part; std::getline(stream, part, ',');) parts.push_back(part);
  return parts;
}

/// "1,32,64" -> {1, 32, 64}.
inline std::vector<int> int_list(const std::string& text) {
  std::vector<int> values;
  for (const std::string& part : split_list(text)) values.push_back(std::stoi(part));
  return values;
}

/// Flag name ("--seqs") and what to do with its value.
using FlagHandlers = std::vector<std::pair<std::string, std::function<void(const std::string&)>>>;

/// Parses "--flag value" pairs; prints `usage` (after the program name) and exits on --help,
/// a missing value or an unknown flag.
inline void parse_flags(int argc, char** argv, const char* usage, const FlagHandlers& handlers) {
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    const auto handler = std::find_if(handlers.begin(), handlers.end(),
                                      [&](const auto& h) { return h.first == flag; });
    if (flag == "--help" || i + 1 >= argc || handler == handlers.end()) {
      std::printf("usage: %s %s\n", argv[0], usage);
      std::exit(flag == "--help" ? 0 : 2);
    }
    handler->second(argv[++i]);
  }
}

/// Median and spread of repeated timings (microseconds).
struct Stats {
  double median = 0, p10 = 0, p90 = 0, min = 0, max = 0;
  size_t count = 0;
};

inline Stats summarize(std::vector<double> samples) {
  Stats s;
  if (samples.empty()) return s;
  std::sort(samples.begin(), samples.end());
  const auto at = [&](double q) { return samples[static_cast<size_t>(q * (samples.size() - 1) + 0.5)]; };
  s.median = at(0.5);
  s.p10 = at(0.1);
  s.p90 = at(0.9);
  s.min = samples.front();
  s.max = samples.back();
  s.count = samples.size();
  return s;
}

/// Wall-clock seconds since an arbitrary origin.
inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// Seconds of each of `repeats` calls of fn, after one untimed warm-up call.
template <typename Fn>
std::vector<double> time_calls(int repeats, Fn&& fn) {
  fn();
  std::vector<double> samples;
  samples.reserve(repeats > 0 ? repeats : 0);
  for (int r = 0; r < repeats; ++r) {
    const double t0 = now_seconds();
    fn();
    samples.push_back(now_seconds() - t0);
  }
  return samples;
}

/// Copy bandwidth of this machine in bytes per second, counting read + write bytes:
/// median of `repeats` memcpy calls of a `bytes` buffer (pages touched before timing).
inline double copy_bandwidth(size_t bytes, int repeats) {
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  const Stats s = summarize(time_calls(repeats, [&] { std::memcpy(dst.data(), src.data(), bytes); }));
  return 2.0 * static_cast<double>(bytes) / s.median;
}

/// CPU model and core count of this machine, and the compiler that built the binary.
inline std::string machine_description() {
  std::string model = "unknown CPU";
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  }
  std::ostringstream os;
  os << model << ", " << std::thread::hardware_concurrency() << " hardware threads, compiler "
#if defined(__clang__)
     << "clang " << __clang_major__ << "." << __clang_minor__;
#elif defined(__GNUC__)
     << "gcc " << __GNUC__ << "." << __GNUC_MINOR__;
#else
     << "unknown";
#endif
  return os.str();
}

}  // namespace vpage_bench
