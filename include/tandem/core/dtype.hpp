// SPDX-License-Identifier: Apache-2.0
// Element types: fp32, bf16, fp16 (and fp64 for scalars that cross ranks), with round-to-nearest-even
// conversions written as plain bit manipulation so that host and device produce the same bits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "tandem/core/config.hpp"

namespace tandem {

/// Whether x is finite (neither infinite nor NaN), read from its bits. Unlike std::isfinite, comparisons and
/// x != x, it holds under -ffinite-math-only (-Ofast, -ffast-math), where the compiler may assume every float is
/// finite and fold those to a constant: tandem's own checks (non-finite gradients, option validation) use it, so they
/// hold under whatever flags a user compiles with.
TANDEM_HD inline bool finite(double x) {
  std::uint64_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return (bits & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
}
TANDEM_HD inline bool finite(float x) {
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return (bits & 0x7f800000u) != 0x7f800000u;
}

/// The element type of a buffer.
enum class DType : std::uint8_t { fp32, bf16, fp16, fp64 };

/// Bytes per element.
constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::fp32:
      return 4;
    case DType::bf16:
      return 2;
    case DType::fp16:
      return 2;
    case DType::fp64:
      return 8;
  }
  return 0;
}

/// Short lower-case name ("fp32", "bf16", "fp16", "fp64").
constexpr const char* dtype_name(DType t) {
  switch (t) {
    case DType::fp32:
      return "fp32";
    case DType::bf16:
      return "bf16";
    case DType::fp16:
      return "fp16";
    case DType::fp64:
      return "fp64";
  }
  return "?";
}

namespace detail {

TANDEM_HD inline std::uint32_t float_bits(float f) {
#if TANDEM_IN_DEVICE_CODE
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

TANDEM_HD inline float bits_float(std::uint32_t u) {
#if TANDEM_IN_DEVICE_CODE
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

}  // namespace detail

/// bfloat16: the top 16 bits of an IEEE float. Conversion from float rounds to nearest, ties to even;
/// NaN stays a (quiet) NaN.
struct BFloat16 {
  std::uint16_t bits;  // no initializer: the type stays trivial, so buffers of it can be memcpy'd

  BFloat16() = default;
  TANDEM_HD explicit BFloat16(float f) : bits(from_float(f)) {}
  TANDEM_HD explicit operator float() const { return detail::bits_float(std::uint32_t{bits} << 16); }

  TANDEM_HD static std::uint16_t from_float(float f) {
    // Branch-free, so that loops of conversions vectorize.
    const std::uint32_t x = detail::float_bits(f);
    const std::uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;  // ties go to the even neighbour
    const std::uint32_t quiet_nan = (x >> 16) | 0x0040u;
    return static_cast<std::uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
  }
};

/// IEEE binary16. Conversion from float rounds to nearest, ties to even, through the subnormal range;
/// values at or above 65520 become infinity; NaN stays a (quiet) NaN.
struct Float16 {
  std::uint16_t bits;  // no initializer: the type stays trivial

  Float16() = default;
  TANDEM_HD explicit Float16(float f) : bits(from_float(f)) {}
  TANDEM_HD explicit operator float() const { return to_float(bits); }

  TANDEM_HD static std::uint16_t from_float(float f) {
    const std::uint32_t x = detail::float_bits(f);
    const std::uint32_t sign = (x >> 16) & 0x8000u;
    const std::uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return static_cast<std::uint16_t>(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (ax >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
    if (ax < 0x38800000u) {                                                    // below 2^-14: subnormal or 0
      if (ax <= 0x33000000u) return static_cast<std::uint16_t>(sign);          // <= 2^-25 rounds to 0
      // value = m * 2^(e-150); in units of 2^-24 that is m >> (126 - e), rounded to nearest even.
      const std::uint32_t e = ax >> 23;
      const std::uint32_t m = (ax & 0x7fffffu) | 0x800000u;
      const std::uint32_t shift = 126u - e;  // 14 .. 24
      std::uint32_t q = m >> shift;
      const std::uint32_t rem = m & ((1u << shift) - 1u);
      const std::uint32_t half = 1u << (shift - 1u);
      if (rem > half || (rem == half && (q & 1u))) ++q;  // may carry into the smallest normal: still right
      return static_cast<std::uint16_t>(sign | q);
    }
    // Normal: rebias the exponent (127 -> 15) and keep 10 mantissa bits, rounding the 13 dropped ones.
    std::uint32_t r = (ax - 0x38000000u) >> 13;
    const std::uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
    return static_cast<std::uint16_t>(sign | r);
  }

  TANDEM_HD static float to_float(std::uint16_t h) {
    const std::uint32_t sign = std::uint32_t{h & 0x8000u} << 16;
    const std::uint32_t e = (h >> 10) & 0x1fu;
    const std::uint32_t m = h & 0x3ffu;
    if (e == 0x1fu) return detail::bits_float(sign | 0x7f800000u | (m << 13));
    if (e == 0) {  // zero or subnormal: m * 2^-24, exact in float
      const float v = static_cast<float>(m) * 5.9604644775390625e-8f;
      return sign ? -v : v;
    }
    return detail::bits_float(sign | ((e + 112u) << 23) | (m << 13));
  }
};

/// The DType of a C++ element type: float, BFloat16, Float16 or double; other types do not compile.
template <class T>
struct DTypeOf {
  static_assert(sizeof(T) == 0, "tandem: no DType for this element type; use float, BFloat16, Float16 or double");
};
template <>
struct DTypeOf<float> {
  static constexpr DType value = DType::fp32;
};
template <>
struct DTypeOf<BFloat16> {
  static constexpr DType value = DType::bf16;
};
template <>
struct DTypeOf<Float16> {
  static constexpr DType value = DType::fp16;
};
template <>
struct DTypeOf<double> {
  static constexpr DType value = DType::fp64;
};
template <class T>
inline constexpr DType dtype_of = DTypeOf<T>::value;

/// Element conversions through float, usable on host and device: `convert<Dst>(src)`.
template <class Dst, class Src>
TANDEM_HD inline Dst convert(Src v) {
  if constexpr (std::is_same_v<Dst, Src>) {
    return v;
  } else {
    return Dst(static_cast<float>(v));
  }
}

/// Calls `f(T{})` with the C++ type of a parameter dtype (float, BFloat16 or Float16): nothing is instantiated for
/// double, which parameters cannot be (Layout rejects fp64); fp64 here is out of contract.
template <class F>
decltype(auto) visit_param_dtype(DType t, F&& f) {
  switch (t) {
    case DType::bf16:
      return f(BFloat16{});
    case DType::fp16:
      return f(Float16{});
    case DType::fp32:
    case DType::fp64:
      break;
  }
  return f(float{});
}

/// Calls `f(T{})` with the C++ type of `t` (float, BFloat16, Float16 or double).
template <class F>
decltype(auto) visit_dtype(DType t, F&& f) {
  if (t == DType::fp64) return f(double{});
  return visit_param_dtype(t, std::forward<F>(f));
}

}  // namespace tandem
