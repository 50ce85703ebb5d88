// SPDX-License-Identifier: Apache-2.0
// Bad input is rejected with tandem::error naming the tensor or argument, before anything is written, on
// every rank (also when only one rank is wrong), and nobody hangs: the group runs with a short timeout,
// so a hang would surface as a timeout_error and fail the exception-type checks.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "../examples/mlp/mlp.hpp"
#include "support/backend.hpp"
#include "support/comm.hpp"
#include "tandem/tandem.hpp"

namespace {

using namespace std::chrono_literals;
const std::vector<int> dims = {5, 9, 3};

// Runs `body(comm, refs)` on `world` ranks; returns each rank's exception message ("" if none was thrown)
// and checks that every exception was a tandem::error but not a timeout or peer failure.
template <class F>
std::vector<std::string> run_ranks(int world, F body) {
  std::vector<std::string> messages(static_cast<std::size_t>(world));
  std::mutex m;
  const auto start = std::chrono::steady_clock::now();
  tandem::LocalGroup group(world, {.timeout = 5s});
  group.run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 1);
    std::vector<tandem::TensorRef> refs = model.tensors();
    const std::vector<std::vector<float>> before = model.params();
    const std::vector<std::vector<float>> grads_before = model.grads();
    try {
      body(comm, refs);
    } catch (const tandem::timeout_error& e) {
      FAIL("rank " << comm.rank() << " timed out: " << e.what());
    } catch (const tandem::peer_error& e) {
      FAIL("rank " << comm.rank() << " saw a peer failure: " << e.what());
    } catch (const tandem::error& e) {
      std::lock_guard lock(m);
      messages[static_cast<std::size_t>(comm.rank())] = e.what();
    }
    CHECK(model.params() == before);  // nothing written
    CHECK(model.grads() == grads_before);
  });
  CHECK(std::chrono::steady_clock::now() - start < 5s);
  return messages;
}

template <class P = tandem::Replicated>
void construct(tandem::LocalComm& comm, const std::vector<tandem::TensorRef>& refs,
               tandem::DataParallelOptions options = {}, tandem::AdamWOptions adamw = {}) {
  test::DataParallel<P, tandem::AdamW> dp(comm, refs, adamw, options);
}

}  // namespace

TEST_CASE("a null pointer on one rank: that rank names the tensor, every other rank names that rank") {
  for (int world : {1, 3}) {
    const auto messages = run_ranks(world, [&](tandem::LocalComm& comm, std::vector<tandem::TensorRef>& refs) {
      if (comm.rank() == world - 1) refs[3].param = nullptr;
      construct<tandem::GradientSharded>(comm, refs);
    });
    for (int r = 0; r < world; ++r) {
      CAPTURE(r);
      const std::string& msg = messages[static_cast<std::size_t>(r)];
      CHECK(msg.find("tensor 3 (`layers.1.weight`): param pointer is null") != std::string::npos);
      if (r != world - 1) CHECK(msg.find("rank " + std::to_string(world - 1) + " failed: ") != std::string::npos);
    }
  }
}

TEST_CASE("null grad, oversized numel, mixed dtypes, overlapping buffers, misaligned buffers") {
  using Edit = void (*)(std::vector<tandem::TensorRef>&);
  const std::vector<std::pair<Edit, std::string>> cases = {
      {[](auto& r) { r[0].grad = nullptr; }, "tensor 0 (`input.gain`): grad pointer is null"},
      {[](auto& r) { r[1].numel = std::size_t{1} << 60; }, "tensor 1 (`layers.0.weight`): numel"},
      {[](auto& r) { r[2].dtype = tandem::DType::bf16; }, "tensor 2 (`layers.0.bias`): dtype bf16 differs"},
      {[](auto& r) { r[4].grad = r[3].param; }, "overlaps"},
      {[](auto& r) { r[2].param = static_cast<char*>(r[2].param) + 1; }, "aligned"},
      {[](auto& r) { r[1].dtype = tandem::DType::fp64; }, "fp64 is not supported"},
      {[](auto& r) { r[1].dtype = static_cast<tandem::DType>(9); }, "dtype DType 9 is not supported"},
      {[](auto& r) { r.clear(); }, "no tensors"},
  };
  for (const auto& [edit, want] : cases) {
    CAPTURE(want);
    const auto messages = run_ranks(2, [&](tandem::LocalComm& comm, std::vector<tandem::TensorRef>& refs) {
      if (comm.rank() == 1) edit(refs);
      construct(comm, refs);
    });
    CHECK(messages[1].find(want) != std::string::npos);
    CHECK(messages[0].find("rank 1 failed: ") != std::string::npos);
  }
}

