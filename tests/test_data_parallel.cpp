// SPDX-License-Identifier: Apache-2.0
// The spine: N ranks training under each policy end every step with the parameters one rank reaches on
// the whole global batch. The reference is independent of tandem's step: one model trained on the whole
// batch with plain-loop optimizers written here from the formulas. One generic testbed, typed over policies.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "../examples/mlp/mlp.hpp"
#include "support/backend.hpp"
#include "support/comm.hpp"
#include "support/params.hpp"
#include "support/temp_path.hpp"
#include "tandem/tandem.hpp"

namespace {

using test::as_float;
using test::bitwise_equal;
using test::max_relative_error;
using test::Params;

const std::vector<int> dims = {13, 37, 29, 23, 19, 7};  // 11 tensors, odd sizes
constexpr int global_batch = 24;                        // divisible by 1, 2, 3, 4
constexpr int train_steps = 50;
constexpr std::uint64_t init_seed = 42;

enum class Opt { adamw, sgd };

struct Config {
  int world = 1;
  int accumulation = 1;
  float max_grad_norm = 0.0f;
  Opt optimizer = Opt::adamw;
  bool owned_storage = false;
  std::size_t bucket_cap_bytes = 2048;  // small: many buckets, tensors straddling shards
};

const tandem::AdamWOptions adamw_options{
    .lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-8f, .weight_decay = 0.05f};
const tandem::SGDOptions sgd_options{
    .lr = 0.05f, .momentum = 0.9f, .weight_decay = 1e-3f, .nesterov = tandem::Nesterov::on};

const mlp::Dataset& dataset() {
  static const mlp::Dataset data(global_batch * 4 * train_steps, dims.front(), dims.back(), 7);
  return data;
}

// ---- the reference: one rank, the whole global batch, plain loops -------------------------------------------

// `pieces` > 1 computes each step's whole-batch gradient as the mean of that many sub-batch gradients: the
// same mathematics in another summation order. How far that moves the result is the model's own rounding
// noise floor, which 16-bit parameters amplify (a master weight that crosses a rounding boundary flips a
// parameter by one ulp, and the forward pass carries the flip on).
template <class T>
Params train_reference(const Config& c, int pieces = 1) {
  mlp::Mlp<T> model(dims, init_seed);
  const std::size_t nt = model.params().size();
  Params master = as_float(model.params()), m(nt), v(nt);
  for (std::size_t i = 0; i < nt; ++i) {
    m[i].assign(master[i].size(), 0.0f);
    v[i].assign(master[i].size(), 0.0f);
  }
  const int batch = global_batch * c.accumulation;
  for (int step = 1; step <= train_steps; ++step) {
    Params g;
    for (int p = 0; p < pieces; ++p) {
      model.forward_backward(dataset(), (step - 1) * batch + p * batch / pieces, batch / pieces);
      Params part = as_float(model.grads());
      if (p == 0)
        g = part;
      else
        for (std::size_t i = 0; i < g.size(); ++i)
          for (std::size_t e = 0; e < g[i].size(); ++e) g[i][e] += part[i][e];
    }
    if (pieces > 1)
      for (auto& t : g)
        for (float& e : t) e /= static_cast<float>(pieces);
    if (c.max_grad_norm > 0.0f) {
      double sq = 0;
      for (auto& t : g)
        for (float e : t) sq += double{e} * e;
      const double norm = std::sqrt(sq);
      const float coef = static_cast<float>(std::min(1.0, c.max_grad_norm / (norm + 1e-6)));  // torch's rule
      for (auto& t : g)
        for (float& e : t) e *= coef;
    }
    for (std::size_t i = 0; i < nt; ++i)
      for (std::size_t e = 0; e < master[i].size(); ++e) {
        float& w = master[i][e];
        const float ge = g[i][e];
        if (c.optimizer == Opt::adamw) {
          const auto& o = adamw_options;
          w *= 1.0f - o.lr * o.weight_decay;
          m[i][e] = o.beta1 * m[i][e] + (1.0f - o.beta1) * ge;
          v[i][e] = o.beta2 * v[i][e] + (1.0f - o.beta2) * ge * ge;
          const double mhat = m[i][e] / (1.0 - std::pow(double{o.beta1}, step));
          const double vhat = v[i][e] / (1.0 - std::pow(double{o.beta2}, step));
          w = static_cast<float>(w - o.lr * mhat / (std::sqrt(vhat) + o.eps));
        } else {
          const auto& o = sgd_options;
          float d = ge + o.weight_decay * w;
          m[i][e] = step == 1 ? d : o.momentum * m[i][e] + d;
          d = d + o.momentum * m[i][e];
          w -= o.lr * d;
        }
        model.params()[i][e] = T(w);
      }
  }
  return as_float(model.params());
}

// ---- tandem: N ranks as threads ------------------------------------------------------------------------------

template <class Policy, class Optimizer, class T>
Params train_tandem(const Config& c, const typename Optimizer::Options& options) {
  std::vector<Params> results(static_cast<std::size_t>(c.world));
  tandem::LocalGroup group(c.world);
  group.run([&](tandem::LocalComm& comm) {
    mlp::Mlp<T> model(dims, init_seed + static_cast<std::uint64_t>(comm.rank()) * 1000);  // rank 0's init wins
    tandem::DataParallelOptions dpo{.bucket_cap_bytes = c.bucket_cap_bytes,
                                    .first_bucket_cap_bytes = c.bucket_cap_bytes / 2,
                                    .accumulation_steps = c.accumulation,
                                    .max_grad_norm = c.max_grad_norm};
    std::vector<tandem::TensorRef> refs = model.tensors();
    auto run = [&](auto& dp, auto&& sync_in, auto&& sync_out) {
      sync_in();
      dp.broadcast_parameters(0);
      const int local = global_batch / c.world;
      for (int step = 0; step < train_steps; ++step)
        for (int micro = 0; micro < c.accumulation; ++micro) {
          const int begin = (step * c.accumulation + micro) * global_batch + comm.rank() * local;
          sync_out();  // the model reads its parameters (tandem's views or its own buffers)
          model.forward_backward(dataset(), begin, local);
          sync_in();
          const tandem::StepResult r = dp.step();
          REQUIRE(r.updated == (micro + 1 == c.accumulation));
          REQUIRE(!r.skipped);
          // Every configuration that clips sets its threshold under every step's norm: the steps compared are clipped.
          if (r.updated && c.max_grad_norm > 0.0f) REQUIRE(r.clip_coefficient < 1.0f);
        }
      sync_out();
    };
    if (!c.owned_storage) {
      test::DataParallel<Policy, Optimizer> dp(comm, refs, options, dpo);
      run(
          dp, [] {}, [] {});
    } else {
      std::vector<tandem::TensorSpec> specs;
      for (const auto& r : refs) specs.push_back({r.name, r.numel, r.dtype});
      test::DataParallel<Policy, Optimizer> dp(comm, specs, options, dpo);
      // The model keeps its own buffers here; copying through the views stands in for a model that
      // computes on them directly (params out of the views before forward, grads into them after).
      auto params_to_views = [&] {
        for (std::size_t i = 0; i < refs.size(); ++i)
          std::memcpy(dp.template param_view<T>(i), model.params()[i].data(), refs[i].numel * sizeof(T));
      };
      auto grads_to_views = [&] {  // bucket by bucket, as backward produces them: every policy's way
        for (std::size_t b = 0; b < dp.num_buckets(); ++b) {
          auto bucket = dp.gradients(b);
          for (std::size_t i : bucket.tensors()) {
            float* g = bucket.grad(i);
            for (std::size_t e = 0; e < refs[i].numel; ++e) g[e] += static_cast<float>(model.grads()[i][e]);
          }
        }
      };
      auto views_to_params = [&] {
        for (std::size_t i = 0; i < refs.size(); ++i)
          std::memcpy(model.params()[i].data(), dp.template param_view<T>(i), refs[i].numel * sizeof(T));
      };
      bool first = true;
      run(
          dp,
          [&] {
            if (first)
              params_to_views(), first = false;
            else
              grads_to_views();
          },
          views_to_params);
    }
    results[static_cast<std::size_t>(comm.rank())] = as_float(model.params());  // each rank its own entry
  });
  for (std::size_t r = 1; r < results.size(); ++r) {  // every rank holds the same parameters, bit for bit
    CAPTURE(r);
    CHECK(bitwise_equal(results[r], results[0]));
  }
  return results[0];
}

template <class T>
Params train_policy(int which, const Config& c) {
  auto go = [&](auto policy) {
    using P = decltype(policy);
    if (c.optimizer == Opt::adamw) return train_tandem<P, tandem::AdamW, T>(c, adamw_options);
    return train_tandem<P, tandem::SGD, T>(c, sgd_options);
  };
  if (which == 0) return go(tandem::Replicated{});
  if (which == 1) return go(tandem::OptimizerSharded{});
  return go(tandem::GradientSharded{});
}

const char* policy_name(int which) {
  return which == 0 ? "Replicated" : which == 1 ? "OptimizerSharded" : "GradientSharded";
}

// Runs every policy at world sizes 1-4 against the reference; returns the per-world results per policy.
enum class Bitwise {
  all_policies,  // Replicated == OptimizerSharded == GradientSharded, bit for bit
  all_but_zero2  // GradientSharded sums micro-steps after the reduction: equal within the tolerance only
};

// fp32: within `tolerance` of the reference. 16-bit parameters: within 4x the noise floor (see
// train_reference), or `tolerance` if larger.
template <class T>
void check_equivalence(Config c, double tolerance, Bitwise bitwise) {
  const Params ref = train_reference<T>(c);
  if constexpr (!std::is_same_v<T, float>) {
    const double floor = max_relative_error(train_reference<T>(c, 3), ref);
    INFO("16-bit noise floor " << floor);
    REQUIRE(floor < 1e-2);
    tolerance = std::max(tolerance, 4 * floor);
  }
  for (int world = 1; world <= 4; ++world) {
    c.world = world;
    Params first;
    for (int which = 0; which < 3; ++which) {
      CAPTURE(world);
      CAPTURE(policy_name(which));
      const Params got = train_policy<T>(which, c);
      const double err = max_relative_error(got, ref);
      INFO("relative error " << err << ", tolerance " << tolerance);
      CHECK(err <= tolerance);
      if (which == 0) {
        first = got;
        CHECK(bitwise_equal(got, train_policy<T>(which, c)));  // two runs: the same bits
      } else if (which == 1 || bitwise == Bitwise::all_policies) {
        CHECK(bitwise_equal(got, first));
      } else {
        CHECK(max_relative_error(got, first) <= tolerance);
      }
    }
  }
}

}  // namespace

