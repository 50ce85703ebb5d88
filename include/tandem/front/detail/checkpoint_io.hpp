// SPDX-License-Identifier: Apache-2.0
// Checkpoint I/O: a rank's TrainingState to and from CheckpointData (core/checkpoint.hpp's world-size- and
// policy-independent form: per tensor, its parameters, fp32 master weights and optimizer state). Saving gathers
// every owned range to rank 0 (the state's owned space under policy P: all of it under replicated state, the rank's
// shards under sharded state; the parameters from the full buffer, or gathered from the shards); loading takes from
// the data what this rank owns. The front checks the data (detail::check_checkpoint) and orders the streams.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>

#include "tandem/comm/communicator.hpp"
#include "tandem/core/checkpoint.hpp"
#include "tandem/core/config.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/core/plan.hpp"
#include "tandem/core/tensor.hpp"
#include "tandem/front/detail/training_state.hpp"
#include "tandem/policy/policy.hpp"

namespace tandem::detail {

/// Tensor i's offset in the plan's flat space.
inline std::size_t flat_index(const Plan& plan, std::size_t tensor) {
  const Placement& at = plan.placement(tensor);
  return plan.bucket(at.bucket).offset + at.offset;
}

/// An owned-space array of `dtype` (master weights, optimizer state, parameter shards) over the whole flat space, on
/// every rank: each bucket's owned ranges all-gathered, or copied where every rank owns all of it. Collective.
template <Policy P, class Backend, Communicator Comm>
TANDEM_COLD std::vector<unsigned char> gather_owned(Comm& comm, const Backend& backend, const Plan& plan,
                                                    const void* owned, DType dtype) {
  const std::size_t size = dtype_size(dtype);
  auto gathered = backend.template allocate<unsigned char>(plan.total_size() * size);
  const auto* from = static_cast<const unsigned char*>(owned);
  for (std::size_t b = 0; b < plan.num_buckets(); ++b) {
    const Bucket& bucket = plan.bucket(b);
    if (owned_shards<P>(comm.size()) == comm.size())
      backend.copy(gathered.data() + bucket.offset * size, from + owned_offset<P>(plan, b) * size, bucket.size * size,
                   backend.stream());
    else
      comm.all_gather(from + owned_offset<P>(plan, b) * size, gathered.data() + bucket.offset * size,
                      bucket.shard_size, dtype, backend.stream());
  }
  std::vector<unsigned char> full(gathered.bytes());
  backend.read(full.data(), gathered.data(), gathered.bytes(), backend.stream());
  return full;
}

/// The training state as a checkpoint holds it: `meta` (step, names, fingerprint) with every tensor's parameters,
/// masters and state filled in on rank 0; the other ranks take part in the gathers and return `meta` as it is.
/// Collective.
template <Policy P, class Backend, Communicator Comm>
TANDEM_COLD CheckpointData collect_checkpoint(Comm& comm, const Backend& backend, const Plan& plan,
                                              const Layout& layout, const TrainingState<Backend>& state,
                                              CheckpointData meta) {
  const DType pdtype = meta.param_dtype;
  const std::size_t psize = dtype_size(pdtype);
  const int rank = comm.rank();
  std::vector<unsigned char> masters, params;
  if (state.master() != nullptr) masters = gather_owned<P>(comm, backend, plan, state.master(), DType::fp32);
  if (state.param_flat() == nullptr) {
    params = gather_owned<P>(comm, backend, plan, state.param_shard(), pdtype);
  } else if (rank == 0) {
    params.resize(plan.total_size() * psize);
    backend.read(params.data(), state.param_flat(), params.size(), backend.stream());
  }
  std::vector<std::vector<unsigned char>> states;
  for (std::size_t k = 0; k < state.state_count(); ++k)
    states.push_back(gather_owned<P>(comm, backend, plan, state.state(k), DType::fp32));
  if (rank != 0) return meta;
  auto floats = [](const std::vector<unsigned char>& bytes, std::size_t at, std::size_t n) {
    std::vector<float> v(n);
    if (n != 0) std::memcpy(v.data(), bytes.data() + at * sizeof(float), n * sizeof(float));
    return v;
  };
  meta.state_count = static_cast<std::uint32_t>(state.state_count());
  meta.tensors = layout.tensors();
  for (std::size_t i = 0; i < layout.size(); ++i) {
    const std::size_t at = flat_index(plan, i), n = layout[i].numel;
    const unsigned char* p = params.data() + at * psize;
    meta.params.emplace_back(p, p + n * psize);
    meta.masters.push_back(masters.empty() ? std::vector<float>{} : floats(masters, at, n));
    meta.states.emplace_back();
    for (const auto& st : states) meta.states.back().push_back(floats(st, at, n));
  }
  return meta;
}

/// Copies what this rank keeps of a checked checkpoint into its state, on the backend's work stream: the full
/// parameters (where it keeps them), and over its owned ranges the parameter shards, master weights and optimizer
/// state. The copies read `c` as late as when they run: the caller keeps `c` alive until the stream has done them.
template <Policy P, class Backend>
TANDEM_COLD void restore_checkpoint(const Backend& backend, const Plan& plan, const Layout& layout, int rank,
                                    const TrainingState<Backend>& state, const CheckpointData& c) {
  const std::size_t psize = dtype_size(c.param_dtype);
  for (std::size_t i = 0; i < layout.size(); ++i) {
    const std::size_t at = flat_index(plan, i), n = layout[i].numel;
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
