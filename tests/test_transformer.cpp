// SPDX-License-Identifier: Apache-2.0
// The tiny transformer's backward pass against central finite differences in double precision: every row
// operation on its own (LayerNorm, GELU, causal softmax, cross-entropy), then every parameter of a whole
// small model (which covers the embeddings, attention, MLP, residuals and head through their composition).
// The float model, which trains, is checked against the double one; its fast exp against the C library's.
// Then the example's data: the sorting task, text windows and the distributed sampler; and which OpenBLAS kernels
// the example runs on (blas_core.hpp): the verdicts, the --blas-core plan and the sgemm check of candidate kernels.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <vector>

#include "../examples/tiny_transformer/blas_core.hpp"
#include "../examples/tiny_transformer/data.hpp"
#include "../examples/tiny_transformer/model.hpp"
#include "support/cases.hpp"

namespace {

std::vector<double> random_vector(std::size_t n, std::mt19937_64& rng, double scale = 1.0) {
  std::normal_distribution<double> normal(0.0, scale);
  std::vector<double> v(n);
  for (double& x : v) x = normal(rng);
  return v;
}

/// Central difference of f at x[i] (x restored afterwards).
template <class F>
double numeric_derivative(std::vector<double>& x, std::size_t i, F&& f, double h = 1e-6) {
  const double saved = x[i];
  x[i] = saved + h;
  const double up = f();
  x[i] = saved - h;
  const double down = f();
  x[i] = saved;
  return (up - down) / (2 * h);
}

/// |a - b| <= tol * max(1, |b|): relative for large values, absolute near zero.
void check_close(double analytic, double numeric, double tol, const std::string& what) {
  INFO(what << ": analytic " << analytic << ", numeric " << numeric);
  CHECK(std::abs(analytic - numeric) <= tol * std::max(1.0, std::abs(numeric)));
}

}  // namespace

TEST_CASE("exp_approx and tanh_approx match the C library in float") {
  double worst_exp = 0, worst_tanh = 0;
  for (float x = -87.0f; x <= 88.0f; x += 0.0137f) {
    const double ref = std::exp(double(x));
    worst_exp = std::max(worst_exp, std::abs(tiny::exp_approx(x) - ref) / ref);
  }
  for (float y = -12.0f; y <= 12.0f; y += 0.00113f)
    worst_tanh = std::max(worst_tanh, std::abs(double(tiny::tanh_approx(y)) - std::tanh(double(y))));
  CHECK(worst_exp < 3e-7);
  CHECK(worst_tanh < 3e-7);
  CHECK(tiny::exp_approx(-1000.0f) >= 0.0f);
  CHECK(tiny::exp_approx(-1000.0f) < 1e-37f);
  CHECK(std::isfinite(tiny::exp_approx(1000.0f)));
}

