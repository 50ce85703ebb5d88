// SPDX-License-Identifier: Apache-2.0
// GradientBucket (DataParallel::gradients(b)): owned storage's bucket-by-bucket gradient views. Under GradientSharded
// they lie in a few reused bucket buffers (DataParallelOptions::gradient_buffers), so no full-size gradient buffer
// exists. Training through them must give bitwise what OptimizerSharded gives with its full gradient buffer (the same
// sums in the same order at accumulation 1), whatever the number of buffers and the order buckets are opened in; a
// bucket never opened is zero; every misuse is a clear error; a bucket abandoned by an exception stops the micro-step
// until load_checkpoint. Built twice (streams label): on the stream-faithful backend a missing wait between tandem's
// zeroing of a buffer and the user's next writes into it changes the result.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../examples/mlp/mlp.hpp"
#include "support/backend.hpp"
#include "support/comm.hpp"
#include "support/params.hpp"
#include "support/temp_path.hpp"
#include "tandem/tandem.hpp"

namespace {

using test::Params;

const std::vector<int> dims = {13, 37, 29, 23, 19, 7};
constexpr int global_batch = 12;
constexpr int steps = 8;

const mlp::Dataset& dataset() {
  static const mlp::Dataset data(global_batch * 2 * steps, dims.front(), dims.back(), 3);
  return data;
}

/// How backward opens the buckets in one micro-step.
enum class Order {
  in_order,       ///< 0, 1, 2, ...: one open at a time
  pairs_swapped,  ///< 1, 0, 3, 2, ...: a later bucket first, so two are held at once
  skip_odd,       ///< odd buckets never opened (their gradients are taken as zero)
  empty_odd,      ///< odd buckets opened and released without a write
  alternate       ///< at step s bucket b opened only where b + s is even: each is written one step, not the next
};

/// Whether `order` writes bucket b at micro-step s.
bool writes(Order order, std::size_t b, int s) {
  switch (order) {
    case Order::skip_odd:
    case Order::empty_odd:
      return b % 2 == 0;
    case Order::alternate:
      return (b + static_cast<std::size_t>(s)) % 2 == 0;
    default:
      return true;
  }
}

std::vector<tandem::TensorSpec> specs_of(mlp::Mlp<float>& model) {
  std::vector<tandem::TensorSpec> specs;
  for (const auto& r : model.tensors()) specs.push_back({r.name, r.numel, r.dtype});
  return specs;
}

/// Trains the MLP with owned storage at `world` ranks, writing each bucket's gradients through gradients(b) in
/// `order`; returns rank 0's final parameters.
template <class Policy>
Params train(int world, int accumulation, int buffers, Order order) {
  Params result;
  std::mutex m;
  tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 11);
    const std::vector<tandem::TensorSpec> specs = specs_of(model);
    test::DataParallel<Policy, tandem::AdamW> dp(comm, specs, {.lr = 1e-2f, .weight_decay = 0.01f},
                                                 {.bucket_cap_bytes = 1024,
                                                  .first_bucket_cap_bytes = 512,
                                                  .accumulation_steps = accumulation,
                                                  .gradient_buffers = buffers});
    REQUIRE(dp.num_buckets() >= 6);
    for (std::size_t i = 0; i < specs.size(); ++i)
      std::memcpy(dp.template param_view<float>(i), model.params()[i].data(), specs[i].numel * sizeof(float));
    dp.broadcast_parameters();
    const int local = global_batch / world;
    for (int s = 0; s < steps * accumulation; ++s) {
      for (std::size_t i = 0; i < specs.size(); ++i)
        std::memcpy(model.params()[i].data(), dp.template param_view<float>(i), specs[i].numel * sizeof(float));
      model.forward_backward(dataset(), s * global_batch + comm.rank() * local, local);
      auto write = [&](std::size_t b) {
        auto bucket = dp.gradients(b);
        for (std::size_t i : bucket.tensors()) {
          float* g = bucket.grad(i);
          for (std::size_t e = 0; e < specs[i].numel; ++e) g[e] += model.grads()[i][e];
        }
      };
      const std::size_t n = dp.num_buckets();
      for (std::size_t b = 0; b < n; ++b) {
        if (order == Order::in_order) write(b);
        if ((order == Order::skip_odd || order == Order::alternate) && writes(order, b, s)) write(b);
        if (order == Order::empty_odd) {
          if (b % 2 == 0)
            write(b);
          else
            auto bucket = dp.gradients(b);
        }
        if (order == Order::pairs_swapped && b % 2 == 0) {
          if (b + 1 == n) {
            write(b);
            continue;
          }
          auto later = dp.gradients(b + 1);  // held while bucket b is opened, written and released
          write(b);
          for (std::size_t i : later.tensors()) {
            float* g = later.grad(i);
            for (std::size_t e = 0; e < specs[i].numel; ++e) g[e] += model.grads()[i][e];
          }
        }
      }
      dp.step();
    }
    if (comm.rank() == 0) {
      std::lock_guard lock(m);
      result = test::param_views(dp);
    }
  });
  return result;
}

