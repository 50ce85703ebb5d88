// SPDX-License-Identifier: Apache-2.0
// Mpi: a tandem::Communicator whose ranks are MPI processes, on host memory, with NCCL's semantics and results equal
// bit for bit to LocalGroup's at the same world size.
//
// Why not MPI_Allreduce: MPI leaves the reduction order to the implementation (Open MPI picks an algorithm by size
// and rank count, and recursive doubling or a ring adds in different orders on different ranks), has no average,
// and reduces bf16/fp16 in nothing portable. tandem's guarantee is that every communicator reduces element i as
// ((s0[i] + s1[i]) + s2[i]) + ... in rank order, accumulated in fp32 (fp64 for fp64) and rounded once. So Mpi moves
// bytes with MPI point-to-point messages and reduces with LocalGroup's own code (detail::local_reduce):
//
//   reduce_scatter  rank q sends block r of its send to rank r; rank r reduces the blocks it holds in rank order
//   all_reduce      the same on `size` slices of the buffer (detail::local_slice), then each rank sends its reduced
//                   slice to every rank: reduce-scatter + all-gather, the bytes a ring moves, 2 (N-1)/N per rank
//   all_gather      every rank sends its block to every rank
//   broadcast       the root sends to every rank
//
// Every collective begins with a header exchange: each rank sends a 256-byte description of its call (kind, count,
// dtype, op, root, call number, or why it rejected its own arguments) to every other rank, and every rank reaches
// the same verdict from them as LocalGroup does (detail::check_agreement): disagreeing or rejected calls throw
// tandem::error on every rank and leave the communicator usable. Only then does data move, so no message ever lands
// in a buffer of the wrong size. The in-place forms (send == recv; recv == send + rank*count for reduce_scatter;
// send == recv + rank*count for all_gather) need no MPI_IN_PLACE: the sends of a phase complete before its results
// are written, and a reduction reads each block of its inputs before writing it. Transfers larger than
// MpiOptions::max_message_bytes (default 1 GiB, below MPI's int count limit) are split into several messages, so any
// count that fits in memory works.
//
// Nothing blocks: messages are non-blocking and polled (spinning, then yielding, then sleeping 100 us at a time), so a
// waiting rank can notice, and report, every way the call can fail:
//   - a peer threw, timed out or found a dead peer: it sends a notice; the others throw tandem::peer_error naming it
//     ("tandem: rank 1 failed: ..."). A tandem::Mpi destroyed by an exception sends one too; Mpi::abort(what) sends
//     the exception's text.
//   - a peer destroyed its Mpi before this call (it stopped early): its departure notice makes the others throw
//     tandem::error at once.
//   - a peer's process is gone (killed, crashed) and it runs on this host: a waiting rank checks every
//     MpiOptions::liveness_interval that the processes it waits for still exist (Linux /proc; the check knows the
//     process start time, so a reused pid does not fool it) and throws tandem::peer_error naming the rank and pid.
//   - anything else (a peer on another host died, hangs, or never called): after MpiOptions::timeout (default 5
//     minutes) tandem::timeout_error names the ranks whose messages did not arrive.
// Destruction is a handshake: each rank sends a departure notice and waits (at most 2 s) for every peer's, so that no
// message is left unreceived when the duplicate is freed (Open MPI reuses context ids, and a message that arrives for
// a freed communicator would corrupt the next one); where the handshake does not complete, the duplicate is kept until
// MPI_Finalize instead.
// After any of these the communicator is unusable (its pending messages are cancelled; every later call throws), and
// MPI itself usually is too: report the error and end the process with a non-zero status (docs/launching.md). Before
// it throws, a failing rank cancels its transfers and tells its peers, waiting briefly for both, but never for a
// transfer with a dead peer or a send to a failed one (Open MPI leaves those pending for ever): a rank that finds a
// dead peer throws about liveness_interval after the death (tests/mpi/run_failure.cmake checks it). A receive MPI has
// already matched cannot be cancelled: its data may still land in the call's receive buffer after the throw (measured
// with Open MPI over TCP: a 1 GiB broadcast that timed out went on filling it). tandem keeps its own staging for such
// a receive alive until the process ends; the caller's buffers of a failed call must stay too, so end the process
// without freeing them (a DataParallel destroyed by the exception frees its buffers).
//
// Streams: a collective runs on the calling thread and is complete when it returns. Given Stream{} (HostBackend) it
// runs at once; given a HostStream's stream (StreamHostBackend) it first waits for the work enqueued on that stream
// (HostStream::synchronize), so it reads what that work wrote, and work enqueued after it reads its results. A CUDA
// stream is refused with tandem::error: Mpi moves host memory, and device buffers need tandem::Nccl (on GPUs, join one
// over this Mpi with nccl_from_host_comm). Neither can be captured (HostStream::begin_capture): a replay would not
// run the collective. A refused stream is told to every rank in the call's header, as bad arguments are, so every rank
// throws at once; a HostStream whose work failed fails the rank, which tells the others.
//
// Errors of MPI calls throw tandem::mpi_error (TANDEM_MPI_CHECK): the communicator is a duplicate of the one passed
// in, with MPI_ERRORS_RETURN set, so MPI returns its errors instead of aborting the job. Only the duplication itself
// (MPI_Comm_idup, in the constructor) runs under the error handler of the communicator passed in (MPI's default
// aborts the job).
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <signal.h>
#include <unistd.h>
#endif

#include "tandem/backend/host.hpp"
#include "tandem/backend/host_stream.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/comm/local_group.hpp"
#include "tandem/core/deadline.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/hash.hpp"
#include "tandem/core/stream.hpp"

