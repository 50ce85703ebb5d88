// SPDX-License-Identifier: Apache-2.0
// AdamW and SGD bodies against double-precision references written from the papers/PyTorch's formulas,
// over several steps, with fp32 and 16-bit parameters, run with one lane and with 256 lanes; and against their element
// maths as plain loops, bit for bit, at every array alignment, lane count and dtype (the shape of detail::update_item).
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "tandem/core/dtype.hpp"
#include "tandem/kernels/adamw.hpp"
#include "tandem/kernels/sgd.hpp"
#include "tandem/kernels/sum_squares.hpp"

namespace {

constexpr std::size_t n = 10007;

struct Reference {
  std::vector<double> w, m, v;
};

template <class Body>
void run_body(const Body& body, std::size_t items, unsigned lanes) {
  for (std::size_t i = 0; i < items; ++i)
    for (unsigned l = 0; l < lanes; ++l) body(i, l, lanes);
}

// ‖a - b‖ / ‖b‖
double relative_error(const std::vector<float>& a, const std::vector<double>& b) {
  double d = 0, r = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    d += (a[i] - b[i]) * (a[i] - b[i]);
    r += b[i] * b[i];
  }
  return std::sqrt(d / r);
}

template <class P, class Opt>
void check_optimizer(const typename Opt::Options& o, unsigned lanes) {
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> master(n), state0(n, 0.0f), state1(n, 0.0f), grad(n);
  std::vector<P> param(n);
  Reference ref{std::vector<double>(n), std::vector<double>(n, 0.0), std::vector<double>(n, 0.0)};
  for (std::size_t i = 0; i < n; ++i) {
    master[i] = static_cast<float>(P(dist(rng)));
    ref.w[i] = master[i];
  }
  const float grad_scale = 0.75f;
  for (std::uint64_t t = 1; t <= 5; ++t) {
    for (auto& g : grad) g = dist(rng) * 0.1f;
    for (std::size_t i = 0; i < n; ++i) param[i] = P(std::nanf(""));  // poison: every element must be written
    tandem::UpdateArgs<P> a;
    a.master = master.data();
    a.param = param.data();
    a.grad = grad.data();
    a.state[0] = state0.data();
    a.state[1] = state1.data();
    a.n = n;
    a.grad_scale = &grad_scale;
    const typename Opt::Scalars scalars = Opt::scalars(o, t);
    run_body(typename Opt::template Body<P>{a, &scalars}, tandem::update_items(n), lanes);

    // double-precision reference
    for (std::size_t i = 0; i < n; ++i) {
      const double g = double{grad_scale} * grad[i];
      double& w = ref.w[i];
      if constexpr (std::is_same_v<Opt, tandem::AdamW>) {
        w *= 1.0 - double{o.lr} * o.weight_decay;
        ref.m[i] = o.beta1 * ref.m[i] + (1.0 - o.beta1) * g;
        ref.v[i] = o.beta2 * ref.v[i] + (1.0 - o.beta2) * g * g;
        const double mhat = ref.m[i] / (1.0 - std::pow(double{o.beta1}, double(t)));
        const double vhat = ref.v[i] / (1.0 - std::pow(double{o.beta2}, double(t)));
        w -= o.lr * mhat / (std::sqrt(vhat) + o.eps);
      } else {
        double d = g + double{o.weight_decay} * w;
        if (o.momentum != 0.0f) {
          ref.m[i] = t == 1 ? d : o.momentum * ref.m[i] + (1.0 - o.dampening) * d;
          d = o.nesterov == tandem::Nesterov::on ? d + o.momentum * ref.m[i] : ref.m[i];
        }
        w -= o.lr * d;
      }
    }
    CAPTURE(t);
    CHECK(relative_error(master, ref.w) < 1e-6);
    for (std::size_t i = 0; i < n; ++i)
      if (static_cast<float>(param[i]) != static_cast<float>(P(master[i])))
        FAIL("param " << i << " is not the cast master weight");
  }
}

}  // namespace

TEST_CASE_TEMPLATE("AdamW body equals a double-precision reference", P, float, tandem::BFloat16, tandem::Float16) {
  tandem::AdamWOptions o{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-8f, .weight_decay = 0.1f};
  check_optimizer<P, tandem::AdamW>(o, 1);
  check_optimizer<P, tandem::AdamW>(o, 256);
}

