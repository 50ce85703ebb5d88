// SPDX-License-Identifier: Apache-2.0
// DataParallelOptions::reduce_dtype: gradients cross ranks in bf16 or fp16 while micro-steps accumulate in fp32 and
// the update stays fp32 (at accumulation 1 the sharded policies keep the reduced shard 16-bit and the update reads
// it). Checked against plain loops (one SGD step's exact values, with roundings written here), across policies and
// storage modes (bitwise where the reduction order allows, clipped too), against fp32 reduction (close, and not equal),
// on the wire (the collectives' dtype), in memory (the reduce buffer and the 16-bit shard, as estimate_memory says),
// and at its edges (a dtype it refuses, ranks that disagree, fp16's overflow caught by the non-finite check).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "support/backend.hpp"
#include "support/comm.hpp"
#include "support/params.hpp"
#include "support/train.hpp"
#include "tandem/tandem.hpp"

namespace {

using tandem::DType;
using test::Params;

/// Round to nearest even into bf16 and back (finite inputs): the reference's own rounding.
float round_bf16(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  u &= 0xFFFF0000u;
  std::memcpy(&x, &u, sizeof u);
  return x;
}

/// Round to nearest even into fp16 and back, for |x| below 65504: 10 mantissa bits where x is normal in fp16
/// (|x| >= 2^-14), else a multiple of fp16's smallest step, 2^-24.
float round_fp16(float x) {
  if (std::fabs(x) < 0x1p-14f) return std::nearbyint(x * 0x1p24f) * 0x1p-24f;
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u += 0xFFFu + ((u >> 13) & 1u);
  u &= ~0x1FFFu;
  std::memcpy(&x, &u, sizeof u);
  return x;
}

const std::vector<tandem::TensorSpec> specs = {{"a", 37}, {"b", 1000}, {"c", 5}, {"d", 301}};

tandem::DataParallelOptions small_buckets(DType reduce) {
  return {.bucket_cap_bytes = 1024, .first_bucket_cap_bytes = 512, .reduce_dtype = reduce};
}

/// Rank r's gradient of tensor i: full-mantissa values in (-1, 1).
std::vector<float> gradient_of(int rank, std::size_t i) {
  std::mt19937 gen(static_cast<std::uint32_t>(1000 * rank + i));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> g(specs[i].numel);
  for (float& x : g) x = u(gen);
  return g;
}

/// One SGD step (lr 1, no momentum, no decay) from zero parameters at `world` ranks: the parameters are minus the
/// reduced gradients tandem used. Owned storage, or the user's buffers; returns every rank's parameters.
template <class Policy>
std::vector<Params> one_sgd_step(int world, DType reduce, bool owned) {
  std::vector<Params> out(static_cast<std::size_t>(world));
  const tandem::SGDOptions sgd{.lr = 1.0f};
  tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
    Params& mine = out[static_cast<std::size_t>(comm.rank())];
    if (owned) {
      test::DataParallel<Policy, tandem::SGD> dp(comm, specs, sgd, small_buckets(reduce));
      dp.template initialize_parameters<float>([](std::size_t, float*) {});  // tandem's buffers start at zero
      for (std::size_t b = 0; b < dp.num_buckets(); ++b) {
        auto grads = dp.gradients(b);
        for (std::size_t i : grads.tensors()) {
          const std::vector<float> g = gradient_of(comm.rank(), i);
          std::copy(g.begin(), g.end(), grads.grad(i));
        }
      }
      dp.step();
      mine.resize(specs.size());
      for (std::size_t b = 0; b < dp.num_buckets(); ++b) {
        auto params = dp.parameters(b);
        for (std::size_t i : params.tensors())
          mine[i].assign(params.template param<float>(i), params.template param<float>(i) + specs[i].numel);
      }
    } else {
      if constexpr (tandem::parameter_sharding_of<Policy> == tandem::ParameterSharding::replicated) {
        Params grads(specs.size());
        mine.resize(specs.size());
        std::vector<tandem::TensorRef> refs;
        for (std::size_t i = 0; i < specs.size(); ++i) {
          mine[i].assign(specs[i].numel, 0.0f);
          grads[i] = gradient_of(comm.rank(), i);
          refs.push_back({specs[i].name, mine[i].data(), grads[i].data(), specs[i].numel});
        }
        test::DataParallel<Policy, tandem::SGD> dp(comm, refs, sgd, small_buckets(reduce));
        dp.step();
      }
    }
  });
  return out;
}

