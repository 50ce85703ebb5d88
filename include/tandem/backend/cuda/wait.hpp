// SPDX-License-Identifier: Apache-2.0
// Bounded host waits for the device, the one implementation CudaBackend (read, synchronize) and Nccl (barrier,
// wait_stream, initialisation, teardown) use instead of cudaStreamSynchronize, which can block forever behind a
// collective whose peers never arrive.
//
//   poll_until(timeout, ready)          calls ready() until it holds (true) or `timeout` has passed (false), backing
//                                       off: back to back for cuda_poll_spin_time, then yielding the core between
//                                       calls until cuda_poll_yield_time, then sleeping cuda_poll_sleep_time between
//                                       calls. A short wait (a small kernel, a copy) ends within a microsecond or so;
//                                       a long one (a step's collectives) costs one core a wake-up every ~50 us and
//                                       adds at most that much to the wait.
//   wait_event(event, timeout, poll)    poll_until over cudaEventQuery(event); poll() runs after each query that
//                                       found the event pending (Nccl checks ncclCommGetAsyncError there) and may
//                                       throw. A CUDA error the query reports throws tandem::cuda_error.
//
//   CudaWaitEvents                      the events a CudaBackend waits on, reused: acquire() hands one out (made
//                                       on the first need), its handle gives it back; thread-safe.
//
// The caller records the event where it wants to wait (the point its stream has reached), so work enqueued on the
// stream later, by any thread, is not waited for; and it turns a `false` into the timeout_error naming what it
// waited for.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <mutex>
#include <new>
#include <thread>
#include <utility>
#include <vector>

#include "tandem/backend/cuda/check.hpp"
#include "tandem/backend/cuda/device.hpp"
#include "tandem/core/deadline.hpp"

namespace tandem::detail {

inline constexpr std::chrono::microseconds cuda_poll_spin_time{20};
inline constexpr std::chrono::microseconds cuda_poll_yield_time{200};
inline constexpr std::chrono::microseconds cuda_poll_sleep_time{50};

/// Calls ready() until it returns true (then returns true) or until `timeout` has passed since the call (then
/// returns false, after one last call). ready() may throw; the exception passes through. A timeout too long for the
/// clock (milliseconds::max(), say) never ends the wait.
template <class Ready>
bool poll_until(std::chrono::milliseconds timeout, Ready&& ready) {
  using clock = std::chrono::steady_clock;
  const clock::time_point start = clock::now();
  const clock::time_point deadline = deadline_after(start, timeout);
  for (;;) {
    if (ready()) return true;
    const clock::time_point now = clock::now();
    if (now >= deadline) return ready();
    const clock::duration waited = now - start;
    if (waited < cuda_poll_spin_time) continue;
    if (waited < cuda_poll_yield_time)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(cuda_poll_sleep_time);
  }
}

/// Waits until `event` (recorded by the caller) has completed: true, or false once `timeout` has passed. poll() runs
/// after every query that found the event pending. The caller makes the event's device current.
template <class Poll>
bool wait_event(cudaEvent_t event, std::chrono::milliseconds timeout, Poll&& poll) {
  return poll_until(timeout, [&] {
    const cudaError_t status = cudaEventQuery(event);
    if (status == cudaSuccess) return true;
    if (status != cudaErrorNotReady) throw_cuda_error(status, "cudaEventQuery(event)", __FILE__, __LINE__);
    poll();
    return false;
  });
}

/// wait_event with nothing to check between queries.
inline bool wait_event(cudaEvent_t event, std::chrono::milliseconds timeout) {
  return wait_event(event, timeout, [] {});
}

/// Events (timing disabled) of one device for host waits, reused from wait to wait.
class CudaWaitEvents {
 public:
  explicit CudaWaitEvents(int device) noexcept : device_(device) {}
  CudaWaitEvents(const CudaWaitEvents&) = delete;
  CudaWaitEvents& operator=(const CudaWaitEvents&) = delete;
  ~CudaWaitEvents() {
    const CudaDeviceGuard guard(device_, std::nothrow);
    for (cudaEvent_t e : free_) TANDEM_CUDA_LOG(cudaEventDestroy(e));
  }

  /// One event, the caller's alone until the handle ends.
  class Handle {
   public:
    Handle(const Handle&) = delete;
    Handle& operator=(const Handle&) = delete;
    ~Handle() { owner_->give_back(event_); }
    cudaEvent_t get() const { return event_; }

   private:
    friend class CudaWaitEvents;
    Handle(CudaWaitEvents* owner, cudaEvent_t event) noexcept : owner_(owner), event_(event) {}
    CudaWaitEvents* owner_;
    cudaEvent_t event_;
  };

  /// An event of this device; call with the device current.
  [[nodiscard]] Handle acquire() {
    {
      const std::lock_guard lock(mutex_);
      if (!free_.empty()) {
        const cudaEvent_t e = free_.back();
        free_.pop_back();
        return Handle(this, e);
      }
    }
    cudaEvent_t e = nullptr;
    TANDEM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return Handle(this, e);
  }

 private:
  void give_back(cudaEvent_t e) noexcept {
    try {
      const std::lock_guard lock(mutex_);
      free_.push_back(e);
      return;
    } catch (...) {  // no memory to keep it: destroy it instead
    }
    const CudaDeviceGuard guard(device_, std::nothrow);
    TANDEM_CUDA_LOG(cudaEventDestroy(e));
  }

  int device_;
  std::mutex mutex_;
  std::vector<cudaEvent_t> free_;
};

}  // namespace tandem::detail
