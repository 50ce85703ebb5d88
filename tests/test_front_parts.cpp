// SPDX-License-Identifier: Apache-2.0
// The parts DataParallel is made of (front/detail/), each alone, without a DataParallel: TrainingState allocates what
// a policy's buffer rule asks for and nothing else, zeroed; BucketKernels launches the bodies of the dtypes it was made
// for (checked against plain loops over the same values); the configuration words tell every difference between ranks
// apart; the user's buffers are validated; in checkpoint I/O each rank writes its shard of every array and gets
// rank back what it keeps, at world sizes 1-3, through valid safetensors files.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <new>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "support/comm.hpp"
#include "tandem/backend/host.hpp"
#include "tandem/backend/host_stream.hpp"
#include "tandem/comm/local_group.hpp"
#include "tandem/front/data_parallel.hpp"
#include "tandem/front/detail/agreement.hpp"
#include "tandem/front/detail/bucket_kernels.hpp"
#include "tandem/front/detail/checkpoint_io.hpp"
#include "tandem/front/detail/step_control.hpp"
#include "tandem/front/detail/training_state.hpp"
#include "tandem/front/detail/validation.hpp"
#include "tandem/front/estimate.hpp"
#include "tandem/kernels/adamw.hpp"
#include "tandem/kernels/detail/word_agreement.hpp"
#include "tandem/kernels/sgd.hpp"
#include "tandem/policy/gradient_sharded.hpp"
#include "tandem/policy/optimizer_sharded.hpp"
#include "tandem/policy/parameter_sharded.hpp"
#include "tandem/policy/replicated.hpp"

using tandem::DType;
using tandem::HostBackend;

namespace {

std::vector<tandem::TensorSpec> specs(DType dtype) {
  std::vector<tandem::TensorSpec> s;
  const std::size_t sizes[] = {37, 1, 1000, 64, 3, 777, 129};
  for (std::size_t i = 0; i < std::size(sizes); ++i) s.push_back({"t" + std::to_string(i), sizes[i], dtype});
  return s;
}

bool all_zero(const void* p, std::size_t bytes) {
  const auto* c = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < bytes; ++i)
    if (c[i] != 0) return false;
  return true;
}

template <class Policy>
void check_state(int world, tandem::Storage storage, DType dtype, DType reduce, int accumulation) {
  const tandem::DataParallelOptions options{.bucket_cap_bytes = 2048,
                                            .first_bucket_cap_bytes = 512,
                                            .accumulation_steps = accumulation,
                                            .gradient_buffers = 3,
                                            .reduce_dtype = reduce};
  const tandem::Plan plan = tandem::bucket_plan(specs(dtype), world, options);
  const tandem::BufferInputs in = tandem::detail::buffer_inputs(plan, dtype, storage, options);
  const tandem::Buffers need = tandem::buffers_for<Policy>(in);
  const HostBackend backend;
  const tandem::detail::TrainingState<HostBackend> state(backend, need, dtype, reduce, 2, {});
  const tandem::Buffers held = state.held();
  CHECK(held.param_flat == need.param_flat);
  CHECK(held.param_shard == need.param_shard);
  CHECK(held.param_slots == need.param_slots);
  CHECK(held.master == need.master);
  CHECK(held.state == need.state);
  CHECK(held.grad_flat == need.grad_flat);
  CHECK(held.grad_slots == need.grad_slots);
  CHECK(held.staging == need.staging);
  CHECK(held.grad_shard == need.grad_shard);
  CHECK(held.reduce_buffer == need.reduce_buffer);
  CHECK(held.grad_shard_dtype == need.grad_shard_dtype);
  // A buffer exists exactly where the rule asks for one, and starts zero (the masters are derived later).
  const std::size_t p = tandem::dtype_size(dtype);
  CHECK((state.param_flat() != nullptr) == (need.param_flat != 0));
  CHECK((state.param_shard() != nullptr) == (need.param_shard != 0));
  CHECK((state.grad_flat() != nullptr) == (need.grad_flat != 0));
  CHECK((state.grad_shard() != nullptr) == (need.grad_shard != 0));
  CHECK((state.reduce_buffer() != nullptr) == (need.reduce_buffer != 0));
  CHECK((state.master() != nullptr) == (need.master != 0));
  CHECK(all_zero(state.param_flat(), need.param_flat * p));
  CHECK(all_zero(state.param_shard(), need.param_shard * p));
  CHECK(all_zero(state.grad_flat(), need.grad_flat * 4));
  CHECK(all_zero(state.staging(), need.staging * 4));
  CHECK(all_zero(state.state(0), need.state * 4));
  CHECK(all_zero(state.state(1), need.state * 4));
  CHECK(all_zero(state.grad_shard(), need.grad_shard * tandem::dtype_size(need.grad_shard_dtype)));
  for (std::size_t s = 0; s < state.grad_slots(); ++s) CHECK(all_zero(state.grad_slot(s), need.grad_slot_size * 4));
  for (std::size_t s = 0; s < state.gather_buffers(); ++s)
    CHECK(all_zero(state.gather_buffer(s), need.param_slot_size * p));
  // What they amount to is what the estimator says a construction holds, but for the pack tables (DataParallel's).
  std::size_t numel = 0;
  for (const auto& t : specs(dtype)) numel += t.numel;
  tandem::MemoryReport estimate =
      tandem::estimate_memory<Policy, tandem::AdamW>(specs(dtype), world, storage, {}, options);
  CHECK((estimate.pack_tables != 0) == (storage == tandem::Storage::user));
  estimate.pack_tables = 0;
  CHECK(tandem::memory_of(held, in, numel, 2) == estimate);
}

}  // namespace

