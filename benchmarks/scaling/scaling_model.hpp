// SPDX-License-Identifier: Apache-2.0
// An analytical model of one optimizer step of tandem's data parallelism, per GPU, for a weak-scaling run
// (fixed tokens per GPU per micro-step): compute from FLOPs, tandem's own kernels from the bytes they move,
// collectives from nccl-tests' bus-bandwidth definitions, memory from tandem's own estimator (estimate_memory, what
// DataParallel::memory_report() reports). The buckets and shards are the plan DataParallel cuts with its default
// options, so every bucket size, padding and shard is what the library would use.
// docs/scaling.md states each input's source and what the model leaves out; tests/test_scaling_model.cpp
// checks it against hand computations. Host-only, no CUDA.
#pragma once

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <fstream>
#include <limits>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "tandem/core/dtype.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/plan.hpp"
#include "tandem/core/tensor.hpp"
#include "tandem/front/estimate.hpp"
#include "tandem/front/options.hpp"
#include "tandem/kernels/adamw.hpp"
#include "tandem/kernels/sgd.hpp"
#include "tandem/policy/gradient_sharded.hpp"
#include "tandem/policy/optimizer_sharded.hpp"
#include "tandem/policy/policy.hpp"
#include "tandem/policy/replicated.hpp"

namespace tandem::scaling {

// ---- Model layouts -----------------------------------------------------------------------------------------

/// One parameter tensor: name, element count and shape as "AxB" (or "A").
struct TensorEntry {
  std::string name;
  std::size_t numel = 0;
  std::string shape;
  friend bool operator==(const TensorEntry&, const TensorEntry&) = default;
};

/// A model's parameter tensors in model (layout) order.
struct ModelLayout {
  std::string name;
  std::vector<TensorEntry> tensors;

  std::size_t total_numel() const {
    std::size_t n = 0;
    for (const TensorEntry& t : tensors) n += t.numel;
    return n;
  }
  std::vector<std::size_t> numels() const {
    std::vector<std::size_t> out;
    out.reserve(tensors.size());
    for (const TensorEntry& t : tensors) out.push_back(t.numel);
    return out;
  }
};

namespace detail {

/// The product of a shape's 'x'-separated dimensions; fails on anything but digits and 'x'.
inline std::size_t shape_numel(const std::string& shape, const std::string& where) {
  constexpr std::size_t most = std::numeric_limits<std::size_t>::max();
  const auto too_large = [&] { tandem::detail::fail(where + ": shape '" + shape + "' has 2^64 elements or more"); };
  std::size_t product = 1, dim = 0;
  bool digits = false, zero = false, overflow = false;  // a 0 dimension makes the product of the others 0
  const auto multiply = [&] {
    zero = zero || dim == 0;
    overflow = overflow || (dim != 0 && product > most / dim);
    product *= dim;
  };
  for (char c : shape) {
    if (c >= '0' && c <= '9') {
      const auto digit = static_cast<std::size_t>(c - '0');
      if (dim > (most - digit) / 10) too_large();
      dim = dim * 10 + digit;
      digits = true;
    } else if (c == 'x' && digits) {
      multiply();
      dim = 0;
      digits = false;
    } else {
      tandem::detail::fail(where + ": shape '" + shape + "' is not of the form AxBx...");
    }
  }
  if (!digits) tandem::detail::fail(where + ": shape '" + shape + "' is not of the form AxBx...");
  multiply();
  if (zero) return 0;
  if (overflow) too_large();
  return product;
}

inline std::string join_shape(const std::vector<std::size_t>& dims) {
  std::string s;
  for (std::size_t i = 0; i < dims.size(); ++i) {
    if (i) s += 'x';  // appended apart: GCC 12's -Wrestrict misfires on ("x" + std::string) at -O3 (GCC PR 105329)
    s += std::to_string(dims[i]);
  }
  return s;
}

}  // namespace detail

/// Reads a tensor list: one tensor per line, `name<TAB>numel<TAB>shape`; blank lines and lines starting with
/// '#' are skipped. Throws tandem::error naming the file and line when a line is malformed or the numel
/// disagrees with the shape.
inline ModelLayout load_tensor_list(const std::string& path, std::string name) {
  std::ifstream in(path);
  if (!in) tandem::detail::fail("tandem::scaling: cannot open the tensor list '" + path + "'");
  ModelLayout layout{std::move(name), {}};
  std::string line;
  for (std::size_t line_no = 1; std::getline(in, line); ++line_no) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line[0] == '#') continue;
    const std::string where = path + ":" + std::to_string(line_no);
    const std::size_t tab1 = line.find('\t');
    const std::size_t tab2 = tab1 == std::string::npos ? std::string::npos : line.find('\t', tab1 + 1);
    if (tab2 == std::string::npos || line.find('\t', tab2 + 1) != std::string::npos)
      tandem::detail::fail(where + ": expected three tab-separated fields, name<TAB>numel<TAB>shape");
    TensorEntry t{line.substr(0, tab1), 0, line.substr(tab2 + 1)};
    const std::string numel = line.substr(tab1 + 1, tab2 - tab1 - 1);
    if (t.name.empty() || numel.empty() || numel.find_first_not_of("0123456789") != std::string::npos)
      tandem::detail::fail(where + ": the name must be non-empty and the numel a non-negative integer");
    const auto [end, err] = std::from_chars(numel.data(), numel.data() + numel.size(), t.numel);
    if (err != std::errc{} || end != numel.data() + numel.size())
      tandem::detail::fail(where + ": numel " + numel + " is 2^64 or more");
    if (detail::shape_numel(t.shape, where) != t.numel)
      tandem::detail::fail(where + ": numel " + numel + " is not the product of shape " + t.shape);
    layout.tensors.push_back(std::move(t));
  }
  if (layout.tensors.empty()) tandem::detail::fail("tandem::scaling: the tensor list '" + path + "' has no tensors");
  return layout;
}

