// SPDX-License-Identifier: Apache-2.0
// Checkpoint I/O: a rank's TrainingState to and from a checkpoint. Sharded checkpoints (core/checkpoint_manifest.hpp):
// rank r writes shard r of every bucket of every array (parameters, master weights, optimizer state) to a file of its
// own, streamed through one host chunk (write_shard); loading reads, under any policy and world size, only the saved
// slices that overlap what a rank keeps, each checked against its checksum (ShardedCheckpoint). The single-file format
// of earlier versions (core/checkpoint.hpp) still loads (restore_checkpoint). The front agrees on failures across
// ranks (detail::all_ranks_succeed), checks the checkpoint against its layout (validation.hpp), writes the manifest and
// orders the streams.
#pragma once

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/core/atomic_file.hpp"
#include "tandem/core/checkpoint.hpp"
#include "tandem/core/checkpoint_manifest.hpp"
#include "tandem/core/config.hpp"
#include "tandem/core/crc32c.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/core/hash.hpp"
#include "tandem/core/plan.hpp"
#include "tandem/core/safetensors.hpp"
#include "tandem/core/tensor.hpp"
#include "tandem/front/detail/training_state.hpp"
#include "tandem/policy/policy.hpp"

namespace tandem::detail {

/// Copies what this rank keeps of a checked checkpoint into its state, on the backend's work stream: the full
/// parameters (where it keeps them), and over its owned ranges the parameter shards, master weights and optimizer
/// state. The copies read `c` as late as when they run: the caller keeps `c` alive until the stream has done them.
template <Policy P, class Backend>
TANDEM_COLD void restore_checkpoint(const Backend& backend, const Plan& plan, const Layout& layout, int rank,
                                    const TrainingState<Backend>& state, const CheckpointData& c) {
  const std::size_t psize = dtype_size(c.param_dtype);
  for (std::size_t i = 0; i < layout.size(); ++i) {
    const std::size_t at = plan.flat_offset(i), n = layout[i].numel;
    if (n == 0) continue;
    if (state.param_flat() != nullptr)
      backend.copy(state.param_flat() + at * psize, c.params[i].data(), n * psize, backend.stream());
    const std::size_t b = plan.placement(i).bucket;
    const Range owned = owned_range<P>(plan, b, rank);
    const std::size_t begin = std::max(at, owned.begin), end = std::min(at + n, owned.end);
    if (begin >= end) continue;
    const std::size_t into = owned_offset<P>(plan, b) + (begin - owned.begin), from = begin - at;
    if (state.param_shard() != nullptr)
      backend.copy(state.param_shard() + into * psize, c.params[i].data() + from * psize, (end - begin) * psize,
                   backend.stream());
    if (state.master() != nullptr)
      backend.copy(state.master() + into, c.masters[i].data() + from, (end - begin) * sizeof(float), backend.stream());
    for (std::size_t k = 0; k < state.state_count(); ++k)
      backend.copy(state.state(k) + into, c.states[i][k].data() + from, (end - begin) * sizeof(float),
                   backend.stream());
  }
}

}  // namespace tandem::detail

// ---- sharded checkpoints (core/checkpoint_manifest.hpp) -------------------------------------------------------------

