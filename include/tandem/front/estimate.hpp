// SPDX-License-Identifier: Apache-2.0
// The memory estimator: the MemoryReport that DataParallel<P, Opt> would report on one rank, computed from the
// tensor list alone. It cuts the same plan (detail::plan_for) and applies the policy's buffer rule (P::buffers) and
// the one categorisation (memory_of), allocating nothing, so it answers "does this fit?" for any world size before
// any rank exists. tests/test_memory_report.cpp holds it equal to memory_report() of real constructions.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "tandem/core/error.hpp"
#include "tandem/core/tensor.hpp"
#include "tandem/front/options.hpp"
#include "tandem/kernels/optimizer.hpp"
#include "tandem/policy/policy.hpp"

namespace tandem {

/// What DataParallel<P, Opt>'s memory_report() would return on each rank of a group of `world_size` for these
/// tensors, with `storage` (Storage::user: built from TensorRefs; Storage::owned: from TensorSpecs). Throws
/// tandem::error for arguments the construction would reject.
template <Policy P, Optimizer Opt>
TANDEM_COLD MemoryReport estimate_memory(std::vector<TensorSpec> tensors, int world_size, Storage storage,
                                         const typename Opt::Options& optimizer = {},
                                         const DataParallelOptions& options = {}) {
  if (world_size < 1)
    detail::fail("tandem: estimate_memory: world_size is " + std::to_string(world_size) + "; it must be >= 1");
  detail::validate(options);
  Opt::validate(optimizer);
  const Layout layout(std::move(tensors));
  detail::validate_one_dtype(layout);
  const Plan plan = detail::plan_for(layout, options, world_size);
  const BufferInputs in = detail::buffer_inputs(plan, layout[0].dtype, storage, options);
  return memory_of(P::buffers(in), in, layout.total_numel(), Opt::state_count(optimizer));
}

}  // namespace tandem