/// GPT-2's architecture (Radford et al., 2019): pre-LayerNorm blocks, Conv1D weights stored in x out, an
/// MLP of width 4d, learned position embeddings, output head tied to the token embedding (no tensor of its own).
struct Gpt2Config {
  std::size_t layers = 12;
  std::size_t width = 768;
  std::size_t heads = 12;  ///< no effect on the parameter count; must divide width
  std::size_t context = 1024;
  std::size_t vocab = 50257;
};

inline constexpr Gpt2Config gpt2_124m{.layers = 12, .width = 768, .heads = 12, .context = 1024, .vocab = 50257};
inline constexpr Gpt2Config gpt2_350m{.layers = 24, .width = 1024, .heads = 16, .context = 1024, .vocab = 50257};

/// GPT-2's parameter tensors in model order, named as Hugging Face's GPT2Model (and tests/data/gpt2_124m.tsv).
inline ModelLayout gpt2_layout(const Gpt2Config& c, std::string name) {
  if (c.layers == 0 || c.width == 0 || c.heads == 0 || c.width % c.heads != 0 || c.context == 0 || c.vocab == 0)
    tandem::detail::fail("tandem::scaling: Gpt2Config needs positive sizes and heads dividing width");
  ModelLayout layout{std::move(name), {}};
  auto add = [&](const std::string& tensor, std::vector<std::size_t> dims) {
    std::size_t numel = 1;
    for (std::size_t d : dims) numel *= d;
    layout.tensors.push_back({tensor, numel, detail::join_shape(dims)});
  };
  const std::size_t d = c.width;
  add("wte.weight", {c.vocab, d});
  add("wpe.weight", {c.context, d});
  for (std::size_t l = 0; l < c.layers; ++l) {
    const std::string h = "h." + std::to_string(l) + ".";
    add(h + "ln_1.weight", {d});
    add(h + "ln_1.bias", {d});
    add(h + "attn.c_attn.weight", {d, 3 * d});
    add(h + "attn.c_attn.bias", {3 * d});
    add(h + "attn.c_proj.weight", {d, d});
    add(h + "attn.c_proj.bias", {d});
    add(h + "ln_2.weight", {d});
    add(h + "ln_2.bias", {d});
    add(h + "mlp.c_fc.weight", {d, 4 * d});
    add(h + "mlp.c_fc.bias", {4 * d});
    add(h + "mlp.c_proj.weight", {4 * d, d});
    add(h + "mlp.c_proj.bias", {d});
  }
  add("ln_f.weight", {d});
  add("ln_f.bias", {d});
  return layout;
}