namespace tandem::detail {

/// One array a checkpoint holds for every element: the parameters, the fp32 master weights, an optimizer state array.
struct CheckpointArray {
  enum class Kind { params, master, state } kind = Kind::params;
  std::size_t index = 0;  ///< the state array's
  DType dtype = DType::fp32;
  std::string prefix;  ///< of its tensors' names in a shard file
};

/// The arrays of a checkpoint of `param_dtype` parameters with `state_count` state arrays, in file order.
inline std::vector<CheckpointArray> checkpoint_arrays(DType param_dtype, std::size_t state_count) {
  using Kind = CheckpointArray::Kind;
  std::vector<CheckpointArray> arrays = {{Kind::params, 0, param_dtype, ""}};
  if (param_dtype != DType::fp32) arrays.push_back({Kind::master, 0, DType::fp32, "master/"});
  for (std::size_t k = 0; k < state_count; ++k)
    arrays.push_back({Kind::state, k, DType::fp32, "state" + std::to_string(k) + "/"});
  return arrays;
}

/// The arrays the checkpoint of manifest `m` holds: the parameters alone where it is parameters-only (an import: no
/// master weights even of 16-bit parameters, no state), else checkpoint_arrays.
inline std::vector<CheckpointArray> arrays_of(const CheckpointManifest& m) {
  if (m.parameters_only) return {{CheckpointArray::Kind::params, 0, m.param_dtype, ""}};
  return checkpoint_arrays(m.param_dtype, m.state_count);
}

/// Elements [begin, end) of layout tensor `tensor`; its first element is at `flat` of the plan's flat space.
struct Slice {
  std::size_t tensor = 0, begin = 0, end = 0, flat = 0, bucket = 0;
};

/// Shard `rank` of every bucket of `plan`, cut at tensor boundaries, in flat order (alignment gaps and padding hold
/// nothing and are left out).
inline std::vector<Slice> shard_slices(const Plan& plan, int rank) {
  std::vector<Slice> out;
  for (std::size_t b = 0; b < plan.num_buckets(); ++b) {
    const Range shard = plan.shard(b, rank);
    std::vector<std::size_t> tensors = plan.bucket(b).tensors;
    std::sort(tensors.begin(), tensors.end(),
              [&](std::size_t x, std::size_t y) { return plan.flat_offset(x) < plan.flat_offset(y); });
    for (std::size_t t : tensors) {
      const std::size_t first = plan.flat_offset(t), n = plan.placement(t).numel;
      const std::size_t lo = std::max(first, shard.begin), hi = std::min(first + n, shard.end);
      if (lo < hi) out.push_back({t, lo - first, hi - first, lo, b});
    }
  }
  return out;
}

/// What a slice's tensor name in a shard file ends with: "[begin:end]", or nothing where the slice is the whole tensor
/// of `numel` elements (written into `buffer`).
inline std::string_view slice_suffix(std::size_t begin, std::size_t end, std::size_t numel, char (&buffer)[48]) {
  if (begin == 0 && end == numel) return {};
  buffer[0] = '[';
  char* p = std::to_chars(buffer + 1, buffer + 21, begin).ptr;  // (each number at most 20 digits)
  *p++ = ':';
  p = std::to_chars(p, p + 20, end).ptr;
  *p++ = ']';
  return {buffer, static_cast<std::size_t>(p - buffer)};
}

/// A slice's tensor name in a shard file: the array's prefix and the tensor's name, with "[begin:end]" unless whole.
inline std::string slice_name(const CheckpointArray& a, const TensorSpec& t, std::size_t begin, std::size_t end) {
  char buffer[48];
  std::string name = a.prefix + t.name;
  name += slice_suffix(begin, end, t.numel, buffer);
  return name;
}

/// Whether `name` is slice_name(a, t, begin, end) (without building it).
inline bool is_slice_name(std::string_view name, const CheckpointArray& a, const TensorSpec& t, std::size_t begin,
                          std::size_t end) {
  char buffer[48];
  if (!name.starts_with(a.prefix)) return false;
  name.remove_prefix(a.prefix.size());
  if (!name.starts_with(t.name)) return false;
  name.remove_prefix(t.name.size());
  return name == slice_suffix(begin, end, t.numel, buffer);
}

/// The entries of a shard file (write_shard) whose tensor pieces are `slices` (shard_slices), in file order: each
/// array's slice of each piece.
inline std::vector<SafetensorsEntry> shard_entries(const Layout& layout, const std::vector<CheckpointArray>& arrays,
                                                   const std::vector<Slice>& slices) {
  std::vector<SafetensorsEntry> entries;
  entries.reserve(arrays.size() * slices.size());
  for (const CheckpointArray& a : arrays)
    for (const Slice& s : slices)
      entries.push_back({slice_name(a, layout[s.tensor], s.begin, s.end), a.dtype, s.end - s.begin});
  return entries;
}

/// The entries of a file that holds `arrays` of every tensor whole (consolidate_checkpoint), in file order.
inline std::vector<SafetensorsEntry> whole_entries(const std::vector<TensorSpec>& tensors,
                                                   const std::vector<CheckpointArray>& arrays) {
  std::vector<SafetensorsEntry> entries;
  entries.reserve(arrays.size() * tensors.size());
  for (const CheckpointArray& a : arrays)
    for (const TensorSpec& t : tensors) entries.push_back({a.prefix + t.name, a.dtype, t.numel});
  return entries;
}

/// An optimizer group's options as a checkpoint records them: by name, in Opt's order (OptionsNamed).
template <class Opt>
OptimizerOptionValues option_values(const typename Opt::Options& options) {
  OptimizerOptionValues values;
  Opt::visit_options(options, [&](const char* name, const auto& member) {
    using T = std::remove_cvref_t<decltype(member)>;
    static_assert(std::is_enum_v<T> || std::is_same_v<T, float>, "an optimizer option is a float or an enumeration");
    if constexpr (std::is_enum_v<T>)
      values.emplace_back(name, static_cast<double>(static_cast<std::underlying_type_t<T>>(member)));
    else
      values.emplace_back(name, static_cast<double>(member));
  });
  return values;
}

/// The options a checkpoint recorded (option_values): each of Opt's by its name, and no other; values as their float
/// or, for an enumeration, an integer. Throws tandem::error, its message beginning with `where`, otherwise. The result
/// is not validated (Opt::validate).
template <class Opt>
typename Opt::Options options_from_values(const OptimizerOptionValues& values, const std::string& where) {
  typename Opt::Options options{};
  std::size_t found = 0;
  Opt::visit_options(options, [&](const char* name, auto& member) {
    using T = std::remove_cvref_t<decltype(member)>;
    const auto at = std::find_if(values.begin(), values.end(), [&](const auto& v) { return v.first == name; });
    if (at == values.end()) fail(where + "lacks the " + Opt::name + " option `" + name + "`");
    ++found;
    if constexpr (std::is_enum_v<T>) {
      using U = std::underlying_type_t<T>;
      if (!(at->second >= static_cast<double>(std::numeric_limits<U>::min()) &&
            at->second <= static_cast<double>(std::numeric_limits<U>::max()) && at->second == std::floor(at->second)))
        fail(where + "gives the " + Opt::name + " option `" + name + "` " + json::number(at->second) +
             ", which is not one of its values");
      member = static_cast<T>(static_cast<U>(at->second));
    } else if (!json::float_of(at->second, member)) {
      fail(where + "gives the " + Opt::name + " option `" + name + "` " + json::number(at->second) +
           ", beyond a float's range");
    }
  });
  if (found != values.size())
    for (const auto& [name, value] : values) {
      bool known = false;
      Opt::visit_options(options, [&](const char* mine, const auto&) { known = known || name == mine; });
      if (!known) fail(where + "holds an option `" + name + "`, which " + Opt::name + " does not have");
    }
  return options;
}

/// The fingerprint of optimizer groups and their assignment (DataParallel's, which checkpoints record): group 0's
/// alone where there is one group (as checkpoints have always held), else every group's and the assignment's.
template <class Opt>
std::uint64_t groups_fingerprint(const std::vector<typename Opt::Options>& groups,
                                 const std::vector<std::size_t>& group_of) {
  std::uint64_t h = Opt::fingerprint(groups[0]);
  if (groups.size() == 1) return h;
  for (std::size_t g = 1; g < groups.size(); ++g) {
    const std::uint64_t f = Opt::fingerprint(groups[g]);
    h = fnv1a(&f, sizeof f, h);
  }
  for (std::size_t group : group_of) {
    const std::uint64_t v = group;
    h = fnv1a(&v, sizeof v, h);
  }
  return h;
}

/// Optimizer groups and each tensor's group (empty: every tensor in group 0).
template <class Opt>
struct OptimizerGroups {
  std::vector<typename Opt::Options> groups;
  std::vector<std::size_t> group_of;
};

/// The optimizer groups manifest `m` of the checkpoint `path` recorded (none where it recorded none, or is
/// parameters-only), each of Opt's options by name (options_from_values), valid (Opt::validate) and needing at most
/// `state_count` state arrays, and together giving the manifest's optimizer fingerprint (the assignment parse_manifest
/// checked); throws tandem::error otherwise.
template <class Opt>
std::optional<OptimizerGroups<Opt>> recorded_groups(const CheckpointManifest& m, const std::string& path,
                                                    std::size_t state_count) {
  if (m.parameters_only || m.optimizer_groups.empty()) return std::nullopt;
  OptimizerGroups<Opt> recorded;
  for (std::size_t g = 0; g < m.optimizer_groups.size(); ++g) {
    const std::string where = "tandem: the checkpoint `" + path + "`, optimizer group " + std::to_string(g) + ", ";
    const auto& options = recorded.groups.emplace_back(options_from_values<Opt>(m.optimizer_groups[g], where));
    try {
      Opt::validate(options);
    } catch (const error& e) {
      fail(where + "holds invalid options: " + reason(e));
    }
    if (Opt::state_count(options) > state_count)
      fail(where + "holds options that need " + std::to_string(Opt::state_count(options)) + " state arrays; " +
           std::to_string(state_count) + " are kept");
  }
  recorded.group_of.assign(m.optimizer_group_of.begin(), m.optimizer_group_of.end());
  if (groups_fingerprint<Opt>(recorded.groups, recorded.group_of) != m.optimizer_fingerprint)
    fail("tandem: the checkpoint `" + path +
         "` holds optimizer options that do not give its optimizer_fingerprint: its manifest was edited or damaged");
  return recorded;
}

/// What a checkpoint whose names clash is told to do.
inline constexpr const char* checkpoint_names_advice =
    "; a checkpoint keys each array of a tensor by its name (`<name>`, `master/<name>`, `state<k>/<name>`, and "
    "`<name>[begin:end]` where a shard cuts it): rename the tensor";

/// Checks, as DataParallel is constructed, that a checkpoint of `layout` (parameters in its tensors' dtype,
/// `state_count` optimizer state arrays) can name every entry apart, so that no save fails on it hours in. This one
/// checks the consolidated file of every array, whatever the world size: two tensors of one name, `__metadata__`, a
/// name that is another's with `master/` or `state<k>/` before it.
TANDEM_COLD inline void validate_checkpoint_names(const Layout& layout, std::size_t state_count) {
  check_entry_names(whole_entries(layout.tensors(), checkpoint_arrays(layout[0].dtype, state_count)),
                    "a checkpoint of this layout", checkpoint_names_advice);
}
/// ... and this one rank `rank`'s shard file at `plan`: a name that is another's with the `[begin:end]` of a piece
/// this plan cuts after it.
TANDEM_COLD inline void validate_checkpoint_names(const Plan& plan, const Layout& layout, std::size_t state_count,
                                                  int rank) {
  check_entry_names(shard_entries(layout, checkpoint_arrays(layout[0].dtype, state_count), shard_slices(plan, rank)),
                    "rank " + std::to_string(rank) + "'s checkpoint shard at this world size", checkpoint_names_advice);
}

/// Bytes a checkpoint streams through host memory at a time.
inline constexpr std::size_t checkpoint_chunk_bytes = std::size_t{8} << 20;

/// Where rank `rank` keeps a slice of its shard of `array` (backend memory; the slice lies in the rank's shard).
template <Policy P, class Backend>
unsigned char* slice_source(const TrainingState<Backend>& state, const Plan& plan, int rank, const CheckpointArray& a,
                            const Slice& s, std::size_t psize) {
  using Kind = CheckpointArray::Kind;
  if (a.kind == Kind::params) {
    if (state.param_flat() != nullptr) return state.param_flat() + s.flat * psize;
    return state.param_shard() +
           (plan.bucket(s.bucket).shard_offset + s.flat - plan.shard(s.bucket, rank).begin) * psize;
  }
  float* base = a.kind == Kind::master ? state.master() : state.state(a.index);
  return reinterpret_cast<unsigned char*>(base + owned_offset<P>(plan, s.bucket) + s.flat -
                                          owned_range<P>(plan, s.bucket, rank).begin);
}

/// Writes rank `rank`'s shard of every array (shard `rank` of every bucket) to `path`, streamed through one host
/// chunk, as a safetensors file whose metadata records the step and the program's `metadata` (which the manifest's
/// record of the header's checksum then covers: ShardedCheckpoint holds the manifest's to them); returns its size and
/// data checksum. Local: no collective.
template <Policy P, class Backend>
TANDEM_COLD SafetensorsSummary write_shard(const Backend& backend, const Plan& plan, const Layout& layout,
                                           const TrainingState<Backend>& state, DType param_dtype, int rank, int world,
                                           std::uint64_t step, const CheckpointMetadata& metadata,
                                           const std::string& path) {
  const std::vector<CheckpointArray> arrays = checkpoint_arrays(param_dtype, state.state_count());
  const std::vector<Slice> slices = shard_slices(plan, rank);
  std::vector<SafetensorsEntry> entries = shard_entries(layout, arrays, slices);
  std::size_t largest = 0;
  for (const SafetensorsEntry& e : entries) largest = std::max<std::size_t>(largest, e.count * dtype_size(e.dtype));
  std::vector<std::pair<std::string, std::string>> file_metadata = {{"format", safetensors_shard_format},
                                                                    {"rank", std::to_string(rank)},
                                                                    {"world_size", std::to_string(world)},
                                                                    {"step", std::to_string(step)}};
  for (const auto& [key, value] : metadata) file_metadata.emplace_back(std::string(shard_metadata_prefix) + key, value);
  SafetensorsWriter out(path, std::move(entries), std::move(file_metadata), "the checkpoint shard");
  const std::size_t psize = dtype_size(param_dtype);
  // Host memory is written from where it is (the host backend has nothing queued, and nothing writes the state before
  // commit); other memory through one chunk.
  std::vector<unsigned char> chunk(Backend::host_memory ? 0 : std::min(largest, checkpoint_chunk_bytes));
  for (const CheckpointArray& a : arrays)
    for (const Slice& s : slices) {
      const unsigned char* from = slice_source<P>(state, plan, rank, a, s, psize);
      const std::size_t bytes = (s.end - s.begin) * dtype_size(a.dtype);
      if constexpr (Backend::host_memory) {
        out.data_in_place(from, bytes);
      } else {
        for (std::size_t at = 0; at < bytes; at += chunk.size()) {
          const std::size_t n = std::min(chunk.size(), bytes - at);
          backend.read(chunk.data(), from + at, n, backend.stream());
          out.data(chunk.data(), n);
        }
      }
    }
  return out.commit();
}

/// Throws tandem::error: file `f`'s tensor (or slice) `name` has data of CRC-32C `crc`, where `expected` is recorded.
[[noreturn]] TANDEM_COLD inline void checksum_mismatch(const SafetensorsFile& f, std::string_view name,
                                                       std::uint32_t crc, std::uint32_t expected) {
  f.corrupt(naming("the checksum of ", name, " does not match its data (") + hex8(crc) + ", recorded " +
            hex8(expected) + ")");
}

/// The most files of a checkpoint a ShardedCheckpoint of this thread keeps open at once: 64 (a fraction of the usual
/// limit of 1024 descriptors a process); tests lower it.
inline std::size_t& checkpoint_max_open_files() {
  static thread_local std::size_t files = 64;
  return files;
}
/// The most files one ShardedCheckpoint of this thread has held open at once, since the caller last set it to 0 (what
/// a load keeps open, for tests: its ShardedCheckpoint is internal).
inline std::size_t& checkpoint_most_open_files() {
  static thread_local std::size_t files = 0;
  return files;
}

/// A sharded checkpoint opened for loading: its manifest (checked by the caller), the plan that saved it, and its
/// files, opened when first read, at most `max_open` at a time (a checkpoint of thousands of ranks read on one: the
/// least recently read is closed first, and opened and checked again if read again). read() copies any range of any
/// array of any tensor into backend memory, reading only the saved slices that overlap it, each verified against the
/// checksum its file records.
class ShardedCheckpoint {
 public:
  ShardedCheckpoint(std::string dir, CheckpointManifest manifest, const Layout& layout,
                    std::size_t max_open = checkpoint_max_open_files())
      : dir_(std::move(dir)),
        manifest_(std::move(manifest)),
        files_(manifest_.files.size()),
        next_(manifest_.files.size(), 0),
        used_(manifest_.files.size(), 0),
        max_open_(std::max<std::size_t>(max_open, 1)) {
    if (manifest_.parameters_only) return;  // whole tensors in one file: no plan
    PlanOptions po;                         // the saving plan, as detail::plan_for cut it
    po.bucket_cap_bytes = static_cast<std::size_t>(manifest_.bucket_cap_bytes);
    po.first_bucket_cap_bytes = static_cast<std::size_t>(manifest_.first_bucket_cap_bytes);
    po.world_size = static_cast<int>(manifest_.world_size);
    po.bucket_element_bytes = sizeof(float);
    po.alignment_elements = 16 / dtype_size(manifest_.param_dtype);
    po.shard_alignment_elements = 128 / dtype_size(manifest_.param_dtype);
    std::vector<std::size_t> sizes;
    for (const TensorSpec& t : layout.tensors()) sizes.push_back(t.numel);
    saved_ = Plan(sizes, po);
  }

