// SPDX-License-Identifier: Apache-2.0
// Sharded checkpoints: DataParallel::save_checkpoint and load_checkpoint of a layout (the GPT-2-124M tensor list, or
// 10,000 x 1 KB) at 1 and 2 ranks (threads), OptimizerSharded, AdamW, fp32 (12 bytes per element: parameters and two
// state arrays), against plain POSIX I/O of the same bytes to the same disk in the same run (PlainFiles, below):
//   save  x_plain = (the same files written anew with write() + fsync under new names, a thread per file, the directory
//                   flushed, then the previous ones removed) / save time (a save replaces the previous checkpoint: it
//                   removes the files only that one named)
//   load  x_plain = (the same files read with pread(), a thread per file) / load time, both from the disk: every file
//                   read (the checkpoint's manifest and shards, the plain files) is written back and dropped from the
//                   page cache (posix_fadvise DONTNEED) just before
//         x_plain_cached = the same, both from the page cache (a load that follows a save on the same machine)
// (at the saving plan a rank of a load reads its own file, and gathers the parameters it keeps beyond its shard from
// the other ranks)
// (1.0: as fast as plain I/O of the checkpoint's bytes; the goal is >= 0.7), each the median over 5 rounds of the
// ratio within a round, where the two run one after the other, the file system synced (untimed) after each. The
// reported time is the best round's (a load's: from the disk), and x_plain_best = the plain side's best round / that:
// a disk whose speed jumps between rounds (this project's VM serves the same read at one speed or a third of it, by
// chance) moves a round's ratio, not the best rounds of a side that met its fast state once.
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
#include <optional>
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

// Writes `path` back to the disk and drops its pages from the page cache, so that the next read of it comes from the
// disk.
void drop_cached(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) std::abort();
  if (::fdatasync(fd) != 0 || ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) != 0) std::abort();
  ::close(fd);
}

// Commits to the disk what the file system of `dir` holds back, such as the freeing (and, where the file system
// discards freed blocks, the discarding) of removed files' blocks: run untimed after each timed side, so that neither
// pays for what the other left.
void settle(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0 || ::syncfs(fd) != 0) std::abort();
  ::close(fd);
}

