// SPDX-License-Identifier: Apache-2.0
// A sharded checkpoint is a directory: one safetensors file per rank of the group that saved it, and manifest.json,
// written last, which names them. The manifest is the set: a checkpoint exists once its manifest is renamed into
// place, so a save that crashes leaves the previous manifest, and the files it names, as they were.
//
//   manifest.json      {"format": "tandem-checkpoint", "version": 2, "step": 120, "skipped_steps": 3,
//                       "policy": "GradientSharded", "world_size": 4, "optimizer": "AdamW", "optimizer_fingerprint":
//                       "9f3c...", "state_count": 2, "param_dtype": "bf16", "bucket_cap_bytes": ...,
//                       "first_bucket_cap_bytes": ..., "parameters_only": false,
//                       "optimizer_groups": [{"lr": 0.001, "beta1": 0.9, ...}, ...], "optimizer_group_of": [0, 1, ...],
//                       "metadata": {"data_seed": "7", ...},
//                       "tensors": [{"name": ..., "numel": ..., "dtype": ...}, ...],
//                       "files": [{"name": ..., "bytes": ..., "header_crc32c": "1a2b3c4d"}, ...]}
//   <files[r].name>    rank r's part: for every bucket of the saving plan (its tensor list, its world size and bucket
//                      caps), shard r of it, cut at tensor boundaries into 1-D tensors:
//                        "<name>" or "<name>[b:e]"          the parameters (elements [b, e) of tensor <name>)
//                        "master/<name>..."                 the fp32 master weights (16-bit parameters only)
//                        "state<k>/<name>..."               optimizer state array k (fp32)
//                      each with its CRC-32C in the file's metadata, which also records the step and the
//                      program's metadata ("metadata/<key>"), so that the manifest's record of the header's checksum
//                      covers them (a manifest without "metadata", of a save before it, holds none).
// "optimizer_groups" holds the options of each optimizer group by name, and "optimizer_group_of" each tensor's group
// (written where there is more than one group); a manifest of a save before they were recorded holds neither. Their
// values reproduce "optimizer_fingerprint", which the load checks (the manifest has no checksum of its own).
// A parameters-only checkpoint (tandem_checkpoint import) holds only the parameters, whole, in one file, tensors in any
// order; loading it sets the parameters, derives the master weights and starts the optimizer state and step at zero.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "tandem/core/dtype.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/hash.hpp"
#include "tandem/core/json.hpp"
#include "tandem/core/tensor.hpp"

