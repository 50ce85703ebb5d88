// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: the checkpoint reader on arbitrary bytes. Anything but a clean tandem::error (a crash, a
// sanitizer report, another exception, a hang, an allocation past libFuzzer's limit) is a bug. Inputs that
// parse are checked for internal consistency.
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "tandem/core/checkpoint.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::vector<unsigned char> bytes(data, data + size);
  try {
    const tandem::CheckpointData c = tandem::parse_checkpoint(bytes, "fuzz input");
    const std::size_t psize = tandem::dtype_size(c.param_dtype);
    for (std::size_t i = 0; i < c.tensors.size(); ++i) {
      if (c.params[i].size() != c.tensors[i].numel * psize) std::abort();
      if (c.states[i].size() != c.state_count) std::abort();
    }
  } catch (const tandem::error&) {
    // rejected cleanly
  }
  return 0;
}