TEST_CASE("a layout that differs between ranks: every rank throws, none hangs") {
  const auto messages = run_ranks(4, [&](tandem::LocalComm& comm, std::vector<tandem::TensorRef>& refs) {
    if (comm.rank() == 2) refs[1].name = "renamed";
    construct<tandem::OptimizerSharded>(comm, refs);
  });
  for (const std::string& msg : messages) CHECK(msg.find("layout differs between ranks") != std::string::npos);

  const auto sizes = run_ranks(2, [&](tandem::LocalComm& comm, std::vector<tandem::TensorRef>& refs) {
    if (comm.rank() == 1) refs[4].numel -= 1;
    construct(comm, refs);
  });
  for (const std::string& msg : sizes) CHECK(msg.find("rank 1 has 5 tensors of 88 elements") != std::string::npos);
}

TEST_CASE("ranks constructed with different options all throw") {
  const auto messages = run_ranks(3, [&](tandem::LocalComm& comm, std::vector<tandem::TensorRef>& refs) {
    construct(comm, refs, {.accumulation_steps = comm.rank() == 1 ? 2 : 1});
  });
  for (const std::string& msg : messages) CHECK(msg.find("constructed DataParallel differently") != std::string::npos);
}

TEST_CASE("optimizer options that differ between ranks: every rank throws") {
  const auto messages = run_ranks(2, [&](tandem::LocalComm& comm, std::vector<tandem::TensorRef>& refs) {
    construct(comm, refs, {}, {.lr = comm.rank() == 0 ? 1e-3f : 2e-3f});
  });
  for (const std::string& msg : messages) CHECK_MESSAGE(msg.find("optimizer or its options") != std::string::npos, msg);
}

TEST_CASE("optimizer options changed between steps are validated; state cannot appear later") {
  const auto momentum = run_ranks(2, [&](tandem::LocalComm& comm, std::vector<tandem::TensorRef>& refs) {
    test::DataParallel<tandem::OptimizerSharded, tandem::SGD> dp(comm, refs, {.lr = 0.1f});
    dp.step();
    dp.optimizer_options().momentum = 0.9f;
    dp.step();
  });
  for (const std::string& msg : momentum) CHECK(msg.find("SGD momentum enabled later") != std::string::npos);
  const auto beta = run_ranks(2, [&](tandem::LocalComm& comm, std::vector<tandem::TensorRef>& refs) {
    test::DataParallel<tandem::Replicated, tandem::AdamW> dp(comm, refs);
    dp.optimizer_options().beta1 = 1.0f;
    dp.step();
  });
  for (const std::string& msg : beta) CHECK(msg.find("AdamWOptions::beta1") != std::string::npos);
}

