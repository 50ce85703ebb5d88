// SPDX-License-Identifier: Apache-2.0
// CudaDeviceGuard: makes a device current for a scope and restores the caller's device at its end, so that tandem's
// CUDA calls run on the device their objects belong to and never change which device the calling thread uses.
// Cheap where the device is already current (one cudaGetDevice, no cudaSetDevice either way).
#pragma once

#include <cuda_runtime.h>

#include <new>

#include "tandem/backend/cuda/check.hpp"

namespace tandem::detail {

/// The calling thread's current device.
inline int current_device() {
  int device = 0;
  TANDEM_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

class CudaDeviceGuard {
 public:
  /// Makes `device` current (a negative device: leaves the current one); throws tandem::cuda_error on failure.
  explicit CudaDeviceGuard(int device) {
    if (device < 0) return;
    TANDEM_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) {
      TANDEM_CUDA_CHECK(cudaSetDevice(device));
      restore_ = true;
    }
  }

  /// For destructors, which never throw: logs a failed call instead, and then leaves the device as it is.
  CudaDeviceGuard(int device, std::nothrow_t) noexcept {
    if (device < 0) return;
    const cudaError_t got = cudaGetDevice(&previous_);
    if (got != cudaSuccess) {
      log_cuda_error(got, "cudaGetDevice(&previous_)", __FILE__, __LINE__);
      return;
    }
    if (previous_ != device) {
      const cudaError_t set = cudaSetDevice(device);
      if (set != cudaSuccess)
        log_cuda_error(set, "cudaSetDevice(device)", __FILE__, __LINE__);
      else
        restore_ = true;
    }
  }

  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

  ~CudaDeviceGuard() {
    if (restore_) TANDEM_CUDA_LOG(cudaSetDevice(previous_));
  }

 private:
  int previous_ = 0;
  bool restore_ = false;
};

}  // namespace tandem::detail