TEST_CASE("row operations: backward equals finite differences (double)") {
  std::mt19937_64 rng(11);
  const int c = 13;

  SUBCASE("GELU") {
    for (double x : {-4.0, -1.3, -0.2, 0.0, 0.05, 0.7, 2.5, 6.0}) {
      std::vector<double> v{x};
      check_close(tiny::gelu_grad(x), numeric_derivative(v, 0, [&] { return tiny::gelu(v[0]); }), 1e-7, "gelu'");
    }
  }

  SUBCASE("LayerNorm: d/dx, d/dw, d/db of sum(dy * y)") {
    auto x = random_vector(c, rng, 2.0), w = random_vector(c, rng), b = random_vector(c, rng),
         dy = random_vector(c, rng);
    auto objective = [&] {
      std::vector<double> y(c);
      double mean, rstd, s = 0;
      tiny::layernorm_row(x.data(), w.data(), b.data(), y.data(), &mean, &rstd, c);
      for (int i = 0; i < c; ++i) s += dy[i] * y[i];
      return s;
    };
    std::vector<double> y(c), dx(c, 0.5), dwx(c, 7.0);  // dx accumulates onto what is there, dwx is overwritten
    double mean, rstd;
    tiny::layernorm_row(x.data(), w.data(), b.data(), y.data(), &mean, &rstd, c);
    tiny::layernorm_row_backward(dy.data(), x.data(), w.data(), mean, rstd, dx.data(), dwx.data(), c);
    for (int i = 0; i < c; ++i) {  // one row: its dw is dwx, its db is dy
      check_close(dx[i] - 0.5, numeric_derivative(x, i, objective), 1e-6, "dx");
      check_close(dwx[i], numeric_derivative(w, i, objective), 1e-6, "dw");
      check_close(dy[i], numeric_derivative(b, i, objective), 1e-6, "db");
    }
  }

  SUBCASE("causal softmax: row i sees keys 0..i, the rest is zero") {
    const int len = 9, seen = 6;
    auto s = random_vector(len, rng, 3.0), dp = random_vector(len, rng);
    auto objective = [&] {
      std::vector<double> p = s;
      tiny::causal_softmax_row(p.data(), seen, len);
      double o = 0;
      for (int j = 0; j < len; ++j) o += dp[j] * p[j];
      return o;
    };
    std::vector<double> p = s;
    tiny::causal_softmax_row(p.data(), seen, len);
    double total = 0;
    for (int j = 0; j < seen; ++j) total += p[j];
    CHECK(total == doctest::Approx(1.0).epsilon(1e-14));
    for (int j = seen; j < len; ++j) CHECK(p[j] == 0.0);
    std::vector<double> ds = dp;
    tiny::causal_softmax_row_backward(p.data(), ds.data(), seen, len);
    for (int j = 0; j < len; ++j) check_close(ds[j], numeric_derivative(s, j, objective), 1e-6, "dscore");
  }

  SUBCASE("cross-entropy: loss, argmax and gradient") {
    const int v = 11, target = 4;
    auto logits = random_vector(v, rng, 2.0);
    logits[7] = 9.0;  // the argmax, not the target
    auto loss = [&] {
      std::vector<double> l = logits;
      return tiny::cross_entropy_row(l.data(), target, v, 0.0).loss;
    };
    double lse = 0;
    for (double z : logits) lse += std::exp(z);
    CHECK(loss() == doctest::Approx(std::log(lse) - logits[target]).epsilon(1e-13));
    std::vector<double> g = logits;
    const auto row = tiny::cross_entropy_row(g.data(), target, v, 0.5);
    CHECK_FALSE(row.correct);
    for (int j = 0; j < v; ++j) check_close(g[j], 0.5 * numeric_derivative(logits, j, loss), 1e-7, "dlogit");
  }
}

