// SPDX-License-Identifier: Apache-2.0
// Checkpoint I/O: a rank's TrainingState to and from CheckpointData (core/checkpoint.hpp's world-size- and
// policy-independent form: per tensor, its parameters, fp32 master weights and optimizer state). Saving gathers
// every owned range to rank 0 (the state's owned space under policy P: all of it under replicated state, the rank's
// shards under sharded state; the parameters from the full buffer, or gathered from the shards); loading takes from
// the data what this rank owns. The front agrees on failures across ranks (detail::all_ranks_succeed), checks the
// data (detail::check_checkpoint) and orders the streams.
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

/// Saving: every owned-space array of a rank's state (master weights, optimizer state, parameter shards) over the
/// whole flat space on every rank, and the full parameters on rank 0, gathered in three steps so that no rank ever
/// fails alone inside a collective: the constructor allocates everything (the caller agrees on its success across
/// ranks), gather() runs the collectives and allocates nothing, and data() (rank 0) assembles the CheckpointData.
template <Policy P, class Backend>
class CheckpointGather {
 public:
  TANDEM_COLD CheckpointGather(const Backend& backend, const Plan& plan, const TrainingState<Backend>& state,
                               DType param_dtype, int rank)
      : backend_(backend), plan_(plan), state_(state), pdtype_(param_dtype), rank_(rank) {
    const std::size_t full = plan.total_size(), psize = dtype_size(param_dtype);
    staging_ = allocate_named<unsigned char>(backend, full * std::max(psize, sizeof(float)), "the checkpoint's gather buffer");
    if (state.master() != nullptr) masters_.resize(full * sizeof(float));
    if (state.param_flat() == nullptr || rank == 0) params_.resize(full * psize);
    states_.assign(state.state_count(), std::vector<unsigned char>(full * sizeof(float)));
  }

  /// The collectives (every rank, in the same order), then rank 0's read of the full parameters.
  template <Communicator Comm>
  TANDEM_COLD void gather(Comm& comm) {
    if (state_.master() != nullptr) gather_owned(comm, state_.master(), DType::fp32, masters_);
    if (state_.param_flat() == nullptr) gather_owned(comm, state_.param_shard(), pdtype_, params_);
    for (std::size_t k = 0; k < state_.state_count(); ++k) gather_owned(comm, state_.state(k), DType::fp32, states_[k]);
    if (state_.param_flat() != nullptr && rank_ == 0)
      backend_.read(params_.data(), state_.param_flat(), params_.size(), backend_.stream());
  }

  /// Rank 0: `meta` (step, names, fingerprint) with every tensor's parameters, masters and state filled in.
  TANDEM_COLD CheckpointData data(const Layout& layout, CheckpointData meta) const {
    const std::size_t psize = dtype_size(pdtype_);
    auto floats = [](const std::vector<unsigned char>& bytes, std::size_t at, std::size_t n) {
      std::vector<float> v(n);
      if (n != 0) std::memcpy(v.data(), bytes.data() + at * sizeof(float), n * sizeof(float));
      return v;
    };
    meta.param_dtype = pdtype_;
    meta.state_count = static_cast<std::uint32_t>(state_.state_count());
    meta.tensors = layout.tensors();
    for (std::size_t i = 0; i < layout.size(); ++i) {
      const std::size_t at = plan_.flat_offset(i), n = layout[i].numel;
      const unsigned char* p = params_.data() + at * psize;
      meta.params.emplace_back(p, p + n * psize);
      meta.masters.push_back(masters_.empty() ? std::vector<float>{} : floats(masters_, at, n));
      meta.states.emplace_back();
      for (const auto& st : states_) meta.states.back().push_back(floats(st, at, n));
    }
    return meta;
  }

 private:
  /// An owned-space array of `dtype` over the whole flat space, into `out`: each bucket's owned ranges all-gathered,
  /// or copied where a rank owns every shard.
  template <Communicator Comm>
  void gather_owned(Comm& comm, const void* owned, DType dtype, std::vector<unsigned char>& out) {
    const std::size_t size = dtype_size(dtype);
    const auto* from = static_cast<const unsigned char*>(owned);
    unsigned char* to = staging_.data();
    for (std::size_t b = 0; b < plan_.num_buckets(); ++b) {
      const Bucket& bucket = plan_.bucket(b);
      if (owns_every_shard<P>(comm.size()))
        backend_.copy(to + bucket.offset * size, from + owned_offset<P>(plan_, b) * size, bucket.size * size,
                      backend_.stream());
      else
        comm.all_gather(from + owned_offset<P>(plan_, b) * size, to + bucket.offset * size, bucket.shard_size, dtype,
                        backend_.stream());
    }
    backend_.read(out.data(), to, out.size(), backend_.stream());
  }

  const Backend& backend_;
  const Plan& plan_;
  const TrainingState<Backend>& state_;
  DType pdtype_;
  int rank_;
  typename Backend::template Buffer<unsigned char> staging_;
  std::vector<unsigned char> masters_, params_;
  std::vector<std::vector<unsigned char>> states_;
};

/// Copies what this rank keeps of a checked checkpoint into its state, on the backend's work stream: the full
/// parameters (where it keeps them), and over its owned ranges the parameter shards, master weights and optimizer
/// state. The copies read `c` as late as when they run: the caller keeps `c` alive until the stream has done them.
template <Policy P, class Backend>
TANDEM_COLD void restore_checkpoint(const Backend& backend, const Plan& plan, const Layout& layout, int rank,
                                    const TrainingState<Backend>& state, const CheckpointData& c) {
  const std::size_t psize = dtype_size(c.param_dtype);
  for (std::size_t i = 0; i < layout.size(); ++i) {
    const std::size_t at = plan.flat_offset(i), n = layout[i].numel;
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