/// Evaluates an MPI call once; unless it returns MPI_SUCCESS, throws tandem::mpi_error with the status, MPI's text
/// for it, the call, file:line and the rank in MPI_COMM_WORLD. Needs the communicator's error handler to be
/// MPI_ERRORS_RETURN (tandem::Mpi sets it on its own); under MPI_ERRORS_ARE_FATAL, MPI aborts before returning.
#define TANDEM_MPI_CHECK(call)                                                          \
  do {                                                                                  \
    const int tandem_mpi_status_ = (call);                                              \
    if (tandem_mpi_status_ != MPI_SUCCESS)                                              \
      ::tandem::detail::throw_mpi_error(tandem_mpi_status_, #call, __FILE__, __LINE__); \
  } while (0)

namespace tandem {

/// Options of an Mpi communicator, for designated initializers: `tandem::Mpi comm(MPI_COMM_WORLD, {.timeout = 30s});`.
struct MpiOptions {
  /// How long one collective (or the construction) may wait for the other ranks before it throws
  /// tandem::timeout_error naming the ranks that did not arrive.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  /// How often a waiting rank checks that the processes it waits for on this host still exist; 0 disables it.
  std::chrono::milliseconds liveness_interval{100};
  /// The largest single MPI message, in bytes (1 to INT_MAX); larger transfers are split into several. The same on
  /// every rank: construction throws on every rank where ranks differ.
  std::size_t max_message_bytes = std::size_t{1} << 30;
};

namespace detail {

/// This process's rank in MPI_COMM_WORLD, or -1 when MPI is not initialized (or already finalized).
inline int mpi_world_rank() noexcept {
  int initialized = 0, finalized = 0;
  if (MPI_Initialized(&initialized) != MPI_SUCCESS || !initialized) return -1;
  if (MPI_Finalized(&finalized) != MPI_SUCCESS || finalized) return -1;
  int rank = -1;
  if (MPI_Comm_rank(MPI_COMM_WORLD, &rank) != MPI_SUCCESS) return -1;
  return rank;
}

/// MPI's own text for a status ("MPI_ERR_TRUNCATE: message truncated").
inline std::string mpi_status_text(int status) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(status, text, &length) != MPI_SUCCESS) return "unknown MPI error";
  return std::string(text, static_cast<std::size_t>(std::max(0, std::min(length, MPI_MAX_ERROR_STRING))));
}

/// "tandem: MPI call `MPI_Isend(...)` failed with status 15 (MPI_ERR_TRUNCATE: message truncated) at mpi.hpp:123 on
/// rank 2 of MPI_COMM_WORLD".
[[noreturn]] inline void throw_mpi_error(int status, const char* call, const char* file, int line) {
  std::string s = std::string("tandem: MPI call `") + call + "` failed with status " + std::to_string(status) + " (" +
                  mpi_status_text(status) + ") at " + file + ":" + std::to_string(line);
  const int rank = mpi_world_rank();
  s += rank >= 0 ? " on rank " + std::to_string(rank) + " of MPI_COMM_WORLD" : " (MPI is not initialized)";
  throw mpi_error(s);
}

// --- Wire formats ----------------------------------------------------------------------------------------------------

inline constexpr int kMpiHeaderTag = 7301;  // call headers
inline constexpr int kMpiDataTag = 7302;    // the data of a call, in order
inline constexpr int kMpiNoticeTag = 7303;  // failure and departure notices, probed for while waiting

/// The kinds of call a header announces: the collectives, plus `hello`, the exchange construction runs.
enum class MpiCallKind : std::uint8_t { all_reduce, reduce_scatter, all_gather, broadcast, barrier, hello };

/// One rank's call as it travels to every other rank. `nonce` is the sender's, drawn at construction: messages left
/// over from an earlier communicator (MPI may reuse its context id) carry another and are dropped.
struct MpiHeader {
  std::uint64_t nonce = 0;
  std::uint64_t call = 0;   ///< the call number on the sender (0: hello)
  std::uint64_t count = 0;  ///< elements (hello: the sender's MpiOptions::max_message_bytes)
  std::int64_t pid = 0;     ///< hello: the sender's process id
  std::uint64_t start = 0;  ///< hello: its start time (Linux /proc, clock ticks since boot; 0: unknown)
  std::uint64_t host = 0;   ///< hello: a hash of its kernel boot id and pid namespace (0: unknown)
  std::int32_t root = 0;
  MpiCallKind kind = MpiCallKind::barrier;
  DType dtype = DType::fp32;
  std::uint8_t op = 0;        ///< ReduceOp
  std::uint8_t rejected = 0;  ///< 1: the sender rejected its own arguments, for the reason below
  char reason[200] = {};      ///< NUL-terminated (truncated) text of the rejection
};
static_assert(sizeof(MpiHeader) == 256, "MpiHeader is a fixed 256-byte message");

enum class MpiNoticeKind : std::uint32_t { failed, departed };

/// A notice: the sender failed (with a message), or destroyed its Mpi after completing `calls` calls.
struct MpiNotice {
  std::uint64_t nonce = 0;
  std::uint64_t calls = 0;
  MpiNoticeKind kind = MpiNoticeKind::failed;
  std::uint32_t reserved = 0;
  char message[1000] = {};
};
static_assert(sizeof(MpiNotice) == 1024, "MpiNotice is a fixed 1024-byte message");

inline void copy_text(char* dst, std::size_t capacity, std::string_view text) {
  const std::size_t n = std::min(capacity - 1, text.size());
  std::memcpy(dst, text.data(), n);
  dst[n] = '\0';
}

inline std::string text_of(const char* src, std::size_t capacity) { return std::string(src, strnlen(src, capacity)); }

// --- Whether a process on this host still exists ---------------------------------------------------------------------

/// Who a process is, as far as a peer on the same host can check it.
struct ProcessIdentity {
  std::int64_t pid = 0;
  std::uint64_t start = 0;  ///< 0: unknown (liveness cannot be checked)
  std::uint64_t host = 0;   ///< equal for processes whose pids are comparable (same kernel, same pid namespace)
};

/// Field 22 of /proc/<pid>/stat (start time) and its state letter; nullopt when the process does not exist.
inline std::optional<std::pair<char, std::uint64_t>> read_proc_stat(const std::string& pid) {
#if defined(__linux__)
  std::FILE* f = std::fopen(("/proc/" + pid + "/stat").c_str(), "r");
  if (f == nullptr) return std::nullopt;
  char buffer[1024];
  const std::size_t n = std::fread(buffer, 1, sizeof(buffer) - 1, f);
  std::fclose(f);
  buffer[n] = '\0';
  const char* p = std::strrchr(buffer, ')');  // the command name may hold spaces and parentheses
  if (p == nullptr) return std::nullopt;
  char state = 0;
  unsigned long long start = 0;
  // ") S ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime cstime priority nice
  //  num_threads itrealvalue starttime"
  if (std::sscanf(p + 1, " %c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d %llu", &state,
                  &start) != 2)
    return std::nullopt;
  return std::make_pair(state, static_cast<std::uint64_t>(start));
#else
  (void)pid;
  return std::nullopt;
#endif
}

inline std::string read_small_file(const char* path) {
  std::string s;
  if (std::FILE* f = std::fopen(path, "r")) {
    char buffer[256];
    const std::size_t n = std::fread(buffer, 1, sizeof(buffer), f);
    std::fclose(f);
    s.assign(buffer, n);
  }
  return s;
}

inline ProcessIdentity this_process() {
  ProcessIdentity id;
#if defined(__linux__)
  id.pid = static_cast<std::int64_t>(::getpid());
  if (const auto stat = read_proc_stat("self")) id.start = stat->second;
  char ns[128] = {};
  const ssize_t n = ::readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
  const std::string boot = read_small_file("/proc/sys/kernel/random/boot_id");
  if (n > 0 && !boot.empty() && id.start != 0)
    id.host = fnv1a(std::string_view(ns, static_cast<std::size_t>(n)), fnv1a(boot));
#endif
  return id;
}

/// True only when `p` certainly no longer runs: its pid is gone, is a zombie, or belongs to a later process. A stat
/// file that does not read for another reason (no descriptor left, say) proves nothing: the pid must be gone too.
inline bool process_gone(const ProcessIdentity& p) {
  if (p.start == 0) return false;
  const auto stat = read_proc_stat(std::to_string(p.pid));
#if defined(__linux__)
  if (!stat) return ::kill(static_cast<pid_t>(p.pid), 0) != 0 && errno == ESRCH;
#else
  if (!stat) return false;
#endif
  return stat->first == 'Z' || stat->first == 'X' || stat->second != p.start;
}

/// The requests of one phase of a call, each with the peer it talks to and its direction.
struct MpiPending {
  std::vector<MPI_Request> requests;
  std::vector<int> peers;
  std::vector<unsigned char> receiving;

  void add(MPI_Request r, int peer, bool receive) {
    requests.push_back(r);
    peers.push_back(peer);
    receiving.push_back(receive ? 1 : 0);
  }
  bool done() const {
    return std::all_of(requests.begin(), requests.end(), [](MPI_Request r) { return r == MPI_REQUEST_NULL; });
  }
  void reserve(std::size_t n) {
    requests.reserve(n);
    peers.reserve(n);
    receiving.reserve(n);
  }
  void clear() {
    requests.clear();
    peers.clear();
    receiving.clear();
  }
};

inline std::string rank_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) s += (i == 0 ? "" : ", ") + std::to_string(ranks[i]);
  return s;
}

}  // namespace detail

