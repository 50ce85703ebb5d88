// SPDX-License-Identifier: Apache-2.0
// What the training tests share: trained parameters as floats, and the per-tensor relative error that the
// equivalence guarantees of docs/design.md are stated in.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace test {

using Params = std::vector<std::vector<float>>;

/// The fp32 parameters of a DataParallel with owned storage, read through its views.
template <class DataParallel>
Params param_views(const DataParallel& dp) {
  Params out;
  for (std::size_t i = 0; i < dp.layout().size(); ++i) {
    const float* p = dp.template param_view<float>(i);
    out.emplace_back(p, p + dp.layout()[i].numel);
  }
  return out;
}

template <class T>
Params as_float(const std::vector<std::vector<T>>& p) {
  Params out(p.size());
  for (std::size_t i = 0; i < p.size(); ++i)
    for (const T& v : p[i]) out[i].push_back(static_cast<float>(v));
  return out;
}

/// The largest over tensors of ‖a − ref‖ / ‖ref‖ (‖a − ref‖ where ref is zero). Infinite, so that no tolerance passes
/// it, where the two differ in shape or either holds a value that is not finite (a run that trained to NaN).
inline double max_relative_error(const Params& a, const Params& ref) {
  constexpr double never = std::numeric_limits<double>::infinity();
  if (a.size() != ref.size()) return never;
  double worst = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (a[i].size() != ref[i].size()) return never;
    double d = 0, r = 0;
    for (std::size_t e = 0; e < ref[i].size(); ++e) {
      if (!std::isfinite(a[i][e]) || !std::isfinite(ref[i][e])) return never;
      d += (double{a[i][e]} - ref[i][e]) * (double{a[i][e]} - ref[i][e]);
      r += double{ref[i][e]} * ref[i][e];
    }
    worst = std::max(worst, r > 0 ? std::sqrt(d / r) : std::sqrt(d));
  }
  return worst;
}

/// Every tensor bit for bit equal, sizes included (empty tensors compare equal without touching their data()).
inline bool bitwise_equal(const Params& a, const Params& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() ||
        (!a[i].empty() && std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0))
      return false;
  return true;
}

}  // namespace test
