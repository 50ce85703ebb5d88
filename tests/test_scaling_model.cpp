// SPDX-License-Identifier: Apache-2.0
// The scaling model (benchmarks/scaling/scaling_model.hpp) against hand computations: the GPT-2 layouts, the
// memory formulas, nccl-tests' collective times, the overlap pipeline, and the invariants every prediction
// must keep (overlap never slows a step, never hides more than the backward, world 1 never communicates).
#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "../benchmarks/scaling/scaling_model.hpp"

namespace {

namespace sc = tandem::scaling;

const char* const tsv_path = TANDEM_TEST_DATA_DIR "/gpt2_124m.tsv";
constexpr int worlds[] = {1, 2, 4, 8, 16, 32, 64};

const sc::ModelLayout& gpt2_124m() {
  static const sc::ModelLayout layout = sc::load_tensor_list(tsv_path, "GPT-2 124M");
  return layout;
}

const sc::ModelLayout& gpt2_350m() {
  static const sc::ModelLayout layout = sc::gpt2_layout(sc::gpt2_350m, "GPT-2 350M");
  return layout;
}

// The plan tandem would build, from options written out here rather than taken from the library's plan_for.
tandem::Plan hand_plan(const sc::ModelLayout& layout, int world, std::size_t p) {
  tandem::PlanOptions o;
  o.bucket_cap_bytes = 25u << 20;
  o.first_bucket_cap_bytes = 1u << 20;
  o.world_size = world;
  o.bucket_element_bytes = 4;
  o.alignment_elements = 16 / p;
  o.shard_alignment_elements = 128 / p;
  return tandem::Plan(layout.numels(), o);
}

const sc::PolicyTraits& replicated = sc::policies[0];
const sc::PolicyTraits& optimizer_sharded = sc::policies[1];
const sc::PolicyTraits& gradient_sharded = sc::policies[2];

}  // namespace

TEST_CASE("the policies are tandem's, in order") {
  CHECK(std::string(replicated.name) == "Replicated");
  CHECK(std::string(optimizer_sharded.name) == "OptimizerSharded");
  CHECK(std::string(gradient_sharded.name) == "GradientSharded");
  CHECK(gradient_sharded.reduction == tandem::GradientReduction::every_micro_step);
  CHECK(optimizer_sharded.state == tandem::StateSharding::sharded);
}

TEST_CASE("the GPT-2 124M generator reproduces tests/data/gpt2_124m.tsv exactly") {
  const sc::ModelLayout& file = gpt2_124m();
  const sc::ModelLayout generated = sc::gpt2_layout(sc::gpt2_124m, "generated");
  REQUIRE(file.tensors.size() == 148);
  CHECK(file.total_numel() == 124439808);
  REQUIRE(generated.tensors.size() == file.tensors.size());
  for (std::size_t i = 0; i < file.tensors.size(); ++i) {
    CAPTURE(i);
    CHECK(generated.tensors[i].name == file.tensors[i].name);
    CHECK(generated.tensors[i].numel == file.tensors[i].numel);
    CHECK(generated.tensors[i].shape == file.tensors[i].shape);
  }
}

TEST_CASE("GPT-2 350M: tensors and parameters from the architecture, by hand") {
  const std::size_t L = 24, d = 1024, V = 50257, T = 1024;
  // Per block: ln_1 (2d), c_attn (d*3d + 3d), attn c_proj (d*d + d), ln_2 (2d), c_fc (d*4d + 4d), mlp c_proj (4d*d +
  // d).
  const std::size_t per_block =
      2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (4 * d * d + 4 * d) + (4 * d * d + d);
  CHECK(per_block == 12 * d * d + 13 * d);
  const std::size_t expected = V * d + T * d + L * per_block + 2 * d;  // wte, wpe, blocks, ln_f
  CHECK(expected == 354823168);
  const sc::ModelLayout& m = gpt2_350m();
  CHECK(m.total_numel() == expected);
  REQUIRE(m.tensors.size() == 2 + 12 * L + 2);
  CHECK(m.tensors[0].shape == "50257x1024");
  CHECK(m.tensors[4].name == "h.0.attn.c_attn.weight");
  CHECK(m.tensors[4].shape == "1024x3072");
  CHECK(m.tensors[2 + 12 * 23 + 10].name == "h.23.mlp.c_proj.weight");
  CHECK(m.tensors[2 + 12 * 23 + 10].shape == "4096x1024");
  CHECK(m.tensors.back().name == "ln_f.bias");
}