namespace tandem {

/// A program's own records, kept with a checkpoint beside the training state (DataParallel::save_checkpoint takes them,
/// load_checkpoint returns them): keys and values of UTF-8 text, e.g. the options that chose the program's data, or its
/// data loader's position. Keys are not empty; keys and values together are at most checkpoint_max_metadata_bytes.
using CheckpointMetadata = std::map<std::string, std::string>;

/// The most bytes of keys and values a checkpoint's metadata holds (every shard file of a save repeats them): records,
/// not state; state belongs in tensors.
inline constexpr std::size_t checkpoint_max_metadata_bytes = std::size_t{1} << 20;

/// One optimizer group's options by name, in the optimizer's order (OptionsNamed), each value as a double (an
/// enumeration's as its number).
using OptimizerOptionValues = std::vector<std::pair<std::string, double>>;

struct CheckpointManifest {
  struct File {
    std::string name;  ///< relative to the checkpoint's directory
    std::uint64_t bytes = 0;
    std::uint32_t header_crc = 0;  ///< CRC-32C of the file's header, which records each tensor's CRC-32C
  };
  std::uint64_t step = 0;
  /// Optimizer steps skipped for non-finite gradients before the save (DataParallel::skipped_steps(); 0 in a manifest
  /// of a save before it was recorded). A record of the run, beside the step, outside the shards' checksums.
  std::uint64_t skipped_steps = 0;
  std::string policy;  ///< the policy that saved it (informational: any policy loads it)
  std::uint32_t world_size = 1;
  std::string optimizer;  ///< empty for a parameters-only checkpoint
  std::uint64_t optimizer_fingerprint = 0;
  std::uint32_t state_count = 0;
  DType param_dtype = DType::fp32;
  std::uint64_t bucket_cap_bytes = 0, first_bucket_cap_bytes = 0;  ///< the saving plan's caps
  bool parameters_only = false;
  /// The optimizer options at the save, one list per optimizer group (DataParallel::optimizer_options(g)), which
  /// load_checkpoint restores. Empty in a parameters-only checkpoint, in one saved before they were recorded, and in
  /// one of an optimizer whose options have no names.
  std::vector<OptimizerOptionValues> optimizer_groups;
  /// Each tensor's optimizer group, in the order of `tensors`; empty where there is one group.
  std::vector<std::uint32_t> optimizer_group_of;
  CheckpointMetadata metadata;  ///< the program's (empty in a checkpoint saved without, or before there was any)
  std::vector<TensorSpec> tensors;
  std::vector<File> files;
};

namespace detail {

inline constexpr const char* manifest_name = "manifest.json";
inline constexpr std::uint64_t manifest_version = 2;
/// The prefix of the metadata keys of a shard file that record the program's metadata (CheckpointMetadata).
inline constexpr std::string_view shard_metadata_prefix = "metadata/";

/// Throws tandem::error (its message begins with `what`) unless `metadata` can be a checkpoint's: no empty key, UTF-8
/// throughout, at most checkpoint_max_metadata_bytes in all.
TANDEM_COLD inline void check_checkpoint_metadata(const CheckpointMetadata& metadata, const std::string& what) {
  std::size_t bytes = 0;
  for (const auto& [key, value] : metadata) {
    if (key.empty()) fail(what + "has an empty key");
    for (const std::string* text : {&key, &value})
      if (const std::size_t valid = json::utf8_prefix(*text); valid != text->size())
        fail(what + (text == &key ? "has a key" : "has the value of `" + key + "`") + " that is not UTF-8 from byte " +
             std::to_string(valid) + " on");
    bytes += key.size() + value.size();
  }
  if (bytes > checkpoint_max_metadata_bytes)
    fail(what + "holds " + std::to_string(bytes) + " bytes of keys and values; a checkpoint's metadata holds at most " +
         std::to_string(checkpoint_max_metadata_bytes) + " (records, not state: keep state in tensors)");
}

/// Optimizer groups' options as JSON, as the manifest's "optimizer_groups" holds them: [{"lr": 0.001, ...}, ...].
inline std::string optimizer_groups_json(const std::vector<OptimizerOptionValues>& groups) {
  std::string s = "[";
  for (std::size_t g = 0; g < groups.size(); ++g) {
    s += g == 0 ? "{" : ", {";
    for (std::size_t k = 0; k < groups[g].size(); ++k)
      s += (k == 0 ? "" : ", ") + json::quote(groups[g][k].first) + ": " + json::number(groups[g][k].second);
    s += "}";
  }
  return s + "]";
}

/// Each tensor's optimizer group as JSON, as the manifest's "optimizer_group_of" holds it: [0, 1, ...].
inline std::string group_of_json(const std::vector<std::uint32_t>& group_of) {
  std::string s = "[";
  for (std::size_t i = 0; i < group_of.size(); ++i) s += (i == 0 ? "" : ", ") + std::to_string(group_of[i]);
  return s + "]";
}

/// The manifest as JSON (one tensor and one file per line).
inline std::string manifest_json(const CheckpointManifest& m) {
  using json::quote;
  std::string s = "{\"format\": \"tandem-checkpoint\", \"version\": " + std::to_string(manifest_version) +
                  ", \"step\": " + std::to_string(m.step) + ", \"skipped_steps\": " + std::to_string(m.skipped_steps) +
                  ", \"policy\": " + quote(m.policy) + ", \"world_size\": " + std::to_string(m.world_size) +
                  ", \"optimizer\": " + quote(m.optimizer) + ", \"optimizer_fingerprint\": \"" +
                  hex16(m.optimizer_fingerprint) + "\", \"state_count\": " + std::to_string(m.state_count) +
                  ", \"param_dtype\": \"" + dtype_name(m.param_dtype) +
                  "\", \"bucket_cap_bytes\": " + std::to_string(m.bucket_cap_bytes) +
                  ", \"first_bucket_cap_bytes\": " + std::to_string(m.first_bucket_cap_bytes) +
                  ", \"parameters_only\": " + (m.parameters_only ? "true" : "false");
  if (!m.optimizer_groups.empty()) s += ",\n \"optimizer_groups\": " + optimizer_groups_json(m.optimizer_groups);
  if (!m.optimizer_group_of.empty()) s += ",\n \"optimizer_group_of\": " + group_of_json(m.optimizer_group_of);
  s += ",\n \"metadata\": {";
  for (auto it = m.metadata.begin(); it != m.metadata.end(); ++it)
    s += (it == m.metadata.begin() ? "" : ", ") + quote(it->first) + ": " + quote(it->second);
  s += "},\n \"tensors\": [";
  for (std::size_t i = 0; i < m.tensors.size(); ++i)
    s += std::string(i == 0 ? "\n" : ",\n") + "  {\"name\": " + quote(m.tensors[i].name) +
         ", \"numel\": " + std::to_string(m.tensors[i].numel) + ", \"dtype\": \"" + dtype_name(m.tensors[i].dtype) +
         "\"}";
  s += "],\n \"files\": [";
  for (std::size_t i = 0; i < m.files.size(); ++i) {
    s += std::string(i == 0 ? "\n" : ",\n") + "  {\"name\": " + quote(m.files[i].name) +
         ", \"bytes\": " + std::to_string(m.files[i].bytes) + ", \"header_crc32c\": \"" + hex8(m.files[i].header_crc) +
         "\"}";
  }
  return s + "]}\n";
}

/// A dtype from its name ("fp32", "bf16", "fp16", "fp64"), or false.
inline bool dtype_from_name(const std::string& name, DType& out) {
  for (DType t : {DType::fp32, DType::bf16, DType::fp16, DType::fp64})
    if (name == dtype_name(t)) {
      out = t;
      return true;
    }
  return false;
}

/// Parses and checks a manifest; `path` names it in errors. Its two lists (the tensors, the files: tens of thousands of
/// entries for a large layout) are read as a stream, each entry straight into its struct; the other members, a few,
/// as JSON values.
inline CheckpointManifest parse_manifest(const std::string& text, const std::string& path) {
  using json::Value;
  const std::string where = "tandem: the checkpoint manifest `" + path + "` ";
  auto bad = [&](const std::string& why) -> void { fail(where + why); };
  auto lacks = [&](const char* key) { bad(std::string("lacks `") + key + "` or it has the wrong type"); };
  // One entry of a list: an object of scalar members, each looked for by the caller (a string, a count, or missing).
  struct Entry {
    std::string strings[3];
    std::uint64_t counts[3] = {0, 0, 0};
    bool have_string[3] = {false, false, false}, have_count[3] = {false, false, false},
         not_count[3] = {false, false, false};
  };
  json::Parser p(text, "the checkpoint manifest `" + path + "`");
  // An entry in the form manifest_json writes it, {"k0": v0, "k1": v1, "k2": v2}, each value a string or a count:
  // matched byte for byte into e; anything else leaves the cursor where it was (false), for the general path below.
  auto as_written = [&](const char* const(&keys)[3], Entry& e) {
    const std::size_t mark = p.position();
    for (std::size_t k = 0; k < 3; ++k) {
      bool ok = p.take(k == 0 ? "{\"" : ", \"") && p.take(keys[k]) && p.take("\": ");
      if (ok && p.take_count(e.counts[k]))
        e.have_count[k] = true;
      else if (ok && p.next() == '"')
        e.have_string[k] = true, e.strings[k] = p.string();
      else
        ok = false;
      if (!ok) {
        p.rewind(mark);
        e = Entry{};
        return false;
      }
    }
    return p.take("}") || (p.rewind(mark), e = Entry{}, false);
  };
  // (What is not a list of objects is read whole and left empty, to fail in the checks below, in their order.)
  auto entries = [&](const char* const(&keys)[3], std::deque<Entry>& out) {
    if (p.next() != '[') {
      (void)p.value(1);
      return false;
    }
    p.array([&] {
      Entry e;
      if (p.next() == '{' && as_written(keys, e)) {
        out.push_back(std::move(e));
        return;
      }
      if (p.next() != '{') {
        (void)p.value(2);
        out.push_back(e);
        return;
      }
      p.object([&](std::string_view key) {
        std::size_t k = 0;
        while (k < 3 && key != keys[k]) ++k;
        const char c = p.next();
        if (k < 3 && c == '"' && !e.have_string[k] && !e.have_count[k]) {
          e.strings[k] = p.string();
          e.have_string[k] = true;
        } else if (k < 3 && ((c >= '0' && c <= '9') || c == '-') && !e.have_string[k] && !e.have_count[k]) {
          e.not_count[k] = !p.count(e.counts[k], 3);  // (a number, but not a count: implausible)
          e.have_count[k] = true;
        } else {
          (void)p.value(3);  // a member of no use here (or a repeated one: the first counts)
        }
      });
      out.push_back(std::move(e));
    });
    return true;
  };
  Value root;  // the members other than the two lists
  root.kind = Value::Kind::object;
  std::deque<Entry> tensors, files;  // (a deque: entries are not moved as it grows)
  bool seen_tensors = false, seen_files = false, have_tensors = false, have_files = false;
  if (p.next() != '{') {  // JSON, but not an object: no member of a manifest (or not JSON: that error)
    (void)p.value(0);
    p.finish();
    lacks("format");
  }
  p.object([&](std::string_view key) {
    if (key == "tensors" && !seen_tensors) {
      seen_tensors = true;
      have_tensors = entries({"name", "numel", "dtype"}, tensors);
    } else if (key == "files" && !seen_files) {
      seen_files = true;
      have_files = entries({"name", "bytes", "header_crc32c"}, files);
    } else {
      root.members.push_back({std::string(key), p.value(1)});
    }
  });
  p.finish();
  auto member = [&](const Value& object, const char* key, Value::Kind kind) -> const Value& {
    const Value* v = object.find(key);
    if (v == nullptr || v->kind != kind) lacks(key);
    return *v;
  };
  auto count = [&](const Value& object, const char* key, std::uint64_t max) {
    const Value& v = member(object, key, Value::Kind::number);
    if (!v.is_count || v.count > max) bad(std::string("has an implausible `") + key + "`");
    return v.count;
  };
  auto hex = [&](const std::string& text, const char* key, std::size_t digits) {
    std::uint64_t v = 0;
    if (!parse_hex(text, digits, v)) bad(std::string("has a malformed `") + key + "`");
    return v;
  };
  auto entry_string = [&](const Entry& e, std::size_t k, const char* key) -> const std::string& {
    if (!e.have_string[k]) lacks(key);
    return e.strings[k];
  };
  auto entry_count = [&](const Entry& e, std::size_t k, const char* key, std::uint64_t max) {
    if (!e.have_count[k]) lacks(key);
    if (e.not_count[k] || e.counts[k] > max) bad(std::string("has an implausible `") + key + "`");
    return e.counts[k];
  };
  if (member(root, "format", Value::Kind::string).string != "tandem-checkpoint")
    bad("is not a tandem checkpoint manifest");
  const std::uint64_t version = count(root, "version", UINT32_MAX);
  if (version != manifest_version)
    fail(where + "has format version " + std::to_string(version) + "; this tandem reads version " +
         std::to_string(manifest_version));
  CheckpointManifest m;
  m.step = count(root, "step", UINT64_MAX);
  if (root.find("skipped_steps") != nullptr) m.skipped_steps = count(root, "skipped_steps", UINT64_MAX);
  m.policy = member(root, "policy", Value::Kind::string).string;
  m.world_size = static_cast<std::uint32_t>(count(root, "world_size", 1u << 24));
  if (m.world_size == 0) bad("has world_size 0");
  m.optimizer = member(root, "optimizer", Value::Kind::string).string;
  m.optimizer_fingerprint =
      hex(member(root, "optimizer_fingerprint", Value::Kind::string).string, "optimizer_fingerprint", 16);
  m.state_count = static_cast<std::uint32_t>(count(root, "state_count", 2));
  if (!dtype_from_name(member(root, "param_dtype", Value::Kind::string).string, m.param_dtype) ||
      m.param_dtype == DType::fp64)
    bad("has an unknown param_dtype");
  m.bucket_cap_bytes = count(root, "bucket_cap_bytes", UINT64_MAX);
  m.first_bucket_cap_bytes = count(root, "first_bucket_cap_bytes", UINT64_MAX);
  m.parameters_only = member(root, "parameters_only", Value::Kind::boolean).boolean;
  if (const Value* metadata = root.find("metadata")) {  // (a manifest of a save before metadata has none)
    if (metadata->kind != Value::Kind::object) lacks("metadata");
    for (const json::Member& entry : metadata->members) {
      if (entry.value.kind != Value::Kind::string) bad("has metadata `" + entry.name + "` that is not a string");
      if (!m.metadata.emplace(entry.name, entry.value.string).second) bad("has metadata `" + entry.name + "` twice");
    }
    check_checkpoint_metadata(m.metadata, where + "has metadata that ");
  }
  if (const Value* groups =
          root.find("optimizer_groups")) {  // (a manifest of a save before they were recorded has none)
    if (groups->kind != Value::Kind::array || groups->items.empty()) lacks("optimizer_groups");
    for (const Value& group : groups->items) {
      if (group.kind != Value::Kind::object) lacks("optimizer_groups");
      OptimizerOptionValues& values = m.optimizer_groups.emplace_back();
      for (const json::Member& option : group.members) {
        if (option.value.kind != Value::Kind::number || !std::isfinite(option.value.number))
          bad("has optimizer option `" + option.name + "` that is not a finite number");
        for (const auto& [name, value] : values)
          if (name == option.name) bad("has optimizer option `" + option.name + "` twice in a group");
        values.emplace_back(option.name, option.value.number);
      }
    }
  }
  if (const Value* group_of = root.find("optimizer_group_of")) {
    if (group_of->kind != Value::Kind::array) lacks("optimizer_group_of");
    for (const Value& g : group_of->items) {
      if (!g.is_count || g.count >= m.optimizer_groups.size())
        bad("gives a tensor an optimizer group that optimizer_groups does not hold");
      m.optimizer_group_of.push_back(static_cast<std::uint32_t>(g.count));
    }
  }
  if (m.optimizer_groups.size() > 1 && m.optimizer_group_of.empty())
    bad("holds " + std::to_string(m.optimizer_groups.size()) + " optimizer groups but no optimizer_group_of");
  if (!have_tensors) lacks("tensors");
  m.tensors.reserve(tensors.size());
  for (const Entry& t : tensors) {
    TensorSpec spec;
    spec.name = entry_string(t, 0, "name");
    spec.numel = entry_count(t, 1, "numel", max_numel);
    if (!dtype_from_name(entry_string(t, 2, "dtype"), spec.dtype) || spec.dtype != m.param_dtype)
      bad("gives tensor `" + spec.name + "` a dtype other than param_dtype");
    m.tensors.push_back(std::move(spec));
  }
  if (!have_files) lacks("files");
  for (const Entry& f : files) {
    CheckpointManifest::File file;
    file.name = entry_string(f, 0, "name");
    if (file.name.empty() || file.name.find('/') != std::string::npos || file.name[0] == '.')
      bad("names a file outside its directory: `" + file.name + "`");
    file.bytes = entry_count(f, 1, "bytes", UINT64_MAX);
    file.header_crc = static_cast<std::uint32_t>(hex(entry_string(f, 2, "header_crc32c"), "header_crc32c", 8));
    m.files.push_back(std::move(file));
  }
  if (m.files.size() != (m.parameters_only ? 1u : m.world_size))
    bad("lists " + std::to_string(m.files.size()) + " files for " + std::to_string(m.world_size) + " ranks");
  if (!m.optimizer_group_of.empty() && m.optimizer_group_of.size() != m.tensors.size())
    bad("gives " + std::to_string(m.optimizer_group_of.size()) + " tensors an optimizer group, but holds " +
        std::to_string(m.tensors.size()));
  if (m.parameters_only && (m.state_count != 0 || m.world_size != 1 || !m.optimizer_groups.empty()))
    bad("is parameters-only but holds state");
  return m;
}

}  // namespace detail

}  // namespace tandem
