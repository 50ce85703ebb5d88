// SPDX-License-Identifier: Apache-2.0
// A user's program: includes the umbrella header and prints the version it was built against.
#include <cstdio>
#include <tandem/tandem.hpp>

int main() {
  std::printf("tandem %s\n", tandem::version_string());
  return 0;
}
