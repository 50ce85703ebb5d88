// SPDX-License-Identifier: Apache-2.0
// Working with sharded checkpoints outside a training run (the tool examples/tandem_checkpoint is their command line):
//
//   verify_checkpoint(dir)                     every file's size and header checksum against the manifest, every
//                                              tensor's data against its file, every slice the saving plan cut, and
//                                              the optimizer options recorded (AdamW's, SGD's) as a load checks them
//   consolidate_checkpoint(dir, out, arrays)   the parameters as whole tensors in one safetensors file (with
//                                              Arrays::all also "master/<name>" and "state<k>/<name>"), for inference,
//                                              PyTorch or anything else that reads safetensors; the optimizer's
//                                              options and the program's metadata in the file's ("metadata/<key>")
//   import_parameters(in, dir[, existing])     a safetensors file as a parameters-only checkpoint, which
//                                              DataParallel::load_checkpoint takes as the initial parameters (a
//                                              training run's checkpoint in dir is kept unless told to replace it)
//   checkpoint_digest(dir)                     a checksum of the whole state, whatever files hold it
//
// Each streams its tensors through a few MiB of host memory, checking every slice against its checksum; none holds a
// whole model. Each throws tandem::error naming the first fault.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "tandem/backend/host.hpp"
#include "tandem/core/checkpoint_manifest.hpp"
#include "tandem/core/crc32c.hpp"
#include "tandem/core/safetensors.hpp"
#include "tandem/core/tensor.hpp"
#include "tandem/front/detail/checkpoint_io.hpp"
#include "tandem/kernels/adamw.hpp"
#include "tandem/kernels/sgd.hpp"

namespace tandem {

/// What verify_checkpoint found.
struct CheckpointSummary {
  CheckpointManifest manifest;
  std::uint64_t bytes = 0;  ///< of all its files
};

/// Which arrays consolidate_checkpoint writes.
enum class Arrays {
  parameters,  ///< the parameters only (named as the model's tensors)
  all          ///< also the master weights and optimizer state ("master/<name>", "state<k>/<name>")
};

/// The manifest of the checkpoint in `dir` (its step, the world size, policy and optimizer that saved it, the
/// optimizer options a load restores, unchecked, the parameters' dtype, the tensors, the program's metadata), from
/// manifest.json alone: no shard file is opened (so this
/// says nothing of them; verify_checkpoint reads them). Reads on this process, with no collective, so that a program
/// can look at a checkpoint before it constructs the DataParallel that loads it (to train in the dtype it holds, or to
/// refuse options that would not continue its run). Throws tandem::error where `dir` holds no checkpoint or its
/// manifest does not read. The manifest is replaced whole by a save (atomically), so it is always one save's.
TANDEM_COLD inline CheckpointManifest read_checkpoint_manifest(const std::string& dir) {
  return detail::read_manifest(dir);
}

/// Checks the checkpoint in `dir` whole (every byte of every file is read, and the optimizer options recorded, of
/// AdamW or SGD, as load_checkpoint checks them); returns its manifest and size. Where a
/// save replaces the checkpoint meanwhile, it checks the new one (detail::read_while_saves_replace).
TANDEM_COLD inline CheckpointSummary verify_checkpoint(const std::string& dir) {
  return detail::read_while_saves_replace(dir, "verify", [&](const CheckpointManifest& m) {
    // the optimizer options, as a load checks them (the manifest has no checksum: its fingerprint covers them)
    if (m.optimizer == std::string_view(AdamW::name))
      (void)detail::recorded_groups<AdamW>(m, dir, m.state_count);
    else if (m.optimizer == std::string_view(SGD::name))
      (void)detail::recorded_groups<SGD>(m, dir, m.state_count);
    CheckpointSummary summary{m, 0};
    std::vector<unsigned char> chunk(detail::checkpoint_chunk_bytes);
    for (const CheckpointManifest::File& f : m.files) {
      const SafetensorsFile file(dir + "/" + f.name);
      if (file.size() != f.bytes)
        file.corrupt("it is " + std::to_string(file.size()) + " bytes long; the manifest says " +
                     std::to_string(f.bytes));
      if (file.header_crc() != f.header_crc) file.corrupt("its header's checksum does not match the manifest's");
      for (const SafetensorsFile::Tensor& t : file.tensors()) {  // the header's checksums cover the data
        std::uint32_t recorded = 0, crc = 0;
        if (!file.recorded_crc(t.name, recorded))
          file.corrupt(detail::naming("it records no checksum for ", t.name, ""));
        for (std::uint64_t at = t.begin; at < t.end; at += chunk.size()) {
          const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(chunk.size(), t.end - at));
          file.read(at, chunk.data(), n);
          crc = detail::crc32c(chunk.data(), n, crc);
        }
        if (crc != recorded) file.corrupt(detail::naming("the checksum of ", t.name, " does not match its data"));
      }
      summary.bytes += f.bytes;
    }
    // Every slice of every array of every tensor is where the saving plan put it.
    detail::ShardedCheckpoint ckpt(dir, m, Layout(m.tensors));
    const HostBackend host;
    for (const detail::CheckpointArray& a : detail::arrays_of(m))
      for (std::size_t i = 0; i < m.tensors.size(); ++i)
        ckpt.read(host, a, i, m.tensors[i], 0, m.tensors[i].numel, nullptr, chunk);
    return summary;
  });
}