TEST_CASE_TEMPLATE("TrainingState allocates what the policy's rule asks for, zeroed", Policy, tandem::Replicated,
                   tandem::OptimizerSharded, tandem::GradientSharded, tandem::ParameterSharded) {
  for (int world = 1; world <= 3; ++world)
    for (tandem::Storage storage : {tandem::Storage::user, tandem::Storage::owned})
      for (DType dtype : {DType::fp32, DType::bf16})
        for (DType reduce : {DType::fp32, DType::fp16})
          for (int accumulation : {1, 2}) {
            if (storage == tandem::Storage::user &&
                tandem::parameter_sharding_of<Policy> == tandem::ParameterSharding::sharded)
              continue;  // refused (ParameterSharded keeps no full parameters)
            CAPTURE(world);
            CAPTURE(static_cast<int>(storage));
            CAPTURE(tandem::dtype_name(dtype));
            CAPTURE(tandem::dtype_name(reduce));
            CAPTURE(accumulation);
            check_state<Policy>(world, storage, dtype, reduce, accumulation);
          }
}

namespace {

using Kernels = tandem::detail::BucketKernels<tandem::AdamW, HostBackend>;

template <class T>
std::vector<T> random_values(std::size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<T> v(n);
  for (T& x : v) x = tandem::convert<T>(d(rng));
  return v;
}

// The table made for (T, R, G) runs the bodies of those types: each entry against a plain loop over the same values.
template <class T, class R, class G>
void check_kernels() {
  CAPTURE(tandem::dtype_name(tandem::dtype_of<T>));
  CAPTURE(tandem::dtype_name(tandem::dtype_of<R>));
  CAPTURE(tandem::dtype_name(tandem::dtype_of<G>));
  const HostBackend be;
  const Kernels k = Kernels::make(tandem::dtype_of<T>, tandem::dtype_of<R>, tandem::dtype_of<G>);
  std::mt19937 rng(7);
  const std::size_t n = 5000;  // more than one work item of every body

  // round_for_reduction: R(scale * fp32)
  const std::vector<float> grads = random_values<float>(n, rng);
  std::vector<R> wire(n);
  k.round_for_reduction(be, grads.data(), wire.data(), n, 0.25f, {});
  for (std::size_t i = 0; i < n; ++i)
    REQUIRE(tandem::convert<float>(wire[i]) == tandem::convert<float>(tandem::convert<R>(0.25f * grads[i])));

  // land: R into G, assigned then (fp32 only) added
  std::vector<G> store(n);
  k.land(be, wire.data(), store.data(), n, tandem::WriteMode::assign, {});
  for (std::size_t i = 0; i < n; ++i) REQUIRE(tandem::convert<float>(store[i]) == tandem::convert<float>(wire[i]));
  if constexpr (std::is_same_v<G, float>) {
    k.land(be, wire.data(), store.data(), n, tandem::WriteMode::accumulate, {});
    for (std::size_t i = 0; i < n; ++i) REQUIRE(store[i] == 2.0f * tandem::convert<float>(wire[i]));
  } else {
    CHECK_THROWS_AS(k.land(be, wire.data(), store.data(), n, tandem::WriteMode::accumulate, {}), tandem::error);
  }

  // sum_squares over the G values, in double
  double sum = -1.0, expected = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    const double x = tandem::convert<float>(store[i]);
    expected += x * x;
  }
  k.sum_squares(be, store.data(), n, &sum, {});
  CHECK(sum == doctest::Approx(expected).epsilon(1e-12));

  // masters_from_params: fp32 of T
  const std::vector<T> params = random_values<T>(n, rng);
  std::vector<float> masters(n, -1.0f);
  k.masters_from_params(be, params.data(), masters.data(), n, {});
  for (std::size_t i = 0; i < n; ++i) REQUIRE(masters[i] == tandem::convert<float>(params[i]));

  // update: AdamW's first step over G gradients, as a plain loop in double (lr 0.5: an update of about ±0.5)
  std::vector<T> p = params;
  std::vector<float> m(n), v(n), master = masters;
  tandem::detail::UpdateRange r;
  r.param = p.data();
  r.master = std::is_same_v<T, float> ? reinterpret_cast<float*>(p.data()) : master.data();
  r.grad = store.data();
  r.state[0] = m.data();
  r.state[1] = v.data();
  r.n = n;
  const float grad_scale = 2.0f;
  r.grad_scale = &grad_scale;
  const tandem::AdamWOptions o{.lr = 0.5f, .weight_decay = 0.0f};
  const tandem::AdamW::Scalars scalars = tandem::AdamW::scalars(o, 1);
  k.update(be, r, &scalars, {});
  for (std::size_t i = 0; i < n; ++i) {
    const double g = 2.0 * tandem::convert<float>(store[i]);
    const double step = g == 0.0 ? 0.0 : 0.5 * g / (std::abs(g) + 1e-8);  // m̂ / (sqrt(v̂) + eps) at t = 1
    REQUIRE(tandem::convert<float>(p[i]) ==
            doctest::Approx(tandem::convert<float>(params[i]) - step).epsilon(1e-2).scale(1e-2));
    // The step at t = 1 is ±lr whatever g's size, so the moments show that the update read grad_scale and every G
    // value whole: m = (1 - beta1) g, v = (1 - beta2) g^2 (fp32 arithmetic, within a few ulps).
    REQUIRE(m[i] == doctest::Approx((1.0 - o.beta1) * g).epsilon(1e-6).scale(1e-30));
    REQUIRE(v[i] == doctest::Approx((1.0 - o.beta2) * g * g).epsilon(1e-5).scale(1e-30));
  }
}

}  // namespace

