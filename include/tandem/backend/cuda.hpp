// SPDX-License-Identifier: Apache-2.0
// The CUDA backend: the interface DataParallel uses from HostBackend (Buffer<T>, allocate, zero, copy, launch,
// sum), plus what only a device needs: its own work stream, events, and a read back to the host.
//
//   device    a backend belongs to one device (CudaBackendOptions::device, or the current one at construction) and
//             never changes the calling thread's current device: each call makes its device current for the CUDA
//             calls it makes and restores the caller's (detail::CudaDeviceGuard; no cudaSetDevice where the device
//             is current already). Buffers and events it made free themselves on that device the same way.
//   memory    stream-ordered (cudaMallocAsync / cudaFreeAsync on the backend's stream, from the device's pool)
//   launch    launch_shape(items, resident_blocks<Body>(), lanes_of<Body>()) blocks of block_threads threads, a
//             warp per item unless the body asks for fewer lanes (backend/launch.hpp, the mapping host tests
//             emulate): the warp's threads (or its slot's) are the body's lanes.
//             resident_blocks is the blocks of that kernel the device keeps resident at once (its occupancy, asked of
//             the runtime once per kernel), so a launch is one wave and a larger one strides. The __global__ wrappers
//             below only forward: every computation is in the host+device bodies. With
//             CudaBackendOptions::programmatic_launch (on by default) a launch on a device of compute capability 9.0 or
//             newer is programmatic (the launch attribute cudaLaunchAttributeProgrammaticStreamSerialization): its
//             blocks may be scheduled while the previous kernel on the stream drains, and each waits
//             (griddepcontrol.wait) until that kernel has completed and its writes are visible before it touches
//             memory, so the order is a plain launch's (a kernel compiled for a virtual architecture below 9.0 has no
//             such wait, and is launched plainly: waits_for_prior). It hides about 1 us of the 2.5-3.4 us each launch
//             costs beyond its bytes on an H200 (docs/cuda.md).
//   sum_to    deterministic, no atomics: one block per item (reduction_shape) reduces the lane partials with
//             cub::BlockReduce into a per-item double, then cub::DeviceReduce::Sum (two-pass, run-to-run
//             deterministic) adds the item sums into *out; everything on the stream, nothing read back. Allocation-free
//             in the steady state: the item sums and CUB's temporary storage live in scratch the backend keeps
//             (detail::CudaScratch): it grows (stream-ordered, on the backend's stream) only when a call needs more
//             than any call before, is never trimmed, is reused in stream order whichever stream a call names, and
//             is freed with the backend. So a training loop allocates for clipping in its first step only, and the
//             launches can be captured in a CUDA graph once the scratch has its size: on the backend's stream, or on
//             another stream in the same capture as it (a call on a stream that captures while the backend's does
//             not, or the reverse, throws, as the events that order the scratch cannot cross a capture). sum()
//             (tests, tools) still allocates its 8-byte result per call.
//   waits     read() and synchronize() never block in cudaStreamSynchronize: they record an event and poll it with
//             a back-off (detail::wait_event: spin, then yield, then ~50 us sleeps) for at most
//             CudaBackendOptions::timeout, then throw tandem::timeout_error naming the call, the device and the
//             bytes. A stream stuck behind a collective whose peers never arrive ends in that error, not a hang.
//             read() waits for the stream to reach the copy before it enqueues it (a copy to pageable memory would
//             otherwise block inside cudaMemcpyAsync), so on a timeout nothing was copied.
//   events    cudaEvent_t with timing disabled: record(event, stream) and wait(stream, event) order streams.
//   threads   calls may come from any thread, also several at once (the cached scratch and wait events are locked
//             while a call enqueues); the streams passed must belong to the backend's device.
//
// Each call takes the stream last; Stream{} (a null handle) is CUDA's default stream of the backend's device. A
// host_queue Stream (the stream-faithful host backend's HostStream) is refused with tandem::error.
#pragma once

#if !defined(__CUDACC__)
#error "tandem/backend/cuda.hpp holds CUDA kernels: compile this translation unit with nvcc (a .cu file)"
#endif

#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/device/device_reduce.cuh>
#include <memory>
#include <new>
#include <string>
#include <utility>

