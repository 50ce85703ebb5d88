// SPDX-License-Identifier: Apache-2.0
// Nccl: the communicator concept (comm/communicator.hpp) over NCCL, for device buffers on CUDA streams.
//
// A communicator is built from (unique id, rank, size): rank 0 creates the id with Nccl::make_id(), every rank
// receives it by whatever means it has (MPI, a file rendezvous, threads of one process: NcclGroup below) and
// constructs its Nccl on its own device (the current one; every CUDA call Nccl makes later runs with that device
// current and restores the caller's). Initialisation is non-blocking (ncclCommInitRankConfig with blocking = 0) and
// polled, so a rank that never arrives becomes tandem::timeout_error after options.timeout instead of a hang; the
// communicator is aborted (ncclCommAbort) on timeout and on any asynchronous error, and a call on an aborted
// communicator throws (nccl_error; peer_error when another rank of an NcclGroup aborted it).
//
// Collectives are enqueued on the caller's stream and return at once, as NCCL's do; their semantics and in-place
// forms are NCCL's (and those of the concept). After each enqueue the communicator is polled until NCCL has
// accepted the call (non-blocking communicators may answer ncclInProgress). barrier() is a one-element all-reduce
// that the host waits for; wait_stream() waits for a stream. Every host wait here is bounded: it polls an event
// (backend/cuda/wait.hpp, the same back-off CudaBackend uses) and ncclCommGetAsyncError, so an NCCL failure
// surfaces as nccl_error and a peer that never arrives as timeout_error, never as a hang.
//
// Destruction: normally ncclCommFinalize, polled (with the timeout) until the communicator is quiescent, then
// ncclCommDestroy. When the Nccl is destroyed during stack unwinding, after any of its calls threw, or when the
// finalisation fails or times out, ncclCommAbort instead: a collective teardown would wait for peers that may never
// come. A host_queue Stream (the stream-faithful host backend's) is refused with tandem::error.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

// ncclCommInitRankConfig, ncclCommFinalize and non-blocking communicators came in 2.14 (the CMake targets check the
// same: cmake/tandemCudaTargets.cmake).
#if !defined(NCCL_VERSION_CODE) || !defined(NCCL_VERSION)
#error "tandem needs NCCL 2.14 or later (this nccl.h defines no NCCL_VERSION_CODE)"
#elif NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "tandem needs NCCL 2.14 or later (ncclCommInitRankConfig, ncclCommFinalize, non-blocking communicators)"
#endif

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <functional>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/backend/cuda/check.hpp"
#include "tandem/backend/cuda/device.hpp"
#include "tandem/backend/cuda/stream.hpp"
#include "tandem/backend/cuda/wait.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/core/config.hpp"
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
  /// How long initialisation, an enqueue, a barrier, a wait_stream or the teardown may wait before the
  /// communicator is aborted (and, but for the teardown, tandem::timeout_error is thrown).
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
};

class Nccl;
class NcclGroup;

namespace detail {

/// What the ranks of one NcclGroup::run share: each rank's communicator, so that a rank whose body throws can abort
/// them all (their pending and later calls then fail instead of hanging), and the failures, so that run() rethrows
/// the first original one.
class NcclGroupState {
 public:
  explicit NcclGroupState(int size) : members_(static_cast<std::size_t>(size), nullptr) {}

  /// Throws peer_error when a rank has failed already: there is no group left to join.
  void check_alive(int rank, const char* what);
  /// Registers `comm` as rank `rank`'s communicator; aborts it at once when a rank has failed already.
  void attach(int rank, Nccl& comm) noexcept;
  /// The rank's communicator is gone (destroyed or aborted by itself).
  void detach(int rank) noexcept;
  /// Rank `rank` failed with `what`: every registered communicator is aborted, and so is any attached later.
  void abort_all(int rank, const char* what) noexcept;

  /// Records how a rank's body ended; rethrow_first() rethrows the first failure that was not a peer_error (or the
  /// first of all, if every one was).
  void record_failure(std::exception_ptr e, bool peer) {
    const std::lock_guard lock(mutex_);
    if (!first_failure_) first_failure_ = e;
    if (!peer && !first_original_) first_original_ = e;
  }
  void rethrow_first() {
    if (first_original_) std::rethrow_exception(first_original_);
    if (first_failure_) std::rethrow_exception(first_failure_);
  }