TEST_CASE("BucketKernels launches the bodies of the dtypes it was made for") {
  using tandem::BFloat16, tandem::Float16;
  check_kernels<float, float, float>();
  check_kernels<BFloat16, float, float>();
  check_kernels<Float16, float, float>();
  check_kernels<float, BFloat16, float>();
  check_kernels<float, BFloat16, BFloat16>();
  check_kernels<BFloat16, BFloat16, BFloat16>();
  check_kernels<Float16, Float16, float>();
  check_kernels<BFloat16, Float16, Float16>();
  CHECK_THROWS_AS(Kernels::make(DType::fp32, DType::bf16, DType::fp16), tandem::error);  // G is fp32 or R
}

TEST_CASE("BucketKernels packs and unpacks the user's tensors of its parameter dtype") {
  const HostBackend be;
  const std::vector<tandem::TensorSpec> s = specs(DType::bf16);
  const tandem::Plan plan = tandem::bucket_plan(s, 2, {.bucket_cap_bytes = 2048, .first_bucket_cap_bytes = 512});
  std::mt19937 rng(3);
  std::vector<std::vector<tandem::BFloat16>> user, back;
  std::vector<void*> pointers, back_pointers;
  for (const auto& t : s) {
    user.push_back(random_values<tandem::BFloat16>(t.numel, rng));
    back.emplace_back(t.numel);
  }
  for (std::size_t i = 0; i < s.size(); ++i) {
    pointers.push_back(user[i].data());
    back_pointers.push_back(back[i].data());
  }
  const Kernels k = Kernels::make(DType::bf16, DType::fp32, DType::fp32);
  for (std::size_t b = 0; b < plan.num_buckets(); ++b) {
    const tandem::PackTable in = tandem::make_pack_table(plan, b, pointers);
    const tandem::PackTable out = tandem::make_pack_table(plan, b, back_pointers);
    const tandem::ResidentPackTables<HostBackend> tables(be, {in, out}, {});
    std::vector<tandem::BFloat16> bucket(plan.bucket(b).size);
    std::vector<float> grads(plan.bucket(b).size);
    k.pack_params(be, tables[0], bucket.data(), tandem::StoreHint::cached, {});
    k.unpack_params(be, tables[1], bucket.data(), tandem::StoreHint::cached, {});
    k.pack_grads(be, tables[0], grads.data(), tandem::WriteMode::assign, 0.5f, tandem::StoreHint::cached, {});
    k.pack_grads(be, tables[0], grads.data(), tandem::WriteMode::accumulate, 0.5f, tandem::StoreHint::cached, {});
    for (std::size_t i : plan.bucket(b).tensors) {
      const tandem::Placement& at = plan.placement(i);
      for (std::size_t j = 0; j < at.numel; ++j) {
        REQUIRE(back[i][j].bits == user[i][j].bits);
        REQUIRE(grads[at.offset + j] == tandem::convert<float>(user[i][j]));  // 0.5 x + 0.5 x
      }
    }
  }
}

