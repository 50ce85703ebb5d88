// SPDX-License-Identifier: Apache-2.0
// The CUDA pack/unpack launches, emulated exactly on the host. For each bucket (or run of buckets) the CUDA backend
// launches PackBody once, with launch_shape(items) blocks of block_threads threads (backend/launch.hpp), a warp per
// item (tests/support/cuda_launch.hpp emulates it). The item tables it reads are the ResidentPackTables copied into
// backend memory at plan time. Here the same function computes the shape, the same tables are built and copied (into
// host memory), and every (block, warp, item, lane) of the launch runs the real body, for the GPT-2-124M tensor list,
// 10,000 tensors of 1 KB, and odd sizes at misaligned user pointers; outputs are poisoned first and every element is
// checked against a plain loop.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "../benchmarks/scaling/scaling_model.hpp"
#include "support/cuda_launch.hpp"
#include "tandem/backend/host.hpp"
#include "tandem/backend/launch.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/core/plan.hpp"
#include "tandem/kernels/pack.hpp"

namespace {

using tandem::BFloat16;
using tandem::PackDirection;

using test::emulate_cuda_launch;

template <class T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

// A kernel argument that does not grow with the tensor count: no kernel-parameter limit can apply.
static_assert(sizeof(tandem::PackBody<float, float, PackDirection::to_bucket>) <= 48);
static_assert(sizeof(tandem::PackBody<BFloat16, float, PackDirection::to_bucket, tandem::WriteMode::accumulate>) <= 48);

// The host backend with CudaBackend's pack tables (512-element items, one list): the tables the emulated launches
// read are the device's.
struct CudaTables : tandem::HostBackend {
  static constexpr tandem::PackTableLayout pack_table_layout = tandem::cuda_pack_table_layout;
};
constexpr std::size_t cuda_chunk = tandem::cuda_pack_table_layout.chunk_elements;
static_assert(!tandem::ResidentPackTables<CudaTables>::both_orders &&
              tandem::ResidentPackTables<tandem::HostBackend>::both_orders);

// The item table of one bucket covers each tensor exactly once, in chunks of at most `chunk` elements:
// a tensor gets ceil(numel / chunk) items, in proportion to its bytes.
void check_items(const tandem::PackTable& t, std::size_t chunk) {
  for (const auto* items : {&t.reading_user, &t.reading_bucket}) {
    std::vector<std::size_t> covered(t.tensors.size(), 0), count(t.tensors.size(), 0);
    for (const tandem::PackItem& it : *items) {
      REQUIRE(it.tensor < t.tensors.size());
      REQUIRE(it.begin == covered[it.tensor]);  // ascending, no gap, no overlap
      REQUIRE(it.count > 0);
      REQUIRE(it.count <= chunk);
      covered[it.tensor] += it.count;
      ++count[it.tensor];
    }
    for (std::size_t k = 0; k < t.tensors.size(); ++k) {
      REQUIRE(covered[k] == t.tensors[k].numel);
      REQUIRE(count[k] == (t.tensors[k].numel + chunk - 1) / chunk);
    }
  }
}

// Packs every bucket of `sizes` (user tensors at `misalign` elements off 16-byte alignment) and unpacks it back,
// each in one emulated CUDA launch per bucket, checking every element.
template <class UserT, class BucketT>
void check_layout(const std::vector<std::size_t>& sizes, const std::vector<std::size_t>& misalign, int world) {
  tandem::PlanOptions o;  // the default caps: a 1 MB first bucket, 25 MB after
  o.world_size = world;
  o.bucket_element_bytes = 4;
  o.alignment_elements = 16 / std::min(sizeof(UserT), sizeof(BucketT));
  o.shard_alignment_elements = 128 / std::min(sizeof(UserT), sizeof(BucketT));
  const tandem::Plan plan(sizes, o);
  const CudaTables backend;
  const float scale = 0.5f;
  for (std::size_t b = 0; b < plan.num_buckets(); ++b) {
    CAPTURE(b);
    const tandem::Bucket& bucket = plan.bucket(b);
    // This bucket's user tensors, in one arena, each at its misalignment (values exact in bf16 and fp16).
    std::vector<std::size_t> at(sizes.size(), 0);
    std::size_t arena_elems = 0;
    for (std::size_t i : bucket.tensors) {
      arena_elems = (arena_elems + 16) / 16 * 16 + misalign[i];
      at[i] = arena_elems;
      arena_elems += sizes[i];
    }
    tandem::HostBuffer<UserT> arena(arena_elems + 16);
    std::vector<void*> pointers(sizes.size(), nullptr);
    for (std::size_t i : bucket.tensors) {
      pointers[i] = arena.data() + at[i];
      for (std::size_t e = 0; e < sizes[i]; ++e)
        arena.data()[at[i] + e] = UserT(static_cast<float>(static_cast<int>((e * 31 + i * 7) % 255) - 127) / 64.0f);
    }
    const tandem::PackTable table = tandem::make_pack_table(plan, b, pointers, cuda_chunk);
    check_items(table, cuda_chunk);
    const tandem::ResidentPackTables<CudaTables> resident(backend, {table}, {});
    const tandem::PackTableView& t = resident[0];
    REQUIRE(t.items == table.size());
    REQUIRE(t.reading_user == t.reading_bucket);  // one list, both directions
    REQUIRE(resident.bytes() ==
            table.size() * sizeof(tandem::PackItem) + table.tensors.size() * sizeof(tandem::PackTensor));

    // pack: one launch; the bucket is poisoned first, gaps and padding must stay poisoned.
    tandem::HostBuffer<BucketT> flat(bucket.size);
    const BucketT poison = BucketT(std::nanf(""));
    std::fill(flat.data(), flat.data() + bucket.size, poison);
    emulate_cuda_launch(t.items, tandem::PackBody<UserT, BucketT, PackDirection::to_bucket>{t.reading_user, t.tensors,
                                                                                            flat.data(), scale});
    std::vector<char> covered(bucket.size, 0);
    for (std::size_t i : bucket.tensors) {
      const std::size_t off = plan.placement(i).offset;
      for (std::size_t e = 0; e < sizes[i]; ++e) {
        const BucketT want = BucketT(scale * static_cast<float>(arena.data()[at[i] + e]));
        if (!same_bits(flat.data()[off + e], want)) FAIL("pack: tensor " << i << " element " << e);
        covered[off + e] = 1;
      }
    }
    for (std::size_t e = 0; e < bucket.size; ++e)
      if (!covered[e] && !same_bits(flat.data()[e], poison)) FAIL("pack wrote outside the tensors at " << e);

    // unpack: one launch into poisoned user buffers (the arena's gaps must stay poisoned too).
    const UserT user_poison = UserT(std::nanf(""));
    std::fill(arena.data(), arena.data() + arena.size(), user_poison);
    emulate_cuda_launch(t.items, tandem::PackBody<UserT, BucketT, PackDirection::from_bucket>{
                                     t.reading_bucket, t.tensors, flat.data(), 1.0f});
    std::vector<char> written(arena.size(), 0);
    for (std::size_t i : bucket.tensors) {
      const std::size_t off = plan.placement(i).offset;
      for (std::size_t e = 0; e < sizes[i]; ++e) {
        const UserT want = UserT(static_cast<float>(flat.data()[off + e]));
        if (!same_bits(arena.data()[at[i] + e], want)) FAIL("unpack: tensor " << i << " element " << e);
        written[at[i] + e] = 1;
      }
    }
    for (std::size_t e = 0; e < arena.size(); ++e)
      if (!written[e] && !same_bits(arena.data()[e], user_poison)) FAIL("unpack wrote outside the tensors at " << e);
  }
}

std::vector<std::size_t> gpt2_sizes() {
  std::vector<std::size_t> sizes;
  for (const auto& t : tandem::scaling::load_tensor_list(TANDEM_TEST_DATA_DIR "/gpt2_124m.tsv", "gpt2").tensors)
    sizes.push_back(t.numel);
  return sizes;
}

}  // namespace

