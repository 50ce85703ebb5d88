// SPDX-License-Identifier: Apache-2.0
// tiny_transformer: trains a small decoder-only transformer with tandem on N ranks, on a task made here
// (sorting lists of numbers) or on the bytes of any text file, and with --compare tells the story of data
// parallelism: 1 rank against N ranks under each policy — time down, accuracy unchanged.
#include <fcntl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <limits>
#include <map>
#include <string>

#include "../cli.hpp"
#include "blas_core.hpp"
#include "tandem/comm/launch_env.hpp"
#include "train.hpp"

#if defined(TINY_HAVE_CUDA)
#include "cuda_train.hpp"
#endif

#if defined(TINY_HAVE_MPI)
#include <mpi.h>

#include "tandem/comm/mpi.hpp"
#endif

namespace {

/// A progress bar on a terminal (redrawn in place, at most 10 times a second); plain log lines otherwise.
class ProgressReporter {
 public:
  explicit ProgressReporter(std::string label) : label_(std::move(label)), tty_(isatty(STDOUT_FILENO) != 0) {}

  /// Rates and the ETA over the steps the clock covers (it restarts after --untimed-steps; with --resume it starts at
  /// the checkpoint's step), so that the last line's tokens/s is the table's.
  void operator()(const tiny::StepReport& r) {
    const int step = r.step, steps = r.steps;
    const double seconds = r.seconds, loss = r.loss;
    const double tokens_per_second = seconds > 0 ? tokens_per_step_ * r.timed_steps / seconds : 0;
    const double eta = r.timed_steps > 0 ? seconds * (steps - step) / r.timed_steps : 0;
    if (tty_) {
      if (step < steps && seconds - last_draw_ < 0.1) return;
      last_draw_ = seconds;
      const int width = 24, filled = int(std::int64_t(width) * step / steps);  // 64-bit: 24 x step overflows an int
      std::printf("\r  %-22s [%s%s] %5d/%d  loss %.4f  %7.0f tok/s  ETA %3.0f s ", label_.c_str(),
                  std::string(std::size_t(filled), '#').c_str(), std::string(std::size_t(width - filled), '.').c_str(),
                  step, steps, loss, tokens_per_second, eta);
      if (step == steps) std::printf("\r%*s\r", 110, "");
      std::fflush(stdout);
    } else if (step == steps || step % std::max(1, steps / 5) == 0) {
      std::printf("  %s: step %d/%d  loss %.4f  %.0f tok/s\n", label_.c_str(), step, steps, loss, tokens_per_second);
      std::fflush(stdout);
    }
  }

  double tokens_per_step_ = 0;

 private:
  std::string label_;
  bool tty_;
  double last_draw_ = -1;
};

struct Row {
  std::string policy;
  int ranks = 1;
  tiny::TrainResult result;
};

void print_header() {
  std::printf("%-17s %5s %8s %9s %8s %11s %10s %9s %11s %11s\n", "policy", "ranks", "time s", "tokens/s", "speed-up",
              "final loss", "eval loss", "accuracy", "states KiB", "buffers KiB");
}

void print_row(const Row& row, double baseline_seconds) {
  const tiny::TrainResult& r = row.result;
  std::printf("%-17s %5d %8.2f %9.0f %7.2fx %11.5f %10.5f %8.2f%% %11.1f %11.1f\n", row.policy.c_str(), row.ranks,
              r.seconds, r.tokens_per_second(), baseline_seconds / r.seconds, r.final_loss, r.eval_loss,
              100.0 * r.eval_accuracy, double(r.memory.model_states()) / 1024.0, double(r.memory.buckets) / 1024.0);
  std::fflush(stdout);
}

void write_csv(const std::string& path, const std::vector<Row>& rows, const tiny::TrainConfig& cfg) {
  std::ofstream out(path);
  if (!out) throw std::invalid_argument("cannot write --csv file '" + path + "'");
  out << std::fixed << std::setprecision(9);  // losses compared within 1e-5 relative need more than 6 digits
  out << "policy,ranks,steps,global_batch,accumulation,precision,reduce_dtype,seconds,tokens_per_second,final_loss,"
         "eval_loss,eval_accuracy,tandem_bytes_per_rank,model_state_bytes,buffer_bytes\n";
  for (const Row& row : rows)
    out << row.policy << ',' << row.ranks << ',' << cfg.steps << ',' << cfg.batch << ',' << cfg.accumulation << ','
        << (cfg.precision == tiny::Precision::bf16 ? "bf16" : "fp32") << ',' << tandem::dtype_name(cfg.reduce_dtype)
        << ',' << row.result.seconds << ',' << row.result.tokens_per_second() << ',' << row.result.final_loss << ','
        << row.result.eval_loss << ',' << row.result.eval_accuracy << ',' << row.result.memory.total() << ','
        << row.result.memory.model_states() << ',' << row.result.memory.buckets << '\n';
}

/// Throws unless the file `path` (given to `flag`) can be opened for writing now, so that a run whose results could not
/// be written is refused before it trains. Leaves the file system as it found it: an existing file is opened without
/// truncating it, a new one is created and removed again.
void check_writable_file(const std::string& flag, const std::string& path) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  const bool created = fd >= 0;
  if (!created && errno == EEXIST) fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    throw std::invalid_argument(flag + " " + path + ": cannot write the file: " + std::strerror(error) +
                                " (checked before training)");
  }
  ::close(fd);
  if (created) ::unlink(path.c_str());
}

