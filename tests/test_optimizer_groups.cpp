// SPDX-License-Identifier: Apache-2.0
// Per-tensor optimizer options (set_optimizer_groups, torch's parameter groups): tensors in a group without weight
// decay, or with another learning rate, are updated with those options, under every policy and both storage modes,
// at world sizes 1-3 (buckets small enough that groups change inside buckets and shards). Checked against AdamW
// written out in double with plain loops; groups that all equal the base options give bitwise the run without groups
// (the update's cut into segments changes no bit); every wrong argument, and ranks that disagree, are errors on
// every rank that leave the groups as they were.
#include <doctest/doctest.h>

#include <cmath>
#include <mutex>
#include <string>
#include <vector>

#include "support/backend.hpp"
#include "support/comm.hpp"
#include "support/params.hpp"
#include "tandem/tandem.hpp"

namespace {

using test::Params;

const std::vector<tandem::TensorSpec> specs = {{"w0", 300}, {"b0", 37},   {"ln.w", 64}, {"w1", 411},
                                               {"b1", 5},   {"ln.b", 64}, {"w2", 129}};
const std::vector<std::size_t> group_of = {0, 1, 2, 0, 1, 2, 0};  // weights, biases (no decay), norms (half lr)
constexpr int steps = 5;

const tandem::AdamWOptions base{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-8f, .weight_decay = 0.1f};
const tandem::AdamWOptions no_decay{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-8f, .weight_decay = 0.0f};
const tandem::AdamWOptions half_lr{.lr = 5e-3f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-8f, .weight_decay = 0.1f};

tandem::DataParallelOptions small_buckets() { return {.bucket_cap_bytes = 1024, .first_bucket_cap_bytes = 512}; }

float initial(std::size_t i, std::size_t e) { return std::sin(0.37f * static_cast<float>(e) + static_cast<float>(i)); }
float gradient(int rank, int step, std::size_t i, std::size_t e) {
  return std::cos(0.11f * static_cast<float>(e * (i + 1)) + 0.7f * static_cast<float>(step) +
                  1.3f * static_cast<float>(rank));
}

/// A change of group 1's options before step `at` (none where `at` is 0).
struct Switch {
  int at = 0;
  tandem::AdamWOptions to{};
};

/// AdamW (torch's formulas) in double over the ranks' mean gradient, each tensor with its group's options (group 1's
/// replaced from step `change.at` on).
Params reference(int world, const std::vector<tandem::AdamWOptions>& groups, const std::vector<std::size_t>& of,
                 Switch change = {}) {
  Params out;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    std::vector<double> p(specs[i].numel), m(p.size(), 0.0), v(p.size(), 0.0);
    for (std::size_t e = 0; e < p.size(); ++e) p[e] = initial(i, e);
    for (int t = 1; t <= steps; ++t) {
      const tandem::AdamWOptions& o = change.at != 0 && t >= change.at && of[i] == 1 ? change.to : groups[of[i]];
      const double bc1 = 1.0 - std::pow(double{o.beta1}, t), bc2 = 1.0 - std::pow(double{o.beta2}, t);
      for (std::size_t e = 0; e < p.size(); ++e) {
        double g = 0.0;
        for (int r = 0; r < world; ++r) g += gradient(r, t, i, e);
        g /= world;
        p[e] *= 1.0 - double{o.lr} * o.weight_decay;
        m[e] = o.beta1 * m[e] + (1.0 - o.beta1) * g;
        v[e] = o.beta2 * v[e] + (1.0 - o.beta2) * g * g;
        p[e] -= o.lr / bc1 * m[e] / (std::sqrt(v[e]) / std::sqrt(bc2) + o.eps);
      }
    }
    out.emplace_back(p.begin(), p.end());
  }
  return out;
}

