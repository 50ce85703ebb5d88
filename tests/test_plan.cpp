// SPDX-License-Identifier: Apache-2.0
// The planner against its invariants, checked element by element on random layouts and world sizes 1-9.
#include <doctest/doctest.h>

#include <algorithm>
#include <fstream>
#include <random>
#include <sstream>
#include <vector>

#include "../benchmarks/scaling/scaling_model.hpp"
#include "tandem/core/plan.hpp"

namespace {

std::vector<std::size_t> random_sizes(std::mt19937& rng) {
  std::uniform_int_distribution<int> count(1, 40), kind(0, 9);
  std::vector<std::size_t> sizes(static_cast<std::size_t>(count(rng)));
  for (auto& n : sizes) {
    switch (kind(rng)) {
      case 0:
        n = 0;
        break;
      case 1:
        n = 1;
        break;
      case 2:
        n = std::uniform_int_distribution<std::size_t>(2, 7)(rng);
        break;
      case 3:
        n = std::uniform_int_distribution<std::size_t>(1000, 5000)(rng);
        break;
      default:
        n = std::uniform_int_distribution<std::size_t>(1, 700)(rng);
        break;
    }
  }
  return sizes;
}

// Checks every invariant of `plan` for tensors `sizes`, touching every element.
enum class Check { every_element, intervals };

void check_plan(const std::vector<std::size_t>& sizes, const tandem::PlanOptions& o, const tandem::Plan& plan,
                Check how = Check::every_element) {
  const std::size_t world = static_cast<std::size_t>(o.world_size);
  const std::size_t cap = o.bucket_cap_bytes / o.bucket_element_bytes;
  const std::size_t first_cap = o.first_bucket_cap_bytes / o.bucket_element_bytes;
  REQUIRE(plan.num_tensors() == sizes.size());

  // Buckets tile the flat space in order; sizes padded; shards aligned.
  std::size_t offset = 0, shard_offset = 0;
  for (std::size_t b = 0; b < plan.num_buckets(); ++b) {
    const tandem::Bucket& k = plan.bucket(b);
    REQUIRE(k.offset == offset);
    REQUIRE(k.shard_offset == shard_offset);
    REQUIRE(k.size % (world * o.shard_alignment_elements) == 0);
    REQUIRE(k.size >= k.used);
    REQUIRE(k.size - std::max<std::size_t>(k.used, 1) < world * o.shard_alignment_elements);
    REQUIRE(k.shard_size * world == k.size);
    REQUIRE(!k.tensors.empty());
    const std::size_t limit = b == 0 ? first_cap : cap;
    const auto nonempty =
        std::count_if(k.tensors.begin(), k.tensors.end(), [&](std::size_t i) { return sizes[i] != 0; });
    if (nonempty > 1) REQUIRE(k.used <= limit);              // only a lone tensor may exceed the cap
    REQUIRE(nonempty >= (plan.num_buckets() == 1 ? 0 : 1));  // no bucket of empty tensors alone
    offset += k.size;
    shard_offset += k.shard_size;
  }
  REQUIRE(plan.total_size() == offset);
  REQUIRE(plan.total_shard_size() == shard_offset);

  // Reverse layout order: the concatenation of bucket tensor lists is n-1, n-2, ..., 0.
  std::vector<std::size_t> order;
  for (const auto& k : plan.buckets()) order.insert(order.end(), k.tensors.begin(), k.tensors.end());
  REQUIRE(order.size() == sizes.size());
  for (std::size_t i = 0; i < order.size(); ++i) REQUIRE(order[i] == sizes.size() - 1 - i);

  // Every tensor element maps to exactly one flat position, inside its bucket, aligned, no overlaps; every
  // flat position is in exactly one (bucket, rank) shard.
  std::vector<std::pair<std::size_t, std::size_t>> spans;  // flat [begin, end) of each tensor
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const tandem::Placement& at = plan.placement(i);
    REQUIRE(at.numel == sizes[i]);
    if (at.numel != 0) REQUIRE(at.offset % o.alignment_elements == 0);
    const tandem::Bucket& k = plan.bucket(at.bucket);
    REQUIRE(std::find(k.tensors.begin(), k.tensors.end(), i) != k.tensors.end());
    REQUIRE(at.offset + at.numel <= k.used);
    spans.emplace_back(k.offset + at.offset, k.offset + at.offset + at.numel);
  }
  if (how == Check::intervals) {
    std::sort(spans.begin(), spans.end());
    for (std::size_t i = 1; i < spans.size(); ++i) REQUIRE(spans[i].first >= spans[i - 1].second);
    for (std::size_t b = 0; b < plan.num_buckets(); ++b)
      for (int r = 0; r < o.world_size; ++r) {
        const tandem::Range s = plan.shard(b, r);
        REQUIRE(s.begin == plan.bucket(b).offset + static_cast<std::size_t>(r) * plan.bucket(b).shard_size);
        REQUIRE(s.begin % o.shard_alignment_elements == 0);
      }
    return;
  }
  // Element by element: each tensor element owns exactly one flat slot, and each flat slot lies in exactly
  // one (bucket, rank) shard.
  std::vector<int> owners(plan.total_size(), 0), shard_hits(plan.total_size(), 0);
  for (const auto& [begin, end] : spans)
    for (std::size_t e = begin; e < end; ++e) ++owners[e];
  for (std::size_t b = 0; b < plan.num_buckets(); ++b)
    for (int r = 0; r < o.world_size; ++r) {
      const tandem::Range s = plan.shard(b, r);
      REQUIRE(s.begin % o.shard_alignment_elements == 0);
      for (std::size_t e = s.begin; e < s.end; ++e) ++shard_hits[e];
    }
  std::size_t covered = 0;
  for (int c : owners) {
    REQUIRE(c <= 1);
    covered += static_cast<std::size_t>(c);
  }
  std::size_t total = 0;
  for (auto n : sizes) total += n;
  REQUIRE(covered == total);
  REQUIRE(std::all_of(shard_hits.begin(), shard_hits.end(), [](int h) { return h == 1; }));
}

}  // namespace