TEST_CASE("fp32 AdamW: every policy at world sizes 1-4 equals single-rank training; bitwise across policies") {
  check_equivalence<float>(Config{}, 1e-5, Bitwise::all_policies);
}

TEST_CASE("fp32 SGD with Nesterov momentum: the same guarantees") {
  check_equivalence<float>(Config{.optimizer = Opt::sgd}, 1e-5, Bitwise::all_policies);
}

TEST_CASE("global-norm clipping active on every step") {
  check_equivalence<float>(Config{.max_grad_norm = 0.05f}, 1e-5, Bitwise::all_policies);
}

TEST_CASE("4-step gradient accumulation") {
  check_equivalence<float>(Config{.accumulation = 4}, 1e-5, Bitwise::all_but_zero2);
}

TEST_CASE("4-step accumulation with clipping and SGD") {
  check_equivalence<float>(Config{.accumulation = 4, .max_grad_norm = 0.05f, .optimizer = Opt::sgd}, 1e-5,
                           Bitwise::all_but_zero2);
}

TEST_CASE("bf16 parameters with fp32 master weights") {
  check_equivalence<tandem::BFloat16>(Config{}, 1e-5, Bitwise::all_policies);
}

TEST_CASE("fp16 parameters with fp32 master weights, accumulation and clipping") {
  check_equivalence<tandem::Float16>(Config{.accumulation = 4, .max_grad_norm = 0.05f}, 1e-5, Bitwise::all_but_zero2);
}

TEST_CASE("zero-copy (owned storage)") {
  check_equivalence<float>(Config{.owned_storage = true}, 1e-5, Bitwise::all_policies);
  check_equivalence<tandem::BFloat16>(Config{.accumulation = 4, .owned_storage = true}, 1e-5, Bitwise::all_but_zero2);
}

TEST_CASE("clipping follows torch's clip_grad_norm_: min(1, max / (norm + 1e-6)), also just below the maximum") {
  // 16 gradients of 0.25: the global norm is exactly 1. torch scales by 1 / (1 + 1e-6) when max_grad_norm is 1 (a
  // rule that scales only when norm > max would not), and by exactly 1 when the maximum is well above the norm.
  for (const float max_norm : {1.0f, 4.0f}) {
    CAPTURE(max_norm);
    tandem::LocalGroup(1).run([&](tandem::LocalComm& comm) {
      std::vector<float> w(16, 1.0f), g(16, 0.25f);
      test::DataParallel<tandem::Replicated, tandem::SGD> dp(comm, {{"w", w.data(), g.data(), 16, tandem::DType::fp32}},
                                                             {.lr = 1.0f}, {.max_grad_norm = max_norm});
      const tandem::StepResult r = dp.step();
      CHECK(r.grad_norm == 1.0);
      const float expected = static_cast<float>(std::min(1.0, max_norm / (1.0 + 1e-6)));
      CHECK(r.clip_coefficient == expected);
      CHECK((max_norm == 1.0f) == (r.clip_coefficient < 1.0f));
      for (float x : w) CHECK(x == 1.0f - 0.25f * expected);
    });
  }
}

TEST_CASE("all_reduce_host sums or averages host values across ranks, in place") {
  for (int world = 1; world <= 4; ++world) {
    CAPTURE(world);
    tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
      std::vector<float> w(8, 1.0f), g(8, 0.0f);
      test::DataParallel<tandem::OptimizerSharded, tandem::SGD> dp(comm,
                                                                   {{"w", w.data(), g.data(), 8, tandem::DType::fp32}});
      const double r = comm.rank();
      double values[3] = {r + 1.0, 0.1 * r, -1.0};
      dp.all_reduce_host(values);
      const double n = world;
      CHECK(values[0] == n * (n + 1) / 2);
      double tenths = 0;
      for (int q = 0; q < world; ++q) tenths += 0.1 * q;  // rank order, as LocalGroup adds
      CHECK(values[1] == tenths);
      CHECK(values[2] == -n);
      double loss = 2.0 * r;
      dp.all_reduce_host({&loss, 1}, tandem::ReduceOp::avg);
      CHECK(loss == doctest::Approx(n - 1));
      dp.all_reduce_host({});  // nothing to reduce: no collective
    });
  }
}

