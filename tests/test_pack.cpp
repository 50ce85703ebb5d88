// SPDX-License-Identifier: Apache-2.0
// Pack and unpack bodies over random layouts: odd sizes, misaligned user pointers, every dtype pair the
// library uses, scale and accumulate; outputs poisoned first and every element checked against a plain
// loop. The bodies run both as the host runs them (one lane) and as a CUDA block runs them (256 lanes,
// grid-stride over items), so the vector head/body/tail split is exercised the way the GPU uses it.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <random>
#include <tuple>
#include <vector>

#include "support/cuda_launch.hpp"
#include "tandem/backend/host.hpp"
#include "tandem/backend/launch.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/core/plan.hpp"
#include "tandem/kernels/pack.hpp"

namespace {

using tandem::BFloat16;
using tandem::Float16;

enum class Lanes { host, cuda_launch, cuda_half_warps };

// Runs body over `items` as the host backend does, or as a CUDA grid of at most 7 blocks (grid-stride too) would, a
// warp or half a warp per item.
template <class Body>
void run(std::size_t items, const Body& body, Lanes lanes) {
  if (lanes == Lanes::host) {
    tandem::HostBackend{}.launch(items, body);
  } else if (lanes == Lanes::cuda_launch) {
    test::emulate_cuda_launch(items, body, 7);
  } else {
    test::emulate_cuda_launch(items, tandem::WithItemLanes<Body, 16>{body}, 7);
  }
}

template <class T>
float value_of(T v) {
  return static_cast<float>(v);
}

template <class T>
T make(float f) {
  return T(f);
}

template <class T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

struct Layout {
  std::vector<std::size_t> sizes;
  std::vector<std::size_t> misalign;  // elements each user pointer is shifted by
};

Layout random_layout(std::mt19937& rng) {
  Layout l;
  const int n = std::uniform_int_distribution<int>(1, 12)(rng);
  for (int i = 0; i < n; ++i) {
    const int kind = std::uniform_int_distribution<int>(0, 5)(rng);
    std::size_t size = kind == 0   ? 0
                       : kind == 1 ? std::uniform_int_distribution<std::size_t>(1, 9)(rng)
                       : kind == 2 ? std::uniform_int_distribution<std::size_t>(4090, 9000)(rng)
                                   : std::uniform_int_distribution<std::size_t>(10, 600)(rng);
    l.sizes.push_back(size);
    l.misalign.push_back(std::uniform_int_distribution<std::size_t>(0, 7)(rng));
  }
  return l;
}

// Packs user buffers of UserT into a bucket of BucketT (assign or accumulate) and unpacks back; checks all.
template <class UserT, class BucketT>
void check_round_trip(std::mt19937& rng, Lanes lanes, tandem::WriteMode mode, tandem::StoreHint hint) {
  const Layout l = random_layout(rng);
  tandem::PlanOptions o;
  o.world_size = std::uniform_int_distribution<int>(1, 4)(rng);
  o.alignment_elements = 16 / std::min(sizeof(UserT), sizeof(BucketT));
  o.shard_alignment_elements = 128 / std::min(sizeof(UserT), sizeof(BucketT));
  o.bucket_cap_bytes = 1 << 30;
  o.first_bucket_cap_bytes = 1 << 30;
  const tandem::Plan plan(l.sizes, o);
  REQUIRE(plan.num_buckets() == 1);

  // One arena for every user tensor, each at a random element misalignment from 16 bytes.
  std::size_t arena_elems = 0;
  std::vector<std::size_t> at;
  for (std::size_t i = 0; i < l.sizes.size(); ++i) {
    arena_elems = (arena_elems + 16) / 16 * 16 + l.misalign[i];
    at.push_back(arena_elems);
    arena_elems += l.sizes[i];
  }
  tandem::HostBuffer<UserT> arena(arena_elems + 16);
  std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
  std::vector<void*> pointers;
  for (std::size_t i = 0; i < l.sizes.size(); ++i) {
    pointers.push_back(arena.data() + at[i]);
    for (std::size_t e = 0; e < l.sizes[i]; ++e) arena.data()[at[i] + e] = make<UserT>(dist(rng));
  }
  const tandem::PackTable table = tandem::make_pack_table(plan, 0, pointers, 64 * (1 + rng() % 4));
  // The two item orders hold the same items; reading_user visits tensors in layout order.
  REQUIRE(table.reading_user.size() == table.reading_bucket.size());
  {
    auto key = [](const tandem::PackItem& i) { return std::tuple(i.tensor, i.begin, i.count); };
    std::vector<std::tuple<std::uint32_t, std::uint64_t, std::uint32_t>> a, b;
    for (const auto& i : table.reading_user) a.push_back(key(i));
    for (const auto& i : table.reading_bucket) b.push_back(key(i));
    std::vector<std::uint32_t> order;
    for (const auto& i : table.reading_user)
      if (order.empty() || order.back() != i.tensor) order.push_back(i.tensor);
    CHECK(std::is_sorted(order.rbegin(), order.rend()));  // bucket slots descending = layout order ascending
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    CHECK(a == b);
  }
  const float scale = mode == tandem::WriteMode::assign ? 0.25f * static_cast<float>(1 + rng() % 3) : 0.5f;

  // Poison the bucket (NaN), or fill it with known values to accumulate onto.
  tandem::HostBuffer<BucketT> bucket(plan.total_size());
  std::vector<BucketT> before(plan.total_size());
  for (std::size_t e = 0; e < plan.total_size(); ++e)
    before[e] = mode == tandem::WriteMode::assign ? make<BucketT>(std::nanf("")) : make<BucketT>(dist(rng));
  std::memcpy(bucket.data(), before.data(), bucket.bytes());

  if (mode == tandem::WriteMode::assign)
    run(table.size(),
        tandem::PackBody<UserT, BucketT, tandem::PackDirection::to_bucket>{
            table.reading_user.data(), table.tensors.data(), bucket.data(), scale, hint},
        lanes);
  else
    run(table.size(),
        tandem::PackBody<UserT, BucketT, tandem::PackDirection::to_bucket, tandem::WriteMode::accumulate>{
            table.reading_user.data(), table.tensors.data(), bucket.data(), scale},
        lanes);

  // Reference: a plain loop per tensor; gaps between tensors must be untouched.
  std::vector<int> covered(plan.total_size(), 0);
  for (std::size_t i = 0; i < l.sizes.size(); ++i) {
    const std::size_t off = plan.placement(i).offset;
    for (std::size_t e = 0; e < l.sizes[i]; ++e) {
      const float x = scale * value_of(arena.data()[at[i] + e]);
      const BucketT want =
          mode == tandem::WriteMode::assign ? make<BucketT>(x) : make<BucketT>(value_of(before[off + e]) + x);
      if (!same_bits(bucket.data()[off + e], want))
        FAIL("tensor " << i << " element " << e << ": " << value_of(bucket.data()[off + e])
                       << " != " << value_of(want));
      covered[off + e] = 1;
    }
  }
  for (std::size_t e = 0; e < plan.total_size(); ++e)
    if (!covered[e]) REQUIRE(same_bits(bucket.data()[e], before[e]));

  // Unpack (bucket -> user) into poisoned user buffers: every element must equal the cast bucket value.
  if constexpr (std::is_same_v<UserT, BucketT>) {
    for (std::size_t e = 0; e < arena_elems; ++e) arena.data()[e] = make<UserT>(std::nanf(""));
    const float unscale = 2.0f;
    run(table.size(),
        tandem::PackBody<UserT, BucketT, tandem::PackDirection::from_bucket>{
            table.reading_bucket.data(), table.tensors.data(), bucket.data(), unscale, hint},
        lanes);
    for (std::size_t i = 0; i < l.sizes.size(); ++i)
      for (std::size_t e = 0; e < l.sizes[i]; ++e) {
        const UserT want = make<UserT>(unscale * value_of(bucket.data()[plan.placement(i).offset + e]));
        if (!same_bits(arena.data()[at[i] + e], want)) FAIL("unpack tensor " << i << " element " << e);
      }
  }
}

}  // namespace

