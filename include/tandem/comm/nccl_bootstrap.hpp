// SPDX-License-Identifier: Apache-2.0
// Bootstraps of the Nccl communicator for one process per GPU: choose the GPU by local rank, make rank 0's
// ncclUniqueId, carry it to every rank (over a host communicator such as tandem::Mpi, or through a file every
// rank sees), then join. Single-process multi-GPU is NcclGroup (comm/nccl.hpp).
//
//   MPI (mpirun, srun --mpi=...):        tandem::Mpi host(MPI_COMM_WORLD);
//                                        tandem::select_device(tandem::detect_launch());
//                                        tandem::Nccl gpu = tandem::nccl_from_host_comm(host);
//   environment (torchrun-style, srun):  tandem::Nccl gpu = tandem::nccl_from_environment(path, job_key);
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstddef>
#include <span>
#include <string>
#include <string_view>

#include "tandem/backend/cuda/check.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/comm/file_rendezvous.hpp"
#include "tandem/comm/launch_env.hpp"
#include "tandem/comm/nccl.hpp"
#include "tandem/core/error.hpp"

namespace tandem {

/// Makes the GPU of this process's local rank current (cudaSetDevice) and returns it. Throws, saying what the
/// launcher told, when the local rank is unknown or the node has fewer GPUs than processes.
inline int select_device(const LaunchInfo& info) {
  if (!info.local_rank)
    detail::fail("tandem: select_device: the launcher did not say this process's local rank, so its GPU is unknown (" +
                 info.describe() + "); set LOCAL_RANK, or call cudaSetDevice yourself");
  int devices = 0;
  TANDEM_CUDA_CHECK(cudaGetDeviceCount(&devices));
  if (*info.local_rank >= devices)
    detail::fail("tandem: select_device: local rank " + std::to_string(*info.local_rank) + " but this node has " +
                 std::to_string(devices) + " GPU(s); start at most one process per GPU (" + info.describe() + ")");
  TANDEM_CUDA_CHECK(cudaSetDevice(*info.local_rank));
  return *info.local_rank;
}

/// Joins an Nccl communicator of the same ranks as `host` (tandem::Mpi, or any host-memory communicator):
/// rank 0 makes the id, `host` broadcasts it. Call with each rank's GPU already current (select_device).
template <Communicator HostComm>
Nccl nccl_from_host_comm(HostComm& host, NcclOptions options = {}) {
  static_assert(sizeof(ncclUniqueId) % sizeof(float) == 0, "the id travels as 4-byte words");
  ncclUniqueId id{};
  if (host.rank() == 0) id = Nccl::make_id();
  // A broadcast copies its words unchanged (no arithmetic), so the id's bytes may travel as fp32 words.
  host.broadcast(&id, &id, sizeof(id) / sizeof(float), DType::fp32, 0, Stream{});
  return Nccl(id, host.rank(), host.size(), options);
}

/// One process per GPU started by a launcher without MPI (torchrun-style RANK/WORLD_SIZE/LOCAL_RANK, or srun):
/// selects the GPU by local rank, passes rank 0's id through the file `path` (tandem::share_blob; `job_key` tells
/// this job's file from a stale one, e.g. the scheduler's job id), and joins.
inline Nccl nccl_from_environment(const std::string& path, std::string_view job_key, NcclOptions options = {},
                                  FileRendezvousOptions file = {}) {
  const LaunchInfo info = detect_launch();
  select_device(info);
  ncclUniqueId id{};
  if (info.rank == 0) id = Nccl::make_id();
  share_blob(path, job_key, info.rank, std::as_writable_bytes(std::span(&id, 1)), file);
  return Nccl(id, info.rank, info.world_size, options);
}

}  // namespace tandem