TEST_CASE("a DataParallel moved out of a factory and into a vector trains like one never moved") {
  auto train = [](bool move) {
    Params out;
    std::mutex m;
    tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
      mlp::Mlp<float> model(dims, init_seed);
      using DP = test::DataParallel<tandem::OptimizerSharded, tandem::AdamW>;
      auto make = [&] { return DP(comm, model.tensors(), adamw_options, {.bucket_cap_bytes = 2048}); };
      std::vector<DP> kept;
      std::optional<DP> direct;
      if (move) {
        DP built = make();
        built.broadcast_parameters();
        kept.push_back(std::move(built));
        CHECK_THROWS_WITH_AS(built.step(), doctest::Contains("on a DataParallel that has been moved from"),
                             tandem::error);
      } else {
        direct.emplace(comm, model.tensors(), adamw_options, tandem::DataParallelOptions{.bucket_cap_bytes = 2048});
        direct->broadcast_parameters();
      }
      DP& dp = move ? kept.front() : *direct;
      const int local = global_batch / 2;
      for (int step = 0; step < 10; ++step) {
        model.forward_backward(dataset(), step * global_batch + comm.rank() * local, local);
        dp.step();
      }
      if (comm.rank() == 0) {
        std::lock_guard lock(m);
        out = as_float(model.params());
      }
    });
    return out;
  };
  CHECK(bitwise_equal(train(true), train(false)));
}

// The cases below build their own stream-faithful backends (and streams): they run in the _streams build too, which
// CI runs under ThreadSanitizer.
namespace {

/// What makes the host wait for tandem's work stream (read, synchronize), and the allocations, counted; the counts
/// outlive the backend's move into DataParallel.
struct HostWaits {
  std::atomic<int> reads{0}, synchronizes{0}, allocations{0};
};
struct WaitCountingBackend : tandem::StreamHostBackend {
  std::shared_ptr<HostWaits> waits = std::make_shared<HostWaits>();
  template <class T>
  Buffer<T> allocate(std::size_t n) const {
    ++waits->allocations;
    return tandem::StreamHostBackend::allocate<T>(n);
  }
  void read(void* host, const void* src, std::size_t bytes, tandem::Stream s = {}) const {
    ++waits->reads;
    tandem::StreamHostBackend::read(host, src, bytes, s);
  }
  void synchronize(tandem::Stream s = {}) const {
    ++waits->synchronizes;
    tandem::StreamHostBackend::synchronize(s);
  }
};

/// The capture test's "backward", one launch on the user's stream: g = 0.5 (w - target), a quadratic loss's gradient.
struct QuadraticGradient {
  float* g;
  const float* w;
  const float* target;
  std::size_t n;
  void operator()(std::size_t, unsigned, unsigned) const {
    for (std::size_t i = 0; i < n; ++i) g[i] = 0.5f * (w[i] - target[i]);
  }
};

/// The quadratic loss's parameters at the start, its gradients' buffer and its target, for n elements.
struct QuadraticProblem {
  std::vector<float> w, g, target;
  explicit QuadraticProblem(std::size_t n) : w(n), g(n, 0.0f), target(n) {
    for (std::size_t i = 0; i < n; ++i) {
      w[i] = 0.01f * static_cast<float>(i % 97);
      target[i] = 0.5f - 0.002f * static_cast<float>(i % 89);
    }
  }
  QuadraticGradient gradient() { return {g.data(), w.data(), target.data(), w.size()}; }
};

}  // namespace

TEST_CASE_TEMPLATE(
    "step() makes the host wait only to read the step's scalars, once per optimizer step, and allocates "
    "nothing",
    Policy, tandem::Replicated, tandem::OptimizerSharded, tandem::GradientSharded) {
  // Copy mode (the user's buffers), so every policy but ParameterSharded. The user's stream is a stream of its own, as
  // a CUDA stream is: the host never waits on it. Under StepReport::deferred step() never reads.
  for (const int world : {1, 2})
    for (const bool clip : {false, true})
      for (const tandem::StepReport report : {tandem::StepReport::at_step, tandem::StepReport::deferred}) {
        CAPTURE(world);
        CAPTURE(clip);
        CAPTURE(report);
        tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
          tandem::HostStream user;
          std::vector<float> w(5000), g(5000);
          for (std::size_t i = 0; i < w.size(); ++i) {
            w[i] = 0.01f * static_cast<float>(i % 97);
            g[i] = 0.001f * static_cast<float>(i % 13) - 0.005f;  // written once: nothing races the packs
          }
          WaitCountingBackend backend;
          const std::shared_ptr<HostWaits> waits = backend.waits;
          tandem::DataParallel<Policy, tandem::AdamW, WaitCountingBackend> dp(comm,
                                                                              {{"w", w.data(), g.data(), w.size()}}, {},
                                                                              {.bucket_cap_bytes = 8192,
                                                                               .accumulation_steps = 2,
                                                                               .max_grad_norm = clip ? 1.0f : 0.0f,
                                                                               .step_report = report,
                                                                               .stream = user.stream()},
                                                                              std::move(backend));
          dp.broadcast_parameters();
          dp.step();
          dp.step();  // one optimizer step first: whatever a first step sets up is set up
          const int reads = waits->reads, synchronizes = waits->synchronizes, allocations = waits->allocations;
          for (int k = 0; k < 6; ++k) dp.step();  // 3 optimizer steps
          // The scalar all-reduce's result (docs/cuda.md): read when the norm is needed or the ranks' options are
          // checked.
          CHECK(waits->reads - reads == (report == tandem::StepReport::at_step && (clip || world > 1) ? 3 : 0));
          CHECK(waits->synchronizes == synchronizes);
          CHECK(waits->allocations == allocations);
          const tandem::StepResult last = dp.last_step();  // one read, when asked
          CHECK(waits->reads - reads == (report == tandem::StepReport::at_step && (clip || world > 1) ? 4 : 1));
          CHECK(last.updated);
          CHECK(last.step == 4);
          CHECK(dp.step_count() == 4);
          CHECK(tandem::finite(last.grad_norm) == clip);
          user.synchronize();
        });
      }
}
TEST_CASE_TEMPLATE(
    "a step() captured on the user's stream and replayed gives the bits of eager steps, without a host "
    "wait or an allocation",
    Policy, tandem::Replicated, tandem::OptimizerSharded, tandem::GradientSharded) {
  // One rank without clipping: the step makes no host read, so it can be captured (HostStream::begin_capture, the
  // stand-in for a CUDA graph's capture). The "backward" is the user's launch on their stream, from the parameters
  // (a quadratic loss), so a replay trains on as an eager step does. Each replay's AdamW step must use its own step
  // count's bias corrections: scalars fixed at capture would give other bits. Under ParametersReady::by_bucket the
  // capture holds the next pass's wait for every bucket (the comm stream rejoins the capture through them), and an
  // eager wait after the replays issues nothing (it would wait for an event last recorded in the capture).
  constexpr std::size_t n = 3000;
  constexpr int steps = 6;
  for (const int accumulation : {1, 2}) {
    CAPTURE(accumulation);
    auto train = [&](bool captured, tandem::ParametersReady ready) {
      QuadraticProblem problem(n);
      std::vector<float>& w = problem.w;
      std::uint64_t saved_steps = 0;
      const std::string dir = test::temp_path(captured ? "captured_step" : "eager_step");
      tandem::LocalGroup(1).run([&](tandem::LocalComm& comm) {
        tandem::HostStream user;
        WaitCountingBackend backend;
        const std::shared_ptr<HostWaits> waits = backend.waits;
        tandem::DataParallel<Policy, tandem::AdamW, WaitCountingBackend> dp(
            comm, {{"w", w.data(), problem.g.data(), n}}, {.lr = 1e-2f},
            {.bucket_cap_bytes = 4096,
             .accumulation_steps = accumulation,
             .parameters_ready = ready,
             .stream = user.stream()},
            std::move(backend));
        dp.broadcast_parameters();
        const tandem::StreamHostBackend launcher;
        auto optimizer_step = [&] {  // accumulation micro-steps, each a backward on the user's stream and a step()
          for (int k = 0; k < accumulation; ++k) {
            launcher.launch(1, problem.gradient(), user.stream());
            dp.step();
            for (std::size_t b = 0; b < dp.num_buckets(); ++b) dp.wait_parameters(b);  // the next pass reads them all
          }
        };
        optimizer_step();  // eager first in both runs, as a CUDA graph is captured after a warm-up step
        if (!captured) {
          for (int s = 1; s < steps; ++s) optimizer_step();
        } else {
          const int reads = waits->reads, synchronizes = waits->synchronizes, allocations = waits->allocations;
          user.begin_capture();
          optimizer_step();
          const tandem::HostGraph graph = user.end_capture();
          CHECK(waits->reads == reads);
          CHECK(waits->synchronizes == synchronizes);
          CHECK(waits->allocations == allocations);
          for (int s = 1; s < steps; ++s) graph.replay();
          for (std::size_t b = 0; b < dp.num_buckets(); ++b) dp.wait_parameters(b);
        }
        user.synchronize();
        CHECK(dp.step_count() == (captured ? 2u : static_cast<std::uint64_t>(steps)));  // the host counts step() calls
        dp.save_checkpoint(dir);  // ... and a save records the backend's count, which replays advanced too
        saved_steps = dp.step_count();
      });
      CHECK(saved_steps == static_cast<std::uint64_t>(steps));
      std::filesystem::remove_all(dir);
      return w;
    };
    const std::vector<float> eager = train(false, tandem::ParametersReady::at_step);
    CHECK(eager != QuadraticProblem(n).w);  // the steps moved the parameters from where they start
    for (const tandem::ParametersReady ready : {tandem::ParametersReady::at_step, tandem::ParametersReady::by_bucket}) {
      CAPTURE(ready);
      const std::vector<float> replayed = train(true, ready);
      CHECK(std::memcmp(eager.data(), replayed.data(), n * sizeof(float)) == 0);
    }
  }
}

