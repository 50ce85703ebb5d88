// SPDX-License-Identifier: Apache-2.0
// Non-finite gradients: detected from the global sum of squares, so every rank reaches the same verdict even
// when only one rank's gradients hold the NaN; skipped (counted, nothing changed) or thrown on every rank.
#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "../examples/mlp/mlp.hpp"
#include "support/backend.hpp"
#include "support/temp_path.hpp"
#include "support/train.hpp"
#include "tandem/tandem.hpp"

namespace {

const std::vector<int> dims = {13, 37, 29, 7};
const mlp::Dataset& dataset() {
  static const mlp::Dataset data(24 * 10, dims.front(), dims.back(), 3);
  return data;
}

constexpr int poisoned_step = 3;

enum class Poison { none, nan_on_rank_1, inf_on_rank_0 };

struct Outcome {
  std::vector<std::vector<float>> params;
  std::uint64_t steps = 0, skipped = 0;
  std::vector<std::string> errors;
};

// Trains 6 steps on `world` ranks; at poisoned_step one rank's gradient is poisoned (or, with Poison::none and
// `leave_out`, that step is left out altogether). Under StepReport::deferred, last_step() reports at the end, or with
// `save_to` a save_checkpoint there does.
template <class P>
Outcome train(int world, tandem::NonFinite policy, Poison poison, bool leave_out = false,
              tandem::StepReport report = tandem::StepReport::at_step, const std::string& save_to = {}) {
  Outcome out;
  out.errors.resize(static_cast<std::size_t>(world));
  std::mutex m;
  tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 2);
    test::DataParallel<P, tandem::AdamW> dp(comm, model.tensors(), {.lr = 1e-2f},
                                            {.bucket_cap_bytes = 1024, .non_finite = policy, .step_report = report});
    const int local = 24 / world;
    try {
      for (int step = 0; step < 6; ++step) {
        if (leave_out && step == poisoned_step) continue;
        model.forward_backward(dataset(), step * 24 + comm.rank() * local, local);
        if (step == poisoned_step) {
          if (poison == Poison::nan_on_rank_1 && comm.rank() == 1) model.grads()[2][5] = std::nanf("");
          if (poison == Poison::inf_on_rank_0 && comm.rank() == 0)
            model.grads()[0][0] = std::numeric_limits<float>::infinity();
        }
        const tandem::StepResult r = dp.step();
        if (report == tandem::StepReport::deferred)
          CHECK((r.pending && !r.updated && !r.skipped));
        else
          CHECK(r.skipped ==
                (policy == tandem::NonFinite::skip_step && poison != Poison::none && step == poisoned_step));
      }
      if (report == tandem::StepReport::deferred && !save_to.empty()) dp.save_checkpoint(save_to);
      if (report == tandem::StepReport::deferred) {
        const tandem::StepResult last = dp.last_step();
        CHECK(last.updated);
        CHECK(last.step == 5);
      }
    } catch (const tandem::error& e) {
      out.errors[static_cast<std::size_t>(comm.rank())] = e.what();
    }
    if (comm.rank() == 0) {
      std::lock_guard lock(m);
      out.params = model.params();
      out.steps = dp.step_count();
      out.skipped = dp.skipped_steps();
    }
  });
  return out;
}

}  // namespace

TEST_CASE_TEMPLATE("skip_step drops the poisoned step on every rank, exactly as if it never happened", P,
                   tandem::Replicated, tandem::OptimizerSharded, tandem::GradientSharded) {
  for (Poison poison : {Poison::nan_on_rank_1, Poison::inf_on_rank_0}) {
    const Outcome skipped = train<P>(3, tandem::NonFinite::skip_step, poison);
    const Outcome left_out = train<P>(3, tandem::NonFinite::skip_step, Poison::none, true);
    CHECK(skipped.params == left_out.params);
    CHECK(skipped.steps == 5);
    CHECK(skipped.skipped == 1);
    CHECK(left_out.skipped == 0);
  }
}

