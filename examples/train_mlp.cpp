// SPDX-License-Identifier: Apache-2.0
// Trains a small MLP (examples/mlp/mlp.hpp) on a synthetic classification task with N host ranks under each
// tandem policy, next to a 1-rank baseline, and prints wall time, throughput, final loss, held-out accuracy
// and tandem's memory per rank; it fails (exit code 1) where a policy's final loss is not the baseline's within
// 1e-4 relative, or is not finite. The lines that make training data-parallel are marked "tandem:".
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include "cli.hpp"
#include "mlp/mlp.hpp"
#include "tandem/tandem.hpp"

namespace {

constexpr int train_samples = 16384, eval_samples = 4096;

struct Settings {
  int ranks = 2;
  int steps = 2000;
  int batch = 64;  // global
  int accumulation = 1;
  float lr = 5e-3f;
  std::uint64_t seed = 1;
  std::vector<int> dims = {32, 128, 128, 10};
};

struct Outcome {
  double seconds = 0, loss = 0, accuracy = 0;
  tandem::MemoryReport memory;
};

// One data set: training draws from its first train_samples samples, the accuracy is measured on the rest.
template <class Policy>
Outcome train(const Settings& s, int ranks, const mlp::Dataset& data) {
  Outcome out;
  std::mutex m;
  const auto start = std::chrono::steady_clock::now();
  tandem::LocalGroup(ranks).run([&](tandem::LocalComm& comm) {  // tandem: one thread per rank
    mlp::Mlp<float> model(s.dims, s.seed + static_cast<std::uint64_t>(comm.rank()));
    tandem::DataParallel<Policy, tandem::AdamW> dp(comm, model.tensors(), {.lr = s.lr},  // tandem: wrap
                                                   {.accumulation_steps = s.accumulation});
    dp.broadcast_parameters();                           // tandem: rank 0's weights everywhere
    const int local = s.batch / ranks / s.accumulation;  // this rank's share of a micro-batch
    double loss_sum = 0;
    int loss_count = 0;
    for (int step = 0; step < s.steps; ++step) {
      for (int micro = 0; micro < s.accumulation; ++micro) {
        const int global_micro = (step * s.accumulation + micro) % (train_samples / (local * ranks));
        const int begin = global_micro * local * ranks + comm.rank() * local;  // disjoint slice per rank
        const float loss = model.forward_backward(data, begin, local);
        if (step >= s.steps - 20) loss_sum += loss, ++loss_count;
        dp.step();  // tandem: reduce, update, regather
      }
    }
    comm.all_reduce(&loss_sum, &loss_sum, 1, tandem::DType::fp64, tandem::ReduceOp::avg);  // the global mean
    if (comm.rank() == 0) {
      std::lock_guard lock(m);
      out.loss = loss_sum / loss_count;
      out.accuracy = model.accuracy(data, train_samples, eval_samples);  // held out: never trained on
      out.memory = dp.memory_report();
    }
  });
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

void print_row(const char* policy, int ranks, const Settings& s, const Outcome& o, double baseline_seconds) {
  const double samples = static_cast<double>(s.steps) * s.batch;
  std::printf("%-17s %5d %8.2f %10.0f %7.2fx %10.4f %8.1f%% %10.1f\n", policy, ranks, o.seconds, samples / o.seconds,
              baseline_seconds / o.seconds, o.loss, 100.0 * o.accuracy, static_cast<double>(o.memory.total()) / 1024.0);
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{"Train a small MLP with tandem on N host ranks under each policy, next to 1 rank."};
  app.add_option("--ranks", s.ranks, "ranks (threads) to compare with 1 rank")->check(CLI::Range(1, 64));
  app.add_option("--steps", s.steps, "optimizer steps")->check(examples::positive);
  app.add_option("--batch", s.batch, "global batch (samples per optimizer step), at most the 16384 training samples")
      ->check(CLI::Range(1, train_samples));
  app.add_option("--accum", s.accumulation, "micro-steps per optimizer step")->check(CLI::Range(1, train_samples));
  app.add_option("--lr", s.lr, "AdamW learning rate")->check(examples::positive);
  app.add_option("--seed", s.seed, "seed of the data and the initial weights")->check(examples::non_negative);
  if (const int code = examples::parse_command_line(app, argc, argv); code >= 0) return code;
  if (s.batch % (s.ranks * s.accumulation) != 0) {
    std::fprintf(stderr, "--batch (%d) must be a multiple of --ranks x --accum (%d)\n", s.batch,
                 s.ranks * s.accumulation);
    return 2;
  }

  const mlp::Dataset data(train_samples + eval_samples, s.dims.front(), s.dims.back(), s.seed);
  std::printf("MLP %d-%d-%d-%d, %d steps of %d samples, AdamW lr %g, accumulation %d\n\n", s.dims[0], s.dims[1],
              s.dims[2], s.dims[3], s.steps, s.batch, s.lr, s.accumulation);
  std::printf("%-17s %5s %8s %10s %8s %10s %9s %10s\n", "policy", "ranks", "time s", "samples/s", "speed-up",
              "final loss", "accuracy", "KiB/rank");
  double worst = 0;  // the largest relative difference of a policy's final loss from the baseline's
  try {
    const Outcome base = train<tandem::Replicated>(s, 1, data);
    print_row("1 rank", 1, s, base, base.seconds);
    const auto row = [&](const char* policy, const Outcome& o) {
      print_row(policy, s.ranks, s, o, base.seconds);
      const double difference = std::abs(o.loss - base.loss) / std::abs(base.loss);
      worst = std::isfinite(difference) ? std::max(worst, difference) : INFINITY;
    };
    row("Replicated", train<tandem::Replicated>(s, s.ranks, data));
    row("OptimizerSharded", train<tandem::OptimizerSharded>(s, s.ranks, data));
    row("GradientSharded", train<tandem::GradientSharded>(s, s.ranks, data));
  } catch (const std::exception& e) {  // a failure: one line
    std::fprintf(stderr, "train_mlp: %s\n", e.what());
    return 1;
  }
  // The ranks split each global batch, so every policy takes the 1-rank run's steps: they differ by the order of the
  // gradient sums' float additions alone.
  std::printf("\n%d ranks vs 1: final loss within %.1e relative under every policy (at most 1e-4 passes)\n", s.ranks,
              worst);
  return worst <= 1e-4 ? 0 : 1;
}
