// SPDX-License-Identifier: Apache-2.0
// Multi-tensor pack and unpack: one launch moves every tensor of a bucket between the user's scattered
// buffers and the bucket's flat storage, fused with a scale and a dtype cast.
//
// Layout: the bucket is one flat array; tensor k of the bucket sits at tensors[k].offset (16-byte aligned,
// see core/plan.hpp). Work items are chunks of at most `chunk_elements` elements of one tensor (the backend's,
// PackTableLayout; the jagged grid: a tensor gets warps in proportion to its size), listed once at plan time in
// `items`, so a step does no host work beyond the launch, has no kernel-parameter limit, and the tables can live in
// device memory.
// Each item is a cast_segment (kernels/vector.hpp): 16-byte vectors with scalar head and tail, the product with the
// scale rounded before it is accumulated (the rounding rule, kernels/detail/rounding.hpp).
//
//   pack   (user -> bucket): bucket[offset + j] (=|+=) cast<BucketT>(scale * user[j])
//   unpack (bucket -> user): user[j] = cast<UserT>(scale * bucket[offset + j])
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tandem/backend/allocate.hpp"
#include "tandem/backend/launch.hpp"
#include "tandem/core/config.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/plan.hpp"
#include "tandem/core/stream.hpp"
#include "tandem/kernels/vector.hpp"

namespace tandem {

enum class PackDirection { to_bucket, from_bucket };

/// Launches that write more than this many bytes stream their stores past the cache (host backend).
inline constexpr std::size_t streaming_store_bytes = std::size_t{4} << 20;

/// The store hint for a launch that writes `bytes`.
constexpr StoreHint store_hint_for(std::size_t bytes) {
  return bytes >= streaming_store_bytes ? StoreHint::streaming : StoreHint::cached;
}

/// One tensor of a bucket: the user's buffer and where the tensor sits in the bucket.
struct PackTensor {
  void* user = nullptr;
  std::size_t offset = 0;  ///< elements from the bucket's start
  std::size_t numel = 0;
};

/// One work item: elements [begin, begin + count) of bucket tensor `tensor`.
struct PackItem {
  std::uint32_t tensor = 0;
  std::uint32_t count = 0;
  std::uint64_t begin = 0;
};

/// How DataParallel groups buckets into runs, each run packed or unpacked by one launch where a step issues its
/// buckets together (a launch costs 2.5-3.4 us beyond its bytes on an H200, docs/cuda.md).
enum class RunGrouping {
  per_bucket,  ///< a run per bucket
  one,         ///< every bucket in one run
  from_first,  ///< issued from bucket 0 up: runs of 1, run_growth, run_growth^2, ... buckets
  from_last    ///< issued from the last bucket down: the same sizes, counted from the end
};

/// The growth of from_first / from_last runs. The first run issued is one bucket, so the work waiting for it (its
/// collective, or the next forward) starts after one bucket's launch; the k-th later run is run_growth^k buckets.
/// Its launch runs while the work on the (run_growth^k - 1) / (run_growth - 1) buckets issued before it goes on, so
/// that work never waits for a launch as long as a bucket's collective takes run_growth times its pack or longer: a
/// collective moves its bytes over links (NVLink: 450 GB/s each way on an H200) about a tenth as fast as the pack
/// moves them through memory (4.8 TB/s).
inline constexpr std::size_t run_growth = 4;

/// Buckets [0, n) split into runs of consecutive buckets (RunGrouping), and which run holds each bucket.
struct BucketRuns {
  std::vector<Range> runs;          ///< bucket ranges, ascending, covering [0, n)
  std::vector<std::size_t> run_of;  ///< bucket -> index into runs