TEST_CASE_TEMPLATE("SGD body equals a double-precision reference", P, float, tandem::BFloat16) {
  check_optimizer<P, tandem::SGD>({.lr = 0.1f}, 1);
  check_optimizer<P, tandem::SGD>({.lr = 0.1f, .momentum = 0.9f, .dampening = 0.1f, .weight_decay = 1e-2f}, 256);
  check_optimizer<P, tandem::SGD>(
      {.lr = 0.05f, .momentum = 0.8f, .weight_decay = 1e-3f, .nesterov = tandem::Nesterov::on}, 1);
}

TEST_CASE("without weight decay an infinite weight stays infinite, as in PyTorch (SGD made it NaN: 0 times inf)") {
  constexpr float inf = std::numeric_limits<float>::infinity();
  for (const float momentum : {0.0f, 0.9f}) {
    const auto s = tandem::SGD::scalars({.lr = 0.1f, .momentum = momentum}, 2);
    float w = inf, b[1] = {0.5f};
    tandem::SGD::Body<float>::element(s, 0.5f, w, b);
    CHECK(w == inf);
    w = -inf;
    tandem::SGD::Body<float>::element(s, 0.5f, w, b);
    CHECK(w == -inf);
  }
  const auto s = tandem::AdamW::scalars({.lr = 0.1f, .weight_decay = 0.0f}, 2);
  float w = inf, m = 0.1f, v = 0.1f;
  tandem::AdamW::Body<float>::element(s, 0.5f, w, m, v);
  CHECK(w == inf);
}

TEST_CASE("sum of squares: fixed chunking, equal to a double loop") {
  std::mt19937 rng(9);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{4095}, std::size_t{4097}, std::size_t{50001}}) {
    std::vector<float> x(count);
    for (auto& e : x) e = dist(rng);
    double want = 0;
    for (float e : x) want += double{e} * e;
    const tandem::SumSquaresBody body{x.data(), count};
    double one_lane = 0, many_lanes = 0;
    for (std::size_t i = 0; i < tandem::sum_squares_items(count); ++i) {
      one_lane += body(i, 0, 1);
      for (unsigned l = 0; l < 256; ++l) many_lanes += body(i, l, 256);
    }
    CHECK(one_lane == doctest::Approx(want).epsilon(1e-12));
    CHECK(many_lanes == doctest::Approx(want).epsilon(1e-12));
  }
}

TEST_CASE("bias corrections by squaring are within a float's rounding of std::pow's, at any step count") {
  using tandem::detail::pow_rn;
  for (std::uint64_t t = 0; t < 64; ++t) CHECK(pow_rn(0.5, t) == std::ldexp(1.0, -static_cast<int>(t)));  // exact
  CHECK(pow_rn(0.9, 1) == 0.9);
  std::mt19937_64 rng(3);
  for (float beta : {0.5f, 0.9f, 0.99f, 0.999f, 0.9999f, 0.99999f}) {
    const tandem::AdamWOptions o{.lr = 3e-4f, .beta1 = beta, .beta2 = beta};
    for (int k = 0; k < 3000; ++k) {
      const std::uint64_t t = k < 2000 ? static_cast<std::uint64_t>(k) + 1 : (rng() >> (24 + k % 40)) + 1;
      const tandem::AdamW::Scalars s = tandem::AdamW::scalars(o, t);
      const double bc = 1.0 - std::pow(double{beta}, static_cast<double>(t));
      const auto step_size = static_cast<float>(double{o.lr} / bc);
      const auto inv_sqrt = static_cast<float>(1.0 / std::sqrt(bc));
      CAPTURE(beta);
      CAPTURE(t);
      CHECK(std::abs(s.step_size - step_size) <= std::nextafter(step_size, 2 * step_size) - step_size);
      CHECK(std::abs(s.inv_sqrt_bc2 - inv_sqrt) <= std::nextafter(inv_sqrt, 2 * inv_sqrt) - inv_sqrt);
    }
  }
}

