// SPDX-License-Identifier: Apache-2.0
// The one stable hash: 64-bit FNV-1a. Stable across runs, processes, hosts and builds (it is written into checkpoints
// and compared between ranks), so it must never change; used for layout and option fingerprints, configuration
// agreement between ranks, and rendezvous file checksums. Not cryptographic and not a checksum for large data (the
// checkpoint format has CRC-32 for that).
#pragma once

#include <cstddef>
#include <cstdint>
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

}  // namespace tandem::detail
