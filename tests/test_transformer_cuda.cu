// SPDX-License-Identifier: Apache-2.0
// GPU tests of the tiny transformer's CUDA path (label `gpu`; exit code 77, reported skipped, where no GPU exists).
// The model on CudaCompute runs ops.hpp's item bodies as kernels and its products on cuBLAS; it must compute what
// the host computes and train to the host's loss:
//   - one forward and backward (several attention blocks, the last partial; rows without a target): the loss
//     within 1e-5 relative, every parameter's gradient within 1e-4 relative (cuBLAS and OpenBLAS sum in
//     different orders, nvcc contracts to FMA);
//   - a few training steps through DataParallel<..., CudaBackend, Nccl> on one GPU under each policy, in fp32 and
//     in bf16 with accumulation: final and held-out loss, and the trained parameters, within 1e-3 relative of
//     the host (2e-2 in bf16);
//   - with two or more GPUs: 2 CUDA ranks (NCCL) against 2 host ranks.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "../examples/tiny_transformer/cuda_compute.cuh"
#include "support/gpu_main.hpp"
#include "support/params.hpp"
#include "support/sort_task.hpp"
#include "tandem/comm/nccl.hpp"

namespace {

double relative_error(double a, double ref) { return std::abs(a - ref) / std::max(std::abs(ref), 1e-30); }

/// Trains `ranks` CUDA ranks (devices 0..ranks-1) and returns rank 0's result.
template <class Policy>
tiny::TrainResult train_gpus(int ranks, const tiny::TrainConfig& cfg, const tiny::Task& task) {
  std::vector<int> devices;
  for (int d = 0; d < ranks; ++d) devices.push_back(d);
  tiny::TrainResult out;
  std::mutex m;
  tandem::NcclGroup(devices).run([&](tandem::Nccl& comm) {
    tiny::TrainResult r =
        tiny::train_rank<Policy>(comm, cfg, task, {}, tiny::CudaCompute(devices[std::size_t(comm.rank())]));
    std::lock_guard lock(m);
    if (comm.rank() == 0) out = std::move(r);
  });
  return out;
}

/// The GPU run's final and held-out loss, and its trained parameters, within `tolerance` relative of the host's.
void check_same_training(const tiny::TrainResult& gpu, const tiny::TrainResult& host, double tolerance) {
  const double params_error = test::max_relative_error({gpu.params}, {host.params});
  MESSAGE("final loss: GPU " << gpu.final_loss << ", host " << host.final_loss << "; held-out loss: GPU "
                             << gpu.eval_loss << ", host " << host.eval_loss << "; parameters differ by "
                             << params_error << " relative");
  CHECK(relative_error(gpu.final_loss, host.final_loss) <= tolerance);
  CHECK(relative_error(gpu.eval_loss, host.eval_loss) <= tolerance);
  REQUIRE(gpu.params.size() == host.params.size());
  CHECK(params_error <= tolerance);
}

}  // namespace

TEST_CASE("one forward and backward on the GPU equal the host's") {
  const tiny::ModelConfig cfg{.vocab = 37, .context = 80, .width = 32, .layers = 2, .heads = 4, .mlp_ratio = 4};
  const int batch = 3, len = 75;  // two blocks of attention rows, the second partial
  std::mt19937 rng(17);
  std::vector<int> tokens(batch * len), targets(batch * len);
  for (int r = 0; r < batch * len; ++r) {
    tokens[std::size_t(r)] = int(rng() % cfg.vocab);
    targets[std::size_t(r)] = r % 7 == 3 ? -1 : int(rng() % cfg.vocab);
  }
  tiny::Transformer<float> host(cfg, 5);
  tiny::Transformer<float, tiny::CudaCompute> gpu(cfg, 5, tiny::CudaCompute(0));
  REQUIRE(gpu.host_parameters() == host.parameters());

  for (tiny::Pass pass : {tiny::Pass::evaluate, tiny::Pass::train}) {
    const tiny::ForwardStats h = host.forward(tokens.data(), targets.data(), batch, len, pass);
    const tiny::ForwardStats g = gpu.forward(tokens.data(), targets.data(), batch, len, pass);
    CHECK(g.rows == h.rows);
    CHECK(relative_error(g.loss_sum, h.loss_sum) <= 1e-5);
    CHECK(std::abs(g.correct - h.correct) <= 1);  // an argmax may tip on a near tie
  }
  host.backward();
  gpu.backward();
  std::vector<float> grads(gpu.num_parameters());
  gpu.compute().to_host(grads.data(), gpu.gradients().data(), grads.size() * sizeof(float));
  test::Params got, ref;
  std::size_t offset = 0;
  for (std::size_t t = 0; t < host.num_tensors(); ++t) {
    const std::size_t n = host.tensor_numel(t);
    got.emplace_back(grads.begin() + std::ptrdiff_t(offset), grads.begin() + std::ptrdiff_t(offset + n));
    ref.emplace_back(host.grad(t), host.grad(t) + n);
    offset += n;
  }
  const double error = test::max_relative_error(got, ref);
  MESSAGE("largest relative gradient error over " << host.num_tensors() << " tensors: " << error);
  CHECK(error <= 1e-4);
}

TEST_CASE_TEMPLATE("training on one GPU matches the host's loss", Policy, tandem::Replicated, tandem::OptimizerSharded,
                   tandem::GradientSharded, tandem::ParameterSharded) {
  const tiny::Task task = test::sort_task(32 * 40);
  const tiny::TrainConfig cfg = test::sort_config(40);
  check_same_training(train_gpus<Policy>(1, cfg, task), tiny::train_local<Policy>(1, cfg, task), 1e-3);
}

TEST_CASE("bf16 parameters with accumulation on one GPU track the host") {
  const tiny::Task task = test::sort_task(32 * 40);
  tiny::TrainConfig cfg = test::sort_config(40);
  cfg.precision = tiny::Precision::bf16;
  cfg.accumulation = 2;
  check_same_training(train_gpus<tandem::GradientSharded>(1, cfg, task),
                      tiny::train_local<tandem::GradientSharded>(1, cfg, task), 2e-2);
}

TEST_CASE_TEMPLATE("2 GPU ranks (NCCL) match 2 host ranks", Policy, tandem::Replicated, tandem::GradientSharded,
                   tandem::ParameterSharded) {
  test::require_gpus(2);  // fewer GPUs: reported as skipped
  const tiny::Task task = test::sort_task(32 * 40);
  const tiny::TrainConfig cfg = test::sort_config(40);
  check_same_training(train_gpus<Policy>(2, cfg, task), tiny::train_local<Policy>(2, cfg, task), 1e-3);
}
