// SPDX-License-Identifier: Apache-2.0
// LocalGroup: N ranks as threads of one process, exchanging host memory, with NCCL's collective semantics.
//
// Every collective is a rendezvous. A rank publishes its call in its slot (kind, pointers, count, dtype, op, root,
// or why it rejected its own arguments) and waits at a barrier. Past the barrier every rank reads all slots and
// reaches the same verdict: if any rank rejected its arguments, the calls disagree, or one rank's output overlaps
// another rank's buffers, every rank throws tandem::error, so nobody hangs. Otherwise each rank does its share of the
// work directly on the other ranks' buffers (one address space) and waits at a second barrier, so that no rank
// returns and reuses its buffers while another still reads them. Slots are double-buffered by call parity: a rank
// may publish its next call while a slower rank still reads the previous one.
//
// Reductions are deterministic: element i is ((s0[i] + s1[i]) + s2[i]) + ... in rank order, accumulated in fp32
// (fp64 for fp64), divided by the rank count for avg, and rounded once, whichever rank computes it; so all_reduce and
// reduce_scatter agree bit for bit. all_reduce splits the elements into `size` cache-line-aligned slices, one per
// rank, and writes each slice into every rank's recv; reduce_scatter has rank r reduce the block it receives. A rank
// walks its elements in blocks of 2048 through a stack accumulator, reading every input of a block before writing any
// output (ranks outer, elements inner, so the loops vectorize), which makes the in-place forms safe. all_gather: each
// rank fills its own recv from every rank's send; broadcast: each rank copies the root's send. Results of 4 MiB or more
// per rank are written with streaming stores.
//
// The barrier counts generations. A waiter polls it: a microsecond with a pause between reads (not when the ranks
// outnumber the CPUs they may run on), then yielding its core between reads; after a millisecond it sleeps on a
// condition variable. The first barrier of a call can be interrupted: when a rank's body throws, the group is aborted
// and waiters throw peer_error; after options.timeout a waiter throws timeout_error naming the ranks that did not
// arrive, and aborts the group. The second barrier cannot be interrupted: once every rank is past the first, every
// rank is bound to reach it.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

#include "tandem/backend/host_stream.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/core/deadline.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/stream.hpp"
#include "tandem/kernels/vector.hpp"

