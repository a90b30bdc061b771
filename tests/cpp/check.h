// The test harness of every ctest executable (no framework is downloaded at build time):
// TEST_CASE registers a case, EXPECT, EXPECT_MSG and EXPECT_THROWS fail it, TEST_MAIN runs
// them all.
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

/// Fails the current case with `message` (a std::string expression) and the location when
/// `cond` is false.
#define EXPECT_MSG(cond, message)                                              \
  do {                                                                         \
    if (!(cond)) {                                                             \
      throw ::vpage_test::Failure(std::string(message) + " at " + __FILE__ + ":" + std::to_string(__LINE__)); \
    }                                                                          \
  } while (0)

/// Fails the current case unless `stmt` throws `type` (or a type derived from it) whose
/// what() contains `text` ("" matches any message). Another exception, or none, fails.
#define EXPECT_THROWS_WITH(stmt, type, text)                                   \
  do {                                                                         \
    const std::string vpage_where_ = std::string(" at ") + __FILE__ + ":" + std::to_string(__LINE__); \
    bool vpage_thrown_ = false;                                                \
    std::string vpage_what_;                                                   \
    try {                                                                      \
      stmt;                                                                    \
    } catch (const type& e) {                                                  \
      vpage_thrown_ = true;                                                    \
      vpage_what_ = e.what();                                                  \
    } catch (const std::exception& e) {                                        \
      throw ::vpage_test::Failure(std::string(#stmt) + " threw another type than " #type ": " + e.what() + vpage_where_); \
    }                                                                          \
    if (!vpage_thrown_) throw ::vpage_test::Failure(std::string(#stmt) + " did not throw " #type + vpage_where_); \
    if (vpage_what_.find(text) == std::string::npos) {                         \
      throw ::vpage_test::Failure(std::string(#stmt) + " threw '" + vpage_what_ + "', without '" + (text) + "'" + vpage_where_); \
    }                                                                          \
  } while (0)

/// Fails the current case unless `stmt` throws `type` (or a type derived from it).
#define EXPECT_THROWS(stmt, type) EXPECT_THROWS_WITH(stmt, type, "")

/// The executable's main: runs every case, exit code 0 when all passed.
#define TEST_MAIN() int main() { return ::vpage_test::run_all(); }
