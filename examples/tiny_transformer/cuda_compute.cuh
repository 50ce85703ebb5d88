// SPDX-License-Identifier: Apache-2.0
// CudaCompute: compute.hpp's interface on a GPU. Every item body of ops.hpp runs as one CUDA thread per item
// (grid-stride, so any item count fits one launch); the matrix products are cuBLAS's (row-major through the
// usual swap: C = op(A) op(B) row-major is C^T = op(B)^T op(A)^T column-major). Nothing here computes: the
// arithmetic is in ops.hpp, shared with the host, and in cuBLAS.
//
// Everything runs in order on the compute's own stream, which DataParallel is given as the user's stream, so
// tandem's step is ordered after backward and the next forward after the step. cuBLAS's default math mode is
// kept: fp32 products in fp32 (no TF32), which is what lets the GPU match the host's loss.
#pragma once

#if !defined(__CUDACC__)
#error "cuda_compute.cuh launches kernels: include it from a .cu file"
#endif

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>

#include "blas.hpp"
#include "ops.hpp"
#include "tandem/backend/cuda.hpp"

namespace tiny {

[[noreturn]] inline void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line) {
  throw tandem::cuda_error("cuBLAS error " + std::to_string(int(status)) + " (" + cublasGetStatusString(status) +
                           ") in " + call + " at " + file + ":" + std::to_string(line));
}

#define TINY_CUBLAS_CHECK(call)                                                                                     \
  do {                                                                                                              \
    const cublasStatus_t tiny_status_ = (call);                                                                     \
    if (tiny_status_ != CUBLAS_STATUS_SUCCESS) ::tiny::throw_cublas_error(tiny_status_, #call, __FILE__, __LINE__); \
  } while (0)

namespace detail {

template <class Body>
__global__ void for_each_item(Body body, std::size_t items) {
  const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
  for (std::size_t i = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < items; i += stride) body(i);
}

template <class T>
struct Fill {
  T* p;
  T value;
  __device__ void operator()(std::size_t i) const { p[i] = value; }
};

inline cublasOperation_t cublas_op(Trans t) { return t == Trans::yes ? CUBLAS_OP_T : CUBLAS_OP_N; }

}  // namespace detail

class CudaCompute {
 public:
  using Backend = tandem::CudaBackend;
  template <class T>
  using Array = tandem::CudaBuffer<T>;  // stream-ordered, freed in order on the compute's stream
  static constexpr bool host_memory = false;
  static constexpr const char* name() { return "cuda"; }
  static constexpr unsigned threads = 256;

  /// Works on `device` (made current for the calling thread) on a new non-blocking stream.
  explicit CudaCompute(int device) : device_(device) {
    TANDEM_CUDA_CHECK(cudaSetDevice(device));
    cudaStream_t s = nullptr;
    TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    stream_ = s;
    TINY_CUBLAS_CHECK(cublasCreate(&blas_));
    TINY_CUBLAS_CHECK(cublasSetStream(blas_, stream_));
  }
  CudaCompute(CudaCompute&& o) noexcept
      : device_(o.device_),
        stream_(std::exchange(o.stream_, nullptr)),
        blas_(std::exchange(o.blas_, nullptr)),
        ones_(std::move(o.ones_)) {}
  CudaCompute& operator=(CudaCompute&&) = delete;
  CudaCompute(const CudaCompute&) = delete;
  CudaCompute& operator=(const CudaCompute&) = delete;
  ~CudaCompute() {
    ones_ = {};  // freed on the stream, before the stream goes
    if (stream_) TANDEM_CUDA_LOG(cudaStreamSynchronize(stream_));
    if (blas_) cublasDestroy(blas_);
    if (stream_) TANDEM_CUDA_LOG(cudaStreamDestroy(stream_));
  }

  /// n zeroed elements, allocated in order on the compute's stream (the previous ones freed on it).
  template <class T>
  void resize(Array<T>& a, std::size_t n) const {
    a = Array<T>(n, stream());
    zero(a.data(), n);
  }

  template <class T>
  void zero(T* p, std::size_t n) const {
    if (n) TANDEM_CUDA_CHECK(cudaMemsetAsync(p, 0, n * sizeof(T), stream_));
  }

  template <class Body>
  void for_each(std::size_t items, const Body& body) const {
    if (items == 0) return;
    const std::size_t blocks = std::min<std::size_t>((items + threads - 1) / threads, tandem::max_grid_blocks);
    detail::for_each_item<Body><<<unsigned(blocks), threads, 0, stream_>>>(body, items);
    TANDEM_CUDA_CHECK(cudaGetLastError());
  }

  void gemm(Trans ta, Trans tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b, int ldb,
            float beta, float* c, int ldc) const {
    TINY_CUBLAS_CHECK(cublasSgemm(blas_, detail::cublas_op(tb), detail::cublas_op(ta), n, m, k, &alpha, b, ldb, a, lda,
                                  &beta, c, ldc));
  }

  void gemm_batched(Trans ta, Trans tb, int m, int n, int k, float alpha, const float* a, int lda, std::size_t stride_a,
                    const float* b, int ldb, std::size_t stride_b, float beta, float* c, int ldc, std::size_t stride_c,
                    int count) const {
    TINY_CUBLAS_CHECK(cublasSgemmStridedBatched(
        blas_, detail::cublas_op(tb), detail::cublas_op(ta), n, m, k, &alpha, b, ldb, static_cast<long long>(stride_b),
        a, lda, static_cast<long long>(stride_a), &beta, c, ldc, static_cast<long long>(stride_c), count));
  }

  /// out = m^T ones: cuBLAS's gemv against a vector of ones (reserve_rows(rows) first).
  void column_sums(const float* m, int rows, int cols, float* out) const {
    if (ones_.size() < std::size_t(rows))
      throw std::logic_error("CudaCompute::column_sums: " + std::to_string(rows) + " rows, but reserve_rows(" +
                             std::to_string(ones_.size()) + ")");
    const float one = 1.0f, zero = 0.0f;
    // Row-major m (rows x cols) is column-major m^T (cols x rows, leading dimension cols).
    TINY_CUBLAS_CHECK(cublasSgemv(blas_, CUBLAS_OP_N, cols, rows, &one, m, cols, ones_.data(), 1, &zero, out, 1));
  }

  void reserve_rows(std::size_t rows) {
    if (ones_.size() >= rows) return;
    resize(ones_, rows);
    for_each(rows, detail::Fill<float>{ones_.data(), 1.0f});
  }

  void broadcast_rows(const float* b, float* y, int rows, int cols) const {
    for_each(std::size_t(rows) * cols, BroadcastRowsBody<float>{b, y, std::size_t(cols)});
  }

  void to_device(void* dst, const void* src, std::size_t bytes) const {
    if (bytes) TANDEM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    // The host buffer may be reused as soon as this returns.
    synchronize();
  }
  void to_host(void* dst, const void* src, std::size_t bytes) const {
    if (bytes) TANDEM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    synchronize();
  }
  void synchronize() const { TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

  tandem::Stream stream() const { return tandem::Stream{stream_}; }
  Backend backend() const { return Backend(tandem::CudaBackendOptions{.device = device_}); }
  int device() const { return device_; }

 private:
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  Array<float> ones_;
};

}  // namespace tiny