namespace tandem {

/// Options of a LocalGroup, for designated initializers: `LocalGroup g(4, {.timeout = 200ms});`.
struct LocalGroupOptions {
  /// How long a rank waits at a rendezvous for the other ranks before it throws tandem::timeout_error.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
};

namespace detail {

enum class LocalCallKind : std::uint8_t { all_reduce, reduce_scatter, all_gather, broadcast, barrier };

inline const char* local_call_name(LocalCallKind kind) {
  switch (kind) {
    case LocalCallKind::all_reduce:
      return "all_reduce";
    case LocalCallKind::reduce_scatter:
      return "reduce_scatter";
    case LocalCallKind::all_gather:
      return "all_gather";
    case LocalCallKind::broadcast:
      return "broadcast";
    case LocalCallKind::barrier:
      return "barrier";
  }
  return "?";
}

inline bool is_reduction(LocalCallKind kind) {
  return kind == LocalCallKind::all_reduce || kind == LocalCallKind::reduce_scatter;
}

/// One rank's call, as published in its slot. Aligned to a cache line: each rank writes only its own.
struct alignas(64) LocalCall {
  LocalCallKind kind = LocalCallKind::barrier;
  DType dtype = DType::fp32;
  ReduceOp op = ReduceOp::sum;
  int root = 0;
  std::size_t count = 0;
  const void* send = nullptr;
  void* recv = nullptr;
  std::string rejected;  ///< non-empty: why this rank rejected its own arguments
};

/// "all_reduce(count=10, fp32, sum)", "all_gather(count=12, fp32)", "broadcast(count=3, bf16, root=0)", "barrier()".
TANDEM_COLD inline std::string describe_call(const LocalCall& c) {
  std::string s = local_call_name(c.kind);
  if (c.kind == LocalCallKind::barrier) return s + "()";
  s += "(count=" + std::to_string(c.count) + ", " + dtype_name(c.dtype);
  if (is_reduction(c.kind)) s += std::string(", ") + reduce_op_name(c.op);
  if (c.kind == LocalCallKind::broadcast) s += ", root=" + std::to_string(c.root);
  return s + ")";
}

/// Whether two ranks' calls belong to the same collective (pointers aside).
inline bool same_call(const LocalCall& a, const LocalCall& b) {
  if (a.kind != b.kind) return false;
  if (a.kind == LocalCallKind::barrier) return true;
  if (a.count != b.count || a.dtype != b.dtype) return false;
  if (is_reduction(a.kind) && a.op != b.op) return false;
  if (a.kind == LocalCallKind::broadcast && a.root != b.root) return false;
  return true;
}

/// A byte range [begin, begin + bytes) of the address space; empty when bytes == 0.
struct ByteRange {
  std::uintptr_t begin = 0;
  std::size_t bytes = 0;
};

inline ByteRange byte_range(const void* p, std::size_t bytes) { return {reinterpret_cast<std::uintptr_t>(p), bytes}; }

inline bool overlap(ByteRange a, ByteRange b) {
  return a.bytes != 0 && b.bytes != 0 && a.begin < b.begin + b.bytes && b.begin < a.begin + a.bytes;
}

/// The bytes of `send` a call reads (none for a broadcast off the root) and of `recv` it writes. Valid once the
/// call passed check_call.
inline ByteRange read_range(const LocalCall& c, int rank, int size) {
  const std::size_t bytes = c.count * dtype_size(c.dtype);
  switch (c.kind) {
    case LocalCallKind::all_reduce:
      return byte_range(c.send, bytes);
    case LocalCallKind::reduce_scatter:
      return byte_range(c.send, bytes * static_cast<std::size_t>(size));
    case LocalCallKind::all_gather:
      return byte_range(c.send, bytes);
    case LocalCallKind::broadcast:
      return rank == c.root ? byte_range(c.send, bytes) : ByteRange{};
    case LocalCallKind::barrier:
      break;
  }
  return {};
}

inline ByteRange write_range(const LocalCall& c, int size) {
  const std::size_t bytes = c.count * dtype_size(c.dtype);
  if (c.kind == LocalCallKind::barrier) return {};
  return byte_range(c.recv, c.kind == LocalCallKind::all_gather ? bytes * static_cast<std::size_t>(size) : bytes);
}

/// Checks one rank's own arguments; returns why they are rejected, or "" when they are fine. The checks of a call
/// (this, check_cross_rank, check_agreement) are TANDEM_COLD: a few comparisons that cost nothing optimized for size,
/// beside message building that is most of their code.
TANDEM_COLD inline std::string check_call(const LocalCall& c, int rank, int size) {
  if (c.kind == LocalCallKind::barrier) return {};
  const auto where = [&] {  // built only for a rejection: an accepted call allocates nothing
    return std::string("tandem: ") + local_call_name(c.kind) + " on rank " + std::to_string(rank) + ": ";
  };
  const auto dtype_index = static_cast<unsigned>(c.dtype);
  if (dtype_index > static_cast<unsigned>(DType::fp64)) {
    return where() + "`dtype` is " + std::to_string(dtype_index) + ", not one of DType::fp32, bf16, fp16, fp64";
  }
  if (is_reduction(c.kind) && c.op != ReduceOp::sum && c.op != ReduceOp::avg) {
    return where() + "`op` is " + std::to_string(static_cast<int>(c.op)) + ", not ReduceOp::sum or ReduceOp::avg";
  }
  if (c.kind == LocalCallKind::broadcast && (c.root < 0 || c.root >= size)) {
    return where() + "`root` is " + std::to_string(c.root) + " but the group has " + std::to_string(size) +
           " ranks; pass a root in [0, " + std::to_string(size) + ")";
  }
  const std::size_t elem = dtype_size(c.dtype);
  if (c.count > std::numeric_limits<std::size_t>::max() / elem / static_cast<std::size_t>(size)) {
    return where() + "`count` " + std::to_string(c.count) + " is too large: " + std::to_string(size) + " x count " +
           dtype_name(c.dtype) + " elements do not fit in the address space";
  }
  if (c.count == 0) return {};  // a valid no-op: the pointers are not used

  const bool sharded_send = c.kind == LocalCallKind::reduce_scatter;
  const bool sharded_recv = c.kind == LocalCallKind::all_gather;
  const bool reads_send = c.kind != LocalCallKind::broadcast || rank == c.root;
  const auto elements = [&](bool sharded) {
    return sharded ? std::to_string(size) + " x " + std::to_string(c.count) : std::to_string(c.count);
  };
  if (reads_send && c.send == nullptr) {
    return where() + "`send` is null but count is " + std::to_string(c.count) + "; pass a buffer of " +
           elements(sharded_send) + " " + dtype_name(c.dtype) + " elements";
  }
  if (c.recv == nullptr) {
    return where() + "`recv` is null but count is " + std::to_string(c.count) + "; pass a buffer of " +
           elements(sharded_recv) + " " + dtype_name(c.dtype) + " elements";
  }
  if (!reads_send) return {};

  // In-place forms (NCCL's): all_reduce and broadcast send == recv; reduce_scatter recv == send + rank*count;
  // all_gather send == recv + rank*count. Any other overlap is rejected.
  const std::size_t shift = static_cast<std::size_t>(rank) * c.count * elem;
  const auto send = reinterpret_cast<std::uintptr_t>(c.send);
  const auto recv = reinterpret_cast<std::uintptr_t>(c.recv);
  bool in_place = false;
  const char* form = "send == recv";
  switch (c.kind) {
    case LocalCallKind::reduce_scatter:
      in_place = recv == send + shift;
      form = "recv == send + rank * count";
      break;
    case LocalCallKind::all_gather:
      in_place = send == recv + shift;
      form = "send == recv + rank * count";
      break;
    default:
      in_place = send == recv;
      break;
  }
  if (!in_place && overlap(read_range(c, rank, size), write_range(c, size))) {
    return where() + "`send` and `recv` overlap but are not the in-place form (" + form +
           "); pass disjoint buffers or exactly the in-place form";
  }
  return {};
}

/// Buffers of different ranks: no rank may write where another rank reads or writes (like NCCL ranks, each rank
/// needs buffers of its own; here they would race). Returns the error, or "" when the buffers are independent.
TANDEM_COLD inline std::string check_cross_rank(const LocalCall* calls, int size) {
  const char* name = local_call_name(calls[0].kind);
  for (int q = 0; q < size; ++q) {
    const ByteRange written = write_range(calls[q], size);
    if (written.bytes == 0) continue;
    for (int p = 0; p < size; ++p) {
      if (p == q) continue;
      const char* what = nullptr;
      if (overlap(written, write_range(calls[p], size))) {
        what = "`recv`";
      } else if (overlap(written, read_range(calls[p], p, size))) {
        what = "`send`";
      }
      if (what != nullptr) {
        return std::string("tandem: ") + name + ": rank " + std::to_string(q) + "'s `recv` overlaps rank " +
               std::to_string(p) + "'s " + what +
               "; every rank needs buffers of its own (ranks are threads here, but the collective writes all of "
               "them at once)";
      }
    }
  }
  return {};
}

/// The verdict on the published calls, pointers aside (every rank's own arguments were fine and the calls agree): ""
/// to go ahead, or the message this rank throws. Also used by communicators whose ranks are processes.
TANDEM_COLD inline std::string check_agreement(const LocalCall* calls, int size, int rank) {
  if (!calls[rank].rejected.empty()) return calls[rank].rejected;
  for (int q = 0; q < size; ++q) {
    if (calls[q].rejected.empty()) continue;
    return std::string("tandem: ") + local_call_name(calls[rank].kind) + " on rank " + std::to_string(rank) +
           " abandoned: rank " + std::to_string(q) + " rejected its arguments (" + calls[q].rejected + ")";
  }
  for (int q = 1; q < size; ++q) {
    if (!same_call(calls[0], calls[q])) {
      return "tandem: collective mismatch: rank 0 called " + describe_call(calls[0]) + " but rank " +
             std::to_string(q) + " called " + describe_call(calls[q]) +
             "; every rank must call the same collectives in the same order with the same count, dtype, op and root";
    }
  }
  return {};
}

/// The verdict every rank reaches from the published calls: "" to go ahead, or the message this rank throws.
inline std::string check_calls(const LocalCall* calls, int size, int rank) {
  std::string verdict = check_agreement(calls, size, rank);
  if (!verdict.empty() || calls[0].count == 0) return verdict;
  return check_cross_rank(calls, size);
}

/// A call as a rank publishes it, with its own verdict on its arguments (`rejected`): what LocalComm, DeviceComm and
/// Mpi put before the first exchange of a collective.
inline LocalCall make_call(LocalCallKind kind, const void* send, void* recv, std::size_t count, DType dtype,
                           ReduceOp op, int root, int rank, int size) {
  LocalCall c;
  c.kind = kind;
  c.dtype = dtype;
  c.op = op;
  c.root = root;
  c.count = count;
  c.send = send;
  c.recv = recv;
  c.rejected = check_call(c, rank, size);
  return c;
}

// --- The work --------------------------------------------------------------------------------------------------------

/// Elements per accumulator block: 8 KiB of fp32 (16 KiB of fp64) on the stack, well inside L1 + L2.
inline constexpr std::size_t kLocalReduceBlock = 2048;

template <class T>
using local_accumulator_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

/// Reduces `m` elements at offset `src` of every rank's send buffer, in rank order, into `acc`, then writes them at
/// offset `dst` of the recv buffer of ranks [dst_first, dst_last). Ranks outer, elements inner: every loop is a plain
/// stream the compiler vectorizes. Fixed > 0 is the trip count known at compile time (full blocks), which GCC's -O2
/// cost model needs in order to vectorize; Fixed == 0 takes `m` (the tail).
template <class T, std::size_t Fixed>
void local_reduce_block(const LocalCall* calls, int size, std::size_t src, std::size_t m, ReduceOp op, int dst_first,
                        int dst_last, std::size_t dst, local_accumulator_t<T>* __restrict acc, StoreHint hint) {
  using Acc = local_accumulator_t<T>;
  const std::size_t n = Fixed != 0 ? Fixed : m;
  if (size > 1) {  // the first two ranks in one pass: one trip through acc fewer, the same additions in the same order
    const T* __restrict s0 = static_cast<const T*>(calls[0].send) + src;
    const T* __restrict s1 = static_cast<const T*>(calls[1].send) + src;
    for (std::size_t i = 0; i < n; ++i) acc[i] = convert<Acc>(s0[i]) + convert<Acc>(s1[i]);
  } else {
    const T* __restrict s = static_cast<const T*>(calls[0].send) + src;
    for (std::size_t i = 0; i < n; ++i) acc[i] = convert<Acc>(s[i]);
  }
  for (int q = 2; q < size; ++q) {
    const T* __restrict s = static_cast<const T*>(calls[q].send) + src;
    for (std::size_t i = 0; i < n; ++i) acc[i] += convert<Acc>(s[i]);
  }
  if (op == ReduceOp::avg) {
    const Acc ranks = static_cast<Acc>(size);
    for (std::size_t i = 0; i < n; ++i) acc[i] = acc[i] / ranks;
  }
  for (int q = dst_first; q < dst_last; ++q) {
    T* __restrict d = static_cast<T*>(calls[q].recv) + dst;
    if constexpr (std::is_same_v<T, local_accumulator_t<T>>) {
      if (hint == StoreHint::streaming) {  // large results: skip the read-for-ownership of every line
        stream_copy(acc, d, n);
        continue;
      }
    }
    for (std::size_t i = 0; i < n; ++i) d[i] = convert<T>(acc[i]);
  }
}

/// Results of at least this many bytes per rank are written with streaming stores.
inline constexpr std::size_t kLocalStreamingBytes = std::size_t{4} << 20;

/// Reduces elements [src_begin, src_begin + n) of every rank's send buffer and writes the result at dst_begin of the
/// recv buffer of ranks [dst_first, dst_last), one block at a time. Each block is read completely before it is
/// written, so recv may alias the caller's own send in the in-place forms.
template <class T>
void local_reduce(const LocalCall* calls, int size, std::size_t src_begin, std::size_t n, ReduceOp op, int dst_first,
                  int dst_last, std::size_t dst_begin) {
  alignas(64) local_accumulator_t<T> acc[kLocalReduceBlock];
  const StoreHint hint = n * sizeof(T) >= kLocalStreamingBytes ? StoreHint::streaming : StoreHint::cached;
  std::size_t done = 0;
  for (; n - done >= kLocalReduceBlock; done += kLocalReduceBlock) {
    local_reduce_block<T, kLocalReduceBlock>(calls, size, src_begin + done, kLocalReduceBlock, op, dst_first, dst_last,
                                             dst_begin + done, acc, hint);
  }
  if (done < n) {
    local_reduce_block<T, 0>(calls, size, src_begin + done, n - done, op, dst_first, dst_last, dst_begin + done, acc,
                             hint);
  }
  stream_fence();
}

/// Rank `rank`'s slice [first, last) of `count` elements split `size` ways on cache-line boundaries (64 bytes), so
/// that no two ranks write the same line.
template <class T>
std::pair<std::size_t, std::size_t> local_slice(std::size_t count, int size, int rank) {
  constexpr std::size_t line = 64 / sizeof(T) > 0 ? 64 / sizeof(T) : 1;  // elements per cache line
  const std::size_t lines = count / line + (count % line != 0);
  const std::size_t base = lines / static_cast<std::size_t>(size);
  const std::size_t extra = lines % static_cast<std::size_t>(size);
  const auto r = static_cast<std::size_t>(rank);
  const std::size_t first = r * base + std::min(r, extra);
  const std::size_t last = first + base + (r < extra ? 1 : 0);
  return {std::min(first * line, count), std::min(last * line, count)};
}

/// memcpy(dst, src, bytes) for a collective's copies: blocks of at least kLocalStreamingBytes are written with
/// streaming stores (stream_copy), so that no line of dst is read before it is written (glibc's memcpy reads them below
/// a threshold far larger than a bucket), and fenced.
inline void local_copy(void* dst, const void* src, std::size_t bytes) {
  if (bytes < kLocalStreamingBytes) {
    std::memcpy(dst, src, bytes);
    return;
  }
  stream_copy(static_cast<const unsigned char*>(src), static_cast<unsigned char*>(dst), bytes);
  stream_fence();
}

/// This rank's share of a collective every rank agreed on (count > 0).
inline void local_execute(const LocalCall* calls, int size, int rank) {
  const LocalCall& c = calls[rank];
  const std::size_t bytes = c.count * dtype_size(c.dtype);
  switch (c.kind) {
    case LocalCallKind::all_reduce:
      visit_dtype(c.dtype, [&](auto tag) {
        using T = decltype(tag);
        const auto [first, last] = local_slice<T>(c.count, size, rank);
        local_reduce<T>(calls, size, first, last - first, c.op, 0, size, first);
      });
      break;
    case LocalCallKind::reduce_scatter:
      visit_dtype(c.dtype, [&](auto tag) {
        using T = decltype(tag);
        local_reduce<T>(calls, size, static_cast<std::size_t>(rank) * c.count, c.count, c.op, rank, rank + 1, 0);
      });
      break;
    case LocalCallKind::all_gather:  // fill my recv: block p is rank p's send (already there for my own, in place)
      for (int p = 0; p < size; ++p) {
        char* dst = static_cast<char*>(c.recv) + static_cast<std::size_t>(p) * bytes;
        if (dst != calls[p].send) local_copy(dst, calls[p].send, bytes);
      }
      break;
    case LocalCallKind::broadcast:
      if (c.recv != calls[c.root].send) local_copy(c.recv, calls[c.root].send, bytes);
      break;
    case LocalCallKind::barrier:
      break;
  }
}

// --- The rendezvous --------------------------------------------------------------------------------------------------

inline void local_pause() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

/// A waiter polls with a pause between reads for local_spin_time (only while every rank has a CPU of its own), then
/// yields its core between reads, and sleeps on the condition variable once it has waited local_poll_time. Polling ends
/// a short wait within a fraction of a microsecond; a sleep costs the waker a system call and the sleeper tens of
/// microseconds to be scheduled again, which only long waits can afford. The pause-only spin lasts about as long as a
/// yield and a switch to another thread, no longer: wherever the scheduler put two ranks on one core (taskset, an MPI
/// launcher's binding, other processes' load: busy waiters count as load, so a loaded machine stacks them), it keeps
/// the core from the rank being waited for, and a yield hands that rank the core at once. On a core nothing else
/// wants, a yield returns at once.
inline constexpr std::chrono::microseconds local_spin_time{1};
inline constexpr std::chrono::microseconds local_poll_time{1000};

/// The CPUs the calling thread may run on: its affinity mask where the platform has one (taskset, cgroup cpusets, an
/// MPI launcher's process binding all narrow it), else std::thread::hardware_concurrency(); 0 when unknown.
inline unsigned usable_cpus() {
#if defined(__linux__) && defined(CPU_COUNT)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return static_cast<unsigned>(CPU_COUNT(&set));
#endif
  return std::thread::hardware_concurrency();  // more CPUs than a cpu_set_t holds, or no affinity masks here
}

/// Whether a barrier wait can be interrupted by an abort, a departed rank, or the timeout.
enum class LocalWait : std::uint8_t { interruptible, uninterruptible };

/// Which kind of failure run() saw: a rank's own, or a peer_error caused by another rank's.
enum class LocalFailure : std::uint8_t { original, peer };

/// What the ranks of one LocalGroup::run share: the call slots, the barrier, and the abort state.
class LocalGroupState {
 public:
  LocalGroupState(int size, std::chrono::milliseconds timeout)
      : size_(size),
        timeout_(timeout),
        slots_(2 * static_cast<std::size_t>(size)),
        arrived_(std::make_unique<std::atomic<std::uint64_t>[]>(static_cast<std::size_t>(size))) {
    // The rank threads inherit the caller's affinity. With more ranks than CPUs, a waiter that spins keeps the core
    // from the rank it waits for.
    const unsigned cpus = usable_cpus();
    oversubscribed_ = cpus != 0 && static_cast<unsigned>(size) > cpus;
  }
  LocalGroupState(const LocalGroupState&) = delete;
  LocalGroupState& operator=(const LocalGroupState&) = delete;

