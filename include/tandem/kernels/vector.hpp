// SPDX-License-Identifier: Apache-2.0
// Cast-copy of one contiguous segment, shared by pack and unpack: dst[i] = cast(scale * src[i]) (or +=).
//
// Shape: the segment [0, n) is cut into a scalar head (elements before src and dst are both 16-byte
// aligned), whole groups of G = 16 / min(sizeof(Src), sizeof(Dst)) elements moved as 16-byte vectors, and a
// scalar tail. When src and dst are misaligned by different amounts no vector path exists and every element
// goes through the scalar path. Lane `lane` of `lanes` takes groups lane, lane + lanes, ... (four at a time, the rest
// two at a time: their loads are in flight together) and the scalar elements whose index is congruent to `lane`; on
// CUDA a warp's threads are the lanes, the host runs one lane. Where a 16-bit type meets fp32 (two accesses of each
// side per group, so two groups at a time), each `lanes` consecutive groups are split among the lanes in 16-byte parts
// of the fp32 side, so that each of a warp's accesses covers one contiguous range (cast_segment, below). The product
// scale * src[i] is rounded before it is added (kernels/detail/rounding.hpp), so an accumulating copy gives the same
// bits on the host and on the device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "tandem/backend/launch.hpp"
#include "tandem/core/config.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/kernels/detail/host_simd.hpp"
#include "tandem/kernels/detail/rounding.hpp"

