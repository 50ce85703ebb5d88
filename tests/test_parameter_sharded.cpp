// SPDX-License-Identifier: Apache-2.0
// ParameterSharded (ZeRO-3): each rank keeps a shard of the parameters, and a pass reads a bucket's parameters
// through parameters(b), which gathers them into a few reused buffers. It reduces exactly as GradientSharded does, so
// training through it must give GradientSharded's bits at every world size, accumulation, number of gather buffers
// and prefetch pattern, and the single-rank reference's values within rounding. One training loop (owned storage,
// initialize_parameters, parameters(b), gradients(b)) serves every policy. Also: the gathers it issues, every misuse,
// checkpoints across policies and world sizes, and its memory. Built twice (streams label): on the stream-faithful
// backend a missing wait between a gather and the pass that reads it, or between a pass's reads and the next gather
// into the same buffer, changes the result.
#include <doctest/doctest.h>

#include <cstdio>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
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
constexpr int steps = 6;

const mlp::Dataset& dataset() {
  static const mlp::Dataset data(global_batch * 2 * steps, dims.front(), dims.back(), 3);
  return data;
}

/// How a micro-step's passes ask for the parameters.
enum class Prefetch {
  none,  ///< each bucket when its pass reaches it
  next   ///< and the next bucket of the pass right after (forward: descending buckets, backward: ascending)
};

struct Setup {
  int world = 1;
  int accumulation = 1;
  int buffers = 2;  ///< parameter_buffers (and gradient_buffers)
  Prefetch prefetch = Prefetch::none;
  int steps = ::steps;
  int batch = global_batch;  ///< global batch per micro-step
  /// The first forward of each window (its buffers start empty): rank 0 alone opens again, as for logging, the bucket
  /// two before the one open (still gathered with 3 buffers).
  bool rank0_rereads = false;
};

template <class T>
std::vector<tandem::TensorSpec> specs_of(mlp::Mlp<T>& model) {
  std::vector<tandem::TensorSpec> specs;
  for (const auto& r : model.tensors()) specs.push_back({r.name, r.numel, r.dtype});
  return specs;
}

/// One rank's training under any policy with owned storage: initial values from `seed` on rank 0 (every rank's model
/// starts different), then each micro-step a forward pass reading every bucket's parameters into the model (last
/// bucket first, as the layers run), forward and backward on the host model, and a backward pass that reads each
/// bucket again (first bucket first) and writes its gradients. Checkpoint hooks between optimizer steps.
template <class Policy, class T = float, class Comm>
void train_rank(Comm& comm, test::DataParallel<Policy, tandem::AdamW, Comm>& dp, mlp::Mlp<T>& model, const Setup& s,
                int first_step = 0) {
  const std::size_t n = dp.num_buckets();
  const int local = s.batch / s.world;
  auto read = [&](auto& bucket) {
    for (std::size_t i : bucket.tensors()) {
      const T* p = bucket.template param<T>(i);
      std::copy(p, p + model.params()[i].size(), model.params()[i].begin());
    }
  };
  for (int m = first_step * s.accumulation; m < s.steps * s.accumulation; ++m) {
    for (std::size_t b = n; b-- > 0;) {
      auto params = dp.parameters(b);
      if (s.prefetch == Prefetch::next && b > 0) dp.prefetch_parameters(b - 1);
      read(params);
      if (s.rank0_rereads && comm.rank() == 0 && m % s.accumulation == 0 && b + 2 < n) (void)dp.parameters(b + 2);
    }
    model.forward_backward(dataset(), m * s.batch + comm.rank() * local, local);
    for (std::size_t b = 0; b < n; ++b) {
      auto params = dp.parameters(b);
      if (s.prefetch == Prefetch::next && b + 1 < n) dp.prefetch_parameters(b + 1);
      for (std::size_t i : params.tensors()) {  // what backward reads is what forward read
        const T* p = params.template param<T>(i);
        REQUIRE(std::memcmp(p, model.params()[i].data(), model.params()[i].size() * sizeof(T)) == 0);
      }
      auto grads = dp.gradients(b);
      for (std::size_t i : grads.tensors()) {
        float* g = grads.grad(i);
        for (std::size_t e = 0; e < model.grads()[i].size(); ++e) g[e] += static_cast<float>(model.grads()[i][e]);
      }
    }
    dp.step();
  }
}