  int size() const { return size_; }
  /// Whether the ranks outnumber the CPUs they may run on: then a waiter yields its core from the start.
  bool oversubscribed() const { return oversubscribed_; }

  /// Rank `rank`'s slot for its call number `seq` (slots alternate with the parity of seq).
  LocalCall& slot(std::uint64_t seq, int rank) { return slots_[first_slot(seq) + static_cast<std::size_t>(rank)]; }
  const LocalCall* calls(std::uint64_t seq) const { return &slots_[first_slot(seq)]; }

  /// Throws unless the group can still complete a rendezvous: peer_error when it was aborted, tandem::error when a
  /// rank already returned from its body.
  void check_usable(int rank, const char* what) {
    if (!stop_.load(std::memory_order_acquire)) return;
    std::unique_lock<std::mutex> lock(mutex_);
    throw_stopped(rank, what, std::nullopt);
  }

  /// Waits until every rank arrived. `what` names the collective in messages.
  void wait(int rank, const char* what, LocalWait mode) {
    const bool interruptible = mode == LocalWait::interruptible;
    if (interruptible) check_usable(rank, what);
    const std::uint64_t gen = generation_.load(std::memory_order_acquire);
    arrived_[static_cast<std::size_t>(rank)].store(gen + 1, std::memory_order_relaxed);
    if (waiting_.fetch_add(1, std::memory_order_acq_rel) + 1 == size_) {  // the last to arrive releases the others
      waiting_.store(0, std::memory_order_relaxed);
      {
        std::unique_lock<std::mutex> lock(mutex_);
        // Aborted meanwhile: the waiters throw (they find the generation unchanged), so this rank must too.
        if (interruptible && stop_.load(std::memory_order_relaxed)) throw_stopped(rank, what, std::nullopt);
        generation_.store(gen + 1, std::memory_order_release);
      }
      wake_.notify_all();
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    const auto released = [&] {
      return generation_.load(std::memory_order_acquire) != gen ||
             (interruptible && stop_.load(std::memory_order_relaxed));
    };
    if (poll(released, start)) {
      if (generation_.load(std::memory_order_acquire) != gen) return;
    }  // else stopped, or waited too long to poll on: decided under the lock below
    std::unique_lock<std::mutex> lock(mutex_);
    const auto deadline = detail::deadline_after(start, timeout_);
    if (!interruptible || deadline == std::chrono::steady_clock::time_point::max()) {
      wake_.wait(lock, released);
    } else {
      while (!wake_.wait_until(lock, deadline, released)) {
        std::vector<int> missing = missing_ranks(gen);
        if (missing.empty()) {  // all arrived; the last one is about to release us
          wake_.wait(lock, released);
          break;
        }
        timed_out_generation_ = gen;
        timed_out_missing_ = std::move(missing);
        std::string message = timeout_message(rank, what);
        set_aborted(rank, message);
        lock.unlock();
        wake_.notify_all();
        throw timeout_error(message);
      }
    }
    if (generation_.load(std::memory_order_relaxed) != gen) return;  // completed: wins over a later abort
    throw_stopped(rank, what, gen);
  }

  /// A rank's body threw: abort the group, waking every waiter. The first abort's message is the one peers report.
  void abort(int rank, const std::string& what) noexcept {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!aborted_) {
        try {
          set_aborted(rank, what);
        } catch (...) {  // no memory for the message: abort without it
          aborted_ = true;
          aborted_rank_ = rank;
          stop_.store(true, std::memory_order_release);
        }
      }
    }
    wake_.notify_all();
  }