  const CheckpointManifest& manifest() const { return manifest_; }
  /// Whether file `file` (of the manifest's list) has been opened.
  bool opened(std::size_t file) const { return used_[file] != 0; }
  /// Bytes of data read from the files so far (headers not counted): every saved slice read() needed, whole.
  std::uint64_t bytes_read() const { return bytes_read_; }

  /// Elements [lo, hi) of array `a` of layout tensor `tensor` (named `spec`) into `to` (backend memory, hi - lo
  /// elements), through `chunk` (host memory, checkpoint_chunk_bytes, allocated here when first needed; the backend's
  /// copies are waited for before it is reused). With `to` null it only opens the files that hold them and checks
  /// their entries (nothing is read or written), so that a missing or damaged file is found before anything changes.
  /// Slices read straight into host memory are read by runs (adjacent in their file and in memory, up to 1 MiB each, in
  /// one call; each still checked against its own checksum), so a run may be read as late as flush(), which the
  /// caller calls after its last read.
  template <class Backend>
  void read(const Backend& backend, const CheckpointArray& a, std::size_t tensor, const TensorSpec& spec,
            std::size_t lo, std::size_t hi, unsigned char* to, std::vector<unsigned char>& chunk) {
    if (to == nullptr) {
      visit(a, tensor, spec, lo, hi, nullptr, no_direct, [](const unsigned char*, std::size_t, std::uint64_t) {});
      return;
    }
    const std::size_t size = dtype_size(a.dtype);
    // Host memory takes a slice that lies wholly in [lo, hi) straight from the file (its checksum is taken there).
    auto direct = [&]([[maybe_unused]] std::size_t begin, [[maybe_unused]] std::size_t end) -> unsigned char* {
      if constexpr (Backend::host_memory)
        return begin >= lo && end <= hi ? to + (begin - lo) * size : nullptr;
      else
        return static_cast<unsigned char*>(nullptr);
    };
    visit(a, tensor, spec, lo, hi, &chunk, direct, [&](const unsigned char* data, std::size_t n, std::uint64_t at) {
      backend.copy(to + at, data, n, backend.stream());
      backend.synchronize(backend.stream());  // the copy reads `chunk`, which the next read overwrites
    });
  }

