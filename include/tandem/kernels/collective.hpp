// SPDX-License-Identifier: Apache-2.0
// The reduction of a collective among ranks that share one address space (DeviceGroup, comm/device_group.hpp: N
// ranks as threads on one device): out[i] = ((s0[i] + s1[i]) + s2[i]) + ... over the ranks in rank order,
// accumulated in fp32 (fp64 for fp64), divided by the rank count for avg, rounded once into the element type. These
// are exactly LocalGroup's additions in LocalGroup's order, so the two give the same bits
// (tests/test_device_group.cpp).
//
// Layout: rank q's input is send[q] + src (n elements of T); the result goes to recv[q] + dst for q in
// [dst_first, dst_last). An all-reduce has each rank reduce its slice and write it to every rank; a reduce-scatter has
// rank r reduce block r and write its own recv. Work item k covers elements [k * chunk, (k + 1) * chunk); its lanes
// stride through them. One lane reads every rank's element before it writes any result, so the in-place forms
// (recv == send, or recv == send + r * count) are safe: no other lane, block or rank touches that element.
#pragma once

#include <cstddef>
#include <type_traits>

#include "tandem/core/config.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/kernels/detail/rounding.hpp"

namespace tandem {

/// The most ranks one DeviceGroup holds (its pointers travel by value in the kernel's arguments).
inline constexpr int max_group_ranks = 8;

/// Elements per work item of a group reduction.
inline constexpr std::size_t group_reduce_chunk = 4096;

/// Every rank's send and recv pointers for one collective.
struct GroupBuffers {
  const void* send[max_group_ranks] = {};
  void* recv[max_group_ranks] = {};
};

constexpr std::size_t group_reduce_items(std::size_t n) { return (n + group_reduce_chunk - 1) / group_reduce_chunk; }

template <class T>
struct GroupReduceBody {
  using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;

  GroupBuffers buffers;
  int ranks = 1;
  bool average = false;  ///< divide by `ranks` (ReduceOp::avg)
  std::size_t src = 0, dst = 0, n = 0;
  int dst_first = 0, dst_last = 0;

  TANDEM_HD void operator()(std::size_t item, unsigned lane, unsigned lanes) const {
    const std::size_t begin = item * group_reduce_chunk;
    const std::size_t end = begin + group_reduce_chunk < n ? begin + group_reduce_chunk : n;
    for (std::size_t i = begin + lane; i < end; i += lanes) {
      Acc acc = convert<Acc>(static_cast<const T*>(buffers.send[0])[src + i]);
      for (int q = 1; q < ranks; ++q) acc += convert<Acc>(static_cast<const T*>(buffers.send[q])[src + i]);
      if (average) acc = detail::div_rn(acc, static_cast<Acc>(ranks));
      const T out = convert<T>(acc);
      for (int q = dst_first; q < dst_last; ++q) static_cast<T*>(buffers.recv[q])[dst + i] = out;
    }
  }
};

}  // namespace tandem
