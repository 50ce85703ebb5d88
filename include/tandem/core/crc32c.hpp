// SPDX-License-Identifier: Apache-2.0
// CRC-32C (Castagnoli; iSCSI, ext4, RocksDB; reflected polynomial 0x82F63B78, check value 0xE3069283): the checksum of
// tandem's checkpoint files. On x86-64 with SSE 4.2 it runs on the crc32 instruction (8 bytes per instruction, chosen
// at run time, so a binary built for any x86-64 still runs everywhere), over three interleaved streams so that three
// instructions are in flight (the instruction's latency is 3 cycles, its throughput 1); elsewhere, and under nvcc, in
// slices of 8 bytes through 8 tables (about 1-2 GB/s).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
#define TANDEM_CRC32C_SSE42 1
#include <nmmintrin.h>
#else
#define TANDEM_CRC32C_SSE42 0
#endif

namespace tandem::detail {

/// The slicing-by-8 tables: t[k][b] is the CRC of byte b followed by k zero bytes.
inline const std::array<std::array<std::uint32_t, 256>, 8>& crc32c_tables() {
  static const auto tables = [] {
    std::array<std::array<std::uint32_t, 256>, 8> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1u) ? 0x82F63B78u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (std::uint32_t i = 0; i < 256; ++i)
      for (std::size_t k = 1; k < 8; ++k) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xffu];
    return t;
  }();
  return tables;
}

/// The running (not inverted) CRC over n bytes, in software.
inline std::uint32_t crc32c_software(std::uint32_t crc, const unsigned char* p, std::size_t n) {
  const auto& t = crc32c_tables();
  for (; n >= 8; n -= 8, p += 8) {
    std::uint32_t lo, hi;
    std::memcpy(&lo, p, 4);  // little-endian hosts (every host tandem builds for)
    std::memcpy(&hi, p + 4, 4);
    lo ^= crc;
    crc = t[7][lo & 0xffu] ^ t[6][(lo >> 8) & 0xffu] ^ t[5][(lo >> 16) & 0xffu] ^ t[4][lo >> 24] ^ t[3][hi & 0xffu] ^
          t[2][(hi >> 8) & 0xffu] ^ t[1][(hi >> 16) & 0xffu] ^ t[0][hi >> 24];
  }
  for (; n > 0; --n, ++p) crc = t[0][(crc ^ *p) & 0xffu] ^ (crc >> 8);
  return crc;
}

/// Bytes per stream of the interleaved CRC: three streams of this many bytes are one block.
inline constexpr std::size_t crc32c_stream_bytes = 4096;

/// The running CRC of `c` followed by crc32c_stream_bytes zero bytes, which joins two streams: the CRC of A then B is
/// shift(crc(A)) ^ crc(B from 0). It is linear in c, so four tables of 256 entries hold it, built from its values at
/// the 32 single bits (each the software CRC over the zeros).
class Crc32cShift {
 public:
  Crc32cShift() {
    static constexpr std::array<unsigned char, crc32c_stream_bytes> zeros{};
    std::array<std::uint32_t, 32> bit{};
    for (std::size_t i = 0; i < 32; ++i) bit[i] = crc32c_software(std::uint32_t{1} << i, zeros.data(), zeros.size());
    for (std::size_t k = 0; k < 4; ++k)
      for (std::uint32_t b = 0; b < 256; ++b) {
        std::uint32_t v = 0;
        for (std::size_t i = 0; i < 8; ++i)
          if ((b >> i) & 1u) v ^= bit[8 * k + i];
        table_[k][b] = v;
      }
  }
  std::uint32_t operator()(std::uint32_t c) const {
    return table_[0][c & 0xffu] ^ table_[1][(c >> 8) & 0xffu] ^ table_[2][(c >> 16) & 0xffu] ^ table_[3][c >> 24];
  }

 private:
  std::array<std::array<std::uint32_t, 256>, 4> table_{};
};

#if TANDEM_CRC32C_SSE42
/// The running CRC over n bytes on the crc32 instruction: whole blocks as three interleaved streams joined by
/// Crc32cShift, then the rest as one stream.
__attribute__((target("sse4.2"))) inline std::uint32_t crc32c_sse42(std::uint32_t crc, const unsigned char* p,
                                                                    std::size_t n) {
  constexpr std::size_t stream = crc32c_stream_bytes;
  std::uint64_t c = crc;
  if (n >= 3 * stream) {
    static const Crc32cShift shift;
    for (; n >= 3 * stream; n -= 3 * stream, p += 3 * stream) {
      std::uint64_t b = 0, d = 0;
      for (std::size_t i = 0; i < stream; i += 8) {
        std::uint64_t wa, wb, wd;
        std::memcpy(&wa, p + i, 8);
        std::memcpy(&wb, p + stream + i, 8);
        std::memcpy(&wd, p + 2 * stream + i, 8);
        c = _mm_crc32_u64(c, wa);
        b = _mm_crc32_u64(b, wb);
        d = _mm_crc32_u64(d, wd);
      }
      c = shift(shift(static_cast<std::uint32_t>(c)) ^ static_cast<std::uint32_t>(b)) ^ static_cast<std::uint32_t>(d);
    }
  }
  for (; n >= 8; n -= 8, p += 8) {
    std::uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
  }
  auto c32 = static_cast<std::uint32_t>(c);
  for (; n > 0; --n, ++p) c32 = _mm_crc32_u8(c32, *p);
  return c32;
}

inline bool crc32c_has_sse42() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#endif

/// CRC-32C of n bytes, continued from `crc` (the CRC of what came before; 0 to start).
inline std::uint32_t crc32c(const void* data, std::size_t n, std::uint32_t crc = 0) {
  const auto* p = static_cast<const unsigned char*>(data);
#if TANDEM_CRC32C_SSE42
  if (crc32c_has_sse42()) return ~crc32c_sse42(~crc, p, n);
#endif
  return ~crc32c_software(~crc, p, n);
}

}  // namespace tandem::detail
