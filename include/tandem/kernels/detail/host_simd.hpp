// SPDX-License-Identifier: Apache-2.0
// The host's conversions of eight elements at a time where a 16-bit type is on either side of a cast: two vectors of
// four floats (SSE2, which every x86-64 host compiler targets; TANDEM_HOST_SSE2, core/config.hpp, says whether this
// build has them). detail::cast_segment (kernels/vector.hpp) moves such a group through them: widen8 the source (and,
// accumulating, the destination), the rounded product and the sum as vectors, narrow8 the result. Compilers vectorize
// the scalar conversions of core/dtype.hpp poorly or not at all (Float16's has branches; GCC 12 made the fp32 -> bf16
// pack slower at -O3 than at -O2): with them the host pack of GPT-2 into bf16 ran at 0.33x copy and into fp16 at 0.11x,
// with these at 0.65x and 0.40x in that run (bench_pack; fp16's rounding is still bound by arithmetic at SSE2's width,
// and later runs gave 0.27x to 0.42x). Built for F16C (TANDEM_HOST_F16C: -mf16c, -march=x86-64-v3 or native), fp16
// converts by its instructions instead (0.65x in the run of docs/design.md). Those raise the overflow, underflow and
// inexact floating-point flags where a conversion overflows, gives a subnormal or rounds (a trap enabled by
// feenableexcept fires there); the SSE2 forms raise only inexact, where a result is subnormal. The bits are the same.
//
// Every function gives, lane by lane, the bits of the scalar conversion it replaces: BFloat16::from_float,
// Float16::from_float and Float16::to_float, and a bf16's float (its bits shifted up). tests/test_dtype.cpp checks them
// against those on every 16-bit pattern and on every float rounding case (and test_dtype_f16c, built with -mf16c, the
// F16C forms). The integer work follows the scalar forms. The two float operations (fp16's subnormal rounding and
// widening) are exact or correctly rounded in the default rounding mode, and the same whatever the flush-to-zero and
// denormals-are-zero flags say: no result of theirs is subnormal, and a subnormal float rounds to an fp16 zero whether
// or not it is read as zero. F16C's conversions ignore flush-to-zero (the Intel SDM says so of VCVTPS2PH) and give the
// same bits under both flags (test_dtype_f16c).
#pragma once

#include "tandem/core/config.hpp"

#if TANDEM_HOST_SSE2

#include <emmintrin.h>
#if TANDEM_HOST_F16C
#include <immintrin.h>
#endif

#include <type_traits>

#include "tandem/core/dtype.hpp"

namespace tandem::detail {

/// Eight elements as floats: elements 0..3 in lo, 4..7 in hi.
struct Float4x2 {
  __m128 lo, hi;
};

/// The types widen8 and narrow8 take.
template <class T>
inline constexpr bool host_simd_type =
    std::is_same_v<T, float> || std::is_same_v<T, BFloat16> || std::is_same_v<T, Float16>;

namespace simd {

inline __m128i splat(unsigned x) { return _mm_set1_epi32(static_cast<int>(x)); }

inline __m128i select(__m128i mask, __m128i yes, __m128i no) {
  return _mm_or_si128(_mm_and_si128(mask, yes), _mm_andnot_si128(mask, no));
}

/// Four fp16 patterns (zero-extended into 32-bit lanes) as floats: Float16::to_float.
inline __m128 half_to_float(__m128i h) {
  const __m128i exponent_mask = splat(0x7c00u << 13);
  const __m128i rebias = splat(112u << 23);  // 127 - 15
  __m128i o = _mm_slli_epi32(_mm_and_si128(h, splat(0x7fffu)), 13);
  const __m128i exponent = _mm_and_si128(o, exponent_mask);
  o = _mm_add_epi32(o, rebias);
  o = _mm_add_epi32(o, _mm_and_si128(_mm_cmpeq_epi32(exponent, exponent_mask), rebias));  // inf and NaN: 255
  // zero and subnormals: m * 2^-24, as (1 + m / 1024) * 2^-14 less 2^-14, both normal, so the difference is exact
  const __m128 subnormal =
      _mm_sub_ps(_mm_castsi128_ps(_mm_add_epi32(o, splat(1u << 23))), _mm_castsi128_ps(splat(113u << 23)));
  o = select(_mm_cmpeq_epi32(exponent, _mm_setzero_si128()), _mm_castps_si128(subnormal), o);
  return _mm_castsi128_ps(_mm_or_si128(o, _mm_slli_epi32(_mm_and_si128(h, splat(0x8000u)), 16)));
}

/// Four floats as fp16 patterns in the low halves of 32-bit lanes: Float16::from_float.
inline __m128i float_to_half(__m128 f) {
  const __m128i x = _mm_castps_si128(f);
  const __m128i sign = _mm_and_si128(x, splat(0x80000000u));
  const __m128i ax = _mm_xor_si128(x, sign);  // < 2^31: signed compares order it
  // at or above 65520: infinity, or a quiet NaN
  const __m128i overflow = _mm_cmpgt_epi32(ax, splat(0x477ff000u - 1u));
  const __m128i nan = _mm_cmpgt_epi32(ax, splat(0x7f800000u));
  const __m128i big = _mm_or_si128(splat(0x7c00u), _mm_and_si128(nan, splat(0x0200u)));
  // below 2^-14: adding 0.5 rounds to a multiple of 2^-24 (to nearest, ties to even), and the multiple is the
  // subnormal's pattern (2^-14 itself carries into the smallest normal, 0x400)
  const __m128i half = splat(126u << 23);
  const __m128i small = _mm_cmpgt_epi32(splat(0x38800000u), ax);
  const __m128i subnormal =
      _mm_sub_epi32(_mm_castps_si128(_mm_add_ps(_mm_castsi128_ps(ax), _mm_castsi128_ps(half))), half);
  // normal: rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest, ties to the even pattern
  const __m128i odd = _mm_and_si128(_mm_srli_epi32(ax, 13), splat(1u));
  const __m128i normal = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(ax, splat(0xfffu - 0x38000000u)), odd), 13);
  const __m128i bits = select(overflow, big, select(small, subnormal, normal));
  return _mm_or_si128(bits, _mm_srli_epi32(sign, 16));
}

