// SPDX-License-Identifier: Apache-2.0
// Conversions against independent references: the compiler's own _Float16 (IEEE round-to-nearest-even)
// for fp16, and a brute-force nearest-neighbour search in double for bf16.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>

#include "support/cases.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/kernels/detail/host_simd.hpp"

namespace {

float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The bf16 nearest to x (ties to the even bit pattern), found by comparing the two neighbours in double.
std::uint16_t reference_bf16(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  if (std::isnan(x)) return 0;  // checked separately
  const std::uint16_t lo = static_cast<std::uint16_t>(u >> 16);
  const std::uint16_t hi = static_cast<std::uint16_t>(lo + 1);
  const double dl = std::fabs(double{from_bits(std::uint32_t{lo} << 16)} - double{x});
  // the pattern after the largest finite one is infinity, which IEEE rounding treats as 2^128
  const double vh = (hi & 0x7fffu) == 0x7f80u ? std::copysign(std::ldexp(1.0, 128), double{x})
                                              : double{from_bits(std::uint32_t{hi} << 16)};
  const double dh = std::fabs(vh - double{x});
  if ((u & 0xffffu) == 0) return lo;
  if (dl < dh) return lo;
  if (dh < dl) return hi;
  return (lo & 1u) ? hi : lo;
}

}  // namespace

TEST_CASE("bf16 from float rounds to nearest even") {
  std::mt19937 rng(1);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 2'000'000; ++i) {
    std::uint32_t u = bits(rng);
    if (i % 4 == 0) u = (u & 0xffff0000u) | 0x8000u;  // exact ties
    const float x = from_bits(u);
    if (std::isnan(x)) {
      CHECK(std::isnan(static_cast<float>(tandem::BFloat16(x))));
      continue;
    }
    if (std::isinf(x)) {
      CHECK(static_cast<float>(tandem::BFloat16(x)) == x);
      continue;
    }
    const std::uint16_t want = reference_bf16(x);
    const std::uint16_t got = tandem::BFloat16(x).bits;
    if (got != want) FAIL("bf16(" << x << ") bits " << got << ", want " << want);
  }
  CHECK(tandem::BFloat16(1.0f).bits == 0x3f80);
  CHECK(static_cast<float>(tandem::BFloat16(-2.5f)) == -2.5f);
}

#if !defined(__FLT16_MAX__)
TEST_CASE("fp16 conversions match IEEE _Float16") {
  test::skip_case("this compiler has no _Float16 to compare fp16 with");
}
#else
TEST_CASE("fp16 from float matches IEEE _Float16 on every tested pattern") {
  auto check = [](std::uint32_t u) {
    const float x = from_bits(u);
    const _Float16 ref = static_cast<_Float16>(x);
    std::uint16_t want;
    std::memcpy(&want, &ref, 2);
    const std::uint16_t got = tandem::Float16(x).bits;
    if (std::isnan(x)) {
      REQUIRE((got & 0x7c00u) == 0x7c00u);
      REQUIRE((got & 0x3ffu) != 0);
      return;
    }
    if (got != want) FAIL("fp16(" << x << ") bits " << got << ", want " << want);
  };
  // every float whose low 13 bits are one of the interesting rounding cases, over the whole exponent range
  for (std::uint32_t hi = 0; hi < (1u << 19); ++hi)
    for (std::uint32_t lo : {0x0000u, 0x0001u, 0x0fffu, 0x1000u, 0x1001u, 0x1fffu}) check((hi << 13) | lo);
  std::mt19937 rng(2);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 2'000'000; ++i) check(bits(rng));
}

TEST_CASE("fp16 to float is exact for all 65536 patterns") {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    _Float16 ref;
    const std::uint16_t b = static_cast<std::uint16_t>(h);
    std::memcpy(&ref, &b, 2);
    const float want = static_cast<float>(ref);
    const float got = tandem::Float16::to_float(b);
    if (std::isnan(want)) {
      REQUIRE(std::isnan(got));
    } else {
      REQUIRE(std::memcmp(&want, &got, 4) == 0);
    }
  }
}
#endif