/// A communicator over MPI processes (host memory). Collective over the MPI communicator: every rank constructs it,
/// calls the same collectives in the same order, and destroys it. Use it from one thread at a time; MPI must be
/// initialized before construction and finalized after destruction. Every call completes before it returns, after
/// the work enqueued on a HostStream it is given (see the top of this file).
///
///   MPI_Init(&argc, &argv);
///   {
///     tandem::Mpi comm(MPI_COMM_WORLD);
///     tandem::DataParallel<tandem::Replicated, tandem::AdamW, tandem::HostBackend, tandem::Mpi> dp(comm, ...);
///   }
///   MPI_Finalize();
class Mpi {
 public:
  /// Duplicates `comm` (the user's communicator is left as it was), sets MPI_ERRORS_RETURN on the duplicate, and
  /// exchanges with every rank what the failure checks need. Throws tandem::error for a null, inter- or uninitialized
  /// communicator or bad options, tandem::timeout_error when some ranks do not construct theirs within the timeout.
  explicit Mpi(MPI_Comm comm, MpiOptions options = {}) : options_(options), uncaught_(std::uncaught_exceptions()) {
    int initialized = 0, finalized = 0;
    TANDEM_MPI_CHECK(MPI_Initialized(&initialized));
    TANDEM_MPI_CHECK(MPI_Finalized(&finalized));
    if (!initialized || finalized)
      detail::fail(
          "tandem: Mpi: MPI is not initialized (or already finalized); call MPI_Init or MPI_Init_thread "
          "before constructing tandem::Mpi, and MPI_Finalize after destroying it");
    if (comm == MPI_COMM_NULL)
      detail::fail("tandem: Mpi: `comm` is MPI_COMM_NULL; pass a communicator (MPI_COMM_WORLD)");
    if (options.timeout.count() <= 0)
      detail::fail("tandem: Mpi: `options.timeout` is " + std::to_string(options.timeout.count()) +
                   " ms; pass a positive duration");
    if (options.liveness_interval.count() < 0)
      detail::fail("tandem: Mpi: `options.liveness_interval` is negative; pass 0 to disable the check");
    if (options.max_message_bytes < 1 || options.max_message_bytes > static_cast<std::size_t>(INT32_MAX))
      detail::fail("tandem: Mpi: `options.max_message_bytes` is " + std::to_string(options.max_message_bytes) +
                   "; pass 1 to 2147483647 (MPI counts are ints)");
    int inter = 0;
    TANDEM_MPI_CHECK(MPI_Comm_test_inter(comm, &inter));
    if (inter) detail::fail("tandem: Mpi: `comm` is an intercommunicator; pass an intracommunicator");

    // The duplicate, non-blocking so that construction honours the timeout too.
    MPI_Request dup = MPI_REQUEST_NULL;
    TANDEM_MPI_CHECK(MPI_Comm_idup(comm, &comm_, &dup));
    int rank = 0;
    TANDEM_MPI_CHECK(MPI_Comm_rank(comm, &rank));
    rank_ = rank;
    {
      detail::MpiPending pending;
      pending.add(dup, -1, true);
      wait(pending, "construction (MPI_Comm_idup)", detail::deadline_after(Clock::now(), options_.timeout));
    }
    TANDEM_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    MPI_Errhandler handler = MPI_ERRHANDLER_NULL;
    TANDEM_MPI_CHECK(MPI_Comm_get_errhandler(comm_, &handler));
    const bool returns = handler == MPI_ERRORS_RETURN;
    TANDEM_MPI_CHECK(MPI_Errhandler_free(&handler));
    if (!returns) detail::fail("tandem: Mpi: MPI_ERRORS_RETURN did not take effect on the duplicated communicator");
    TANDEM_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    TANDEM_MPI_CHECK(MPI_Comm_size(comm_, &size_));

    std::random_device device;
    nonce_ = (static_cast<std::uint64_t>(device()) << 32 ^ device()) ^
             static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    if (nonce_ == 0) nonce_ = 1;
    self_ = detail::this_process();
    peers_.resize(static_cast<std::size_t>(size_));
    departed_.assign(static_cast<std::size_t>(size_), std::nullopt);
    headers_.resize(static_cast<std::size_t>(size_));
    collective(detail::MpiCallKind::hello, nullptr, nullptr, 0, DType::fp32, ReduceOp::sum, 0);
    // Both sides of a transfer split it into messages of this size: ranks that differ would take a piece for a whole
    // and fill buffers partly. Every rank saw every rank's value, so all of them refuse, or none.
    for (int q = 0; q < size_; ++q) {
      const std::uint64_t theirs = peers_[static_cast<std::size_t>(q)].max_message_bytes;
      if (q == rank_ || theirs == options_.max_message_bytes) continue;
      MPI_Comm_free(&comm_);  // no message is on the way: the hello's sends and receives are complete on every rank
      detail::fail("tandem: Mpi: rank " + std::to_string(rank_) +
                   " was constructed with MpiOptions::max_message_bytes " + std::to_string(options_.max_message_bytes) +
                   " and rank " + std::to_string(q) + " with " + std::to_string(theirs) +
                   "; every rank must pass the same value");
    }
  }

