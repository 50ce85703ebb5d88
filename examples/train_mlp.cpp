// SPDX-License-Identifier: Apache-2.0
// Trains a small MLP (examples/mlp/mlp.hpp) on a synthetic classification task with N host ranks under each
// tandem policy, next to a 1-rank baseline, and prints wall time, throughput, final loss, held-out accuracy
// and tandem's memory per rank. The lines that make training data-parallel are marked "tandem:".
#include <CLI/CLI.hpp>
#include <chrono>
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

template <class Policy>
Outcome train(const Settings& s, int ranks, const mlp::Dataset& train_set, const mlp::Dataset& eval_set) {
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
        const int global_micro = (step * s.accumulation + micro) % (train_set.size() / (local * ranks));
        const int begin = global_micro * local * ranks + comm.rank() * local;  // disjoint slice per rank
        const float loss = model.forward_backward(train_set, begin, local);
        if (step >= s.steps - 20) loss_sum += loss, ++loss_count;
        dp.step();  // tandem: reduce, update, regather
      }
    }
    comm.all_reduce(&loss_sum, &loss_sum, 1, tandem::DType::fp64, tandem::ReduceOp::avg);  // the global mean
    if (comm.rank() == 0) {
      std::lock_guard lock(m);
      out.loss = loss_sum / loss_count;
      out.accuracy = model.accuracy(eval_set, 0, eval_set.size());
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
  app.add_option("--lr", s.lr, "AdamW learning rate");
  app.add_option("--seed", s.seed, "seed of the data and the initial weights");
  if (const int code = examples::parse_command_line(app, argc, argv); code >= 0) return code;
  if (s.batch % (s.ranks * s.accumulation) != 0) {
    std::fprintf(stderr, "--batch (%d) must be a multiple of --ranks x --accum (%d)\n", s.batch,
                 s.ranks * s.accumulation);
    return 2;
  }

  const mlp::Dataset train_set(train_samples, s.dims.front(), s.dims.back(), s.seed);
  const mlp::Dataset eval_set(eval_samples, s.dims.front(), s.dims.back(), s.seed);  // same task, held-out samples
  // (the teacher is drawn first from the same seed, so both sets share it; the samples differ by position)
  std::printf("MLP %d-%d-%d-%d, %d steps of %d samples, AdamW lr %g, accumulation %d\n\n", s.dims[0], s.dims[1],
              s.dims[2], s.dims[3], s.steps, s.batch, s.lr, s.accumulation);
  std::printf("%-17s %5s %8s %10s %8s %10s %9s %10s\n", "policy", "ranks", "time s", "samples/s", "speed-up",
              "final loss", "accuracy", "KiB/rank");
  try {
    const Outcome base = train<tandem::Replicated>(s, 1, train_set, eval_set);
    print_row("1 rank", 1, s, base, base.seconds);
    print_row("Replicated", s.ranks, s, train<tandem::Replicated>(s, s.ranks, train_set, eval_set), base.seconds);
    print_row("OptimizerSharded", s.ranks, s, train<tandem::OptimizerSharded>(s, s.ranks, train_set, eval_set),
              base.seconds);
    print_row("GradientSharded", s.ranks, s, train<tandem::GradientSharded>(s, s.ranks, train_set, eval_set),
              base.seconds);
  } catch (const std::exception& e) {  // tandem's refusal of an argument (--lr nan, say), or a failure: one line
    std::fprintf(stderr, "train_mlp: %s\n", e.what());
    return 1;
  }
  return 0;
}
