// SPDX-License-Identifier: Apache-2.0
// SGD with momentum, dampening, Nesterov and (coupled) weight decay, as PyTorch's torch.optim.SGD:
//
//   g = grad_scale * grad + weight_decay * w   (the decay term only where weight_decay != 0)
//   b = g                                    on the first step (step 1)
//   b = momentum * b + (1 - dampening) * g   afterwards
//   g = g + momentum * b   (Nesterov)   or   g = b
//   w = w - lr * g
//
// over a flat range, elementwise. Without momentum no state is kept. A group whose momentum turns from 0 to non-zero
// after step 1 starts from a zero buffer (b = (1 - dampening) * g), where PyTorch, which had kept no buffer, starts
// from b = g: the same with dampening 0. Every product is rounded before it is added
// (kernels/detail/rounding.hpp): host and device give the same bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "tandem/core/dtype.hpp"
#include "tandem/core/error.hpp"
#include "tandem/kernels/detail/rounding.hpp"
#include "tandem/kernels/optimizer.hpp"

namespace tandem {

struct SGDOptions {
  float lr = 1e-2f;
  float momentum = 0.0f;
  float dampening = 0.0f;  ///< in [0, 1] (PyTorch does not check it)
  float weight_decay = 0.0f;
  Nesterov nesterov = Nesterov::off;
};

struct SGD {
  using Options = SGDOptions;
  static constexpr const char* name = "SGD";
  static constexpr bool elementwise = true;

  static std::size_t state_count(const Options& o) { return o.momentum != 0.0f ? 1 : 0; }

  static void validate(const Options& o) {
    auto bad = [](const char* what, float value, const char* rule) {
      detail::fail(std::string("tandem: SGDOptions::") + what + " is " + detail::number(value) + "; " + rule);
    };
    // finite() first: it holds under -ffinite-math-only, where a comparison with a NaN may be folded away
    if (!finite(o.lr) || o.lr < 0.0f) bad("lr", o.lr, "it must be finite and >= 0");
    if (!finite(o.momentum) || o.momentum < 0.0f) bad("momentum", o.momentum, "it must be finite and >= 0");
    if (!finite(o.dampening) || o.dampening < 0.0f || o.dampening > 1.0f)
      bad("dampening", o.dampening, "it must be in [0, 1]");
    if (!finite(o.weight_decay) || o.weight_decay < 0.0f)
      bad("weight_decay", o.weight_decay, "it must be finite and >= 0");
    if (o.nesterov != Nesterov::off && o.nesterov != Nesterov::on)
      detail::fail("tandem: SGDOptions::nesterov is " + std::to_string(static_cast<int>(o.nesterov)) +
                   ", not a Nesterov (off or on)");
    if (o.nesterov == Nesterov::on && (o.momentum <= 0.0f || o.dampening != 0.0f))
      detail::fail("tandem: SGDOptions::nesterov needs momentum > 0 and dampening == 0 (as in PyTorch)");
  }

  /// Equal on ranks with equal options (checked across ranks at construction).
  static std::uint64_t fingerprint(const Options& o) {
    return detail::fingerprint_values(
        {o.lr, o.momentum, o.dampening, o.weight_decay, o.nesterov == Nesterov::on ? 1.0f : 0.0f});
  }

  /// Calls f(name, member) for each option, in this order (OptionsNamed): a checkpoint records them by name.
  template <class O, class F>
  static void visit_options(O& o, F&& f) {
    f("lr", o.lr);
    f("momentum", o.momentum);
    f("dampening", o.dampening);
    f("weight_decay", o.weight_decay);
    f("nesterov", o.nesterov);
  }

  struct Scalars {
    float lr, momentum, dampening, weight_decay;
    bool first_step;
    bool nesterov;
    bool has_momentum;
  };

  TANDEM_HD static Scalars scalars(const Options& o, std::uint64_t t) {
    return {o.lr, o.momentum, o.dampening, o.weight_decay, t == 1, o.nesterov == Nesterov::on, o.momentum != 0.0f};
  }

  template <class P, class G = float>
  struct Body {
    UpdateArgs<P, G> a;
    const Scalars* s;  ///< in backend memory

    TANDEM_HD void operator()(std::size_t item, unsigned lane, unsigned lanes) const {
      const Scalars c = *s;  // a local copy: no store to the arrays can change it, so it stays in registers
      with_flags(c, [&](auto decay, auto momentum, auto first, auto nesterov) {
        auto f = [c, decay, momentum, first, nesterov](float g, float& w, float(&b)[1]) {
          element_as(c, g, w, b, decay, momentum, first, nesterov);
        };
        detail::update_item<decltype(momentum)::value ? 1 : 0>(a, item, lane, lanes, f);
      });
    }

    /// One element, in registers: g the scaled gradient, w the weight, b[0] the momentum buffer (with momentum).
    TANDEM_HD static void element(const Scalars& s, float g, float& w, float (&b)[1]) {
      with_flags(s, [&](auto... flags) { element_as(s, g, w, b, flags...); });
    }

    /// element(), its flags (s's, as with_flags passes them) known at compile time.
    template <bool Decay, bool Momentum, bool First, bool Nesterov>
    TANDEM_HD static void element_as(const Scalars& s, float g, float& w, float (&b)[1], std::bool_constant<Decay>,
                                     std::bool_constant<Momentum>, std::bool_constant<First>,
                                     std::bool_constant<Nesterov>) {
      using detail::mul_rn;
      if constexpr (Decay) g = g + mul_rn(s.weight_decay, w);  // only where != 0, as PyTorch: an infinite w stays
      if constexpr (Momentum) {
        if constexpr (First)
          b[0] = g;
        else
          b[0] = mul_rn(s.momentum, b[0]) + mul_rn(1.0f - s.dampening, g);
        if constexpr (Nesterov)
          g = g + mul_rn(s.momentum, b[0]);
        else
          g = b[0];
      }
      w = w - mul_rn(s.lr, g);
    }

    /// Calls f(decay, momentum, first, nesterov), s's flags (weight_decay != 0, has_momentum, first_step, nesterov;
    /// the last two false without momentum) as std::bool_constant: the flags are the same for every element, so each
    /// combination is a loop of its own, without a branch per element. The compiler vectorizes no loop with one
    /// (floating-point operations may trap, so it does not compute both sides), and moves none out at -O2.
    template <class F>
    TANDEM_HD static void with_flags(const Scalars& s, F&& f) {
      const auto pick = [](bool on, auto&& next) {
        if (on)
          next(std::true_type{});
        else
          next(std::false_type{});
      };
      pick(s.weight_decay != 0.0f, [&](auto decay) {
        if (!s.has_momentum) {
          f(decay, std::false_type{}, std::false_type{}, std::false_type{});
          return;
        }
        pick(s.first_step, [&](auto first) {
          pick(s.nesterov, [&](auto nesterov) { f(decay, std::true_type{}, first, nesterov); });
        });
      });
    }
  };
};

}  // namespace tandem