/// The same training in copy mode (the user's gradient buffers, which tandem reads at each step and never zeroes):
/// the tensors of the buckets `order` does not write at a step get zero gradients from the user. Independent of how
/// owned storage zeroes and skips its buckets.
Params train_user_gradients(int world, Order order) {
  Params result;
  std::mutex m;
  tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 11);
    test::DataParallel<tandem::Replicated, tandem::AdamW> dp(comm, model.tensors(),
                                                             {.lr = 1e-2f, .weight_decay = 0.01f},
                                                             {.bucket_cap_bytes = 1024, .first_bucket_cap_bytes = 512});
    dp.broadcast_parameters();
    const int local = global_batch / world;
    for (int s = 0; s < steps; ++s) {
      model.forward_backward(dataset(), s * global_batch + comm.rank() * local, local);
      for (std::size_t b = 0; b < dp.num_buckets(); ++b)
        if (!writes(order, b, s))
          for (std::size_t i : dp.plan().bucket(b).tensors)
            std::fill(model.grads()[i].begin(), model.grads()[i].end(), 0.0f);
      dp.step();
    }
    if (comm.rank() == 0) {
      std::lock_guard lock(m);
      result = model.params();
    }
  });
  return result;
}

}  // namespace

TEST_CASE("GradientSharded through reused gradient buffers equals OptimizerSharded bit for bit") {
  for (int world = 1; world <= 3; ++world) {
    CAPTURE(world);
    const Params reference = train<tandem::OptimizerSharded>(world, 1, 2, Order::in_order);
    for (int buffers : {1, 2, 3}) {
      CAPTURE(buffers);
      CHECK(test::bitwise_equal(train<tandem::GradientSharded>(world, 1, buffers, Order::in_order), reference));
    }
    CHECK(test::bitwise_equal(train<tandem::GradientSharded>(world, 1, 2, Order::pairs_swapped), reference));
    CHECK(test::bitwise_equal(train<tandem::OptimizerSharded>(world, 1, 2, Order::pairs_swapped), reference));
  }
}

TEST_CASE("with accumulation, through reused buffers, every number of buffers gives the same bits") {
  for (int world : {1, 2, 3}) {
    CAPTURE(world);
    const Params reference = train<tandem::GradientSharded>(world, 2, 3, Order::in_order);
    CHECK(test::bitwise_equal(train<tandem::GradientSharded>(world, 2, 1, Order::in_order), reference));
    CHECK(test::bitwise_equal(train<tandem::GradientSharded>(world, 2, 2, Order::pairs_swapped), reference));
    // The same training within rounding of OptimizerSharded's (which sums micro-steps before reducing).
    CHECK(test::max_relative_error(train<tandem::OptimizerSharded>(world, 2, 2, Order::in_order), reference) < 1e-5);
  }
}

