// SPDX-License-Identifier: Apache-2.0
// Checkpoints: bit-identical resume, resharding across world sizes and policies, corrupt and truncated files,
// a crash in the middle of a save, and mismatched layouts or optimizers, each failing on every rank; the writer's
// temporary files (unique per writer, removed when a save fails), the limit on names and the names a checkpoint could
// not tell apart, ranks loading different files, saves refused where the state is not a training state.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <new>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../examples/mlp/mlp.hpp"
#include "support/backend.hpp"
#include "support/comm.hpp"
#include "support/params.hpp"
#include "support/temp_path.hpp"
#include "tandem/tandem.hpp"

namespace {

// This thread's allocations fail (std::bad_alloc) once this many more have been made; -1: none fails.
thread_local long allocations_left = -1;

}  // namespace

// The global operator new, with allocations_left: a test fails each allocation of a call in turn.
void* operator new(std::size_t n) {
  if (allocations_left == 0) throw std::bad_alloc();
  if (allocations_left > 0) --allocations_left;
  if (void* p = std::malloc(n != 0 ? n : 1)) return p;
  throw std::bad_alloc();
}
// (and its nothrow form, which std::stable_sort's buffer takes: under ASan it would otherwise be ASan's, freed below)
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return ::operator new(n);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"  // (operator new above is malloc's)
#endif
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

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
// saves it after the last (each rank calling `before_save(rank)` first, where given). Returns rank 0's parameters.
template <class P, class T = float>
Params train(int world, int first, int last, Action action, const std::string& path,
             const std::function<void(int)>& before_save = nullptr) {
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
    if (action == Action::save) {
      if (before_save) before_save(comm.rank());
      dp.save_checkpoint(path);
    }
    if (comm.rank() == 0) {
      std::lock_guard lock(m);
      out = as_float(model.params());
    }
  });
  return out;
}

// AdamW, its options without names (not OptionsNamed).
struct Unnamed : tandem::AdamW {
  template <class O, class F>
  static void visit_options(O&, F&&) = delete;
};
static_assert(tandem::Optimizer<Unnamed> && !tandem::OptionsNamed<Unnamed>);

// The temporary files writers of `path` leave beside it (`path`.tmp.*).
std::vector<std::string> temporaries_beside(const std::string& path) {
  const std::filesystem::path p(path);
  std::vector<std::string> found;
  for (const auto& entry : std::filesystem::directory_iterator(p.parent_path()))
    if (entry.path().filename().string().starts_with(p.filename().string() + ".tmp"))
      found.push_back(entry.path().string());
  return found;
}

// The temporary files of the checkpoint at `path`: inside it where it is a directory (a sharded checkpoint's shards
// and manifest), else beside it.
std::vector<std::string> temporaries_of(const std::string& path) {
  const std::filesystem::path p(path);
  if (!std::filesystem::is_directory(p)) return temporaries_beside(path);
  std::vector<std::string> found;
  for (const auto& entry : std::filesystem::directory_iterator(p))
    if (entry.path().filename().string().find(".tmp") != std::string::npos) found.push_back(entry.path().string());
  return found;
}

// The shard files of the checkpoint in directory `dir`, sorted.
std::vector<std::string> shard_files(const std::string& dir) {
  std::vector<std::string> found;
  for (const auto& entry : std::filesystem::directory_iterator(dir))
    if (entry.path().extension() == ".safetensors") found.push_back(entry.path().string());
  std::sort(found.begin(), found.end());
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
  std::filesystem::remove_all(path);  // (a save over the fp32 model's checkpoint is refused)
  const Params bf16 = train<P, tandem::BFloat16>(2, 0, 12, Action::none, path);
  train<P, tandem::BFloat16>(2, 0, 6, Action::save, path);
  CHECK(train<P, tandem::BFloat16>(2, 6, 12, Action::load, path) == bf16);
  std::filesystem::remove_all(path);
}

TEST_CASE("a load restores the optimizer options and groups of the save; an edited manifest's are refused") {
  const std::string path = temp_path("options");
  const tandem::AdamWOptions base{.lr = 3e-3f, .weight_decay = 0.05f};
  const tandem::AdamWOptions biases{.lr = 1e-3f, .weight_decay = 0.0f};
  using DP = test::DataParallel<tandem::GradientSharded, tandem::AdamW>;
  const auto bias_groups = [](const DP& dp) {
    std::vector<std::size_t> group(dp.layout().size(), 0);
    for (std::size_t i = 0; i < group.size(); ++i) group[i] = dp.layout()[i].name.ends_with(".bias") ? 1 : 0;
    return group;
  };
  // Steps [first, last) at 2 ranks. A run from the start sets two groups (the biases' with another lr and no decay)
  // and group 0's lr to 2e-3 before step 3; a run from the checkpoint sets neither (its lr is 1 before the load),
  // so it trains as the first only where the load restores them. Returns rank 0's parameters.
  const auto run = [&](int first, int last, bool load, bool save) {
    Params out;
    tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
      mlp::Mlp<float> model(dims, 5 + static_cast<std::uint64_t>(comm.rank()));
      DP dp(comm, model.tensors(), base, {.bucket_cap_bytes = 2048, .first_bucket_cap_bytes = 1024});
      dp.broadcast_parameters();
      if (load) {
        dp.optimizer_options().lr = 1.0f;
        dp.load_checkpoint(path);
        REQUIRE(dp.optimizer_group_count() == 2);
        CHECK(dp.optimizer_options(0).lr == 2e-3f);
        CHECK(dp.optimizer_options(0).weight_decay == base.weight_decay);
        CHECK(std::memcmp(&dp.optimizer_options(1), &biases, sizeof biases) == 0);
        const std::vector<std::size_t> group = bias_groups(dp);
        for (std::size_t i = 0; i < group.size(); ++i) CHECK(dp.optimizer_group(i) == group[i]);
      } else {
        dp.set_optimizer_groups({base, biases}, bias_groups(dp));
      }
      const int local = global_batch / 2;
      for (int step = first; step < last; ++step) {
        if (!load && step == 3) dp.optimizer_options().lr = 2e-3f;
        model.forward_backward(dataset(), step * global_batch + comm.rank() * local, local);
        dp.step();
      }
      if (save) dp.save_checkpoint(path);
      if (comm.rank() == 0) out = as_float(model.params());
    });
    return out;
  };
  const Params uninterrupted = run(0, 8, false, false);
  run(0, 5, false, true);
  CHECK(run(5, 8, true, false) == uninterrupted);
  const std::string manifest_file = path + "/manifest.json";
  std::string manifest;
  {
    const std::vector<char> bytes = read_file(manifest_file);
    manifest.assign(bytes.begin(), bytes.end());
  }
  CHECK(manifest.find("\"optimizer_groups\": [{\"lr\": 0.002, \"beta1\": 0.9, \"beta2\": 0.999, \"eps\": 1e-08, "
                      "\"weight_decay\": 0.05}, {\"lr\": 0.001, \"beta1\": 0.9, \"beta2\": 0.999, \"eps\": 1e-08, "
                      "\"weight_decay\": 0}]") != std::string::npos);
  {  // a consolidated file carries them, as the manifest holds them
    const std::string out = path + ".safetensors";
    tandem::consolidate_checkpoint(path, out, tandem::Arrays::all);
    const tandem::SafetensorsFile file(out);
    const std::string* groups = file.metadata("tandem_optimizer_groups");
    const std::string* group_of = file.metadata("tandem_optimizer_group_of");
    REQUIRE((groups != nullptr && group_of != nullptr));
    CHECK(manifest.find("\"optimizer_groups\": " + *groups + ",\n") != std::string::npos);
    CHECK(manifest.find("\"optimizer_group_of\": " + *group_of + ",\n") != std::string::npos);
    CHECK(*group_of == "[0, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1]");
    std::filesystem::remove(out);
  }
  // Loads the checkpoint with its manifest edited (`from` replaced by `to`) at 2 ranks, whose lr is 1 before; returns
  // each rank's error ("" where it loaded), then verify_checkpoint's, and checks that a failed load changed nothing,
  // and what a load of a manifest without options keeps.
  const auto load_edited = [&](const std::string& from, const std::string& to) {
    std::string edited = manifest;
    REQUIRE(edited.find(from) != std::string::npos);
    edited.replace(edited.find(from), from.size(), to);
    write_file(manifest_file, std::vector<char>(edited.begin(), edited.end()));
    std::vector<std::string> messages(3);
    try {
      tandem::verify_checkpoint(path);
    } catch (const tandem::error& e) {
      messages[2] = e.what();
    }
    tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
      mlp::Mlp<float> model(dims, 1);
      DP dp(comm, model.tensors(), base);
      dp.optimizer_options().lr = 1.0f;
      try {
        dp.load_checkpoint(path);
      } catch (const tandem::error& e) {
        messages[static_cast<std::size_t>(comm.rank())] = e.what();
        CHECK(dp.step_count() == 0);
      }
      CHECK(dp.optimizer_group_count() == 1);  // a failed load, or one of a checkpoint without options: the program's
      CHECK(dp.optimizer_options().lr == 1.0f);
      CHECK(dp.optimizer_group(0) == 0);
    });
    write_file(manifest_file, std::vector<char>(manifest.begin(), manifest.end()));
    return messages;
  };
  struct Refusal {
    std::string from, to, why;
  };
  const Refusal refused[] = {
      {"\"lr\": 0.002", "\"lr\": 0.0025", "holds optimizer options that do not give its optimizer_fingerprint"},
      {"\"eps\": 1e-08, \"weight_decay\": 0.05", "\"weight_decay\": 0.05",
       "optimizer group 0, lacks the AdamW option `eps`"},
      {"\"weight_decay\": 0}", "\"weight_decay\": 0, \"nesterov\": 1}",
       "optimizer group 1, holds an option `nesterov`, which AdamW does not have"},
      {"\"weight_decay\": 0}", "\"weight_decay\": -1}",
       "optimizer group 1, holds invalid options: AdamWOptions::weight_decay is -1"},
  };
  for (const Refusal& r : refused) {
    CAPTURE(r.why);
    for (const std::string& message : load_edited(r.from, r.to)) CHECK(message.find(r.why) != std::string::npos);
  }
  // A manifest of a save before options were recorded: the program's stay (checked in load_edited).
  const std::size_t from = manifest.find(",\n \"optimizer_groups\"");
  const std::size_t to = manifest.find(",\n \"metadata\"");
  REQUIRE(from < to);
  for (const std::string& message : load_edited(manifest.substr(from, to - from), "")) CHECK(message.empty());
  // A save refuses, on every rank, options that differ across ranks or that no step would take; the checkpoint stays.
  std::vector<std::string> messages(2);
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 1);
    DP dp(comm, model.tensors(), base);
    dp.broadcast_parameters();
    auto& message = messages[static_cast<std::size_t>(comm.rank())];
    if (comm.rank() == 1) dp.optimizer_options().lr = 4e-3f;
    try {
      dp.save_checkpoint(path);
    } catch (const tandem::error& e) {
      message += std::string(e.what()) + "\n";
    }
    dp.optimizer_options().lr = -1.0f;
    try {
      dp.save_checkpoint(path);
    } catch (const tandem::error& e) {
      message += e.what();
    }
  });
  for (const std::string& message : messages) {
    CHECK(message.find("ranks 0 and 1 have different optimizer options (optimizer_options()); every rank must set the "
                       "same. Nothing was saved") != std::string::npos);
    CHECK(message.find("save_checkpoint: AdamWOptions::lr is -1; it must be finite and >= 0. Nothing was saved") !=
          std::string::npos);
  }
  const std::vector<char> after = read_file(manifest_file);
  CHECK(std::string(after.begin(), after.end()) == manifest);
  std::filesystem::remove_all(path);
  // An optimizer whose options have no names: its checkpoint holds none, and a load leaves the program's
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 1);
    test::DataParallel<tandem::Replicated, Unnamed> a(comm, model.tensors(), {.lr = 0.5f});
    a.broadcast_parameters();
    a.save_checkpoint(path);
    test::DataParallel<tandem::Replicated, Unnamed> b(comm, model.tensors(), {.lr = 0.25f});
    b.load_checkpoint(path);
    CHECK(b.optimizer_options().lr == 0.25f);
  });
  {
    const std::vector<char> bytes = read_file(manifest_file);
    CHECK(std::string(bytes.begin(), bytes.end()).find("optimizer_groups") == std::string::npos);
  }
  std::filesystem::remove_all(path);
  // SGD's options, Nesterov's enumeration among them
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 1);
    const tandem::SGDOptions saved{.lr = 0.05f, .momentum = 0.9f, .nesterov = tandem::Nesterov::on};
    test::DataParallel<tandem::Replicated, tandem::SGD> a(comm, model.tensors(), saved);
    a.broadcast_parameters();
    a.save_checkpoint(path);
    test::DataParallel<tandem::Replicated, tandem::SGD> b(comm, model.tensors(), {.momentum = 0.5f});
    b.load_checkpoint(path);
    CHECK(std::memcmp(&b.optimizer_options(), &saved, sizeof saved) == 0);
    // options that need more state than was built, refused by the save as the next step would refuse them
    test::DataParallel<tandem::Replicated, tandem::SGD> c(comm, model.tensors());
    c.broadcast_parameters();
    c.optimizer_options().momentum = 0.9f;
    CHECK_THROWS_WITH_AS(c.save_checkpoint(path),
                         doctest::Contains("tandem: save_checkpoint: the SGD options need 1 state buffers but "
                                           "DataParallel was constructed with 0"),
                         tandem::error);
  });
  std::filesystem::remove_all(path);
}