TEST_CASE("emulated CUDA launches: the GPT-2-124M tensor list, fp32, world size 4") {
  const std::vector<std::size_t> sizes = gpt2_sizes();
  REQUIRE(sizes.size() == 148);
  check_layout<float, float>(sizes, std::vector<std::size_t>(sizes.size(), 0), 4);
}

TEST_CASE("emulated CUDA launches: 10,000 tensors of 1 KB, fp32 and bf16 into fp32 buckets") {
  const std::vector<std::size_t> sizes(10000, 256);
  check_layout<float, float>(sizes, std::vector<std::size_t>(sizes.size(), 0), 2);
  check_layout<BFloat16, float>(sizes, std::vector<std::size_t>(sizes.size(), 0), 3);
}

TEST_CASE("emulated CUDA launches: odd sizes at misaligned user pointers, every dtype pair") {
  std::mt19937 rng(2024);
  for (int trial = 0; trial < 12; ++trial) {
    CAPTURE(trial);
    std::vector<std::size_t> sizes, misalign;
    const int n = std::uniform_int_distribution<int>(1, 300)(rng);
    for (int i = 0; i < n; ++i) {
      const int kind = std::uniform_int_distribution<int>(0, 9)(rng);
      sizes.push_back(kind == 0   ? 0
                      : kind == 1 ? std::uniform_int_distribution<std::size_t>(1, 7)(rng)
                      : kind == 2 ? std::uniform_int_distribution<std::size_t>(4095, 70000)(rng)
                                  : std::uniform_int_distribution<std::size_t>(8, 3000)(rng));
      misalign.push_back(std::uniform_int_distribution<std::size_t>(0, 7)(rng));
    }
    const int world = std::uniform_int_distribution<int>(1, 5)(rng);
    check_layout<float, float>(sizes, misalign, world);
    check_layout<BFloat16, float>(sizes, misalign, world);
    check_layout<tandem::Float16, float>(sizes, misalign, world);
    check_layout<float, BFloat16>(sizes, misalign, world);
    check_layout<BFloat16, BFloat16>(sizes, misalign, world);
  }
}

