// SPDX-License-Identifier: Apache-2.0
// safetensors files (the format of Hugging Face's `safetensors`, which PyTorch, JAX and NumPy users open): an 8-byte
// little-endian header length N, N bytes of JSON (padded with spaces; tandem's writer starts the data 64-byte aligned,
// the format asks for 8), then the data, each tensor's bytes at [data_offsets[0], data_offsets[1]) of the data
// section, contiguous, in offset order, covering it exactly.
//
//   {"__metadata__": {"k": "v", ...}, "<name>": {"dtype": "F32", "shape": [n], "data_offsets": [b, e]}, ...}
//
// SafetensorsWriter streams a file of 1-D tensors declared up front, in bounded memory, and records every tensor's
// CRC-32C in one metadata value (`crc32c`: 8 hex digits per tensor, in the order of their data, so the header's length
// is known before the data and the digits are written in place at commit; the header's own CRC then covers the file),
// beside `tandem_checksums: crc32c`, which says the checksums are tandem's;
// SafetensorsFile reads a header (as a stream: no JSON document is built; entries in the form the writers write are
// matched byte for byte, any other form parsed in full; each tensor's name and shape are views of the header, which
// keeps its text and one array of dimensions, so nothing is allocated per tensor), validates it as the reference
// implementation does, finds tensors by name through a hash index, and reads ranges. Files of the earlier forms (no
// `tandem_checksums`, which tandem's shards and consolidated files say by `format: tandem-checkpoint-shard` or a
// `tandem_step`; a `crc32c/<name>` key per tensor) read the same; in any other file those keys are its own metadata.
// Only F32, BF16, F16 and F64 tensors are tandem's; other dtypes are refused by name.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <span>
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

/// The metadata key by which a file says that its `crc32c` value is tandem's checksums (its value: "crc32c").
inline constexpr std::string_view safetensors_checksums_key = "tandem_checksums";
/// The `format` of tandem's shard and imported files, and the key of a consolidated file's step: also the marks of
/// tandem's files written before safetensors_checksums_key, whose `crc32c` is tandem's too.
inline constexpr const char* safetensors_shard_format = "tandem-checkpoint-shard";
inline constexpr const char* safetensors_step_key = "tandem_step";

/// The largest header tandem reads and writes: the reference implementation's limit (100,000,000 bytes, not 100 MiB).
inline constexpr std::uint64_t safetensors_max_header = 100'000'000;

/// That text `s` is UTF-8, as a safetensors header must be; else throws tandem::error saying that `what` would hold
/// it (the part before the first byte that is not), then `advice`.
TANDEM_COLD inline void check_utf8(std::string_view s, const std::string& what, const std::string& advice = "") {
  const std::size_t valid = json::utf8_prefix(s);
  if (valid != s.size())
    fail("tandem: " + what +
         naming(" that is not UTF-8 from byte " + std::to_string(valid) + " on (", s.substr(0, valid), " before it)") +
         advice);
}

/// That a file of `entries` can name each apart: no two share a name, none is `__metadata__` (the header's key for
/// the file's metadata), and each is UTF-8. Throws tandem::error saying that `what` would hold them, then `advice`.
TANDEM_COLD inline void check_entry_names(const std::vector<SafetensorsEntry>& entries, const std::string& what,
                                          const std::string& advice = "") {
  for (const SafetensorsEntry& e : entries) {
    if (e.name == "__metadata__")
      fail("tandem: " + what +
           " would hold a tensor named `__metadata__`, the safetensors header's key for its metadata" + advice);
    check_utf8(e.name, what + " would hold a tensor name", advice);
  }
  NameIndex names;
  const std::size_t repeated =
      names.build(entries.size(), [&](std::size_t k) -> std::string_view { return entries[k].name; });
  if (repeated != entries.size())
    fail("tandem: " + what + " would hold two tensors named `" + entries[repeated].name + "`" + advice);
}

}  // namespace detail