// An optimizer option changed through optimizer_options() on one rank only: before, the ranks went on with different
// learning rates and silently diverged. The options' fingerprint rides on the step's scalar all-reduce (with the norm
// where there is one); the next step throws on every rank before anything is updated, and once the ranks agree again
// they train on exactly as if the refused step had never been taken. Under StepReport::deferred the step does not
// throw, updates nothing all the same (the device refused it), and the next report (last_step() at two ranks,
// all_ranks_have_batch() at three) throws on every rank.
TEST_CASE_TEMPLATE("an optimizer option changed on one rank only: the next step throws on every rank, updating nothing",
                   P, tandem::Replicated, tandem::OptimizerSharded, tandem::GradientSharded, tandem::ParameterSharded) {
  const std::vector<int> sizes = {13, 37, 29, 7};
  for (int world : {2, 3})
    for (float clip : {0.0f, 1.0f}) {
      std::vector<float> untouched;  // the run without the refused step, compared with the one with it
      for (const auto& [meddle, report] :
           {std::pair{false, tandem::StepReport::at_step}, std::pair{true, tandem::StepReport::at_step},
            std::pair{true, tandem::StepReport::deferred}}) {
        CAPTURE(world);
        CAPTURE(clip);
        CAPTURE(meddle);
        CAPTURE(report);
        std::mutex m;
        std::vector<std::string> messages(static_cast<std::size_t>(world));
        std::vector<std::vector<float>> finals(static_cast<std::size_t>(world));
        tandem::LocalGroup(world, {.timeout = 5s}).run([&](tandem::LocalComm& comm) {
          mlp::Mlp<float> model(sizes, 3);
          std::vector<tandem::TensorSpec> specs;
          for (const tandem::TensorRef& t : model.tensors()) specs.push_back({t.name, t.numel, t.dtype});
          test::DataParallel<P, tandem::AdamW> dp(
              comm, specs, {.lr = 1e-2f}, {.bucket_cap_bytes = 512, .max_grad_norm = clip, .step_report = report});
          dp.template initialize_parameters<float>(
              [&](std::size_t i, float* v) { std::copy(model.params()[i].begin(), model.params()[i].end(), v); });
          auto backward = [&](int step) {
            for (std::size_t b = 0; b < dp.num_buckets(); ++b) {
              auto grads = dp.gradients(b);
              for (std::size_t i : grads.tensors())
                for (std::size_t e = 0; e < specs[i].numel; ++e)
                  grads.grad(i)[e] = 0.01f * static_cast<float>((e % 5) + i + comm.rank() + step) - 0.02f;
            }
          };
          auto parameters = [&] {
            std::vector<float> all;
            for (std::size_t b = 0; b < dp.num_buckets(); ++b) {
              auto params = dp.parameters(b);
              for (std::size_t i : params.tensors())
                all.insert(all.end(), params.template param<float>(i),
                           params.template param<float>(i) + specs[i].numel);
            }
            return all;
          };
          backward(0);
          dp.step();
          if (meddle) {
            const std::vector<float> before = parameters();
            if (comm.rank() == world - 1) dp.optimizer_options().lr = 2e-2f;
            backward(1);
            try {
              const tandem::StepResult r = dp.step();
              CHECK(r.pending == (report == tandem::StepReport::deferred));
              if (r.pending && world == 2) dp.last_step();
              if (r.pending && world == 3) dp.all_ranks_have_batch(tandem::Batch::available);  // reports too
            } catch (const tandem::error& e) {
              std::lock_guard lock(m);
              messages[static_cast<std::size_t>(comm.rank())] = e.what();
            }
            CHECK(parameters() == before);
            CHECK(dp.step_count() == 1);
            if (comm.rank() == world - 1) dp.optimizer_options().lr = 1e-2f;
          }
          backward(2);
          dp.step();
          const std::vector<float> after = parameters();
          std::lock_guard lock(m);
          finals[static_cast<std::size_t>(comm.rank())] = after;
        });
        for (const std::vector<float>& f : finals) CHECK(f == finals[0]);
        if (!meddle) {
          untouched = finals[0];
          continue;
        }
        CHECK(finals[0] == untouched);
        for (const std::string& msg : messages)
          CHECK(msg.find(report == tandem::StepReport::at_step
                             ? "step(): the ranks' optimizer options differ at optimizer step 2"
                         : world == 2 ? "last_step(): the ranks' optimizer options differ at 1 optimizer step(s) "
                                        "since the last report"
                                      : "all_ranks_have_batch: the ranks' optimizer options differ at 1 optimizer "
                                        "step(s) since the last report") != std::string::npos);
      }
    }
}