TEST_CASE("optimizer options through a manifest's text come back bit for bit, FLT_MAX and subnormals too") {
  // option_values, the manifest's JSON and options_from_values, as a save and a load take them
  auto through_text = [](const tandem::SGDOptions& o) {
    tandem::CheckpointManifest m;
    m.tensors = {{"w", 1, tandem::DType::fp32}};
    m.files = {{"f", 1, 1}};
    m.optimizer_groups = {tandem::detail::option_values<tandem::SGD>(o)};
    const tandem::CheckpointManifest back = tandem::detail::parse_manifest(tandem::detail::manifest_json(m), "m");
    return tandem::detail::options_from_values<tandem::SGD>(back.optimizer_groups.at(0), "m: ");
  };
  std::mt19937 gen(3);
  std::vector<float> values = {3.4028235e38f, -3.4028235e38f, 1e-45f, -1e-45f, 1.17549435e-38f, 0.0f, -0.0f, 1.0f};
  for (int i = 0; i < 20000; ++i) {
    const std::uint32_t bits = gen();
    float f;
    std::memcpy(&f, &bits, sizeof f);
    if (std::isfinite(f)) values.push_back(f);
  }
  for (std::size_t i = 0; i + 3 < values.size(); i += 4) {
    const tandem::SGDOptions o{.lr = values[i],
                               .momentum = values[i + 1],
                               .dampening = values[i + 2],
                               .weight_decay = values[i + 3],
                               .nesterov = i % 8 == 0 ? tandem::Nesterov::on : tandem::Nesterov::off};
    const tandem::SGDOptions back = through_text(o);
    REQUIRE_MESSAGE(std::memcmp(&back, &o, sizeof o) == 0, i);
  }
  // values that are no float's, or no Nesterov's
  const std::pair<tandem::OptimizerOptionValues, const char*> refused[] = {
      {{{"lr", 1e39}, {"momentum", 0}, {"dampening", 0}, {"weight_decay", 0}, {"nesterov", 0}},
       "gives the SGD option `lr` 1e+39, beyond a float's range"},
      {{{"lr", 1}, {"momentum", 0}, {"dampening", 0}, {"weight_decay", 0}, {"nesterov", 0.5}},
       "gives the SGD option `nesterov` 0.5, which is not one of its values"},
      {{{"lr", 1}, {"momentum", 0}, {"dampening", 0}, {"weight_decay", 0}, {"nesterov", 1e10}},
       "gives the SGD option `nesterov` 1e+10, which is not one of its values"},
  };
  for (const auto& [values_given, why] : refused)
    CHECK_THROWS_WITH_AS(tandem::detail::options_from_values<tandem::SGD>(values_given, "m: "), doctest::Contains(why),
                         tandem::error);
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
  std::filesystem::remove_all(path);
  std::filesystem::remove_all(again);
}

TEST_CASE("a damaged checkpoint fails clearly on every rank; a good one loads after it") {
  const std::string good = temp_path("good"), bad = temp_path("bad"), resaved = temp_path("resaved");
  train<tandem::Replicated>(2, 0, 3, Action::save, good);
  const std::vector<std::string> shards = shard_files(good);
  REQUIRE(shards.size() == 2);
  struct Case {
    std::string what;
    std::function<void(const std::string& dir)> damage;
    std::string want;
    bool in_restore;  // found while the state is restored (a checksum), not before anything changed
  };
  auto edit = [](const std::string& file, auto&& f) {
    std::vector<char> bytes = read_file(file);
    f(bytes);
    write_file(file, bytes);
  };
  auto shard = [&](const std::string& dir, std::size_t k) {
    return dir + "/" + std::filesystem::path(shards[k]).filename().string();
  };
  const std::vector<Case> cases = {
      {"a shard cut short", [&](const std::string& d) { edit(shard(d, 0), [](auto& b) { b.resize(b.size() / 2); }); },
       "bytes long; the checkpoint's manifest says", false},
      {"a shard missing", [&](const std::string& d) { std::filesystem::remove(shard(d, 1)); }, "cannot open", false},
      {"a shard's header damaged", [&](const std::string& d) { edit(shard(d, 1), [](auto& b) { b[8] = 'X'; }); },
       "does not start with '{'", false},
      {"a bit flipped in a shard's data",
       [&](const std::string& d) { edit(shard(d, 1), [](auto& b) { b[b.size() - 5] ^= 0x10; }); },
       "does not match its data", true},
      {"no manifest", [&](const std::string& d) { std::filesystem::remove(d + "/manifest.json"); },
       "has no manifest.json", false},
      {"a manifest that is not JSON",  // (a member name's opening quote made a brace)
       [&](const std::string& d) {
         edit(d + "/manifest.json", [](auto& b) { b[std::string(b.begin(), b.end()).find("\"files\"")] = '}'; });
       },
       "is not valid JSON", false},
      {"a manifest of a later format",
       [&](const std::string& d) {
         edit(d + "/manifest.json", [](auto& b) {
           const std::string text(b.begin(), b.end());
           const std::size_t at = text.find("\"version\": 2");
           b[at + 11] = '3';
         });
       },
       "has format version 3", false},
      {"a manifest whose step was changed",  // (the shards' metadata records it too, under their header checksums)
       [&](const std::string& d) {
         edit(d + "/manifest.json", [](auto& b) {
           const std::string text(b.begin(), b.end());
           b[text.find("\"step\": 3") + 8] = '8';
         });
       },
       "records step 3 where the checkpoint's manifest says 8 (a damaged manifest?)", false},
  };
  for (const Case& c : cases) {
    CAPTURE(c.what);
    std::filesystem::remove_all(bad);
    std::filesystem::copy(good, bad);
    c.damage(bad);
    std::filesystem::remove_all(resaved);
    std::vector<std::string> messages(3), after(3), saved(3);
    tandem::LocalGroup(3).run([&](tandem::LocalComm& comm) {
      mlp::Mlp<float> model(dims, 1);
      test::DataParallel<tandem::OptimizerSharded, tandem::AdamW> dp(comm, model.tensors());
      const auto before = model.params();
      try {
        dp.load_checkpoint(bad);
      } catch (const tandem::error& e) {
        messages[static_cast<std::size_t>(comm.rank())] = e.what();
      }
      if (!c.in_restore) CHECK(model.params() == before);  // nothing changed
      try {
        dp.step();
      } catch (const tandem::error& e) {
        after[static_cast<std::size_t>(comm.rank())] = e.what();
      }
      try {  // a half-restored state is no checkpoint: the save is refused, as the step is
        dp.save_checkpoint(resaved);
      } catch (const tandem::error& e) {
        saved[static_cast<std::size_t>(comm.rank())] = e.what();
      }
      dp.load_checkpoint(good);  // a good checkpoint loads, and training goes on
      CHECK(dp.step_count() == 3);
      dp.step();
    });
    for (std::size_t r = 0; r < 3; ++r) {
      CAPTURE(messages[r]);
      CHECK(messages[r].find(c.want) != std::string::npos);
      CHECK((after[r].find("load a checkpoint that verifies") != std::string::npos) == c.in_restore);
      CHECK((saved[r].find("save_checkpoint: load_checkpoint failed while restoring") != std::string::npos) ==
            c.in_restore);
      CHECK(saved[r].empty() == !c.in_restore);  // an intact state saves
    }
    CHECK(std::filesystem::exists(resaved + "/manifest.json") == !c.in_restore);
  }
  std::filesystem::remove_all(good);
  std::filesystem::remove_all(bad);
  std::filesystem::remove_all(resaved);
}

