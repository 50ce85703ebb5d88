// SPDX-License-Identifier: Apache-2.0
// The host backend: memory is ordinary (64-byte aligned) host memory, copies are memcpy, and launch() runs a
// kernel body over its work items in linear order, serially or split into contiguous ranges across threads.
// Work completes before each call returns, so streams and events are trivially satisfied: Event is empty and
// record/wait do nothing, which is what makes the CUDA backend's stream protocol no-op-correct here (its
// stream-faithful counterpart, StreamHostBackend in backend/host_stream.hpp, runs the protocol for real).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "tandem/backend/launch.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/stream.hpp"

namespace tandem {

namespace detail {

/// Runs part(context, p) for p = 0 .. parts-1: part 0 on the calling thread, the others on threads of their own, and
/// returns when all are done. Not a template, so a launch instantiates only its loop, not the thread machinery.
inline void run_parts(std::size_t parts, const void* context, void (*part)(const void*, std::size_t)) {
  std::vector<std::jthread> workers;
  workers.reserve(parts - 1);
  for (std::size_t p = 1; p < parts; ++p) workers.emplace_back(part, context, p);
  part(context, 0);
}

}  // namespace detail

/// An owning, typed, 64-byte aligned host allocation.
template <class T>
class HostBuffer {
 public:
  HostBuffer() = default;
  explicit HostBuffer(std::size_t n) : size_(n) {
    if (n == 0) return;
    constexpr std::size_t huge = std::size_t{2} << 20;
    if (n > (SIZE_MAX - huge) / sizeof(T)) throw std::bad_alloc();
    // Large buffers are aligned to 2 MiB and offered to transparent huge pages: tandem's kernels stream
    // through several of them at once, and 4 KiB pages would spend much of that time in page walks.
    const std::size_t align = n * sizeof(T) >= 2 * huge ? huge : 64;
    const std::size_t bytes = (n * sizeof(T) + align - 1) / align * align;
    data_.reset(static_cast<T*>(std::aligned_alloc(align, bytes)));
    if (!data_) throw std::bad_alloc();
#if defined(MADV_HUGEPAGE)
    if (align == huge) ::madvise(data_.get(), bytes, MADV_HUGEPAGE);  // a hint: failure changes nothing
#endif
  }
  T* data() const { return data_.get(); }
  std::size_t size() const { return size_; }
  std::size_t bytes() const { return size_ * sizeof(T); }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> data_;
  std::size_t size_ = 0;
};

struct HostBackendOptions {
  int threads = 1;  ///< threads one launch is split across (ranks that are threads usually want 1)
};

class HostBackend {
 public:
  template <class T>
  using Buffer = HostBuffer<T>;
  struct Event {};

  /// Whether buffers are host memory (the host can read them without a copy).
  static constexpr bool host_memory = true;

  HostBackend() = default;
  explicit HostBackend(HostBackendOptions options) : options_(options) {
    if (options_.threads < 1)
      detail::fail("tandem: HostBackendOptions::threads is " + std::to_string(options_.threads) +
                   "; it must be at least 1");
  }

  static constexpr const char* name() { return "host"; }
  /// tandem's work stream (the host has only one order: the calling thread's).
  Stream stream() const { return {}; }
  /// tandem's comm stream: the same order.
  Stream comm_stream() const { return {}; }

  template <class T>
  Buffer<T> allocate(std::size_t n) const {
    return Buffer<T>(n);
  }

  void copy(void* dst, const void* src, std::size_t bytes, Stream = {}) const {
    if (bytes != 0 && dst != src) std::memmove(dst, src, bytes);
  }

  void zero(void* dst, std::size_t bytes, Stream = {}) const {
    if (bytes != 0) std::memset(dst, 0, bytes);
  }

  /// Copies `bytes` of backend memory to the host (here: a copy).
  void read(void* host, const void* src, std::size_t bytes, Stream = {}) const { copy(host, src, bytes); }

  /// Runs body(item, 0, 1) for item = 0 .. items-1: in order on one thread, or in contiguous ranges.
  template <class Body>
  void launch(std::size_t items, const Body& body, Stream = {}) const {
    const std::size_t parts = std::min<std::size_t>(static_cast<std::size_t>(options_.threads), items);
    if (parts <= 1) {
      for (std::size_t i = 0; i < items; ++i) body(i, 0u, 1u);
      detail::stream_fence();  // order any streaming stores before what follows
      return;
    }
    struct Split {
      const Body* body;
      std::size_t items, parts;
    };
    const Split split{&body, items, parts};
    detail::run_parts(parts, &split, [](const void* context, std::size_t p) {
      const Split& s = *static_cast<const Split*>(context);
      const std::size_t begin = s.items * p / s.parts, end = s.items * (p + 1) / s.parts;
      for (std::size_t i = begin; i < end; ++i) (*s.body)(i, 0u, 1u);
      detail::stream_fence();
    });
  }

  /// Returns the sum over items of body(item, 0, 1) (a double), added in item order: deterministic.
  template <class Body>
  double sum(std::size_t items, const Body& body, Stream = {}) const {
    double total = 0.0;
    for (std::size_t i = 0; i < items; ++i) total += body(i, 0u, 1u);
    return total;
  }

  /// *out = sum(items, body): the same additions in the same order.
  template <class Body>
  void sum_to(std::size_t items, const Body& body, double* out, Stream = {}) const {
    *out = sum(items, body);
  }

  Event make_event() const { return {}; }
  /// Nothing to order: work is done when its call returns. A HostStream (StreamHostBackend's) is refused here, since
  /// work enqueued on it would race with this backend's.
  void record(Event&, Stream s) const { check_stream(s); }
  void wait(Stream s, const Event&) const { check_stream(s); }

  void synchronize(Stream = {}) const {}
  /// Whether `s` is capturing work (never: there is nothing to capture).
  bool capturing(Stream) const { return false; }

  const HostBackendOptions& options() const { return options_; }

 private:
  static void check_stream(Stream s) {
    if (s.handle != nullptr && s.kind == StreamKind::host_queue)
      detail::fail(
          "tandem: HostBackend was given a HostStream; HostBackend runs work on the calling thread, so work "
          "on a HostStream would race with it: use StreamHostBackend (backend/host_stream.hpp), or Stream{}");
  }
  HostBackendOptions options_;
};

}  // namespace tandem