  /// A rank's body returned: any rendezvous that still waits for it can never complete.
  void depart(int rank) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (departed_rank_ < 0) departed_rank_ = rank;
      stop_.store(true, std::memory_order_release);
    }
    wake_.notify_all();
  }

  /// Records the exception a rank's body ended with; the first original one is rethrown by rethrow_first().
  void record_failure(std::exception_ptr e, LocalFailure kind) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!first_failure_) first_failure_ = e;
    if (kind == LocalFailure::original && !first_original_) first_original_ = e;
  }

  void rethrow_first() {
    if (first_original_) std::rethrow_exception(first_original_);
    if (first_failure_) std::rethrow_exception(first_failure_);
  }

 private:
  /// Polls `released` until it holds (returns true) or until local_poll_time after `start` (returns false): for
  /// local_spin_time with a pause between reads (skipped when oversubscribed), then yielding the core between reads to
  /// whichever thread the scheduler has waiting for it, perhaps the rank being waited for.
  template <class Released>
  bool poll(const Released& released, std::chrono::steady_clock::time_point start) const {
    using std::chrono::steady_clock;
    if (!oversubscribed_) {
      for (unsigned i = 1;; ++i) {
        if (released()) return true;
        local_pause();
        if (i % 8 == 0 && steady_clock::now() - start >= local_spin_time) break;  // the clock every 8 pauses
      }
    }
    for (;;) {
      if (released()) return true;
      std::this_thread::yield();
      if (steady_clock::now() - start >= local_poll_time) return released();
    }
  }

  std::size_t first_slot(std::uint64_t seq) const {
    return static_cast<std::size_t>(seq & 1) * static_cast<std::size_t>(size_);
  }

  void set_aborted(int rank, const std::string& what) {  // under the lock
    aborted_message_ = what;
    aborted_rank_ = rank;
    aborted_ = true;
    stop_.store(true, std::memory_order_release);
  }

  std::vector<int> missing_ranks(std::uint64_t gen) const {
    std::vector<int> missing;
    for (int q = 0; q < size_; ++q) {
      if (arrived_[static_cast<std::size_t>(q)].load(std::memory_order_relaxed) != gen + 1) missing.push_back(q);
    }
    return missing;
  }

  // "... on rank 0: ranks 2, 3 did not arrive"
  TANDEM_COLD std::string timeout_message(int rank, const char* what) const {
    std::string list = timed_out_missing_.size() == 1 ? "rank " : "ranks ";
    for (std::size_t i = 0; i < timed_out_missing_.size(); ++i) {
      list += (i == 0 ? "" : ", ") + std::to_string(timed_out_missing_[i]);
    }
    return std::string("tandem: ") + what + " timed out after " + std::to_string(timeout_.count()) + " ms on rank " +
           std::to_string(rank) + ": " + list + " did not arrive";
  }

  /// Throws for a rendezvous that cannot complete (under the lock); `waited` is the generation this rank waited in,
  /// or nullopt when it is entering (or releasing) one.
  [[noreturn]] TANDEM_COLD void throw_stopped(int rank, const char* what, std::optional<std::uint64_t> waited) const {
    if (aborted_) {
      // The ranks that waited in the barrier that timed out report the timeout; a rank that arrived late (one of
      // the missing) or enters later reports the failure of the rank that timed out.
      const bool was_waiting =
          waited && timed_out_generation_ == waited &&
          std::find(timed_out_missing_.begin(), timed_out_missing_.end(), rank) == timed_out_missing_.end();
      if (was_waiting) throw timeout_error(timeout_message(rank, what));
      throw peer_error("tandem: rank " + std::to_string(aborted_rank_) + " failed: " + aborted_message_);
    }
    throw error(std::string("tandem: ") + what + " on rank " + std::to_string(rank) + " cannot complete: rank " +
                std::to_string(departed_rank_) +
                " already returned from its body; every rank must call the same collectives in the same order");
  }

  const int size_;
  const std::chrono::milliseconds timeout_;
  bool oversubscribed_ = false;
  std::vector<LocalCall> slots_;                           // [parity][rank]
  std::unique_ptr<std::atomic<std::uint64_t>[]> arrived_;  // per rank: 1 + the last generation it arrived in
  alignas(64) std::atomic<int> waiting_{0};                // ranks arrived in the current generation
  alignas(64) std::atomic<std::uint64_t> generation_{0};
  std::atomic<bool> stop_{false};  // aborted_ or a rank departed: waiters must look under the lock

  std::mutex mutex_;  // guards everything below, and the generation change
  std::condition_variable wake_;
  bool aborted_ = false;
  int aborted_rank_ = -1;
  std::string aborted_message_;
  std::optional<std::uint64_t> timed_out_generation_;  // the barrier that timed out, if one did
  std::vector<int> timed_out_missing_;                 // and the ranks it missed
  int departed_rank_ = -1;
  std::exception_ptr first_failure_;
  std::exception_ptr first_original_;
};

}  // namespace detail