namespace tandem {

/// Whether a kernel overwrites its destination or adds into it.
enum class WriteMode { assign, accumulate };

/// How a kernel stores: through the cache, or streaming (non-temporal on the host: for destinations far larger
/// than the cache that are not read again soon, which saves the read-for-ownership of every line).
enum class StoreHint { cached, streaming };

namespace detail {

template <class T, std::size_t N>
struct alignas(16) Vec {
  T v[N];
};

/// 16 bytes as four 32-bit words, in memory order.
struct Words16 {
  unsigned w[4];
};

/// The c-th 16 bytes of a vector of a 16-bit storage type (BFloat16, Float16) as words: element 8c + 2k in the low
/// half of word k, the high half holding element 8c + 2k + 1 (little-endian, as memory holds them on host and device).
template <class T, std::size_t N>
TANDEM_HD inline Words16 words_of(const Vec<T, N>& v, std::size_t c) {
  static_assert(sizeof(T) == 2 && N % 8 == 0, "16-bit storage types fill a 16-byte word with 8 elements");
  Words16 r;
  TANDEM_UNROLL
  for (std::size_t k = 0; k < 4; ++k)
    r.w[k] = unsigned{v.v[8 * c + 2 * k].bits} | (unsigned{v.v[8 * c + 2 * k + 1].bits} << 16);
  return r;
}

/// The inverse of words_of: elements 8c .. 8c + 7 of v from the words.
template <class T, std::size_t N>
TANDEM_HD inline void set_words(Vec<T, N>& v, std::size_t c, const Words16& words) {
  static_assert(sizeof(T) == 2 && N % 8 == 0, "16-bit storage types fill a 16-byte word with 8 elements");
  TANDEM_UNROLL
  for (std::size_t k = 0; k < 8; ++k)
    v.v[8 * c + k].bits = static_cast<std::uint16_t>(words.w[k / 2] >> (16 * (k % 2)));
}

// On the device a vector of 16-bit storage types moves as 16-byte words (uint4) assembled from the elements' bits:
// one 128-bit load or store per 8 elements (a Vec of class types would otherwise move element by element). Vectors of
// arithmetic types move as themselves, which nvcc already makes 128-bit accesses.
template <class T, std::size_t N>
TANDEM_HD inline Vec<T, N> load_vec(const T* p) {
#if TANDEM_IN_DEVICE_CODE
  if constexpr (std::is_arithmetic_v<T>) {
    return *reinterpret_cast<const Vec<T, N>*>(p);
  } else {
    Vec<T, N> r;
    TANDEM_UNROLL
    for (std::size_t c = 0; c < N / 8; ++c) {
      const uint4 u = reinterpret_cast<const uint4*>(p)[c];
      set_words(r, c, Words16{{u.x, u.y, u.z, u.w}});
    }
    return r;
  }
#else
  Vec<T, N> r;
  std::memcpy(&r, p, sizeof r);
  return r;
#endif
}

template <class T, std::size_t N>
TANDEM_HD inline void store_vec(T* p, const Vec<T, N>& v) {
#if TANDEM_IN_DEVICE_CODE
  if constexpr (std::is_arithmetic_v<T>) {
    *reinterpret_cast<Vec<T, N>*>(p) = v;
  } else {
    TANDEM_UNROLL
    for (std::size_t c = 0; c < N / 8; ++c) {
      const Words16 x = words_of(v, c);
      // __stwb: an ordinary (write-back) store, which nvcc keeps one 128-bit store; a plain uint4 assignment it splits
      __stwb(reinterpret_cast<uint4*>(p) + c, make_uint4(x.w[0], x.w[1], x.w[2], x.w[3]));
    }
  }
#else
  std::memcpy(p, &v, sizeof v);
#endif
}

/// Elements [k * P, (k + 1) * P) of v from p: one access of P * sizeof(T) bytes (16, or 8 for four 16-bit elements),
/// which p's alignment to that size allows.
template <std::size_t P, class T, std::size_t N>
TANDEM_HD inline void load_part(Vec<T, N>& v, std::size_t k, const T* p) {
  static_assert(N % P == 0 && (P * sizeof(T) == 16 || (P == 4 && sizeof(T) == 2)), "16-byte parts, or 8 of 16 bits");
#if TANDEM_IN_DEVICE_CODE
  if constexpr (P * sizeof(T) == 16) {
    const Vec<T, P> x = load_vec<T, P>(p);
    TANDEM_UNROLL
    for (std::size_t e = 0; e < P; ++e) v.v[k * P + e] = x.v[e];
  } else {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    TANDEM_UNROLL
    for (std::size_t e = 0; e < 4; ++e)
      v.v[k * P + e].bits = static_cast<std::uint16_t>((e < 2 ? u.x : u.y) >> (16 * (e % 2)));
  }
#else
  std::memcpy(&v.v[k * P], p, P * sizeof(T));
#endif
}

/// The inverse of load_part: elements [k * P, (k + 1) * P) of v to p, in one access.
template <std::size_t P, class T, std::size_t N>
TANDEM_HD inline void store_part(T* p, const Vec<T, N>& v, std::size_t k) {
  static_assert(N % P == 0 && (P * sizeof(T) == 16 || (P == 4 && sizeof(T) == 2)), "16-byte parts, or 8 of 16 bits");
#if TANDEM_IN_DEVICE_CODE
  if constexpr (P * sizeof(T) == 16) {
    Vec<T, P> x;
    TANDEM_UNROLL
    for (std::size_t e = 0; e < P; ++e) x.v[e] = v.v[k * P + e];
    store_vec<T, P>(p, x);
  } else {
    const auto word = [&](std::size_t e) {
      return unsigned{v.v[k * P + e].bits} | (unsigned{v.v[k * P + e + 1].bits} << 16);
    };
    __stwb(reinterpret_cast<uint2*>(p), make_uint2(word(0), word(2)));
  }
#else
  std::memcpy(p, &v.v[k * P], P * sizeof(T));
#endif
}

/// A 16-byte-aligned vector store that bypasses the cache on x86 hosts (an ordinary store elsewhere).
/// The host backend fences after every launch (detail::stream_fence in backend/launch.hpp).
template <class T, std::size_t N>
TANDEM_HD inline void stream_vec(T* p, const Vec<T, N>& v) {
#if TANDEM_HOST_SSE2
  static_assert(sizeof(Vec<T, N>) % 16 == 0, "streaming stores move whole 16-byte vectors");
  const char* from = reinterpret_cast<const char*>(&v);
  char* to = reinterpret_cast<char*>(p);
  for (std::size_t k = 0; k < sizeof(v); k += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + k), _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + k)));