/// Throws tandem::error where `dir` holds what save_checkpoint of the tensors `tensors` (a DataParallel's
/// `layout().tensors()`) would refuse to replace: the checkpoint of other tensors, or a manifest.json that does not
/// read. Reads only, on this process, with no collective: a program checks before it trains what a save after training
/// would refuse (a `dir` without a checkpoint, or not there yet, passes).
TANDEM_COLD inline void check_save_target(const std::string& dir, const std::vector<TensorSpec>& tensors) {
  detail::check_replaceable(dir, tensors);
}

/// The CRC-32C of every array of every tensor of the checkpoint in `dir`, whole, in layout order: the bytes
/// consolidate_checkpoint(dir, out, Arrays::all) writes as its data: bitwise-equal states (the same parameters, master
/// weights and optimizer state) give equal digests, whatever world size, policy and files saved them, and states that
/// differ give different ones but for a chance of 2^-32 (a CRC-32C; the names and the step are not in it). Where a
/// save replaces the checkpoint meanwhile, it is the new one's (detail::read_while_saves_replace).
TANDEM_COLD inline std::uint32_t checkpoint_digest(const std::string& dir) {
  return detail::read_while_saves_replace(dir, "digest", [&](const CheckpointManifest& m) {
    detail::ShardedCheckpoint ckpt(dir, m, Layout(m.tensors));
    std::vector<unsigned char> chunk(detail::checkpoint_chunk_bytes);
    std::uint32_t crc = 0;
    for (const detail::CheckpointArray& a : detail::arrays_of(m))
      for (std::size_t i = 0; i < m.tensors.size(); ++i)
        ckpt.stream(a, i, m.tensors[i], chunk,
                    [&](const unsigned char* p, std::size_t n) { crc = detail::crc32c(p, n, crc); });
    return crc;
  });
}

namespace detail {

/// Throws tandem::error where the path `out` is the directory `dir` or lies inside it, symbolic links resolved: a file
/// written there would replace the checkpoint's manifest or a shard while it is read, or sit among its files.
TANDEM_COLD inline void check_outside(const std::string& dir, const std::string& out, const char* what) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path d = fs::weakly_canonical(dir, ec);
  if (ec) return;  // nothing to compare with: the read of the checkpoint says what is wrong with `dir`
  const fs::path o = fs::weakly_canonical(out, ec);
  if (ec) return;
  for (fs::path p = o; !p.empty(); p = p.parent_path()) {
    if (p == d)
      fail(std::string("tandem: ") + what + ": `" + out + "` is inside the checkpoint directory `" + dir +
           "`, which it reads; write it elsewhere. Nothing was changed");
    if (p == p.parent_path()) break;
  }
}