TEST_CASE(
    "the program's metadata: kept with the state, returned by load at any size, checked, the same on every rank") {
  const std::string dir = temp_path("metadata"), out = temp_path("metadata_consolidated") + ".safetensors";
  // Any UTF-8 text, JSON's escapes included, and an empty value.
  const tandem::CheckpointMetadata metadata = {
      {"seed", "7"}, {"data", "text \"quoted\"\n\tl\u00ednea \u2713"}, {"empty", ""}, {"k\\ey/with:punctuation", "{}"}};
  // Saves `given(rank)` at 2 ranks under GradientSharded; returns each rank's error message ("" where it saved).
  auto save = [&](auto&& given, const std::string& where) {
    std::vector<std::string> messages(2);
    tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
      mlp::Mlp<float> model(dims, 5);
      test::DataParallel<tandem::GradientSharded, tandem::AdamW> dp(comm, model.tensors());
      dp.broadcast_parameters();
      model.forward_backward(dataset(), comm.rank() * 12, 12);
      dp.step();
      messages[static_cast<std::size_t>(comm.rank())] =
          test::message_of([&] { dp.save_checkpoint(where, given(comm.rank())); });
    });
    return messages;
  };
  const std::vector<std::string> saved(2, "(no error)");
  auto read_text = [](const std::string& path) {
    const std::vector<char> bytes = read_file(path);
    return std::string(bytes.begin(), bytes.end());
  };
  CHECK(save([&](int) { return metadata; }, dir) == saved);
  CHECK(tandem::verify_checkpoint(dir).manifest.metadata == metadata);
  // load_checkpoint returns it, at another size under another policy, on every rank.
  std::vector<tandem::CheckpointMetadata> loaded(3);
  tandem::LocalGroup(3).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 1);
    test::DataParallel<tandem::OptimizerSharded, tandem::AdamW> dp(comm, model.tensors());
    loaded[static_cast<std::size_t>(comm.rank())] = dp.load_checkpoint(dir);
  });
  CHECK(loaded == std::vector<tandem::CheckpointMetadata>(3, metadata));
  // The consolidated file carries it, as "metadata/<key>".
  tandem::consolidate_checkpoint(dir, out);
  {
    const tandem::SafetensorsFile file(out);
    for (const auto& [key, value] : metadata) {
      CAPTURE(key);
      const std::string* held = file.metadata("metadata/" + key);
      REQUIRE(held != nullptr);
      CHECK(*held == value);
    }
  }
  // Imported, the parameters are a start, not a run: no metadata comes back.
  const std::string imported = temp_path("metadata_imported");
  tandem::import_parameters(out, imported);
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 1);
    test::DataParallel<tandem::Replicated, tandem::AdamW> dp(comm, model.tensors());
    CHECK(dp.load_checkpoint(imported).empty());
  });
  std::filesystem::remove_all(imported);
  // Saves refused on every rank, the checkpoint there unchanged: metadata that differs between ranks, an empty key,
  // text that is not UTF-8, more than checkpoint_max_metadata_bytes.
  const std::string manifest = read_text(dir + "/manifest.json");
  struct Refused {
    std::function<tandem::CheckpointMetadata(int)> given;
    std::string want;
  };
  const std::vector<Refused> refused = {
      {[&](int rank) {
         return rank == 1 ? tandem::CheckpointMetadata{{"seed", "8"}} : metadata;
       },
       "ranks 0 and 1 gave different metadata; every rank must give the same. Nothing was saved"},
      {[&](int) {
         return tandem::CheckpointMetadata{{"", "x"}};
       },
       "the metadata has an empty key"},
      {[&](int) {
         return tandem::CheckpointMetadata{{"seed", "\xff"}};
       },
       "the metadata has the value of `seed` that is not UTF-8 from byte 0 on"},
      {[&](int) {
         return tandem::CheckpointMetadata{{"k", std::string(tandem::checkpoint_max_metadata_bytes, 'x')}};
       },
       "holds 1048577 bytes of keys and values; a checkpoint's metadata holds at most 1048576"},
  };
  for (const Refused& r : refused) {
    CAPTURE(r.want);
    for (const std::string& message : save(r.given, dir)) {
      CAPTURE(message);
      CHECK(message.find(r.want) != std::string::npos);
    }
    CHECK(read_text(dir + "/manifest.json") == manifest);
    CHECK(tandem::verify_checkpoint(dir).manifest.metadata == metadata);
    // A first save refused: not even its directory is made.
    const std::string fresh = temp_path("metadata_fresh");
    CHECK(save(r.given, fresh) != saved);
    CHECK(!std::filesystem::exists(fresh));
  }
  // A manifest whose metadata was changed (no checksum of its own covers it) is refused: each shard records it too.
  auto edited = [&](const std::string& from, const std::string& to) {
    const std::string copy = temp_path("metadata_edited");
    std::filesystem::remove_all(copy);
    std::filesystem::copy(dir, copy);
    std::string text = manifest;
    REQUIRE(text.find(from) != std::string::npos);
    text.replace(text.find(from), from.size(), to);
    write_file(copy + "/manifest.json", {text.begin(), text.end()});
    std::string verified = test::message_of([&] { tandem::verify_checkpoint(copy); });
    const std::vector<std::string> messages = try_load(2, copy);
    std::filesystem::remove_all(copy);
    return std::pair{verified, messages};
  };
  for (const auto& [from, to, key] :
       std::vector<std::array<std::string, 3>>{{"\"seed\": \"7\"", "\"seed\": \"8\"", "seed"},
                                               {"\"empty\": \"\"", "\"emptz\": \"\"", "empty"},
                                               {"\"seed\": \"7\"", "\"seed\": \"7\", \"new\": \"1\"", "new"}}) {
    CAPTURE(to);
    const auto [verified, messages] = edited(from, to);
    const std::string want = "its record of the metadata `" + key + "` differs from the checkpoint manifest's";
    CHECK(verified.find(want) != std::string::npos);
    for (const std::string& message : messages) CHECK(message.find(want) != std::string::npos);
  }
  // A manifest of a save before metadata (no "metadata" member) loads, with none.
  {
    std::filesystem::remove_all(dir);
    CHECK(save([](int) { return tandem::CheckpointMetadata{}; }, dir) == saved);
    std::string text = read_text(dir + "/manifest.json");
    const std::string member = "\n \"metadata\": {},";
    REQUIRE(text.find(member) != std::string::npos);
    text.erase(text.find(member), member.size());
    write_file(dir + "/manifest.json", {text.begin(), text.end()});
    CHECK(tandem::verify_checkpoint(dir).manifest.metadata.empty());
    CHECK(try_load(2, dir) == std::vector<std::string>(2));
  }
  std::filesystem::remove_all(dir);
  std::filesystem::remove(out);
}

TEST_CASE("verify reads every byte; consolidate writes the tensors whole; import makes them the initial parameters") {
  const std::string dir = temp_path("tools"), out = temp_path("consolidated") + ".safetensors",
                    all = temp_path("consolidated_all") + ".safetensors", imported = temp_path("imported");
  const Params saved = train<tandem::GradientSharded>(3, 0, 4, Action::save, dir);
  const tandem::CheckpointSummary summary = tandem::verify_checkpoint(dir);
  CHECK(summary.manifest.step == 4);
  CHECK(summary.manifest.world_size == 3);
  CHECK(summary.manifest.policy == "GradientSharded");
  std::uint64_t bytes = 0;
  for (const std::string& f : shard_files(dir)) bytes += std::filesystem::file_size(f);
  CHECK(summary.bytes == bytes);
  // The consolidated file holds each tensor whole, named as the model's, bit for bit what training left.
  tandem::consolidate_checkpoint(dir, out);
  tandem::consolidate_checkpoint(dir, all, tandem::Arrays::all);
  mlp::Mlp<float> model(dims, 5);
  {
    const tandem::SafetensorsFile file(out);
    REQUIRE(file.tensors().size() == saved.size());
    for (std::size_t i = 0; i < saved.size(); ++i) {
      const tandem::SafetensorsFile::Tensor* t = file.find(model.tensors()[i].name);
      REQUIRE(t != nullptr);
      CHECK(std::ranges::equal(t->shape, std::vector<std::uint64_t>{saved[i].size()}));
      std::vector<float> values(saved[i].size());
      file.read(t->begin, values.data(), values.size() * 4);
      CHECK(values == saved[i]);
    }
    const tandem::SafetensorsFile with_state(all);
    CHECK(with_state.tensors().size() == 3 * saved.size());  // parameters and AdamW's two arrays (fp32: no masters)
    CHECK(with_state.find("state1/" + model.tensors()[0].name) != nullptr);
  }
  // Imported, it is a checkpoint of the parameters alone: they load under any policy and size, the optimizer starts
  // afresh, and training from it equals training from the same parameters set by hand.
  tandem::import_parameters(out, imported);
  CHECK(tandem::verify_checkpoint(imported).manifest.parameters_only);
  tandem::import_parameters(out, imported);  // a parameters-only checkpoint is replaced
  // A training run's checkpoint is not, unless told: nothing is lost by an import into the wrong directory.
  const std::vector<std::string> before = shard_files(dir);
  CHECK_THROWS_WITH_AS(tandem::import_parameters(out, dir),
                       doctest::Contains("holds a training checkpoint (step 4, GradientSharded at 3 ranks, with AdamW "
                                         "state), which the import would replace"),
                       tandem::error);
  CHECK(shard_files(dir) == before);
  CHECK(!tandem::verify_checkpoint(dir).manifest.parameters_only);
  // A file of every array is no model's parameters (it would import, and no load could take it): refused, no trace.
  const std::string from_all = temp_path("imported_all");
  std::string first = model.tensors()[0].name;  // the names are checked in order: state0/<the first> comes first
  for (const auto& t : model.tensors()) first = std::min(first, t.name);
  const std::string refusal =
      "holds `state0/" + first + "` beside `" + first + "`: the master weights or optimizer state of a file of every";
  CHECK_THROWS_WITH_AS(tandem::import_parameters(all, from_all), doctest::Contains(refusal.c_str()), tandem::error);
  CHECK(!std::filesystem::exists(from_all));
  // A consolidated file is never written into the checkpoint it reads (over its manifest, a shard, or beside them),
  // whatever path names it: the checkpoint stays whole.
  const std::string link = temp_path("tools_link");
  std::filesystem::create_directory_symlink(dir, link);
  for (const std::string& target : {dir + "/manifest.json", before[0], dir + "/./extra.safetensors", dir,
                                    dir + "/new/x.safetensors", link + "/manifest.json"}) {
    CAPTURE(target);
    CHECK_THROWS_WITH_AS(tandem::consolidate_checkpoint(dir, target), doctest::Contains("is inside the checkpoint"),
                         tandem::error);
  }
  std::filesystem::remove(link);
  CHECK(shard_files(dir) == before);
  CHECK(tandem::verify_checkpoint(dir).manifest.step == 4);
  // An empty path names no directory (a save wrote its files into `/`): every entry point refuses it.
  const char* empty_path = "the checkpoint directory is an empty path";
  CHECK_THROWS_WITH_AS(tandem::verify_checkpoint(""), doctest::Contains(empty_path), tandem::error);
  CHECK_THROWS_WITH_AS(tandem::consolidate_checkpoint("", out), doctest::Contains(empty_path), tandem::error);
  CHECK_THROWS_WITH_AS(tandem::import_parameters(out, ""), doctest::Contains(empty_path), tandem::error);
  CHECK_THROWS_WITH_AS(tandem::check_save_target("", {{"w", 8, tandem::DType::fp32}}), doctest::Contains(empty_path),
                       tandem::error);
  std::vector<std::string> refusals(2);
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> m(dims, 1);
    test::DataParallel<tandem::GradientSharded, tandem::AdamW> dp(comm, m.tensors());
    refusals[static_cast<std::size_t>(comm.rank())] = test::message_of([&] { dp.save_checkpoint(""); });
  });
  for (const std::string& r : refusals) CHECK(r.find(empty_path) != std::string::npos);
  {
    const std::string copy = temp_path("tools_copy");
    std::filesystem::copy(dir, copy);
    tandem::import_parameters(out, copy, tandem::ExistingCheckpoint::replace);
    CHECK(tandem::verify_checkpoint(copy).manifest.parameters_only);
    CHECK(shard_files(copy).size() == 1);  // the training run's shards are gone, the imported file is there
    std::filesystem::remove_all(copy);
  }
  Params from_import, by_hand;
  for (bool import : {true, false}) {
    tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
      mlp::Mlp<float> m(dims, 99);
      if (!import) m.params() = saved;
      test::DataParallel<tandem::OptimizerSharded, tandem::AdamW> dp(comm, m.tensors(), {.lr = 3e-3f});
      if (import) {
        dp.load_checkpoint(imported);
        CHECK(dp.step_count() == 0);
        CHECK(test::as_float(m.params()) == saved);
      }
      for (int step = 0; step < 2; ++step) {
        m.forward_backward(dataset(), step * global_batch + comm.rank() * 12, 12);
        dp.step();
      }
      if (comm.rank() == 0) (import ? from_import : by_hand) = test::as_float(m.params());
    });
  }
  CHECK(from_import == by_hand);
  // A model without one of the file's tensors, or with another size, is told which.
  for (const std::string& msg : try_load(2, imported)) CHECK(msg.empty());
  tandem::LocalGroup(1).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> other({13, 37, 7}, 1);
    test::DataParallel<tandem::Replicated, tandem::AdamW> dp(comm, other.tensors());
    CHECK_THROWS_WITH_AS(dp.load_checkpoint(imported), doctest::Contains("holds `"), tandem::error);
  });
  // verify finds a flipped bit anywhere in the data.
  const std::string victim = shard_files(dir)[1];
  std::vector<char> shard = read_file(victim);
  shard[shard.size() - 100] ^= 0x01;
  write_file(victim, shard);
  CHECK_THROWS_WITH_AS(tandem::verify_checkpoint(dir), doctest::Contains("does not match its data"), tandem::error);
  // So does import, in the file it takes: a damaged consolidated file becomes no checkpoint, and the one there stays.
  std::vector<char> consolidated = read_file(out);
  consolidated[consolidated.size() - 100] ^= 0x01;
  write_file(out, consolidated);
  CHECK_THROWS_WITH_AS(tandem::import_parameters(out, imported), doctest::Contains("does not match its data"),
                       tandem::error);
  CHECK(tandem::verify_checkpoint(imported).manifest.parameters_only);
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(imported);
  std::remove(out.c_str());
  std::remove(all.c_str());
}

