// SPDX-License-Identifier: Apache-2.0
// CudaScratch: device memory a CudaBackend reuses from call to call (sum_to's per-item sums and CUB's temporary
// storage), so that a call in the steady state allocates nothing: with the default pool's release threshold (0) the
// pool is trimmed at every synchronisation, and a per-call cudaMallocAsync would then map fresh memory each step.
//
//   lease(bytes, stream)   at least `bytes` of it for the work the caller enqueues on `stream` while the lease lives.
//                          The block only grows (to twice its size, or to `bytes` if more), the old block freed and the
//                          new one allocated in stream order on the home stream (the backend's work stream); it is
//                          freed there when the CudaScratch ends. A growth while the home stream captures a CUDA
//                          graph throws tandem::error before anything is enqueued: captured, the allocation would be
//                          the graph's (mapped at each launch, and a graph holding an allocation it does not free
//                          cannot be launched again), while the scratch keeps its address for later calls.
//   ordering               the home stream is the scratch's one timeline. A lease on another stream makes that
//                          stream wait for the home stream first (an event) and, when the lease ends, the home stream
//                          wait for that stream's work: no two uses overlap, whichever streams they run on, and the
//                          final free comes after every use. Leases on the home stream cost no event at all. A lease
//                          on another stream throws, before anything is enqueued, where one of the two captures a
//                          CUDA graph and the other is not in that capture: the events cannot cross its boundary.
//   threads                a lease holds a mutex while the caller enqueues (not while the device runs the work), so
//                          one backend may be called from several threads.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <mutex>
#include <new>
#include <string>
#include <utility>

#include "tandem/backend/cuda/check.hpp"
#include "tandem/backend/cuda/device.hpp"

namespace tandem::detail {

class CudaScratch {
 public:
  /// Scratch of `device` whose timeline is `home` (a stream of that device, alive for as long as the scratch).
  CudaScratch(int device, cudaStream_t home) noexcept : device_(device), home_(home) {}
  CudaScratch(const CudaScratch&) = delete;
  CudaScratch& operator=(const CudaScratch&) = delete;
  ~CudaScratch() {
    const CudaDeviceGuard guard(device_, std::nothrow);
    if (data_) TANDEM_CUDA_LOG(cudaFreeAsync(data_, home_));
    if (event_) TANDEM_CUDA_LOG(cudaEventDestroy(event_));
  }

  /// The scratch for the work enqueued on one stream while it lives (see the file comment).
  class Lease {
   public:
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() {
      if (stream_ == owner_->home_) return;
      // The home stream (and so the next lease, a growth's free, the final free) waits for this lease's work.
      TANDEM_CUDA_LOG(cudaEventRecord(owner_->event_, stream_));
      TANDEM_CUDA_LOG(cudaStreamWaitEvent(owner_->home_, owner_->event_, 0));
    }
    void* data() const { return owner_->data_; }
    std::size_t bytes() const { return owner_->bytes_; }

   private:
    friend class CudaScratch;
    Lease(std::unique_lock<std::mutex> lock, CudaScratch* owner, cudaStream_t stream)
        : lock_(std::move(lock)), owner_(owner), stream_(stream) {}
    std::unique_lock<std::mutex> lock_;
    CudaScratch* owner_;
    cudaStream_t stream_;
  };