TEST_CASE("StepControl keeps the step count and makes each group's scalars and the factor on the stream") {
  // On the stream-faithful backend: the values exist once the stream has run, in its order.
  const tandem::StreamHostBackend be;
  const tandem::Stream s = be.stream();
  tandem::detail::StepControl<tandem::SGD, tandem::StreamHostBackend> control(be, 3, 7, s);
  // 11 groups: more than one store launch carries (8)
  control.reserve_groups(be, 11);
  // one step as DataParallel makes it: the options stored where they changed, then the verdict and scalars
  auto prepare = [&](const std::vector<tandem::SGDOptions>& groups, const tandem::detail::StepChecks& checks) {
    control.store_changed_options(be, groups, {}, s);
    control.prepare(be, groups.size(), checks, s);
  };
  std::vector<tandem::SGDOptions> groups;
  for (int g = 0; g < 11; ++g) groups.push_back({.lr = 0.1f * static_cast<float>(g + 1), .momentum = 0.5f});
  const std::vector<double> squares(1, 100.0);  // norm 10 * 0.5 = 5 against a maximum of 1
  const tandem::StreamHostBackend::Buffer<double> sum = be.allocate<double>(1);
  be.copy(sum.data(), squares.data(), sizeof(double), s);
  prepare(groups, {.sum_of_squares = sum.data(), .average = 0.5f, .max_grad_norm = 1.0f});
  tandem::detail::StepRecord record = control.record(be, s);
  CHECK(record.verdict == tandem::detail::StepVerdict::update);
  CHECK(record.step == 8);
  CHECK(record.grad_norm == 5.0);
  CHECK(record.clip_coefficient == tandem::detail::clip_coefficient(5.0, 1.0f));
  std::vector<tandem::SGD::Scalars> got(11);
  float scale = 0.0f;
  be.read(got.data(), control.scalars(0), got.size() * sizeof(tandem::SGD::Scalars), s);
  be.read(&scale, control.grad_scale(), sizeof scale, s);
  for (std::size_t g = 0; g < 11; ++g) {
    CAPTURE(g);
    CHECK(got[g].lr == groups[g].lr);
    CHECK(!got[g].first_step);  // step 8
  }
  CHECK(scale == tandem::detail::mul_rn(0.5f, tandem::detail::clip_coefficient(5.0, 1.0f)));
  CHECK(scale < 0.5f * 0.2f + 1e-6f);
  // the count set again (a checkpoint's load at step 0, with 7 steps skipped before it): the next step is the first
  control.set_step(be, 0, 7, s);
  record = control.record(be, s);
  CHECK(record.verdict == tandem::detail::StepVerdict::none);
  CHECK(record.step == 0);
  CHECK(record.non_finite_steps == 7);
  groups.resize(2);
  prepare(groups, {.average = 0.25f});
  be.read(got.data(), control.scalars(0), 2 * sizeof(tandem::SGD::Scalars), s);
  be.read(&scale, control.grad_scale(), sizeof scale, s);
  CHECK(got[0].first_step);
  CHECK(got[1].first_step);
  CHECK(scale == 0.25f);
  // options changed between steps are stored by the next step, and so are those given to store_options (that a step
  // with the options of the last store launches no store is tested through a captured step in test_data_parallel)
  groups[1].lr = 0.75f;
  prepare(groups, {});
  be.read(got.data(), control.scalars(0), 2 * sizeof(tandem::SGD::Scalars), s);
  CHECK(got[0].lr == 0.1f);
  CHECK(got[1].lr == 0.75f);
  groups[0].lr = 0.5f;
  control.store_options(be, groups, {}, s);
  prepare(groups, {});
  be.read(got.data(), control.scalars(0), 2 * sizeof(tandem::SGD::Scalars), s);
  CHECK(got[0].lr == 0.5f);
  CHECK(got[1].lr == 0.75f);
  groups.resize(12);
  CHECK_THROWS_WITH_AS(prepare(groups, {}), doctest::Contains("more optimizer groups"), tandem::error);
  // room for more groups is a new buffer (set_optimizer_groups, even one that then fails and keeps the old groups):
  // the next step stores the options again, although they did not change
  groups.resize(2);
  control.reserve_groups(be, 20);
  prepare(groups, {});
  be.read(got.data(), control.scalars(0), 2 * sizeof(tandem::SGD::Scalars), s);
  CHECK(got[0].lr == 0.5f);
  CHECK(got[1].lr == 0.75f);
  // a non-finite norm where it skips: the count stays and the skip word, which the updates read, is set
  const double inf = std::numeric_limits<double>::infinity();
  be.copy(sum.data(), &inf, sizeof inf, s);
  const std::uint64_t at = control.record(be, s).step;
  prepare(groups, {.sum_of_squares = sum.data(), .skip_non_finite = true});
  std::uint32_t skip = 0;
  be.read(&skip, control.skip(), sizeof skip, s);
  CHECK(skip == 1);
  CHECK(control.record(be, s).step == at);
  CHECK(control.record(be, s).verdict == tandem::detail::StepVerdict::non_finite);
  prepare(groups, {});
  be.read(&skip, control.skip(), sizeof skip, s);
  CHECK(skip == 0);
  CHECK(control.record(be, s).step == at + 1);
  // the options' fingerprint lanes (more than one rank) are stored with the options, and again when they change alone
  // (set_optimizer_groups may change the fingerprint but not the options); a step's lanes are those, then its stale
  // lane (0: its launches are of the grouping in use)
  const tandem::StreamHostBackend::Buffer<double> step_lanes = be.allocate<double>(5);
  auto lanes_read = [&](tandem::Stream on) {
    std::array<double, 5> l{};
    be.read(l.data(), step_lanes.data(), sizeof l, on);
    return l;
  };
  const std::array<double, 4> lanes{1.0, 1.0, 3.0, 9.0}, other{2.0, 4.0, 3.0, 9.0};
  control.store_options(be, groups, lanes, s);
  control.step_lanes(be, step_lanes.data(), s);
  CHECK(lanes_read(s) == std::array<double, 5>{1.0, 1.0, 3.0, 9.0, 0.0});
  control.store_changed_options(be, groups, other, s);
  control.step_lanes(be, step_lanes.data(), s);
  CHECK(lanes_read(s) == std::array<double, 5>{2.0, 4.0, 3.0, 9.0, 0.0});
  CHECK_THROWS_WITH_AS(control.store_options(be, groups, std::span<const double>(lanes.data(), 3), s),
                       doctest::Contains("4 lanes"), tandem::error);

  // A step prepared in a capture, then the groups regrouped: its replays do not update and are counted, and their
  // stale lane is 1; a step prepared after updates, and replays before a regroup update (the capture's grouping is the
  // one in use). Another rank's stale lane, summed into this one's, refuses this rank's step too.
  tandem::HostStream user;
  const tandem::Stream u = user.stream();
  user.begin_capture();
  control.step_lanes(be, step_lanes.data(), u);
  control.prepare(be, groups.size(), {}, u);
  const tandem::HostGraph graph = user.end_capture();
  const std::uint64_t taken = control.record(be, u).step;
  graph.replay();
  CHECK(control.record(be, u).verdict == tandem::detail::StepVerdict::update);
  CHECK(control.record(be, u).step == taken + 1);
  CHECK(lanes_read(u)[4] == 0.0);
  control.regroup(be, u);
  for (std::uint64_t k = 1; k <= 2; ++k) {
    graph.replay();
    record = control.record(be, u);
    CHECK(record.verdict == tandem::detail::StepVerdict::regrouped);
    CHECK(record.step == taken + 1);
    CHECK(record.regrouped_steps == k);
    be.read(&skip, control.skip(), sizeof skip, u);
    CHECK(skip == 1);
    CHECK(lanes_read(u)[4] == 1.0);
  }
  control.step_lanes(be, step_lanes.data(), u);
  CHECK(lanes_read(u)[4] == 0.0);
  const double another_rank_stale = 1.0;
  be.copy(step_lanes.data() + 4, &another_rank_stale, sizeof(double), u);
  control.prepare(be, groups.size(), {.stale = step_lanes.data() + 4}, u);
  record = control.record(be, u);
  CHECK(record.verdict == tandem::detail::StepVerdict::regrouped);
  CHECK(record.step == taken + 1);
  CHECK(record.regrouped_steps == 3);
  control.prepare(be, groups.size(), {}, u);
  record = control.record(be, u);
  CHECK(record.verdict == tandem::detail::StepVerdict::update);
  CHECK(record.step == taken + 2);
  CHECK(record.regrouped_steps == 3);
  control.set_step(be, 4, 0, u);  // a load keeps the tally, as the others
  CHECK(control.record(be, u).regrouped_steps == 3);
}

