// SPDX-License-Identifier: Apache-2.0
// kill -9 in the middle of a save: a child process saves checkpoints into one directory, one after another, each of
// parameters all equal to its number k; the test kills it with SIGKILL while a file of a save is being written. The
// directory then holds a checkpoint that verifies and loads, whole: every parameter of it equal to one k (a set mixed
// from two saves would mix two), and the file the kill interrupted is left as a temporary file the manifest does not
// name. Not built for the sanitizers' runs (a forked child of an instrumented process).
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "support/temp_path.hpp"
#include "tandem/tandem.hpp"

namespace {

const std::vector<std::size_t> sizes = {3000000, 1000003, 777, 2000000};  // about 72 MB with AdamW's state

// The child: saves checkpoint k = 1, 2, ... into `dir` until it is killed.
[[noreturn]] void save_forever(const std::string& dir) {
  try {
    tandem::LocalGroup(2).run([&](tandem::LocalComm& comm) {
      std::vector<tandem::TensorSpec> specs;
      for (std::size_t i = 0; i < sizes.size(); ++i) specs.push_back({"t" + std::to_string(i), sizes[i]});
      tandem::DataParallel<tandem::GradientSharded, tandem::AdamW> dp(comm, specs);
      for (int k = 1;; ++k) {
        dp.initialize_parameters<float>([&](std::size_t i, float* v) { std::fill(v, v + sizes[i], float(k)); });
        dp.save_checkpoint(dir);
      }
    });
  } catch (...) {
  }
  std::_Exit(1);
}

bool has_temporary(const std::string& dir) {
  std::error_code ignored;
  for (const auto& e : std::filesystem::directory_iterator(dir, ignored))
    if (e.path().filename().string().find(".tmp.") != std::string::npos) return true;
  return false;
}

}  // namespace

TEST_CASE("kill -9 during a save leaves the previous checkpoint whole and loadable") {
  const std::string dir = test::temp_path("kill");
  bool killed_mid_write = false;
  for (int attempt = 0; attempt < 5 && !killed_mid_write; ++attempt) {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) save_forever(dir);
    // Wait for a first checkpoint, then for a save in progress, and kill the child there.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!std::filesystem::exists(dir + "/manifest.json") && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    while (!has_temporary(dir) && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    REQUIRE(WIFSIGNALED(status));
    killed_mid_write = has_temporary(dir);  // else the file was renamed before the signal landed: try again
  }
  REQUIRE(killed_mid_write);
  const tandem::CheckpointSummary summary = tandem::verify_checkpoint(dir);
  CHECK(summary.manifest.world_size == 2);
  tandem::LocalGroup(3).run([&](tandem::LocalComm& comm) {
    std::vector<tandem::TensorSpec> specs;
    for (std::size_t i = 0; i < sizes.size(); ++i) specs.push_back({"t" + std::to_string(i), sizes[i]});
    tandem::DataParallel<tandem::Replicated, tandem::AdamW> dp(comm, specs);
    dp.load_checkpoint(dir);
    const float k = *dp.param_view<float>(0);
    CHECK(k >= 1.0f);
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const float* v = dp.param_view<float>(i);
      for (std::size_t e = 0; e < sizes[i]; ++e) REQUIRE(v[e] == k);  // one save's values, whole
    }
    dp.save_checkpoint(dir);  // the killed child held the directory's save lock: it went with the child
  });
  CHECK(tandem::verify_checkpoint(dir).manifest.world_size == 3);
  std::filesystem::remove_all(dir);
}

TEST_CASE(
    "a directory's save lock: refused to another process, named by its pid; it goes with its process, and a "
    "child forked while it is held keeps it no longer than its holder") {
  const std::string dir = test::temp_path("save_lock");
  std::filesystem::create_directories(dir);
  const auto refusal = [&] { return "another save into `" + dir + "` is in progress (pid "; };
  const auto message_of_lock = [&] {
    try {
      const tandem::detail::SaveLock lock(dir, "save_checkpoint");
      return std::string("(held)");
    } catch (const tandem::error& e) {
      return std::string(e.what());
    }
  };
  // A process holds it: this one is refused, naming that process, until it is killed.
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  const pid_t holder = ::fork();
  REQUIRE(holder >= 0);
  if (holder == 0) {
    const tandem::detail::SaveLock lock(dir, "save_checkpoint");
    const char byte = lock.held() ? 'y' : 'n';
    if (::write(ready[1], &byte, 1) == 1) ::pause();
    std::_Exit(1);
  }
  char byte = 0;
  REQUIRE(::read(ready[0], &byte, 1) == 1);
  CHECK(byte == 'y');
  const std::string refused = message_of_lock();
  CHECK(refused.find(refusal() + std::to_string(holder) + " on ") != std::string::npos);
  ::kill(holder, SIGKILL);
  int status = 0;
  ::waitpid(holder, &status, 0);
  CHECK(message_of_lock() == "(held)");
  // This process holds it and forks a child that lives on: releasing it releases it for the child too.
  pid_t child = -1;
  {
    const tandem::detail::SaveLock lock(dir, "save_checkpoint");
    REQUIRE(lock.held());
    child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      ::pause();
      std::_Exit(1);
    }
  }
  CHECK(message_of_lock() == "(held)");
  ::kill(child, SIGKILL);
  ::waitpid(child, &status, 0);
  ::close(ready[0]);
  ::close(ready[1]);
  std::filesystem::remove_all(dir);
}
