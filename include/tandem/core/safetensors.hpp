// SPDX-License-Identifier: Apache-2.0
// safetensors files (the format of Hugging Face's `safetensors`, which PyTorch, JAX and NumPy users open): an 8-byte
// little-endian header length N, N bytes of JSON (padded with spaces to a multiple of 8), then the data, each tensor's
// bytes at [data_offsets[0], data_offsets[1]) of the data section, contiguous, in offset order, covering it exactly.
//
//   {"__metadata__": {"k": "v", ...}, "<name>": {"dtype": "F32", "shape": [n], "data_offsets": [b, e]}, ...}
//
// SafetensorsWriter streams a file of 1-D tensors declared up front, in bounded memory, and records each tensor's
// CRC-32C in the metadata (`crc32c/<name>`, 8 hex digits, so the header's length is known before the data and the
// header is rewritten with the values at commit; the header's own CRC then covers the file); SafetensorsFile reads a
// header, validates it as the reference implementation does, and reads ranges. Only F32, BF16, F16 and F64 tensors are
// tandem's; other dtypes are refused by name.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tandem/core/atomic_file.hpp"
#include "tandem/core/crc32c.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/hash.hpp"
#include "tandem/core/json.hpp"

namespace tandem {

/// The safetensors name of a dtype ("F32", "BF16", "F16", "F64").
constexpr const char* safetensors_dtype(DType t) {
  switch (t) {
    case DType::fp32:
      return "F32";
    case DType::bf16:
      return "BF16";
    case DType::fp16:
      return "F16";
    case DType::fp64:
      return "F64";
  }
  return "?";
}

/// One 1-D tensor of a file being written.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::fp32;
  std::uint64_t count = 0;  ///< elements
};

/// What a committed file is: its size and the CRC-32C of its header, which records every tensor's CRC-32C (so the two
/// together cover every byte).
struct SafetensorsSummary {
  std::uint64_t bytes = 0;
  std::uint32_t header_crc = 0;
};

namespace detail {

/// The largest header tandem reads (the reference implementation's limit).
inline constexpr std::uint64_t safetensors_max_header = std::uint64_t{100} << 20;

}  // namespace detail

class SafetensorsWriter {
 public:
  /// Declares the file's tensors (their data follows in this order) and its metadata, and writes the header.
  SafetensorsWriter(std::string path, std::vector<SafetensorsEntry> entries,
                    std::vector<std::pair<std::string, std::string>> metadata, std::string what)
      : file_(std::move(path), what), entries_(std::move(entries)), metadata_(std::move(metadata)) {
    std::vector<const std::string*> names;
    for (const SafetensorsEntry& e : entries_) names.push_back(&e.name);
    std::sort(names.begin(), names.end(), [](const std::string* a, const std::string* b) { return *a < *b; });
    for (std::size_t i = 1; i < names.size(); ++i)
      if (*names[i] == *names[i - 1])
        detail::fail("tandem: " + what + " would hold two tensors named `" + *names[i] + "`");
    crcs_.assign(entries_.size(), 0);
    header_ = header();
    const std::uint64_t n = header_.size();
    file_.write(&n, 8);
    file_.write(header_.data(), header_.size());
  }

