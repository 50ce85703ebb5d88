// SPDX-License-Identifier: Apache-2.0
// What a policy decides, and the concept a policy type satisfies. A policy is an empty tag type whose
// static members say which buffers exist (through two traits) and which collective runs in each phase
// (two hooks over one bucket). The front (front/data_parallel.hpp) calls nothing else, so adding a policy
// is adding one short file.
#pragma once

#include <concepts>
#include <cstddef>

#include "tandem/comm/communicator.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/core/stream.hpp"

namespace tandem {

/// Who keeps the fp32 master weights and optimizer state of a bucket.
enum class StateSharding {
  replicated,  ///< every rank keeps (and updates) the whole bucket
  sharded      ///< rank r keeps shard r of every bucket
};

/// When gradients are reduced across ranks.
enum class GradientReduction {
  at_boundary,      ///< micro-steps accumulate locally in a full fp32 buffer; reduce once per optimizer step
  every_micro_step  ///< reduce-scatter every micro-step into an fp32 shard accumulator; no full reduced copy
};

/// One bucket as a policy's hooks see it.
struct BucketView {
  float* grad = nullptr;  ///< the bucket's fp32 gradients (size elements)
  void* param = nullptr;  ///< the bucket's parameters in the parameter dtype (size elements)
  DType param_dtype = DType::fp32;
  std::size_t size = 0;        ///< elements, a multiple of the world size
  std::size_t shard_size = 0;  ///< size / world size
  int rank = 0;
  Stream stream = {};
};

template <class P>
concept Policy = requires {
  { P::name } -> std::convertible_to<const char*>;
  { P::state } -> std::convertible_to<StateSharding>;
  { P::reduction } -> std::convertible_to<GradientReduction>;
};

}  // namespace tandem