namespace detail {

/// The threads of a group's run(): rank_body(state, rank) once per rank, each on its own thread, all joined. A rank
/// whose body returns departs; one whose body throws aborts the group, so that ranks waiting in (or later entering)
/// a rendezvous throw peer_error instead of hanging. Rethrows the first exception that was not a peer_error.
/// LocalGroup and DeviceGroup (comm/device_group.hpp) share it.
template <class RankBody>
void run_ranks(int size, std::chrono::milliseconds timeout, RankBody&& rank_body) {
  LocalGroupState state(size, timeout);
  const auto rank_main = [&](int rank) {
    std::exception_ptr failure;
    LocalFailure kind = LocalFailure::original;
    try {
      rank_body(state, rank);
      state.depart(rank);
      return;
    } catch (const peer_error&) {
      failure = std::current_exception();
      kind = LocalFailure::peer;
    } catch (...) {
      failure = std::current_exception();
    }
    state.record_failure(failure, kind);
    try {
      state.abort(rank, exception_message(failure));
    } catch (...) {  // no memory for the message: abort without it
      state.abort(rank, std::string());
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(size));
  for (int rank = 0; rank < size; ++rank) {
    try {
      threads.emplace_back(rank_main, rank);
    } catch (...) {  // the ranks already started must not wait for this one
      state.record_failure(std::current_exception(), LocalFailure::original);
      state.abort(rank, "could not start its thread: " + exception_message(std::current_exception()));
      break;
    }
  }
  for (std::thread& t : threads) t.join();
  state.rethrow_first();
}

}  // namespace detail

class LocalGroup;

/// One rank's handle inside LocalGroup::run. A LocalComm belongs to its rank's thread: call it from that thread only,
/// and not after the body returned. A collective given Stream{} completes before it returns; one given a HostStream
/// (backend/host_stream.hpp) is enqueued on it, as NCCL's are on a CUDA stream, and runs on its worker. Either way the
/// rank's collectives run in the order it called them (a collective waits for the previous one, whatever stream that
/// was on), and the body's end waits for the last one. A collective captured on a HostStream takes its place in that
/// order at each replay of the capture, as NCCL orders a graph's operations at the graph's launch.
class LocalComm {
 public:
  LocalComm(const LocalComm&) = delete;
  LocalComm& operator=(const LocalComm&) = delete;