#else
  store_vec<T, N>(p, v);
#endif
}

TANDEM_HD inline std::uintptr_t misalignment16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) & 15u; }

template <class Src, class Dst, WriteMode Mode>
TANDEM_HD inline void cast_one(const Src* src, Dst* dst, std::size_t i, float scale) {
  const float x = mul_rn(scale, static_cast<float>(src[i]));
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
TANDEM_HD inline void cast_segment(const Src* src, Dst* dst, std::size_t n, float scale, unsigned lane, unsigned lanes,
                                   StoreHint hint = StoreHint::cached) {
  constexpr std::size_t G = group_elements<Src, Dst>;
  const std::size_t head = vector_head(src, dst, n);
  const std::size_t groups = (n - head) / G;
  const std::size_t tail = head + groups * G;
  for (std::size_t i = lane; i < head; i += lanes) cast_one<Src, Dst, Mode>(src, dst, i, scale);
  // groups: elements [head + g*G, head + (g+1)*G) on the host (one lane), one 16-byte (or 2x16-byte) load and store
  // each; on the device, the same elements in a block of groups taken part-major (below). On the device a
  // group's loads (its source, and its destination where it accumulates) are apart from its arithmetic, so that
  // several groups' loads are in flight while the results of only one are held: a 16-bit source's results take twice
  // its registers (ptxas, sm_90: the lane-major bf16 -> fp32 pack took 40 registers, not 54; part-major, 32).
  struct Loaded {
    Vec<Src, G> s;
    Vec<Dst, G> d;  ///< (accumulate)
  };
  auto load = [&](std::size_t g) {
    const std::size_t at = head + g * G;
    Loaded l{};  // (d stays zero where nothing loads it: never read then)
    l.s = load_vec<Src, G>(src + at);
    if constexpr (Mode == WriteMode::accumulate) l.d = load_vec<Dst, G>(dst + at);
    return l;
  };
  auto cast = [&](const Loaded& l) {
#if TANDEM_HOST_SSE2
    // A 16-bit type on either side: the group as two vectors of four floats (kernels/detail/host_simd.hpp).
    if constexpr (G == 8 && host_simd_type<Src> && host_simd_type<Dst>) {
      if constexpr (Mode == WriteMode::assign && std::is_same_v<Src, Dst>)
        if (scale == 1.0f) return l.s;  // a plain copy keeps every bit
      const __m128 k = _mm_set1_ps(scale);
      Float4x2 x = widen8(l.s.v);
      x = {mul_rn(k, x.lo), mul_rn(k, x.hi)};
      if constexpr (Mode == WriteMode::accumulate) {
        const Float4x2 before = widen8(l.d.v);
        x = {_mm_add_ps(before.lo, x.lo), _mm_add_ps(before.hi, x.hi)};
      }
      Vec<Dst, G> d;
      narrow8(x, d.v);
      return d;
    }
#endif
    Vec<Dst, G> d;
    if constexpr (Mode == WriteMode::accumulate) d = l.d;
    auto element = [&](std::size_t k) {
      const float x = mul_rn(scale, static_cast<float>(l.s.v[k]));
      if constexpr (Mode == WriteMode::accumulate) {
        d.v[k] = Dst(static_cast<float>(d.v[k]) + x);
      } else if constexpr (std::is_same_v<Src, Dst>) {
        d.v[k] = scale == 1.0f ? l.s.v[k] : Dst(x);
      } else {
        d.v[k] = Dst(x);
      }
    };
    // Unrolled on the host only between arithmetic types: GCC at -O2 then makes the group one vector (fp32 pack and
    // unpack at twice the speed), where a 16-bit storage type's conversions ran slower unrolled than as a loop (fp32 ->
    // bf16 pack of GPT-2: 0.32x copy, not 0.46x).
    if constexpr (std::is_arithmetic_v<Src> && std::is_arithmetic_v<Dst>) {
      TANDEM_UNROLL
      for (std::size_t k = 0; k < G; ++k) element(k);
    } else {
      TANDEM_DEVICE_UNROLL
      for (std::size_t k = 0; k < G; ++k) element(k);
    }
    return d;
  };
  auto group = [&](std::size_t g) { return cast(load(g)); };
  auto put = [&](std::size_t g, const Loaded& l) { store_vec<Dst, G>(dst + head + g * G, cast(l)); };
  // On the device, the elements of one 16-byte access of the wider type (P), and the accesses of a group (Q: 2 where a
  // 16-bit type meets fp32, else 1).
  constexpr std::size_t P = 16 / (sizeof(Src) > sizeof(Dst) ? sizeof(Src) : sizeof(Dst));
  constexpr std::size_t Q = G / P;
  // The host (one lane): four groups at a time, every source line of theirs (two of fp32 where a 16-bit type meets it)
  // and, accumulating, every destination line prefetched 1 KB ahead; then their stores, streaming where the hint says
  // (assign only). The hardware prefetcher alone kept a single thread waiting for memory where a group takes more
  // arithmetic than a copy (a 16-bit conversion, an accumulate) and so fewer loads are in flight.
  if (lanes == 1) {
    const bool streaming = hint == StoreHint::streaming && Mode == WriteMode::assign;
    auto store = [&](std::size_t g, const Vec<Dst, G>& d) {
      if (streaming) {
        stream_vec<Dst, G>(dst + head + g * G, d);
      } else {
        store_vec<Dst, G>(dst + head + g * G, d);
      }
    };
    std::size_t g = 0;
    for (; g + 4 <= groups; g += 4) {
#if !TANDEM_IN_DEVICE_CODE && (defined(__GNUC__) || defined(__clang__))
      for (std::size_t b = 0; b < 4 * G * sizeof(Src); b += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(src + head + g * G) + 1024 + b);
      if constexpr (Mode == WriteMode::accumulate)
        for (std::size_t b = 0; b < 4 * G * sizeof(Dst); b += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(dst + head + g * G) + 1024 + b, 1);
#endif
      const Vec<Dst, G> d0 = group(g), d1 = group(g + 1), d2 = group(g + 2), d3 = group(g + 3);
      store(g, d0);
      store(g + 1, d1);
      store(g + 2, d2);
      store(g + 3, d3);
    }
    for (; g < groups; ++g) store(g, group(g));
  } else if constexpr (Q == 1) {  // the device: four groups' loads in flight per lane, then their stores
    std::size_t g = lane;
    for (; g + 3 * lanes < groups; g += 4 * lanes) {
      const Loaded l0 = load(g), l1 = load(g + lanes), l2 = load(g + 2 * lanes), l3 = load(g + 3 * lanes);
      put(g, l0);
      put(g + lanes, l1);
      put(g + 2 * lanes, l2);
      put(g + 3 * lanes, l3);
    }
    // The rest two groups at a time, both loads before either store: a 1 KB fp32 tensor is 64 groups, two per lane,
    // which one at a time would wait for memory twice in a row (a store may alias the next load, so the compiler
    // cannot hoist it).
    for (; g + lanes < groups; g += 2 * lanes) {
      const Loaded l0 = load(g), l1 = load(g + lanes);
      put(g, l0);
      put(g + lanes, l1);
    }
    if (g < groups) put(g, load(g));
  } else {  // the device, where a 16-bit type meets fp32: a group is Q = 2 accesses of P elements of each side
    // Lane l's groups are l, l + lanes, ...: a whole block of `lanes` consecutive groups is laid out part-major, lane
    // l's part c at elements [(c * lanes + l) * P, (c * lanes + l + 1) * P) of the block, so that each access
    // instruction of a warp covers one contiguous range (512 bytes of fp32, 256 of the 16-bit type), whole 32-byte
    // sectors; lane-major, as on the host, each fp32 access would cover every other 16 bytes, half of each sector.
    // The last block, if partial, goes lane-major.
    auto at = [&](std::size_t g, std::size_t c) { return head + (g - lane) * G + (c * lanes + lane) * P; };
    auto load_parts = [&](std::size_t g) {
      Loaded l{};
      TANDEM_UNROLL
      for (std::size_t c = 0; c < Q; ++c) {
        load_part<P>(l.s, c, src + at(g, c));
        if constexpr (Mode == WriteMode::accumulate) load_part<P>(l.d, c, dst + at(g, c));
      }
      return l;
    };
    auto put_parts = [&](std::size_t g, const Loaded& l) {
      const Vec<Dst, G> d = cast(l);
      TANDEM_UNROLL
      for (std::size_t c = 0; c < Q; ++c) store_part<P>(dst + at(g, c), d, c);
    };
    // Two whole blocks at a time (the same trip count in every lane): 2 * Q loads in flight per lane.
    std::size_t g = lane;
    for (; g - lane + 2 * lanes <= groups; g += 2 * lanes) {
      const Loaded l0 = load_parts(g), l1 = load_parts(g + lanes);
      put_parts(g, l0);
      put_parts(g + lanes, l1);
    }
    if (g - lane + lanes <= groups) {
      put_parts(g, load_parts(g));
      g += lanes;
    }
    if (g < groups) put(g, load(g));
  }
  for (std::size_t i = tail + lane; i < n; i += lanes) cast_one<Src, Dst, Mode>(src, dst, i, scale);
}

/// dst[0, n) = src[0, n): ordinary stores up to dst's first 16-byte boundary, streaming stores (host) from there, and
/// ordinary stores for a tail of less than 16 bytes (all of it where no element of dst starts on a boundary).
/// The caller fences (detail::stream_fence) before others read dst.
template <class T>
inline void stream_copy(const T* src, T* dst, std::size_t n) {
  constexpr std::size_t G = 16 / sizeof(T) > 0 ? 16 / sizeof(T) : 1;
  std::size_t i = 0;
  if constexpr (sizeof(T) * G == 16) {
    for (; i < n && misalignment16(dst + i) != 0; ++i) dst[i] = src[i];
    for (; i + G <= n; i += G) stream_vec<T, G>(dst + i, load_vec<T, G>(src + i));
  }
  for (; i < n; ++i) dst[i] = src[i];
}

}  // namespace detail

/// Elements per work item of a flat cast-copy.
inline constexpr std::size_t cast_chunk_elements = 1024;

constexpr std::size_t cast_items(std::size_t n) { return (n + cast_chunk_elements - 1) / cast_chunk_elements; }

/// dst[i] (=|+=) cast<Dst>(scale * src[i]) for i in [0, n): a flat range, cast_chunk_elements per item.
template <class Src, class Dst, WriteMode Mode = WriteMode::assign>
struct CastBody {
  const Src* src;
  Dst* dst;
  std::size_t n;
  float scale;
  StoreHint hint = StoreHint::cached;  ///< streaming for ranges far larger than the cache (host; assign only)

  TANDEM_HD void operator()(std::size_t item, unsigned lane, unsigned lanes) const {
    const std::size_t begin = item * cast_chunk_elements;
    const std::size_t count = n - begin < cast_chunk_elements ? n - begin : cast_chunk_elements;
    detail::cast_segment<Src, Dst, Mode>(src + begin, dst + begin, count, scale, lane, lanes, hint);
  }
};

}  // namespace tandem
