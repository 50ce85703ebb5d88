// SPDX-License-Identifier: Apache-2.0
// Checkpoints: bit-identical resume, resharding across world sizes and policies, corrupt and truncated files,
// a crash in the middle of a save, and mismatched layouts or optimizers, each failing on every rank; the writer's
// temporary files (unique per writer, removed when a save fails), the limit on names, ranks loading different files.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../examples/mlp/mlp.hpp"
#include "support/backend.hpp"
#include "support/params.hpp"
#include "support/temp_path.hpp"
#include "tandem/tandem.hpp"

namespace {

using test::as_float;
using test::max_relative_error;
using test::Params;

const std::vector<int> dims = {13, 37, 29, 23, 19, 7};
constexpr int global_batch = 24;

const mlp::Dataset& dataset() {
  static const mlp::Dataset data(global_batch * 40, dims.front(), dims.back(), 11);
  return data;
}

using test::temp_path;

enum class Action { none, save, load };

// Trains steps [first, last) at `world` ranks under policy P; optionally loads `path` before the first step or
// saves it after the last. Returns rank 0's parameters.
template <class P, class T = float>
Params train(int world, int first, int last, Action action, const std::string& path) {
  Params out;
  std::mutex m;
  tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<T> model(dims, 5 + static_cast<std::uint64_t>(comm.rank()));
    test::DataParallel<P, tandem::AdamW> dp(comm, model.tensors(), {.lr = 3e-3f, .weight_decay = 0.05f},
                                            {.bucket_cap_bytes = 2048, .first_bucket_cap_bytes = 1024});
    dp.broadcast_parameters();
    if (action == Action::load) {
      dp.load_checkpoint(path);
      CHECK(dp.step_count() == static_cast<std::uint64_t>(first));
    }
    const int local = global_batch / world;
    for (int step = first; step < last; ++step) {
      model.forward_backward(dataset(), step * global_batch + comm.rank() * local, local);
      dp.step();
    }
    if (action == Action::save) dp.save_checkpoint(path);
    if (comm.rank() == 0) {
      std::lock_guard lock(m);
      out = as_float(model.params());
    }
  });
  return out;
}

