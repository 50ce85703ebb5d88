// SPDX-License-Identifier: Apache-2.0
// scaling_model: prints docs/scaling.md's tables. For GPT-2 124M (read from its tensor list) and GPT-2 350M
// (generated), each policy and world sizes 1-64: predicted step time, exposed communication with and without
// overlap, scaling efficiency, and memory per GPU. An analytical model (scaling_model.hpp); no GPU needed.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <string>
#include <vector>

#include "scaling_model.hpp"

#ifndef TANDEM_DATA_DIR
#define TANDEM_DATA_DIR "tests/data"
#endif

namespace {

namespace sc = tandem::scaling;

constexpr int worlds[] = {1, 2, 4, 8, 16, 32, 64};

const char* usage =
    "usage: scaling_model [options]\n"
    "  --tsv PATH             GPT-2 124M tensor list (default " TANDEM_DATA_DIR
    "/gpt2_124m.tsv)\n"
    "  --gpu h100|h200        published HBM bandwidth of the GPU: 3.35 or 4.8 TB/s (default h100)\n"
    "  --kernel-bw GB/s       measured bandwidth of tandem's kernels, > 0 (default: fraction x HBM)\n"
    "  --kernel-bw-fraction F kernel bandwidth as a fraction of HBM when not measured, in (0, 1] (default 0.8)\n"
    "  --busbw-intra GB/s     nccl-tests bus bandwidth within a node, > 0 (default 370)\n"
    "  --busbw-inter GB/s     nccl-tests bus bandwidth across nodes, > 0 (default 368)\n"
    "  --gpus-per-node N      worlds up to N use the intra-node bandwidth, a whole number >= 1 (default 8)\n"
    "  --latency-us X         fixed cost per collective call, microseconds, >= 0 (default 0)\n"
    "  --mfu F                model FLOPs utilization, in (0, 1] (default 0.4)\n"
    "  --peak-tflops X        bf16 dense peak, > 0 (default 989.4)\n"
    "  --tokens N             tokens per GPU per micro-step, > 0 (default 16384)\n"
    "  --accum K              micro-steps per optimizer step, a whole number >= 1 (default 1)\n";

[[noreturn]] void die(const std::string& message) {
  std::fprintf(stderr, "scaling_model: %s\n%s", message.c_str(), usage);
  std::exit(2);
}

/// The finite number `text`, or die naming `flag`.
double number(const std::string& flag, const char* text) {
  char* end = nullptr;
  const double v = std::strtod(text, &end);
  if (end == text || *end != '\0' || !std::isfinite(v)) die(flag + " expects a finite number, got '" + text + "'");
  return v;
}

double positive(const std::string& flag, const char* text) {
  const double v = number(flag, text);
  if (!(v > 0.0)) die(flag + " expects a number > 0, got '" + std::string(text) + "'");
  return v;
}

double non_negative(const std::string& flag, const char* text) {
  const double v = number(flag, text);
  if (!(v >= 0.0)) die(flag + " expects a number >= 0, got '" + std::string(text) + "'");
  return v;
}

double fraction(const std::string& flag, const char* text) {
  const double v = number(flag, text);
  if (!(v > 0.0 && v <= 1.0)) die(flag + " expects a fraction in (0, 1], got '" + std::string(text) + "'");
  return v;
}

/// A whole number from 1 to INT_MAX (checked before the conversion: a double beyond int's range does not convert).
int count(const std::string& flag, const char* text) {
  const double v = number(flag, text);
  if (!(v >= 1.0 && v <= double(std::numeric_limits<int>::max()) && v == std::floor(v)))
    die(flag + " expects a whole number from 1 to " + std::to_string(std::numeric_limits<int>::max()) + ", got '" +
        text + "'");
  return static_cast<int>(v);
}

double ms(double seconds) { return seconds * 1e3; }
double mib(double bytes) { return bytes / (1024.0 * 1024.0); }

void print_inputs(const sc::Inputs& in, const std::string& gpu) {
  std::printf(
      "Inputs: %s, peak %.1f TFLOP/s bf16 dense, MFU %.2f, backward %.0f%% of compute; kernel bandwidth %.0f GB/s",
      gpu.c_str(), in.peak_flops / 1e12, in.mfu, in.backward_share * 100.0, in.kernel_bw() / 1e9);
  if (in.kernel_bandwidth > 0.0)
    std::printf(" (measured)");
  else
    std::printf(" (%.2f x %.2f TB/s HBM, not measured)", in.kernel_bandwidth_fraction, in.hbm_bandwidth / 1e12);
  std::printf(
      "; busbw %.0f GB/s within %d GPUs, %.0f GB/s beyond; %.0f us per collective; %.0f tokens per GPU per "
      "micro-step, %d micro-step(s) per step; AdamW.\n\n",
      in.busbw_intra / 1e9, in.gpus_per_node, in.busbw_inter / 1e9, in.collective_latency * 1e6, in.tokens_per_gpu,
      in.accumulation_steps);
}

void print_time_table(const sc::ModelLayout& model, const sc::Inputs& in) {
  std::printf("### %s: time per optimizer step (bf16 parameters, ms)\n\n", model.name.c_str());
  std::printf(
      "| GPUs | policy | buckets | compute | kernels | comm | exposed, no overlap | step, no overlap | efficiency, no "
      "overlap | exposed, overlap | step, overlap | efficiency, overlap |\n");
  std::printf("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const sc::PolicyTraits& policy : sc::policies)
    for (int world : worlds) {
      const sc::Prediction r = sc::predict(model, policy, world, in);
      std::printf("| %d | %s | %zu | %.2f | %.2f | %.2f | %.2f | %.2f | %.1f%% | %.2f | %.2f | %.1f%% |\n", world,
                  policy.name, r.buckets, ms(r.compute), ms(r.kernels), ms(r.comm()), ms(r.exposed(sc::Overlap::off)),
                  ms(r.step(sc::Overlap::off)), 100.0 * r.efficiency(sc::Overlap::off), ms(r.exposed(sc::Overlap::on)),
                  ms(r.step(sc::Overlap::on)), 100.0 * r.efficiency(sc::Overlap::on));
    }
  std::printf("\n");
}

void print_memory_table(const sc::ModelLayout& model, sc::Inputs in, tandem::DType dtype) {
  in.param_dtype = dtype;
  const bool fp32 = dtype == tandem::DType::fp32;
  std::printf("### %s: memory per GPU, %s (MiB)\n\n", model.name.c_str(),
              fp32 ? "fp32 parameters (no master copy), AdamW" : "bf16 parameters, fp32 master weights, AdamW");
  std::printf(
      "| GPUs | policy | params | grads | master weights | optimizer state | buckets | pack tables | total |\n");
  std::printf("|---:|---|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const sc::PolicyTraits& policy : sc::policies)
    for (int world : worlds) {
      const tandem::MemoryReport m = sc::predict(model, policy, world, in).memory;
      std::printf("| %d | %s | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f |\n", world, policy.name, mib(m.params),
                  mib(m.grads), mib(m.master_weights), mib(m.optimizer_state), mib(m.buckets), mib(m.pack_tables),
                  mib(m.total()));
    }
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  sc::Inputs in;
  std::string tsv = TANDEM_DATA_DIR "/gpt2_124m.tsv", gpu = "H100 SXM";
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::printf("%s", usage);
      return 0;
    }
    if (i + 1 >= argc) die("unknown flag or missing value: " + flag);
    const char* value = argv[++i];
    if (flag == "--tsv") {
      tsv = value;
    } else if (flag == "--gpu") {
      const std::string g = value;
      if (g == "h100") {
        in.hbm_bandwidth = 3.35e12;
        gpu = "H100 SXM";
      } else if (g == "h200") {
        in.hbm_bandwidth = 4.8e12;
        gpu = "H200 SXM";
      } else {
        die("--gpu expects h100 or h200, got '" + g + "'");
      }
    } else if (flag == "--kernel-bw") {
      in.kernel_bandwidth = positive(flag, value) * 1e9;
    } else if (flag == "--kernel-bw-fraction") {
      in.kernel_bandwidth_fraction = fraction(flag, value);
    } else if (flag == "--busbw-intra") {
      in.busbw_intra = positive(flag, value) * 1e9;
    } else if (flag == "--busbw-inter") {
      in.busbw_inter = positive(flag, value) * 1e9;
    } else if (flag == "--gpus-per-node") {
      in.gpus_per_node = count(flag, value);
    } else if (flag == "--latency-us") {
      in.collective_latency = non_negative(flag, value) * 1e-6;
    } else if (flag == "--mfu") {
      in.mfu = fraction(flag, value);
    } else if (flag == "--peak-tflops") {
      in.peak_flops = positive(flag, value) * 1e12;
    } else if (flag == "--tokens") {
      in.tokens_per_gpu = positive(flag, value);
    } else if (flag == "--accum") {
      in.accumulation_steps = count(flag, value);
    } else {
      die("unknown flag: " + flag);
    }
  }
  try {
    sc::validate(in);
    const std::vector<sc::ModelLayout> models = {sc::load_tensor_list(tsv, "GPT-2 124M"),
                                                 sc::gpt2_layout(sc::gpt2_350m, "GPT-2 350M")};
    // Every prediction once before any table is printed: inputs the model cannot compute with fail with no half table.
    for (const sc::ModelLayout& model : models)
      for (const sc::PolicyTraits& policy : sc::policies)
        for (int world : worlds)
          for (tandem::DType dtype : {tandem::DType::bf16, tandem::DType::fp32}) {
            sc::Inputs with = in;
            with.param_dtype = dtype;
            (void)sc::predict(model, policy, world, with);
          }
    print_inputs(in, gpu);
    for (const sc::ModelLayout& model : models) {
      std::printf("## %s (%zu tensors, %zu parameters)\n\n", model.name.c_str(), model.tensors.size(),
                  model.total_numel());
      print_time_table(model, in);
      print_memory_table(model, in, tandem::DType::bf16);
      print_memory_table(model, in, tandem::DType::fp32);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "scaling_model: %s\n", e.what());
    return 1;
  }
  return 0;
}
