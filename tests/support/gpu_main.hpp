// SPDX-License-Identifier: Apache-2.0
// main() of a GPU test (a test_*.cu file, label `gpu`). Include it once, in the test's .cu file, with
// DOCTEST_CONFIG_IMPLEMENT defined. Exit codes as support/cases.hpp says (ctest runs each case as its own process, as
// tools/gpu-bundle-run does), and: 77 (skipped) where no GPU exists (listing the cases works anywhere), or where a case
// needs more GPUs than exist and said so with test::require_gpus(n); 1 where a CUDA driver is installed but fails.
// A case that cannot run here must call test::require_gpus(n) at its top; it must never `return` early, which would
// show as passed: main() fails every case that made no check (CHECK, REQUIRE, ...), with a message saying so.
#pragma once

#define TANDEM_TEST_CASES_MAIN
#include <cstdio>
#include <string>
#include <string_view>

#include "cases.hpp"
#include "tandem/backend/cuda/check.hpp"

namespace test {

/// Call at the top of a case that needs `n` GPUs: where fewer are visible, the case stops here and its process
/// reports skipped (exit code 77), never passed. Call it from the case's own thread, before any other work.
inline void require_gpus(int n) {
  const int have = tandem::visible_cuda_devices();
  if (have >= n) return;
  skip_case("needs " + std::to_string(n) + " GPU" + (n == 1 ? "" : "s") + ", " + std::to_string(have) + " visible");
}

}  // namespace test

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
  return test::run_cases(argc, argv);
}
