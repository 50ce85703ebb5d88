// SPDX-License-Identifier: Apache-2.0
// AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization"), as PyTorch's torch.optim.AdamW:
//
//   g  = grad_scale * grad
//   w  = w * (1 - lr * weight_decay)                   decoupled weight decay
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * g^2
//   w  = w - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//
// over a flat range, elementwise (so the state shards freely), fp32 maths, the parameter-dtype write fused. Every
// product, quotient and square root is rounded on its own (kernels/detail/rounding.hpp): host and device give the
// same bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "tandem/core/dtype.hpp"
#include "tandem/core/error.hpp"
#include "tandem/kernels/detail/rounding.hpp"
#include "tandem/kernels/optimizer.hpp"

namespace tandem {

struct AdamWOptions {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;  ///< > 0 (PyTorch also takes 0, where a gradient of 0 gives 0/0)
  float weight_decay = 1e-2f;
};

struct AdamW {
  using Options = AdamWOptions;
  static constexpr const char* name = "AdamW";
  static constexpr bool elementwise = true;

  static std::size_t state_count(const Options&) { return 2; }  // m, v

  static void validate(const Options& o) {
    auto bad = [](const char* what, float value, const char* rule) {
      detail::fail(std::string("tandem: AdamWOptions::") + what + " is " + detail::number(value) + "; " + rule);
    };
    // finite() first: it holds under -ffinite-math-only, where a comparison with a NaN may be folded away
    if (!finite(o.lr) || o.lr < 0.0f) bad("lr", o.lr, "it must be finite and >= 0");
    if (!finite(o.beta1) || o.beta1 < 0.0f || o.beta1 >= 1.0f) bad("beta1", o.beta1, "it must be in [0, 1)");
    if (!finite(o.beta2) || o.beta2 < 0.0f || o.beta2 >= 1.0f) bad("beta2", o.beta2, "it must be in [0, 1)");
    if (!finite(o.eps) || o.eps <= 0.0f) bad("eps", o.eps, "it must be finite and > 0");
    if (!finite(o.weight_decay) || o.weight_decay < 0.0f)
      bad("weight_decay", o.weight_decay, "it must be finite and >= 0");
  }

  /// Equal on ranks with equal options (checked across ranks at construction).
  static std::uint64_t fingerprint(const Options& o) {
    return detail::fingerprint_values({o.lr, o.beta1, o.beta2, o.eps, o.weight_decay});
  }

  /// Calls f(name, member) for each option, in this order (OptionsNamed): a checkpoint records them by name.
  template <class O, class F>
  static void visit_options(O& o, F&& f) {
    f("lr", o.lr);
    f("beta1", o.beta1);
    f("beta2", o.beta2);
    f("eps", o.eps);
    f("weight_decay", o.weight_decay);
  }

  /// Per-step scalars, from the options and the 1-based step number t. A DataParallel computes them on its backend
  /// (detail::PrepareStepBody), from the step count it keeps there.
  struct Scalars {
    float beta1, beta2, eps;
    float decay;         ///< 1 - lr * weight_decay
    float step_size;     ///< lr / (1 - beta1^t)
    float inv_sqrt_bc2;  ///< 1 / sqrt(1 - beta2^t)
  };

  TANDEM_HD static Scalars scalars(const Options& o, std::uint64_t t) {
    using detail::div_rn, detail::mul_rn, detail::pow_rn, detail::sqrt_rn;
    const double bc1 = 1.0 - pow_rn(double{o.beta1}, t);
    const double bc2 = 1.0 - pow_rn(double{o.beta2}, t);
    return {o.beta1,
            o.beta2,
            o.eps,
            1.0f - mul_rn(o.lr, o.weight_decay),
            static_cast<float>(div_rn(double{o.lr}, bc1)),
            static_cast<float>(div_rn(1.0, sqrt_rn(bc2)))};
  }

  template <class P, class G = float>
  struct Body {
    UpdateArgs<P, G> a;
    const Scalars* s;  ///< in backend memory

    TANDEM_HD void operator()(std::size_t item, unsigned lane, unsigned lanes) const {
      const Scalars c = *s;  // a local copy: no store to the arrays can change it, so it stays in registers
      detail::update_item<2>(a, item, lane, lanes,
                             [c](float g, float& w, float(&mv)[2]) { element(c, g, w, mv[0], mv[1]); });
    }

    /// One element, in registers: g the scaled gradient, w the master weight, m and v the moments.
    TANDEM_HD static void element(const Scalars& s, float g, float& w, float& m, float& v) {
      using detail::div_rn, detail::mul_rn, detail::sqrt_rn;
      w = mul_rn(w, s.decay);
      m = mul_rn(s.beta1, m) + mul_rn(1.0f - s.beta1, g);
      v = mul_rn(s.beta2, v) + mul_rn(mul_rn(1.0f - s.beta2, g), g);
      w = w - div_rn(mul_rn(s.step_size, m), mul_rn(sqrt_rn(v), s.inv_sqrt_bc2) + s.eps);
    }
  };
};

}  // namespace tandem
