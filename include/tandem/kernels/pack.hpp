// SPDX-License-Identifier: Apache-2.0
// Multi-tensor pack and unpack: one launch moves every tensor of a bucket between the user's scattered
// buffers and the bucket's flat storage, fused with a scale and a dtype cast.
//
// Layout: the bucket is one flat array; tensor k of the bucket sits at tensors[k].offset (16-byte aligned,
// see core/plan.hpp). Work items are chunks of at most `chunk_elements` elements of one tensor (the jagged
// grid: a tensor gets blocks in proportion to its size), listed once at plan time in `items`, so a step does
// no host work beyond the launch, has no kernel-parameter limit, and the tables can live in device memory.
// Each item is a cast_segment (kernels/vector.hpp): 16-byte vectors with scalar head and tail, the product with the
// scale rounded before it is accumulated (the rounding rule, kernels/detail/rounding.hpp).
//
//   pack   (user -> bucket): bucket[offset + j] (=|+=) cast<BucketT>(scale * user[j])
//   unpack (bucket -> user): user[j] = cast<UserT>(scale * bucket[offset + j])
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "tandem/backend/allocate.hpp"
#include "tandem/core/config.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/plan.hpp"
#include "tandem/core/stream.hpp"
#include "tandem/kernels/vector.hpp"

namespace tandem {

/// Elements per pack work item: 16 KiB of fp32, a multiple of every vector group.
inline constexpr std::size_t pack_chunk_elements = 1024;

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

/// The item tables of one bucket, built once from the plan. Both item lists hold the same items; only the
/// order differs, so that a host launch reads memory at ascending addresses (which the hardware prefetches):
/// `reading_bucket` in bucket order (for unpack), `reading_user` with the tensors in layout order, as users
/// usually allocate them (for pack). Chunks of one tensor stay ascending in both. On CUDA either will do.
struct PackTable {
  std::vector<PackTensor> tensors;
  std::vector<PackItem> reading_bucket;
  std::vector<PackItem> reading_user;
  std::size_t size() const { return reading_bucket.size(); }
};

/// Builds bucket `b`'s table; user_pointers[i] is layout tensor i's buffer (param or grad).
TANDEM_COLD inline PackTable make_pack_table(const Plan& plan, std::size_t b, const std::vector<void*>& user_pointers,
                                             std::size_t chunk_elements = pack_chunk_elements) {
  if (chunk_elements == 0 || chunk_elements % 16 != 0 || chunk_elements > UINT32_MAX)
    detail::fail("tandem: pack chunk_elements must be a positive multiple of 16 below 2^32");
  const Bucket& bucket = plan.bucket(b);
  PackTable table;
  table.tensors.reserve(bucket.tensors.size());
  for (std::size_t k = 0; k < bucket.tensors.size(); ++k) {
    const std::size_t i = bucket.tensors[k];
    const Placement& at = plan.placement(i);
    table.tensors.push_back({user_pointers[i], at.offset, at.numel});
    const std::size_t numel = at.numel;
    for (std::size_t begin = 0; begin < numel; begin += chunk_elements)
      table.reading_bucket.push_back(
          {static_cast<std::uint32_t>(k), static_cast<std::uint32_t>(std::min(chunk_elements, numel - begin)), begin});
  }
  // reading_user: the runs of each tensor's chunks, tensors reversed.
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

/// Where a bucket's tables live for launches: in the backend's memory (device memory on CUDA).
struct PackTableView {
  const PackItem* reading_user = nullptr;
  const PackItem* reading_bucket = nullptr;
  const PackTensor* tensors = nullptr;
  std::size_t items = 0;  ///< items of one launch over the bucket (both lists hold this many)
};

/// Every bucket's PackTable copied once into backend memory (one allocation for the items, one for the tensors),
/// so that a step copies nothing, a launch passes three pointers whatever the tensor count (no kernel-parameter
/// limit), and the launches can be captured in a CUDA graph.
template <class Backend>
class ResidentPackTables {
 public:
  ResidentPackTables() = default;
  TANDEM_COLD ResidentPackTables(const Backend& backend, const std::vector<PackTable>& tables, Stream stream) {
    std::size_t items = 0, tensors = 0;
    for (const PackTable& t : tables) {
      items += 2 * t.size();
      tensors += t.tensors.size();
    }
    items_ = detail::allocate_named<PackItem>(backend, items, "the pack tables");
    tensors_ = detail::allocate_named<PackTensor>(backend, tensors, "the pack tables");
    std::size_t i = 0, k = 0;
    for (const PackTable& t : tables) {
      PackTableView v;
      v.items = t.size();
      v.reading_user = items_.data() + i;
      backend.copy(items_.data() + i, t.reading_user.data(), t.size() * sizeof(PackItem), stream);
      i += t.size();
      v.reading_bucket = items_.data() + i;
      backend.copy(items_.data() + i, t.reading_bucket.data(), t.size() * sizeof(PackItem), stream);
      i += t.size();
      v.tensors = tensors_.data() + k;
      backend.copy(tensors_.data() + k, t.tensors.data(), t.tensors.size() * sizeof(PackTensor), stream);
      k += t.tensors.size();
      views_.push_back(v);
    }
    backend.synchronize(stream);  // the copies read `tables` (the caller's host memory) when they run: wait for them
  }
  const PackTableView& operator[](std::size_t b) const { return views_[b]; }
  std::size_t size() const { return views_.size(); }
  std::size_t bytes() const { return items_.bytes() + tensors_.bytes(); }

 private:
  typename Backend::template Buffer<PackItem> items_;
  typename Backend::template Buffer<PackTensor> tensors_;
  std::vector<PackTableView> views_;
};

/// The body of a pack or unpack launch over one bucket.
template <class UserT, class BucketT, PackDirection Direction, WriteMode Mode = WriteMode::assign>
struct PackBody {
  const PackItem* items;  ///< PackTable::reading_user for pack, ::reading_bucket for unpack
  const PackTensor* tensors;
  BucketT* bucket;
  float scale;
  StoreHint hint = StoreHint::cached;  ///< streaming for buckets far larger than the cache

  TANDEM_HD void operator()(std::size_t item, unsigned lane, unsigned lanes) const {
    const PackItem it = items[item];
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
