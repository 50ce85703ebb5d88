// SPDX-License-Identifier: Apache-2.0
// GatherSlots: which of K reused bucket-sized buffers ("slots") holds which bucket's gathered parameters, under a
// policy that shards the parameters (ParameterSharded). A pass opens buckets in any order (forward in one, backward in
// the other), so unlike SlotPool there is no order to protect: a slot is held while a handle on it is open, pending
// from a prefetch until the bucket is opened, and otherwise free but still holding its bucket, which a later open
// finds without gathering again (the last bucket of forward is the first of backward). A free slot is reused least
// recently gathered first. Host bookkeeping only; the buffers, their events and the gathers belong to the caller.
// Every rank makes the same calls in the same order, so every rank makes the same choices and the gathers match. The
// choice depends on the gathers alone, not on when handles were released, so that a rank opening again a bucket it
// still holds (a read on rank 0 only, for logging), and releasing it before the next gather, chooses as the others do.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tandem/core/error.hpp"

namespace tandem::detail {

class GatherSlots {
 public:
  static constexpr std::size_t none = static_cast<std::size_t>(-1);

  GatherSlots() = default;
  explicit GatherSlots(std::size_t slots) : slots_(slots) {}

  std::size_t slots() const { return slots_.size(); }

  /// The slot holding bucket b's parameters (held, pending or free), or none.
  std::size_t find(std::size_t bucket) const {
    for (std::size_t s = 0; s < slots_.size(); ++s)
      if (slots_[s].bucket == bucket) return s;
    return none;
  }

  /// The bucket slot s holds, or none.
  std::size_t bucket_of(std::size_t slot) const { return slots_[slot].bucket; }

  /// A slot for bucket b that is neither held nor pending, now recorded as holding b (whose parameters the caller
  /// gathers into it): an empty one first, else the one gathered longest ago. Throws tandem::error (and changes
  /// nothing) when every slot is held or pending.
  std::size_t assign(std::size_t bucket) {
    std::size_t best = none;
    for (std::size_t s = 0; s < slots_.size(); ++s) {
      const Slot& slot = slots_[s];
      if (slot.held || slot.pending) continue;
      if (best == none || rank_of(slot) < rank_of(slots_[best])) best = s;
    }
    if (best == none) {
      std::string busy;
      for (const Slot& slot : slots_)
        busy += (busy.empty() ? "" : ", ") + std::to_string(slot.bucket) + (slot.held ? " open" : " prefetched");
      fail("tandem: bucket " + std::to_string(bucket) + "'s parameters need a gather buffer but all " +
           std::to_string(slots_.size()) + " hold buckets (" + busy +
           "); release a ParameterBucket first, prefetch less far ahead, or raise "
           "DataParallelOptions::parameter_buffers");
    }
    slots_[best] = {bucket, false, false, ++clock_};
    return best;
  }

  /// A handle on slot s is opened (a pending prefetch is now in use).
  void open(std::size_t slot) {
    slots_[slot].held = true;
    slots_[slot].pending = false;
  }
  /// A prefetch gathered into slot s: it stays reserved until its bucket is opened.
  void prefetched(std::size_t slot) { slots_[slot].pending = true; }
  /// The handle on slot s is released: free, still holding its bucket.
  void close(std::size_t slot) { slots_[slot].held = false; }
  bool held(std::size_t slot) const { return slots_[slot].held; }
  /// Slot s holds nothing after all (its gather failed).
  void drop(std::size_t slot) { slots_[slot] = {}; }

  /// The parameters changed (an optimizer step, a restore): no slot holds a current bucket any more. None may be held.
  void forget() {
    for (Slot& slot : slots_) {
      if (slot.held)
        fail("tandem: GatherSlots::forget while slot of bucket " + std::to_string(slot.bucket) + " is open");
      slot = {};
    }
  }

 private:
  struct Slot {
    std::size_t bucket = none;
    bool held = false;
    bool pending = false;
    std::uint64_t gathered = 0;  ///< when its bucket was assigned (gathered)
  };
  /// Reuse order: empty slots first, then by gather time.
  static std::uint64_t rank_of(const Slot& slot) { return slot.bucket == none ? 0 : slot.gathered; }

  std::vector<Slot> slots_;
  std::uint64_t clock_ = 0;
};

}  // namespace tandem::detail
