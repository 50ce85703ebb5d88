// SPDX-License-Identifier: Apache-2.0
// grad_ready(i), the overlap hook: on the host backend it issues a complete bucket's pack and collective at once
// (on CUDA, on the work stream behind an event). Whatever subset of tensors is announced, in whatever order on
// each rank, training must end bit for bit where step() alone ends; misuse is rejected with a message.
#include <doctest/doctest.h>

#include <algorithm>
#include <mutex>
#include <numeric>
#include <random>
#include <vector>

#include "support/backend.hpp"
#include "support/params.hpp"
#include "tandem/tandem.hpp"

namespace {

// Odd sizes, an empty tensor, small buckets: many buckets, tensors straddling shards.
const std::vector<std::size_t> sizes = {37, 1, 0, 300, 129, 64, 5, 1000, 17};

enum class Announce { none, all_shuffled, some_shuffled };

template <class Policy>
std::vector<std::vector<float>> train(int world, int accumulation, Announce announce) {
  std::vector<std::vector<float>> result;
  std::mutex m;
  tandem::LocalGroup group(world);
  group.run([&](tandem::LocalComm& comm) {
    std::vector<std::vector<float>> params(sizes.size()), grads(sizes.size());
    std::vector<tandem::TensorRef> refs;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      params[i].assign(sizes[i], 0.0f);
      grads[i].assign(sizes[i], 0.0f);
      for (std::size_t e = 0; e < sizes[i]; ++e) params[i][e] = 0.01f * static_cast<float>((e * 7 + i) % 13);
      refs.push_back({"t" + std::to_string(i), params[i].data(), grads[i].data(), sizes[i], tandem::DType::fp32});
    }
    test::DataParallel<Policy, tandem::AdamW> dp(comm, refs, {.lr = 1e-2f},
                                                 {.bucket_cap_bytes = 1024,
                                                  .first_bucket_cap_bytes = 512,
                                                  .accumulation_steps = accumulation,
                                                  .max_grad_norm = 0.5f});
    dp.broadcast_parameters();
    std::mt19937 rng(1234u + static_cast<unsigned>(comm.rank()));  // every rank announces in its own order
    for (int step = 0; step < 6 * accumulation; ++step) {
      for (std::size_t i = 0; i < sizes.size(); ++i)
        for (std::size_t e = 0; e < sizes[i]; ++e)
          grads[i][e] =
              std::sin(0.1f * static_cast<float>(e + 3 * i + 17 * step + 101 * comm.rank())) + 0.05f * params[i][e];
      std::vector<std::size_t> order(sizes.size());
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      if (announce == Announce::some_shuffled) order.resize(rng() % order.size());
      if (announce != Announce::none)
        for (std::size_t i : order) dp.grad_ready(i);
      const tandem::StepResult r = dp.step();
      REQUIRE(r.updated == ((step + 1) % accumulation == 0));
    }
    if (comm.rank() == world - 1) {
      std::lock_guard lock(m);
      result = params;
    }
  });
  return result;
}

template <class Policy>
void check_policy() {
  for (int world : {1, 2, 3}) {
    for (int accumulation : {1, 2}) {
      CAPTURE(world);
      CAPTURE(accumulation);
      const auto plain = train<Policy>(world, accumulation, Announce::none);
      for (Announce a : {Announce::all_shuffled, Announce::some_shuffled}) {
        const auto got = train<Policy>(world, accumulation, a);
        CHECK(test::bitwise_equal(got, plain));
      }
    }
  }
}

}  // namespace

TEST_CASE_TEMPLATE("grad_ready in any order on each rank ends bit for bit where step() alone does", Policy,
                   tandem::Replicated, tandem::OptimizerSharded, tandem::GradientSharded) {
  check_policy<Policy>();
}

TEST_CASE("grad_ready rejects an index out of range and a tensor announced twice") {
  tandem::LocalGroup group(1);
  group.run([&](tandem::LocalComm& comm) {
    std::vector<float> p(10, 1.0f), g(10, 0.5f), p2(3, 1.0f), g2(3, 0.5f);
    test::DataParallel<tandem::Replicated, tandem::SGD> dp(comm, {{"a", p.data(), g.data(), 10, tandem::DType::fp32},
                                                                  {"b", p2.data(), g2.data(), 3, tandem::DType::fp32}});
    CHECK_THROWS_WITH_AS(dp.grad_ready(2), doctest::Contains("out of range"), tandem::error);
    dp.grad_ready(1);
    CHECK_THROWS_WITH_AS(dp.grad_ready(1), doctest::Contains("twice"), tandem::error);
    dp.step();
    dp.grad_ready(1);  // a new micro-step: allowed again
    dp.grad_ready(0);
    CHECK(dp.step().updated);
  });
}

TEST_CASE("grad_ready after the tensor's GradientBucket was released says so, rather than 'twice'") {
  tandem::LocalGroup(1).run([&](tandem::LocalComm& comm) {
    test::DataParallel<tandem::Replicated, tandem::SGD> dp(
        comm, std::vector<tandem::TensorSpec>{{"a", 10, tandem::DType::fp32}, {"b", 3, tandem::DType::fp32}}, {});
    dp.broadcast_parameters();
    { auto bucket = dp.gradients(0); }
    CHECK_THROWS_WITH_AS(dp.grad_ready(1),
                         doctest::Contains("grad_ready(1) after bucket 0's GradientBucket was released in this "
                                           "micro-step"),
                         tandem::error);
    CHECK(dp.step().updated);
  });
}