TEST_CASE("bucket runs: the first run issued is one bucket, each later one run_growth times the one before") {
  using tandem::RunGrouping;
  for (std::size_t n = 1; n <= 90; ++n) {
    CAPTURE(n);
    for (const RunGrouping g :
         {RunGrouping::per_bucket, RunGrouping::one, RunGrouping::from_first, RunGrouping::from_last}) {
      CAPTURE(static_cast<int>(g));
      const tandem::BucketRuns runs(n, g);
      // the runs cover [0, n) in order, and run_of names the run of each bucket
      std::size_t at = 0;
      for (std::size_t k = 0; k < runs.runs.size(); ++k) {
        REQUIRE(runs.runs[k].begin == at);
        REQUIRE(runs.runs[k].end > at);
        for (std::size_t b = runs.runs[k].begin; b < runs.runs[k].end; ++b) REQUIRE(runs.run_of[b] == k);
        at = runs.runs[k].end;
      }
      REQUIRE(at == n);
      REQUIRE(runs.run_of.size() == n);
      // the sizes in the order a step issues the buckets: 1, 4, 16, ... (the last one what is left)
      std::vector<std::size_t> issued;
      for (const tandem::Range& r : runs.runs) issued.push_back(r.size());
      if (g == RunGrouping::from_last) std::reverse(issued.begin(), issued.end());
      std::vector<std::size_t> want;
      if (g == RunGrouping::per_bucket) want.assign(n, 1);
      if (g == RunGrouping::one) want = {n};
      if (g == RunGrouping::from_first || g == RunGrouping::from_last)
        for (std::size_t left = n, size = 1; left > 0; size *= tandem::run_growth) {
          want.push_back(std::min(size, left));
          left -= want.back();
        }
      REQUIRE(issued == want);
    }
  }
  CHECK(tandem::BucketRuns(18, RunGrouping::from_first).runs.size() == 3);  // GPT-2-124M's 18 buckets: 1 + 4 + 13
}

