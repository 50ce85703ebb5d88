// SPDX-License-Identifier: Apache-2.0
// main() of a GPU test (a test_*.cu file, label `gpu`): exit code 77, which ctest reports as skipped, where no GPU
// exists (listing the cases works anywhere); doctest otherwise. Include it once, in the test's .cu file, with
// DOCTEST_CONFIG_IMPLEMENT defined.
#pragma once

#include <doctest/doctest.h>

#include <cstdio>
#include <string_view>

#include "tandem/backend/cuda/check.hpp"

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
  if (!listing && tandem::visible_cuda_devices() == 0) {
    std::printf("no CUDA device: this test's gpu cases are skipped\n");
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