/// Throws tandem::error where the safetensors file `in` holds a tensor `<name>` beside `master/<name>` or
/// `state<k>/<name>`: consolidate_checkpoint's Arrays::all, whose extra arrays are no model's parameters.
TANDEM_COLD inline void check_not_all_arrays(const SafetensorsFile& file, const std::string& in) {
  std::vector<std::string_view> names;
  for (const SafetensorsFile::Tensor& t : file.tensors()) names.push_back(t.name);
  std::sort(names.begin(), names.end());
  const auto held = [&](std::string_view name) { return std::binary_search(names.begin(), names.end(), name); };
  for (const std::string_view name : names) {
    std::size_t prefix = 0;
    if (name.starts_with("master/")) {
      prefix = 7;
    } else if (name.starts_with("state")) {
      std::size_t at = 5;
      while (at < name.size() && name[at] >= '0' && name[at] <= '9') ++at;
      if (at > 5 && at < name.size() && name[at] == '/') prefix = at + 1;
    }
    if (prefix != 0 && held(name.substr(prefix)))
      fail("tandem: import_parameters: `" + in + "` holds " + naming("", name, " beside ") +
           naming("", name.substr(prefix), "") +
           ": the master weights or optimizer state of a file of every array (consolidate_checkpoint with "
           "Arrays::all, tandem_checkpoint consolidate --all), which no model's parameters are; import a file of "
           "the parameters alone (consolidate without --all). Nothing was changed");
  }
}

}  // namespace detail

/// Writes the checkpoint in `dir` to the safetensors file `out` (atomically), every tensor whole and 1-D, each array
/// checked against its checksums as it is read; the file's metadata records the step, the policy, the optimizer, its
/// options as the manifest holds them (JSON: "tandem_optimizer_groups" and, with more than one group,
/// "tandem_optimizer_group_of", each tensor's group in the order of the file's tensors) and the program's metadata
/// ("metadata/<key>"). Returns the number of bytes written. `out` may not lie inside `dir`.
/// Where a save replaces the checkpoint meanwhile, it writes the new one (detail::read_while_saves_replace).
TANDEM_COLD inline std::uint64_t consolidate_checkpoint(const std::string& dir, const std::string& out,
                                                        Arrays which = Arrays::parameters) {
  detail::check_outside(dir, out, "consolidate_checkpoint");
  return detail::read_while_saves_replace(dir, "consolidate", [&](const CheckpointManifest& m) {
    std::vector<detail::CheckpointArray> arrays = detail::arrays_of(m);
    if (which == Arrays::parameters) arrays.resize(1);
    std::vector<std::pair<std::string, std::string>> metadata = {{"format", "pt"},
                                                                 {detail::safetensors_step_key, std::to_string(m.step)},
                                                                 {"tandem_policy", m.policy},
                                                                 {"tandem_optimizer", m.optimizer}};
    if (!m.optimizer_groups.empty())  // the options a load would restore, as the manifest holds them (JSON)
      metadata.emplace_back("tandem_optimizer_groups", detail::optimizer_groups_json(m.optimizer_groups));
    if (!m.optimizer_group_of.empty())
      metadata.emplace_back("tandem_optimizer_group_of", detail::group_of_json(m.optimizer_group_of));
    for (const auto& [key, value] : m.metadata)
      metadata.emplace_back(std::string(detail::shard_metadata_prefix) + key, value);
    // The output's failures are not the checkpoint's: a save meanwhile is no reason to write it again.
    const auto output = [](auto&& f) -> decltype(auto) {
      try {
        return f();
      } catch (const error& e) {
        throw detail::OutputFailure{e};
      }
    };
    SafetensorsWriter writer = output([&] {
      return SafetensorsWriter(out, detail::whole_entries(m.tensors, arrays), std::move(metadata),
                               "the consolidated file");
    });
    detail::ShardedCheckpoint ckpt(dir, m, Layout(m.tensors));
    std::vector<unsigned char> chunk(detail::checkpoint_chunk_bytes);
    for (const detail::CheckpointArray& a : arrays)
      for (std::size_t i = 0; i < m.tensors.size(); ++i)
        ckpt.stream(a, i, m.tensors[i], chunk,
                    [&](const unsigned char* p, std::size_t n) { output([&] { writer.data(p, n); }); });
    return output([&] { return writer.commit().bytes; });
  });
}

/// What import_parameters does where `dir` already holds a checkpoint with optimizer state (a training run's).
enum class ExistingCheckpoint {
  refuse,  ///< throw tandem::error and change nothing (a parameters-only checkpoint there is replaced)
  replace  ///< replace it: its files are removed once the imported checkpoint is complete
};