/// What one_sgd_step must give, by plain loops: each rank's gradient scaled by 1/N and rounded to the wire dtype,
/// summed in rank order in fp32, the sum rounded once. Only owned storage in fp32 scales after the sum.
Params reference_step(int world, DType reduce, bool owned) {
  auto wire = [&](float x) {
    return reduce == DType::bf16 ? round_bf16(x) : reduce == DType::fp16 ? round_fp16(x) : x;
  };
  const bool after = owned && reduce == DType::fp32;
  const float scale = 1.0f / static_cast<float>(world);
  Params p(specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    std::vector<std::vector<float>> g;
    for (int r = 0; r < world; ++r) g.push_back(gradient_of(r, i));
    for (std::size_t e = 0; e < specs[i].numel; ++e) {
      float sum = 0.0f;
      for (int r = 0; r < world; ++r) sum += wire(after ? g[r][e] : scale * g[r][e]);
      const float reduced = wire(sum);
      p[i].push_back(0.0f - (after ? scale * reduced : reduced));  // w - lr g from w = 0 (and +0 for a zero sum)
    }
  }
  return p;
}

template <class Policy>
void check_one_step(bool owned) {
  for (int world = 1; world <= 4; ++world) {
    CAPTURE(world);
    for (DType reduce : {DType::fp32, DType::bf16, DType::fp16}) {
      const std::string wire_dtype = tandem::dtype_name(reduce);
      CAPTURE(wire_dtype);
      const Params expected = reference_step(world, reduce, owned);
      for (const Params& got : one_sgd_step<Policy>(world, reduce, owned)) CHECK(test::bitwise_equal(got, expected));
    }
    if (world > 1)  // the dtype changes the values at all: a reference that ignored it would fail above
      for (DType reduce : {DType::bf16, DType::fp16})
        CHECK(!test::bitwise_equal(reference_step(world, reduce, owned), reference_step(world, DType::fp32, owned)));
  }
}

const tandem::AdamWOptions adamw{.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-8f, .weight_decay = 0.05f};

const tandem::SGDOptions sgd{.lr = 0.05f, .momentum = 0.9f};

/// Rank 0's parameters after test::train_rank at `world` ranks (12 steps of the MLP, AdamW unless SGD is asked for).
template <class Policy, class Opt = tandem::AdamW>
Params train(int world, DType reduce, bool owned, int accumulation = 1, float max_grad_norm = 0.0f) {
  test::TrainSetup setup;
  setup.max_grad_norm = max_grad_norm;
  setup.reduce_dtype = reduce;
  setup.owned = owned;
  setup.accumulation = accumulation;
  const mlp::Dataset data = test::make_dataset(setup);
  Params result;
  std::mutex m;
  tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
    Params p;
    if constexpr (std::is_same_v<Opt, tandem::SGD>)
      p = test::train_rank<Policy, Opt, float>(comm, setup, data, sgd);
    else
      p = test::train_rank<Policy, Opt, float>(comm, setup, data, adamw);
    const std::lock_guard lock(m);
    if (comm.rank() == 0) result = std::move(p);
  });
  return result;
}

double max_abs_difference(const Params& a, const Params& b) {
  double d = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i)
    for (std::size_t e = 0; e < a[i].size(); ++e) d = std::max(d, std::fabs(static_cast<double>(a[i][e]) - b[i][e]));
  return d;
}

}  // namespace