/// `steps` AdamW steps at `world` ranks with these groups (none: no set_optimizer_groups), group 1's options set to
/// `change.to` by optimizer_options(1) before step `change.at`; rank 0's parameters.
template <class Policy>
Params train(int world, bool owned, const std::vector<tandem::AdamWOptions>& groups, const std::vector<std::size_t>& of,
             Switch change = {}) {
  Params result;
  std::mutex m;
  tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
    const int r = comm.rank();
    Params mine(specs.size());
    auto run = [&](auto& dp, auto write_grads, auto read_params) {
      if (!groups.empty()) dp.set_optimizer_groups(groups, of);
      for (int t = 1; t <= steps; ++t) {
        if (t == change.at) dp.optimizer_options(1) = change.to;
        write_grads(t);
        dp.step();
      }
      read_params();
    };
    if (owned) {
      test::DataParallel<Policy, tandem::AdamW> dp(comm, specs, base, small_buckets());
      dp.template initialize_parameters<float>([](std::size_t i, float* values) {
        for (std::size_t e = 0; e < specs[i].numel; ++e) values[e] = initial(i, e);
      });
      run(
          dp,
          [&](int t) {
            for (std::size_t b = 0; b < dp.num_buckets(); ++b) {
              auto grads = dp.gradients(b);
              for (std::size_t i : grads.tensors())
                for (std::size_t e = 0; e < specs[i].numel; ++e) grads.grad(i)[e] = gradient(r, t, i, e);
            }
          },
          [&] {
            for (std::size_t b = 0; b < dp.num_buckets(); ++b) {
              auto params = dp.parameters(b);
              for (std::size_t i : params.tensors())
                mine[i].assign(params.template param<float>(i), params.template param<float>(i) + specs[i].numel);
            }
          });
    } else if constexpr (tandem::parameter_sharding_of<Policy> == tandem::ParameterSharding::replicated) {
      Params grads(specs.size());
      std::vector<tandem::TensorRef> refs;
      for (std::size_t i = 0; i < specs.size(); ++i) {
        for (std::size_t e = 0; e < specs[i].numel; ++e) mine[i].push_back(initial(i, e));
        grads[i].resize(specs[i].numel);
        refs.push_back({specs[i].name, mine[i].data(), grads[i].data(), specs[i].numel});
      }
      test::DataParallel<Policy, tandem::AdamW> dp(comm, refs, base, small_buckets());
      run(
          dp,
          [&](int t) {
            for (std::size_t i = 0; i < specs.size(); ++i)
              for (std::size_t e = 0; e < specs[i].numel; ++e) grads[i][e] = gradient(r, t, i, e);
          },
          [] {});
    }
    const std::lock_guard lock(m);
    if (r == 0) result = std::move(mine);
  });
  return result;
}

template <class Policy>
void check_policy(bool owned) {
  const std::vector<tandem::AdamWOptions> groups = {base, no_decay, half_lr};
  for (int world = 1; world <= 3; ++world) {
    CAPTURE(world);
    const Params got = train<Policy>(world, owned, groups, group_of);
    CHECK(test::max_relative_error(got, reference(world, groups, group_of)) < 1e-5);
    // The groups did something: every tensor out of group 0 is far from what the base options give it.
    const Params all_base = reference(world, {base}, std::vector<std::size_t>(specs.size(), 0));
    for (std::size_t i = 0; i < specs.size(); ++i)
      if (group_of[i] != 0) CHECK(test::max_relative_error({got[i]}, {all_base[i]}) > 1e-4);
    // Groups equal to the base options, cut anywhere: the bits of no groups at all.
    CHECK(test::bitwise_equal(train<Policy>(world, owned, {base, base, base}, group_of),
                              train<Policy>(world, owned, {}, {})));
  }
}

std::vector<std::string> messages_of(int world, const std::function<void(tandem::LocalComm&)>& f) {
  std::vector<std::string> out(static_cast<std::size_t>(world));
  tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
    out[static_cast<std::size_t>(comm.rank())] = test::message_of([&] { f(comm); });
  });
  return out;
}

}  // namespace

TEST_CASE("optimizer groups: per-tensor options match AdamW written out in double, under every policy") {
  check_policy<tandem::Replicated>(true);
  check_policy<tandem::OptimizerSharded>(true);
  check_policy<tandem::GradientSharded>(true);
  check_policy<tandem::ParameterSharded>(true);
  check_policy<tandem::Replicated>(false);
  check_policy<tandem::OptimizerSharded>(false);
  check_policy<tandem::GradientSharded>(false);
}