/// Every tensor's parameters as floats, read through parameters(b) (collective).
template <class DP, class T = float>
Params read_params(DP& dp) {
  Params out(dp.layout().size());
  for (std::size_t b = 0; b < dp.num_buckets(); ++b) {
    auto bucket = dp.parameters(b);
    for (std::size_t i : bucket.tensors()) {
      const T* p = bucket.template param<T>(i);
      for (std::size_t e = 0; e < dp.layout()[i].numel; ++e) out[i].push_back(static_cast<float>(p[e]));
    }
  }
  return out;
}

template <class T, class DP>
void initialize(DP& dp, mlp::Mlp<T>& model) {
  dp.template initialize_parameters<T>(
      [&](std::size_t i, T* values) { std::copy(model.params()[i].begin(), model.params()[i].end(), values); });
}

tandem::DataParallelOptions options_of(const Setup& s) {
  return {.bucket_cap_bytes = 1024,
          .first_bucket_cap_bytes = 512,
          .accumulation_steps = s.accumulation,
          .gradient_buffers = s.buffers,
          .parameter_buffers = s.buffers};
}

/// Trains at s.world ranks; returns rank 0's final parameters.
template <class Policy, class T = float>
Params train(const Setup& s) {
  Params result;
  std::mutex m;
  tandem::LocalGroup(s.world).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<T> model(dims, 11 + static_cast<std::uint64_t>(comm.rank()));
    test::DataParallel<Policy, tandem::AdamW> dp(comm, specs_of(model), {.lr = 1e-2f, .weight_decay = 0.01f},
                                                 options_of(s));
    REQUIRE(dp.num_buckets() >= 6);
    initialize(dp, model);
    train_rank<Policy, T>(comm, dp, model, s);
    Params p = read_params<decltype(dp), T>(dp);
    if (comm.rank() == 0) {
      std::lock_guard lock(m);
      result = std::move(p);
    }
  });
  return result;
}

}  // namespace

TEST_CASE("ParameterSharded trains bit for bit as GradientSharded, whatever the gather buffers and prefetching") {
  for (int world = 1; world <= 4; ++world)
    for (int accumulation : {1, 2}) {
      CAPTURE(world);
      CAPTURE(accumulation);
      const Setup base{.world = world, .accumulation = accumulation};
      const Params reference = train<tandem::GradientSharded>(base);
      for (int buffers : {1, 2, 3}) {
        CAPTURE(buffers);
        Setup s = base;
        s.buffers = buffers;
        CHECK(test::bitwise_equal(train<tandem::ParameterSharded>(s), reference));
        if (buffers == 1) continue;  // a prefetch needs a second buffer
        s.prefetch = Prefetch::next;
        CHECK(test::bitwise_equal(train<tandem::ParameterSharded>(s), reference));
      }
      // A bucket still gathered, read again on rank 0 only: the buffers' reuse follows the gathers alone, so the ranks
      // still choose alike (had it followed the releases, rank 0 would have reused another buffer than the others).
      CHECK(
          test::bitwise_equal(train<tandem::ParameterSharded>(
                                  {.world = world, .accumulation = accumulation, .buffers = 3, .rank0_rereads = true}),
                              reference));
      if (accumulation == 1)  // the same sums in the same order as the policies that reduce at the boundary
        CHECK(test::bitwise_equal(train<tandem::OptimizerSharded>(base), reference));
    }
}

TEST_CASE("ParameterSharded at any world size equals single-rank training within rounding") {
  const Params single = train<tandem::Replicated>({.world = 1});
  for (int world : {2, 3, 4}) {
    CAPTURE(world);
    const Params sharded = train<tandem::ParameterSharded>({.world = world, .prefetch = Prefetch::next});
    CHECK(test::max_relative_error(sharded, single) < 1e-5);
    CHECK(!test::bitwise_equal(sharded, train<tandem::ParameterSharded>({.world = world, .steps = steps - 1})));
  }
}

TEST_CASE("ParameterSharded with bf16 parameters equals GradientSharded bit for bit") {
  for (int world : {1, 3}) {
    CAPTURE(world);
    const Setup s{.world = world, .accumulation = 2, .prefetch = Prefetch::next};
    CHECK(test::bitwise_equal(train<tandem::ParameterSharded, tandem::BFloat16>(s),
                              train<tandem::GradientSharded, tandem::BFloat16>(s)));
  }
}