class SafetensorsWriter {
 public:
  /// Declares the file's tensors (their data follows in this order) and its metadata, and writes the header.
  SafetensorsWriter(std::string path, std::vector<SafetensorsEntry> entries,
                    std::vector<std::pair<std::string, std::string>> metadata, std::string what)
      : file_(std::move(path), what), entries_(std::move(entries)), metadata_(std::move(metadata)) {
    detail::check_entry_names(entries_, what);
    for (const auto& [k, v] : metadata_) {
      if (k == "crc32c" || k.starts_with("crc32c/") || k == detail::safetensors_checksums_key)
        detail::fail("tandem: " + what + " cannot take metadata `" + k + "`: the writer records the checksums there");
      detail::check_utf8(k, what + " would hold a metadata key");
      detail::check_utf8(v, what + " would hold a metadata value");
    }
    crcs_.assign(entries_.size(), 0);
    header_ = header();  // (the checksums' digits zero until commit)
    const std::uint64_t n = header_.size();
    if (n > detail::safetensors_max_header)  // what is written can be read: the readers' limit, checked here too
      detail::fail("tandem: " + what + " would have a header of " + std::to_string(n) +
                   " bytes, over the 100,000,000 that safetensors readers (tandem's, and the reference implementation) "
                   "accept: fewer or shorter tensor names");
    std::uint64_t total = 8 + n;
    for (std::size_t i = 0; i < entries_.size(); ++i) total += bytes(i);
    file_.reserve(total);
    file_.write(&n, 8);
    file_.write(header_.data(), header_.size());
  }

  /// The next n bytes of the data: the current tensor's, then the next ones' (a tensor may come in pieces), copied (p
  /// may change once this returns). Small pieces are gathered into one write of up to 1 MiB; large ones are written as
  /// they are.
  void data(const void* p, std::size_t n) { append(static_cast<const unsigned char*>(p), n, false); }
  /// As data(), but small pieces are written from where they are, as late as commit(): the bytes must stay unchanged
  /// until then. (Pieces that lie next to each other in memory are written by one call, nothing copied.)
  void data_in_place(const void* p, std::size_t n) { append(static_cast<const unsigned char*>(p), n, true); }

  /// Rewrites the header with every tensor's CRC (in place: same width) and commits the file atomically.
  SafetensorsSummary commit() {
    flush();
    std::uint64_t expected = 0;
    for (std::size_t i = 0; i < entries_.size(); ++i) expected += bytes(i);
    if (file_.written() - 8 - header_.size() != expected)
      detail::fail("tandem: internal error: a tensor's data was not written in full");
    for (std::size_t i = 0; i < entries_.size(); ++i) detail::write_hex(header_.data() + crcs_at_ + 8 * i, crcs_[i], 8);
    file_.write_at(8, header_.data(), header_.size());
    const std::uint64_t size = file_.written();
    file_.commit();
    return {size, detail::crc32c(header_.data(), header_.size())};
  }

 private:
  static constexpr std::size_t buffer_bytes = std::size_t{1} << 20;
  static constexpr std::size_t data_alignment = 64;

  std::uint64_t bytes(std::size_t i) const { return entries_[i].count * dtype_size(entries_[i].dtype); }

