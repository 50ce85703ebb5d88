// SPDX-License-Identifier: Apache-2.0
// A rendezvous through a shared file: rank 0 publishes a small opaque blob (NCCL's 128-byte ncclUniqueId, say) and
// every other rank reads it, with no other channel between them. The path must be on a file system every rank sees
// (the same node's /tmp for one node; a shared scratch directory across nodes).
//
// Rank 0 writes the file completely under a temporary name beside the target, fsyncs it and renames it over the
// target, so a reader sees either no file or the whole file, never a partial one. The file holds a magic, a format
// version, the `key`, the blob's size, the blob and a checksum of all that:
//
//   "TANDEMRV" | u32 version = 1 | u32 key bytes | u64 blob bytes | key | blob | u64 FNV-1a of everything before
//
// Readers poll until a file with their key appears or the timeout expires. The key tells this rendezvous's file from
// one an earlier one left at the same path, so it must be unique to the rendezvous (a run that rendezvouses again, to
// build a new communicator after an abort, say, adds a counter): something every rank knows and no other run
// shares (SLURM_JOB_ID.SLURM_STEP_ID; torchrun's TORCHELASTIC_RUN_ID, its --rdzv-id, with TORCHELASTIC_RESTART_COUNT;
// a value the launch script draws). MASTER_ADDR:MASTER_PORT is not: a rerun of the same command has the same one, and
// its readers, starting before rank 0 publishes, would take the earlier run's blob. A file with another key is skipped
// as stale, and the timeout error says so. A file with this run's key already there when rank 0 publishes means the key
// was used before (a run that ended without removing its file, or two runs sharing a key): readers may have taken it,
// so publish_blob removes it and throws. Rank 0 cannot know when the last reader is done, so it removes the file itself
// (remove_blob) once every rank has used the blob: after a barrier, or, as nccl_from_environment does, once the
// communicator the blob set up has been joined (which needs every rank).
//
// (A TCP rendezvous at MASTER_ADDR:MASTER_PORT is not provided: the file, MPI, and the launcher's own channels cover
// the launchers tandem supports; see docs/launching.md.)
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "tandem/core/atomic_file.hpp"
#include "tandem/core/deadline.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/hash.hpp"

namespace tandem {

struct FileRendezvousOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  ///< how long a reader waits for rank 0's file
  std::chrono::milliseconds poll_interval{20};                 ///< how often it looks
};