TEST_CASE("a bucket is gathered once per pass, and the last buckets of forward are reused by backward") {
  tandem::LocalGroup(2).run([&](tandem::LocalComm& local) {
    test::CountingComm comm{local};
    mlp::Mlp<float> model(dims, 3);
    const Setup s{.world = 2, .prefetch = Prefetch::next, .steps = 2};
    test::DataParallel<tandem::ParameterSharded, tandem::AdamW, test::CountingComm> dp(comm, specs_of(model), {},
                                                                                       options_of(s));
    initialize(dp, model);
    const int n = static_cast<int>(dp.num_buckets());
    const int before = comm.count(test::Collective::all_gather);
    train_rank<tandem::ParameterSharded>(comm, dp, model, s);
    // Backward finds the last `buffers` buckets of forward still gathered; each step's update makes every bucket stale.
    CHECK(comm.count(test::Collective::all_gather) - before == s.steps * (2 * n - s.buffers));
    // Without a step in between, a bucket still in a buffer is not gathered again.
    { auto p = dp.parameters(0); }
    const int once = comm.count(test::Collective::all_gather);
    { auto p = dp.parameters(0); }
    dp.prefetch_parameters(0);
    CHECK(comm.count(test::Collective::all_gather) == once);
  });
}

TEST_CASE("ParameterSharded misuse is a clear error") {
  tandem::LocalGroup(1).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 1);
    test::DataParallel<tandem::ParameterSharded, tandem::AdamW> dp(comm, specs_of(model), {},
                                                                   options_of({.buffers = 2}));
    CHECK(test::message_of([&] { (void)dp.parameters(0); }).find("before initialize_parameters()") !=
          std::string::npos);
    CHECK(test::message_of([&] {
            dp.template initialize_parameters<tandem::BFloat16>([](std::size_t, tandem::BFloat16*) {});
          }).find("the parameters are fp32") != std::string::npos);
    CHECK(test::message_of([&] {
            dp.template initialize_parameters<float>([](std::size_t, float*) {}, 1);
          }).find("root 1 is out of range") != std::string::npos);
    initialize(dp, model);
    const std::size_t n = dp.num_buckets();
    CHECK(test::message_of([&] { (void)dp.parameters(n); }).find("bucket out of range") != std::string::npos);
    CHECK(test::message_of([&] { dp.prefetch_parameters(n); }).find("bucket out of range") != std::string::npos);
    {
      auto p0 = dp.parameters(0);
      CHECK(test::message_of([&] { (void)dp.parameters(0); }).find("already open") != std::string::npos);
      const std::size_t other = dp.plan().bucket(1).tensors.front();
      CHECK(test::message_of([&] { (void)p0.param<float>(other); }).find("not in this handle's bucket 0") !=
            std::string::npos);
      CHECK(test::message_of([&] {
              (void)p0.param<tandem::BFloat16>(p0.tensors().front());
            }).find("the parameters are fp32") != std::string::npos);
      dp.prefetch_parameters(1);
      const std::string full = test::message_of([&] { (void)dp.parameters(2); });
      CHECK(full.find("all 2 hold buckets (0 open, 1 prefetched)") != std::string::npos);
      CHECK(full.find("DataParallelOptions::parameter_buffers") != std::string::npos);
      CHECK(test::message_of([&] { dp.step(); }).find("bucket 0's ParameterBucket is still open") != std::string::npos);
      CHECK(test::message_of([&] {
              dp.template initialize_parameters<float>([](std::size_t, float*) {});
            }).find("bucket 0's ParameterBucket is still open") != std::string::npos);
      p0.release();
      CHECK(test::message_of([&] { p0.release(); }).find("used after release()") != std::string::npos);
    }
    { auto p2 = dp.parameters(2); }  // bucket 0's buffer is free again (bucket 1's is still reserved)
    CHECK(dp.step().updated);
  });
}

TEST_CASE_TEMPLATE("a fill that throws on the root: every rank throws, and stepping waits for a good one", Policy,
                   tandem::Replicated, tandem::ParameterSharded) {
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 1);
    test::DataParallel<Policy, tandem::AdamW> dp(comm, specs_of(model), {}, options_of({}));
    const std::string what = test::message_of([&] {
      dp.template initialize_parameters<float>([&](std::size_t i, float*) {
        if (i == 3) throw std::runtime_error("no values for tensor 3");
      });
    });
    CHECK(what.find("initialize_parameters: fill threw on rank 0: no values for tensor 3") != std::string::npos);
    // A throw of something else (not a std::exception): every rank is told too (the root alone left before)
    CHECK(test::message_of([&] {
            dp.template initialize_parameters<float>([&](std::size_t, float*) { throw 42; });
          }).find("fill threw on rank 0 (an exception not derived from std::exception)") != std::string::npos);
    CHECK(test::message_of([&] { (void)dp.parameters(0); }).find("before ") != std::string::npos);
    initialize(dp, model);
    CHECK(read_params(dp) == test::as_float(model.params()));
  });
}

