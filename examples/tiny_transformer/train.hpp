// SPDX-License-Identifier: Apache-2.0
// Data-parallel training of the tiny transformer with tandem: one rank's loop (train_rank, for any
// communicator and compute: host ranks over LocalComm or Mpi, CUDA ranks over Nccl) and N host ranks as threads
// of this process (train_local; cuda_train.cu has the CUDA counterpart). The lines that make training
// data-parallel are marked "tandem:"; everything else is what single-device training does anyway.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "data.hpp"
#include "model.hpp"
#include "tandem/tandem.hpp"

namespace tiny {

enum class PolicyKind { replicated, optimizer_sharded, gradient_sharded };

inline const char* policy_name(PolicyKind p) {
  switch (p) {
    case PolicyKind::replicated:
      return "Replicated";
    case PolicyKind::optimizer_sharded:
      return "OptimizerSharded";
    case PolicyKind::gradient_sharded:
      return "GradientSharded";
  }
  return "?";
}

/// Calls f.template operator()<Policy>() with the tandem policy type of `p`.
template <class F>
decltype(auto) with_policy(PolicyKind p, F&& f) {
  switch (p) {
    case PolicyKind::optimizer_sharded:
      return f.template operator()<tandem::OptimizerSharded>();
    case PolicyKind::gradient_sharded:
      return f.template operator()<tandem::GradientSharded>();
    case PolicyKind::replicated:
      break;
  }
  return f.template operator()<tandem::Replicated>();
}

enum class Precision {
  fp32,  ///< fp32 parameters and gradients
  bf16   ///< bf16 parameters and gradients for tandem (fp32 master weights inside tandem); the model computes in fp32
};

struct Task {
  std::string name;
  Examples train, eval;
  int vocab = 0;
  bool whole_example_accuracy = false;  ///< accuracy counts examples with every target right (else targets)
};

struct TrainConfig {
  ModelConfig model;
  int steps = 600;
  int batch = 32;  ///< global: examples per optimizer step, over all ranks and micro-steps
  int accumulation = 1;
  float lr = 3e-3f;  ///< peak; linear warm-up over the first 5% of the steps, cosine decay to 10% at the end
  float weight_decay = 0.0f;
  float max_grad_norm = 1.0f;
  std::uint64_t seed = 1;
  Precision precision = Precision::fp32;
  int eval_batch = 64;    ///< examples per evaluation forward pass
  int untimed_steps = 0;  ///< the first steps are left out of the throughput (buffers' first touch, caches)
};

struct TrainResult {
  double seconds = 0;               ///< the training loop's wall time (no set-up, no evaluation, no untimed steps)
  double tokens = 0;                ///< input tokens trained on, over all ranks
  double final_loss = 0;            ///< mean training loss of the last (up to) 10 steps, over the global batches
  double eval_loss = 0;             ///< mean loss over the held-out targets
  double eval_accuracy = 0;         ///< held-out accuracy (whole examples or targets, see Task)
  std::size_t memory_per_rank = 0;  ///< tandem's bytes per rank (MemoryReport::total)
  std::vector<float> params;        ///< rank 0's final parameters
  double tokens_per_second() const { return seconds > 0 ? tokens / seconds : 0; }
};

/// Called on rank 0 after every optimizer step: (step done, steps, global mean loss, seconds so far).
using Progress = std::function<void(int, int, double, double)>;

inline float learning_rate(const TrainConfig& cfg, int step) {
  const int warmup = std::max(1, cfg.steps / 20);
  if (step < warmup) return cfg.lr * float(step + 1) / float(warmup);
  const double t = double(step - warmup) / std::max(1, cfg.steps - warmup);
  return cfg.lr * float(0.1 + 0.45 * (1.0 + std::cos(3.141592653589793 * t)));
}

inline void validate(const TrainConfig& cfg, const Task& task, int world) {
  if (cfg.steps < 1) throw std::invalid_argument("--steps must be positive");
  if (cfg.batch % (cfg.accumulation * world) != 0)
    throw std::invalid_argument("--batch (" + std::to_string(cfg.batch) + ") must be a multiple of --accum x ranks (" +
                                std::to_string(cfg.accumulation) + " x " + std::to_string(world) + ")");
  if (task.train.len > cfg.model.context)
    throw std::invalid_argument("the task's sequences (" + std::to_string(task.train.len) +
                                " tokens) are longer than the model's context (" + std::to_string(cfg.model.context) +
                                ")");
  if (task.vocab > cfg.model.vocab) throw std::invalid_argument("the task's vocabulary exceeds the model's");
}

/// One rank's training: every rank of `comm` calls it with the same arguments. The model computes on `compute`
/// (HostCompute, or CudaCompute with an Nccl communicator).
template <class Policy, class Comm, class Compute = HostCompute>
TrainResult train_rank(Comm& comm, const TrainConfig& cfg, const Task& task, const Progress& progress = {},
                       Compute compute = {}) {
  const int rank = comm.rank(), world = comm.size(), len = task.train.len;
  validate(cfg, task, world);
  // Different on purpose on each rank: broadcast_parameters() makes them equal.
  Transformer<float, Compute> model(cfg.model, cfg.seed + std::uint64_t(rank), std::move(compute));
  Compute& dev = model.compute();
  const std::size_t numel = model.num_parameters();

  // The tensors tandem trains: the model's own buffers, or bf16 copies of them.
  std::vector<tandem::TensorRef> tensors = model.tensor_refs();
  typename Compute::template Array<tandem::BFloat16> params16, grads16;
  if (cfg.precision == Precision::bf16) {
    dev.resize(params16, numel);
    dev.resize(grads16, numel);
    dev.for_each(numel, CastBody<float, tandem::BFloat16>{model.parameters().data(), params16.data()});
    for (tandem::TensorRef& t : tensors) {
      const std::size_t offset = static_cast<float*>(t.param) - model.parameters().data();
      t = {t.name, params16.data() + offset, grads16.data() + offset, t.numel, tandem::DType::bf16};
    }
  }
  auto params_to_model = [&] {
    if (cfg.precision == Precision::bf16)
      dev.for_each(numel, CastBody<tandem::BFloat16, float>{params16.data(), model.parameters().data()});
  };

  // Everything allocated before the first collective (on GPUs, allocating between collectives can deadlock).
  const int local = cfg.batch / cfg.accumulation / world;
  model.reserve(std::max(local, cfg.eval_batch), len);

  tandem::DataParallel<Policy, tandem::AdamW, typename Compute::Backend, Comm> dp(  // tandem: wrap the model's tensors
      comm, tensors, {.lr = cfg.lr, .weight_decay = cfg.weight_decay},
      {.accumulation_steps = cfg.accumulation, .max_grad_norm = cfg.max_grad_norm, .stream = dev.stream()},
      dev.backend());
  dp.broadcast_parameters();  // tandem: rank 0's initial weights everywhere

  DistributedSampler sampler(task.train.size(), cfg.batch, cfg.seed);
  std::vector<int> tokens(std::size_t(local) * len), targets(tokens.size());
  double final_loss = 0;
  const int window = std::min(10, cfg.steps);

  const int untimed = cfg.untimed_steps < cfg.steps ? cfg.untimed_steps : 0;
  dev.synchronize();
  comm.barrier();
  auto start = std::chrono::steady_clock::now();
  for (int step = 0; step < cfg.steps; ++step) {
    if (step == untimed && step > 0) {
      dev.synchronize();
      comm.barrier();
      start = std::chrono::steady_clock::now();
    }
    dp.optimizer_options().lr = learning_rate(cfg, step);
    double loss = 0;
    for (int micro = 0; micro < cfg.accumulation; ++micro) {
      const std::vector<std::size_t> mine = sampler.indices(std::uint64_t(step), micro, cfg.accumulation, rank, world);
      for (std::size_t k = 0; k < mine.size(); ++k) {
        std::copy_n(task.train.tokens_of(mine[k]), len, tokens.begin() + std::ptrdiff_t(k * len));
        std::copy_n(task.train.targets_of(mine[k]), len, targets.begin() + std::ptrdiff_t(k * len));
      }
      params_to_model();
      loss += model.forward(tokens.data(), targets.data(), local, len, Pass::train).mean_loss() / cfg.accumulation;
      model.backward();
      if (cfg.precision == Precision::bf16)
        dev.for_each(numel, CastBody<float, tandem::BFloat16>{model.gradients().data(), grads16.data()});
      dp.step();  // tandem: average the gradients over ranks (and micro-steps), update, regather
    }
    dp.all_reduce_host({&loss, 1}, tandem::ReduceOp::avg);  // the global batch's mean
    if (step >= cfg.steps - window) final_loss += loss / window;
    if (rank == 0 && progress)
      progress(step + 1, cfg.steps, loss,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  dev.synchronize();
  comm.barrier();
  TrainResult result;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.tokens = double(cfg.steps - untimed) * cfg.batch * len;
  result.final_loss = final_loss;

  // Held-out evaluation, split over the ranks: rank r takes a contiguous 1/world of the examples.
  params_to_model();
  const std::size_t n_eval = task.eval.size();
  const std::size_t begin = n_eval * rank / world, end = n_eval * (rank + 1) / world;
  double sums[4] = {0, 0, 0, 0};  // loss, target rows, correct (rows or examples), examples
  for (std::size_t e = begin; e < end; e += std::size_t(cfg.eval_batch)) {
    const int b = int(std::min<std::size_t>(std::size_t(cfg.eval_batch), end - e));
    const ForwardStats s = model.forward(task.eval.tokens_of(e), task.eval.targets_of(e), b, len, Pass::evaluate);
    sums[0] += s.loss_sum;
    sums[1] += s.rows;
    if (!task.whole_example_accuracy) sums[2] += s.correct;
    for (int k = 0; k < b && task.whole_example_accuracy; ++k) {
      const auto& ok = model.row_correct();
      sums[2] += std::all_of(ok.begin() + k * len, ok.begin() + (k + 1) * len, [](std::uint8_t c) { return c != 0; });
    }
    sums[3] += b;
  }
  dp.all_reduce_host(sums, tandem::ReduceOp::sum);
  result.eval_loss = sums[1] > 0 ? sums[0] / sums[1] : 0;
  result.eval_accuracy =
      task.whole_example_accuracy ? sums[2] / std::max(1.0, sums[3]) : sums[2] / std::max(1.0, sums[1]);
  result.memory_per_rank = dp.memory_report().total();
  if (rank == 0) result.params = model.host_parameters();
  return result;
}

/// `ranks` ranks as threads of this process (tandem::LocalGroup); returns rank 0's result.
template <class Policy>
TrainResult train_local(int ranks, const TrainConfig& cfg, const Task& task, const Progress& progress = {}) {
  TrainResult out;
  std::mutex m;
  tandem::LocalGroup(ranks).run([&](tandem::LocalComm& comm) {  // tandem: one thread per rank
    use_one_blas_thread();
    TrainResult r = train_rank<Policy>(comm, cfg, task, progress);
    if (comm.rank() == 0) {
      std::lock_guard lock(m);
      out = std::move(r);
    }
  });
  return out;
}

}  // namespace tiny