  void append(const unsigned char* c, std::size_t n, bool in_place) {
    while (n > 0) {
      while (current_ < entries_.size() && done_ == bytes(current_)) {
        ++current_;
        done_ = 0;
      }
      if (current_ == entries_.size()) detail::fail("tandem: internal error: more data than the declared tensors");
      const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(n, bytes(current_) - done_));
      crcs_[current_] = detail::crc32c(c, k, crcs_[current_]);
      put(c, k, in_place);
      c += k;
      n -= k;
      done_ += k;
    }
  }

  /// Queues n bytes for the next gathered write (from where they are, or from a copy in buffer_), or writes a large
  /// piece at once.
  void put(const unsigned char* p, std::size_t n, bool in_place) {
    if (n >= buffer_bytes) {
      flush();
      file_.write(p, n);
      return;
    }
    if (pending_bytes_ + n > buffer_bytes || pending_.size() == detail::AtomicFile::max_pieces) flush();
    if (!in_place) {
      if (buffer_.capacity() == 0) buffer_.reserve(buffer_bytes);  // (at most what is pending: never reallocated)
      buffer_.insert(buffer_.end(), p, p + n);
      p = buffer_.data() + buffer_.size() - n;
    }
    pending_bytes_ += n;
    if (!pending_.empty() &&
        static_cast<const unsigned char*>(pending_.back().iov_base) + pending_.back().iov_len == p) {
      pending_.back().iov_len += n;  // (next to the previous piece)
      return;
    }
    pending_.push_back({const_cast<unsigned char*>(p), n});
  }
  void flush() {
    if (pending_.empty()) return;
    file_.write(pending_);
    pending_.clear();
    pending_bytes_ = 0;
    buffer_.clear();
  }

  /// The header, with the checksums' digits zero; where they start goes to crcs_at_.
  std::string header() {
    using detail::json::quote_into;
    std::size_t estimate = 64;  // (reserved: a shard's header is megabytes)
    for (const auto& [k, v] : metadata_) estimate += k.size() + v.size() + 8;
    for (const SafetensorsEntry& e : entries_) estimate += e.name.size() + 96;
    std::string h;
    h.reserve(estimate);
    h += "{\"__metadata__\":{";
    // (appended piece by piece: GCC 12 at -O3 warns falsely of overlapping copies in long `+` chains of strings)
    auto number = [&](std::uint64_t v) {
      char digits[24];
      h.append(digits, std::to_chars(digits, digits + sizeof digits, v).ptr);
    };
    for (const auto& [k, v] : metadata_) {
      quote_into(h, k);
      h += ':';
      quote_into(h, v);
      h += ',';
    }
    quote_into(h, detail::safetensors_checksums_key);
    h += ":\"crc32c\",\"crc32c\":\"";
    crcs_at_ = h.size();
    h.append(8 * entries_.size(), '0');
    h += '"';
    h += '}';
    std::uint64_t at = 0;
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      const SafetensorsEntry& e = entries_[i];
      h += ',';
      quote_into(h, e.name);
      h += ":{\"dtype\":\"";
      h += safetensors_dtype(e.dtype);
      h += "\",\"shape\":[";
      number(e.count);
      h += "],\"data_offsets\":[";
      number(at);
      h += ',';
      number(at + bytes(i));
      h += "]}";
      at += bytes(i);
    }
    h += "}";
    // The data starts 64-byte aligned in the file (the format asks for 8): a read into memory whose address differs
    // from the file offset by other than a multiple of 32 bytes copies out of the page cache a third slower.
    h.append((data_alignment - (8 + h.size()) % data_alignment) % data_alignment, ' ');
    return h;
  }

  detail::AtomicFile file_;
  std::vector<SafetensorsEntry> entries_;
  std::vector<std::pair<std::string, std::string>> metadata_;
  std::vector<std::uint32_t> crcs_;
  std::size_t crcs_at_ = 0;  ///< where the digits of crcs_[0] are in header_ (each tensor's 8 follow)
  std::string header_;
  std::vector<unsigned char> buffer_;  ///< copies of the pending pieces given by data()
  std::vector<struct iovec> pending_;  ///< what the next gathered write writes, in order
  std::size_t pending_bytes_ = 0;
  std::size_t current_ = 0;
  std::uint64_t done_ = 0;
};

/// One tensor of a safetensors file. Its name and shape are views of the header that holds it (SafetensorsHeader,
/// SafetensorsFile): valid while that lives, and never allocated one by one (a shard's header names tens of thousands).
struct SafetensorsTensor {
  std::string_view name;
  DType dtype = DType::fp32;
  std::span<const std::uint64_t> shape;
  std::uint64_t begin = 0, end = 0;  ///< bytes of the data section
  bool has_crc = false;              ///< whether the file's metadata records its CRC-32C
  std::uint32_t crc = 0;             ///< (has_crc)
  /// Elements (the product of the shape, which the parser checked against the data offsets).
  std::uint64_t count() const { return (end - begin) / dtype_size(dtype); }
};

/// A safetensors header: its tensors (in the header's order), found by name, and its metadata. It holds its text, which
/// the tensors' names view (those written with escapes: a copy, unescaped), and their shapes. Moved, not copied.
class SafetensorsHeader {
 public:
  std::vector<SafetensorsTensor> tensors;
  std::vector<std::pair<std::string, std::string>> metadata;  ///< but the tensors' checksums, parsed into them

