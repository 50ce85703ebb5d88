// SPDX-License-Identifier: Apache-2.0
// A sharded checkpoint of the GPT-2-124M tensor list (148 tensors, 124,439,808 fp32 parameters, AdamW: 1.5 GB) saved
// at 4 ranks under GradientSharded, after steps on synthetic gradients (so that every array holds values): loaded at
// 1, 2 and 3 ranks under every policy and saved again there, its state is bitwise the saved one (checkpoint_digest:
// the CRC-32C of every array of every tensor, whatever files hold it); and continuing from it at 4 ranks equals an
// uninterrupted run bit for bit. Owned storage, ranks as threads. Not built for the sanitizers' runs (its size).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

#include "../benchmarks/scaling/scaling_model.hpp"
#include "support/temp_path.hpp"
#include "tandem/tandem.hpp"

namespace {

std::vector<tandem::TensorSpec> gpt2() {
  std::vector<tandem::TensorSpec> specs;
  for (const auto& t : tandem::scaling::load_tensor_list(TANDEM_TEST_DATA_DIR "/gpt2_124m.tsv", "gpt2").tensors)
    specs.push_back({t.name, t.numel, tandem::DType::fp32});
  return specs;
}

// A value of element e of tensor i at step s on rank r, small and different everywhere.
float synthetic(std::size_t i, std::size_t e, int s, int r) {
  return 1e-3f *
             static_cast<float>(
                 (i * 7919 + e * 31 + static_cast<std::size_t>(s) * 131 + static_cast<std::size_t>(r) * 17) % 2003) -
         1.0f;
}

// Owned storage under P at comm's size: initial parameters, `steps` steps on synthetic gradients (or, from `resume`,
// the checkpoint's state and the steps after it), then a save to `save` if given. Returns a digest of rank 0's
// parameters as the model reads them (parameters(b)).
template <class P>
std::uint32_t run(tandem::LocalComm& comm, int first, int steps, const std::string& resume, const std::string& save) {
  const std::vector<tandem::TensorSpec> specs = gpt2();
  tandem::DataParallel<P, tandem::AdamW> dp(comm, specs, {.lr = 1e-3f});
  dp.template initialize_parameters<float>([&](std::size_t i, float* v) {
    for (std::size_t e = 0; e < specs[i].numel; ++e) v[e] = synthetic(i, e, -1, 0);
  });
  if (!resume.empty()) dp.load_checkpoint(resume);
  for (int s = first; s < steps; ++s) {
    for (std::size_t b = 0; b < dp.num_buckets(); ++b) {
      auto grads = dp.gradients(b);
      for (std::size_t i : grads.tensors())
        for (std::size_t e = 0; e < specs[i].numel; ++e) grads.grad(i)[e] += synthetic(i, e, s, comm.rank());
    }
    dp.step();
  }
  if (!save.empty()) dp.save_checkpoint(save);
  std::uint32_t digest = 0;
  for (std::size_t b = 0; b < dp.num_buckets(); ++b) {
    auto params = dp.parameters(b);
    for (std::size_t i : params.tensors())
      digest = tandem::detail::crc32c(params.template param<float>(i), specs[i].numel * sizeof(float), digest);
  }
  return digest;
}

template <class P>
std::uint32_t run_group(int world, int first, int steps, const std::string& resume, const std::string& save) {
  std::uint32_t digest = 0;
  std::mutex m;
  tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
    const std::uint32_t d = run<P>(comm, first, steps, resume, save);
    std::lock_guard lock(m);
    if (comm.rank() == 0) digest = d;
  });
  return digest;
}

template <class Q>
void reload_everywhere(const std::string& saved, std::uint32_t state, const std::string& scratch) {
  for (int world = 1; world <= 3; ++world) {
    CAPTURE(world);
    CAPTURE(Q::name);
    std::filesystem::remove_all(scratch);
    run_group<Q>(world, 2, 2, saved, scratch);  // load, save again, nothing in between
    CHECK(tandem::checkpoint_digest(scratch) == state);
  }
}

}  // namespace

TEST_CASE("a GPT-2-124M checkpoint saved at 4 ranks reloads bit for bit at 1-3 under every policy, and resumes") {
  const std::string saved = test::temp_path("gpt2_saved"), scratch = test::temp_path("gpt2_scratch");
  const std::uint32_t at_two = run_group<tandem::GradientSharded>(4, 0, 2, "", saved);
  const std::uint32_t state = tandem::checkpoint_digest(saved);
  reload_everywhere<tandem::Replicated>(saved, state, scratch);
  reload_everywhere<tandem::OptimizerSharded>(saved, state, scratch);
  reload_everywhere<tandem::GradientSharded>(saved, state, scratch);
  reload_everywhere<tandem::ParameterSharded>(saved, state, scratch);
  // Its parameters are the run's; continuing at 4 ranks equals the run that never stopped.
  CHECK(run_group<tandem::GradientSharded>(4, 2, 2, saved, "") == at_two);
  CHECK(run_group<tandem::GradientSharded>(4, 2, 3, saved, "") == run_group<tandem::GradientSharded>(4, 0, 3, "", ""));
  std::filesystem::remove_all(saved);
  std::filesystem::remove_all(scratch);
}
