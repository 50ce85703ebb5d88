// SPDX-License-Identifier: Apache-2.0
// The checkpoint file: tandem's whole training state in a logical, world-size-independent layout (tensor by
// tensor, in layout order, no padding), so that it can be loaded at another world size or under another policy.
//
// File (little-endian):
//   "TANDEMCK"  u32 version  u32 header_bytes  header  u32 crc32(header)
//   per tensor, in layout order:  record  u32 crc32(record)
//   "TNDMEND."  u64 bytes before this trailer
// header: u64 step, u32 state_count, u8 param dtype, str optimizer, str saved_by_policy, u32 saved_world_size,
//         u64 optimizer fingerprint, u32 tensors, then per tensor: str name, u64 numel, u8 dtype
//         (str = u32 length + bytes)
// record: the parameters (numel elements of the parameter dtype), then for 16-bit parameters the fp32 master
//         weights, then state_count fp32 optimizer-state arrays (numel each).
// Writes are atomic: a temporary file in the same directory, named uniquely for each writer (so that saves to one path
// from several threads or processes never share one), is written, flushed to disk (fsync) and renamed over the
// target, so a crash at any point leaves the previous checkpoint intact; a write that fails removes its temporary
// file. Strings (names) are at most checkpoint_max_text bytes, on write as on read.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "tandem/core/atomic_file.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/hash.hpp"
#include "tandem/core/tensor.hpp"