namespace {

tiny::ModelConfig small_config() {
  return {.vocab = 7, .context = 6, .width = 8, .layers = 2, .heads = 2, .mlp_ratio = 2};
}

struct Batch {
  int batch, len;
  std::vector<int> tokens, targets;
  Batch(int batch_, int len_, std::uint64_t seed, int vocab) : batch(batch_), len(len_) {
    std::mt19937_64 rng(seed);
    for (int i = 0; i < batch * len; ++i) {
      tokens.push_back(static_cast<int>(rng() % vocab));
      targets.push_back(i % 4 == 1 ? -1 : static_cast<int>(rng() % vocab));  // some rows have no target
    }
  }
};

/// Every parameter's analytic gradient against a central difference of the mean loss.
void check_every_parameter(tiny::Transformer<double>& model, const Batch& data) {
  // Larger weights than GPT-2's init, so that attention is far from uniform and every path carries signal.
  std::mt19937_64 rng(5);
  std::normal_distribution<double> normal(0.0, 0.3);
  for (double& p : model.parameters()) p += normal(rng);

  model.forward(data.tokens.data(), data.targets.data(), data.batch, data.len, tiny::Pass::train);
  std::vector<double>& grads = model.gradients();
  std::fill(grads.begin(), grads.end(), std::nan(""));  // backward must write every element
  model.backward();
  const std::vector<double> analytic = grads;

  std::vector<double>& params = model.parameters();
  auto loss = [&] {
    return model.forward(data.tokens.data(), data.targets.data(), data.batch, data.len, tiny::Pass::evaluate)
        .mean_loss();
  };
  std::size_t checked = 0;
  double worst = 0;
  for (std::size_t t = 0; t < model.num_tensors(); ++t) {
    const std::size_t begin = model.param(t) - params.data();
    for (std::size_t i = begin; i < begin + model.tensor_numel(t); ++i) {
      const double numeric = numeric_derivative(params, i, loss);
      INFO(model.tensor_name(t) << "[" << (i - begin) << "]");
      check_close(analytic[i], numeric, 1e-6, "gradient");
      worst = std::max(worst, std::abs(analytic[i] - numeric));
      ++checked;
    }
  }
  CHECK(checked == model.num_parameters());
  MESSAGE("max |analytic - numeric| over " << checked << " parameters: " << worst);
  // Positions past the batch's length are never used: their position embeddings get no gradient.
  const std::size_t width = std::size_t(model.config().width), wpe_begin = model.param(1) - params.data();
  for (std::size_t i = wpe_begin + std::size_t(data.len) * width; i < wpe_begin + model.config().context * width; ++i)
    CHECK(analytic[i] == 0.0);
}

}  // namespace

TEST_CASE("whole model: every parameter's gradient equals finite differences (double)") {
  SUBCASE("short sequences: one block of attention rows") {
    tiny::Transformer<double> model(small_config(), 3);
    check_every_parameter(model, Batch(3, 5, 9, 7));
  }
  SUBCASE("long sequences: several blocks of attention rows, the last one partial") {
    tiny::ModelConfig cfg = small_config();
    cfg.context = 150;
    cfg.layers = 1;
    tiny::Transformer<double> model(cfg, 4);
    check_every_parameter(model, Batch(1, 141, 10, 7));
  }
}

TEST_CASE("the float model (fast exp, float BLAS) tracks the double model") {
  const tiny::ModelConfig cfg{.vocab = 19, .context = 16, .width = 32, .layers = 2, .heads = 4, .mlp_ratio = 4};
  tiny::Transformer<double> ref(cfg, 8);
  tiny::Transformer<float> model(cfg, 8);
  for (std::size_t i = 0; i < ref.num_parameters(); ++i) ref.parameters()[i] = double(model.parameters()[i]);
  std::mt19937_64 rng(21);
  const int batch = 4, len = 16;
  std::vector<int> tokens(batch * len), targets(batch * len);
  for (int i = 0; i < batch * len; ++i) tokens[i] = int(rng() % 19), targets[i] = int(rng() % 19);

  const auto a = model.forward(tokens.data(), targets.data(), batch, len, tiny::Pass::train);
  const auto b = ref.forward(tokens.data(), targets.data(), batch, len, tiny::Pass::train);
  CHECK(a.mean_loss() == doctest::Approx(b.mean_loss()).epsilon(1e-5));
  model.backward();
  ref.backward();
  for (std::size_t t = 0; t < ref.num_tensors(); ++t) {
    double diff = 0, norm = 0;
    for (std::size_t i = 0; i < ref.tensor_numel(t); ++i) {
      const double d = double(model.grad(t)[i]) - ref.grad(t)[i];
      diff += d * d;
      norm += ref.grad(t)[i] * ref.grad(t)[i];
    }
    INFO(ref.tensor_name(t));
    CHECK(std::sqrt(diff) <= 1e-4 * std::sqrt(norm) + 1e-9);
  }
}

