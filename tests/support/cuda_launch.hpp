// SPDX-License-Identifier: Apache-2.0
// A CUDA launch emulated exactly on the host: the grid CudaBackend::launch computes (launch_shape), each block's item
// slots visiting their items grid-stride (for_each_item_of_slot), each item run by all lanes_of<Body>() lanes of its
// slot (a warp, unless the body says), lane by lane. Host tests run the real bodies this way to check what the device
// runs: its lane split, vector groups and coverage.
#pragma once

#include <cstddef>

#include "tandem/backend/launch.hpp"

namespace test {

/// Runs body over `items` as a CUDA launch of at most `max_blocks` blocks does; returns the blocks it used.
template <class Body>
unsigned emulate_cuda_launch(std::size_t items, const Body& body, unsigned max_blocks = tandem::max_grid_blocks) {
  constexpr unsigned lanes = tandem::lanes_of<Body>();
  const tandem::LaunchShape shape = tandem::launch_shape(items, max_blocks, lanes);
  for (unsigned b = 0; b < shape.grid; ++b)
    for (unsigned slot = 0; slot < shape.block / lanes; ++slot)
      tandem::for_each_item_of_slot(b, slot, shape.grid, items, lanes, [&](std::size_t item) {
        for (unsigned lane = 0; lane < lanes; ++lane) body(item, lane, lanes);
      });
  return shape.grid;
}

}  // namespace test