TEST_CASE("PrepareStepBody: the step count advances, each group's scalars, and torch's clip rule in the factor") {
  const std::array<tandem::AdamWOptions, 2> groups{tandem::AdamWOptions{.lr = 1e-3f},
                                                   tandem::AdamWOptions{.lr = 2e-2f, .weight_decay = 0.0f}};
  std::array<tandem::AdamW::Scalars, 2> scalars{};
  std::uint64_t step = 41;
  float scale = -1.0f;
  std::uint32_t skip = 7;
  tandem::detail::StepRecord record{};
  auto prepare = [&](const tandem::detail::StepChecks& checks) {
    tandem::detail::PrepareStepBody<tandem::AdamW>{&step, &scale, groups.data(), scalars.data(),
                                                   2,     checks, &skip,         &record}(0, 0, 1);
  };
  using tandem::detail::StepVerdict;
  prepare({.average = 0.25f});  // no norm: the factor is the averaging
  CHECK(step == 42);
  CHECK(scale == 0.25f);
  CHECK(skip == 0);
  CHECK(record.verdict == StepVerdict::update);
  CHECK(record.step == 42);
  CHECK(record.clip_coefficient == 1.0f);
  for (std::size_t g = 0; g < 2; ++g) {
    const tandem::AdamW::Scalars want = tandem::AdamW::scalars(groups[g], 42);
    CHECK(std::memcmp(&scalars[g], &want, sizeof want) == 0);
  }
  const double big = 400.0;  // norm sqrt(400) * 0.5 = 10 against max 1: factor 0.5 * 1 / (10 + 1e-6)
  prepare({.sum_of_squares = &big, .average = 0.5f, .max_grad_norm = 1.0f});
  CHECK(step == 43);
  const float clip = static_cast<float>(1.0 / (10.0 + 1e-6));
  CHECK(scale == static_cast<float>(0.5 * clip));
  CHECK(record.grad_norm == 10.0);
  CHECK(record.clip_coefficient == clip);
  prepare({.sum_of_squares = &big, .average = 0.5f});  // the norm without clipping (a non-finite check only)
  CHECK(scale == 0.5f);
  CHECK(record.grad_norm == 10.0);
  CHECK(record.clip_coefficient == 1.0f);
  const double small = 0.01;  // norm 0.05 under max 1: not clipped
  prepare({.sum_of_squares = &small, .average = 0.5f, .max_grad_norm = 1.0f});
  CHECK(scale == 0.5f);
  const double nan = std::nan("");
  prepare({.sum_of_squares = &nan, .average = 0.5f, .max_grad_norm = 1.0f});  // NonFinite::ignore: not clipped
  CHECK(scale == 0.5f);
  CHECK(step == 46);
  CHECK(skip == 0);
  CHECK(record.verdict == StepVerdict::update);

  // A non-finite norm where it skips: no count, no scalars, the skip word set, the record says why.
  const std::array<tandem::AdamW::Scalars, 2> before = scalars;
  scale = -1.0f;
  for (const double bad : {nan, std::numeric_limits<double>::infinity()}) {
    prepare({.sum_of_squares = &bad, .average = 0.5f, .max_grad_norm = 1.0f, .skip_non_finite = true});
    CHECK(step == 46);
    CHECK(skip == 1);
    CHECK(record.verdict == StepVerdict::non_finite);
    CHECK(record.step == 46);
    CHECK(scale == -1.0f);
    CHECK(std::memcmp(scalars.data(), before.data(), sizeof before) == 0);
  }
  prepare({.sum_of_squares = &big, .average = 0.5f, .skip_non_finite = true});  // a finite norm updates
  CHECK(step == 47);
  CHECK(skip == 0);

  // The options' lanes over 3 ranks (detail::WordAgreement): equal words update, different ones do not, before the
  // norm is looked at.
  auto lanes_of = [](std::initializer_list<std::uint64_t> words) {
    std::array<double, tandem::detail::WordAgreement::lanes> sums{};
    for (std::uint64_t w : words) {
      const auto mine = tandem::detail::WordAgreement::encode(w, 3);
      for (std::size_t l = 0; l < sums.size(); ++l) sums[l] += mine[l];
    }
    return sums;
  };
  const auto same = lanes_of({0x1234567890abcdefu, 0x1234567890abcdefu, 0x1234567890abcdefu});
  const auto differ = lanes_of({0x1234567890abcdefu, 0x1234567890abcdeeu, 0x1234567890abcdefu});
  prepare({.average = 1.0f, .lanes = same.data(), .world = 3});
  CHECK(step == 48);
  CHECK(record.verdict == StepVerdict::update);
  prepare({.sum_of_squares = &nan, .average = 1.0f, .lanes = differ.data(), .world = 3, .skip_non_finite = true});
  CHECK(step == 48);
  CHECK(skip == 1);
  CHECK(record.verdict == StepVerdict::options_differ);
  CHECK(record.step == 48);

  // Without a skip word or a record the body decides the same and writes neither.
  tandem::detail::PrepareStepBody<tandem::AdamW>{
      &step, &scale, groups.data(), scalars.data(), 2, {.average = 1.0f, .lanes = differ.data(), .world = 3}}(0, 0, 1);
  CHECK(step == 48);

  // A launch made for another grouping than the one in use (a replay of a step captured before the groups changed)
  // does not update, before any other check, and is counted in the third tally; the grouping it was made for updates.
  std::array<std::uint64_t, 3> tallies{5, 6, 7};
  const std::uint64_t in_use = 3;
  auto launch = [&](std::uint64_t made_for, const tandem::detail::StepChecks& checks) {
    tandem::detail::PrepareStepBody<tandem::AdamW>{.step = &step,
                                                   .grad_scale = &scale,
                                                   .options = groups.data(),
                                                   .scalars = scalars.data(),
                                                   .groups = 2,
                                                   .checks = checks,
                                                   .skip = &skip,
                                                   .record = &record,
                                                   .tallies = tallies.data(),
                                                   .grouping = &in_use,
                                                   .launched_grouping = made_for}(0, 0, 1);
  };
  scale = -1.0f;
  const std::array<tandem::AdamW::Scalars, 2> kept = scalars;
  for (const std::uint64_t made_for : {std::uint64_t{2}, std::uint64_t{4}}) {
    launch(made_for,
           {.sum_of_squares = &nan, .average = 1.0f, .lanes = differ.data(), .world = 3, .skip_non_finite = true});
    CHECK(step == 48);
    CHECK(skip == 1);
    CHECK(scale == -1.0f);
    CHECK(std::memcmp(scalars.data(), kept.data(), sizeof kept) == 0);
    CHECK(record.verdict == StepVerdict::regrouped);
    CHECK(record.step == 48);
  }
  CHECK(tallies == std::array<std::uint64_t, 3>{5, 6, 9});
  CHECK(record.non_finite_steps == 5);
  CHECK(record.refused_steps == 6);
  CHECK(record.regrouped_steps == 9);
  // Made for the grouping in use, but stale on another rank (the ranks' stale lanes sum to more than 0): the same
  double stale = 1.0;
  launch(in_use, {.average = 1.0f, .lanes = same.data(), .stale = &stale, .world = 3});
  CHECK(step == 48);
  CHECK(skip == 1);
  CHECK(record.verdict == StepVerdict::regrouped);
  CHECK(tallies == std::array<std::uint64_t, 3>{5, 6, 10});
  stale = 0.0;
  launch(in_use, {.average = 1.0f, .lanes = same.data(), .stale = &stale, .world = 3});
  CHECK(step == 49);
  CHECK(skip == 0);
  CHECK(record.verdict == StepVerdict::update);
  CHECK(tallies == std::array<std::uint64_t, 3>{5, 6, 10});
}