// After throw_error the next window trains as if the poisoned one had been skipped: every policy, both storage modes,
// with accumulation (the window's micro-steps, its gradients in tandem's buffers or accumulated in the user's bucket,
// are all dropped). Before, copy mode kept the window's last micro-step and its NaN, and owned storage kept the NaN in
// its gradient buffer, so every later step threw again.
TEST_CASE_TEMPLATE("after throw_error the next window trains as if the poisoned one had been skipped", P,
                   tandem::Replicated, tandem::OptimizerSharded, tandem::GradientSharded, tandem::ParameterSharded) {
  for (bool owned : {false, true}) {
    if (!owned && tandem::parameter_sharding_of<P> == tandem::ParameterSharding::sharded) continue;
    for (int accumulation : {1, 2}) {
      CAPTURE(owned);
      CAPTURE(accumulation);
      test::TrainSetup setup{
          .steps = 5, .accumulation = accumulation, .owned = owned, .poison_step = 2, .poison_rank = 1};
      const mlp::Dataset data = test::make_dataset(setup);
      auto run = [&](tandem::NonFinite policy) {
        setup.non_finite = policy;
        test::Params out;
        std::mutex m;
        tandem::LocalGroup(3).run([&](tandem::LocalComm& comm) {
          const test::Params p = test::train_rank<P, tandem::AdamW, float>(comm, setup, data, {.lr = 1e-2f});
          std::lock_guard lock(m);
          if (comm.rank() == 0) out = p;
        });
        return out;
      };
      std::atomic<int> errors{0};
      setup.non_finite_errors = &errors;
      const test::Params thrown = run(tandem::NonFinite::throw_error);
      CHECK(errors == 3);  // the poisoned window threw on each of the 3 ranks, once
      const test::Params skipped = run(tandem::NonFinite::skip_step);
      CHECK(errors == 3);  // skip_step threw nothing
      CHECK(thrown == skipped);
      for (const auto& t : thrown)
        for (float x : t) REQUIRE(tandem::finite(x));
    }
  }
}

TEST_CASE("throw_error throws on every rank; ignore lets the NaN through") {
  const Outcome thrown = train<tandem::GradientSharded>(3, tandem::NonFinite::throw_error, Poison::nan_on_rank_1);
  for (const std::string& e : thrown.errors)
    CHECK(e.find("non-finite gradients at optimizer step 4") != std::string::npos);
  CHECK(thrown.steps == 3);
  const Outcome ignored = train<tandem::Replicated>(2, tandem::NonFinite::ignore, Poison::nan_on_rank_1);
  CHECK(std::isnan(ignored.params[2][5]));
}

