// SPDX-License-Identifier: Apache-2.0
// SlotPool: which of K reused bucket-sized buffers ("slots") each bucket holds, for buckets that are processed in
// bucket order (GradientSharded's gradient buffers with owned storage: a bucket holds a slot from when backward opens
// it until its reduction is issued). Host bookkeeping only; the buffers and their events belong to the caller.
//
// The rule that keeps processing going: one slot is always left for the next bucket in order. A later bucket may
// not take the last free slot while the next bucket holds none, or the next one could never be processed (the later
// buckets wait for it, holding every slot). So every bucket can always be processed in order, and misuse is a
// tandem::error that says what to do, never a hang.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "tandem/core/error.hpp"

namespace tandem::detail {

/// How SlotPool's errors name a slot and the option that sets their number.
struct SlotNames {
  const char* slot = "gradient buffer";
  const char* option = "DataParallelOptions::gradient_buffers";
};

class SlotPool {
 public:
  static constexpr std::size_t none = static_cast<std::size_t>(-1);

  SlotPool() = default;
  SlotPool(std::size_t slots, std::size_t buckets, SlotNames names = {})
      : slot_bucket_(slots, none), bucket_slot_(buckets, none), names_(names) {}

  std::size_t slots() const { return slot_bucket_.size(); }
  std::size_t free_slots() const {
    return static_cast<std::size_t>(std::count(slot_bucket_.begin(), slot_bucket_.end(), none));
  }
  /// The slot bucket b holds, or none.
  std::size_t slot_of(std::size_t bucket) const { return bucket_slot_[bucket]; }

  /// Gives `bucket` a free slot and returns it; `next` is the next bucket to be processed. Throws tandem::error (and
  /// changes nothing) if no slot is free, or if taking one would leave none for `next`.
  std::size_t acquire(std::size_t bucket, std::size_t next) {
    if (bucket_slot_[bucket] != none)
      fail("tandem: bucket " + std::to_string(bucket) + " already holds " + names_.slot + " " +
           std::to_string(bucket_slot_[bucket]));
    const std::size_t free = free_slots();
    if (free == 0) {
      std::string held;
      for (std::size_t h : slot_bucket_) held += (held.empty() ? "" : ", ") + std::to_string(h);
      fail("tandem: bucket " + std::to_string(bucket) + " needs a " + names_.slot + " but all " +
           std::to_string(slots()) + " hold buckets (" + held +
           ") that are open or wait for an earlier bucket (buckets are processed in bucket order, from " +
           std::to_string(next) + " on); release or open the buckets in bucket order, or raise " + names_.option);
    }
    if (bucket != next && next < bucket_slot_.size() && bucket_slot_[next] == none && free == 1)
      fail("tandem: bucket " + std::to_string(bucket) + " would take the last free " + names_.slot + ", which bucket " +
           std::to_string(next) + " needs: buckets are processed in bucket order and it is next. " + "Open bucket " +
           std::to_string(next) + " first (open and release it without writing if backward " +
           "leaves it zero), or raise " + names_.option + " (now " + std::to_string(slots()) + ")");
    const auto slot =
        static_cast<std::size_t>(std::find(slot_bucket_.begin(), slot_bucket_.end(), none) - slot_bucket_.begin());
    slot_bucket_[slot] = bucket;
    bucket_slot_[bucket] = slot;
    return slot;
  }

  /// Bucket b gives its slot back.
  void release(std::size_t bucket) {
    const std::size_t slot = bucket_slot_[bucket];
    if (slot == none) fail("tandem: SlotPool::release: bucket " + std::to_string(bucket) + " holds no slot");
    slot_bucket_[slot] = none;
    bucket_slot_[bucket] = none;
  }

  /// Every slot free.
  void clear() {
    std::fill(slot_bucket_.begin(), slot_bucket_.end(), none);
    std::fill(bucket_slot_.begin(), bucket_slot_.end(), none);
  }

 private:
  std::vector<std::size_t> slot_bucket_;  ///< the bucket slot s holds, or none
  std::vector<std::size_t> bucket_slot_;  ///< the slot bucket b holds, or none
  SlotNames names_;
};

}  // namespace tandem::detail