TEST_CASE("the tensor list loader rejects malformed lines, naming the line") {
  const auto path = std::filesystem::temp_directory_path() / "tandem_scaling_bad_list.tsv";
  {
    std::ofstream out(path);
    out << "# comment\nok\t6\t2x3\nbad\t7\t2x3\n";
  }
  CHECK_THROWS_WITH_AS(sc::load_tensor_list(path.string(), "bad"), doctest::Contains(":3:"), tandem::error);
  {
    std::ofstream out(path);
    out << "two\tfields\n";
  }
  CHECK_THROWS_WITH_AS(sc::load_tensor_list(path.string(), "bad"), doctest::Contains("three tab-separated"),
                       tandem::error);
  // Sizes past 2^64 are refused, not wrapped: 2^32 x 2^32 wraps to 0, which would equal the numel 0.
  for (const char* line :
       {"big\t99999999999999999999\t1\n", "wraps\t0\t4294967296x4294967296\n", "long\t1\t99999999999999999999\n"}) {
    CAPTURE(line);
    {
      std::ofstream out(path);
      out << line;
    }
    CHECK_THROWS_WITH_AS(sc::load_tensor_list(path.string(), "bad"), doctest::Contains("2^64"), tandem::error);
  }
  {
    std::ofstream out(path);
    out << "empty\t0\t4294967296x4294967296x0\n";  // a 0 dimension: 0 elements, however large the others
  }
  CHECK(sc::load_tensor_list(path.string(), "empty").tensors.at(0).numel == 0);
  std::filesystem::remove(path);
  CHECK_THROWS_AS(sc::load_tensor_list(path.string(), "missing"), tandem::error);
}

TEST_CASE("the model's plan is tandem's default: 25 MiB / 1 MiB caps, 16 B and 128 B alignment") {
  for (const sc::ModelLayout* model : {&gpt2_124m(), &gpt2_350m()})
    for (int n : {1, 3, 8, 64})
      for (tandem::DType dtype : {tandem::DType::bf16, tandem::DType::fp32}) {
        CAPTURE(model->name);
        CAPTURE(n);
        const tandem::Plan plan = sc::plan_of(*model, n, dtype);
        const tandem::Plan hand = hand_plan(*model, n, tandem::dtype_size(dtype));
        REQUIRE(plan.num_buckets() == hand.num_buckets());
        CHECK(plan.num_buckets() > 1);  // the 1 MiB first bucket at least splits off
        CHECK(plan.total_size() == hand.total_size());
        CHECK(plan.total_shard_size() == hand.total_shard_size());
        for (std::size_t b = 0; b < plan.num_buckets(); ++b) {
          CHECK(plan.buckets()[b].tensors == hand.buckets()[b].tensors);
          CHECK(plan.buckets()[b].size == hand.buckets()[b].size);
        }
      }
}

