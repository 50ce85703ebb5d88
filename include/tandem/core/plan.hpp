// SPDX-License-Identifier: Apache-2.0
// The Plan: how the layout's tensors are grouped into buckets and how each bucket is split into per-rank
// shards. Pure functions of (tensor sizes, options): built once at construction, testable exhaustively.
//
// Coordinates. A bucket is a contiguous run of elements in a "flat space" that concatenates all buckets
// (bucket b occupies [offset, offset + size)). Inside a bucket, tensors sit at `alignment_elements`-aligned
// offsets, in reverse layout order (the order backward produces gradients). Each bucket's size is padded to a
// multiple of world_size * shard_alignment_elements, so shard r of bucket b is
// [offset + r * shard_size, offset + (r + 1) * shard_size) and every shard starts aligned. A tensor may
// straddle shards. The "shard space" of a rank concatenates its shard of every bucket (bucket b's shard at
// shard_offset), which is how sharded optimizer state and gradient accumulators are laid out.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "tandem/core/error.hpp"
#include "tandem/core/tensor.hpp"

namespace tandem {

/// How buckets are cut. Caps are in bytes of the bucket's element type (`bucket_element_bytes`).
struct PlanOptions {
  std::size_t bucket_cap_bytes = std::size_t{25} << 20;       ///< later buckets (PyTorch DDP's default)
  std::size_t first_bucket_cap_bytes = std::size_t{1} << 20;  ///< the first bucket, so communication starts early
  int world_size = 1;
  std::size_t bucket_element_bytes = 4;       ///< bytes per element when measuring the caps (the gradient bucket)
  std::size_t alignment_elements = 4;         ///< tensor offsets are multiples of this (16 B / smallest element)
  std::size_t shard_alignment_elements = 32;  ///< shards are multiples of this (128 B / smallest element)
};

/// A half-open range of flat (or shard-space) element indices.
struct Range {
  std::size_t begin = 0;
  std::size_t end = 0;
  std::size_t size() const { return end - begin; }
  friend bool operator==(const Range&, const Range&) = default;
};

/// Where a tensor lives: its bucket, its offset inside that bucket, and its size (elements).
struct Placement {
  std::size_t bucket = 0;
  std::size_t offset = 0;
  std::size_t numel = 0;
};

struct Bucket {
  std::vector<std::size_t> tensors;  ///< layout indices, in bucket order (reverse layout order)
  std::size_t offset = 0;            ///< first element in flat space
  std::size_t used = 0;              ///< elements up to the end of the last tensor (before padding)
  std::size_t size = 0;              ///< padded elements: a multiple of world_size * shard_alignment_elements
  std::size_t shard_size = 0;        ///< size / world_size
  std::size_t shard_offset = 0;      ///< this bucket's shard in a rank's shard space
};

class Plan {
 public:
  Plan() = default;

  /// Plans buckets for tensors of the given sizes (layout order). Throws tandem::error on bad options.
  TANDEM_COLD Plan(const std::vector<std::size_t>& numels, const PlanOptions& options) : options_(options) {
    validate(options);
    if (numels.empty()) detail::fail("tandem: cannot plan an empty layout");
    std::size_t sum = 0;  // bounded as Layout bounds it: no size below can wrap
    for (std::size_t k = 0; k < numels.size(); ++k) {
      if (numels[k] > max_numel - sum)
        detail::fail("tandem: Plan: the tensors' sizes add up to more than 2^48 elements (at tensor " +
                     std::to_string(k) + ", of " + std::to_string(numels[k]) + ")");
      sum += numels[k];
    }
    const std::size_t world = static_cast<std::size_t>(options.world_size);
    const std::size_t pad_unit = world * options.shard_alignment_elements;
    placements_.resize(numels.size());

    Bucket current;
    std::size_t cap = options.first_bucket_cap_bytes / options.bucket_element_bytes;
    auto close = [&] {
      current.size = round_up(std::max<std::size_t>(current.used, 1), pad_unit);
      if (current.size > max_total - total_size_)
        detail::fail("tandem: Plan: the padded buckets come to more than 2^62 elements (world_size " +
                     std::to_string(world) + " x shard_alignment_elements " +
                     std::to_string(options.shard_alignment_elements) + " per bucket); lower either");
      current.shard_size = current.size / world;
      current.offset = total_size_;
      current.shard_offset = total_shard_size_;
      total_size_ += current.size;
      total_shard_size_ += current.shard_size;
      buckets_.push_back(std::move(current));
      current = Bucket{};
      cap = options.bucket_cap_bytes / options.bucket_element_bytes;
    };
    for (std::size_t k = numels.size(); k-- > 0;) {
      const std::size_t at = round_up(current.used, options.alignment_elements);
      if (current.used != 0 && numels[k] != 0 && at + numels[k] > cap) close();  // empty tensors never open one
      // An empty tensor takes no space (and no alignment): it sits at the current end.
      const std::size_t offset = numels[k] == 0 ? current.used : round_up(current.used, options.alignment_elements);
      placements_[k] = Placement{buckets_.size(), offset, numels[k]};
      current.tensors.push_back(k);
      current.used = offset + numels[k];
    }
    close();
  }

