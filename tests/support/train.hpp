// SPDX-License-Identifier: Apache-2.0
// One rank's data-parallel training of the MLP example over any communicator: the body the multi-process tests
// (tests/mpi/) and the unequal-batches tests share, so that a run over Mpi and a run over LocalGroup execute the
// same code and can be compared bit for bit. Under a policy that shards the parameters (or when the setup asks) it
// trains on owned storage:
// each micro-step's forward reads every bucket's parameters into the model through parameters(b) (last bucket first,
// the next one prefetched), and backward writes each bucket's gradients through gradients(b).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <string_view>
#include <vector>

#include "../../examples/mlp/mlp.hpp"
#include "backend.hpp"
#include "params.hpp"
#include "tandem/front/data_parallel.hpp"

namespace test {

/// What one training run is: the model, the data, the schedule.
struct TrainSetup {
  std::vector<int> dims = {13, 37, 29, 23, 19, 7};   // 11 tensors, odd sizes
  int global_batch = 24;                             // samples per micro-step over all ranks; divisible by 1-4
  int steps = 12;                                    // optimizer steps
  int accumulation = 1;                              // micro-steps per optimizer step
  std::size_t bucket_cap_bytes = 2048;               // small: many buckets, tensors straddling shards
  std::uint64_t seed = 42;                           // rank r initialises with seed + 1000 r; broadcast fixes it
  tandem::DType reduce_dtype = tandem::DType::fp32;  // DataParallelOptions::reduce_dtype
  float max_grad_norm = 0.0f;                        // DataParallelOptions::max_grad_norm
  bool owned = false;                                // owned storage under every policy (always when it shards params)
  tandem::NonFinite non_finite = tandem::NonFinite::ignore;  // DataParallelOptions::non_finite; throw_error's errors
                                                             // are caught (and counted) and training goes on
  std::atomic<int>* non_finite_errors = nullptr;             // where set: +1 for each such error a rank catches
  int poison_step = -1;  // at this optimizer step's last micro-step, rank poison_rank's first gradient is a NaN
  int poison_rank = 0;
};

/// The synthetic task, large enough for `setup`.
inline mlp::Dataset make_dataset(const TrainSetup& setup) {
  return mlp::Dataset(setup.global_batch * setup.accumulation * setup.steps, setup.dims.front(), setup.dims.back(), 7);
}

/// Called before each micro-step with (optimizer step, micro-step): a test injects failures here.
using StepHook = std::function<void(int, int)>;

/// Trains this rank's model under DataParallel<Policy, Optimizer> over `comm` (on `B`, the suite's backend unless
/// given) and returns its final parameters. Rank r takes samples [r * b, (r + 1) * b) of each micro-step's global
/// batch, b = global_batch / comm.size().
template <class Policy, class Optimizer, class T, class B = Backend, class Comm>
Params train_rank(Comm& comm, const TrainSetup& setup, const mlp::Dataset& data,
                  const typename Optimizer::Options& options, const StepHook& hook = {}) {
  constexpr bool sharded = tandem::parameter_sharding_of<Policy> == tandem::ParameterSharding::sharded;
  const bool owned = sharded || setup.owned;
  mlp::Mlp<T> model(setup.dims, setup.seed + static_cast<std::uint64_t>(comm.rank()) * 1000);
  const tandem::DataParallelOptions dpo{.bucket_cap_bytes = setup.bucket_cap_bytes,
                                        .first_bucket_cap_bytes = setup.bucket_cap_bytes / 2,
                                        .accumulation_steps = setup.accumulation,
                                        .max_grad_norm = setup.max_grad_norm,
                                        .non_finite = setup.non_finite,
                                        .reduce_dtype = setup.reduce_dtype};
  auto make = [&] {
    if constexpr (!sharded)
      if (!owned) return tandem::DataParallel<Policy, Optimizer, B, Comm>(comm, model.tensors(), options, dpo);
    std::vector<tandem::TensorSpec> specs;
    for (const tandem::TensorRef& t : model.tensors()) specs.push_back({t.name, t.numel, t.dtype});
    return tandem::DataParallel<Policy, Optimizer, B, Comm>(comm, std::move(specs), options, dpo);
  };
  auto dp = make();
  if (owned)
    dp.template initialize_parameters<T>(
        [&](std::size_t i, T* values) { std::copy(model.params()[i].begin(), model.params()[i].end(), values); });
  else if constexpr (!sharded)
    dp.broadcast_parameters(0);
  const std::size_t buckets = dp.num_buckets();
  const int local = setup.global_batch / comm.size();
  for (int step = 0; step < setup.steps; ++step) {
    for (int micro = 0; micro < setup.accumulation; ++micro) {
      if (hook) hook(step, micro);
      const int begin = (step * setup.accumulation + micro) * setup.global_batch + comm.rank() * local;
      if (owned)
        for (std::size_t b = buckets; b-- > 0;) {
          auto params = dp.parameters(b);
          if (b > 0) dp.prefetch_parameters(b - 1);
          for (std::size_t i : params.tensors())
            std::copy_n(params.template param<T>(i), model.params()[i].size(), model.params()[i].begin());
        }
      model.forward_backward(data, begin, local);
      if (step == setup.poison_step && micro == setup.accumulation - 1 && comm.rank() == setup.poison_rank)
        model.grads()[0][0] = tandem::convert<T>(std::numeric_limits<float>::quiet_NaN());
      if (owned)
        for (std::size_t b = 0; b < buckets; ++b) {
          auto grads = dp.gradients(b);
          for (std::size_t i : grads.tensors())
            for (std::size_t e = 0; e < model.grads()[i].size(); ++e)
              grads.grad(i)[e] += static_cast<float>(model.grads()[i][e]);
        }
      try {
        dp.step();
      } catch (const tandem::error& e) {  // throw_error's own error: the window was dropped; go on. Any other: fail
        if (setup.non_finite != tandem::NonFinite::throw_error ||
            std::string_view(e.what()).find("non-finite gradients") == std::string_view::npos)
          throw;
        if (setup.non_finite_errors != nullptr) ++*setup.non_finite_errors;
      }
    }
  }
  if (owned)
    for (std::size_t b = 0; b < buckets; ++b) {  // the final parameters (collective)
      auto params = dp.parameters(b);
      for (std::size_t i : params.tensors())
        std::copy_n(params.template param<T>(i), model.params()[i].size(), model.params()[i].begin());
    }
  return as_float(model.params());
}

}  // namespace test