TEST_CASE("the compute's row primitives: the host's loops and the GPU's item body agree") {
  const tiny::HostCompute compute;
  const int rows = 7, cols = 13;
  std::mt19937_64 rng(3);
  std::vector<float> m(rows * cols), b(cols), sums(cols, -1.0f), y(rows * cols), y_body(rows * cols);
  for (float& v : m) v = float(std::normal_distribution<double>()(rng));
  for (float& v : b) v = float(std::normal_distribution<double>()(rng));
  compute.column_sums(m.data(), rows, cols, sums.data());  // overwrites
  for (int j = 0; j < cols; ++j) {
    double ref = 0;
    for (int r = 0; r < rows; ++r) ref += m[std::size_t(r * cols + j)];
    CHECK(sums[std::size_t(j)] == doctest::Approx(ref).epsilon(1e-6));
  }
  compute.broadcast_rows(b.data(), y.data(), rows, cols);
  compute.for_each(y_body.size(), tiny::BroadcastRowsBody<float>{b.data(), y_body.data(), std::size_t(cols)});
  CHECK(y == y_body);
  for (int r = 0; r < rows; ++r) CHECK(std::equal(b.begin(), b.end(), y.begin() + r * cols));
}

TEST_CASE("bad input is rejected with a message") {
  tiny::Transformer<float> model(small_config(), 1);
  std::vector<int> tokens{1, 2, 7}, targets{1, 2, 3};
  CHECK_THROWS_WITH_AS(model.forward(tokens.data(), targets.data(), 1, 3, tiny::Pass::train),
                       doctest::Contains("outside the vocabulary"), std::invalid_argument);
  std::vector<int> good{1, 2, 3}, bad_target{1, 2, 99};
  CHECK_THROWS_WITH_AS(model.forward(good.data(), bad_target.data(), 1, 3, tiny::Pass::train),
                       doctest::Contains("target 99"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(model.forward(tokens.data(), targets.data(), 1, 7, tiny::Pass::train),
                       doctest::Contains("context"), std::invalid_argument);
  CHECK_THROWS_AS(model.backward(), std::logic_error);
  CHECK_THROWS_WITH_AS(tiny::Transformer<float>({.width = 10, .heads = 4}, 1), doctest::Contains("multiple of heads"),
                       std::invalid_argument);
}

// --- Data
// ---------------------------------------------------------------------------------------------------------------

TEST_CASE("sort task: inputs, separator and targets line up; the held-out lists are new") {
  const tiny::SortTask task{.length = 5, .values = 20};
  std::set<std::vector<int>> seen;
  const tiny::Examples train = task.make(500, 1, nullptr, &seen);
  const tiny::Examples eval = task.make(200, 2, &seen);
  REQUIRE(train.size() == 500);
  REQUIRE(train.len == 10);
  for (std::size_t e = 0; e < train.size(); ++e) {
    const int* x = train.tokens_of(e);
    const int* t = train.targets_of(e);
    std::vector<int> sorted(x, x + 5);
    std::sort(sorted.begin(), sorted.end());
    CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end());  // distinct
    CHECK(x[5] == 20);                                                        // the separator
    for (int i = 0; i < 5; ++i) {
      CHECK(t[i] == -1);
      CHECK(t[5 + i] == sorted[i]);             // the separator and y_1..y_4 predict y_1..y_5
      if (i < 4) CHECK(x[6 + i] == sorted[i]);  // the model reads y_1..y_4
    }
  }
  for (std::size_t e = 0; e < eval.size(); ++e) {
    std::vector<int> y(eval.targets_of(e) + 5, eval.targets_of(e) + 10);
    CHECK(seen.count(y) == 0);
  }
  CHECK_THROWS_AS(tiny::SortTask({.length = 9, .values = 8}).make(1, 1), std::invalid_argument);
}

TEST_CASE("text: non-overlapping windows, each target the next byte") {
  std::string text;
  for (int i = 0; i < 1000; ++i) text += char('a' + i % 26);
  const auto [train, eval] = tiny::make_text_examples(text, 16);
  CHECK(train.size() == (900 - 1) / 16);
  CHECK(eval.size() == (100 - 1) / 16);
  for (std::size_t e = 0; e < train.size(); ++e)
    for (int i = 0; i < 16; ++i) {
      CHECK(train.tokens_of(e)[i] == text[e * 16 + i]);
      CHECK(train.targets_of(e)[i] == text[e * 16 + i + 1]);
    }
  CHECK_THROWS_WITH_AS(tiny::make_text_examples("short", 16), doctest::Contains("too few"), std::invalid_argument);
}

TEST_CASE("distributed sampler: the same global batches whatever the rank count, reshuffled every epoch") {
  const std::size_t examples = 103;
  const int batch = 12;
  auto global_batch = [&](std::uint64_t step, int accumulation, int world) {
    std::vector<std::size_t> all;
    for (int micro = 0; micro < accumulation; ++micro)
      for (int rank = 0; rank < world; ++rank) {
        tiny::DistributedSampler sampler(examples, batch, 7);  // a rank's own sampler
        const auto mine = sampler.indices(step, micro, accumulation, rank, world);
        CHECK(mine.size() == std::size_t(batch / accumulation / world));
        all.insert(all.end(), mine.begin(), mine.end());
      }
    return all;
  };
  tiny::DistributedSampler sampler(examples, batch, 7);
  CHECK(sampler.batches_per_epoch() == 8);
  std::set<std::size_t> epoch0, epoch1;
  for (std::uint64_t step = 0; step < 16; ++step) {
    const auto one = global_batch(step, 1, 1);
    CHECK(global_batch(step, 1, 2) == one);
    CHECK(global_batch(step, 1, 4) == one);
    CHECK(global_batch(step, 2, 3) == one);
    (step < 8 ? epoch0 : epoch1).insert(one.begin(), one.end());
  }
  CHECK(epoch0.size() == 96);  // no example twice within an epoch
  CHECK(epoch1.size() == 96);
  CHECK(global_batch(0, 1, 1) != global_batch(8, 1, 1));  // a new order each epoch
  CHECK_THROWS_AS(sampler.indices(0, 0, 1, 0, 5), std::invalid_argument);
  CHECK_THROWS_AS(tiny::DistributedSampler(5, 12, 1), std::invalid_argument);
}

// --- Which OpenBLAS kernels run (blas_core.hpp): pure verdicts, the --blas-core plan, the sgemm check ---------------

namespace {

tiny::CpuFeatures avx512_cpu() {
  return {.x86_64 = true,
          .avx = true,
          .avx2 = true,
          .fma = true,
          .avx512f = true,
          .avx512dq = true,
          .avx512cd = true,
          .avx512bw = true,
          .avx512vl = true};
}
tiny::CpuFeatures avx2_cpu() { return {.x86_64 = true, .avx = true, .avx2 = true, .fma = true}; }

/// A plain-loop float sgemm with blas.hpp's signature; `fault` breaks it in one way for the check to catch.
enum class Fault { none, ignore_beta, read_c_when_beta_is_zero, write_padding, one_element_off, drop_last_k };

auto loop_gemm(Fault fault) {
  return [fault](tiny::Trans ta, tiny::Trans tb, int m, int n, int k, float alpha, const float* a, int lda,
                 const float* b, int ldb, float beta, float* c, int ldc) {
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) {
        float sum = 0;
        const int terms = fault == Fault::drop_last_k && k > 1 ? k - 1 : k;
        for (int p = 0; p < terms; ++p)
          sum += (ta == tiny::Trans::no ? a[i * lda + p] : a[p * lda + i]) *
                 (tb == tiny::Trans::no ? b[p * ldb + j] : b[j * ldb + p]);
        float& out = c[i * ldc + j];
        const bool read_c = fault == Fault::read_c_when_beta_is_zero ? true : beta != 0.0f;
        out = alpha * sum + (fault == Fault::ignore_beta || !read_c ? 0.0f : beta * out);
        if (fault == Fault::one_element_off && i == m - 1 && j == n - 1 && m * n > 1000) out *= 1.001f;
      }
    if (fault == Fault::write_padding && ldc > n) c[ldc - 1] = 0.0f;
  };
}

}  // namespace