TEST_CASE("a bucket never opened, or opened and not written, contributes zero gradients, under every policy") {
  const Params reference = train<tandem::Replicated>(2, 1, 2, Order::skip_odd);
  CHECK(test::bitwise_equal(train<tandem::OptimizerSharded>(2, 1, 2, Order::skip_odd), reference));
  CHECK(test::bitwise_equal(train<tandem::OptimizerSharded>(2, 1, 2, Order::empty_odd), reference));
  CHECK(test::bitwise_equal(train<tandem::GradientSharded>(2, 1, 1, Order::empty_odd), reference));
  // Skipped buckets are reduced in their turn, so the later buckets opened meanwhile each hold a buffer: with as
  // many buffers as buckets that always works; with one, opening bucket 2 while bucket 1 is next says so.
  CHECK(test::bitwise_equal(train<tandem::GradientSharded>(2, 1, 64, Order::skip_odd), reference));
  CHECK_THROWS_WITH_AS(train<tandem::GradientSharded>(2, 1, 1, Order::skip_odd),
                       doctest::Contains("bucket 2 would take the last free gradient buffer, which bucket 1 needs"),
                       tandem::error);
  CHECK(!test::bitwise_equal(train<tandem::Replicated>(2, 1, 2, Order::in_order), reference));
  // A bucket written at one step and not opened at the next contributes zero at the next, not what it held (a
  // stale gradient), under every policy: against the user's own zeroed gradients in copy mode.
  const Params alternate = train_user_gradients(2, Order::alternate);
  CHECK(test::max_relative_error(train_user_gradients(2, Order::in_order), alternate) > 1e-3);  // the skips matter
  CHECK(test::max_relative_error(train<tandem::Replicated>(2, 1, 2, Order::alternate), alternate) <= 1e-6);
  CHECK(test::max_relative_error(train<tandem::OptimizerSharded>(2, 1, 2, Order::alternate), alternate) <= 1e-6);
  CHECK(test::max_relative_error(train<tandem::GradientSharded>(2, 1, 64, Order::alternate), alternate) <= 1e-6);
}

TEST_CASE("gradients(b) misuse is a clear error") {
  tandem::LocalGroup(1).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 1);
    const std::vector<tandem::TensorSpec> specs = specs_of(model);
    const tandem::DataParallelOptions options{
        .bucket_cap_bytes = 1024, .first_bucket_cap_bytes = 512, .gradient_buffers = 2};

    test::DataParallel<tandem::GradientSharded, tandem::AdamW> copy(comm, model.tensors(), {}, options);
    CHECK(test::message_of([&] { (void)copy.gradients(0); }).find("gradients(b) is for owned storage") !=
          std::string::npos);

    test::DataParallel<tandem::GradientSharded, tandem::AdamW> dp(comm, specs, {}, options);
    dp.broadcast_parameters();
    const std::size_t n = dp.num_buckets();
    CHECK(test::message_of([&] { (void)dp.gradients(n); }).find("bucket out of range") != std::string::npos);
    {
      auto b0 = dp.gradients(0);
      CHECK(test::message_of([&] { (void)dp.gradients(0); }).find("already open") != std::string::npos);
      const std::size_t other = dp.plan().bucket(1).tensors.front();
      CHECK(test::message_of([&] { (void)b0.grad(other); }).find("not in this handle's bucket 0") != std::string::npos);
      CHECK(test::message_of([&] { dp.step(); }).find("bucket 0's GradientBucket is still open") != std::string::npos);
      auto b1 = dp.gradients(1);
      // Both buffers are held: bucket 2 cannot have one, and the message says how to proceed.
      const std::string full = test::message_of([&] { (void)dp.gradients(2); });
      CHECK(full.find("all 2 hold buckets (0, 1)") != std::string::npos);
      CHECK(full.find("DataParallelOptions::gradient_buffers") != std::string::npos);
      b1.release();
      CHECK(test::message_of([&] { b1.release(); }).find("used after release()") != std::string::npos);
      // Bucket 1 waits for bucket 0 (buckets are reduced in bucket order), so it keeps its buffer.
      CHECK(test::message_of([&] { (void)dp.gradients(2); }).find("all 2 hold buckets (0, 1)") != std::string::npos);
    }
    CHECK(test::message_of([&] { (void)dp.gradients(0); }).find("already complete in this micro-step") !=
          std::string::npos);
    auto b2 = dp.gradients(2);  // both buffers are free again: buckets 0 and 1 were reduced
    b2.release();
    CHECK(dp.step().updated);
    auto again = dp.gradients(0);  // a new micro-step
    CHECK(again.bucket() == 0);
  });
}

