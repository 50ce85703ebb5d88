// SPDX-License-Identifier: Apache-2.0
// Data-parallel training of the tiny transformer with tandem: one rank's loop (train_rank, for any
// communicator and compute: host ranks over LocalComm or Mpi, CUDA ranks over Nccl) and N host ranks as threads
// of this process (train_local; cuda_train.cu has the CUDA counterpart). The lines that make training
// data-parallel are marked "tandem:"; everything else is what single-device training does anyway.
#pragma once

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "data.hpp"
#include "model.hpp"
#include "tandem/tandem.hpp"

namespace tiny {

enum class PolicyKind { replicated, optimizer_sharded, gradient_sharded, parameter_sharded };

inline const char* policy_name(PolicyKind p) {
  switch (p) {
    case PolicyKind::replicated:
      return "Replicated";
    case PolicyKind::optimizer_sharded:
      return "OptimizerSharded";
    case PolicyKind::gradient_sharded:
      return "GradientSharded";
    case PolicyKind::parameter_sharded:
      return "ParameterSharded";
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
    case PolicyKind::parameter_sharded:
      return f.template operator()<tandem::ParameterSharded>();
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
  /// The dtype gradients cross ranks in (tandem's reduce_dtype): fp32, or bf16 for half the bytes.
  tandem::DType reduce_dtype = tandem::DType::fp32;
  int eval_batch = 64;    ///< examples per evaluation forward pass
  int untimed_steps = 0;  ///< the first steps (fewer than `steps`) are left out of the throughput (first touch, caches)
  /// The learning-rate schedule's length (0: `steps`). A run that stops and resumes follows the schedule of one that
  /// never stopped only when both give the same length here.
  int schedule_steps = 0;
  std::string save_dir;    ///< non-empty: save a checkpoint here at the end (and every save_every steps)
  int save_every = 0;      ///< > 0: also save after every save_every-th step
  std::string resume_dir;  ///< non-empty: start from the checkpoint here (its step count: where training goes on)
};

struct TrainResult {
  double seconds = 0;     ///< the training loop's wall time (no set-up, evaluation, untimed steps or checkpoint saves)
  double tokens = 0;      ///< input tokens trained on, over all ranks
  double final_loss = 0;  ///< mean training loss of the last (up to) 10 steps, over the global batches
  double eval_loss = 0;   ///< mean loss over the held-out targets
  double eval_accuracy = 0;     ///< held-out accuracy (whole examples or targets, see Task)
  tandem::MemoryReport memory;  ///< bytes per rank, rank 0's memory_report()
  std::vector<float> params;    ///< rank 0's final parameters
  double tokens_per_second() const { return seconds > 0 ? tokens / seconds : 0; }
};

/// What rank 0 reports after every optimizer step.
struct StepReport {
  int step = 0;         ///< steps done (counted from 0, also when resumed)
  int steps = 0;        ///< the step training ends at
  double loss = 0;      ///< the global batch's mean loss
  double seconds = 0;   ///< since the clock started: at the first step run, then again after cfg.untimed_steps
  int timed_steps = 0;  ///< the steps `seconds` covers (rates and the ETA divide by these, not by `step`)
};

/// Called on rank 0 after every optimizer step.
using Progress = std::function<void(const StepReport&)>;

/// What a checkpoint of this example records of the run that saved it (tandem keeps it with the training state): what a
/// run that resumes from it must share with it to continue it (the training set, the order of its batches, the
/// learning-rate schedule), keyed by the options that set them.
inline tandem::CheckpointMetadata run_record(const TrainConfig& cfg, const Task& task) {
  char lr[32], data[17];
  *std::to_chars(lr, lr + sizeof lr - 1, cfg.lr).ptr = '\0';  // (the shortest text that reads back as this float)
  std::snprintf(data, sizeof data, "%016llx", static_cast<unsigned long long>(task.train.fingerprint()));
  return {{"training set", task.name + ", " + std::to_string(task.train.size()) + " examples of " +
                               std::to_string(task.train.len) + " tokens, fingerprint " + data},
          {"--seed", std::to_string(cfg.seed)},
          {"--batch", std::to_string(cfg.batch)},
          {"--lr", lr},
          {"--schedule-steps", std::to_string(cfg.schedule_steps > 0 ? cfg.schedule_steps : cfg.steps)}};
}

/// Throws std::invalid_argument unless this run (`cfg`, `task`) can resume from a checkpoint that recorded `saved` (its
/// metadata) at step `step`: it continues that checkpoint's run (its run_record is `saved`; a checkpoint that records
/// nothing passes: imported parameters, where a run starts rather than goes on) and trains past `step`.
inline void check_resumable(const tandem::CheckpointMetadata& saved, std::uint64_t step, const TrainConfig& cfg,
                            const Task& task) {
  std::string differs;
  if (!saved.empty())
    for (const auto& [key, value] : run_record(cfg, task))
      if (const auto it = saved.find(key); it == saved.end() || it->second != value)
        differs +=
            "\n  " + key + ": " + (it == saved.end() ? "not recorded" : it->second) + " (this run: " + value + ")";
  if (!differs.empty())
    throw std::invalid_argument(
        "--resume: the checkpoint in '" + cfg.resume_dir + "' is of a run this one would not continue:" + differs +
        "\ngive that run's options to continue it; to start a new run from its parameters, make them a checkpoint of "
        "their own (tandem_checkpoint consolidate, then import) and resume from that");
  if (step >= std::uint64_t(cfg.steps))
    throw std::invalid_argument("--resume: the checkpoint in '" + cfg.resume_dir + "' is at step " +
                                std::to_string(step) + ", which --steps " + std::to_string(cfg.steps) +
                                " does not go past: nothing to train; raise --steps");
}

/// Throws std::invalid_argument, naming the options to change, unless this run can resume from the checkpoint in
/// cfg.resume_dir as its manifest describes it (tandem::read_checkpoint_manifest: read before anything trains): one
/// there, of parameters in this run's dtype (--bf16), that check_resumable passes. Where a save replaces the checkpoint
/// after this, train_rank checks again what it loads.
inline void check_resume_manifest(const TrainConfig& cfg, const Task& task) {
  tandem::CheckpointManifest m;
  try {
    m = tandem::read_checkpoint_manifest(cfg.resume_dir);
  } catch (const tandem::error& e) {
    throw std::invalid_argument(std::string("--resume: ") + e.what());
  }
  const tandem::DType trains = cfg.precision == Precision::bf16 ? tandem::DType::bf16 : tandem::DType::fp32;
  if (m.param_dtype != trains) {
    const std::string holds = tandem::dtype_name(m.param_dtype);
    throw std::invalid_argument("--resume: the checkpoint in '" + cfg.resume_dir + "' holds " + holds +
                                " parameters, and this run trains " + tandem::dtype_name(trains) + " ones: " +
                                (m.param_dtype == tandem::DType::bf16 ? std::string("resume it with --bf16")
                                 : m.param_dtype == tandem::DType::fp32
                                     ? std::string("resume it without --bf16")
                                     : "this example trains fp32 or bf16 (--bf16) parameters only"));
  }
  // (as load_checkpoint takes them: a parameters-only checkpoint, imported, records no run and starts at step 0)
  check_resumable(m.parameters_only ? tandem::CheckpointMetadata{} : m.metadata, m.parameters_only ? 0 : m.step, cfg,
                  task);
}

inline float learning_rate(const TrainConfig& cfg, int step) {
  const int length = cfg.schedule_steps > 0 ? cfg.schedule_steps : cfg.steps;
  const int warmup = std::max(1, length / 20);
  if (step < warmup) return cfg.lr * float(step + 1) / float(warmup);
  const double t = std::min(1.0, double(step - warmup) / std::max(1, length - warmup));  // the floor after the end
  return cfg.lr * float(0.1 + 0.45 * (1.0 + std::cos(3.141592653589793 * t)));
}

/// Whether the example trains under `Policy` on tandem's storage: the policies that keep no full gradients (and
/// ParameterSharded no full parameters) would otherwise leave their saving in the model's own buffers, so the model
/// reads and writes tandem's views unit by unit (BucketPasses). The others wrap the model's buffers.
template <class Policy>
inline constexpr bool on_tandem_storage = Policy::reduction == tandem::GradientReduction::every_micro_step;

/// The model's unit hook under owned storage, and the only place that knows about buckets. Before each unit of
/// forward it holds the ParameterBuckets of the buckets holding the unit's tensors (releasing those the unit does not
/// need) and prefetches the next unit's; before each unit of backward it also holds their GradientBuckets, releasing
/// (so reducing, while backward goes on) those whose tensors are all done. The model's tensors are bound to the views;
/// bf16 parameters are first cast into an fp32 copy of the bucket, since the model computes in fp32.
template <class DP, class Model>
class BucketPasses {
 public:
  using Compute = std::remove_cvref_t<decltype(std::declval<Model&>().compute())>;
  static constexpr std::size_t none = std::size_t(-1);

  /// For the plan the DataParallel cuts (tandem::bucket_plan). Allocates the fp32 copies (bf16) now, before any
  /// collective.
  BucketPasses(const tandem::Plan& plan, Model& model, Precision precision)
      : model_(model),
        bf16_(precision == Precision::bf16),
        units_(unit_buckets(plan, model)),
        params_(plan.num_buckets()),
        grads_(plan.num_buckets()),
        copy_of_(plan.num_buckets(), none) {
    if (bf16_) {
      copies_.resize(std::size_t(parameter_buffers(plan, model)));
      for (auto& c : copies_) model.compute().resize(c, plan.max_bucket_size());
    }
  }
  void attach(DP& dp) { dp_ = &dp; }

  /// Bucket buffers a pass holds at once for this plan: parameters for a unit and the next unit's prefetch; gradients
  /// for a unit, plus the one the gradient buffers' rule keeps for the next bucket in order.
  static int parameter_buffers(const tandem::Plan& plan, const Model& model) {
    const auto units = unit_buckets(plan, model);
    std::size_t most = 1;
    for (std::size_t u = 0; u + 1 < units.size(); ++u) {
      std::vector<std::size_t> both = units[u];
      both.insert(both.end(), units[u + 1].begin(), units[u + 1].end());
      most = std::max(most, unique(both).size());
    }
    return int(most);
  }
  static int gradient_buffers(const tandem::Plan& plan, const Model& model) {
    std::size_t most = 1;
    for (const auto& unit : unit_buckets(plan, model)) most = std::max(most, unit.size());
    return int(most) + 1;
  }

  /// The hook: unit [first, end) of `phase` is next.
  void operator()(Phase phase, std::size_t first, std::size_t) {
    std::size_t u = 0;
    while (model_.unit_tensors(u).first != first) ++u;
    const std::vector<std::size_t>& need = units_[u];
    auto needed = [&](std::size_t b) { return std::find(need.begin(), need.end(), b) != need.end(); };
    for (std::size_t b = 0; b < params_.size(); ++b) {  // ascending: gradients are reduced in bucket order
      if (grads_[b] && !needed(b)) grads_[b].reset();   // tandem: release = this bucket's gradients are complete
      if (params_[b] && !needed(b)) close(b);
    }
    for (std::size_t b : need) {
      if (!params_[b]) open(b);  // tandem: gathered now (or already, by the prefetch)
      if (phase == Phase::backward && !grads_[b]) grads_[b].emplace(dp_->gradients(b));
      for (std::size_t t : params_[b]->tensors())
        model_.bind(t, weights(b, t), grads_[b] ? grads_[b]->grad(t) : nullptr);
    }
    const std::size_t next = phase == Phase::forward ? u + 1 : u - 1;  // u - 1 wraps past the first unit
    if (next < units_.size())
      for (std::size_t b : units_[next])
        if (!needed(b)) dp_->prefetch_parameters(b);  // tandem: start the next unit's gather now
  }

  /// Ends a pass: every handle released (after backward, the remaining buckets' reductions are issued).
  void finish() {
    for (auto& g : grads_) g.reset();
    for (std::size_t b = 0; b < params_.size(); ++b)
      if (params_[b]) close(b);
  }

 private:
  void open(std::size_t b) {
    params_[b].emplace(dp_->parameters(b));
    if (!bf16_) return;
    std::size_t c = 0;
    while (std::find(copy_of_.begin(), copy_of_.end(), c) != copy_of_.end()) ++c;  // a free copy (there is one)
    copy_of_[b] = c;
    for (std::size_t t : params_[b]->tensors())
      model_.compute().for_each(dp_->layout()[t].numel,
                                CastBody<tandem::BFloat16, float>{params_[b]->template param<tandem::BFloat16>(t),
                                                                  copies_[c].data() + dp_->plan().placement(t).offset});
  }
  void close(std::size_t b) {
    params_[b].reset();
    copy_of_[b] = none;
  }
  /// Tensor t's parameters as the model reads them: tandem's view, or its fp32 copy.
  const float* weights(std::size_t b, std::size_t t) const {
    if (!bf16_) return params_[b]->template param<float>(t);
    return copies_[copy_of_[b]].data() + dp_->plan().placement(t).offset;
  }

  static std::vector<std::size_t> unique(std::vector<std::size_t> v) {
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
    return v;
  }
  /// For each unit of the model, the buckets holding its tensors, ascending.
  static std::vector<std::vector<std::size_t>> unit_buckets(const tandem::Plan& plan, const Model& model) {
    std::vector<std::vector<std::size_t>> units;
    for (std::size_t u = 0; u < model.num_units(); ++u) {
      std::vector<std::size_t> buckets;
      for (std::size_t t = model.unit_tensors(u).first; t < model.unit_tensors(u).second; ++t)
        buckets.push_back(plan.placement(t).bucket);
      units.push_back(unique(std::move(buckets)));
    }
    return units;
  }

  DP* dp_ = nullptr;
  Model& model_;
  bool bf16_;
  std::vector<std::vector<std::size_t>> units_;
  std::vector<std::optional<typename DP::ParameterBucket>> params_;
  std::vector<std::optional<typename DP::GradientBucket>> grads_;
  std::vector<typename Compute::template Array<float>> copies_;  ///< bf16: fp32 copies of the held buckets
  std::vector<std::size_t> copy_of_;                             ///< the copy bucket b's parameters are in
};

/// Rejects a configuration that cannot train on `world` ranks, naming the flag; main() calls it for every run it plans
/// before the first one starts, train_rank() again.
inline void validate(const TrainConfig& cfg, const Task& task, int world) {
  if (cfg.steps < 1) throw std::invalid_argument("--steps must be positive");
  if (cfg.untimed_steps < 0 || cfg.untimed_steps >= cfg.steps)
    throw std::invalid_argument("--untimed-steps (" + std::to_string(cfg.untimed_steps) +
                                ") must be less than the steps to train (" + std::to_string(cfg.steps) +
                                ", from --steps or --epochs): no step would be timed");
  // In 64 bits: --accum and the rank count are each at most INT_MAX, their product is not.
  if (cfg.accumulation < 1 || world < 1 || cfg.batch % (std::int64_t(cfg.accumulation) * world) != 0)
    throw std::invalid_argument("--batch (" + std::to_string(cfg.batch) + ") must be a multiple of --accum x ranks (" +
                                std::to_string(cfg.accumulation) + " x " + std::to_string(world) + ")");
  if (task.train.len > cfg.model.context)
    throw std::invalid_argument("the task's sequences (" + std::to_string(task.train.len) +
                                " tokens) are longer than the model's context (" + std::to_string(cfg.model.context) +
                                ")");
  if (task.vocab > cfg.model.vocab) throw std::invalid_argument("the task's vocabulary exceeds the model's");
}

/// One rank's training: every rank of `comm` calls it with the same arguments. The model computes on `compute`
/// (HostCompute, or CudaCompute with an Nccl communicator). Under a policy that shards the parameters the model works
/// on tandem's storage through BucketPasses; under the others tandem wraps the model's own buffers.
template <class Policy, class Comm, class Compute = HostCompute>
TrainResult train_rank(Comm& comm, const TrainConfig& cfg, const Task& task, const Progress& progress = {},
                       Compute compute = {}) {
  constexpr bool owned = on_tandem_storage<Policy>;
  using DP = tandem::DataParallel<Policy, tandem::AdamW, typename Compute::Backend, Comm>;
  const int rank = comm.rank(), world = comm.size(), len = task.train.len;
  validate(cfg, task, world);
  // Different on purpose on each rank: broadcast_parameters() (initialize_parameters) makes them equal.
  using Model = Transformer<float, Compute>;
  Model model(cfg.model, cfg.seed + std::uint64_t(rank), std::move(compute));
  Compute& dev = model.compute();
  const std::size_t numel = model.num_parameters();

  // The tensors tandem trains: the model's own buffers, bf16 copies of them, or (owned) their specs.
  const tandem::DType dtype = cfg.precision == Precision::bf16 ? tandem::DType::bf16 : tandem::DType::fp32;
  std::vector<tandem::TensorRef> tensors = model.tensor_refs();
  typename Compute::template Array<tandem::BFloat16> params16, grads16;
  if (!owned && cfg.precision == Precision::bf16) {
    dev.resize(params16, numel);
    dev.resize(grads16, numel);
    dev.for_each(numel, CastBody<float, tandem::BFloat16>{model.parameters().data(), params16.data()});
    for (tandem::TensorRef& t : tensors) {
      const std::size_t offset = static_cast<float*>(t.param) - model.parameters().data();
      t = {t.name, params16.data() + offset, grads16.data() + offset, t.numel, tandem::DType::bf16};
    }
  }
  auto params_to_model = [&] {
    if (!owned && cfg.precision == Precision::bf16)
      dev.for_each(numel, CastBody<tandem::BFloat16, float>{params16.data(), model.parameters().data()});
  };
  std::vector<tandem::TensorSpec> specs;
  std::vector<std::size_t> offsets;  // of each tensor in the model's parameters
  for (const tandem::TensorRef& t : model.tensor_refs()) {
    specs.push_back({t.name, t.numel, dtype});
    offsets.push_back(std::size_t(static_cast<float*>(t.param) - model.parameters().data()));
  }

  // tandem: a --save that would be refused (another model's checkpoint there) is refused before training; every rank
  // reads the shared directory, so all of them refuse, before any collective
  if (!cfg.save_dir.empty()) tandem::check_save_target(cfg.save_dir, specs);

  // Everything allocated before the first collective (on GPUs, allocating between collectives can deadlock).
  const int local = cfg.batch / cfg.accumulation / world;
  model.reserve(std::max(local, cfg.eval_batch), len);

  tandem::DataParallelOptions options{.accumulation_steps = cfg.accumulation,
                                      .max_grad_norm = cfg.max_grad_norm,
                                      .reduce_dtype = cfg.reduce_dtype,  // tandem: gradients cross ranks in this dtype
                                      .stream = dev.stream()};
  if constexpr (owned) {
    // A bucket is gathered whole, so buckets of about an eighth of the model: a pass holds a few at a time.
    options.bucket_cap_bytes = options.first_bucket_cap_bytes = std::max<std::size_t>(4096, numel * sizeof(float) / 8);
    const tandem::Plan plan = tandem::bucket_plan(specs, world, options);
    options.parameter_buffers = BucketPasses<DP, Model>::parameter_buffers(plan, model);
    options.gradient_buffers = BucketPasses<DP, Model>::gradient_buffers(plan, model);
  }
  const tandem::AdamW::Options adamw{.lr = cfg.lr, .weight_decay = cfg.weight_decay};
  auto make = [&] {
    if constexpr (owned)
      return DP(comm, specs, adamw, options, dev.backend());  // tandem: tandem holds the parameters, a shard per rank
    else
      return DP(comm, tensors, adamw, options, dev.backend());  // tandem: wrap the model's tensors
  };
  std::optional<BucketPasses<DP, Model>> passes;
  if constexpr (owned) passes.emplace(tandem::bucket_plan(specs, world, options), model, cfg.precision);
  DP dp = make();
  struct EndPasses {  // the handles go before dp does, also when an exception leaves a pass half done
    std::optional<BucketPasses<DP, Model>>& passes;
    ~EndPasses() {
      if (passes) passes->finish();
    }
  } end_passes{passes};
  if constexpr (owned) {
    const std::vector<float> initial = model.host_parameters();
    auto fill = [&]<class T>(std::size_t t, T* values) {  // tandem: rank 0's initial weights, in tandem's dtype
      const std::vector<T> v(initial.begin() + std::ptrdiff_t(offsets[t]),
                             initial.begin() + std::ptrdiff_t(offsets[t] + specs[t].numel));
      dev.to_device(values, v.data(), v.size() * sizeof(T));
    };
    if (dtype == tandem::DType::bf16)
      dp.template initialize_parameters<tandem::BFloat16>(fill);
    else
      dp.template initialize_parameters<float>(fill);
    model.release_storage();
    passes->attach(dp);
    model.set_unit_hook(std::ref(*passes));
  } else {
    dp.broadcast_parameters();  // tandem: rank 0's initial weights everywhere
  }

  // tandem: kept with every checkpoint this run saves (its metadata); a resumed run checks that it continues that run
  const tandem::CheckpointMetadata record = run_record(cfg, task);
  int first_step = 0;
  if (!cfg.resume_dir.empty()) {  // tandem: the checkpoint's state, at any rank count and under any policy
    // Checked before training from its manifest (check_resume_manifest), and again here: a save may have replaced it
    // since. Every rank loaded the same checkpoint, so they all stop here, or none does.
    const tandem::CheckpointMetadata saved = dp.load_checkpoint(cfg.resume_dir);
    check_resumable(saved, dp.step_count(), cfg, task);
    first_step = int(dp.step_count());  // below cfg.steps, an int
  }

  DistributedSampler sampler(task.train.size(), cfg.batch, cfg.seed);
  std::vector<int> tokens(std::size_t(local) * len), targets(tokens.size());
  double final_loss = 0;
  const int window = std::min(10, cfg.steps - first_step);  // the final loss: the mean over the last steps run
  auto end_pass = [&] {
    if (passes) passes->finish();
  };

  const int untimed = std::max(first_step, cfg.untimed_steps);  // validate(): cfg.untimed_steps < cfg.steps
  int clock_step = first_step;                                  // the step the clock started at
  // The clock: training time only. Checkpoint saves (--save-every; the last --save comes after the clock stops) are
  // left out, so that tokens/s is the same with and without them.
  using Clock = std::chrono::steady_clock;
  Clock::duration saving{};  // spent in saves since the clock started
  dev.synchronize();
  comm.barrier();
  Clock::time_point start = Clock::now();
  auto trained = [&] { return std::chrono::duration<double>(Clock::now() - start - saving).count(); };
  for (int step = first_step; step < cfg.steps; ++step) {
    if (step == untimed && step > first_step) {
      dev.synchronize();
      comm.barrier();
      start = Clock::now();
      saving = {};
      clock_step = step;
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
      end_pass();
      model.backward();
      end_pass();
      if (!owned && cfg.precision == Precision::bf16)
        dev.for_each(numel, CastBody<float, tandem::BFloat16>{model.gradients().data(), grads16.data()});
      dp.step();  // tandem: average the gradients over ranks (and micro-steps), update, regather
    }
    dp.all_reduce_host({&loss, 1}, tandem::ReduceOp::avg);  // the global batch's mean
    if (step >= cfg.steps - window) final_loss += loss / window;
    if (rank == 0 && progress)
      progress({.step = step + 1,
                .steps = cfg.steps,
                .loss = loss,
                .seconds = trained(),
                .timed_steps = step + 1 - clock_step});
    if (cfg.save_every > 0 && (step + 1) % cfg.save_every == 0 && step + 1 < cfg.steps) {
      dev.synchronize();  // the steps before it, on every rank, are training time
      comm.barrier();
      const Clock::time_point save_start = Clock::now();
      dp.save_checkpoint(cfg.save_dir, record);  // tandem: every rank writes its shard; the manifest makes it the set
      saving += Clock::now() - save_start;
    }
  }
  dev.synchronize();
  comm.barrier();
  TrainResult result;
  result.seconds = trained();
  if (!cfg.save_dir.empty()) dp.save_checkpoint(cfg.save_dir, record);
  result.tokens = double(std::max(0, cfg.steps - untimed)) * cfg.batch * len;
  result.final_loss = final_loss;

  // Held-out evaluation, split over the ranks: rank r takes a contiguous 1/world of the examples. Under sharded
  // parameters each forward pass gathers (a collective), so every rank runs as many passes as the largest share needs:
  // a rank past its share repeats the first batch of the set and leaves it out of the sums.
  params_to_model();
  const std::size_t n_eval = task.eval.size(), eval_batch = std::size_t(cfg.eval_batch);
  const std::size_t begin = n_eval * rank / world, end = n_eval * (rank + 1) / world;
  const std::size_t share = owned ? (n_eval + world - 1) / world : end - begin;
  double sums[4] = {0, 0, 0, 0};  // loss, target rows, correct (rows or examples), examples
  for (std::size_t e = begin; e < begin + share; e += eval_batch) {
    const bool counted = e < end;
    const std::size_t at = counted ? e : 0;
    const int b = int(std::min(eval_batch, counted ? end - e : n_eval));
    const ForwardStats s = model.forward(task.eval.tokens_of(at), task.eval.targets_of(at), b, len, Pass::evaluate);
    end_pass();
    if (!counted) continue;
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
  result.memory = dp.memory_report();
  if constexpr (owned) {
    std::vector<float> params(numel);
    for (std::size_t b = 0; b < dp.num_buckets(); ++b) {  // collective: every rank gathers every bucket
      auto bucket = dp.parameters(b);
      for (std::size_t t : bucket.tensors()) {
        float* out = params.data() + offsets[t];
        if (dtype == tandem::DType::fp32) {
          dev.to_host(out, bucket.template param<float>(t), specs[t].numel * sizeof(float));
        } else {
          std::vector<tandem::BFloat16> v(specs[t].numel);
          dev.to_host(v.data(), bucket.template param<tandem::BFloat16>(t), v.size() * sizeof(tandem::BFloat16));
          std::transform(v.begin(), v.end(), out, [](tandem::BFloat16 x) { return static_cast<float>(x); });
        }
      }
    }
    if (rank == 0) result.params = std::move(params);
  } else if (rank == 0) {
    result.params = model.host_parameters();
  }
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
