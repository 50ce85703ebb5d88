// SPDX-License-Identifier: Apache-2.0
// tandem_memory: how much memory each rank holds under each policy, before any rank exists. For a model given by
// its parameter count (--params) or its tensor list (--layout), a world size and a parameter dtype, it prints one
// table: a row per (policy, storage, reduce dtype), GB per rank by MemoryReport category, from tandem::estimate_memory
// (the figures DataParallel::memory_report() gives on a CUDA rank), beside the ZeRO paper's closed form for the same
// partitioning. Nothing is allocated and no GPU is needed. Exit codes: 0 done, 1 tandem rejected the configuration, 2
// bad argument.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../benchmarks/scaling/scaling_model.hpp"  // load_tensor_list: tandem's one reader of tensor lists
#include "tandem/backend/launch.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/tensor.hpp"
#include "tandem/front/estimate.hpp"
#include "tandem/front/options.hpp"
#include "tandem/kernels/adamw.hpp"
#include "tandem/kernels/sgd.hpp"
#include "tandem/policy/gradient_sharded.hpp"
#include "tandem/policy/optimizer_sharded.hpp"
#include "tandem/policy/parameter_sharded.hpp"
#include "tandem/policy/policy.hpp"
#include "tandem/policy/replicated.hpp"

namespace {

/// A bad command line: main prints it on one line and exits with 2.
struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

constexpr std::size_t synthesized_tensor = std::size_t{1} << 24;  // --params: tensors of 2^24 elements, as the test
constexpr double mib = 1024.0 * 1024.0;

std::string usage() {
  const tandem::DataParallelOptions d;
  auto num = [](double v) {
    char s[32];
    std::snprintf(s, sizeof s, "%g", v);
    return std::string(s);
  };
  return "usage: tandem_memory (--params N | --layout FILE) [options]\n"
         "Memory per rank of each tandem policy (tandem::estimate_memory), in GB (1e9 bytes), beside the ZeRO paper.\n"
         "  --params N                 parameter count: 7.5e9, 124e6 or an integer (tensors of 2^24 elements)\n"
         "  --layout FILE              tensor list: '#' comment lines, then name<TAB>numel<TAB>shape\n"
         "                             (as tests/data/gpt2_124m.tsv)\n"
         "  --world N                  ranks (default 8)\n"
         "  --dtype fp32|bf16|fp16     parameter dtype (default bf16; 16-bit parameters get fp32 master weights)\n"
         "  --optimizer adamw|sgd|sgd-momentum\n"
         "                             default adamw (2 fp32 state arrays); sgd keeps none, sgd-momentum one\n"
         "  --bucket-cap-mb X          bucket cap in MiB of fp32 gradients (default " +
         num(static_cast<double>(d.bucket_cap_bytes) / mib) +
         ")\n"
         "  --first-bucket-cap-mb X    the first bucket's cap in MiB (default " +
         num(static_cast<double>(d.first_bucket_cap_bytes) / mib) +
         ")\n"
         "  --gradient-buffers K       GradientSharded (owned storage) and ParameterSharded: reused bucket gradient\n"
         "                             buffers (default " +
         std::to_string(d.gradient_buffers) +
         ")\n"
         "  --parameter-buffers K      ParameterSharded: reused bucket buffers parameters are gathered into (default " +
         std::to_string(d.parameter_buffers) +
         ")\n"
         "  --storage user|owned|both  user: DataParallel over your buffers (TensorRef); owned: over TensorSpecs,\n"
         "                             tandem holds the storage (default both)\n"
         "  --reduce-dtype fp32|bf16|fp16|both\n"
         "                             the dtype gradients are reduced in (DataParallelOptions::reduce_dtype); both:\n"
         "                             fp32 and the parameter dtype (the default; fp32 alone for fp32 parameters)\n"
         "  --accumulation-steps K     micro-steps per optimizer step (default 1; above 1 the reduced shard is fp32)\n"
         "  --help                     this text\n";
}

/// A count written as an integer (124439808) or in floating-point notation (7.5e9, 124e6), in [lo, hi].
std::size_t parse_count(const std::string& flag, const std::string& text, std::size_t lo, std::size_t hi,
                        const std::string& accepted) {
  const std::string wrong = flag + " expects " + accepted + ", got '" + text + "'";
  if (text.empty() || text.find_first_not_of("0123456789.eE+") != std::string::npos) throw usage_error(wrong);
  std::size_t value = 0;
  if (text.find_first_not_of("0123456789") == std::string::npos) {
    if (text.size() > 19) throw usage_error(wrong);
    value = std::stoull(text);
  } else {
    char* end = nullptr;
    const double v = std::strtod(text.c_str(), &end);
    if (end != text.c_str() + text.size() || !std::isfinite(v) || v != std::floor(v) || v < 0 || v > 1.8e19)
      throw usage_error(wrong);
    value = static_cast<std::size_t>(v);
  }
  if (value < lo || value > hi) throw usage_error(wrong);
  return value;
}

/// A bucket cap given in MiB (a positive decimal number, fractions allowed), in bytes.
std::size_t parse_mib(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);  // (strtod alone would take " 25", "0x10" or "infinity")
  if (text.empty() || text.find_first_not_of("0123456789.eE+-") != std::string::npos ||
      end != text.c_str() + text.size() || !std::isfinite(v) || !(v > 0) || v > 1e12)
    throw usage_error(flag + " expects a positive number of MiB (e.g. 25 or 0.5), got '" + text + "'");
  const long long bytes = std::llround(v * mib);
  if (bytes < 4) throw usage_error(flag + " must be at least 4 bytes (one fp32 gradient), got '" + text + "' MiB");
  return static_cast<std::size_t>(bytes);
}

