// SPDX-License-Identifier: Apache-2.0
// The backend the DataParallel suite runs on. Each suite file is built twice (tests/CMakeLists.txt): as test_<x>
// on HostBackend (work runs in call order), and as test_<x>_streams with TANDEM_TEST_STREAMS on StreamHostBackend,
// where tandem's work and comm streams are worker threads with random delays before each operation (ctest label
// `streams`), and the pack tables are CudaBackend's (one list of 512-element items), so that the suite runs both.
// The delays are taken from the environment, so that CI can run the suite under several seeds unchanged:
//   TANDEM_STREAMS_SEED          the seed (default 1)
//   TANDEM_STREAMS_MAX_DELAY_US  the longest delay in microseconds (default 50; 0: none)
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "tandem/backend/host.hpp"
#include "tandem/backend/host_stream.hpp"
#include "tandem/comm/local_group.hpp"
#include "tandem/front/data_parallel.hpp"

namespace test {

inline std::uint64_t env_number(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::stoull(v) : fallback;
}

/// The delays the streams build uses, from the environment.
inline tandem::HostStreamOptions stream_delays() {
  return {.max_delay = std::chrono::microseconds(env_number("TANDEM_STREAMS_MAX_DELAY_US", 50)),
          .seed = env_number("TANDEM_STREAMS_SEED", 1)};
}

/// StreamHostBackend with the environment's delays on its work and comm streams, and CudaBackend's pack tables.
struct DelayedStreamBackend : tandem::StreamHostBackend {
  static constexpr tandem::PackTableLayout pack_table_layout = tandem::cuda_pack_table_layout;
  DelayedStreamBackend()
      : tandem::StreamHostBackend({.work_stream = stream_delays(), .comm_stream = stream_delays()}) {}
};

#if defined(TANDEM_TEST_STREAMS)
using Backend = DelayedStreamBackend;
#else
using Backend = tandem::HostBackend;
#endif

/// tandem::DataParallel on the suite's backend.
template <class Policy, class Optimizer, class Comm = tandem::LocalComm>
using DataParallel = tandem::DataParallel<Policy, Optimizer, Backend, Comm>;

}  // namespace test
