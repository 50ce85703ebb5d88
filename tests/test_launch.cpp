// SPDX-License-Identifier: Apache-2.0
// Launcher detection (comm/launch_env.hpp) against made-up environments, and the shared-file rendezvous
// (comm/file_rendezvous.hpp) between threads: late writers, stale files from another job, torn files, timeouts.
#include <doctest/doctest.h>
#include <sys/stat.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tandem/comm/file_rendezvous.hpp"
#include "tandem/comm/launch_env.hpp"
#include "tandem/core/deadline.hpp"

namespace {

using namespace std::chrono_literals;
using Env = std::map<std::string, std::string>;

tandem::EnvironmentLookup lookup(const Env& env) {
  return [&env](const char* name) -> const char* {
    const auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  };
}

tandem::LaunchInfo detect(const Env& env) { return tandem::detect_launch(lookup(env)); }

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::string scratch_path(const char* name) {
  std::random_device rd;
  return (std::filesystem::temp_directory_path() / (std::string("tandem_test_") + name + "_" + std::to_string(rd())))
      .string();
}

}  // namespace

TEST_CASE("detect_launch: no launcher") {
  const tandem::LaunchInfo info = detect({{"HOME", "/root"}});
  CHECK(info.launcher == tandem::Launcher::none);
  CHECK(info.rank == 0);
  CHECK(info.world_size == 1);
  CHECK(info.local_rank == 0);  // the only process of its job: its GPU is device 0
  CHECK(info.local_size == 1);
  CHECK(tandem::device_for(info, 4, lookup({})) == 0);
  CHECK(contains(info.describe(), "no launcher found"));
}

