// SPDX-License-Identifier: Apache-2.0
// The interface between tests/test_rounding.cpp and the two builds of tandem's kernel bodies it compares: the ordinary
// one (tandem's flags, in test_rounding.cpp itself) and tests/rounding/contracted.cpp (FMA contraction on, rounded
// products opaque, as nvcc sees them). Only plain types cross it: in contracted.cpp namespace tandem is renamed, so
// tandem's types there are other types with the same layout (buffers travel as void*, dtypes as Dt).
#pragma once

#include <cstddef>
#include <cstdint>

namespace rounding {

/// Element types of tandem's buffers: float, BFloat16, Float16.
enum class Dt { fp32, bf16, fp16 };

/// A CastBody<Src, Dst, mode> over n elements (src and dst may be misaligned), or a PackBody over a pack table's items.
struct Cast {
  Dt src = Dt::fp32, dst = Dt::fp32;
  bool accumulate = false;
  const void* from = nullptr;
  void* to = nullptr;
  std::size_t n = 0;
  float scale = 1.0f;
};

/// PackBody<User, Bucket, to_bucket, mode> over the items of a PackTable built by the caller (tandem::PackItem and
/// tandem::PackTensor arrays).
struct Pack {
  Dt user = Dt::fp32, bucket = Dt::fp32;
  bool accumulate = false;
  const void* items = nullptr;
  const void* tensors = nullptr;
  std::size_t count = 0;  ///< items
  void* flat = nullptr;
  float scale = 1.0f;
};

/// One optimizer step over a flat range (tandem::UpdateArgs with the parameter dtype as a value).
struct Update {
  Dt param_dtype = Dt::fp32;
  float* master = nullptr;
  void* param = nullptr;
  const float* grad = nullptr;
  float* state0 = nullptr;
  float* state1 = nullptr;
  std::size_t n = 0;
  float grad_scale = 1.0f;
  std::uint64_t step = 1;
};

struct AdamWOptions {
  float lr, beta1, beta2, eps, weight_decay;
};

struct SGDOptions {
  float lr, momentum, dampening, weight_decay;
  bool nesterov;
};

/// The bodies of one build, each run on the host with `lanes` lanes (1: the host path; 256: the CUDA block's shape).
struct Bodies {
  void (*cast)(const Cast&, unsigned lanes);
  void (*pack)(const Pack&, unsigned lanes);
  void (*adamw)(const Update&, const AdamWOptions&, unsigned lanes);
  void (*sgd)(const Update&, const SGDOptions&, unsigned lanes);
  double (*sum_squares)(const float* x, std::size_t n, unsigned lanes);  ///< chunk sums added in item order
  double (*ordered_sum)(const double* terms, std::size_t groups, std::size_t per_group);
  float (*rounded_fma)(float a, float b, float c);  ///< detail::mul_rn(a, b) + c
  float (*raw_fma)(float a, float b, float c);      ///< a * b + c, as written
  /// d[i] = d[i] + scale * s[i] written with raw operators (what the review found in vector.hpp), for a test of the
  /// test: in the contracted build it must differ from the body.
  void (*raw_accumulate)(const float* s, float* d, std::size_t n, float scale);
};

/// The ordinary build (tandem's own flags: -ffp-contract=off).
const Bodies& plain_bodies();

#if TANDEM_ROUNDING_CONTRACTED
/// The build with -ffp-contract=fast and FMA, products rounded by detail::mul_rn opaque
/// (tests/rounding/contracted.cpp).
const Bodies& contracted_bodies();
#endif

}  // namespace rounding