  /// Reads the run of slices that read() has gathered, and checks each against its checksum.
  void flush() {
    if (run_.slices.empty()) return;
    const Run run = std::exchange(run_, Run{});
    const SafetensorsFile& f = *files_[run.file];
    f.read(run.file_begin, run.to, static_cast<std::size_t>(run.file_end - run.file_begin));
    bytes_read_ += run.file_end - run.file_begin;
    for (const SafetensorsFile::Tensor* t : run.slices) {
      const std::uint32_t crc = crc32c(run.to + (t->begin - run.file_begin), t->end - t->begin);
      if (crc != t->crc) checksum_mismatch(f, t->name, crc, t->crc);
    }
  }

  /// Every element of array `a` of layout tensor `tensor`, in order: sink(data, bytes) for each piece (host memory,
  /// valid during the call), each saved slice checked against its checksum once read.
  template <class Sink>
  void stream(const CheckpointArray& a, std::size_t tensor, const TensorSpec& spec, std::vector<unsigned char>& chunk,
              Sink&& sink) {
    visit(a, tensor, spec, 0, spec.numel, &chunk, no_direct,
          [&](const unsigned char* data, std::size_t n, std::uint64_t) { sink(data, n); });
  }

 private:
  /// Bytes read into place by one call: a run of small slices, or a piece of a large one (checksummed while still in
  /// the cache it was read through).
  static constexpr std::uint64_t direct_piece_bytes = std::uint64_t{1} << 20;

  static unsigned char* no_direct(std::size_t, std::size_t) { return nullptr; }

