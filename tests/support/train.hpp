// SPDX-License-Identifier: Apache-2.0
// One rank's data-parallel training of the MLP example over any communicator: the body the multi-process tests
// (tests/mpi/) and the unequal-batches tests share, so that a run over Mpi and a run over LocalGroup execute the
// same code and can be compared bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "../../examples/mlp/mlp.hpp"
#include "backend.hpp"
#include "params.hpp"
#include "tandem/front/data_parallel.hpp"

namespace test {

/// What one training run is: the model, the data, the schedule.
struct TrainSetup {
  std::vector<int> dims = {13, 37, 29, 23, 19, 7};  // 11 tensors, odd sizes
  int global_batch = 24;                            // samples per micro-step over all ranks; divisible by 1-4
  int steps = 12;                                   // optimizer steps
  int accumulation = 1;                             // micro-steps per optimizer step
  std::size_t bucket_cap_bytes = 2048;              // small: many buckets, tensors straddling shards
  std::uint64_t seed = 42;                          // rank r initialises with seed + 1000 r; broadcast fixes it
};

/// The synthetic task, large enough for `setup`.
inline mlp::Dataset make_dataset(const TrainSetup& setup) {
  return mlp::Dataset(setup.global_batch * setup.accumulation * setup.steps, setup.dims.front(), setup.dims.back(), 7);
}

/// Called before each micro-step with (optimizer step, micro-step): a test injects failures here.
using StepHook = std::function<void(int, int)>;

/// Trains this rank's model under DataParallel<Policy, Optimizer> over `comm` and returns its final parameters.
/// Rank r takes samples [r * b, (r + 1) * b) of each micro-step's global batch, b = global_batch / comm.size().
template <class Policy, class Optimizer, class T, class Comm>
Params train_rank(Comm& comm, const TrainSetup& setup, const mlp::Dataset& data,
                  const typename Optimizer::Options& options, const StepHook& hook = {}) {
  mlp::Mlp<T> model(setup.dims, setup.seed + static_cast<std::uint64_t>(comm.rank()) * 1000);
  const tandem::DataParallelOptions dpo{.bucket_cap_bytes = setup.bucket_cap_bytes,
                                        .first_bucket_cap_bytes = setup.bucket_cap_bytes / 2,
                                        .accumulation_steps = setup.accumulation};
  test::DataParallel<Policy, Optimizer, Comm> dp(comm, model.tensors(), options, dpo);
  dp.broadcast_parameters(0);
  const int local = setup.global_batch / comm.size();
  for (int step = 0; step < setup.steps; ++step) {
    for (int micro = 0; micro < setup.accumulation; ++micro) {
      if (hook) hook(step, micro);
      const int begin = (step * setup.accumulation + micro) * setup.global_batch + comm.rank() * local;
      model.forward_backward(data, begin, local);
      dp.step();
    }
  }
  return as_float(model.params());
}

}  // namespace test