TEST_CASE("runtime policy traits map to tandem's policy types; optimizer states to tandem's optimizers") {
  for (const sc::PolicyTraits& policy : sc::policies) {
    CAPTURE(std::string(policy.name));
    const sc::PolicyTraits mapped = sc::with_policy(policy, []<tandem::Policy P>() { return sc::traits_of<P>(); });
    CHECK(std::string(mapped.name) == policy.name);
    CHECK(mapped.state == policy.state);
    CHECK(mapped.reduction == policy.reduction);
  }
  const auto name = [](const sc::PolicyTraits& p) {
    return sc::with_policy(p, []<tandem::Policy P>() { return std::string(P::name); });
  };
  sc::PolicyTraits copy = sc::policies[2];
  std::string spelled = copy.name;  // equal by content, not by pointer
  copy.name = spelled.c_str();
  CHECK(name(copy) == "GradientSharded");
  CHECK_THROWS_WITH_AS(name({"FullySharded", tandem::StateSharding::sharded, tandem::GradientReduction::at_boundary}),
                       doctest::Contains("FullySharded"), tandem::error);
  // A known name with another policy's traits is no policy either.
  CHECK_THROWS_AS(name({"Replicated", tandem::StateSharding::sharded, tandem::GradientReduction::at_boundary}),
                  tandem::error);

  const auto optimizer = [](std::size_t k) {
    return sc::with_optimizer(k, []<tandem::Optimizer Opt>(const typename Opt::Options& o) {
      return std::string(Opt::name) + "/" + std::to_string(Opt::state_count(o));
    });
  };
  CHECK(optimizer(2) == "AdamW/2");
  CHECK(optimizer(1) == "SGD/1");
  CHECK(optimizer(0) == "SGD/0");
  CHECK_THROWS_WITH_AS(optimizer(3), doctest::Contains("optimizer_states"), tandem::error);
  sc::Inputs in;
  in.optimizer_states = 3;
  CHECK_THROWS_WITH_AS(sc::validate(in), doctest::Contains("optimizer_states"), tandem::error);
}

TEST_CASE("memory at world 1 is the sum of docs/design.md's terms") {
  for (const sc::ModelLayout* model : {&gpt2_124m(), &gpt2_350m()}) {
    CAPTURE(model->name);
    const double psi = static_cast<double>(model->total_numel());
    for (std::size_t p : {std::size_t{2}, std::size_t{4}}) {
      CAPTURE(p);
      const tandem::Plan plan = hand_plan(*model, 1, p);
      const double F = static_cast<double>(plan.total_size()), M = static_cast<double>(plan.max_bucket_size());
      CHECK(F >= psi);
      CHECK(F - psi < static_cast<double>(plan.num_buckets() * (model->tensors.size() * 16 / p + 128 / p)));
      CHECK(plan.total_shard_size() == plan.total_size());  // one rank holds every shard

      sc::Inputs in;
      in.param_dtype = p == 2 ? tandem::DType::bf16 : tandem::DType::fp32;
      const double master = p == 2 ? 4 * F : 0.0;
      // Replicated: psi p + psi p + master + 4*2*F + (pF + 4F).
      const tandem::MemoryReport r = sc::predict(*model, replicated, 1, in).memory;
      CHECK(r.params == psi * p);
      CHECK(r.grads == psi * p);
      CHECK(r.master_weights == master);
      CHECK(r.optimizer_state == 8 * F);
      CHECK(r.buckets == p * F + 4 * F);
      // CudaBackend's pack tables: for the parameters and the gradients, a 16-byte item per 512 elements of each
      // tensor and a 24-byte record per tensor.
      double tables = 0;
      for (const std::size_t n : model->numels()) tables += 2 * (16.0 * static_cast<double>((n + 511) / 512) + 24);
      CHECK(r.pack_tables == tables);
      CHECK(r.total() == doctest::Approx(2 * psi * p + master + 8 * F + p * F + 4 * F + tables).epsilon(1e-15));
      // Sharded state at world 1: S = F; GradientSharded's buckets are staging (pF) + one bucket + the accumulator.
      const tandem::MemoryReport z1 = sc::predict(*model, optimizer_sharded, 1, in).memory;
      CHECK(z1.total() == r.total());
      const tandem::MemoryReport z2 = sc::predict(*model, gradient_sharded, 1, in).memory;
      CHECK(z2.buckets == p * F + 4 * M + 4 * F);
      CHECK(z2.total() ==
            doctest::Approx(2 * psi * p + master + 8 * F + p * F + 4 * M + 4 * F + tables).epsilon(1e-15));
    }
  }
}