// ---- Policies ------------------------------------------------------------------------------------------------

/// A policy's two traits, read from tandem's own policy tag types, so the model cannot drift from the library.
struct PolicyTraits {
  const char* name = "";
  StateSharding state = StateSharding::replicated;
  GradientReduction reduction = GradientReduction::at_boundary;
  friend constexpr bool operator==(const PolicyTraits& a, const PolicyTraits& b) {
    return std::string_view(a.name) == b.name && a.state == b.state && a.reduction == b.reduction;
  }
};

template <tandem::Policy P>
constexpr PolicyTraits traits_of() {
  return {P::name, P::state, P::reduction};
}

template <tandem::Policy... Ps>
struct PolicyList {
  static constexpr std::array<PolicyTraits, sizeof...(Ps)> traits = {traits_of<Ps>()...};
};

/// The policies the model covers, in the tables' order: the one list behind `policies` and `with_policy`, so a
/// fourth policy is one more type here.
using Policies = PolicyList<Replicated, OptimizerSharded, GradientSharded>;

inline constexpr auto policies = Policies::traits;

namespace detail {

template <class F, tandem::Policy P, tandem::Policy... Rest>
decltype(auto) with_policy(const PolicyTraits& policy, F& f, PolicyList<P, Rest...>) {
  if (policy == traits_of<P>()) return f.template operator()<P>();
  if constexpr (sizeof...(Rest) > 0) {
    return with_policy(policy, f, PolicyList<Rest...>{});
  } else {
    tandem::detail::fail(std::string("tandem::scaling: the policy traits named '") + policy.name +
                         "' match none of tandem::scaling::Policies");
  }
}

}  // namespace detail

/// Calls `f.template operator()<P>()` for the policy type P of `Policies` whose traits `policy` are: the model's
/// runtime traits mapped to the compile-time policy the library's templates take.
template <class F>
decltype(auto) with_policy(const PolicyTraits& policy, F&& f) {
  return detail::with_policy(policy, f, Policies{});
}

// ---- Inputs ----------------------------------------------------------------------------------------------------

enum class Overlap { off, on };

/// Everything the model assumes. Defaults and their sources: docs/scaling.md, "Inputs".
struct Inputs {
  double peak_flops = 989.4e12;            ///< H100/H200 SXM bf16 dense tensor-core peak, FLOP/s
  double mfu = 0.4;                        ///< model FLOPs utilization of forward + backward
  double backward_share = 2.0 / 3.0;       ///< backward's share of forward + backward time
  double hbm_bandwidth = 3.35e12;          ///< published HBM bandwidth, B/s (H100 SXM; H200 4.8e12)
  double kernel_bandwidth_fraction = 0.8;  ///< kernel bandwidth = this x HBM, until a measurement is given
  double kernel_bandwidth = 0.0;           ///< measured bandwidth of tandem's kernels, B/s; 0 = use the fraction
  double busbw_intra = 370e9;              ///< nccl-tests bus bandwidth within a node (NVLink), B/s
  double busbw_inter = 368e9;              ///< nccl-tests bus bandwidth across nodes (InfiniBand), B/s
  int gpus_per_node = 8;                   ///< worlds up to this size use busbw_intra
  double collective_latency = 0.0;         ///< fixed cost per collective call, s (0: bandwidth only)
  double tokens_per_gpu = 16 * 1024;       ///< tokens per GPU per micro-step
  int accumulation_steps = 1;              ///< micro-steps per optimizer step
  DType param_dtype = DType::bf16;         ///< bf16 (fp32 master weights) or fp32
  std::size_t optimizer_states = 2;        ///< 2: AdamW (m, v); 1: SGD with momentum; 0: plain SGD