TEST_CASE_TEMPLATE(
    "a learning-rate schedule over replays of a captured step: store_optimizer_options() before each replay gives "
    "the bits of eager steps",
    Policy, tandem::Replicated, tandem::OptimizerSharded, tandem::GradientSharded) {
  // A step whose options did not change since the last store captures no store of its own, so each replay reads the
  // options stored before it. Without the stores the replays keep the capture's lr, and the bits differ (the check that
  // this test can fail).
  constexpr std::size_t n = 3000;
  constexpr int steps = 6;
  auto lr = [](int s) { return 1e-2f / static_cast<float>(1 + s); };
  enum class Run { eager, replayed, replayed_without_stores };
  auto train = [&](Run run) {
    QuadraticProblem problem(n);
    std::vector<float>& w = problem.w;
    tandem::LocalGroup(1).run([&](tandem::LocalComm& comm) {
      tandem::HostStream user;
      WaitCountingBackend backend;
      const std::shared_ptr<HostWaits> waits = backend.waits;
      tandem::DataParallel<Policy, tandem::AdamW, WaitCountingBackend> dp(
          comm, {{"w", w.data(), problem.g.data(), n}}, {.lr = lr(0)},
          {.bucket_cap_bytes = 4096, .stream = user.stream()}, std::move(backend));
      dp.broadcast_parameters();
      const tandem::StreamHostBackend launcher;
      auto optimizer_step = [&] {
        launcher.launch(1, problem.gradient(), user.stream());
        dp.step();
      };
      optimizer_step();  // step 0, eager in every run
      if (run == Run::eager) {
        for (int s = 1; s < steps; ++s) {
          dp.optimizer_options().lr = lr(s);
          optimizer_step();
        }
      } else {
        const int reads = waits->reads, synchronizes = waits->synchronizes, allocations = waits->allocations;
        dp.optimizer_options().lr = lr(1);
        dp.store_optimizer_options();  // before the capture: the captured step stores nothing
        user.begin_capture();
        optimizer_step();
        const tandem::HostGraph graph = user.end_capture();
        for (int s = 1; s < steps; ++s) {
          if (run == Run::replayed) {
            dp.optimizer_options().lr = lr(s);
            dp.store_optimizer_options();
          }
          graph.replay();
        }
        CHECK(waits->reads == reads);  // neither the stores nor the capture wait for the streams
        CHECK(waits->synchronizes == synchronizes);
        CHECK(waits->allocations == allocations);
      }
      user.synchronize();
    });
    return w;
  };
  const std::vector<float> eager = train(Run::eager), replayed = train(Run::replayed),
                           stale = train(Run::replayed_without_stores);
  CHECK(std::memcmp(eager.data(), replayed.data(), n * sizeof(float)) == 0);
  CHECK(std::memcmp(eager.data(), stale.data(), n * sizeof(float)) != 0);
}