TEST_CASE("all_gather_words has run its copy of the caller's words when a collective throws") {
  tandem::LocalGroup(1).run([](tandem::LocalComm& comm) {
    test::CountingComm failing{comm, test::Collective::all_gather, 0};  // its first all-gather throws
    const tandem::StreamHostBackend backend;
    std::atomic<bool> reached{false};
    // Work ahead of the copy on the backend's stream: the copy runs after it, so only a wait for the copy sees it done.
    backend.launch(
        1,
        [&](std::size_t, unsigned, unsigned) {
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
          reached = true;
        },
        backend.stream());
    auto mine = std::make_unique<std::vector<std::uint64_t>>(std::vector<std::uint64_t>{1, 2, 3});
    CHECK_THROWS_WITH_AS(tandem::detail::all_gather_words(failing, backend, *mine), "injected collective failure",
                         tandem::error);
    CHECK(reached.load());  // else the copy of *mine would still be queued, and read it after this frees it
    mine.reset();
    backend.synchronize(backend.stream());
  });
}

TEST_CASE("the configuration words tell every difference between ranks apart") {
  using tandem::detail::Configuration, tandem::detail::configuration_of, tandem::detail::check_same_configuration;
  const tandem::Layout layout(specs(DType::fp32));
  const tandem::DataParallelOptions base;
  const Configuration mine = configuration_of(layout, "GradientSharded", 42, base, tandem::Storage::owned, 2);
  auto with = [&](const Configuration& other) {
    std::vector<std::uint64_t> all(mine.word, mine.word + Configuration::words);
    all.insert(all.end(), other.word, other.word + Configuration::words);
    return all;
  };
  CHECK_NOTHROW(check_same_configuration(with(mine), 2));
  std::vector<tandem::TensorSpec> other_specs = specs(DType::fp32);
  other_specs[3].numel += 1;
  CHECK_THROWS_WITH_AS(check_same_configuration(with(configuration_of(tandem::Layout(other_specs), "GradientSharded",
                                                                      42, base, tandem::Storage::owned, 2)),
                                                2),
                       doctest::Contains("the tensor layout differs between ranks"), tandem::error);
  std::vector<Configuration> others = {
      configuration_of(layout, "ParameterSharded", 42, base, tandem::Storage::owned, 2),
      configuration_of(layout, "GradientSharded", 43, base, tandem::Storage::owned, 2),
      configuration_of(layout, "GradientSharded", 42, base, tandem::Storage::user, 2),
      configuration_of(layout, "GradientSharded", 42, base, tandem::Storage::owned, 3)};
  for (tandem::DataParallelOptions o :
       {tandem::DataParallelOptions{.bucket_cap_bytes = 1}, tandem::DataParallelOptions{.first_bucket_cap_bytes = 1},
        tandem::DataParallelOptions{.accumulation_steps = 2}, tandem::DataParallelOptions{.max_grad_norm = 1.0f},
        tandem::DataParallelOptions{.non_finite = tandem::NonFinite::skip_step},
        tandem::DataParallelOptions{.gradient_buffers = 3}, tandem::DataParallelOptions{.parameter_buffers = 3},
        tandem::DataParallelOptions{.reduce_dtype = DType::bf16},
        tandem::DataParallelOptions{.step_report = tandem::StepReport::deferred}})
    others.push_back(configuration_of(layout, "GradientSharded", 42, o, tandem::Storage::owned, 2));
  for (std::size_t k = 0; k < others.size(); ++k) {
    CAPTURE(k);
    CHECK_THROWS_WITH_AS(check_same_configuration(with(others[k]), 2),
                         doctest::Contains("ranks 0 and 1 constructed DataParallel differently"), tandem::error);
  }
}

