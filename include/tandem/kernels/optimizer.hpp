// SPDX-License-Identifier: Apache-2.0
// What every optimizer body shares: the arguments of an update over one flat range (the range of a bucket a
// rank owns), its chunking into work items, and the concept an optimizer type satisfies.
//
// Data layout: element i of the range has an fp32 master weight master[i] (for fp32 parameters this is the
// parameter itself, so param == master), a gradient grad[i] (already reduced over ranks; of type G: fp32, or the
// 16-bit reduce dtype where the reduced shard stays in it; read as float and multiplied by grad_scale, which
// carries clipping and any deferred averaging) and up to two fp32 state
// elements state[0][i], state[1][i]. The updated weight is written to master[i] and, cast, to param[i]. Bodies
// follow the rounding rule of kernels/detail/rounding.hpp, so an update gives the same bits on host and device.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "tandem/core/config.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/core/hash.hpp"

namespace tandem {

/// Elements per optimizer work item.
inline constexpr std::size_t update_chunk_elements = 4096;

/// Whether SGD uses Nesterov momentum.
enum class Nesterov { off, on };

template <class P, class G = float>
struct UpdateArgs {
  float* master = nullptr;  ///< fp32 weights (== param for fp32 parameters)
  P* param = nullptr;       ///< parameter-dtype copy that is gathered and unpacked
  const G* grad = nullptr;
  float* state[2] = {nullptr, nullptr};
  std::size_t n = 0;
  float grad_scale = 1.0f;
};

/// Work items of an update over n elements.
constexpr std::size_t update_items(std::size_t n) { return (n + update_chunk_elements - 1) / update_chunk_elements; }

namespace detail {

/// FNV-1a over the bit patterns of an optimizer's option values: equal options, equal fingerprints.
inline std::uint64_t fingerprint_values(std::initializer_list<float> values) {
  std::uint64_t h = fnv1a_basis;
  for (float v : values) {
    std::uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    for (int k = 0; k < 4; ++k) {  // little-endian byte order on every host
      const auto byte = static_cast<unsigned char>((bits >> (8 * k)) & 0xffu);
      h = fnv1a(&byte, 1, h);
    }
  }
  return h;
}

/// Calls f(i) for the elements of `item` that lane `lane` of `lanes` owns (coalesced on CUDA).
template <class F>
TANDEM_HD inline void for_each_update_element(std::size_t item, unsigned lane, unsigned lanes, std::size_t n, F&& f) {
  const std::size_t begin = item * update_chunk_elements;
  const std::size_t end = begin + update_chunk_elements < n ? begin + update_chunk_elements : n;
  if (lanes == 1) {  // the host: a unit-stride loop the compiler can vectorize
    for (std::size_t i = begin; i < end; ++i) f(i);
  } else {
    for (std::size_t i = begin + lane; i < end; i += lanes) f(i);
  }
}

}  // namespace detail

/// An optimizer type: its options, how much fp32 state it keeps per element, a validation of its options,
/// the per-step scalars computed on the host, and a body templated on the parameter type and the gradient type
/// (Body<P, G = float>, over UpdateArgs<P, G>).
template <class O>
concept Optimizer = requires(const typename O::Options& options, std::uint64_t step) {
  { O::name } -> std::convertible_to<const char*>;
  { O::state_count(options) } -> std::convertible_to<std::size_t>;
  O::validate(options);
  { O::fingerprint(options) } -> std::convertible_to<std::uint64_t>;
  { O::scalars(options, step) } -> std::same_as<typename O::Scalars>;
  typename O::template Body<float>;
  typename O::template Body<float, BFloat16>;  // a 16-bit reduced shard (DataParallelOptions::reduce_dtype)
  { O::elementwise } -> std::convertible_to<bool>;
};

}  // namespace tandem