TEST_CASE_TEMPLATE("replays of a captured step after a load read the options the load restored", Policy,
                   tandem::Replicated, tandem::OptimizerSharded, tandem::GradientSharded) {
  // A checkpoint saved after one step with lr 5e-3; an eager run goes on from there. A second run captures its step
  // with lr 1e-2, then loads the checkpoint and replays: the load stores the restored options as
  // store_optimizer_options() does, so the replays give the eager run's bits (with the capture's lr, other bits).
  // Then a load of a checkpoint of more groups than there is room for: the options' buffers are replaced, and those
  // the graph reads stay (AddressSanitizer finds a read of freed memory otherwise), so it still replays; but its
  // launches are of the groups before, so the replay updates nothing and last_step() says so.
  constexpr std::size_t n = 3000;
  constexpr int steps = 5;
  const std::string dir = test::temp_path("restored_options"), groups_dir = test::temp_path("three_groups");
  auto train = [&](bool captured) {
    QuadraticProblem problem(n);
    std::vector<float> trained;
    tandem::LocalGroup(1).run([&](tandem::LocalComm& comm) {
      tandem::HostStream user;
      tandem::DataParallel<Policy, tandem::AdamW, tandem::StreamHostBackend> dp(
          comm, {{"w", problem.w.data(), problem.g.data(), n}}, {.lr = 1e-2f},
          {.bucket_cap_bytes = 4096, .stream = user.stream()});
      dp.broadcast_parameters();
      const tandem::StreamHostBackend launcher;
      auto optimizer_step = [&] {
        launcher.launch(1, problem.gradient(), user.stream());
        dp.step();
      };
      optimizer_step();
      if (!captured) {
        dp.optimizer_options().lr = 5e-3f;
        dp.save_checkpoint(dir);
        for (int s = 0; s < steps; ++s) optimizer_step();
        const tandem::AdamWOptions options = dp.optimizer_options();
        dp.set_optimizer_groups({options, options, options}, {2});
        dp.save_checkpoint(groups_dir);
        user.synchronize();
        trained = problem.w;
      } else {
        user.begin_capture();
        optimizer_step();
        const tandem::HostGraph graph = user.end_capture();
        dp.load_checkpoint(dir);
        CHECK(dp.optimizer_options().lr == 5e-3f);
        for (int s = 0; s < steps; ++s) graph.replay();
        user.synchronize();
        trained = problem.w;
        dp.load_checkpoint(groups_dir);
        CHECK(dp.optimizer_group_count() == 3);
        user.synchronize();  // the load writes the parameters in the user's stream's order
        const std::vector<float> loaded = problem.w;
        graph.replay();
        user.synchronize();
        CHECK(std::memcmp(loaded.data(), problem.w.data(), n * sizeof(float)) == 0);
        CHECK_THROWS_WITH_AS(dp.last_step(), doctest::Contains("1 replay(s) of a step captured before"), tandem::error);
      }
    });
    return trained;
  };
  const std::vector<float> eager = train(false), replayed = train(true);
  CHECK(std::memcmp(eager.data(), replayed.data(), n * sizeof(float)) == 0);
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(groups_dir);
}

namespace {

/// Two tensors of a quadratic problem under DataParallel on the stream-faithful backend, the user's work on a stream
/// of its own: an optimizer step is the gradient computed on that stream, then step(); capture() records one.
template <class Policy>
struct TwoTensorSteps {
  static constexpr std::size_t n = 3000, half = n / 2;
  QuadraticProblem problem{n};
  tandem::HostStream user;
  test::StreamGate gate;  ///< holds the work after each captured collective, where closed (test::CountingComm)
  test::CountingComm gated;
  tandem::DataParallel<Policy, tandem::AdamW, tandem::StreamHostBackend, test::CountingComm> dp;
  tandem::StreamHostBackend launcher;
  TwoTensorSteps(tandem::LocalComm& comm, tandem::StepReport report)
      : gated{.comm = comm, .gate = &gate},
        dp(gated,
           {{"a", problem.w.data(), problem.g.data(), half},
            {"b", problem.w.data() + half, problem.g.data() + half, n - half}},
           {.lr = 1e-2f}, {.bucket_cap_bytes = 4096, .step_report = report, .stream = user.stream()}) {
    dp.broadcast_parameters();
  }
  void optimizer_step() {
    launcher.launch(1, problem.gradient(), user.stream());
    dp.step();
  }
  tandem::HostGraph capture() {
    user.begin_capture();
    optimizer_step();
    return user.end_capture();
  }
};

}  // namespace

TEST_CASE_TEMPLATE(
    "replays of a step captured before the optimizer groups' count or assignment changed update nothing, and the next "
    "report says so; captured again, the step replays to the bits of eager steps",
    Policy, tandem::Replicated, tandem::OptimizerSharded, tandem::GradientSharded) {
  // Two tensors, one group at first. The eager run steps 3 times, takes two groups ({0, 1}) for 2 steps, then the
  // same groups assigned the other way ({1, 0}) for 2 steps. The captured run replays its step 2 times; after each
  // change its replays of the step captured before leave the parameters, the optimizer state and the step count as
  // they are (the later steps' bits show it: a step taken would change them), a save and last_step() throw, and a step
  // captured anew continues as the eager run. set_optimizer_groups with the same count and assignment keeps the
  // captured step: its replays go on, with the options it stored. Two ranks step under StepReport::deferred (a step
  // that reads cannot be captured), and both throw alike.
  constexpr std::size_t n = TwoTensorSteps<Policy>::n;
  auto train = [&](int world, bool captured) {
    std::vector<float> trained;
    const std::string dir = test::temp_path("regrouped_capture");
    tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
      TwoTensorSteps<Policy> t(comm, world > 1 ? tandem::StepReport::deferred : tandem::StepReport::at_step);
      QuadraticProblem& problem = t.problem;
      tandem::HostStream& user = t.user;
      auto& dp = t.dp;
      auto optimizer_step = [&] { t.optimizer_step(); };
      auto capture = [&] { return t.capture(); };
      tandem::AdamWOptions other = dp.optimizer_options();
      other.lr = 5e-3f;
      other.weight_decay = 0.0f;
      const std::vector<tandem::AdamWOptions> groups{dp.optimizer_options(), other};
      std::vector<tandem::AdamWOptions> halved = groups;  // other options, the same count and assignment
      halved[0].lr *= 0.5f;
      // replays of `graph` after a change of groups: nothing moves, and `report` throws for them, saying how many
      auto refused = [&](const tandem::HostGraph& graph, int replays, auto report) {
        user.synchronize();
        const std::vector<float> before = problem.w;
        const std::uint64_t count = dp.last_step().step;
        for (int k = 0; k < replays; ++k) graph.replay();
        user.synchronize();
        CHECK(std::memcmp(before.data(), problem.w.data(), n * sizeof(float)) == 0);
        const std::string says =
            std::to_string(replays) + " replay(s) of a step captured before the optimizer groups changed";
        CHECK_THROWS_WITH_AS(report(), doctest::Contains(says.c_str()), tandem::error);
        CHECK(dp.last_step().step == count);  // reported once
      };
      optimizer_step();
      if (!captured) {
        for (int s = 0; s < 2; ++s) optimizer_step();
        dp.set_optimizer_groups(groups, {0, 1});
        for (int s = 0; s < 2; ++s) optimizer_step();
        dp.set_optimizer_groups(groups, {1, 0});
        optimizer_step();
        dp.set_optimizer_groups(halved, {1, 0});
        optimizer_step();
      } else {
        const tandem::HostGraph one_group = capture();
        for (int s = 0; s < 2; ++s) one_group.replay();
        dp.set_optimizer_groups(groups, {0, 1});  // another count
        refused(one_group, 3, [&] { dp.save_checkpoint(dir); });
        CHECK(!std::filesystem::exists(dir));
        const tandem::HostGraph two_groups = capture();
        for (int s = 0; s < 2; ++s) two_groups.replay();
        dp.set_optimizer_groups(groups, {1, 0});  // the same count, another assignment
        // every rank's report (under deferred, where it reports), then this rank's
        refused(two_groups, 1,
                [&] { world > 1 ? (void)dp.all_ranks_have_batch(tandem::Batch::available) : (void)dp.last_step(); });
        refused(one_group, 2, [&] { dp.last_step(); });
        const std::size_t held = t.gate.holds();
        const tandem::HostGraph swapped = capture();
        {
          // In the replay, the work after the last collective the step captured waits until another thread opens the
          // gate, 50 ms on. set_optimizer_groups's own collectives come after the replay's (LocalComm orders them as
          // issued, as NCCL does), so that work is what the options it stores could overtake: under Replicated the
          // step's updates (under the sharded policies an all-gather follows the updates). It stores them in the
          // user's stream's order, after the whole replay, which takes the options before, as the eager step does.
          REQUIRE(t.gate.holds() > held);
          t.gate.close(t.gate.holds() - 1);
          swapped.replay();
          const std::jthread opener([&t] {
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
            t.gate.open();
          });
          // the same count and assignment: the captured step stays good, and the replays take the new options
          dp.set_optimizer_groups(halved, {1, 0});
        }
        swapped.replay();
        // a change of groups during a capture is refused on every rank (it would be made at each replay)
        user.begin_capture();
        CHECK_THROWS_WITH_AS(dp.set_optimizer_groups(groups, {0, 0}),
                             doctest::Contains("set_optimizer_groups while the user's stream is capturing"),
                             tandem::error);
        // (so are the calls that wait on the host: "after a captured step the calls that wait on the host ...")
        (void)user.end_capture();
        CHECK(dp.optimizer_group(0) == 1);
        user.synchronize();
        CHECK(dp.last_step().step == 7);
      }
      user.synchronize();
      if (comm.rank() == 0) trained = problem.w;
    });
    std::filesystem::remove_all(dir);
    return trained;
  };
  for (const int world : {1, 2}) {
    CAPTURE(world);
    const std::vector<float> eager = train(world, false), replayed = train(world, true);
    CHECK(std::memcmp(eager.data(), replayed.data(), n * sizeof(float)) == 0);
  }
}