  SafetensorsHeader() = default;
  SafetensorsHeader(SafetensorsHeader&&) = default;
  SafetensorsHeader& operator=(SafetensorsHeader&&) = default;

  /// The index in `tensors` of the tensor named `name`, or detail::NameIndex::none.
  std::size_t index(std::string_view name) const {
    return by_name_.find(name, [&](std::size_t k) -> std::string_view { return tensors[k].name; });
  }
  /// The tensor named `name`, or null.
  const SafetensorsTensor* find(std::string_view name) const {
    const std::size_t i = index(name);
    return i == detail::NameIndex::none ? nullptr : &tensors[i];
  }
  /// The value of metadata key k (its first), or null.
  const std::string* find_metadata(std::string_view k) const {
    for (const auto& [key, value] : metadata)
      if (key == k) return &value;
    return nullptr;
  }

  /// Parses the n bytes of header text that `fill` writes into the header's own storage (fill(char* out)), for a data
  /// section of `data_bytes`: see parse_safetensors_header.
  template <class Fill>
  static SafetensorsHeader parse(std::size_t n, Fill&& fill, std::uint64_t data_bytes, const std::string& path);

 private:
  void parse_text(std::uint64_t data_bytes, const std::string& path);

  std::unique_ptr<char[]> text_;  ///< the JSON text (its address kept by a move: the names view it)
  std::size_t text_size_ = 0;
  std::deque<std::string> unescaped_;  ///< the names written with escapes, unescaped (stable addresses)
  std::vector<std::uint64_t> dims_;    ///< every tensor's shape, in the header's order
  detail::NameIndex by_name_;          ///< over `tensors`
};

