// SPDX-License-Identifier: Apache-2.0
// DeviceGroup<Backend>: N ranks as threads sharing one device, with NCCL's collective semantics. It exists because a
// lent GPU machine has one GPU and NCCL refuses two ranks on one device, yet every policy must run at world sizes 1-4
// on it; over StreamHostBackend the same code runs on the CPU, where its stream protocol is tested.
//
// A collective is a host rendezvous (LocalGroup's: call slots, the same mismatch checks and messages, the timeout,
// abort on a rank's failure) plus device work on each rank's stream:
//   1. rank r records `ready[r]` on its stream (its inputs as issued so far) and publishes its call;
//   2. past the first barrier every rank has checked every call; rank r's stream waits for every `ready[q]`;
//   3. rank r issues its share: all_reduce reduces its slice (detail::local_slice, as LocalGroup splits) from every
//      rank's send and writes it into every rank's recv; reduce_scatter reduces block r into its own recv (both
//      GroupReduceBody, kernels/collective.hpp: LocalGroup's additions in rank order, so the same bits);
//      all_gather copies its send into block r of every rank's recv; broadcast copies the root's send into its recv;
//   4. rank r records `done[r]`; past the second barrier its stream waits for every `done[q]`, so that no rank's
//      later work reuses its buffers while another rank's share still reads or writes them.
// The host returns once the work is issued, as NCCL's calls do; nothing waits for the device. The in-place forms
// are NCCL's (recv == send for all_reduce and broadcast, recv == send + r * count for reduce_scatter,
// send == recv + r * count for all_gather), and safe because each element is read and written by one lane of one
// rank. barrier() is a host rendezvous only. At most max_group_ranks ranks. A rank that fails to issue its share
// (between the two barriers) marks it; then every rank waits for its own stream's work and meets the others once
// more, and the failing rank rethrows while every other rank throws peer_error. The rank threads start on CUDA's
// default device: build each rank's CudaBackend for the group's device.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/comm/local_group.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/stream.hpp"
#include "tandem/kernels/collective.hpp"

namespace tandem {

/// Options of a DeviceGroup, for designated initializers.
struct DeviceGroupOptions {
  /// How long a rank waits at a rendezvous for the other ranks before it throws tandem::timeout_error.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
};

template <class Backend>
class DeviceGroup;

/// One rank's handle inside DeviceGroup::run: a Communicator whose buffers are the shared device's memory. Call it
/// from its rank's thread only; each collective is issued on the stream it is given.
template <class Backend>
class DeviceComm {
 public:
  DeviceComm(const DeviceComm&) = delete;
  DeviceComm& operator=(const DeviceComm&) = delete;

  int rank() const { return rank_; }
  int size() const { return state_->size(); }

  void all_reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op, Stream stream = {}) {
    collective(detail::LocalCallKind::all_reduce, send, recv, count, dtype, op, 0, stream);
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op, Stream stream = {}) {
    collective(detail::LocalCallKind::reduce_scatter, send, recv, count, dtype, op, 0, stream);
  }
  void all_gather(const void* send, void* recv, std::size_t count, DType dtype, Stream stream = {}) {
    collective(detail::LocalCallKind::all_gather, send, recv, count, dtype, ReduceOp::sum, 0, stream);
  }
  void broadcast(const void* send, void* recv, std::size_t count, DType dtype, int root, Stream stream = {}) {
    collective(detail::LocalCallKind::broadcast, send, recv, count, dtype, ReduceOp::sum, root, stream);
  }
  /// A rendezvous of the host threads; orders no device work.
  void barrier() {
    collective(detail::LocalCallKind::barrier, nullptr, nullptr, 0, DType::fp32, ReduceOp::sum, 0, Stream{});
  }

 private:
  friend class DeviceGroup<Backend>;
  using Event = typename Backend::Event;

  /// What the ranks of one run share besides the rendezvous: the backend that issues the work, the events, and each
  /// rank's mark of a collective it failed to issue (its call number + 1; 0: none).
  struct Shared {
    const Backend* backend;
    std::vector<Event> ready, done;
    std::unique_ptr<std::atomic<std::uint64_t>[]> failed;
  };

