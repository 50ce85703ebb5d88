// SPDX-License-Identifier: Apache-2.0
// The rounding rule (include/tandem/kernels/detail/rounding.hpp): every kernel body gives the same bits whether or not
// the compiler fuses multiplies into adds, as nvcc does for the device and host compilers may. Each body runs in two
// builds on fresh random inputs and the outputs are compared bit for bit:
//   - the ordinary build: this file, compiled with tandem's flags (-ffp-contract=off);
//   - tests/rounding/contracted.cpp: -ffp-contract=fast with FMA, the products that detail::mul_rn rounds kept opaque,
//     as __fmul_rn keeps them on the device. A raw `c + a * b` left in a body is fused there and fails the comparison.
// Where the compiler or the build machine has no FMA (tests/CMakeLists.txt checks) only the first case runs.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "rounding/bodies_impl.hpp"
#include "support/cases.hpp"
#include "tandem/core/plan.hpp"

const rounding::Bodies& rounding::plain_bodies() { return this_build; }

namespace {

// a = 1 + 2^-12: a * a = 1 + 2^-11 + 2^-24 rounds (a tie, to even) to 1 + 2^-11, so a * a - (1 + 2^-11) is 0 when the
// product is rounded on its own and 2^-24 when it is fused.
constexpr float tie = 1.0f + 0x1p-12f;
constexpr float tie_square = 1.0f + 0x1p-11f;

#if TANDEM_ROUNDING_CONTRACTED
using rounding::Dt;

/// Elements at which a and b hold different bits (NaN payloads and signed zeros included).
template <class T>
std::size_t differing(const std::vector<T>& a, const std::vector<T>& b) {
  REQUIRE(a.size() == b.size());
  std::size_t count = 0;
  for (std::size_t i = 0; i < a.size(); ++i) count += std::memcmp(&a[i], &b[i], sizeof(T)) != 0;
  return count;
}

/// Fresh inputs on every run; TANDEM_TEST_SEED=<n> replays one (the cases CAPTURE their seed), as in test_local_group.
std::uint64_t fresh_seed() {
  if (const char* s = std::getenv("TANDEM_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  return (std::uint64_t{std::random_device{}()} << 32) ^ std::random_device{}();
}

/// A buffer of n elements of dtype d, held as raw storage so one test body serves every dtype.
struct Buffer {
  Dt dtype = Dt::fp32;
  std::vector<float> f32;
  std::vector<tandem::BFloat16> bf16;
  std::vector<tandem::Float16> fp16;

  Buffer(Dt d, std::size_t n) : dtype(d) {
    if (d == Dt::fp32) f32.resize(n);
    if (d == Dt::bf16) bf16.resize(n);
    if (d == Dt::fp16) fp16.resize(n);
  }
  void* data() {
    if (dtype == Dt::bf16) return bf16.data();
    if (dtype == Dt::fp16) return fp16.data();
    return f32.data();
  }
  void* at(std::size_t i) { return static_cast<char*>(data()) + i * element_bytes(); }
  std::size_t element_bytes() const { return dtype == Dt::fp32 ? 4 : 2; }
  void set(std::size_t i, float v) {
    if (dtype == Dt::fp32) f32[i] = v;
    if (dtype == Dt::bf16) bf16[i] = tandem::BFloat16(v);
    if (dtype == Dt::fp16) fp16[i] = tandem::Float16(v);
  }
  float get(std::size_t i) const {
    if (dtype == Dt::bf16) return static_cast<float>(bf16[i]);
    if (dtype == Dt::fp16) return static_cast<float>(fp16[i]);
    return f32[i];
  }
  std::size_t size() const { return dtype == Dt::fp32 ? f32.size() : dtype == Dt::bf16 ? bf16.size() : fp16.size(); }
  friend std::size_t differing(const Buffer& a, const Buffer& b) {
    return differing(a.f32, b.f32) + differing(a.bf16, b.bf16) + differing(a.fp16, b.fp16);
  }
};

std::string name(Dt d) { return d == Dt::fp32 ? "fp32" : d == Dt::bf16 ? "bf16" : "fp16"; }

/// Fails the case unless this CPU runs the contracted build's FMA instructions. tests/CMakeLists.txt built that part
/// only because the build machine ran them: a binary moved to a CPU without FMA must say so, not pass unchecked.
void require_contracted_build_runs() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  REQUIRE_MESSAGE(__builtin_cpu_supports("fma"),
                  "this CPU has no FMA but the build machine had: reconfigure here (the contracted build is left out)");
#endif  // aarch64: FMA is part of the base architecture
}
#endif

}  // namespace

TEST_CASE("tandem's own build rounds every product on its own, and the contracted build fuses raw ones") {
  const rounding::Bodies& plain = rounding::plain_bodies();
  CHECK(plain.rounded_fma(tie, tie, -tie_square) == 0.0f);
  CHECK(plain.raw_fma(tie, tie, -tie_square) == 0.0f);  // -ffp-contract=off (cmake/TandemTargetDefaults.cmake)
#if TANDEM_ROUNDING_CONTRACTED
  require_contracted_build_runs();
  const rounding::Bodies& contracted = rounding::contracted_bodies();
  CHECK(contracted.rounded_fma(tie, tie, -tie_square) == 0.0f);  // the opaque product: as __fmul_rn on the device
  CHECK(contracted.raw_fma(tie, tie, -tie_square) == 0x1p-24f);  // the raw one is fused: the build emulates nvcc
#endif
}

#if TANDEM_ROUNDING_CONTRACTED

TEST_CASE("cast bodies give the same bits with FMA contraction (accumulate with scale 0.75, casts, misaligned)") {
  require_contracted_build_runs();
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  struct Kind {
    Dt src, dst;
    bool accumulate;
    float scale;
  };
  const Kind kinds[] = {
      {Dt::fp32, Dt::fp32, true, 0.75f},     {Dt::bf16, Dt::fp32, true, 0.75f},  {Dt::fp16, Dt::fp32, true, 0.75f},
      {Dt::fp32, Dt::bf16, true, 0.75f},     {Dt::fp32, Dt::fp32, false, 0.75f}, {Dt::fp32, Dt::bf16, false, 0.25f},
      {Dt::fp32, Dt::fp16, false, 1.0f / 3}, {Dt::bf16, Dt::fp32, false, 1.0f},  {Dt::fp16, Dt::fp32, false, 0.5f}};
  for (const Kind& k : kinds) {
    for (unsigned lanes : {1u, 256u}) {
      // offsets in elements from 16-byte-aligned storage: equal (the vector path) or not (scalar only)
      const std::size_t src_at = rng() % 8, dst_at = rng() % 2 ? src_at : rng() % 8;
      const std::size_t n = 4096 * 3 + rng() % 4096;
      const std::string src_name = name(k.src);
      CAPTURE(src_name);
      const std::string dst_name = name(k.dst);
      CAPTURE(dst_name);
      CAPTURE(k.accumulate);
      CAPTURE(lanes);
      CAPTURE(src_at);
      CAPTURE(dst_at);
      Buffer src(k.src, n + 8), dst(k.dst, n + 8);
      for (std::size_t i = 0; i < n + 8; ++i) {
        src.set(i, dist(rng));
        dst.set(i, k.accumulate ? dist(rng) : std::nanf(""));  // assign: poisoned, every element must be written
      }
      Buffer plain = dst, contracted = dst;
      rounding::Cast c{k.src, k.dst, k.accumulate, src.at(src_at), plain.at(dst_at), n, k.scale};
      rounding::plain_bodies().cast(c, lanes);
      c.to = contracted.at(dst_at);
      rounding::contracted_bodies().cast(c, lanes);
      CHECK(differing(plain, contracted) == 0);

      // the ordinary build is the formula, each operation rounded: dst = cast(dst + round(scale * src))
      Buffer want = dst;
      for (std::size_t i = 0; i < n; ++i) {
        const float x = k.scale * src.get(src_at + i);
        want.set(dst_at + i, k.accumulate ? want.get(dst_at + i) + x : x);
        if (!k.accumulate && k.scale == 1.0f && k.src == k.dst) want.set(dst_at + i, src.get(src_at + i));
      }
      CHECK(differing(plain, want) == 0);
    }
  }
}

TEST_CASE("the test can fail: a raw accumulate, d + scale times s, differs under contraction in many elements") {
  require_contracted_build_runs();
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  const std::size_t n = 100000;
  std::vector<float> s(n), d(n);
  for (std::size_t i = 0; i < n; ++i) {
    s[i] = dist(rng);
    d[i] = dist(rng);
  }
  std::vector<float> body = d, raw = d;
  rounding::plain_bodies().cast({Dt::fp32, Dt::fp32, true, s.data(), body.data(), n, 0.75f}, 1);
  rounding::contracted_bodies().raw_accumulate(s.data(), raw.data(), n, 0.75f);
  // a body written so fails the case above: the review measured 7% of elements, these inputs give about a fifth
  CHECK(differing(body, raw) > n / 50);
}

TEST_CASE("pack bodies give the same bits with FMA contraction (many tensors, misaligned, accumulate and cast)") {
  require_contracted_build_runs();
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  struct Kind {
    Dt user, bucket;
    bool accumulate;
    float scale;
  };
  // 16-bit sources accumulate at scale 1/3: a 16-bit value times 0.75 is exact in fp32, so a fused product would give
  // the same bits as a rounded one, and the test could not tell them apart.
  for (const Kind& k : {Kind{Dt::fp32, Dt::fp32, true, 0.75f}, Kind{Dt::bf16, Dt::fp32, true, 1.0f / 3},
                        Kind{Dt::fp16, Dt::fp32, true, 1.0f / 3}, Kind{Dt::fp32, Dt::bf16, true, 1.0f / 3},
                        Kind{Dt::fp32, Dt::bf16, false, 0.25f}, Kind{Dt::fp32, Dt::fp32, false, 1.0f / 3}}) {
    const std::string user_name = name(k.user);
    CAPTURE(user_name);
    const std::string bucket_name = name(k.bucket);
    CAPTURE(bucket_name);
    CAPTURE(k.accumulate);
    std::vector<std::size_t> sizes;
    for (int t = 0; t < 12; ++t) sizes.push_back(rng() % 3 == 0 ? 1 + rng() % 7 : 1 + rng() % 9000);
    const std::size_t bucket_bytes = k.bucket == Dt::fp32 ? 4 : 2;
    tandem::PlanOptions o;
    o.first_bucket_cap_bytes = o.bucket_cap_bytes = std::size_t{1} << 30;  // one bucket
    o.bucket_element_bytes = bucket_bytes;
    o.alignment_elements = 16 / 2;
    o.shard_alignment_elements = 128 / 2;
    const tandem::Plan plan(sizes, o);
    // user tensors in one arena, each at a random misalignment
    std::size_t arena = 0;
    std::vector<std::size_t> at;
    for (std::size_t numel : sizes) {
      arena = (arena + 8) / 8 * 8 + rng() % 8;
      at.push_back(arena);
      arena += numel;
    }
    Buffer user(k.user, arena);
    for (std::size_t i = 0; i < arena; ++i) user.set(i, dist(rng));
    std::vector<void*> pointers;
    for (std::size_t t = 0; t < sizes.size(); ++t) pointers.push_back(user.at(at[t]));
    const tandem::PackTable table = tandem::make_pack_table(plan, 0, pointers);
    Buffer flat(k.bucket, plan.bucket(0).size);
    for (std::size_t i = 0; i < flat.size(); ++i) flat.set(i, k.accumulate ? dist(rng) : 0.0f);
    for (unsigned lanes : {1u, 256u}) {
      CAPTURE(lanes);
      Buffer plain = flat, contracted = flat;
      rounding::Pack p{k.user,       k.bucket,     k.accumulate, table.reading_user.data(), table.tensors.data(),
                       table.size(), plain.data(), k.scale};
      rounding::plain_bodies().pack(p, lanes);
      p.flat = contracted.data();
      rounding::contracted_bodies().pack(p, lanes);
      CHECK(differing(plain, contracted) == 0);
    }
  }
}

namespace {

/// Three optimizer steps in each build from the same state; every output (master, states, params) compared bitwise.
template <class Options, class Step>
void check_update(Dt param_dtype, const Options& options, Step step) {
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  const std::size_t n = 4096 * 2 + 1 + rng() % 4096;
  for (unsigned lanes : {1u, 256u}) {
    const std::string param_dtype_name = name(param_dtype);
    CAPTURE(param_dtype_name);
    CAPTURE(lanes);
    struct State {
      std::vector<float> master, m, v;
      Buffer param;
    };
    State start{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n), Buffer(param_dtype, n)};
    for (std::size_t i = 0; i < n; ++i) {
      start.param.set(i, dist(rng));
      start.master[i] = start.param.get(i);  // a master weight the parameter dtype holds exactly
    }
    State plain = start, contracted = start;
    std::vector<float> grad(n);
    for (std::uint64_t t = 1; t <= 3; ++t) {
      CAPTURE(t);
      for (auto& g : grad) g = 0.1f * dist(rng);
      for (State* s : {&plain, &contracted}) {
        for (std::size_t i = 0; i < n; ++i) s->param.set(i, std::nanf(""));  // poison: every element is written
        const rounding::Update u{
            param_dtype, s->master.data(), s->param.data(), grad.data(), s->m.data(), s->v.data(), n, 0.75f, t};
        step(s == &plain ? rounding::plain_bodies() : rounding::contracted_bodies(), u, options, lanes);
      }
      CHECK(differing(plain.master, contracted.master) == 0);
      CHECK(differing(plain.m, contracted.m) == 0);
      CHECK(differing(plain.v, contracted.v) == 0);
      CHECK(differing(plain.param, contracted.param) == 0);
      for (std::size_t i = 0; i < n; ++i) REQUIRE(!std::isnan(plain.param.get(i)));
    }
  }
}

}  // namespace