TEST_CASE_TEMPLATE(
    "a replay stale on one rank only (its step captured before the optimizer groups changed, the other rank's after) "
    "updates nothing on either rank, and every rank's report says so",
    Policy, tandem::Replicated, tandem::OptimizerSharded, tandem::GradientSharded) {
  // Each rank's stale lane rides the step's scalar all-reduce, so that the ranks reach one verdict: the rank whose own
  // step is current would otherwise update alone, and the ranks' parameters part.
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    TwoTensorSteps<Policy> t(comm, tandem::StepReport::deferred);
    auto& dp = t.dp;
    t.optimizer_step();
    const tandem::HostGraph before = t.capture();
    tandem::AdamWOptions other = dp.optimizer_options();
    other.lr = 5e-3f;
    dp.set_optimizer_groups({dp.optimizer_options(), other}, {0, 1});
    const tandem::HostGraph after = t.capture();
    t.user.synchronize();
    const std::vector<float> start = t.problem.w;
    (comm.rank() == 0 ? before : after).replay();
    t.user.synchronize();
    CHECK(start == t.problem.w);
    CHECK_THROWS_WITH_AS(dp.all_ranks_have_batch(tandem::Batch::available),
                         doctest::Contains("1 replay(s) of a step captured before the optimizer groups changed"),
                         tandem::error);
    after.replay();  // current on both ranks: it updates
    t.user.synchronize();
    CHECK(t.problem.w != start);
    const tandem::StepResult last = dp.last_step();
    CHECK(last.updated);
    CHECK(last.step == 2);
  });
}

TEST_CASE(
    "a step that reads its verdict (StepReport::at_step, two ranks) refuses a capture by name, and changes nothing") {
  // Before, its read failed inside the capture, and the state was left damaged (load a checkpoint).
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    TwoTensorSteps<tandem::Replicated> t(comm, tandem::StepReport::at_step);
    t.optimizer_step();
    t.user.begin_capture();
    t.launcher.launch(1, t.problem.gradient(), t.user.stream());
    CHECK_THROWS_WITH_AS(t.dp.step(),
                         doctest::Contains("step() while the user's stream is capturing: under "
                                           "StepReport::at_step"),
                         tandem::error);
    (void)t.user.end_capture();  // whole: no stream of tandem's joined it
    CHECK(t.dp.micro_step() == 0);
    t.optimizer_step();  // eager steps go on
    CHECK(t.dp.last_step().updated);
    CHECK(t.dp.step_count() == 2);
  });
}

TEST_CASE_TEMPLATE(
    "after a captured step the calls that wait on the host refuse the capture by name; it ends whole and its replay "
    "gives the bits of an eager step",
    Policy, tandem::Replicated, tandem::OptimizerSharded, tandem::GradientSharded) {
  // The captured step leaves tandem's streams joined to the capture until it ends, so a wait on them there fails.
  // Before, all_ranks_have_batch under StepReport::at_step and all_reduce_host went on, failed in the wait, and left a
  // stream joined that could not rejoin: the capture could not end. One rank steps under at_step (no clipping: its step
  // reads nothing, and is capturable), two under deferred.
  const std::string dir = test::temp_path("refused_after_capture");
  for (const int world : {1, 2}) {
    CAPTURE(world);
    std::vector<float> eager, replayed;
    tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
      for (const bool captured : {false, true}) {
        TwoTensorSteps<Policy> t(comm, world == 1 ? tandem::StepReport::at_step : tandem::StepReport::deferred);
        auto& dp = t.dp;
        t.optimizer_step();
        if (!captured) {
          t.optimizer_step();
        } else {
          t.user.begin_capture();
          t.optimizer_step();
          auto refused = [](auto call, const char* name) {
            CHECK_THROWS_WITH_AS(
                call(), doctest::Contains((std::string(name) + " while the user's stream is capturing").c_str()),
                tandem::error);
          };
          std::vector<double> loss{1.0};
          refused([&] { (void)dp.all_ranks_have_batch(tandem::Batch::available); }, "all_ranks_have_batch");
          refused([&] { dp.all_reduce_host(loss); }, "all_reduce_host");
          refused([&] { (void)dp.last_step(); }, "last_step()");
          refused([&] { dp.save_checkpoint(dir); }, "save_checkpoint");
          refused([&] { (void)dp.load_checkpoint(dir); }, "load_checkpoint");
          refused([&] { dp.set_optimizer_groups({dp.optimizer_options()}, {0, 0}); }, "set_optimizer_groups");
          CHECK(loss[0] == 1.0);
          const tandem::HostGraph graph = t.user.end_capture();
          graph.replay();
        }
        // between captures they go on
        CHECK(dp.all_ranks_have_batch(tandem::Batch::available));
        CHECK(dp.last_step().step == 2);
        t.user.synchronize();
        if (comm.rank() == 0) (captured ? replayed : eager) = t.problem.w;
      }
    });
    REQUIRE(eager.size() == TwoTensorSteps<Policy>::n);
    CHECK(std::memcmp(eager.data(), replayed.data(), eager.size() * sizeof(float)) == 0);
  }
  CHECK(!std::filesystem::exists(dir));
}

