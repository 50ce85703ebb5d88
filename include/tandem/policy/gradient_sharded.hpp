// SPDX-License-Identifier: Apache-2.0
// GradientSharded (ZeRO stage 2): every micro-step's gradients are packed into a bucket-sized staging
// buffer and reduce-scattered, and each rank adds its shard into an fp32 shard accumulator; no rank ever
// holds a full reduced gradient. Master weights and optimizer state are sharded as in ZeRO-1.
// Collectives per step: reduce-scatter(grads) every micro-step + all-gather(params).
#pragma once

#include "tandem/policy/optimizer_sharded.hpp"
#include "tandem/policy/policy.hpp"

namespace tandem {

struct GradientSharded : detail::ShardedCollectives {
  static constexpr const char* name = "GradientSharded";
  static constexpr StateSharding state = StateSharding::sharded;
  static constexpr GradientReduction reduction = GradientReduction::every_micro_step;
};

}  // namespace tandem