TEST_CASE_TEMPLATE("pack/unpack round trip, host lanes and CUDA lanes (a warp or half a warp per item)", Pair,
                   std::pair<float, float>, std::pair<BFloat16, float>, std::pair<Float16, float>,
                   std::pair<float, BFloat16>, std::pair<BFloat16, BFloat16>, std::pair<Float16, Float16>) {
  using UserT = typename Pair::first_type;
  using BucketT = typename Pair::second_type;
  std::mt19937 rng(77);
  for (int trial = 0; trial < 60; ++trial) {
    CAPTURE(trial);
    const Lanes lanes = trial % 3 == 0 ? Lanes::host : trial % 3 == 1 ? Lanes::cuda_launch : Lanes::cuda_half_warps;
    // Host lanes take the streaming stores' loop where the hint says so (an accumulating pack never does).
    const tandem::StoreHint hint = trial % 2 == 0 ? tandem::StoreHint::streaming : tandem::StoreHint::cached;
    check_round_trip<UserT, BucketT>(rng, lanes, tandem::WriteMode::assign, hint);
    check_round_trip<UserT, BucketT>(rng, lanes, tandem::WriteMode::accumulate, hint);
  }
}

TEST_CASE_TEMPLATE(
    "a copy with scale 1 keeps every bit, NaN payloads and negative zero included, with either store hint", T, float,
    BFloat16, Float16) {
  // NaN payloads (a signalling one, which a conversion would quiet), negative zero, the smallest subnormal, infinity
  std::uint32_t bits[] = {0x7fa00001u, 0xffc12345u, 0x80000000u, 0x00000001u, 0x7f800000u};
  if constexpr (std::is_same_v<T, BFloat16>) {
    const std::uint32_t b[] = {0x7f81u, 0xffc5u, 0x8000u, 0x0001u, 0x7f80u};
    std::copy(std::begin(b), std::end(b), bits);
  } else if constexpr (std::is_same_v<T, Float16>) {
    const std::uint32_t h[] = {0x7c01u, 0xfe05u, 0x8000u, 0x0001u, 0x7c00u};
    std::copy(std::begin(h), std::end(h), bits);
  }
  const std::size_t n = 101;  // a scalar head, whole groups (four at a time on the host), a tail
  const T one = make<T>(1.0f);
  for (const tandem::StoreHint hint : {tandem::StoreHint::cached, tandem::StoreHint::streaming}) {
    for (std::size_t offset = 0; offset < 16 / sizeof(T); ++offset) {
      CAPTURE(offset);
      tandem::HostBuffer<T> src(n + 8), dst(n + 8);
      for (std::size_t i = 0; i < n + 8; ++i) {
        std::memcpy(src.data() + i, &bits[i % 5], sizeof(T));  // (little-endian: the low bytes)
        dst.data()[i] = one;
      }
      tandem::CastBody<T, T>{src.data() + offset, dst.data() + offset, n, 1.0f, hint}(0, 0, 1);
      tandem::detail::stream_fence();
      CHECK(std::memcmp(src.data() + offset, dst.data() + offset, n * sizeof(T)) == 0);
      for (std::size_t i = 0; i < n + 8; ++i)
        if (i < offset || i >= offset + n) CHECK(same_bits(dst.data()[i], one));
    }
  }
}