TEST_CASE("blas kernels: generic when narrower than the CPU, with the kernels to name instead") {
  const tiny::BlasVerdict prescott = tiny::judge_blas_kernels("Prescott", avx512_cpu());
  CHECK(prescott.kernels == tiny::SimdLevel::sse);
  CHECK(prescott.cpu == tiny::SimdLevel::avx512);
  CHECK(prescott.generic());
  CHECK(prescott.better == "SkylakeX");
  CHECK(tiny::judge_blas_kernels("prescott", avx2_cpu()).better == "Haswell");  // any case, as OpenBLAS takes it
  CHECK(tiny::judge_blas_kernels("Nehalem", {.x86_64 = true, .avx = true}).better == "Sandybridge");
  CHECK(tiny::judge_blas_kernels("Haswell", avx512_cpu()).better == "SkylakeX");  // AVX2 kernels on AVX-512
  for (const char* best : {"SkylakeX", "Cooperlake", "SapphireRapids"})
    CHECK_FALSE(tiny::judge_blas_kernels(best, avx512_cpu()).generic());
  CHECK_FALSE(tiny::judge_blas_kernels("Haswell", avx2_cpu()).generic());
  CHECK_FALSE(tiny::judge_blas_kernels("Zen", avx2_cpu()).generic());
  CHECK_FALSE(tiny::judge_blas_kernels("Prescott", {.x86_64 = true}).generic());  // an SSE-only CPU: nothing better
  // AVX-512 without BW and VL (Knights Landing) cannot run SkylakeX's kernels: its best are Haswell's.
  tiny::CpuFeatures knl = avx2_cpu();
  knl.avx512f = knl.avx512cd = true;
  CHECK(tiny::cpu_simd_level(knl) == tiny::SimdLevel::avx2);
  CHECK(tiny::judge_blas_kernels("Prescott", knl).better == "Haswell");
  // Names outside the x86-64 table (another architecture's kernels) and CPUs that are not x86-64: no advice.
  CHECK(tiny::judge_blas_kernels("NEOVERSEN1", avx512_cpu()).kernels == tiny::SimdLevel::unknown);
  CHECK_FALSE(tiny::judge_blas_kernels("NEOVERSEN1", avx512_cpu()).generic());
  CHECK_FALSE(tiny::judge_blas_kernels("Prescott", tiny::CpuFeatures{}).generic());
  CHECK_FALSE(tiny::judge_blas_kernels("", avx512_cpu()).generic());
}