TEST_CASE("sharded master weights and optimizer state shrink as 1/N (within padding); replicated ones do not") {
  for (const sc::ModelLayout* model : {&gpt2_124m(), &gpt2_350m()}) {
    CAPTURE(model->name);
    const sc::Inputs in;  // bf16 parameters: 64-element shard alignment
    const double one = sc::predict(*model, optimizer_sharded, 1, in).memory.optimizer_state;
    const double buckets = static_cast<double>(hand_plan(*model, 1, 2).num_buckets());
    for (int n : worlds) {
      CAPTURE(n);
      for (const sc::PolicyTraits* policy : {&optimizer_sharded, &gradient_sharded}) {
        const tandem::MemoryReport m = sc::predict(*model, *policy, n, in).memory;
        // 4 bytes x 2 states per element; each bucket pads by less than n x 64 elements.
        CHECK(m.optimizer_state * n >= one);
        CHECK(m.optimizer_state * n < one + 8.0 * buckets * n * 64);
        CHECK(m.master_weights * 2 == m.optimizer_state);
      }
      const tandem::MemoryReport r = sc::predict(*model, replicated, n, in).memory;
      CHECK(r.optimizer_state >= one);
      CHECK(r.optimizer_state < one + 8.0 * buckets * n * 64);
      // GradientSharded keeps one staging bucket (4M) and a shard accumulator (4S) instead of ZeRO-1's 4F.
      const tandem::Plan plan = hand_plan(*model, n, 2);
      const double F = static_cast<double>(plan.total_size()), S = static_cast<double>(plan.total_shard_size()),
                   M = static_cast<double>(plan.max_bucket_size());
      CHECK(sc::predict(*model, gradient_sharded, n, in).memory.buckets == 2 * F + 4 * M + 4 * S);
      CHECK(sc::predict(*model, optimizer_sharded, n, in).memory.buckets == 2 * F + 4 * F);
    }
  }
}

TEST_CASE("optimizer state is 4kF replicated and 4kS sharded for k = 0, 1, 2; nothing else depends on k") {
  const sc::ModelLayout& model = gpt2_350m();
  for (int n : {1, 8, 64}) {
    CAPTURE(n);
    const tandem::Plan plan = hand_plan(model, n, 2);
    const double F = static_cast<double>(plan.total_size()), S = static_cast<double>(plan.total_shard_size());
    sc::Inputs adamw;
    for (std::size_t k : {std::size_t{0}, std::size_t{1}, std::size_t{2}}) {
      CAPTURE(k);
      sc::Inputs in;
      in.optimizer_states = k;
      for (const sc::PolicyTraits& policy : sc::policies) {
        CAPTURE(std::string(policy.name));
        const double owned = policy.state == tandem::StateSharding::sharded ? S : F;
        const tandem::MemoryReport m = sc::predict(model, policy, n, in).memory;
        const tandem::MemoryReport a = sc::predict(model, policy, n, adamw).memory;
        CHECK(m.optimizer_state == 4 * static_cast<double>(k) * owned);
        CHECK(m.master_weights == 4 * owned);
        CHECK(m.total() - m.optimizer_state == a.total() - a.optimizer_state);
      }
    }
  }
}

TEST_CASE("collective times are nccl-tests' bus-bandwidth formulas (hand values for n = 2, 8, 64)") {
  sc::Inputs in;
  in.busbw_intra = 300e9;
  in.busbw_inter = 50e9;
  in.gpus_per_node = 8;
  const double S = 1e8;
  // all-reduce: S * 2(n-1)/n / busbw
  CHECK(sc::all_reduce_time(S, 2, in) == doctest::Approx(3.333333333e-4).epsilon(1e-9));  // 1e8 * 1 / 300e9
  CHECK(sc::all_reduce_time(S, 8, in) == doctest::Approx(5.833333333e-4).epsilon(1e-9));  // 1e8 * 1.75 / 300e9
  CHECK(sc::all_reduce_time(S, 64, in) == doctest::Approx(3.9375e-3).epsilon(1e-12));     // 1e8 * 1.96875 / 50e9
  // reduce-scatter and all-gather: S * (n-1)/n / busbw, S the whole array
  CHECK(sc::reduce_scatter_time(S, 2, in) == doctest::Approx(1.666666667e-4).epsilon(1e-9));  // 1e8 * 0.5 / 300e9
  CHECK(sc::reduce_scatter_time(S, 8, in) == doctest::Approx(2.916666667e-4).epsilon(1e-9));  // 1e8 * 0.875 / 300e9
  CHECK(sc::reduce_scatter_time(S, 64, in) == doctest::Approx(1.96875e-3).epsilon(1e-12));    // 1e8 * 0.984375 / 50e9
  CHECK(sc::all_gather_time(S, 64, in) == doctest::Approx(1.96875e-3).epsilon(1e-12));
  CHECK(sc::all_reduce_time(S, 1, in) == 0.0);
  CHECK(sc::reduce_scatter_time(S, 1, in) == 0.0);
  in.collective_latency = 1e-5;
  CHECK(sc::all_reduce_time(S, 8, in) == doctest::Approx(5.933333333e-4).epsilon(1e-9));
  CHECK(sc::all_reduce_time(S, 1, in) == 0.0);
}

