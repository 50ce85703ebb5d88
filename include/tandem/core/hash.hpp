// SPDX-License-Identifier: Apache-2.0
// The one stable hash: 64-bit FNV-1a. Stable across runs, processes, hosts and builds (it is written into checkpoints
// and compared between ranks), so it must never change; used for layout and option fingerprints, configuration
// agreement between ranks, and rendezvous file checksums. Not cryptographic and not a checksum for large data (the
// checkpoint formats have CRC-32 and CRC-32C for that). And the one text form of hashes and checksums in files: fixed
// width lowercase hex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

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

/// v as `digits` (at most 16) lowercase hex digits (8 for a CRC, 16 for a 64-bit hash).
inline std::string hex_text(std::uint64_t v, int digits) {
  digits = digits < 1 ? 1 : digits > 16 ? 16 : digits;
  char text[17];
  std::snprintf(text, sizeof text, "%0*llx", digits, static_cast<unsigned long long>(v));
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

}  // namespace tandem::detail
