// SPDX-License-Identifier: Apache-2.0
// DataParallel::step() per policy at world sizes 1-4 (ranks are threads of one process), on a GPT-2-small-shaped
// layout scaled to this machine (12 layers, width 256, vocab 8192, context 512: 11.7 M fp32 parameters, AdamW,
// copy mode), next to its memory-traffic floor: the bytes every rank's step moves (the model below) divided by
// the aggregate copy bandwidth (the faster of memcpy and a streaming copy) of min(world, cores) threads, each copying
// as many bytes as a rank's step reads (so that the copy and the step meet the same caches: a large L3 holds a small
// step's buffers), measured right after the case. x_floor = measured time / floor time (1.0 would be a step that only
// streams memory at copy speed).
//
// Traffic per rank and step (Ψ parameters, F flat elements, S = F / N; fp32 and AdamW: 28 bytes per updated
// element; the LocalGroup reduction reads N slices and writes N results per element it reduces):
//   Replicated        pack 8Ψ + all-reduce 8F + update 28F + unpack 8Ψ                   = 16Ψ + 36F
//   OptimizerSharded  pack 8Ψ + reduce-scatter 4F + 4S + update 28S + all-gather 8(F - S) + unpack 8Ψ
//   GradientSharded   the same (the reduce-scatter writes the shard accumulator)
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "support.hpp"
#include "tandem/tandem.hpp"

namespace {

std::vector<std::size_t> gpt2_scaled() {
  const std::size_t width = 256, vocab = 8192, context = 512, layers = 12;
  std::vector<std::size_t> sizes = {vocab * width, context * width};
  for (std::size_t l = 0; l < layers; ++l) {
    const std::size_t block[] = {width, width, width * 3 * width, 3 * width, width * width,     width,
                                 width, width, width * 4 * width, 4 * width, 4 * width * width, width};
    sizes.insert(sizes.end(), std::begin(block), std::end(block));
  }
  sizes.push_back(width);
  sizes.push_back(width);
  return sizes;
}

template <class Policy>
double traffic_bytes(double psi, double f, double n) {
  const double s = f / n;
  if constexpr (std::is_same_v<Policy, tandem::Replicated>) return 16 * psi + 36 * f;
  return 16 * psi + 4 * f + 4 * s + 28 * s + 8 * (f - s);
}

template <class Policy>
void BM_step(benchmark::State& state) {
  const int world = static_cast<int>(state.range(0));
  const std::vector<std::size_t> sizes = gpt2_scaled();
  const auto iterations = static_cast<std::int64_t>(state.max_iterations);
  double seconds = 0, flat = 0;
  tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
    std::vector<std::vector<float>> params, grads;
    std::vector<tandem::TensorRef> refs;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      params.emplace_back(sizes[i], 0.01f);
      grads.emplace_back(sizes[i], 1e-3f);
      refs.push_back({"t" + std::to_string(i), params.back().data(), grads.back().data(), sizes[i]});
    }
    tandem::DataParallel<Policy, tandem::AdamW> dp(comm, refs);
    dp.step();  // warm up: first touch of every buffer
    comm.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    for (std::int64_t i = 0; i < iterations; ++i) dp.step();
    comm.barrier();
    if (comm.rank() == 0) {
      seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      flat = static_cast<double>(dp.plan().total_size());
    }
  });
  for (auto _ : state) state.SetIterationTime(seconds / static_cast<double>(iterations));
  const double psi = static_cast<double>(bench::total(sizes));
  const double traffic = traffic_bytes<Policy>(psi, flat, world) * world;
  const int threads = std::min<int>(world, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  const auto per_thread = static_cast<std::size_t>(traffic / world / 2);  // a rank's reads (half its traffic)
  const double floor = traffic / bench::aggregate_copy_rate(threads, per_thread);
  const double per_step = seconds / static_cast<double>(iterations);
  state.counters["floor_ms"] = floor * 1e3;
  state.counters["x_floor"] = per_step / floor;
  state.counters["params_M"] = psi / 1e6;
  state.SetBytesProcessed(static_cast<std::int64_t>(traffic * static_cast<double>(state.iterations())));
}

void worlds(benchmark::internal::Benchmark* b) {
  b->DenseRange(1, 4)->ArgName("ranks")->UseManualTime()->MinTime(1.0)->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK(BM_step<tandem::Replicated>)->Name("step/Replicated")->Apply(worlds);
BENCHMARK(BM_step<tandem::OptimizerSharded>)->Name("step/OptimizerSharded")->Apply(worlds);
BENCHMARK(BM_step<tandem::GradientSharded>)->Name("step/GradientSharded")->Apply(worlds);

BENCHMARK_MAIN();
