// SPDX-License-Identifier: Apache-2.0
// Cross-rank agreement: the small collectives by which every rank learns what every other rank found, so that a
// problem on one rank makes every rank throw the same kind of error instead of leaving the others waiting in a
// collective. Each goes through backend memory (NCCL reduces and gathers device memory only) on the backend's work
// stream, and waits for it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/core/config.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/core/error.hpp"

namespace tandem::detail {

/// Every rank's words (this rank passes `mine`; every rank must pass as many): rank r's at [r * n, (r + 1) * n) of
/// the result. Collective.
template <Communicator Comm, class Backend>
TANDEM_COLD std::vector<std::uint64_t> all_gather_words(Comm& comm, Backend& backend,
                                                        const std::vector<std::uint64_t>& mine) {
  const std::size_t words = mine.size(), ranks = static_cast<std::size_t>(comm.size());
  auto staging = backend.template allocate<std::uint64_t>(words * (ranks + 1));
  backend.copy(staging.data(), mine.data(), words * sizeof(std::uint64_t), backend.stream());
  comm.all_gather(staging.data(), staging.data() + words, words, DType::fp64, backend.stream());
  std::vector<std::uint64_t> all(words * ranks);
  backend.read(all.data(), staging.data() + words, all.size() * sizeof(std::uint64_t), backend.stream());
  return all;
}

/// Every rank passes its own problem (empty: none, else the message it would throw, up to 503 bytes of it travel);
/// if any rank has one, every rank throws tandem::error: its own message, or the first failing rank's, named.
/// Collective.
template <Communicator Comm, class Backend>
TANDEM_COLD void all_ranks_succeed(Comm& comm, Backend& backend, const std::string& problem) {
  constexpr std::size_t words = 64;
  std::vector<std::uint64_t> mine(words, 0);
  mine[0] = problem.empty() ? 0 : 1;
  std::memcpy(&mine[1], problem.data(), std::min((words - 1) * sizeof(std::uint64_t) - 1, problem.size()));
  const std::vector<std::uint64_t> all = all_gather_words(comm, backend, mine);
  if (!problem.empty()) throw error(problem);
  for (int r = 0; r < comm.size(); ++r) {
    const std::uint64_t* w = &all[static_cast<std::size_t>(r) * words];
    if (w[0] != 0)
      fail("tandem: rank " + std::to_string(r) + " failed: " + std::string(reinterpret_cast<const char*>(&w[1])));
  }
}

}  // namespace tandem::detail