 private:
  std::mutex mutex_;
  std::vector<Nccl*> members_;
  bool aborted_ = false;
  std::string message_;  // "tandem: NcclGroup: rank R failed: ..."
  std::exception_ptr first_failure_;
  std::exception_ptr first_original_;
};

}  // namespace detail

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
  Nccl(const ncclUniqueId& id, int rank, int size, NcclOptions options = {}) : Nccl(id, rank, size, options, nullptr) {}

  Nccl(const Nccl&) = delete;
  Nccl& operator=(const Nccl&) = delete;

  /// Finalises and destroys the communicator, or aborts it while unwinding or after an error (see the file comment).
  ~Nccl() {
    const detail::CudaDeviceGuard device(device_, std::nothrow);
    if (failed_ || std::uncaught_exceptions() > uncaught_at_construction_) {
      const std::lock_guard lock(mutex_);
      abort_locked();
    } else {
      close();
    }
    release();
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  /// The device the communicator was built on.
  int device() const { return device_; }
  /// The NCCL communicator; null once aborted. Calls made on it directly bypass the abort protocol of NcclGroup.
  ncclComm_t native() const { return comm_; }

  void all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op, Stream stream) {
    const FailureMark mark(*this);
    const cudaStream_t s = detail::native(stream);
    {
      const auto lock = hold("ncclAllReduce");
      const detail::CudaDeviceGuard device(device_);
      TANDEM_NCCL_CHECK(ncclAllReduce(send, recv, count, detail::nccl_dtype(dtype), detail::nccl_op(op), comm_, s));
    }
    wait_ready("ncclAllReduce");
  }

  /// send holds size * count elements; recv receives this rank's block (in place: recv == send + rank * count).
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op, Stream stream) {
    const FailureMark mark(*this);
    const cudaStream_t s = detail::native(stream);
    {
      const auto lock = hold("ncclReduceScatter");
      const detail::CudaDeviceGuard device(device_);
      TANDEM_NCCL_CHECK(ncclReduceScatter(send, recv, count, detail::nccl_dtype(dtype), detail::nccl_op(op), comm_, s));
    }
    wait_ready("ncclReduceScatter");
  }

  /// recv holds size * count elements (in place: send == recv + rank * count).
  void all_gather(const void* send, void* recv, std::size_t count, DType dtype, Stream stream) {
    const FailureMark mark(*this);
    const cudaStream_t s = detail::native(stream);
    {
      const auto lock = hold("ncclAllGather");
      const detail::CudaDeviceGuard device(device_);
      TANDEM_NCCL_CHECK(ncclAllGather(send, recv, count, detail::nccl_dtype(dtype), comm_, s));
    }
    wait_ready("ncclAllGather");
  }

  void broadcast(const void* send, void* recv, std::size_t count, DType dtype, int root, Stream stream) {
    const FailureMark mark(*this);
    const cudaStream_t s = detail::native(stream);
    {
      const auto lock = hold("ncclBroadcast");
      const detail::CudaDeviceGuard device(device_);
      TANDEM_NCCL_CHECK(ncclBroadcast(send, recv, count, detail::nccl_dtype(dtype), root, comm_, s));
    }
    wait_ready("ncclBroadcast");
  }

  /// Returns once every rank has reached its barrier (and the legacy default stream's work before it is done).
  void barrier() {
    all_reduce(scratch_, scratch_, 1, DType::fp32, ReduceOp::sum, Stream{});
    wait_stream(Stream{}, "barrier");
  }

  /// Waits until `stream` has run the work enqueued on it so far, polling an event and the communicator's
  /// asynchronous error (nccl_error); aborts the communicator on an error or after options.timeout (timeout_error).
  void wait_stream(Stream stream, const char* what) {
    const FailureMark mark(*this);
    const cudaStream_t s = detail::native(stream);
    const detail::CudaDeviceGuard device(device_);
    TANDEM_CUDA_CHECK(cudaEventRecord(event_, s));
    if (!detail::wait_event(event_, options_.timeout, [&] { check_async(what); })) abort_with_timeout(what);
    check_async(what);  // aborted by a peer meanwhile: the stream ended early, with nothing reduced
  }

 private:
  friend class NcclGroup;
  friend class detail::NcclGroupState;

  Nccl(const ncclUniqueId& id, int rank, int size, NcclOptions options, detail::NcclGroupState* group)
      : rank_(rank), size_(size), options_(options), group_(group) {
    if (size < 1 || rank < 0 || rank >= size)
      detail::fail("tandem: Nccl: rank " + std::to_string(rank) + " of size " + std::to_string(size) +
                   " is invalid; the size must be >= 1 and the rank in [0, size)");
    if (options.timeout.count() <= 0)
      detail::fail("tandem: Nccl: `options.timeout` is " + std::to_string(options.timeout.count()) +
                   " ms; pass a positive duration");
    detail::error_rank() = rank;
    device_ = detail::current_device();
    try {
      TANDEM_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
      TANDEM_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&scratch_), sizeof(float), nullptr));
      if (group_) group_->check_alive(rank_, "ncclCommInitRankConfig");
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;
      ncclComm_t comm = nullptr;
      const ncclResult_t status = ncclCommInitRankConfig(&comm, size, id, rank, &config);
      {
        const std::lock_guard lock(mutex_);
        comm_ = comm;
        if (status != ncclSuccess && status != ncclInProgress) abort_locked();
      }
      if (status != ncclSuccess && status != ncclInProgress)
        detail::throw_nccl_error(status, "ncclCommInitRankConfig(&comm, size, id, rank, &config)", __FILE__, __LINE__);
      if (group_) group_->attach(rank_, *this);  // aborts this communicator at once if a peer has failed already
      wait_ready("ncclCommInitRankConfig");
    } catch (...) {
      {
        const std::lock_guard lock(mutex_);
        abort_locked();
      }
      release();
      throw;
    }
  }

  /// Marks the communicator failed when the scope it guards ends by an exception: the destructor then aborts.
  struct FailureMark {
    explicit FailureMark(Nccl& comm) noexcept : comm_(comm), at_(std::uncaught_exceptions()) {}
    FailureMark(const FailureMark&) = delete;
    FailureMark& operator=(const FailureMark&) = delete;
    ~FailureMark() {
      if (std::uncaught_exceptions() > at_) comm_.failed_ = true;
    }
    Nccl& comm_;
    int at_;
  };

  /// The communicator's lock, held while comm_ is used (a failing NcclGroup peer aborts it under the same lock);
  /// throws when the communicator was aborted.
  std::unique_lock<std::mutex> hold(const char* what) {
    std::unique_lock lock(mutex_);
    if (!comm_) throw_aborted(what);
    return lock;
  }

  /// Polls until the communicator has finished its current (non-blocking) call.
  void wait_ready(const char* what) {
    const bool done = detail::poll_until(options_.timeout, [&] {
      const auto lock = hold(what);
      ncclResult_t state = ncclSuccess;
      TANDEM_NCCL_CHECK(ncclCommGetAsyncError(comm_, &state));
      if (state == ncclInProgress) return false;
      if (state != ncclSuccess) abort_with_error(state, what);
      return true;
    });
    if (!done) abort_with_timeout(what);
  }

  void check_async(const char* what) {
    const auto lock = hold(what);
    ncclResult_t state = ncclSuccess;
    TANDEM_NCCL_CHECK(ncclCommGetAsyncError(comm_, &state));
    if (state != ncclSuccess && state != ncclInProgress) abort_with_error(state, what);
  }

  /// With mutex_ held.
  [[noreturn]] TANDEM_COLD void abort_with_error(ncclResult_t state, const char* what) {
    abort_locked();
    throw nccl_error(std::string("tandem: NCCL reported an asynchronous error during ") + what + " on rank " +
                     std::to_string(rank_) + ": " + ncclGetErrorString(state) + " (" + ncclGetLastError(nullptr) +
                     "); the communicator was aborted (build a new one to continue)");
  }

  [[noreturn]] TANDEM_COLD void abort_with_timeout(const char* what) {
    const std::lock_guard lock(mutex_);
    if (!comm_) throw_aborted(what);  // a peer's abort came first
    abort_locked();
    throw timeout_error(std::string("tandem: ") + what + " on rank " + std::to_string(rank_) + " of " +
                        std::to_string(size_) + " did not complete within " + std::to_string(options_.timeout.count()) +
                        " ms (a rank did not arrive, or the device is stuck); the communicator was aborted");
  }

  /// With mutex_ held.
  [[noreturn]] TANDEM_COLD void throw_aborted(const char* what) const {
    const std::string where = std::string(what) + " on rank " + std::to_string(rank_) + " of " + std::to_string(size_);
    if (aborted_by_peer_)
      throw peer_error(
          (peer_failure_.empty() ? std::string("tandem: another rank of the NcclGroup failed") : peer_failure_) + "; " +
          where + " was abandoned: its communicator was aborted so that it does not hang");
    throw nccl_error("tandem: Nccl: " + where +
                     ": the communicator was aborted after an earlier error or timeout; build a new one to continue");
  }

  /// ncclCommAbort (once), with mutex_ held: kernels of this communicator still running quit, nothing waits for
  /// peers.
  void abort_locked() noexcept {
    if (!comm_) return;
    const detail::CudaDeviceGuard device(device_, std::nothrow);
    const ncclResult_t s = ncclCommAbort(comm_);
    comm_ = nullptr;
    if (s != ncclSuccess && s != ncclInProgress)
      std::fprintf(stderr, "tandem: ncclCommAbort failed on rank %d: %s (ignored)\n", rank_, ncclGetErrorString(s));
  }

  /// A failing NcclGroup peer aborts this communicator (from its own thread).
  void abort_by_peer(const std::string& message) noexcept {
    const std::lock_guard lock(mutex_);
    if (!comm_) return;
    aborted_by_peer_ = true;
    try {
      peer_failure_ = message;
    } catch (...) {  // no memory for the message: throw_aborted says less
    }
    abort_locked();
  }

  /// The normal teardown: ncclCommFinalize, polled until quiescent (bounded by the timeout), then ncclCommDestroy;
  /// ncclCommAbort where any of that fails. Never throws.
  void close() noexcept {
    {
      const std::lock_guard lock(mutex_);
      if (!comm_) return;
      const ncclResult_t s = ncclCommFinalize(comm_);
      if (s != ncclSuccess && s != ncclInProgress) {
        std::fprintf(stderr, "tandem: ncclCommFinalize failed on rank %d: %s; aborting the communicator\n", rank_,
                     ncclGetErrorString(s));
        abort_locked();
        return;
      }
    }
    ncclResult_t failure = ncclSuccess;
    const bool quiescent = detail::poll_until(options_.timeout, [&]() noexcept {
      const std::lock_guard lock(mutex_);
      if (!comm_) return true;  // aborted by a peer meanwhile
      ncclResult_t state = ncclSuccess;
      const ncclResult_t q = ncclCommGetAsyncError(comm_, &state);
      if (q != ncclSuccess) state = q;
      if (state == ncclInProgress) return false;
      failure = state;
      return true;
    });
    const std::lock_guard lock(mutex_);
    if (!comm_) return;
    if (!quiescent || failure != ncclSuccess) {
      if (!quiescent)
        std::fprintf(stderr,
                     "tandem: ncclCommFinalize on rank %d of %d did not complete within %lld ms (a rank did not "
                     "finalize); aborting the communicator\n",
                     rank_, size_, static_cast<long long>(options_.timeout.count()));
      else
        std::fprintf(stderr, "tandem: ncclCommFinalize failed on rank %d: %s; aborting the communicator\n", rank_,
                     ncclGetErrorString(failure));
      abort_locked();
      return;
    }
    const detail::CudaDeviceGuard device(device_, std::nothrow);
    const ncclResult_t s = ncclCommDestroy(comm_);
    comm_ = nullptr;
    if (s != ncclSuccess && s != ncclInProgress)
      std::fprintf(stderr, "tandem: ncclCommDestroy failed on rank %d: %s (ignored in a destructor)\n", rank_,
                   ncclGetErrorString(s));
  }

  /// After the communicator is gone: leaves the group, frees the event and the scratch word.
  void release() noexcept {
    if (group_) group_->detach(rank_);
    group_ = nullptr;
    const detail::CudaDeviceGuard device(device_, std::nothrow);
    if (scratch_) TANDEM_CUDA_LOG(cudaFreeAsync(scratch_, nullptr));  // after the barriers that used it
    scratch_ = nullptr;
    if (event_) TANDEM_CUDA_LOG(cudaEventDestroy(event_));
    event_ = nullptr;
  }

  std::mutex mutex_;  // guards comm_, aborted_by_peer_ and peer_failure_
  ncclComm_t comm_ = nullptr;
  bool aborted_by_peer_ = false;
  std::string peer_failure_;
  int rank_ = 0;
  int size_ = 1;
  int device_ = -1;
  NcclOptions options_;
  detail::NcclGroupState* group_ = nullptr;
  float* scratch_ = nullptr;     // the barrier's one word (stream-ordered on the legacy default stream)
  cudaEvent_t event_ = nullptr;  // what wait_stream waits on
  bool failed_ = false;          // one of this communicator's calls threw: the destructor aborts
  int uncaught_at_construction_ = std::uncaught_exceptions();
};

