// SPDX-License-Identifier: Apache-2.0
// The runners behind rounding::Bodies (tests/rounding/bodies.hpp), compiled once in each build that
// tests/test_rounding.cpp compares: included by test_rounding.cpp and by tests/rounding/contracted.cpp, after
// tandem's kernel headers. Everything here has internal linkage, so the two copies never meet; the including file
// names its copy with `this_build`.
#pragma once

#include <cstddef>
#include <cstdint>

#include "bodies.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/kernels/adamw.hpp"
#include "tandem/kernels/detail/rounding.hpp"
#include "tandem/kernels/pack.hpp"
#include "tandem/kernels/sgd.hpp"
#include "tandem/kernels/sum_squares.hpp"
#include "tandem/kernels/vector.hpp"

namespace {

template <class Body>
void run_items(const Body& body, std::size_t items, unsigned lanes) {
  for (std::size_t item = 0; item < items; ++item)
    for (unsigned lane = 0; lane < lanes; ++lane) body(item, lane, lanes);
}

/// f(T{}) with the C++ type of dtype d.
template <class F>
void visit(rounding::Dt d, F&& f) {
  switch (d) {
    case rounding::Dt::fp32:
      return f(float{});
    case rounding::Dt::bf16:
      return f(tandem::BFloat16{});
    case rounding::Dt::fp16:
      return f(tandem::Float16{});
  }
}

template <tandem::WriteMode Mode>
void cast_as(const rounding::Cast& c, unsigned lanes) {
  visit(c.src, [&](auto src) {
    visit(c.dst, [&](auto dst) {
      using Src = decltype(src);
      using Dst = decltype(dst);
      const tandem::CastBody<Src, Dst, Mode> body{static_cast<const Src*>(c.from), static_cast<Dst*>(c.to), c.n,
                                                  c.scale};
      run_items(body, tandem::cast_items(c.n), lanes);
    });
  });
}

void cast(const rounding::Cast& c, unsigned lanes) {
  if (c.accumulate) {
    cast_as<tandem::WriteMode::accumulate>(c, lanes);
  } else {
    cast_as<tandem::WriteMode::assign>(c, lanes);
  }
}

template <tandem::WriteMode Mode>
void pack_as(const rounding::Pack& p, unsigned lanes) {
  visit(p.user, [&](auto user) {
    visit(p.bucket, [&](auto bucket) {
      using U = decltype(user);
      using B = decltype(bucket);
      const tandem::PackBody<U, B, tandem::PackDirection::to_bucket, Mode> body{
          static_cast<const tandem::PackItem*>(p.items), static_cast<const tandem::PackTensor*>(p.tensors),
          static_cast<B*>(p.flat), p.scale};
      run_items(body, p.count, lanes);
    });
  });
}

void pack(const rounding::Pack& p, unsigned lanes) {
  if (p.accumulate) {
    pack_as<tandem::WriteMode::accumulate>(p, lanes);
  } else {
    pack_as<tandem::WriteMode::assign>(p, lanes);
  }
}

template <class Opt>
void update(const rounding::Update& u, const typename Opt::Options& o, unsigned lanes) {
  visit(u.param_dtype, [&](auto param) {
    using P = decltype(param);
    tandem::UpdateArgs<P> a;
    a.master = u.master;
    a.param = static_cast<P*>(u.param);
    a.grad = u.grad;
    a.state[0] = u.state0;
    a.state[1] = u.state1;
    a.n = u.n;
    a.grad_scale = &u.grad_scale;
    const typename Opt::Scalars scalars = Opt::scalars(o, u.step);
    run_items(typename Opt::template Body<P>{a, &scalars}, tandem::update_items(u.n), lanes);
  });
}

void adamw(const rounding::Update& u, const rounding::AdamWOptions& o, unsigned lanes) {
  update<tandem::AdamW>(u, {o.lr, o.beta1, o.beta2, o.eps, o.weight_decay}, lanes);
}

void sgd(const rounding::Update& u, const rounding::SGDOptions& o, unsigned lanes) {
  update<tandem::SGD>(
      u, {o.lr, o.momentum, o.dampening, o.weight_decay, o.nesterov ? tandem::Nesterov::on : tandem::Nesterov::off},
      lanes);
}

double sum_squares(const float* x, std::size_t n, unsigned lanes) {
  const tandem::SumSquaresBody body{x, n};
  double total = 0.0;
  for (std::size_t item = 0; item < tandem::sum_squares_items(n); ++item) {
    double chunk = 0.0;
    for (unsigned lane = 0; lane < lanes; ++lane) chunk += body(item, lane, lanes);
    total += chunk;
  }
  return total;
}

double ordered_sum(const double* terms, std::size_t groups, std::size_t per_group) {
  double out = -1.0;
  const tandem::OrderedSumBody body{terms, groups, per_group, &out};
  body(0, 0, 1);
  return out;
}

float rounded_fma(float a, float b, float c) { return tandem::detail::mul_rn(a, b) + c; }

float raw_fma(float a, float b, float c) { return a * b + c; }

void raw_accumulate(const float* s, float* d, std::size_t n, float scale) {
  for (std::size_t i = 0; i < n; ++i) d[i] = d[i] + scale * s[i];
}

const rounding::Bodies this_build{cast,        pack,        adamw,   sgd,           sum_squares,
                                  ordered_sum, rounded_fma, raw_fma, raw_accumulate};

}  // namespace