TEST_CASE("detect_launch: a local rank with no launcher's rank and size is an error, unless it says 'alone'") {
  CHECK_THROWS_WITH_AS(detect({{"LOCAL_RANK", "3"}}),
                       "tandem: detect_launch: LOCAL_RANK is 3 but no launcher set this process's rank and world size "
                       "(RANK and WORLD_SIZE, or another launcher's: docs/launching.md); set them too, or unset "
                       "LOCAL_RANK (to choose a GPU for a single process, set CUDA_VISIBLE_DEVICES)",
                       tandem::error);
  CHECK_THROWS_WITH_AS(detect({{"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "4"}}),
                       doctest::Contains("LOCAL_WORLD_SIZE is 4 but no launcher set"), tandem::error);
  CHECK_THROWS_WITH_AS(detect({{"MPI_LOCALRANKID", "1"}}),
                       doctest::Contains("MPI_LOCALRANKID is 1 but no launcher set this process's rank and world size "
                                         "(PMI_RANK and PMI_SIZE"),
                       tandem::error);
  CHECK_THROWS_WITH_AS(detect({{"LOCAL_WORLD_SIZE", "0"}}), doctest::Contains("LOCAL_WORLD_SIZE is 0 but"),
                       tandem::error);
  // local rank 0 of 1 is what running alone means, and a value that is no count ("-1": scripts' "not distributed")
  // says nothing: listed, not refused
  for (const Env& env : {Env{{"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "1"}}, Env{{"LOCAL_RANK", "-1"}},
                         Env{{"LOCAL_RANK", ""}, {"LOCAL_WORLD_SIZE", "x"}}}) {
    const auto alone = detect(env);
    CHECK(alone.launcher == tandem::Launcher::none);
    CHECK(alone.local_rank == 0);
    CHECK(contains(alone.describe(), "no launcher found"));
    CHECK(contains(alone.describe(), "also set but ignored: LOCAL_RANK=" + env.begin()->second));
  }
  // a SLURM batch script's own environment: its task's variables are listed, and it runs alone; a local rank there
  // names what srun would have set
  const auto batch = detect({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "0"}});
  CHECK(batch.launcher == tandem::Launcher::none);
  CHECK(contains(batch.describe(), "also set but ignored: SLURM_PROCID=0, SLURM_NTASKS=4, SLURM_LOCALID=0"));
  CHECK_THROWS_WITH_AS(detect({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"}}),
                       doctest::Contains("SLURM_LOCALID is 1 but no launcher set this process's rank and world size "
                                         "(SLURM_PROCID and SLURM_STEP_NUM_TASKS in a job step, where srun sets "
                                         "SLURM_STEP_ID"),
                       tandem::error);
  // under a launcher that was found, another's local variables are listed too
  const auto mpi = detect({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}});
  CHECK(mpi.launcher == tandem::Launcher::openmpi);
  CHECK(contains(mpi.describe(), "also set but ignored: LOCAL_RANK=1"));
}

TEST_CASE("detect_launch: each launcher's variables") {
  SUBCASE("Open MPI") {
    const auto info = detect({{"OMPI_COMM_WORLD_RANK", "3"},
                              {"OMPI_COMM_WORLD_SIZE", "4"},
                              {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                              {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
    CHECK(info.launcher == tandem::Launcher::openmpi);
    CHECK(info.rank == 3);
    CHECK(info.world_size == 4);
    CHECK(info.local_rank == 1);
    CHECK(info.local_size == 2);
    CHECK(info.missing.empty());
    CHECK(contains(info.describe(), "Open MPI (mpirun): rank 3 of 4, local rank 1 of 2"));
  }
  SUBCASE("torchrun style, without MASTER_PORT") {
    const auto info = detect(
        {{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"}, {"MASTER_ADDR", "node0"}});
    CHECK(info.launcher == tandem::Launcher::torchrun);
    CHECK(info.rank == 5);
    CHECK(info.master_addr == "node0");
    CHECK(!info.master_port);
    CHECK(info.missing == std::vector<std::string>{"MASTER_PORT"});
    CHECK(contains(info.describe(), "missing: MASTER_PORT"));
  }
  SUBCASE("PMI") {
    const auto info = detect({{"PMI_RANK", "0"}, {"PMI_SIZE", "2"}});
    CHECK(info.launcher == tandem::Launcher::pmi);
    CHECK(info.world_size == 2);
    CHECK(!info.local_rank);
    CHECK(info.missing == std::vector<std::string>{"MPI_LOCALRANKID", "MPI_LOCALNRANKS"});
    CHECK(contains(info.describe(), "local rank unknown"));
  }
  SUBCASE("srun --mpi=pmi2: PMI without Hydra's local variables takes the job step's") {
    const auto info = detect({{"PMI_RANK", "3"},
                              {"PMI_SIZE", "4"},
                              {"PMI_FD", "9"},
                              {"SLURM_PROCID", "3"},
                              {"SLURM_STEP_ID", "0"},
                              {"SLURM_STEP_NUM_TASKS", "4"},
                              {"SLURM_LOCALID", "1"},
                              {"SLURM_NODEID", "1"},
                              {"SLURM_TASKS_PER_NODE", "2(x2)"}});
    CHECK(info.launcher == tandem::Launcher::pmi);
    CHECK(info.rank == 3);
    CHECK(info.local_rank == 1);
    CHECK(info.local_size == 2);
    CHECK(info.missing.empty());
    CHECK(contains(info.describe(), "rank 3 of 4, local rank 1 of 2"));
    CHECK(!contains(info.describe(), "ignored"));  // the step's variables were read, to match the PMI ranks
    CHECK(contains(info.describe(), "SLURM_PROCID=3, SLURM_STEP_NUM_TASKS=4"));
    CHECK(tandem::device_for(info, 2, lookup({})) == 1);
  }
  SUBCASE("PMI ranks that are not the SLURM step's tasks (a launcher's proxies started by srun): not guessed") {
    const auto info = detect({{"PMI_RANK", "3"},
                              {"PMI_SIZE", "4"},
                              {"SLURM_PROCID", "0"},
                              {"SLURM_STEP_ID", "0"},
                              {"SLURM_STEP_NUM_TASKS", "2"},
                              {"SLURM_LOCALID", "0"},
                              {"SLURM_NODEID", "0"},
                              {"SLURM_TASKS_PER_NODE", "1(x2)"}});
    CHECK(info.launcher == tandem::Launcher::pmi);
    CHECK(!info.local_rank);
    CHECK(info.missing == std::vector<std::string>{"MPI_LOCALRANKID", "MPI_LOCALNRANKS"});
  }
  SUBCASE("SLURM job step: the local size comes from SLURM_TASKS_PER_NODE at SLURM_NODEID") {
    const auto info = detect({{"SLURM_PROCID", "6"},
                              {"SLURM_STEP_ID", "0"},
                              {"SLURM_STEP_NUM_TASKS", "7"},
                              {"SLURM_NTASKS", "99"},
                              {"SLURM_LOCALID", "0"},
                              {"SLURM_NODEID", "3"},
                              {"SLURM_TASKS_PER_NODE", "2(x3),1"}});
    CHECK(info.launcher == tandem::Launcher::slurm);
    CHECK(info.rank == 6);
    CHECK(info.world_size == 7);  // the step's tasks, not the allocation's
    CHECK(info.local_rank == 0);
    CHECK(info.local_size == 1);
  }
  SUBCASE("srun --preserve-env: the step's per-node list, not the job's that SLURM_TASKS_PER_NODE keeps") {
    const auto info = detect({{"SLURM_PROCID", "1"},
                              {"SLURM_STEP_ID", "0"},
                              {"SLURM_STEP_NUM_TASKS", "2"},
                              {"SLURM_LOCALID", "1"},
                              {"SLURM_NODEID", "0"},
                              {"SLURM_TASKS_PER_NODE", "4(x2)"},
                              {"SLURM_STEP_TASKS_PER_NODE", "2"}});
    CHECK(info.local_size == 2);
    CHECK(contains(info.describe(), "SLURM_STEP_TASKS_PER_NODE=2"));
  }
  SUBCASE("SLURM job step whose srun sets no SLURM_STEP_NUM_TASKS: the world size from SLURM_NTASKS") {
    const auto info = detect({{"SLURM_PROCID", "2"},
                              {"SLURM_STEP_ID", "0"},
                              {"SLURM_NTASKS", "4"},
                              {"SLURM_LOCALID", "0"},
                              {"SLURM_NODEID", "1"},
                              {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"}});
    CHECK(info.launcher == tandem::Launcher::slurm);
    CHECK(info.rank == 2);
    CHECK(info.world_size == 4);
    CHECK(info.local_rank == 0);
    CHECK(info.local_size == 2);
    CHECK(info.missing.empty());
    CHECK(contains(info.describe(), "rank 2 of 4, local rank 0 of 2"));
    CHECK(contains(info.describe(), "SLURM_NTASKS=4"));
  }
  SUBCASE("srun --mpi=pmi2 whose srun sets no SLURM_STEP_NUM_TASKS: the PMI ranks matched by SLURM_NTASKS") {
    const Env env = {
        {"PMI_RANK", "3"},     {"PMI_SIZE", "4"},      {"SLURM_PROCID", "3"}, {"SLURM_STEP_ID", "0"},
        {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"}, {"SLURM_NODEID", "1"}, {"SLURM_TASKS_PER_NODE", "2(x2)"}};
    const auto info = detect(env);
    CHECK(info.launcher == tandem::Launcher::pmi);
    CHECK(info.local_rank == 1);
    CHECK(info.local_size == 2);
    CHECK(info.missing.empty());
    CHECK(contains(info.describe(), "SLURM_PROCID=3, SLURM_NTASKS=4"));
    CHECK(!contains(info.describe(), "ignored"));
    // the allocation's task count is not the PMI world's: not the step's tasks, so not guessed
    Env other = env;
    other["SLURM_NTASKS"] = "8";
    CHECK(!detect(other).local_rank);
  }
  SUBCASE("a SLURM batch script without srun is no launch") {
    const auto info = detect({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}});
    CHECK(info.launcher == tandem::Launcher::none);
  }
}

TEST_CASE("device_for: the local rank's GPU, or the one GPU a launcher gave each process") {
  tandem::LaunchInfo info;
  info.launcher = tandem::Launcher::slurm;
  info.world_size = 8;
  info.rank = 3;
  info.local_rank = 3;
  info.local_size = 4;
  CHECK(tandem::device_for(info, 4, lookup({})) == 3);
  CHECK(tandem::device_for(info, 8, lookup({{"CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7"}})) == 3);
  // srun --gpus-per-task=1: each process sees its own GPU as device 0
  CHECK(tandem::device_for(info, 1, lookup({{"CUDA_VISIBLE_DEVICES", "3"}})) == 0);
  CHECK_THROWS_WITH_AS(tandem::device_for(info, 1, lookup({})),
                       doctest::Contains("local rank 3 but this process sees 1 GPU(s); start at most one process per "
                                         "GPU, or give each process a GPU of its own"),
                       tandem::error);
  CHECK_THROWS_WITH_AS(tandem::device_for(info, 2, lookup({{"CUDA_VISIBLE_DEVICES", "4,5"}})),
                       doctest::Contains("sees 2 GPU(s) (CUDA_VISIBLE_DEVICES=\"4,5\")"), tandem::error);
  CHECK_THROWS_WITH_AS(tandem::device_for(info, 0, lookup({{"CUDA_VISIBLE_DEVICES", ""}})),
                       doctest::Contains("this process sees no GPU (CUDA_VISIBLE_DEVICES=\"\")"), tandem::error);
  info.local_rank.reset();
  CHECK_THROWS_WITH_AS(tandem::device_for(info, 4, lookup({})),
                       doctest::Contains("did not say this process's local rank, so its GPU is unknown"),
                       tandem::error);
}

TEST_CASE("detect_launch: mpirun inside a SLURM step wins; the SLURM variables are listed as ignored") {
  const auto info = detect({{"OMPI_COMM_WORLD_RANK", "1"},
                            {"OMPI_COMM_WORLD_SIZE", "2"},
                            {"SLURM_PROCID", "0"},
                            {"SLURM_STEP_ID", "4"},
                            {"SLURM_NTASKS", "1"}});
  CHECK(info.launcher == tandem::Launcher::openmpi);
  CHECK(info.rank == 1);
  CHECK(contains(info.describe(), "also set but ignored: SLURM_PROCID=0"));
}

TEST_CASE("detect_launch: mpirun and torchrun that agree: mpirun wins; that disagree: an error; PMI under torchrun") {
  const auto info =
      detect({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"RANK", "1"}, {"WORLD_SIZE", "2"}});
  CHECK(info.launcher == tandem::Launcher::openmpi);
  CHECK(contains(info.describe(), "also set but ignored: RANK=1, WORLD_SIZE=2"));
  // torchrun's workers started under mpirun: every worker of a node would take mpirun's rank
  CHECK_THROWS_WITH_AS(detect({{"OMPI_COMM_WORLD_RANK", "1"},
                               {"OMPI_COMM_WORLD_SIZE", "2"},
                               {"RANK", "13"},
                               {"WORLD_SIZE", "16"},
                               {"LOCAL_RANK", "5"}}),
                       doctest::Contains("the variables of two launchers disagree: OMPI_COMM_WORLD_RANK=1, "
                                         "OMPI_COMM_WORLD_SIZE=2 (Open MPI (mpirun)) and RANK=13, WORLD_SIZE=16"),
                       tandem::error);
  // torchrun's workers under Hydra's mpiexec, Flux or srun --mpi=pmi2: torchrun's variables win the order, as nested
  const auto under_pmi = detect({{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"RANK", "13"}, {"WORLD_SIZE", "16"}});
  CHECK(under_pmi.launcher == tandem::Launcher::torchrun);
  CHECK(under_pmi.rank == 13);
  CHECK(contains(under_pmi.describe(), "also set but ignored: PMI_RANK=1, PMI_SIZE=2"));
}

TEST_CASE("detect_launch: inconsistent or malformed variables name themselves") {
  CHECK_THROWS_WITH_AS(detect({{"RANK", "0"}, {"WORLD_SIZE", "4294967296"}}),
                       doctest::Contains("WORLD_SIZE is \"4294967296\", too large (at most 9 digits)"), tandem::error);
  CHECK(detect({{"RANK", "0000000002"}, {"WORLD_SIZE", "0004"}}).rank == 2);  // leading zeros are no digits of size
  CHECK_THROWS_WITH_AS(detect({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "0"}}),
                       doctest::Contains("MASTER_PORT is 0, not a TCP port (1 to 65535)"), tandem::error);
  CHECK_THROWS_WITH_AS(detect({{"RANK", "4"}, {"WORLD_SIZE", "4"}}),
                       "tandem: detect_launch (torchrun-style environment): RANK is 4 but WORLD_SIZE is 4; a rank "
                       "must be below the world size",
                       tandem::error);
  CHECK_THROWS_WITH_AS(detect({{"RANK", "1"}}), doctest::Contains("RANK is set but WORLD_SIZE is not"), tandem::error);
  CHECK_THROWS_WITH_AS(detect({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "99999"}}),
                       doctest::Contains("MASTER_PORT is 99999, not a TCP port (1 to 65535)"), tandem::error);
  CHECK(detect({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "65535"}}).master_port == 65535);
  CHECK_THROWS_WITH_AS(detect({{"PMI_RANK", "1x"}, {"PMI_SIZE", "2"}}),
                       doctest::Contains("PMI_RANK is \"1x\", not a non-negative integer"), tandem::error);
  CHECK_THROWS_WITH_AS(detect({{"OMPI_COMM_WORLD_RANK", "0"},
                               {"OMPI_COMM_WORLD_SIZE", "2"},
                               {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                               {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}),
                       doctest::Contains("OMPI_COMM_WORLD_LOCAL_RANK is 2 but OMPI_COMM_WORLD_LOCAL_SIZE is 2"),
                       tandem::error);
  CHECK_THROWS_WITH_AS(
      detect({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"}}),
      doctest::Contains("a node's process count must be in [1, world size]"), tandem::error);
  CHECK_THROWS_WITH_AS(detect({{"SLURM_PROCID", "0"},
                               {"SLURM_STEP_ID", "0"},
                               {"SLURM_NTASKS", "2"},
                               {"SLURM_NODEID", "5"},
                               {"SLURM_TASKS_PER_NODE", "2"}}),
                       doctest::Contains("SLURM_TASKS_PER_NODE is \"2\" and SLURM_NODEID is 5"), tandem::error);
}

TEST_CASE("slurm_tasks_on_node parses SLURM's compressed per-node lists") {
  using tandem::detail::slurm_tasks_on_node;
  CHECK(slurm_tasks_on_node("4", 0) == 4);
  CHECK(slurm_tasks_on_node("2(x3),1", 2) == 2);
  CHECK(slurm_tasks_on_node("2(x3),1", 3) == 1);
  CHECK(!slurm_tasks_on_node("2(x3),1", 4));
  CHECK(!slurm_tasks_on_node("2(3)", 0));
  CHECK(!slurm_tasks_on_node("", 0));
  // Malformed anywhere, also past the node asked about (they were taken up to it)
  for (const char* bad : {"2junk", "4(x2)garbage", "2,", "3(x0),1", "2(x1", ",2", "2,,1", "1234567890"}) {
    CAPTURE(bad);
    CHECK(!slurm_tasks_on_node(bad, 0));
  }
  CHECK(slurm_tasks_on_node("1(x999999999),3", 999999999) == 3);  // node counts beyond an int's sum
}

TEST_CASE("share_blob: rank 0 publishes late; three readers wait and get the same 128 bytes") {
  const std::string path = scratch_path("blob");
  std::array<std::byte, 128> id{};
  for (std::size_t i = 0; i < id.size(); ++i) id[i] = static_cast<std::byte>(i * 7 + 3);
  std::vector<std::array<std::byte, 128>> got(4);
  std::vector<std::string> errors(4);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 4; ++r)
    ranks.emplace_back([&, r] {
      try {
        std::array<std::byte, 128>& mine = got[static_cast<std::size_t>(r)];
        if (r == 0) {
          std::this_thread::sleep_for(100ms);
          mine = id;
        }
        tandem::share_blob(path, "job-17", r, mine, {.timeout = 10s, .poll_interval = 5ms});
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(errors[static_cast<std::size_t>(r)].empty());
    CHECK(got[static_cast<std::size_t>(r)] == id);
  }
  std::filesystem::remove(path);
}

TEST_CASE("wait_for_blob skips a stale file with another key, and a torn file, until the right one appears") {
  const std::string path = scratch_path("stale");
  const std::array<std::byte, 4> old_blob{std::byte{9}, std::byte{9}, std::byte{9}, std::byte{9}};
  tandem::publish_blob(path, "old-job", old_blob);
  {  // a torn copy of a valid file under another name, to check that readers reject partial files
    const auto bytes = tandem::detail::rendezvous_file("new-job", old_blob);
    std::ofstream(path + ".torn", std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), 20);
    CHECK(tandem::detail::read_rendezvous(path + ".torn", "new-job").state ==
          tandem::detail::RendezvousRead::State::unreadable);
    std::filesystem::remove(path + ".torn");
  }
  const std::array<std::byte, 4> new_blob{std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4}};
  // The waiter meets the stale file, then a torn file of the right key at the path itself (a writer that is not
  // atomic, caught half-way), then the whole one: it must wait through both, not return the torn file's bytes.
  std::thread writer([&] {
    std::this_thread::sleep_for(100ms);
    const auto bytes = tandem::detail::rendezvous_file("new-job", new_blob);
    std::filesystem::remove(path);
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), 20);
    std::this_thread::sleep_for(100ms);
    std::filesystem::remove(path);
    tandem::publish_blob(path, "new-job", new_blob);
  });
  const std::vector<std::byte> got = tandem::wait_for_blob(path, "new-job", 4, {.timeout = 10s, .poll_interval = 5ms});
  writer.join();
  CHECK(std::equal(got.begin(), got.end(), new_blob.begin(), new_blob.end()));
  std::filesystem::remove(path);
}

TEST_CASE("a key used before: rank 0 refuses and removes the file; remove_blob removes only its own key's file") {
  const std::string path = scratch_path("reused");
  const std::array<std::byte, 4> blob{std::byte{5}, std::byte{6}, std::byte{7}, std::byte{8}};
  tandem::publish_blob(path, "run-1", blob);
  CHECK_THROWS_WITH_AS(tandem::publish_blob(path, "run-1", blob),
                       doctest::Contains("already holds a rendezvous file with key \"run-1\""), tandem::error);
  CHECK(!std::filesystem::exists(path));
  tandem::publish_blob(path, "run-1", blob);  // the next run starts clean
  CHECK(!tandem::remove_blob(path, "run-2"));
  CHECK(std::filesystem::exists(path));
  CHECK(tandem::remove_blob(path, "run-1"));
  CHECK(!std::filesystem::exists(path));
  CHECK(!tandem::remove_blob(path, "run-1"));
  { std::ofstream(path) << "not a rendezvous file"; }
  CHECK(!tandem::remove_blob(path, "run-1"));  // what is not a rendezvous file of this key stays
  CHECK(std::filesystem::exists(path));
  std::filesystem::remove(path);
}

TEST_CASE("publish_blob refuses an empty key, a blob over the file limit, a path that holds another kind of file") {
  const std::string path = scratch_path("refused");
  const std::array<std::byte, 4> blob{};
  CHECK_THROWS_WITH_AS(tandem::publish_blob(path, "", blob), doctest::Contains("the key is empty"), tandem::error);
  const std::vector<std::byte> big(tandem::detail::kRendezvousMaxFile - 32);  // with the header and key: over
  CHECK_THROWS_WITH_AS(tandem::publish_blob(path, "k", big),
                       doctest::Contains("makes a rendezvous file over the 16777216 bytes readers read"),
                       tandem::error);
  CHECK(!std::filesystem::exists(path));
  const std::vector<std::byte> largest(tandem::detail::kRendezvousMaxFile -
                                       tandem::detail::rendezvous_file_bytes(1, 0));
  tandem::publish_blob(path, "k", largest);  // the largest file readers read
  CHECK(tandem::wait_for_blob(path, "k", largest.size(), {.timeout = 1s, .poll_interval = 5ms}).size() ==
        largest.size());
  CHECK(tandem::remove_blob(path, "k"));
  { std::ofstream(path) << "precious data"; }
  CHECK_THROWS_WITH_AS(tandem::publish_blob(path, "k", blob),
                       doctest::Contains("holds a file that is not a tandem rendezvous file"), tandem::error);
  std::ifstream in(path);
  CHECK(std::string(std::istreambuf_iterator<char>(in), {}) == "precious data");  // untouched
  // A damaged file of this rendezvous at the path: readers wait it out and say what they found.
  const auto bytes = tandem::detail::rendezvous_file("k", blob);
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), 34);
  CHECK_THROWS_WITH_AS(tandem::wait_for_blob(path, "k", 4, {.timeout = 50ms, .poll_interval = 5ms}),
                       doctest::Contains("a file it cannot use: its length does not match its header (truncated?)"),
                       tandem::timeout_error);
  std::filesystem::remove(path);
}

TEST_CASE("read_rendezvous: a change to any byte of a file is found; another format version; a file it cannot open") {
  using tandem::detail::read_rendezvous;
  using State = tandem::detail::RendezvousRead::State;
  const std::string path = scratch_path("damaged");
  const std::array<std::byte, 4> blob{std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4}};
  const auto good = tandem::detail::rendezvous_file("k", blob);
  const auto write = [&](const auto& bytes) {
    std::ofstream(path, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  };
  write(good);
  REQUIRE(read_rendezvous(path, "k").state == State::ready);
  for (std::size_t at = 0; at < good.size(); ++at) {  // magic, version, lengths, key, blob, checksum: none passes
    CAPTURE(at);
    auto bytes = good;
    bytes[at] ^= 0x10;
    write(bytes);
    CHECK(read_rendezvous(path, "k").state != State::ready);
  }
  auto bytes = good;
  bytes[good.size() - 9] ^= 0x01;  // the blob's last byte
  write(bytes);
  CHECK(read_rendezvous(path, "k").why == "its checksum does not match (corrupted?)");
  // Another version of the format, whole (its checksum recomputed): named, not read as this one.
  bytes = good;
  const std::uint32_t other = tandem::detail::kRendezvousVersion + 1;
  std::memcpy(bytes.data() + 8, &other, 4);
  const std::uint64_t sum = tandem::detail::rendezvous_checksum(bytes.data(), bytes.size() - 8);
  std::memcpy(bytes.data() + bytes.size() - 8, &sum, 8);
  write(bytes);
  CHECK(read_rendezvous(path, "k").why == "its format version is " + std::to_string(other) + ", not " +
                                              std::to_string(tandem::detail::kRendezvousVersion));
  // A path the system refuses to open (a file where a directory should be): said, where a missing file is waited for.
  const tandem::detail::RendezvousRead refused = read_rendezvous(path + "/inside", "k");
  CHECK(refused.state == State::unreadable);
  CHECK(refused.why == "cannot open it: Not a directory");
  CHECK_THROWS_WITH_AS(tandem::wait_for_blob(path + "/inside", "k", 4, {.timeout = 50ms, .poll_interval = 5ms}),
                       doctest::Contains("cannot open it: Not a directory"), tandem::timeout_error);
  std::filesystem::remove(path);
}

TEST_CASE("an unbounded timeout (milliseconds::max()) waits, where the sum with the clock would overflow") {
  using tandem::detail::deadline_after;
  const auto now = std::chrono::steady_clock::now();
  CHECK(deadline_after(now, std::chrono::milliseconds::max()) == std::chrono::steady_clock::time_point::max());
  CHECK(deadline_after(now, 1500ms) == now + 1500ms);
  const std::string path = scratch_path("unbounded");
  const std::array<std::byte, 4> blob{std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4}};
  std::thread writer([&] {
    std::this_thread::sleep_for(100ms);
    tandem::publish_blob(path, "k", blob);
  });
  const std::vector<std::byte> got =
      tandem::wait_for_blob(path, "k", 4, {.timeout = std::chrono::milliseconds::max(), .poll_interval = 5ms});
  writer.join();
  CHECK(std::equal(got.begin(), got.end(), blob.begin(), blob.end()));
  std::filesystem::remove(path);
}

TEST_CASE("wait_for_blob: timeouts say what was found; a size mismatch is an error") {
  const std::string path = scratch_path("timeout");
  CHECK_THROWS_WITH_AS(tandem::wait_for_blob(path, "k", 4, {.timeout = 50ms, .poll_interval = 5ms}),
                       doctest::Contains("found no file there"), tandem::timeout_error);
  // A poll interval longer than the timeout: it waits the timeout, not a whole interval (it slept the interval).
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(tandem::wait_for_blob(path, "k", 4, {.timeout = 50ms, .poll_interval = 120s}), tandem::timeout_error);
  CHECK(std::chrono::steady_clock::now() - start < 60s);
  const std::array<std::byte, 4> blob{};
  tandem::publish_blob(path, "other", blob);
  CHECK_THROWS_WITH_AS(tandem::wait_for_blob(path, "mine", 4, {.timeout = 50ms, .poll_interval = 5ms}),
                       doctest::Contains("a file with key \"other\" (left by another job?) instead of \"mine\""),
                       tandem::timeout_error);
  CHECK_THROWS_WITH_AS(tandem::wait_for_blob(path, "other", 8, {.timeout = 50ms, .poll_interval = 5ms}),
                       doctest::Contains("holds a 4-byte blob but this rank expects 8 bytes"), tandem::error);
  std::filesystem::remove(path);
  // A FIFO at the path (no writer): read without blocking, it times out saying what it found, and is never replaced.
  REQUIRE(::mkfifo(path.c_str(), 0600) == 0);
  CHECK_THROWS_WITH_AS(tandem::wait_for_blob(path, "k", 4, {.timeout = 50ms, .poll_interval = 5ms}),
                       doctest::Contains("found a file it cannot use: it is not a regular file"),
                       tandem::timeout_error);
  CHECK_THROWS_WITH_AS(tandem::publish_blob(path, "k", blob), doctest::Contains("is not a tandem rendezvous file"),
                       tandem::error);
  CHECK(std::filesystem::is_fifo(path));
  std::filesystem::remove(path);
  CHECK_THROWS_WITH_AS(tandem::publish_blob("/nonexistent-dir/x", "k", blob), doctest::Contains("cannot create"),
                       tandem::error);
}