TEST_CASE("a GradientBucket destroyed by an exception stops the micro-step until load_checkpoint") {
  const std::string path = test::temp_path("gradient_buckets_abandoned");
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 1);
    const std::vector<tandem::TensorSpec> specs = specs_of(model);
    test::DataParallel<tandem::GradientSharded, tandem::AdamW> dp(
        comm, specs, {}, {.bucket_cap_bytes = 1024, .first_bucket_cap_bytes = 512, .gradient_buffers = 1});
    dp.broadcast_parameters();
    dp.step();
    dp.save_checkpoint(path);
    try {
      auto bucket = dp.gradients(0);
      bucket.grad(bucket.tensors().front())[0] = 1e6f;  // half-written when backward fails
      throw std::runtime_error("backward failed");
    } catch (const std::runtime_error&) {
    }
    CHECK(test::message_of([&] { dp.step(); }).find("destroyed by an exception during backward") != std::string::npos);
    CHECK(test::message_of([&] {
            (void)dp.gradients(1);
          }).find("discard_gradients() (on every rank) or load_checkpoint") != std::string::npos);
    // A save still saves, between optimizer steps: the state of the last one, which the abandoned bucket never reached.
    dp.save_checkpoint(path + ".after");
    if (comm.rank() == 0) {
      CHECK(tandem::checkpoint_digest(path + ".after") == tandem::checkpoint_digest(path));
      std::filesystem::remove_all(path + ".after");
    }
    dp.load_checkpoint(path);
    // A clean window: the abandoned buffer was zeroed. A fresh DataParallel loaded from the same checkpoint and
    // stepped alike gives the same bits (the 1e6 would have moved the first tensor).
    test::DataParallel<tandem::GradientSharded, tandem::AdamW> fresh(
        comm, specs, {}, {.bucket_cap_bytes = 1024, .first_bucket_cap_bytes = 512, .gradient_buffers = 1});
    fresh.load_checkpoint(path);
    { auto bucket = dp.gradients(0); }
    CHECK(dp.step().updated);
    CHECK(fresh.step().updated);
    CHECK(dp.step_count() == 2);
    for (std::size_t i = 0; i < specs.size(); ++i)
      CHECK(std::memcmp(dp.template param_view<float>(i), fresh.template param_view<float>(i),
                        specs[i].numel * sizeof(float)) == 0);
  });
  std::filesystem::remove_all(path);
}

TEST_CASE("grad_view(i) is bucket.grad(i) under the policies that keep full-size gradients") {
  auto check = [](auto policy) {
    using P = decltype(policy);
    tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
      mlp::Mlp<float> model(dims, 1);
      test::DataParallel<P, tandem::AdamW> dp(comm, specs_of(model), {},
                                              {.bucket_cap_bytes = 1024, .first_bucket_cap_bytes = 512});
      dp.broadcast_parameters();
      for (std::size_t b = 0; b < dp.num_buckets(); ++b) {
        auto bucket = dp.gradients(b);
        for (std::size_t i : bucket.tensors()) CHECK(bucket.grad(i) == dp.grad_view(i));
      }
    });
  };
  check(tandem::Replicated{});
  check(tandem::OptimizerSharded{});
}

