// SPDX-License-Identifier: Apache-2.0
// Nccl: the communicator concept (comm/communicator.hpp) over NCCL, for device buffers on CUDA streams.
//
// A communicator is built from (unique id, rank, size): rank 0 creates the id with Nccl::make_id(), every rank
// receives it by whatever means it has (MPI, a file rendezvous, threads of one process: NcclGroup below) and
// constructs its Nccl on its own device. Initialisation is non-blocking (ncclCommInitRankConfig with
// blocking = 0) and polled, so a rank that never arrives becomes tandem::timeout_error after options.timeout
// instead of a hang; the communicator is aborted (ncclCommAbort) on timeout and on any asynchronous error.
//
// Collectives are enqueued on the caller's stream and return at once, as NCCL's do; their semantics and in-place
// forms are NCCL's (and those of the concept). After each enqueue the communicator is polled until NCCL has
// accepted the call (non-blocking communicators may answer ncclInProgress). barrier() is a one-element all-reduce
// that the host waits for, polling the stream and ncclCommGetAsyncError with the timeout.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tandem/backend/cuda/check.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/stream.hpp"

namespace tandem {

namespace detail {

[[noreturn]] inline void throw_nccl_error(ncclResult_t status, const char* call, const char* file, int line) {
  throw nccl_error(describe_failure("NCCL", static_cast<int>(status), ncclGetErrorString(status), call, file, line) +
                   ": " + ncclGetLastError(nullptr));
}

inline ncclDataType_t nccl_dtype(DType t) {
  switch (t) {
    case DType::fp32:
      return ncclFloat32;
    case DType::bf16:
      return ncclBfloat16;
    case DType::fp16:
      return ncclFloat16;
    case DType::fp64:
      return ncclFloat64;
  }
  fail("tandem: Nccl: unsupported dtype");
}

inline ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::avg ? ncclAvg : ncclSum; }

}  // namespace detail

}  // namespace tandem