  int rank() const { return rank_; }
  int size() const { return state_->size(); }

  void all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op, Stream stream = {}) {
    submit(stream, detail::LocalCallKind::all_reduce, send, recv, count, dtype, op, 0);
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op, Stream stream = {}) {
    submit(stream, detail::LocalCallKind::reduce_scatter, send, recv, count, dtype, op, 0);
  }
  void all_gather(const void* send, void* recv, std::size_t count, DType dtype, Stream stream = {}) {
    submit(stream, detail::LocalCallKind::all_gather, send, recv, count, dtype, ReduceOp::sum, 0);
  }
  void broadcast(const void* send, void* recv, std::size_t count, DType dtype, int root, Stream stream = {}) {
    submit(stream, detail::LocalCallKind::broadcast, send, recv, count, dtype, ReduceOp::sum, root);
  }
  void barrier() {
    submit(Stream{}, detail::LocalCallKind::barrier, nullptr, nullptr, 0, DType::fp32, ReduceOp::sum, 0);
  }

 private:
  friend class LocalGroup;
  LocalComm(detail::LocalGroupState& state, int rank) : state_(&state), rank_(rank) {}

  /// Runs the collective now (Stream{}) or enqueues it on a HostStream, after this rank's previous collective.
  void submit(Stream stream, detail::LocalCallKind kind, const void* send, void* recv, std::size_t count, DType dtype,
              ReduceOp op, int root) {
    HostStream* queue = detail::host_queue(stream);
    if (queue == nullptr) {
      finish_pending();
      collective(kind, send, recv, count, dtype, op, root);
      return;
    }
    // Issued now, or, captured on the stream (HostStream::begin_capture), at each replay of the capture, in the
    // chain of this rank's collectives as it is then: NCCL orders a graph's operations among the communicator's others
    // at the graph's launch.
    queue->issue([this, kind, send, recv, count, dtype, op, root](Stream on) {
      previous_.wait_on(on);
      detail::host_queue(on)->enqueue([this, kind, send, recv, count, dtype, op, root] {
        detail::error_rank() = rank_;
        collective(kind, send, recv, count, dtype, op, root);
      });
      queued_ = true;
      previous_.record(on);
    });
  }