  Mpi(const Mpi&) = delete;
  Mpi& operator=(const Mpi&) = delete;

  /// Tells the other ranks that this one leaves (or, while an exception propagates, that it failed), then frees the
  /// duplicate communicator. Never throws.
  ~Mpi() {
    // Departure is a handshake: each rank sends a notice to every peer, then waits (a bounded time) for theirs.
    int finalized = 1;
    if (MPI_Finalized(&finalized) != MPI_SUCCESS || finalized || comm_ == MPI_COMM_NULL) return;
    if (failed_.empty() && hello_done_) {
      // Departure: a peer still waiting for this rank's next call learns it will not come.
      if (std::uncaught_exceptions() > uncaught_) {
        abort(
            "its tandem::Mpi was destroyed by an exception (call Mpi::abort(what) in the handler to pass its text on)");
      } else {
        notify(detail::MpiNoticeKind::departed, "");
      }
    }
    // The communicator is freed only when no message to or from it can still be on the way: every peer said it
    // left (or failed), so each of our notices was received too. A message that arrives after MPI freed the
    // communicator would be delivered to a later one that reuses its context id (Open MPI does reuse them, and its
    // per-peer sequence numbers then lose messages). Otherwise it stays allocated until MPI_Finalize: a few KB, and
    // its context id is never reused while any rank still holds it.
    if (failed_.empty() && !leaked_ && all_peers_left()) MPI_Comm_free(&comm_);
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  /// The duplicate communicator tandem talks on (do not send on it yourself).
  MPI_Comm comm() const { return comm_; }
  const MpiOptions& options() const { return options_; }

  void all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op, Stream stream = {}) {
    collective(detail::MpiCallKind::all_reduce, send, recv, count, dtype, op, 0, stream);
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op, Stream stream = {}) {
    collective(detail::MpiCallKind::reduce_scatter, send, recv, count, dtype, op, 0, stream);
  }
  void all_gather(const void* send, void* recv, std::size_t count, DType dtype, Stream stream = {}) {
    collective(detail::MpiCallKind::all_gather, send, recv, count, dtype, ReduceOp::sum, 0, stream);
  }
  void broadcast(const void* send, void* recv, std::size_t count, DType dtype, int root, Stream stream = {}) {
    collective(detail::MpiCallKind::broadcast, send, recv, count, dtype, ReduceOp::sum, root, stream);
  }
  void barrier() { collective(detail::MpiCallKind::barrier, nullptr, nullptr, 0, DType::fp32, ReduceOp::sum, 0); }

  /// Tells every other rank that this one failed, with `what` (the exception's text, say): ranks waiting in (or later
  /// entering) a collective throw tandem::peer_error("tandem: rank R failed: what"). The communicator is unusable
  /// afterwards. Never throws; waits at most about a second for the notices to leave.
  void abort(std::string_view what) noexcept {
    if (!failed_.empty()) return;
    try {
      failed_ = "rank " + std::to_string(rank_) + " aborted: " + std::string(what);
    } catch (...) {
      failed_ = "aborted";
    }
    notify(detail::MpiNoticeKind::failed, what);
  }

 private:
  using Clock = std::chrono::steady_clock;

  // --- One call ------------------------------------------------------------------------------------------------------

  /// Why `stream` cannot order a collective on this thread (see the top of this file), or "" where it can.
  static std::string stream_refusal(Stream stream, detail::MpiCallKind kind) {
    if (stream.handle == nullptr) return {};  // the calling thread: its earlier work is done
    // (under the 199 characters a header carries to the other ranks)
    const std::string call = std::string("tandem: Mpi::") + call_name(kind);
    if (stream.kind != StreamKind::host_queue)
      return call +
             " was given a CUDA stream: Mpi moves host memory (HostBackend, StreamHostBackend); for device buffers "
             "use tandem::Nccl (nccl_from_host_comm)";
    if (detail::host_queue(stream)->capturing())
      return call +
             " on a capturing HostStream: a replay would not run a collective of the calling thread; capture with "
             "LocalComm, or run uncaptured";
    return {};
  }

