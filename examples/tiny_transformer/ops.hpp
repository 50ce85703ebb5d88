// SPDX-License-Identifier: Apache-2.0
// The tiny transformer's non-GEMM operations, one row (or one element) at a time, as host+device bodies:
// the host runs them over rows in loops; a CUDA path launches the same bodies one row per block. T is
// float for training and double for the finite-difference checks.
//
// Shapes: a "row" is one token's vector of `c` features (layer norm, bias, GELU), one query's attention
// scores over the `len` keys it may see (causal softmax), or one token's `v` logits (cross-entropy).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "tandem/core/config.hpp"

namespace tiny {

// --- exp and tanh --------------------------------------------------------------------------------------------------
// float: a branch-free exp (range reduction to r in [-ln2/2, ln2/2], a degree-6 polynomial, scaling by 2^n
// through the exponent bits; relative error < 2e-7 for x in [-87, 88], clamped outside) that compilers
// vectorize; double: the C library's, for the reference checks.

TANDEM_HD inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer
  const float n = (x * 1.44269504088896341f + shifter) - shifter;
  const float r = x - n * 0.693145751953125f - n * 1.428606820309417e-06f;  // ln 2 split in two for exactness
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const std::int32_t bits = (static_cast<std::int32_t>(n) + 127) << 23;  // 2^n (n in [-126, 127])
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

TANDEM_HD inline double exp_approx(double x) { return std::exp(x); }

/// tanh(y) = 1 - 2 / (exp(2y) + 1); absolute error < 2e-7 in float.
template <class T>
TANDEM_HD inline T tanh_approx(T y) {
  return T(1) - T(2) / (exp_approx(T(2) * y) + T(1));
}

// --- Row reductions
// ---------------------------------------------------------------------------------------------------- Eight
// interleaved partial results, combined at the end: a fixed order (so results do not depend on the compiler) that
// compilers turn into vector code, where one running sum would be a serial chain.

inline constexpr int reduction_lanes = 8;

/// sum over j < n of f(j)
template <class T, class F>
TANDEM_HD inline T row_sum(int n, F&& f) {
  T lane[reduction_lanes] = {};
  int j = 0;
  for (; j + reduction_lanes <= n; j += reduction_lanes)
    for (int k = 0; k < reduction_lanes; ++k) lane[k] += f(j + k);
  for (int k = 0; j + k < n; ++k) lane[k] += f(j + k);
  T total = 0;
  for (int k = 0; k < reduction_lanes; ++k) total += lane[k];
  return total;
}

template <class T>
TANDEM_HD inline T row_max(const T* x, int n) {
  T lane[reduction_lanes];
  for (int k = 0; k < reduction_lanes; ++k) lane[k] = x[0];
  int j = 0;
  for (; j + reduction_lanes <= n; j += reduction_lanes)
    for (int k = 0; k < reduction_lanes; ++k) lane[k] = x[j + k] > lane[k] ? x[j + k] : lane[k];
  for (int k = 0; j + k < n; ++k) lane[k] = x[j + k] > lane[k] ? x[j + k] : lane[k];
  T max = lane[0];
  for (int k = 1; k < reduction_lanes; ++k) max = lane[k] > max ? lane[k] : max;
  return max;
}

// --- GELU (the tanh form of GPT-2 and of PyTorch's nn.GELU(approximate="tanh")) -----------------------------------
//   g(x) = x/2 (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
//   g'(x) = (1 + tanh(u))/2 + x/2 (1 - tanh(u)^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)

inline constexpr double gelu_k = 0.7978845608028654;  // sqrt(2/pi)
inline constexpr double gelu_c = 0.044715;

template <class T>
TANDEM_HD inline T gelu(T x) {
  const T u = T(gelu_k) * (x + T(gelu_c) * x * x * x);
  return T(0.5) * x * (T(1) + tanh_approx(u));
}

template <class T>
TANDEM_HD inline T gelu_grad(T x) {
  const T u = T(gelu_k) * (x + T(gelu_c) * x * x * x);
  const T t = tanh_approx(u);
  return T(0.5) * (T(1) + t) + T(0.5) * x * (T(1) - t * t) * T(gelu_k) * (T(1) + T(3 * gelu_c) * x * x);
}

// --- Layer norm over one row of c features ---------------------------------------------------------------------------
//   y = (x - mean) * rstd * w + b,  rstd = 1 / sqrt(var + eps), var the biased variance (as PyTorch).

inline constexpr double layernorm_eps = 1e-5;

template <class T>
TANDEM_HD inline void layernorm_row(const T* x, const T* w, const T* b, T* y, T* mean_out, T* rstd_out, int c) {
  const T mean = row_sum<T>(c, [&](int i) { return x[i]; }) / T(c);
  const T var = row_sum<T>(c, [&](int i) { return (x[i] - mean) * (x[i] - mean); }) / T(c);
  const T rstd = T(1) / std::sqrt(var + T(layernorm_eps));
  for (int i = 0; i < c; ++i) y[i] = (x[i] - mean) * rstd * w[i] + b[i];
  *mean_out = mean;
  *rstd_out = rstd;
}

/// Backward of layernorm_row for one row: dx += the input gradient, and dwx = dy * xhat, this row's part of the
/// weight gradient (the weight and bias gradients sum dwx and dy over the rows: a product with a ones vector).
///   dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),  dxhat = dy * w
template <class T>
TANDEM_HD inline void layernorm_row_backward(const T* dy, const T* x, const T* w, T mean, T rstd, T* dx, T* dwx,
                                             int c) {
  const T m1 = row_sum<T>(c, [&](int i) { return dy[i] * w[i]; }) / T(c);
  const T m2 = row_sum<T>(c, [&](int i) { return dy[i] * w[i] * ((x[i] - mean) * rstd); }) / T(c);
  for (int i = 0; i < c; ++i) {
    const T xhat = (x[i] - mean) * rstd;
    dwx[i] = dy[i] * xhat;
    dx[i] += rstd * (dy[i] * w[i] - m1 - xhat * m2);
  }
}

// --- Causal softmax over one query's row of scores
// --------------------------------------------------------------------- Row i of a (len_total x len_total) score matrix
// sees keys 0..i: p[j] = softmax(s[0..i])[j] for j <= i, 0 after.

template <class T>
TANDEM_HD inline void causal_softmax_row(T* p, int seen, int len_total) {
  const T max = row_max(p, seen);
  for (int j = 0; j < seen; ++j) p[j] = exp_approx(p[j] - max);
  const T inv = T(1) / row_sum<T>(seen, [&](int j) { return p[j]; });
  for (int j = 0; j < seen; ++j) p[j] *= inv;
  for (int j = seen; j < len_total; ++j) p[j] = 0;
}

/// In place: dp (the gradient of p) becomes the gradient of the scores, ds_j = p_j (dp_j - sum_k p_k dp_k).
template <class T>
TANDEM_HD inline void causal_softmax_row_backward(const T* p, T* dp, int seen, int len_total) {
  const T dot = row_sum<T>(seen, [&](int j) { return p[j] * dp[j]; });
  for (int j = 0; j < seen; ++j) dp[j] = p[j] * (dp[j] - dot);
  for (int j = seen; j < len_total; ++j) dp[j] = 0;
}

// --- Softmax cross-entropy over one row of v logits ------------------------------------------------------------------

struct CrossEntropyRow {
  double loss = 0;       ///< -log softmax(logits)[target]
  bool correct = false;  ///< argmax(logits) == target (the first maximum on ties)
};

/// Loss of one row against `target`; with `grad_scale` != 0 the logits are replaced by their gradient,
/// (softmax - onehot(target)) * grad_scale.
template <class T>
TANDEM_HD inline CrossEntropyRow cross_entropy_row(T* logits, int target, int v, T grad_scale) {
  T max = logits[0];
  int arg = 0;
  for (int j = 1; j < v; ++j)
    if (logits[j] > max) max = logits[j], arg = j;
  const T sum = row_sum<T>(v, [&](int j) { return exp_approx(logits[j] - max); });
  CrossEntropyRow out;
  out.loss = static_cast<double>(std::log(sum) - (logits[target] - max));
  out.correct = arg == target;
  if (grad_scale != T(0)) {
    const T inv = T(1) / sum;
    for (int j = 0; j < v; ++j) logits[j] = exp_approx(logits[j] - max) * inv * grad_scale;
    logits[target] -= grad_scale;
  }
  return out;
}

// --- Item bodies ---------------------------------------------------------------------------------------------------
// What one work item does: compute.for_each(items, body) calls body(item) for every item, a loop on the host and
// one CUDA thread per item on the GPU, so the host tests run exactly the code the GPU runs. No two items write the
// same element. Indices are std::size_t; rows are row-major with the widths given.

/// x[r] = wte[tokens[r]] + wpe[r % len], rows of c; items: rows.
template <class T>
struct EmbedBody {
  const int* tokens;
  const T *wte, *wpe;
  T* x;
  std::size_t len, c;
  TANDEM_HD void operator()(std::size_t r) const {
    const T* te = wte + std::size_t(tokens[r]) * c;
    const T* pe = wpe + (r % len) * c;
    T* xr = x + r * c;
    for (std::size_t i = 0; i < c; ++i) xr[i] = te[i] + pe[i];
  }
};

/// The embeddings' backward for token rows: dwte[t][i] = the sum of dx[r][i] over the rows r holding token t, in
/// row order. The rows of token t are rows[start[t] .. start[t+1]) (ascending). Items: vocab x c.
template <class T>
struct TokenGradBody {
  const T* dx;
  const int *start, *rows;
  T* dwte;
  std::size_t c;
  TANDEM_HD void operator()(std::size_t e) const {
    const std::size_t t = e / c, i = e % c;
    T sum = 0;
    for (int k = start[t]; k < start[t + 1]; ++k) sum += dx[std::size_t(rows[k]) * c + i];
    dwte[e] = sum;
  }
};

/// Every row of y (cols wide) = b; items: rows x cols.
template <class T>
struct BroadcastRowsBody {
  const T* b;
  T* y;
  std::size_t cols;
  TANDEM_HD void operator()(std::size_t e) const { y[e] = b[e % cols]; }
};

/// y[e] += a[e]
template <class T>
struct AddBody {
  T* y;
  const T* a;
  TANDEM_HD void operator()(std::size_t e) const { y[e] += a[e]; }
};

/// g[e] = gelu(h[e])
template <class T>
struct GeluBody {
  const T* h;
  T* g;
  TANDEM_HD void operator()(std::size_t e) const { g[e] = gelu(h[e]); }
};

/// dh[e] *= gelu'(h[e])
template <class T>
struct GeluBackwardBody {
  const T* h;
  T* dh;
  TANDEM_HD void operator()(std::size_t e) const { dh[e] *= gelu_grad(h[e]); }
};

/// layernorm_row of row r; items: rows.
template <class T>
struct LayerNormBody {
  const T *x, *w, *b;
  T *y, *mean, *rstd;
  int c;
  TANDEM_HD void operator()(std::size_t r) const {
    const std::size_t o = r * std::size_t(c);
    layernorm_row(x + o, w, b, y + o, mean + r, rstd + r, c);
  }
};

/// layernorm_row_backward of row r; items: rows.
template <class T>
struct LayerNormBackwardBody {
  const T *dy, *x, *w, *mean, *rstd;
  T *dx, *dwx;
  int c;
  TANDEM_HD void operator()(std::size_t r) const {
    const std::size_t o = r * std::size_t(c);
    layernorm_row_backward(dy + o, x + o, w, mean[r], rstd[r], dx + o, dwx + o, c);
  }
};

/// Causal softmax of query rows [r0, r0 + rows) of `count` score matrices (len x len, `stride` elements apart);
/// items: count x rows.
template <class T>
struct CausalSoftmaxBody {
  T* p;
  std::size_t stride;
  int r0, rows, len;
  TANDEM_HD void operator()(std::size_t item) const {
    const int i = r0 + int(item % std::size_t(rows));
    causal_softmax_row(p + (item / rows) * stride + std::size_t(i) * len, i + 1, len);
  }
};

/// The backward of CausalSoftmaxBody over the same rows: dp (`dstride` apart) becomes the scores' gradient.
template <class T>
struct CausalSoftmaxBackwardBody {
  const T* p;
  T* dp;
  std::size_t stride, dstride;
  int r0, rows, len;
  TANDEM_HD void operator()(std::size_t item) const {
    const int i = r0 + int(item % std::size_t(rows));
    const std::size_t m = item / rows;
    causal_softmax_row_backward(p + m * stride + std::size_t(i) * len, dp + m * dstride + std::size_t(i) * len, i + 1,
                                len);
  }
};

/// cross_entropy_row of row r against targets[r]: loss[r] and correct[r] (1 when the row has no target). With
/// `train`, the row becomes the loss gradient (zero for a row without a target). Items: rows.
template <class T>
struct CrossEntropyBody {
  T* logits;
  const int* targets;
  T* loss;
  std::uint8_t* correct;
  int v;
  T grad_scale;
  bool train;
  TANDEM_HD void operator()(std::size_t r) const {
    T* row = logits + r * std::size_t(v);
    if (targets[r] < 0) {
      if (train)
        for (int j = 0; j < v; ++j) row[j] = 0;
      loss[r] = 0;
      correct[r] = 1;
      return;
    }
    const CrossEntropyRow ce = cross_entropy_row(row, targets[r], v, train ? grad_scale : T(0));
    loss[r] = T(ce.loss);
    correct[r] = ce.correct ? 1 : 0;
  }
};

/// dst[e] = To(src[e]) (bf16 copies of the parameters and gradients).
template <class From, class To>
struct CastBody {
  const From* src;
  To* dst;
  TANDEM_HD void operator()(std::size_t e) const { dst[e] = To(src[e]); }
};

}  // namespace tiny
