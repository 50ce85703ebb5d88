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

/// Makes this process's GPU current (cudaSetDevice) and returns it: the device of its local rank, or device 0 where
/// the launcher gave each process a GPU of its own (device_for, comm/launch_env.hpp). Throws, saying what the launcher
/// told, when the local rank is unknown or the process sees no such GPU.
inline int select_device(const LaunchInfo& info) {
  int devices = 0;
  TANDEM_CUDA_CHECK(cudaGetDeviceCount(&devices));
  const int device = device_for(info, devices);
  TANDEM_CUDA_CHECK(cudaSetDevice(device));
  return device;
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
/// selects the GPU (select_device), passes rank 0's id through the file `path` (tandem::share_blob; `job_key` must be
/// unique to the rendezvous, e.g. SLURM_JOB_ID.SLURM_STEP_ID: see file_rendezvous.hpp), and joins. Rank 0 removes the
/// file once it has joined (every rank has then read the id), or when joining fails.
inline Nccl nccl_from_environment(const std::string& path, std::string_view job_key, NcclOptions options = {},
                                  FileRendezvousOptions file = {}) {
  const LaunchInfo info = detect_launch();
  select_device(info);
  ncclUniqueId id{};
  if (info.rank == 0) id = Nccl::make_id();
  share_blob(path, job_key, info.rank, std::as_writable_bytes(std::span(&id, 1)), file);
  if (info.rank != 0) return Nccl(id, info.rank, info.world_size, options);
  // Removes the file once the communicator below is built (every rank has joined, so every rank read the id), or when
  // joining throws (readers still waiting then time out finding no file rather than join a communicator that is gone).
  const detail::BlobRemoval removal{path, std::string(job_key)};
  return Nccl(id, info.rank, info.world_size, options);
}

}  // namespace tandem
