// SPDX-License-Identifier: Apache-2.0
// detail::GatherSlots (front/detail/gather_slots.hpp): which gather buffer holds which bucket's parameters under
// ParameterSharded. Its choices against a plain model (a list of slots searched by hand) over random sequences of
// open, prefetch, release and forget, and its errors.
#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "tandem/core/error.hpp"
#include "tandem/front/detail/gather_slots.hpp"

using tandem::detail::GatherSlots;

TEST_CASE("a bucket keeps its buffer after release until reused, least recently gathered first") {
  GatherSlots slots(2);
  CHECK(slots.find(4) == GatherSlots::none);
  const std::size_t a = slots.assign(4);
  slots.open(a);
  const std::size_t b = slots.assign(3);
  slots.prefetched(b);
  CHECK(a != b);
  CHECK_THROWS_WITH_AS(slots.assign(2), doctest::Contains("all 2 hold buckets (4 open, 3 prefetched)"), tandem::error);
  CHECK(slots.find(4) == a);  // the failed assign changed nothing
  CHECK(slots.find(3) == b);
  slots.close(a);
  slots.open(b);  // the prefetched bucket is opened
  slots.close(b);
  CHECK(slots.find(4) == a);  // both released, both still there
  CHECK(slots.find(3) == b);
  slots.open(a);  // bucket 4 opened again and released last (a read on one rank only): the choice is the same
  slots.close(a);
  CHECK(slots.assign(2) == a);  // bucket 4 was gathered first
  CHECK(slots.find(4) == GatherSlots::none);
  CHECK(slots.bucket_of(a) == 2);
  slots.drop(a);
  CHECK(slots.find(2) == GatherSlots::none);
  slots.open(b);
  CHECK_THROWS_WITH_AS(slots.forget(), doctest::Contains("open"), tandem::error);
  slots.close(b);
  slots.forget();
  CHECK(slots.find(3) == GatherSlots::none);
}

TEST_CASE("random sequences: the same choices as a plain model") {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 200; ++round) {
    const std::size_t k = 1 + rng() % 4, buckets = 1 + rng() % 8;
    GatherSlots slots(k);
    struct Model {
      std::size_t bucket = GatherSlots::none;
      bool held = false, pending = false;
      std::uint64_t gathered = 0;
    };
    std::vector<Model> model(k);
    std::uint64_t clock = 0;
    for (int op = 0; op < 100; ++op) {
      const std::size_t b = rng() % buckets;
      std::size_t mine = GatherSlots::none;
      for (std::size_t s = 0; s < k; ++s)
        if (model[s].bucket == b) mine = s;
      REQUIRE(slots.find(b) == mine);
      switch (rng() % 4) {
        case 0:
        case 1: {  // open b (parameters(b)), or prefetch it
          const bool prefetch = rng() % 2 == 0;
          if (mine != GatherSlots::none && (model[mine].held || (prefetch && model[mine].pending))) break;
          if (mine == GatherSlots::none) {
            // The plain rule: an empty slot first (lowest index), else the one gathered longest ago.
            std::size_t best = GatherSlots::none;
            for (std::size_t s = 0; s < k; ++s) {
              if (model[s].held || model[s].pending) continue;
              const std::uint64_t rank = model[s].bucket == GatherSlots::none ? 0 : model[s].gathered;
              const std::uint64_t best_rank = best == GatherSlots::none                 ? ~std::uint64_t{0}
                                              : model[best].bucket == GatherSlots::none ? 0
                                                                                        : model[best].gathered;
              if (rank < best_rank) best = s;
            }
            if (best == GatherSlots::none) {
              CHECK_THROWS_AS(slots.assign(b), tandem::error);
              break;
            }
            REQUIRE(slots.assign(b) == best);
            model[best] = {b, false, false, ++clock};
            mine = best;
          }
          if (prefetch && !model[mine].held) {
            slots.prefetched(mine);
            model[mine].pending = true;
          } else if (!prefetch) {
            slots.open(mine);
            model[mine].held = true;
            model[mine].pending = false;
          }
          break;
        }
        case 2:  // release b's handle
          if (mine == GatherSlots::none || !model[mine].held) break;
          slots.close(mine);
          model[mine].held = false;
          break;
        case 3: {  // an optimizer step: only when nothing is open
          bool any = false;
          for (const Model& m : model) any = any || m.held;
          if (any || rng() % 4 != 0) break;
          slots.forget();
          for (Model& m : model) m = {};
          break;
        }
      }
      for (std::size_t s = 0; s < k; ++s) {
        REQUIRE(slots.bucket_of(s) == model[s].bucket);
        REQUIRE(slots.held(s) == model[s].held);
      }
    }
  }
}