  double kernel_bw() const {
    return kernel_bandwidth > 0.0 ? kernel_bandwidth : kernel_bandwidth_fraction * hbm_bandwidth;
  }
  std::size_t param_bytes() const { return dtype_size(param_dtype); }
};

/// Rejects inputs the model cannot use, naming the field.
inline void validate(const Inputs& in) {
  auto positive = [](double v, const char* what) {
    if (!(v > 0.0) || !std::isfinite(v))
      tandem::detail::fail(std::string("tandem::scaling: Inputs::") + what + " must be positive and finite");
  };
  positive(in.peak_flops, "peak_flops");
  positive(in.mfu, "mfu");
  positive(in.hbm_bandwidth, "hbm_bandwidth");
  if (!(in.kernel_bandwidth >= 0.0) || !std::isfinite(in.kernel_bandwidth))
    tandem::detail::fail("tandem::scaling: Inputs::kernel_bandwidth must be finite and >= 0 (0: use the fraction)");
  if (in.kernel_bandwidth == 0.0 && !(in.kernel_bandwidth_fraction > 0.0 && in.kernel_bandwidth_fraction <= 1.0))
    tandem::detail::fail(
        "tandem::scaling: Inputs::kernel_bandwidth_fraction is a fraction of the HBM bandwidth; it "
        "must be in (0, 1]");
  positive(in.kernel_bw(), "kernel_bandwidth (or kernel_bandwidth_fraction)");
  positive(in.busbw_intra, "busbw_intra");
  positive(in.busbw_inter, "busbw_inter");
  positive(in.tokens_per_gpu, "tokens_per_gpu");
  if (in.mfu > 1.0) tandem::detail::fail("tandem::scaling: Inputs::mfu is a fraction; it must be at most 1");
  if (!(in.backward_share >= 0.0 && in.backward_share <= 1.0))
    tandem::detail::fail("tandem::scaling: Inputs::backward_share must be in [0, 1]");
  if (!(in.collective_latency >= 0.0) || !std::isfinite(in.collective_latency))
    tandem::detail::fail("tandem::scaling: Inputs::collective_latency must be finite and >= 0");
  if (in.gpus_per_node < 1) tandem::detail::fail("tandem::scaling: Inputs::gpus_per_node must be at least 1");
  if (in.accumulation_steps < 1) tandem::detail::fail("tandem::scaling: Inputs::accumulation_steps must be >= 1");
  if (in.param_dtype != DType::bf16 && in.param_dtype != DType::fp32 && in.param_dtype != DType::fp16)
    tandem::detail::fail("tandem::scaling: Inputs::param_dtype must be bf16, fp16 or fp32");
  if (in.optimizer_states > 2)
    tandem::detail::fail("tandem::scaling: Inputs::optimizer_states is " + std::to_string(in.optimizer_states) +
                         "; it must be 0 (SGD), 1 (SGD with momentum) or 2 (AdamW)");
}

/// Calls `f.template operator()<Opt>(options)` for the optimizer with `states` fp32 state arrays per element: AdamW
/// (m, v) for 2, SGD with momentum 0.9 for 1, plain SGD for 0.
template <class F>
decltype(auto) with_optimizer(std::size_t states, F&& f) {
  if (states == 2) return f.template operator()<AdamW>(AdamWOptions{});
  if (states == 1) return f.template operator()<SGD>(SGDOptions{.momentum = 0.9f});
  if (states == 0) return f.template operator()<SGD>(SGDOptions{});
  tandem::detail::fail("tandem::scaling: Inputs::optimizer_states is " + std::to_string(states) +
                       "; it must be 0 (SGD), 1 (SGD with momentum) or 2 (AdamW)");
}

