// SPDX-License-Identifier: Apache-2.0
// GradientSharded (ZeRO stage 2): every micro-step, each bucket's gradients are reduce-scattered as soon as they are
// complete and each rank adds its shard into a shard accumulator (fp32; the 16-bit reduce dtype without
// accumulation); no rank holds a full reduced gradient, and a bucket's full gradients live only until it is reduced
// (with owned storage, in a few reused bucket buffers).
// Master weights and optimizer state are sharded as in ZeRO-1.
// Collectives per step: reduce-scatter(grads) every micro-step + all-gather(params).
#pragma once

#include <algorithm>

#include "tandem/policy/optimizer_sharded.hpp"
#include "tandem/policy/policy.hpp"

namespace tandem {

struct GradientSharded : ReduceEveryMicroStep, GatherAfterUpdate, detail::ShardedCollectives {
  static constexpr const char* name = "GradientSharded";
  static constexpr StateSharding state = StateSharding::sharded;

  /// Full parameters; of the gradients only this rank's reduced shard lives across the step. A bucket's full
  /// gradients exist only until it is reduce-scattered: packed into one staging bucket from the user's buffers, or,
  /// with owned storage, written by backward into one of `gradient_buffers` reused bucket buffers.
  static Buffers buffers(const BufferInputs& in) {
    const std::size_t shard = in.plan.total_shard_size(), bucket = in.plan.max_bucket_size();
    Buffers b{.param_flat = in.plan.total_size(),
              .master = in.param_dtype == DType::fp32 ? 0 : shard,
              .state = shard,
              .grad_shard = shard};
    if (in.storage == Storage::user) {
      b.staging = bucket;
    } else {
      b.grad_slots = std::min(in.gradient_buffers, in.plan.num_buckets());  // more could never be held
      b.grad_slot_size = bucket;
    }
    return b;
  }
};

}  // namespace tandem