// The temporary files a save to `path` may leave beside it.
std::vector<std::string> temporaries_of(const std::string& path) {
  const std::filesystem::path p(path);
  std::vector<std::string> found;
  for (const auto& entry : std::filesystem::directory_iterator(p.parent_path()))
    if (entry.path().filename().string().starts_with(p.filename().string() + ".tmp"))
      found.push_back(entry.path().string());
  return found;
}

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_file(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Loads `path` on `world` ranks; returns each rank's error message ("" when it loaded).
std::vector<std::string> try_load(int world, const std::string& path) {
  std::vector<std::string> messages(static_cast<std::size_t>(world));
  tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 1);
    test::DataParallel<tandem::OptimizerSharded, tandem::AdamW> dp(comm, model.tensors());
    try {
      dp.load_checkpoint(path);
    } catch (const tandem::error& e) {
      messages[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  return messages;
}

}  // namespace

TEST_CASE_TEMPLATE("resuming from a checkpoint is bit-identical to an uninterrupted run", P, tandem::Replicated,
                   tandem::OptimizerSharded, tandem::GradientSharded) {
  const std::string path = temp_path("resume");
  for (int world : {1, 3}) {
    CAPTURE(world);
    const Params uninterrupted = train<P>(world, 0, 20, Action::none, path);
    train<P>(world, 0, 10, Action::save, path);
    const Params resumed = train<P>(world, 10, 20, Action::load, path);
    CHECK(resumed == uninterrupted);
  }
  const Params bf16 = train<P, tandem::BFloat16>(2, 0, 12, Action::none, path);
  train<P, tandem::BFloat16>(2, 0, 6, Action::save, path);
  CHECK(train<P, tandem::BFloat16>(2, 6, 12, Action::load, path) == bf16);
  std::remove(path.c_str());
}

TEST_CASE("save at 4 ranks, load at 2 and 3 under other policies: the state is restored bit for bit") {
  const std::string path = temp_path("reshard");
  const Params saved = train<tandem::GradientSharded>(4, 0, 10, Action::save, path);
  // Loading alone (no further step) hands back exactly the saved parameters, at any size and policy.
  CHECK(train<tandem::Replicated>(2, 10, 10, Action::load, path) == saved);
  CHECK(train<tandem::OptimizerSharded>(3, 10, 10, Action::load, path) == saved);
  // Continuing at 4 ranks after a round trip through 2 and 3 ranks is still bit-identical (nothing lost).
  const std::string again = temp_path("reshard_again");
  tandem::LocalGroup(3).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 9);
    test::DataParallel<tandem::OptimizerSharded, tandem::AdamW> dp(
        comm, model.tensors(), {.lr = 3e-3f, .weight_decay = 0.05f}, {.bucket_cap_bytes = 4096});
    dp.load_checkpoint(path);
    dp.save_checkpoint(again);
  });
  CHECK(train<tandem::GradientSharded>(4, 10, 20, Action::load, again) ==
        train<tandem::GradientSharded>(4, 0, 20, Action::none, path));
  // Continuing at 2 or 3 ranks equals a run at that size all along within the equivalence tolerance.
  for (int world : {2, 3}) {
    CAPTURE(world);
    const Params continued = train<tandem::Replicated>(world, 10, 20, Action::load, path);
    const Params all_along = train<tandem::Replicated>(world, 0, 20, Action::none, path);
    CHECK(max_relative_error(continued, all_along) <= 1e-5);
  }
  std::remove(path.c_str());
  std::remove(again.c_str());
}

TEST_CASE("a truncated or bit-flipped checkpoint fails clearly on every rank; the previous one still loads") {
  const std::string good = temp_path("good"), bad = temp_path("bad");
  train<tandem::Replicated>(2, 0, 3, Action::save, good);
  const std::vector<char> bytes = read_file(good);
  struct Case {
    std::vector<char> data;
    std::string want;
  };
  std::vector<Case> cases;
  cases.push_back(
      {std::vector<char>(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(bytes.size() / 2)), "truncated"});
  cases.push_back({std::vector<char>(bytes.begin(), bytes.begin() + 20), "truncated"});
  cases.push_back({std::vector<char>(bytes.begin(), bytes.end() - 3), "truncated"});
  for (std::size_t at : {std::size_t{30}, bytes.size() / 2, bytes.size() - 30}) {
    std::vector<char> flipped = bytes;
    flipped[at] = static_cast<char>(flipped[at] ^ 0x10);
    cases.push_back({flipped, ""});
  }
  std::vector<char> magic = bytes;
  magic[0] = 'X';
  cases.push_back({magic, "bad magic"});
  for (const Case& c : cases) {
    write_file(bad, c.data);
    const auto messages = try_load(3, bad);
    for (const std::string& msg : messages) {
      CAPTURE(msg);
      CHECK(msg.find("is corrupt") != std::string::npos);
      if (!c.want.empty()) CHECK(msg.find(c.want) != std::string::npos);
    }
  }
  for (const std::string& msg : try_load(3, good)) CHECK(msg.empty());
  for (const std::string& msg : try_load(2, temp_path("missing"))) CHECK(msg.find("cannot open") != std::string::npos);
  std::remove(good.c_str());
  std::remove(bad.c_str());
}

