// SPDX-License-Identifier: Apache-2.0
// The tiny transformer's CUDA ranks, compiled by nvcc in cuda_train.cu (only where CUDA and NCCL are enabled:
// TINY_HAVE_CUDA). main.cpp, a host translation unit, calls these.
#pragma once

#include "train.hpp"

#if defined(TINY_HAVE_MPI)
#include "tandem/comm/mpi.hpp"
#endif

namespace tiny {

/// GPUs this process can use (0 without a driver or device: then the host backend is the default).
int cuda_device_count();

/// Where a CUDA driver is installed but no GPU can be used, why (tandem::cuda_device_fault); "" otherwise.
std::string cuda_fault();

/// Throws, saying so, when fewer than `ranks` GPUs are visible, or CUDA fails (cuda_fault).
void require_gpus(int ranks);

/// `ranks` CUDA ranks as threads of this process, one per GPU (devices 0..ranks-1, NCCL between them); returns
/// rank 0's result (require_gpus first).
TrainResult train_cuda(PolicyKind policy, int ranks, const TrainConfig& cfg, const Task& task,
                       const Progress& progress = {});

#if defined(TINY_HAVE_MPI)
/// This process as one CUDA rank of an MPI job: the GPU of its local rank, NCCL set up through `mpi`.
TrainResult train_cuda_mpi(PolicyKind policy, tandem::Mpi& mpi, const TrainConfig& cfg, const Task& task,
                           const Progress& progress = {});
#endif

}  // namespace tiny