  /// One call: its header to every rank (with this rank's own refusal of its arguments or stream, so that every rank
  /// throws at once), then the transfers. Given a HostStream, its earlier work is done first; a failure of that work
  /// fails this rank, which tells the others.
  void collective(detail::MpiCallKind kind, const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                  int root, Stream stream = {}) {
    const char* name = call_name(kind);
    if (!failed_.empty())
      throw error(std::string("tandem: ") + name + " on rank " + std::to_string(rank_) +
                  ": this communicator failed earlier (" + failed_ + ") and cannot be used any more");
    std::string verdict;
    try {
      drain_notices(name, nullptr);
      detail::LocalCall mine = detail::make_call(as_local(kind), send, recv, count, dtype, op, root, rank_, size_);
      if (mine.rejected.empty()) mine.rejected = stream_refusal(stream, kind);
      if (mine.rejected.empty() && stream.handle != nullptr) detail::host_queue(stream)->synchronize();
      // From here: the stream's work, however long, is this rank's own, not a wait for its peers.
      const Clock::time_point deadline = detail::deadline_after(Clock::now(), options_.timeout);
      exchange_headers(kind, mine, name, deadline);
      if (kind != detail::MpiCallKind::hello) {
        std::vector<detail::LocalCall> calls(static_cast<std::size_t>(size_));
        for (int q = 0; q < size_; ++q) {
          detail::LocalCall& c = calls[static_cast<std::size_t>(q)];
          if (q == rank_) {
            c = mine;
            continue;
          }
          const detail::MpiHeader& h = headers_[static_cast<std::size_t>(q)];
          c.kind = as_local(h.kind);
          c.dtype = h.dtype;
          c.op = static_cast<ReduceOp>(h.op);
          c.root = h.root;
          c.count = h.count;
          if (h.rejected) c.rejected = detail::text_of(h.reason, sizeof(h.reason));
        }
        verdict = detail::check_agreement(calls.data(), size_, rank_);
        if (verdict.empty() && kind != detail::MpiCallKind::barrier && count != 0)
          visit_dtype(dtype, [&](auto tag) { run<decltype(tag)>(kind, send, recv, count, op, root, name, deadline); });
      }
    } catch (const std::exception& e) {
      fail(e.what(), !from_notice_);  // a failure a peer's notice reported was told to everyone by that peer
      throw;
    }
    // Every rank got past the headers and reached the same verdict: this call is over on every rank.
    ++calls_;
    if (kind == detail::MpiCallKind::hello) hello_done_ = true;
    if (!verdict.empty()) throw error(std::move(verdict));
  }

  static detail::LocalCallKind as_local(detail::MpiCallKind kind) {
    return kind == detail::MpiCallKind::hello ? detail::LocalCallKind::barrier
                                              : static_cast<detail::LocalCallKind>(kind);
  }

  static const char* call_name(detail::MpiCallKind kind) {
    return kind == detail::MpiCallKind::hello ? "construction"
                                              : detail::local_call_name(static_cast<detail::LocalCallKind>(kind));
  }

  /// Every rank sends its header to every other rank; headers left over from an earlier communicator are dropped.
  void exchange_headers(detail::MpiCallKind kind, const detail::LocalCall& mine, const char* name,
                        Clock::time_point deadline) {
    detail::MpiHeader& out = header_out_;  // a member: a failed call cancels its sends only after this frame is gone
    out = {};
    out.nonce = nonce_;
    out.call = calls_;
    out.count = kind == detail::MpiCallKind::hello ? options_.max_message_bytes : mine.count;
    out.pid = self_.pid;
    out.start = self_.start;
    out.host = self_.host;
    out.root = mine.root;
    out.kind = kind;
    out.dtype = mine.dtype;
    out.op = static_cast<std::uint8_t>(mine.op);
    out.rejected = mine.rejected.empty() ? 0 : 1;
    detail::copy_text(out.reason, sizeof(out.reason), mine.rejected);

    std::vector<int> need;
    for (int q = 0; q < size_; ++q)
      if (q != rank_) need.push_back(q);
    detail::MpiPending& pending = in_flight_;
    pending.clear();
    for (const int q : need)
      post(pending, q, &headers_[static_cast<std::size_t>(q)], sizeof(detail::MpiHeader), detail::kMpiHeaderTag, true);
    for (const int q : need) post(pending, q, &out, sizeof(out), detail::kMpiHeaderTag, false);
    while (true) {
      wait(pending, name, deadline);
      pending.clear();
      for (const int q : need) {
        detail::MpiHeader& h = headers_[static_cast<std::size_t>(q)];
        const bool fresh = kind == detail::MpiCallKind::hello ? h.kind == detail::MpiCallKind::hello && h.call == 0
                                                              : h.nonce == peers_[static_cast<std::size_t>(q)].nonce;
        if (!fresh) {
          post(pending, q, &h, sizeof(h), detail::kMpiHeaderTag, true);
          continue;
        }
        if (kind == detail::MpiCallKind::hello) {
          Peer& p = peers_[static_cast<std::size_t>(q)];
          p.nonce = h.nonce;
          p.process = {h.pid, h.start, h.host};
          p.same_host = h.host != 0 && h.host == self_.host;
          p.max_message_bytes = h.count;
        } else if (h.call != calls_) {
          throw error("tandem: " + std::string(name) + " on rank " + std::to_string(rank_) + " is call " +
                      std::to_string(calls_) + " of this communicator but rank " + std::to_string(q) + " sent call " +
                      std::to_string(h.call) + "; the ranks lost step (an earlier call failed?)");
        }
      }
      if (pending.requests.empty()) return;
      need.clear();
      for (const int q : pending.peers) need.push_back(q);
    }
  }