namespace tandem {

/// The logical training state a checkpoint holds.
struct CheckpointData {
  std::uint64_t step = 0;
  std::uint32_t state_count = 0;
  DType param_dtype = DType::fp32;
  std::string optimizer;
  std::string saved_by_policy;
  std::uint32_t saved_world_size = 1;
  std::uint64_t optimizer_fingerprint = 0;
  std::vector<TensorSpec> tensors;
  /// Per tensor: parameter bytes, fp32 masters (16-bit parameters only), state_count fp32 arrays.
  std::vector<std::vector<unsigned char>> params;
  std::vector<std::vector<float>> masters;
  std::vector<std::vector<std::vector<float>>> states;
  /// Set by parse_checkpoint: a hash of the file's checksums, equal for equal files (what ranks compare after a load).
  std::uint64_t content_id = 0;
};

/// The longest string (a tensor name, an optimizer or policy name) a checkpoint holds, in bytes.
inline constexpr std::size_t checkpoint_max_text = 4096;

namespace detail {

inline constexpr char checkpoint_magic[8] = {'T', 'A', 'N', 'D', 'E', 'M', 'C', 'K'};
inline constexpr char checkpoint_trailer[8] = {'T', 'N', 'D', 'M', 'E', 'N', 'D', '.'};
inline constexpr std::uint32_t checkpoint_version = 1;

/// CRC-32 (IEEE 802.3, reflected, polynomial 0xEDB88320), continued from `crc`.
inline std::uint32_t crc32(const void* data, std::size_t n, std::uint32_t crc = 0) {
  static const std::array<std::uint32_t, 256> table = [] {
    std::array<std::uint32_t, 256> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (std::size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xffu] ^ (crc >> 8);
  return ~crc;
}

/// The legacy file's writer: AtomicFile with the values of the format.
class CheckpointWriter {
 public:
  explicit CheckpointWriter(std::string path) : file_(std::move(path), "the checkpoint file") {}
  void bytes(const void* data, std::size_t n) { file_.write(data, n); }
  template <class T>
  void value(T v) {
    bytes(&v, sizeof v);
  }
  std::size_t written() const { return file_.written(); }
  void commit() { file_.commit(); }

 private:
  AtomicFile file_;
};

/// Reads a checkpoint from memory, checking every length against what is left.
class CheckpointReader {
 public:
  CheckpointReader(const std::vector<unsigned char>& data, std::string path) : data_(data), path_(std::move(path)) {}

  void bytes(void* out, std::size_t n) {
    if (n == 0) return;  // (out may be the null data() of an empty array)
    if (n > data_.size() - at_) corrupt("it ends early (truncated?)");
    std::memcpy(out, data_.data() + at_, n);
    at_ += n;
  }
  template <class T>
  T value() {
    T v;
    bytes(&v, sizeof v);
    return v;
  }
  std::string text(std::size_t max = checkpoint_max_text) {
    const auto n = value<std::uint32_t>();
    if (n > max) corrupt("a string length of " + std::to_string(n) + " is implausible");
    std::string s(n, '\0');
    bytes(s.data(), n);
    return s;
  }
  std::size_t at() const { return at_; }
  const unsigned char* data() const { return data_.data(); }
  std::size_t size() const { return data_.size(); }

  [[noreturn]] void corrupt(const std::string& why) const {
    fail("tandem: the checkpoint `" + path_ + "` is corrupt: " + why + " (at byte " + std::to_string(at_) + ")");
  }

 private:
  const std::vector<unsigned char>& data_;
  std::string path_;
  std::size_t at_ = 0;
};

}  // namespace detail

/// Writes `c` to `path` atomically (temporary file, fsync, rename, the directory's fsync). Throws tandem::error on
/// failure; the previous file at `path`, if any, is then untouched, unless only the directory's flush failed: the new
/// file is then in place (the message says so), but a power loss may bring the previous one back.
inline void write_checkpoint(const std::string& path, const CheckpointData& c) {
  detail::CheckpointWriter w(path);
  std::vector<unsigned char> header;
  auto put = [&header](const void* p, std::size_t n) {
    header.insert(header.end(), static_cast<const unsigned char*>(p), static_cast<const unsigned char*>(p) + n);
  };
  auto put_text = [&](const std::string& s) {
    if (s.size() > checkpoint_max_text)
      detail::fail("tandem: cannot save a checkpoint: the name `" + s.substr(0, 64) + "...` is " +
                   std::to_string(s.size()) + " bytes long; checkpoints hold names of at most " +
                   std::to_string(checkpoint_max_text) + " bytes");
    const auto n = static_cast<std::uint32_t>(s.size());
    put(&n, 4);
    put(s.data(), s.size());
  };
  const auto dtype = static_cast<std::uint8_t>(c.param_dtype);
  const auto count = static_cast<std::uint32_t>(c.tensors.size());
  put(&c.step, 8);
  put(&c.state_count, 4);
  put(&dtype, 1);
  put_text(c.optimizer);
  put_text(c.saved_by_policy);
  put(&c.saved_world_size, 4);
  put(&c.optimizer_fingerprint, 8);
  put(&count, 4);
  for (const TensorSpec& t : c.tensors) {
    const auto d = static_cast<std::uint8_t>(t.dtype);
    const std::uint64_t n = t.numel;
    put_text(t.name);
    put(&n, 8);
    put(&d, 1);
  }
  w.bytes(detail::checkpoint_magic, 8);
  w.value(detail::checkpoint_version);
  w.value(static_cast<std::uint32_t>(header.size()));
  w.bytes(header.data(), header.size());
  w.value(detail::crc32(header.data(), header.size()));
  for (std::size_t i = 0; i < c.tensors.size(); ++i) {
    std::uint32_t crc = detail::crc32(c.params[i].data(), c.params[i].size());
    w.bytes(c.params[i].data(), c.params[i].size());
    if (c.param_dtype != DType::fp32) {
      crc = detail::crc32(c.masters[i].data(), c.masters[i].size() * 4, crc);
      w.bytes(c.masters[i].data(), c.masters[i].size() * 4);
    }
    for (const auto& s : c.states[i]) {
      crc = detail::crc32(s.data(), s.size() * 4, crc);
      w.bytes(s.data(), s.size() * 4);
    }
    w.value(crc);
  }
  const std::uint64_t before = w.written();
  w.bytes(detail::checkpoint_trailer, 8);
  w.value(before);
  w.commit();
}

/// Verifies and decodes checkpoint bytes: magic, version, every checksum, the trailer, and that every length is
/// plausible. `path` names the source in messages. Throws tandem::error naming the first problem.
inline CheckpointData parse_checkpoint(const std::vector<unsigned char>& data, const std::string& path) {
  detail::CheckpointReader r(data, path);
  char magic[8];
  r.bytes(magic, 8);
  if (std::memcmp(magic, detail::checkpoint_magic, 8) != 0) r.corrupt("it is not a tandem checkpoint (bad magic)");
  const auto version = r.value<std::uint32_t>();
  if (version != detail::checkpoint_version)
    detail::fail("tandem: the checkpoint `" + path + "` has format version " + std::to_string(version) +
                 "; this tandem reads version " + std::to_string(detail::checkpoint_version));
  const auto header_bytes = r.value<std::uint32_t>();
  if (header_bytes > data.size() - r.at()) r.corrupt("the header is longer than the file (truncated?)");
  const std::uint32_t header_crc = detail::crc32(data.data() + r.at(), header_bytes);
  const std::size_t header_end = r.at() + header_bytes;

  CheckpointData c;
  c.step = r.value<std::uint64_t>();
  c.state_count = r.value<std::uint32_t>();
  c.param_dtype = static_cast<DType>(r.value<std::uint8_t>());
  c.optimizer = r.text();
  c.saved_by_policy = r.text();
  c.saved_world_size = r.value<std::uint32_t>();
  c.optimizer_fingerprint = r.value<std::uint64_t>();
  const auto count = r.value<std::uint32_t>();
  if (c.state_count > 2) r.corrupt("state_count " + std::to_string(c.state_count) + " is implausible");
  if (c.param_dtype != DType::fp32 && c.param_dtype != DType::bf16 && c.param_dtype != DType::fp16)
    r.corrupt("unknown parameter dtype");
  if (count > data.size()) r.corrupt("the tensor count is implausible");
  for (std::uint32_t i = 0; i < count; ++i) {
    TensorSpec t;
    t.name = r.text();
    t.numel = r.value<std::uint64_t>();
    t.dtype = static_cast<DType>(r.value<std::uint8_t>());
    if (t.numel > max_numel) r.corrupt("tensor " + std::to_string(i) + " has an implausible size");
    c.tensors.push_back(std::move(t));
  }
  if (r.at() != header_end) r.corrupt("the header's length does not match its contents");
  if (r.value<std::uint32_t>() != header_crc) r.corrupt("the header's checksum does not match");
  c.content_id = detail::fnv1a(&header_crc, sizeof header_crc);

  const std::size_t psize = dtype_size(c.param_dtype);
  for (std::size_t i = 0; i < c.tensors.size(); ++i) {
    const std::size_t n = c.tensors[i].numel;
    const std::size_t floats = (c.param_dtype != DType::fp32 ? n : 0) + c.state_count * n;
    if (n * psize + floats * 4 + 4 > data.size() - r.at())
      r.corrupt("tensor " + std::to_string(i) + " (`" + c.tensors[i].name + "`) is cut short (truncated?)");
    const std::uint32_t crc = detail::crc32(data.data() + r.at(), n * psize + floats * 4);
    c.params.emplace_back(n * psize);
    r.bytes(c.params.back().data(), n * psize);
    c.masters.emplace_back(c.param_dtype != DType::fp32 ? n : 0);
    r.bytes(c.masters.back().data(), c.masters.back().size() * 4);
    c.states.emplace_back(c.state_count, std::vector<float>(n));
    for (auto& s : c.states.back()) r.bytes(s.data(), n * 4);
    if (r.value<std::uint32_t>() != crc)
      r.corrupt("the checksum of tensor " + std::to_string(i) + " (`" + c.tensors[i].name + "`) does not match");
    c.content_id = detail::fnv1a(&crc, sizeof crc, c.content_id);
  }
  const std::size_t before = r.at();
  char trailer[8];
  r.bytes(trailer, 8);
  if (std::memcmp(trailer, detail::checkpoint_trailer, 8) != 0 || r.value<std::uint64_t>() != before)
    r.corrupt("the trailer is missing or wrong");
  if (r.at() != data.size()) r.corrupt("there are extra bytes after the trailer");
  return c;
}

/// Reads and verifies the checkpoint at `path` (parse_checkpoint). A file of another format is refused by its first
/// bytes, before the rest is read: a safetensors file (a model's weights, a consolidated checkpoint) says so.
inline CheckpointData read_checkpoint(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) detail::fail("tandem: cannot open the checkpoint `" + path + "`: " + std::strerror(errno));
  std::vector<unsigned char> data(9);
  data.resize(std::fread(data.data(), 1, data.size(), f));
  if (data.size() < 8 || std::memcmp(data.data(), detail::checkpoint_magic, 8) != 0) {
    std::fclose(f);
    std::uint64_t header = 0;  // a safetensors file: a little-endian header length, then the header's '{'
    for (std::size_t k = 0; k < 8 && k < data.size(); ++k) header |= std::uint64_t{data[k]} << (8 * k);
    if (data.size() == 9 && data[8] == '{' && header >= 2)
      detail::fail("tandem: `" + path +
                   "` is a safetensors file, not a tandem checkpoint: load a checkpoint's directory, or make one of "
                   "this file's tensors with `tandem_checkpoint import` (tandem::import_parameters)");
    data.resize(std::min<std::size_t>(data.size(), 8));
    return parse_checkpoint(data, path);  // says which: too short, or not a tandem checkpoint
  }
  std::error_code ec;
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  if (!ec) data.reserve(static_cast<std::size_t>(size));
  unsigned char buffer[1 << 16];
  for (std::size_t n; (n = std::fread(buffer, 1, sizeof buffer, f)) > 0;) data.insert(data.end(), buffer, buffer + n);
  const bool bad = std::ferror(f);
  std::fclose(f);
  if (bad) detail::fail("tandem: cannot read the checkpoint `" + path + "`");
  return parse_checkpoint(data, path);
}

}  // namespace tandem