/// Makes the safetensors file `in` (all of its tensors of one dtype: F32, BF16 or F16; any shapes, flattened) a
/// parameters-only checkpoint in `dir`, replacing a parameters-only checkpoint there. Where `dir` holds a training
/// run's checkpoint (optimizer state, or a manifest.json that does not read), it throws and changes nothing unless
/// `existing` is ExistingCheckpoint::replace. A file of every array (consolidate_checkpoint's Arrays::all: a tensor
/// `<name>` beside `master/<name>` or `state<k>/<name>`) is refused: no model has those tensors, so no
/// load_checkpoint could take the checkpoint. Returns the new manifest. Where only the flush of the directory fails
/// after the imported file's rename, it throws and leaves that file, which no manifest names (the next save or import
/// there removes it).
TANDEM_COLD inline CheckpointManifest import_parameters(const std::string& in, const std::string& dir,
                                                        ExistingCheckpoint existing = ExistingCheckpoint::refuse) {
  // Checked before anything changes, and again under the directory's lock (no save commits between it and the import).
  const auto refuse_training_checkpoint = [&] {
    if (existing == ExistingCheckpoint::refuse && std::filesystem::exists(dir + "/" + detail::manifest_name)) {
      std::string held;
      try {
        const CheckpointManifest old = detail::read_manifest(dir);
        if (!old.parameters_only)
          held = "a training checkpoint (step " + std::to_string(old.step) + ", " + old.policy + " at " +
                 std::to_string(old.world_size) + " ranks, with " + old.optimizer + " state)";
      } catch (const error& e) {
        held = std::string("a manifest.json that does not read (") + e.what() + ")";
      }
      if (!held.empty())
        detail::fail("tandem: import_parameters: `" + dir + "` holds " + held +
                     ", which the import would replace; import into another directory, or pass "
                     "ExistingCheckpoint::replace (tandem_checkpoint import --replace). Nothing was changed");
    }
  };
  refuse_training_checkpoint();
  const SafetensorsFile file(in);
  if (file.tensors().empty()) file.corrupt("it holds no tensors");
  detail::check_not_all_arrays(file, in);
  CheckpointManifest m;
  m.policy = "imported";
  m.param_dtype = file.tensors()[0].dtype;
  m.parameters_only = true;
  std::vector<SafetensorsEntry> entries;
  for (const SafetensorsFile::Tensor& t : file.tensors()) {
    if (t.dtype != m.param_dtype || t.dtype == DType::fp64)
      detail::fail(
          "tandem: import_parameters: `" + in + "` holds " + safetensors_dtype(t.dtype) +
          detail::naming(" tensor ", t.name, "") +
          (t.dtype == m.param_dtype ? "" : std::string(" beside ") + safetensors_dtype(m.param_dtype) + " ones") +
          "; a model's parameters share one dtype of F32, BF16 or F16");
    m.tensors.push_back({std::string(t.name), static_cast<std::size_t>(t.count()), t.dtype});
    entries.push_back({std::string(t.name), t.dtype, t.count()});
  }
  detail::create_directories_durably(dir);
  const detail::SaveLock lock(dir, "import_parameters");
  refuse_training_checkpoint();
  const std::string name = "parameters-" + detail::hex16(detail::new_save_id()) + ".safetensors";
  SafetensorsWriter writer(dir + "/" + name, std::move(entries), {{"format", detail::safetensors_shard_format}},
                           "the imported parameters");
  std::vector<unsigned char> chunk(detail::checkpoint_chunk_bytes);
  for (const SafetensorsFile::Tensor& t : file.tensors()) {  // in the header's order, as the writer declared them
    std::uint32_t crc = 0;  // where the file records the tensor's checksum (tandem's files do), checked as it is read
    for (std::uint64_t at = t.begin; at < t.end; at += chunk.size()) {
      const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(chunk.size(), t.end - at));
      file.read(at, chunk.data(), n);
      if (t.has_crc) crc = detail::crc32c(chunk.data(), n, crc);
      writer.data(chunk.data(), n);
    }
    if (t.has_crc && crc != t.crc) detail::checksum_mismatch(file, t.name, crc, t.crc);
  }
  const SafetensorsSummary s = writer.commit();
  m.files.push_back({name, s.bytes, s.header_crc});
  detail::commit_manifest(dir, m);
  return m;
}

}  // namespace tandem