/// The layout as the tensors DataParallel would be built from, all in the parameter dtype.
inline std::vector<TensorSpec> tensor_specs(const ModelLayout& layout, DType dtype) {
  std::vector<TensorSpec> specs;
  specs.reserve(layout.tensors.size());
  for (const TensorEntry& t : layout.tensors) specs.push_back({t.name, t.numel, dtype});
  return specs;
}

/// The plan DataParallel cuts for this layout at this world size with its default options (front/options.hpp):
/// 25 MiB buckets, a 1 MiB first bucket, caps in fp32 gradient bytes, 16-byte tensor and 128-byte shard alignment.
inline Plan plan_of(const ModelLayout& layout, int world, DType dtype) {
  return tandem::detail::plan_for(Layout(tensor_specs(layout, dtype)), DataParallelOptions{}, world);
}

// ---- Collectives (nccl-tests, doc/PERFORMANCE.md) ------------------------------------------------------------

/// The bus bandwidth for a world of n ranks: NVLink within a node, the network beyond it.
inline double bus_bandwidth(int n, const Inputs& in) { return n <= in.gpus_per_node ? in.busbw_intra : in.busbw_inter; }

/// All-reduce of `bytes` (each rank's buffer): t = S * 2(n-1)/n / busbw. Zero for one rank.
inline double all_reduce_time(double bytes, int n, const Inputs& in) {
  if (n <= 1) return 0.0;
  return in.collective_latency + bytes * 2.0 * (n - 1) / n / bus_bandwidth(n, in);
}

/// Reduce-scatter of a `bytes` array (the whole array, n shards): t = S * (n-1)/n / busbw.
inline double reduce_scatter_time(double bytes, int n, const Inputs& in) {
  if (n <= 1) return 0.0;
  return in.collective_latency + bytes * (n - 1) / n / bus_bandwidth(n, in);
}

/// All-gather into a `bytes` array (the whole array): t = S * (n-1)/n / busbw.
inline double all_gather_time(double bytes, int n, const Inputs& in) { return reduce_scatter_time(bytes, n, in); }

/// Collectives queued one after another on one stream: collective b may start once its gradients are ready
/// (`ready[b]`, seconds after backward began) and collective b-1 has finished. Returns how far the last one
/// ends past `window` (the backward's length): the communication left exposed. Never less than
/// sum(duration) - window, never more than sum(duration) while every ready time is within the window.
inline double exposed_after(const std::vector<double>& ready, const std::vector<double>& duration, double window) {
  if (ready.size() != duration.size())
    tandem::detail::fail("tandem::scaling: exposed_after needs one ready time per collective");
  double end = 0.0;
  for (std::size_t b = 0; b < ready.size(); ++b) end = std::max(end, ready[b]) + duration[b];
  return std::max(0.0, end - window);
}

// ---- Memory (tandem's estimator, copy mode) --------------------------------------------------------------------

/// Bytes per GPU by category: what DataParallel<P, Opt>::memory_report() reports on each rank when built from the
/// user's buffers (Storage::user, copy mode), from tandem::estimate_memory; the model keeps no memory rule of its
/// own. With F, S, M the plan's total, shard and largest bucket sizes and k the optimizer's states: params and grads
/// psi*p, master weights 4F or 4S (16-bit parameters only), optimizer state 4kF or 4kS, buckets pF + 4F or, under
/// GradientSharded, pF + 4M + 4S, and CudaBackend's pack tables (about 64 bytes per 1024 elements). Activations,
/// workspace and the allocator's slack are not in it.
inline MemoryReport memory_per_gpu(const ModelLayout& layout, const PolicyTraits& policy, int world, const Inputs& in) {
  const std::vector<TensorSpec> specs = tensor_specs(layout, in.param_dtype);
  return with_policy(policy, [&]<tandem::Policy P>() {
    return with_optimizer(in.optimizer_states, [&]<tandem::Optimizer Opt>(const typename Opt::Options& options) {
      return estimate_memory<P, Opt>(specs, world, Storage::user, options, {}, cuda_pack_table_layout);
    });
  });
}

