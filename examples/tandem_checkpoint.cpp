// SPDX-License-Identifier: Apache-2.0
// tandem_checkpoint: a sharded checkpoint (the directory DataParallel::save_checkpoint writes) outside a training run;
// the command line of front/checkpoint_files.hpp.
//
//   tandem_checkpoint verify DIR                    read every byte of every file and check it against its checksum;
//                                                   print the optimizer options a load restores, a group a line, and
//                                                   the program's metadata (save_checkpoint's), a key a line
//   tandem_checkpoint consolidate DIR OUT [--all]   the parameters as whole tensors in one safetensors file (--all:
//                                                   with the master weights and optimizer state), for inference or
//                                                   PyTorch
//   tandem_checkpoint import IN.safetensors DIR [--replace]
//                                                   a safetensors file as a parameters-only checkpoint, which
//                                                   DataParallel::load_checkpoint(DIR) takes as initial parameters;
//                                                   a training run's checkpoint in DIR is refused unless --replace
//   tandem_checkpoint --help                        this usage, on stdout
// (A path may not start with '-': `./-x` names such a file.)
//
// Exit codes: 0 done, 1 the checkpoint or a file is at fault (the message says which and why), 2 bad arguments.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "tandem/core/json.hpp"
#include "tandem/front/checkpoint_files.hpp"

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  // A DIR, OUT or IN that starts with '-' is a flag in the wrong place (`consolidate DIR --all` without OUT, say),
  // never a path to write: the usage, not a file named "--all".
  const auto paths = [&](std::size_t n) {
    for (std::size_t i = 1; i <= n && i < args.size(); ++i)
      if (args[i].starts_with("-")) return false;
    return true;
  };
  try {
    if (args.size() == 2 && args[0] == "verify" && paths(1)) {
      const tandem::CheckpointSummary s = tandem::verify_checkpoint(args[1]);
      const tandem::CheckpointManifest& m = s.manifest;
      const std::string skipped =
          m.skipped_steps == 0 ? "" : " (" + std::to_string(m.skipped_steps) + " more skipped: non-finite gradients)";
      std::printf("%s: step %llu%s, saved by %s at %u ranks, %zu %s tensors%s, %zu files, %llu bytes: verified\n",
                  args[1].c_str(), static_cast<unsigned long long>(m.step), skipped.c_str(), m.policy.c_str(),
                  m.world_size, m.tensors.size(), tandem::dtype_name(m.param_dtype),
                  m.parameters_only ? " (parameters only)" : "", m.files.size(),
                  static_cast<unsigned long long>(s.bytes));
      for (std::size_t g = 0; g < m.optimizer_groups.size(); ++g) {  // the options a load restores
        std::string line =
            m.optimizer_groups.size() == 1
                ? "  " + m.optimizer + " options:"
                : "  " + m.optimizer + " group " + std::to_string(g) + " (" +
                      std::to_string(std::count(m.optimizer_group_of.begin(), m.optimizer_group_of.end(), g)) +
                      " tensors):";
        for (const auto& [name, value] : m.optimizer_groups[g])
          line += " " + name + " " + tandem::detail::json::number(value);
        std::printf("%s\n", line.c_str());
      }
      for (const auto& [key, value] : m.metadata)  // the program's records, as JSON strings (any text prints)
        std::printf("  metadata %s: %s\n", tandem::detail::json::quote(key).c_str(),
                    tandem::detail::json::quote(value).c_str());
      return 0;
    }
    if ((args.size() == 3 || (args.size() == 4 && args[3] == "--all")) && args[0] == "consolidate" && paths(2)) {
      const bool all = args.size() == 4;
      const std::uint64_t bytes =
          tandem::consolidate_checkpoint(args[1], args[2], all ? tandem::Arrays::all : tandem::Arrays::parameters);
      std::printf("%s: %s of %s, %llu bytes\n", args[2].c_str(),
                  all ? "the parameters, master weights and optimizer state" : "the parameters", args[1].c_str(),
                  static_cast<unsigned long long>(bytes));
      return 0;
    }
    if ((args.size() == 3 || (args.size() == 4 && args[3] == "--replace")) && args[0] == "import" && paths(2)) {
      const tandem::CheckpointManifest m = tandem::import_parameters(
          args[1], args[2],
          args.size() == 4 ? tandem::ExistingCheckpoint::replace : tandem::ExistingCheckpoint::refuse);
      std::printf("%s: the %zu %s tensors of %s, as a parameters-only checkpoint\n", args[2].c_str(), m.tensors.size(),
                  tandem::dtype_name(m.param_dtype), args[1].c_str());
      return 0;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tandem_checkpoint: %s\n", e.what());
    return 1;
  }
  const bool help = args.size() == 1 && (args[0] == "--help" || args[0] == "-h");
  std::fprintf(help ? stdout : stderr,
               "usage: tandem_checkpoint verify DIR\n"
               "       tandem_checkpoint consolidate DIR OUT.safetensors [--all]\n"
               "       tandem_checkpoint import IN.safetensors DIR [--replace]\n");
  return help ? 0 : 2;
}