/// "fp32", "bf16" or "fp16" as a DType; none for anything else.
std::optional<tandem::DType> dtype_named(const std::string& name) {
  for (tandem::DType d : {tandem::DType::fp32, tandem::DType::bf16, tandem::DType::fp16})
    if (name == tandem::dtype_name(d)) return d;
  return std::nullopt;
}

enum class OptimizerChoice { adamw, sgd, sgd_momentum };

struct Args {
  std::optional<std::size_t> params;
  std::optional<std::string> layout;
  int world = 8;
  tandem::DType dtype = tandem::DType::bf16;
  OptimizerChoice optimizer = OptimizerChoice::adamw;
  tandem::DataParallelOptions options;
  std::vector<tandem::Storage> storages = {tandem::Storage::user, tandem::Storage::owned};
  std::optional<tandem::DType> reduce;  ///< none: both (fp32 and the parameter dtype)
  bool help = false;
};

Args parse(int argc, char** argv) {
  Args a;
  const std::vector<std::string> flags = {"--params",
                                          "--layout",
                                          "--world",
                                          "--dtype",
                                          "--optimizer",
                                          "--bucket-cap-mb",
                                          "--first-bucket-cap-mb",
                                          "--gradient-buffers",
                                          "--parameter-buffers",
                                          "--storage",
                                          "--reduce-dtype",
                                          "--accumulation-steps"};
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      a.help = true;
      return a;
    }
    if (std::find(flags.begin(), flags.end(), flag) == flags.end()) {
      std::string accepted;
      for (const std::string& f : flags) accepted += f + ", ";
      throw usage_error("unknown argument '" + flag + "'; accepted: " + accepted + "--help");
    }
    if (i + 1 >= argc) throw usage_error(flag + " needs a value");
    const std::string value = argv[++i];
    if (flag == "--params") {
      if (a.params || a.layout) throw usage_error("give exactly one of --params N or --layout FILE, once");
      a.params = parse_count(flag, value, 1, tandem::max_numel,
                             "a parameter count from 1 to 2^48 (tandem's limit), e.g. 7.5e9, 124e6 or 124439808");
    } else if (flag == "--layout") {
      if (a.params || a.layout) throw usage_error("give exactly one of --params N or --layout FILE, once");
      if (!std::ifstream(value)) throw usage_error("--layout: cannot open '" + value + "'");
      a.layout = value;
    } else if (flag == "--world") {
      a.world = static_cast<int>(parse_count(flag, value, 1, static_cast<std::size_t>(std::numeric_limits<int>::max()),
                                             "a number of ranks >= 1"));
    } else if (flag == "--dtype") {
      const std::optional<tandem::DType> d = dtype_named(value);
      if (!d) throw usage_error("--dtype expects fp32, bf16 or fp16, got '" + value + "'");
      a.dtype = *d;
    } else if (flag == "--optimizer") {
      if (value == "adamw")
        a.optimizer = OptimizerChoice::adamw;
      else if (value == "sgd")
        a.optimizer = OptimizerChoice::sgd;
      else if (value == "sgd-momentum")
        a.optimizer = OptimizerChoice::sgd_momentum;
      else
        throw usage_error("--optimizer expects adamw, sgd or sgd-momentum, got '" + value + "'");
    } else if (flag == "--bucket-cap-mb") {
      a.options.bucket_cap_bytes = parse_mib(flag, value);
    } else if (flag == "--first-bucket-cap-mb") {
      a.options.first_bucket_cap_bytes = parse_mib(flag, value);
    } else if (flag == "--gradient-buffers") {
      a.options.gradient_buffers = static_cast<int>(parse_count(
          flag, value, 1, static_cast<std::size_t>(std::numeric_limits<int>::max()), "a number of buffers >= 1"));
    } else if (flag == "--parameter-buffers") {
      a.options.parameter_buffers = static_cast<int>(parse_count(
          flag, value, 1, static_cast<std::size_t>(std::numeric_limits<int>::max()), "a number of buffers >= 1"));
    } else if (flag == "--storage") {
      if (value == "user")
        a.storages = {tandem::Storage::user};
      else if (value == "owned")
        a.storages = {tandem::Storage::owned};
      else if (value == "both")
        a.storages = {tandem::Storage::user, tandem::Storage::owned};
      else
        throw usage_error("--storage expects user, owned or both, got '" + value + "'");
    } else if (flag == "--reduce-dtype") {
      a.reduce = dtype_named(value);  // "both": none
      if (!a.reduce && value != "both")
        throw usage_error("--reduce-dtype expects fp32, bf16, fp16 or both, got '" + value + "'");
    } else if (flag == "--accumulation-steps") {
      a.options.accumulation_steps = static_cast<int>(parse_count(
          flag, value, 1, static_cast<std::size_t>(std::numeric_limits<int>::max()), "a number of micro-steps >= 1"));
    }
  }
  if (!a.params && !a.layout) throw usage_error("give exactly one of --params N or --layout FILE");
  return a;
}