  /// Waits until this rank's enqueued collectives have run; rethrows the error of the stream that ran the last one.
  void finish_pending() {
    if (queued_) previous_.wait_on(Stream{});  // the host path (nothing ever queued) skips the event's lock
  }

  /// The same, for a rank that already failed: their own errors are not this rank's story.
  void abandon_pending() noexcept {
    try {
      finish_pending();
    } catch (...) {
    }
  }

  void collective(detail::LocalCallKind kind, const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                  int root) {
    detail::LocalGroupState& state = *state_;
    const int size = state.size();
    const char* name = detail::local_call_name(kind);
    state.check_usable(rank_, name);  // before touching the slot: a dead group may have readers left behind
    const std::uint64_t seq = seq_++;
    state.slot(seq, rank_) = detail::make_call(kind, send, recv, count, dtype, op, root, rank_, size);
    state.wait(rank_, name, detail::LocalWait::interruptible);

    const detail::LocalCall* calls = state.calls(seq);
    std::string verdict = detail::check_calls(calls, size, rank_);
    if (!verdict.empty()) throw error(std::move(verdict));
    if (kind == detail::LocalCallKind::barrier || count == 0) return;
    detail::local_execute(calls, size, rank_);
    state.wait(rank_, name, detail::LocalWait::uninterruptible);  // others may still read my buffers
  }