namespace {

/// Trains `steps` optimizer steps of SGD (accumulation 2, owned storage) from the checkpoint at `path`, adding
/// gradient (s + 1) * 0.01 everywhere at micro-step s; returns rank 0's parameters. SGD, not AdamW: AdamW is
/// invariant to a constant scale of the gradients and would hide a stale offset.
template <class Policy>
Params continue_from(const std::string& path, int steps, bool dirty_window, bool discard) {
  Params result;
  std::mutex m;
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 1);
    const std::vector<tandem::TensorSpec> specs = specs_of(model);
    test::DataParallel<Policy, tandem::SGD> dp(
        comm, specs, {.lr = 0.1f, .momentum = 0.9f},
        {.bucket_cap_bytes = 1024, .first_bucket_cap_bytes = 512, .accumulation_steps = 2, .gradient_buffers = 1});
    dp.load_checkpoint(path);
    auto fill = [&](float value) {
      for (std::size_t b = 0; b < dp.num_buckets(); ++b) {
        auto bucket = dp.gradients(b);
        for (std::size_t i : bucket.tensors())  // backward adds into the views
          for (std::size_t e = 0; e < specs[i].numel; ++e) bucket.grad(i)[e] += value;
      }
    };
    if (dirty_window) {  // half a window of large gradients, then a fresh start
      fill(100.0f);
      CHECK(!dp.step().updated);
      if (discard)
        dp.discard_gradients();
      else
        dp.load_checkpoint(path);
      CHECK(dp.micro_step() == 0);
    }
    for (int s = 0; s < 2 * steps; ++s) {
      fill(static_cast<float>(s + 1) * 0.01f);
      CHECK(dp.step().updated == (s % 2 == 1));
    }
    if (comm.rank() == 0) {
      std::lock_guard lock(m);
      result = test::param_views(dp);
    }
  });
  return result;
}

}  // namespace

TEST_CASE_TEMPLATE("load_checkpoint and discard_gradients inside a window start a clean one", Policy,
                   tandem::Replicated, tandem::OptimizerSharded, tandem::GradientSharded) {
  const std::string path = test::temp_path("gradient_buckets_window");
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 5);
    test::DataParallel<Policy, tandem::SGD> dp(comm, model.tensors(), {.lr = 0.1f, .momentum = 0.9f},
                                               {.bucket_cap_bytes = 1024, .first_bucket_cap_bytes = 512});
    dp.broadcast_parameters();
    dp.step();
    dp.save_checkpoint(path);
  });
  const Params clean = continue_from<Policy>(path, 3, false, false);
  CHECK(test::bitwise_equal(continue_from<Policy>(path, 3, true, false), clean));
  CHECK(test::bitwise_equal(continue_from<Policy>(path, 3, true, true), clean));
  std::filesystem::remove_all(path);
}

TEST_CASE("a bucket whose reduction fails to issue ends the micro-step; discard_gradients goes on") {
  tandem::LocalGroup(1).run([&](tandem::LocalComm& local) {
    test::CountingComm comm{local, test::Collective::reduce_scatter, 1};
    mlp::Mlp<float> model(dims, 1);
    const std::vector<tandem::TensorSpec> specs = specs_of(model);
    test::DataParallel<tandem::GradientSharded, tandem::AdamW, test::CountingComm> dp(
        comm, specs, {}, {.bucket_cap_bytes = 1024, .first_bucket_cap_bytes = 512});
    dp.broadcast_parameters();
    { auto b0 = dp.gradients(0); }  // reduce_scatter call 0
    auto b1 = dp.gradients(1);
    CHECK(test::message_of([&] { b1.release(); }).find("injected collective failure") != std::string::npos);
    // Not issued again behind the user's back, and said why.
    CHECK(test::message_of([&] { dp.step(); }).find("issuing bucket 1's reduction failed") != std::string::npos);
    CHECK(comm.count(test::Collective::reduce_scatter) == 2);
    dp.discard_gradients();
    CHECK(dp.step().updated);  // a whole clean micro-step: every bucket once
    CHECK(comm.count(test::Collective::reduce_scatter) == 2 + static_cast<int>(dp.num_buckets()));
  });
}