/// Throws unless a checkpoint can be saved in the directory `dir` (--save saves after training, and every --save-every
/// steps): a file can be created in `dir`, or, where it does not exist yet, in its nearest existing ancestor, which
/// save_checkpoint will create it under. The probe file is removed again; nothing is created that stays.
void check_save_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path at = fs::absolute(fs::path(dir), ec);
  if (ec) throw std::invalid_argument("--save " + dir + ": " + ec.message());
  while (!fs::exists(at, ec) && at.has_parent_path() && at.parent_path() != at) at = at.parent_path();
  if (!fs::is_directory(at, ec))
    throw std::invalid_argument("--save " + dir + ": " + at.string() + " is not a directory (checked before training)");
  const fs::path probe = at / (".tiny_transformer_save_check." + std::to_string(::getpid()));
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int error = errno;
    throw std::invalid_argument("--save " + dir + ": cannot create a file in " + at.string() + ": " +
                                std::strerror(error) + " (checked before training)");
  }
  ::close(fd);
  ::unlink(probe.c_str());
}

/// FNV-1a over the parameters' bytes: equal fingerprints mean bitwise-equal trained models.
std::uint64_t fingerprint(const std::vector<float>& params) {
  return tandem::detail::fnv1a(params.data(), params.size() * sizeof(float));
}

#if defined(TINY_HAVE_MPI)
/// Rank 0's problem (empty: none) on every process of the job, so that they all stop, or none does.
std::string rank0_problem(std::string problem) {
  int size = int(problem.size());
  MPI_Bcast(&size, 1, MPI_INT, 0, MPI_COMM_WORLD);
  problem.resize(std::size_t(size));
  MPI_Bcast(problem.data(), size, MPI_CHAR, 0, MPI_COMM_WORLD);
  return problem;
}