// The checkpoint's files as plain files, each of its file's size, in a directory beside the checkpoint's (the same
// disk), with a buffer of that size for each: what a program writing or reading its state with plain POSIX calls
// would do with the same bytes (the same memory traffic, no checksum, no format). The files and buffers are made once
// and kept, as the state a checkpoint holds is (memory freed and allocated again costs more on a VM that hands freed
// memory back to its host, and bulk writes outside the timed ones would leave the disk busy for what runs next).
class PlainFiles {
 public:
  PlainFiles(std::string dir, const std::vector<std::pair<std::string, std::uintmax_t>>& files) : dir_(std::move(dir)) {
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    for (std::size_t k = 0; k < files.size(); ++k) {
      paths_.push_back(dir_ + "/plain" + std::to_string(k) + ".0");
      buffers_.emplace_back(static_cast<std::size_t>(files[k].second));
      std::memset(buffers_.back().data(), 3, buffers_.back().bytes());
      const int fd = ::open(paths_[k].c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (::write(fd, buffers_[k].data(), buffers_[k].bytes()) != ssize_t(buffers_[k].bytes())) std::abort();
      ::fsync(fd);
      ::close(fd);
    }
  }
  PlainFiles(const PlainFiles&) = delete;
  PlainFiles& operator=(const PlainFiles&) = delete;
  ~PlainFiles() { std::filesystem::remove_all(dir_); }

  double bytes() const {
    double n = 0;
    for (const auto& b : buffers_) n += double(b.bytes());
    return n;
  }
  // Seconds for one thread per file to write it again or to read it with pread (from the disk where `cold`, else from
  // the page cache). A file is written again as a checkpoint's is, as any save that must not lose the previous one
  // writes: a new file (written, fsync, its name made durable), then the old one removed (in place, into the old
  // file's blocks, a crash would leave neither).
  double run(bool write, bool cold) {
    if (cold)
      for (const std::string& p : paths_) drop_cached(p);
    const std::size_t chunk = std::size_t{8} << 20;  // per call: the size of the checkpoint's own writes and reads
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::jthread> workers;
    for (std::size_t k = 0; k < paths_.size(); ++k)
      workers.emplace_back([&, k] {
        char* p = buffers_[k].data();
        const std::size_t size = buffers_[k].bytes();
        const std::string next = dir_ + "/plain" + std::to_string(k) + "." + std::to_string(generation_ + 1);
        const int fd =
            write ? ::open(next.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644) : ::open(paths_[k].c_str(), O_RDONLY);
        for (std::size_t at = 0; at < size; at += chunk) {
          const std::size_t n = std::min(chunk, size - at);
          const ssize_t done = write ? ::write(fd, p + at, n) : ::pread(fd, p + at, n, off_t(at));
          if (done != ssize_t(n)) std::abort();
        }
        if (write) ::fsync(fd);
        ::close(fd);
      });
    workers.clear();
    if (write) {  // the new names made durable, then the old files removed
      const int dir_fd = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY);
      ::fsync(dir_fd);
      ::close(dir_fd);
      ++generation_;
      for (std::size_t k = 0; k < paths_.size(); ++k) {
        std::filesystem::remove(paths_[k]);
        paths_[k] = dir_ + "/plain" + std::to_string(k) + "." + std::to_string(generation_);
      }
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

 private:
  std::string dir_;
  std::vector<std::string> paths_;  // the current files
  int generation_ = 0;
  std::vector<tandem::HostBuffer<char>> buffers_;
};

// The layout's tensors, named t0, t1, ...
std::vector<tandem::TensorSpec> specs_of(const std::vector<std::size_t>& sizes) {
  std::vector<tandem::TensorSpec> specs;
  // (appended: GCC 12 warns falsely of overlapping copies in `"t" + std::to_string(i)`)
  for (std::size_t i = 0; i < sizes.size(); ++i)
    specs.push_back({std::string("t").append(std::to_string(i)), sizes[i]});
  return specs;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 == 1 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

void BM_checkpoint(benchmark::State& state, const char* layout, bool save) {
  const int world = static_cast<int>(state.range(0));
  const std::vector<std::size_t> sizes = bench::layout(layout);
  const std::string dir = bench_dir(std::string(layout) + (save ? "_save" : "_load"));
  std::filesystem::remove_all(dir);
  // Rounds of plain I/O of the checkpoint's bytes and one save or load, each round's ratio kept: page-cache, disk and
  // memory state drift over a run (on a VM, first-touched pages and blocks cost several times more, and this
  // project's VM discards freed blocks, which the next writes pay for), so the two are compared where they ran side by
  // side; which of them goes first alternates, as the one that follows the other's writes pays for them. A load's
  // round is two: from the page cache, then from the disk.
  const int rounds = static_cast<int>(state.max_iterations) * (save ? 1 : 2);
  double best = 1e30, best_plain = 1e30, bytes = 0;
  std::vector<double> ratios, ratios_cached;  // plain time / tandem's time, of each round
  std::optional<PlainFiles> plain_files;
  std::size_t peak_bytes = 0;
  tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
    tandem::DataParallel<tandem::OptimizerSharded, tandem::AdamW> dp(comm, specs_of(sizes));
    dp.broadcast_parameters();
    dp.save_checkpoint(dir);  // warm up (and the files a load reads)
    if (comm.rank() == 0) {
      plain_files.emplace(dir + "_plain", files_of(dir));
      bytes = plain_files->bytes();
    }
    for (int r = 0; r < rounds; ++r) {
      const bool cold = !save && r % 2 == 1;
      const bool plain_first = (save ? r : r / 2) % 2 == 0;
      double ours = 0, theirs = 0;
      const auto plain = [&] {
        comm.barrier();
        if (comm.rank() == 0) {
          theirs = plain_files->run(save, cold);
          settle(dir);
        }
      };
      if (plain_first) plain();
      comm.barrier();
      if (comm.rank() == 0) {
        if (cold)
          for (const auto& e : std::filesystem::directory_iterator(dir)) drop_cached(e.path().string());
        peak = allocated.load();
      }
      comm.barrier();
      const std::size_t before = allocated.load();
      const auto t0 = std::chrono::steady_clock::now();
      if (save)
        dp.save_checkpoint(dir);
      else
        dp.load_checkpoint(dir);
      comm.barrier();
      if (comm.rank() == 0) {
        ours = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        settle(dir);
        peak_bytes = std::max(peak_bytes, peak.load() - before);
      }
      if (!plain_first) plain();
      if (comm.rank() == 0) {
        if (cold || save) {
          best = std::min(best, ours);
          best_plain = std::min(best_plain, theirs);
        }
        (cold || save ? ratios : ratios_cached).push_back(theirs / ours);
      }
    }
  });
  plain_files.reset();
  std::filesystem::remove_all(dir);
  for (auto _ : state) state.SetIterationTime(best);
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes * double(state.iterations())));
  state.counters["x_plain"] = median(ratios);
  state.counters["x_plain_best"] = best_plain / best;
  if (!save) state.counters["x_plain_cached"] = median(ratios_cached);
  state.counters["model_MB"] = double(bench::total(sizes)) * 12 / 1e6;
  if (save) state.counters["peak_host_MB"] = double(peak_bytes) / 1e6;
}

