// SPDX-License-Identifier: Apache-2.0
// TANDEM_CUDA_CHECK(call): evaluates a CUDA runtime call once; on failure resets CUDA's last error (cudaGetLastError:
// an error that is not sticky; a sticky one, a kernel's illegal address say, stays with the context and every later
// call returns it) and throws tandem::cuda_error carrying the status, its name, the call text, file:line and the rank.
// visible_cuda_devices(): how many GPUs this process may use, 0 without a driver or device (not an error);
// cuda_device_fault(): why a machine with a driver can use none (a driver older than the runtime, say), "" otherwise.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <string>

#include "tandem/core/error.hpp"

namespace tandem::detail {

/// Throws tandem::cuda_error for a failed CUDA call. cudaGetLastError() resets the per-thread error state, so a
/// later, unrelated check does not report this failure again.
[[noreturn]] inline void throw_cuda_error(cudaError_t status, const char* call, const char* file, int line) {
  (void)cudaGetLastError();
  throw cuda_error(describe_failure("CUDA", static_cast<int>(status), cudaGetErrorName(status), call, file, line) +
                   ": " + cudaGetErrorString(status));
}

/// For destructors, which never throw: logs a failed call to stderr instead.
inline void log_cuda_error(cudaError_t status, const char* call, const char* file, int line) {
  (void)cudaGetLastError();
  const std::string what =
      describe_failure("CUDA", static_cast<int>(status), cudaGetErrorName(status), call, file, line);
  std::fprintf(stderr, "%s (ignored in a destructor)\n", what.c_str());
}

}  // namespace tandem::detail

namespace tandem {

/// The CUDA devices this process can use; 0 where there is no driver or no device, which is not an error here:
/// callers choose the host instead (or skip, in tests).
inline int visible_cuda_devices() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

/// Where visible_cuda_devices() is 0 although a CUDA driver is installed, why: the error counting the devices gave
/// ("cudaErrorInsufficientDriver: ... (driver API 12.4, runtime 13.0)"), a fault to report rather than the absence of
/// a GPU. "" where devices are visible, where none exists (cudaErrorNoDevice) and where no driver is installed.
inline std::string cuda_device_fault() {
  int n = 0;
  const cudaError_t status = cudaGetDeviceCount(&n);
  (void)cudaGetLastError();
  if (status == cudaSuccess || status == cudaErrorNoDevice) return "";
  int driver = 0, runtime = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
  if (cudaRuntimeGetVersion(&runtime) != cudaSuccess) runtime = 0;
  (void)cudaGetLastError();
  if (driver == 0) return "";  // no driver: a machine without a GPU
  const auto version = [](int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); };
  return std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status) + " (driver API " + version(driver) +
         ", runtime " + version(runtime) + ")";
}

}  // namespace tandem

#define TANDEM_CUDA_CHECK(call)                                                           \
  do {                                                                                    \
    const cudaError_t tandem_cuda_status_ = (call);                                       \
    if (tandem_cuda_status_ != cudaSuccess)                                               \
      ::tandem::detail::throw_cuda_error(tandem_cuda_status_, #call, __FILE__, __LINE__); \
  } while (0)

/// TANDEM_CUDA_CHECK for destructors: logs instead of throwing.
#define TANDEM_CUDA_LOG(call)                                                           \
  do {                                                                                  \
    const cudaError_t tandem_cuda_status_ = (call);                                     \
    if (tandem_cuda_status_ != cudaSuccess)                                             \
      ::tandem::detail::log_cuda_error(tandem_cuda_status_, #call, __FILE__, __LINE__); \
  } while (0)