  const PlanOptions& options() const { return options_; }
  int world_size() const { return options_.world_size; }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  const Bucket& bucket(std::size_t b) const { return buckets_[b]; }
  std::size_t num_buckets() const { return buckets_.size(); }
  const Placement& placement(std::size_t tensor) const { return placements_[tensor]; }
  std::size_t num_tensors() const { return placements_.size(); }

  /// Total padded elements over all buckets (the length of the flat space).
  std::size_t total_size() const { return total_size_; }
  /// Elements of one rank's shard space (every bucket's shard_size, summed).
  std::size_t total_shard_size() const { return total_shard_size_; }
  /// The largest bucket, in elements.
  std::size_t max_bucket_size() const {
    std::size_t m = 0;
    for (const Bucket& b : buckets_) m = std::max(m, b.size);
    return m;
  }

  /// Tensor i's first element in the flat space.
  std::size_t flat_offset(std::size_t tensor) const {
    const Placement& at = placement(tensor);
    return bucket(at.bucket).offset + at.offset;
  }
  /// Shard `rank` of bucket `b`, in flat coordinates.
  Range shard(std::size_t b, int rank) const {
    const Bucket& k = buckets_[b];
    const std::size_t begin = k.offset + static_cast<std::size_t>(rank) * k.shard_size;
    return {begin, begin + k.shard_size};
  }

  static std::size_t round_up(std::size_t n, std::size_t unit) { return (n + unit - 1) / unit * unit; }

 private:
  static constexpr std::size_t max_total = std::size_t{1} << 62;  ///< elements of the padded flat space

  static void validate(const PlanOptions& o) {
    if (o.world_size < 1)
      detail::fail("tandem: PlanOptions::world_size is " + std::to_string(o.world_size) + "; it must be at least 1");
    if (o.bucket_element_bytes == 0) detail::fail("tandem: PlanOptions::bucket_element_bytes must be positive");
    const auto power_of_two = [](std::size_t n) { return n != 0 && (n & (n - 1)) == 0; };
    if (!power_of_two(o.alignment_elements) || !power_of_two(o.shard_alignment_elements) ||
        o.shard_alignment_elements < o.alignment_elements)
      detail::fail("tandem: PlanOptions::alignment_elements (" + std::to_string(o.alignment_elements) +
                   ") and shard_alignment_elements (" + std::to_string(o.shard_alignment_elements) +
                   ") must be powers of two, the second at least the first");
    // their product, the unit a bucket is padded to, must not wrap
    if (o.shard_alignment_elements > max_numel / static_cast<std::size_t>(o.world_size))
      detail::fail("tandem: PlanOptions: world_size " + std::to_string(o.world_size) + " x shard_alignment_elements " +
                   std::to_string(o.shard_alignment_elements) + " is over 2^48 elements per bucket");
    if (o.bucket_cap_bytes < o.bucket_element_bytes || o.first_bucket_cap_bytes < o.bucket_element_bytes)
      detail::fail("tandem: bucket caps must hold at least one element (bucket_cap_bytes, first_bucket_cap_bytes)");
  }

  PlanOptions options_;
  std::vector<Bucket> buckets_;
  std::vector<Placement> placements_;
  std::size_t total_size_ = 0;
  std::size_t total_shard_size_ = 0;
};

}  // namespace tandem
