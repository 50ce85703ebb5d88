// SPDX-License-Identifier: Apache-2.0
// The phases of a step as a policy acts in them. A policy is composed of one gradient scheme (when gradients cross
// ranks, and where the reduced gradients live) and one parameter scheme (how the ranks come to hold the updated
// parameters, and where a pass finds them); each scheme states its trait and acts in its phase through the hooks
// below, over the operations the front offers (BucketOps). The front calls the hooks and never branches on the traits;
// the traits remain for what must be known before anything runs: the buffer rule, the coherence checks (policy.hpp),
// the memory estimator and the scaling model.
//
//   phase                                   hook                        schemes
//   a bucket's gradients of one micro-step  gradients_complete(ops, b)  ReduceAtBoundary, ReduceEveryMicroStep
//   the optimizer wrote the owned range     after_update(ops, b)        UpdateEverywhere, GatherAfterUpdate,
//   a pass asks for a bucket's parameters   open_parameters(ops, b)       GatherBeforeUse (both hooks)
#pragma once

#include <cstddef>

namespace tandem {

/// Who keeps the fp32 master weights and optimizer state of a bucket.
enum class StateSharding {
  replicated,  ///< every rank keeps (and updates) the whole bucket
  sharded      ///< rank r keeps shard r of every bucket
};

/// When gradients are reduced across ranks.
enum class GradientReduction {
  at_boundary,      ///< micro-steps accumulate locally in a full fp32 buffer; reduce once per optimizer step
  every_micro_step  ///< reduce-scatter every micro-step into a shard accumulator; no full reduced copy
};

/// Who keeps a bucket's parameters between the forward and backward passes that use them.
enum class ParameterSharding {
  replicated,  ///< every rank keeps every parameter; the optimizer step gathers the updated shards (if any) at once
  sharded      ///< rank r keeps shard r; a bucket is all-gathered into a reused buffer while a pass uses it (ZeRO-3)
};

namespace detail {

/// What the phase hooks may ask of the front for bucket b (DataParallel implements it; this archetype checks a policy's
/// hooks against it in the Policy concept).
struct ArchetypeBucketOps {
  /// This micro-step ends the accumulation window (the optimizer runs after it).
  bool window_ends() const;
  /// Adds this micro-step's gradients of b into the full local gradient buffer (with the user's buffers: packs them;
  /// with tandem's storage: backward already added into it).
  void accumulate(std::size_t b);
  /// Reduces b's full local gradients with the policy's reduce_gradients; the owned range then holds the reduced sum.
  void reduce(std::size_t b);
  /// Reduces this micro-step's gradients of b with the policy's reduce_gradients into the shard accumulator (written
  /// there by the collective at a window's first micro-step where the policy honours BucketView::reduced, added
  /// after); the bucket's full gradients are then dropped (their buffer is free for the next bucket).
  void reduce_into_shard(std::size_t b);
  /// Runs the policy's gather_parameters over b's full parameters in place (the update wrote this rank's owned part).
  void gather(std::size_t b);
  /// b's full parameters where this rank keeps them.
  const void* parameters(std::size_t b);
  /// Runs the policy's gather_parameters from this rank's shard of b into a gather buffer, and returns the buffer.
  const void* gather_for_use(std::size_t b);
};

}  // namespace detail

/// Gradients accumulate locally across micro-steps and are reduced once, when the window ends (DDP, ZeRO-1).
struct ReduceAtBoundary {
  static constexpr GradientReduction reduction = GradientReduction::at_boundary;
  template <class Ops>
  static void gradients_complete(Ops& ops, std::size_t b) {
    ops.accumulate(b);
    if (ops.window_ends()) ops.reduce(b);
  }
};

/// Every micro-step's gradients are reduced at once into the rank's shard; no full gradients outlive their bucket's
/// reduction (ZeRO-2, ZeRO-3).
struct ReduceEveryMicroStep {
  static constexpr GradientReduction reduction = GradientReduction::every_micro_step;
  template <class Ops>
  static void gradients_complete(Ops& ops, std::size_t b) {
    ops.reduce_into_shard(b);
  }
};

/// Every rank updates every parameter: nothing to gather (DDP).
struct UpdateEverywhere {
  static constexpr ParameterSharding parameters = ParameterSharding::replicated;
  template <class Ops>
  static void after_update(Ops&, std::size_t) {}
  template <class Ops>
  static const void* open_parameters(Ops& ops, std::size_t b) {
    return ops.parameters(b);
  }
};

/// Each rank updates its shard, and the shards are gathered into every rank's full parameters at once (ZeRO-1/2);
/// a pass finds them where they are, as under UpdateEverywhere.
struct GatherAfterUpdate : UpdateEverywhere {
  template <class Ops>
  static void after_update(Ops& ops, std::size_t b) {
    ops.gather(b);
  }
};

/// Each rank keeps only its shard; a bucket is gathered when a pass asks for it (ZeRO-3).
struct GatherBeforeUse {
  static constexpr ParameterSharding parameters = ParameterSharding::sharded;
  template <class Ops>
  static void after_update(Ops&, std::size_t) {}  // the shard is all this rank keeps; the next use gathers
  template <class Ops>
  static const void* open_parameters(Ops& ops, std::size_t b) {
    return ops.gather_for_use(b);
  }
};

}  // namespace tandem
