// SPDX-License-Identifier: Apache-2.0
// CRC-32C (Castagnoli; iSCSI, ext4, RocksDB; reflected polynomial 0x82F63B78, check value 0xE3069283): the checksum of
// tandem's checkpoint files. Chosen at run time, so a binary built for any x86-64 runs everywhere:
//   - with AVX-512 and VPCLMULQDQ, from 256 bytes: folding by carry-less multiplication, 256 bytes per step (about
//     55 GB/s from cache on the AMD EPYC it was measured on);
//   - with SSE 4.2: the crc32 instruction, 8 bytes per instruction, over three interleaved streams so that three are
//     in flight (its latency is 3 cycles, its throughput 1; about 20-28 GB/s there);
//   - elsewhere, and under nvcc: slices of 8 bytes through 8 tables (about 1-2 GB/s).
// tests/test_formats.cpp checks each this host runs against the tables.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
#define TANDEM_CRC32C_SSE42 1
#include <immintrin.h>
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

/// x^n mod P, for P the CRC-32C polynomial, in the bit order of the folding constants below: the coefficient of x^d at
/// bit 63 - d of a 64-bit word (a 64-bit reflected polynomial of degree below 32).
constexpr std::uint64_t crc32c_xpow_mod(std::uint64_t n) {
  std::uint64_t v = 1;  // x^0, in the usual order (bit d: x^d), of degree below 32
  for (std::uint64_t k = 0; k < n; ++k) {
    v <<= 1;
    if (v & (std::uint64_t{1} << 32)) v ^= (std::uint64_t{1} << 32) | 0x1EDC6F41u;
  }
  std::uint64_t r = 0;
  for (int d = 0; d < 32; ++d)
    if ((v >> d) & 1u) r |= std::uint64_t{1} << (63 - d);
  return r;
}

/// The running CRC over n >= 256 bytes by folding (the method of Intel's "Fast CRC Computation for Generic
/// Polynomials Using PCLMULQDQ"): 16-byte blocks B, each the 128-bit polynomial of its bits in message order, stand for
/// the message M = sum of B_i x^(128 (k - 1 - i)); a block d bits ahead of the end of what is folded is folded into
/// the block d bits later as H x^(64 + d) + L x^d (H, L its 64-bit halves) with both powers reduced mod P, a
/// carry-less product each. Four 512-bit registers (16 blocks, 256 bytes) fold at a time, then into one, then one
/// 128-bit block, whose CRC with the tail's, on the crc32 instruction, is the message's (the running CRC enters as the
/// first 32 bits of the message). Folded constants are x^(d - 1) and x^(64 + d - 1): the carry-less product of two
/// 64-bit reflected polynomials is 127 bits, one short of the block's 128.
#define TANDEM_CRC32C_FOLD_TARGET __attribute__((target("sse4.2,pclmul,avx512f,vpclmulqdq")))

/// The constants that fold a 128-bit block `bits` bits ahead, in every 128-bit lane.
TANDEM_CRC32C_FOLD_TARGET inline __m512i crc32c_fold_constants(std::uint64_t bits) {
  const auto lo = static_cast<long long>(crc32c_xpow_mod(64 + bits - 1)),
             hi = static_cast<long long>(crc32c_xpow_mod(bits - 1));
  return _mm512_set_epi64(hi, lo, hi, lo, hi, lo, hi, lo);
}
/// x folded by the constants k into next, in every lane.
TANDEM_CRC32C_FOLD_TARGET inline __m512i crc32c_fold(__m512i x, __m512i k, __m512i next) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11), next,
                                   0x96);
}
TANDEM_CRC32C_FOLD_TARGET inline __m128i crc32c_fold(__m128i x, __m128i k, __m128i next) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), next);
}

TANDEM_CRC32C_FOLD_TARGET inline std::uint32_t crc32c_vpclmul(std::uint32_t crc, const unsigned char* p,
                                                              std::size_t n) {
  static const __m512i k2048 = crc32c_fold_constants(2048), k512 = crc32c_fold_constants(512);
  static const __m128i k128 =
      _mm_set_epi64x(static_cast<long long>(crc32c_xpow_mod(127)), static_cast<long long>(crc32c_xpow_mod(64 + 127)));
  __m512i z0 =
      _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(crc))));
  __m512i z1 = _mm512_loadu_si512(p + 64), z2 = _mm512_loadu_si512(p + 128), z3 = _mm512_loadu_si512(p + 192);
  p += 256;
  n -= 256;
  for (; n >= 256; n -= 256, p += 256) {
    z0 = crc32c_fold(z0, k2048, _mm512_loadu_si512(p));
    z1 = crc32c_fold(z1, k2048, _mm512_loadu_si512(p + 64));
    z2 = crc32c_fold(z2, k2048, _mm512_loadu_si512(p + 128));
    z3 = crc32c_fold(z3, k2048, _mm512_loadu_si512(p + 192));
  }
  z1 = crc32c_fold(z0, k512, z1);
  z2 = crc32c_fold(z1, k512, z2);
  z3 = crc32c_fold(z2, k512, z3);
  for (; n >= 64; n -= 64, p += 64) z3 = crc32c_fold(z3, k512, _mm512_loadu_si512(p));
  alignas(64) __m128i lanes[4];
  _mm512_store_si512(lanes, z3);
  __m128i r = lanes[0];
  for (int i = 1; i < 4; ++i) r = crc32c_fold(r, k128, lanes[i]);
  for (; n >= 16; n -= 16, p += 16) r = crc32c_fold(r, k128, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::uint64_t c = _mm_crc32_u64(0, static_cast<std::uint64_t>(_mm_cvtsi128_si64(r)));
  c = _mm_crc32_u64(c, static_cast<std::uint64_t>(_mm_extract_epi64(r, 1)));
  auto c32 = static_cast<std::uint32_t>(c);
  for (; n > 0; --n, ++p) c32 = _mm_crc32_u8(c32, *p);
  return c32;
}

inline bool crc32c_has_vpclmul() {
  static const bool has = __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("pclmul") &&
                          __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq");
  return has;
}
#endif

/// CRC-32C of n bytes, continued from `crc` (the CRC of what came before; 0 to start).
inline std::uint32_t crc32c(const void* data, std::size_t n, std::uint32_t crc = 0) {
  const auto* p = static_cast<const unsigned char*>(data);
#if TANDEM_CRC32C_SSE42
  if (n >= 256 && crc32c_has_vpclmul()) return ~crc32c_vpclmul(~crc, p, n);
  if (crc32c_has_sse42()) return ~crc32c_sse42(~crc, p, n);
#endif
  return ~crc32c_software(~crc, p, n);
}

}  // namespace tandem::detail