TEST_CASE("read_checkpoint_manifest reads the manifest alone: what verify returns, without a shard file") {
  const std::string dir = temp_path("manifest_alone"), empty = temp_path("manifest_none");
  train<tandem::GradientSharded, tandem::BFloat16>(2, 0, 3, Action::save, dir);
  const tandem::CheckpointManifest verified = tandem::verify_checkpoint(dir).manifest;
  const tandem::CheckpointManifest read = tandem::read_checkpoint_manifest(dir);
  CHECK(read.step == 3);
  CHECK(read.param_dtype == tandem::DType::bf16);
  CHECK(read.world_size == 2);
  CHECK(read.policy == "GradientSharded");
  CHECK(read.optimizer == "AdamW");
  CHECK(tandem::detail::manifest_json(read) == tandem::detail::manifest_json(verified));
  // No shard file is opened: with one removed, verify fails and the manifest still reads.
  std::filesystem::remove(shard_files(dir).at(1));
  CHECK(test::message_of([&] { tandem::verify_checkpoint(dir); }).find("cannot open") != std::string::npos);
  CHECK(tandem::read_checkpoint_manifest(dir).step == 3);
  // No checkpoint: an error that says so.
  std::filesystem::create_directories(empty);
  CHECK(test::message_of([&] { tandem::read_checkpoint_manifest(empty); }) ==
        "tandem: the checkpoint `" + empty +
            "` has no manifest.json: it is not a checkpoint, or its first save did not finish");
  CHECK(test::message_of([&] { tandem::read_checkpoint_manifest(empty + "/missing"); }) != "(no error)");
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(empty);
}

TEST_CASE("a file of the earlier single-file format still loads; a damaged one fails clearly on every rank") {
  const std::string legacy = temp_path("legacy"), bad = temp_path("legacy_bad");
  // A state of this model written in the earlier format: the parameters of rank 0's model, zero optimizer state.
  mlp::Mlp<float> source(dims, 17);
  tandem::CheckpointData c;
  c.step = 7;
  c.state_count = 2;
  c.optimizer = "AdamW";
  c.saved_by_policy = "Replicated";
  for (std::size_t i = 0; i < source.params().size(); ++i) {
    const auto& p = source.params()[i];
    c.tensors.push_back({source.tensors()[i].name, p.size(), tandem::DType::fp32});
    const auto* bytes = reinterpret_cast<const unsigned char*>(p.data());
    c.params.emplace_back(bytes, bytes + p.size() * 4);
    c.masters.emplace_back();
    c.states.push_back({std::vector<float>(p.size()), std::vector<float>(p.size())});
  }
  tandem::write_checkpoint(legacy, c);
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 1);
    test::DataParallel<tandem::GradientSharded, tandem::AdamW> dp(comm, model.tensors());
    dp.load_checkpoint(legacy);
    CHECK(dp.step_count() == 7);
    CHECK(model.params() == source.params());
  });
  const std::vector<char> bytes = read_file(legacy);
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
  for (const Case& k : cases) {
    write_file(bad, k.data);
    const auto messages = try_load(3, bad);
    for (const std::string& msg : messages) {
      CAPTURE(msg);
      CHECK(msg.find("is corrupt") != std::string::npos);
      if (!k.want.empty()) CHECK(msg.find(k.want) != std::string::npos);
    }
  }
  for (const std::string& msg : try_load(2, temp_path("missing"))) CHECK(msg.find("cannot open") != std::string::npos);
  // A safetensors file (a model's weights) is told apart by its first bytes, and not read whole first.
  {
    tandem::SafetensorsWriter w(bad, {{"w", tandem::DType::fp32, 1}}, {{"format", "pt"}}, "the test file");
    const float one = 1.0f;
    w.data(&one, sizeof one);
    w.commit();
  }
  for (const std::string& msg : try_load(2, bad))
    CHECK(msg == "tandem: `" + bad +
                     "` is a safetensors file, not a tandem checkpoint: load a checkpoint's directory, or make one of "
                     "this file's tensors with `tandem_checkpoint import` (tandem::import_parameters)");
  std::remove(legacy.c_str());
  std::remove(bad.c_str());
}

TEST_CASE("a crash in the middle of a save leaves the previous checkpoint loadable") {
  const std::string path = temp_path("crash");
  const Params first = train<tandem::OptimizerSharded>(2, 0, 4, Action::save, path);
  const std::vector<std::string> first_files = shard_files(path);
  std::vector<std::string> messages(2);
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 5);
    test::DataParallel<tandem::OptimizerSharded, tandem::AdamW> dp(comm, model.tensors(),
                                                                   {.lr = 3e-3f, .weight_decay = 0.05f});
    if (comm.rank() == 1) tandem::detail::checkpoint_fault_after_bytes() = 1000;  // rank 1's shard
    try {
      dp.save_checkpoint(path);
    } catch (const tandem::error& e) {
      messages[static_cast<std::size_t>(comm.rank())] = e.what();
    }
    tandem::detail::checkpoint_fault_after_bytes() = 0;
  });
  CHECK(messages[1].find("simulated crash") != std::string::npos);
  CHECK(messages[0].find("rank 1 failed") != std::string::npos);
  CHECK(train<tandem::OptimizerSharded>(2, 4, 4, Action::load, path) == first);
  CHECK(temporaries_of(path).size() == 1);  // the crash left its partial file, as a real one would
  // A save that completes next to it replaces the checkpoint, and removes the files only the previous one named.
  const Params second = train<tandem::OptimizerSharded>(2, 0, 5, Action::save, path);
  CHECK(train<tandem::OptimizerSharded>(2, 5, 5, Action::load, path) == second);
  for (const std::string& f : first_files) CHECK_FALSE(std::filesystem::exists(f));
  CHECK(shard_files(path).size() == 2);
  CHECK(temporaries_of(path).empty());  // and those a crashed save left: its partial file
  std::filesystem::remove_all(path);
}

TEST_CASE(
    "a directory's flush that fails after a rename: a shard's fails the save, the manifest's keeps the files of the "
    "checkpoint it replaces") {
  const std::string dir = temp_path("unflushed");
  const Params first = train<tandem::OptimizerSharded>(2, 0, 3, Action::save, dir);
  const std::vector<std::string> first_files = shard_files(dir);
  // Rank 1's shard is renamed into place, and then its directory's flush fails: the save fails on every rank and takes
  // its files with it (no manifest names them); the previous checkpoint stays.
  std::vector<std::string> messages(2);
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 5);
    test::DataParallel<tandem::OptimizerSharded, tandem::AdamW> dp(comm, model.tensors(),
                                                                   {.lr = 3e-3f, .weight_decay = 0.05f});
    if (comm.rank() == 1) tandem::detail::directory_flush_fault_at() = 1;  // its first commit: its shard's
    messages[static_cast<std::size_t>(comm.rank())] = test::message_of([&] { dp.save_checkpoint(dir); });
    tandem::detail::directory_flush_fault_at() = 0;
  });
  CHECK(messages[1].find("is in place, but flushing its directory failed (Input/output error): a power loss may undo "
                         "its rename") != std::string::npos);
  CHECK(messages[0].find("rank 1 failed") != std::string::npos);
  CHECK(shard_files(dir) == first_files);
  CHECK(train<tandem::OptimizerSharded>(2, 3, 3, Action::load, dir) == first);
  // Rank 0's manifest is renamed into place (its second commit, after its shard), and then the flush fails: the save
  // is committed, but a power loss could bring the previous manifest back, so the files it names stay.
  const Params second = train<tandem::OptimizerSharded>(2, 0, 4, Action::save, dir, [](int rank) {
    if (rank == 0) tandem::detail::directory_flush_fault_at() = 2;
  });
  CHECK(train<tandem::OptimizerSharded>(2, 4, 4, Action::load, dir) == second);
  CHECK(shard_files(dir).size() == 4);
  for (const std::string& f : first_files) CHECK(std::filesystem::exists(f));
  // The next save removes them, with the files only the checkpoint it replaces names.
  const Params third = train<tandem::OptimizerSharded>(2, 0, 5, Action::save, dir);
  CHECK(train<tandem::OptimizerSharded>(2, 5, 5, Action::load, dir) == third);
  CHECK(shard_files(dir).size() == 2);
  for (const std::string& f : first_files) CHECK_FALSE(std::filesystem::exists(f));
  std::filesystem::remove_all(dir);
}