// WordAgreement against a plain comparison of the words: the lanes are summed in double, in rank order and in
// reverse (an all-reduce may add in any order), at world sizes up to 2^16, with the largest chunks (every partial sum
// at its largest) and with words that differ in one bit of a chunk.
TEST_CASE("WordAgreement finds any difference in the checked bits, exactly, at any world size") {
  using tandem::detail::WordAgreement;
  std::mt19937_64 rng(11);
  auto verdict = [](const std::vector<std::uint64_t>& words, bool reverse) {
    const int world = static_cast<int>(words.size());
    double sums[WordAgreement::lanes] = {};
    for (std::size_t k = 0; k < words.size(); ++k) {
      const auto lanes = WordAgreement::encode(words[reverse ? words.size() - 1 - k : k], world);
      for (std::size_t l = 0; l < WordAgreement::lanes; ++l) sums[l] += lanes[l];
    }
    return WordAgreement::agree(sums, world);
  };
  for (int world : {1, 2, 3, 7, 64, 1000, 4096, 65536}) {
    CAPTURE(world);
    const unsigned bits = WordAgreement::chunk_bits(world);
    CHECK(bits >= 18);
    const std::uint64_t largest = (std::uint64_t{1} << bits) - 1;
    for (std::uint64_t word : {std::uint64_t{0}, largest | (largest << 32), std::uint64_t{rng()}}) {
      std::vector<std::uint64_t> words(static_cast<std::size_t>(world), word);
      CHECK(verdict(words, false));
      if (world == 1) continue;
      for (unsigned bit : {0u, bits - 1, 32u, 31u + bits}) {
        CAPTURE(bit);
        std::vector<std::uint64_t> other = words;
        other[static_cast<std::size_t>(world) / 2] ^= std::uint64_t{1} << bit;
        CHECK_FALSE(verdict(other, false));
        CHECK_FALSE(verdict(other, true));
      }
      // Differences that cancel in the sum (x + 1 on one rank, x - 1 on another) are still found by the squares.
      std::vector<std::uint64_t> balanced(static_cast<std::size_t>(world), std::uint64_t{5} | (std::uint64_t{5} << 32));
      balanced[0] += 1;
      balanced[1] -= 1;
      CHECK_FALSE(verdict(balanced, false));
    }
  }
}

TEST_CASE("the user's buffers: null, misaligned and overlapping ones are named") {
  using tandem::detail::validate_user_buffers;
  std::vector<float> memory(100);
  const tandem::Layout layout({{"a", 10, DType::fp32}, {"b", 10, DType::fp32}});
  auto refs = [&](void* p0, void* g0, void* p1, void* g1) {
    return std::vector<tandem::TensorRef>{{"a", p0, g0, 10, DType::fp32}, {"b", p1, g1, 10, DType::fp32}};
  };
  float* m = memory.data();
  CHECK_NOTHROW(validate_user_buffers(layout, refs(m, m + 10, m + 20, m + 30)));
  CHECK_THROWS_WITH_AS(validate_user_buffers(layout, refs(m, nullptr, m + 20, m + 30)),
                       doctest::Contains("grad pointer is null"), tandem::error);
  CHECK_THROWS_WITH_AS(validate_user_buffers(layout, refs(m, m + 10, m + 15, m + 30)), doctest::Contains("overlaps"),
                       tandem::error);
  CHECK_THROWS_WITH_AS(validate_user_buffers(layout, refs(reinterpret_cast<char*>(m) + 1, m + 10, m + 20, m + 30)),
                       doctest::Contains("aligned to their element size"), tandem::error);
  CHECK_NOTHROW(validate_user_buffers(  // zero-size tensors may be anything
      tandem::Layout({{"a", 0, DType::fp32}}), {{"a", nullptr, nullptr, 0, DType::fp32}}));
}