// Opening the shard file of a checkpoint of the layout at 1 rank, from the page cache: its header read, parsed and
// checked (SafetensorsFile; for 10,000 x 1 KB, 30,000 slices named in 2.5 MB), bytes/s of header and ns_per_entry.
// The part of a load that the page cache does not make cheap: beside checkpoint/load's x_plain_cached.
void BM_open_shard(benchmark::State& state, const char* layout) {
  const std::vector<std::size_t> sizes = bench::layout(layout);
  const std::string dir = bench_dir(std::string(layout) + "_open");
  std::filesystem::remove_all(dir);
  tandem::LocalGroup(1).run([&](tandem::LocalComm& comm) {
    tandem::DataParallel<tandem::OptimizerSharded, tandem::AdamW> dp(comm, specs_of(sizes));
    dp.broadcast_parameters();  // owned storage: the initial parameters are set (a save refuses a state without them)
    dp.save_checkpoint(dir);
  });
  const std::string path = files_of(dir).at(0).first;
  std::uint64_t header = 0, entries = 0;
  double total = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    const tandem::SafetensorsFile file(path);
    benchmark::DoNotOptimize(file.tensors().data());
    const double open = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(open);
    total += open;
    header = file.size() - file.tensors().back().end;  // (the data section ends the file)
    entries = file.tensors().size();
  }
  std::filesystem::remove_all(dir);
  state.SetBytesProcessed(static_cast<std::int64_t>(header * std::uint64_t(state.iterations())));
  state.counters["header_MB"] = double(header) / 1e6;
  state.counters["ns_per_entry"] = total / double(state.iterations()) / double(entries) * 1e9;
}

void shape(benchmark::internal::Benchmark* b) {
  b->DenseRange(1, 2)->ArgName("ranks")->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK_CAPTURE(BM_checkpoint, save_gpt2, "gpt2", true)->Name("checkpoint/save/gpt2")->Apply(shape);
BENCHMARK_CAPTURE(BM_checkpoint, load_gpt2, "gpt2", false)->Name("checkpoint/load/gpt2")->Apply(shape);
BENCHMARK_CAPTURE(BM_checkpoint, save_small, "10000x1KB", true)->Name("checkpoint/save/10000x1KB")->Apply(shape);
BENCHMARK_CAPTURE(BM_checkpoint, load_small, "10000x1KB", false)->Name("checkpoint/load/10000x1KB")->Apply(shape);

BENCHMARK_CAPTURE(BM_open_shard, small, "10000x1KB")
    ->Name("checkpoint/open_shard/10000x1KB")
    ->UseManualTime()
    ->Iterations(50)
    ->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