TEST_CASE_TEMPLATE(
    "a step that checks (two ranks, clipping, non-finite skip) is captured under StepReport::deferred and replays to "
    "the bits of eager steps, a skipped one too",
    Policy, tandem::Replicated, tandem::OptimizerSharded, tandem::GradientSharded) {
  // At two ranks with clipping and NonFinite::skip_step, StepReport::at_step reads the verdict back at every step, so
  // such a step cannot be captured; deferred, it reads nothing, and the device's verdict alone clips, skips or updates
  // in each replay. One replay's gradients hold a NaN (the target poisoned between replays): the device skips it, as
  // the eager run skips that step. The replayed parameters, the last step's norm and the counts must equal the eager
  // run's.
  constexpr std::size_t n = 3000;
  constexpr int steps = 6, poisoned = 3;
  struct Outcome {
    std::vector<float> w;
    tandem::StepResult last;
    std::uint64_t skipped = 0;
  };
  auto train = [&](bool captured) {
    std::vector<Outcome> out(2);
    tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
      QuadraticProblem problem(n);
      tandem::HostStream user;
      WaitCountingBackend backend;
      const std::shared_ptr<HostWaits> waits = backend.waits;
      tandem::DataParallel<Policy, tandem::AdamW, WaitCountingBackend> dp(
          comm, {{"w", problem.w.data(), problem.g.data(), n}}, {.lr = 1e-2f},
          {.bucket_cap_bytes = 4096,
           .max_grad_norm = 1.0f,
           .non_finite = tandem::NonFinite::skip_step,
           .step_report = captured ? tandem::StepReport::deferred : tandem::StepReport::at_step,
           .stream = user.stream()},
          std::move(backend));
      dp.broadcast_parameters();
      const tandem::StreamHostBackend launcher;
      auto optimizer_step = [&] {
        launcher.launch(1, problem.gradient(), user.stream());
        return dp.step();
      };
      const float target = problem.target[7];
      auto poison = [&](float value) {  // between steps: the user's stream has read the target it had
        user.synchronize();
        problem.target[7] = value;
      };
      if (captured) {  // the first step to sum the norm sizes the backend's scratch: refused in a capture
        user.begin_capture();
        launcher.launch(1, problem.gradient(), user.stream());
        CHECK_THROWS_WITH_AS(dp.step(),
                             doctest::Contains("step() while the user's stream is capturing: this is the first "
                                               "optimizer step to sum the gradients' norm"),
                             tandem::error);
        (void)user.end_capture();  // whole: no stream of tandem's joined it
        CHECK(dp.micro_step() == 0);
      }
      optimizer_step();  // step 0, eager in both runs
      if (!captured) {
        for (int s = 1; s < steps; ++s) {
          if (s == poisoned) poison(std::nanf(""));
          const tandem::StepResult r = optimizer_step();
          CHECK(r.skipped == (s == poisoned));
          if (s != poisoned) CHECK(r.clip_coefficient < 1.0f);  // clipping is active
          if (s == poisoned) poison(target);
        }
      } else {
        const int reads = waits->reads, synchronizes = waits->synchronizes, allocations = waits->allocations;
        user.begin_capture();
        CHECK(optimizer_step().pending);
        const tandem::HostGraph graph = user.end_capture();
        CHECK(waits->reads == reads);
        CHECK(waits->synchronizes == synchronizes);
        CHECK(waits->allocations == allocations);
        for (int s = 1; s < steps; ++s) {
          if (s == poisoned) poison(std::nanf(""));
          graph.replay();
          if (s == poisoned) poison(target);
        }
      }
      user.synchronize();
      Outcome& mine = out[static_cast<std::size_t>(comm.rank())];
      mine.last = dp.last_step();
      mine.skipped = dp.skipped_steps();
      mine.w = problem.w;
    });
    return out;
  };
  const std::vector<Outcome> eager = train(false), replayed = train(true);
  for (std::size_t r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(std::memcmp(eager[r].w.data(), replayed[r].w.data(), n * sizeof(float)) == 0);
    CHECK(eager[r].w == eager[0].w);
    for (const Outcome* o : {&eager[r], &replayed[r]}) {
      CHECK(o->last.updated);
      CHECK(o->last.step == static_cast<std::uint64_t>(steps - 1));  // one of the steps was skipped
      CHECK(o->skipped == 1);
      CHECK(o->last.clip_coefficient < 1.0f);
    }
    CHECK(std::memcmp(&eager[r].last.grad_norm, &replayed[r].last.grad_norm, sizeof(double)) == 0);
  }
  CHECK(eager[0].w != QuadraticProblem(n).w);
}

TEST_CASE_TEMPLATE(
    "deferred: options changed on one rank between replays are refused, and all_ranks_have_batch throws on every rank "
    "whichever ranks called last_step()",
    Policy, tandem::Replicated, tandem::GradientSharded) {
  // The options check all-reduces the lanes stored with the options (store_optimizer_options), not values fixed at
  // capture: a replay after rank 1 alone stored another lr is refused on the device, on both ranks. Rank 0 alone asks
  // last_step() and throws; the collective report then throws on both ranks, rank 0 included.
  constexpr std::size_t n = 3000;
  std::vector<std::string> at_last(2), at_batch(2);
  std::vector<std::vector<float>> before(2), after(2);
  std::vector<std::uint64_t> steps(2);
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    const auto rank = static_cast<std::size_t>(comm.rank());
    QuadraticProblem problem(n);
    tandem::HostStream user;
    tandem::DataParallel<Policy, tandem::AdamW, tandem::StreamHostBackend> dp(
        comm, {{"w", problem.w.data(), problem.g.data(), n}}, {.lr = 1e-2f},
        {.bucket_cap_bytes = 4096, .step_report = tandem::StepReport::deferred, .stream = user.stream()},
        tandem::StreamHostBackend{});
    dp.broadcast_parameters();
    const tandem::StreamHostBackend launcher;
    auto optimizer_step = [&] {
      launcher.launch(1, problem.gradient(), user.stream());
      dp.step();
    };
    auto set_lr = [&](float lr) {  // rank 1's lr; every rank stores its options
      if (rank == 1) dp.optimizer_options().lr = lr;
      dp.store_optimizer_options();
    };
    optimizer_step();  // step 1, eager
    user.begin_capture();
    optimizer_step();
    const tandem::HostGraph graph = user.end_capture();
    graph.replay();  // step 2
    user.synchronize();
    before[rank] = problem.w;
    set_lr(2e-2f);
    graph.replay();  // refused: the ranks' options differ
    user.synchronize();
    after[rank] = problem.w;
    if (rank == 0) {
      try {
        dp.last_step();
      } catch (const tandem::error& e) {
        at_last[rank] = e.what();
      }
    }
    try {
      dp.all_ranks_have_batch(tandem::Batch::available);
    } catch (const tandem::error& e) {
      at_batch[rank] = e.what();
    }
    set_lr(1e-2f);
    graph.replay();  // step 3: the same options again
    user.synchronize();
    steps[rank] = dp.last_step().step;
  });
  for (std::size_t r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(after[r] == before[r]);
    CHECK(steps[r] == 3);
    CHECK(at_batch[r].find("all_ranks_have_batch: the ranks' optimizer options differ at 1 optimizer step(s)") !=
          std::string::npos);
  }
  CHECK(at_last[0].find("last_step(): the ranks' optimizer options differ at 1 optimizer step(s)") !=
        std::string::npos);
  CHECK(at_last[1].empty());
}