TEST_CASE("a save removes only files of tandem's names, whatever the manifest of the checkpoint it replaces names") {
  const std::string in = temp_path("foreign_in.safetensors"), dir = temp_path("foreign");
  {
    tandem::SafetensorsWriter w(in, {{"w", tandem::DType::fp32, 2}}, {{"format", "pt"}}, "the test file");
    const float values[2] = {1.0f, 2.0f};
    w.data(values, sizeof values);
    w.commit();
  }
  // A manifest edited (or damaged) to name the user's file, or itself, in place of its parameters' file.
  for (const std::string foreign : {"notes.txt", "manifest.json"}) {
    CAPTURE(foreign);
    const std::string imported = tandem::import_parameters(in, dir).files[0].name;
    {
      std::ofstream(dir + "/notes.txt") << "the user's";
      const std::vector<char> bytes = read_file(dir + "/manifest.json");
      std::string text(bytes.begin(), bytes.end());
      const std::size_t at = text.find(imported);
      REQUIRE(at != std::string::npos);
      text.replace(at, imported.size(), foreign);
      std::ofstream(dir + "/manifest.json", std::ios::binary | std::ios::trunc) << text;
    }
    REQUIRE(tandem::detail::read_manifest(dir).files[0].name == foreign);
    tandem::import_parameters(in, dir);
    CHECK(read_file(dir + "/notes.txt").size() == 10);
    CHECK(tandem::verify_checkpoint(dir).manifest.parameters_only);
    CHECK_FALSE(std::filesystem::exists(dir + "/" + imported));  // tandem's file, named no more: removed
    CHECK(shard_files(dir).size() == 1);
  }
  std::filesystem::remove_all(dir);
  std::filesystem::remove(in);
}

TEST_CASE("the manifest's rename commits a save: a failure after it keeps the new checkpoint, before it the old") {
  const std::string dir = temp_path("commit"), elsewhere = temp_path("commit_elsewhere"),
                    scratch = temp_path("commit_scratch");
  const Params first = train<tandem::OptimizerSharded>(2, 0, 3, Action::save, dir);
  const std::vector<std::string> first_files = shard_files(dir);
  // Five steps, then a save: where `verdict_lost`, every collective of it after the manifest's rename fails (the
  // ranks cannot learn whether rank 0 committed); else rank 1 saves to a directory of its own, which rank 0 does not
  // see (a node-local disk). Returns each rank's message and rank 0's parameters.
  const auto save = [&](bool verdict_lost) {
    std::vector<std::string> messages(2);
    Params params;
    tandem::LocalGroup(2).run([&](tandem::LocalComm& local) {
      test::CountingComm comm{local, test::Collective::all_gather};
      mlp::Mlp<float> model(dims, 5);
      test::DataParallel<tandem::OptimizerSharded, tandem::AdamW, test::CountingComm> dp(
          comm, model.tensors(), {.lr = 3e-3f, .weight_decay = 0.05f},
          {.bucket_cap_bytes = 2048, .first_bucket_cap_bytes = 1024});
      dp.broadcast_parameters();
      for (int step = 0; step < 5; ++step) {
        model.forward_backward(dataset(), step * global_batch + comm.rank() * 12, 12);
        dp.step();
      }
      const int before = comm.count(test::Collective::all_gather);
      dp.save_checkpoint(scratch);  // counts a save's all-gathers: the last one says whether rank 0 committed
      comm.fail_at = verdict_lost ? 2 * comm.count(test::Collective::all_gather) - before - 1 : -1;
      messages[static_cast<std::size_t>(comm.rank())] =
          test::message_of([&] { dp.save_checkpoint(!verdict_lost && comm.rank() == 1 ? elsewhere : dir); });
      if (comm.rank() == 0) params = as_float(model.params());
    });
    return std::pair(messages, params);
  };
  {
    const auto [messages, params] = save(false);
    CHECK(messages[0].find("rank 1's file, is not there") != std::string::npos);
    CHECK(messages[0].find("every rank must save to one directory on storage they share") != std::string::npos);
    CHECK(messages[1].find("rank 0 failed: ") != std::string::npos);
    CHECK(shard_files(dir) == first_files);  // rank 0's new file is gone, the old checkpoint whole
    CHECK(shard_files(elsewhere).empty());   // and so is rank 1's
    CHECK(train<tandem::OptimizerSharded>(2, 3, 3, Action::load, dir) == first);
  }
  {
    const auto [messages, params] = save(true);
    CHECK(messages == std::vector<std::string>(2, "injected collective failure"));
    // The manifest was renamed: it is the checkpoint, its files kept by every rank (they once removed theirs).
    CHECK(tandem::verify_checkpoint(dir).manifest.step == 5);
    CHECK(train<tandem::OptimizerSharded>(2, 5, 5, Action::load, dir) == params);
    CHECK(shard_files(dir).size() == 2);
  }
  for (const std::string& d : {dir, elsewhere, scratch}) std::filesystem::remove_all(d);
}

TEST_CASE("a save over the checkpoint of other tensors is refused, on every rank, and that checkpoint stays") {
  // As two DataParallel objects (two models, or a model's fp32 and bf16 parts) saving to one directory would: the
  // second save removed the first's files.
  const std::string dir = temp_path("two_models");
  const Params saved = train<tandem::Replicated>(2, 0, 2, Action::save, dir);
  const std::vector<std::string> files = shard_files(dir);
  std::vector<std::string> messages(2);
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> other({13, 37, 7}, 1);
    test::DataParallel<tandem::Replicated, tandem::AdamW> dp(comm, other.tensors());
    dp.broadcast_parameters();
    messages[static_cast<std::size_t>(comm.rank())] = test::message_of([&] { dp.save_checkpoint(dir); });
  });
  CHECK(messages[0].find("tandem: save_checkpoint: `" + dir +
                         "` holds the checkpoint of other tensors (11 of them, Replicated, step 2; it holds `") !=
        std::string::npos);
  CHECK(messages[0].find("save each model, and each DataParallel of one, to a directory of its own, or remove that "
                         "checkpoint first. Nothing was changed") != std::string::npos);
  CHECK(messages[1].find("rank 0 failed: tandem: save_checkpoint: `") != std::string::npos);
  CHECK(shard_files(dir) == files);
  CHECK(train<tandem::Replicated>(2, 2, 2, Action::load, dir) == saved);
  // The same tensors under another optimizer (or policy) replace it: the same model's run, changed.
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 5);
    test::DataParallel<tandem::GradientSharded, tandem::SGD> dp(comm, model.tensors(), {.lr = 0.1f});
    dp.broadcast_parameters();
    dp.save_checkpoint(dir);
  });
  CHECK(tandem::verify_checkpoint(dir).manifest.optimizer == "SGD");
  // A manifest.json that does not read (a later version, damaged) may name another model's checkpoint: refused too.
  {
    const std::vector<char> manifest = read_file(dir + "/manifest.json");
    write_file(dir + "/manifest.json", std::vector<char>(manifest.begin(), manifest.begin() + 40));
    const std::vector<std::string> kept = shard_files(dir);
    tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
      mlp::Mlp<float> model(dims, 5);
      test::DataParallel<tandem::GradientSharded, tandem::SGD> dp(comm, model.tensors(), {.lr = 0.1f});
      dp.broadcast_parameters();
      CHECK(test::message_of([&] { dp.save_checkpoint(dir); }).find("holds a manifest.json that does not read") !=
            std::string::npos);
    });
    CHECK(shard_files(dir) == kept);
    write_file(dir + "/manifest.json", manifest);
  }
  for (const std::string& msg : try_load(2, dir + "/manifest.json"))  // not "bad magic"
    CHECK(msg == "tandem: `" + dir + "/manifest.json` is the manifest of a sharded checkpoint: load its directory, `" +
                     dir + "`");
  std::filesystem::remove_all(dir);
}

TEST_CASE("a manifest's commit that throws leaves the previous one: nothing throws once it is renamed") {
  // save_checkpoint keeps the files a manifest names only where commit_manifest returned: an exception after the
  // rename had every rank remove its file under a committed manifest. Each allocation of the commit fails in turn.
  const std::string dir = temp_path("commit_allocations");
  train<tandem::Replicated>(2, 0, 2, Action::save, dir);
  const std::vector<char> before = read_file(dir + "/manifest.json");
  tandem::CheckpointManifest next = tandem::detail::read_manifest(dir);
  next.policy = "OptimizerSharded";  // the same files, said to be another policy's: the commit changes manifest.json
                                     // and removes nothing (another step would not verify: the files record theirs)
  bool committed = false;
  long failures = 0;
  for (long n = 0; !committed && n < 10000; ++n) {
    allocations_left = n;
    try {
      tandem::detail::commit_manifest(dir, next);
      committed = true;
    } catch (const std::exception&) {
      ++failures;
    }
    allocations_left = -1;
    if (!committed) REQUIRE(read_file(dir + "/manifest.json") == before);  // it threw: the previous one stands
  }
  CHECK(committed);
  CHECK(failures > 5);  // (the commit allocates: each of those allocations failed once)
  CHECK(tandem::detail::read_manifest(dir).policy == next.policy);
  CHECK(temporaries_of(dir).empty());
  tandem::verify_checkpoint(dir);
  std::filesystem::remove_all(dir);
}

TEST_CASE("the files a save's clean-up may remove: tandem's own names, and their temporary files, only") {
  using tandem::detail::is_checkpoint_file_name;
  const std::string id = "0123456789abcdef";
  for (const std::string& name :
       std::vector<std::string>{"step12-" + id + "-rank3-of8.safetensors", "parameters-" + id + ".safetensors",
                                "step12-" + id + "-rank3-of8.safetensors.tmp.4242.7", "manifest.json.tmp.4242.0"})
    CHECK_MESSAGE(is_checkpoint_file_name(name), name);
  for (const std::string& name : std::vector<std::string>{
           "manifest.json", "manifest.json.tmp.bak", "step12-" + id + "-rank3-of8.safetensors.tmp.x",
           "step12-" + id + "-rank3-of8.safetensors.tmp.1.2.3", "step12-0123-rank3-of8.safetensors",
           "step-" + id + "-rank3-of8.safetensors", "step12-" + id + "-rank3-of8.safetensors.bak",
           "parameters-" + id + ".safetensors~", "notes.txt", "model.safetensors"})
    CHECK_MESSAGE(!is_checkpoint_file_name(name), name);
}

TEST_CASE("a checkpoint of more files than a process keeps open loads, verifies and consolidates") {
  const std::string dir = temp_path("many_files"), whole = temp_path("many_files_whole") + ".safetensors",
                    reference = temp_path("many_files_reference") + ".safetensors";
  const Params saved = train<tandem::Replicated>(4, 0, 2, Action::save, dir);
  tandem::consolidate_checkpoint(dir, reference, tandem::Arrays::all);
  const std::uint32_t digest = tandem::checkpoint_digest(dir);
  // At most 2 of the 4 files open at once: each read past them closes the least recently read first.
  tandem::detail::checkpoint_max_open_files() = 2;
  CHECK(tandem::checkpoint_digest(dir) == digest);
  tandem::verify_checkpoint(dir);
  tandem::consolidate_checkpoint(dir, whole, tandem::Arrays::all);
  CHECK(read_file(whole) == read_file(reference));
  {
    const tandem::CheckpointManifest m = tandem::detail::read_manifest(dir);
    tandem::detail::checkpoint_most_open_files() = 0;
    tandem::detail::ShardedCheckpoint ckpt(dir, m, tandem::Layout(m.tensors));
    std::vector<unsigned char> chunk(tandem::detail::checkpoint_chunk_bytes);
    for (const tandem::detail::CheckpointArray& a : tandem::detail::arrays_of(m))
      for (std::size_t i = 0; i < m.tensors.size(); ++i)
        ckpt.stream(a, i, m.tensors[i], chunk, [](const unsigned char*, std::size_t) {});
    CHECK(tandem::detail::checkpoint_most_open_files() == 2);
  }
  tandem::detail::checkpoint_max_open_files() = 64;
  // A load that reads every file (Replicated, at 1 and 3 ranks), each rank keeping at most 2 open.
  for (int world : {1, 3}) {
    CAPTURE(world);
    Params loaded;
    tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
      tandem::detail::checkpoint_max_open_files() = 2;
      tandem::detail::checkpoint_most_open_files() = 0;
      mlp::Mlp<float> model(dims, 1);
      test::DataParallel<tandem::Replicated, tandem::AdamW> dp(comm, model.tensors(),
                                                               {.lr = 3e-3f, .weight_decay = 0.05f});
      dp.load_checkpoint(dir);
      CHECK(tandem::detail::checkpoint_most_open_files() == 2);  // every file read, never more than 2 open
      if (comm.rank() == 0) loaded = as_float(model.params());
      tandem::detail::checkpoint_max_open_files() = 64;
    });
    CHECK(loaded == saved);
  }
  std::filesystem::remove_all(dir);
  std::remove(whole.c_str());
  std::remove(reference.c_str());
}