TEST_CASE("a step's communication is the sum over tandem's buckets (hand values)") {
  sc::Inputs in;
  in.busbw_intra = 300e9;
  in.busbw_inter = 50e9;
  const sc::ModelLayout& model = gpt2_124m();
  {  // Replicated, 8 GPUs: all-reduce of every fp32 bucket = 4F bytes * 2*7/8 / 300e9.
    const double F = static_cast<double>(hand_plan(model, 8, 2).total_size());
    const sc::Prediction r = sc::predict(model, replicated, 8, in);
    CHECK(r.grad_comm == doctest::Approx(4 * F * 1.75 / 300e9).epsilon(1e-12));
    CHECK(r.param_comm == 0.0);
    CHECK(r.exposed(sc::Overlap::off) == doctest::Approx(r.comm()).epsilon(1e-15));
  }
  {  // OptimizerSharded, 64 GPUs: reduce-scatter 4F (fp32) + all-gather 2F (bf16), each * 63/64 / 50e9.
    const double F = static_cast<double>(hand_plan(model, 64, 2).total_size());
    const sc::Prediction r = sc::predict(model, optimizer_sharded, 64, in);
    CHECK(r.grad_comm == doctest::Approx(4 * F * 63 / 64 / 50e9).epsilon(1e-12));
    CHECK(r.param_comm == doctest::Approx(2 * F * 63 / 64 / 50e9).epsilon(1e-12));
  }
  {  // GradientSharded with 3 micro-steps reduce-scatters 3 times; OptimizerSharded once.
    in.accumulation_steps = 3;
    const double F = static_cast<double>(hand_plan(model, 2, 2).total_size());
    CHECK(sc::predict(model, gradient_sharded, 2, in).grad_comm == doctest::Approx(3 * 4 * F * 0.5 / 300e9));
    CHECK(sc::predict(model, optimizer_sharded, 2, in).grad_comm == doctest::Approx(4 * F * 0.5 / 300e9));
  }
}