// ---- The ZeRO paper's figures --------------------------------------------------------------------------------------

/// Rajbhandari et al. 2020 (ZeRO), Figure 1: model states per device in bytes for psi parameters on n devices, with
/// 16-bit parameters and gradients and K bytes per parameter of optimizer states (K = 12 for mixed-precision Adam:
/// fp32 master weights, momentum and variance).
struct PaperForm {
  const char* stage;    ///< the paper's name for the partitioning
  const char* formula;  ///< as the paper writes it
  double (*bytes)(double psi, double n);
};
constexpr double zero_k = 12;

// ---- The table -----------------------------------------------------------------------------------------------------

struct Setup {
  std::vector<tandem::TensorSpec> tensors;
  std::size_t psi = 0;  ///< parameters (unpadded)
  int world = 1;
  tandem::DataParallelOptions options;
  std::vector<tandem::Storage> storages;
  std::vector<tandem::DType> reduces;  ///< DataParallelOptions::reduce_dtype, a row each
  bool paper_applies = false;          ///< 16-bit parameters and AdamW: what the paper's K = 12 describes
};

struct Row {
  const char* policy;
  tandem::Storage storage;
  tandem::DType reduce;
  tandem::MemoryReport report;
  std::optional<double> paper;  ///< bytes
};

struct Table {
  std::vector<Row> rows;
  std::vector<std::pair<const char*, PaperForm>> forms;  ///< (policy, its paper form), in row order
};

template <tandem::Policy P, tandem::Optimizer Opt>
void add(Table& t, const Setup& s, const typename Opt::Options& optimizer, PaperForm form) {
  t.forms.emplace_back(P::name, form);
  for (tandem::Storage storage : s.storages) {
    // A policy that shards the parameters has no full copy to keep in the user's buffers: owned storage only.
    if (tandem::parameter_sharding_of<P> == tandem::ParameterSharding::sharded && storage == tandem::Storage::user)
      continue;
    for (tandem::DType reduce : s.reduces) {
      tandem::DataParallelOptions options = s.options;
      options.reduce_dtype = reduce;
      const tandem::MemoryReport r = tandem::estimate_memory<P, Opt>(s.tensors, s.world, storage, optimizer, options,
                                                                     tandem::cuda_pack_table_layout);
      std::optional<double> paper;
      if (s.paper_applies) paper = form.bytes(static_cast<double>(s.psi), static_cast<double>(s.world));
      t.rows.push_back({P::name, storage, reduce, r, paper});
    }
  }
}

/// One line per policy: the policy, and the ZeRO paper's closed form for the same partitioning.
template <tandem::Optimizer Opt>
Table table(const Setup& s, const typename Opt::Options& o) {
  Table t;
  add<tandem::Replicated, Opt>(t, s, o, {"DDP", "(2+2+K)Psi", [](double p, double) { return (2 + 2 + zero_k) * p; }});
  add<tandem::OptimizerSharded, Opt>(
      t, s, o, {"ZeRO-1", "4Psi + K Psi/N", [](double p, double n) { return 4 * p + zero_k * p / n; }});
  add<tandem::GradientSharded, Opt>(
      t, s, o, {"ZeRO-2", "2Psi + (2+K) Psi/N", [](double p, double n) { return 2 * p + (2 + zero_k) * p / n; }});
  add<tandem::ParameterSharded, Opt>(
      t, s, o, {"ZeRO-3", "(2+2+K) Psi/N", [](double p, double n) { return (2 + 2 + zero_k) * p / n; }});
  return t;
}

