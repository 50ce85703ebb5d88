// SPDX-License-Identifier: Apache-2.0
// memory_report() (counted from the actual allocations) equals each policy's formula (docs/design.md), written
// here from the plan's sizes, and the pack tables' written out from the tensors' (in the streams build, for
// CudaBackend's layout), and estimate_memory (which allocates nothing) equals both, for the test model at world sizes
// 1-4, fp32 and bf16, copy and zero-copy storage; and the estimator reproduces the ZeRO paper's table.
#include <doctest/doctest.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "../examples/mlp/mlp.hpp"
#include "support/backend.hpp"
#include "tandem/tandem.hpp"

namespace {

const std::vector<int> dims = {13, 37, 29, 23, 19, 7};

enum class Mode { copy, owned };

// The pack tables of copy mode, written out: for the parameters and for the gradients, a 16-byte item per chunk of
// each tensor in each of the backend's lists (two on the host, one on CUDA), and a 24-byte record per tensor.
std::size_t pack_tables(const std::vector<tandem::TensorSpec>& specs, tandem::PackTableLayout layout) {
  std::size_t bytes = 0;
  for (const tandem::TensorSpec& t : specs) {
    std::size_t chunks = 0;
    for (std::size_t at = 0; at < t.numel; at += layout.chunk_elements) ++chunks;
    bytes += (layout.ordered ? 2 : 1) * 16 * chunks + 24;
  }
  return 2 * bytes;
}

// The formulas of docs/design.md: Ψ elements of p bytes; F, S, M from the plan; k optimizer states.
// K: the reused gradient bucket buffers of GradientSharded with owned storage.
template <class Policy>
tandem::MemoryReport formula(const tandem::Plan& plan, std::size_t psi, std::size_t p, std::size_t k, Mode mode,
                             std::size_t K, std::size_t tables) {
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
    r.pack_tables = tables;
  } else {
    r.params = p * F;
    r.grads = zero2 ? 4 * S : 4 * F;  // ZeRO-2 keeps only the reduced shard across the step
    r.buckets = zero2 ? 4 * K * M : 0;
  }
  return r;
}

template <class Policy, class T>
void check(int world, Mode mode, int gradient_buffers) {
  tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<T> model(dims, 1);
    std::vector<tandem::TensorRef> refs = model.tensors();
    std::vector<tandem::TensorSpec> specs;
    std::size_t psi = 0;
    for (const auto& r : refs) {
      psi += r.numel;
      specs.push_back({r.name, r.numel, r.dtype});
    }
    const tandem::DataParallelOptions options{
        .bucket_cap_bytes = 3000, .first_bucket_cap_bytes = 1000, .gradient_buffers = gradient_buffers};
    const tandem::Storage storage = mode == Mode::copy ? tandem::Storage::user : tandem::Storage::owned;
    const tandem::PackTableLayout layout = tandem::pack_table_layout_of<test::Backend>();
    const tandem::MemoryReport estimate =
        tandem::estimate_memory<Policy, tandem::AdamW>(specs, world, storage, {}, options, layout);
    auto verify = [&](const auto& dp) {
      const tandem::Plan& plan = dp.plan();
      CHECK(plan.num_buckets() > 2);
      CHECK(plan.total_size() >= psi);
      CHECK(plan.total_size() % static_cast<std::size_t>(world) == 0);
      CHECK(plan.total_shard_size() * static_cast<std::size_t>(world) == plan.total_size());
      const tandem::MemoryReport report = dp.memory_report();
      CHECK(report == formula<Policy>(plan, psi, sizeof(T), 2, mode, static_cast<std::size_t>(gradient_buffers),
                                      pack_tables(specs, layout)));
      CHECK(report == estimate);
    };
    if (mode == Mode::copy)
      verify(test::DataParallel<Policy, tandem::AdamW>(comm, refs, {}, options));
    else
      verify(test::DataParallel<Policy, tandem::AdamW>(comm, specs, {}, options));
  });
}

}  // namespace

TEST_CASE_TEMPLATE("memory_report equals the policy's formula and the estimator", Policy, tandem::Replicated,
                   tandem::OptimizerSharded, tandem::GradientSharded) {
  for (int world = 1; world <= 4; ++world)
    for (Mode mode : {Mode::copy, Mode::owned}) {
      CAPTURE(world);
      check<Policy, float>(world, mode, 2);
      check<Policy, tandem::BFloat16>(world, mode, world == 3 ? 1 : 3);
    }
}