TEST_CASE("16-bit parameters imported alone verify, consolidate and load: no master weights are looked for") {
  const std::string dir = temp_path("bf16_saved"), imported = temp_path("bf16_imported"),
                    file = temp_path("bf16_parameters") + ".safetensors", all = temp_path("bf16_all") + ".safetensors";
  const Params saved = train<tandem::OptimizerSharded, tandem::BFloat16>(2, 0, 3, Action::save, dir);
  tandem::consolidate_checkpoint(dir, file);  // bf16 parameters, whole
  tandem::import_parameters(file, imported);
  CHECK(tandem::verify_checkpoint(imported).manifest.param_dtype == tandem::DType::bf16);
  tandem::checkpoint_digest(imported);
  tandem::consolidate_checkpoint(imported, all, tandem::Arrays::all);
  CHECK(tandem::SafetensorsFile(all).tensors().size() == saved.size());  // the parameters: nothing else is held
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<tandem::BFloat16> model(dims, 1);
    test::DataParallel<tandem::GradientSharded, tandem::AdamW> dp(comm, model.tensors());
    dp.load_checkpoint(imported);
    CHECK(dp.step_count() == 0);
    CHECK(as_float(model.params()) == saved);
  });
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(imported);
  std::remove(file.c_str());
  std::remove(all.c_str());
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
  CHECK(temporaries_beside(dir).empty());  // (the writer's temporary file was `dir`.tmp.*, beside the directory)
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

TEST_CASE("sharded saves to different directories at once (two groups of ranks, as two jobs) do not mix") {
  const std::string a = temp_path("concurrent_a"), b = temp_path("concurrent_b");
  Params saved_a, saved_b;
  {
    std::jthread first([&] { saved_a = train<tandem::OptimizerSharded>(2, 0, 2, Action::save, a); });
    std::jthread second([&] { saved_b = train<tandem::GradientSharded>(2, 0, 3, Action::save, b); });
  }
  REQUIRE(saved_a != saved_b);
  CHECK(train<tandem::OptimizerSharded>(2, 2, 2, Action::load, a) == saved_a);  // loaded, no step after
  CHECK(train<tandem::GradientSharded>(2, 3, 3, Action::load, b) == saved_b);
  CHECK(temporaries_of(a).empty());
  CHECK(temporaries_of(b).empty());
  std::filesystem::remove_all(a);
  std::filesystem::remove_all(b);
}

TEST_CASE("a save into a directory another save holds is refused, on every rank, naming it; the checkpoint stays") {
  // Two jobs saving into one directory at once removed each other's unfinished files: the second is now refused.
  const std::string dir = temp_path("held"), file = temp_path("held_parameters") + ".safetensors";
  const Params saved = train<tandem::Replicated>(2, 0, 2, Action::save, dir);
  const std::vector<std::string> files = shard_files(dir);
  tandem::consolidate_checkpoint(dir, file);
  const auto save_on_two_ranks = [&] {
    std::vector<std::string> messages(2);
    tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
      mlp::Mlp<float> model(dims, 9);
      test::DataParallel<tandem::GradientSharded, tandem::AdamW> dp(comm, model.tensors());
      dp.broadcast_parameters();
      messages[static_cast<std::size_t>(comm.rank())] = test::message_of([&] { dp.save_checkpoint(dir); });
    });
    return messages;
  };
  {
    const tandem::detail::SaveLock held(dir, "the test");  // as another job's save would, in its own process
    REQUIRE(held.held());
    const std::string refusal = "tandem: save_checkpoint: another save into `" + dir + "` is in progress (pid " +
                                std::to_string(::getpid()) + " on ";
    const std::vector<std::string> messages = save_on_two_ranks();
    CHECK(messages[0].starts_with(refusal));
    CHECK(
        messages[0].ends_with(" holds `.tandem-save.lock`): one save at a time writes to a directory; give each "
                              "job, and each DataParallel, a directory of its own. Nothing was changed"));
    CHECK(messages[1] == "tandem: rank 0 failed: " + messages[0]);
    CHECK(test::message_of([&] {
            tandem::import_parameters(file, dir, tandem::ExistingCheckpoint::replace);
          }).starts_with("tandem: import_parameters: another save into `" + dir + "` is in progress (pid "));
    CHECK(shard_files(dir) == files);
    CHECK(temporaries_of(dir).empty());
  }
  CHECK(train<tandem::Replicated>(2, 2, 2, Action::load, dir) == saved);
  // Released, the directory takes a save again (the refused ones released theirs too).
  CHECK(save_on_two_ranks() == std::vector<std::string>(2, "(no error)"));
  CHECK(tandem::verify_checkpoint(dir).manifest.policy == "GradientSharded");
  CHECK(std::filesystem::exists(dir + "/.tandem-save.lock"));  // it stays: removing it would let two saves hold two
  std::filesystem::remove_all(dir);
  std::remove(file.c_str());
}

TEST_CASE("saves into one directory from two groups of ranks at once: each commits whole or is refused") {
  const std::string dir = temp_path("racing");
  std::array<std::vector<std::string>, 2> failures;
  std::array<Params, 2> states;
  std::array<std::atomic<int>, 2> committed{};
  {
    std::vector<std::jthread> jobs;
    for (int job = 0; job < 2; ++job)
      jobs.emplace_back([&, job] {
        tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
          mlp::Mlp<float> model(dims, 20 + static_cast<std::uint64_t>(job));
          test::DataParallel<tandem::OptimizerSharded, tandem::AdamW> dp(comm, model.tensors());
          dp.broadcast_parameters();
          if (comm.rank() == 0) states[static_cast<std::size_t>(job)] = as_float(model.params());
          for (int save = 0; save < 6; ++save) {
            const std::string message = test::message_of([&] { dp.save_checkpoint(dir); });
            if (comm.rank() != 0) continue;
            if (message == "(no error)")
              ++committed[static_cast<std::size_t>(job)];
            else if (message.find("another save into `" + dir + "` is in progress") == std::string::npos)
              failures[static_cast<std::size_t>(job)].push_back(message);  // anything else is a fault
          }
        });
      });
  }
  CHECK(failures[0] == std::vector<std::string>());
  CHECK(failures[1] == std::vector<std::string>());
  CHECK(committed[0] + committed[1] >= 1);
  tandem::verify_checkpoint(dir);
  const Params loaded = train<tandem::OptimizerSharded>(2, 0, 0, Action::load, dir);
  CHECK((loaded == states[0] || loaded == states[1]));
  CHECK(shard_files(dir).size() == 2);  // the other job's files went with its save, refused or replaced
  CHECK(temporaries_of(dir).empty());
  std::filesystem::remove_all(dir);
}

TEST_CASE("loads while another job saves into the directory: each reads one whole checkpoint") {
  // A save commits, then removes the files only the checkpoint it replaced named: a load that read the replaced
  // manifest finds its files gone, or its ranks read two manifests. Such a load reads the directory again.
  const std::string dir = temp_path("reading_while_saving");
  constexpr int saves = 30;
  std::array<Params, saves> saved;  // the saving job's parameters at each save, by step count - 1
  std::atomic<int> committed{0};
  std::atomic<bool> saving_failed{false};
  std::mutex m;
  std::vector<std::string> failures;
  std::vector<std::pair<std::uint64_t, Params>> loaded;  // the loading job's: step count and parameters
  {
    std::jthread saving([&] {
      try {
        tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
          mlp::Mlp<float> model(dims, 30);
          test::DataParallel<tandem::OptimizerSharded, tandem::AdamW> dp(comm, model.tensors(), {.lr = 3e-3f});
          dp.broadcast_parameters();
          for (int step = 0; step < saves; ++step) {
            model.forward_backward(dataset(), step * global_batch + comm.rank() * 12, 12);
            dp.step();
            dp.save_checkpoint(dir);
            if (comm.rank() == 0) {
              saved[static_cast<std::size_t>(step)] = as_float(model.params());
              committed.store(step + 1);
            }
          }
        });
      } catch (const std::exception& e) {
        const std::lock_guard lock(m);
        failures.push_back(std::string("the saving job: ") + e.what());
        saving_failed = true;
      }
    });
    while (committed.load() == 0 && !saving_failed.load()) std::this_thread::yield();
    REQUIRE(!saving_failed.load());
    tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
      mlp::Mlp<float> model(dims, 40);
      test::DataParallel<tandem::GradientSharded, tandem::AdamW> dp(comm, model.tensors(), {.lr = 3e-3f},
                                                                    {.bucket_cap_bytes = 2048});
      // Until a load reads the last save; the ranks agree on the step count (a failed load throws on every rank).
      for (int failed = 0; dp.step_count() != static_cast<std::uint64_t>(saves) && failed < 10 && !saving_failed;) {
        const std::string message = test::message_of([&] { dp.load_checkpoint(dir); });
        failed += message != "(no error)";
        if (comm.rank() != 0) continue;
        const std::lock_guard lock(m);
        if (message != "(no error)")
          failures.push_back(message);
        else
          loaded.emplace_back(dp.step_count(), as_float(model.params()));
      }
    });
  }
  for (const std::string& failure : failures) FAIL_CHECK(failure);
  REQUIRE(!loaded.empty());
  for (const auto& [step, params] : loaded) {
    REQUIRE((step >= 1 && step <= saves));
    CHECK(params == saved[step - 1]);
  }
  CHECK(loaded.back().first == saves);
  std::filesystem::remove_all(dir);
}

namespace {

// Rewrites the manifest of the checkpoint in `dir` with other contents, through a rename, as a save's commit would:
// its policy, which is a record only, toggled between OptimizerSharded and Replicated.
void rewrite_manifest(const std::string& dir) {
  const std::string path = dir + "/manifest.json";
  std::string text = tandem::detail::read_text_file(path, "the manifest");
  const std::string a = "\"policy\": \"OptimizerSharded\"", b = "\"policy\": \"Replicated\"";
  if (const auto at = text.find(a); at != std::string::npos)
    text.replace(at, a.size(), b);
  else if (const auto at_b = text.find(b); at_b != std::string::npos)
    text.replace(at_b, b.size(), a);
  else
    FAIL("the manifest names neither policy");
  {
    std::ofstream out(path + ".test", std::ios::binary);
    out << text;
  }
  std::filesystem::rename(path + ".test", path);
}

}  // namespace

