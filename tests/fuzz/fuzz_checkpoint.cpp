// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: every checkpoint reader on arbitrary bytes — the earlier single-file format, the sharded format's
// manifest (JSON), and the safetensors files of its shards: the input as a header alone, and as a whole file (an 8-byte
// length, the header, the data) opened from disk by SafetensorsFile, whose tensors are then read back and checked
// against their checksums. Anything but a clean tandem::error (a crash, a sanitizer report, another exception, a hang,
// an allocation past libFuzzer's limit) is a bug. Inputs that parse are checked for internal consistency.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "tandem/core/checkpoint.hpp"
#include "tandem/core/checkpoint_manifest.hpp"
#include "tandem/core/json.hpp"
#include "tandem/core/safetensors.hpp"

namespace {

// Each parsed tensor as the format requires, found by its name; returns where the last one's data ends.
std::uint64_t check_tensors(const tandem::SafetensorsHeader& h) {
  std::uint64_t end = 0;
  for (const auto& t : h.tensors) {
    std::uint64_t count = 1;  // (the parser bounds the product below 2^60)
    for (const std::uint64_t d : t.shape) count *= d;
    if (t.end < t.begin || t.end - t.begin != count * tandem::dtype_size(t.dtype) || t.count() != count) std::abort();
    if (h.find(t.name) != &t) std::abort();  // each name found, as itself
    end = std::max(end, t.end);
  }
  return end;
}

// The input as a file on disk, opened and read as a checkpoint's shard is: every tensor's data read back in pieces and
// checked against its checksum (a mismatch is a clean error, as in verify_checkpoint).
void whole_file(const std::uint8_t* data, std::size_t size) {
  static const struct Scratch {  // one file per process, removed at exit
    std::string path =
        (std::filesystem::temp_directory_path() / ("fuzz_checkpoint." + std::to_string(::getpid()) + ".safetensors"))
            .string();
    ~Scratch() { std::remove(path.c_str()); }
  } scratch;
  const std::string& path = scratch.path;
  if (std::FILE* f = std::fopen(path.c_str(), "wb")) {
    const bool written = std::fwrite(data, 1, size, f) == size;
    if (std::fclose(f) != 0 || !written) return;
  } else {
    return;
  }
  try {
    const tandem::SafetensorsFile file(path);
    std::uint64_t data_bytes = 0;
    for (const auto& t : file.tensors()) data_bytes = std::max(data_bytes, t.end);
    if (data_bytes > file.size()) std::abort();  // (the file holds what it names)
    std::vector<unsigned char> piece(4096);
    for (const auto& t : file.tensors()) {
      std::uint32_t crc = 0;
      for (std::uint64_t at = t.begin; at < t.end; at += piece.size()) {
        const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(piece.size(), t.end - at));
        file.read(at, piece.data(), n);
        crc = tandem::detail::crc32c(piece.data(), n, crc);
      }
      if (t.has_crc && crc != t.crc) file.corrupt("checksum mismatch");
    }
  } catch (const tandem::error&) {
  }
}

}  // namespace

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
    if (again.step != m.step || again.metadata != m.metadata || again.tensors.size() != m.tensors.size() ||
        again.files.size() != m.files.size() || again.optimizer_group_of != m.optimizer_group_of ||
        again.optimizer_groups.size() != m.optimizer_groups.size())
      std::abort();
    // each option by its name, and its value: a float's as that float, any other exactly
    for (std::size_t g = 0; g < m.optimizer_groups.size(); ++g) {
      if (again.optimizer_groups[g].size() != m.optimizer_groups[g].size()) std::abort();
      for (std::size_t k = 0; k < m.optimizer_groups[g].size(); ++k) {
        const auto& [name, value] = m.optimizer_groups[g][k];
        const double back = again.optimizer_groups[g][k].second;
        float f = 0, f_back = 0;
        const bool a_float = tandem::detail::json::float_of(value, f) && static_cast<double>(f) == value;
        if (again.optimizer_groups[g][k].first != name ||
            (a_float ? !tandem::detail::json::float_of(back, f_back) || f_back != f : back != value))
          std::abort();
      }
    }
  } catch (const tandem::error&) {
  }
  try {
    // The input as a header alone, its data section as long as the input.
    const tandem::SafetensorsHeader h = tandem::parse_safetensors_header(text, size, "fuzz input");
    if (check_tensors(h) != size) std::abort();
  } catch (const tandem::error&) {
  }
  // The input as a whole file: first as the bytes it holds (the header its length prefix names, the data after it),
  // then opened from disk.
  std::uint64_t n = 0;
  for (std::size_t k = 0; k < 8 && k < size; ++k) n |= std::uint64_t{data[k]} << (8 * k);
  if (size >= 8 && n <= size - 8) try {
      const std::uint64_t data_bytes = size - 8 - n;
      const tandem::SafetensorsHeader h =
          tandem::parse_safetensors_header(std::string_view(text).substr(8, n), data_bytes, "fuzz file");
      if (check_tensors(h) != data_bytes) std::abort();
    } catch (const tandem::error&) {
    }
  whole_file(data, size);
  return 0;
}