TEST_CASE("last_step() reports no step before the first optimizer step and after a load, else the latest step") {
  constexpr std::size_t n = 100;
  const std::string dir = test::temp_path("last_step");
  tandem::LocalGroup(1).run([&](tandem::LocalComm& comm) {
    std::vector<float> w(n, 0.25f), g(n, 0.5f);  // the norm is sqrt(100 * 0.25) = 5, clipped to 1
    tandem::DataParallel<tandem::Replicated, tandem::AdamW> dp(
        comm, {{"w", w.data(), g.data(), n}}, {.lr = 1e-2f},
        {.max_grad_norm = 1.0f, .step_report = tandem::StepReport::deferred});
    dp.broadcast_parameters();
    const tandem::StepResult none = dp.last_step();
    CHECK((!none.updated && !none.skipped && !none.pending));
    CHECK(none.step == 0);
    const tandem::StepResult r = dp.step();
    CHECK((r.pending && !r.updated && r.step == 0));
    CHECK(dp.step_count() == 0);  // not reported yet
    const tandem::StepResult last = dp.last_step();
    CHECK((last.updated && !last.skipped && !last.pending));
    CHECK(last.step == 1);
    CHECK(last.grad_norm == 5.0);
    CHECK(last.clip_coefficient == static_cast<float>(1.0 / (5.0 + 1e-6)));
    CHECK(dp.step_count() == 1);
    dp.save_checkpoint(dir);
    dp.step();
    dp.load_checkpoint(dir);
    const tandem::StepResult loaded = dp.last_step();
    CHECK((!loaded.updated && !loaded.skipped));
    CHECK(loaded.step == 1);
    CHECK(std::isnan(loaded.grad_norm));
  });
  std::filesystem::remove_all(dir);
}

namespace {

/// GradientSharded with a reduce_gradients of its own that reduces in place only, and does not declare that it
/// honours BucketView::reduced.
struct InPlaceGradientSharded : tandem::ReduceEveryMicroStep, tandem::GatherAfterUpdate {
  static constexpr const char* name = "InPlaceGradientSharded";
  static constexpr tandem::StateSharding state = tandem::StateSharding::sharded;
  template <tandem::Communicator C>
  static void reduce_gradients(C& comm, const tandem::BucketView& b) {
    auto* base = static_cast<unsigned char*>(b.grad);
    comm.reduce_scatter(base, base + static_cast<std::size_t>(b.rank) * b.shard_size * tandem::dtype_size(b.grad_dtype),
                        b.shard_size, b.grad_dtype, tandem::ReduceOp::sum, b.stream);
  }
  template <tandem::Communicator C>
  static void gather_parameters(C& comm, const tandem::BucketView& b) {
    tandem::GradientSharded::gather_parameters(comm, b);
  }
  static tandem::Buffers buffers(const tandem::BufferInputs& in) { return tandem::GradientSharded::buffers(in); }
};

}  // namespace

TEST_CASE(
    "a policy that reduces every micro-step without declaring it honours BucketView::reduced is given none: it trains "
    "bit for bit as GradientSharded") {
  static_assert(tandem::honours_reduced<tandem::GradientSharded> && tandem::honours_reduced<tandem::ParameterSharded>);
  static_assert(!tandem::honours_reduced<InPlaceGradientSharded> && !tandem::honours_reduced<tandem::Replicated>);
  for (const int accumulation : {1, 2}) {
    for (const int world : {2, 3}) {
      CAPTURE(accumulation);
      CAPTURE(world);
      const Config c{.world = world, .accumulation = accumulation};
      CHECK(bitwise_equal(train_tandem<InPlaceGradientSharded, tandem::AdamW, float>(c, adamw_options),
                          train_tandem<tandem::GradientSharded, tandem::AdamW, float>(c, adamw_options)));
    }
  }
}

TEST_CASE("store_optimizer_options() validates the options it stores") {
  tandem::LocalGroup(1).run([&](tandem::LocalComm& comm) {
    std::vector<float> w(64, 1.0f), g(64, 0.0f);
    tandem::DataParallel<tandem::Replicated, tandem::AdamW> dp(comm, {{"w", w.data(), g.data(), w.size()}});
    dp.optimizer_options().lr = -1.0f;
    CHECK_THROWS_WITH_AS(dp.store_optimizer_options(), doctest::Contains("lr"), tandem::error);
  });
}

namespace {

/// Base, counting the pack table items it allocates (ResidentPackTables); the count outlives the move into
/// DataParallel.
template <class Base>
struct PackItemCounting : Base {
  std::shared_ptr<std::size_t> pack_items = std::make_shared<std::size_t>(0);
  template <class T>
  typename Base::template Buffer<T> allocate(std::size_t n) const {
    if constexpr (std::is_same_v<T, tandem::PackItem>) *pack_items += n;
    return Base::template allocate<T>(n);
  }
};
/// The host backend with CudaBackend's pack tables.
struct CudaTablesOnHost : tandem::HostBackend {
  static constexpr tandem::PackTableLayout pack_table_layout = tandem::cuda_pack_table_layout;
};

/// The pack table items a copy-mode DataParallel on `backend` allocates for tensors of these sizes; checks that two
/// SGD steps on it give the bits they give on HostBackend.
template <class Backend>
std::size_t pack_items_of(const std::vector<std::size_t>& sizes, Backend backend) {
  const std::shared_ptr<std::size_t> items = backend.pack_items;
  tandem::LocalGroup(1).run([&](tandem::LocalComm& comm) {
    Params w(sizes.size()), g(sizes.size()), w_plain, g_plain;
    for (std::size_t i = 0; i < sizes.size(); ++i)
      for (std::size_t e = 0; e < sizes[i]; ++e) w[i].push_back(0.01f * static_cast<float>((e * 7 + i) % 101));
    w_plain = w;
    g_plain = g;
    const Params start = w;
    auto refs = [&](Params& ws, Params& gs) {
      std::vector<tandem::TensorRef> r;
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        gs[i].assign(sizes[i], 0.0f);
        r.push_back({"t" + std::to_string(i), ws[i].data(), gs[i].data(), sizes[i]});
      }
      return r;
    };
    tandem::DataParallel<tandem::Replicated, tandem::SGD, Backend> dp(comm, refs(w, g), {.lr = 0.1f},
                                                                      {.bucket_cap_bytes = 8192}, std::move(backend));
    tandem::DataParallel<tandem::Replicated, tandem::SGD> plain(comm, refs(w_plain, g_plain), {.lr = 0.1f},
                                                                {.bucket_cap_bytes = 8192});
    for (int step = 1; step <= 2; ++step) {
      for (Params* gs : {&g, &g_plain})
        for (std::size_t i = 0; i < sizes.size(); ++i)
          for (std::size_t e = 0; e < sizes[i]; ++e)
            (*gs)[i][e] = 0.001f * static_cast<float>(static_cast<int>((e * 13 + i * 5 + step) % 17) - 8);
      dp.step();
      plain.step();
    }
    CHECK(w != start);  // trained
    CHECK(bitwise_equal(w, w_plain));
  });
  return *items;
}

}  // namespace

TEST_CASE(
    "copy mode's pack tables take the backend's items: two lists of 1024 elements on the host, one of 512 on "
    "CUDA's") {
  const std::vector<std::size_t> sizes{5000, 1, 511, 512, 513, 1023, 1024, 1025, 70000, 16};
  auto items = [&](std::size_t chunk) {
    std::size_t n = 0;
    for (const std::size_t s : sizes) n += (s + chunk - 1) / chunk;
    return n;
  };
  // Two tables, the parameters' and the gradients', each covering every tensor.
  CHECK(pack_items_of(sizes, PackItemCounting<tandem::HostBackend>{}) == 2 * 2 * items(1024));
  CHECK(pack_items_of(sizes, PackItemCounting<CudaTablesOnHost>{}) == 2 * items(512));
}