  /// The next n bytes of the data: the current tensor's, then the next ones' (a tensor may come in pieces). Small
  /// pieces are gathered into one write of up to 8 MiB; large ones are written as they are.
  void data(const void* p, std::size_t n) {
    const auto* c = static_cast<const unsigned char*>(p);
    while (n > 0) {
      while (current_ < entries_.size() && done_ == bytes(current_)) {
        ++current_;
        done_ = 0;
      }
      if (current_ == entries_.size()) detail::fail("tandem: internal error: more data than the declared tensors");
      const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(n, bytes(current_) - done_));
      crcs_[current_] = detail::crc32c(c, k, crcs_[current_]);
      put(c, k);
      c += k;
      n -= k;
      done_ += k;
    }
  }

  /// Rewrites the header with every tensor's CRC and commits the file atomically.
  SafetensorsSummary commit() {
    flush();
    std::uint64_t expected = 0;
    for (std::size_t i = 0; i < entries_.size(); ++i) expected += bytes(i);
    if (file_.written() - 8 - header_.size() != expected)
      detail::fail("tandem: internal error: a tensor's data was not written in full");
    const std::string final_header = header();
    if (final_header.size() != header_.size()) detail::fail("tandem: internal error: the header changed its length");
    file_.write_at(8, final_header.data(), final_header.size());
    const std::uint64_t size = file_.written();
    file_.commit();
    return {size, detail::crc32c(final_header.data(), final_header.size())};
  }

 private:
  static constexpr std::size_t buffer_bytes = std::size_t{8} << 20;

  std::uint64_t bytes(std::size_t i) const { return entries_[i].count * dtype_size(entries_[i].dtype); }

  void put(const unsigned char* p, std::size_t n) {
    if (buffer_.size() + n > buffer_bytes) flush();
    if (n >= buffer_bytes) {
      file_.write(p, n);
      return;
    }
    buffer_.insert(buffer_.end(), p, p + n);
  }
  void flush() {
    if (buffer_.empty()) return;
    file_.write(buffer_.data(), buffer_.size());
    buffer_.clear();
  }

  std::string header() const {
    using detail::json::quote;
    std::string h = "{\"__metadata__\":{";
    // (appended piece by piece: GCC 12 at -O3 warns falsely of overlapping copies in long `+` chains of strings)
    bool first = true;
    auto member = [&](const std::string& k, const std::string& v) {
      if (!first) h += ',';
      h += quote(k);
      h += ':';
      h += quote(v);
      first = false;
    };
    for (const auto& [k, v] : metadata_) member(k, v);
    for (std::size_t i = 0; i < entries_.size(); ++i) member("crc32c/" + entries_[i].name, detail::hex8(crcs_[i]));
    h += '}';
    std::uint64_t at = 0;
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      const SafetensorsEntry& e = entries_[i];
      h += ',';
      h += quote(e.name);
      h += ":{\"dtype\":\"";
      h += safetensors_dtype(e.dtype);
      h += "\",\"shape\":[";
      h += std::to_string(e.count);
      h += "],\"data_offsets\":[";
      h += std::to_string(at);
      h += ',';
      h += std::to_string(at + bytes(i));
      h += "]}";
      at += bytes(i);
    }
    h += "}";
    h.append((8 - h.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
    return h;
  }

  detail::AtomicFile file_;
  std::vector<SafetensorsEntry> entries_;
  std::vector<std::pair<std::string, std::string>> metadata_;
  std::vector<std::uint32_t> crcs_;
  std::string header_;
  std::vector<unsigned char> buffer_;
  std::size_t current_ = 0;
  std::uint64_t done_ = 0;
};

/// One tensor of a safetensors file.
struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::fp32;
  std::vector<std::uint64_t> shape;
  std::uint64_t begin = 0, end = 0;  ///< bytes of the data section
  std::uint64_t count() const {
    std::uint64_t n = 1;
    for (std::uint64_t d : shape) n *= d;
    return n;
  }
};

/// A safetensors header: its tensors (in the header's order) and its metadata.
struct SafetensorsHeader {
  std::vector<SafetensorsTensor> tensors;
  std::vector<std::pair<std::string, std::string>> metadata;
};

namespace detail {

[[noreturn]] inline void safetensors_corrupt(const std::string& path, const std::string& why) {
  fail("tandem: `" + path + "` is not a valid safetensors file: " + why);
}

inline SafetensorsTensor safetensors_tensor(const std::string& name, const json::Value& v, const std::string& path) {
  using Kind = json::Value::Kind;
  if (v.kind != Kind::object) safetensors_corrupt(path, "the entry of `" + name + "` is not an object");
  SafetensorsTensor t;
  t.name = name;
  const auto* dtype = v.find("dtype");
  const auto* shape = v.find("shape");
  const auto* offsets = v.find("data_offsets");
  if (!dtype || dtype->kind != Kind::string || !shape || shape->kind != Kind::array || !offsets ||
      offsets->kind != Kind::array || offsets->items.size() != 2)
    safetensors_corrupt(path, "the entry of `" + name + "` lacks a dtype, a shape or two data_offsets");
  if (dtype->string == "F32")
    t.dtype = DType::fp32;
  else if (dtype->string == "BF16")
    t.dtype = DType::bf16;
  else if (dtype->string == "F16")
    t.dtype = DType::fp16;
  else if (dtype->string == "F64")
    t.dtype = DType::fp64;
  else
    fail("tandem: `" + path + "`: tensor `" + name + "` is " + dtype->string +
         "; tandem reads F32, BF16, F16 and F64 tensors");
  std::uint64_t count = 1;
  for (const auto& d : shape->items) {
    if (d.kind != Kind::number || !d.is_count) safetensors_corrupt(path, "the shape of `" + name + "` is not sizes");
    if (d.count != 0 && count > (std::uint64_t{1} << 60) / d.count)
      safetensors_corrupt(path, "the shape of `" + name + "` overflows");
    count *= d.count;
    t.shape.push_back(d.count);
  }
  for (const auto& o : offsets->items)
    if (o.kind != Kind::number || !o.is_count)
      safetensors_corrupt(path, "the data_offsets of `" + name + "` are not sizes");
  t.begin = offsets->items[0].count;
  t.end = offsets->items[1].count;
  if (t.end < t.begin || t.end - t.begin != count * dtype_size(t.dtype))
    safetensors_corrupt(path, "the data_offsets of `" + name + "` do not match its shape and dtype");
  return t;
}

}  // namespace detail

