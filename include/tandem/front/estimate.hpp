// SPDX-License-Identifier: Apache-2.0
// The memory estimator: the MemoryReport that DataParallel<P, Opt> would report on one rank, computed from the
// tensor list alone. It cuts the same plan (detail::plan_for, public as bucket_plan) and applies the policy's buffer
// rule (buffers_for<P>) and the one categorisation (memory_of), and sizes the pack tables (pack_tables_bytes),
// allocating nothing, so it answers "does this fit?" for any world size before any rank exists.
// tests/test_memory_report.cpp holds it equal to memory_report() of real constructions.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "tandem/core/error.hpp"
#include "tandem/core/tensor.hpp"
#include "tandem/front/options.hpp"
#include "tandem/kernels/optimizer.hpp"
#include "tandem/kernels/pack.hpp"
#include "tandem/policy/policy.hpp"

namespace tandem {

/// The buckets DataParallel cuts for these tensors at this world size with these options (plan().bucket(b).tensors,
/// sizes and shards), before any rank exists: to size DataParallelOptions::parameter_buffers and gradient_buffers for
/// the buckets a pass holds at once, say. Throws tandem::error for arguments the construction would reject.
TANDEM_COLD inline Plan bucket_plan(std::vector<TensorSpec> tensors, int world_size,
                                    const DataParallelOptions& options = {}) {
  if (world_size < 1) detail::fail("tandem: world_size is " + std::to_string(world_size) + "; it must be >= 1");
  detail::validate(options);
  const Layout layout(std::move(tensors));
  detail::validate_one_dtype(layout);
  return detail::plan_for(layout, options, world_size);
}

/// What DataParallel<P, Opt, Backend>'s memory_report() would return on each rank of a group of `world_size` for these
/// tensors, with `storage` (Storage::user: built from TensorRefs; Storage::owned: from TensorSpecs). `pack_tables` is
/// the backend's layout of its pack tables (pack_table_layout_of<Backend>(): the default is HostBackend's,
/// cuda_pack_table_layout CudaBackend's). It sets MemoryReport::pack_tables alone, and the two differ there only for
/// tensors whose size is not a multiple of 1024 elements. Throws tandem::error for arguments the construction would
/// reject, the tensors' names aside (the construction checks that a checkpoint can tell them apart), and where the
/// report's total would be past what 64 bits count.
template <Policy P, Optimizer Opt>
TANDEM_COLD MemoryReport estimate_memory(std::vector<TensorSpec> tensors, int world_size, Storage storage,
                                         const typename Opt::Options& optimizer = {},
                                         const DataParallelOptions& options = {},
                                         PackTableLayout pack_tables = PackTableLayout{}) {
  Opt::validate(optimizer);
  detail::check_chunk_elements(pack_tables.chunk_elements);
  const DType dtype = tensors.empty() ? DType::fp32 : tensors[0].dtype;
  std::size_t numel = 0;
  for (const TensorSpec& t : tensors) numel += t.numel;
  const Plan plan = bucket_plan(std::move(tensors), world_size, options);
  const BufferInputs in = detail::buffer_inputs(plan, dtype, storage, options);
  MemoryReport r = memory_of(buffers_for<P>(in), in, numel, Opt::state_count(optimizer));
  // Copy mode keeps a table of every bucket for the parameters (unpack) and one for the gradients (pack).
  if (storage == Storage::user)
    r.pack_tables = detail::ByteCount{}.add(pack_tables_bytes(plan, pack_tables), 2).value();
  detail::check_total(r);
  return r;
}

}  // namespace tandem
