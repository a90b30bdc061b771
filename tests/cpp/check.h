// Minimal test harness for the ctest executables (no framework is downloaded at build time).
#pragma once

#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <vector>

namespace vpage_test {

struct Case {
  const char* name;
  std::function<void()> body;
};

inline std::vector<Case>& cases() {
  static std::vector<Case> all;
  return all;
}

struct Register {
  Register(const char* name, std::function<void()> body) { cases().push_back({name, std::move(body)}); }
};

struct Failure : std::exception {
  std::string message;
  explicit Failure(std::string m) : message(std::move(m)) {}
  const char* what() const noexcept override { return message.c_str(); }
};

/// Runs every registered case; prints one line each and a summary; returns the exit code.
inline int run_all() {
  int failed = 0;
  for (const Case& c : cases()) {
    try {
      c.body();
      std::printf("[ ok ] %s\n", c.name);
    } catch (const std::exception& e) {
      ++failed;
      std::printf("[FAIL] %s: %s\n", c.name, e.what());
    }
  }
  std::printf("%zu passed, %d failed\n", cases().size() - failed, failed);
  return failed == 0 ? 0 : 1;
}

}  // namespace vpage_test

#define VPAGE_TEST_CAT2(a, b) a##b
#define VPAGE_TEST_CAT(a, b) VPAGE_TEST_CAT2(a, b)
/// Defines and registers a test case.
#define TEST_CASE(name)                                                        \
  static void VPAGE_TEST_CAT(test_fn_, __LINE__)();                            \
  static ::vpage_test::Register VPAGE_TEST_CAT(test_reg_, __LINE__)(name, VPAGE_TEST_CAT(test_fn_, __LINE__)); \
  static void VPAGE_TEST_CAT(test_fn_, __LINE__)()

/// Fails the current case with the expression and location when `cond` is false.
#define EXPECT(cond)                                                           \
  do {                                                                         \
    if (!(cond)) {                                                             \
      throw ::vpage_test::Failure(std::string(#cond) + " at " + __FILE__ + ":" + std::to_string(__LINE__)); \
    }                                                                          \
  } while (0)

#define EXPECT_THROWS(stmt)                                                    \
  do {                                                                         \
    bool vpage_thrown_ = false;                                                \
    try { stmt; } catch (const std::exception&) { vpage_thrown_ = true; }      \
    EXPECT(vpage_thrown_);                                                     \
  } while (0)

#define TEST_MAIN() int main() { return ::vpage_test::run_all(); }