  /// The saved slices of tensor `tensor`'s array `a` that overlap elements [lo, hi), in order: each is opened and its
  /// entry checked; with a chunk, it is read whole (for its checksum): into direct(begin, end) where that gives memory
  /// for the whole slice, else through the chunk, sink(data, bytes, offset) receiving its part in [lo, hi), `offset`
  /// bytes from element lo. The checksum is compared at the slice's end.
  template <class Direct, class Sink>
  void visit(const CheckpointArray& a, std::size_t tensor, const TensorSpec& spec, std::size_t lo, std::size_t hi,
             std::vector<unsigned char>* chunk, Direct&& direct, Sink&& sink) {
    if (lo >= hi) return;
    const std::size_t size = dtype_size(a.dtype);
    auto piece = [&](std::size_t file, std::size_t begin, std::size_t end) {  // saved elements [begin, end)
      const std::size_t from = std::max(lo, begin), until = std::min(hi, end);
      if (from >= until) return;
      const SafetensorsFile& f = open(file);
      // The entry after the last one found in this file first (slices are read in the order of the file's data when
      // the plan is the saving one), else the one of this name.
      const std::vector<SafetensorsFile::Tensor>& entries = f.tensors();
      std::size_t& next = next_[file];
      const SafetensorsFile::Tensor* t = nullptr;
      if (next < entries.size() && is_slice_name(entries[next].name, a, spec, begin, end))
        t = &entries[next];
      else if ((t = f.find(slice_name(a, spec, begin, end))) == nullptr)
        f.corrupt("it lacks `" + slice_name(a, spec, begin, end) + "`");
      next = static_cast<std::size_t>(t - entries.data()) + 1;
      if (t->dtype != a.dtype || t->count() != end - begin)
        f.corrupt(naming("", t->name, " has the wrong dtype or size"));
      if (!t->has_crc) f.corrupt(naming("it records no checksum for ", t->name, ""));
      if (chunk == nullptr) return;
      const std::uint64_t bytes = (end - begin) * size;
      unsigned char* into = direct(begin, end);
      if (into != nullptr && bytes <= direct_piece_bytes) {  // joins the run of slices read by one call
        if (run_.slices.empty() || run_.file != file || run_.file_end != t->begin || run_.to_end != into ||
            run_.file_end - run_.file_begin + bytes > direct_piece_bytes) {
          flush();
          run_.file = file;
          run_.file_begin = run_.file_end = t->begin;
          run_.to = run_.to_end = into;
        }
        run_.slices.push_back(t);
        run_.file_end += bytes;
        run_.to_end += bytes;
        return;
      }
      flush();
      std::uint32_t crc = 0;
      const std::uint32_t expected = t->crc;
      // Read whole into direct memory, in pieces of 1 MiB, each checksummed while still in the cache it was read
      // through; else through the chunk, each piece's part in [lo, hi) passed to the sink.
      if (into == nullptr && chunk->empty()) chunk->resize(checkpoint_chunk_bytes);  // (allocated when first needed)
      const std::uint64_t piece_bytes = into != nullptr ? direct_piece_bytes : chunk->size();
      const std::uint64_t want_begin = (from - begin) * size, want_end = (until - begin) * size;
      for (std::uint64_t at = 0; at < bytes; at += piece_bytes) {
        const auto n = static_cast<std::size_t>(std::min(piece_bytes, bytes - at));
        unsigned char* to = into != nullptr ? into + at : chunk->data();
        f.read(t->begin + at, to, n);
        bytes_read_ += n;
        crc = crc32c(to, n, crc);
        if (into != nullptr) continue;
        const std::uint64_t c0 = std::max(at, want_begin), c1 = std::min<std::uint64_t>(at + n, want_end);
        // byte c0 of the slice is element begin + c0 / size: (begin - lo) * size + c0 bytes from element lo
        if (c0 < c1) sink(chunk->data() + (c0 - at), static_cast<std::size_t>(c1 - c0), c0 + begin * size - lo * size);
      }
      if (crc != expected) checksum_mismatch(f, t->name, crc, expected);
    };
    if (manifest_.parameters_only) {
      piece(0, 0, spec.numel);
      return;
    }
    const std::size_t first = saved_.flat_offset(tensor), b = saved_.placement(tensor).bucket;
    for (int s = 0; s < static_cast<int>(manifest_.world_size); ++s) {
      const Range shard = saved_.shard(b, s);
      const std::size_t begin = std::max(first, shard.begin), end = std::min(first + spec.numel, shard.end);
      if (begin < end) piece(static_cast<std::size_t>(s), begin - first, end - first);
    }
  }

  const SafetensorsFile& open(std::size_t file) {
    used_[file] = ++clock_;
    if (!files_[file]) {
      if (open_ == max_open_) {  // close the least recently read, once the run (which may point into it) is read
        flush();
        std::size_t oldest = file;
        for (std::size_t f = 0; f < files_.size(); ++f)
          if (files_[f] && (oldest == file || used_[f] < used_[oldest])) oldest = f;
        files_[oldest].reset();
        --open_;
      }
      const CheckpointManifest::File& m = manifest_.files[file];
      const std::string path = dir_ + "/" + m.name;
      std::error_code error;
      const std::uintmax_t size = std::filesystem::file_size(path, error);
      if (error) fail("tandem: cannot open `" + path + "`, a file of the checkpoint: " + error.message());
      if (size != m.bytes)
        fail("tandem: `" + path + "` is " + std::to_string(size) + " bytes long; the checkpoint's manifest says " +
             std::to_string(m.bytes) + " (truncated, or from another save?)");
      files_[file].emplace(path);
      checkpoint_most_open_files() = std::max(checkpoint_most_open_files(), ++open_);
      if (files_[file]->header_crc() != m.header_crc)
        files_[file]->corrupt("its header's checksum does not match the manifest's (a file of another save?)");
      // The step and the program's metadata, which the manifest alone records in files saved before shards recorded
      // them too (those record no step).
      if (const std::string* step = files_[file]->metadata("step"); step != nullptr) {
        if (*step != std::to_string(manifest_.step))
          files_[file]->corrupt("it records step " + *step + " where the checkpoint's manifest says " +
                                std::to_string(manifest_.step) + " (a damaged manifest?)");
        check_metadata(*files_[file]);
      }
    }
    return *files_[file];
  }

  /// Holds file `f`'s record of the program's metadata to the manifest's.
  void check_metadata(const SafetensorsFile& f) const {
    CheckpointMetadata recorded;
    for (const auto& [key, value] : f.metadata())
      if (key.starts_with(shard_metadata_prefix) &&
          !recorded.emplace(key.substr(shard_metadata_prefix.size()), value).second)
        f.corrupt(naming("it records metadata ", key, " twice"));
    if (recorded == manifest_.metadata) return;
    auto a = recorded.cbegin(), b = manifest_.metadata.cbegin();  // the first key (in order) that differs
    for (; a != recorded.end() && b != manifest_.metadata.end() && *a == *b; ++a, ++b) {
    }
    const std::string& key =
        b == manifest_.metadata.end() || (a != recorded.end() && a->first < b->first) ? a->first : b->first;
    f.corrupt(
        naming("its record of the metadata ", key, " differs from the checkpoint manifest's (a damaged manifest?)"));
  }

