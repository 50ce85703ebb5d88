// SPDX-License-Identifier: Apache-2.0
// Which launcher started this process, and where it sits in the job: rank, world size, local rank and size, read
// from the variables each launcher sets. One helper, so that the MPI and NCCL bootstraps and the examples agree.
//
//   launcher   variables (rank, size / local rank, local size / extras)
//   openmpi    OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE / OMPI_COMM_WORLD_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_SIZE
//   torchrun   RANK, WORLD_SIZE / LOCAL_RANK, LOCAL_WORLD_SIZE / MASTER_ADDR, MASTER_PORT
//   pmi        PMI_RANK, PMI_SIZE (MPICH's Hydra, srun --mpi=pmi2) / MPI_LOCALRANKID, MPI_LOCALNRANKS (Hydra's);
//              inside a SLURM job step without them (srun --mpi=pmi2), SLURM_LOCALID and the step's per-node list
//   slurm      SLURM_PROCID, SLURM_STEP_NUM_TASKS (or SLURM_NTASKS) / SLURM_LOCALID, SLURM_STEP_TASKS_PER_NODE (or
//              SLURM_TASKS_PER_NODE, which srun --preserve-env leaves at the job's) at SLURM_NODEID; only inside a job
//              step (SLURM_STEP_ID set): a batch script's own environment says SLURM_PROCID=0 of all the job's tasks,
//              which is no launch at all
//
// When several launchers' variables are present (mpirun inside a SLURM allocation, torchrun inside srun), the most
// specific wins in the order above, the process-level launcher over the allocation, and describe() lists the others'
// variables that are set, local ones included, as ignored. Open MPI's and torchrun's variables that disagree throw:
// torchrun's workers started by mpirun inherit mpirun's, and which launcher started this process is not in the
// environment. Within the launcher it picks, inconsistent or malformed values (a rank not below the size, a local size
// above the world size, "3x") throw tandem::error naming the variables. With no launcher, the process is rank 0 of 1,
// local rank 0 of 1; a local rank other than 0 or a local size other than 1 with no rank and size (LOCAL_RANK=3 alone)
// throws rather than run alone.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "tandem/core/error.hpp"

namespace tandem {

enum class Launcher { none, openmpi, torchrun, pmi, slurm };

constexpr const char* launcher_name(Launcher l) {
  switch (l) {
    case Launcher::none:
      return "none";
    case Launcher::openmpi:
      return "Open MPI (mpirun)";
    case Launcher::torchrun:
      return "torchrun-style environment";
    case Launcher::pmi:
      return "PMI (MPICH Hydra, srun --mpi=pmi2)";
    case Launcher::slurm:
      return "SLURM (srun)";
  }
  return "?";
}

/// Where this process sits in the job, as its launcher told it.
struct LaunchInfo {
  Launcher launcher = Launcher::none;
  int rank = 0;
  int world_size = 1;
  std::optional<int> local_rank;  ///< rank among the processes of this node (chooses the GPU); nullopt: not told
  std::optional<int> local_size;  ///< processes on this node; nullopt: not told
  std::optional<std::string> master_addr;  ///< torchrun-style only
  std::optional<int> master_port;          ///< torchrun-style only
  std::vector<std::string> found;          ///< the variables read, as NAME=value
  std::vector<std::string> missing;        ///< variables this launcher normally sets that were absent
  std::vector<std::string> ignored;        ///< other launchers' variables, present but not used, as NAME=value