TEST_CASE("a load that saves overtake: read again by every rank together; after 5 attempts, said, nothing changed") {
  using tandem::detail::LoadPhase;
  const std::string dir = temp_path("overtaken");
  const Params saved = train<tandem::OptimizerSharded>(2, 0, 2, Action::save, dir);
  for (int overtakes : {2, tandem::detail::checkpoint_load_attempts}) {
    CAPTURE(overtakes);
    std::atomic<int> read_by_rank_0{0};
    std::array<int, 2> readings{};
    std::array<std::string, 2> messages;
    Params before, after;
    tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
      const int rank = comm.rank();
      mlp::Mlp<float> model(dims, 70);
      test::DataParallel<tandem::GradientSharded, tandem::AdamW> dp(comm, model.tensors(), {.lr = 3e-3f});
      // A save commits after rank 0 read the checkpoint and before rank 1 reads it, at the first `overtakes` attempts.
      tandem::detail::checkpoint_load_hook() = [&](int attempt, LoadPhase phase) {
        if (phase == LoadPhase::reading) ++readings[static_cast<std::size_t>(rank)];
        if (rank == 0 && phase == LoadPhase::read) read_by_rank_0 = attempt;
        if (rank == 1 && phase == LoadPhase::reading && attempt <= overtakes) {
          while (read_by_rank_0.load() < attempt) std::this_thread::yield();
          rewrite_manifest(dir);
        }
      };
      if (rank == 0) before = as_float(model.params());
      messages[static_cast<std::size_t>(rank)] = test::message_of([&] { dp.load_checkpoint(dir); });
      tandem::detail::checkpoint_load_hook() = nullptr;
      CHECK(dp.step_count() == (overtakes < tandem::detail::checkpoint_load_attempts ? 2u : 0u));
      if (rank == 0) after = as_float(model.params());
    });
    if (overtakes < tandem::detail::checkpoint_load_attempts) {
      CHECK(messages == std::array<std::string, 2>{"(no error)", "(no error)"});
      CHECK(readings == std::array<int, 2>{overtakes + 1, overtakes + 1});
      CHECK(after == saved);
    } else {
      const std::string why =
          "tandem: load_checkpoint: ranks 0 and 1 read different checkpoints (both of step 2); every rank must load "
          "the same one. Nothing was changed (saves into `" +
          dir + "` replaced the checkpoint while it was read, 5 times in a row: load it when they pause)";
      CHECK(messages == std::array<std::string, 2>{why, why});
      CHECK(readings == std::array<int, 2>{5, 5});
      CHECK(after == before);
    }
  }
  std::filesystem::remove_all(dir);
}

namespace {

// Commits the checkpoint in `from` into `dir` as a save does: its files copied in, its manifest renamed over the one in
// `dir`, then the files that only the replaced manifest named removed.
void commit_copy(const std::string& from, const std::string& dir) {
  namespace fs = std::filesystem;
  const tandem::CheckpointManifest replaced = tandem::read_checkpoint_manifest(dir),
                                   next = tandem::read_checkpoint_manifest(from);
  for (const auto& f : next.files)
    fs::copy_file(from + "/" + f.name, dir + "/" + f.name, fs::copy_options::overwrite_existing);
  fs::copy_file(from + "/manifest.json", dir + "/manifest.json.test", fs::copy_options::overwrite_existing);
  fs::rename(dir + "/manifest.json.test", dir + "/manifest.json");
  for (const auto& f : replaced.files)
    if (std::ranges::none_of(next.files, [&](const auto& kept) { return kept.name == f.name; }))
      fs::remove(dir + "/" + f.name);
}

}  // namespace

TEST_CASE("verify, consolidate and digest that saves overtake read the new checkpoint; after 5 attempts, said") {
  namespace fs = std::filesystem;
  using tandem::detail::LoadPhase;
  const std::string a = temp_path("overtaken_a"), b = temp_path("overtaken_b"), dir = temp_path("overtaken_tools"),
                    out = temp_path("overtaken_out") + ".safetensors",
                    want = temp_path("overtaken_want") + ".safetensors";
  train<tandem::OptimizerSharded>(2, 0, 2, Action::save, a);  // step 2
  train<tandem::OptimizerSharded>(3, 0, 3, Action::save, b);  // step 3, other files
  const std::uint32_t digests[2] = {tandem::checkpoint_digest(a), tandem::checkpoint_digest(b)};
  REQUIRE(digests[0] != digests[1]);
  auto bytes_of = [](const std::string& path) { return read_file(path); };
  // Each reader runs on a copy of `a`; after it read the manifest at each of its first `overtakes` attempts, a save
  // commits b, a, b, ... (removing the files of the one it replaces). Returns the reader's error ("(no error)" where
  // it returned) and how many times it read the manifest.
  auto overtaken = [&](int overtakes, auto&& reader) {
    fs::remove_all(dir);
    fs::copy(a, dir, fs::copy_options::recursive);
    int attempts = 0;
    tandem::detail::checkpoint_load_hook() = [&](int attempt, LoadPhase phase) {
      CHECK(phase == LoadPhase::read);
      attempts = attempt;
      if (attempt <= overtakes) commit_copy(attempt % 2 == 1 ? b : a, dir);
    };
    struct Unhook {
      ~Unhook() { tandem::detail::checkpoint_load_hook() = nullptr; }
    } unhook;
    return std::pair{test::message_of(reader), attempts};
  };
  for (int overtakes = 0; overtakes < tandem::detail::checkpoint_load_attempts; ++overtakes) {
    CAPTURE(overtakes);
    const std::uint64_t step = overtakes % 2 == 0 ? 2 : 3;  // the checkpoint committed last
    const std::string& source = overtakes % 2 == 0 ? a : b;
    tandem::CheckpointSummary verified;
    CHECK(overtaken(overtakes, [&] { verified = tandem::verify_checkpoint(dir); }) ==
          std::pair{std::string("(no error)"), overtakes + 1});
    CHECK(verified.manifest.step == step);
    std::uint32_t digest = 0;
    CHECK(overtaken(overtakes, [&] { digest = tandem::checkpoint_digest(dir); }) ==
          std::pair{std::string("(no error)"), overtakes + 1});
    CHECK(digest == digests[step - 2]);
    CHECK(overtaken(overtakes, [&] { tandem::consolidate_checkpoint(dir, out, tandem::Arrays::all); }) ==
          std::pair{std::string("(no error)"), overtakes + 1});
    tandem::consolidate_checkpoint(source, want, tandem::Arrays::all);
    CHECK(bytes_of(out) == bytes_of(want));
  }
  // Overtaken at every attempt: the error says so, and what to do.
  const int all = tandem::detail::checkpoint_load_attempts;
  const std::pair<const char*, std::function<void()>> readers[] = {
      {"verify", [&] { tandem::verify_checkpoint(dir); }},
      {"digest", [&] { tandem::checkpoint_digest(dir); }},
      {"consolidate", [&] { tandem::consolidate_checkpoint(dir, out); }}};
  const std::vector<char> consolidated = bytes_of(out);
  for (const auto& [verb, reader] : readers) {
    CAPTURE(verb);
    const auto [message, attempts] = overtaken(all, reader);
    CHECK(attempts == all);
    CHECK_MESSAGE(message.ends_with(tandem::detail::replaced_while_read(dir, all, verb)), message);
    CHECK(message.find("tandem: cannot open") == 0);
  }
  CHECK(bytes_of(out) == consolidated);  // the failed consolidations left the file there as it was, and nothing beside
  CHECK(temporaries_beside(out).empty());
  // A failure to write the consolidated file is not the checkpoint's: not read again, though a save overtook it.
  const auto [unwritable, tries] = overtaken(1, [&] { tandem::consolidate_checkpoint(dir, dir + "_none/x"); });
  CHECK(tries == 1);
  CHECK_MESSAGE(unwritable.find("_none/x") != std::string::npos, unwritable);
  CHECK(unwritable.find("replaced the checkpoint") == std::string::npos);
  // A file missing with no save meanwhile: one read, the error as it was.
  fs::remove_all(dir);
  fs::copy(a, dir, fs::copy_options::recursive);
  fs::remove(shard_files(dir).at(0));
  int attempts = 0;
  tandem::detail::checkpoint_load_hook() = [&](int attempt, LoadPhase) { attempts = attempt; };
  const std::string message = test::message_of([&] { tandem::verify_checkpoint(dir); });
  tandem::detail::checkpoint_load_hook() = nullptr;
  CHECK(attempts == 1);
  CHECK(message.find("tandem: cannot open") == 0);
  CHECK(message.find("replaced the checkpoint") == std::string::npos);
  for (const std::string& path : {a, b, dir, out, want}) fs::remove_all(path);
}

TEST_CASE("a load that must open again a file a save removed: it reads the new checkpoint whole") {
  // At one rank a checkpoint of two is read from both files; with one file open at a time, the load opens the first
  // again to copy from it, after a save (made before the copy) replaced the checkpoint and removed that file.
  using tandem::detail::LoadPhase;
  const std::string dir = temp_path("reopened");
  train<tandem::OptimizerSharded>(2, 0, 2, Action::save, dir);
  Params newer, loaded;
  int readings = 0;
  std::uint64_t step = 0;
  tandem::LocalGroup(1).run([&](tandem::LocalComm& comm) {
    mlp::Mlp<float> model(dims, 5);
    test::DataParallel<tandem::OptimizerSharded, tandem::AdamW> dp(
        comm, model.tensors(), {.lr = 3e-3f, .weight_decay = 0.05f},
        {.bucket_cap_bytes = 2048, .first_bucket_cap_bytes = 1024});
    const std::size_t open = tandem::detail::checkpoint_max_open_files();
    tandem::detail::checkpoint_max_open_files() = 1;
    tandem::detail::checkpoint_load_hook() = [&](int attempt, LoadPhase phase) {
      readings += phase == LoadPhase::reading;
      if (phase == LoadPhase::copying && attempt == 1)
        std::thread([&] { newer = train<tandem::OptimizerSharded>(2, 0, 3, Action::save, dir); }).join();
    };
    const std::string message = test::message_of([&] { dp.load_checkpoint(dir); });
    tandem::detail::checkpoint_load_hook() = nullptr;
    tandem::detail::checkpoint_max_open_files() = open;
    CHECK(message == "(no error)");
    step = dp.step_count();
    loaded = as_float(model.params());
  });
  CHECK(readings == 2);
  CHECK(step == 3);
  CHECK(loaded == newer);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a load one rank refuses for its own call is not read again") {
  const std::string dir = temp_path("refused_load");
  std::array<std::string, 2> messages;
  std::array<int, 2> readings{};
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    const int rank = comm.rank();
    mlp::Mlp<float> model(dims, 1);
    std::vector<tandem::TensorSpec> specs;
    for (const auto& t : model.tensors()) specs.push_back({t.name, t.numel});
    test::DataParallel<tandem::GradientSharded, tandem::AdamW> dp(
        comm, specs, {}, {.bucket_cap_bytes = 1024, .first_bucket_cap_bytes = 512, .gradient_buffers = 1});
    dp.broadcast_parameters();
    dp.step();
    dp.save_checkpoint(dir);
    tandem::detail::checkpoint_load_hook() = [&](int, tandem::detail::LoadPhase phase) {
      readings[static_cast<std::size_t>(rank)] += phase == tandem::detail::LoadPhase::reading;
    };
    {
      std::optional<decltype(dp.gradients(0))> bucket;  // rank 1's, open through the load
      if (rank == 1) bucket.emplace(dp.gradients(0));
      messages[static_cast<std::size_t>(rank)] = test::message_of([&] { dp.load_checkpoint(dir); });
      if (rank == 0) bucket.emplace(dp.gradients(0));  // (releasing a bucket reduces it: on every rank)
    }
    dp.discard_gradients();
    tandem::detail::checkpoint_load_hook() = nullptr;
  });
  const std::string why =
      "tandem: load_checkpoint while bucket 0's GradientBucket is still open; release it (let it go out of scope) "
      "first";
  CHECK(messages == std::array<std::string, 2>{"tandem: rank 1 failed: " + why, why});
  CHECK(readings == std::array<int, 2>{1, 0});
  std::filesystem::remove_all(dir);
}

