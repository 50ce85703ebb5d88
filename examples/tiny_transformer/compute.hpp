// SPDX-License-Identifier: Apache-2.0
// Where the tiny transformer computes. The model (model.hpp) is written once against this small interface; the
// host's HostCompute implements it with plain loops and CBLAS (OpenBLAS), and CudaCompute (cuda_compute.cuh)
// with one thread per item and cuBLAS. Both run the same item bodies of ops.hpp and the same matrix products in
// the same order, so the host tests cover every line of the model that the GPU runs.
//
//   Array<T>                        owning storage in the compute's memory: data(), size()
//   resize(array, n)                n zeroed elements (previous contents are dropped)
//   zero(p, n)                      n elements at p set to zero
//   for_each(items, body)           body(item) for every item in [0, items), in any order
//   gemm(...)                       row-major C = alpha op(A) op(B) + beta C (blas.hpp's convention)
//   gemm_batched(..., count)        `count` such products, each matrix `stride` elements after the previous one
//   column_sums(m, rows, cols, out) out[j] = the sum over the rows of m[r][j] (overwritten)
//   reserve_rows(rows)              prepares column_sums for up to `rows` rows (allocates now, not later)
//   broadcast_rows(b, y, rows, cols) every row of y = b
//   to_device / to_host             copies between host memory and the compute's memory (to_host waits for it)
//   synchronize()                   waits until the compute's work so far is done
//   Backend, stream()               the tandem backend for DataParallel and the stream the model works on
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>

#include "blas.hpp"
#include "tandem/backend/host.hpp"
#include "tandem/core/stream.hpp"

namespace tiny {

class HostCompute {
 public:
  using Backend = tandem::HostBackend;
  template <class T>
  using Array = std::vector<T>;
  static constexpr bool host_memory = true;
  static constexpr const char* name() { return "host"; }

  template <class T>
  void resize(Array<T>& a, std::size_t n) const {
    a.assign(n, T(0));
  }

  template <class Body>
  void for_each(std::size_t items, const Body& body) const {
    for (std::size_t i = 0; i < items; ++i) body(i);
  }

  template <class T>
  void gemm(Trans ta, Trans tb, int m, int n, int k, T alpha, const T* a, int lda, const T* b, int ldb, T beta, T* c,
            int ldc) const {
    tiny::gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }

  template <class T>
  void gemm_batched(Trans ta, Trans tb, int m, int n, int k, T alpha, const T* a, int lda, std::size_t stride_a,
                    const T* b, int ldb, std::size_t stride_b, T beta, T* c, int ldc, std::size_t stride_c,
                    int count) const {
    for (int i = 0; i < count; ++i)
      tiny::gemm(ta, tb, m, n, k, alpha, a + i * stride_a, lda, b + i * stride_b, ldb, beta, c + i * stride_c, ldc);
  }

  // Row loops, vectorized over the columns; the GPU multiplies by a vector of ones instead.
  template <class T>
  void column_sums(const T* m, int rows, int cols, T* out) const {
    std::fill_n(out, cols, T(0));
    for (int r = 0; r < rows; ++r) {
      const T* row = m + std::size_t(r) * cols;
      for (int j = 0; j < cols; ++j) out[j] += row[j];
    }
  }

  void reserve_rows(std::size_t) const {}

  template <class T>
  void broadcast_rows(const T* b, T* y, int rows, int cols) const {
    for (int r = 0; r < rows; ++r) std::copy_n(b, cols, y + std::size_t(r) * cols);
  }

  template <class T>
  void zero(T* p, std::size_t n) const {
    std::fill_n(p, n, T(0));
  }

  void to_device(void* dst, const void* src, std::size_t bytes) const {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void to_host(void* dst, const void* src, std::size_t bytes) const {
    if (bytes) std::memcpy(dst, src, bytes);
  }

  void synchronize() const {}
  tandem::Stream stream() const { return {}; }
  Backend backend() const { return {}; }
};

}  // namespace tiny