  /// One paragraph: the launcher, the values and the variables they came from, what is missing, what was ignored.
  std::string describe() const {
    std::string s;
    if (launcher == Launcher::none) {
      s = "tandem: no launcher found (looked for OMPI_COMM_WORLD_RANK/SIZE from mpirun, RANK/WORLD_SIZE from torchrun, "
          "PMI_RANK/PMI_SIZE, SLURM_PROCID in an srun job step); running as rank 0 of 1, local rank 0 of 1";
    } else {
      s = std::string("tandem: launched by ") + launcher_name(launcher) + ": rank " + std::to_string(rank) + " of " +
          std::to_string(world_size);
      s += local_rank ? ", local rank " + std::to_string(*local_rank) : std::string(", local rank unknown");
      s += local_size ? " of " + std::to_string(*local_size) : std::string(" of an unknown number");
      if (master_addr || master_port)
        s += ", master " + master_addr.value_or("?") + ":" + (master_port ? std::to_string(*master_port) : "?");
      s += " (from " + join(found) + ")";
    }
    if (!missing.empty()) s += "; missing: " + join(missing);
    if (!ignored.empty()) s += "; also set but ignored: " + join(ignored);
    return s;
  }

 private:
  static std::string join(const std::vector<std::string>& v) {
    std::string s;
    for (const std::string& x : v) s += (s.empty() ? "" : ", ") + x;
    return s;
  }
};

/// How detect_launch reads a variable: nullptr when unset. Tests pass their own.
using EnvironmentLookup = std::function<const char*(const char*)>;

namespace detail {

/// The process's own environment, the default EnvironmentLookup.
inline const char* process_environment(const char* name) { return std::getenv(name); }

/// The value of `name` as a non-negative int; throws naming the variable when it is not one.
inline std::optional<int> env_int(const EnvironmentLookup& env, const char* name, std::vector<std::string>* found) {
  const char* v = env(name);
  if (v == nullptr) return std::nullopt;
  const std::string text(v);
  const bool digits = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
  const std::size_t first = digits ? std::min(text.find_first_not_of('0'), text.size() - 1) : 0;  // (leading zeros)
  if (!digits || text.size() - first > 9)
    fail(std::string("tandem: detect_launch: ") + name + " is \"" + text + "\", " +
         (digits ? "too large (at most 9 digits)" : "not a non-negative integer") + "; fix or unset it");
  long long value = 0;
  for (std::size_t i = first; i < text.size(); ++i) value = value * 10 + (text[i] - '0');
  if (found != nullptr) found->push_back(std::string(name) + "=" + text);
  return static_cast<int>(value);
}

/// SLURM_TASKS_PER_NODE ("2(x3),1": 2 tasks on each of 3 nodes, then 1) at node `node`; nullopt when malformed
/// anywhere (read whole, also past `node`: "2junk", "2,", "3(x0)") or when it covers fewer nodes.
inline std::optional<int> slurm_tasks_on_node(const std::string& spec, int node) {
  std::size_t i = 0;
  const auto number = [&](long long& value) {  // 1 to 9 digits
    const std::size_t start = i;
    value = 0;
    while (i < spec.size() && spec[i] >= '0' && spec[i] <= '9' && i - start < 9) value = value * 10 + (spec[i++] - '0');
    return i > start;
  };
  long long at = 0;
  std::optional<int> found;
  while (true) {
    long long tasks = 0, repeat = 1;
    if (!number(tasks)) return std::nullopt;
    if (i < spec.size() && spec[i] == '(') {
      if (spec.compare(i, 2, "(x") != 0) return std::nullopt;
      i += 2;
      if (!number(repeat) || repeat == 0 || i >= spec.size() || spec[i] != ')') return std::nullopt;
      ++i;
    }
    if (!found && node < at + repeat) found = static_cast<int>(tasks);
    at += repeat;
    if (i == spec.size()) return found;
    if (spec[i] != ',') return std::nullopt;
    ++i;
  }
}

inline void check_launch(const LaunchInfo& info, const char* rank_var, const char* size_var, const char* local_rank_var,
                         const char* local_size_var) {
  const std::string who = std::string("tandem: detect_launch (") + launcher_name(info.launcher) + "): ";
  if (info.world_size < 1) fail(who + size_var + " is " + std::to_string(info.world_size) + "; it must be at least 1");
  if (info.rank >= info.world_size)
    fail(who + rank_var + " is " + std::to_string(info.rank) + " but " + size_var + " is " +
         std::to_string(info.world_size) + "; a rank must be below the world size");
  if (info.local_size && (*info.local_size < 1 || *info.local_size > info.world_size))
    fail(who + local_size_var + " is " + std::to_string(*info.local_size) + " but " + size_var + " is " +
         std::to_string(info.world_size) + "; a node's process count must be in [1, world size]");
  if (info.local_rank && info.local_size && *info.local_rank >= *info.local_size)
    fail(who + local_rank_var + " is " + std::to_string(*info.local_rank) + " but " + local_size_var + " is " +
         std::to_string(*info.local_size) + "; a local rank must be below the local size");
  if (info.local_rank && *info.local_rank >= info.world_size)
    fail(who + local_rank_var + " is " + std::to_string(*info.local_rank) + " but " + size_var + " is " +
         std::to_string(info.world_size));
}

}  // namespace detail

/// Reads the launcher's variables (see the table at the top of this header). Throws tandem::error when the launcher it
/// recognises set them inconsistently; returns Launcher::none, rank 0 of 1, when no launcher's variables are set.
inline LaunchInfo detect_launch(const EnvironmentLookup& env = detail::process_environment) {
  struct Candidate {
    Launcher launcher;
    const char *rank, *size, *size_fallback, *local_rank, *local_size;
  };
  const Candidate candidates[] = {
      {Launcher::openmpi, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", nullptr, "OMPI_COMM_WORLD_LOCAL_RANK",
       "OMPI_COMM_WORLD_LOCAL_SIZE"},
      {Launcher::torchrun, "RANK", "WORLD_SIZE", nullptr, "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
      {Launcher::pmi, "PMI_RANK", "PMI_SIZE", nullptr, "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
      {Launcher::slurm, "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_LOCALID", nullptr},
  };
  const auto present = [&](const Candidate& c) {
    if (c.launcher == Launcher::slurm) return env(c.rank) != nullptr && env("SLURM_STEP_ID") != nullptr;
    return env(c.rank) != nullptr || env(c.size) != nullptr;
  };

  LaunchInfo info;
  const Candidate* chosen = nullptr;
  for (const Candidate& c : candidates)
    if (chosen == nullptr && present(c)) chosen = &c;
  for (const Candidate& c : candidates) {  // every other launcher's variables that are set, local ones included
    if (&c == chosen) continue;
    for (const char* name : {c.rank, c.size, c.size_fallback, c.local_rank, c.local_size})
      if (const char* v = name != nullptr ? env(name) : nullptr) info.ignored.push_back(std::string(name) + "=" + v);
  }
  if (chosen == nullptr) {
    // A local rank other than 0 (or a local size other than 1) without the rank and size it belongs to: the process
    // was told it is one of several on its node but not its place in the job. Running it as rank 0 of 1 would train a
    // model of its own on device 0, beside the others, without a word. A value that is no count ("-1", "": scripts'
    // "not distributed") says nothing of the kind: listed as ignored above, as under a launcher that was found.
    const auto count = [&](const char* name) -> std::optional<int> {
      try {
        return name != nullptr ? detail::env_int(env, name, nullptr) : std::nullopt;
      } catch (const error&) {
        return std::nullopt;
      }
    };
    for (const Candidate& c : candidates)
      for (const auto& [name, alone] : {std::pair{c.local_rank, 0}, std::pair{c.local_size, 1}})
        if (const std::optional<int> v = count(name); v && *v != alone)
          detail::fail(std::string("tandem: detect_launch: ") + name + " is " + std::to_string(*v) +
                       " but no launcher set this process's rank and world size (" + c.rank + " and " + c.size +
                       (c.launcher == Launcher::slurm ? " in a job step, where srun sets SLURM_STEP_ID" : "") +
                       ", or another launcher's: docs/launching.md); set them too, or unset " + name +
                       " (to choose a GPU for a single process, set CUDA_VISIBLE_DEVICES)");
    info.local_rank = 0;  // the only process of its job
    info.local_size = 1;
    return info;
  }
  const Candidate& c = *chosen;
  info.launcher = c.launcher;

  const std::optional<int> rank = detail::env_int(env, c.rank, &info.found);
  std::optional<int> size = detail::env_int(env, c.size, &info.found);
  if (!size && c.size_fallback != nullptr) size = detail::env_int(env, c.size_fallback, &info.found);
  if (!rank || !size) {
    const std::string have = rank ? c.rank : (c.size_fallback && size ? c.size_fallback : c.size);
    const std::string lack =
        rank ? std::string(c.size) + (c.size_fallback ? std::string(" (or ") + c.size_fallback + ")" : "") : c.rank;
    detail::fail(std::string("tandem: detect_launch (") + launcher_name(c.launcher) + "): " + have + " is set but " +
                 lack + " is not; set both (or neither)");
  }
  info.rank = *rank;
  info.world_size = *size;
  // torchrun's workers started by mpirun inherit mpirun's variables, which win the order above although torchrun is
  // the launcher that started them (torchrun's own order over PMI's, and every launcher's over SLURM's, is that of the
  // nesting): where the two disagree, which one started this process is not in its environment.
  const Candidate& t = candidates[1];  // torchrun's
  if (const char* trank = env(t.rank), *tsize = env(t.size);
      c.launcher == Launcher::openmpi && trank != nullptr && tsize != nullptr &&
      (std::string(trank) != std::to_string(info.rank) || std::string(tsize) != std::to_string(info.world_size)))
    detail::fail(std::string("tandem: detect_launch: the variables of two launchers disagree: ") + c.rank + "=" +
                 std::to_string(info.rank) + ", " + c.size + "=" + std::to_string(info.world_size) + " (" +
                 launcher_name(c.launcher) + ") and " + t.rank + "=" + trank + ", " + t.size + "=" + tsize + " (" +
                 launcher_name(t.launcher) +
                 "): torchrun started by mpirun? Which one started this process is not in "
                 "its environment; unset mpirun's variables in the processes torchrun starts (`mpirun ... env -u "
                 "OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE torchrun ...`), or start the ranks with one launcher");
  // srun --mpi=pmi2 sets PMI_RANK and PMI_SIZE but not Hydra's local variables: the job step's say where it sits, when
  // the step's tasks are the PMI ranks (not a launcher's proxies started by srun).
  const auto same = [&](const char* slurm, int value) {
    const char* v = env(slurm);
    return v != nullptr && std::string(v) == std::to_string(value);
  };
  const bool pmi_in_slurm_step = c.launcher == Launcher::pmi && env(c.local_rank) == nullptr &&
                                 env("SLURM_STEP_ID") != nullptr && same("SLURM_PROCID", info.rank) &&
                                 (same("SLURM_STEP_NUM_TASKS", info.world_size) ||
                                  (env("SLURM_STEP_NUM_TASKS") == nullptr && same("SLURM_NTASKS", info.world_size)));
  const char* local_rank_var = pmi_in_slurm_step ? "SLURM_LOCALID" : c.local_rank;
  const char* local_size_var = pmi_in_slurm_step ? nullptr : c.local_size;
  if (pmi_in_slurm_step) {  // the step's variables were read, to match its tasks with the PMI ranks: not ignored
    std::erase_if(info.ignored, [](const std::string& v) { return v.starts_with("SLURM_"); });
    const char* tasks = env("SLURM_STEP_NUM_TASKS") != nullptr ? "SLURM_STEP_NUM_TASKS" : "SLURM_NTASKS";
    for (const char* name : {"SLURM_PROCID", tasks}) info.found.push_back(std::string(name) + "=" + env(name));
  }
  // The tasks of each node of the job step: srun sets SLURM_STEP_TASKS_PER_NODE always, and SLURM_TASKS_PER_NODE to
  // the same unless told to keep the caller's environment (--preserve-env: the job's list).
  const char* per_node_var =
      env("SLURM_STEP_TASKS_PER_NODE") != nullptr ? "SLURM_STEP_TASKS_PER_NODE" : "SLURM_TASKS_PER_NODE";
  info.local_rank = detail::env_int(env, local_rank_var, &info.found);
  if (!info.local_rank) info.missing.push_back(local_rank_var);
  if (local_size_var != nullptr) {
    info.local_size = detail::env_int(env, local_size_var, &info.found);
    if (!info.local_size) info.missing.push_back(local_size_var);
  } else {  // SLURM: the tasks of this node, from the per-node list
    const char* spec = env(per_node_var);
    const std::optional<int> node = detail::env_int(env, "SLURM_NODEID", &info.found);
    if (spec == nullptr) info.missing.push_back("SLURM_STEP_TASKS_PER_NODE");
    if (!node) info.missing.push_back("SLURM_NODEID");
    if (spec != nullptr && node) {
      info.found.push_back(std::string(per_node_var) + "=" + spec);
      info.local_size = detail::slurm_tasks_on_node(spec, *node);
      if (!info.local_size)
        detail::fail(std::string("tandem: detect_launch (") + launcher_name(c.launcher) + "): " + per_node_var +
                     " is \"" + spec + "\" and SLURM_NODEID is " + std::to_string(*node) +
                     "; expected a list like \"2(x3),1\" covering that node");
    }
  }
  if (c.launcher == Launcher::torchrun) {
    if (const char* addr = env("MASTER_ADDR")) {
      info.master_addr = addr;
      info.found.push_back(std::string("MASTER_ADDR=") + addr);
    } else {
      info.missing.push_back("MASTER_ADDR");
    }
    info.master_port = detail::env_int(env, "MASTER_PORT", &info.found);
    if (!info.master_port) info.missing.push_back("MASTER_PORT");
    if (info.master_port && (*info.master_port < 1 || *info.master_port > 65535))
      detail::fail("tandem: detect_launch (" + std::string(launcher_name(c.launcher)) + "): MASTER_PORT is " +
                   std::to_string(*info.master_port) + ", not a TCP port (1 to 65535); fix or unset it");
  }
  const char* size_name = env(c.size) != nullptr ? c.size : c.size_fallback;
  detail::check_launch(info, c.rank, size_name, local_rank_var, local_size_var ? local_size_var : per_node_var);
  return info;
}

/// The GPU a process uses among the `visible` ones it sees (cudaGetDeviceCount; select_device in
/// comm/nccl_bootstrap.hpp): device 0 where the launcher gave each process a GPU of its own (CUDA_VISIBLE_DEVICES set
/// and one device visible: srun --gpus-per-task=1, a container per GPU), else the device of its local rank. Throws
/// tandem::error, saying what the launcher told, when the local rank is unknown or there is no such device. (One
/// CUDA_VISIBLE_DEVICES of one device exported to every process of a node looks the same: they all take it, and NCCL
/// then refuses the duplicate GPU when they join.)
inline int device_for(const LaunchInfo& info, int visible, const EnvironmentLookup& env = detail::process_environment) {
  if (!info.local_rank)
    detail::fail("tandem: select_device: the launcher did not say this process's local rank, so its GPU is unknown (" +
                 info.describe() +
                 "); start it with a launcher that does (docs/launching.md), or call cudaSetDevice yourself");
  const char* mask = env("CUDA_VISIBLE_DEVICES");
  const std::string shown = mask != nullptr ? std::string(" (CUDA_VISIBLE_DEVICES=\"") + mask + "\")" : "";
  if (visible < 1)
    detail::fail("tandem: select_device: this process sees no GPU" + shown + " (" + info.describe() + ")");
  if (visible == 1 && mask != nullptr && *mask != '\0') return 0;
  if (*info.local_rank < visible) return *info.local_rank;
  detail::fail("tandem: select_device: local rank " + std::to_string(*info.local_rank) + " but this process sees " +
               std::to_string(visible) + " GPU(s)" + shown +
               "; start at most one process per GPU, or give each process a GPU of its own (CUDA_VISIBLE_DEVICES, srun "
               "--gpus-per-task=1) (" +
               info.describe() + ")");
}

}  // namespace tandem
