// SPDX-License-Identifier: Apache-2.0
// CUDA ranks of the tiny transformer: the same train_rank as the host ranks, with CudaCompute for the model and
// tandem's CudaBackend and Nccl for the data parallelism.
#include <mutex>
#include <stdexcept>
#include <string>

#include "cuda_compute.cuh"
#include "cuda_train.hpp"
#include "tandem/comm/nccl.hpp"
#include "tandem/comm/nccl_bootstrap.hpp"

namespace tiny {

int cuda_device_count() { return tandem::visible_cuda_devices(); }

std::string cuda_fault() { return tandem::cuda_device_fault(); }

void require_gpus(int ranks) {
  if (const std::string fault = cuda_fault(); !fault.empty())
    throw std::invalid_argument("--backend cuda: CUDA cannot use this machine's GPUs: " + fault);
  const int devices = cuda_device_count();
  if (ranks > devices)
    throw std::invalid_argument("--backend cuda needs one GPU per rank: " + std::to_string(ranks) + " rank(s), " +
                                std::to_string(devices) + " GPU(s) visible");
}

TrainResult train_cuda(PolicyKind policy, int ranks, const TrainConfig& cfg, const Task& task,
                       const Progress& progress) {
  require_gpus(ranks);
  std::vector<int> ids;
  for (int d = 0; d < ranks; ++d) ids.push_back(d);
  TrainResult out;
  std::mutex m;
  with_policy(policy, [&]<class Policy>() {
    tandem::NcclGroup(ids).run([&](tandem::Nccl& comm) {  // tandem: one thread and one GPU per rank
      TrainResult r = train_rank<Policy>(comm, cfg, task, progress, CudaCompute(ids[std::size_t(comm.rank())]));
      if (comm.rank() == 0) {
        std::lock_guard lock(m);
        out = std::move(r);
      }
    });
  });
  return out;
}

#if defined(TINY_HAVE_MPI)
TrainResult train_cuda_mpi(PolicyKind policy, tandem::Mpi& mpi, const TrainConfig& cfg, const Task& task,
                           const Progress& progress) {
  const int device = tandem::select_device(tandem::detect_launch());  // the local rank's GPU
  CudaCompute compute(device);
  tandem::Nccl comm = tandem::nccl_from_host_comm(mpi);  // rank 0's NCCL id, broadcast over MPI
  return with_policy(policy,
                     [&]<class Policy>() { return train_rank<Policy>(comm, cfg, task, progress, std::move(compute)); });
}
#endif

}  // namespace tiny
