// SPDX-License-Identifier: Apache-2.0
// The communicator concept: the collectives data parallelism needs, with NCCL's semantics.
//
//   all_reduce(send, recv, count)        recv[i] = op over ranks of send[i]; in place when send == recv
//   reduce_scatter(send, recv, count)    send holds size*count elements; rank r receives the reduction of
//                                        elements [r*count, (r+1)*count); in place when recv == send + r*count
//   all_gather(send, recv, count)        recv holds size*count elements; block q is rank q's send;
//                                        in place when send == recv + r*count
//   broadcast(send, recv, count, root)   recv = root's send on every rank (send is read on the root only);
//                                        in place when send == recv
//
// Counts are in elements of `dtype`. 16-bit inputs are reduced in fp32 and rounded once. `avg` divides the
// sum by the number of ranks. Every rank must call the same collectives in the same order with the same
// count, dtype and op. Every call takes a stream last; the host communicators complete before returning.
#pragma once

#include <concepts>
#include <cstddef>

#include "tandem/core/dtype.hpp"
#include "tandem/core/stream.hpp"

namespace tandem {

enum class ReduceOp { sum, avg };

constexpr const char* reduce_op_name(ReduceOp op) { return op == ReduceOp::sum ? "sum" : "avg"; }

template <class C>
concept Communicator = requires(C& c, const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                                int root, Stream stream) {
  { c.rank() } -> std::convertible_to<int>;
  { c.size() } -> std::convertible_to<int>;
  c.all_reduce(send, recv, count, dtype, op, stream);
  c.reduce_scatter(send, recv, count, dtype, op, stream);
  c.all_gather(send, recv, count, dtype, stream);
  c.broadcast(send, recv, count, dtype, root, stream);
  c.barrier();
};

}  // namespace tandem
