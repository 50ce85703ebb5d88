// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: every checkpoint reader on arbitrary bytes — the earlier single-file format, the sharded format's
// manifest (JSON) and the safetensors header of its shard files. Anything but a clean tandem::error (a crash, a
// sanitizer report, another exception, a hang, an allocation past libFuzzer's limit) is a bug. Inputs that parse are
// checked for internal consistency.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "tandem/core/checkpoint.hpp"
#include "tandem/core/checkpoint_manifest.hpp"
#include "tandem/core/safetensors.hpp"

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
  const std::string text(bytes.begin(), bytes.end());
  try {
    const tandem::CheckpointManifest m = tandem::detail::parse_manifest(text, "fuzz input");
    if (m.files.size() != (m.parameters_only ? 1u : m.world_size)) std::abort();
    for (const auto& f : m.files)
      if (f.name.empty() || f.name.find('/') != std::string::npos) std::abort();
    // What it parsed writes back to a manifest that parses to the same.
    const tandem::CheckpointManifest again =
        tandem::detail::parse_manifest(tandem::detail::manifest_json(m), "fuzz input, written back");
    if (again.step != m.step || again.tensors.size() != m.tensors.size() || again.files.size() != m.files.size())
      std::abort();
  } catch (const tandem::error&) {
  }
  try {
    // The data section as long as the tensors say it is, when they say anything plausible.
    const tandem::SafetensorsHeader h = tandem::parse_safetensors_header(text, size, "fuzz input");
    std::uint64_t end = 0;
    for (const auto& t : h.tensors) {
      std::uint64_t count = 1;  // (the parser bounds the product below 2^60)
      for (const std::uint64_t d : t.shape) count *= d;
      if (t.end < t.begin || t.end - t.begin != count * tandem::dtype_size(t.dtype) || t.count() != count) std::abort();
      if (h.find(t.name) != &t) std::abort();  // each name found, as itself
      end = std::max(end, t.end);
    }
    if (end != size) std::abort();
  } catch (const tandem::error&) {
  }
  return 0;
}