TEST_CASE("reduce_dtype: one step's values equal plain loops' under every policy, owned and user storage") {
  check_one_step<tandem::Replicated>(true);
  check_one_step<tandem::OptimizerSharded>(true);
  check_one_step<tandem::GradientSharded>(true);
  check_one_step<tandem::ParameterSharded>(true);
  check_one_step<tandem::Replicated>(false);
  check_one_step<tandem::OptimizerSharded>(false);
  check_one_step<tandem::GradientSharded>(false);
}

TEST_CASE("reduce_dtype: the policies train bitwise alike in bf16 and fp16 wherever the reduction order allows") {
  for (DType reduce : {DType::bf16, DType::fp16}) {
    const std::string wire_dtype = tandem::dtype_name(reduce);
    CAPTURE(wire_dtype);
    for (int world = 1; world <= 4; ++world) {
      CAPTURE(world);
      // Accumulation 1: every policy rounds each micro-step's averaged sum once, in both storage modes (both average
      // before rounding), unclipped and clipped (the sharded policies' norm reads their 16-bit shard, the others'
      // their fp32 copy of the same values).
      for (float clip : {0.0f, 0.05f}) {
        CAPTURE(clip);
        const Params ref = train<tandem::Replicated>(world, reduce, true, 1, clip);
        CHECK(test::bitwise_equal(train<tandem::OptimizerSharded>(world, reduce, true, 1, clip), ref));
        CHECK(test::bitwise_equal(train<tandem::GradientSharded>(world, reduce, true, 1, clip), ref));
        CHECK(test::bitwise_equal(train<tandem::ParameterSharded>(world, reduce, true, 1, clip), ref));
        CHECK(test::bitwise_equal(train<tandem::Replicated>(world, reduce, false, 1, clip), ref));
        CHECK(test::bitwise_equal(train<tandem::OptimizerSharded>(world, reduce, false, 1, clip), ref));
        CHECK(test::bitwise_equal(train<tandem::GradientSharded>(world, reduce, false, 1, clip), ref));
        if (clip > 0.0f) CHECK(!test::bitwise_equal(ref, train<tandem::Replicated>(world, reduce, true)));
      }
      // Accumulation 2: the boundary policies round the accumulated sum once, the others each micro-step's sum.
      const Params boundary = train<tandem::Replicated>(world, reduce, true, 2);
      const Params every = train<tandem::GradientSharded>(world, reduce, true, 2);
      CHECK(test::bitwise_equal(train<tandem::OptimizerSharded>(world, reduce, true, 2), boundary));
      CHECK(test::bitwise_equal(train<tandem::ParameterSharded>(world, reduce, true, 2), every));
      if (world > 1) CHECK(!test::bitwise_equal(boundary, every));
    }
  }
}

TEST_CASE("reduce_dtype: 16-bit training stays close to fp32 training, and differs from it") {
  // SGD with momentum, whose update is linear in the gradients: the parameters' distance from fp32 training is the
  // rounding of the reduced gradients (2^-9 relative in bf16, 2^-12 in fp16, per rounding) carried through 12 steps.
  test::TrainSetup setup;
  const Params initial = test::as_float(mlp::Mlp<float>(setup.dims, setup.seed).params());
  for (int world = 2; world <= 4; ++world) {
    CAPTURE(world);
    const Params fp32 = train<tandem::Replicated, tandem::SGD>(world, DType::fp32, false);
    const Params fp32_every = train<tandem::GradientSharded, tandem::SGD>(world, DType::fp32, true, 2);
    const double moved = max_abs_difference(fp32, initial);
    for (DType reduce : {DType::bf16, DType::fp16}) {
      const std::string wire_dtype = tandem::dtype_name(reduce);
      CAPTURE(wire_dtype);
      const double tolerance = reduce == DType::bf16 ? 1e-2 : 1e-3;
      const double d = max_abs_difference(train<tandem::Replicated, tandem::SGD>(world, reduce, false), fp32) / moved;
      // Accumulation 2, reduced (and rounded) every micro-step.
      const double e =
          max_abs_difference(train<tandem::GradientSharded, tandem::SGD>(world, reduce, true, 2), fp32_every) / moved;
      MESSAGE("world " << world << ", " << wire_dtype << ": at most " << d << " (accumulation 2: " << e
                       << ") of the largest move from the initial values");
      CHECK(d > 0.0);
      CHECK(d < tolerance);
      CHECK(e > 0.0);
      CHECK(e < tolerance);
    }
  }
}