/// Parses and validates a safetensors header (the JSON text) for a data section of `data_bytes`, as the reference
/// implementation does: an object; __metadata__ of strings; each tensor's dtype, shape and offsets consistent; the
/// tensors contiguous in offset order, covering the data exactly; no name twice. `path` names the file in errors.
inline SafetensorsHeader parse_safetensors_header(const std::string& text, std::uint64_t data_bytes,
                                                  const std::string& path) {
  if (text.empty() || text[0] != '{') detail::safetensors_corrupt(path, "its header does not start with '{'");
  const detail::json::Value header = detail::json::parse(text, "the header of `" + path + "`");
  if (header.kind != detail::json::Value::Kind::object)
    detail::safetensors_corrupt(path, "its header is not an object");
  SafetensorsHeader h;
  for (const auto& [name, v] : header.members) {
    if (name == "__metadata__") {
      if (v.kind != detail::json::Value::Kind::object)
        detail::safetensors_corrupt(path, "__metadata__ is not an object");
      for (const auto& [k, value] : v.members) {
        if (value.kind != detail::json::Value::Kind::string)
          detail::safetensors_corrupt(path, "metadata `" + k + "` is not a string");
        h.metadata.emplace_back(k, value.string);
      }
      continue;
    }
    h.tensors.push_back(detail::safetensors_tensor(name, v, path));
  }
  std::vector<const SafetensorsTensor*> by_offset;
  for (const SafetensorsTensor& t : h.tensors) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](const SafetensorsTensor* a, const SafetensorsTensor* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  std::uint64_t at = 0;
  for (const SafetensorsTensor* t : by_offset) {
    if (t->begin != at)
      detail::safetensors_corrupt(path,
                                  "the data of `" + t->name + "` does not start where the previous tensor's ends");
    at = t->end;
  }
  if (at != data_bytes) detail::safetensors_corrupt(path, "its tensors do not cover its data section exactly");
  std::vector<const std::string*> names;
  for (const SafetensorsTensor& t : h.tensors) names.push_back(&t.name);
  std::sort(names.begin(), names.end(), [](const std::string* a, const std::string* b) { return *a < *b; });
  for (std::size_t i = 1; i < names.size(); ++i)
    if (*names[i] == *names[i - 1]) detail::safetensors_corrupt(path, "it names `" + *names[i] + "` twice");
  return h;
}

/// A safetensors file opened for reading: its header parsed and validated, its data read by range.
class SafetensorsFile {
 public:
  using Tensor = SafetensorsTensor;

