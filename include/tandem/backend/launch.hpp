// SPDX-License-Identifier: Apache-2.0
// How a launch of `items` work items maps onto CUDA blocks, warps and threads, as plain functions so that host tests
// can prove the mapping covers every item exactly once.
//
// A kernel body is a callable body(item, lane, lanes): it does the part of work item `item` that lane `lane` of
// `lanes` cooperating lanes owns. On CUDA a launch gives each item a warp (lanes = item_lanes = 32): a block of
// block_threads threads works on items_per_block items at once, and warp w of block b walks items
// b * items_per_block + w, then + grid * items_per_block, ... (grid-stride). A warp rather than a block per item keeps
// every lane busy on small items (a 1 KB tensor is 64 vectors: a block would leave three quarters of its threads idle)
// and needs no synchronisation inside a block. A reduction (CudaBackend::sum_to) gives each item a block instead, whose
// lanes reduce together: block b walks items b, b + grid, .... The grid is at most max_blocks blocks (the device's
// resident blocks, CudaBackend::max_blocks): further items are reached by the grid-stride loop. On the host one lane
// does the whole item (lane 0 of 1), items in linear order, which is cache-friendly and vectorizable.
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
/// Lanes of one work item in a launch: a warp.
inline constexpr unsigned item_lanes = 32;
/// Items one block of a launch works on at once.
inline constexpr unsigned items_per_block = block_threads / item_lanes;
/// Threads a CUDA multiprocessor keeps resident at once (sm_80 and sm_90): a launch of more blocks than the device's
/// SMs x resident_threads_per_sm / block_threads runs in more than one wave.
inline constexpr unsigned resident_threads_per_sm = 2048;
/// The most blocks one launch uses where the device is not known; further items are reached by the grid-stride loop.
inline constexpr unsigned max_grid_blocks = 65535;

struct LaunchShape {
  unsigned grid = 0;   ///< blocks (0: nothing to launch)
  unsigned block = 0;  ///< threads per block
};

/// The grid a launch of `items` items uses: a warp per item, so ceil(items / items_per_block) blocks, up to
/// `max_blocks`.
constexpr LaunchShape launch_shape(std::size_t items, unsigned max_blocks = max_grid_blocks) {
  if (items == 0) return {0, block_threads};
  const std::size_t blocks = (items + items_per_block - 1) / items_per_block;
  return {static_cast<unsigned>(std::min<std::size_t>(blocks, max_blocks)), block_threads};
}

/// The grid a reduction over `items` items uses: a block per item, up to `max_blocks`.
constexpr LaunchShape reduction_shape(std::size_t items, unsigned max_blocks = max_grid_blocks) {
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

/// Calls f(item) for every item warp `warp` of block `block` of a `grid`-block launch visits, in order.
template <class F>
TANDEM_HD void for_each_item_of_warp(unsigned block, unsigned warp, unsigned grid, std::size_t items, F&& f) {
  const std::size_t stride = std::size_t{grid} * items_per_block;
  for (std::size_t item = std::size_t{block} * items_per_block + warp; item < items; item += stride) f(item);
}

/// Calls f(item) for every item block `block` of a `grid`-block reduction visits, in order.
template <class F>
TANDEM_HD void for_each_item_of_block(unsigned block, unsigned grid, std::size_t items, F&& f) {
  for (std::size_t item = block; item < items; item += grid) f(item);
}

}  // namespace tandem
