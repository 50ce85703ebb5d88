// SPDX-License-Identifier: Apache-2.0
// main() of a GPU test (a test_*.cu file, label `gpu`). Include it once, in the test's .cu file, with
// DOCTEST_CONFIG_IMPLEMENT defined. Exit codes (ctest runs each case as its own process, as tools/gpu-bundle-run does):
//   0   every selected case passed;
//   77  reported as *skipped*: no GPU exists (listing the cases works anywhere), or a case needs more GPUs than
//       exist and said so with test::require_gpus(n) (nothing failed otherwise);
//   1   a case failed, or a case ran no check at all.
// A case that cannot run here must call test::require_gpus(n) at its top; it must never `return` early, which would
// show as passed: main() fails every case that made no check (CHECK, REQUIRE, ...), with a message saying so.
#pragma once

#include <doctest/doctest.h>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/backend/cuda/check.hpp"

namespace test {

/// Thrown by require_gpus: this case cannot run on this machine. Not a std::exception, so that a case's own
/// `catch (const std::exception&)` cannot swallow it.
struct SkipCase {
  std::string reason;
};

namespace detail {

/// What the cases of this process came to (filled by GpuCaseListener, read by main()).
struct GpuCaseResults {
  std::mutex mutex;
  std::atomic<bool> skip_requested{false};  // set by require_gpus in the running case
  std::string skip_reason;
  std::string current;  // the running case's name
  std::vector<std::string> passed, failed, skipped, unchecked;
};

inline GpuCaseResults& gpu_case_results() {
  static GpuCaseResults results;
  return results;
}

/// A doctest listener (it prints nothing): sorts every case that ran into passed / failed / skipped / unchecked.
struct GpuCaseListener : doctest::IReporter {
  explicit GpuCaseListener(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData& tc) override {
    GpuCaseResults& r = gpu_case_results();
    std::lock_guard lock(r.mutex);
    r.current = tc.m_name;
    r.skip_requested = false;
    r.skip_reason.clear();
  }
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats& st) override {
    GpuCaseResults& r = gpu_case_results();
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

}  // namespace detail

/// Call at the top of a case that needs `n` GPUs: where fewer are visible, the case stops here and its process
/// reports skipped (exit code 77), never passed. Call it from the case's own thread, before any other work.
inline void require_gpus(int n) {
  const int have = tandem::visible_cuda_devices();
  if (have >= n) return;
  detail::GpuCaseResults& r = detail::gpu_case_results();
  std::string reason =
      "needs " + std::to_string(n) + " GPU" + (n == 1 ? "" : "s") + ", " + std::to_string(have) + " visible";
  {
    std::lock_guard lock(r.mutex);
    r.skip_reason = reason;
    r.skip_requested = true;
  }
  throw SkipCase{std::move(reason)};
}

}  // namespace test

// doctest reports the SkipCase as an exception of the case (its console shows this text); main() turns it into 77.
REGISTER_EXCEPTION_TRANSLATOR(const test::SkipCase& skip) {
  return doctest::String(("skipped (test::require_gpus): " + skip.reason).c_str());
}
REGISTER_LISTENER("tandem_gpu_cases", 1, test::detail::GpuCaseListener);

int main(int argc, char** argv) {
  // Listing the cases (ctest's per-case entries are made that way at build time) needs no GPU.
  // doctest's listing options are -l… / --list… (or --dt-list…).
  bool listing = false;
  for (int i = 1; i < argc; ++i) {
    std::string_view arg(argv[i]);
    if (!arg.starts_with('-')) continue;
    arg.remove_prefix(arg.find_first_not_of('-'));
    if (arg.starts_with("dt-")) arg.remove_prefix(3);
    listing = listing || arg.starts_with('l');
  }
  if (!listing) {
    // Skipped only where there is no GPU: a driver that fails (older than the runtime, say) fails every case.
    if (const std::string fault = tandem::cuda_device_fault(); !fault.empty()) {
      std::printf("FAILED: CUDA cannot count this machine's devices: %s\n", fault.c_str());
      return 1;
    }
    if (tandem::visible_cuda_devices() == 0) {
      std::printf("no CUDA device: this test's gpu cases are skipped\n");
      return 77;
    }
  }
  doctest::Context context(argc, argv);
  const int rc = context.run();
  if (context.shouldExit()) return rc;  // --list-test-cases, --help, --version
  test::detail::GpuCaseResults& r = test::detail::gpu_case_results();
  std::lock_guard lock(r.mutex);
  for (const std::string& name : r.unchecked)
    std::printf(
        "FAILED: gpu case '%s' made no check; a case that cannot run here must call test::require_gpus(n) "
        "(reported as skipped), never return early (reported as passed)\n",
        name.c_str());
  if (!r.failed.empty() || !r.unchecked.empty()) return rc != 0 ? rc : 1;
  if (!r.skipped.empty()) {
    for (const std::string& s : r.skipped) std::printf("SKIPPED: %s\n", s.c_str());
    return 77;
  }
  return rc;
}
