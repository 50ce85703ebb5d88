// SPDX-License-Identifier: Apache-2.0
// A test double around LocalComm that counts the collectives it is asked for, can fail one of them and can hold the
// work after each one captured in a graph behind a gate; the gate; and the message of what a call throws.
#pragma once

#include <array>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <string>

#include "tandem/backend/host_stream.hpp"
#include "tandem/comm/local_group.hpp"
#include "tandem/core/error.hpp"

namespace test {

enum class Collective { all_reduce, reduce_scatter, all_gather, broadcast };

/// Numbered operations that work on HostStreams can be made to wait behind: hold(q) enqueues on q operation number
/// holds() (from 0), which, whenever it runs (in each replay of a graph, where q was capturing), waits while it is the
/// one closed (close(k)) until open(). close() and open() may be called from any thread. A gate must outlive every
/// stream and graph that holds an operation of it.
class StreamGate {
 public:
  void hold(tandem::HostStream& q) {
    std::size_t k = 0;
    {
      std::lock_guard lock(mutex_);
      k = made_++;
    }
    q.enqueue([this, k] {
      std::unique_lock lock(mutex_);
      opened_.wait(lock, [this, k] { return closed_ != k; });
    });
  }
  /// How many operations hold() has made.
  std::size_t holds() {
    std::lock_guard lock(mutex_);
    return made_;
  }
  void close(std::size_t k) {
    std::lock_guard lock(mutex_);
    closed_ = k;
  }
  void open() {
    {
      std::lock_guard lock(mutex_);
      closed_ = none;
    }
    opened_.notify_all();
  }

 private:
  static constexpr std::size_t none = ~std::size_t{0};
  std::mutex mutex_;
  std::condition_variable opened_;
  std::size_t made_ = 0, closed_ = none;
};

/// LocalComm, counting its collectives by kind and by kind and dtype; the call of kind `fail_kind` numbered `fail_at`
/// (0-based) throws tandem::error before doing anything; where `gate` is set, a collective issued on a capturing
/// HostStream is followed there by StreamGate::hold, so that in the graph's replays the work after it waits behind
/// the gate (collectives outside a capture are not held).
struct CountingComm {
  tandem::LocalComm& comm;
  Collective fail_kind = Collective::reduce_scatter;
  int fail_at = -1;  ///< none
  StreamGate* gate = nullptr;
  std::array<int, 4> calls{};
  std::array<std::array<int, 4>, 4> calls_in{};  ///< [kind][dtype]

  int count(Collective c) const { return calls[static_cast<std::size_t>(c)]; }
  int count(Collective c, tandem::DType d) const {
    return calls_in[static_cast<std::size_t>(c)][static_cast<std::size_t>(d)];
  }
  int rank() const { return comm.rank(); }
  int size() const { return comm.size(); }
  void all_reduce(const void* s, void* r, std::size_t n, tandem::DType d, tandem::ReduceOp op, tandem::Stream st) {
    called(Collective::all_reduce, d);
    comm.all_reduce(s, r, n, d, op, st);
    held(st);
  }
  void reduce_scatter(const void* s, void* r, std::size_t n, tandem::DType d, tandem::ReduceOp op, tandem::Stream st) {
    called(Collective::reduce_scatter, d);
    comm.reduce_scatter(s, r, n, d, op, st);
    held(st);
  }
  void all_gather(const void* s, void* r, std::size_t n, tandem::DType d, tandem::Stream st) {
    called(Collective::all_gather, d);
    comm.all_gather(s, r, n, d, st);
    held(st);
  }
  void broadcast(const void* s, void* r, std::size_t n, tandem::DType d, int root, tandem::Stream st) {
    called(Collective::broadcast, d);
    comm.broadcast(s, r, n, d, root, st);
    held(st);
  }
  void barrier() { comm.barrier(); }

 private:
  void called(Collective c, tandem::DType d) {
    ++calls_in[static_cast<std::size_t>(c)][static_cast<std::size_t>(d)];
    if (c == fail_kind && calls[static_cast<std::size_t>(c)] == fail_at) {
      ++calls[static_cast<std::size_t>(c)];
      throw tandem::error("injected collective failure");
    }
    ++calls[static_cast<std::size_t>(c)];
  }
  void held(tandem::Stream st) {
    if (gate == nullptr) return;
    tandem::HostStream* q = tandem::detail::host_queue(st);
    if (q != nullptr && q->capturing()) gate->hold(*q);
  }
};
static_assert(tandem::Communicator<CountingComm>);

/// What f() throws as tandem::error, or "(no error)".
template <class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const tandem::error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace test