TEST_CASE("a crash in the middle of a save leaves the previous checkpoint loadable") {
  const std::string path = temp_path("crash");
  const Params first = train<tandem::OptimizerSharded>(2, 0, 4, Action::save, path);
  std::vector<std::string> messages(2);
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 5);
    test::DataParallel<tandem::OptimizerSharded, tandem::AdamW> dp(comm, model.tensors(),
                                                                   {.lr = 3e-3f, .weight_decay = 0.05f});
    if (comm.rank() == 0) tandem::detail::checkpoint_fault_after_bytes() = 1000;  // rank 0 writes
    try {
      dp.save_checkpoint(path);
    } catch (const tandem::error& e) {
      messages[static_cast<std::size_t>(comm.rank())] = e.what();
    }
    tandem::detail::checkpoint_fault_after_bytes() = 0;
  });
  CHECK(messages[0].find("simulated crash") != std::string::npos);
  CHECK(messages[1].find("rank 0 failed") != std::string::npos);
  CHECK(train<tandem::OptimizerSharded>(2, 4, 4, Action::load, path) == first);
  CHECK(temporaries_of(path).size() == 1);  // the crash left its partial file, as a real one would
  for (const std::string& t : temporaries_of(path)) std::remove(t.c_str());
  std::remove(path.c_str());
}

TEST_CASE("a save whose rename fails removes its temporary file; saves to one path from many threads do not mix") {
  tandem::CheckpointData c;
  c.tensors = {{"w", 3, tandem::DType::fp32}};
  c.params = {std::vector<unsigned char>(12, 7)};
  c.masters = {{}};
  c.states = {{}};
  // The target is a directory: the rename fails, and nothing is left behind.
  const std::string dir = temp_path("rename_target");
  std::filesystem::create_directory(dir);
  std::ofstream(dir + "/keep").put('x');  // not empty: rename over it fails on every file system
  CHECK_THROWS_WITH_AS(tandem::write_checkpoint(dir, c), doctest::Contains("cannot rename"), tandem::error);
  CHECK(temporaries_of(dir).empty());
  std::filesystem::remove_all(dir);
  // Four writers, five saves each, of four different checkpoints: the file is always one of them, whole.
  const std::string path = temp_path("concurrent");
  std::vector<tandem::CheckpointData> versions(4, c);
  for (std::size_t k = 0; k < versions.size(); ++k) versions[k].step = k;
  std::vector<std::thread> writers;
  for (std::size_t k = 0; k < versions.size(); ++k)
    writers.emplace_back([&, k] {
      for (int n = 0; n < 5; ++n) tandem::write_checkpoint(path, versions[k]);
    });
  for (std::thread& w : writers) w.join();
  const tandem::CheckpointData read = tandem::read_checkpoint(path);
  CHECK(read.step < versions.size());
  CHECK(read.params == c.params);
  CHECK(temporaries_of(path).empty());
  std::remove(path.c_str());
}

TEST_CASE("names are limited alike on save and load: 4096 bytes round-trip, 4097 fail to save on every rank") {
  for (std::size_t length : {tandem::checkpoint_max_text, tandem::checkpoint_max_text + 1}) {
    CAPTURE(length);
    const std::string path = temp_path("long_name");
    std::vector<std::string> messages(2);
    tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
      std::vector<float> w(5, 1.0f), g(5, 0.5f);
      test::DataParallel<tandem::Replicated, tandem::SGD> dp(
          comm, {{std::string(length, 'n'), w.data(), g.data(), w.size()}}, {.lr = 0.1f});
      dp.step();
      try {
        dp.save_checkpoint(path);
        dp.load_checkpoint(path);
        CHECK(dp.step_count() == 1);
      } catch (const tandem::error& e) {
        messages[static_cast<std::size_t>(comm.rank())] = e.what();
      }
    });
    if (length == tandem::checkpoint_max_text) {
      CHECK(messages == std::vector<std::string>(2));
    } else {
      CHECK(messages[0].find("names of at most 4096 bytes") != std::string::npos);
      CHECK(messages[1].find("rank 0 failed") != std::string::npos);
    }
    CHECK(temporaries_of(path).empty());
    std::remove(path.c_str());
  }
}

