// SPDX-License-Identifier: Apache-2.0
// Replicated (PyTorch DDP): full gradients accumulated locally and all-reduced when the window ends, full optimizer
// state on every rank, every rank updates every parameter. Collectives per step: all-reduce(grads).
#pragma once

#include "tandem/policy/policy.hpp"

namespace tandem {

struct Replicated : ReduceAtBoundary, UpdateEverywhere {
  static constexpr const char* name = "Replicated";
  static constexpr StateSharding state = StateSharding::replicated;

  template <Communicator C>
  static void reduce_gradients(C& comm, const BucketView& b) {
    comm.all_reduce(b.grad, b.grad, b.size, b.grad_dtype, ReduceOp::sum, b.stream);
  }

  template <Communicator C>
  static void gather_parameters(C&, const BucketView&) {}  // never called (UpdateEverywhere): every rank updated all

  /// Every buffer full size: the parameters, their gradients (accumulated across micro-steps), and for the whole
  /// flat space the master weights (16-bit parameters) and optimizer state.
  static Buffers buffers(const BufferInputs& in) {
    const std::size_t full = in.plan.total_size();
    return {.param_flat = full, .master = in.param_dtype == DType::fp32 ? 0 : full, .state = full, .grad_flat = full};
  }
};

}  // namespace tandem