#if !TANDEM_HOST_SSE2
TEST_CASE("the host's vector conversions give the scalar conversions' bits") {
  test::skip_case("this host build has no vector conversions (SSE2)");
}
#else
#if defined(TANDEM_TEST_EXPECT_F16C)
static_assert(TANDEM_HOST_F16C, "test_dtype_f16c is built with -mf16c: the conversions below must be F16C's");
#endif
TEST_CASE("the host's vector conversions give the scalar conversions' bits") {
  // Eight floats at a time through widen8 / narrow8 against BFloat16 / Float16's scalar conversions, bit for bit.
  const auto narrow = [](const std::uint32_t(&u)[8]) {
    float f[8];
    std::memcpy(f, u, sizeof f);
    tandem::BFloat16 b[8];
    tandem::Float16 h[8];
    tandem::detail::narrow8(tandem::detail::widen8(f), b);
    tandem::detail::narrow8(tandem::detail::widen8(f), h);
    for (int k = 0; k < 8; ++k) {
      if (b[k].bits != tandem::BFloat16::from_float(f[k])) FAIL("bf16 of float bits " << u[k] << ": " << b[k].bits);
      if (h[k].bits != tandem::Float16::from_float(f[k])) FAIL("fp16 of float bits " << u[k] << ": " << h[k].bits);
    }
  };
  // Every float whose low bits are a rounding case of fp16 (13 dropped bits) or of bf16 (16), over every sign and
  // exponent, and random patterns; eight lanes of different cases at a time.
  std::uint32_t u[8];
  int lane = 0;
  const auto add = [&](std::uint32_t x) {
    u[lane++] = x;
    if (lane == 8) {
      narrow(u);
      lane = 0;
    }
  };
  const std::uint32_t fp16_cases[] = {0x0000u, 0x0001u, 0x0fffu, 0x1000u, 0x1001u, 0x1fffu};
  const std::uint32_t bf16_cases[] = {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu};
  // The flush-to-zero and denormals-are-zero flags change nothing (the header says so): a second pass with both set.
  // The flags are restored however the case ends.
  struct RestoreFlags {
    unsigned csr = _mm_getcsr();
    ~RestoreFlags() { _mm_setcsr(csr); }
  } const restore;
  for (const unsigned flags : {0u, 0x8040u}) {
    CAPTURE(flags);
    _mm_setcsr(restore.csr | flags);
    for (std::uint32_t hi = 0; hi < (1u << 19); ++hi)
      for (const std::uint32_t lo : fp16_cases) add((hi << 13) | lo);
    for (std::uint32_t hi = 0; hi < (1u << 16); ++hi)
      for (const std::uint32_t lo : bf16_cases) add((hi << 16) | lo);
    std::mt19937 rng(3);
    std::uniform_int_distribution<std::uint32_t> bits;
    for (int i = 0; i < 1'000'000; ++i) add(bits(rng));

    // and every 16-bit pattern widened
    for (std::uint32_t h = 0; h < 65536; h += 8) {
      tandem::BFloat16 b[8];
      tandem::Float16 f16[8];
      for (std::uint32_t k = 0; k < 8; ++k) b[k].bits = f16[k].bits = static_cast<std::uint16_t>(h + k);
      float from_b[8], from_h[8];
      tandem::detail::narrow8(tandem::detail::widen8(b), from_b);
      tandem::detail::narrow8(tandem::detail::widen8(f16), from_h);
      for (std::uint32_t k = 0; k < 8; ++k) {
        const float want_b = static_cast<float>(b[k]), want_h = tandem::Float16::to_float(f16[k].bits);
        if (std::memcmp(&from_b[k], &want_b, 4) != 0) FAIL("float of bf16 bits " << h + k);
        if (std::memcmp(&from_h[k], &want_h, 4) != 0) FAIL("float of fp16 bits " << h + k);
      }
    }
  }
  CHECK(lane == 0);
}
#endif

TEST_CASE("dtype sizes and names") {
  CHECK(tandem::dtype_size(tandem::DType::fp32) == 4);
  CHECK(tandem::dtype_size(tandem::DType::bf16) == 2);
  CHECK(tandem::dtype_size(tandem::DType::fp16) == 2);
  CHECK(tandem::dtype_size(tandem::DType::fp64) == 8);
  CHECK(std::string(tandem::dtype_name(tandem::DType::bf16)) == "bf16");
}