TEST_CASE("ranks that load different checkpoints all throw, and nothing changes") {
  const std::string early = temp_path("early"), late = temp_path("late");
  train<tandem::Replicated>(2, 0, 2, Action::save, early);
  train<tandem::Replicated>(2, 0, 3, Action::save, late);
  std::vector<std::string> messages(2);
  std::vector<std::uint64_t> steps(2);
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 5);
    test::DataParallel<tandem::Replicated, tandem::AdamW> dp(comm, model.tensors(), {.lr = 3e-3f, .weight_decay = 0.05f},
                                                             {.bucket_cap_bytes = 2048, .first_bucket_cap_bytes = 1024});
    const auto before = model.params();
    try {
      dp.load_checkpoint(comm.rank() == 0 ? early : late);
    } catch (const tandem::error& e) {
      messages[static_cast<std::size_t>(comm.rank())] = e.what();
    }
    steps[static_cast<std::size_t>(comm.rank())] = dp.step_count();
    CHECK(model.params() == before);
  });
  for (const std::string& m : messages) CHECK(m.find("read different checkpoints (steps 2 and 3)") != std::string::npos);
  CHECK(steps == std::vector<std::uint64_t>{0, 0});
  std::remove(early.c_str());
  std::remove(late.c_str());
}

TEST_CASE("checkpoints of another model or optimizer, and saves inside an accumulation window, are rejected") {
  const std::string path = temp_path("mismatch");
  train<tandem::Replicated>(2, 0, 2, Action::save, path);
  std::vector<std::string> messages(2);
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    auto record = [&](auto&& f) {
      try {
        f();
      } catch (const tandem::error& e) {
        messages[static_cast<std::size_t>(comm.rank())] += std::string(e.what()) + "\n";
      }
    };
    mlp::Mlp<float> other({13, 37, 7}, 1);
    test::DataParallel<tandem::Replicated, tandem::AdamW> dp(comm, other.tensors());
    record([&] { dp.load_checkpoint(path); });
    mlp::Mlp<float> same(dims, 1);
    test::DataParallel<tandem::Replicated, tandem::SGD> sgd(comm, same.tensors(), {.momentum = 0.9f});
    record([&] { sgd.load_checkpoint(path); });
    test::DataParallel<tandem::Replicated, tandem::AdamW> accum(comm, same.tensors(), {}, {.accumulation_steps = 2});
    accum.step();
    record([&] { accum.save_checkpoint(path); });
  });
  for (const std::string& msg : messages) {
    CHECK(msg.find("holds 11 tensors but the layout has 5") != std::string::npos);
    CHECK(msg.find("holds AdamW state (2 arrays) but this DataParallel uses SGD (1)") != std::string::npos);
    CHECK(msg.find("inside an accumulation window") != std::string::npos);
  }
  std::remove(path.c_str());
}

TEST_CASE("empty tensors and empty state arrays round-trip (found by fuzzing: memcpy from a null pointer)") {
  const std::string path = temp_path("empty");
  tandem::CheckpointData c;
  c.step = 3;
  c.state_count = 1;
  c.optimizer = "SGD";
  c.saved_by_policy = "Replicated";
  c.tensors = {{"empty", 0, tandem::DType::fp32}, {"x", 2, tandem::DType::fp32}};
  c.params = {{}, std::vector<unsigned char>(8, 7)};
  c.masters = {{}, {}};
  c.states = {{std::vector<float>{}}, {std::vector<float>{1.0f, 2.0f}}};
  tandem::write_checkpoint(path, c);
  const tandem::CheckpointData back = tandem::read_checkpoint(path);
  CHECK(back.tensors.size() == 2);
  CHECK(back.params[0].empty());
  CHECK(back.params[1] == c.params[1]);
  CHECK(back.states[1][0] == c.states[1][0]);
  std::remove(path.c_str());
}

TEST_CASE("crc32 matches the standard check value") {
  const char text[] = "123456789";
  CHECK(tandem::detail::crc32(text, 9) == 0xCBF43926u);
}
