// SPDX-License-Identifier: Apache-2.0
// What the GPU tests (test_*.cu) share: device memory and a user stream, each freed at scope end. Synchronous
// allocation: the tests are not about the overlap of allocations.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "tandem/backend/cuda/check.hpp"
#include "tandem/core/stream.hpp"

namespace test {

/// `count` elements of T in device memory (and 16 more, for misaligned views).
template <class T>
struct Device {
  T* p = nullptr;
  std::size_t n = 0;
  explicit Device(std::size_t count) : n(count) { TANDEM_CUDA_CHECK(cudaMalloc(&p, (n + 16) * sizeof(T))); }
  ~Device() { cudaFree(p); }
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
  void upload(const T* host, std::size_t count, std::size_t at = 0) {
    TANDEM_CUDA_CHECK(cudaMemcpy(p + at, host, count * sizeof(T), cudaMemcpyHostToDevice));
  }
  void download(T* host, std::size_t count, std::size_t at = 0) const {
    TANDEM_CUDA_CHECK(cudaMemcpy(host, p + at, count * sizeof(T), cudaMemcpyDeviceToHost));
  }
};

/// A non-blocking stream of the user's.
struct UserStream {
  cudaStream_t s = nullptr;
  UserStream() { TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~UserStream() { cudaStreamDestroy(s); }
  UserStream(const UserStream&) = delete;
  UserStream& operator=(const UserStream&) = delete;
  tandem::Stream stream() const { return {s}; }
  void synchronize() const { TANDEM_CUDA_CHECK(cudaStreamSynchronize(s)); }
};

}  // namespace test
