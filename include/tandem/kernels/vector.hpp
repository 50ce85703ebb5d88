// SPDX-License-Identifier: Apache-2.0
// Cast-copy of one contiguous segment, shared by pack and unpack: dst[i] = cast(scale * src[i]) (or +=).
//
// Shape: the segment [0, n) is cut into a scalar head (elements before src and dst are both 16-byte
// aligned), whole groups of G = 16 / min(sizeof(Src), sizeof(Dst)) elements moved as 16-byte vectors, and a
// scalar tail. When src and dst are misaligned by different amounts no vector path exists and every element
// goes through the scalar path. Lane `lane` of `lanes` takes groups lane, lane + lanes, ... and the scalar
// elements whose index is congruent to `lane`; the CUDA block's threads are the lanes, the host runs one lane.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "tandem/core/config.hpp"
#include "tandem/core/dtype.hpp"

namespace tandem {

/// Whether a kernel overwrites its destination or adds into it.
enum class WriteMode { assign, accumulate };

namespace detail {

template <class T, std::size_t N>
struct alignas(16) Vec {
  T v[N];
};

template <class T, std::size_t N>
TANDEM_HD inline Vec<T, N> load_vec(const T* p) {
#if TANDEM_IN_DEVICE_CODE
  return *reinterpret_cast<const Vec<T, N>*>(p);
#else
  Vec<T, N> r;
  std::memcpy(&r, p, sizeof r);
  return r;
#endif
}

template <class T, std::size_t N>
TANDEM_HD inline void store_vec(T* p, const Vec<T, N>& v) {
#if TANDEM_IN_DEVICE_CODE
  *reinterpret_cast<Vec<T, N>*>(p) = v;
#else
  std::memcpy(p, &v, sizeof v);
#endif
}

TANDEM_HD inline std::uintptr_t misalignment16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) & 15u; }

template <class Src, class Dst, WriteMode Mode>
TANDEM_HD inline void cast_one(const Src* src, Dst* dst, std::size_t i, float scale) {
  const float x = scale * static_cast<float>(src[i]);
  if constexpr (Mode == WriteMode::accumulate) {
    dst[i] = Dst(static_cast<float>(dst[i]) + x);
  } else if constexpr (std::is_same_v<Src, Dst>) {
    dst[i] = scale == 1.0f ? src[i] : Dst(x);  // a plain copy keeps every bit (NaN payloads, -0)
  } else {
    dst[i] = Dst(x);
  }
}

/// Elements per 16-byte vector group for a Src -> Dst cast.
template <class Src, class Dst>
inline constexpr std::size_t group_elements = 16 / (sizeof(Src) < sizeof(Dst) ? sizeof(Src) : sizeof(Dst));

/// Number of leading scalar elements before src and dst are both 16-byte aligned, or n if they never are
/// within one group (different misalignments): then the whole segment is scalar.
template <class Src, class Dst>
TANDEM_HD inline std::size_t vector_head(const Src* src, const Dst* dst, std::size_t n) {
  constexpr std::size_t G = group_elements<Src, Dst>;
  for (std::size_t h = 0; h < G && h < n; ++h)
    if (misalignment16(src + h) == 0 && misalignment16(dst + h) == 0) return h;
  return n;
}

template <class Src, class Dst, WriteMode Mode>
TANDEM_HD inline void cast_segment(const Src* src, Dst* dst, std::size_t n, float scale, unsigned lane,
                                   unsigned lanes) {
  constexpr std::size_t G = group_elements<Src, Dst>;
  const std::size_t head = vector_head(src, dst, n);
  const std::size_t groups = (n - head) / G;
  const std::size_t tail = head + groups * G;
  for (std::size_t i = lane; i < head; i += lanes) cast_one<Src, Dst, Mode>(src, dst, i, scale);
  // groups: elements [head + g*G, head + (g+1)*G), one 16-byte (or 2x16-byte) load and store each
  auto group = [&](std::size_t g) {
    const std::size_t at = head + g * G;
    const Vec<Src, G> s = load_vec<Src, G>(src + at);
    Vec<Dst, G> d;
    if constexpr (Mode == WriteMode::accumulate) d = load_vec<Dst, G>(dst + at);
    TANDEM_UNROLL
    for (std::size_t k = 0; k < G; ++k) {
      const float x = scale * static_cast<float>(s.v[k]);
      if constexpr (Mode == WriteMode::accumulate) {
        d.v[k] = Dst(static_cast<float>(d.v[k]) + x);
      } else if constexpr (std::is_same_v<Src, Dst>) {
        d.v[k] = scale == 1.0f ? s.v[k] : Dst(x);
      } else {
        d.v[k] = Dst(x);
      }
    }
    store_vec<Dst, G>(dst + at, d);
  };
  if (lanes == 1) {  // the host: unit stride, so the compiler can vectorize across groups
    for (std::size_t g = 0; g < groups; ++g) group(g);
  } else {
    for (std::size_t g = lane; g < groups; g += lanes) group(g);
  }
  for (std::size_t i = tail + lane; i < n; i += lanes) cast_one<Src, Dst, Mode>(src, dst, i, scale);
}

}  // namespace detail

/// Elements per work item of a flat cast-copy.
inline constexpr std::size_t cast_chunk_elements = 4096;

constexpr std::size_t cast_items(std::size_t n) { return (n + cast_chunk_elements - 1) / cast_chunk_elements; }

/// dst[i] (=|+=) cast<Dst>(scale * src[i]) for i in [0, n): a flat range, cast_chunk_elements per item.
template <class Src, class Dst, WriteMode Mode = WriteMode::assign>
struct CastBody {
  const Src* src;
  Dst* dst;
  std::size_t n;
  float scale;

  TANDEM_HD void operator()(std::size_t item, unsigned lane, unsigned lanes) const {
    const std::size_t begin = item * cast_chunk_elements;
    const std::size_t count = n - begin < cast_chunk_elements ? n - begin : cast_chunk_elements;
    detail::cast_segment<Src, Dst, Mode>(src + begin, dst + begin, count, scale, lane, lanes);
  }
};

}  // namespace tandem