#if TANDEM_HOST_F16C
/// Eight fp16 patterns (in memory order) as floats, by F16C: Float16::to_float. The instruction quiets a signalling
/// NaN (sets the top bit of its payload, bit 22 of the float) where to_float keeps the pattern: the xor clears that
/// bit again in the NaN lanes whose fp16 pattern had it clear.
inline Float4x2 half8_to_float(__m128i w) {
  const auto one = [](__m128i h4, __m128i h32) {  // four halves in h4's low 64 bits, the same zero-extended in h32
    const __m128 f = _mm_cvtph_ps(h4);
    const __m128i quieted = _mm_andnot_si128(_mm_slli_epi32(h32, 13), splat(1u << 22));
    return _mm_castsi128_ps(
        _mm_xor_si128(_mm_castps_si128(f), _mm_and_si128(_mm_castps_si128(_mm_cmpunord_ps(f, f)), quieted)));
  };
  const __m128i zero = _mm_setzero_si128();
  return {one(w, _mm_unpacklo_epi16(w, zero)), one(_mm_unpackhi_epi64(w, w), _mm_unpackhi_epi16(w, zero))};
}

/// Eight floats as fp16 patterns in memory order, by F16C (rounding to nearest even, whatever MXCSR's mode says):
/// Float16::from_float. The instruction keeps the top of a NaN's payload where from_float gives the quiet NaN 0x7e00
/// with the sign: the NaN lanes' low nine bits are cleared.
inline __m128i float8_to_half(const Float4x2& x) {
  const __m128i h =
      _mm_unpacklo_epi64(_mm_cvtps_ph(x.lo, _MM_FROUND_TO_NEAREST_INT), _mm_cvtps_ph(x.hi, _MM_FROUND_TO_NEAREST_INT));
  const __m128i nan = _mm_packs_epi32(_mm_castps_si128(_mm_cmpunord_ps(x.lo, x.lo)),
                                      _mm_castps_si128(_mm_cmpunord_ps(x.hi, x.hi)));  // 16-bit lanes of all ones
  return _mm_andnot_si128(_mm_and_si128(nan, _mm_set1_epi16(0x01ff)), h);
}
#endif

/// Four floats as bf16 patterns, each in the high half of its 32-bit lane (the low half is not specified):
/// BFloat16::from_float.
inline __m128i float_to_bf16_high(__m128 f) {
  const __m128i x = _mm_castps_si128(f);
  const __m128i odd = _mm_and_si128(_mm_srli_epi32(x, 16), splat(1u));
  const __m128i rounded = _mm_add_epi32(_mm_add_epi32(x, splat(0x7fffu)), odd);  // ties to the even neighbour
  const __m128i nan = _mm_cmpgt_epi32(_mm_and_si128(x, splat(0x7fffffffu)), splat(0x7f800000u));
  return select(nan, _mm_or_si128(x, splat(0x0040u << 16)), rounded);  // a NaN stays a quiet NaN
}

/// Eight 16-bit patterns, from the high halves of a's and b's lanes, in memory order.
inline __m128i pack_high_halves(__m128i a, __m128i b) {
  // signed saturation keeps a lane that is already a sign-extended 16-bit value as it is
  return _mm_packs_epi32(_mm_srai_epi32(a, 16), _mm_srai_epi32(b, 16));
}

}  // namespace simd

/// p[0..7] as floats.
template <class T>
inline Float4x2 widen8(const T* p) {
  static_assert(host_simd_type<T>);
  if constexpr (std::is_same_v<T, float>) {
    return {_mm_loadu_ps(p), _mm_loadu_ps(p + 4)};
  } else {
    const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i zero = _mm_setzero_si128();
    if constexpr (std::is_same_v<T, BFloat16>) {
      return {_mm_castsi128_ps(_mm_unpacklo_epi16(zero, w)), _mm_castsi128_ps(_mm_unpackhi_epi16(zero, w))};
    } else {
#if TANDEM_HOST_F16C
      return simd::half8_to_float(w);
#else
      return {simd::half_to_float(_mm_unpacklo_epi16(w, zero)), simd::half_to_float(_mm_unpackhi_epi16(w, zero))};
#endif
    }
  }
}

/// p[0..7] = T(x's elements).
template <class T>
inline void narrow8(const Float4x2& x, T* p) {
  static_assert(host_simd_type<T>);
  if constexpr (std::is_same_v<T, float>) {
    _mm_storeu_ps(p, x.lo);
    _mm_storeu_ps(p + 4, x.hi);
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     simd::pack_high_halves(simd::float_to_bf16_high(x.lo), simd::float_to_bf16_high(x.hi)));
  } else {
#if TANDEM_HOST_F16C
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), simd::float8_to_half(x));
#else
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     simd::pack_high_halves(_mm_slli_epi32(simd::float_to_half(x.lo), 16),
                                            _mm_slli_epi32(simd::float_to_half(x.hi), 16)));
#endif
  }
}

}  // namespace tandem::detail

#endif  // TANDEM_HOST_SSE2