TEST_CASE("blas kernels: the line the program prints says which kernels, which OpenBLAS, and what to do") {
  const tiny::BlasInfo info{.corename = "Prescott",
                            .config = "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH NO_AFFINITY Prescott MAX_THREADS=64",
                            .library = "/usr/lib/openblas-pthread/libopenblasp-r0.3.21.so"};
  CHECK(tiny::openblas_version(info.config) == "OpenBLAS 0.3.21");
  CHECK(tiny::openblas_version("") == "OpenBLAS");
  const tiny::BlasVerdict generic = tiny::judge_blas_kernels(info.corename, avx512_cpu());
  const std::string line = tiny::describe_blas(info, generic, nullptr);
  INFO(line);
  CHECK(line.rfind("blas: Prescott kernels (SSE) of OpenBLAS 0.3.21 (libopenblasp-r0.3.21.so); ", 0) == 0);
  CHECK(line.find("generic kernels on a CPU with AVX-512: OPENBLAS_CORETYPE=SkylakeX or --blas-core auto") !=
        std::string::npos);
  // Set by the user (or the machine): said, and only the variable is suggested.
  const std::string forced = tiny::describe_blas(info, generic, "Prescott");
  CHECK(forced.find(", OPENBLAS_CORETYPE=Prescott; ") != std::string::npos);
  CHECK(forced.find("--blas-core") == std::string::npos);
  // The best kernels for the CPU: no advice.
  const tiny::BlasInfo skx{.corename = "SkylakeX", .config = "OpenBLAS 0.3.21 DYNAMIC_ARCH SkylakeX", .library = {}};
  CHECK(tiny::describe_blas(skx, tiny::judge_blas_kernels("SkylakeX", avx512_cpu()), nullptr) ==
        "blas: SkylakeX kernels (AVX-512) of OpenBLAS 0.3.21");
  CHECK(tiny::blas_advice(tiny::judge_blas_kernels("Haswell", avx512_cpu()), nullptr)
            .rfind("kernels narrower than this CPU's AVX-512: OPENBLAS_CORETYPE=SkylakeX", 0) == 0);
  // A BLAS that does not name its kernels.
  CHECK(tiny::describe_blas({.corename = {}, .config = {}, .library = "/lib/libblas.so.3"}, {}, nullptr)
            .find("libblas.so.3 that does not say which kernels") != std::string::npos);
}