#include "tandem/backend/cuda/check.hpp"
#include "tandem/backend/cuda/device.hpp"
#include "tandem/backend/cuda/scratch.hpp"
#include "tandem/backend/cuda/stream.hpp"
#include "tandem/backend/cuda/wait.hpp"
#include "tandem/backend/launch.hpp"
#include "tandem/core/config.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/stream.hpp"

/// Kernels get hidden visibility: template instantiations in several shared objects must not collide.
#define TANDEM_KERNEL __global__ __attribute__((visibility("hidden")))

namespace tandem {

namespace detail {

/// This thread's part of a launch of Body over `items`: body(item, lane, lanes) for each item its slot of
/// lanes_of<Body>() threads visits (for_each_item_of_slot).
template <class Body>
__device__ void run_slot_items(const Body& body, std::size_t items) {
  constexpr unsigned lanes = lanes_of<Body>();
  const unsigned lane = threadIdx.x % lanes;
  for_each_item_of_slot(blockIdx.x, threadIdx.x / lanes, gridDim.x, items, lanes,
                        [&](std::size_t item) { body(item, lane, lanes); });
}

/// The launch wrapper of every kernel body: forwards (block, slot, thread) to body(item, lane, lanes), lanes_of<Body>()
/// threads (a warp, unless the body says) per item. __launch_bounds__: every launch uses block_threads threads, which
/// the compiler allocates registers for.
template <class Body>
TANDEM_KERNEL void __launch_bounds__(block_threads) run_items(Body body, std::size_t items) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // In a programmatic launch (CudaBackend::launch) the next kernel may be scheduled now, and this one waits for the
  // previous kernel's completion and writes before it reads or writes anything. In a plain launch both do nothing
  // (PTX ISA: .wait waits for the prerequisite grids in flight, .launch_dependents signals the dependents the runtime
  // designated; a plain launch has neither), so one kernel serves both.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  run_slot_items(body, items);
}

/// item_sums[item] = the sum over the block's lanes of body(item, lane, lanes), a fixed reduction tree.
template <class Body>
TANDEM_KERNEL void __launch_bounds__(block_threads) sum_items(Body body, std::size_t items, double* item_sums) {
  using Reduce = cub::BlockReduce<double, block_threads>;
  __shared__ typename Reduce::TempStorage temp;
  for_each_item_of_block(blockIdx.x, gridDim.x, items, [&](std::size_t item) {
    const double total = Reduce(temp).Sum(body(item, threadIdx.x, blockDim.x));
    if (threadIdx.x == 0) item_sums[item] = total;
    __syncthreads();  // temp is reused by the block's next item
  });
}

/// kernel<<<shape, stream>>>(args...), with programmatic stream serialization where `programmatic`
/// (CudaBackend::launch: the kernel may start while the one before it on the stream ends, and waits for it with
/// griddepcontrol.wait).
template <class... Params, class... Args>
void launch_kernel(void (*kernel)(Params...), LaunchShape shape, cudaStream_t stream, bool programmatic,
                   Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(shape.grid);
  config.blockDim = dim3(shape.block);
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = programmatic ? 1 : 0;
  TANDEM_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace detail

/// An owning, typed device allocation, freed in order on the stream it was allocated on, with its device current.
template <class T>
class CudaBuffer {
 public:
  CudaBuffer() = default;
  /// n elements on the current device, allocated in order on `stream` (a stream of that device).
  CudaBuffer(std::size_t n, Stream stream) : CudaBuffer(n, stream, detail::current_device()) {}
  /// n elements on `device`, allocated in order on `stream` (a stream of that device).
  CudaBuffer(std::size_t n, Stream stream, int device) : size_(n), stream_(stream), device_(device) {
    if (n == 0) return;
    const cudaStream_t s = detail::native(stream);
    const detail::CudaDeviceGuard guard(device);
    void* p = nullptr;
    TANDEM_CUDA_CHECK(cudaMallocAsync(&p, n * sizeof(T), s));
    data_ = static_cast<T*>(p);
  }
  CudaBuffer(CudaBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)),
        stream_(o.stream_),
        device_(o.device_) {}
  CudaBuffer& operator=(CudaBuffer&& o) noexcept {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      stream_ = o.stream_;
      device_ = o.device_;
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
    if (data_) {
      const detail::CudaDeviceGuard guard(device_, std::nothrow);
      TANDEM_CUDA_LOG(cudaFreeAsync(data_, static_cast<cudaStream_t>(stream_.handle)));  // native: checked at birth
    }
    data_ = nullptr;
  }
  T* data_ = nullptr;
  std::size_t size_ = 0;
  Stream stream_;
  int device_ = -1;
};

/// An event for ordering streams (timing disabled), made on and destroyed with its device current.
class CudaEvent {
 public:
  /// An event of the current device.
  CudaEvent() : CudaEvent(-1) {}
  /// An event of `device` (-1: the current device).
  explicit CudaEvent(int device) : device_(device) {
    if (device_ < 0) device_ = detail::current_device();
    const detail::CudaDeviceGuard guard(device_);
    TANDEM_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }
  CudaEvent(CudaEvent&& o) noexcept : event_(std::exchange(o.event_, nullptr)), device_(o.device_) {}
  CudaEvent& operator=(CudaEvent&& o) noexcept {
    std::swap(event_, o.event_);
    std::swap(device_, o.device_);
    return *this;
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  ~CudaEvent() {
    if (!event_) return;
    const detail::CudaDeviceGuard guard(device_, std::nothrow);
    TANDEM_CUDA_LOG(cudaEventDestroy(event_));
  }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
  int device_ = -1;
};

struct CudaBackendOptions {
  int device = -1;     ///< the device to use (-1: the calling thread's current device at construction)
  Stream stream = {};  ///< tandem's work stream (null: the backend creates a non-blocking stream and owns it)
  /// How long read() and synchronize() wait for a stream before they throw tandem::timeout_error (as
  /// LocalGroupOptions::timeout; milliseconds::max(): no bound).
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  /// Whether launch() uses programmatic dependent launch where the device has it (compute capability 9.0 or newer):
  /// the launch overlaps the previous kernel's end; the order of memory accesses is a plain launch's. On an H200 it
  /// made every pack, unpack and step() row of bench_cuda faster than plain launches (its /plain_launch rows).
  bool programmatic_launch = true;
};

namespace detail {

/// What a CudaBackend caches between calls: sum_to's scratch and the events read/synchronize wait on.
struct CudaBackendCache {
  CudaBackendCache(int device, cudaStream_t home) noexcept : scratch(device, home), events(device) {}
  CudaScratch scratch;
  CudaWaitEvents events;
};

}  // namespace detail

class CudaBackend {
 public:
  template <class T>
  using Buffer = CudaBuffer<T>;
  using Event = CudaEvent;