TEST_CASE_TEMPLATE("a fill sees the current parameters: it may set some tensors, or read them", Policy,
                   tandem::Replicated, tandem::ParameterSharded) {
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 1);
    test::DataParallel<Policy, tandem::AdamW> dp(comm, specs_of(model), {}, options_of({}));
    initialize(dp, model);
    dp.template initialize_parameters<float>([&](std::size_t i, float* values) {  // on rank 0 only
      for (std::size_t e = 0; e < model.params()[i].size(); ++e) {
        if (i == 1) values[e] = 7.0f;   // a new tensor 1
        if (i == 2) values[e] *= 2.0f;  // tensor 2 rescaled; the others left as they were
      }
    });
    Params want = test::as_float(model.params());
    for (float& x : want[1]) x = 7.0f;
    for (float& x : want[2]) x *= 2.0f;
    CHECK(read_params(dp) == want);
  });
}

TEST_CASE("ParameterSharded checkpoints restore bit for bit under any policy and world size") {
  const std::string path = test::temp_path("parameter_sharded.ckpt");
  const Setup s{.world = 3, .prefetch = Prefetch::next};
  const Params uninterrupted = train<tandem::ParameterSharded>(s);
  auto run = [&](auto policy, int world, int first, int last, bool save) {
    using Policy = decltype(policy);
    Params result;
    std::mutex m;
    tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
      mlp::Mlp<float> model(dims, 11 + static_cast<std::uint64_t>(comm.rank()));
      Setup mine = s;
      mine.world = world;
      mine.steps = last;
      test::DataParallel<Policy, tandem::AdamW> dp(comm, specs_of(model), {.lr = 1e-2f, .weight_decay = 0.01f},
                                                   options_of(mine));
      initialize(dp, model);
      if (first > 0) dp.load_checkpoint(path);
      train_rank<Policy>(comm, dp, model, mine, first);
      if (save) dp.save_checkpoint(path);
      Params p = read_params(dp);
      if (comm.rank() == 0) {
        std::lock_guard lock(m);
        result = std::move(p);
      }
    });
    return result;
  };
  run(tandem::ParameterSharded{}, 3, 0, 3, true);
  CHECK(test::bitwise_equal(run(tandem::ParameterSharded{}, 3, 3, steps, false), uninterrupted));
  CHECK(test::bitwise_equal(run(tandem::GradientSharded{}, 3, 3, steps, false), uninterrupted));
  // Another world size: the same training from the same state, within rounding (other shards, other sums).
  CHECK(test::max_relative_error(run(tandem::ParameterSharded{}, 2, 3, steps, false), uninterrupted) < 1e-5);
  // Saved by another policy, restored under ParameterSharded.
  run(tandem::Replicated{}, 3, 0, 3, true);
  CHECK(test::bitwise_equal(run(tandem::ParameterSharded{}, 3, 3, steps, false), uninterrupted));
  std::filesystem::remove_all(path);
}

TEST_CASE("ParameterSharded's memory: a shard of everything, plus the gather and gradient buffers") {
  for (int world : {1, 2, 3}) {
    CAPTURE(world);
    tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
      mlp::Mlp<tandem::BFloat16> model(dims, 1);
      const std::vector<tandem::TensorSpec> specs = specs_of(model);
      const tandem::DataParallelOptions options = options_of({.buffers = 3});
      test::DataParallel<tandem::ParameterSharded, tandem::AdamW> dp(comm, specs, {}, options);
      const tandem::Plan& plan = dp.plan();
      const std::size_t shard = plan.total_shard_size(), bucket = plan.max_bucket_size(), b16 = 2, f = 4;
      const tandem::MemoryReport r = dp.memory_report();
      CHECK(r.params == shard * b16);
      CHECK(r.grads == shard * f);
      CHECK(r.master_weights == shard * f);
      CHECK(r.optimizer_state == 2 * shard * f);
      CHECK(r.buckets == 3 * bucket * b16 + 3 * bucket * f);
      CHECK(r == tandem::estimate_memory<tandem::ParameterSharded, tandem::AdamW>(specs, world, tandem::Storage::owned,
                                                                                  {}, options));
    });
  }
  mlp::Mlp<float> model(dims, 1);
  CHECK_THROWS_WITH_AS(
      (tandem::estimate_memory<tandem::ParameterSharded, tandem::AdamW>(specs_of(model), 2, tandem::Storage::user)),
      doctest::Contains("ParameterSharded keeps only a shard of the parameters, so it needs owned"), tandem::error);
}
