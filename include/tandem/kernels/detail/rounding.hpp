// SPDX-License-Identifier: Apache-2.0
// The rounding rule of every kernel body: each floating-point operation is rounded on its own, to nearest even, in the
// operand type (fp32, or fp64 for sums of squares). In particular no product is fused with the sum it feeds: nvcc
// contracts `c + a * b` into one FMA (rounded once) unless the product is __fmul_rn, and host compilers may or may not
// (GCC's C++ default is -ffp-contract=fast, Clang's contracts within one expression), so a body written with raw
// operators gives different bits on the host and on the device. Bodies therefore write every product as mul_rn(a, b)
// and every quotient and square root as div_rn / sqrt_rn; sums and differences stay plain operators (once a product
// is rounded on its own, nothing is left to contract).
//
//   device: __fmul_rn / __fdiv_rn / __fsqrt_rn (__dmul_rn ... for double): correctly rounded, never contracted, and
//           independent of -fmad, -prec-div and -prec-sqrt. -ftz=true (implied by -use_fast_math) flushes subnormals
//           on the device only: it breaks the rule there.
//   host:   plain operators, so the host loops still vectorize. Correctly rounded as long as the compiler does not
//           contract: tandem's own targets compile with -ffp-contract=off, and docs/design.md ("Rounding rule") says
//           what a user's build needs for host and device to give the same bits.
//
// tests/test_rounding.cpp compiles the bodies a second time with -ffp-contract=fast and FMA, with
// TANDEM_DETAIL_ROUNDED_PRODUCT defined to hide each rounded product from the optimizer (as nvcc cannot fuse a
// __fmul_rn), and checks that every body still gives the same bits: a raw product feeding a sum fails it.
#pragma once

#include <cmath>
#include <cstdint>

#include "tandem/core/config.hpp"

#if TANDEM_HOST_SSE2
#include <xmmintrin.h>
#endif

// The test hook above; nothing else defines it. (The test renames namespace tandem in that translation unit, so
// its differently defined inline functions never meet the ordinary ones.)
#ifndef TANDEM_DETAIL_ROUNDED_PRODUCT
#define TANDEM_DETAIL_ROUNDED_PRODUCT(x) (x)
#endif

namespace tandem::detail {

/// a * b, rounded to nearest even on its own: never fused with the sum it feeds.
TANDEM_HD inline float mul_rn(float a, float b) {
#if TANDEM_IN_DEVICE_CODE
  return __fmul_rn(a, b);
#else
  return TANDEM_DETAIL_ROUNDED_PRODUCT(a * b);
#endif
}

TANDEM_HD inline double mul_rn(double a, double b) {
#if TANDEM_IN_DEVICE_CODE
  return __dmul_rn(a, b);
#else
  return TANDEM_DETAIL_ROUNDED_PRODUCT(a * b);
#endif
}

#if TANDEM_HOST_SSE2
/// Four products, each rounded on its own (the host's vector conversions, kernels/detail/host_simd.hpp).
inline __m128 mul_rn(__m128 a, __m128 b) { return TANDEM_DETAIL_ROUNDED_PRODUCT(_mm_mul_ps(a, b)); }
#endif

/// a / b, correctly rounded (IEEE division on the device whatever -prec-div says).
TANDEM_HD inline float div_rn(float a, float b) {
#if TANDEM_IN_DEVICE_CODE
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

TANDEM_HD inline double div_rn(double a, double b) {
#if TANDEM_IN_DEVICE_CODE
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}

/// sqrt(a), correctly rounded (IEEE square root on the device whatever -prec-sqrt says).
TANDEM_HD inline float sqrt_rn(float a) {
#if TANDEM_IN_DEVICE_CODE
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

TANDEM_HD inline double sqrt_rn(double a) {
#if TANDEM_IN_DEVICE_CODE
  return __dsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

/// x^t for an integer t, by squaring: the same products, each rounded on its own, on host and device (the math
/// library's pow is not correctly rounded on the device, so it could differ from the host's in the last bit).
TANDEM_HD inline double pow_rn(double x, std::uint64_t t) {
  double result = 1.0;
  for (; t != 0; t >>= 1) {
    if (t & 1u) result = mul_rn(result, x);
    if (t > 1) x = mul_rn(x, x);
  }
  return result;
}

}  // namespace tandem::detail
