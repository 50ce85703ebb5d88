// SPDX-License-Identifier: Apache-2.0
// DataParallel's construction options, and the plan they give for a layout: shared by DataParallel and the memory
// estimator (front/estimate.hpp), so that both cut the same buckets.
#pragma once

#include <cmath>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "tandem/core/dtype.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/plan.hpp"
#include "tandem/core/stream.hpp"
#include "tandem/core/tensor.hpp"
#include "tandem/policy/policy.hpp"

namespace tandem {

/// What step() does when the reduced gradients hold a NaN or an infinity (detected on every rank alike, from
/// the global sum of squares).
enum class NonFinite {
  ignore,      ///< no check: the update proceeds (and the parameters become non-finite)
  skip_step,   ///< discard this step's gradients, leave parameters and optimizer state as they were, count it
  throw_error  ///< throw tandem::error on every rank
};

/// When step() learns what an optimizer step did. Either way the step's verdict (update; skip, for a non-finite norm;
/// refuse, where the ranks' optimizer options differ) is made on the device, and the updates obey it there
/// (docs/cuda.md, "The one host wait").
enum class StepReport {
  at_step,  ///< step() reads the verdict back, reports it in its StepResult and throws where it says so: one host wait
            ///< per optimizer step with more than one rank, clipping or a non-finite check
  deferred  ///< step() never waits for the device (a step can be captured in a CUDA graph whatever it checks): its
            ///< StepResult is `pending` where the device decides, and DataParallel::last_step() reads the latest
            ///< verdict when asked. A step that NonFinite::throw_error or differing options refused throws at the next
            ///< report: last_step(), all_ranks_have_batch() or save_checkpoint()
};

/// When the user's stream may read the parameters an optimizer step wrote (docs/cuda.md, "Parameters by bucket").
enum class ParametersReady {
  at_step,   ///< when step() returns: the user's stream waits for every bucket's update, gather and unpack
  by_bucket  ///< bucket by bucket: step() leaves the user's stream waiting for the updates only, and the user's stream
             ///< waits for bucket b's gather and unpack through DataParallel::wait_parameters(b) (or parameters(b)),
             ///< so the next forward reads the first buckets while the last ones are still gathered
};

struct DataParallelOptions {
  std::size_t bucket_cap_bytes = std::size_t{25} << 20;       ///< fp32 gradient bytes per bucket
  std::size_t first_bucket_cap_bytes = std::size_t{1} << 20;  ///< the first bucket (the last layers)
  int accumulation_steps = 1;                                 ///< micro-steps per optimizer step
  float max_grad_norm = 0.0f;  ///< > 0: scale gradients by min(1, max_grad_norm / (norm + 1e-6)), as torch does
  NonFinite non_finite = NonFinite::ignore;  ///< checking costs one pass over the owned gradients
  /// Owned storage under a policy that keeps no full gradients (GradientSharded): how many bucket-sized gradient
  /// buffers backward writes into, reused bucket after bucket; at most this many buckets are open (gradients(b)) or
  /// waiting to be reduced at once.
  int gradient_buffers = 2;
  /// Under a policy that shards the parameters (ParameterSharded): how many bucket-sized buffers buckets are gathered
  /// into while a pass uses them (parameters(b)) or after prefetch_parameters(b); two let one bucket's gather overlap
  /// the use of another.
  int parameter_buffers = 2;
  /// The dtype gradients cross ranks in: fp32, or bf16 / fp16 for half the bytes (PyTorch FSDP's reduce_dtype). With a
  /// 16-bit dtype, each bucket's fp32 gradients are averaged (× 1/(N·k)) and rounded into a bucket-sized buffer and
  /// reduced there (LocalGroup, DeviceGroup and Mpi add in fp32 and round once; NCCL in its own order), and the owned
  /// range is read back: into fp32, where micro-steps accumulate, or, under the sharded policies with
  /// accumulation_steps 1, kept in the 16-bit shard the update reads. Master weights and optimizer maths stay fp32.
  /// fp16 overflows where the averaged sum exceeds 65504 (no loss scaling here: set non_finite to catch it); bf16
  /// keeps fp32's range with 8 bits of mantissa.
  DType reduce_dtype = DType::fp32;
  StepReport step_report = StepReport::at_step;                 ///< when step() reports an optimizer step's outcome
  ParametersReady parameters_ready = ParametersReady::at_step;  ///< when the user's stream may read new parameters
  Stream stream = {};  ///< the user's stream (backward writes gradients on it); tandem orders its work after it
};

namespace detail {

/// Throws tandem::error naming the first option out of range.
TANDEM_COLD inline void validate(const DataParallelOptions& options) {
  if (options.accumulation_steps < 1)
    fail("tandem: DataParallelOptions::accumulation_steps is " + std::to_string(options.accumulation_steps) +
         "; it must be at least 1");
  if (!finite(options.max_grad_norm) || options.max_grad_norm < 0.0f)
    fail("tandem: DataParallelOptions::max_grad_norm is " + number(options.max_grad_norm) +
         "; it must be finite and >= 0 (0 disables clipping)");
  if (const auto n = static_cast<unsigned>(options.non_finite); n > static_cast<unsigned>(NonFinite::throw_error))
    fail("tandem: DataParallelOptions::non_finite is " + std::to_string(n) +
         ", not a NonFinite (ignore, skip_step or throw_error)");
  for (const auto& [name, cap] : {std::pair{"bucket_cap_bytes", options.bucket_cap_bytes},
                                  std::pair{"first_bucket_cap_bytes", options.first_bucket_cap_bytes}})
    if (cap < sizeof(float))
      fail(std::string("tandem: DataParallelOptions::") + name + " is " + std::to_string(cap) +
           "; it must be at least 4 bytes");
  if (options.gradient_buffers < 1)
    fail("tandem: DataParallelOptions::gradient_buffers is " + std::to_string(options.gradient_buffers) +
         "; it must be at least 1");
  if (options.parameter_buffers < 1)
    fail("tandem: DataParallelOptions::parameter_buffers is " + std::to_string(options.parameter_buffers) +
         "; it must be at least 1");
  if (const auto n = static_cast<unsigned>(options.step_report); n > static_cast<unsigned>(StepReport::deferred))
    fail("tandem: DataParallelOptions::step_report is " + std::to_string(n) +
         ", not a StepReport (at_step or deferred)");
  if (const auto n = static_cast<unsigned>(options.parameters_ready);
      n > static_cast<unsigned>(ParametersReady::by_bucket))
    fail("tandem: DataParallelOptions::parameters_ready is " + std::to_string(n) +
         ", not a ParametersReady (at_step or by_bucket)");
  if (const DType r = options.reduce_dtype; r != DType::fp32 && r != DType::bf16 && r != DType::fp16)
    fail(std::string("tandem: DataParallelOptions::reduce_dtype is ") +
         (r == DType::fp64 ? "fp64" : "DType " + std::to_string(static_cast<int>(r))) +
         "; gradients are reduced in fp32, bf16 or fp16");
}

/// Throws tandem::error unless every tensor has the first one's dtype (one DataParallel per parameter dtype).
TANDEM_COLD inline void validate_one_dtype(const Layout& layout) {
  for (std::size_t i = 1; i < layout.size(); ++i)
    if (layout[i].dtype != layout[0].dtype)
      fail(layout.describe(i) + ": dtype " + dtype_name(layout[i].dtype) + " differs from " + layout.describe(0) +
           "'s " + dtype_name(layout[0].dtype) + "; use one DataParallel per parameter dtype");
}

/// The buckets DataParallel cuts for these tensors (layout order, one parameter dtype) at this world size: caps in
/// fp32 gradient bytes, tensor offsets aligned to 16 bytes and shards to 128 bytes of the parameter dtype.
inline Plan plan_for(const Layout& layout, const DataParallelOptions& options, int world_size) {
  const std::size_t psize = dtype_size(layout[0].dtype);
  PlanOptions po;
  po.bucket_cap_bytes = options.bucket_cap_bytes;
  po.first_bucket_cap_bytes = options.first_bucket_cap_bytes;
  po.world_size = world_size;
  po.bucket_element_bytes = sizeof(float);
  po.alignment_elements = 16 / psize;
  po.shard_alignment_elements = 128 / psize;
  std::vector<std::size_t> sizes;
  sizes.reserve(layout.size());
  for (const TensorSpec& t : layout.tensors()) sizes.push_back(t.numel);
  return Plan(sizes, po);
}

/// What a policy's buffer rule (P::buffers) reads, from the plan and the options fixed at construction.
inline BufferInputs buffer_inputs(const Plan& plan, DType param_dtype, Storage storage,
                                  const DataParallelOptions& options) {
  return {plan,
          param_dtype,
          storage,
          static_cast<std::size_t>(options.gradient_buffers),
          static_cast<std::size_t>(options.parameter_buffers),
          options.reduce_dtype,
          options.accumulation_steps};
}

}  // namespace detail

}  // namespace tandem
