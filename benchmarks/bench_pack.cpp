// SPDX-License-Identifier: Apache-2.0
// Host pack and unpack of whole layouts (every bucket, one launch each) against a copy of the same traffic (the
// faster of memcpy and a streaming copy, support.hpp; memcpy's own row shows where it is the slower).
// Layouts: the GPT-2-124M tensor list, 10,000 x 1 KB, 100 x 1 MB; fp32 -> fp32, fp32 -> bf16 and fp32 -> fp16
// buckets, and an fp32 pack that accumulates (a later micro-step's: bucket += gradient).
#include <benchmark/benchmark.h>

#include <vector>

#include "support.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/core/plan.hpp"
#include "tandem/kernels/pack.hpp"

namespace {

template <class UserT, class BucketT>
struct Setup {
  std::vector<std::size_t> sizes;
  tandem::Plan plan;
  bench::Arena<UserT> user;
  tandem::HostBuffer<BucketT> flat;
  std::vector<tandem::PackTable> tables;

  explicit Setup(const std::string& layout)
      : sizes(bench::layout(layout)), plan(sizes, options()), user(sizes), flat(plan.total_size()) {
    for (std::size_t b = 0; b < plan.num_buckets(); ++b)
      tables.push_back(tandem::make_pack_table(plan, b, user.pointers));
    for (std::size_t e = 0; e < flat.size(); ++e) flat.data()[e] = BucketT(0.5f);
  }
  static tandem::PlanOptions options() {
    tandem::PlanOptions o;
    o.alignment_elements = 16 / std::min(sizeof(UserT), sizeof(BucketT));
    o.shard_alignment_elements = 128 / std::min(sizeof(UserT), sizeof(BucketT));
    return o;
  }
  BucketT* bucket(std::size_t b) { return flat.data() + plan.bucket(b).offset; }
};

template <class UserT, class BucketT, tandem::PackDirection Direction,
          tandem::WriteMode Mode = tandem::WriteMode::assign>
void BM_pack(benchmark::State& state, const std::string& layout) {
  Setup<UserT, BucketT> s(layout);
  const tandem::HostBackend backend;
  const std::size_t n = bench::total(s.sizes);
  auto items = [](const tandem::PackTable& t) {
    return Direction == tandem::PackDirection::to_bucket ? t.reading_user.data() : t.reading_bucket.data();
  };
  const std::size_t src = Direction == tandem::PackDirection::to_bucket ? sizeof(UserT) : sizeof(BucketT);
  const std::size_t dst = Direction == tandem::PackDirection::to_bucket ? sizeof(BucketT) : sizeof(UserT);
  // An accumulating pack reads the bucket as well as writing it.
  const std::size_t traffic = n * (src + dst + (Mode == tandem::WriteMode::accumulate ? dst : 0));
  // Against a copy moving the same traffic (half of it read, half written), as bench_optim and bench_cuda do.
  bench::run_against_copy(state, traffic, traffic / 2, [&] {
    for (std::size_t b = 0; b < s.plan.num_buckets(); ++b) {
      const tandem::PackTable& t = s.tables[b];
      const tandem::StoreHint hint = Mode == tandem::WriteMode::assign
                                         ? tandem::store_hint_for(s.plan.bucket(b).size * sizeof(BucketT))
                                         : tandem::StoreHint::cached;
      backend.launch(t.size(), tandem::PackBody<UserT, BucketT, Direction, Mode>{items(t), t.tensors.data(),
                                                                                 s.bucket(b), 1.0f, hint});
    }
  });
  state.counters["buckets"] = static_cast<double>(s.plan.num_buckets());
}

void BM_memcpy(benchmark::State& state, const std::string& layout) {
  const std::size_t bytes = bench::total(bench::layout(layout)) * sizeof(float);
  tandem::HostBuffer<unsigned char> a(bytes), b(bytes);
  std::memset(a.data(), 1, bytes);
  std::memset(b.data(), 2, bytes);
  bench::run_against_copy(state, 2 * bytes, bytes, [&] { std::memcpy(b.data(), a.data(), bytes); });
}

const int registered = [] {
  using tandem::BFloat16;
  using tandem::Float16;
  using tandem::PackDirection;
  using tandem::WriteMode;
  for (const char* name : bench::layout_names) {
    const std::string l = name;
    benchmark::RegisterBenchmark(("memcpy/" + l).c_str(), BM_memcpy, l)->UseRealTime()->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("pack/fp32->fp32/" + l).c_str(), BM_pack<float, float, PackDirection::to_bucket>, l)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("unpack/fp32->fp32/" + l).c_str(), BM_pack<float, float, PackDirection::from_bucket>,
                                 l)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("pack/fp32->bf16/" + l).c_str(), BM_pack<float, BFloat16, PackDirection::to_bucket>,
                                 l)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("pack/fp32->fp16/" + l).c_str(), BM_pack<float, Float16, PackDirection::to_bucket>, l)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("pack+=/fp32->fp32/" + l).c_str(),
                                 BM_pack<float, float, PackDirection::to_bucket, WriteMode::accumulate>, l)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  return 0;
}();

}  // namespace

BENCHMARK_MAIN();