TEST_CASE_TEMPLATE("update bodies leave every array as it is where the skip word is set", Opt, tandem::AdamW,
                   tandem::SGD) {
  // Poisoned outputs would show any write; then a cleared word updates (so the check above can fail).
  constexpr std::size_t m = 3000;
  std::vector<float> master(m), s0(m, 0.5f), s1(m, 0.25f), grad(m, 0.125f);
  std::vector<tandem::BFloat16> param(m, tandem::BFloat16(std::nanf("")));
  for (std::size_t i = 0; i < m; ++i) master[i] = static_cast<float>(i) * 0.01f;
  const std::vector<float> master0 = master, s00 = s0, s10 = s1;
  const float grad_scale = 1.0f;
  std::uint32_t skip = 1;
  tandem::UpdateArgs<tandem::BFloat16> a{master.data(), param.data(), grad.data(), {s0.data(), s1.data()}, m,
                                         &grad_scale,   &skip};
  typename Opt::Options o{};
  o.lr = 0.1f;
  if constexpr (std::is_same_v<Opt, tandem::SGD>) o.momentum = 0.9f;
  const typename Opt::Scalars scalars = Opt::scalars(o, 2);
  for (unsigned lanes : {1u, 256u}) {
    run_body(typename Opt::template Body<tandem::BFloat16>{a, &scalars}, tandem::update_items(m), lanes);
    CHECK(master == master0);
    CHECK(s0 == s00);
    CHECK(s1 == s10);
    for (const tandem::BFloat16 p : param) REQUIRE(std::isnan(static_cast<float>(p)));
  }
  skip = 0;
  run_body(typename Opt::template Body<tandem::BFloat16>{a, &scalars}, tandem::update_items(m), 1);
  CHECK(master != master0);
  CHECK(!std::isnan(static_cast<float>(param[m - 1])));
}