  /// Whether buffers are host memory (the host can read them without a copy).
  static constexpr bool host_memory = false;
  /// The pack tables a launch reads (kernels/pack.hpp): 512-element items, one list.
  static constexpr PackTableLayout pack_table_layout = cuda_pack_table_layout;

  CudaBackend() : CudaBackend(CudaBackendOptions{}) {}
  explicit CudaBackend(CudaBackendOptions options)
      : device_(options.device), stream_(options.stream), timeout_(options.timeout) {
    if (timeout_.count() <= 0)
      detail::fail("tandem: CudaBackend: `options.timeout` is " + std::to_string(timeout_.count()) +
                   " ms; pass a positive duration (std::chrono::milliseconds::max() for no bound)");
    cudaStream_t s = detail::native(stream_);
    if (device_ < 0) device_ = detail::current_device();
    const detail::CudaDeviceGuard guard(device_);
    int sms = 0;
    TANDEM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_));
    sms_ = static_cast<unsigned>(std::clamp(sms, 1, 1024));
    max_blocks_ = sms_ * (resident_threads_per_sm / block_threads);
    int major = 0;
    TANDEM_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_));
    programmatic_ = options.programmatic_launch && major >= 9;
    if (s == nullptr) {
      TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      stream_.handle = s;
      owns_stream_ = true;
    }
    try {
      cudaStream_t c = nullptr;
      TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&c, cudaStreamNonBlocking));
      comm_stream_.handle = c;
      cache_ = std::make_unique<detail::CudaBackendCache>(device_, s);
    } catch (...) {
      if (comm_stream_.handle != nullptr) TANDEM_CUDA_LOG(cudaStreamDestroy(detail::native(comm_stream_)));
      if (owns_stream_) TANDEM_CUDA_LOG(cudaStreamDestroy(s));
      throw;
    }
  }
  CudaBackend(CudaBackend&& o) noexcept
      : device_(o.device_),
        sms_(o.sms_),
        max_blocks_(o.max_blocks_),
        programmatic_(o.programmatic_),
        stream_(std::exchange(o.stream_, Stream{})),
        comm_stream_(std::exchange(o.comm_stream_, Stream{})),
        owns_stream_(std::exchange(o.owns_stream_, false)),
        timeout_(o.timeout_),
        cache_(std::move(o.cache_)) {}
  CudaBackend& operator=(CudaBackend&&) = delete;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;
  ~CudaBackend() {
    // Pending work on the stream still completes; buffers freed on it later stay valid (stream-ordered). The scratch
    // is freed on the stream before the stream is destroyed. A moved-from backend has nothing to free.
    if (!cache_ && !owns_stream_ && comm_stream_.handle == nullptr) return;
    const detail::CudaDeviceGuard guard(device_, std::nothrow);
    cache_.reset();
    if (comm_stream_.handle != nullptr)
      TANDEM_CUDA_LOG(cudaStreamDestroy(static_cast<cudaStream_t>(comm_stream_.handle)));
    if (owns_stream_) TANDEM_CUDA_LOG(cudaStreamDestroy(static_cast<cudaStream_t>(stream_.handle)));
  }

  static constexpr const char* name() { return "cuda"; }
  int device() const { return device_; }
  /// The blocks of Body's kernel the device keeps resident at once: its SMs x the blocks of it one SM holds (its
  /// occupancy: registers, threads), at most max_blocks(). launch() uses no more, so that a launch is one wave whose
  /// blocks stride to the end together: a grid larger than that leaves its last blocks to start as others end, and
  /// the launch's end with fewer warps in flight (the fp32 pack kernels keep 5 or 6 blocks per SM, not 8).
  /// Asked of the runtime once per kernel and device (cudaOccupancyMaxActiveBlocksPerMultiprocessor), kept after.
  template <class Body>
  unsigned resident_blocks() const {
    return resident_blocks_of<detail::run_items<Body>>();
  }
  /// resident_blocks() for any kernel of block_threads threads (a benchmark's own, say).
  template <auto kernel>
  unsigned resident_blocks_of() const {
    static PerDevice known;
    return once_per_device(known, [&] {
      int per_sm = 0;
      TANDEM_CUDA_CHECK(
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, static_cast<int>(block_threads), 0));
      return std::min(max_blocks_, sms_ * static_cast<unsigned>(std::max(per_sm, 1)));
    });
  }
  /// Whether run_items<Body>, as this device runs it, waits for the kernel before it (griddepcontrol.wait): only code
  /// compiled for a virtual architecture of 9.0 or newer has the wait. A binary built for 8.0 alone runs on a 9.0
  /// device from its compute_80 PTX, without it; launched programmatically, such a kernel would read what the kernel
  /// before it has not written yet, so launch() launches it plainly. Asked of the runtime once per kernel and device.
  template <class Body>
  bool waits_for_prior() const {
    return waits_for_prior_of<detail::run_items<Body>>();
  }
  /// waits_for_prior() for any kernel (a benchmark's own, whose wait is compiled under __CUDA_ARCH__ >= 900 too).
  template <auto kernel>
  bool waits_for_prior_of() const {
    static PerDevice known;  // 1: no, 2: yes
    return once_per_device(known, [&] {
             const detail::CudaDeviceGuard guard(device_);
             cudaFuncAttributes attributes{};
             TANDEM_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
             return attributes.ptxVersion >= 90 ? 2u : 1u;
           }) == 2;
  }
  /// The most blocks one launch uses: the blocks the device keeps resident at once (its SMs x resident_threads_per_sm
  /// / block_threads).
  unsigned max_blocks() const { return max_blocks_; }
  /// Whether launch() launches programmatically (CudaBackendOptions::programmatic_launch, on a 9.0 or newer device).
  bool programmatic() const { return programmatic_; }
  /// tandem's work stream: packs, updates, unpacks, allocations and frees are ordered on it.
  Stream stream() const { return stream_; }
  /// tandem's comm stream, which the backend creates (non-blocking) and owns: DataParallel runs its gradient
  /// reductions and parameter gathers there, beside the work stream, ordered against it by events (docs/cuda.md).
  Stream comm_stream() const { return comm_stream_; }
  /// How long read() and synchronize() wait (CudaBackendOptions::timeout).
  std::chrono::milliseconds timeout() const { return timeout_; }

  template <class T>
  Buffer<T> allocate(std::size_t n) const {
    return Buffer<T>(n, stream_, device_);
  }

  /// Copies `bytes` (device or host memory, either direction: unified addressing) in order on `stream`.
  void copy(void* dst, const void* src, std::size_t bytes, Stream stream = {}) const {
    const cudaStream_t s = detail::native(stream);
    if (bytes == 0 || dst == src) return;
    const detail::CudaDeviceGuard guard(device_);
    TANDEM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
  }

  void zero(void* dst, std::size_t bytes, Stream stream = {}) const {
    const cudaStream_t s = detail::native(stream);
    if (bytes == 0) return;
    const detail::CudaDeviceGuard guard(device_);
    TANDEM_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, s));
  }

  /// Copies `bytes` from device memory to the host and waits (bounded by timeout()) for `stream`, not the device, to
  /// reach it. First waits for the stream's earlier work, then copies: on a timeout_error nothing was copied and that
  /// work is still enqueued.
  void read(void* host, const void* src, std::size_t bytes, Stream stream = {}) const {
    const cudaStream_t s = detail::native(stream);
    const detail::CudaDeviceGuard guard(device_);
    const auto event = cache_->events.acquire();
    wait_for(event.get(), s, "read", bytes, WaitPoint::before_copy);
    if (bytes == 0 || host == src) return;
    TANDEM_CUDA_CHECK(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDefault, s));
    wait_for(event.get(), s, "read", bytes, WaitPoint::copy);  // pinned host memory: the copy is asynchronous
  }

  /// Runs body(item, lane, lanes) for every item: launch_shape(items, resident_blocks<Body>(), lanes_of<Body>())
  /// blocks, a warp per item unless the body asks for fewer lanes.
  template <class Body>
  void launch(std::size_t items, const Body& body, Stream stream = {}) const {
    const cudaStream_t s = detail::native(stream);
    if (items == 0) return;
    const detail::CudaDeviceGuard guard(device_);
    detail::launch_kernel(detail::run_items<Body>, launch_shape(items, resident_blocks<Body>(), lanes_of<Body>()), s,
                          programmatic_ && waits_for_prior<Body>(), body, items);
  }

  /// *out (device memory) = the sum over items of body(item, ...) (a double per item), deterministically. Allocates
  /// nothing once the backend's scratch is as large as the largest call before needed (see the file comment).
  template <class Body>
  void sum_to(std::size_t items, const Body& body, double* out, Stream stream = {}) const {
    const cudaStream_t s = detail::native(stream);
    const detail::CudaDeviceGuard guard(device_);
    if (items == 0) {
      TANDEM_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(double), s));
      return;
    }
    const LaunchShape shape = reduction_shape(items, max_blocks_);
    const auto n = static_cast<std::int64_t>(items);
    std::size_t temp_bytes = 0;  // CUB's size query: host arithmetic only, no memory touched
    TANDEM_CUDA_CHECK(cub::DeviceReduce::Sum(nullptr, temp_bytes, static_cast<double*>(nullptr), out, n, s));
    // scratch: [item sums, padded to 256 bytes][CUB temporary storage]
    const std::size_t sums_bytes = (items * sizeof(double) + 255) / 256 * 256;
    const detail::CudaScratch::Lease scratch = cache_->scratch.lease(sums_bytes + temp_bytes, s);
    auto* const item_sums = static_cast<double*>(scratch.data());
    void* const temp = static_cast<unsigned char*>(scratch.data()) + sums_bytes;
    detail::sum_items<Body><<<shape.grid, shape.block, 0, s>>>(body, items, item_sums);
    TANDEM_CUDA_CHECK(cudaGetLastError());
    TANDEM_CUDA_CHECK(cub::DeviceReduce::Sum(temp, temp_bytes, item_sums, out, n, s));
  }

  /// The sum of sum_to, read back to the host (waits for `stream`, as read() does).
  template <class Body>
  double sum(std::size_t items, const Body& body, Stream stream = {}) const {
    const Buffer<double> total(1, stream, device_);
    sum_to(items, body, total.data(), stream);
    double host = 0.0;
    read(&host, total.data(), sizeof host, stream);
    return host;
  }

  Event make_event() const { return Event(device_); }
  /// Marks the point `stream` has reached.
  void record(Event& event, Stream stream) const {
    const cudaStream_t s = detail::native(stream);
    const detail::CudaDeviceGuard guard(device_);
    TANDEM_CUDA_CHECK(cudaEventRecord(event.get(), s));
  }
  /// Makes later work on `stream` wait for `event` (as recorded at the time of this call); the host does not wait.
  void wait(Stream stream, const Event& event) const {
    const cudaStream_t s = detail::native(stream);
    const detail::CudaDeviceGuard guard(device_);
    TANDEM_CUDA_CHECK(cudaStreamWaitEvent(s, event.get(), 0));
  }
  /// Whether `stream` is capturing work into a CUDA graph (cudaStreamIsCapturing).
  bool capturing(Stream stream) const {
    const cudaStream_t s = detail::native(stream);
    if (s == nullptr) return false;  // the legacy default stream: tandem's calls never capture it
    const detail::CudaDeviceGuard guard(device_);
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    TANDEM_CUDA_CHECK(cudaStreamIsCapturing(s, &status));
    return status != cudaStreamCaptureStatusNone;  // active, or invalidated and not ended yet
  }

  /// Waits (bounded by timeout()) until `stream` has run the work enqueued on it so far.
  void synchronize(Stream stream = {}) const {
    const cudaStream_t s = detail::native(stream);
    const detail::CudaDeviceGuard guard(device_);
    const auto event = cache_->events.acquire();
    wait_for(event.get(), s, "synchronize", 0, WaitPoint::stream);
  }

 private:
  enum class WaitPoint { stream, before_copy, copy };

  /// Records `event` on `s` and waits for it, at most timeout(); throws tandem::timeout_error past it.
  void wait_for(cudaEvent_t event, cudaStream_t s, const char* call, std::size_t bytes, WaitPoint point) const {
    TANDEM_CUDA_CHECK(cudaEventRecord(event, s));
    if (!detail::wait_event(event, timeout_)) throw_timeout(call, bytes, point);
  }

  [[noreturn]] TANDEM_COLD void throw_timeout(const char* call, std::size_t bytes, WaitPoint point) const {
    std::string where = "tandem: CudaBackend::" + std::string(call);
    if (point != WaitPoint::stream) where += " of " + std::to_string(bytes) + " bytes";
    where += " on device " + std::to_string(device_);
    if (detail::error_rank() >= 0) where += " (rank " + std::to_string(detail::error_rank()) + ")";
    const std::string limit = std::to_string(timeout_.count()) + " ms (CudaBackendOptions::timeout)";
    if (point == WaitPoint::copy)
      throw timeout_error(where + ": the copy to host memory did not complete within " + limit +
                          "; it is still enqueued and may yet write to the host buffer");
    throw timeout_error(where + ": the stream's earlier work did not finish within " + limit +
                        ": a collective waiting for a rank that failed or never called it, or a kernel that does not "
                        "end. " +
                        (point == WaitPoint::before_copy ? "Nothing was copied; the" : "The") +
                        " work is still enqueued");
  }

  int device_ = -1;
  unsigned sms_ = 1;
  unsigned max_blocks_ = max_grid_blocks;
  /// What a kernel's query gave on each device ordinal (0: not asked yet); a query never gives 0.
  using PerDevice = std::array<std::atomic<unsigned>, 64>;
  /// known[device] as `ask()` gives it, asked once per device (every time on an ordinal past the table's).
  template <class Ask>
  unsigned once_per_device(PerDevice& known, const Ask& ask) const {
    const bool cached = device_ >= 0 && static_cast<std::size_t>(device_) < known.size();
    if (cached) {
      const unsigned value = known[static_cast<std::size_t>(device_)].load(std::memory_order_relaxed);
      if (value != 0) return value;
    }
    const unsigned value = ask();
    if (cached) known[static_cast<std::size_t>(device_)].store(value, std::memory_order_relaxed);
    return value;
  }

  bool programmatic_ = false;  // launch() is programmatic (options.programmatic_launch on a 9.0+ device)
  Stream stream_;
  Stream comm_stream_;  ///< always the backend's own
  bool owns_stream_ = false;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<detail::CudaBackendCache> cache_;
};

}  // namespace tandem