  /// At least `bytes` (> 0) for work on `stream`, a stream of this scratch's device. Call with that device current.
  [[nodiscard]] Lease lease(std::size_t bytes, cudaStream_t stream) {
    std::unique_lock lock(mutex_);
    if (stream != home_) check_same_capture(stream);
    if (bytes > bytes_) grow(bytes);
    if (stream != home_) {
      if (!event_) TANDEM_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
      TANDEM_CUDA_CHECK(cudaEventRecord(event_, home_));
      TANDEM_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0));
    }
    return Lease(std::move(lock), this, stream);
  }

  /// The bytes held now (0 before the first lease).
  std::size_t capacity() const {
    const std::lock_guard lock(mutex_);
    return bytes_;
  }

 private:
  /// Throws tandem::error, before anything is enqueued, where `stream` and the home stream are not in the same state of
  /// capture (one captures and the other does not, or they capture into different graphs): the lease's event would
  /// then order a captured stream against an eager one, which CUDA refuses and which invalidates the capture
  /// (cudaErrorStreamCaptureIsolation). Both eager, or both in one capture (the home stream joined to it), is fine.
  /// Also refused: a capture already invalidated (its id means nothing, and all work enqueued there fails), and the
  /// legacy default stream while a blocking stream of the device captures (CUDA's query answers
  /// cudaErrorStreamCaptureImplicit, leaving that capture valid: the legacy stream is unusable until it ends).
  void check_same_capture(cudaStream_t stream) const {
    const Capture mine = capture_of(stream), home = capture_of(home_);
    const auto where = [](const Capture& c, const char* active, const char* none) {
      switch (c.state) {
        case CaptureState::none:
          return none;
        case CaptureState::active:
          return active;
        case CaptureState::invalidated:
          return "is in a capture that an earlier error invalidated (end it)";
        case CaptureState::legacy_blocked:
          return "is the legacy default stream, which a blocking stream's capture of a CUDA graph makes unusable";
      }
      return none;
    };
    if (mine.state == home.state &&
        (mine.state == CaptureState::none || (mine.state == CaptureState::active && mine.id == home.id)))
      return;
    fail(std::string("tandem: sum_to on a stream that ") +
         where(mine, "is capturing a CUDA graph", "is not capturing") + " while the backend's stream " +
         where(home, mine.state == CaptureState::active ? "captures another graph" : "is capturing one",
               "is not capturing") +
         ": the scratch they share is ordered by an event between them, which cannot cross a capture's boundary; "
         "call it on the backend's stream (CudaBackend::stream()) or on a stream in the same capture as it");
  }

  enum class CaptureState { none, active, invalidated, legacy_blocked };
  struct Capture {
    CaptureState state;
    unsigned long long id;  // meaningful where active
  };
  static Capture capture_of(cudaStream_t stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    const cudaError_t rc = cudaStreamGetCaptureInfo(stream, &status, &id);
    if (rc == cudaErrorStreamCaptureImplicit) {
      (void)cudaGetLastError();  // the query's answer, not an error of the program's work: leave no trace of it
      return {CaptureState::legacy_blocked, 0};
    }
    TANDEM_CUDA_CHECK(rc);
    switch (status) {
      case cudaStreamCaptureStatusActive:
        return {CaptureState::active, id};
      case cudaStreamCaptureStatusInvalidated:
        return {CaptureState::invalidated, 0};
      default:
        return {CaptureState::none, 0};
    }
  }

  void grow(std::size_t bytes) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    TANDEM_CUDA_CHECK(cudaStreamIsCapturing(home_, &capture));
    if (capture != cudaStreamCaptureStatusNone)
      fail("tandem: sum_to needs " + std::to_string(bytes) + " bytes of scratch, more than the " +
           std::to_string(bytes_) +
           " it holds, while the backend's stream is capturing a CUDA graph, which would own the new block; "
           "make the same call once before the capture (a step: one eager step first, docs/cuda.md)");
    constexpr std::size_t granule = 4096;
    const std::size_t want = (std::max(bytes, 2 * bytes_) + granule - 1) / granule * granule;
    if (data_) {
      void* old = std::exchange(data_, nullptr);
      bytes_ = 0;
      TANDEM_CUDA_CHECK(cudaFreeAsync(old, home_));
    }
    void* p = nullptr;
    TANDEM_CUDA_CHECK(cudaMallocAsync(&p, want, home_));
    data_ = p;
    bytes_ = want;
  }

  int device_;
  cudaStream_t home_;
  mutable std::mutex mutex_;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  cudaEvent_t event_ = nullptr;  // orders leases on other streams against the home stream
};

}  // namespace tandem::detail
