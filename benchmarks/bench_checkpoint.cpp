// SPDX-License-Identifier: Apache-2.0
// Sharded checkpoints: DataParallel::save_checkpoint and load_checkpoint of a layout (the GPT-2-124M tensor list, or
// 10,000 x 1 KB) at 1 and 2 ranks (threads), OptimizerSharded, AdamW, fp32 (12 bytes per element: parameters and two
// state arrays), against plain POSIX I/O of the same bytes to the same directory in the same run:
//   save  x_plain = (the same files written with write() + fsync over files of the same size, a thread per rank) /
//                   save time (a save replaces the previous checkpoint: it removes the files only that one named)
//   load  x_plain = (the same files read with pread(), a thread per rank) / load time
// (at the saving plan a rank of a load reads its own file, and gathers the parameters it keeps beyond its shard from
// the other ranks)
// (1.0: as fast as plain I/O of the checkpoint's bytes; the goal is >= 0.7), each the best of 3 rounds that alternate
// the two. Loading follows a save, so both read the files from the page cache, as a resume on the same machine would.
// The save's host memory beyond what training holds is counted too: peak_host_MB, the peak of the bytes it allocates
// through operator new (its streaming chunk, headers, the manifest) over the run of one save, beside model_MB, the
// state it writes.
//
// The files go to $TANDEM_BENCH_DIR (default: the system's temporary directory): point it at the disk to measure.
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "support.hpp"
#include "tandem/tandem.hpp"

// Bytes allocated through operator new, now and at their peak since the last reset (every thread's).
namespace {
std::atomic<std::size_t> allocated{0}, peak{0};
}  // namespace

// Not inlined: where GCC inlines them into the standard containers' code, it sees `free` of a pointer 16 bytes before
// what `operator new` returned and warns (-Warray-bounds, -Wmismatched-new-delete), wrongly.
__attribute__((noinline)) void* operator new(std::size_t n) {
  void* p = std::malloc(n + 16);
  if (p == nullptr) throw std::bad_alloc();
  *static_cast<std::size_t*>(p) = n;
  const std::size_t now = allocated.fetch_add(n) + n;
  std::size_t seen = peak.load();
  while (now > seen && !peak.compare_exchange_weak(seen, now)) {
  }
  return static_cast<char*>(p) + 16;
}
__attribute__((noinline)) void operator delete(void* p) noexcept {
  if (p == nullptr) return;
  char* block = static_cast<char*>(p) - 16;
  allocated.fetch_sub(*reinterpret_cast<std::size_t*>(block));
  std::free(block);
}
__attribute__((noinline)) void operator delete(void* p, std::size_t) noexcept { operator delete(p); }

namespace {

std::string bench_dir(const std::string& name) {
  const char* root = std::getenv("TANDEM_BENCH_DIR");
  return (std::filesystem::path(root != nullptr && *root != '\0' ? root : std::filesystem::temp_directory_path()) /
          ("tandem_bench_" + name + "_" + std::to_string(::getpid())))
      .string();
}

// The checkpoint's files and their sizes.
std::vector<std::pair<std::string, std::uintmax_t>> files_of(const std::string& dir) {
  std::vector<std::pair<std::string, std::uintmax_t>> out;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().extension() == ".safetensors") out.emplace_back(e.path().string(), e.file_size());
  return out;
}

