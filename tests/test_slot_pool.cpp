// SPDX-License-Identifier: Apache-2.0
// detail::SlotPool (front/detail/slot_pool.hpp): slots handed to buckets processed in bucket order. Checked against a
// plain model over random sequences of acquire/release, and its rule: one slot is always left for the next bucket,
// so that processing in order never runs out of slots.
#include <doctest/doctest.h>

#include <random>
#include <string>
#include <vector>

#include "tandem/core/error.hpp"
#include "tandem/front/detail/slot_pool.hpp"

using tandem::detail::SlotPool;

TEST_CASE("slots are handed out, given back and reused; errors change nothing") {
  SlotPool pool(2, 5);
  CHECK(pool.free_slots() == 2);
  CHECK(pool.acquire(0, 0) == 0);
  CHECK(pool.acquire(2, 0) == 1);  // bucket 0 (next) holds one: a later bucket may take the last
  CHECK(pool.free_slots() == 0);
  CHECK_THROWS_WITH_AS(pool.acquire(3, 0), doctest::Contains("all 2 hold buckets (0, 2)"), tandem::error);
  CHECK_THROWS_WITH_AS(pool.acquire(0, 0), doctest::Contains("already holds gradient buffer 0"), tandem::error);
  pool.release(0);
  CHECK(pool.slot_of(0) == SlotPool::none);
  CHECK(pool.slot_of(2) == 1);
  // Bucket 1 is next and holds none: bucket 3 may not take the last free slot, bucket 1 may.
  CHECK_THROWS_WITH_AS(pool.acquire(3, 1), doctest::Contains("bucket 3 would take the last free gradient buffer"),
                       tandem::error);
  CHECK(pool.free_slots() == 1);
  CHECK(pool.acquire(1, 1) == 0);
  CHECK_THROWS_WITH_AS(pool.release(4), doctest::Contains("bucket 4 holds no slot"), tandem::error);
  pool.clear();
  CHECK(pool.free_slots() == 2);
  CHECK(pool.slot_of(1) == SlotPool::none);
}

TEST_CASE("the names in the messages are the caller's") {
  SlotPool pool(1, 3, {.slot = "parameter buffer", .option = "Options::parameter_buffers"});
  pool.acquire(0, 0);
  CHECK_THROWS_WITH_AS(pool.acquire(1, 0), doctest::Contains("needs a parameter buffer"), tandem::error);
  CHECK_THROWS_WITH_AS(pool.acquire(1, 0), doctest::Contains("raise Options::parameter_buffers"), tandem::error);
}

// Random buckets opened ahead of the next one, processed in order whenever the next is released: the pool must agree
// with a plain model at every step, and processing in order must never be refused a slot.
TEST_CASE("random sequences: the pool agrees with a plain model, and in-order processing always gets a slot") {
  std::mt19937 rng(7);
  for (int round = 0; round < 400; ++round) {
    const std::size_t slots = 1 + rng() % 4, buckets = 1 + rng() % 9;
    SlotPool pool(slots, buckets);
    std::vector<int> holds(buckets, 0), released(buckets, 0);  // the model
    std::size_t next = 0;
    while (next < buckets) {
      const std::size_t b = next + rng() % (buckets - next);
      const std::size_t free = slots - static_cast<std::size_t>(std::count(holds.begin(), holds.end(), 1));
      const bool allowed = !holds[b] && !released[b] && free > 0 && (b == next || holds[next] || free > 1);
      if (released[b] || holds[b]) {
        // Process: the next bucket, once released (or never opened: it takes a slot now, which must succeed).
        if (!holds[next]) {
          REQUIRE_NOTHROW(pool.acquire(next, next));
          holds[next] = 1;
        }
        pool.release(next);
        holds[next] = 0;
        ++next;
        while (next < buckets && released[next]) {
          pool.release(next);
          holds[next] = 0;
          ++next;
        }
        continue;
      }
      if (allowed) {
        REQUIRE_NOTHROW(pool.acquire(b, next));
        holds[b] = 1;
        released[b] = 1;  // opened and released at once: it waits for the buckets before it
      } else {
        REQUIRE_THROWS_AS(pool.acquire(b, next), tandem::error);
      }
      REQUIRE(pool.free_slots() == slots - static_cast<std::size_t>(std::count(holds.begin(), holds.end(), 1)));
    }
    CHECK(pool.free_slots() == slots);
  }
}
