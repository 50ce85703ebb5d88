// SPDX-License-Identifier: Apache-2.0
// A test double around LocalComm that counts the collectives it is asked for and can fail one of them, and the
// message of what a call throws.
#pragma once

#include <array>
#include <cstddef>
#include <string>

#include "tandem/comm/local_group.hpp"
#include "tandem/core/error.hpp"

namespace test {

enum class Collective { all_reduce, reduce_scatter, all_gather, broadcast };

/// LocalComm, counting its collectives by kind and by kind and dtype; the call of kind `fail_kind` numbered `fail_at`
/// (0-based) throws tandem::error before doing anything.
struct CountingComm {
  tandem::LocalComm& comm;
  Collective fail_kind = Collective::reduce_scatter;
  int fail_at = -1;  ///< none
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
  }
  void reduce_scatter(const void* s, void* r, std::size_t n, tandem::DType d, tandem::ReduceOp op, tandem::Stream st) {
    called(Collective::reduce_scatter, d);
    comm.reduce_scatter(s, r, n, d, op, st);
  }
  void all_gather(const void* s, void* r, std::size_t n, tandem::DType d, tandem::Stream st) {
    called(Collective::all_gather, d);
    comm.all_gather(s, r, n, d, st);
  }
  void broadcast(const void* s, void* r, std::size_t n, tandem::DType d, int root, tandem::Stream st) {
    called(Collective::broadcast, d);
    comm.broadcast(s, r, n, d, root, st);
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