  BucketRuns() = default;
  TANDEM_COLD BucketRuns(std::size_t n, RunGrouping grouping) {
    std::vector<std::size_t> sizes;  // in issue order
    for (std::size_t left = n, next = 1; left > 0;) {
      const std::size_t size = grouping == RunGrouping::per_bucket ? 1
                               : grouping == RunGrouping::one      ? left
                                                                   : std::min(next, left);
      sizes.push_back(size);
      left -= size;
      next *= run_growth;
    }
    if (grouping == RunGrouping::from_last) std::reverse(sizes.begin(), sizes.end());
    std::size_t at = 0;
    for (std::size_t size : sizes) {
      runs.push_back({at, at + size});
      run_of.insert(run_of.end(), size, runs.size() - 1);
      at += size;
    }
  }
  /// The run that holds bucket b.
  const Range& of(std::size_t b) const { return runs[run_of[b]]; }
};

/// The item tables of one run of buckets (a single bucket, or several consecutive ones: BucketRuns), built once from
/// the plan. Tensor offsets count from the run's first bucket: the run's buckets are contiguous in the flat storage.
/// Both item lists hold the same items; only the order differs, so that a host launch reads memory at ascending
/// addresses (which the hardware prefetches): `reading_bucket` in bucket order (for unpack), `reading_user` with the
/// tensors in layout order, as users usually allocate them (for pack). Chunks of one tensor stay ascending in both.
/// A backend whose launches run their items at once (PackTableLayout::ordered false: CUDA) keeps only
/// `reading_bucket` in its memory (ResidentPackTables). Each bucket's items are contiguous in both lists, so one bucket
/// of the run can be launched alone (ResidentPackTables::slice).
struct PackTable {
  std::vector<PackTensor> tensors;
  std::vector<PackItem> reading_bucket;
  std::vector<PackItem> reading_user;
  /// Bucket j of the run (counted from its first) holds items [bucket_items[j], bucket_items[j + 1]) of
  /// reading_bucket, and the mirrored [size() - bucket_items[j + 1], size() - bucket_items[j]) of reading_user.
  std::vector<std::size_t> bucket_items{0};
  std::size_t size() const { return reading_bucket.size(); }
};

namespace detail {
/// A pack table's item size (PackTableLayout::chunk_elements): a positive multiple of 16 below 2^32.
TANDEM_COLD inline void check_chunk_elements(std::size_t chunk_elements) {
  if (chunk_elements == 0 || chunk_elements % 16 != 0 || chunk_elements > UINT32_MAX)
    fail("tandem: pack chunk_elements is " + std::to_string(chunk_elements) +
         "; it must be a positive multiple of 16 below 2^32");
}
}  // namespace detail

/// Builds the table of the buckets `run` (consecutive); user_pointers[i] is layout tensor i's buffer (param or grad).
/// Items are of at most `chunk_elements` elements: the backend's (pack_table_layout_of<Backend>().chunk_elements).
TANDEM_COLD inline PackTable make_pack_table(const Plan& plan, Range run, const std::vector<void*>& user_pointers,
                                             std::size_t chunk_elements = PackTableLayout{}.chunk_elements) {
  detail::check_chunk_elements(chunk_elements);
  if (run.begin >= run.end || run.end > plan.num_buckets())
    detail::fail("tandem: make_pack_table: buckets [" + std::to_string(run.begin) + ", " + std::to_string(run.end) +
                 ") are not a non-empty range of the plan's " + std::to_string(plan.num_buckets()));
  const std::size_t origin = plan.bucket(run.begin).offset;
  PackTable table;
  for (std::size_t b = run.begin; b < run.end; ++b) {
    const Bucket& bucket = plan.bucket(b);
    for (const std::size_t i : bucket.tensors) {
      const Placement& at = plan.placement(i);
      const auto k = static_cast<std::uint32_t>(table.tensors.size());
      table.tensors.push_back({user_pointers[i], bucket.offset - origin + at.offset, at.numel});
      for (std::size_t begin = 0; begin < at.numel; begin += chunk_elements)
        table.reading_bucket.push_back(
            {k, static_cast<std::uint32_t>(std::min(chunk_elements, at.numel - begin)), begin});
    }
    table.bucket_items.push_back(table.reading_bucket.size());
  }
  // reading_user: the runs of each tensor's chunks, tensors reversed (so each bucket's items stay together).
  const std::vector<PackItem>& items = table.reading_bucket;
  table.reading_user.reserve(items.size());
  for (std::size_t end = items.size(); end > 0;) {
    std::size_t begin = end;
    while (begin > 0 && items[begin - 1].tensor == items[end - 1].tensor) --begin;
    for (std::size_t k = begin; k < end; ++k) table.reading_user.push_back(items[k]);
    end = begin;
  }
  return table;
}

/// Builds bucket `b`'s table alone.
TANDEM_COLD inline PackTable make_pack_table(const Plan& plan, std::size_t b, const std::vector<void*>& user_pointers,
                                             std::size_t chunk_elements = PackTableLayout{}.chunk_elements) {
  return make_pack_table(plan, Range{b, b + 1}, user_pointers, chunk_elements);
}

/// Where a bucket's tables live for launches: in the backend's memory (device memory on CUDA).
struct PackTableView {
  const PackItem* reading_user = nullptr;  ///< reading_bucket itself where the backend keeps one list
  const PackItem* reading_bucket = nullptr;
  const PackTensor* tensors = nullptr;
  std::size_t items = 0;  ///< items of one launch over the bucket (both lists hold this many)
};

/// Every run's PackTable copied once into backend memory (one allocation for the items, one for the tensors),
/// so that a step copies nothing, a launch passes three pointers whatever the tensor count (no kernel-parameter
/// limit), and the launches can be captured in a CUDA graph. Where the backend's launches run their items at once
/// (PackTableLayout::ordered false) only reading_bucket is kept, and each view's reading_user is that same list.
template <class Backend>
class ResidentPackTables {
 public:
  /// Whether reading_user is kept as a list of its own.
  static constexpr bool both_orders = pack_table_layout_of<Backend>().ordered;

