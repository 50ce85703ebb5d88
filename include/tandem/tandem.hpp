// SPDX-License-Identifier: Apache-2.0
// The umbrella header: data parallelism on the host backend with LocalGroup (ranks as threads), every policy and
// optimizer, and the stream-faithful host backend (tandem/backend/host_stream.hpp, which LocalGroup uses). Launch
// helpers (tandem/comm/launch_env.hpp, file_rendezvous.hpp), Mpi (tandem/comm/mpi.hpp), DeviceGroup
// (tandem/comm/device_group.hpp) and the CUDA parts (tandem/backend/cuda.hpp, tandem/comm/nccl.hpp) are included by
// name, so that a program pays to compile only what it uses.
#pragma once

#include "tandem/backend/host.hpp"
#include "tandem/backend/launch.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/comm/local_group.hpp"
#include "tandem/core/checkpoint.hpp"
#include "tandem/core/config.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/hash.hpp"
#include "tandem/core/plan.hpp"
#include "tandem/core/stream.hpp"
#include "tandem/core/tensor.hpp"
#include "tandem/front/checkpoint_files.hpp"
#include "tandem/front/data_parallel.hpp"
#include "tandem/front/estimate.hpp"
#include "tandem/front/options.hpp"
#include "tandem/kernels/adamw.hpp"
#include "tandem/kernels/optimizer.hpp"
#include "tandem/kernels/pack.hpp"
#include "tandem/kernels/sgd.hpp"
#include "tandem/kernels/sum_squares.hpp"
#include "tandem/kernels/vector.hpp"
#include "tandem/policy/gradient_sharded.hpp"
#include "tandem/policy/optimizer_sharded.hpp"
#include "tandem/policy/parameter_sharded.hpp"
#include "tandem/policy/policy.hpp"
#include "tandem/policy/replicated.hpp"
