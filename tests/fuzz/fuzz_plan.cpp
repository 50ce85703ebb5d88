// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: the planner on arbitrary tensor sizes and options. Bad options must be rejected with
// tandem::error; every accepted plan must satisfy the invariants (every element placed once, alignment,
// padding, shards tiling each bucket); a violation aborts.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "tandem/core/plan.hpp"

namespace {

struct Input {
  const std::uint8_t* data;
  std::size_t size;
  template <class T>
  T take() {
    T v{};
    const std::size_t n = size < sizeof(T) ? size : sizeof(T);
    std::memcpy(&v, data, n);
    data += n;
    size -= n;
    return v;
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in{data, size};
  tandem::PlanOptions o;
  o.world_size = static_cast<int>(in.take<std::uint8_t>() % 17) - 1;  // -1 .. 15: invalid ones included
  o.bucket_element_bytes = in.take<std::uint8_t>() % 9;
  o.alignment_elements = in.take<std::uint8_t>() % 9;
  o.shard_alignment_elements = in.take<std::uint8_t>() % 65;
  o.bucket_cap_bytes = in.take<std::uint16_t>();
  o.first_bucket_cap_bytes = in.take<std::uint16_t>();
  std::vector<std::size_t> sizes;
  while (in.size > 0 && sizes.size() < 64) sizes.push_back(in.take<std::uint16_t>() % 5000);
  tandem::Plan plan;
  try {
    plan = tandem::Plan(sizes, o);
  } catch (const tandem::error&) {
    return 0;  // rejected cleanly
  }
  const std::size_t world = static_cast<std::size_t>(o.world_size);
  std::vector<std::uint8_t> owner(plan.total_size(), 0);
  std::size_t offset = 0;
  for (const tandem::Bucket& b : plan.buckets()) {
    if (b.offset != offset || b.size % (world * o.shard_alignment_elements) != 0 || b.used > b.size ||
        b.shard_size * world != b.size)
      std::abort();
    offset += b.size;
  }
  if (offset != plan.total_size()) std::abort();
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const tandem::Placement& at = plan.placement(i);
    const tandem::Bucket& b = plan.bucket(at.bucket);
    if (at.numel != sizes[i] || at.offset + at.numel > b.used) std::abort();
    if (at.numel != 0 && at.offset % o.alignment_elements != 0) std::abort();
    for (std::size_t e = 0; e < at.numel; ++e)
      if (owner[b.offset + at.offset + e]++ != 0) std::abort();  // two tensors on one element
  }
  return 0;
}