  template <class T>
  void run(detail::MpiCallKind kind, const void* send, void* recv, std::size_t count, ReduceOp op, int root,
           const char* name, Clock::time_point deadline) {
    const auto* in = static_cast<const unsigned char*>(send);
    auto* out = static_cast<unsigned char*>(recv);
    const std::size_t bytes = count * sizeof(T);
    const auto me = static_cast<std::size_t>(rank_);
    detail::MpiPending& pending = in_flight_;
    pending.clear();
    switch (kind) {
      case detail::MpiCallKind::reduce_scatter:
        reduce_phase<T>(
            in, count, [&](int q) { return static_cast<std::size_t>(q) * count; }, [&](int) { return count; }, out, op,
            name, deadline);
        break;
      case detail::MpiCallKind::all_reduce: {
        const auto first = [&](int q) { return detail::local_slice<T>(count, size_, q).first; };
        const auto length = [&](int q) {
          const auto [a, b] = detail::local_slice<T>(count, size_, q);
          return b - a;
        };
        reduce_phase<T>(in, count, first, length, out + first(rank_) * sizeof(T), op, name, deadline);
        pending.clear();
        for (int q = 0; q < size_; ++q) {  // the all-gather of the reduced slices
          if (q == rank_) continue;
          post(pending, q, out + first(q) * sizeof(T), length(q) * sizeof(T), detail::kMpiDataTag, true);
        }
        for (int q = 0; q < size_; ++q)
          if (q != rank_)
            post(pending, q, out + first(rank_) * sizeof(T), length(rank_) * sizeof(T), detail::kMpiDataTag, false);
        wait(pending, name, deadline);
        break;
      }
      case detail::MpiCallKind::all_gather: {
        unsigned char* mine = out + me * bytes;
        if (mine != in) std::memcpy(mine, in, bytes);  // check_call rejected every other overlap
        for (int q = 0; q < size_; ++q)
          if (q != rank_) post(pending, q, out + static_cast<std::size_t>(q) * bytes, bytes, detail::kMpiDataTag, true);
        for (int q = 0; q < size_; ++q)
          if (q != rank_) post(pending, q, mine, bytes, detail::kMpiDataTag, false);
        wait(pending, name, deadline);
        break;
      }
      case detail::MpiCallKind::broadcast:
        if (rank_ == root) {
          if (out != in) std::memcpy(out, in, bytes);
          for (int q = 0; q < size_; ++q)
            if (q != rank_) post(pending, q, in, bytes, detail::kMpiDataTag, false);
        } else {
          post(pending, root, out, bytes, detail::kMpiDataTag, true);
        }
        wait(pending, name, deadline);
        break;
      case detail::MpiCallKind::barrier:
      case detail::MpiCallKind::hello:
        break;
    }
  }

  /// Rank q sends elements [first(q), first(q) + length(q)) of its input to rank q; each rank reduces what it
  /// received with its own part, in rank order (LocalGroup's code), into `result`.
  template <class T, class First, class Length>
  void reduce_phase(const unsigned char* in, std::size_t count, First first, Length length, unsigned char* result,
                    ReduceOp op, const char* name, Clock::time_point deadline) {
    (void)count;
    const std::size_t n = length(rank_);
    const std::size_t block = n * sizeof(T);
    const std::size_t need = block * static_cast<std::size_t>(size_ - 1);
    if (staging_.bytes() < need) {
      staging_ = HostBuffer<unsigned char>();
      staging_ = HostBuffer<unsigned char>(need);
    }
    std::vector<detail::LocalCall> calls(static_cast<std::size_t>(size_));
    detail::MpiPending& pending = in_flight_;
    pending.clear();
    std::size_t slot = 0;
    for (int q = 0; q < size_; ++q) {
      detail::LocalCall& c = calls[static_cast<std::size_t>(q)];
      if (q == rank_) {
        c.send = in + first(rank_) * sizeof(T);
        c.recv = result;
        continue;
      }
      unsigned char* at = staging_.data() + slot++ * block;
      c.send = at;
      post(pending, q, at, block, detail::kMpiDataTag, true);
    }
    for (int q = 0; q < size_; ++q)
      if (q != rank_) post(pending, q, in + first(q) * sizeof(T), length(q) * sizeof(T), detail::kMpiDataTag, false);
    wait(pending, name, deadline);
    if (n != 0) detail::local_reduce<T>(calls.data(), size_, 0, n, op, rank_, rank_ + 1, 0);
  }

  // --- Messages
  // --------------------------------------------------------------------------------------------------------

  /// Posts a receive from (or a send to) `peer`, split into messages of at most max_message_bytes.
  void post(detail::MpiPending& pending, int peer, const void* data, std::size_t bytes, int tag, bool receive) {
    auto* p = static_cast<unsigned char*>(const_cast<void*>(data));
    std::size_t done = 0;
    do {
      const std::size_t n = std::min(bytes - done, options_.max_message_bytes);
      MPI_Request r = MPI_REQUEST_NULL;
      if (receive) {
        TANDEM_MPI_CHECK(MPI_Irecv(p + done, static_cast<int>(n), MPI_BYTE, peer, tag, comm_, &r));
      } else {
        TANDEM_MPI_CHECK(MPI_Isend(p + done, static_cast<int>(n), MPI_BYTE, peer, tag, comm_, &r));
      }
      pending.add(r, peer, receive);
      done += n;
    } while (done < bytes);
  }

  /// Polls until every request of `pending` completed. Throws (leaving the rest to fail()) when a peer failed,
  /// departed or died, or at the deadline.
  void wait(detail::MpiPending& pending, const char* name, Clock::time_point deadline) {
    const Clock::time_point start = Clock::now();
    Clock::time_point next_liveness = detail::deadline_after(start, options_.liveness_interval);
    std::vector<int> indices(pending.requests.size());
    std::vector<MPI_Status> statuses(pending.requests.size());
    for (std::uint64_t poll = 0;; ++poll) {
      int completed = 0;
      const int status = MPI_Testsome(static_cast<int>(pending.requests.size()), pending.requests.data(), &completed,
                                      indices.data(), statuses.data());
      if (status != MPI_SUCCESS) {
        int code = status;
        int peer = -1;
        if (status == MPI_ERR_IN_STATUS)
          for (int i = 0; i < completed; ++i)
            if (statuses[static_cast<std::size_t>(i)].MPI_ERROR != MPI_SUCCESS) {
              code = statuses[static_cast<std::size_t>(i)].MPI_ERROR;
              peer = pending.peers[static_cast<std::size_t>(indices[static_cast<std::size_t>(i)])];
              break;
            }
        throw mpi_error("tandem: " + std::string(name) + " on rank " + std::to_string(rank_) +
                        ": MPI reported status " + std::to_string(code) + " (" + detail::mpi_status_text(code) + ")" +
                        (peer >= 0 ? " on a message with rank " + std::to_string(peer) : std::string()));
      }
      if (completed == MPI_UNDEFINED || pending.done()) {
        // The caller's own pending vector is cleared by the caller when it reuses it.
        return;
      }
      if (poll < 256) continue;  // spin: most calls complete within microseconds
      if (poll % 16 == 0) {
        const Clock::time_point now = Clock::now();
        if (comm_ != MPI_COMM_NULL && hello_done_) drain_notices(name, &pending);
        if (options_.liveness_interval.count() > 0 && now >= next_liveness) {
          check_liveness(pending, name);
          next_liveness = detail::deadline_after(now, options_.liveness_interval);
        }
        if (now >= deadline) throw timeout_error(timeout_message(pending, name));
      }
      if (Clock::now() - start < std::chrono::milliseconds(20)) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    }
  }