static_assert(Communicator<Nccl>);

namespace detail {

inline void NcclGroupState::check_alive(int rank, const char* what) {
  const std::lock_guard lock(mutex_);
  if (aborted_)
    throw peer_error(message_ + "; " + what + " on rank " + std::to_string(rank) + " of " +
                     std::to_string(members_.size()) + " was not started");
}

inline void NcclGroupState::attach(int rank, Nccl& comm) noexcept {
  const std::lock_guard lock(mutex_);
  members_[static_cast<std::size_t>(rank)] = &comm;
  if (aborted_) comm.abort_by_peer(message_);
}

inline void NcclGroupState::detach(int rank) noexcept {
  const std::lock_guard lock(mutex_);
  members_[static_cast<std::size_t>(rank)] = nullptr;
}

inline void NcclGroupState::abort_all(int rank, const char* what) noexcept {
  const std::lock_guard lock(mutex_);
  if (!aborted_) {
    aborted_ = true;
    try {
      message_ = "tandem: NcclGroup: rank " + std::to_string(rank) + " failed: " + what;
    } catch (...) {  // no memory for the message: peers say less
    }
  }
  for (Nccl* comm : members_)
    if (comm) comm->abort_by_peer(message_);
}

}  // namespace detail

/// Ranks as threads of one process, one per device (single-node multi-GPU): run(body) calls body(Nccl&) once per
/// device, each on its own thread with its device current. If a body throws, the group's communicators are aborted
/// (ncclCommAbort) so that the other ranks' pending and later NCCL calls fail (tandem::peer_error) instead of
/// hanging, and run() rethrows the first exception that was not a peer_error (as LocalGroup::run does).
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
    static_assert(std::is_invocable_v<F&, Nccl&>, "NcclGroup::run needs a body callable as body(Nccl&)");
    const ncclUniqueId id = Nccl::make_id();
    const int n = size();
    detail::NcclGroupState state(n);
    const auto failed = [&state](int rank, bool peer, const char* what) noexcept {
      state.record_failure(std::current_exception(), peer);
      state.abort_all(rank, what);
    };
    const auto rank_main = [&](int rank) {
      try {
        TANDEM_CUDA_CHECK(cudaSetDevice(devices_[static_cast<std::size_t>(rank)]));
        Nccl comm(id, rank, n, options_, &state);  // unwinding aborts it (~Nccl) before the peers are aborted
        std::invoke(body, comm);
      } catch (const peer_error& e) {
        failed(rank, true, e.what());
      } catch (const std::exception& e) {
        failed(rank, false, e.what());
      } catch (...) {
        failed(rank, false, "an exception not derived from std::exception");
      }
    };
    std::vector<std::thread> threads;
    threads.reserve(static_cast<std::size_t>(n));
    for (int rank = 0; rank < n; ++rank) {
      try {
        threads.emplace_back(rank_main, rank);
      } catch (const std::exception& e) {  // the ranks already started must not wait for this one
        failed(rank, false, e.what());
        break;
      }
    }
    for (std::thread& t : threads) t.join();
    state.rethrow_first();
  }

 private:
  std::vector<int> devices_;
  NcclOptions options_;
};

}  // namespace tandem