namespace detail {

[[noreturn]] inline void safetensors_corrupt(const std::string& path, const std::string& why) {
  fail("tandem: `" + path + "` is not a valid safetensors file: " + why);
}

/// The dtype a safetensors name gives ("F32", "BF16", "F16", "F64"), or false.
inline bool safetensors_dtype_of(std::string_view name, DType& out) {
  for (const DType t : {DType::fp32, DType::bf16, DType::fp16, DType::fp64})
    if (name == safetensors_dtype(t)) {
      out = t;
      return true;
    }
  return false;
}

/// The entry at the cursor in the form the writers write (tandem's and the reference implementation's): exactly
/// {"dtype":"<one of tandem's>","shape":[n,...],"data_offsets":[b,e]}, no white space. Matched byte for byte into
/// t.dtype, `dims` (the shape appended) and `offsets`; anything else leaves the cursor and `dims` as they were (false).
inline bool safetensors_entry_as_written(json::Parser& p, SafetensorsTensor& t, std::vector<std::uint64_t>& dims,
                                         std::uint64_t (&offsets)[2]) {
  const std::size_t mark = p.position(), rank = dims.size();
  auto undo = [&] {
    p.rewind(mark);
    dims.resize(rank);
    return false;
  };
  if (!p.take("{\"dtype\":\"")) return undo();
  bool known = false;
  const std::size_t dtype_at = p.position();
  for (const DType d : {DType::fp32, DType::bf16, DType::fp16, DType::fp64}) {
    if (p.take(safetensors_dtype(d)) && p.take("\"")) {  // the whole name: "F32F64" is no dtype
      t.dtype = d;
      known = true;
      break;
    }
    p.rewind(dtype_at);
  }
  if (!known || !p.take(",\"shape\":[")) return undo();
  if (!p.take("]")) {
    do {
      std::uint64_t d = 0;
      if (!p.take_count(d)) return undo();
      dims.push_back(d);
    } while (p.take(","));
    if (!p.take("]")) return undo();
  }
  if (!p.take(",\"data_offsets\":[") || !p.take_count(offsets[0]) || !p.take(",") || !p.take_count(offsets[1]) ||
      !p.take("]}"))
    return undo();
  return true;
}

/// The entry of tensor `name` at the cursor: {"dtype": ..., "shape": [...], "data_offsets": [b, e]}, in any order
/// (the writers' form matched byte for byte, any other parsed member by member); its shape appended to `dims` (the
/// caller points t.shape at it once `dims` no longer grows).
inline SafetensorsTensor safetensors_tensor(std::string_view name, json::Parser& p, std::vector<std::uint64_t>& dims,
                                            const std::string& path) {
  const auto named = [&](const char* what) {
    return naming(std::string("the ").append(what).append(" of "), name, "");
  };
  if (p.next() != '{') safetensors_corrupt(path, named("entry") + " is not an object");
  SafetensorsTensor t;
  t.name = name;
  const std::size_t rank_at = dims.size();
  std::uint64_t offsets[2] = {0, 0};
  if (!safetensors_entry_as_written(p, t, dims, offsets)) {
    std::string dtype;
    std::vector<std::uint64_t> offset_list;
    bool has_dtype = false, has_shape = false, has_offsets = false, sizes = true;
    auto once = [&](bool& seen) {
      if (seen) safetensors_corrupt(path, named("entry") + " has a member twice");
      seen = true;
    };
    auto sizes_into = [&](std::vector<std::uint64_t>& out, bool& seen) {
      once(seen);
      if (p.next() != '[') {
        (void)p.value(2);
        sizes = false;
        return;
      }
      p.array([&] {
        std::uint64_t d = 0;
        sizes = p.count(d, 3) && sizes;
        out.push_back(d);
      });
    };
    p.object([&](std::string_view key) {
      if (key == "dtype") {
        once(has_dtype);
        if (p.next() != '"') safetensors_corrupt(path, named("dtype") + " is not a string");
        dtype = p.string();
      } else if (key == "shape") {
        sizes_into(dims, has_shape);
      } else if (key == "data_offsets") {
        sizes_into(offset_list, has_offsets);
      } else {
        (void)p.value(2);  // a member the format does not define: ignored, as the reference implementation does
      }
    });
    if (!has_dtype || !has_shape || !has_offsets || offset_list.size() != 2)
      safetensors_corrupt(path, named("entry") + " lacks a dtype, a shape or two data_offsets");
    if (!sizes) safetensors_corrupt(path, named("shape or data_offsets") + " are not sizes");
    if (!safetensors_dtype_of(dtype, t.dtype))
      fail(naming("tandem: `" + path + "`: tensor ", name, " is ") + dtype +
           "; tandem reads F32, BF16, F16 and F64 tensors");
    offsets[0] = offset_list[0];
    offsets[1] = offset_list[1];
  }
  std::uint64_t count = 1;
  for (std::size_t k = rank_at; k < dims.size(); ++k) {
    const std::uint64_t d = dims[k];
    if (d != 0 && count > (std::uint64_t{1} << 60) / d) safetensors_corrupt(path, named("shape") + " overflows");
    count *= d;
  }
  t.begin = offsets[0];
  t.end = offsets[1];
  if (t.end < t.begin || t.end - t.begin != count * dtype_size(t.dtype))
    safetensors_corrupt(path, named("data_offsets") + " do not match its shape and dtype");
  return t;
}

}  // namespace detail

/// Parses and validates a safetensors header (the JSON text) for a data section of `data_bytes`, as the reference
/// implementation does: an object; __metadata__ of strings; each tensor's dtype, shape and offsets consistent; the
/// tensors contiguous in offset order, covering the data exactly; no name twice. The CRC-32Cs the metadata of a file
/// of tandem's records (`crc32c`: 8 hex digits per tensor in the order of their data; or, as earlier files have them,
/// `crc32c/<name>`) are parsed into the tensors; in a file that is not tandem's (no `tandem_checksums: crc32c`,
/// `format: tandem-checkpoint-shard` or `tandem_step`) such keys are metadata like any other. `path` names the file in
/// errors. Read as a stream (no document is built); the header keeps a copy of the text.
inline SafetensorsHeader parse_safetensors_header(std::string_view text, std::uint64_t data_bytes,
                                                  const std::string& path) {
  return SafetensorsHeader::parse(
      text.size(), [&](char* out) { std::memcpy(out, text.data(), text.size()); }, data_bytes, path);
}

