// SPDX-License-Identifier: Apache-2.0
// Built with -Ofast (llm.c's default flags; tests/CMakeLists.txt), where -ffinite-math-only lets the compiler assume
// that no float is a NaN or an infinity, and fold std::isfinite to true and comparisons with NaN away. tandem's checks
// read the bits (tandem::finite), so non-finite gradients are still detected and non-finite options still rejected.
#include <doctest/doctest.h>

#include <limits>
#include <string>
#include <vector>

#include "tandem/tandem.hpp"

namespace {

// A value the compiler cannot see through.
float opaque(float x) {
  volatile float v = x;
  return v;
}

}  // namespace

TEST_CASE("built with -ffinite-math-only") {
#if defined(__FINITE_MATH_ONLY__)
  CHECK(__FINITE_MATH_ONLY__ == 1);
#else
  FAIL("this file must be compiled with -Ofast (or -ffinite-math-only)");
#endif
}

TEST_CASE("finite() reads the bits under -Ofast") {
  CHECK(tandem::finite(opaque(1.0f)));
  CHECK(tandem::finite(static_cast<double>(opaque(-3.0e38f))));
  CHECK_FALSE(tandem::finite(opaque(std::numeric_limits<float>::quiet_NaN())));
  CHECK_FALSE(tandem::finite(opaque(std::numeric_limits<float>::infinity())));
  CHECK_FALSE(tandem::finite(static_cast<double>(opaque(-std::numeric_limits<float>::infinity()))));
}

TEST_CASE("non-finite gradients are detected and non-finite options rejected under -Ofast") {
  for (tandem::NonFinite policy : {tandem::NonFinite::throw_error, tandem::NonFinite::skip_step}) {
    CAPTURE(static_cast<int>(policy));
    std::vector<std::string> errors(2);
    std::vector<std::vector<float>> weights(2);
    tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
      std::vector<float> w(100, 1.0f), g(100, 0.25f);
      tandem::DataParallel<tandem::GradientSharded, tandem::AdamW> dp(comm, {{"w", w.data(), g.data(), w.size()}},
                                                                      {.lr = 0.1f}, {.non_finite = policy});
      if (comm.rank() == 1) g[17] = opaque(std::numeric_limits<float>::quiet_NaN());
      try {
        const tandem::StepResult r = dp.step();
        CHECK(r.skipped);
        CHECK_FALSE(r.updated);
      } catch (const tandem::error& e) {
        errors[static_cast<std::size_t>(comm.rank())] = e.what();
      }
      weights[static_cast<std::size_t>(comm.rank())] = w;
    });
    for (std::size_t r = 0; r < 2; ++r) {
      CHECK(weights[r] == std::vector<float>(100, 1.0f));  // nothing was updated, nothing became a NaN
      CHECK((errors[r].find("non-finite gradients") != std::string::npos) ==
            (policy == tandem::NonFinite::throw_error));
    }
  }
  tandem::LocalGroup(1).run([&](tandem::LocalComm& comm) {
    std::vector<float> w(4), g(4);
    const float nan = opaque(std::numeric_limits<float>::quiet_NaN());
    using DP = tandem::DataParallel<tandem::Replicated, tandem::AdamW>;
    CHECK_THROWS_WITH_AS(DP(comm, {{"w", w.data(), g.data(), 4}}, {.lr = nan}), doctest::Contains("AdamWOptions::lr"),
                         tandem::error);
    CHECK_THROWS_WITH_AS(DP(comm, {{"w", w.data(), g.data(), 4}}, {.beta1 = nan}),
                         doctest::Contains("AdamWOptions::beta1"), tandem::error);
    CHECK_THROWS_WITH_AS(DP(comm, {{"w", w.data(), g.data(), 4}}, {}, {.max_grad_norm = nan}),
                         doctest::Contains("max_grad_norm"), tandem::error);
  });
}