namespace {

constexpr std::size_t not_owned = static_cast<std::size_t>(-1);

// f(i, e, flat, owned) for every element e of every tensor i: its flat index, and its index in the owned space of
// `rank` under policy P (not_owned where the rank does not own it).
template <class P, class F>
void for_each_element(const tandem::Plan& plan, int rank, F&& f) {
  for (std::size_t b = 0; b < plan.num_buckets(); ++b) {
    const tandem::Range own = tandem::owned_range<P>(plan, b, rank);
    for (std::size_t i : plan.bucket(b).tensors) {
      const std::size_t at = plan.flat_offset(i);
      for (std::size_t e = 0; e < plan.placement(i).numel; ++e) {
        const std::size_t flat = at + e;
        const bool mine = flat >= own.begin && flat < own.end;
        f(i, e, flat, mine ? tandem::owned_offset<P>(plan, b) + (flat - own.begin) : not_owned);
      }
    }
  }
}

// Checkpoint I/O: distinct values in every array of every tensor, saved at `world` ranks under policy P (each rank
// writes its shard file; the manifest names them), restored at `restore_world` ranks under policy Q: each rank holds
// exactly what it keeps of them (the full parameters or its shard, its owned master weights and state), and the
// files are valid safetensors whose tensors are the saved slices.
template <class P, class Q>
void check_checkpoint_io(int world, int restore_world, DType dtype) {
  std::vector<tandem::TensorSpec> s = specs(dtype);
  s.insert(s.begin() + 2, {"empty", 0, dtype});  // zero-size tensors hold nothing anywhere
  const tandem::DataParallelOptions options{.bucket_cap_bytes = 2048, .first_bucket_cap_bytes = 512};
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("tandem_test_parts_" + std::to_string(::getpid()) + "_" + std::to_string(world)))
                              .string();
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  // Element e of tensor i: the parameter and each array's values derived from (i, e).
  auto value = [](std::size_t i, std::size_t e, int array) { return static_cast<float>(1000 * i + e) + 0.25f * array; };
  tandem::CheckpointManifest manifest;
  manifest.step = 5;
  manifest.world_size = static_cast<std::uint32_t>(world);
  manifest.optimizer = "AdamW";
  manifest.state_count = 2;
  manifest.param_dtype = dtype;
  manifest.bucket_cap_bytes = options.bucket_cap_bytes;
  manifest.first_bucket_cap_bytes = options.first_bucket_cap_bytes;
  manifest.tensors = s;
  manifest.files.resize(static_cast<std::size_t>(world));
  tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
    const HostBackend be;
    const tandem::Plan plan = tandem::bucket_plan(s, world, options);
    const tandem::Layout layout(s);
    const auto in = tandem::detail::buffer_inputs(plan, dtype, tandem::Storage::owned, options);
    tandem::detail::TrainingState<HostBackend> state(be, tandem::buffers_for<P>(in), dtype, DType::fp32, 2, {});
    for_each_element<P>(plan, comm.rank(), [&](std::size_t i, std::size_t e, std::size_t f, std::size_t o) {
      tandem::visit_param_dtype(dtype, [&](auto t) {
        using T = decltype(t);
        if (state.param_flat() != nullptr)  // the full parameters are every rank's
          reinterpret_cast<T*>(state.param_flat())[f] = tandem::convert<T>(value(i, e, 0));
        if (o != not_owned && state.param_shard() != nullptr)
          reinterpret_cast<T*>(state.param_shard())[o] = tandem::convert<T>(value(i, e, 0));
      });
      if (o == not_owned) return;
      if (state.master() != nullptr) state.master()[o] = value(i, e, 1);
      state.state(0)[o] = value(i, e, 2);
      state.state(1)[o] = value(i, e, 3);
    });
    const std::string name = "rank" + std::to_string(comm.rank()) + ".safetensors";
    const tandem::SafetensorsSummary summary = tandem::detail::write_shard<P>(
        be, plan, layout, state, dtype, comm.rank(), world, manifest.step, manifest.metadata, dir + "/" + name);
    manifest.files[static_cast<std::size_t>(comm.rank())] = {name, summary.bytes, summary.header_crc};
  });
  tandem::detail::commit_manifest(dir, manifest);
  // Each file is a safetensors file of this rank's slices, every one of them named and checksummed.
  std::size_t slices = 0;
  for (const auto& f : manifest.files) {
    const tandem::SafetensorsFile file(dir + "/" + f.name);
    CHECK(file.size() == f.bytes);
    for (const auto& t : file.tensors()) {
      std::uint32_t crc = 0;
      CHECK(file.recorded_crc(t.name, crc));
      std::vector<unsigned char> data(t.end - t.begin);
      file.read(t.begin, data.data(), data.size());
      CHECK(tandem::detail::crc32c(data.data(), data.size()) == crc);
      ++slices;
    }
  }
  CHECK(slices >= (s.size() - 1) * (dtype == DType::fp32 ? 3 : 4));  // every tensor's arrays, in one slice or more
  tandem::LocalGroup(restore_world).run([&](tandem::LocalComm& comm) {
    const HostBackend be;
    const tandem::Plan plan = tandem::bucket_plan(s, restore_world, options);
    const tandem::Layout layout(s);
    const auto in = tandem::detail::buffer_inputs(plan, dtype, tandem::Storage::owned, options);
    const tandem::detail::TrainingState<HostBackend> state(be, tandem::buffers_for<Q>(in), dtype, DType::fp32, 2, {});
    tandem::detail::ShardedCheckpoint ckpt(dir, manifest, layout);
    tandem::detail::restore_sharded<Q>(be, plan, layout, comm.rank(), state, ckpt, tandem::detail::Restore::check);
    tandem::detail::restore_sharded<Q>(be, plan, layout, comm.rank(), state, ckpt, tandem::detail::Restore::copy);
    // At the saving plan, a rank that owns a shard of the state reads its own file only.
    if (Q::state == tandem::StateSharding::sharded && restore_world == world)
      for (int r = 0; r < world; ++r) CHECK(ckpt.opened(static_cast<std::size_t>(r)) == (r == comm.rank()));
    // At any plan, it reads exactly the saved slices (each whole, for its checksum) that overlap the elements it owns
    // of each tensor: from the files' own entries (`[master/|state<k>/]<tensor>[[begin:end]]`), not the reader's plan.
    std::vector<std::size_t> own_lo(s.size(), SIZE_MAX), own_hi(s.size(), 0);
    for_each_element<Q>(plan, comm.rank(), [&](std::size_t i, std::size_t e, std::size_t, std::size_t o) {
      if (o == not_owned) return;
      own_lo[i] = std::min(own_lo[i], e);
      own_hi[i] = std::max(own_hi[i], e + 1);
    });
    std::uint64_t needed = 0;
    for (const auto& f : manifest.files) {
      const tandem::SafetensorsFile file(dir + "/" + f.name);
      for (const auto& t : file.tensors()) {
        std::string_view name = t.name;
        if (const std::size_t slash = name.find('/'); slash != std::string_view::npos) name.remove_prefix(slash + 1);
        const std::size_t bracket = name.find('[');
        const std::string tensor(name.substr(0, bracket));
        const auto i = static_cast<std::size_t>(
            std::find_if(s.begin(), s.end(), [&](const tandem::TensorSpec& spec) { return spec.name == tensor; }) -
            s.begin());
        REQUIRE(i < s.size());
        std::size_t begin = 0, end = s[i].numel;
        if (bracket != std::string_view::npos)
          REQUIRE(std::sscanf(std::string(name.substr(bracket)).c_str(), "[%zu:%zu]", &begin, &end) == 2);
        if (begin < own_hi[i] && own_lo[i] < end) needed += t.end - t.begin;
      }
    }
    CHECK(ckpt.bytes_read() == needed);
    for_each_element<Q>(plan, comm.rank(), [&](std::size_t i, std::size_t e, std::size_t f, std::size_t o) {
      float expected = 0.0f, param = 0.0f, shard = 0.0f;
      tandem::visit_param_dtype(dtype, [&](auto t) {
        using T = decltype(t);
        expected = tandem::convert<float>(tandem::convert<T>(value(i, e, 0)));
        if (state.param_flat() != nullptr) param = tandem::convert<float>(reinterpret_cast<T*>(state.param_flat())[f]);
        if (o != not_owned && state.param_shard() != nullptr)
          shard = tandem::convert<float>(reinterpret_cast<T*>(state.param_shard())[o]);
      });
      if (o == not_owned) return;  // (full parameters beyond the owned range are gathered by the front: not here)
      if (state.param_flat() != nullptr) REQUIRE(param == expected);
      if (state.param_shard() != nullptr) REQUIRE(shard == expected);
      if (state.master() != nullptr) REQUIRE(state.master()[o] == value(i, e, 1));
      REQUIRE(state.state(0)[o] == value(i, e, 2));
      REQUIRE(state.state(1)[o] == value(i, e, 3));
    });
  });
  std::filesystem::remove_all(dir);
}

}  // namespace