template <class Fill>
SafetensorsHeader SafetensorsHeader::parse(std::size_t n, Fill&& fill, std::uint64_t data_bytes,
                                           const std::string& path) {
  SafetensorsHeader h;
  h.text_ = std::make_unique_for_overwrite<char[]>(n);  // (not zeroed first: `fill` writes every byte)
  h.text_size_ = n;
  fill(h.text_.get());
  h.parse_text(data_bytes, path);
  return h;
}

inline void SafetensorsHeader::parse_text(std::uint64_t data_bytes, const std::string& path) {
  const std::string_view text(text_.get(), text_size_);
  if (text.empty() || text[0] != '{') detail::safetensors_corrupt(path, "its header does not start with '{'");
  detail::json::Parser p(text, "the header of `" + path + "`");
  tensors.reserve(text.size() / 64);  // (an entry takes some 60 bytes or more: reserved for most headers)
  dims_.reserve(text.size() / 64);
  std::vector<std::uint32_t> ranks;  // each tensor's, for pointing its shape at dims_ once that is complete
  ranks.reserve(text.size() / 64);
  constexpr std::string_view crc_key = "crc32c", name_crc_key = "crc32c/";
  std::string crcs_scratch;
  std::string_view crcs;  // (`crc32c`: a view of the text, which holds hex digits as they are)
  bool has_crcs = false;
  std::vector<std::pair<std::string, std::string>> named_crcs;  // (tensor name, 8 hex digits), from `crc32c/<name>`
  std::string scratch;
  const std::less<const char*> before;
  p.object([&](std::string_view name) {
    if (name != "__metadata__") {
      // A name without escapes is a view of the text; one with escapes comes unescaped in the parser's scratch.
      if (before(name.data(), text.data()) || !before(name.data(), text.data() + text.size()))
        name = unescaped_.emplace_back(name);
      const std::size_t rank_at = dims_.size();
      tensors.push_back(detail::safetensors_tensor(name, p, dims_, path));
      ranks.push_back(static_cast<std::uint32_t>(dims_.size() - rank_at));
      return;
    }
    if (p.next() != '{') detail::safetensors_corrupt(path, "__metadata__ is not an object");
    p.object([&](std::string_view k) {
      if (p.next() != '"') {
        std::string why = "metadata `";  // (appended: GCC 12 warns falsely of overlapping copies in `"..." + string&&`)
        why.append(k).append("` is not a string");
        detail::safetensors_corrupt(path, why);
      }
      if (k == crc_key && !has_crcs) {
        crcs = p.text(crcs_scratch);
        has_crcs = true;
      } else if (k.substr(0, name_crc_key.size()) == name_crc_key) {
        named_crcs.emplace_back(k.substr(name_crc_key.size()), p.text(scratch));
      } else {
        metadata.emplace_back(k, p.string());
      }
    });
  });
  p.finish();
  // Checksums only where the file says it is tandem's: another writer's `crc32c` (a whole file's, say) is metadata.
  const std::string* marker = find_metadata(detail::safetensors_checksums_key);
  const std::string* format = find_metadata("format");
  const bool tandems = (marker != nullptr && *marker == "crc32c") ||
                       (format != nullptr && *format == detail::safetensors_shard_format) ||
                       find_metadata(detail::safetensors_step_key) != nullptr;
  if (!tandems) {
    if (has_crcs) metadata.emplace_back(crc_key, crcs);
    for (auto& [name, v] : named_crcs) metadata.emplace_back(std::string(name_crc_key) + name, std::move(v));
    has_crcs = false;
    named_crcs.clear();
  }
  for (std::size_t k = 0, at = 0; k < tensors.size(); at += ranks[k++])
    tensors[k].shape = {dims_.data() + at, ranks[k]};
  // The tensors in the order of their data: the header's order where that is it (as the writers write them).
  const auto offset_order = [&](std::size_t a, std::size_t b) {
    const SafetensorsTensor &x = tensors[a], &y = tensors[b];
    return x.begin != y.begin ? x.begin < y.begin : x.end < y.end;
  };
  std::vector<std::size_t> by_offset;
  for (std::size_t i = 1; i < tensors.size() && by_offset.empty(); ++i)
    if (offset_order(i, i - 1)) {
      by_offset.resize(tensors.size());
      for (std::size_t k = 0; k < by_offset.size(); ++k) by_offset[k] = k;
      std::sort(by_offset.begin(), by_offset.end(), offset_order);
    }
  auto in_data_order = [&](std::size_t k) -> SafetensorsTensor& {
    return tensors[by_offset.empty() ? k : by_offset[k]];
  };
  std::uint64_t at = 0;
  for (std::size_t k = 0; k < tensors.size(); ++k) {
    const SafetensorsTensor& t = in_data_order(k);
    if (t.begin != at)
      detail::safetensors_corrupt(
          path, detail::naming("the data of ", t.name, " does not start where the previous tensor's ends"));
    at = t.end;
  }
  if (at != data_bytes) detail::safetensors_corrupt(path, "its tensors do not cover its data section exactly");
  if (tensors.size() >= (std::size_t{1} << 31)) detail::safetensors_corrupt(path, "it names over 2^31 tensors");
  const std::size_t repeated =
      by_name_.build(tensors.size(), [&](std::size_t k) -> std::string_view { return tensors[k].name; });
  if (repeated != tensors.size())
    detail::safetensors_corrupt(path, detail::naming("it names ", tensors[repeated].name, " twice"));
  auto set_crc = [&](SafetensorsTensor& tensor, std::string_view digits) {
    std::uint64_t value = 0;
    if (!detail::parse_hex(digits, 8, value))
      detail::safetensors_corrupt(path, detail::naming("the checksum of ", tensor.name, " is not 8 hex digits"));
    tensor.has_crc = true;
    tensor.crc = static_cast<std::uint32_t>(value);
  };
  if (has_crcs) {
    if (crcs.size() != 8 * tensors.size())
      detail::safetensors_corrupt(path, "its crc32c metadata holds " + std::to_string(crcs.size()) +
                                            " characters, not 8 hex digits for each of its " +
                                            std::to_string(tensors.size()) + " tensors");
    for (std::size_t k = 0; k < tensors.size(); ++k) set_crc(in_data_order(k), crcs.substr(8 * k, 8));
  }
  for (auto& [name, v] : named_crcs) {
    const std::size_t i = index(name);
    if (i == detail::NameIndex::none) {  // a checksum of no tensor here: kept as the metadata it is
      metadata.emplace_back(std::string(name_crc_key) + name, std::move(v));
      continue;
    }
    set_crc(tensors[i], v);
  }
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
        header_(std::move(o.header_)),
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
  const std::vector<Tensor>& tensors() const { return header_.tensors; }
  /// The tensor named `name`, or null.
  const Tensor* find(std::string_view name) const { return header_.find(name); }
  /// The value of metadata key k, or null.
  const std::string* metadata(std::string_view k) const { return header_.find_metadata(k); }
  /// Every metadata key and value but the checksums (those of tandem's files), in the header's order.
  const std::vector<std::pair<std::string, std::string>>& metadata() const { return header_.metadata; }
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

  /// The CRC-32C that the file's metadata records for tensor `name`, if it records one.
  bool recorded_crc(std::string_view name, std::uint32_t& crc) const {
    const Tensor* t = find(name);
    if (t == nullptr || !t->has_crc) return false;
    crc = t->crc;
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
    if (n > detail::safetensors_max_header)
      corrupt("its header length " + std::to_string(n) + " is over 100,000,000 bytes");
    if (n > size_ - 8) corrupt("its header is longer than the file (truncated?)");
    header_ = SafetensorsHeader::parse(
        static_cast<std::size_t>(n),
        [&](char* text) {
          read(8, text, static_cast<std::size_t>(n));
          header_crc_ = detail::crc32c(text, static_cast<std::size_t>(n));
        },
        size_ - 8 - n, path_);
    data_begin_ = 8 + n;
  }

  std::string path_;
  int fd_ = -1;
  SafetensorsHeader header_;
  std::uint64_t data_begin_ = 0, size_ = 0;
  std::uint32_t header_crc_ = 0;
};

}  // namespace tandem