  std::string dir_;
  CheckpointManifest manifest_;
  Plan saved_;
  std::vector<std::optional<SafetensorsFile>> files_;
  std::vector<std::size_t> next_;    ///< per file: the index of the entry after the last one found there
  std::vector<std::uint64_t> used_;  ///< per file: when it was last read (clock_), 0 never
  std::uint64_t clock_ = 0;
  std::size_t max_open_, open_ = 0;
  std::uint64_t bytes_read_ = 0;
  struct Run {  // slices adjacent in file `file` (bytes [file_begin, file_end)) and in host memory [to, to_end)
    std::size_t file = 0;
    std::uint64_t file_begin = 0, file_end = 0;
    unsigned char *to = nullptr, *to_end = nullptr;
    std::vector<const SafetensorsFile::Tensor*> slices;
  } run_;
};

/// Copies this rank's owned range of every array of an opened sharded checkpoint into its state, on the backend's work
/// stream (waited for): of the parameters, into the full parameters where it keeps them (the rest of them is the other
/// ranks' to read: the caller gathers them as after an optimizer step, through the policy's after_update) or into its
/// parameter shard; of the master weights and optimizer state (none from a parameters-only checkpoint), into its
/// shards of them. Throws tandem::error at the first slice that fails its checksum; what was copied before it stays
/// copied. With Restore::check, it only opens and checks the files it would read (ShardedCheckpoint::read with no
/// destination).
enum class Restore { check, copy };

template <Policy P, class Backend>
TANDEM_COLD void restore_sharded(const Backend& backend, const Plan& plan, const Layout& layout, int rank,
                                 const TrainingState<Backend>& state, ShardedCheckpoint& ckpt, Restore mode) {
  using Kind = CheckpointArray::Kind;
  const CheckpointManifest& m = ckpt.manifest();
  const std::vector<CheckpointArray> arrays = arrays_of(m);
  const std::size_t psize = dtype_size(m.param_dtype);
  std::vector<unsigned char> chunk;  // (ShardedCheckpoint::read allocates it if a slice is not read into place)
  // Array by array, tensor by tensor in flat order: the order of the saved files when the plan is the saving one, so
  // that the slices read into place join into runs.
  std::vector<std::size_t> order(layout.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](std::size_t x, std::size_t y) { return plan.flat_offset(x) < plan.flat_offset(y); });
  const bool copy = mode == Restore::copy;
  for (const CheckpointArray& a : arrays) {
    if (a.kind == Kind::master && state.master() == nullptr) continue;
    for (const std::size_t i : order) {
      const std::size_t first = plan.flat_offset(i), n = layout[i].numel, b = plan.placement(i).bucket;
      if (n == 0) continue;
      const Range owned = owned_range<P>(plan, b, rank);
      const std::size_t own_lo = std::max(first, owned.begin), own_hi = std::min(first + n, owned.end);
      if (own_lo >= own_hi) continue;
      const Slice s{i, own_lo - first, own_hi - first, own_lo, b};
      ckpt.read(backend, a, i, layout[i], s.begin, s.end,
                copy ? slice_source<P>(state, plan, rank, a, s, psize) : nullptr, chunk);
    }
  }
  ckpt.flush();
}

/// A name for one save's files that no other save in the same directory picks: the clock, the process and a count.
inline std::uint64_t new_save_id() {
  static std::atomic<std::uint64_t> count{0};
  const std::uint64_t words[3] = {
      static_cast<std::uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()),
      static_cast<std::uint64_t>(::getpid()), count.fetch_add(1)};
  return fnv1a(words, sizeof words);
}

/// The name of rank `rank`'s file of the save `id` at `step`.
inline std::string shard_file_name(std::uint64_t step, std::uint64_t id, int rank, int world) {
  return "step" + std::to_string(step) + "-" + hex16(id) + "-rank" + std::to_string(rank) + "-of" +
         std::to_string(world) + ".safetensors";
}

/// The largest manifest tandem writes and reads (about ten million tensors' names and sizes).
inline constexpr std::size_t manifest_max_bytes = std::size_t{1} << 30;

/// The contents of a small file (a manifest), or an error naming it (also where it is over manifest_max_bytes).
inline std::string read_text_file(const std::string& path, const std::string& what) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) fail("tandem: cannot open " + what + " `" + path + "`: " + std::strerror(errno));
  std::string text;
  char buffer[1 << 14];
  for (std::size_t n; text.size() <= manifest_max_bytes && (n = std::fread(buffer, 1, sizeof buffer, f)) > 0;)
    text.append(buffer, n);
  const bool bad = std::ferror(f) != 0;
  std::fclose(f);
  if (bad) fail("tandem: cannot read " + what + " `" + path + "`");
  if (text.size() > manifest_max_bytes)
    fail("tandem: " + what + " `" + path + "` is over " + std::to_string(manifest_max_bytes) +
         " bytes, more than tandem writes or reads");
  return text;
}

/// The path of the manifest of the checkpoint in directory `dir`. Throws tandem::error where `dir` is an empty path,
/// or a directory without a manifest (what a path that is no directory lacks, the manifest's read says).
inline std::string manifest_path(const std::string& dir) {
  check_directory_named(dir);
  std::string path = dir + "/" + manifest_name;
  std::error_code ec;
  if (std::filesystem::is_directory(dir, ec) && !std::filesystem::exists(path, ec) && !ec)
    fail("tandem: the checkpoint `" + dir + "` has no " + manifest_name +
         ": it is not a checkpoint, or its first save did not finish");
  return path;
}

/// The manifest of the checkpoint in `dir`; throws tandem::error where there is none or it does not read.
inline CheckpointManifest read_manifest(const std::string& dir) {
  const std::string path = manifest_path(dir);
  return parse_manifest(read_text_file(path, "the checkpoint manifest"), path);
}

/// How many times a load reads a checkpoint's directory while saves replace the checkpoint in it (load_checkpoint).
inline constexpr int checkpoint_load_attempts = 5;

/// The points of a load's attempt at which checkpoint_load_hook() is called: before the rank reads the checkpoint,
/// after it read it (before the ranks compare what they read), and before it copies the state in.
enum class LoadPhase : std::uint8_t { reading, read, copying };

/// Test hook: when set, load_checkpoint on this thread calls it with the attempt (from 1) at each LoadPhase, and
/// read_while_saves_replace at LoadPhase::read, where tests make saves overtake the read. Never set it in production
/// code.
inline std::function<void(int, LoadPhase)>& checkpoint_load_hook() {
  static thread_local std::function<void(int, LoadPhase)> hook;
  return hook;
}

/// Whether the manifest in `dir` is now other than the one whose CRC-32C is `content` (0: none was read): a save
/// committed since it was read. False where there is none now (also where `dir` is not a directory).
inline bool manifest_replaced(const std::string& dir, std::uint64_t content) {
  try {
    const std::string text = read_text_file(dir + "/" + manifest_name, "the checkpoint manifest");
    return crc32c(text.data(), text.size()) != content;
  } catch (const std::exception&) {
    return false;
  }
}