TEST_CASE("optimizer options are validated with the option's name") {
  CHECK_THROWS_WITH_AS(tandem::AdamW::validate({.lr = -1.0f}), doctest::Contains("AdamWOptions::lr"), tandem::error);
  CHECK_THROWS_WITH_AS(tandem::AdamW::validate({.beta2 = 1.0f}), doctest::Contains("beta2"), tandem::error);
  CHECK_THROWS_WITH_AS(tandem::AdamW::validate({.eps = 0.0f}), doctest::Contains("eps"), tandem::error);
  CHECK_THROWS_WITH_AS(tandem::AdamW::validate({.eps = -1e-9f}), doctest::Contains("eps is -9.99999972e-10;"),
                       tandem::error);  // every digit that tells it apart: it said -0.000000
  CHECK_THROWS_WITH_AS(tandem::SGD::validate({.lr = std::numeric_limits<float>::quiet_NaN()}),
                       doctest::Contains("SGDOptions::lr is nan;"), tandem::error);
  CHECK_THROWS_WITH_AS(tandem::SGD::validate({.lr = 0.1f, .nesterov = tandem::Nesterov::on}),
                       doctest::Contains("nesterov"), tandem::error);
  CHECK_NOTHROW(tandem::SGD::validate({}));
}

// ---- the bodies' shape: every alignment, lane count and dtype gives the bits of a plain loop ----------------------

namespace {

/// The element updates written out as plain loops in the order of the rounding rule (each product rounded on its own;
/// this file is built with -ffp-contract=off like every tandem target): what a body must give, bit for bit, whatever
/// its vector groups, head and tail, lanes and array alignments.
struct PlainAdamW {
  tandem::AdamW::Scalars s;
  void operator()(float g, float& w, float& m, float& v) const {
    w = w * s.decay;
    m = s.beta1 * m + (1.0f - s.beta1) * g;
    v = s.beta2 * v + ((1.0f - s.beta2) * g) * g;
    const float denom = std::sqrt(v) * s.inv_sqrt_bc2 + s.eps;
    w = w - (s.step_size * m) / denom;
  }
};

struct PlainSGD {
  tandem::SGD::Scalars s;
  void operator()(float g, float& w, float& b, float&) const {
    g = g + s.weight_decay * w;
    if (s.has_momentum) {
      b = s.first_step ? g : s.momentum * b + (1.0f - s.dampening) * g;
      g = s.nesterov ? g + s.momentum * b : b;
    }
    w = w - s.lr * g;
  }
};

template <class T>
std::uint64_t bits_of(T x) {
  std::uint64_t b = 0;
  std::memcpy(&b, &x, sizeof x);
  return b;
}

/// Arrays at a chosen misalignment: `offset` elements past a 64-byte-aligned start.
template <class T>
struct Shifted {
  std::vector<unsigned char> bytes;
  T* p = nullptr;
  Shifted(std::size_t n, std::size_t offset) : bytes((n + offset) * sizeof(T) + 64) {
    auto at = reinterpret_cast<std::uintptr_t>(bytes.data());
    at = (at + 63) / 64 * 64 + offset * sizeof(T);
    p = reinterpret_cast<T*>(at);
  }
};

/// One step of Opt's body over n elements with the given per-array offsets (master, grad, state 0, state 1, param) and
/// lanes, against the plain loop. `shared` makes fp32 parameters their own master (param == master).
template <class Opt, class P, class G>
void check_against_plain(const typename Opt::Options& o, std::uint64_t t, std::size_t n,
                         const std::array<std::size_t, 5>& offsets, unsigned lanes, bool shared, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  Shifted<float> master(n, offsets[0]), s0(n, offsets[2]), s1(n, offsets[3]);
  Shifted<G> grad(n, offsets[1]);
  Shifted<P> param(n, offsets[4]);
  std::vector<float> w(n), m(n), v(n);
  for (std::size_t i = 0; i < n; ++i) {
    master.p[i] = w[i] = dist(rng);
    grad.p[i] = G(dist(rng) * 0.1f);
    s0.p[i] = m[i] = dist(rng) * 0.01f;
    s1.p[i] = v[i] = std::abs(dist(rng)) * 1e-4f;
    param.p[i] = P(std::nanf(""));  // poison: every element must be written
  }
  tandem::UpdateArgs<P, G> a;
  a.master = master.p;
  a.param = shared ? reinterpret_cast<P*>(master.p) : param.p;
  a.grad = grad.p;
  a.state[0] = s0.p;
  a.state[1] = s1.p;
  a.n = n;
  const float grad_scale = 0.75f;
  a.grad_scale = &grad_scale;
  const typename Opt::Scalars scalars = Opt::scalars(o, t);
  run_body(typename Opt::template Body<P, G>{a, &scalars}, tandem::update_items(n), lanes);

  using Plain = std::conditional_t<std::is_same_v<Opt, tandem::AdamW>, PlainAdamW, PlainSGD>;
  const Plain plain{scalars};
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < n; ++i) {
    plain(0.75f * static_cast<float>(grad.p[i]), w[i], m[i], v[i]);
    const bool state1 = std::is_same_v<Opt, tandem::AdamW>;
    const bool state0 = state1 || Opt::state_count(o) > 0;
    if (bits_of(master.p[i]) != bits_of(w[i]) || (state0 && bits_of(s0.p[i]) != bits_of(m[i])) ||
        (state1 && bits_of(s1.p[i]) != bits_of(v[i])) ||
        (!shared && bits_of(param.p[i]) != bits_of(tandem::convert<P>(w[i]))))
      ++wrong;
  }
  CHECK_MESSAGE(wrong == 0, Opt::name << " n " << n << " lanes " << lanes << " offsets " << offsets[0] << offsets[1]
                                      << offsets[2] << offsets[3] << offsets[4] << (shared ? " shared" : ""));
}

