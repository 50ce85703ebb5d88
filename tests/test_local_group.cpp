// SPDX-License-Identifier: Apache-2.0
// LocalGroup: every collective, dtype, world size 1-5, odd counts, in place and out of place, against plain-loop
// references (rank-order accumulation, rounded by arithmetic in double rather than by tandem's bit tricks); then
// determinism, argument and mismatch errors, a failing rank, a departed rank, and the timeout.
// Inputs are fresh random numbers (TANDEM_TEST_SEED=<n> replays a run); outputs are poisoned (all bits set, a NaN)
// before every call, so an element that was not written fails its comparison.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <typeinfo>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

#include "tandem/comm/local_group.hpp"

namespace {

using namespace std::chrono_literals;
using tandem::BFloat16;
using tandem::DType;
using tandem::Float16;
using tandem::LocalComm;
using tandem::LocalGroup;
using tandem::LocalGroupOptions;
using tandem::ReduceOp;
using Clock = std::chrono::steady_clock;
using Rng = std::mt19937_64;

// --- Randomness ------------------------------------------------------------------------------------------------------

std::uint64_t fresh_seed() {
  if (const char* s = std::getenv("TANDEM_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  return (std::uint64_t{std::random_device{}()} << 32) ^ std::random_device{}();
}

/// A value of T spread over 2^-8 .. 2^8 in magnitude, so that the order of a sum shows in its bits.
template <class T>
T random_value(Rng& rng) {
  std::uniform_real_distribution<double> mantissa(-1.0, 1.0);
  std::uniform_int_distribution<int> exponent(-8, 8);
  const double x = std::ldexp(mantissa(rng), exponent(rng));
  if constexpr (std::is_same_v<T, double>) {
    return x;
  } else if constexpr (std::is_same_v<T, float>) {
    return static_cast<float>(x);
  } else {
    return T(static_cast<float>(x));
  }
}

template <class T>
using Buffers = std::vector<std::vector<T>>;  // [rank][element]

template <class T>
Buffers<T> random_buffers(int size, std::size_t count, Rng& rng) {
  Buffers<T> b(static_cast<std::size_t>(size), std::vector<T>(count));
  for (auto& v : b) {
    for (auto& x : v) x = random_value<T>(rng);
  }
  return b;
}

template <class T>
void poison(T* p, std::size_t count) {
  if (count != 0) std::memset(static_cast<void*>(p), 0xff, count * sizeof(T));  // a NaN in every dtype
}

template <class T>
Buffers<T> poisoned_buffers(int size, std::size_t count) {
  Buffers<T> b(static_cast<std::size_t>(size), std::vector<T>(count));
  for (auto& v : b) poison(v.data(), v.size());
  return b;
}

template <class T>
bool same_bytes(const T* a, const T* b, std::size_t count) {
  return count == 0 || std::memcmp(a, b, count * sizeof(T)) == 0;
}

// --- An independent reference ----------------------------------------------------------------------------------------

/// Decodes an element exactly, without tandem's conversions.
double value_of(float v) { return v; }
double value_of(double v) { return v; }
double value_of(BFloat16 v) {
  const std::uint32_t u = std::uint32_t{v.bits} << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
double value_of(Float16 v) {
  const int e = (v.bits >> 10) & 0x1f;
  const int m = v.bits & 0x3ff;
  double x = e == 0x1f ? (m != 0 ? std::nan("") : INFINITY)
             : e == 0  ? std::ldexp(m, -24)
                       : std::ldexp(1024 + m, e - 25);
  return (v.bits & 0x8000) != 0 ? -x : x;
}

template <class T>
std::size_t count_nan(const std::vector<T>& v) {
  return static_cast<std::size_t>(
      std::count_if(v.begin(), v.end(), [](const T& x) { return std::isnan(value_of(x)); }));
}

/// Rounds x to `mantissa` explicit bits, exponents below `min_exp` subnormal, ties to even: by exact arithmetic in
/// double (x / ulp is exact, nearbyint rounds ties to even), not by bit manipulation.
double round_to_precision(double x, int mantissa, int min_exp) {
  if (x == 0) return x;
  int e;
  std::frexp(x, &e);  // |x| in [2^(e-1), 2^e)
  const double ulp = std::ldexp(1.0, std::max(e - 1, min_exp) - mantissa);
  return std::nearbyint(x / ulp) * ulp;
}

template <class T>
constexpr double output_epsilon() {  // relative error of the final rounding
  if constexpr (std::is_same_v<T, BFloat16>) return 0x1p-8;
  if constexpr (std::is_same_v<T, Float16>) return 0x1p-11;
  return 0;
}

struct Expected {
  double value;      // the exact bits expected, as a value: rank-order accumulation rounded once
  double exact;      // the sum (or mean) in long double
  double tolerance;  // how far `value` may be from `exact`
};

/// The reduction of element `index` of every rank's buffer, accumulated in rank order in fp32 (fp64 for double).
template <class T>
Expected expected_reduction(const Buffers<T>& send, std::size_t index, ReduceOp op) {
  const auto size = send.size();
  Expected e{};
  if constexpr (std::is_same_v<T, double>) {
    double acc = send[0][index];
    for (std::size_t q = 1; q < size; ++q) acc += send[q][index];
    if (op == ReduceOp::avg) acc /= static_cast<double>(size);
    e.value = acc;
  } else {
    float acc = static_cast<float>(value_of(send[0][index]));
    for (std::size_t q = 1; q < size; ++q) acc += static_cast<float>(value_of(send[q][index]));
    if (op == ReduceOp::avg) acc /= static_cast<float>(size);
    e.value = acc;
    if constexpr (std::is_same_v<T, BFloat16>) e.value = round_to_precision(acc, 7, -126);
    if constexpr (std::is_same_v<T, Float16>) e.value = round_to_precision(acc, 10, -14);
  }
  long double exact = 0;
  long double magnitude = 0;
  for (std::size_t q = 0; q < size; ++q) {
    exact += value_of(send[q][index]);
    magnitude += std::fabs(value_of(send[q][index]));
  }
  if (op == ReduceOp::avg) exact /= static_cast<long double>(size);
  const double accumulation_epsilon = std::is_same_v<T, double> ? 0x1p-53 : 0x1p-24;
  e.exact = static_cast<double>(exact);
  e.tolerance = static_cast<double>(size + 1) * accumulation_epsilon * static_cast<double>(magnitude) +
                output_epsilon<T>() * std::fabs(e.exact) + (std::is_same_v<T, Float16> ? 0x1p-25 : 0.0);
  return e;
}

/// Collects failed element checks; reports the count and the first.
struct Failures {
  std::size_t count = 0;
  std::string first;
  void add(const std::string& what) {
    if (count++ == 0) first = what;
  }
};

template <class T>
void check_reduced(Failures& f, const T& out, const Expected& e, const char* where, int rank, std::size_t i) {
  const double got = value_of(out);
  const bool bits_ok = got == e.value && std::signbit(got) == std::signbit(e.value);  // NaN poison fails too
  const bool near_ok = std::fabs(got - e.exact) <= e.tolerance;
  if (!bits_ok || !near_ok) {
    f.add(std::string(where) + ": rank " + std::to_string(rank) + " element " + std::to_string(i) + ": got " +
          std::to_string(got) + ", expected " + std::to_string(e.value) + " (exact " + std::to_string(e.exact) +
          ", tolerance " + std::to_string(e.tolerance) + ")");
  }
}

// --- One generic testbed per collective ------------------------------------------------------------------------------

enum class Placement { out_of_place, in_place };

struct Case {
  int size;
  std::size_t count;
  Placement placement;
  ReduceOp op;
};

std::string describe(const char* collective, DType t, const Case& c) {
  return std::string(collective) + "<" + tandem::dtype_name(t) + "> size=" + std::to_string(c.size) +
         " count=" + std::to_string(c.count) + (c.placement == Placement::in_place ? " in place " : " out of place ") +
         tandem::reduce_op_name(c.op);
}

const int kSizes[] = {1, 2, 3, 4, 5};
// Not multiples of any world size or vector width; 4099 spans three 2048-element accumulator blocks on one rank.
const std::initializer_list<std::size_t> kCounts = {0, 1, 7, 1000, 4099};
// all_reduce also splits `count` into per-rank slices: 10007 gives slices of several blocks each.
const std::initializer_list<std::size_t> kAllReduceCounts = {0, 1, 7, 1000, 4099, 10007};
const Placement kPlacements[] = {Placement::out_of_place, Placement::in_place};
const std::initializer_list<ReduceOp> kOps = {ReduceOp::sum, ReduceOp::avg};
const std::initializer_list<ReduceOp> kNoOp = {ReduceOp::sum};  // all_gather, broadcast: op unused

template <class Check>
void for_each_case(Check check, std::initializer_list<std::size_t> counts, std::initializer_list<ReduceOp> ops) {
  for (int size : kSizes) {
    for (std::size_t count : counts) {
      for (Placement placement : kPlacements) {
        for (ReduceOp op : ops) check(Case{size, count, placement, op});
      }
    }
  }
}

template <class T>
void check_all_reduce(const Case& c, Rng& rng) {
  const std::string where = describe("all_reduce", tandem::dtype_of<T>, c);
  INFO(where);
  const Buffers<T> send = random_buffers<T>(c.size, c.count, rng);
  Buffers<T> in = send;  // written by the in-place form: all_reduce must never write `send` out of place
  Buffers<T> recv = c.placement == Placement::in_place ? send : poisoned_buffers<T>(c.size, c.count);
  LocalGroup group(c.size);
  group.run([&](LocalComm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    const T* src = c.placement == Placement::in_place ? recv[r].data() : in[r].data();
    comm.all_reduce(src, recv[r].data(), c.count, tandem::dtype_of<T>, c.op);
  });
  Failures f;
  for (std::size_t i = 0; i < c.count; ++i) {
    const Expected e = expected_reduction(send, i, c.op);
    for (int r = 0; r < c.size; ++r) check_reduced(f, recv[static_cast<std::size_t>(r)][i], e, where.c_str(), r, i);
  }
  CHECK_MESSAGE(f.count == 0, f.count << " wrong elements; first: " << f.first);
  for (int r = 0; r < c.size; ++r) {
    CHECK(same_bytes(in[static_cast<std::size_t>(r)].data(), send[static_cast<std::size_t>(r)].data(), c.count));
  }
}

template <class T>
void check_reduce_scatter(const Case& c, Rng& rng) {
  const std::string where = describe("reduce_scatter", tandem::dtype_of<T>, c);
  INFO(where);
  const std::size_t total = c.count * static_cast<std::size_t>(c.size);
  const Buffers<T> send = random_buffers<T>(c.size, total, rng);
  Buffers<T> in = send;  // in place: recv is block `rank` of this buffer
  Buffers<T> recv = poisoned_buffers<T>(c.size, c.count);
  LocalGroup group(c.size);
  group.run([&](LocalComm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    T* dst = c.placement == Placement::in_place ? in[r].data() + r * c.count : recv[r].data();
    comm.reduce_scatter(in[r].data(), dst, c.count, tandem::dtype_of<T>, c.op);
  });
  Failures f;
  for (int r = 0; r < c.size; ++r) {
    const auto ur = static_cast<std::size_t>(r);
    const T* out = c.placement == Placement::in_place ? in[ur].data() + ur * c.count : recv[ur].data();
    for (std::size_t i = 0; i < c.count; ++i) {
      check_reduced(f, out[i], expected_reduction(send, ur * c.count + i, c.op), where.c_str(), r, i);
    }
    // Every other block of `send` is left as it was (in place too).
    for (int b = 0; b < c.size; ++b) {
      if (b == r && c.placement == Placement::in_place) continue;
      const std::size_t at = static_cast<std::size_t>(b) * c.count;
      CHECK(same_bytes(in[ur].data() + at, send[ur].data() + at, c.count));
    }
  }
  CHECK_MESSAGE(f.count == 0, f.count << " wrong elements; first: " << f.first);
}

template <class T>
void check_all_gather(const Case& c, Rng& rng) {
  INFO(describe("all_gather", tandem::dtype_of<T>, c));
  const std::size_t total = c.count * static_cast<std::size_t>(c.size);
  const Buffers<T> send = random_buffers<T>(c.size, c.count, rng);
  Buffers<T> in = send;
  Buffers<T> recv = poisoned_buffers<T>(c.size, total);
  if (c.placement == Placement::in_place) {  // my block of recv already holds my send
    for (int r = 0; r < c.size; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      std::copy_n(send[ur].data(), c.count, recv[ur].data() + ur * c.count);
    }
  }
  LocalGroup group(c.size);
  group.run([&](LocalComm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    const T* src = c.placement == Placement::in_place ? recv[r].data() + r * c.count : in[r].data();
    comm.all_gather(src, recv[r].data(), c.count, tandem::dtype_of<T>);
  });
  for (int r = 0; r < c.size; ++r) {
    const auto ur = static_cast<std::size_t>(r);
    for (int p = 0; p < c.size; ++p) {
      const auto up = static_cast<std::size_t>(p);
      INFO("rank " << r << ", block " << p);
      CHECK(same_bytes(recv[ur].data() + up * c.count, send[up].data(), c.count));
    }
    CHECK(same_bytes(in[ur].data(), send[ur].data(), c.count));
  }
}

template <class T>
void check_broadcast(const Case& c, Rng& rng) {
  const int root = std::uniform_int_distribution<int>(0, c.size - 1)(rng);
  INFO(describe("broadcast", tandem::dtype_of<T>, c) << " root=" << root);
  // Every rank has different data in `send`: only the root's may be read. Odd ranks off the root pass null.
  const Buffers<T> send = random_buffers<T>(c.size, c.count, rng);
  Buffers<T> in = send;
  Buffers<T> recv = poisoned_buffers<T>(c.size, c.count);
  const auto uroot = static_cast<std::size_t>(root);
  if (c.placement == Placement::in_place) recv[uroot] = send[uroot];
  LocalGroup group(c.size);
  group.run([&](LocalComm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    const T* src = c.placement == Placement::in_place ? recv[r].data() : in[r].data();
    if (r != uroot && r % 2 == 1 && c.placement == Placement::out_of_place) src = nullptr;
    comm.broadcast(src, recv[r].data(), c.count, tandem::dtype_of<T>, root);
  });
  for (int r = 0; r < c.size; ++r) {
    const auto ur = static_cast<std::size_t>(r);
    INFO("rank " << r);
    CHECK(same_bytes(recv[ur].data(), send[uroot].data(), c.count));
    CHECK(same_bytes(in[ur].data(), send[ur].data(), c.count));
  }
}

#define TANDEM_LOCAL_TYPES float, BFloat16, Float16, double

TEST_CASE_TEMPLATE("LocalGroup all_reduce matches a rank-order reference", T, TANDEM_LOCAL_TYPES) {
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  Rng rng(seed);
  for_each_case([&](const Case& c) { check_all_reduce<T>(c, rng); }, kAllReduceCounts, kOps);
}

TEST_CASE_TEMPLATE("LocalGroup reduce_scatter matches a rank-order reference", T, TANDEM_LOCAL_TYPES) {
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  Rng rng(seed);
  for_each_case([&](const Case& c) { check_reduce_scatter<T>(c, rng); }, kCounts, kOps);
}

TEST_CASE_TEMPLATE("LocalGroup all_gather concatenates every rank's send", T, TANDEM_LOCAL_TYPES) {
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  Rng rng(seed);
  for_each_case([&](const Case& c) { check_all_gather<T>(c, rng); }, kCounts, kNoOp);
}

TEST_CASE_TEMPLATE("LocalGroup broadcast copies the root's send", T, TANDEM_LOCAL_TYPES) {
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  Rng rng(seed);
  for_each_case([&](const Case& c) { check_broadcast<T>(c, rng); }, kCounts, kNoOp);
}

TEST_CASE("LocalGroup's collectives past the streaming threshold, blocks at several 16-byte misalignments") {
  // Per-rank results of kLocalStreamingBytes or more are written with streaming stores, from each block's first 16-byte
  // boundary on (the reductions: where the accumulator is the element type). An odd count puts the later blocks of a
  // 3-rank all_gather at other misalignments (bf16: 2-byte steps).
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  Rng rng(seed);
  constexpr std::size_t base = tandem::detail::kLocalStreamingBytes / sizeof(float);
  for (Placement placement : kPlacements) {
    for (std::size_t extra : {std::size_t{0}, std::size_t{3}}) {
      const std::size_t count = base + extra;
      check_all_gather<float>(Case{3, count, placement, ReduceOp::sum}, rng);
      check_all_gather<BFloat16>(Case{3, 2 * base + extra, placement, ReduceOp::sum}, rng);
      check_broadcast<float>(Case{2, count, placement, ReduceOp::sum}, rng);
      check_reduce_scatter<float>(Case{2, count, placement, ReduceOp::sum}, rng);
      check_all_reduce<float>(Case{2, 2 * count, placement, ReduceOp::avg}, rng);
    }
  }
}

TEST_CASE("the independent bf16/fp16 rounding agrees with known values") {
  // Guards the reference itself: ties to even, and the fp16 subnormal range.
  CHECK(round_to_precision(1.0 + 0x1p-8, 7, -126) == 1.0);                     // tie -> even (down)
  CHECK(round_to_precision(1.0 + 3 * 0x1p-8, 7, -126) == 1.0 + 0x1p-6);        // tie -> even (up)
  CHECK(round_to_precision(1.0 + 0x1p-8 + 0x1p-20, 7, -126) == 1.0 + 0x1p-7);  // above the tie
  CHECK(round_to_precision(0x1p-25, 10, -14) == 0.0);                          // half the smallest subnormal
  CHECK(round_to_precision(3 * 0x1p-25, 10, -14) == 0x1p-23);                  // 1.5 subnormal ulps -> 2
  CHECK(round_to_precision(-2049.0, 10, -14) == -2048.0);
  CHECK(value_of(Float16(-2049.0f)) == -2048.0);
  CHECK(value_of(BFloat16(1.0f + 0x1p-8f)) == 1.0);
}

TEST_CASE_TEMPLATE("LocalGroup reduce_scatter equals the matching block of all_reduce, bit for bit", T, float, BFloat16,
                   Float16, double) {
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  Rng rng(seed);
  for (int size : kSizes) {
    for (std::size_t count : {std::size_t{1}, std::size_t{7}, std::size_t{1000}, std::size_t{4099}}) {
      for (ReduceOp op : kOps) {
        INFO("size=" << size << " count=" << count << " " << tandem::reduce_op_name(op));
        const std::size_t total = count * static_cast<std::size_t>(size);
        const Buffers<T> send = random_buffers<T>(size, total, rng);
        Buffers<T> reduced = poisoned_buffers<T>(size, total);
        Buffers<T> scattered = poisoned_buffers<T>(size, count);
        LocalGroup(size).run([&](LocalComm& comm) {
          const auto r = static_cast<std::size_t>(comm.rank());
          comm.all_reduce(send[r].data(), reduced[r].data(), total, tandem::dtype_of<T>, op);
          comm.reduce_scatter(send[r].data(), scattered[r].data(), count, tandem::dtype_of<T>, op);
        });
        for (int r = 0; r < size; ++r) {
          const auto ur = static_cast<std::size_t>(r);
          INFO("rank " << r);
          CHECK(same_bytes(scattered[ur].data(), reduced[ur].data() + ur * count, count));
          CHECK(count_nan(scattered[ur]) == 0);
          CHECK(count_nan(reduced[ur]) == 0);
        }
      }
    }
  }
}

TEST_CASE_TEMPLATE("LocalGroup all_reduce is deterministic whatever the timing and the split", T, float, BFloat16) {
  const std::uint64_t seed = fresh_seed();
  CAPTURE(seed);
  Rng rng(seed);
  const int size = 4;
  const std::size_t count = 10007;
  const std::size_t prefix = 777;  // split 4 ways differently from `count`
  const Buffers<T> send = random_buffers<T>(size, count, rng);
  std::vector<Buffers<T>> results;
  for (int trial = 0; trial < 3; ++trial) {
    Buffers<T> recv = poisoned_buffers<T>(size, count);
    Buffers<T> head = poisoned_buffers<T>(size, prefix);
    std::vector<int> delay_us(size);
    for (int& d : delay_us) d = trial == 0 ? 0 : std::uniform_int_distribution<int>(0, 2000)(rng);
    LocalGroup(size).run([&](LocalComm& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      std::this_thread::sleep_for(std::chrono::microseconds(delay_us[r]));
      comm.all_reduce(send[r].data(), recv[r].data(), count, tandem::dtype_of<T>, ReduceOp::sum);
      comm.all_reduce(send[r].data(), head[r].data(), prefix, tandem::dtype_of<T>, ReduceOp::sum);
    });
    for (int r = 0; r < size; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      CHECK(same_bytes(recv[ur].data(), recv[0].data(), count));   // every rank got the same bits
      CHECK(same_bytes(head[ur].data(), recv[0].data(), prefix));  // whatever slice computed them
      CHECK(count_nan(recv[ur]) == 0);
    }
    results.push_back(std::move(recv));
  }
  for (std::size_t t = 1; t < results.size(); ++t) CHECK(same_bytes(results[t][0].data(), results[0][0].data(), count));
}

TEST_CASE("LocalGroup runs many mixed collectives back to back") {
  // Exact integer data, so each rank checks its own results against the exact answer as it goes.
  const int size = 5;
  const int rounds = 300;
  std::atomic<int> wrong{0};
  std::atomic<int> arrived[rounds] = {};
  LocalGroup(size).run([&](LocalComm& comm) {
    const int r = comm.rank();
    std::vector<float> a(64), b(64 * size);
    for (int round = 0; round < rounds; ++round) {
      const std::size_t n = static_cast<std::size_t>(round % 13) + 1;
      switch (round % 4) {
        case 0: {
          for (std::size_t i = 0; i < n; ++i) a[i] = static_cast<float>(r + round + static_cast<int>(i));
          comm.all_reduce(a.data(), a.data(), n, DType::fp32, ReduceOp::sum);
          for (std::size_t i = 0; i < n; ++i) {
            const int expected = size * (size - 1) / 2 + size * (round + static_cast<int>(i));
            if (a[i] != static_cast<float>(expected)) ++wrong;
          }
          break;
        }
        case 1: {
          for (std::size_t i = 0; i < n; ++i)
            b[static_cast<std::size_t>(r) * n + i] = static_cast<float>(r * 100 + round);
          comm.all_gather(b.data() + static_cast<std::size_t>(r) * n, b.data(), n, DType::fp32);
          for (int p = 0; p < size; ++p) {
            for (std::size_t i = 0; i < n; ++i) {
              if (b[static_cast<std::size_t>(p) * n + i] != static_cast<float>(p * 100 + round)) ++wrong;
            }
          }
          break;
        }
        case 2: {
          const int root = round % size;
          std::fill_n(a.data(), n, r == root ? static_cast<float>(round) : -1.0f);
          comm.broadcast(a.data(), a.data(), n, DType::fp32, root);
          for (std::size_t i = 0; i < n; ++i) {
            if (a[i] != static_cast<float>(round)) ++wrong;
          }
          break;
        }
        default: {
          ++arrived[round];
          comm.barrier();
          if (arrived[round].load() != size) ++wrong;
        }
      }
    }
  });
  CHECK(wrong.load() == 0);
}

#if defined(__linux__)
TEST_CASE("LocalGroup counts the CPUs its ranks may run on, not the machine's, and completes on one CPU") {
  // Ranks confined to fewer CPUs than there are ranks (taskset, an MPI launcher's binding) are oversubscribed even on
  // a machine with cores to spare: a waiter spinning there keeps the only CPU from the rank it waits for. LocalGroup
  // used to count the machine's CPUs, and every collective of two ranks bound to one CPU took a spin budget.
  cpu_set_t mask;
  REQUIRE(sched_getaffinity(0, sizeof(mask), &mask) == 0);
  const int cpus = CPU_COUNT(&mask);
  CHECK(tandem::detail::usable_cpus() == static_cast<unsigned>(cpus));
  CHECK(tandem::detail::LocalGroupState(cpus, 1s).oversubscribed() == false);
  CHECK(tandem::detail::LocalGroupState(cpus + 1, 1s).oversubscribed());

  int first = 0;
  while (!CPU_ISSET(first, &mask)) ++first;
  const int size = 3;
  const int rounds = 200;
  int set_affinity = -1;
  unsigned confined_cpus = 0;
  bool confined_oversubscribed = false;
  std::atomic<int> wrong{0};
  std::thread confined([&] {  // its affinity passes to the ranks' threads
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(first, &one);
    set_affinity = pthread_setaffinity_np(pthread_self(), sizeof(one), &one);
    confined_cpus = tandem::detail::usable_cpus();
    confined_oversubscribed = tandem::detail::LocalGroupState(2, 1s).oversubscribed();
    LocalGroup(size).run([&](LocalComm& comm) {
      std::vector<float> a(33);
      for (int round = 0; round < rounds; ++round) {
        for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(comm.rank() * round + static_cast<int>(i));
        comm.all_reduce(a.data(), a.data(), a.size(), DType::fp32, ReduceOp::sum);
        for (std::size_t i = 0; i < a.size(); ++i) {
          if (a[i] != static_cast<float>(size * (size - 1) / 2 * round + size * static_cast<int>(i))) ++wrong;
        }
      }
    });
  });
  confined.join();
  REQUIRE(set_affinity == 0);
  CHECK(confined_cpus == 1);
  CHECK(confined_oversubscribed);
  CHECK(wrong.load() == 0);
}
#endif

// --- Errors: nobody hangs --------------------------------------------------------------------------------------------

/// Runs body on `size` ranks; each rank's tandem::error message and exact type are recorded, and run() must
/// return (every rank handled its error) within a second.
struct ErrorRecord {
  std::vector<std::string> messages;
  std::vector<std::string> types;
};

template <class Body>
ErrorRecord run_catching(int size, Body body, LocalGroupOptions options = {.timeout = std::chrono::seconds(5)}) {
  ErrorRecord rec{std::vector<std::string>(static_cast<std::size_t>(size)),
                  std::vector<std::string>(static_cast<std::size_t>(size))};
  const auto start = Clock::now();
  LocalGroup(size, options).run([&](LocalComm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    try {
      body(comm);
    } catch (const tandem::error& e) {
      rec.messages[r] = e.what();
      rec.types[r] = typeid(e) == typeid(tandem::error) ? "error" : "subclass";
    }
  });
  CHECK(Clock::now() - start < 1s);
  return rec;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST_CASE("LocalGroup: a rank calling a different count makes every rank throw") {
  const ErrorRecord rec = run_catching(4, [&](LocalComm& comm) {
    const std::size_t count = comm.rank() == 1 ? 12 : 10;
    std::vector<float> mine(count, 1.0f);
    comm.all_reduce(mine.data(), mine.data(), count, DType::fp32, ReduceOp::sum);
  });
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r << ": " << rec.messages[static_cast<std::size_t>(r)]);
    CHECK(rec.types[static_cast<std::size_t>(r)] == "error");
    CHECK(contains(rec.messages[static_cast<std::size_t>(r)],
                   "tandem: collective mismatch: rank 0 called all_reduce(count=10, fp32, sum) but rank 1 called "
                   "all_reduce(count=12, fp32, sum)"));
  }
}

TEST_CASE("LocalGroup: a rank calling with a different dtype, op or root makes every rank throw") {
  struct Case {
    const char* what;
    std::function<void(LocalComm&)> call;
    const char* message;
  };
  const Case cases[] = {
      {"dtype",
       [](LocalComm& comm) {
         std::vector<double> mine(10, 1.0);  // room for 10 of either dtype
         comm.all_reduce(mine.data(), mine.data(), 10, comm.rank() == 2 ? DType::fp64 : DType::fp32, ReduceOp::sum);
       },
       "tandem: collective mismatch: rank 0 called all_reduce(count=10, fp32, sum) but rank 2 called "
       "all_reduce(count=10, fp64, sum)"},
      {"op",
       [](LocalComm& comm) {
         std::vector<float> mine(10, 1.0f);
         comm.all_reduce(mine.data(), mine.data(), 10, DType::fp32, comm.rank() == 1 ? ReduceOp::avg : ReduceOp::sum);
       },
       "tandem: collective mismatch: rank 0 called all_reduce(count=10, fp32, sum) but rank 1 called "
       "all_reduce(count=10, fp32, avg)"},
      {"root",
       [](LocalComm& comm) {
         std::vector<float> mine(10, 1.0f);
         comm.broadcast(mine.data(), mine.data(), 10, DType::fp32, comm.rank() == 2 ? 1 : 0);
       },
       "tandem: collective mismatch: rank 0 called broadcast(count=10, fp32, root=0) but rank 2 called "
       "broadcast(count=10, fp32, root=1)"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.what);
    const ErrorRecord rec = run_catching(3, c.call);
    for (int r = 0; r < 3; ++r) {
      INFO("rank " << r << ": " << rec.messages[static_cast<std::size_t>(r)]);
      CHECK(rec.types[static_cast<std::size_t>(r)] == "error");
      CHECK(contains(rec.messages[static_cast<std::size_t>(r)], c.message));
    }
  }
}

TEST_CASE("LocalGroup: a rank calling a different collective makes every rank throw, and the group goes on") {
  std::atomic<int> after{0};
  const ErrorRecord rec = run_catching(3, [&](LocalComm& comm) {
    std::vector<float> a(10, 1.0f), b(36, 0.0f);
    try {
      if (comm.rank() == 1) {
        comm.all_gather(b.data(), b.data(), 12, DType::fp32);  // not in place: b + rank*12 != b ... and overlapping
      } else {
        comm.all_reduce(a.data(), a.data(), 10, DType::fp32, ReduceOp::sum);
      }
    } catch (const tandem::error&) {
      // Every rank threw at the same rendezvous: the group is still in step.
      comm.all_reduce(a.data(), a.data(), 10, DType::fp32, ReduceOp::sum);
      if (a[9] == 3.0f) ++after;
      throw;
    }
  });
  CHECK(after.load() == 3);
  // Rank 1 rejected its own (overlapping) arguments: that message wins over the mismatch.
  CHECK(contains(rec.messages[1], "all_gather on rank 1: `send` and `recv` overlap but are not the in-place form"));
  CHECK(contains(rec.messages[0], "rank 1 rejected its arguments"));
  CHECK(contains(rec.messages[2], "rank 1 rejected its arguments"));

  const ErrorRecord mismatch = run_catching(3, [&](LocalComm& comm) {
    std::vector<float> a(10, 1.0f), b(36, 0.0f);
    if (comm.rank() == 1) {
      comm.all_gather(b.data() + 12, b.data(), 12, DType::fp32);
    } else {
      comm.all_reduce(a.data(), a.data(), 10, DType::fp32, ReduceOp::sum);
    }
  });
  for (const std::string& m : mismatch.messages) {
    CHECK(contains(m,
                   "tandem: collective mismatch: rank 0 called all_reduce(count=10, fp32, sum) but rank 1 called "
                   "all_gather(count=12, fp32)"));
  }
}

TEST_CASE("LocalGroup: arguments one rank rejects make every rank throw") {
  SUBCASE("null recv") {
    const ErrorRecord rec = run_catching(4, [&](LocalComm& comm) {
      std::vector<float> a(8, 1.0f);
      comm.all_reduce(a.data(), comm.rank() == 2 ? nullptr : a.data(), 8, DType::fp32, ReduceOp::avg);
    });
    CHECK(contains(rec.messages[2], "tandem: all_reduce on rank 2: `recv` is null but count is 8"));
    for (int r : {0, 1, 3}) CHECK(contains(rec.messages[static_cast<std::size_t>(r)], "rank 2 rejected its arguments"));
    for (const std::string& t : rec.types) CHECK(t == "error");
  }
  SUBCASE("null send") {
    const ErrorRecord rec = run_catching(2, [&](LocalComm& comm) {
      std::vector<BFloat16> a(16);
      comm.reduce_scatter(comm.rank() == 0 ? nullptr : a.data(), a.data() + 8 * comm.rank(), 8, DType::bf16,
                          ReduceOp::sum);
    });
    CHECK(contains(rec.messages[0], "`send` is null but count is 8; pass a buffer of 2 x 8 bf16 elements"));
    CHECK(contains(rec.messages[1], "rank 0 rejected its arguments"));
  }
  SUBCASE("root out of range") {
    const ErrorRecord rec = run_catching(3, [&](LocalComm& comm) {
      std::vector<float> a(4);
      comm.broadcast(a.data(), a.data(), 4, DType::fp32, 3);
    });
    for (const std::string& m : rec.messages) CHECK(contains(m, "`root` is 3 but the group has 3 ranks"));
  }
  SUBCASE("reduce_scatter buffers that overlap without being in place") {
    const ErrorRecord rec = run_catching(2, [&](LocalComm& comm) {
      std::vector<float> a(8);
      comm.reduce_scatter(a.data(), a.data() + 1, 4, DType::fp32, ReduceOp::sum);
    });
    CHECK(contains(rec.messages[0],
                   "reduce_scatter on rank 0: `send` and `recv` overlap but are not the in-place "
                   "form (recv == send + rank * count)"));
    CHECK(contains(rec.messages[1], "reduce_scatter on rank 1: `send` and `recv` overlap"));
  }
  SUBCASE("ranks sharing one recv buffer") {
    std::vector<float> shared(5);
    const ErrorRecord rec = run_catching(3, [&](LocalComm& comm) {
      std::vector<float> a(5, 1.0f);
      comm.all_reduce(a.data(), shared.data(), 5, DType::fp32, ReduceOp::sum);
    });
    for (const std::string& m : rec.messages) CHECK(contains(m, "rank 0's `recv` overlaps rank 1's `recv`"));
  }
  SUBCASE("count 0 needs no buffers") {
    const ErrorRecord rec = run_catching(3, [&](LocalComm& comm) {
      comm.all_reduce(nullptr, nullptr, 0, DType::bf16, ReduceOp::sum);
      comm.reduce_scatter(nullptr, nullptr, 0, DType::fp16, ReduceOp::avg);
      comm.all_gather(nullptr, nullptr, 0, DType::fp64);
      comm.broadcast(nullptr, nullptr, 0, DType::fp32, 2);
    });
    for (const std::string& m : rec.messages) CHECK(m.empty());
  }
}

struct BodyFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

TEST_CASE("LocalGroup: a rank that throws releases the others with peer_error, and run() rethrows the original") {
  std::vector<std::string> peer(4);
  const auto start = Clock::now();
  LocalGroup group(4);  // the default timeout (5 min): only the abort can release the waiters in time
  CHECK_THROWS_AS(group.run([&](LocalComm& comm) {
    const int r = comm.rank();
    if (r == 2) {
      std::this_thread::sleep_for(50ms);  // ranks 0 and 1 are blocked in all_reduce by now
      throw BodyFailure("boom");
    }
    if (r == 3) std::this_thread::sleep_for(150ms);  // enters after the abort
    std::vector<float> a(100, 1.0f);
    try {
      comm.all_reduce(a.data(), a.data(), a.size(), DType::fp32, ReduceOp::sum);
    } catch (const tandem::peer_error& e) {
      peer[static_cast<std::size_t>(r)] = e.what();
      throw;
    }
  }),
                  BodyFailure);
  CHECK(Clock::now() - start < 1s);
  for (int r : {0, 1, 3}) CHECK(peer[static_cast<std::size_t>(r)] == "tandem: rank 2 failed: boom");

  // Something that is not a std::exception travels too, and the group can run again afterwards.
  CHECK_THROWS_AS(group.run([&](LocalComm& comm) {
    if (comm.rank() == 0) throw 42;
    comm.barrier();
  }),
                  int);
  std::atomic<int> done{0};
  group.run([&](LocalComm& comm) {
    comm.barrier();
    ++done;
  });
  CHECK(done.load() == 4);
}

TEST_CASE("LocalGroup: a rank that returns while others wait for it makes them throw") {
  const auto start = Clock::now();
  CHECK_THROWS_WITH_AS(LocalGroup(3, {.timeout = std::chrono::seconds(5)}).run([&](LocalComm& comm) {
    if (comm.rank() != 1) comm.barrier();
  }),
                       doctest::Contains("rank 1 already returned from its body"), tandem::error);
  CHECK(Clock::now() - start < 1s);
}

TEST_CASE("LocalGroup: an unbounded timeout (milliseconds::max()) waits for a late rank; a failure still releases") {
  // A wait without a deadline is another branch of the barrier (its deadline would overflow the clock).
  LocalGroup group(3, {.timeout = std::chrono::milliseconds::max()});
  std::vector<float> sums(3, 0.0f);
  group.run([&](LocalComm& comm) {
    if (comm.rank() == 2) std::this_thread::sleep_for(100ms);  // the others wait in all_reduce, not timing out
    float v = static_cast<float>(comm.rank() + 1);
    comm.all_reduce(&v, &v, 1, DType::fp32, ReduceOp::sum);
    sums[static_cast<std::size_t>(comm.rank())] = v;
  });
  CHECK(sums == std::vector<float>(3, 6.0f));

  std::vector<std::string> peer(3);
  auto start = Clock::now();
  CHECK_THROWS_AS(group.run([&](LocalComm& comm) {
    if (comm.rank() == 1) {
      std::this_thread::sleep_for(50ms);  // ranks 0 and 2 wait in all_reduce by now
      throw BodyFailure("boom");
    }
    float v = 1.0f;
    try {
      comm.all_reduce(&v, &v, 1, DType::fp32, ReduceOp::sum);
    } catch (const tandem::peer_error& e) {
      peer[static_cast<std::size_t>(comm.rank())] = e.what();
      throw;
    }
  }),
                  BodyFailure);
  CHECK(Clock::now() - start < 1s);
  CHECK(peer[0] == "tandem: rank 1 failed: boom");
  CHECK(peer[2] == "tandem: rank 1 failed: boom");

  start = Clock::now();
  CHECK_THROWS_WITH_AS(group.run([&](LocalComm& comm) {
    if (comm.rank() == 1)
      std::this_thread::sleep_for(50ms);
    else
      comm.barrier();
  }),
                       doctest::Contains("rank 1 already returned from its body"), tandem::error);
  CHECK(Clock::now() - start < 1s);
}

TEST_CASE("LocalGroup: a rank that does not arrive in time makes the waiting ranks throw timeout_error") {
  for (int size : {2, 4}) {
    INFO("size " << size);
    // The last ranks "sleep 2 s"; they wake early once the others have timed out, to keep the test short.
    const int first_late = size == 2 ? 1 : 2;
    std::vector<std::string> messages(static_cast<std::size_t>(size));
    std::vector<std::string> types(static_cast<std::size_t>(size));
    std::vector<double> waited_ms(static_cast<std::size_t>(size));
    std::mutex m;
    std::condition_variable cv;
    int timed_out = 0;
    LocalGroup group(size, {.timeout = 200ms});
    CHECK_THROWS_AS(group.run([&](LocalComm& comm) {
      const int r = comm.rank();
      const auto ur = static_cast<std::size_t>(r);
      if (r >= first_late) {
        std::unique_lock<std::mutex> lock(m);
        cv.wait_for(lock, 2s, [&] { return timed_out == first_late; });
      }
      const auto start = Clock::now();
      try {
        comm.barrier();
      } catch (const tandem::timeout_error& e) {
        waited_ms[ur] = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
        messages[ur] = e.what();
        types[ur] = "timeout";
        {
          std::lock_guard<std::mutex> lock(m);
          ++timed_out;
        }
        cv.notify_all();
        throw;
      } catch (const tandem::peer_error& e) {
        messages[ur] = e.what();
        types[ur] = "peer";
        throw;
      }
    }),
                    tandem::timeout_error);
    const std::string missing = size == 2 ? "rank 1 did not arrive" : "ranks 2, 3 did not arrive";
    // The rank that timed out first waited the whole timeout; the others may have arrived a little later.
    CHECK(*std::max_element(waited_ms.begin(), waited_ms.begin() + first_late) >= 199.0);
    for (int r = 0; r < size; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      INFO("rank " << r << ": " << messages[ur]);
      if (r < first_late) {
        CHECK(types[ur] == "timeout");
        CHECK(messages[ur] == "tandem: barrier timed out after 200 ms on rank " + std::to_string(r) + ": " + missing);
        CHECK(waited_ms[ur] < 1500.0);
      } else {
        CHECK(types[ur] == "peer");
        CHECK(contains(messages[ur], "failed: tandem: barrier timed out after 200 ms"));
      }
    }
  }
}

TEST_CASE("LocalGroup rejects a size below 1 and a timeout that is not positive") {
  CHECK_THROWS_WITH_AS(LocalGroup(0), doctest::Contains("`size` is 0"), tandem::error);
  CHECK_THROWS_WITH_AS(LocalGroup(-3), doctest::Contains("`size` is -3"), tandem::error);
  CHECK_THROWS_WITH_AS(LocalGroup(2, {.timeout = 0ms}), doctest::Contains("`options.timeout` is 0 ms"), tandem::error);
  LocalGroup one(1);
  CHECK(one.size() == 1);
  int ran = 0;
  one.run([&](LocalComm& comm) {
    CHECK(comm.rank() == 0);
    CHECK(comm.size() == 1);
    ++ran;
  });
  CHECK(ran == 1);
}

}  // namespace