TEST_CASE("AdamW gives the same bits with FMA contraction (fp32, bf16 and fp16 parameters)") {
  require_contracted_build_runs();
  const rounding::AdamWOptions o{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-8f, .weight_decay = 0.1f};
  for (Dt p : {Dt::fp32, Dt::bf16, Dt::fp16})
    check_update(p, o,
                 [](const rounding::Bodies& b, const rounding::Update& u, const rounding::AdamWOptions& o,
                    unsigned lanes) { b.adamw(u, o, lanes); });
}

TEST_CASE("SGD with momentum gives the same bits with FMA contraction (dampening, weight decay, Nesterov)") {
  require_contracted_build_runs();
  auto step = [](const rounding::Bodies& b, const rounding::Update& u, const rounding::SGDOptions& o, unsigned lanes) {
    b.sgd(u, o, lanes);
  };
  for (Dt p : {Dt::fp32, Dt::bf16, Dt::fp16}) {
    check_update(p, rounding::SGDOptions{0.1f, 0.9f, 0.1f, 1e-2f, false}, step);
    check_update(p, rounding::SGDOptions{0.05f, 0.8f, 0.0f, 1e-3f, true}, step);
    check_update(p, rounding::SGDOptions{0.1f, 0.0f, 0.0f, 1e-2f, false}, step);  // no momentum: no state
  }
}