namespace detail {

inline constexpr char kRendezvousMagic[8] = {'T', 'A', 'N', 'D', 'E', 'M', 'R', 'V'};
inline constexpr std::uint32_t kRendezvousVersion = 1;
/// The largest rendezvous file, in bytes, that readers read (and publish_blob writes): for small blobs, not data.
inline constexpr std::size_t kRendezvousMaxFile = std::size_t{1} << 24;

inline std::uint64_t rendezvous_checksum(const unsigned char* p, std::size_t n) { return fnv1a(p, n); }

template <class T>
void append_bytes(std::vector<unsigned char>& out, const T& v) {
  const auto* p = reinterpret_cast<const unsigned char*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}

/// The size of the file for a key and a blob of these sizes.
constexpr std::size_t rendezvous_file_bytes(std::size_t key, std::size_t blob) {
  return sizeof(kRendezvousMagic) + 4 + 4 + 8 + key + blob + 8;
}

/// The file's bytes for (key, blob).
inline std::vector<unsigned char> rendezvous_file(std::string_view key, std::span<const std::byte> blob) {
  std::vector<unsigned char> out(kRendezvousMagic, kRendezvousMagic + sizeof(kRendezvousMagic));
  append_bytes(out, kRendezvousVersion);
  append_bytes(out, static_cast<std::uint32_t>(key.size()));
  append_bytes(out, static_cast<std::uint64_t>(blob.size()));
  out.insert(out.end(), key.begin(), key.end());
  const auto* b = reinterpret_cast<const unsigned char*>(blob.data());
  out.insert(out.end(), b, b + blob.size());
  append_bytes(out, rendezvous_checksum(out.data(), out.size()));
  return out;
}

/// What a reader found at the path.
struct RendezvousRead {
  enum class State { absent, unreadable, other_key, ready } state = State::absent;
  std::string key;                   ///< other_key: the key found
  std::vector<unsigned char> bytes;  ///< ready: the blob
  std::string why;                   ///< unreadable: what was wrong
  bool foreign = false;              ///< unreadable: not a rendezvous file at all (no magic)
};

inline RendezvousRead read_rendezvous(const std::string& path, std::string_view key) {
  RendezvousRead r;
  // Non-blocking: a FIFO at the path would block a plain open until a writer came, past any timeout.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    if (errno != ENOENT) {
      r.state = RendezvousRead::State::unreadable;
      r.why = std::string("cannot open it: ") + std::strerror(errno);
    }
    return r;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    r.state = RendezvousRead::State::unreadable;
    r.why = "it is not a regular file";
    r.foreign = true;
    return r;
  }
  std::vector<unsigned char> data;
  unsigned char buffer[4096];
  while (data.size() <= kRendezvousMaxFile) {  // (one byte past it: too long, found below)
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    data.insert(data.end(), buffer, buffer + n);
  }
  ::close(fd);
  r.state = RendezvousRead::State::unreadable;
  constexpr std::size_t head = sizeof(kRendezvousMagic) + 4 + 4 + 8;
  if (data.size() < sizeof(kRendezvousMagic) ||
      std::memcmp(data.data(), kRendezvousMagic, sizeof(kRendezvousMagic)) != 0) {
    r.why = "it is not a tandem rendezvous file";
    r.foreign = true;
    return r;
  }
  if (data.size() < head + 8) {
    r.why = "it is shorter than a rendezvous file's header (truncated?)";
    return r;
  }
  if (data.size() > kRendezvousMaxFile) {
    r.why = "it is over the " + std::to_string(kRendezvousMaxFile) + " bytes a rendezvous file holds";
    return r;
  }
  std::uint32_t version = 0, key_bytes = 0;
  std::uint64_t blob_bytes = 0;
  std::memcpy(&version, data.data() + 8, 4);
  std::memcpy(&key_bytes, data.data() + 12, 4);
  std::memcpy(&blob_bytes, data.data() + 16, 8);
  if (version != kRendezvousVersion) {
    r.why = "its format version is " + std::to_string(version) + ", not " + std::to_string(kRendezvousVersion);
    return r;
  }
  if (key_bytes > data.size() || blob_bytes > data.size() || data.size() != head + key_bytes + blob_bytes + 8) {
    r.why = "its length does not match its header (truncated?)";
    return r;
  }
  std::uint64_t sum = 0;
  std::memcpy(&sum, data.data() + data.size() - 8, 8);
  if (sum != rendezvous_checksum(data.data(), data.size() - 8)) {
    r.why = "its checksum does not match (corrupted?)";
    return r;
  }
  r.key.assign(reinterpret_cast<const char*>(data.data() + head), key_bytes);
  if (r.key != key) {
    r.state = RendezvousRead::State::other_key;
    return r;
  }
  r.state = RendezvousRead::State::ready;
  r.bytes.assign(data.begin() + static_cast<std::ptrdiff_t>(head + key_bytes), data.end() - 8);
  return r;
}

}  // namespace detail

/// Removes `path` if it holds a rendezvous file with `key` (nothing else: a file of another run, or one that does not
/// read, stays). Returns whether it removed one; throws tandem::error when the system refuses.
inline bool remove_blob(const std::string& path, std::string_view key) {
  if (detail::read_rendezvous(path, key).state != detail::RendezvousRead::State::ready) return false;
  if (::unlink(path.c_str()) != 0 && errno != ENOENT)
    detail::fail("tandem: remove_blob: cannot remove `" + path + "`: " + std::strerror(errno));
  return true;
}

namespace detail {
/// Calls remove_blob(path, key) when it goes out of scope, by return or by exception; an error is dropped (the file
/// stays, and the next publish_blob with this key says so).
struct BlobRemoval {
  std::string path, key;
  BlobRemoval(std::string p, std::string k) : path(std::move(p)), key(std::move(k)) {}
  BlobRemoval(const BlobRemoval&) = delete;
  BlobRemoval& operator=(const BlobRemoval&) = delete;
  ~BlobRemoval() {
    try {
      remove_blob(path, key);
    } catch (const std::exception&) {
    }
  }
};
}  // namespace detail