// ---- tandem's kernels ------------------------------------------------------------------------------------------

/// Bytes tandem's kernels read and write per optimizer step (copy mode, k micro-steps, no clipping).
struct KernelBytes {
  double pack = 0;  ///< gradients into the fp32 bucket: read psi*p, write 4 psi (read 4 psi more when accumulating)
  double accumulate = 0;  ///< GradientSharded: adding my reduced shard into the shard accumulator, 12S
  double optimizer = 0;   ///< AdamW over the owned range: grad 4, master r/w 8, state r/w 8k, 16-bit param write p
  double unpack = 0;      ///< parameters from the bucket to the user's buffers: read and write psi*p
  double total() const { return pack + accumulate + optimizer + unpack; }
};

inline KernelBytes kernel_bytes(const Plan& plan, std::size_t psi, std::size_t p, std::size_t k,
                                const PolicyTraits& policy, int world, int accumulation_steps) {
  const double P = static_cast<double>(psi), F = static_cast<double>(plan.total_size()),
               S = static_cast<double>(plan.total_shard_size()), pb = static_cast<double>(p);
  const double steps = accumulation_steps, later = accumulation_steps - 1;
  const double owned = policy.state == StateSharding::sharded ? S : F;
  KernelBytes b;
  if (policy.reduction == GradientReduction::every_micro_step) {
    // Every micro-step: assign into the shared staging bucket (zeroing its gaps), then reduce-scatter: the window's
    // first writes my shard into the accumulator itself (at one rank a copy, 8S, counted here: no communication is),
    // the later ones are added into it.
    b.pack = steps * (P * pb + 4.0 * P + 4.0 * (F - P));
    b.accumulate = (world == 1 ? 8.0 * S : 0.0) + later * 12.0 * S;
  } else {
    b.pack = steps * (P * pb + 4.0 * P) + later * 4.0 * P;  // accumulating micro-steps also read the bucket
  }
  const double per_element = 4.0 + 8.0 + 8.0 * static_cast<double>(k) + (p == 4 ? 0.0 : pb);
  b.optimizer = owned * per_element;
  b.unpack = 2.0 * P * pb;
  return b;
}

// ---- One optimizer step ------------------------------------------------------------------------------------------

/// The model's prediction for one (model, policy, world). Times in seconds per optimizer step.
struct Prediction {
  std::string model;
  PolicyTraits policy;
  int world = 1;
  std::size_t buckets = 0;
  double compute = 0;     ///< forward + backward of every micro-step: 6 psi tokens / (peak * mfu)
  double backward = 0;    ///< one micro-step's backward: the window gradient communication can hide behind
  double kernels = 0;     ///< tandem's kernels at the kernel bandwidth (never hidden)
  double grad_comm = 0;   ///< all-reduce (Replicated) or reduce-scatter (sharded) of the fp32 buckets
  double param_comm = 0;  ///< all-gather of the parameter shards (sharded policies), in the parameter dtype
  double exposed_without_overlap = 0;     ///< all communication
  double exposed_with_overlap = 0;        ///< gradient communication past the backward, plus the all-gather
  double efficiency_without_overlap = 1;  ///< step time at world 1 / step time (weak scaling)
  double efficiency_with_overlap = 1;
  MemoryReport memory;
  KernelBytes bytes;

  double comm() const { return grad_comm + param_comm; }
  double exposed(Overlap o) const { return o == Overlap::on ? exposed_with_overlap : exposed_without_overlap; }
  double step(Overlap o) const { return compute + kernels + exposed(o); }
  double efficiency(Overlap o) const { return o == Overlap::on ? efficiency_with_overlap : efficiency_without_overlap; }
};