template <class Opt, class P, class G>
void check_shapes(const typename Opt::Options& o) {
  std::mt19937 rng(17);
  const std::size_t group = tandem::detail::update_group_elements<P, G>;
  std::uniform_int_distribution<std::size_t> shift(0, group - 1);
  for (std::size_t n :
       {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{4096}, std::size_t{4099}, std::size_t{9001}})
    for (unsigned lanes : {1u, 3u, 32u, 256u}) {  // the host, odd, a CUDA warp (what a launch gives an item), a block
      std::vector<std::array<std::size_t, 5>> layouts = {{0, 0, 0, 0, 0}, {1, 1, 1, 1, 1}, {3, 3, 3, 3, 3}};
      for (int k = 0; k < 4; ++k) layouts.push_back({shift(rng), shift(rng), shift(rng), shift(rng), shift(rng)});
      for (const auto& offsets : layouts) {
        for (std::uint64_t t : {std::uint64_t{1}, std::uint64_t{3}})
          check_against_plain<Opt, P, G>(o, t, n, offsets, lanes, false, rng);
        if constexpr (std::is_same_v<P, float>) check_against_plain<Opt, P, G>(o, 2, n, offsets, lanes, true, rng);
      }
    }
}

template <class P, class G>
void check_every_optimizer() {
  check_shapes<tandem::AdamW, P, G>({.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-8f, .weight_decay = 0.1f});
  // every combination of SGD's flags (its body has a loop for each): weight decay, momentum, Nesterov; the first step
  // (t = 1) and a later one
  check_shapes<tandem::SGD, P, G>({.lr = 0.1f});
  check_shapes<tandem::SGD, P, G>({.lr = 0.1f, .weight_decay = 1e-2f});
  check_shapes<tandem::SGD, P, G>({.lr = 0.1f, .momentum = 0.9f, .dampening = 0.1f});
  check_shapes<tandem::SGD, P, G>({.lr = 0.1f, .momentum = 0.9f, .dampening = 0.1f, .weight_decay = 1e-2f});
  check_shapes<tandem::SGD, P, G>({.lr = 0.05f, .momentum = 0.8f, .nesterov = tandem::Nesterov::on});
  check_shapes<tandem::SGD, P, G>(
      {.lr = 0.05f, .momentum = 0.8f, .weight_decay = 1e-3f, .nesterov = tandem::Nesterov::on});
}

}  // namespace

TEST_CASE_TEMPLATE("update bodies give the plain loop's bits at every alignment, lane count and dtype", P, float,
                   tandem::BFloat16, tandem::Float16) {
  SUBCASE("fp32 gradients") { check_every_optimizer<P, float>(); }
  SUBCASE("bf16 gradients") { check_every_optimizer<P, tandem::BFloat16>(); }
}
