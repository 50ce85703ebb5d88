// SPDX-License-Identifier: Apache-2.0
// A training job in which one rank fails, for tests/mpi/run_failure.cmake: `mpi_failure <mode>` under mpirun.
//   kill   the last rank raise(SIGKILL)s itself at step 5 (no word to anyone)
//   throw  the last rank throws at step 5; its tandem::Mpi is destroyed by the exception
//   abort  the last rank throws at step 5 and passes the exception's text on with Mpi::abort
//   kill_saving DIR
//          every rank saves a checkpoint into DIR after step 4 and again after step 6; in the second save the last
//          rank dies in the middle of writing its file: the kernel kills it with SIGXFSZ at a file size limit
//          (RLIMIT_FSIZE) of half its first file, so it leaves a partial temporary file, as a crash does
// Just before it fails, the last rank prints "[mpi_failure] rank R fails at T us; liveness interval L ms". Every rank
// that catches an exception prints "[mpi_failure] rank R caught <type> at T us: <what>" and exits with status 3
// without MPI_Finalize (MPI cannot finalize with a dead peer); a rank that finishes training prints
// "[mpi_failure] rank R finished", which the driver treats as a failure of the test. T is steady_clock
// (CLOCK_MONOTONIC, one clock for every process on a host) in microseconds, so the driver can tell how long after the
// failure each rank reported it.
#include <mpi.h>
#include <sys/prctl.h>
#include <sys/resource.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

#include "support/train.hpp"
#include "tandem/comm/mpi.hpp"
#include "tandem/tandem.hpp"

namespace {

long long now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int report(int rank, const char* type, const char* what) {
  std::fprintf(stderr, "[mpi_failure] rank %d caught %s at %lld us: %s\n", rank, type, now_us(), what);
  std::fflush(stderr);
  return 3;
}

int train(const std::string& mode, int rank, int size) {
  test::TrainSetup setup;
  setup.steps = 400;  // far more than the failure needs: finishing means nobody noticed
  const mlp::Dataset data = test::make_dataset(setup);
  const int victim = size - 1;
  const tandem::MpiOptions options{.timeout = std::chrono::seconds(60)};  // liveness_interval: the default, 100 ms
  const auto hook = [&](int step, int) {
    if (rank != victim || step != 5) return;
    std::fprintf(stderr, "[mpi_failure] rank %d fails at %lld us; liveness interval %lld ms\n", rank, now_us(),
                 static_cast<long long>(options.liveness_interval.count()));
    std::fflush(stderr);
    if (mode == "kill") std::raise(SIGKILL);
    throw std::runtime_error("injected failure on rank " + std::to_string(rank) + " at step 5");
  };
  const tandem::AdamWOptions adamw{.lr = 1e-3f};
  if (mode == "abort") {
    tandem::Mpi comm(MPI_COMM_WORLD, options);
    try {
      test::train_rank<tandem::GradientSharded, tandem::AdamW, float>(comm, setup, data, adamw, hook);
    } catch (const std::exception& e) {
      comm.abort(e.what());  // no-op on a rank whose communicator already failed
      throw;
    }
  } else {
    tandem::Mpi comm(MPI_COMM_WORLD, options);
    test::train_rank<tandem::GradientSharded, tandem::AdamW, float>(comm, setup, data, adamw, hook);
  }
  std::fprintf(stderr, "[mpi_failure] rank %d finished\n", rank);
  return 0;
}

// kill_saving: a plain training loop (train_rank's hook cannot save) that saves after steps 4 and 6.
int train_saving(const std::string& dir, int rank, int size) {
  test::TrainSetup setup;
  setup.steps = 400;
  const mlp::Dataset data = test::make_dataset(setup);
  const int victim = size - 1, local = setup.global_batch / size;
  const tandem::MpiOptions options{.timeout = std::chrono::seconds(60)};
  tandem::Mpi comm(MPI_COMM_WORLD, options);
  mlp::Mlp<float> model(setup.dims, setup.seed);
  tandem::DataParallel<tandem::GradientSharded, tandem::AdamW, tandem::HostBackend, tandem::Mpi> dp(
      comm, model.tensors(), {.lr = 1e-3f}, {.bucket_cap_bytes = setup.bucket_cap_bytes});
  dp.broadcast_parameters(0);
  for (int step = 0; step < setup.steps; ++step) {
    model.forward_backward(data, step * setup.global_batch + rank * local, local);
    dp.step();
    if (step == 3) dp.save_checkpoint(dir);
    if (step == 5) {
      if (rank == victim) {
        // (printed first: with the limit set, a write to stderr redirected to a file could be the one that kills)
        std::fprintf(stderr, "[mpi_failure] rank %d fails at %lld us; liveness interval %lld ms\n", rank, now_us(),
                     static_cast<long long>(options.liveness_interval.count()));
        std::fflush(stderr);
        // SIGXFSZ kills (where the launcher left it ignored, the write would fail instead), and no core dump, nor a
        // core handler the kernel pipes it to, holds up the death the other ranks must notice.
        const std::uint64_t bytes = tandem::read_checkpoint_manifest(dir).files.at(std::size_t(victim)).bytes;
        const rlimit half{rlim_t(bytes / 2), rlim_t(bytes / 2)};
        if (std::signal(SIGXFSZ, SIG_DFL) == SIG_ERR || prctl(PR_SET_DUMPABLE, 0) != 0 ||
            setrlimit(RLIMIT_FSIZE, &half) != 0)
          throw std::runtime_error(std::string("setting up the kill: ") + std::strerror(errno));
      }
      dp.save_checkpoint(dir);
    }
  }
  std::fprintf(stderr, "[mpi_failure] rank %d finished\n", rank);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "kill" && mode != "throw" && mode != "abort" && !(mode == "kill_saving" && argc > 2)) {
    std::fprintf(stderr, "usage: mpi_failure kill|throw|abort, or mpi_failure kill_saving DIR\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  try {
    const int status = mode == "kill_saving" ? train_saving(argv[2], rank, size) : train(mode, rank, size);
    MPI_Finalize();
    return status;
  } catch (const tandem::peer_error& e) {
    return report(rank, "tandem::peer_error", e.what());
  } catch (const tandem::timeout_error& e) {
    return report(rank, "tandem::timeout_error", e.what());
  } catch (const tandem::error& e) {
    return report(rank, "tandem::error", e.what());
  } catch (const std::exception& e) {
    return report(rank, "std::exception", e.what());
  }
}