TEST_CASE("compute and kernel time against hand values") {
  const sc::ModelLayout& model = gpt2_124m();
  const double psi = 124439808.0;
  sc::Inputs in;  // 989.4 TFLOP/s, MFU 0.4, 16384 tokens, kernel bandwidth 0.8 x 3.35 TB/s
  const double F1 = static_cast<double>(hand_plan(model, 1, 2).total_size());
  const sc::Prediction r = sc::predict(model, replicated, 1, in);
  CHECK(r.compute == doctest::Approx(6 * psi * 16384 / (989.4e12 * 0.4)).epsilon(1e-12));
  CHECK(r.compute == doctest::Approx(0.030910).epsilon(1e-4));
  CHECK(r.backward == doctest::Approx(r.compute * 2 / 3).epsilon(1e-12));
  // bf16 AdamW: pack 2 + 4 bytes per parameter, update 4 + 8 + 16 + 2 per bucket element, unpack 2 + 2.
  CHECK(r.bytes.total() == doctest::Approx(6 * psi + 30 * F1 + 4 * psi).epsilon(1e-15));
  CHECK(r.kernels == doctest::Approx((10 * psi + 30 * F1) / (0.8 * 3.35e12)).epsilon(1e-12));

  const tandem::Plan plan4 = hand_plan(model, 4, 2);
  const double F4 = static_cast<double>(plan4.total_size()), S4 = static_cast<double>(plan4.total_shard_size());
  const sc::KernelBytes z2 = sc::predict(model, gradient_sharded, 4, in).bytes;
  CHECK(z2.pack == doctest::Approx(6 * psi + 4 * (F4 - psi)));  // staging gaps are zeroed
  CHECK(z2.accumulate == 0);                                    // the reduce-scatter writes the shard accumulator
  const double S1 = static_cast<double>(hand_plan(model, 1, 2).total_shard_size());
  CHECK(sc::predict(model, gradient_sharded, 1, in).bytes.accumulate == doctest::Approx(8 * S1));  // a copy at 1 rank
  CHECK(z2.optimizer == doctest::Approx(30 * S4));
  CHECK(z2.unpack == doctest::Approx(4 * psi));

  in.accumulation_steps = 3;  // the 2nd and 3rd micro-steps read the bucket they add into
  CHECK(sc::predict(model, replicated, 4, in).bytes.pack == doctest::Approx(3 * 6 * psi + 2 * 4 * psi));
  CHECK(sc::predict(model, replicated, 4, in).compute == doctest::Approx(3 * r.compute));
  const sc::KernelBytes z2_accum = sc::predict(model, gradient_sharded, 4, in).bytes;
  CHECK(z2_accum.pack == doctest::Approx(3 * (6 * psi + 4 * (F4 - psi))));  // a fresh staging bucket every time
  CHECK(z2_accum.accumulate == doctest::Approx(2 * 12 * S4));               // then read-add-write twice
  in.accumulation_steps = 1;
  in.param_dtype = tandem::DType::fp32;  // the master is the parameter: 4 + 8 + 16, no separate write
  const double F1_32 = static_cast<double>(hand_plan(model, 1, 4).total_size());
  CHECK(sc::predict(model, replicated, 1, in).bytes.optimizer == doctest::Approx(28 * F1_32));
  in.kernel_bandwidth = 1e12;  // a measurement replaces the fraction
  CHECK(sc::predict(model, replicated, 1, in).kernels ==
        doctest::Approx(sc::predict(model, replicated, 1, in).bytes.total() / 1e12));
}

TEST_CASE("the overlap pipeline, simulated by hand") {
  // ready 0.2: runs 0.2-0.3; ready 0.5: runs 0.5-1.1; ready 1.0 but waits for the previous: 1.1-1.4.
  CHECK(sc::exposed_after({0.2, 0.5, 1.0}, {0.1, 0.6, 0.3}, 1.0) == doctest::Approx(0.4));
  CHECK(sc::exposed_after({0.0, 0.0}, {0.3, 0.3}, 1.0) == 0.0);
  CHECK(sc::exposed_after({0.0, 0.0}, {0.3, 0.3}, 0.0) == doctest::Approx(0.6));
  CHECK(sc::exposed_after({}, {}, 1.0) == 0.0);
  CHECK_THROWS_AS(sc::exposed_after({0.0}, {}, 1.0), tandem::error);
}

TEST_CASE("overlap never slows a step, never hides more than the backward, never hides the last bucket") {
  sc::Inputs fast, slow, accumulating;
  slow.busbw_intra = 20e9;  // communication far longer than the backward
  slow.busbw_inter = 5e9;
  slow.collective_latency = 20e-6;
  accumulating.accumulation_steps = 3;
  for (const sc::Inputs* in : {&fast, &slow, &accumulating})
    for (const sc::ModelLayout* model : {&gpt2_124m(), &gpt2_350m()})
      for (const sc::PolicyTraits& policy : sc::policies)
        for (int n : worlds) {
          CAPTURE(model->name);
          CAPTURE(std::string(policy.name));
          CAPTURE(n);
          const sc::Prediction r = sc::predict(*model, policy, n, *in);
          CHECK(r.step(sc::Overlap::on) <= r.step(sc::Overlap::off));
          const double hidden = r.exposed(sc::Overlap::off) - r.exposed(sc::Overlap::on);
          const int windows =
              policy.reduction == tandem::GradientReduction::every_micro_step ? in->accumulation_steps : 1;
          CHECK(hidden >= 0.0);
          CHECK(hidden <= windows * r.backward * (1 + 1e-12));
          // The all-gather after the optimizer is exposed either way; so is the last bucket, wte's, which backward
          // finishes last: at least its fp32 gradients' collective (its bucket is never smaller than wte).
          const double wte_bytes = 4.0 * static_cast<double>(model->tensors[0].numel);
          const double last = policy.state == tandem::StateSharding::sharded
                                  ? sc::reduce_scatter_time(wte_bytes, n, *in)
                                  : sc::all_reduce_time(wte_bytes, n, *in);
          CHECK(r.exposed(sc::Overlap::on) >= r.param_comm + windows * last * (1 - 1e-12));
          CHECK(r.efficiency(sc::Overlap::on) >= r.efficiency(sc::Overlap::off));
        }
}

