// SPDX-License-Identifier: Apache-2.0
// The tandem side of ctest torch_optimizers (check_torch_optimizers.py, which runs this and PyTorch): two ranks train
// four tensors with AdamW, and again with SGD (momentum, Nesterov in one group, dampening in the other), with two
// optimizer groups (the biases with other options), an lr schedule and the gradients averaged over the ranks (AdamW's
// clipped to a global norm of 1, SGD's not: clipping would hide their scale), and save a checkpoint at step 5 and at
// step 10, each consolidated with every array (parameters and optimizer state). They do so with the user's buffers
// under Replicated, OptimizerSharded and GradientSharded, and with tandem's own storage (parameters read and gradients
// written by bucket) under those and ParameterSharded. PyTorch trains the same problem with torch.optim.AdamW and
// torch.optim.SGD, and resumes from each step-5 file; both must end where tandem did.
//
//   optimizer_runs OUT   writes OUT/<optimizer>/<run>/step5.safetensors and .../step10.safetensors and their
//                        checkpoints, the runs named <policy> (the user's buffers) and <policy>-owned
//
// Every value both sides compute from the problem is an IEEE float32 operation on the same operands, in the same
// order (the script writes the same formulas in NumPy), so the two sides differ only by what their optimizers do.
#include <cstdio>
#include <exception>
#include <string>
#include <type_traits>
#include <vector>

#include "tandem/tandem.hpp"

namespace {

constexpr int world = 2;
constexpr int steps = 10, save_at = 5;

struct Tensor {
  const char* name;
  std::size_t numel;
  std::size_t group;  ///< the optimizer group: 1 for the biases
};
const std::vector<Tensor> tensors = {
    {"embed.weight", 700, 0}, {"block.bias", 37, 1}, {"head.weight", 515, 0}, {"head.bias", 9, 1}};

/// The initial parameter and the target of element i of tensor k.
float initial(std::size_t k, std::size_t i) {
  return 0.01f * static_cast<float>(static_cast<int>((i + 13 * k) % 97) - 48);
}
float target(std::size_t k, std::size_t i) { return 0.5f - 0.002f * static_cast<float>((i + 7 * k) % 89); }

/// Rank r's gradient of element i of tensor k at step t (1-based), from its parameter w.
float gradient(std::size_t k, std::size_t i, int r, int t, float w) {
  const float scale = 1.0f + 0.5f * static_cast<float>(r);
  const auto noise =
      static_cast<float>(static_cast<int>((i * 7 + k * 5 + static_cast<std::size_t>(r * 3 + t)) % 11) - 5) * 0.01f;
  return (w - target(k, i)) * scale + noise;
}

/// The learning rates of step t (1-based): each group's decays linearly.
float lr(std::size_t group, int t) {
  const float base = group == 0 ? 1e-2f : 3e-2f;
  return base * (1.0f - 0.05f * static_cast<float>(t));
}

/// The two optimizer groups' options at step 1: construction takes group 0's, set_optimizer_groups both.
std::vector<tandem::AdamWOptions> groups_of(tandem::AdamW) {
  const tandem::AdamWOptions decayed{.lr = lr(0, 1), .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-8f, .weight_decay = 0.1f};
  return {decayed, {.lr = lr(1, 1), .beta1 = 0.8f, .beta2 = 0.995f, .eps = 1e-6f, .weight_decay = 0.0f}};
}
std::vector<tandem::SGDOptions> groups_of(tandem::SGD) {
  return {{.lr = lr(0, 1), .momentum = 0.9f, .weight_decay = 0.01f, .nesterov = tandem::Nesterov::on},
          {.lr = lr(1, 1), .momentum = 0.8f, .dampening = 0.1f}};
}

/// Clipping to a global norm of 1 (every step's gradients scaled by about 0.05), or none.
template <class Opt>
tandem::DataParallelOptions options() {
  return {.bucket_cap_bytes = 1024, .max_grad_norm = std::is_same_v<Opt, tandem::AdamW> ? 1.0f : 0.0f};
}

/// Steps 1 to `steps` on one rank, with `write_gradients` writing the rank's gradients at each (from its parameters);
/// checkpoints of steps 5 and 10 in `dir`, consolidated.
template <class Opt, class DP, class Gradients>
void steps_of(tandem::LocalComm& comm, DP& dp, const std::string& dir, Gradients&& write_gradients) {
  std::vector<std::size_t> group_of;
  for (const Tensor& t : tensors) group_of.push_back(t.group);
  dp.set_optimizer_groups(groups_of(Opt{}), group_of);
  for (int t = 1; t <= steps; ++t) {
    for (std::size_t group = 0; group < 2; ++group) dp.optimizer_options(group).lr = lr(group, t);
    write_gradients(t);
    const tandem::StepResult result = dp.step();
    if (!result.updated) throw tandem::error("optimizer_runs: step " + std::to_string(t) + " did not update");
    if (t == save_at || t == steps) {
      const std::string name = dir + "/step" + std::to_string(t);
      dp.save_checkpoint(name);
      if (comm.rank() == 0) tandem::consolidate_checkpoint(name, name + ".safetensors", tandem::Arrays::all);
    }
  }
}

/// The user's buffers: each rank writes its gradients into them, and reads the parameters step() wrote back.
template <class Policy, class Opt>
void train_user_buffers(const std::string& out) {
  tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
    std::vector<std::vector<float>> w(tensors.size()), g(tensors.size());
    std::vector<tandem::TensorRef> refs;
    for (std::size_t k = 0; k < tensors.size(); ++k) {
      w[k].resize(tensors[k].numel);
      g[k].resize(tensors[k].numel);
      for (std::size_t i = 0; i < w[k].size(); ++i) w[k][i] = initial(k, i);
      refs.push_back({tensors[k].name, w[k].data(), g[k].data(), w[k].size()});
    }
    tandem::DataParallel<Policy, Opt> dp(comm, refs, groups_of(Opt{})[0], options<Opt>());
    dp.broadcast_parameters();
    steps_of<Opt>(comm, dp, out + "/" + Opt::name + "/" + Policy::name, [&](int t) {
      for (std::size_t k = 0; k < tensors.size(); ++k)
        for (std::size_t i = 0; i < w[k].size(); ++i) g[k][i] = gradient(k, i, comm.rank(), t, w[k][i]);
    });
  });
}

