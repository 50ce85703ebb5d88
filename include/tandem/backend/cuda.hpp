// SPDX-License-Identifier: Apache-2.0
// The CUDA backend: the interface DataParallel uses from HostBackend (Buffer<T>, allocate, zero, copy, launch,
// sum), plus what only a device needs: its own work stream, events, and a read back to the host.
//
//   memory    stream-ordered (cudaMallocAsync / cudaFreeAsync on the backend's stream, from the device's pool)
//   launch    launch_shape(items) blocks of block_threads threads (backend/launch.hpp, the mapping host tests
//             emulate); block b runs items b, b + grid, ... and its threads are the body's lanes. The
//             __global__ wrappers below only forward: every computation is in the host+device bodies.
//   sum_to    deterministic, no atomics: one block per item reduces the lane partials with cub::BlockReduce
//             into a per-item double, then cub::DeviceReduce::Sum (two-pass, run-to-run deterministic) adds the
//             item sums into *out; everything on the stream, nothing read back.
//   events    cudaEvent_t with timing disabled: record(event, stream) and wait(stream, event) order streams.
//
// Each call takes the stream last; Stream{} (a null handle) is CUDA's default stream. A backend belongs to one
// device: call it from a thread whose current device is that device (the constructor makes it current).
#pragma once

#if !defined(__CUDACC__)
#error "tandem/backend/cuda.hpp holds CUDA kernels: compile this translation unit with nvcc (a .cu file)"
#endif

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/device/device_reduce.cuh>
#include <utility>

#include "tandem/backend/cuda/check.hpp"
#include "tandem/backend/launch.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/stream.hpp"

/// Kernels get hidden visibility: template instantiations in several shared objects must not collide.
#define TANDEM_KERNEL __global__ __attribute__((visibility("hidden")))

namespace tandem {

namespace detail {

inline cudaStream_t native(Stream s) { return static_cast<cudaStream_t>(s.handle); }

/// The launch wrapper of every kernel body: forwards (block, thread) to body(item, lane, lanes).
template <class Body>
TANDEM_KERNEL void run_items(Body body, std::size_t items) {
  for_each_item_of_block(blockIdx.x, gridDim.x, items, [&](std::size_t item) { body(item, threadIdx.x, blockDim.x); });
}

/// item_sums[item] = the sum over the block's lanes of body(item, lane, lanes), a fixed reduction tree.
template <class Body>
TANDEM_KERNEL void sum_items(Body body, std::size_t items, double* item_sums) {
  using Reduce = cub::BlockReduce<double, block_threads>;
  __shared__ typename Reduce::TempStorage temp;
  for_each_item_of_block(blockIdx.x, gridDim.x, items, [&](std::size_t item) {
    const double total = Reduce(temp).Sum(body(item, threadIdx.x, blockDim.x));
    if (threadIdx.x == 0) item_sums[item] = total;
    __syncthreads();  // temp is reused by the block's next item
  });
}

}  // namespace detail

/// An owning, typed device allocation, freed in order on the stream it was allocated on.
template <class T>
class CudaBuffer {
 public:
  CudaBuffer() = default;
  CudaBuffer(std::size_t n, Stream stream) : size_(n), stream_(stream) {
    if (n == 0) return;
    void* p = nullptr;
    TANDEM_CUDA_CHECK(cudaMallocAsync(&p, n * sizeof(T), detail::native(stream)));
    data_ = static_cast<T*>(p);
  }
  CudaBuffer(CudaBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)), stream_(o.stream_) {}
  CudaBuffer& operator=(CudaBuffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      stream_ = o.stream_;
    }
    return *this;
  }
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;
  ~CudaBuffer() { release(); }

  T* data() const { return data_; }
  std::size_t size() const { return size_; }
  std::size_t bytes() const { return size_ * sizeof(T); }

 private:
  void release() noexcept {
    if (data_) TANDEM_CUDA_LOG(cudaFreeAsync(data_, detail::native(stream_)));
    data_ = nullptr;
  }
  T* data_ = nullptr;
  std::size_t size_ = 0;
  Stream stream_;
};