  detail::LocalGroupState* state_;
  int rank_;
  std::uint64_t seq_ = 0;  // number of collectives this rank ran: picks the slot parity
  HostEvent previous_;     // recorded after each collective enqueued on a HostStream
  bool queued_ = false;    // whether any collective was enqueued on a HostStream
};

static_assert(Communicator<LocalComm>, "LocalComm must satisfy tandem::Communicator");

/// N ranks as threads of this process, on host memory: the communicator for tests and CPU training.
///
///   tandem::LocalGroup group(4);
///   group.run([&](tandem::LocalComm& comm) { comm.all_reduce(g, g, n, tandem::DType::fp32, tandem::ReduceOp::avg); });
class LocalGroup {
 public:
  explicit LocalGroup(int size, LocalGroupOptions options = {}) : size_(size), options_(options) {
    if (size < 1) {
      detail::fail("tandem: LocalGroup: `size` is " + std::to_string(size) + "; pass the number of ranks (at least 1)");
    }
    if (options.timeout.count() <= 0) {
      detail::fail("tandem: LocalGroup: `options.timeout` is " + std::to_string(options.timeout.count()) +
                   " ms; pass a positive duration");
    }
  }

  int size() const { return size_; }

  /// Runs body(LocalComm&) once per rank, each on its own thread (the same body object, called concurrently), and
  /// joins them all. If a body throws, the group is aborted: ranks waiting in (or later entering) a collective throw
  /// tandem::peer_error instead of hanging, and run() rethrows the first exception that was not a peer_error.
  template <class F>
  void run(F&& body) {
    static_assert(std::is_invocable_v<F&, LocalComm&>, "LocalGroup::run needs a body callable as body(LocalComm&)");
    detail::run_ranks(size_, options_.timeout, [&](detail::LocalGroupState& state, int rank) {
      LocalComm comm(state, rank);
      try {
        std::invoke(body, comm);
      } catch (...) {
        // Collectives this rank still has queued on a HostStream use `comm` and the group: abort the group so that
        // they fail at once instead of waiting for peers, and let them finish before `comm` goes.
        state.abort(rank, detail::exception_message(std::current_exception()));
        comm.abandon_pending();
        throw;
      }
      comm.finish_pending();
    });
  }

 private:
  int size_;
  LocalGroupOptions options_;
};

}  // namespace tandem