/// tandem's storage: the initial parameters given to initialize_parameters, then at each step every bucket's
/// parameters read through parameters(b) and its gradients added through gradients(b), in bucket order.
template <class Policy, class Opt>
void train_owned(const std::string& out) {
  tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
    std::vector<tandem::TensorSpec> specs;
    for (const Tensor& t : tensors) specs.push_back({t.name, t.numel, tandem::DType::fp32});
    tandem::DataParallel<Policy, Opt> dp(comm, specs, groups_of(Opt{})[0], options<Opt>());
    dp.template initialize_parameters<float>([](std::size_t k, float* values) {
      for (std::size_t i = 0; i < tensors[k].numel; ++i) values[i] = initial(k, i);
    });
    std::vector<std::vector<float>> w(tensors.size());
    steps_of<Opt>(comm, dp, out + "/" + Opt::name + "/" + Policy::name + "-owned", [&](int t) {
      for (std::size_t b = 0; b < dp.num_buckets(); ++b) {
        {
          auto params = dp.parameters(b);
          for (std::size_t k : params.tensors()) {
            const float* p = params.template param<float>(k);
            w[k].assign(p, p + tensors[k].numel);
          }
        }
        auto grads = dp.gradients(b);  // zeroed: backward adds into it
        for (std::size_t k : grads.tensors()) {
          float* g = grads.grad(k);
          for (std::size_t i = 0; i < tensors[k].numel; ++i) g[i] += gradient(k, i, comm.rank(), t, w[k][i]);
        }
      }
    });
  });
}

template <class Opt>
void train_all(const std::string& out) {
  train_user_buffers<tandem::Replicated, Opt>(out);
  train_user_buffers<tandem::OptimizerSharded, Opt>(out);
  train_user_buffers<tandem::GradientSharded, Opt>(out);
  train_owned<tandem::Replicated, Opt>(out);
  train_owned<tandem::OptimizerSharded, Opt>(out);
  train_owned<tandem::GradientSharded, Opt>(out);
  train_owned<tandem::ParameterSharded, Opt>(out);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: optimizer_runs OUT\n");
    return 2;
  }
  try {
    train_all<tandem::AdamW>(argv[1]);
    train_all<tandem::SGD>(argv[1]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "optimizer_runs: %s\n", e.what());
    return 1;
  }
  return 0;
}