TEST_CASE("names: a sharded checkpoint holds any; the earlier format writes only what it reads (4096 bytes)") {
  const std::string path = temp_path("long_name");
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    std::vector<float> w(5, 1.0f), g(5, 0.5f);
    test::DataParallel<tandem::Replicated, tandem::SGD> dp(
        comm, {{std::string(5000, 'n'), w.data(), g.data(), w.size()}}, {.lr = 0.1f});
    dp.step();
    dp.save_checkpoint(path);
    dp.load_checkpoint(path);
    CHECK(dp.step_count() == 1);
  });
  std::filesystem::remove_all(path);
  for (std::size_t length : {tandem::checkpoint_max_text, tandem::checkpoint_max_text + 1}) {
    CAPTURE(length);
    tandem::CheckpointData c;
    c.tensors = {{std::string(length, 'n'), 1, tandem::DType::fp32}};
    c.params = {std::vector<unsigned char>(4, 0)};
    c.masters = {{}};
    c.states = {{}};
    if (length == tandem::checkpoint_max_text) {
      tandem::write_checkpoint(path, c);
      CHECK(tandem::read_checkpoint(path).tensors[0].name.size() == length);
    } else {
      CHECK_THROWS_WITH_AS(tandem::write_checkpoint(path, c), doctest::Contains("names of at most 4096 bytes"),
                           tandem::error);
    }
    CHECK(temporaries_of(path).empty());
    std::remove(path.c_str());
  }
}

// Every rank's verdict on constructing DataParallel<Replicated, SGD> over `specs` at `world` ranks: "" where it is
// built.
std::vector<std::string> construct(const std::vector<tandem::TensorSpec>& specs, int world, float momentum) {
  std::vector<std::string> messages(static_cast<std::size_t>(world));
  tandem::LocalGroup(world).run([&](tandem::LocalComm& comm) {
    try {
      test::DataParallel<tandem::Replicated, tandem::SGD> dp(comm, specs, {.lr = 0.1f, .momentum = momentum});
    } catch (const tandem::error& e) {
      messages[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  return messages;
}

TEST_CASE("names a checkpoint could not tell apart are refused at construction, on every rank") {
  struct Case {
    std::vector<std::string> names;
    tandem::DType dtype;
    float momentum;    // SGD: one state array with momentum, none without
    std::string want;  // empty: accepted
  };
  const tandem::DType f32 = tandem::DType::fp32, b16 = tandem::DType::bf16;
  const std::string whole = "a checkpoint of this layout would hold ";
  const std::vector<Case> cases = {
      {{"w", "b", "w"}, f32, 0.0f, whole + "two tensors named `w`; a checkpoint keys each array"},
      {{"w", "__metadata__"}, f32, 0.0f, whole + "a tensor named `__metadata__`, the safetensors header's key"},
      {{"master/w", "w"}, b16, 0.0f, whole + "two tensors named `master/w`"},
      {{"w", "state0/w"}, f32, 0.9f, whole + "two tensors named `state0/w`"},
      {{"w", "master/w"}, f32, 0.0f, ""},  // fp32 parameters: no master weights
      {{"w", "state0/w"}, f32, 0.0f, ""},  // no state arrays
      {{"w", "w[0:2]"}, f32, 0.9f, ""},    // no shard cuts `w` (4 elements) at [0:2]
  };
  for (const Case& c : cases) {
    CAPTURE(c.names.back());
    std::vector<tandem::TensorSpec> specs;
    for (const std::string& name : c.names) specs.push_back({name, 4, c.dtype});
    for (const std::string& m : construct(specs, 2, c.momentum)) {
      CAPTURE(m);
      CHECK((c.want.empty() ? m.empty() : m.find(c.want) != std::string::npos));
    }
  }
  // A name that is a piece of another where the shards cut it: refused at that world size only (the plan does not
  // depend on names, so the piece is found first from a layout without the clash).
  const std::vector<tandem::TensorSpec> plain = {{"a", 4, f32}, {"w", 100, f32}};
  const tandem::Plan plan = tandem::bucket_plan(plain, 2);
  std::string piece, shard;  // the piece of `w` in the shard file that holds `a`
  for (int rank = 0; rank < 2; ++rank) {
    const std::vector<tandem::detail::Slice> slices = tandem::detail::shard_slices(plan, rank);
    if (std::ranges::none_of(slices, [](const auto& s) { return s.tensor == 0; })) continue;
    for (const tandem::detail::Slice& s : slices)
      if (s.tensor == 1 && s.end - s.begin < 100)
        piece = "w[" + std::to_string(s.begin) + ":" + std::to_string(s.end) + "]";
    shard = "rank " + std::to_string(rank) + "'s checkpoint shard at this world size";
  }
  REQUIRE(!piece.empty());  // 100 elements cross the shard boundary of a 128-element bucket, beside `a` on one side
  std::vector<tandem::TensorSpec> clash = plain;
  clash[0].name = piece;
  for (const std::string& m : construct(clash, 2, 0.0f)) {  // the rank that finds it, and the other, told by it
    CAPTURE(m);
    CHECK(m.find(shard + " would hold two tensors named `" + piece + "`") != std::string::npos);
  }
  for (const std::string& m : construct(clash, 1, 0.0f)) CHECK(m.empty());
}

TEST_CASE("save_checkpoint refuses a state that is not whole: before the initial parameters, after a move") {
  const std::string path = temp_path("not_whole");
  tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
    const std::vector<tandem::TensorSpec> specs = {{"w", 8, tandem::DType::fp32}};
    test::DataParallel<tandem::Replicated, tandem::SGD> dp(comm, specs, {.lr = 0.1f});
    CHECK_THROWS_WITH_AS(dp.save_checkpoint(path), doctest::Contains("save_checkpoint before broadcast_parameters()"),
                         tandem::error);
    CHECK(!std::filesystem::exists(path));
    dp.broadcast_parameters();
    comm.barrier();  // both ranks have seen the refusal before either saves
    dp.save_checkpoint(path);
    test::DataParallel<tandem::Replicated, tandem::SGD> moved(std::move(dp));
    CHECK_THROWS_WITH_AS(dp.save_checkpoint(path), doctest::Contains("has been moved from"), tandem::error);
  });
  std::filesystem::remove_all(path);
}

TEST_CASE("ranks that load different checkpoints all throw, and nothing changes; a copy of one is the same one") {
  const std::string early = temp_path("early"), late = temp_path("late"), again = temp_path("again"),
                    copy = temp_path("copy");
  train<tandem::Replicated>(2, 0, 2, Action::save, early);
  train<tandem::Replicated>(2, 0, 3, Action::save, late);
  train<tandem::Replicated>(2, 0, 2, Action::save, again);  // the same step (and state), another save
  std::filesystem::remove_all(copy);
  std::filesystem::copy(early, copy);
  // Ranks 0 and 1 load `first` and `second`: what each threw ("" if nothing), and each's step count after.
  const auto load = [&](const std::string& first, const std::string& second) {
    std::vector<std::string> messages(2);
    std::vector<std::uint64_t> steps(2);
    tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
      mlp::Mlp<float> model(dims, 5);
      test::DataParallel<tandem::Replicated, tandem::AdamW> dp(
          comm, model.tensors(), {.lr = 3e-3f, .weight_decay = 0.05f},
          {.bucket_cap_bytes = 2048, .first_bucket_cap_bytes = 1024});
      const auto before = model.params();
      try {
        dp.load_checkpoint(comm.rank() == 0 ? first : second);
      } catch (const tandem::error& e) {
        messages[static_cast<std::size_t>(comm.rank())] = e.what();
        CHECK(model.params() == before);
      }
      steps[static_cast<std::size_t>(comm.rank())] = dp.step_count();
    });
    return std::pair(messages, steps);
  };
  {
    const auto [messages, steps] = load(early, late);
    for (const std::string& m : messages)
      CHECK(m.find("read different checkpoints (steps 2 and 3)") != std::string::npos);
    CHECK(steps == std::vector<std::uint64_t>{0, 0});
  }
  {  // the same step: told apart by their contents (the manifest names each save's own files)
    const auto [messages, steps] = load(early, again);
    for (const std::string& m : messages)
      CHECK(m.find("read different checkpoints (both of step 2)") != std::string::npos);
    CHECK(steps == std::vector<std::uint64_t>{0, 0});
  }
  {  // a copy of the directory holds the same checkpoint
    const auto [messages, steps] = load(early, copy);
    CHECK(messages == std::vector<std::string>{"", ""});
    CHECK(steps == std::vector<std::uint64_t>{2, 2});
  }
  for (const std::string& dir : {early, late, again, copy}) std::filesystem::remove_all(dir);
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
    // SGD with momentum keeps one state array, without none: the options constructed with must keep the saved count.
    sgd.save_checkpoint(path + "_sgd");
    test::DataParallel<tandem::Replicated, tandem::SGD> plain(comm, same.tensors(), {.momentum = 0.0f});
    record([&] { plain.load_checkpoint(path + "_sgd"); });
    test::DataParallel<tandem::Replicated, tandem::AdamW> accum(comm, same.tensors(), {}, {.accumulation_steps = 2});
    accum.step();
    record([&] { accum.save_checkpoint(path); });
  });
  for (const std::string& msg : messages) {
    CHECK(msg.find("holds 11 tensors but the layout has 5") != std::string::npos);
    CHECK(msg.find("holds AdamW state (2 arrays) but this DataParallel uses SGD (1)") != std::string::npos);
    CHECK(msg.find("holds SGD state (1 arrays) but this DataParallel uses SGD (0), as the options it was constructed "
                   "with decide (SGD keeps a momentum buffer only where `momentum` is not 0)") != std::string::npos);
    CHECK(msg.find("inside an accumulation window") != std::string::npos);
    CHECK(msg.find("or drop the window's gradients with discard_gradients() first") != std::string::npos);
  }
  std::filesystem::remove_all(path);
  std::filesystem::remove_all(path + "_sgd");
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