  ResidentPackTables() = default;
  TANDEM_COLD ResidentPackTables(const Backend& backend, const std::vector<PackTable>& tables, Stream stream) {
    std::size_t items = 0, tensors = 0;
    for (const PackTable& t : tables) {
      items += (both_orders ? 2 : 1) * t.size();
      tensors += t.tensors.size();
    }
    items_ = detail::allocate_named<PackItem>(backend, items, "the pack tables");
    tensors_ = detail::allocate_named<PackTensor>(backend, tensors, "the pack tables");
    std::size_t i = 0, k = 0;
    for (const PackTable& t : tables) {
      PackTableView v;
      v.items = t.size();
      if constexpr (both_orders) {
        v.reading_user = items_.data() + i;
        backend.copy(items_.data() + i, t.reading_user.data(), t.size() * sizeof(PackItem), stream);
        i += t.size();
      }
      v.reading_bucket = items_.data() + i;
      if constexpr (!both_orders) v.reading_user = v.reading_bucket;
      backend.copy(items_.data() + i, t.reading_bucket.data(), t.size() * sizeof(PackItem), stream);
      i += t.size();
      v.tensors = tensors_.data() + k;
      backend.copy(tensors_.data() + k, t.tensors.data(), t.tensors.size() * sizeof(PackTensor), stream);
      k += t.tensors.size();
      views_.push_back(v);
      bucket_items_.push_back(t.bucket_items);
    }
    backend.synchronize(stream);  // the copies read `tables` (the caller's host memory) when they run: wait for them
  }
  /// Table k: its whole run.
  const PackTableView& operator[](std::size_t k) const { return views_[k]; }
  /// Bucket j (counted from the run's first) of table k alone; its tensor offsets still count from the run's start.
  PackTableView slice(std::size_t k, std::size_t j) const {
    const std::vector<std::size_t>& at = bucket_items_[k];
    PackTableView v = views_[k];
    v.reading_bucket += at[j];
    v.reading_user = both_orders ? v.reading_user + (v.items - at[j + 1]) : v.reading_bucket;
    v.items = at[j + 1] - at[j];
    return v;
  }
  /// The launch over `buckets`, the tables being those of `runs`: a whole run, or one bucket of a run (its tensor
  /// offsets count from the run's first bucket either way).
  PackTableView view(const BucketRuns& runs, Range buckets) const {
    const std::size_t k = runs.run_of[buckets.begin];
    if (buckets == runs.runs[k]) return views_[k];
    if (buckets.size() != 1) detail::fail("tandem: internal error: a pack launch covers a run or one of its buckets");
    return slice(k, buckets.begin - runs.runs[k].begin);
  }
  std::size_t size() const { return views_.size(); }
  std::size_t bytes() const { return items_.bytes() + tensors_.bytes(); }

 private:
  typename Backend::template Buffer<PackItem> items_;
  typename Backend::template Buffer<PackTensor> tensors_;
  std::vector<PackTableView> views_;
  std::vector<std::vector<std::size_t>> bucket_items_;  ///< PackTable::bucket_items of each table
};

/// The bytes ResidentPackTables holds for the tables of every bucket of `plan` in one direction (the parameters', or
/// the gradients'), however the buckets are grouped into runs, with a backend's `layout`: a PackItem (16 bytes) per
/// chunk of each tensor in each list, and a PackTensor (24 bytes) per tensor. Computed from the plan alone, for
/// estimate_memory.
TANDEM_COLD inline std::size_t pack_tables_bytes(const Plan& plan, PackTableLayout layout) {
  detail::check_chunk_elements(layout.chunk_elements);
  std::size_t items = 0, tensors = 0;
  for (std::size_t b = 0; b < plan.num_buckets(); ++b)
    for (const std::size_t i : plan.bucket(b).tensors) {
      items += (plan.placement(i).numel + layout.chunk_elements - 1) / layout.chunk_elements;
      ++tensors;
    }
  return (layout.ordered ? 2 : 1) * items * sizeof(PackItem) + tensors * sizeof(PackTensor);
}

/// The body of a pack or unpack launch over one bucket.
template <class UserT, class BucketT, PackDirection Direction, WriteMode Mode = WriteMode::assign>
struct PackBody {
  const PackItem* items;  ///< PackTable::reading_user for pack, ::reading_bucket for unpack
  const PackTensor* tensors;
  BucketT* bucket;
  float scale;
  StoreHint hint = StoreHint::cached;  ///< streaming for buckets far larger than the cache

  TANDEM_HD void operator()(std::size_t item, unsigned lane, unsigned lanes) const { run(items[item], lane, lanes); }
  /// Lane `lane`'s part of item `it` (read from `items` already).
  TANDEM_HD void run(const PackItem& it, unsigned lane, unsigned lanes) const {
    const PackTensor t = tensors[it.tensor];
    UserT* user = static_cast<UserT*>(t.user) + it.begin;
    BucketT* flat = bucket + t.offset + it.begin;
    if constexpr (Direction == PackDirection::to_bucket) {
      detail::cast_segment<UserT, BucketT, Mode>(user, flat, it.count, scale, lane, lanes, hint);
    } else {
      static_assert(Mode == WriteMode::assign, "unpack overwrites the user's buffers");
      detail::cast_segment<BucketT, UserT, Mode>(flat, user, it.count, scale, lane, lanes, hint);
    }
  }
};

}  // namespace tandem