/// Rank 0's half: writes (key, blob) to `path` atomically (temporary file, fsync, rename). Throws tandem::error
/// naming the path and the system's reason when it cannot, and when `path` already holds a file with `key`: an
/// earlier use of the key left it, and readers may have taken its blob for this one's (the file is removed, so that
/// the next run starts clean; give each run a key of its own, see the top of this file).
/// Throws too, changing nothing, for an empty key, a file over 16 MiB (a blob for a rendezvous, not data), and where
/// `path` holds a file that is not a rendezvous file (tandem replaces only its own).
inline void publish_blob(const std::string& path, std::string_view key, std::span<const std::byte> blob) {
  if (key.empty())
    detail::fail("tandem: publish_blob: the key is empty; pass a key unique to the run (docs/launching.md)");
  if (key.size() > detail::kRendezvousMaxFile || blob.size() > detail::kRendezvousMaxFile ||  // (the sum below fits)
      detail::rendezvous_file_bytes(key.size(), blob.size()) > detail::kRendezvousMaxFile)
    detail::fail("tandem: publish_blob: a " + std::to_string(blob.size()) + "-byte blob with a " +
                 std::to_string(key.size()) + "-byte key makes a rendezvous file over the " +
                 std::to_string(detail::kRendezvousMaxFile) + " bytes readers read; a rendezvous shares a small blob");
  if (const detail::RendezvousRead there = detail::read_rendezvous(path, key); there.foreign)
    detail::fail("tandem: publish_blob: `" + path + "` holds a file that is not a tandem rendezvous file, which " +
                 "publish_blob does not replace; pass a path of its own to the rendezvous");
  if (remove_blob(path, key))
    detail::fail("tandem: publish_blob: `" + path + "` already holds a rendezvous file with key \"" + std::string(key) +
                 "\", left by an earlier run with the same key (one that ended before removing it, or one running "
                 "beside this one); this run's other ranks may have taken its stale blob, so rank 0 stops here. The "
                 "file is removed: start the run again, with a key unique to each run (not MASTER_ADDR:MASTER_PORT; "
                 "docs/launching.md)");
  const std::vector<unsigned char> file = detail::rendezvous_file(key, blob);
  try {
    detail::AtomicFile out(path, "the rendezvous file");
    out.write(file.data(), file.size());
    try {
      out.commit();
    } catch (const error&) {
      if (!out.renamed()) throw;  // in place: the blob is for this run, whose readers need no power-loss durability
    }
  } catch (const error& e) {
    detail::fail(std::string("tandem: publish_blob: ") + e.what() +
                 "; pass a path in a writable directory that every rank sees");
  }
}

/// The other ranks' half: waits until `path` holds a complete file with `key` and returns its blob. Throws
/// tandem::timeout_error after options.timeout (saying whether it found nothing, a stale file with another key, or an
/// unreadable file), and tandem::error when the blob's size is not `expected_bytes` (pass 0 to accept any size).
inline std::vector<std::byte> wait_for_blob(const std::string& path, std::string_view key, std::size_t expected_bytes,
                                            FileRendezvousOptions options = {}) {
  if (options.timeout.count() <= 0 || options.poll_interval.count() <= 0)
    detail::fail("tandem: wait_for_blob: `options.timeout` and `options.poll_interval` must be positive");
  const auto deadline = detail::deadline_after(std::chrono::steady_clock::now(), options.timeout);
  detail::RendezvousRead last;
  while (true) {
    last = detail::read_rendezvous(path, key);
    if (last.state == detail::RendezvousRead::State::ready) {
      if (expected_bytes != 0 && last.bytes.size() != expected_bytes)
        detail::fail("tandem: wait_for_blob: `" + path + "` holds a " + std::to_string(last.bytes.size()) +
                     "-byte blob but this rank expects " + std::to_string(expected_bytes) +
                     " bytes; every rank must exchange the same kind of blob");
      std::vector<std::byte> blob(last.bytes.size());
      if (!blob.empty()) std::memcpy(blob.data(), last.bytes.data(), blob.size());
      return blob;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) break;
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(options.poll_interval, deadline - now));
  }
  std::string found;
  switch (last.state) {
    case detail::RendezvousRead::State::absent:
      found = "no file there (does rank 0 write it, and is the path on a file system every rank sees?)";
      break;
    case detail::RendezvousRead::State::other_key:
      found = "a file with key \"" + last.key + "\" (left by another job?) instead of \"" + std::string(key) + "\"";
      break;
    default:
      found = "a file it cannot use: " + last.why;
      break;
  }
  throw timeout_error("tandem: wait_for_blob: waited " + std::to_string(options.timeout.count()) + " ms for `" + path +
                      "` and found " + found);
}

/// Both halves: rank 0 publishes `blob`; every other rank fills `blob` (same size) from the file. It removes nothing:
/// rank 0 calls remove_blob once every rank has used the blob (after a barrier, say).
inline void share_blob(const std::string& path, std::string_view key, int rank, std::span<std::byte> blob,
                       FileRendezvousOptions options = {}) {
  if (rank < 0) detail::fail("tandem: share_blob: `rank` is " + std::to_string(rank) + "; pass this process's rank");
  if (blob.empty()) detail::fail("tandem: share_blob: `blob` is empty; pass the buffer to share (rank 0) or fill");
  if (rank == 0) {
    publish_blob(path, key, blob);
    return;
  }
  const std::vector<std::byte> got = wait_for_blob(path, key, blob.size(), options);
  std::memcpy(blob.data(), got.data(), blob.size());
}

}  // namespace tandem
