// SPDX-License-Identifier: Apache-2.0
// Ranks with unequal numbers of batches (LocalGroup; tests/mpi/ checks the same over Mpi): with
// DataParallel::all_ranks_have_batch every rank stops at the shortest rank's count, bit-identically to a run that
// had only that many batches; without it, a rank that stops early makes the others fail at once instead of hanging;
// and ranks that disagree on the micro-steps taken so far are told so.
#include <doctest/doctest.h>

#include <chrono>
#include <mutex>
#include <string>
#include <vector>

#include "support/backend.hpp"
#include "support/params.hpp"
#include "support/train.hpp"
#include "tandem/tandem.hpp"

namespace {

const tandem::AdamWOptions adamw{.lr = 3e-3f, .weight_decay = 0.05f};

}  // namespace

TEST_CASE("all_ranks_have_batch: ranks with 5, 3 and 4 batches all stop after 3 steps") {
  test::TrainSetup setup;
  setup.steps = 3;
  const mlp::Dataset data = test::make_dataset(test::TrainSetup{});
  const int world = 3;
  // Reference: every rank has exactly 3 batches.
  std::vector<test::Params> ref(world), got(world);
  std::vector<std::uint64_t> steps(world);
  tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
    ref[static_cast<std::size_t>(comm.rank())] =
        test::train_rank<tandem::OptimizerSharded, tandem::AdamW, float>(comm, setup, data, adamw);
  });
  tandem::LocalGroup(world, {.timeout = std::chrono::seconds(60)}).run([&](tandem::LocalComm& comm) {
    const int r = comm.rank();
    const int batches = r == 0 ? 5 : r == 1 ? 3 : 4;
    mlp::Mlp<float> model(setup.dims, setup.seed + static_cast<std::uint64_t>(r) * 1000);
    test::DataParallel<tandem::OptimizerSharded, tandem::AdamW> dp(
        comm, model.tensors(), adamw,
        {.bucket_cap_bytes = setup.bucket_cap_bytes, .first_bucket_cap_bytes = setup.bucket_cap_bytes / 2});
    dp.broadcast_parameters(0);
    const int local = setup.global_batch / world;
    int step = 0;
    while (dp.all_ranks_have_batch(step < batches ? tandem::Batch::available : tandem::Batch::exhausted)) {
      model.forward_backward(data, step * setup.global_batch + r * local, local);
      dp.step();
      ++step;
    }
    steps[static_cast<std::size_t>(r)] = dp.step_count();
    got[static_cast<std::size_t>(r)] = test::as_float(model.params());
  });
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK(steps[static_cast<std::size_t>(r)] == 3);
    CHECK(test::bitwise_equal(got[static_cast<std::size_t>(r)], ref[static_cast<std::size_t>(r)]));
  }
}

TEST_CASE("all_ranks_have_batch: ranks that took different numbers of micro-steps are told so on every rank") {
  test::TrainSetup setup;
  const mlp::Dataset data = test::make_dataset(setup);
  std::mutex m;
  std::vector<std::string> messages;
  // accumulation 2 under Replicated: the first micro-step runs no collective, so nothing else catches the extra
  // step() on rank 1.
  CHECK_THROWS_AS(tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(setup.dims, setup.seed);
    test::DataParallel<tandem::Replicated, tandem::AdamW> dp(comm, model.tensors(), adamw, {.accumulation_steps = 2});
    model.forward_backward(data, 0, 4);
    if (comm.rank() == 1) dp.step();
    try {
      dp.all_ranks_have_batch(tandem::Batch::available);
    } catch (const tandem::error& e) {
      std::lock_guard lock(m);
      messages.emplace_back(e.what());
      throw;
    }
  }),
                  tandem::error);
  REQUIRE(messages.size() == 2);
  for (const std::string& s : messages) {
    CHECK(s.find("rank 0 has taken 0 micro-steps but rank 1 has taken 1") != std::string::npos);
  }
}

TEST_CASE("a rank that stops early without all_ranks_have_batch: the others fail at once, naming it") {
  const test::TrainSetup setup;
  const mlp::Dataset data = test::make_dataset(setup);
  const auto start = std::chrono::steady_clock::now();
  std::string what;
  try {
    tandem::LocalGroup(3).run([&](tandem::LocalComm& comm) {
      test::TrainSetup mine = setup;
      if (comm.rank() == 1) mine.steps = 2;  // rank 1 has fewer batches and returns after its last step
      test::train_rank<tandem::GradientSharded, tandem::AdamW, float>(comm, mine, data, adamw);
    });
  } catch (const tandem::error& e) {
    what = e.what();
  }
  INFO(what);
  CHECK(what.find("rank 1 already returned from its body") != std::string::npos);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30));
}