TEST_CASE("a DataParallel with a GradientBucket open refuses to move and moves nothing; a moved-from one refuses") {
  tandem::LocalGroup(1).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 1);
    using DP = test::DataParallel<tandem::GradientSharded, tandem::AdamW>;
    DP dp(comm, specs_of(model), {}, {.bucket_cap_bytes = 1024});
    dp.broadcast_parameters();
    auto bucket = dp.gradients(0);
    const std::size_t first = bucket.tensors().front();
    CHECK(test::message_of([&] {
            DP moved(std::move(dp));
          }).find("cannot be moved while bucket 0's GradientBucket is open") != std::string::npos);
    bucket.grad(first)[0] = 1.0f;  // nothing moved: the handle and its DataParallel go on
    bucket.release();
    CHECK(dp.step().updated);
    DP moved(std::move(dp));
    CHECK(moved.step().updated);
    for (const auto& [what, call] : std::vector<std::pair<std::string, std::function<void()>>>{
             {"discard_gradients", [&] { dp.discard_gradients(); }},
             {"optimizer_options()", [&] { (void)dp.optimizer_options(); }},
             {"load_checkpoint", [&] { dp.load_checkpoint("no such checkpoint"); }},
             {"all_ranks_have_batch", [&] { (void)dp.all_ranks_have_batch(tandem::Batch::available); }},
             {"all_reduce_host",
              [&] {
                double loss = 1.0;
                dp.all_reduce_host({&loss, 1});
              }},
             {"memory_report()", [&] { (void)dp.memory_report(); }},
             {"gradients(b)", [&] { (void)dp.gradients(0); }}}) {
      CAPTURE(what);
      CHECK(test::message_of(call) == "tandem: " + what + " on a DataParallel that has been moved from");
    }
  });
}

TEST_CASE("handles that outlive their DataParallel refuse every use and release nothing (they wrote freed memory)") {
  tandem::LocalGroup(1).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 1);
    using DP = test::DataParallel<tandem::GradientSharded, tandem::AdamW>;
    std::optional<DP> dp(std::in_place, comm, specs_of(model), tandem::AdamW::Options{},
                         tandem::DataParallelOptions{.bucket_cap_bytes = 1024});
    dp->broadcast_parameters();
    std::optional<DP::GradientBucket> grads(dp->gradients(0));
    std::optional<DP::ParameterBucket> params(dp->parameters(0));
    const std::size_t first = grads->tensors().front();
    dp.reset();  // says on stderr that the handles are open
    CHECK(test::message_of([&] {
            (void)grads->grad(first);
          }).find("GradientBucket of bucket 0 used after its DataParallel was destroyed") != std::string::npos);
    CHECK(test::message_of([&] { grads->release(); }).find("used after its DataParallel was destroyed") !=
          std::string::npos);
    CHECK(test::message_of([&] {
            (void)params->param<float>(params->tensors().front());
          }).find("ParameterBucket of bucket 0 used after") != std::string::npos);
    grads.reset();  // the destructors release nothing (under ASan: no use after free)
    params.reset();
  });
}