  DeviceComm(detail::LocalGroupState& state, Shared& shared, int rank)
      : state_(&state), shared_(&shared), rank_(rank) {}

  void collective(detail::LocalCallKind kind, const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                  int root, Stream stream) {
    detail::LocalGroupState& state = *state_;
    const Backend& backend = *shared_->backend;
    const int size = state.size();
    const char* name = detail::local_call_name(kind);
    state.check_usable(rank_, name);
    const std::uint64_t seq = seq_++;
    detail::LocalCall& mine = state.slot(seq, rank_);
    mine = detail::make_call(kind, send, recv, count, dtype, op, root, rank_, size);
    const bool moves_data = kind != detail::LocalCallKind::barrier && count != 0;
    if (moves_data && mine.rejected.empty()) {
      try {
        backend.record(shared_->ready[rank_index()], stream);
      } catch (const std::exception& e) {  // every rank must still arrive: the failure becomes this call's verdict
        mine.rejected = std::string("tandem: ") + name + " on rank " + std::to_string(rank_) +
                        ": recording its stream failed: " + e.what();
      }
    }
    state.wait(rank_, name, detail::LocalWait::interruptible);
    const detail::LocalCall* calls = state.calls(seq);
    std::string verdict = detail::check_calls(calls, size, rank_);
    if (!verdict.empty()) throw error(std::move(verdict));
    if (!moves_data) return;
    // Past the first barrier every rank is bound to reach the second: a failure in between is rethrown after it,
    // and marked in `failed` (for this call's number) so that the peers, whose results miss this rank's share,
    // throw too. No rank writes its mark for the next call before every rank has read this one (past barrier 1).
    std::exception_ptr failure;
    try {
      for (int q = 0; q < size; ++q)
        if (q != rank_) backend.wait(stream, shared_->ready[static_cast<std::size_t>(q)]);
      issue(calls, size, stream);
      backend.record(shared_->done[rank_index()], stream);
    } catch (...) {
      failure = std::current_exception();
      shared_->failed[rank_index()].store(seq + 1, std::memory_order_relaxed);
    }
    state.wait(rank_, name, detail::LocalWait::uninterruptible);
    int failed_rank = -1;
    for (int q = 0; q < size && failed_rank < 0; ++q)
      if (shared_->failed[static_cast<std::size_t>(q)].load(std::memory_order_relaxed) == seq + 1) failed_rank = q;
    if (failed_rank >= 0) {
      // Every rank sees the same marks. Each waits until its own stream has run what it issued (which reads the
      // other ranks' buffers), then all meet once more, so that no rank unwinds and frees its buffers while another
      // rank's share still reads them.
      try {
        backend.synchronize(stream);
      } catch (...) {
      }
      state.wait(rank_, name, detail::LocalWait::uninterruptible);
      if (failure) std::rethrow_exception(failure);
      throw peer_error(std::string("tandem: ") + name + " on rank " + std::to_string(rank_) + ": rank " +
                       std::to_string(failed_rank) +
                       " failed to issue its share of the collective, so this rank's result is incomplete");
    }
    for (int q = 0; q < size; ++q)
      if (q != rank_) backend.wait(stream, shared_->done[static_cast<std::size_t>(q)]);
  }

