// SPDX-License-Identifier: Apache-2.0
// Compiler glue shared by every layer: host/device annotations, version.
#pragma once

#if defined(__CUDACC__)
#define TANDEM_HD __host__ __device__
#define TANDEM_DEVICE_COMPILE 1
#else
#define TANDEM_HD
#define TANDEM_DEVICE_COMPILE 0
#endif

#if defined(__CUDA_ARCH__)
#define TANDEM_UNROLL _Pragma("unroll")
#else
#define TANDEM_UNROLL
#endif

#if defined(__CUDA_ARCH__)
#define TANDEM_IN_DEVICE_CODE 1
#else
#define TANDEM_IN_DEVICE_CODE 0
#endif

#define TANDEM_VERSION_MAJOR 0
#define TANDEM_VERSION_MINOR 1
#define TANDEM_VERSION_PATCH 0

namespace tandem {

/// The library version as "major.minor.patch".
inline const char* version_string() { return "0.1.0"; }

}  // namespace tandem