TEST_CASE(
    "checkpoint I/O: each rank writes its shard, and each rank reads back what it keeps, at any size and policy") {
  for (int world = 1; world <= 3; ++world)
    for (int restore = 1; restore <= 3; ++restore) {
      CAPTURE(world);
      CAPTURE(restore);
      check_checkpoint_io<tandem::Replicated, tandem::ParameterSharded>(world, restore, DType::bf16);
      check_checkpoint_io<tandem::ParameterSharded, tandem::OptimizerSharded>(world, restore, DType::fp32);
      check_checkpoint_io<tandem::GradientSharded, tandem::Replicated>(world, restore, DType::bf16);
    }
}

namespace {

/// HostBackend whose allocations of more than `limit` bytes fail as the host's do, with std::bad_alloc.
struct LimitedBackend : HostBackend {
  std::size_t limit = 0;
  template <class T>
  Buffer<T> allocate(std::size_t n) const {
    if (n * sizeof(T) > limit) throw std::bad_alloc();
    return HostBackend::allocate<T>(n);
  }
};

}  // namespace

TEST_CASE("a rank's problem in a save or load: the exception's message, or for std::bad_alloc what the rank did") {
  using tandem::detail::problem_of;
  CHECK(problem_of(std::bad_alloc(), "writing the checkpoint shard `f`") ==
        "tandem: out of host memory while writing the checkpoint shard `f` (std::bad_alloc)");
  CHECK(problem_of(tandem::error("tandem: the disk is full"), "writing") == "tandem: the disk is full");
  CHECK(problem_of(std::runtime_error("other"), "writing") == "other");
}

TEST_CASE("an allocation that fails is a tandem::error naming the buffer, on every rank") {
  // Rank 1 cannot hold its first buffer (the parameters' bucket: 1000 fp32 elements padded to 1024); rank 0 can.
  std::vector<std::string> errors(2);
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    std::vector<float> w(1000), g(1000);
    LimitedBackend backend;
    backend.limit = comm.rank() == 1 ? 3000 : std::size_t{1} << 30;
    try {
      tandem::DataParallel<tandem::Replicated, tandem::AdamW, LimitedBackend> dp(
          comm, {{"w", w.data(), g.data(), w.size()}}, {}, {}, backend);
    } catch (const tandem::error& e) {
      errors[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  CHECK(errors[1].find("allocating the parameters (4096 bytes) failed: std::bad_alloc") != std::string::npos);
  CHECK(errors[0].find("rank 1 failed: tandem: allocating the parameters") != std::string::npos);
}