  /// This rank's share of a collective every rank agreed on (count > 0).
  void issue(const detail::LocalCall* calls, int size, Stream stream) const {
    const Backend& backend = *shared_->backend;
    const detail::LocalCall& c = calls[rank_];
    const std::size_t bytes = c.count * dtype_size(c.dtype);
    GroupBuffers buffers;
    for (int q = 0; q < size; ++q) {
      buffers.send[q] = calls[q].send;
      buffers.recv[q] = calls[q].recv;
    }
    const bool average = c.op == ReduceOp::avg;
    switch (c.kind) {
      case detail::LocalCallKind::all_reduce:
        visit_dtype(c.dtype, [&](auto tag) {
          using T = decltype(tag);
          const auto [first, last] = detail::local_slice<T>(c.count, size, rank_);
          const GroupReduceBody<T> body{buffers, size, average, first, first, last - first, 0, size};
          backend.launch(group_reduce_items(last - first), body, stream);
        });
        break;
      case detail::LocalCallKind::reduce_scatter:
        visit_dtype(c.dtype, [&](auto tag) {
          using T = decltype(tag);
          const GroupReduceBody<T> body{buffers, size,    average, static_cast<std::size_t>(rank_) * c.count,
                                        0,       c.count, rank_,   rank_ + 1};
          backend.launch(group_reduce_items(c.count), body, stream);
        });
        break;
      case detail::LocalCallKind::all_gather:  // my send into block `rank` of every rank's recv
        for (int q = 0; q < size; ++q) {
          char* dst = static_cast<char*>(calls[q].recv) + static_cast<std::size_t>(rank_) * bytes;
          if (dst != c.send) backend.copy(dst, c.send, bytes, stream);
        }
        break;
      case detail::LocalCallKind::broadcast:
        if (c.recv != calls[c.root].send) backend.copy(c.recv, calls[c.root].send, bytes, stream);
        break;
      case detail::LocalCallKind::barrier:
        break;
    }
  }

  std::size_t rank_index() const { return static_cast<std::size_t>(rank_); }

  detail::LocalGroupState* state_;
  Shared* shared_;
  int rank_;
  std::uint64_t seq_ = 0;  // number of collectives this rank called: picks the slot parity
};

/// N ranks as threads of this process on one device of `Backend` (CudaBackend: one GPU; StreamHostBackend: the CPU's
/// stand-in), for tests and for the GPU suite on a one-GPU machine.
///
///   tandem::DeviceGroup<tandem::CudaBackend> group(4);
///   group.run([&](tandem::DeviceComm<tandem::CudaBackend>& comm) { ... DataParallel<..., CudaBackend,
///             tandem::DeviceComm<tandem::CudaBackend>> dp(comm, ...); ... });
template <class Backend>
class DeviceGroup {
 public:
  explicit DeviceGroup(int size, Backend backend = {}, DeviceGroupOptions options = {})
      : size_(size), backend_(std::move(backend)), options_(options) {
    if (size < 1 || size > max_group_ranks)
      detail::fail("tandem: DeviceGroup: `size` is " + std::to_string(size) + "; it must be in [1, " +
                   std::to_string(max_group_ranks) + "]");
    if (options.timeout.count() <= 0)
      detail::fail("tandem: DeviceGroup: `options.timeout` is " + std::to_string(options.timeout.count()) +
                   " ms; pass a positive duration");
  }

  int size() const { return size_; }
  /// The backend that issues the collectives' work (on the stream each call is given).
  const Backend& backend() const { return backend_; }

  /// Runs body(DeviceComm<Backend>&) once per rank, each on its own thread, and joins them; a rank that throws aborts
  /// the group (the others throw peer_error, never hang) and run() rethrows the first original exception.
  template <class F>
  void run(F&& body) {
    static_assert(std::is_invocable_v<F&, DeviceComm<Backend>&>,
                  "DeviceGroup::run needs a body callable as body(DeviceComm<Backend>&)");
    typename DeviceComm<Backend>::Shared shared{
        &backend_, {}, {}, std::make_unique<std::atomic<std::uint64_t>[]>(static_cast<std::size_t>(size_))};
    for (int r = 0; r < size_; ++r) {
      shared.ready.push_back(backend_.make_event());
      shared.done.push_back(backend_.make_event());
    }
    detail::run_ranks(size_, options_.timeout, [&](detail::LocalGroupState& state, int rank) {
      DeviceComm<Backend> comm(state, shared, rank);
      std::invoke(body, comm);
    });
  }

 private:
  int size_;
  Backend backend_;
  DeviceGroupOptions options_;
};

}  // namespace tandem
