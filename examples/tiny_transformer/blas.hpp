// SPDX-License-Identifier: Apache-2.0
// Matrix products of the tiny transformer on the host: thin row-major wrappers over CBLAS (OpenBLAS), for
// float (training) and double (the finite-difference gradient checks). Nothing here multiplies by hand.
//
//   gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):  C (m x n) = alpha * op(A) op(B) + beta * C
//   with op(A) m x k and op(B) k x n, every matrix row-major with the given leading dimension.
#pragma once

#include <cblas.h>

namespace tiny {

enum class Trans { no, yes };

inline CBLAS_TRANSPOSE cblas_trans(Trans t) { return t == Trans::yes ? CblasTrans : CblasNoTrans; }

inline void gemm(Trans ta, Trans tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b, int ldb,
                 float beta, float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, cblas_trans(ta), cblas_trans(tb), m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

inline void gemm(Trans ta, Trans tb, int m, int n, int k, double alpha, const double* a, int lda, const double* b,
                 int ldb, double beta, double* c, int ldc) {
  cblas_dgemm(CblasRowMajor, cblas_trans(ta), cblas_trans(tb), m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

/// Ranks are threads that each call BLAS: one BLAS thread per rank, so that N ranks use N cores and a
/// 1-rank run is the honest single-device baseline.
inline void use_one_blas_thread() {
#if defined(TINY_HAVE_OPENBLAS_THREADS)
  openblas_set_num_threads(1);
#endif
}

}  // namespace tiny
