// SPDX-License-Identifier: Apache-2.0
// memory_report() (counted from the actual allocations) equals each policy's formula (docs/design.md) for
// the test model at world sizes 1-4, fp32 and bf16, copy and zero-copy storage.
#include <doctest/doctest.h>

#include <mutex>
#include <vector>

#include "../examples/mlp/mlp.hpp"
#include "support/backend.hpp"
#include "tandem/tandem.hpp"

namespace {

const std::vector<int> dims = {13, 37, 29, 23, 19, 7};

enum class Mode { copy, owned };

// The formulas of docs/design.md: Ψ elements of p bytes; F, S, M from the plan; k optimizer states.
template <class Policy>
tandem::MemoryReport formula(const tandem::Plan& plan, std::size_t psi, std::size_t p, std::size_t k, Mode mode) {
  const std::size_t F = plan.total_size(), S = plan.total_shard_size(), M = plan.max_bucket_size();
  const bool sharded_state = Policy::state == tandem::StateSharding::sharded;
  const bool zero2 = Policy::reduction == tandem::GradientReduction::every_micro_step;
  const std::size_t owned = sharded_state ? S : F;
  tandem::MemoryReport r;
  r.master_weights = p == 4 ? 0 : 4 * owned;
  r.optimizer_state = 4 * k * owned;
  if (mode == Mode::copy) {
    r.params = psi * p;
    r.grads = psi * p;
    r.buckets = p * F + (zero2 ? 4 * M + 4 * S : 4 * F);
  } else {
    r.params = p * F;
    r.grads = 4 * F;
    r.buckets = zero2 ? 4 * S : 0;
  }
  return r;
}

template <class Policy, class T>
void check(int world, Mode mode) {
  tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<T> model(dims, 1);
    std::vector<tandem::TensorRef> refs = model.tensors();
    std::size_t psi = 0;
    for (const auto& r : refs) psi += r.numel;
    const tandem::DataParallelOptions options{.bucket_cap_bytes = 3000, .first_bucket_cap_bytes = 1000};
    auto verify = [&](const auto& dp) {
      const tandem::Plan& plan = dp.plan();
      CHECK(plan.total_size() >= psi);
      CHECK(plan.total_size() % static_cast<std::size_t>(world) == 0);
      CHECK(plan.total_shard_size() * static_cast<std::size_t>(world) == plan.total_size());
      CHECK(dp.memory_report() == formula<Policy>(plan, psi, sizeof(T), 2, mode));
    };
    if (mode == Mode::copy) {
      verify(test::DataParallel<Policy, tandem::AdamW>(comm, refs, {}, options));
    } else {
      std::vector<tandem::TensorSpec> specs;
      for (const auto& r : refs) specs.push_back({r.name, r.numel, r.dtype});
      verify(test::DataParallel<Policy, tandem::AdamW>(comm, specs, {}, options));
    }
  });
}

}  // namespace

TEST_CASE_TEMPLATE("memory_report equals the policy's formula", Policy, tandem::Replicated, tandem::OptimizerSharded,
                   tandem::GradientSharded) {
  for (int world = 1; world <= 4; ++world)
    for (Mode mode : {Mode::copy, Mode::owned}) {
      CAPTURE(world);
      check<Policy, float>(world, mode);
      check<Policy, tandem::BFloat16>(world, mode);
    }
}

TEST_CASE("sharding shrinks what the formulas say it shrinks (many buckets: staging is one bucket, not all)") {
  auto report = [](auto policy, int world) {
    using P = decltype(policy);
    tandem::MemoryReport out;
    std::mutex m;
    tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
      mlp::Mlp<tandem::BFloat16> model(dims, 1);
      test::DataParallel<P, tandem::AdamW> dp(comm, model.tensors(), {},
                                              {.bucket_cap_bytes = 600, .first_bucket_cap_bytes = 600});
      CHECK(dp.plan().num_buckets() > 8);
      std::lock_guard lock(m);
      out = dp.memory_report();
    });
    return out;
  };
  const auto ddp = report(tandem::Replicated{}, 4), z1 = report(tandem::OptimizerSharded{}, 4),
             z2 = report(tandem::GradientSharded{}, 4);
  CHECK(z1.optimizer_state * 4 == ddp.optimizer_state);
  CHECK(z1.master_weights * 4 == ddp.master_weights);
  CHECK(z2.optimizer_state == z1.optimizer_state);
  CHECK(z2.buckets < z1.buckets);
  CHECK(z2.total() < z1.total());
  CHECK(z1.total() < ddp.total());
}