TEST_CASE("sum of squares and the ordered sum give the same bits with FMA contraction") {
  require_contracted_build_runs();
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  const std::size_t n = 4096 * 5 + 1 + rng() % 4096;
  std::vector<float> x(n);
  for (auto& e : x) e = dist(rng);
  for (unsigned lanes : {1u, 256u}) {
    CAPTURE(lanes);
    const std::vector<double> plain{rounding::plain_bodies().sum_squares(x.data(), n, lanes)};
    const std::vector<double> contracted{rounding::contracted_bodies().sum_squares(x.data(), n, lanes)};
    CHECK(differing(plain, contracted) == 0);
  }
  std::vector<double> terms(7 * 13);
  for (auto& t : terms) t = std::ldexp(double{dist(rng)}, static_cast<int>(rng() % 40) - 20);
  const std::vector<double> plain{rounding::plain_bodies().ordered_sum(terms.data(), 7, 13)};
  const std::vector<double> contracted{rounding::contracted_bodies().ordered_sum(terms.data(), 7, 13)};
  CHECK(differing(plain, contracted) == 0);
}

#else

TEST_CASE("kernel bodies give the same bits with FMA contraction") {
  test::skip_case("the compiler or this machine has no FMA: the contracted build was left out (tests/CMakeLists.txt)");
}

#endif  // TANDEM_ROUNDING_CONTRACTED
