// SPDX-License-Identifier: Apache-2.0
// A temporary file path unique to this process: ctest runs each case as a process of its own, several at once, and two
// cases (or two instantiations of one template case, or a suite's two builds) must not save to the same file.
#pragma once

#include <filesystem>
#include <random>
#include <string>

namespace test {

inline std::string temp_path(const std::string& name) {
  static const std::string process = std::to_string(std::random_device{}());
  return (std::filesystem::temp_directory_path() / ("tandem_test_" + name + "_" + process + ".ckpt")).string();
}

}  // namespace test