// A body of L lanes per item (the default, a warp, declares nothing) that records which lanes ran each item.
template <unsigned L>
struct LaneRecorder {
  std::vector<std::uint32_t>* seen;  // bit `lane` of each item
  std::vector<int>* calls;
  bool* odd;  // a call with other than L lanes, or a lane beyond them (checked once: millions of calls)
  void operator()(std::size_t i, unsigned lane, unsigned lanes) const {
    *odd = *odd || lanes != L || lane >= L;
    (*seen)[i] |= std::uint32_t{1} << (lane % 32);
    ++(*calls)[i];
  }
};

// The launch of Body (a LaneRecorder, with or without declared lanes) over `items`: its shape, and each item run by
// each of lanes_of<Body>() lanes exactly once (the recorder flags any call with other lanes than it expects).
template <class Body>
void check_item_mapping(std::size_t items, unsigned max_blocks) {
  constexpr unsigned L = tandem::lanes_of<Body>();
  const tandem::LaunchShape s = tandem::launch_shape(items, max_blocks, L);
  CHECK(s.block == tandem::block_threads);
  CHECK(s.grid <= max_blocks);
  CHECK((items == 0) == (s.grid == 0));
  // a block per block_threads / L items, up to the cap
  const std::size_t per_block = tandem::block_threads / L;
  CHECK(s.grid == std::min<std::size_t>((items + per_block - 1) / per_block, max_blocks));
  std::vector<std::uint32_t> seen(items, 0);
  std::vector<int> calls(items, 0);
  bool odd = false;
  Body body;
  body.seen = &seen;
  body.calls = &calls;
  body.odd = &odd;
  CHECK(test::emulate_cuda_launch(items, body, max_blocks) == s.grid);
  CHECK_FALSE(odd);
  const std::uint32_t all = L == 32 ? ~std::uint32_t{0} : (std::uint32_t{1} << L) - 1;
  CHECK(std::all_of(seen.begin(), seen.end(), [&](std::uint32_t m) { return m == all; }));
  CHECK(std::all_of(calls.begin(), calls.end(), [](int c) { return c == int{L}; }));  // each lane once
}

