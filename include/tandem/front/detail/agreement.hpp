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
#include <exception>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "tandem/backend/allocate.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/core/config.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/hash.hpp"
#include "tandem/core/tensor.hpp"
#include "tandem/front/options.hpp"
#include "tandem/policy/policy.hpp"

namespace tandem::detail {

/// Copies `bytes` of host memory to backend memory `to` on the backend's stream, and waits for the copy: it reads the
/// host memory when the stream gets to it, so without the wait a collective that then throws (a peer gone, a timeout)
/// would leave it queued behind host memory the unwinding frees.
template <class Backend>
TANDEM_COLD void stage_host(const Backend& backend, void* to, const void* from, std::size_t bytes) {
  backend.copy(to, from, bytes, backend.stream());
  backend.synchronize(backend.stream());
}

/// Every rank's words (this rank passes `mine`; every rank must pass as many): rank r's at [r * n, (r + 1) * n) of
/// the result. Collective.
template <Communicator Comm, class Backend>
TANDEM_COLD std::vector<std::uint64_t> all_gather_words(Comm& comm, Backend& backend,
                                                        const std::vector<std::uint64_t>& mine) {
  const std::size_t words = mine.size(), ranks = static_cast<std::size_t>(comm.size());
  auto staging = allocate_named<std::uint64_t>(backend, words * (ranks + 1), "the agreement's words");
  stage_host(backend, staging.data(), mine.data(), words * sizeof(std::uint64_t));
  comm.all_gather(staging.data(), staging.data() + words, words, DType::fp64, backend.stream());
  std::vector<std::uint64_t> all(words * ranks);
  backend.read(all.data(), staging.data() + words, all.size() * sizeof(std::uint64_t), backend.stream());
  return all;
}

/// The problem a rank passes to all_ranks_succeed for an exception it caught while `doing` ("writing `file`"): the
/// exception's message, or, for host memory that ran out (std::bad_alloc, whose message names nothing), a message
/// that says what the rank was doing.
inline std::string problem_of(const std::exception& e, const std::string& doing) {
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr)
    return "tandem: out of host memory while " + doing + " (" + e.what() + ")";
  return e.what();
}

/// Every rank passes its own problem (empty: none, else the message it would throw, up to 503 bytes of it travel);
/// returns, on every rank, its own message, or else the first failing rank's, named; nullopt where no rank has one.
/// Throws only where the collective does. Collective.
template <Communicator Comm, class Backend>
TANDEM_COLD std::optional<std::string> first_problem(Comm& comm, Backend& backend, const std::string& problem) {
  constexpr std::size_t words = 64;
  std::vector<std::uint64_t> mine(words, 0);
  mine[0] = problem.empty() ? 0 : 1;
  std::memcpy(&mine[1], problem.data(), std::min((words - 1) * sizeof(std::uint64_t) - 1, problem.size()));
  const std::vector<std::uint64_t> all = all_gather_words(comm, backend, mine);
  if (!problem.empty()) return problem;
  for (int r = 0; r < comm.size(); ++r) {
    const std::uint64_t* w = &all[static_cast<std::size_t>(r) * words];
    if (w[0] != 0)
      return "tandem: rank " + std::to_string(r) + " failed: " + std::string(reinterpret_cast<const char*>(&w[1]));
  }
  return std::nullopt;
}

/// first_problem, thrown: if any rank has a problem, every rank throws tandem::error with it. Collective.
template <Communicator Comm, class Backend>
TANDEM_COLD void all_ranks_succeed(Comm& comm, Backend& backend, const std::string& problem) {
  if (std::optional<std::string> failed = first_problem(comm, backend, problem)) throw error(std::move(*failed));
}

/// What must be equal on every rank for their DataParallel objects to work together, as words: the layout's
/// fingerprint, size and element count (words 0-2), then the configuration (policy, optimizer and its options,
/// DataParallelOptions but the stream, storage, world size).
struct Configuration {
  static constexpr std::size_t words = 14;
  std::uint64_t word[words] = {};
};

/// The configuration words of one rank. `optimizer` is the optimizer's name hash combined with its options'
/// fingerprint.
inline Configuration configuration_of(const Layout& layout, const char* policy, std::uint64_t optimizer,
                                      const DataParallelOptions& options, Storage storage, int world) {
  Configuration c;
  std::uint64_t* w = c.word;
  w[0] = layout.fingerprint();
  w[1] = layout.size();
  w[2] = layout.total_numel();
  w[3] = fnv1a(policy);
  w[4] = optimizer;
  w[5] = static_cast<std::uint64_t>(options.accumulation_steps);
  w[6] = options.bucket_cap_bytes;
  w[7] = options.first_bucket_cap_bytes;
  w[8] = static_cast<std::uint64_t>(storage);
  w[9] = static_cast<std::uint64_t>(world);
  std::memcpy(&w[10], &options.max_grad_norm, sizeof(float));
  w[10] |= static_cast<std::uint64_t>(options.non_finite) << 32;
  w[10] |= static_cast<std::uint64_t>(options.step_report) << 40;
  w[11] = static_cast<std::uint64_t>(options.gradient_buffers);
  w[12] = static_cast<std::uint64_t>(options.parameter_buffers);
  w[13] = static_cast<std::uint64_t>(options.reduce_dtype);
  return c;
}

/// Throws tandem::error, the same on every rank, if any rank's configuration (rank r's words at
/// [r * words, (r + 1) * words) of `all`) differs from rank 0's: naming the layout, or the configuration.
TANDEM_COLD inline void check_same_configuration(const std::vector<std::uint64_t>& all, int world) {
  constexpr std::size_t words = Configuration::words;
  const std::uint64_t* w0 = all.data();
  for (int r = 1; r < world; ++r) {
    const std::uint64_t* w = &all[static_cast<std::size_t>(r) * words];
    if (w[0] != w0[0])
      fail("tandem: the tensor layout differs between ranks: rank 0 has " + std::to_string(w0[1]) + " tensors of " +
           std::to_string(w0[2]) + " elements, rank " + std::to_string(r) + " has " + std::to_string(w[1]) +
           " tensors of " + std::to_string(w[2]) +
           " elements (or other names, sizes or dtypes); every rank must pass the same tensors in the same order");
    if (!std::equal(w0 + 3, w0 + words, w + 3))
      fail("tandem: ranks 0 and " + std::to_string(r) +
           " constructed DataParallel differently (policy, optimizer or its options, accumulation_steps, bucket caps, "
           "storage, world size, max_grad_norm, non_finite, step_report, gradient_buffers, parameter_buffers or "
           "reduce_dtype); "
           "every rank must use the same configuration");
  }
}

/// Every rank publishes its configuration; every rank then throws the same error if they differ. Collective.
template <Communicator Comm, class Backend>
TANDEM_COLD void agree_on_configuration(Comm& comm, Backend& backend, const Configuration& mine) {
  const std::vector<std::uint64_t> all =
      all_gather_words(comm, backend, std::vector<std::uint64_t>(mine.word, mine.word + Configuration::words));
  check_same_configuration(all, comm.size());
}

}  // namespace tandem::detail
