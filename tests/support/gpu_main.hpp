// SPDX-License-Identifier: Apache-2.0
// main() of a GPU test (a test_*.cu file, label `gpu`): exit code 77, which ctest reports as skipped, where no GPU
// exists; doctest otherwise. Include it once, in the test's .cu file, with DOCTEST_CONFIG_IMPLEMENT defined.
#pragma once

#include <doctest/doctest.h>

#include <cstdio>

#include "tandem/backend/cuda/check.hpp"

int main(int argc, char** argv) {
  if (tandem::visible_cuda_devices() == 0) {
    std::printf("no CUDA device: this test's gpu cases are skipped\n");
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