namespace {

// Random layouts of many buckets; each run's table, launched whole and bucket by bucket, against a plain loop over
// the plan. Outputs are poisoned: a launch writes exactly its buckets' tensors. The tables are Backend's
// (pack_table_layout_of): the host's two lists of 1024-element items, or CUDA's one list of 512.
template <class Backend>
void check_runs() {
  constexpr std::size_t chunk = tandem::pack_table_layout_of<Backend>().chunk_elements;
  std::mt19937 rng(77);
  for (int trial = 0; trial < 6; ++trial) {
    CAPTURE(trial);
    std::vector<std::size_t> sizes;
    const int n = std::uniform_int_distribution<int>(1, 120)(rng);
    for (int i = 0; i < n; ++i) sizes.push_back(std::uniform_int_distribution<std::size_t>(0, 5000)(rng));
    tandem::PlanOptions o;
    o.world_size = std::uniform_int_distribution<int>(1, 4)(rng);
    o.bucket_element_bytes = 4;
    o.bucket_cap_bytes = 16384;
    o.first_bucket_cap_bytes = 4096;
    o.alignment_elements = 4;
    o.shard_alignment_elements = 32;
    const tandem::Plan plan(sizes, o);
    std::vector<std::vector<float>> user(sizes.size());
    std::vector<void*> pointers;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      for (std::size_t e = 0; e < sizes[i]; ++e)
        user[i].push_back(std::uniform_real_distribution<float>(-2.0f, 2.0f)(rng));
      pointers.push_back(user[i].data());
    }
    const Backend backend;
    const float poison = std::nanf("");
    for (const tandem::RunGrouping g : {tandem::RunGrouping::from_first, tandem::RunGrouping::from_last}) {
      const tandem::BucketRuns runs(plan.num_buckets(), g);
      std::vector<tandem::PackTable> tables;
      for (const tandem::Range& run : runs.runs) {
        tables.push_back(tandem::make_pack_table(plan, run, pointers, chunk));
        check_items(tables.back(), chunk);
      }
      const tandem::ResidentPackTables<Backend> resident(backend, tables, {});
      for (std::size_t k = 0; k < runs.runs.size(); ++k) {
        const tandem::Range run = runs.runs[k];
        const std::size_t origin = plan.bucket(run.begin).offset;
        const std::size_t span = plan.bucket(run.end - 1).offset + plan.bucket(run.end - 1).size - origin;
        // the buckets of [first, last) packed into a poisoned copy of the run's flat range, checked against the plan
        auto check_pack = [&](const tandem::PackTableView& t, std::size_t first, std::size_t last) {
          std::vector<float> flat(span, poison);
          emulate_cuda_launch(t.items, tandem::PackBody<float, float, PackDirection::to_bucket>{
                                           t.reading_user, t.tensors, flat.data(), 1.0f});
          std::vector<char> mine(span, 0);
          for (std::size_t b = first; b < last; ++b)
            for (std::size_t i : plan.bucket(b).tensors) {
              const std::size_t off = plan.bucket(b).offset - origin + plan.placement(i).offset;
              for (std::size_t e = 0; e < sizes[i]; ++e) {
                if (!same_bits(flat[off + e], user[i][e])) FAIL("pack: bucket " << b << " tensor " << i);
                mine[off + e] = 1;
              }
            }
          for (std::size_t e = 0; e < span; ++e)
            if (!mine[e] && !same_bits(flat[e], poison))
              FAIL("pack wrote outside buckets [" << first << ", " << last << ")");
          // and back: unpack into poisoned user tensors
          std::vector<std::vector<float>> back(sizes.size());
          std::vector<void*> back_pointers;
          for (std::size_t i = 0; i < sizes.size(); ++i) back[i].assign(sizes[i], poison);
          std::vector<tandem::PackTensor> tensors(t.tensors, t.tensors + tables[k].tensors.size());
          for (tandem::PackTensor& pt : tensors)  // the same table, pointing at `back`
            for (std::size_t i = 0; i < sizes.size(); ++i)
              if (pt.user == user[i].data()) pt.user = back[i].data();
          emulate_cuda_launch(t.items, tandem::PackBody<float, float, PackDirection::from_bucket>{
                                           t.reading_bucket, tensors.data(), flat.data(), 1.0f});
          for (std::size_t i = 0; i < sizes.size(); ++i) {
            const bool in = plan.placement(i).bucket >= first && plan.placement(i).bucket < last;
            for (std::size_t e = 0; e < sizes[i]; ++e)
              if (!same_bits(back[i][e], in ? user[i][e] : poison)) FAIL("unpack: tensor " << i << " element " << e);
          }
        };
        check_pack(resident[k], run.begin, run.end);
        for (std::size_t b = run.begin; b < run.end; ++b) check_pack(resident.slice(k, b - run.begin), b, b + 1);
      }
    }
  }
}

}  // namespace

TEST_CASE("a run's table packs and unpacks its buckets in one launch, and any one of them alone (a slice)") {
  SUBCASE("the host's tables: two lists of 1024-element items") { check_runs<tandem::HostBackend>(); }
  SUBCASE("CUDA's tables: one list of 512-element items") { check_runs<CudaTables>(); }
}
