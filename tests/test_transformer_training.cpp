// SPDX-License-Identifier: Apache-2.0
// End to end: the tiny transformer example learns its default task (sorting lists of 8 distinct numbers
// below 64; accuracy counts whole held-out lists, every number right) to >= 95%, and training it on 2 and 4
// ranks under every policy gives the same held-out accuracy (within 0.5 percentage points) and the same
// final loss (within 1e-3 relative) as 1 rank, because every rank count sees the same global batches, while the
// model states each rank holds fall from policy to policy as the ZeRO paper says.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "support/sort_task.hpp"

using test::sort_config;
using test::sort_task;

TEST_CASE("the default task trains to >= 95% held-out accuracy, the same on 1, 2 and 4 ranks under every policy") {
  const tiny::Task task = sort_task(32 * 600);
  const tiny::TrainConfig cfg = sort_config(600);
  const tiny::TrainResult one = tiny::train_local<tandem::Replicated>(1, cfg, task);
  MESSAGE("1 rank: accuracy " << 100 * one.eval_accuracy << "%, final loss " << one.final_loss << ", " << one.seconds
                              << " s");
  CHECK(one.eval_accuracy >= 0.95);

  for (int ranks : {2, 4}) {
    std::size_t previous_states = one.memory.model_states() + 1;
    for (tiny::PolicyKind p : {tiny::PolicyKind::replicated, tiny::PolicyKind::optimizer_sharded,
                               tiny::PolicyKind::gradient_sharded, tiny::PolicyKind::parameter_sharded}) {
      const tiny::TrainResult r =
          tiny::with_policy(p, [&]<class Policy>() { return tiny::train_local<Policy>(ranks, cfg, task); });
      const double loss_error = std::abs(r.final_loss - one.final_loss) / one.final_loss;
      MESSAGE(std::string(tiny::policy_name(p))
              << " x" << ranks << ": accuracy " << 100 * r.eval_accuracy << "%, final loss " << r.final_loss << " ("
              << loss_error << " relative), " << r.seconds << " s");
      INFO(std::string(tiny::policy_name(p)) << " on " << ranks << " ranks");
      CHECK(std::abs(r.eval_accuracy - one.eval_accuracy) <= 0.005);
      CHECK(loss_error <= 1e-3);
      CHECK(r.params.size() == one.params.size());
      CHECK(r.memory.model_states() < previous_states);
      previous_states = r.memory.model_states();
    }
  }
}

TEST_CASE("bf16 parameters (fp32 master weights in tandem): 2 ranks track 1 rank") {
  const tiny::Task task = sort_task(32 * 150);
  tiny::TrainConfig cfg = sort_config(150);
  cfg.precision = tiny::Precision::bf16;
  cfg.accumulation = 2;
  const tiny::TrainResult one = tiny::train_local<tandem::Replicated>(1, cfg, task);
  // Over the model's buffers (bf16 copies of them, in copy mode), and on tandem's storage (BucketPasses).
  const tiny::TrainResult two = tiny::train_local<tandem::OptimizerSharded>(2, cfg, task);
  const tiny::TrainResult sharded = tiny::train_local<tandem::ParameterSharded>(2, cfg, task);
  MESSAGE("bf16 final loss: 1 rank " << one.final_loss << ", 2 ranks " << two.final_loss << ", ParameterSharded "
                                     << sharded.final_loss);
  CHECK(one.final_loss < 2.0);  // it learns (the uniform guess is ln 64 = 4.16)
  CHECK(std::abs(two.final_loss - one.final_loss) <= 0.02 * one.final_loss);
  CHECK(std::abs(sharded.final_loss - one.final_loss) <= 0.02 * one.final_loss);
  for (const tiny::TrainResult* r : {&one, &sharded}) {
    std::size_t not_bf16 = 0;  // the model computes with the bf16 parameters tandem holds
    for (float p : r->params) not_bf16 += float(tandem::BFloat16(p)) != p;
    CHECK(not_bf16 == 0);
  }
}