TEST_CASE("world 1 has no communication") {
  for (const sc::ModelLayout* model : {&gpt2_124m(), &gpt2_350m()})
    for (const sc::PolicyTraits& policy : sc::policies) {
      CAPTURE(std::string(policy.name));
      const sc::Prediction r = sc::predict(*model, policy, 1, sc::Inputs{});
      CHECK(r.grad_comm == 0.0);
      CHECK(r.param_comm == 0.0);
      CHECK(r.exposed(sc::Overlap::off) == 0.0);
      CHECK(r.exposed(sc::Overlap::on) == 0.0);
      CHECK(r.step(sc::Overlap::on) == r.step(sc::Overlap::off));
      CHECK(r.efficiency(sc::Overlap::off) == 1.0);
    }
}

TEST_CASE("bad inputs are rejected with the field's name") {
  sc::Inputs in;
  in.mfu = 1.5;
  CHECK_THROWS_WITH_AS(sc::validate(in), doctest::Contains("mfu"), tandem::error);
  in = {};
  in.busbw_inter = 0;
  CHECK_THROWS_WITH_AS(sc::validate(in), doctest::Contains("busbw_inter"), tandem::error);
  in = {};
  in.accumulation_steps = 0;
  CHECK_THROWS_WITH_AS(sc::validate(in), doctest::Contains("accumulation_steps"), tandem::error);
  CHECK_THROWS_AS(sc::predict(gpt2_124m(), replicated, 0, sc::Inputs{}), tandem::error);
  CHECK_THROWS_AS(sc::gpt2_layout({.layers = 2, .width = 10, .heads = 3}, "bad"), tandem::error);
  // A measured kernel bandwidth that is not a number or negative is refused, not replaced by the fraction; the
  // fraction of HBM is at most 1; the latency is finite.
  for (double bw : {-1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    in = {};
    in.kernel_bandwidth = bw;
    CHECK_THROWS_WITH_AS(sc::validate(in), doctest::Contains("kernel_bandwidth must be finite and >= 0"),
                         tandem::error);
  }
  in = {};
  in.kernel_bandwidth_fraction = 5;
  CHECK_THROWS_WITH_AS(sc::validate(in), doctest::Contains("must be in (0, 1]"), tandem::error);
  in.kernel_bandwidth = 2e12;  // measured: the fraction is not used
  CHECK_NOTHROW(sc::validate(in));
  in = {};
  in.collective_latency = std::numeric_limits<double>::infinity();
  CHECK_THROWS_WITH_AS(sc::validate(in), doctest::Contains("collective_latency must be finite"), tandem::error);
  // Inputs each in range whose step overflows, and a layout of no parameters: refused, not a table of inf and NaN.
  in = {};
  in.tokens_per_gpu = 1e308;
  CHECK_THROWS_WITH_AS(sc::predict(gpt2_124m(), replicated, 8, in), doctest::Contains("out of the model's range"),
                       tandem::error);
  const sc::ModelLayout empty{"empty", {{"a", 0, "0"}}};
  CHECK_THROWS_WITH_AS(sc::predict(empty, replicated, 2, sc::Inputs{}), doctest::Contains("has no parameters"),
                       tandem::error);
}
