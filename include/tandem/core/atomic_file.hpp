// SPDX-License-Identifier: Apache-2.0
// AtomicFile: the one way tandem writes a file that others read (checkpoint shards and manifests, the rendezvous
// blob). It writes a temporary file beside the target, named uniquely for each writer (process id and a per-process
// count, so that writers in several threads or processes never share one), flushes it to disk and renames it over
// the target: readers see the old file or the new one, never a part. A writer that fails, or is destroyed before
// commit(), removes its temporary file; only a crash (or the test hook below) leaves it behind. POSIX.
#pragma once

#include <fcntl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "tandem/core/error.hpp"

namespace tandem::detail {

/// Test hook: when non-zero, an AtomicFile of this thread fails (as a crash would: its temporary file stays) once it
/// has written this many bytes. Never set it in production code.
inline std::size_t& checkpoint_fault_after_bytes() {
  static thread_local std::size_t bytes = 0;
  return bytes;
}

/// Test hook: when non-zero, the commit() that many commits from now on this thread (1: the next) renames its file and
/// then fails the directory's flush, as an I/O error (EIO) would. Never set it in production code.
inline unsigned& directory_flush_fault_at() {
  static thread_local unsigned commits = 0;
  return commits;
}

/// Throws tandem::error where `dir`, a checkpoint's directory, is an empty path: `dir + "/" + name` would be a file in
/// the file system's root.
inline void check_directory_named(const std::string& dir) {
  if (dir.empty()) fail("tandem: the checkpoint directory is an empty path (its files would go to `/`); name one");
}

/// The directory at `path` opened for flush_directory, or -1 (errno set).
inline int open_directory(const char* path) { return ::open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC); }

/// Flushes the open directory `fd` (its entries: a file renamed or created in it then survives a power loss). Returns
/// 0, or the error: a file system that has no directory flush (EINVAL, EROFS, ENOTSUP: some network and FUSE mounts)
/// counts as flushed.
inline int flush_directory(int fd) {
  if (::fsync(fd) == 0) return 0;
  const int e = errno;
  return e == EINVAL || e == EROFS || e == ENOTSUP || e == EOPNOTSUPP ? 0 : e;
}

/// Creates directory `dir` and its missing parents (as std::filesystem::create_directories), and makes each new
/// entry durable by flushing the directory that holds it: a file committed into `dir` then survives a power loss
/// with the directory itself. Throws tandem::error naming what failed, and for an empty path.
TANDEM_COLD inline void create_directories_durably(const std::string& dir) {
  namespace fs = std::filesystem;
  check_directory_named(dir);
  std::vector<fs::path> missing;  // from `dir` up to its first existing ancestor
  std::error_code ec;
  fs::path start = fs::path(dir).lexically_normal();
  if (!start.has_filename()) start = start.parent_path();  // ("a/b/": "a/b")
  for (fs::path p = start; !p.empty() && !fs::exists(p, ec); p = p.parent_path()) {
    missing.push_back(p);
    if (p == p.parent_path()) break;
  }
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
    if (!fs::create_directory(*it, ec) && ec)
      fail("tandem: cannot create the directory `" + it->string() + "`: " + ec.message());
    const fs::path parent = it->has_parent_path() ? it->parent_path() : fs::path(".");
    const int fd = open_directory(parent.c_str());
    const int e = fd < 0 ? errno : flush_directory(fd);
    if (fd >= 0) ::close(fd);
    if (e != 0)
      fail("tandem: cannot flush the directory `" + parent.string() + "` after creating `" + it->string() +
           "`: " + std::strerror(e));
  }
}

/// A temporary name beside `path` that no other writer uses.
inline std::string unique_temp_name(const std::string& path) {
  static std::atomic<std::uint64_t> count{0};
  return path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(count.fetch_add(1));
}

class AtomicFile {
 public:
  /// The most pieces one call of write(pieces) writes (the system's IOV_MAX).
#ifdef IOV_MAX
  static constexpr std::size_t max_pieces = IOV_MAX;
#else
  static constexpr std::size_t max_pieces = 16;  // (POSIX's least IOV_MAX)
#endif