TEST_CASE("bad options name the option") {
  const std::vector<std::pair<tandem::DataParallelOptions, std::string>> cases = {
      {{.accumulation_steps = 0}, "accumulation_steps"},
      {{.max_grad_norm = -1e-7f}, "max_grad_norm is -1.00000001e-07;"},  // it said -0.000000
      {{.bucket_cap_bytes = 0}, "bucket_cap_bytes is 0; it must be at least 4 bytes"},
      {{.first_bucket_cap_bytes = 3}, "first_bucket_cap_bytes is 3"},
      {{.non_finite = static_cast<tandem::NonFinite>(7)}, "non_finite is 7, not a NonFinite"},
      {{.step_report = static_cast<tandem::StepReport>(2)}, "step_report is 2, not a StepReport"},
      {{.parameters_ready = static_cast<tandem::ParametersReady>(5)}, "parameters_ready is 5, not a ParametersReady"},
  };
  for (const auto& [options, want] : cases) {
    const auto messages = run_ranks(
        2, [&](tandem::LocalComm& comm, std::vector<tandem::TensorRef>& refs) { construct(comm, refs, options); });
    for (const std::string& msg : messages) CHECK(msg.find(want) != std::string::npos);
  }
  const auto lr = run_ranks(1, [&](tandem::LocalComm& comm, std::vector<tandem::TensorRef>& refs) {
    construct(comm, refs, {}, {.lr = -1.0f});
  });
  CHECK(lr[0].find("AdamWOptions::lr") != std::string::npos);
  const auto nesterov = run_ranks(2, [&](tandem::LocalComm& comm, std::vector<tandem::TensorRef>& refs) {
    test::DataParallel<tandem::Replicated, tandem::SGD> dp(
        comm, refs, {.lr = 0.1f, .momentum = 0.9f, .nesterov = static_cast<tandem::Nesterov>(3)});
  });
  for (const std::string& msg : nesterov) CHECK(msg.find("nesterov is 3, not a Nesterov") != std::string::npos);
  // a Batch that is not one, passed by one rank only: every rank learns of it, and no rank is left in the gather
  const auto batch = run_ranks(2, [&](tandem::LocalComm& comm, std::vector<tandem::TensorRef>& refs) {
    test::DataParallel<tandem::Replicated, tandem::SGD> dp(comm, refs, {.lr = 0.1f});
    (void)dp.all_ranks_have_batch(comm.rank() == 1 ? static_cast<tandem::Batch>(9) : tandem::Batch::available);
  });
  for (const std::string& msg : batch)
    CHECK(msg.find("rank 1 passed a value that is not a Batch") != std::string::npos);
}

TEST_CASE("broadcast root out of range, tensor index out of range, step before broadcast with owned storage") {
  const auto root = run_ranks(2, [&](tandem::LocalComm& comm, std::vector<tandem::TensorRef>& refs) {
    test::DataParallel<tandem::Replicated, tandem::SGD> dp(comm, refs);
    dp.broadcast_parameters(2);
  });
  for (const std::string& msg : root) CHECK(msg.find("root 2 is out of range") != std::string::npos);

  auto specs_of = [](const std::vector<tandem::TensorRef>& refs) {
    std::vector<tandem::TensorSpec> specs;
    for (const auto& r : refs) specs.push_back({r.name, r.numel, r.dtype});
    return specs;
  };
  const auto copy_mode = run_ranks(1, [&](tandem::LocalComm& comm, std::vector<tandem::TensorRef>& refs) {
    test::DataParallel<tandem::Replicated, tandem::SGD> dp(comm, refs);
    (void)dp.grad_view(0);
  });
  CHECK(copy_mode[0].find("grad_view is for owned storage") != std::string::npos);
  const auto index = run_ranks(1, [&](tandem::LocalComm& comm, std::vector<tandem::TensorRef>& refs) {
    test::DataParallel<tandem::Replicated, tandem::SGD> dp(comm, specs_of(refs));
    (void)dp.param_view<float>(refs.size());
  });
  CHECK(index[0].find("index out of range") != std::string::npos);
  const auto type = run_ranks(1, [&](tandem::LocalComm& comm, std::vector<tandem::TensorRef>& refs) {
    test::DataParallel<tandem::Replicated, tandem::SGD> dp(comm, specs_of(refs));
    (void)dp.param_view<tandem::BFloat16>(0);
  });
  CHECK(type[0].find("param_view<bf16>(0): the parameters are fp32") != std::string::npos);

  const auto early = run_ranks(2, [&](tandem::LocalComm& comm, std::vector<tandem::TensorRef>& refs) {
    test::DataParallel<tandem::GradientSharded, tandem::AdamW> dp(comm, specs_of(refs));
    dp.step();
  });
  for (const std::string& msg : early) CHECK(msg.find("broadcast_parameters()") != std::string::npos);
}