/// Evaluates an NCCL call once; ncclSuccess and ncclInProgress (a non-blocking communicator still working) pass,
/// anything else throws tandem::nccl_error with the status, its text, the call, file:line and the rank.
#define TANDEM_NCCL_CHECK(call)                                                           \
  do {                                                                                    \
    const ncclResult_t tandem_nccl_status_ = (call);                                      \
    if (tandem_nccl_status_ != ncclSuccess && tandem_nccl_status_ != ncclInProgress)      \
      ::tandem::detail::throw_nccl_error(tandem_nccl_status_, #call, __FILE__, __LINE__); \
  } while (0)

namespace tandem {

struct NcclOptions {
  /// How long initialisation, an enqueue or a barrier may wait before the communicator is aborted and
  /// tandem::timeout_error is thrown.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
};

class Nccl {
 public:
  /// A new unique id (call on one rank, then hand it to every rank).
  static ncclUniqueId make_id() {
    ncclUniqueId id;
    TANDEM_NCCL_CHECK(ncclGetUniqueId(&id));
    return id;
  }

  /// Joins the communicator `id` as `rank` of `size`, on the calling thread's current device. Waits (polling) until
  /// every rank has joined or options.timeout passes.
  Nccl(const ncclUniqueId& id, int rank, int size, NcclOptions options = {})
      : rank_(rank), size_(size), options_(options) {
    if (size < 1 || rank < 0 || rank >= size)
      detail::fail("tandem: Nccl: rank " + std::to_string(rank) + " of size " + std::to_string(size) +
                   " is invalid; the size must be >= 1 and the rank in [0, size)");
    detail::error_rank() = rank;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    TANDEM_NCCL_CHECK(ncclCommInitRankConfig(&comm_, size, id, rank, &config));
    wait_ready("ncclCommInitRankConfig");
    TANDEM_CUDA_CHECK(cudaMalloc(&scratch_, sizeof(float)));
  }

  Nccl(const Nccl&) = delete;
  Nccl& operator=(const Nccl&) = delete;

  ~Nccl() {
    if (scratch_) TANDEM_CUDA_LOG(cudaFree(scratch_));
    if (comm_ == nullptr) return;
    const ncclResult_t s = ncclCommDestroy(comm_);
    if (s != ncclSuccess && s != ncclInProgress)
      std::fprintf(stderr, "tandem: ncclCommDestroy failed on rank %d: %s (ignored in a destructor)\n", rank_,
                   ncclGetErrorString(s));
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  ncclComm_t native() const { return comm_; }

  void all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op, Stream stream) {
    TANDEM_NCCL_CHECK(
        ncclAllReduce(send, recv, count, detail::nccl_dtype(dtype), detail::nccl_op(op), comm_, native(stream)));
    wait_ready("ncclAllReduce");
  }

  /// send holds size * count elements; recv receives this rank's block (in place: recv == send + rank * count).
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op, Stream stream) {
    TANDEM_NCCL_CHECK(
        ncclReduceScatter(send, recv, count, detail::nccl_dtype(dtype), detail::nccl_op(op), comm_, native(stream)));
    wait_ready("ncclReduceScatter");
  }

  /// recv holds size * count elements (in place: send == recv + rank * count).
  void all_gather(const void* send, void* recv, std::size_t count, DType dtype, Stream stream) {
    TANDEM_NCCL_CHECK(ncclAllGather(send, recv, count, detail::nccl_dtype(dtype), comm_, native(stream)));
    wait_ready("ncclAllGather");
  }

  void broadcast(const void* send, void* recv, std::size_t count, DType dtype, int root, Stream stream) {
    TANDEM_NCCL_CHECK(ncclBroadcast(send, recv, count, detail::nccl_dtype(dtype), root, comm_, native(stream)));
    wait_ready("ncclBroadcast");
  }

  /// Returns once every rank has reached its barrier (and the legacy default stream's work before it is done).
  void barrier() {
    all_reduce(scratch_, scratch_, 1, DType::fp32, ReduceOp::sum, Stream{});
    wait_stream(Stream{}, "barrier");
  }

  /// Waits for `stream`, polling it and the communicator's asynchronous error; aborts on error or timeout.
  void wait_stream(Stream stream, const char* what) {
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
    for (;;) {
      const cudaError_t s = cudaStreamQuery(native(stream));
      if (s == cudaSuccess) return;
      if (s != cudaErrorNotReady) TANDEM_CUDA_CHECK(s);
      check_async(what);
      if (std::chrono::steady_clock::now() > deadline) abort_with_timeout(what);
      std::this_thread::yield();
    }
  }

 private:
  static cudaStream_t native(Stream s) { return static_cast<cudaStream_t>(s.handle); }

  /// Polls until the communicator has finished its current (non-blocking) call.
  void wait_ready(const char* what) {
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
    for (;;) {
      ncclResult_t state = ncclSuccess;
      TANDEM_NCCL_CHECK(ncclCommGetAsyncError(comm_, &state));
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) abort_with_error(state, what);
      if (std::chrono::steady_clock::now() > deadline) abort_with_timeout(what);
      std::this_thread::yield();
    }
  }

  void check_async(const char* what) {
    ncclResult_t state = ncclSuccess;
    TANDEM_NCCL_CHECK(ncclCommGetAsyncError(comm_, &state));
    if (state != ncclSuccess && state != ncclInProgress) abort_with_error(state, what);
  }

  [[noreturn]] void abort_with_error(ncclResult_t state, const char* what) {
    abort();
    throw nccl_error(std::string("tandem: NCCL reported an asynchronous error during ") + what + " on rank " +
                     std::to_string(rank_) + ": " + ncclGetErrorString(state) +
                     "; the communicator was aborted (build a new one to continue)");
  }

  [[noreturn]] void abort_with_timeout(const char* what) {
    abort();
    throw timeout_error(std::string("tandem: ") + what + " on rank " + std::to_string(rank_) + " of " +
                        std::to_string(size_) + " did not complete within " + std::to_string(options_.timeout.count()) +
                        " ms (a rank did not arrive, or the device is stuck); the communicator was aborted");
  }

  void abort() noexcept {
    if (comm_) (void)ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  ncclComm_t comm_ = nullptr;
  int rank_ = 0;
  int size_ = 1;
  NcclOptions options_;
  float* scratch_ = nullptr;
};

static_assert(Communicator<Nccl>);

/// Ranks as threads of one process, one per device (single-node multi-GPU): run(body) calls body(Nccl&) once per
/// device, each on its own thread with its device current, and rethrows the first exception a rank threw.
class NcclGroup {
 public:
  explicit NcclGroup(std::vector<int> devices, NcclOptions options = {})
      : devices_(std::move(devices)), options_(options) {
    if (devices_.empty()) detail::fail("tandem: NcclGroup needs at least one device");
  }

  /// One rank per visible device.
  static NcclGroup all_devices(NcclOptions options = {}) {
    int n = 0;
    TANDEM_CUDA_CHECK(cudaGetDeviceCount(&n));
    std::vector<int> devices(static_cast<std::size_t>(n));
    for (int d = 0; d < n; ++d) devices[static_cast<std::size_t>(d)] = d;
    return NcclGroup(devices, options);
  }

  int size() const { return static_cast<int>(devices_.size()); }

  template <class F>
  void run(F&& body) {
    const ncclUniqueId id = Nccl::make_id();
    std::exception_ptr first;
    std::mutex m;
    std::vector<std::thread> threads;
    const int n = size();
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        try {
          TANDEM_CUDA_CHECK(cudaSetDevice(devices_[static_cast<std::size_t>(r)]));
          Nccl comm(id, r, n, options_);
          body(comm);
        } catch (...) {
          std::lock_guard lock(m);
          if (!first) first = std::current_exception();
        }
      });
    for (auto& t : threads) t.join();
    if (first) std::rethrow_exception(first);
  }

 private:
  std::vector<int> devices_;
  NcclOptions options_;
};

}  // namespace tandem