TEST_CASE("reduce_dtype: the gradient collectives travel in the reduce dtype") {
  const std::vector<DType> dtypes = {DType::fp32, DType::bf16, DType::fp16};
  for (DType reduce : dtypes) {
    const std::string wire_dtype = tandem::dtype_name(reduce);
    CAPTURE(wire_dtype);
    tandem::LocalGroup(2).run([&](tandem::LocalComm& local) {
      test::CountingComm comm{local};
      test::DataParallel<tandem::GradientSharded, tandem::SGD, test::CountingComm> gs(comm, specs, {.lr = 0.1f},
                                                                                      small_buckets(reduce));
      gs.template initialize_parameters<float>([](std::size_t, float*) {});
      const std::size_t buckets = gs.num_buckets();
      for (int s = 0; s < 3; ++s) gs.step();
      for (DType d : dtypes)
        CHECK(comm.count(test::Collective::reduce_scatter, d) == (d == reduce ? 3 * static_cast<int>(buckets) : 0));
      // The one all-reduce of an optimizer step is its scalars' (the options check), in fp64.
      CHECK(comm.count(test::Collective::all_reduce) == 3);
      CHECK(comm.count(test::Collective::all_reduce, DType::fp64) == 3);
      // The parameters are gathered in their own dtype, whatever the gradients travel in.
      CHECK(comm.count(test::Collective::all_gather, DType::fp32) == 3 * static_cast<int>(buckets));

      test::CountingComm comm2{local};
      test::DataParallel<tandem::Replicated, tandem::SGD, test::CountingComm> r(comm2, specs, {.lr = 0.1f}, [&] {
        tandem::DataParallelOptions o = small_buckets(reduce);
        o.accumulation_steps = 2;
        return o;
      }());
      r.template initialize_parameters<float>([](std::size_t, float*) {});
      for (int s = 0; s < 6; ++s) r.step();
      for (DType d : dtypes)
        CHECK(comm2.count(test::Collective::all_reduce, d) == (d == reduce ? 3 * static_cast<int>(buckets) : 0));
      CHECK(comm2.count(test::Collective::all_reduce, DType::fp64) == 3);  // at the 3 optimizer steps only
      CHECK(comm2.count(test::Collective::reduce_scatter) == 0);
    });
  }
}

