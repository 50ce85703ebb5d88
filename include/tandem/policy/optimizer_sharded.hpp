// SPDX-License-Identifier: Apache-2.0
// OptimizerSharded (ZeRO stage 1): full local gradients, reduce-scattered at the accumulation boundary; each
// rank keeps the master weights and optimizer state of its 1/N shard, updates it, and the parameter shards
// are all-gathered in place. Collectives per step: reduce-scatter(grads) + all-gather(params).
#pragma once

#include "tandem/policy/policy.hpp"

namespace tandem {

namespace detail {

/// The collectives the sharded policies run on a bucket: reduce-scatter (in place, or into BucketView::reduced) and
/// in-place all-gather.
struct ShardedCollectives {
  static constexpr bool reduces_into_reduced = true;  ///< (honours_reduced)

  template <Communicator C>
  static void reduce_gradients(C& comm, const BucketView& b) {
    auto* base = static_cast<unsigned char*>(b.grad);
    void* mine = b.reduced != nullptr
                     ? b.reduced
                     : base + static_cast<std::size_t>(b.rank) * b.shard_size * dtype_size(b.grad_dtype);
    comm.reduce_scatter(base, mine, b.shard_size, b.grad_dtype, ReduceOp::sum, b.stream);
  }

  template <Communicator C>
  static void gather_parameters(C& comm, const BucketView& b) {
    auto* base = static_cast<unsigned char*>(b.param);
    const unsigned char* mine = base + static_cast<std::size_t>(b.rank) * b.shard_size * dtype_size(b.param_dtype);
    comm.all_gather(mine, base, b.shard_size, b.param_dtype, b.stream);
  }
};

}  // namespace detail

struct OptimizerSharded : ReduceAtBoundary, GatherAfterUpdate, detail::ShardedCollectives {
  static constexpr const char* name = "OptimizerSharded";
  static constexpr StateSharding state = StateSharding::sharded;

  /// Full parameters and gradients (accumulated locally until the boundary); master weights and optimizer state of
  /// this rank's shard only.
  static Buffers buffers(const BufferInputs& in) {
    const std::size_t full = in.plan.total_size(), shard = in.plan.total_shard_size();
    return {.param_flat = full, .master = in.param_dtype == DType::fp32 ? 0 : shard, .state = shard, .grad_flat = full};
  }
};

}  // namespace tandem
