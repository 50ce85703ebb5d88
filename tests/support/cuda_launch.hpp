// SPDX-License-Identifier: Apache-2.0
// A CUDA launch emulated exactly on the host: the grid CudaBackend::launch computes (launch_shape), each block's warps
// visiting their items grid-stride (for_each_item_of_warp), each item run by all item_lanes lanes of its warp, lane by
// lane. Host tests run the real bodies this way to check what the device runs: its lane split, vector groups and
// coverage.
#pragma once

#include <cstddef>

#include "tandem/backend/launch.hpp"

namespace test {

/// Runs body over `items` as a CUDA launch of at most `max_blocks` blocks does; returns the blocks it used.
template <class Body>
unsigned emulate_cuda_launch(std::size_t items, const Body& body, unsigned max_blocks = tandem::max_grid_blocks) {
  const tandem::LaunchShape shape = tandem::launch_shape(items, max_blocks);
  for (unsigned b = 0; b < shape.grid; ++b)
    for (unsigned w = 0; w < shape.block / tandem::item_lanes; ++w)
      tandem::for_each_item_of_warp(b, w, shape.grid, items, [&](std::size_t item) {
        for (unsigned lane = 0; lane < tandem::item_lanes; ++lane) body(item, lane, tandem::item_lanes);
      });
  return shape.grid;
}

}  // namespace test
