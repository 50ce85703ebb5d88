// SPDX-License-Identifier: Apache-2.0
// LocalGroup collectives, 64 KB - 64 MB per rank, world sizes 2 and 4, fp32: time per collective, algorithm
// bandwidth (bytes / time) and bus bandwidth as nccl-tests defines them (all-reduce: algbw x 2(n-1)/n;
// reduce-scatter and all-gather: algbw x (n-1)/n, with bytes = the full buffer of size x count).
//
// x_floor compares with memory: all ranks together must read and write the data (all-reduce: every send read
// and every recv written, 2 n bytes; reduce-scatter: n reads + 1 write; all-gather, out of place as here: every
// block read and every recv written, own block included, 2 n), and x_floor = time / (that traffic / the aggregate
// copy traffic rate of min(n, cores) threads, each copying a buffer of the case's size, measured right after it: the
// faster of memcpy and a streaming copy, support.hpp).
//
// Google Benchmark runs each case with a fixed iteration count per call (state.max_iterations), so every rank
// runs exactly that many collectives inside one LocalGroup::run; rank 0 times them and the per-iteration time is
// reported as manual time.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

#include "support.hpp"
#include "tandem/comm/local_group.hpp"

namespace {

enum class Kind { all_reduce, reduce_scatter, all_gather };

void BM_collective(benchmark::State& state, Kind kind) {
  const std::size_t bytes = static_cast<std::size_t>(state.range(0));
  const int world = static_cast<int>(state.range(1));
  const std::size_t count = bytes / sizeof(float);  // elements of the full buffer
  const auto iterations = static_cast<std::int64_t>(state.max_iterations);
  double seconds = 0;
  tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
    std::vector<float> send(count, 1.0f + static_cast<float>(comm.rank())), recv(count);
    const std::size_t block = count / static_cast<std::size_t>(world);
    auto once = [&] {
      switch (kind) {
        case Kind::all_reduce:
          comm.all_reduce(send.data(), recv.data(), count, tandem::DType::fp32, tandem::ReduceOp::sum);
          break;
        case Kind::reduce_scatter:
          comm.reduce_scatter(send.data(), recv.data(), block, tandem::DType::fp32, tandem::ReduceOp::sum);
          break;
        case Kind::all_gather:
          comm.all_gather(send.data(), recv.data(), block, tandem::DType::fp32);
          break;
      }
    };
    once();  // warm up: first touch of the pages
    comm.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    for (std::int64_t i = 0; i < iterations; ++i) once();
    if (comm.rank() == 0) seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  });
  for (auto _ : state) state.SetIterationTime(seconds / static_cast<double>(iterations));
  const double n = world;
  const double factor = kind == Kind::all_reduce ? 2.0 * (n - 1) / n : (n - 1) / n;
  const double per_op = seconds / static_cast<double>(iterations);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(bytes));
  state.counters["algbw_GBps"] = static_cast<double>(bytes) / per_op / 1e9;
  state.counters["busbw_GBps"] = static_cast<double>(bytes) / per_op / 1e9 * factor;
  const double b = static_cast<double>(bytes);
  const double traffic = kind == Kind::reduce_scatter ? (n + 1) * b : 2 * n * b;  // all-reduce, all-gather: 2n
  const int threads = std::min<int>(world, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  state.counters["x_floor"] = per_op / (traffic / bench::aggregate_copy_rate(threads, bytes));
}

void sizes(benchmark::internal::Benchmark* b) {
  for (int world : {2, 4})
    for (std::int64_t bytes = 64 << 10; bytes <= (64 << 20); bytes *= 4) b->Args({bytes, world});
  b->ArgNames({"bytes", "ranks"})->UseManualTime()->Unit(benchmark::kMicrosecond);
}

}  // namespace

BENCHMARK_CAPTURE(BM_collective, all_reduce, Kind::all_reduce)->Apply(sizes);
BENCHMARK_CAPTURE(BM_collective, reduce_scatter, Kind::reduce_scatter)->Apply(sizes);
BENCHMARK_CAPTURE(BM_collective, all_gather, Kind::all_gather)->Apply(sizes);

BENCHMARK_MAIN();