namespace {

// The suite's backend and communicator, each saying which device it uses, as CudaBackend and tandem::Nccl do.
struct BackendOnDevice : test::Backend {
  int on = 0;
  int device() const { return on; }
};
struct CommOnDevice : test::CountingComm {
  int on = 0;
  int device() const { return on; }
};
static_assert(tandem::Communicator<CommOnDevice>);

}  // namespace

TEST_CASE("a communicator and a backend of different devices: that rank names both, every rank throws") {
  const auto messages = run_ranks(3, [&](tandem::LocalComm& local, std::vector<tandem::TensorRef>& refs) {
    CommOnDevice comm{{local}, local.rank()};  // rank r's GPU is r, as select_device makes it
    BackendOnDevice backend;
    backend.on = local.rank() == 2 ? 0 : local.rank();  // rank 2's backend was made before select_device
    tandem::DataParallel<tandem::OptimizerSharded, tandem::AdamW, BackendOnDevice, CommOnDevice> dp(comm, refs, {}, {},
                                                                                                    std::move(backend));
  });
  CHECK(messages[2] ==
        "tandem: the communicator uses device 2 and the backend device 0: make the communicator and DataParallel with "
        "the same device current (select_device first), or pass a backend of the communicator's device");
  CHECK(messages[0] == "tandem: rank 2 failed: " + messages[2]);
  CHECK(messages[1] == "tandem: rank 2 failed: " + messages[2]);
  // The same devices on every rank: built.
  CHECK(run_ranks(2, [&](tandem::LocalComm& local, std::vector<tandem::TensorRef>& refs) {
          CommOnDevice comm{{local}, local.rank()};
          BackendOnDevice backend;
          backend.on = local.rank();
          tandem::DataParallel<tandem::OptimizerSharded, tandem::AdamW, BackendOnDevice, CommOnDevice> dp(
              comm, refs, {}, {}, std::move(backend));
        }) == std::vector<std::string>(2));
}

namespace {

// A communicator that reports an impossible rank: rejected before any collective is attempted.
struct BrokenComm {
  int rank() const { return 5; }
  int size() const { return 2; }
  void all_reduce(const void*, void*, std::size_t, tandem::DType, tandem::ReduceOp, tandem::Stream) {}
  void reduce_scatter(const void*, void*, std::size_t, tandem::DType, tandem::ReduceOp, tandem::Stream) {}
  void all_gather(const void*, void*, std::size_t, tandem::DType, tandem::Stream) { FAIL("no collective expected"); }
  void broadcast(const void*, void*, std::size_t, tandem::DType, int, tandem::Stream) {}
  void barrier() {}
};
static_assert(tandem::Communicator<BrokenComm>);

}  // namespace

TEST_CASE("a communicator whose rank is out of range is rejected up front") {
  BrokenComm comm;
  mlp::Mlp<float> model(dims, 1);
  using DP = test::DataParallel<tandem::Replicated, tandem::AdamW, BrokenComm>;
  CHECK_THROWS_WITH_AS(DP(comm, model.tensors()), doctest::Contains("rank 5 is out of range [0, 2)"), tandem::error);
}

TEST_CASE("zero-size tensors are allowed anywhere and change nothing") {
  // Train the model twice on one rank: as is, and with empty tensors first, between, and last.
  auto train = [](bool with_empty) {
    std::vector<std::vector<float>> result;
    tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
      mlp::Mlp<float> model(dims, 3);
      std::vector<tandem::TensorRef> refs = model.tensors();
      if (with_empty) {
        refs.insert(refs.begin(), tandem::TensorRef{"empty.first", nullptr, nullptr, 0, tandem::DType::fp32});
        refs.insert(refs.begin() + 3, tandem::TensorRef{"empty.middle", nullptr, nullptr, 0, tandem::DType::fp32});
        refs.push_back(tandem::TensorRef{"empty.last", nullptr, nullptr, 0, tandem::DType::fp32});
      }
      test::DataParallel<tandem::GradientSharded, tandem::AdamW> dp(comm, refs, {}, {.bucket_cap_bytes = 64});
      const mlp::Dataset data(64, dims.front(), dims.back(), 5);
      for (int step = 0; step < 8; ++step) {
        model.forward_backward(data, step * 8 + comm.rank() * 4, 4);
        dp.step();
      }
      if (comm.rank() == 0) result = model.params();
    });
    return result;
  };
  CHECK(train(true) == train(false));
}
