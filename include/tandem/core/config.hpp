// SPDX-License-Identifier: Apache-2.0
// Compiler glue shared by every layer: host/device annotations, what the host must be, version.
#pragma once

// One line that says what is wrong, before the errors a C++17 compile of the headers would give (nvcc's default is
// C++17: CMake's tandem::cuda asks for -std=c++20; a build without CMake passes it).
#if defined(__cplusplus) && __cplusplus < 201709L && !defined(_MSVC_LANG)  // (GCC 10's -std=c++20 says 201709)
#error "tandem needs C++20: compile with -std=c++20 (nvcc too)"
#endif

#include <bit>

// tandem's files (checkpoint shards and manifests, rendezvous blobs) are little-endian, as safetensors is, and tandem
// writes and reads their numbers as the host's bytes (CRC-32C's tables too): a big-endian host is refused here, rather
// than writing files that no other host reads.
static_assert(std::endian::native == std::endian::little, "tandem needs a little-endian host: its files are");

#if defined(__CUDACC__)
#define TANDEM_HD __host__ __device__
#define TANDEM_DEVICE_COMPILE 1
#else
#define TANDEM_HD
#define TANDEM_DEVICE_COMPILE 0
#endif

// Unrolls the loop it precedes, whose trip count is a constant (a vector group's elements): on the host too, where
// GCC at -O2 unrolls no such loop, and then vectorizes a group's elements as one vector no more (the host's pack ran
// at half the speed of -O3's, element by element).
// nvcc's host pass takes neither: its front end refuses GCC's pragma, and passes "unroll" to a host compiler that
// does not know it.
#if defined(__CUDA_ARCH__) || (defined(__clang__) && !defined(__CUDACC__))
#define TANDEM_UNROLL _Pragma("unroll")
#elif defined(__GNUC__) && !defined(__CUDACC__)
#define TANDEM_UNROLL _Pragma("GCC unroll 16")
#else
#define TANDEM_UNROLL
#endif
// Unrolls the loop it precedes on the device only (a host loop that GCC runs faster rolled).
#if defined(__CUDA_ARCH__)
#define TANDEM_DEVICE_UNROLL _Pragma("unroll")
#else
#define TANDEM_DEVICE_UNROLL
#endif

// Marks host code that runs once or only on failure (construction, validation, error messages, checkpoint I/O): the
// compiler optimizes it for size and keeps it out of the hot paths' way. Most of a header-only library's compile
// time is code generation of such code in every translation unit that uses it.
#if defined(__GNUC__) || defined(__clang__)
#define TANDEM_COLD [[gnu::cold]]
#else
#define TANDEM_COLD
#endif

// A pointer through which alone its object is reached in the pointer's scope (C's restrict): kernel bodies qualify the
// arrays they walk, so loads and stores of different arrays need not be ordered.
#if defined(__CUDACC__) || defined(__GNUC__) || defined(__clang__)
#define TANDEM_RESTRICT __restrict__
#elif defined(_MSC_VER)
#define TANDEM_RESTRICT __restrict
#else
#define TANDEM_RESTRICT
#endif

#if defined(__CUDA_ARCH__)
#define TANDEM_IN_DEVICE_CODE 1
#else
#define TANDEM_IN_DEVICE_CODE 0
#endif

// 1 in host code built for x86 with SSE2 (every x86-64 compiler's baseline): the host backend's streaming stores and
// 16-bit vector conversions use its intrinsics; 0 elsewhere, where they fall back to plain code.
#if !defined(__CUDA_ARCH__) && defined(__SSE2__)
#define TANDEM_HOST_SSE2 1
#else
#define TANDEM_HOST_SSE2 0
#endif

// 1 where TANDEM_HOST_SSE2 is and the build targets F16C (-mf16c, or -march=x86-64-v3 or -march=native on an x86-64
// CPU of 2012 or later): the host's fp16 conversions of eight elements at a time use its instructions (the fp32 -> fp16
// pack and AdamW with fp16 parameters about 2.5x as fast as with SSE2's integer forms: docs/design.md); 0 elsewhere.
// Compile-time only: a build without the flag runs on every x86-64 CPU. Give every translation unit of a program that
// includes tandem the same flag: the inline conversions differ with it (to the same bits), and the linker keeps one.
#if TANDEM_HOST_SSE2 && defined(__F16C__)
#define TANDEM_HOST_F16C 1
#else
#define TANDEM_HOST_F16C 0
#endif

// The one place of tandem's version: CMakeLists.txt reads these three lines.
#define TANDEM_VERSION_MAJOR 0
#define TANDEM_VERSION_MINOR 1
#define TANDEM_VERSION_PATCH 0

#define TANDEM_DETAIL_STRINGIFY_(x) #x
#define TANDEM_DETAIL_STRINGIFY(x) TANDEM_DETAIL_STRINGIFY_(x)
/// The library version as a string literal, "major.minor.patch".
#define TANDEM_VERSION_STRING                   \
  TANDEM_DETAIL_STRINGIFY(TANDEM_VERSION_MAJOR) \
  "." TANDEM_DETAIL_STRINGIFY(TANDEM_VERSION_MINOR) "." TANDEM_DETAIL_STRINGIFY(TANDEM_VERSION_PATCH)

namespace tandem {

/// The library version as "major.minor.patch".
inline const char* version_string() { return TANDEM_VERSION_STRING; }

}  // namespace tandem