/// What the error of a read of the checkpoint in `dir` adds where saves replaced the checkpoint while it was read,
/// `attempts` times in a row: `verb` (what the reader does) it when they pause.
inline std::string replaced_while_read(const std::string& dir, int attempts, const char* verb) {
  return " (saves into `" + dir + "` replaced the checkpoint while it was read, " + std::to_string(attempts) +
         " times in a row: " + verb + " it when they pause)";
}

/// A failure of a reader of a checkpoint that is not the checkpoint's (writing its own output: no room, no folder):
/// read_while_saves_replace throws it on as tandem::error, and reads nothing again for it.
struct OutputFailure {
  error failure;
};

/// Returns `read(manifest)` of the checkpoint in `dir`, on this process alone. Where `read` throws tandem::error and a
/// save committed since the manifest was read (it removes the files only the replaced checkpoint named), reads the
/// checkpoint again, up to checkpoint_load_attempts times, the last time with replaced_while_read(dir, ..., verb) in
/// its error (an OutputFailure is thrown on at once). So verify_checkpoint, consolidate_checkpoint and
/// checkpoint_digest read a directory that a training job saves into, as load_checkpoint does, taking no lock: what
/// they return is one save's checkpoint, whole.
template <class Read>
TANDEM_COLD auto read_while_saves_replace(const std::string& dir, const char* verb, Read&& read) {
  const std::string path = manifest_path(dir);
  for (int attempt = 1;; ++attempt) {
    const std::string text = read_text_file(path, "the checkpoint manifest");
    const std::uint64_t content = crc32c(text.data(), text.size());
    const CheckpointManifest manifest = parse_manifest(text, path);
    if (const auto& hook = checkpoint_load_hook()) hook(attempt, LoadPhase::read);
    try {
      return read(manifest);
    } catch (const OutputFailure& output) {
      throw output.failure;
    } catch (const error& e) {
      if (!manifest_replaced(dir, content)) throw;
      if (attempt == checkpoint_load_attempts) throw error(e.what() + replaced_while_read(dir, attempt, verb));
    }
  }
}

/// Whether `name` is one tandem writes into a checkpoint's directory: a save's file
/// (step<N>-<id>-rank<R>-of<W>.safetensors), an import's (parameters-<id>.safetensors), or the temporary file of one of
/// them or of the manifest (<name>.tmp.<pid>.<n>, core/atomic_file.hpp).
inline bool is_checkpoint_file_name(std::string_view name) {
  const auto digits_in = [](std::string_view text, std::size_t& at) {
    const std::size_t from = at;
    while (at < text.size() && text[at] >= '0' && text[at] <= '9') ++at;
    return at > from;
  };
  if (const std::size_t tmp = name.find(".tmp."); tmp != std::string_view::npos) {
    const std::string_view suffix = name.substr(tmp + 5);  // <pid>.<n>, and nothing else
    std::size_t at = 0;
    if (!digits_in(suffix, at) || at >= suffix.size() || suffix[at++] != '.' || !digits_in(suffix, at) ||
        at != suffix.size())
      return false;
    if (name.substr(0, tmp) == manifest_name) return true;
    name = name.substr(0, tmp);
  }
  const auto digits = [&](std::size_t& at) { return digits_in(name, at); };
  const auto literal = [&](std::size_t& at, std::string_view text) {
    if (name.substr(at, text.size()) != text) return false;
    at += text.size();
    return true;
  };
  const auto id = [&](std::size_t& at) {
    for (std::size_t k = 0; k < 16; ++k, ++at)
      if (at >= name.size() || std::string_view("0123456789abcdef").find(name[at]) == std::string_view::npos)
        return false;
    return true;
  };
  std::size_t at = 0;
  if (literal(at, "parameters-")) return id(at) && literal(at, ".safetensors") && at == name.size();
  return literal(at, "step") && digits(at) && literal(at, "-") && id(at) && literal(at, "-rank") && digits(at) &&
         literal(at, "-of") && digits(at) && literal(at, ".safetensors") && at == name.size();
}

/// The file in a checkpoint's directory that a save holds locked while it writes there (SaveLock).
inline constexpr std::string_view save_lock_name = ".tandem-save.lock";

/// A checkpoint directory's save lock: taken (flock, exclusive, without waiting) by rank 0 of a save, or by an import,
/// before any file of it is written, and held until its clean-up is done, so that a second save into the directory at
/// once (another job, or another DataParallel) is refused, naming the holder, instead of the two removing each other's
/// files. The kernel holds it for the open file: a process that dies releases it, so a crashed save never blocks the
/// next. Where the file system keeps no such locks (NFS without a lock manager, Lustre mounted without `flock`), saves
/// go unlocked. The file stays, holding the last holder's pid and host. `who` begins the refusal ("save_checkpoint").
class SaveLock {
 public:
  SaveLock(const std::string& dir, std::string_view who) {
    const std::string path = dir + "/" + std::string(save_lock_name);
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    const bool writable = fd_ >= 0;
    if (fd_ < 0 && errno == EACCES) fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);  // another user's
    if (fd_ < 0) fail("tandem: " + std::string(who) + ": cannot open `" + path + "`: " + std::strerror(errno));
    int r = 0;
    do r = ::flock(fd_, LOCK_EX | LOCK_NB);
    while (r != 0 && errno == EINTR);
    if (r == 0) {
      if (writable) record_holder();
      return;
    }
    const int e = errno;
    std::string holder(256, '\0');
    const ssize_t n = ::pread(fd_, holder.data(), holder.size(), 0);
    holder.resize(n > 0 ? static_cast<std::size_t>(n) : 0);
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == '\0')) holder.pop_back();
    ::close(fd_);
    fd_ = -1;
    if (e != EWOULDBLOCK) return;  // no such lock here: unlocked, as every save was before
    fail("tandem: " + std::string(who) + ": another save into `" + dir + "` is in progress (" +
         (holder.empty() ? std::string("a process") : holder) + " holds `" + std::string(save_lock_name) +
         "`): one save at a time writes to a directory; give each job, and each DataParallel, a directory of its own. "
         "Nothing was changed");
  }
  SaveLock(const SaveLock&) = delete;
  SaveLock& operator=(const SaveLock&) = delete;
  ~SaveLock() {
    if (fd_ < 0) return;
    ::flock(fd_, LOCK_UN);  // (for a child forked meanwhile too: it shares the open file)
    ::close(fd_);
  }
  /// Whether the lock is held (false where the file system keeps no locks).
  bool held() const { return fd_ >= 0; }

 private:
  // Best effort: the holder's name only helps the refusal's reader.
  void record_holder() const {
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    const std::string text = "pid " + std::to_string(::getpid()) + " on " + host + "\n";
    if (::ftruncate(fd_, 0) != 0) return;
    const ssize_t written = ::pwrite(fd_, text.data(), text.size(), 0);
    (void)written;
  }
  int fd_ = -1;
};