const char* storage_name(tandem::Storage s) { return s == tandem::Storage::user ? "user" : "owned"; }

void print(const Table& t, const Setup& s, const std::string& optimizer, const std::string& layout_line) {
  const tandem::DType dtype = s.tensors[0].dtype;
  std::printf(
      "tandem_memory: %zu parameters (%s), %d ranks, %s, %d micro-step(s) per step, buckets of %g MiB (the first %g "
      "MiB)",
      s.psi, tandem::dtype_name(dtype), s.world, optimizer.c_str(), s.options.accumulation_steps,
      static_cast<double>(s.options.bucket_cap_bytes) / mib,
      static_cast<double>(s.options.first_bucket_cap_bytes) / mib);
  if (s.storages.back() == tandem::Storage::owned)
    std::printf(", %d gradient and %d parameter buffers", s.options.gradient_buffers, s.options.parameter_buffers);
  std::printf("\n%s\n", layout_line.c_str());
  std::printf(
      "GB per rank (1 GB = 1e9 bytes, as in the ZeRO paper). model states = params + grads + master + optimizer\n"
      "state, buckets = tandem's communication buffers, tables = its pack tables on CUDA (user storage), total =\n"
      "model states + buckets + tables (activations, CUDA and NCCL workspaces are not counted).\n\n");

  double largest = 0;
  for (const Row& r : t.rows) largest = std::max(largest, static_cast<double>(r.report.total()) / 1e9);
  const int decimals = largest >= 1000 ? 1 : largest >= 10 ? 2 : 3;  // 4-5 significant digits for the largest
  auto gb = [&](double bytes) {
    char s[64];
    std::snprintf(s, sizeof s, "%.*f", decimals, bytes / 1e9);
    return std::string(s);
  };
  std::printf(
      "| policy | storage | reduce | params | grads | master | optimizer state | model states | ZeRO paper | buckets | "
      "tables | total |\n"
      "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const Row& r : t.rows) {
    const tandem::MemoryReport& m = r.report;
    std::printf("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", r.policy, storage_name(r.storage),
                tandem::dtype_name(r.reduce), gb(static_cast<double>(m.params)).c_str(),
                gb(static_cast<double>(m.grads)).c_str(), gb(static_cast<double>(m.master_weights)).c_str(),
                gb(static_cast<double>(m.optimizer_state)).c_str(), gb(static_cast<double>(m.model_states())).c_str(),
                r.paper ? gb(*r.paper).c_str() : "-", gb(static_cast<double>(m.buckets)).c_str(),
                gb(static_cast<double>(m.pack_tables)).c_str(), gb(static_cast<double>(m.total())).c_str());
  }

  std::printf("\n");
  if (s.paper_applies) {
    std::printf("ZeRO paper (Rajbhandari et al. 2020), model states with K = 12:\n");
    for (const auto& [policy, form] : t.forms) std::printf("  %s = %s: %s\n", policy, form.stage, form.formula);
  } else {
    std::printf("ZeRO paper: - (its figures are for 16-bit parameters with mixed-precision Adam, K = 12)\n");
  }
  std::printf("Notes:\n");
  if (s.paper_applies)
    std::printf(
        "- The paper's figures (16-bit gradients) are the rows Replicated and OptimizerSharded with user storage\n"
        "  (your 16-bit params and grads, 2Psi + 2Psi), and GradientSharded and ParameterSharded with owned storage\n"
        "  and a 16-bit reduce dtype. Reduced in fp32 (or with more than one micro-step per step), their reduced\n"
        "  gradient shard is fp32 (4Psi/N, the paper counts 2Psi/N): 2Psi + 16Psi/N against 2Psi + 14Psi/N, and\n"
        "  18Psi/N against 16Psi/N.\n");
  for (tandem::DType reduce : s.reduces)
    if (reduce != tandem::DType::fp32)
      std::printf(
          "- reduce %s: gradients are rounded into one bucket-sized %s buffer and reduced there (under buckets);\n"
          "  with one micro-step per step the sharded policies keep their reduced shard in %s.\n",
          tandem::dtype_name(reduce), tandem::dtype_name(reduce), tandem::dtype_name(reduce));
  for (tandem::Storage storage : s.storages) {
    if (storage == tandem::Storage::user)
      std::printf(
          "- user storage: params and grads are your own buffers, in the parameter dtype. What tandem packs them\n"
          "  into (flat parameters, fp32 gradient buckets or shard) is under buckets; where each tensor's chunks\n"
          "  go, under tables (a 16-byte item per 512 elements and a 24-byte record per tensor, for the\n"
          "  parameters and for the gradients: on every rank, whatever the policy).\n");
    else
      std::printf(
          "- owned storage: backward writes gradients straight into tandem's fp32 buckets, where they are reduced\n"
          "  and accumulated, so Replicated and OptimizerSharded keep full fp32 gradients (4Psi, %s);\n"
          "  GradientSharded keeps its reduced shard (4Psi/N in fp32) and reuses %d bucket buffers (under buckets);\n"
          "  ParameterSharded keeps a shard of everything and gathers parameters into %d bucket buffers.\n",
          dtype == tandem::DType::fp32 ? "as your own would be" : "not 2Psi", s.options.gradient_buffers,
          s.options.parameter_buffers);
  }
}

