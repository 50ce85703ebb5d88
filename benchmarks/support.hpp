// SPDX-License-Identifier: Apache-2.0
// What every host benchmark shares: the layouts the issues name (the GPT-2-124M tensor list, 10,000 x 1 KB,
// 100 x 1 MB), a user-side arena holding one buffer per tensor, and the copy ceiling (the faster of memcpy and a
// streaming copy) measured in the same binary so that every figure reads as a ratio.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "scaling/scaling_model.hpp"
#include "tandem/backend/host.hpp"
#include "tandem/core/error.hpp"

namespace bench {

/// Tensor sizes (elements) of a named layout: "gpt2" (148 tensors, 124,439,808 elements), "10000x1KB"
/// (10,000 fp32 tensors of 256 elements), "100x1MB" (100 fp32 tensors of 262,144 elements).
inline std::vector<std::size_t> layout(const std::string& name) {
  if (name == "10000x1KB") return std::vector<std::size_t>(10000, 256);
  if (name == "100x1MB") return std::vector<std::size_t>(100, 262144);
  if (name != "gpt2") tandem::detail::fail("bench: unknown layout " + name);
  std::vector<std::size_t> sizes;
  for (const auto& t : tandem::scaling::load_tensor_list(TANDEM_DATA_DIR "/gpt2_124m.tsv", name).tensors)
    sizes.push_back(t.numel);
  return sizes;
}

inline const char* layout_names[] = {"gpt2", "10000x1KB", "100x1MB"};

inline std::size_t total(const std::vector<std::size_t>& sizes) {
  std::size_t n = 0;
  for (std::size_t s : sizes) n += s;
  return n;
}

/// One user buffer per tensor, laid out back to back in one arena (each 64-byte aligned, like separate
/// allocations), filled with small values so no kernel sees denormals.
template <class T>
struct Arena {
  tandem::HostBuffer<T> storage;
  std::vector<void*> pointers;

  explicit Arena(const std::vector<std::size_t>& sizes) {
    std::size_t at = 0;
    std::vector<std::size_t> offsets;
    for (std::size_t n : sizes) {
      offsets.push_back(at);
      at += (n + 15) / 16 * 16;
    }
    storage = tandem::HostBuffer<T>(at);
    for (std::size_t e = 0; e < at; ++e) storage.data()[e] = T(0.001f * static_cast<float>(e % 1000));
    for (std::size_t o : offsets) pointers.push_back(storage.data() + o);
  }
};

/// dst[0, bytes) = src[0, bytes) with streaming (non-temporal) stores, 64 bytes at a time, where both are 16-byte
/// aligned on an x86 host (memcpy for the tail, and elsewhere). It writes every destination line without reading it
/// first, as tandem's host kernels do above 4 MiB (kernels/pack.hpp) and as glibc's memcpy does only far above that
/// (its non-temporal threshold: about 180 MiB on the development VM), so below that threshold memcpy alone moves
/// half again the memory traffic of such a kernel and is no ceiling for it.
inline void streaming_copy(void* dst, const void* src, std::size_t bytes) {
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  std::size_t done = 0;
#if defined(__SSE2__)
  if (reinterpret_cast<std::uintptr_t>(d) % 16 == 0 && reinterpret_cast<std::uintptr_t>(s) % 16 == 0) {
    for (; bytes - done >= 64; done += 64) {
      const __m128i a = _mm_load_si128(reinterpret_cast<const __m128i*>(s + done));
      const __m128i b = _mm_load_si128(reinterpret_cast<const __m128i*>(s + done + 16));
      const __m128i c = _mm_load_si128(reinterpret_cast<const __m128i*>(s + done + 32));
      const __m128i e = _mm_load_si128(reinterpret_cast<const __m128i*>(s + done + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + done), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + done + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + done + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + done + 48), e);
    }
    _mm_sfence();
  }
#endif
  std::memcpy(d + done, s + done, bytes - done);
}

/// The copies a ceiling is the faster of.
inline void (*const copies[])(void*, const void*, std::size_t) = {
    [](void* d, const void* s, std::size_t n) { std::memcpy(d, s, n); }, streaming_copy};

/// Seconds per copy of `bytes` between two buffers, the faster of memcpy and streaming_copy (best of a few runs of
/// each), measured now: each benchmark measures its ceiling right after itself, so both see the same machine state.
inline double copy_seconds(std::size_t bytes) {
  tandem::HostBuffer<unsigned char> a(bytes), b(bytes);
  std::memset(a.data(), 1, bytes);
  std::memset(b.data(), 2, bytes);
  const int inner = bytes < (std::size_t{1} << 24) ? 20 : 2;
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep)
    for (const auto copy : copies) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < inner; ++i) {
        copy(b.data(), a.data(), bytes);
        benchmark::ClobberMemory();
      }
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / inner);
    }
  return best;
}

/// Runs the benchmark loop, timing it, then reports bytes/s (`traffic_bytes` read + written per iteration)
/// and "x_copy": the copy ceiling's time for `copy_bytes` (copy_seconds), measured right after, over this kernel's
/// time per iteration (1.0: as fast as the faster of memcpy and a streaming copy of those bytes; the acceptance
/// ratios of docs/performance.md).
template <class F>
void run_against_copy(benchmark::State& state, std::size_t traffic_bytes, std::size_t copy_bytes, F&& iteration) {
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    iteration();
    benchmark::ClobberMemory();
  }
  const double per_iteration = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
                               static_cast<double>(state.iterations());
  state.SetBytesProcessed(
      static_cast<std::int64_t>(static_cast<double>(state.iterations()) * static_cast<double>(traffic_bytes)));
  state.counters["x_copy"] = copy_seconds(copy_bytes) / per_iteration;
}

/// Aggregate copy traffic (bytes read + written per second) of `threads` threads copying `bytes` each at once (each
/// copy repeated up to 64 MiB in all, so that small buffers are timed in the cache they fit in), the faster of memcpy
/// and streaming_copy, best of five runs of each, measured now: as copy_seconds, a benchmark measures its ceiling
/// right after itself.
inline double aggregate_copy_rate(int threads, std::size_t bytes) {
  std::vector<tandem::HostBuffer<unsigned char>> a, b;
  for (int t = 0; t < threads; ++t) {
    a.emplace_back(bytes);
    b.emplace_back(bytes);
    std::memset(a.back().data(), 1, bytes);
    std::memset(b.back().data(), 2, bytes);
  }
  const std::size_t inner = std::max<std::size_t>(1, (std::size_t{64} << 20) / std::max<std::size_t>(bytes, 1));
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep)
    for (const auto copy_once : copies) {
      const auto copy = [&](int t) {
        for (std::size_t i = 0; i < inner; ++i) {
          copy_once(b[t].data(), a[t].data(), bytes);
          benchmark::ClobberMemory();
        }
      };
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<std::jthread> workers;
      for (int t = 1; t < threads; ++t) workers.emplace_back(copy, t);
      copy(0);
      workers.clear();
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  return 2.0 * static_cast<double>(bytes) * static_cast<double>(inner) * threads / best;
}

}  // namespace bench