TEST_CASE(
    "the CUDA launch mappings visit every item exactly once: a warp (or its slot) per item, a block per reduced "
    "item") {
  static_assert(tandem::launch_shape(1000).grid == tandem::launch_shape(1000, tandem::max_grid_blocks, 32).grid);
  for (std::size_t items : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{8}, std::size_t{9},
                            std::size_t{255}, std::size_t{65535}, std::size_t{65536}, std::size_t{200001}}) {
    for (unsigned max_blocks : {1u, 7u, 1024u, tandem::max_grid_blocks}) {
      CAPTURE(items);
      CAPTURE(max_blocks);
      check_item_mapping<LaneRecorder<32>>(items, max_blocks);
      check_item_mapping<tandem::WithItemLanes<LaneRecorder<16>, 16>>(items, max_blocks);
      check_item_mapping<tandem::WithItemLanes<LaneRecorder<8>, 8>>(items, max_blocks);

      // one item ahead: every slot visits its items in the same order, and loads each (after its first) while the
      // item before it has not been worked on yet
      for (unsigned lanes : {32u, 16u, 8u}) {
        const tandem::LaunchShape s = tandem::launch_shape(items, max_blocks, lanes);
        for (unsigned b = 0; b < s.grid; ++b)
          for (unsigned slot = 0; slot < s.block / lanes; ++slot) {
            std::vector<std::size_t> plain, loaded, worked;
            tandem::for_each_item_of_slot(b, slot, s.grid, items, lanes, [&](std::size_t i) { plain.push_back(i); });
            tandem::for_each_item_of_slot_ahead(
                b, slot, s.grid, items, lanes,
                [&](std::size_t i) {
                  loaded.push_back(i);
                  return i;
                },
                [&](std::size_t i) {
                  REQUIRE(loaded.size() == std::min(worked.size() + 2, plain.size()));  // the next one is loaded
                  worked.push_back(i);
                });
            REQUIRE(loaded == plain);
            REQUIRE(worked == plain);
          }
      }

      const tandem::LaunchShape r = tandem::reduction_shape(items, max_blocks);
      CHECK(r.grid == std::min<std::size_t>(items, max_blocks));
      std::vector<int> hits(items, 0);
      for (unsigned b = 0; b < r.grid; ++b)
        tandem::for_each_item_of_block(b, r.grid, items, [&](std::size_t i) { ++hits[i]; });
      CHECK(std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; }));
    }
  }
}

TEST_CASE("the host backend's threaded launch visits every item exactly once") {
  for (int threads : {1, 2, 3, 8}) {
    tandem::HostBackend backend({.threads = threads});
    for (std::size_t items : {std::size_t{0}, std::size_t{1}, std::size_t{5}, std::size_t{1000}}) {
      std::vector<std::atomic<int>> hits(items);
      backend.launch(items, [&](std::size_t i, unsigned lane, unsigned lanes) {
        CHECK(lane == 0);
        CHECK(lanes == 1);
        hits[i].fetch_add(1);
      });
      for (auto& h : hits) CHECK(h.load() == 1);
    }
  }
  CHECK_THROWS_AS(tandem::HostBackend({.threads = 0}), tandem::error);
}

TEST_CASE_TEMPLATE("16-bit vectors move as 16-byte words in memory order (the device's 128-bit loads and stores)", T,
                   tandem::BFloat16, tandem::Float16) {
  std::mt19937 rng(23);
  std::uniform_int_distribution<unsigned> bits(0, 0xffff);
  for (int trial = 0; trial < 100; ++trial) {
    tandem::detail::Vec<T, 16> v;
    for (auto& e : v.v) e.bits = static_cast<std::uint16_t>(bits(rng));
    for (std::size_t c = 0; c < 2; ++c) {
      const tandem::detail::Words16 words = tandem::detail::words_of(v, c);
      unsigned memory[4];
      std::memcpy(memory, reinterpret_cast<const unsigned char*>(&v) + 16 * c, 16);  // what a 16-byte load reads
      for (std::size_t k = 0; k < 4; ++k) CHECK(words.w[k] == memory[k]);
      tandem::detail::Vec<T, 16> back;
      for (auto& e : back.v) e.bits = 0xdead;
      tandem::detail::set_words(back, c, words);
      for (std::size_t k = 0; k < 8; ++k) CHECK(back.v[8 * c + k].bits == v.v[8 * c + k].bits);
      for (std::size_t k = 0; k < 8; ++k) CHECK(back.v[8 * (1 - c) + k].bits == 0xdead);  // the other word untouched
    }
  }
}