/// Throws tandem::error where `dir` holds the checkpoint of other tensors (names, sizes, dtypes, in any order) than
/// `tensors`: a save of them would replace it, and it is most likely another model's (two DataParallel objects, of a
/// model's two parameter dtypes, saving to one directory); or a manifest.json that does not read (of a later version,
/// damaged, or unreadable now), which may name such a checkpoint. Returns the files the checkpoint there names (none
/// where there is none), for commit_manifest's clean-up: under the directory's SaveLock no other save changes them.
TANDEM_COLD inline std::vector<std::string> check_replaceable(const std::string& dir,
                                                              const std::vector<TensorSpec>& tensors) {
  check_directory_named(dir);
  if (!std::filesystem::exists(dir + "/" + manifest_name)) return {};
  CheckpointManifest old;
  try {
    old = read_manifest(dir);
  } catch (const error& e) {
    fail("tandem: save_checkpoint: `" + dir + "` holds a manifest.json that does not read (" + e.what() +
         "): a checkpoint of a later tandem, or a damaged one, which this save would replace; save to another "
         "directory, or remove that checkpoint first. Nothing was changed");
  }
  std::vector<std::string> files;
  for (const CheckpointManifest::File& f : old.files) files.push_back(f.name);
  const auto same = [](const TensorSpec& x, const TensorSpec& y) {
    return x.name == y.name && x.numel == y.numel && x.dtype == y.dtype;
  };
  if (std::ranges::equal(tensors, old.tensors, same)) return files;  // the same model's save, in its order
  const auto sorted = [](std::vector<TensorSpec> v) {
    std::sort(v.begin(), v.end(), [](const TensorSpec& x, const TensorSpec& y) { return x.name < y.name; });
    return v;
  };
  const std::vector<TensorSpec> mine = sorted(tensors), theirs = sorted(old.tensors);
  if (std::ranges::equal(mine, theirs, same)) return files;
  std::string differ;
  for (std::size_t i = 0; differ.empty() && i < std::max(mine.size(), theirs.size()); ++i) {
    if (i < mine.size() && i < theirs.size() && same(mine[i], theirs[i])) continue;
    const TensorSpec& t = i < theirs.size() ? theirs[i] : mine[i];
    differ = naming(i < theirs.size() ? "it holds " : "it lacks ", t.name,
                    " (" + std::to_string(t.numel) + " " + dtype_name(t.dtype) + ")");
  }
  fail("tandem: save_checkpoint: `" + dir + "` holds the checkpoint of other tensors (" +
       std::to_string(old.tensors.size()) + " of them, " + (old.parameters_only ? "parameters only" : old.policy) +
       ", step " + std::to_string(old.step) + "; " + differ + "), which this save would replace: save each model, " +
       "and each DataParallel of one, to a directory of its own, or remove that checkpoint first. Nothing was changed");
}

/// Makes `m` the checkpoint in `dir`: checks that every file it names is there, whole (as this process sees `dir`: a
/// rank that saved to storage of its own, not shared, is found here), writes the manifest atomically over the previous
/// one, then removes the files that only the previous one named and, where there was none or it read, those that
/// crashed saves left (files of tandem's names, and their temporary files, that the new manifest does not name): a save
/// next to an old checkpoint replaces it; a crash before the rename leaves it whole. Throws only before the rename.
/// Where the directory's flush fails after the rename, a power loss may bring the previous manifest back: its files
/// stay (the next save removes them), and stderr says so. Only files of tandem's names are ever removed, whatever a
/// previous manifest names. `previous_files`: the files the checkpoint there names, as check_replaceable read them
/// under the directory's SaveLock; null: read them here.
TANDEM_COLD inline void commit_manifest(const std::string& dir, const CheckpointManifest& m,
                                        const std::vector<std::string>* previous_files = nullptr) {
  for (std::size_t i = 0; i < m.files.size(); ++i) {
    std::error_code e;
    const std::string file = dir + "/" + m.files[i].name;
    const std::uintmax_t size = std::filesystem::file_size(file, e);
    if (e || size != m.files[i].bytes)
      fail("tandem: `" + file + "`" + (m.parameters_only ? "" : ", rank " + std::to_string(i) + "'s file,") +
           (e ? " is not there (" + e.message() + ")"
              : " is " + std::to_string(size) + " bytes, not " + std::to_string(m.files[i].bytes)) +
           " as rank 0 sees the directory: every rank must save to one directory on storage they share");
  }
  std::vector<std::string> previous;
  bool previous_read = previous_files != nullptr || !std::filesystem::exists(dir + "/" + manifest_name);
  if (previous_files != nullptr)
    previous = *previous_files;
  else
    try {
      for (const CheckpointManifest::File& f : read_manifest(dir).files) previous.push_back(f.name);
      previous_read = true;
    } catch (const error&) {
      // no previous checkpoint here, or one that does not read: nothing of it is known, so nothing is removed below
    }
  const std::string text = manifest_json(m);
  if (text.size() > manifest_max_bytes)  // what is written can be read (read_text_file's limit)
    fail("tandem: the checkpoint manifest would take " + std::to_string(text.size()) + " bytes, over the " +
         std::to_string(manifest_max_bytes) + " tandem reads: fewer or shorter tensor names");
  std::vector<std::string> names;  // sorted: a directory of many ranks' files is searched once per entry
  for (const CheckpointManifest::File& f : m.files) names.push_back(f.name);
  std::sort(names.begin(), names.end());
  const std::string path = dir + "/" + manifest_name;
  AtomicFile out(path, "the checkpoint manifest");
  out.write(text.data(), text.size());
  try {
    out.commit();
  } catch (const error& e) {
    if (!out.renamed()) throw;
    std::fprintf(stderr, "%s; the files of the checkpoint it replaces are kept\n", e.what());
    return;
  }
  // Committed: from here nothing throws (save_checkpoint keeps the files the manifest names only if this returns).
  try {
    const auto named = [&](const std::string& name) { return std::binary_search(names.begin(), names.end(), name); };
    for (const std::string& name : previous)  // (a manifest edited to name another file does not remove it)
      if (is_checkpoint_file_name(name) && !named(name)) ::unlink((dir + "/" + name).c_str());
    if (!previous_read) return;
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      const std::string name = entry.path().filename().string();
      if (is_checkpoint_file_name(name) && !named(name)) ::unlink(entry.path().c_str());
    }
  } catch (...) {
    // what is left is removed by the next save
  }
}

}  // namespace tandem::detail