/// Whether this process was started by an MPI launcher as one of several ranks (then each process is one rank).
bool launched_by_mpi() {
  const tandem::LaunchInfo launch = tandem::detect_launch();
  const bool mpi = launch.launcher == tandem::Launcher::openmpi || launch.launcher == tandem::Launcher::pmi ||
                   launch.launcher == tandem::Launcher::slurm;
  return mpi && launch.world_size > 1;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  tiny::TrainConfig cfg;
  cfg.model = {.vocab = 0, .context = 0, .width = 64, .layers = 2, .heads = 4, .mlp_ratio = 4};
  cfg.steps = 600;
  cfg.batch = 32;
  cfg.lr = 3e-3f;
  tiny::SortTask sort;
  std::string text_path, csv_path, backend;  // backend: "" chooses (cuda when enough GPUs exist, else host)
  int ranks = 2, epochs = 0, context = 128, eval_examples = 2048, train_examples = 50000;
  bool compare = false, bf16 = false, blas_info = false, blas_self_test = false;
  std::string blas_core = "auto", reduce_dtype = "fp32";
  tiny::PolicyKind policy = tiny::PolicyKind::replicated;
  const std::map<std::string, tiny::PolicyKind> policies{{"replicated", tiny::PolicyKind::replicated},
                                                         {"optimizer-sharded", tiny::PolicyKind::optimizer_sharded},
                                                         {"gradient-sharded", tiny::PolicyKind::gradient_sharded},
                                                         {"parameter-sharded", tiny::PolicyKind::parameter_sharded}};

  CLI::App app{
      "Train a tiny transformer with tandem on N ranks (host CPU ranks, or one GPU per rank). The default task sorts "
      "lists of numbers; --text FILE trains a byte-level language model instead. --compare trains 1 rank, then N "
      "ranks under each policy."};
  auto* policy_opt =
      app.add_option("--policy", policy, "replicated | optimizer-sharded | gradient-sharded | parameter-sharded")
          ->transform(CLI::CheckedTransformer(policies, CLI::ignore_case));
  auto* ranks_opt =
      app.add_option("--ranks", ranks, "ranks (threads of this process), N; under mpirun every process is one rank")
          ->check(CLI::Range(1, 256));
  app.add_option("--backend", backend,
                 "host (CPU ranks) or cuda (one GPU per rank); default: cuda where a GPU per rank exists, else host")
      ->check(CLI::IsMember({"host", "cuda"}));
  auto* steps_opt = app.add_option("--steps", cfg.steps, "optimizer steps")->check(examples::positive);
  app.add_option("--epochs", epochs, "train for this many passes over the training set instead of --steps")
      ->check(examples::positive)
      ->excludes(steps_opt);
  app.add_option("--batch", cfg.batch, "global batch: examples per optimizer step")->check(examples::positive);
  app.add_option("--accum", cfg.accumulation, "micro-steps per optimizer step")->check(examples::positive);
  app.add_option("--lr", cfg.lr, "peak AdamW learning rate (warm-up, then cosine decay)")->check(examples::positive);
  // (Bounds far above a tiny model's, so that no size below overflows an int: the MLP's width is mlp-ratio x width.)
  app.add_option("--width", cfg.model.width, "model width")->check(CLI::Range(1, 16384));
  app.add_option("--layers", cfg.model.layers, "transformer blocks")->check(CLI::Range(1, 1024));
  app.add_option("--heads", cfg.model.heads, "attention heads")->check(CLI::Range(1, 16384));
  app.add_option("--mlp-ratio", cfg.model.mlp_ratio, "MLP width / model width")->check(CLI::Range(1, 64));
  auto* text_opt =
      app.add_option("--text", text_path, "train a byte-level language model on this file")->check(CLI::ExistingFile);
  // Each task's options are refused with the other task, where they would be ignored.
  app.add_option("--context", context, "--text: bytes per training window")->check(examples::positive)->needs(text_opt);
  app.add_option("--sort-length", sort.length, "sort task: numbers per list")
      ->check(CLI::Range(2, 512))
      ->excludes(text_opt);
  app.add_option("--sort-values", sort.values, "sort task: numbers are 0 .. values-1")
      ->check(CLI::Range(2, 65535))
      ->excludes(text_opt);
  app.add_option("--eval", eval_examples, "sort task: held-out examples")
      ->check(CLI::Range(1, 1000000))
      ->excludes(text_opt);
  app.add_option("--train-examples", train_examples,
                 "sort task: training examples, whatever --steps is (a longer run goes over them again, each epoch in "
                 "a new order)")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str()
      ->excludes(text_opt);
  app.add_option("--untimed-steps", cfg.untimed_steps, "leave the first steps out of the time and tokens/s")
      ->check(examples::non_negative);
  app.add_option("--seed", cfg.seed, "seed of the data order, the data (sort task) and the initial weights")
      ->check(examples::non_negative);
  app.add_flag("--bf16", bf16, "bf16 parameters and gradients (fp32 master weights in tandem)");
  app.add_option("--reduce-dtype", reduce_dtype,
                 "the dtype gradients cross ranks in: fp32, or bf16 for half the bytes (micro-steps accumulate in "
                 "fp32)")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  app.add_flag("--compare", compare, "train 1 rank, then --ranks ranks under every policy, and print a table")
      ->excludes(policy_opt);
  auto* schedule_opt = app.add_option("--schedule-steps", cfg.schedule_steps,
                                      "the learning-rate schedule's length (warm-up, cosine decay, then its floor); "
                                      "default 600 whatever --steps is (with --epochs: their steps), so that a run "
                                      "stopped and resumed follows the schedule of one that never stopped")
                           ->check(examples::positive);
  auto* save_opt =
      app.add_option("--save", cfg.save_dir, "save a checkpoint (a directory) at the end")->check(examples::named_path);
  app.add_option("--save-every", cfg.save_every, "with --save: also save after every K-th step")
      ->check(examples::positive)
      ->needs(save_opt);
  auto* resume_opt = app.add_option("--resume", cfg.resume_dir,
                                    "start from the checkpoint in this directory (at any --ranks and --policy) and "
                                    "train on from its step to --steps")
                         ->check(CLI::ExistingDirectory);
  app.add_option("--csv", csv_path, "also write the results to this CSV file")->check(examples::named_path);
  app.add_option("--blas-core", blas_core,
                 "OpenBLAS kernels: keep (those OpenBLAS chose), auto (where those are generic for this CPU, better "
                 "ones that pass a check in a child process), or a name such as SkylakeX or Haswell (checked too); "
                 "an OPENBLAS_CORETYPE already set always wins")
      ->capture_default_str();
  app.add_flag("--blas-info", blas_info, "print which BLAS kernels run (after --blas-core) and exit");
  app.add_flag(tiny::blas_self_test_flag, blas_self_test)->group("");  // the child process of --blas-core's check
  if (const int code = examples::parse_command_line(app, argc, argv); code >= 0) return code;

  if (blas_self_test) return tiny::blas_self_test();
  // Before anything else (MPI included): this may restart the program on other OpenBLAS kernels. One report per job.
  try {
    tiny::settle_blas_core(tiny::parse_blas_core(blas_core), argv, tandem::detect_launch().rank == 0);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tiny_transformer: %s\n", e.what());
    return 2;
  }
  if (blas_info) {
    const tiny::BlasInfo info = tiny::this_blas();
    std::printf("blas library: %s\nblas config: %s\ncpu: %s\n", info.library.c_str(), info.config.c_str(),
                tiny::simd_name(tiny::cpu_simd_level(tiny::this_cpu_features())));
    return 0;
  }

  const int given_ranks = ranks;  // (checked below: under mpirun a --ranks other than the processes' count is refused)
#if defined(TINY_HAVE_MPI)
  // Under mpirun (or srun with MPI), each process is one rank and tandem::Mpi carries the collectives.
  const bool mpi = launched_by_mpi();
  if (mpi) MPI_Init(&argc, &argv);
  struct Finalize {
    bool on;
    ~Finalize() {
      if (on) MPI_Finalize();
    }
  } finalize{mpi};
  int process_rank = 0;
  if (mpi) {
    MPI_Comm_rank(MPI_COMM_WORLD, &process_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);  // each process is one rank
  }
#else
  const bool mpi = false;
  const int process_rank = 0;
#endif
  // One report for the job, from rank 0; the other ranks' errors still reach stderr.
  if (process_rank != 0 && !std::freopen("/dev/null", "w", stdout)) return 2;

  try {
    if (mpi && compare)
      throw std::invalid_argument(
          "--compare runs 1 rank and then N ranks as threads of one process; start it without mpirun");
    if (mpi && ranks_opt->count() > 0 && given_ranks != ranks)
      throw std::invalid_argument("--ranks " + std::to_string(given_ranks) +
                                  ": under mpirun every process is one rank (" + std::to_string(ranks) +
                                  " here); leave --ranks out, or give " + std::to_string(ranks));
    if (cfg.model.width % cfg.model.heads != 0)
      throw std::invalid_argument("--width (" + std::to_string(cfg.model.width) + ") must be a multiple of --heads (" +
                                  std::to_string(cfg.model.heads) + ")");
    if (text_path.empty() && sort.values < sort.length)
      throw std::invalid_argument("--sort-values (" + std::to_string(sort.values) +
                                  ") must be at least --sort-length (" + std::to_string(sort.length) +
                                  "): the lists hold distinct numbers");
#if defined(TINY_HAVE_CUDA)
    const int gpus = tiny::cuda_device_count();
    if (const std::string fault = tiny::cuda_fault(); backend.empty() && !fault.empty())
      std::printf("backend: host (CUDA fails here: %s)\n", fault.c_str());
#else
    const int gpus = 0;
#endif
    // Under mpirun each process is one rank and needs a GPU of its node; otherwise the ranks share this process.
    const int gpus_needed = mpi ? tandem::detect_launch().local_size.value_or(ranks) : ranks;
    if (backend.empty()) {
      backend = gpus > 0 && gpus >= gpus_needed ? "cuda" : "host";
      if (gpus > 0 && backend == "host")
        std::printf("backend: host (%d ranks need %d GPUs, %d visible; --backend cuda --ranks %d trains on GPUs)\n",
                    ranks, gpus_needed, gpus, gpus);
    }
#if defined(TINY_HAVE_CUDA)
    if (backend == "cuda" && !mpi) tiny::require_gpus(ranks);
#else
    if (backend == "cuda")
      throw std::invalid_argument(
          "--backend cuda: this build has no CUDA path (it needs nvcc, cuBLAS and NCCL at configure time); use "
          "--backend host");
#endif
    cfg.precision = bf16 ? tiny::Precision::bf16 : tiny::Precision::fp32;
    cfg.reduce_dtype = reduce_dtype == "bf16" ? tandem::DType::bf16 : tandem::DType::fp32;
    tiny::Task task;
    if (!text_path.empty()) {
      auto [train, eval] = tiny::make_text_examples(tiny::read_file(text_path), context);
      task = {"byte-level language model on " + text_path, std::move(train), std::move(eval), 256, false};
    } else {
      sort.validate();
      std::set<std::vector<int>> seen;
      // Not sized by --steps: runs of any length (and a resumed one) draw their batches from the same examples.
      tiny::Examples train = sort.make(std::size_t(train_examples), cfg.seed, nullptr, &seen);
      tiny::Examples eval = sort.make(std::size_t(eval_examples), cfg.seed + 1000003, &seen);
      task = {"sort " + std::to_string(sort.length) + " distinct numbers below " + std::to_string(sort.values),
              std::move(train), std::move(eval), sort.vocab(), true};
    }
    cfg.model.vocab = task.vocab;
    cfg.model.context = task.train.len;
    if (task.train.size() < std::size_t(cfg.batch))
      throw std::invalid_argument("--batch " + std::to_string(cfg.batch) + " is larger than the training set (" +
                                  std::to_string(task.train.size()) + " examples" +
                                  (text_path.empty() ? "; --train-examples" : "") + ")");
    if (epochs > 0) {
      const std::size_t per_epoch = task.train.size() / std::size_t(cfg.batch);
      // The step counter is an int: a run is at most INT_MAX steps (compared without forming the product).
      const std::size_t most_steps = std::size_t(std::numeric_limits<int>::max());
      if (per_epoch > most_steps / std::size_t(epochs))
        throw std::invalid_argument("--epochs " + std::to_string(epochs) + ": epochs of " + std::to_string(per_epoch) +
                                    " steps come to more than " + std::to_string(most_steps) +
                                    " steps, the most a run takes; give at most " +
                                    std::to_string(most_steps / per_epoch) + " epochs");
      cfg.steps = int(per_epoch * std::size_t(epochs));
    }
    if (schedule_opt->count() == 0) cfg.schedule_steps = epochs > 0 ? cfg.steps : 600;
    if (compare && (save_opt->count() > 0 || resume_opt->count() > 0))
      throw std::invalid_argument("--save and --resume take one run: give --policy and --ranks instead of --compare");
    // Every run planned, and where its results go, is checked before the first one trains: a refusal after minutes of
    // training (a batch the second run cannot split, an unwritable --csv or --save) would waste them.
    for (const int world : compare ? std::vector<int>{1, ranks} : std::vector<int>{ranks})
      tiny::validate(cfg, task, world);
    std::string problem;
    // Rank 0 writes the CSV; for --save and --resume, its view stands for the shared storage's.
    if (process_rank == 0) try {
        if (!csv_path.empty()) check_writable_file("--csv", csv_path);
        if (!cfg.save_dir.empty()) check_save_dir(cfg.save_dir);
        if (!cfg.resume_dir.empty()) tiny::check_resume_manifest(cfg, task);
      } catch (const std::exception& e) {
        problem = e.what();
      }
#if defined(TINY_HAVE_MPI)
    if (mpi) problem = rank0_problem(std::move(problem));
#endif
    if (!problem.empty()) throw std::invalid_argument(problem);
    const bool cuda = backend == "cuda";
    if (!cuda) tiny::use_one_blas_thread();

    const tiny::Transformer<float> probe(cfg.model, 0);
    std::printf("task: %s (%zu training, %zu held-out examples of %d tokens)\n", task.name.c_str(), task.train.size(),
                task.eval.size(), task.train.len);
    std::printf("model: %d layers, width %d, %d heads, MLP %dx, vocab %d: %zu parameters (%s)\n", cfg.model.layers,
                cfg.model.width, cfg.model.heads, cfg.model.mlp_ratio, cfg.model.vocab, probe.num_parameters(),
                bf16 ? "bf16, fp32 master" : "fp32");
    std::printf("training: %d steps of %d examples (%d micro-steps), AdamW lr %g, clip 1.0, %s reduction, %s\n",
                cfg.steps, cfg.batch, cfg.accumulation, double(cfg.lr), tandem::dtype_name(cfg.reduce_dtype),
                cuda ? "one GPU per rank (cuBLAS, NCCL)" : "one BLAS thread per CPU rank");
    if (cfg.schedule_steps != cfg.steps) std::printf("learning-rate schedule over %d steps\n", cfg.schedule_steps);
    if (!cfg.resume_dir.empty()) std::printf("resuming from the checkpoint in %s\n", cfg.resume_dir.c_str());
    if (!cfg.save_dir.empty())
      std::printf("saving to %s%s\n", cfg.save_dir.c_str(),
                  cfg.save_every > 0 ? (" every " + std::to_string(cfg.save_every) + " steps and at the end").c_str()
                                     : " at the end");
    std::printf("\n");

    std::vector<Row> rows;
    // A run's label: "1 rank" for --compare's baseline, else the policy's name (also at one rank).
    auto run = [&](tiny::PolicyKind p, int n, bool baseline) {
      const std::string label = baseline ? "1 rank" : tiny::policy_name(p);
      ProgressReporter progress(label + (n == 1 ? "" : " x" + std::to_string(n)));
      progress.tokens_per_step_ = double(cfg.batch) * task.train.len;
#if defined(TINY_HAVE_CUDA)
      if (cuda) {
#if defined(TINY_HAVE_MPI)
        if (mpi) {
          tandem::Mpi comm(MPI_COMM_WORLD);
          rows.push_back({label, n, tiny::train_cuda_mpi(p, comm, cfg, task, std::ref(progress))});
          return;
        }
#endif
        rows.push_back({label, n, tiny::train_cuda(p, n, cfg, task, std::ref(progress))});
        return;
      }
#endif
      tiny::TrainResult r = tiny::with_policy(p, [&]<class Policy>() {
#if defined(TINY_HAVE_MPI)
        if (mpi) {  // this process is one rank of the MPI job
          tandem::Mpi comm(MPI_COMM_WORLD);
          return tiny::train_rank<Policy>(comm, cfg, task, std::ref(progress));
        }
#endif
        return tiny::train_local<Policy>(n, cfg, task, std::ref(progress));
      });
      rows.push_back({label, n, std::move(r)});
    };
#if defined(TINY_HAVE_MPI)
    if (mpi) std::printf("%s: each process is one rank (tandem::Mpi)\n\n", tandem::detect_launch().describe().c_str());
#endif
    if (compare) {
      run(tiny::PolicyKind::replicated, 1, true);
      for (tiny::PolicyKind p : {tiny::PolicyKind::replicated, tiny::PolicyKind::optimizer_sharded,
                                 tiny::PolicyKind::gradient_sharded, tiny::PolicyKind::parameter_sharded})
        run(p, ranks, false);
    } else {
      run(policy, ranks, false);
    }
    print_header();
    for (const Row& row : rows) print_row(row, rows.front().result.seconds);
    if (compare) {
      double worst_accuracy = 0, worst_loss = 0;
      // (`!(x <= worst)`: a NaN, a run that diverged, is the worst there is and shows as such, where std::max drops it)
      auto worse = [](double& worst, double x) {
        if (!(x <= worst) && !std::isnan(worst)) worst = x;
      };
      for (const Row& row : rows) {
        worse(worst_accuracy, std::abs(row.result.eval_accuracy - rows[0].result.eval_accuracy));
        worse(worst_loss,
              std::abs(row.result.final_loss - rows[0].result.final_loss) / std::abs(rows[0].result.final_loss));
      }
      std::printf("\n%d ranks vs 1: accuracy within %.2f percentage points, final loss within %.1e relative\n", ranks,
                  100.0 * worst_accuracy, worst_loss);
    }
    std::printf("\ntrained parameters: fingerprint %016llx\n",
                (unsigned long long)fingerprint(rows.back().result.params));
    if (!csv_path.empty() && process_rank == 0) write_csv(csv_path, rows, cfg);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tiny_transformer: %s\n", e.what());
    return 2;
  }
  return 0;
}