TEST_CASE("reduce_dtype: memory: one bucket more in the reduce dtype, a 16-bit shard at accumulation 1, as estimated") {
  auto check = [](auto policy, tandem::Storage storage) {
    using P = decltype(policy);
    const std::string name = P::name;
    CAPTURE(name);
    for (int world : {1, 3})
      for (int k : {1, 2}) {
        CAPTURE(world);
        CAPTURE(k);
        std::vector<tandem::MemoryReport> held;
        for (DType reduce : {DType::fp32, DType::bf16, DType::fp16}) {
          tandem::DataParallelOptions o = small_buckets(reduce);
          o.accumulation_steps = k;
          tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
            const auto report = [&] {
              if constexpr (tandem::parameter_sharding_of<P> == tandem::ParameterSharding::replicated)
                if (storage == tandem::Storage::user) {
                  std::vector<std::vector<float>> p, g;
                  std::vector<tandem::TensorRef> refs;
                  for (const auto& s : specs) {
                    p.emplace_back(s.numel);
                    g.emplace_back(s.numel);
                    refs.push_back({s.name, p.back().data(), g.back().data(), s.numel});
                  }
                  return test::DataParallel<P, tandem::AdamW>(comm, refs, {}, o).memory_report();
                }
              return test::DataParallel<P, tandem::AdamW>(comm, specs, {}, o).memory_report();
            }();
            CHECK(report == tandem::estimate_memory<P, tandem::AdamW>(specs, world, storage, {}, o,
                                                                      tandem::pack_table_layout_of<test::Backend>()));
            if (comm.rank() == 0) held.push_back(report);
          });
        }
        const tandem::Plan plan = tandem::bucket_plan(specs, world, small_buckets(DType::fp32));
        tandem::MemoryReport expected = held[0];
        expected.buckets += plan.max_bucket_size() * 2;  // the reduce buffer
        if (P::reduction == tandem::GradientReduction::every_micro_step && k == 1) {
          // The shard keeps 2 bytes per element instead of 4: tandem's gradients (owned), or under buckets (user).
          (storage == tandem::Storage::owned ? expected.grads : expected.buckets) -= plan.total_shard_size() * 2;
        }
        CHECK(held[1] == expected);
        CHECK(held[2] == expected);
      }
  };
  check(tandem::Replicated{}, tandem::Storage::user);
  check(tandem::OptimizerSharded{}, tandem::Storage::user);
  check(tandem::GradientSharded{}, tandem::Storage::user);
  check(tandem::Replicated{}, tandem::Storage::owned);
  check(tandem::OptimizerSharded{}, tandem::Storage::owned);
  check(tandem::GradientSharded{}, tandem::Storage::owned);
  check(tandem::ParameterSharded{}, tandem::Storage::owned);
}

TEST_CASE("reduce_dtype: a dtype it cannot reduce in, and ranks that disagree, are errors on every rank") {
  tandem::DataParallelOptions o = small_buckets(DType::fp64);
  CHECK(test::message_of([&] { tandem::detail::validate(o); }) ==
        "tandem: DataParallelOptions::reduce_dtype is fp64; gradients are reduced in fp32, bf16 or fp16");
  o.reduce_dtype = static_cast<DType>(9);
  CHECK(test::message_of([&] { tandem::detail::validate(o); }).find("reduce_dtype is DType 9") != std::string::npos);

  std::vector<std::string> messages(2);
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    messages[static_cast<std::size_t>(comm.rank())] = test::message_of([&] {
      test::DataParallel<tandem::GradientSharded, tandem::SGD> dp(
          comm, specs, {.lr = 0.1f}, small_buckets(comm.rank() == 0 ? DType::fp32 : DType::bf16));
    });
  });
  for (const std::string& m : messages) CHECK(m.find("reduce_dtype") != std::string::npos);
}

TEST_CASE("reduce_dtype: fp16's overflow becomes an infinity the non-finite check sees") {
  // 70000 per rank, averaged over two ranks before rounding: 35000 fits in fp16, their sum, 70000, does not: the
  // reduction rounds it to infinity.
  for (DType reduce : {DType::fp32, DType::fp16}) {
    const std::string wire_dtype = tandem::dtype_name(reduce);
    CAPTURE(wire_dtype);
    tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
      tandem::DataParallelOptions o = small_buckets(reduce);
      o.non_finite = tandem::NonFinite::skip_step;
      test::DataParallel<tandem::GradientSharded, tandem::SGD> dp(comm, specs, {.lr = 1e-6f}, o);
      dp.template initialize_parameters<float>([](std::size_t, float*) {});
      for (std::size_t b = 0; b < dp.num_buckets(); ++b) {
        auto grads = dp.gradients(b);
        for (std::size_t i : grads.tensors()) std::fill_n(grads.grad(i), specs[i].numel, 70000.0f);
      }
      CHECK(dp.step().skipped == (reduce == DType::fp16));
    });
  }
}
