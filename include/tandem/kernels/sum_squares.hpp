// SPDX-License-Identifier: Apache-2.0
// Sum of squares of a flat fp32 (or 16-bit) range, for global-norm clipping. The range is cut into fixed chunks of
// sum_squares_chunk_elements; each work item returns its chunk's sum in double, and the backend adds the
// chunk sums in item order. The chunking is fixed, so the result does not depend on how many threads run. Squares
// follow the rounding rule (kernels/detail/rounding.hpp) like every body's products, although the square of a float is
// exact in double, so that FMA contraction could not change this sum.
#pragma once

#include <cstddef>

#include "tandem/core/config.hpp"
#include "tandem/kernels/detail/rounding.hpp"

namespace tandem {

inline constexpr std::size_t sum_squares_chunk_elements = 4096;

constexpr std::size_t sum_squares_items(std::size_t n) {
  return (n + sum_squares_chunk_elements - 1) / sum_squares_chunk_elements;
}

template <class T = float>
struct SumSquaresBody {
  const T* x = nullptr;
  std::size_t n = 0;

  /// The part of chunk `item` that lane `lane` of `lanes` owns; lane partials are added by the caller.
  TANDEM_HD double operator()(std::size_t item, unsigned lane, unsigned lanes) const {
    const std::size_t begin = item * sum_squares_chunk_elements;
    const std::size_t end = begin + sum_squares_chunk_elements < n ? begin + sum_squares_chunk_elements : n;
    double s = 0.0;
    for (std::size_t i = begin + lane; i < end; i += lanes) {
      const double v = static_cast<float>(x[i]);
      s += detail::mul_rn(v, v);
    }
    return s;
  }
};
template <class T>
SumSquaresBody(const T*, std::size_t) -> SumSquaresBody<T>;

/// *out = sum over g of (sum over k of terms[g * per_group + k]), each sum from 0 in index order: how a global
/// norm's per-(rank, bucket) terms are combined, on the device as on the host. One item; lane 0 does it all
/// (a few hundred additions: cheaper than a round trip to the host). Additions only: nothing to contract.
struct OrderedSumBody {
  const double* terms = nullptr;
  std::size_t groups = 0;
  std::size_t per_group = 0;
  double* out = nullptr;

  TANDEM_HD void operator()(std::size_t, unsigned lane, unsigned) const {
    if (lane != 0) return;
    double total = 0.0;
    for (std::size_t g = 0; g < groups; ++g) {
      double group = 0.0;
      for (std::size_t k = 0; k < per_group; ++k) group += terms[g * per_group + k];
      total += group;
    }
    *out = total;
  }
};

/// Stores the values it was launched with: out[k] = values[k] for k < count (at most K). Host values reach backend
/// memory in stream order this way without a host buffer that must outlive the copy (the optimizer step's options
/// check, whose all-reduce may throw before a queued copy ran; the optimizer options of a step). One item; lane 0
/// stores.
template <class T, std::size_t K>
struct StoreValuesBody {
  static constexpr std::size_t capacity = K;
  T* out = nullptr;
  T values[K] = {};
  std::size_t count = 0;

  TANDEM_HD void operator()(std::size_t, unsigned lane, unsigned) const {
    if (lane != 0) return;
    for (std::size_t k = 0; k < count; ++k) out[k] = values[k];
  }
};

}  // namespace tandem