TEST_CASE("blas kernels: --blas-core never overrides OPENBLAS_CORETYPE and restarts only where it would change") {
  using tiny::BlasCoreMode;
  CHECK(tiny::parse_blas_core("keep").mode == BlasCoreMode::keep);
  CHECK(tiny::parse_blas_core("auto").mode == BlasCoreMode::automatic);
  CHECK(tiny::parse_blas_core("Haswell").mode == BlasCoreMode::named);
  CHECK(tiny::parse_blas_core("Opteron_SSE3").name == "Opteron_SSE3");
  CHECK_THROWS_WITH_AS(tiny::parse_blas_core(""), doctest::Contains("expected keep, auto or"), std::invalid_argument);
  CHECK_THROWS_AS(tiny::parse_blas_core("Sky lake"), std::invalid_argument);
  CHECK_THROWS_AS(tiny::parse_blas_core("a=b"), std::invalid_argument);

  const tiny::BlasVerdict generic = tiny::judge_blas_kernels("Prescott", avx512_cpu());
  const tiny::BlasVerdict best = tiny::judge_blas_kernels("SkylakeX", avx512_cpu());
  const tiny::BlasCoreOption automatic = tiny::parse_blas_core("auto"), keep = tiny::parse_blas_core("keep"),
                             haswell = tiny::parse_blas_core("haswell");
  CHECK(tiny::blas_core_candidate(automatic, nullptr, "Prescott", generic) == "SkylakeX");
  CHECK(tiny::blas_core_candidate(automatic, nullptr, "SkylakeX", best).empty());
  CHECK(tiny::blas_core_candidate(keep, nullptr, "Prescott", generic).empty());
  CHECK(tiny::blas_core_candidate(haswell, nullptr, "Prescott", generic) == "haswell");
  CHECK(tiny::blas_core_candidate(haswell, nullptr, "Haswell", {}).empty());          // already loaded
  CHECK(tiny::blas_core_candidate(haswell, nullptr, "SkylakeX", best) == "haswell");  // a named step down is allowed
  // OPENBLAS_CORETYPE set (by the user, the machine, or the restart itself): nothing is tried, in every mode.
  for (const tiny::BlasCoreOption& option : {automatic, keep, haswell})
    CHECK(tiny::blas_core_candidate(option, "Prescott", "Prescott", generic).empty());
  CHECK(tiny::blas_core_candidate(automatic, "", "Prescott", generic).empty());  // set, even if empty
  CHECK(tiny::blas_core_candidate(automatic, nullptr, "", generic).empty());     // not OpenBLAS
}