// StepReport::deferred: step() reads nothing back, and the device's verdict alone skips the poisoned step's updates.
// The parameters are those of a run that left the step out, under skip_step and under throw_error alike; skip_step
// counts it, and throw_error's error reaches every rank at the next report (here last_step()), not at the step.
TEST_CASE_TEMPLATE("deferred reports: the device skips the poisoned step, and throw_error throws at the next report", P,
                   tandem::Replicated, tandem::OptimizerSharded, tandem::GradientSharded) {
  const Outcome left_out = train<P>(3, tandem::NonFinite::skip_step, Poison::none, true);
  const Outcome skipped =
      train<P>(3, tandem::NonFinite::skip_step, Poison::nan_on_rank_1, false, tandem::StepReport::deferred);
  CHECK(skipped.params == left_out.params);
  CHECK(skipped.steps == 5);
  CHECK(skipped.skipped == 1);
  for (const std::string& e : skipped.errors) CHECK(e.empty());
  const Outcome thrown =
      train<P>(3, tandem::NonFinite::throw_error, Poison::inf_on_rank_0, false, tandem::StepReport::deferred);
  CHECK(thrown.params == left_out.params);
  CHECK(thrown.steps == 5);
  CHECK(thrown.skipped == 0);
  for (const std::string& e : thrown.errors)
    CHECK(e.find("last_step(): non-finite gradients at 1 optimizer step(s) since the last report") !=
          std::string::npos);
  // A save is a report too, on every rank: it throws on each, and saves nothing.
  const std::string dir = test::temp_path("deferred_save");
  const Outcome unsaved =
      train<P>(3, tandem::NonFinite::throw_error, Poison::inf_on_rank_0, false, tandem::StepReport::deferred, dir);
  CHECK(unsaved.params == left_out.params);
  for (const std::string& e : unsaved.errors)
    CHECK(e.find("save_checkpoint: non-finite gradients at 1 optimizer step(s) since the last report") !=
          std::string::npos);
  CHECK(!std::filesystem::exists(dir + "/manifest.json"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("skipped_steps() travels with a checkpoint: a resumed run counts on from it, a rollback returns to it") {
  const std::string dir = test::temp_path("skipped_steps");
  const tandem::DataParallelOptions skip{.bucket_cap_bytes = 1024, .non_finite = tandem::NonFinite::skip_step};
  // Step `step`'s micro-step on `comm`'s rank, its gradients poisoned on the last rank where `poisoned`.
  auto step = [](auto& dp, mlp::Mlp<float>& model, const tandem::LocalComm& comm, int step, bool poisoned) {
    const int local = 24 / comm.size();
    model.forward_backward(dataset(), step * 24 + comm.rank() * local, local);
    if (poisoned && comm.rank() == comm.size() - 1) model.grads()[1][0] = std::nanf("");
    return dp.step();
  };
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 2);
    test::DataParallel<tandem::OptimizerSharded, tandem::AdamW> dp(comm, model.tensors(), {.lr = 1e-2f}, skip);
    for (int s = 0; s < 6; ++s) step(dp, model, comm, s, s == 1 || s == 3);
    CHECK(dp.step_count() == 4);
    CHECK(dp.skipped_steps() == 2);
    dp.save_checkpoint(dir);
    CHECK(step(dp, model, comm, 6, true).skipped);
    CHECK(dp.skipped_steps() == 3);
    dp.load_checkpoint(dir);  // a rollback: the checkpoint's count again
    CHECK(dp.step_count() == 4);
    CHECK(dp.skipped_steps() == 2);
    CHECK(step(dp, model, comm, 6, true).skipped);
    CHECK(dp.skipped_steps() == 3);
  });
  CHECK(tandem::verify_checkpoint(dir).manifest.skipped_steps == 2);
  // Resumed in another run, at another world size and under another policy: counted on from the checkpoint's.
  tandem::LocalGroup(3).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 9);
    test::DataParallel<tandem::GradientSharded, tandem::AdamW> dp(comm, model.tensors(), {.lr = 1e-2f}, skip);
    dp.load_checkpoint(dir);
    CHECK(dp.skipped_steps() == 2);
    CHECK(step(dp, model, comm, 6, true).skipped);
    CHECK(dp.skipped_steps() == 3);
    CHECK(step(dp, model, comm, 7, false).updated);
    CHECK(dp.step_count() == 5);
    CHECK(dp.skipped_steps() == 3);
  });
  // Under throw_error the count is kept, and only a step whose gradients are not finite throws, named as the one.
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 9);
    test::DataParallel<tandem::Replicated, tandem::AdamW> dp(comm, model.tensors(), {.lr = 1e-2f},
                                                             {.non_finite = tandem::NonFinite::throw_error});
    dp.load_checkpoint(dir);
    CHECK(dp.skipped_steps() == 2);
    CHECK(step(dp, model, comm, 6, false).updated);
    CHECK_THROWS_WITH_AS(step(dp, model, comm, 7, true), doctest::Contains("non-finite gradients at optimizer step 6"),
                         tandem::error);
    CHECK(dp.step_count() == 5);
    CHECK(dp.skipped_steps() == 2);
  });
  // A manifest of a save before the count was recorded has none: 0.
  const std::string manifest = dir + "/manifest.json";
  std::string text = tandem::detail::read_text_file(manifest, "the manifest");
  const std::string member = "\"skipped_steps\": 2, ";
  REQUIRE(text.find(member) != std::string::npos);
  text.erase(text.find(member), member.size());
  std::FILE* f = std::fopen(manifest.c_str(), "wb");
  REQUIRE(f != nullptr);
  CHECK(std::fwrite(text.data(), 1, text.size(), f) == text.size());
  std::fclose(f);
  tandem::LocalGroup(1).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 9);
    test::DataParallel<tandem::Replicated, tandem::AdamW> dp(comm, model.tensors(), {.lr = 1e-2f}, skip);
    CHECK(step(dp, model, comm, 0, true).skipped);
    dp.load_checkpoint(dir);
    CHECK(dp.step_count() == 4);
    CHECK(dp.skipped_steps() == 0);
  });
  std::filesystem::remove_all(dir);
}
