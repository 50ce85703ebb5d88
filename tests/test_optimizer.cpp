// SPDX-License-Identifier: Apache-2.0
// AdamW and SGD bodies against double-precision references written from the papers/PyTorch's formulas,
// over several steps, with fp32 and 16-bit parameters, run with one lane and with 256 lanes.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <random>
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
    a.grad_scale = grad_scale;
    run_body(typename Opt::template Body<P>{a, Opt::scalars(o, t)}, tandem::update_items(n), lanes);

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

TEST_CASE("optimizer options are validated with the option's name") {
  CHECK_THROWS_WITH_AS(tandem::AdamW::validate({.lr = -1.0f}), doctest::Contains("AdamWOptions::lr"), tandem::error);
  CHECK_THROWS_WITH_AS(tandem::AdamW::validate({.beta2 = 1.0f}), doctest::Contains("beta2"), tandem::error);
  CHECK_THROWS_WITH_AS(tandem::AdamW::validate({.eps = 0.0f}), doctest::Contains("eps"), tandem::error);
  CHECK_THROWS_WITH_AS(tandem::SGD::validate({.lr = 0.1f, .nesterov = tandem::Nesterov::on}),
                       doctest::Contains("nesterov"), tandem::error);
  CHECK_NOTHROW(tandem::SGD::validate({}));
}