TEST_CASE("blas kernels: the child's answer is judged strictly") {
  const tiny::ChildExit ok{.exited = true, .code = 0, .signal = 0, .timed_out = false};
  const tiny::BlasCheck passed = tiny::judge_blas_self_test("SkylakeX", ok, "core SkylakeX\nok\n");
  CHECK(passed.passed);
  CHECK(passed.detail == "sgemm on 9 shapes matches a double reference");
  CHECK(tiny::judge_blas_self_test("skylakex", ok, "core SkylakeX\nok\n").passed);
  // OpenBLAS 0.3.21 loads Cooperlake for a name it does not know (warning on stderr): refused.
  const tiny::BlasCheck unknown =
      tiny::judge_blas_self_test("SapphireRapids", ok, "Core not found: SapphireRapids\ncore Cooperlake\nok\n");
  CHECK_FALSE(unknown.passed);
  CHECK(unknown.detail.find("loaded its Cooperlake kernels, not SapphireRapids") != std::string::npos);
  const tiny::BlasCheck wrong = tiny::judge_blas_self_test(
      "Haswell", {.exited = true, .code = 1, .signal = 0, .timed_out = false}, "core Haswell\nmismatch sgemm 3x5x7\n");
  CHECK_FALSE(wrong.passed);
  CHECK(wrong.detail == "sgemm 3x5x7");
  const tiny::BlasCheck crashed = tiny::judge_blas_self_test(
      "SkylakeX", {.exited = false, .code = 0, .signal = SIGILL, .timed_out = false}, "core SkylakeX\n");
  CHECK_FALSE(crashed.passed);
  CHECK(crashed.detail.find("SIGILL") != std::string::npos);
  CHECK_FALSE(tiny::judge_blas_self_test("SkylakeX", {.exited = false, .code = 0, .signal = 0, .timed_out = true},
                                         "core SkylakeX\n")
                  .passed);
  CHECK_FALSE(tiny::judge_blas_self_test("SkylakeX", ok, "").passed);                 // no answer
  CHECK_FALSE(tiny::judge_blas_self_test("SkylakeX", ok, "core SkylakeX\n").passed);  // no ok
  CHECK_FALSE(tiny::judge_blas_self_test("SkylakeX", {.exited = true, .code = 3, .signal = 0, .timed_out = false},
                                         "core SkylakeX\nok\n")
                  .passed);  // ok said, but a failing exit status
}

TEST_CASE("blas kernels: the sgemm check passes OpenBLAS and a float loop, and catches each broken product") {
  CHECK(tiny::check_sgemm([](auto... args) { tiny::gemm(args...); }) == "");
  CHECK(tiny::check_sgemm(loop_gemm(Fault::none), 7) == "");  // float rounding is within the tolerance
  for (Fault fault : {Fault::ignore_beta, Fault::read_c_when_beta_is_zero, Fault::write_padding, Fault::one_element_off,
                      Fault::drop_last_k}) {
    const std::string found = tiny::check_sgemm(loop_gemm(fault), 7);
    INFO("fault " << int(fault) << ": " << found);
    CHECK(found.rfind("sgemm ", 0) == 0);
  }
  CHECK(tiny::check_sgemm(loop_gemm(Fault::write_padding)).find("padding") != std::string::npos);
}

TEST_CASE("blas kernels: this process's OpenBLAS names kernels the table knows") {
  const tiny::BlasInfo info = tiny::this_blas();
#if !defined(TINY_HAVE_OPENBLAS_CORENAME)
  test::skip_case("this BLAS names no kernels (no openblas_get_corename): " + info.library);
#else
  CHECK_FALSE(info.corename.empty());
  CHECK(info.config.rfind("OpenBLAS ", 0) == 0);
#if defined(__x86_64__)
  CHECK(tiny::kernels_simd_level(info.corename) != tiny::SimdLevel::unknown);
  CHECK(tiny::cpu_simd_level(tiny::this_cpu_features()) != tiny::SimdLevel::unknown);
#endif
#endif
  MESSAGE(tiny::describe_blas(info, tiny::judge_blas_kernels(info.corename, tiny::this_cpu_features()),
                              std::getenv("OPENBLAS_CORETYPE")));
}
