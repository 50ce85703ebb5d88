// SPDX-License-Identifier: Apache-2.0
// The one stable hash: 64-bit FNV-1a. Stable across runs, processes, hosts and builds (it is written into checkpoints
// and compared between ranks), so it must never change; used for layout and option fingerprints, configuration
// agreement between ranks, and rendezvous file checksums. Not cryptographic and not a checksum for large data (the
// checkpoint formats have CRC-32 and CRC-32C for that). And the one text form of hashes and checksums in files: fixed
// width lowercase hex. And NameIndex, which finds names by this hash from a seed of each process (a checkpoint shard
// names tens of thousands of tensor slices, and a file's names may be chosen to collide).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::detail {

inline constexpr std::uint64_t fnv1a_basis = 0xcbf29ce484222325ull;

/// Continues hash `h` over n bytes.
inline std::uint64_t fnv1a(const void* data, std::size_t n, std::uint64_t h = fnv1a_basis) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t k = 0; k < n; ++k) h = (h ^ p[k]) * 0x100000001b3ull;
  return h;
}

/// Continues hash `h` over the characters of s.
inline std::uint64_t fnv1a(std::string_view s, std::uint64_t h = fnv1a_basis) noexcept {
  return fnv1a(s.data(), s.size(), h);
}

/// Writes v as `digits` (1 to 16) lowercase hex digits at out.
inline void write_hex(char* out, std::uint64_t v, int digits) noexcept {
  for (int k = digits - 1; k >= 0; --k, v >>= 4) out[k] = "0123456789abcdef"[v & 0xf];
}

/// v as `digits` (at most 16) lowercase hex digits (8 for a CRC, 16 for a 64-bit hash).
inline std::string hex_text(std::uint64_t v, int digits) {
  digits = digits < 1 ? 1 : digits > 16 ? 16 : digits;
  std::string text(static_cast<std::size_t>(digits), '0');
  write_hex(text.data(), v, digits);
  return text;
}
inline std::string hex8(std::uint32_t v) { return hex_text(v, 8); }
inline std::string hex16(std::uint64_t v) { return hex_text(v, 16); }

/// The value of exactly `digits` lowercase hex digits (hex_text's form), or false for any other text.
inline bool parse_hex(std::string_view text, std::size_t digits, std::uint64_t& value) noexcept {
  if (text.size() != digits || digits > 16) return false;
  value = 0;
  for (const char c : text) {
    value <<= 4;
    if (c >= '0' && c <= '9')
      value |= static_cast<std::uint64_t>(c - '0');
    else if (c >= 'a' && c <= 'f')
      value |= static_cast<std::uint64_t>(c - 'a' + 10);
    else
      return false;
  }
  return true;
}

/// A seed, drawn once per process, for the hash that indexes names read from files: names chosen so that the
/// stable hash puts them into a few slots (a hostile file's tensor names) would make an index of them quadratic.
/// Drawn from the clock and where the program was loaded (address-space randomization): unknown to whoever wrote a
/// file in advance, and no entropy source to fail.
inline std::uint64_t name_index_seed() {
  static const std::uint64_t seed = [] {
    static const char here = 0;
    const auto now = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    return fnv1a(&now, sizeof now, reinterpret_cast<std::uintptr_t>(&here));
  }();
  return seed;
}

/// Names found by hash: an index over a list of names that the caller keeps (name_of(i) gives name i), by open
/// addressing in a power of two of slots, at least twice the names; each slot empty (0) or a name's index + 1 and 32
/// more bits of its hash. The hash is FNV-1a from this process's name_index_seed, its slot the top bits of its
/// product with 2^64 / phi (every bit of the hash moves it), so that no set of names lands in a few slots in every
/// process.
class NameIndex {
 public:
  NameIndex() = default;
  /// Indexes names 0 .. n-1 (n below 2^31). Returns the index of the first name equal to an earlier one (which is
  /// left out), or n if all differ.
  template <class NameOf>
  std::size_t build(std::size_t n, NameOf&& name_of) {
    std::size_t size = 16;
    shift_ = 60;
    while (size < 2 * n) {
      size *= 2;
      --shift_;
    }
    slots_.assign(size, {});
    probes_ = 0;
    std::size_t repeated = n;
    for (std::size_t k = 0; k < n; ++k) {
      const std::string_view name = name_of(k);
      const std::uint64_t h = hash(name);
      std::size_t i = slot(h);
      for (; slots_[i].name != 0; i = (i + 1) & (size - 1), ++probes_)
        if (slots_[i].tag == static_cast<std::uint32_t>(h >> 32) && name_of(slots_[i].name - 1) == name) break;
      if (slots_[i].name != 0) {
        repeated = std::min(repeated, k);
        continue;
      }
      slots_[i] = {static_cast<std::uint32_t>(k + 1), static_cast<std::uint32_t>(h >> 32)};
    }
    return repeated;
  }
  /// The index of `name`, or `none` if it is not indexed (name_of as given to build).
  template <class NameOf>
  std::size_t find(std::string_view name, NameOf&& name_of) const {
    if (slots_.empty()) return none;
    const std::uint64_t h = hash(name);
    const std::size_t mask = slots_.size() - 1;
    for (std::size_t i = slot(h);; i = (i + 1) & mask) {
      const Slot s = slots_[i];
      if (s.name == 0) return none;
      if (s.tag == static_cast<std::uint32_t>(h >> 32) && name_of(s.name - 1) == name) return s.name - 1;
    }
  }
  static constexpr std::size_t none = static_cast<std::size_t>(-1);
  /// The occupied slots the last build() stepped over, in all: a fraction of the names where they spread evenly (about
  /// a fifth for 20,000 names in 65,536 slots).
  std::size_t probes() const { return probes_; }

 private:
  struct Slot {
    std::uint32_t name = 0, tag = 0;
  };
  static std::uint64_t hash(std::string_view name) { return fnv1a(name, name_index_seed()); }
  std::size_t slot(std::uint64_t h) const { return static_cast<std::size_t>((h * 0x9e3779b97f4a7c15ull) >> shift_); }
  std::vector<Slot> slots_;
  unsigned shift_ = 60;  // 64 - log2(slots)
  std::size_t probes_ = 0;
};

}  // namespace tandem::detail