// Seconds for one thread per rank to write (with fsync) or read the checkpoint's files, as plain files in `dir`, each
// thread from or into a buffer of its file's size (touched beforehand), as a program would write or read its state with
// plain POSIX calls: the same bytes, the same memory traffic, no checksum, no format. A save writes each file over the
// file of its previous save.
double plain_io(const std::string& dir, const std::vector<std::pair<std::string, std::uintmax_t>>& files, bool write) {
  std::vector<std::string> paths;
  std::vector<tandem::HostBuffer<char>> buffers;
  for (std::size_t k = 0; k < files.size(); ++k) {
    paths.push_back(dir + "/plain" + std::to_string(k));
    buffers.emplace_back(static_cast<std::size_t>(files[k].second));
    std::memset(buffers.back().data(), 3, buffers.back().bytes());
  }
  // The files written beforehand: to read (from the page cache, as the checkpoint's are), or to write over (truncated
  // and written again, as a save replaces the previous checkpoint, whose files it removes).
  for (std::size_t k = 0; k < files.size(); ++k) {
    const int fd = ::open(paths[k].c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (::write(fd, buffers[k].data(), buffers[k].bytes()) != ssize_t(buffers[k].bytes())) std::abort();
    if (write) ::fsync(fd);
    ::close(fd);
  }
  const std::size_t chunk = std::size_t{8} << 20;  // per call: the size of the checkpoint's own writes and reads
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::jthread> workers;
  for (std::size_t k = 0; k < files.size(); ++k)
    workers.emplace_back([&, k] {
      char* p = buffers[k].data();
      const int fd =
          write ? ::open(paths[k].c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644) : ::open(paths[k].c_str(), O_RDONLY);
      for (std::uintmax_t at = 0; at < files[k].second; at += chunk) {
        const auto n = static_cast<std::size_t>(std::min<std::uintmax_t>(chunk, files[k].second - at));
        const ssize_t done = write ? ::write(fd, p + at, n) : ::pread(fd, p + at, n, off_t(at));
        if (done != ssize_t(n)) std::abort();
      }
      if (write) ::fsync(fd);
      ::close(fd);
    });
  workers.clear();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (const std::string& p : paths) std::filesystem::remove(p);
  return seconds;
}

void BM_checkpoint(benchmark::State& state, const char* layout, bool save) {
  const int world = static_cast<int>(state.range(0));
  const std::vector<std::size_t> sizes = bench::layout(layout);
  const std::string dir = bench_dir(std::string(layout) + (save ? "_save" : "_load"));
  std::filesystem::remove_all(dir);
  // Rounds of (plain I/O of the checkpoint's bytes, then one save or load), the best of each kept: page-cache and
  // memory state drift over a run (on a VM, first-touched pages cost several times more), and alternating gives both
  // the same conditions.
  const int rounds = static_cast<int>(state.max_iterations);
  double best = 1e30, best_plain = 1e30, bytes = 0;
  std::size_t peak_bytes = 0;
  tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
    std::vector<tandem::TensorSpec> specs;
    for (std::size_t i = 0; i < sizes.size(); ++i) specs.push_back({"t" + std::to_string(i), sizes[i]});
    tandem::DataParallel<tandem::OptimizerSharded, tandem::AdamW> dp(comm, specs);
    dp.broadcast_parameters();
    dp.save_checkpoint(dir);  // warm up (and the files a load reads)
    for (int r = 0; r < rounds; ++r) {
      comm.barrier();
      if (comm.rank() == 0) {
        const auto files = files_of(dir);
        bytes = 0;
        for (const auto& f : files) bytes += double(f.second);
        best_plain = std::min(best_plain, plain_io(dir, files, save));
        peak = allocated.load();
      }
      comm.barrier();
      const std::size_t before = allocated.load();
      const auto t0 = std::chrono::steady_clock::now();
      save ? dp.save_checkpoint(dir) : dp.load_checkpoint(dir);
      comm.barrier();
      if (comm.rank() == 0) {
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        peak_bytes = std::max(peak_bytes, peak.load() - before);
      }
    }
  });
  std::filesystem::remove_all(dir);
  for (auto _ : state) state.SetIterationTime(best);
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes * double(state.iterations())));
  state.counters["x_plain"] = best_plain / best;
  state.counters["model_MB"] = double(bench::total(sizes)) * 12 / 1e6;
  if (save) state.counters["peak_host_MB"] = double(peak_bytes) / 1e6;
}

void shape(benchmark::internal::Benchmark* b) {
  b->DenseRange(1, 2)->ArgName("ranks")->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK_CAPTURE(BM_checkpoint, save_gpt2, "gpt2", true)->Name("checkpoint/save/gpt2")->Apply(shape);
BENCHMARK_CAPTURE(BM_checkpoint, load_gpt2, "gpt2", false)->Name("checkpoint/load/gpt2")->Apply(shape);
BENCHMARK_CAPTURE(BM_checkpoint, save_small, "10000x1KB", true)->Name("checkpoint/save/10000x1KB")->Apply(shape);
BENCHMARK_CAPTURE(BM_checkpoint, load_small, "10000x1KB", false)->Name("checkpoint/load/10000x1KB")->Apply(shape);

BENCHMARK_MAIN();