/// An event for ordering streams (timing disabled).
class CudaEvent {
 public:
  CudaEvent() { TANDEM_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
  CudaEvent(CudaEvent&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
  CudaEvent& operator=(CudaEvent&& o) noexcept {
    std::swap(event_, o.event_);
    return *this;
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  ~CudaEvent() {
    if (event_) TANDEM_CUDA_LOG(cudaEventDestroy(event_));
  }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

struct CudaBackendOptions {
  int device = -1;     ///< the device to use (-1: the calling thread's current device)
  Stream stream = {};  ///< tandem's work stream (null: the backend creates a non-blocking stream and owns it)
};

class CudaBackend {
 public:
  template <class T>
  using Buffer = CudaBuffer<T>;
  using Event = CudaEvent;

  /// Whether buffers are host memory (the host can read them without a copy).
  static constexpr bool host_memory = false;

  CudaBackend() : CudaBackend(CudaBackendOptions{}) {}
  explicit CudaBackend(CudaBackendOptions options) : device_(options.device), stream_(options.stream) {
    if (device_ >= 0)
      TANDEM_CUDA_CHECK(cudaSetDevice(device_));
    else
      TANDEM_CUDA_CHECK(cudaGetDevice(&device_));
    if (stream_.handle == nullptr) {
      cudaStream_t s = nullptr;
      TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      stream_.handle = s;
      owns_stream_ = true;
    }
  }
  CudaBackend(CudaBackend&& o) noexcept
      : device_(o.device_),
        stream_(std::exchange(o.stream_, Stream{})),
        owns_stream_(std::exchange(o.owns_stream_, false)) {}
  CudaBackend& operator=(CudaBackend&&) = delete;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;
  ~CudaBackend() {
    // Pending work on the stream still completes; buffers freed on it later stay valid (stream-ordered).
    if (owns_stream_) TANDEM_CUDA_LOG(cudaStreamDestroy(detail::native(stream_)));
  }

  static constexpr const char* name() { return "cuda"; }
  int device() const { return device_; }
  /// tandem's work stream: packs, collectives, updates and unpacks are ordered on it.
  Stream stream() const { return stream_; }

  template <class T>
  Buffer<T> allocate(std::size_t n) const {
    return Buffer<T>(n, stream_);
  }

  /// Copies `bytes` (device or host memory, either direction: unified addressing) in order on `stream`.
  void copy(void* dst, const void* src, std::size_t bytes, Stream stream = {}) const {
    if (bytes != 0 && dst != src)
      TANDEM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, detail::native(stream)));
  }

  void zero(void* dst, std::size_t bytes, Stream stream = {}) const {
    if (bytes != 0) TANDEM_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, detail::native(stream)));
  }

  /// Copies `bytes` from device memory to the host and waits for `stream` (not the device) to reach it.
  void read(void* host, const void* src, std::size_t bytes, Stream stream = {}) const {
    copy(host, src, bytes, stream);
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(detail::native(stream)));
  }

  /// Runs body(item, lane, lanes) for every item: launch_shape(items) blocks, their threads the lanes.
  template <class Body>
  void launch(std::size_t items, const Body& body, Stream stream = {}) const {
    const LaunchShape shape = launch_shape(items);
    if (shape.grid == 0) return;
    detail::run_items<Body><<<shape.grid, shape.block, 0, detail::native(stream)>>>(body, items);
    TANDEM_CUDA_CHECK(cudaGetLastError());
  }

  /// *out (device memory) = the sum over items of body(item, ...) (a double per item), deterministically.
  template <class Body>
  void sum_to(std::size_t items, const Body& body, double* out, Stream stream = {}) const {
    const cudaStream_t s = detail::native(stream);
    if (items == 0) {
      TANDEM_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(double), s));
      return;
    }
    const LaunchShape shape = launch_shape(items);
    Buffer<double> item_sums(items, stream);
    detail::sum_items<Body><<<shape.grid, shape.block, 0, s>>>(body, items, item_sums.data());
    TANDEM_CUDA_CHECK(cudaGetLastError());
    const auto n = static_cast<std::int64_t>(items);
    std::size_t temp_bytes = 0;
    TANDEM_CUDA_CHECK(cub::DeviceReduce::Sum(nullptr, temp_bytes, item_sums.data(), out, n, s));
    Buffer<unsigned char> temp(temp_bytes, stream);
    TANDEM_CUDA_CHECK(cub::DeviceReduce::Sum(temp.data(), temp_bytes, item_sums.data(), out, n, s));
  }

  /// The sum of sum_to, read back to the host (waits for `stream`).
  template <class Body>
  double sum(std::size_t items, const Body& body, Stream stream = {}) const {
    Buffer<double> total(1, stream);
    sum_to(items, body, total.data(), stream);
    double host = 0.0;
    read(&host, total.data(), sizeof host, stream);
    return host;
  }

  Event make_event() const { return Event{}; }
  /// Marks the point `stream` has reached.
  void record(Event& event, Stream stream) const {
    TANDEM_CUDA_CHECK(cudaEventRecord(event.get(), detail::native(stream)));
  }
  /// Makes later work on `stream` wait for `event` (as recorded at the time of this call); the host does not wait.
  void wait(Stream stream, const Event& event) const {
    TANDEM_CUDA_CHECK(cudaStreamWaitEvent(detail::native(stream), event.get(), 0));
  }

  void synchronize(Stream stream = {}) const { TANDEM_CUDA_CHECK(cudaStreamSynchronize(detail::native(stream))); }

 private:
  int device_ = -1;
  Stream stream_;
  bool owns_stream_ = false;
};

}  // namespace tandem
