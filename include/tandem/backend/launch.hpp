// SPDX-License-Identifier: Apache-2.0
// How a launch of `items` work items maps onto CUDA blocks, warps and threads, as plain functions so that host tests
// can prove the mapping covers every item exactly once.
//
// A kernel body is a callable body(item, lane, lanes): it does the part of work item `item` that lane `lane` of
// `lanes` cooperating lanes owns. On CUDA a launch gives each item a warp (lanes = item_lanes = 32), or a part of one
// where the body asks for fewer lanes (lanes_of<Body>: several small items per warp): a block of block_threads
// threads works on block_threads / lanes items at once, and slot s of block b (its threads s * lanes onward) walks
// items b * (block_threads / lanes) + s, then + grid * (block_threads / lanes), ... (grid-stride). A warp rather than
// a block per item keeps every lane busy on small items (a 1 KB tensor is 64 vectors: a block would leave three
// quarters of its threads idle) and needs no synchronisation inside a block. A reduction (CudaBackend::sum_to) gives
// each item a block instead, whose lanes reduce together: block b walks items b, b + grid, .... The grid is at most
// max_blocks blocks (on CUDA the blocks of that kernel the device keeps resident, CudaBackend::resident_blocks; SMs x 8
// for a reduction, CudaBackend::max_blocks): further items are reached by the grid-stride loop. On the host one lane
// does the whole item (lane 0 of 1), items in linear order, which is cache-friendly and vectorizable.
#pragma once

#include <algorithm>
#include <cstddef>

#include "tandem/core/config.hpp"

#if TANDEM_HOST_SSE2
#include <emmintrin.h>
#endif

namespace tandem {

/// Threads per block for every tandem kernel.
inline constexpr unsigned block_threads = 256;
/// Lanes of one work item in a launch: a warp.
inline constexpr unsigned item_lanes = 32;
/// Items one block of a launch works on at once.
inline constexpr unsigned items_per_block = block_threads / item_lanes;
/// Lanes of one work item of Body's launches: Body::item_lanes where the body declares it (a power of two that divides
/// a warp), else a warp.
template <class Body>
TANDEM_HD constexpr unsigned lanes_of() {
  if constexpr (requires { Body::item_lanes; }) {
    constexpr unsigned lanes = Body::item_lanes;
    static_assert(lanes >= 1 && lanes <= item_lanes && item_lanes % lanes == 0,
                  "a body's item_lanes is a power of two that divides a warp (32)");
    return lanes;
  } else {
    return item_lanes;
  }
}
/// Body, launched with Lanes lanes per item (lanes_of): on CUDA, block_threads / Lanes items per block at once.
template <class Body, unsigned Lanes>
struct WithItemLanes : Body {
  static constexpr unsigned item_lanes = Lanes;
};
/// How a backend's launches want their pack tables (kernels/pack.hpp): the work items' size, and whether a launch
/// visits its items in list order. A backend says so with `static constexpr PackTableLayout pack_table_layout`;
/// pack_table_layout_of<Backend>() is the host's where it does not.
struct PackTableLayout {
  /// Elements per item (a multiple of 16, every vector group): a tensor of n elements is ceil(n / chunk) items.
  std::size_t chunk_elements = 1024;
  /// True where a launch visits its items in list order (the host: one thread, item after item), so that the pack
  /// reads the user's buffers at ascending addresses, which the hardware prefetches: the tables keep a second item
  /// list in that order (PackTable::reading_user). False where a launch runs its items at once: one list serves both
  /// directions, half the table memory.
  bool ordered = true;
};
/// CudaBackend's: items of 512 elements, one list. On an H200, 512-element items packed and unpacked GPT-2-124M's
/// buckets in runs at 0.885 / 0.894 of a device copy, against 0.877 / 0.881 with 1024 (docs/cuda.md); in one list a
/// table takes what 1024-element items took in two: 32 bytes per 1024 elements.
inline constexpr PackTableLayout cuda_pack_table_layout{.chunk_elements = 512, .ordered = false};
/// Backend's PackTableLayout: Backend::pack_table_layout where it declares one, else the host's.
template <class Backend>
constexpr PackTableLayout pack_table_layout_of() {
  if constexpr (requires { Backend::pack_table_layout; })
    return Backend::pack_table_layout;
  else
    return PackTableLayout{};
}

/// Threads a CUDA multiprocessor keeps resident at once (sm_80 and sm_90): a launch of more blocks than the device's
/// SMs x resident_threads_per_sm / block_threads runs in more than one wave.
inline constexpr unsigned resident_threads_per_sm = 2048;
/// The most blocks one launch uses where the device is not known; further items are reached by the grid-stride loop.
inline constexpr unsigned max_grid_blocks = 65535;

struct LaunchShape {
  unsigned grid = 0;   ///< blocks (0: nothing to launch)
  unsigned block = 0;  ///< threads per block
};

/// The grid a launch of `items` items uses: `lanes` threads per item (a warp unless said), so
/// ceil(items / (block_threads / lanes)) blocks, up to `max_blocks`.
constexpr LaunchShape launch_shape(std::size_t items, unsigned max_blocks = max_grid_blocks,
                                   unsigned lanes = item_lanes) {
  if (items == 0) return {0, block_threads};
  const std::size_t per_block = block_threads / lanes;
  const std::size_t blocks = (items + per_block - 1) / per_block;
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
#if TANDEM_HOST_SSE2
  _mm_sfence();
#endif
}

}  // namespace detail

/// Calls f(item) for every item slot `slot` (threads slot * lanes onward) of block `block` of a `grid`-block launch of
/// `lanes` lanes per item visits, in order.
template <class F>
TANDEM_HD void for_each_item_of_slot(unsigned block, unsigned slot, unsigned grid, std::size_t items, unsigned lanes,
                                     F&& f) {
  const std::size_t per_block = block_threads / lanes;
  const std::size_t stride = std::size_t{grid} * per_block;
  for (std::size_t item = std::size_t{block} * per_block + slot; item < items; item += stride) f(item);
}

/// for_each_item_of_slot, one item ahead: calls f(load(item)) for every item the slot visits, in order, and calls
/// load for the next item before f runs on the current one, so that on a device the next item's load (its descriptor,
/// say) is in flight while f works on this one. bench_cuda's /prefetch rows launch the pack bodies this way.
template <class Load, class F>
TANDEM_HD void for_each_item_of_slot_ahead(unsigned block, unsigned slot, unsigned grid, std::size_t items,
                                           unsigned lanes, Load&& load, F&& f) {
  const std::size_t per_block = block_threads / lanes;
  const std::size_t stride = std::size_t{grid} * per_block;
  std::size_t item = std::size_t{block} * per_block + slot;
  if (item >= items) return;
  auto current = load(item);
  for (item += stride; item < items; item += stride) {
    auto ahead = load(item);
    f(current);
    current = ahead;
  }
  f(current);
}

/// Calls f(item) for every item block `block` of a `grid`-block reduction visits, in order.
template <class F>
TANDEM_HD void for_each_item_of_block(unsigned block, unsigned grid, std::size_t items, F&& f) {
  for (std::size_t item = block; item < items; item += grid) f(item);
}

}  // namespace tandem
