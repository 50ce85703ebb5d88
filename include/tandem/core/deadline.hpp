// SPDX-License-Identifier: Apache-2.0
// The deadline of a wait that takes a timeout. A timeout too long for the clock (std::chrono::milliseconds::max(), the
// usual way to say "no bound") makes the wait unbounded, where adding it to the clock would overflow into a deadline
// already passed.
#pragma once

#include <chrono>

namespace tandem::detail {

/// start + timeout, or the clock's last time point where that sum would pass it (never reached: the wait is unbounded).
inline std::chrono::steady_clock::time_point deadline_after(std::chrono::steady_clock::time_point start,
                                                            std::chrono::milliseconds timeout) {
  using clock = std::chrono::steady_clock;
  const auto room = std::chrono::duration_cast<std::chrono::milliseconds>(clock::time_point::max() - start);
  return timeout >= room ? clock::time_point::max() : start + std::chrono::duration_cast<clock::duration>(timeout);
}

}  // namespace tandem::detail