  explicit SafetensorsFile(std::string path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) detail::fail("tandem: cannot open `" + path_ + "`: " + std::strerror(errno));
    try {
      parse();
    } catch (...) {
      ::close(fd_);
      throw;
    }
  }
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  SafetensorsFile(SafetensorsFile&& o) noexcept
      : path_(std::move(o.path_)),
        fd_(std::exchange(o.fd_, -1)),
        tensors_(std::move(o.tensors_)),
        by_name_(std::move(o.by_name_)),
        metadata_(std::move(o.metadata_)),
        data_begin_(o.data_begin_),
        size_(o.size_),
        header_crc_(o.header_crc_) {}
  SafetensorsFile& operator=(SafetensorsFile&&) = delete;
  ~SafetensorsFile() {
    if (fd_ >= 0) ::close(fd_);
  }

  const std::string& path() const { return path_; }
  std::uint64_t size() const { return size_; }
  /// The tensors, in the header's order.
  const std::vector<Tensor>& tensors() const { return tensors_; }
  const Tensor* find(std::string_view name) const {
    const auto it = std::lower_bound(by_name_.begin(), by_name_.end(), name,
                                     [&](std::size_t i, std::string_view n) { return tensors_[i].name < n; });
    return it != by_name_.end() && tensors_[*it].name == name ? &tensors_[*it] : nullptr;
  }
  /// The value of metadata key k, or null.
  const std::string* metadata(std::string_view k) const {
    const auto it = std::lower_bound(metadata_.begin(), metadata_.end(), k,
                                     [](const auto& entry, std::string_view key) { return entry.first < key; });
    return it != metadata_.end() && it->first == k ? &it->second : nullptr;
  }
  /// The CRC-32C of the header's text (what the checkpoint's manifest records of the file).
  std::uint32_t header_crc() const { return header_crc_; }

  /// n bytes at `offset` of the data section.
  void read(std::uint64_t offset, void* out, std::size_t n) const {
    auto* p = static_cast<unsigned char*>(out);
    std::uint64_t at = data_begin_ + offset;
    while (n > 0) {
      const ssize_t r = ::pread(fd_, p, n, static_cast<off_t>(at));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0)
        detail::fail("tandem: cannot read `" + path_ + "`" +
                     (r < 0 ? ": " + std::string(std::strerror(errno)) : std::string(": it ends early")));
      p += r;
      n -= static_cast<std::size_t>(r);
      at += static_cast<std::uint64_t>(r);
    }
  }

  /// The CRC-32C that the file's metadata records for tensor `name` (crc32c/<name>), if it records one.
  bool recorded_crc(std::string_view name, std::uint32_t& crc) const {
    const std::string* v = metadata("crc32c/" + std::string(name));
    if (v == nullptr) return false;
    std::uint64_t value = 0;
    if (!detail::parse_hex(*v, 8, value)) corrupt("the checksum of `" + std::string(name) + "` is not 8 hex digits");
    crc = static_cast<std::uint32_t>(value);
    return true;
  }

  [[noreturn]] void corrupt(const std::string& why) const { detail::safetensors_corrupt(path_, why); }

 private:
  void parse() {
    struct stat st;
    if (::fstat(fd_, &st) != 0) detail::fail("tandem: cannot stat `" + path_ + "`: " + std::strerror(errno));
    size_ = static_cast<std::uint64_t>(st.st_size);
    if (size_ < 8) corrupt("it is shorter than its 8-byte header length");
    std::uint64_t n = 0;
    data_begin_ = 0;
    read(0, &n, 8);
    if (n > detail::safetensors_max_header) corrupt("its header length " + std::to_string(n) + " is over 100 MiB");
    if (n > size_ - 8) corrupt("its header is longer than the file (truncated?)");
    std::string text(static_cast<std::size_t>(n), '\0');
    read(8, text.data(), text.size());
    data_begin_ = 8 + n;
    SafetensorsHeader h = parse_safetensors_header(text, size_ - data_begin_, path_);
    tensors_ = std::move(h.tensors);
    metadata_ = std::move(h.metadata);
    header_crc_ = detail::crc32c(text.data(), text.size());
    // Looked up by name (a shard holds a slice of every tensor, several arrays each: tens of thousands of names)
    for (std::size_t i = 0; i < tensors_.size(); ++i) by_name_.push_back(i);
    std::sort(by_name_.begin(), by_name_.end(),
              [&](std::size_t a, std::size_t b) { return tensors_[a].name < tensors_[b].name; });
    std::stable_sort(metadata_.begin(), metadata_.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
  }

  std::string path_;
  int fd_ = -1;
  std::vector<Tensor> tensors_;
  std::vector<std::size_t> by_name_;                           ///< tensors_' indices, by name
  std::vector<std::pair<std::string, std::string>> metadata_;  ///< by key
  std::uint64_t data_begin_ = 0, size_ = 0;
  std::uint32_t header_crc_ = 0;
};

}  // namespace tandem
