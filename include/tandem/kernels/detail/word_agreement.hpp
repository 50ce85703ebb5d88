// SPDX-License-Identifier: Apache-2.0
// WordAgreement: a word checked across ranks inside a sum all-reduce that runs anyway. Each rank encodes its word as
// a few doubles (host code); the all-reduce sums them; agree() tells from the sums whether every rank had the same
// word. agree() is host+device code: an optimizer step's verdict is made on the stream (PrepareStepBody,
// kernels/optimizer.hpp), from the sums where the all-reduce left them.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>

#include "tandem/core/config.hpp"

namespace tandem::detail {

/// A 64-bit word (the optimizer options' fingerprint) checked across ranks inside an fp64 sum all-reduce that runs
/// anyway (the optimizer step's), instead of a collective of its own. The word is cut into two chunks x of b bits,
/// and every rank contributes x and x * x to the sum: the ranks agree on a chunk exactly when N * sum(x * x) ==
/// sum(x)^2 (Cauchy-Schwarz; equality only when every x is the same). b is chosen so that every partial sum stays an
/// integer below 2^53, exact in any order of addition, so every rank reaches the same verdict: b = 26 bits per chunk
/// at 2 ranks, 21 at 1024. Two fingerprints that differ only outside the 2b bits go unnoticed (a chance of 2^-2b).
struct WordAgreement {
  static constexpr std::size_t lanes = 4;

  static unsigned chunk_bits(int world) {
    unsigned log2_world = 0;
    while ((std::uint64_t{1} << log2_world) < static_cast<std::uint64_t>(world)) ++log2_world;
    return std::min(32u, (53u - log2_world) / 2u);
  }

  /// This rank's lanes of `word`.
  static std::array<double, lanes> encode(std::uint64_t word, int world) {
    const std::uint64_t mask = (std::uint64_t{1} << chunk_bits(world)) - 1;
    const auto lo = static_cast<double>(word & mask), hi = static_cast<double>((word >> 32) & mask);
    return {lo, lo * lo, hi, hi * hi};
  }

  /// Whether every rank passed the same word, from the lanes' sums over `world` ranks: for each chunk, the sum S is
  /// N m and the sum of squares N m^2 (then sum((x - m)^2) = 0: every x is m).
  TANDEM_HD static bool agree(const double* sums, int world) {
    const auto n = static_cast<std::uint64_t>(world);
    for (std::size_t c = 0; c < lanes; c += 2) {
      const auto sum = static_cast<std::uint64_t>(sums[c]), squares = static_cast<std::uint64_t>(sums[c + 1]);
      if (sum % n != 0 || squares != n * (sum / n) * (sum / n)) return false;
    }
    return true;
  }
};

}  // namespace tandem::detail