std::vector<tandem::TensorSpec> synthesize(std::size_t psi, tandem::DType dtype) {
  std::vector<tandem::TensorSpec> tensors;
  tensors.reserve(psi / synthesized_tensor + 1);
  for (std::size_t left = psi; left > 0;) {
    const std::size_t n = std::min(left, synthesized_tensor);
    std::string name = "t";  // not "t" + to_string(): GCC 12 -O3 warns falsely there (-Wrestrict, GCC bug 105329)
    name += std::to_string(tensors.size());
    tensors.push_back({std::move(name), n, dtype});
    left -= n;
  }
  return tensors;
}

int run(const Args& a) {
  Setup s;
  s.world = a.world;
  s.options = a.options;
  s.storages = a.storages;
  if (a.reduce)
    s.reduces = {*a.reduce};
  else if (a.dtype == tandem::DType::fp32)
    s.reduces = {tandem::DType::fp32};
  else
    s.reduces = {tandem::DType::fp32, a.dtype};
  std::string layout_line;
  if (a.params) {
    s.tensors = synthesize(*a.params, a.dtype);
    const std::size_t n = s.tensors.size(), last = s.tensors.back().numel;
    layout_line = "layout: synthesized from --params as tensors of 2^24 elements, the last smaller: ";
    if (n == 1)
      layout_line += "one tensor";
    else if (last == synthesized_tensor)
      layout_line += std::to_string(n) + " tensors of 2^24";
    else
      layout_line +=
          std::to_string(n) + " tensors, " + std::to_string(n - 1) + " of 2^24 and one of " + std::to_string(last);
  } else {
    tandem::scaling::ModelLayout model;
    try {
      model = tandem::scaling::load_tensor_list(*a.layout, *a.layout);
    } catch (const std::exception& e) {  // a file that is no tensor list is a bad argument
      throw usage_error(std::string("--layout: ") + e.what());
    }
    for (const tandem::scaling::TensorEntry& e : model.tensors) s.tensors.push_back({e.name, e.numel, a.dtype});
    layout_line = "layout: " + *a.layout + ", " + std::to_string(s.tensors.size()) +
                  (s.tensors.size() == 1 ? " tensor, " : " tensors, ") + std::to_string(model.total_numel()) +
                  " parameters";
  }
  for (const tandem::TensorSpec& t : s.tensors) s.psi += t.numel;
  s.paper_applies = a.dtype != tandem::DType::fp32 && a.optimizer == OptimizerChoice::adamw;
  switch (a.optimizer) {
    case OptimizerChoice::adamw:
      print(table<tandem::AdamW>(s, {}), s, "AdamW", layout_line);
      break;
    case OptimizerChoice::sgd:
      print(table<tandem::SGD>(s, {}), s, "SGD without momentum", layout_line);
      break;
    case OptimizerChoice::sgd_momentum:
      print(table<tandem::SGD>(s, {.momentum = 0.9f}), s, "SGD with momentum", layout_line);
      break;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse(argc, argv);
    if (a.help) {
      std::printf("%s", usage().c_str());
      return 0;
    }
    return run(a);
  } catch (const usage_error& e) {
    std::fprintf(stderr, "tandem_memory: %s (see --help)\n", e.what());
    return 2;
  } catch (const tandem::error& e) {
    std::fprintf(stderr, "tandem_memory: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tandem_memory: %s\n", e.what());
    return 1;
  }
}