TEST_CASE("the estimator rejects what a construction rejects") {
  const std::vector<tandem::TensorSpec> specs = {{"w", 10, tandem::DType::bf16}, {"b", 3, tandem::DType::fp32}};
  CHECK_THROWS_WITH_AS((tandem::estimate_memory<tandem::Replicated, tandem::AdamW>(specs, 2, tandem::Storage::user)),
                       doctest::Contains("use one DataParallel per parameter dtype"), tandem::error);
  const std::vector<tandem::TensorSpec> one = {{"w", 10, tandem::DType::fp32}};
  CHECK_THROWS_WITH_AS((tandem::estimate_memory<tandem::Replicated, tandem::AdamW>(one, 0, tandem::Storage::user)),
                       doctest::Contains("world_size is 0"), tandem::error);
  CHECK_THROWS_WITH_AS((tandem::estimate_memory<tandem::GradientSharded, tandem::AdamW>(one, 2, tandem::Storage::owned,
                                                                                        {}, {.gradient_buffers = 0})),
                       doctest::Contains("gradient_buffers is 0"), tandem::error);
  CHECK_THROWS_AS((tandem::estimate_memory<tandem::Replicated, tandem::AdamW>({}, 2, tandem::Storage::user)),
                  tandem::error);
  for (const std::size_t chunk : {std::size_t{0}, std::size_t{24}})  // a pack table layout no backend can have
    for (const tandem::Storage storage : {tandem::Storage::user, tandem::Storage::owned})
      CHECK_THROWS_WITH_AS((tandem::estimate_memory<tandem::Replicated, tandem::AdamW>(
                               one, 2, storage, {}, {}, {.chunk_elements = chunk, .ordered = false})),
                           doctest::Contains("it must be a positive multiple of 16"), tandem::error);
}

// The plan bounds elements (2^62 of padded flat space), not bytes: a layout of millions of tensors at 2^31 ranks pads
// its buckets to where several fp32 arrays of them pass 2^64 bytes, which wrapped to a small total before.
TEST_CASE("memory_of refuses a report past what 64 bits count, by product or by sum, and gives the exact bytes below") {
  const tandem::Plan plan({10}, tandem::PlanOptions{});
  const tandem::BufferInputs in{.plan = plan, .storage = tandem::Storage::owned};
  const std::size_t quarter = std::size_t{1} << 62;  // 2^62 elements: 2^64 bytes of fp32
  const auto refuses = [&](const tandem::Buffers& b, std::size_t state_count) {
    CHECK_THROWS_WITH_AS(tandem::memory_of(b, in, 10, state_count), doctest::Contains("is past what 64 bits count"),
                         tandem::error);
  };
  refuses({.master = quarter}, 0);                                                            // one array's bytes
  refuses({.state = quarter / 2}, 2);                                                         // state_count x state x 4
  refuses({.grad_slots = 4, .grad_slot_size = quarter / 4}, 0);                               // slots x slot size x 4
  refuses({.master = quarter / 2, .state = quarter / 4}, 2);                                  // the total: 2^63 + 2^63
  refuses({.param_flat = quarter / 2, .grad_flat = quarter / 4, .staging = quarter / 4}, 0);  // params + grads
  const tandem::MemoryReport r = tandem::memory_of({.master = quarter / 4, .state = quarter / 8}, in, 10, 2);
  CHECK(r.master_weights == quarter);
  CHECK(r.optimizer_state == quarter);
  CHECK(r.total() == 2 * quarter);
}

// The ZeRO paper's table (Rajbhandari et al. 2020, Figure 1): Psi = 7.5e9 parameters, N = 64, 16-bit parameters and
// gradients, fp32 master weights and Adam moments. Model states per device: 120, 31.4, 16.6 GB. tandem's owned
// storage keeps the reduced gradient shard in fp32 (4 Psi / N rather than 2 Psi / N), so its ZeRO-2 figure is
// 2 Psi + 16 Psi / N = 16.9 GB, 1.7% above the paper's; the user's storage keeps the user's 16-bit gradients.
TEST_CASE("the estimator reproduces the ZeRO paper's model states within 2%") {
  const std::size_t psi = 7'500'000'000;
  std::vector<tandem::TensorSpec> specs;
  for (std::size_t left = psi, i = 0; left > 0; ++i) {  // 2^24-element tensors, the last one smaller
    const std::size_t n = std::min<std::size_t>(left, std::size_t{1} << 24);
    specs.push_back({"t" + std::to_string(i), n, tandem::DType::bf16});
    left -= n;
  }
  auto gb = [&](auto policy, tandem::Storage storage) {
    using P = decltype(policy);
    return static_cast<double>(tandem::estimate_memory<P, tandem::AdamW>(specs, 64, storage).model_states()) / 1e9;
  };
  CHECK(gb(tandem::Replicated{}, tandem::Storage::user) == doctest::Approx(120.0).epsilon(0.02));
  CHECK(gb(tandem::OptimizerSharded{}, tandem::Storage::user) == doctest::Approx(31.4).epsilon(0.02));
  CHECK(gb(tandem::GradientSharded{}, tandem::Storage::owned) == doctest::Approx(16.6).epsilon(0.02));
  // Exactly the closed forms, up to the padding of each bucket to 64 x 128 bytes.
  const double p = static_cast<double>(psi);
  CHECK(gb(tandem::GradientSharded{}, tandem::Storage::owned) == doctest::Approx((2 * p + 16 * p / 64) / 1e9));
  // ParameterSharded: 18 Psi / N = 2.11 GB against the paper's 1.9 (16 Psi / N), for the same fp32 shard: 12% over.
  CHECK(gb(tandem::ParameterSharded{}, tandem::Storage::owned) == doctest::Approx(18 * p / 64 / 1e9));
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
