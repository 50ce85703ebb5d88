// SPDX-License-Identifier: Apache-2.0
// How a test case that cannot run here says so, and how every test executable reports its cases (ctest runs each case
// as its own process, as tools/gpu-bundle-run does). Exit codes of run_cases():
//   0   every selected case passed;
//   77  reported as *skipped* (SKIP_RETURN_CODE): a case called test::skip_case(reason), and nothing failed;
//   1   a case failed, or a case made no check at all.
// A case that cannot run here must call test::skip_case(reason) (or test::require_gpus(n)); it must never `return`
// early or compile to nothing, which would show as passed: run_cases() fails every case that made no check (CHECK,
// REQUIRE, FAIL, ...), with a message saying so.
//
// Include this header where a case calls skip_case; the main() that reports (tests/main.cpp, support/gpu_main.hpp)
// defines TANDEM_TEST_CASES_MAIN before including it, once per executable.
#pragma once

#include <doctest/doctest.h>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace test {

/// Thrown by skip_case: this case cannot run on this machine. Not a std::exception, so that a case's own
/// `catch (const std::exception&)` cannot swallow it.
struct SkipCase {
  std::string reason;
};

namespace detail {

/// What the cases of this process came to (filled by CaseListener, read by run_cases()).
struct CaseResults {
  std::mutex mutex;
  std::atomic<bool> skip_requested{false};  // set by skip_case in the running case
  std::string skip_reason;
  std::string current;  // the running case's name
  std::vector<std::string> passed, failed, skipped, unchecked;
};

inline CaseResults& case_results() {
  static CaseResults results;
  return results;
}

}  // namespace detail

/// Stops the running case and has its process report it skipped (exit code 77), never passed, saying `reason` (what
/// this machine or build lacks). Call it from the case's own thread, before any check fails.
[[noreturn]] inline void skip_case(std::string reason) {
  detail::CaseResults& r = detail::case_results();
  {
    std::lock_guard lock(r.mutex);
    r.skip_reason = reason;
    r.skip_requested = true;
  }
  throw SkipCase{std::move(reason)};
}

}  // namespace test

#if defined(TANDEM_TEST_CASES_MAIN)

namespace test::detail {

/// A doctest listener (it prints nothing): sorts every case that ran into passed / failed / skipped / unchecked.
struct CaseListener : doctest::IReporter {
  explicit CaseListener(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData& tc) override {
    CaseResults& r = case_results();
    std::lock_guard lock(r.mutex);
    r.current = tc.m_name;
    r.skip_requested = false;
    r.skip_reason.clear();
  }
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats& st) override {
    CaseResults& r = case_results();
    std::lock_guard lock(r.mutex);
    if (r.skip_requested && st.numAssertsFailedCurrentTest == 0) {
      r.skipped.push_back(r.current + ": " + r.skip_reason);
    } else if (r.skip_requested || !st.testCaseSuccess) {
      r.failed.push_back(r.current);
    } else if (st.numAssertsCurrentTest == 0) {
      r.unchecked.push_back(r.current);
    } else {
      r.passed.push_back(r.current);
    }
  }
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};

}  // namespace test::detail

// doctest reports the SkipCase as an exception of the case (its console shows this text); run_cases() turns it into 77.
REGISTER_EXCEPTION_TRANSLATOR(const test::SkipCase& skip) {
  return doctest::String(("skipped (test::skip_case): " + skip.reason).c_str());
}
REGISTER_LISTENER("tandem_cases", 1, test::detail::CaseListener);

namespace test {

/// Runs the selected cases and returns the exit code the header describes.
inline int run_cases(int argc, char** argv) {
  doctest::Context context(argc, argv);
  const int rc = context.run();
  if (context.shouldExit()) return rc;  // --list-test-cases, --help, --version
  detail::CaseResults& r = detail::case_results();
  std::lock_guard lock(r.mutex);
  for (const std::string& name : r.unchecked)
    std::printf(
        "FAILED: case '%s' made no check; a case that cannot run here must call test::skip_case(reason) (reported "
        "as skipped), never return early or compile to nothing (reported as passed)\n",
        name.c_str());
  if (!r.failed.empty() || !r.unchecked.empty()) return rc != 0 ? rc : 1;
  if (!r.skipped.empty()) {
    for (const std::string& s : r.skipped) std::printf("SKIPPED: %s\n", s.c_str());
    return 77;
  }
  return rc;
}

}  // namespace test

#endif  // TANDEM_TEST_CASES_MAIN
