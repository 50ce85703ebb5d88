// SPDX-License-Identifier: Apache-2.0
// How a launch of `items` work items maps onto CUDA blocks and threads, as plain functions so that host
// tests can prove the mapping covers every item exactly once.
//
// A kernel body is a callable body(item, lane, lanes): it does the part of work item `item` that lane
// `lane` of `lanes` cooperating lanes owns. On CUDA one block runs one item at a time (lane = threadIdx.x,
// lanes = blockDim.x) and block b walks items b, b + grid, b + 2*grid, ... (grid-stride). On the host one
// lane does the whole item (lane 0 of 1), items in linear order, which is cache-friendly and vectorizable.
#pragma once

#include <algorithm>
#include <cstddef>

#include "tandem/core/config.hpp"

#if !defined(__CUDA_ARCH__) && defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace tandem {

/// Threads per block for every tandem kernel.
inline constexpr unsigned block_threads = 256;
/// The most blocks one launch uses; further items are reached by the grid-stride loop.
inline constexpr unsigned max_grid_blocks = 65535;

struct LaunchShape {
  unsigned grid = 0;   ///< blocks (0: nothing to launch)
  unsigned block = 0;  ///< threads per block
};

/// The grid a launch of `items` items uses: one block per item up to `max_blocks`.
constexpr LaunchShape launch_shape(std::size_t items, unsigned max_blocks = max_grid_blocks) {
  if (items == 0) return {0, block_threads};
  return {static_cast<unsigned>(std::min<std::size_t>(items, max_blocks)), block_threads};
}

namespace detail {

/// Orders streaming (non-temporal) stores before later stores on x86 hosts; nothing elsewhere. The host
/// backend calls it after each launch; on CUDA the end of a kernel does the same.
TANDEM_HD inline void stream_fence() {
#if !TANDEM_IN_DEVICE_CODE && defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace detail

/// Calls f(item) for every item block `block` of a `grid`-block launch visits, in order.
template <class F>
TANDEM_HD void for_each_item_of_block(unsigned block, unsigned grid, std::size_t items, F&& f) {
  for (std::size_t item = block; item < items; item += grid) f(item);
}

}  // namespace tandem