namespace {

/// Where train_through_failure makes step `fail_step`'s end fail, on every rank.
enum class StepFailure {
  none,     ///< nothing fails: the window is dropped with discard_gradients() instead of step()
  scalars,  ///< the step's scalar all-reduce (norm, checks), after the buckets' all-reduces
  gather    ///< the first parameter gather after an update (OptimizerSharded)
};

/// Trains `steps` steps of the MLP at 2 ranks in copy mode (SGD with momentum, clipping), each of 2 micro-steps (so a
/// step() called again after a failed one would add the user's gradients to the reduced ones); before step
/// `fail_step` it saves a checkpoint, then the step fails as `failure` says, and `recover` is called with the
/// checkpoint's path. Returns rank 0's final parameters.
template <class Policy>
Params train_through_failure(int fail_step, StepFailure failure,
                             const std::function<void(test::DataParallel<Policy, tandem::SGD, test::CountingComm>&,
                                                      const std::string&)>& recover) {
  Params result;
  std::mutex m;
  const std::string saved = test::temp_path("step_failure");
  tandem::LocalGroup(2).run([&](tandem::LocalComm& local) {
    test::CountingComm comm{local, test::Collective::all_reduce, -1};
    mlp::Mlp<float> model(dims, 9);
    test::DataParallel<Policy, tandem::SGD, test::CountingComm> dp(
        comm, model.tensors(), {.lr = 0.05f, .momentum = 0.9f},
        {.bucket_cap_bytes = 1024, .first_bucket_cap_bytes = 512, .accumulation_steps = 2, .max_grad_norm = 1.0f});
    REQUIRE(dp.num_buckets() > 2);
    dp.broadcast_parameters();
    const int local_batch = global_batch / 2;
    for (int s = 0; s < steps; ++s) {
      if (s == fail_step) dp.save_checkpoint(saved);
      model.forward_backward(dataset(), 2 * s * global_batch + comm.rank() * local_batch, local_batch);
      CHECK(!dp.step().updated);
      model.forward_backward(dataset(), (2 * s + 1) * global_batch + comm.rank() * local_batch, local_batch);
      if (s != fail_step) {
        CHECK(dp.step().updated);
        continue;
      }
      if (failure == StepFailure::none) {
        dp.discard_gradients();
        continue;
      }
      const bool scalars = failure == StepFailure::scalars;
      comm.fail_kind = scalars ? test::Collective::all_reduce : test::Collective::all_gather;
      comm.fail_at = scalars ? comm.count(test::Collective::all_reduce) + static_cast<int>(dp.num_buckets())
                             : comm.count(test::Collective::all_gather);
      CHECK(test::message_of([&] { dp.step(); }) == "injected collective failure");
      recover(dp, saved);
    }
    if (comm.rank() == 0) {
      std::lock_guard lock(m);
      result = test::as_float(model.params());
    }
  });
  std::filesystem::remove_all(saved);
  return result;
}

}  // namespace

TEST_CASE("step() failing after the buckets' reduction, before any update: refused until discard_gradients") {
  // The scalar all-reduce fails with the window's gradients reduced in place: a second step() would add the last
  // micro-step's gradients to them and reduce again (it had trained on that). Dropping the window goes on as if it
  // had been dropped in the first place, bit for bit.
  const Params reference = train_through_failure<tandem::Replicated>(3, StepFailure::none, [](auto&, auto&) {});
  const Params recovered = train_through_failure<tandem::Replicated>(3, StepFailure::scalars, [](auto& dp, auto&) {
    CHECK(test::message_of([&] { dp.step(); }) ==
          "tandem: step(): step() failed at the end of the accumulation window, before any update (injected "
          "collective failure), with its gradients reduced; discard_gradients() (on every rank) or load_checkpoint "
          "starts a clean window");
    dp.discard_gradients();
  });
  CHECK(test::bitwise_equal(recovered, reference));
}

TEST_CASE("step() failing while updating the parameters: refused, and not saved, until a checkpoint is loaded") {
  // Some buckets are updated and their parameters gathered, others not: only a checkpoint makes a whole state again,
  // and loading the one saved before the step goes on as if that step's window had been dropped, bit for bit.
  const std::string path = test::temp_path("step_failure_update");
  const Params reference = train_through_failure<tandem::OptimizerSharded>(3, StepFailure::none, [](auto&, auto&) {});
  const Params recovered =
      train_through_failure<tandem::OptimizerSharded>(3, StepFailure::gather, [&](auto& dp, const std::string& saved) {
        const std::string damaged =
            "step() failed while updating the parameters (injected collective failure), so some buckets may be "
            "updated and others not (and the ranks' copies may differ); load a checkpoint";
        CHECK(test::message_of([&] { dp.step(); }) == "tandem: step(): " + damaged);
        CHECK(test::message_of([&] { dp.save_checkpoint(path); }) == "tandem: save_checkpoint: " + damaged);
        dp.discard_gradients();  // not enough
        CHECK(test::message_of([&] { dp.step(); }) == "tandem: step(): " + damaged);
        dp.load_checkpoint(saved);
      });
  CHECK(test::bitwise_equal(recovered, reference));
  CHECK(!std::filesystem::exists(path));
}