  /// Creates the temporary file; `what` names the file in errors ("the checkpoint").
  AtomicFile(std::string path, std::string what)
      : path_(std::move(path)), temp_(unique_temp_name(path_)), what_(std::move(what)) {
    fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ < 0) fail("tandem: cannot create " + what_ + " `" + temp_ + "`: " + std::strerror(errno));
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_ && !crashed_) ::unlink(temp_.c_str());
  }

  /// Reserves disk space for a file of `bytes` (the size stays what was written): one allocation instead of one per
  /// write, and a disk without room for the whole file fails here, before anything is written. A file system that
  /// cannot reserve space ahead (no fallocate) writes as it would without.
  void reserve(std::uint64_t bytes) {
#ifdef __linux__
    if (bytes == 0) return;
    int r;
    do r = ::fallocate(fd_, FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(bytes));
    while (r != 0 && errno == EINTR);
    if (r != 0 && (errno == ENOSPC || errno == EDQUOT || errno == EFBIG))
      fail("tandem: no room on the disk for " + what_ + " `" + temp_ + "` (" + std::to_string(bytes) +
           " bytes): " + std::strerror(errno));
#else
    (void)bytes;
#endif
  }

  /// Appends n bytes.
  void write(const void* data, std::size_t n) {
    const std::size_t limit = checkpoint_fault_after_bytes();
    if (limit != 0 && written_ + n > limit) {
      put(data, limit - written_, written_);
      ::close(fd_);
      fd_ = -1;
      crashed_ = true;  // a crash: the partial temporary file stays behind, as it would
      fail("tandem: simulated crash while writing " + what_);
    }
    put(data, n, written_);
    written_ += n;
  }
  /// Appends the pieces, in order, with as few calls as the system allows (max_pieces each); `pieces` is consumed
  /// (advanced past what a call wrote).
  void write(std::vector<struct iovec>& pieces) {
    std::size_t n = 0;
    for (const struct iovec& v : pieces) n += v.iov_len;
    const std::size_t limit = checkpoint_fault_after_bytes();
    if (limit != 0 && written_ + n > limit) {  // (the simulated crash, as write() has it)
      for (const struct iovec& v : pieces) write(v.iov_base, v.iov_len);
      return;
    }
    std::uint64_t offset = written_;
    for (std::size_t first = 0; first < pieces.size();) {
      if (pieces[first].iov_len == 0) {
        ++first;
        continue;
      }
      const int count = static_cast<int>(std::min(pieces.size() - first, max_pieces));
      const ssize_t w = ::pwritev(fd_, pieces.data() + first, count, static_cast<off_t>(offset));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) fail("tandem: cannot write " + what_ + " `" + temp_ + "`: " + std::strerror(errno));
      offset += static_cast<std::uint64_t>(w);
      for (auto done = static_cast<std::size_t>(w); done > 0;) {  // past the pieces it wrote, into one it began
        struct iovec& v = pieces[first];
        const std::size_t k = std::min(done, v.iov_len);
        v.iov_base = static_cast<char*>(v.iov_base) + k;
        v.iov_len -= k;
        done -= k;
        if (v.iov_len == 0) ++first;
      }
    }
    written_ += n;
  }
  /// Overwrites n bytes at `offset` (inside what was written).
  void write_at(std::uint64_t offset, const void* data, std::size_t n) { put(data, n, offset); }
  std::size_t written() const { return written_; }
  const std::string& path() const { return path_; }

  /// Flushes the file to disk, renames it over the target and flushes the directory, so that the rename survives a
  /// power loss. Throws tandem::error before the rename, also where the directory cannot be opened for its flush; and
  /// after it only where that flush fails (renamed() is then true: the file is in place, but a power loss may undo the
  /// rename; flush_directory says which errors count).
  void commit() {
    if (::fsync(fd_) != 0) fail("tandem: cannot flush " + what_ + " `" + temp_ + "`: " + std::strerror(errno));
    if (::close(std::exchange(fd_, -1)) != 0)
      fail("tandem: cannot close " + what_ + " `" + temp_ + "`: " + std::strerror(errno));
    const std::size_t slash = path_.find_last_of('/');
    const std::string dir = slash == std::string::npos ? "." : path_.substr(0, slash + 1);
    const int dfd = open_directory(dir.c_str());
    if (dfd < 0)
      fail("tandem: cannot open the directory `" + dir + "` to make the rename of " + what_ + " `" + path_ +
           "` durable: " + std::strerror(errno));
    struct Closer {
      int fd;
      ~Closer() { ::close(fd); }
    } const closer{dfd};
    if (::rename(temp_.c_str(), path_.c_str()) != 0)
      fail("tandem: cannot rename `" + temp_ + "` to `" + path_ + "`: " + std::strerror(errno));
    committed_ = true;
    unsigned& fault = directory_flush_fault_at();
    const bool faulted = fault != 0 && --fault == 0;
    const int e = faulted ? EIO : flush_directory(dfd);
    if (e != 0)
      fail("tandem: " + what_ + " `" + path_ + "` is in place, but flushing its directory failed (" + std::strerror(e) +
           "): a power loss may undo its rename");
  }
  /// Whether commit() renamed the file over the target (so that a throw from it came from the directory's flush).
  bool renamed() const { return committed_; }

 private:
  void put(const void* data, std::size_t n, std::uint64_t offset) {
    const auto* p = static_cast<const unsigned char*>(data);
    while (n > 0) {
      const ssize_t w = ::pwrite(fd_, p, n, static_cast<off_t>(offset));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) fail("tandem: cannot write " + what_ + " `" + temp_ + "`: " + std::strerror(errno));
      p += w;
      n -= static_cast<std::size_t>(w);
      offset += static_cast<std::uint64_t>(w);
    }
  }

  std::string path_, temp_, what_;
  int fd_ = -1;
  std::size_t written_ = 0;
  bool committed_ = false, crashed_ = false;
};

}  // namespace tandem::detail