  std::string timeout_message(const detail::MpiPending& pending, const char* name) const {
    std::vector<int> silent, not_taking;
    for (std::size_t i = 0; i < pending.requests.size(); ++i) {
      if (pending.requests[i] == MPI_REQUEST_NULL || pending.peers[i] < 0) continue;
      std::vector<int>& list = pending.receiving[i] ? silent : not_taking;
      if (std::find(list.begin(), list.end(), pending.peers[i]) == list.end()) list.push_back(pending.peers[i]);
    }
    std::sort(silent.begin(), silent.end());
    std::sort(not_taking.begin(), not_taking.end());
    std::string s = std::string("tandem: ") + name + " timed out after " + std::to_string(options_.timeout.count()) +
                    " ms on rank " + std::to_string(rank_) + ": ";
    if (!silent.empty()) {
      s += detail::rank_list(silent) + " did not arrive";
    } else if (!not_taking.empty()) {
      s += detail::rank_list(not_taking) + " did not receive what this rank sent";
    } else {
      s += "the ranks of the parent communicator did not all construct their tandem::Mpi";
    }
    return s;
  }

  /// True only when rank q's process certainly no longer runs (it is on this host, and the liveness check is on).
  bool peer_gone(int q) const {
    if (options_.liveness_interval.count() <= 0 || q < 0 || q >= static_cast<int>(peers_.size())) return false;
    const Peer& p = peers_[static_cast<std::size_t>(q)];
    return p.same_host && detail::process_gone(p.process);
  }

  void check_liveness(const detail::MpiPending& pending, const char* name) const {
    for (std::size_t i = 0; i < pending.requests.size(); ++i) {
      const int q = pending.peers[i];
      if (pending.requests[i] == MPI_REQUEST_NULL || !peer_gone(q)) continue;
      const Peer& p = peers_[static_cast<std::size_t>(q)];
      throw peer_error("tandem: " + std::string(name) + " on rank " + std::to_string(rank_) +
                       " cannot complete: rank " + std::to_string(q) + " (process " + std::to_string(p.process.pid) +
                       " on this host) is gone: it exited or was killed without a word (its launcher's output says "
                       "why)");
    }
  }

  /// Receives every notice that arrived and records it: a failure (the first one is kept) or a departure.
  void receive_notices() {
    bool probed_again = false;
    while (true) {
      int flag = 0;
      MPI_Status status;
      TANDEM_MPI_CHECK(MPI_Iprobe(MPI_ANY_SOURCE, detail::kMpiNoticeTag, comm_, &flag, &status));
      if (!flag && !probed_again) {
        // Open MPI matches before it progresses: after a long pause, a notice that arrived may be found only by the
        // second probe.
        probed_again = true;
        continue;
      }
      if (!flag) break;
      detail::MpiNotice notice;
      TANDEM_MPI_CHECK(MPI_Recv(&notice, sizeof(notice), MPI_BYTE, status.MPI_SOURCE, detail::kMpiNoticeTag, comm_,
                                MPI_STATUS_IGNORE));
      const int q = status.MPI_SOURCE;
      if (!hello_done_ || q < 0 || q >= size_ || notice.nonce != peers_[static_cast<std::size_t>(q)].nonce)
        continue;  // not from this communicator's peers (defensive: see ~Mpi)
      peers_[static_cast<std::size_t>(q)].left = true;
      if (notice.kind == detail::MpiNoticeKind::failed) {
        peers_[static_cast<std::size_t>(q)].failed = true;
        if (!peer_failure_)
          peer_failure_ = "tandem: rank " + std::to_string(q) +
                          " failed: " + detail::text_of(notice.message, sizeof(notice.message));
      } else {
        departed_[static_cast<std::size_t>(q)] = notice.calls;
      }
    }
  }

  /// Receives the notices that arrived; throws peer_error when a peer failed, and tandem::error when a peer that
  /// `pending` still waits for departed before this call.
  void drain_notices(const char* name, const detail::MpiPending* pending) {
    receive_notices();
    if (peer_failure_) {
      from_notice_ = true;
      throw peer_error(*peer_failure_);
    }
    if (pending == nullptr) return;
    for (std::size_t i = 0; i < pending->requests.size(); ++i) {
      const int q = pending->peers[i];
      if (pending->requests[i] == MPI_REQUEST_NULL || q < 0) continue;
      const auto& left = departed_[static_cast<std::size_t>(q)];
      if (!left || *left > calls_) continue;  // it completed this call before it left: its messages are on the way
      throw error("tandem: " + std::string(name) + " on rank " + std::to_string(rank_) + " cannot complete: rank " +
                  std::to_string(q) + " destroyed its tandem::Mpi after " + std::to_string(*left) +
                  " calls, before this one; every rank must call the same collectives in the same order (ranks with "
                  "unequal numbers of batches: see DataParallel::all_ranks_have_batch)");
    }
  }