TEST_CASE("optimizer groups: optimizer_options(g) changes one group between steps") {
  // Group 1 (the biases, without decay) gets group 0's options from step 3 on: from then on its tensors follow group
  // 0's rule, as the double reference switched at the same step, and end far from where no switch leaves them.
  const std::vector<tandem::AdamWOptions> groups = {base, no_decay, half_lr};
  for (bool owned : {true, false}) {
    CAPTURE(owned);
    const Params got = train<tandem::GradientSharded>(2, owned, groups, group_of, {.at = 3, .to = base});
    CHECK(test::max_relative_error(got, reference(2, groups, group_of, {.at = 3, .to = base})) < 1e-5);
    const Params unswitched = reference(2, groups, group_of);
    for (std::size_t i = 0; i < specs.size(); ++i) {
      CAPTURE(i);
      if (group_of[i] == 1) CHECK(test::max_relative_error({got[i]}, {unswitched[i]}) > 1e-4);
      if (group_of[i] != 1) CHECK(test::max_relative_error({got[i]}, {unswitched[i]}) < 1e-5);
    }
  }
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    test::DataParallel<tandem::GradientSharded, tandem::AdamW> dp(comm, specs, base, small_buckets());
    dp.template initialize_parameters<float>([](std::size_t, float*) {});
    dp.set_optimizer_groups({base, no_decay}, {0, 1, 1, 0, 1, 1, 0});
    CHECK(dp.optimizer_group_count() == 2);
    CHECK(dp.optimizer_options(1).weight_decay == 0.0f);
    dp.optimizer_options(1).weight_decay = 0.1f;
    CHECK(dp.optimizer_options(1).weight_decay == 0.1f);
    dp.optimizer_options(1).lr = -1.0f;
    CHECK(test::message_of([&] { dp.step(); }) ==
          "tandem: step(): AdamWOptions::lr is -1; it must be finite and >= 0 (optimizer group 1)");
    CHECK(test::message_of([&] { dp.store_optimizer_options(); }) ==
          "tandem: store_optimizer_options(): AdamWOptions::lr is -1; it must be finite and >= 0 (optimizer group 1)");
    CHECK(test::message_of([&] { dp.optimizer_options(2); }) ==
          "tandem: optimizer_options(2): there are 2 optimizer groups (set_optimizer_groups)");
  });
}

TEST_CASE("optimizer groups: wrong arguments and disagreeing ranks throw on every rank and change nothing") {
  auto with_dp = [](auto f) {
    return [f](tandem::LocalComm& comm) {
      test::DataParallel<tandem::OptimizerSharded, tandem::SGD> dp(comm, specs, {.lr = 0.1f}, small_buckets());
      dp.template initialize_parameters<float>([](std::size_t, float*) {});
      try {
        f(comm, dp);
      } catch (...) {
        CHECK(dp.optimizer_group_count() == 1);  // unchanged
        dp.step();                               // and usable
        throw;
      }
    };
  };
  const std::vector<std::size_t> two(specs.size(), 1);
  const std::vector<std::pair<std::function<void(tandem::LocalComm&)>, std::string>> cases = {
      {with_dp([](auto&, auto& dp) { dp.set_optimizer_groups({}, {}); }), "no groups; give at least one"},
      {with_dp([](auto&, auto& dp) {
         dp.set_optimizer_groups({{.lr = 0.1f}}, {0, 0});
       }),
       "2 group indices for 7 tensors"},
      {with_dp([&](auto&, auto& dp) { dp.set_optimizer_groups({{.lr = 0.1f}}, two); }),
       "tensor 0 (`w0`) is in group 1 of 1"},
      {with_dp([&](auto&, auto& dp) {
         dp.set_optimizer_groups({{.lr = 0.1f}, {.lr = -2.0f}}, two);
       }),
       "tandem: set_optimizer_groups: SGDOptions::lr is -2; it must be finite and >= 0 (optimizer group 1)"},
      {with_dp([&](auto&, auto& dp) {  // of two new groups, group 0 is named too
         dp.set_optimizer_groups({{.lr = -2.0f}, {.lr = 0.1f}}, two);
       }),
       "tandem: set_optimizer_groups: SGDOptions::lr is -2; it must be finite and >= 0 (optimizer group 0)"},
      {with_dp([&](auto&, auto& dp) {
         dp.set_optimizer_groups({{.lr = 0.1f}, {.lr = 0.1f, .momentum = 0.9f}}, two);
       }),
       "tandem: set_optimizer_groups: the SGD options of optimizer group 1 need 1 state buffers"},
      // One rank's arguments are wrong: every rank throws that rank's message.
      {with_dp([&](auto& comm, auto& dp) {
         dp.set_optimizer_groups({{.lr = 0.1f}}, std::vector<std::size_t>(comm.rank() == 1 ? 0 : specs.size(), 0));
       }),
       "0 group indices for 7 tensors"},
      {with_dp([&](auto& comm, auto& dp) {
         dp.set_optimizer_groups({{.lr = 0.1f}, {.lr = comm.rank() == 0 ? 0.1f : 0.2f}}, two);
       }),
       "ranks 0 and 1 passed different groups or assignments"},
  };
  for (const auto& [f, expected] : cases) {
    CAPTURE(expected);
    for (const std::string& m : messages_of(2, f)) CHECK(m.find(expected) != std::string::npos);
  }
}
