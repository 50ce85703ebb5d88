// SPDX-License-Identifier: Apache-2.0
// ParameterSharded (ZeRO stage 3, PyTorch FSDP's FULL_SHARD): each rank keeps only its 1/N shard of every bucket's
// parameters, with the shard's master weights and optimizer state. A bucket's full parameters are held only in a few
// reused bucket buffers (DataParallelOptions::parameter_buffers), allocated at construction:
// DataParallel::parameters(b) all-gathers them into one (prefetch_parameters(b) starts the gather early), and the
// handle's release makes the buffer free for another bucket; until then it keeps its bucket, which a later open finds
// without gathering again (until the next optimizer step makes it stale). Gradients are reduce-scattered every
// micro-step into a shard accumulator as under GradientSharded, and the optimizer updates the shard in place: nothing
// is gathered at the step's end. Collectives per step: all-gather(params) at each use + reduce-scatter(grads) every
// micro-step. Owned storage only.
#pragma once

#include <algorithm>

#include "tandem/core/error.hpp"
#include "tandem/policy/gradient_sharded.hpp"
#include "tandem/policy/optimizer_sharded.hpp"
#include "tandem/policy/policy.hpp"

namespace tandem {

struct ParameterSharded : ReduceEveryMicroStep, GatherBeforeUse, detail::ShardedCollectives {
  static constexpr const char* name = "ParameterSharded";
  static constexpr StateSharding state = StateSharding::sharded;

  // reduce_gradients: ShardedCollectives' reduce-scatter.

  /// Called when a pass asks for the bucket (GatherBeforeUse), not at the step's end: every rank's shard into the
  /// gather buffer.
  template <Communicator C>
  static void gather_parameters(C& comm, const BucketView& b) {
    comm.all_gather(b.param_shard, b.param, b.shard_size, b.param_dtype, b.stream);
  }

  /// ZeRO-2's buffers (GradientSharded, owned storage) with the parameters sharded too: of every buffer only this
  /// rank's shard lives across the step; transient are `gradient_buffers` gradient buffers and `parameter_buffers`
  /// gather buffers of one bucket each.
  static Buffers buffers(const BufferInputs& in) {
    if (in.storage != Storage::owned)
      detail::fail(
          "tandem: ParameterSharded keeps only a shard of the parameters, so it needs owned storage (construct "
          "DataParallel from TensorSpecs); with the user's buffers every rank would hold every parameter anyway");
    Buffers b = GradientSharded::buffers(in);
    b.param_flat = 0;
    b.param_shard = in.plan.total_shard_size();
    b.param_slots = std::min(in.parameter_buffers, in.plan.num_buckets());  // more could never be used
    b.param_slot_size = in.plan.max_bucket_size();
    return b;
  }
};

}  // namespace tandem
