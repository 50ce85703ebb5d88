// SPDX-License-Identifier: Apache-2.0
// All-reduce across MPI processes, run as `mpiexec -n 2 bench_mpi`: tandem::Mpi against raw MPI_Allreduce (the
// ceiling of what MPI moves; it may reduce in any order, Mpi reduces in rank order) and against LocalGroup at the same
// world size (ranks as threads of one process: no copies between address spaces). fp32 sum, 64 KB - 64 MB per rank
// in powers of two. Counters, as nccl-tests defines them: algbw = bytes / time, busbw = algbw x 2 (n-1) / n.
// x_MPI_Allreduce = time of MPI_Allreduce / time of this row at the same size (> 1: faster than MPI).
//
// Every rank must run the same benchmarks with the same iteration counts, so each case has a fixed iteration count
// (Google Benchmark calls it once) and the time reported is the slowest rank's. Only rank 0 prints.
//
// The LocalGroup rows run in rank 0 alone (its threads are the ranks) while the other processes sleep, waking every
// 10 ms to look for rank 0's word, so that they do not compete for the cores. LocalGroup's rank r runs on the CPUs
// MPI process r was bound to: Open MPI binds each of two processes to a core of its own, and threads inherit their
// process's binding, so without this LocalGroup's two ranks would share rank 0's one core while MPI's two ranks had
// two. Rank 0's main thread takes the union of the processes' CPUs while the group starts (LocalGroup counts the
// CPUs its ranks may use), and its own again after. Where the processes are not all on one host, or off Linux, the
// threads keep rank 0's CPUs.
#include <benchmark/benchmark.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

#include "tandem/comm/local_group.hpp"
#include "tandem/comm/mpi.hpp"