  /// After this rank's departure notice: waits up to min(timeout, 2 s) until every peer sent one too (or failed).
  bool all_peers_left() noexcept {
    try {
      const Clock::time_point until = detail::deadline_after(
          Clock::now(), std::min<std::chrono::milliseconds>(options_.timeout, std::chrono::seconds(2)));
      while (true) {
        receive_notices();
        bool all = true;
        for (int q = 0; q < size_; ++q) all = all && (q == rank_ || peers_[static_cast<std::size_t>(q)].left);
        if (all) return true;
        if (Clock::now() >= until) return false;
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    } catch (...) {
      return false;
    }
  }

  /// True when rank q sent a failure notice: it cancelled its own transfers and takes no part in any more.
  bool peer_failed(int q) const {
    return q >= 0 && q < static_cast<int>(peers_.size()) && peers_[static_cast<std::size_t>(q)].failed;
  }

  /// receive_notices, for the failure paths: what cannot be received now is left for later. Never throws.
  void refresh_notices() noexcept {
    if (comm_ == MPI_COMM_NULL || !hello_done_) return;
    try {
      receive_notices();
    } catch (...) {
    }
  }

  /// Waits until each request of `pending` completed, `patience` passed, or the transfer cannot end any more, then
  /// frees the requests that did not complete and returns whether there were any (MPI may still use their buffers). A
  /// transfer cannot end once its peer's process is gone (peer_gone), nor a send once its peer failed (peer_failed):
  /// Open MPI cannot cancel a send whose transfer began, and such a send stays pending; waiting for it would hold this
  /// rank's error back for the whole of `patience`. Checked every millisecond, with the notices that arrived
  /// meanwhile. (A receive from a failed peer whose process still runs is waited for: its data may still come.) Never
  /// throws.
  bool settle(detail::MpiPending& pending, Clock::duration patience) noexcept {
    std::vector<MPI_Request>& requests = pending.requests;
    try {
      const Clock::time_point until = Clock::now() + patience;
      Clock::time_point next_check = Clock::now();
      std::vector<std::size_t> waiting;  // requests neither complete, failed, nor given up
      for (std::size_t i = 0; i < requests.size(); ++i)
        if (requests[i] != MPI_REQUEST_NULL) waiting.push_back(i);
      while (!waiting.empty()) {
        std::erase_if(waiting, [&](std::size_t i) {
          int done = 0;
          return MPI_Test(&requests[i], &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || done != 0;
        });
        const Clock::time_point now = Clock::now();
        if (waiting.empty() || now >= until) break;
        if (now >= next_check) {
          refresh_notices();
          std::erase_if(waiting, [&](std::size_t i) {
            const int q = pending.peers[i];
            return (!pending.receiving[i] && peer_failed(q)) || peer_gone(q);
          });
          next_check = now + std::chrono::milliseconds(1);
        }
        std::this_thread::yield();
      }
    } catch (...) {  // no memory to track the requests: free them now
    }
    bool freed = false;
    for (MPI_Request& r : requests)
      if (r != MPI_REQUEST_NULL) {
        MPI_Request_free(&r);
        freed = true;
      }
    return freed;
  }

  /// Sends a notice to every other rank that still takes part (neither failed nor gone) from a heap buffer, waits about
  /// a second at most for the sends to leave (settle), and leaks the buffer if they did not. Never throws.
  void notify(detail::MpiNoticeKind kind, std::string_view message) noexcept {
    if (comm_ == MPI_COMM_NULL || !hello_done_) return;
    try {
      auto notice = std::make_unique<detail::MpiNotice>();
      notice->nonce = nonce_;
      notice->calls = calls_;
      notice->kind = kind;
      detail::copy_text(notice->message, sizeof(notice->message), message);
      detail::MpiPending sends;
      sends.reserve(static_cast<std::size_t>(size_));  // no allocation between a send's start and its tracking
      refresh_notices();
      for (int q = 0; q < size_; ++q) {
        if (q == rank_ || peer_failed(q) || peer_gone(q)) continue;
        MPI_Request r = MPI_REQUEST_NULL;
        if (MPI_Isend(notice.get(), sizeof(detail::MpiNotice), MPI_BYTE, q, detail::kMpiNoticeTag, comm_, &r) ==
            MPI_SUCCESS)
          sends.add(r, q, false);
      }
      if (settle(sends, std::chrono::seconds(1))) {
        notice.release();  // MPI may still read it
        leaked_ = true;
      }
    } catch (...) {  // no memory for a notice: the peers will time out instead
    }
  }

  /// This rank's call failed: cancel what is in flight (a receive MPI already matched cannot be: see the top of this
  /// file), mark the communicator unusable and, unless the failure came from a peer's notice, tell the other ranks.
  void fail(const char* what, bool tell_peers) noexcept {
    try {
      failed_ = what;
    } catch (...) {
      failed_ = "failed";
    }
    cancel_in_flight();
    if (tell_peers) {
      const std::string_view text(what);
      const std::string_view prefix = "tandem: ";
      notify(detail::MpiNoticeKind::failed,
             text.substr(0, prefix.size()) == prefix ? text.substr(prefix.size()) : text);
    }
  }

  /// Cancels every request of the call in flight, waits briefly for the cancellations (settle), and frees what remains.
  void cancel_in_flight() noexcept {
    for (MPI_Request& r : in_flight_.requests)
      if (r != MPI_REQUEST_NULL) MPI_Cancel(&r);
    if (settle(in_flight_, std::chrono::milliseconds(200))) leaked_ = true;
    in_flight_.clear();
    if (leaked_ && staging_.bytes() != 0) {  // a receive MPI could not cancel may still write into it
      try {
        (void)new HostBuffer<unsigned char>(std::move(staging_));
      } catch (...) {
      }
    }
  }

  struct Peer {
    std::uint64_t nonce = 0;
    detail::ProcessIdentity process;
    bool same_host = false;
    std::uint64_t max_message_bytes = 0;  // its MpiOptions' (hello)
    bool left = false;                    // it sent a departure or failure notice
    bool failed = false;                  // it sent a failure notice
  };

  MPI_Comm comm_ = MPI_COMM_NULL;
  MpiOptions options_;
  int rank_ = 0;
  int size_ = 1;
  int uncaught_ = 0;
  std::uint64_t nonce_ = 0;
  std::uint64_t calls_ = 0;  // calls completed (hello included): the number the next call's header carries
  bool hello_done_ = false;
  bool leaked_ = false;
  detail::ProcessIdentity self_;
  std::vector<Peer> peers_;
  std::vector<std::optional<std::uint64_t>> departed_;  // per rank: calls it had completed when it left
  std::vector<detail::MpiHeader> headers_;
  detail::MpiPending in_flight_;             // the requests of the phase in progress
  detail::MpiHeader header_out_;             // this rank's header of the call in progress
  bool from_notice_ = false;                 // the failure being handled was reported by a peer's notice
  std::optional<std::string> peer_failure_;  // the first failure notice received
  HostBuffer<unsigned char> staging_;
  std::string failed_;  // non-empty: why this communicator is unusable
};

static_assert(Communicator<Mpi>, "Mpi must satisfy tandem::Communicator");

}  // namespace tandem