namespace detail {

inline Prediction predict_step(const ModelLayout& layout, const PolicyTraits& policy, int world, const Inputs& in) {
  validate(in);
  const std::size_t psi = layout.total_numel(), p = in.param_bytes();
  if (psi == 0) tandem::detail::fail("tandem::scaling: the layout `" + layout.name + "` has no parameters");
  const Plan plan = plan_of(layout, world, in.param_dtype);
  Prediction r;
  r.model = layout.name;
  r.policy = policy;
  r.world = world;
  r.buckets = plan.num_buckets();
  r.memory = memory_per_gpu(layout, policy, world, in);
  r.bytes = kernel_bytes(plan, psi, p, in.optimizer_states, policy, world, in.accumulation_steps);
  r.kernels = r.bytes.total() / in.kernel_bw();

  const double micro_compute = 6.0 * static_cast<double>(psi) * in.tokens_per_gpu / (in.peak_flops * in.mfu);
  r.compute = in.accumulation_steps * micro_compute;
  r.backward = in.backward_share * micro_compute;

  // Per bucket, in bucket order (the order backward produces gradients): its collective's duration and when
  // its gradients are ready, taking backward's progress as proportional to the parameters it has covered.
  const bool sharded = policy.state == StateSharding::sharded;
  const bool every_micro_step = policy.reduction == GradientReduction::every_micro_step;
  // (Counted in integers, so that the last bucket is ready exactly when backward ends.)
  std::vector<double> ready, duration;
  std::size_t covered = 0;
  for (const Bucket& b : plan.buckets()) {
    for (std::size_t t : b.tensors) covered += layout.tensors[t].numel;
    ready.push_back(r.backward * (static_cast<double>(covered) / static_cast<double>(psi)));
    const double grad_bytes = 4.0 * static_cast<double>(b.size);
    duration.push_back(sharded ? reduce_scatter_time(grad_bytes, world, in) : all_reduce_time(grad_bytes, world, in));
    if (sharded) r.param_comm += all_gather_time(static_cast<double>(p * b.size), world, in);
  }
  double one_reduction = 0.0;
  for (double d : duration) one_reduction += d;
  const int reductions = every_micro_step ? in.accumulation_steps : 1;
  r.grad_comm = reductions * one_reduction;
  r.exposed_without_overlap = r.grad_comm + r.param_comm;
  r.exposed_with_overlap = reductions * exposed_after(ready, duration, r.backward) + r.param_comm;
  // Inputs each in range can still overflow together (1e308 tokens, a bandwidth of 1e-300 GB/s): no table of inf.
  if (!std::isfinite(r.step(Overlap::off)) || !(r.step(Overlap::on) > 0.0))
    tandem::detail::fail("tandem::scaling: " + layout.name + " under " + policy.name + " on " + std::to_string(world) +
                         " GPU(s): the inputs give a step of " + std::to_string(r.step(Overlap::off)) + " s (compute " +
                         std::to_string(r.compute) + " s, kernels " + std::to_string(r.kernels) + " s, communication " +
                         std::to_string(r.comm()) + " s), out of the model's range: check the inputs and their units");
  return r;
}

}  // namespace detail

/// Predicts one optimizer step of `layout` under `policy` on `world` GPUs; efficiency is against world 1.
inline Prediction predict(const ModelLayout& layout, const PolicyTraits& policy, int world, const Inputs& in) {
  if (world < 1) tandem::detail::fail("tandem::scaling: the world size must be at least 1");
  Prediction r = detail::predict_step(layout, policy, world, in);
  const Prediction one = world == 1 ? r : detail::predict_step(layout, policy, 1, in);
  r.efficiency_without_overlap = one.step(Overlap::off) / r.step(Overlap::off);
  r.efficiency_with_overlap = one.step(Overlap::on) / r.step(Overlap::on);
  return r;
}

}  // namespace tandem::scaling