TEST_CASE("random layouts x world sizes 1-9 satisfy every plan invariant") {
  std::mt19937 rng(12345);
  for (int trial = 0; trial < 1200; ++trial) {
    const auto sizes = random_sizes(rng);
    tandem::PlanOptions o;
    o.world_size = 1 + trial % 9;
    o.bucket_element_bytes = trial % 3 == 0 ? 2 : 4;
    o.alignment_elements = 16 / o.bucket_element_bytes;
    o.shard_alignment_elements = 128 / o.bucket_element_bytes;
    o.bucket_cap_bytes = std::uniform_int_distribution<std::size_t>(o.bucket_element_bytes, 40000)(rng);
    o.first_bucket_cap_bytes = std::uniform_int_distribution<std::size_t>(o.bucket_element_bytes, 8000)(rng);
    CAPTURE(trial);
    check_plan(sizes, o, tandem::Plan(sizes, o));
  }
}

TEST_CASE("a tensor larger than the cap gets a bucket of its own; the first bucket has its own cap") {
  tandem::PlanOptions o;
  o.world_size = 2;
  o.bucket_cap_bytes = 4000;       // 1000 fp32
  o.first_bucket_cap_bytes = 400;  // 100 fp32
  const tandem::Plan plan({10, 5000, 30, 30, 60}, o);
  // reverse order: 60 (first bucket, cap 100) + 30 -> 92 aligned offset > 100? 60 -> offset 60, +30 = 90 fits
  REQUIRE(plan.num_buckets() == 4);
  CHECK(plan.bucket(0).tensors == std::vector<std::size_t>{4, 3});
  CHECK(plan.bucket(1).tensors == std::vector<std::size_t>{2});
  CHECK(plan.bucket(2).tensors == std::vector<std::size_t>{1});
  CHECK(plan.bucket(3).tensors == std::vector<std::size_t>{0});
  CHECK(plan.bucket(2).used == 5000);
}

TEST_CASE("GPT-2-124M tensor list: 148 tensors planned with the default caps") {
  std::vector<std::size_t> sizes;
  for (const auto& t : tandem::scaling::load_tensor_list(TANDEM_TEST_DATA_DIR "/gpt2_124m.tsv", "gpt2").tensors)
    sizes.push_back(t.numel);
  REQUIRE(sizes.size() == 148);
  std::size_t total = 0;
  for (auto n : sizes) total += n;
  CHECK(total == 124439808);
  for (int world : {1, 2, 3, 4, 8}) {
    tandem::PlanOptions o;
    o.world_size = world;
    const tandem::Plan plan(sizes, o);
    check_plan(sizes, o, plan, Check::intervals);
    CHECK(plan.total_size() >= total);
    CHECK(plan.total_size() - total < plan.num_buckets() * (148 * 4 + world * 32));
  }
}

TEST_CASE("bad plan options are rejected with the option's name") {
  tandem::PlanOptions o;
  o.world_size = 0;
  CHECK_THROWS_WITH_AS(tandem::Plan({1, 2}, o), doctest::Contains("world_size"), tandem::error);
  o.world_size = 1;
  o.shard_alignment_elements = 6;  // not a multiple of alignment_elements = 4
  CHECK_THROWS_WITH_AS(tandem::Plan({1, 2}, o), doctest::Contains("shard_alignment_elements"), tandem::error);
  CHECK_THROWS_AS(tandem::Plan({}, tandem::PlanOptions{}), tandem::error);
  o.shard_alignment_elements = 3 * 4;  // a multiple, not a power of two
  CHECK_THROWS_WITH_AS(tandem::Plan({1, 2}, o), doctest::Contains("must be powers of two"), tandem::error);
  // Sizes that wrapped: the padding unit to 0 (a division by zero), a bucket past 2^63, a sum of sizes
  o.world_size = 1 << 30;
  o.shard_alignment_elements = std::size_t{1} << 34;
  CHECK_THROWS_WITH_AS(tandem::Plan({1, 2}, o), doctest::Contains("is over 2^48 elements per bucket"), tandem::error);
  o.world_size = 1 << 16;
  o.shard_alignment_elements = std::size_t{1} << 32;  // 2^48 per bucket: allowed, but 2^16 buckets of it are not
  o.bucket_cap_bytes = o.first_bucket_cap_bytes = 4;
  CHECK_THROWS_WITH_AS(tandem::Plan(std::vector<std::size_t>(1 << 15, 1), o),
                       doctest::Contains("padded buckets come to more than 2^62"), tandem::error);
  CHECK_THROWS_WITH_AS(tandem::Plan({tandem::max_numel, 1}, tandem::PlanOptions{}),
                       doctest::Contains("add up to more than 2^48"), tandem::error);
}

TEST_CASE("zero-size tensors never open a bucket of their own") {
  tandem::PlanOptions o;
  o.world_size = 4;
  o.bucket_cap_bytes = 12;
  o.first_bucket_cap_bytes = 12;
  const tandem::Plan with_empty({0, 0, 3, 0}, o), without({3}, o);
  CHECK(with_empty.num_buckets() == 1);
  CHECK(with_empty.total_size() == without.total_size());
}