namespace {

enum class Impl { tandem_mpi, mpi_allreduce, local_group };

std::unique_ptr<tandem::Mpi> g_comm;
std::map<std::int64_t, double> g_mpi_allreduce_seconds;  // per-op time of MPI_Allreduce, by bytes

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

/// Ranks other than 0 wait here, sleeping, until rank 0 sends a word: no spinning MPI_Barrier beside its threads.
/// They look every 10 ms, so that their wake-ups barely interrupt the LocalGroup rank running on their CPU.
void idle_until_rank0_done() {
  int token = 0;
  if (world_rank() == 0) {
    for (int q = 1; q < world_size(); ++q) MPI_Send(&token, 1, MPI_INT, q, 99, MPI_COMM_WORLD);
    return;
  }
  MPI_Request r = MPI_REQUEST_NULL;
  MPI_Irecv(&token, 1, MPI_INT, 0, 99, MPI_COMM_WORLD, &r);
  int done = 0;
  while (MPI_Test(&r, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
}

/// Where each MPI process may run, so that LocalGroup's rank r runs there too (see the top of the file).
class Placement {
 public:
#if defined(__linux__)
  /// Collective: every process passes its CPU mask to rank 0.
  Placement() {
    MPI_Comm node = MPI_COMM_NULL;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    int node_size = 0;
    MPI_Comm_size(node, &node_size);
    MPI_Comm_free(&node);
    cpu_set_t mine;
    CPU_ZERO(&mine);
    int ok = sched_getaffinity(0, sizeof(mine), &mine) == 0 && node_size == world_size() ? 1 : 0;
    int all_ok = 0;
    MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    masks_.resize(static_cast<std::size_t>(world_size()));
    MPI_Gather(&mine, sizeof(cpu_set_t), MPI_BYTE, masks_.data(), sizeof(cpu_set_t), MPI_BYTE, 0, MPI_COMM_WORLD);
    usable_ = all_ok == 1;
    CPU_ZERO(&union_);
    for (const cpu_set_t& m : masks_) CPU_OR(&union_, &union_, &m);
  }

  /// Rank 0's main thread may run on every process's CPUs while it lives.
  class Widened {
   public:
    explicit Widened(const Placement& p) : active_(p.usable_) {
      CPU_ZERO(&saved_);
      if (active_) active_ = pthread_getaffinity_np(pthread_self(), sizeof(saved_), &saved_) == 0;
      if (active_) pthread_setaffinity_np(pthread_self(), sizeof(p.union_), &p.union_);
    }
    ~Widened() {
      if (active_) pthread_setaffinity_np(pthread_self(), sizeof(saved_), &saved_);
    }
    Widened(const Widened&) = delete;
    Widened& operator=(const Widened&) = delete;

   private:
    bool active_;
    cpu_set_t saved_;
  };

  /// The calling thread, LocalGroup's rank `rank`, runs where MPI process `rank` runs.
  void bind(int rank) const {
    if (usable_) pthread_setaffinity_np(pthread_self(), sizeof(cpu_set_t), &masks_[static_cast<std::size_t>(rank)]);
  }

 private:
  bool usable_ = false;
  std::vector<cpu_set_t> masks_;  // per process; rank 0's copy only
  cpu_set_t union_;
#else
  struct Widened {
    explicit Widened(const Placement&) {}
  };
  void bind(int) const {}
#endif
};

std::unique_ptr<Placement> g_placement;

void BM_all_reduce(benchmark::State& state, Impl impl) {
  const std::int64_t bytes = state.range(0);
  const std::size_t count = static_cast<std::size_t>(bytes) / sizeof(float);
  const auto iterations = static_cast<std::int64_t>(state.max_iterations);
  const int n = world_size();
  double seconds = 0;
  if (impl == Impl::local_group) {
    if (world_rank() == 0) {
      const Placement::Widened wide(*g_placement);
      tandem::LocalGroup(n).run([&](tandem::LocalComm& comm) {
        g_placement->bind(comm.rank());
        std::vector<float> send(count, 1.0f + static_cast<float>(comm.rank())), recv(count);
        comm.all_reduce(send.data(), recv.data(), count, tandem::DType::fp32, tandem::ReduceOp::sum);  // warm up
        comm.barrier();
        const auto t0 = std::chrono::steady_clock::now();
        for (std::int64_t i = 0; i < iterations; ++i)
          comm.all_reduce(send.data(), recv.data(), count, tandem::DType::fp32, tandem::ReduceOp::sum);
        comm.barrier();
        if (comm.rank() == 0) seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      });
    }
    idle_until_rank0_done();
  } else {
    std::vector<float> send(count, 1.0f + static_cast<float>(world_rank())), recv(count);
    const auto once = [&] {
      if (impl == Impl::tandem_mpi) {
        g_comm->all_reduce(send.data(), recv.data(), count, tandem::DType::fp32, tandem::ReduceOp::sum);
      } else {
        MPI_Allreduce(send.data(), recv.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      }
    };
    once();  // warm up: first touch of the pages, Mpi's staging buffer
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = std::chrono::steady_clock::now();
    for (std::int64_t i = 0; i < iterations; ++i) once();
    const double mine = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    MPI_Allreduce(&mine, &seconds, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);  // the slowest rank's time
  }
  const double per_op = seconds / static_cast<double>(iterations);
  for (auto _ : state) state.SetIterationTime(per_op);
  if (impl == Impl::mpi_allreduce) g_mpi_allreduce_seconds[bytes] = per_op;
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * bytes);
  const double algbw = static_cast<double>(bytes) / per_op / 1e9;
  state.counters["algbw_GBps"] = algbw;
  state.counters["busbw_GBps"] = algbw * 2.0 * (n - 1) / n;
  state.counters["ranks"] = n;
  const auto raw = g_mpi_allreduce_seconds.find(bytes);
  if (raw != g_mpi_allreduce_seconds.end()) state.counters["x_MPI_Allreduce"] = raw->second / per_op;
}

/// 64 KB - 64 MB in powers of two; a fixed iteration count per size (about 1 GB moved per case, 5 to 2000 calls).
void sizes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"bytes"})->UseManualTime()->Unit(benchmark::kMicrosecond);
}

void register_all() {
  // MPI_Allreduce first: the other rows divide by its time at the same size.
  const std::pair<const char*, Impl> impls[] = {{"BM_all_reduce/MPI_Allreduce", Impl::mpi_allreduce},
                                                {"BM_all_reduce/tandem_Mpi", Impl::tandem_mpi},
                                                {"BM_all_reduce/LocalGroup", Impl::local_group}};
  for (const auto& [name, impl] : impls)
    for (std::int64_t bytes = 64 << 10; bytes <= (64 << 20); bytes *= 2) {
      const std::int64_t iterations = std::clamp<std::int64_t>((std::int64_t{1} << 30) / bytes, 5, 2000);
      benchmark::RegisterBenchmark(name, BM_all_reduce, impl)->Arg(bytes)->Iterations(iterations)->Apply(sizes);
    }
}

/// Prints nothing: the reporter of every rank but 0.
class NullReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int status = 0;
  {
    g_comm = std::make_unique<tandem::Mpi>(MPI_COMM_WORLD);
    g_placement = std::make_unique<Placement>();
    benchmark::Initialize(&argc, argv);
    register_all();
    if (world_rank() == 0) {
      benchmark::RunSpecifiedBenchmarks();
    } else {
      NullReporter quiet;
      benchmark::RunSpecifiedBenchmarks(&quiet);
    }
    benchmark::Shutdown();
    g_placement.reset();
    g_comm.reset();
  }
  MPI_Finalize();
  return status;
}
