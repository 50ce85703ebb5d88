// SPDX-License-Identifier: Apache-2.0
// What a policy decides, and the concept a policy type satisfies. A policy is an empty tag type and the one place
// of its behaviour: its traits (who keeps the optimizer state, when gradients are reduced, who keeps the parameters
// between uses), its phase hooks (policy/phases.hpp: what the front does with a bucket in each phase), the collectives
// those phases run (two hooks over one bucket), its owned range (from its state trait, owned_range below) and its
// buffer rule: which buffers a rank allocates and how large, from which the memory report and the estimator
// (front/estimate.hpp) both follow. The front calls nothing else.
#pragma once

#include <concepts>
#include <cstddef>
#include <string>

#include "tandem/comm/communicator.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/core/plan.hpp"
#include "tandem/core/stream.hpp"
#include "tandem/policy/phases.hpp"

namespace tandem {

/// Where the parameters and the gradients backward writes live.
enum class Storage {
  user,  ///< the user's own buffers (TensorRef): tandem packs the gradients and unpacks the parameters
  owned  ///< tandem's (TensorSpec): the user's tensors are views into tandem's buckets (zero-copy)
};

/// Bytes per rank held for training, by category. With Storage::user, `params` and `grads` are the user's buffers,
/// `buckets` is every buffer tandem allocates besides master weights and optimizer state (its flat copies and the
/// shard accumulator too), and `pack_tables` the tables its pack and unpack launches read (kernels/pack.hpp); with
/// Storage::owned, `params` and `grads` are tandem's storage that lives across the step, `buckets` is its transient
/// storage, and there are no pack tables. Not counted: the optimizer step's scalars (the gradient norm's terms and the
/// options check, a double per bucket and owned shard and a few more, allocated at construction), on CUDA the norm's
/// scratch (a double per 4096 elements of the largest range summed, with CUB's temporary storage: about 13 KB for a
/// 25 MB bucket; from the first clipped or checked step), and the backend's and communicator's own workspaces.
struct MemoryReport {
  std::size_t params = 0;           ///< parameter storage
  std::size_t grads = 0;            ///< gradient storage (the user's buffers, or what tandem keeps across the step)
  std::size_t master_weights = 0;   ///< fp32 master copies of 16-bit parameters
  std::size_t optimizer_state = 0;  ///< optimizer moments
  std::size_t buckets = 0;          ///< tandem's communication buffers and accumulators
  /// Storage::user: the pack tables of the parameters and of the gradients, in backend memory (pack_tables_bytes:
  /// about 64 bytes per 1024 elements, on every rank whatever the policy)
  std::size_t pack_tables = 0;
  std::size_t total() const { return params + grads + master_weights + optimizer_state + buckets + pack_tables; }
  std::size_t model_states() const { return params + grads + master_weights + optimizer_state; }
  friend bool operator==(const MemoryReport&, const MemoryReport&) = default;
};

/// What a policy's buffer rule reads: the plan and the choices fixed at construction.
struct BufferInputs {
  const Plan& plan;
  DType param_dtype = DType::fp32;
  Storage storage = Storage::user;
  std::size_t gradient_buffers = 0;   ///< DataParallelOptions::gradient_buffers
  std::size_t parameter_buffers = 0;  ///< DataParallelOptions::parameter_buffers
  DType reduce_dtype = DType::fp32;   ///< DataParallelOptions::reduce_dtype
  int accumulation_steps = 1;         ///< DataParallelOptions::accumulation_steps
};

/// The buffers one rank allocates, in elements (fp32 unless said). A zero means the buffer does not exist.
struct Buffers {
  std::size_t param_flat = 0;   ///< parameter dtype: every bucket's parameters
  std::size_t param_shard = 0;  ///< parameter dtype: this rank's shard of every bucket (sharded parameters)
  std::size_t param_slots = 0;  ///< parameter dtype: reused buffers a bucket is gathered into while it is used
  std::size_t param_slot_size = 0;
  std::size_t master = 0;      ///< fp32 master weights of the owned range (16-bit parameters only)
  std::size_t state = 0;       ///< each optimizer state array, over the owned range
  std::size_t grad_flat = 0;   ///< full-size gradients living across the step
  std::size_t grad_slots = 0;  ///< reused bucket gradient buffers (owned storage under sharded gradients)
  std::size_t grad_slot_size = 0;
  std::size_t staging = 0;        ///< one bucket of packed gradients (the user's storage under sharded gradients)
  std::size_t grad_shard = 0;     ///< the reduced-gradient shard accumulator, in grad_shard_dtype
  std::size_t reduce_buffer = 0;  ///< reduce dtype: one bucket, where a 16-bit reduction happens (the front's)
  DType grad_shard_dtype = DType::fp32;
};

namespace detail {

/// Bytes of a memory report, summed as a + b × c + ... where a product or a sum past what 64 bits count throws: the
/// plan bounds elements (2^62 of the padded flat space), not the bytes of several arrays of them, which
/// estimate_memory can be asked for (2^47 parameters at 2^31 ranks, say) though no rank could allocate them.
class ByteCount {
 public:
  /// Adds `count` × `each` bytes.
  ByteCount& add(std::size_t count, std::size_t each = 1) {
    if (each != 0 && count > max / each) overflow();
    if (count * each > max - value_) overflow();
    value_ += count * each;
    return *this;
  }
  std::size_t value() const { return value_; }

 private:
  static constexpr std::size_t max = static_cast<std::size_t>(-1);
  [[noreturn]] static void overflow() {
    fail("tandem: the memory per rank of this layout is past what 64 bits count (" + std::to_string(max) +
         " bytes); fewer parameters or ranks");
  }
  std::size_t value_ = 0;
};

/// Bytes of `count` arrays of `elements` elements of `each` bytes, or tandem::error past 64 bits.
inline std::size_t bytes_of(std::size_t count, std::size_t elements, std::size_t each) {
  return ByteCount{}.add(ByteCount{}.add(count, elements).value(), each).value();
}

/// Throws tandem::error unless `r.total()` fits in 64 bits.
inline void check_total(const MemoryReport& r) {
  ByteCount{}.add(r.params).add(r.grads).add(r.master_weights).add(r.optimizer_state).add(r.buckets).add(r.pack_tables);
}

}  // namespace detail

/// The memory report of a set of buffers: the categories of MemoryReport, one rule for every policy. `numel` is the
/// layout's element count (the user's buffers' size with Storage::user); `state_count` the optimizer's arrays.
/// `pack_tables` is left 0: the tables are not buffers of the policy's rule (DataParallel and estimate_memory add
/// them). Throws tandem::error where a category or the total would be past what 64 bits count.
inline MemoryReport memory_of(const Buffers& b, const BufferInputs& in, std::size_t numel, std::size_t state_count) {
  using detail::ByteCount;
  const std::size_t p = dtype_size(in.param_dtype), f = sizeof(float);
  MemoryReport r;
  r.master_weights = ByteCount{}.add(b.master, f).value();
  r.optimizer_state = detail::bytes_of(state_count, b.state, f);
  const std::size_t transient = ByteCount{}
                                    .add(detail::bytes_of(b.grad_slots, b.grad_slot_size, f))
                                    .add(b.staging, f)
                                    .add(detail::bytes_of(b.param_slots, b.param_slot_size, p))
                                    .add(b.reduce_buffer, dtype_size(in.reduce_dtype))
                                    .value();
  const std::size_t flat_params = ByteCount{}.add(b.param_flat, p).add(b.param_shard, p).value();
  const std::size_t flat_grads =
      ByteCount{}.add(b.grad_flat, f).add(b.grad_shard, dtype_size(b.grad_shard_dtype)).value();
  if (in.storage == Storage::user) {
    r.params = ByteCount{}.add(numel, p).value();
    r.grads = r.params;
    r.buckets = ByteCount{}.add(flat_params).add(flat_grads).add(transient).value();
  } else {
    r.params = flat_params;
    r.grads = flat_grads;
    r.buckets = transient;
  }
  detail::check_total(r);
  return r;
}

namespace detail {

/// A communicator with nothing behind it, for checking that a policy's hooks accept every Communicator.
struct ArchetypeCommunicator {
  int rank() const;
  int size() const;
  void all_reduce(const void*, void*, std::size_t, DType, ReduceOp, Stream);
  void reduce_scatter(const void*, void*, std::size_t, DType, ReduceOp, Stream);
  void all_gather(const void*, void*, std::size_t, DType, Stream);
  void broadcast(const void*, void*, std::size_t, DType, int, Stream);
  void barrier();
};
static_assert(Communicator<ArchetypeCommunicator>);

}  // namespace detail

/// One bucket as a policy's hooks see it.
struct BucketView {
  /// The bucket's gradients to reduce (size elements of grad_dtype): fp32, or DataParallelOptions::reduce_dtype's
  /// copy of them. A reduction leaves the reduced sum in the owned range (all of it, or shard `rank`), or in `reduced`.
  void* grad = nullptr;
  DType grad_dtype = DType::fp32;
  void* param = nullptr;  ///< the bucket's parameters in the parameter dtype (size elements)
  /// This rank's shard of them (shard_size elements): inside `param` (at rank × shard_size) unless the policy shards
  /// the parameters, where it is the rank's own storage and `param` a buffer to gather the bucket into.
  const void* param_shard = nullptr;
  DType param_dtype = DType::fp32;
  std::size_t size = 0;        ///< elements, a multiple of the world size
  std::size_t shard_size = 0;  ///< size / world size
  int rank = 0;
  Stream stream = {};
  /// Where the reduction writes the reduced owned range instead (its elements of grad_dtype, apart from `grad`), or
  /// nullptr: in place. The front sets it only for a policy that declares it honours it (honours_reduced), of a
  /// gradient scheme that reduces every micro-step, at the first micro-step of a window: the shard accumulator then
  /// takes the reduced shard from the collective itself.
  void* reduced = nullptr;
};

/// Whether P's reduce_gradients writes the reduced owned range to BucketView::reduced where the front sets it: P
/// declares `static constexpr bool reduces_into_reduced = true` beside that hook (detail::ShardedCollectives does).
/// For any other policy `reduced` stays nullptr: the reduction is in place, and the front copies the shard into the
/// accumulator after it, as at a window's later micro-steps.
template <class P>
inline constexpr bool honours_reduced = requires {
  requires P::reduces_into_reduced;
};

/// A policy: its name and traits, its phase hooks (a gradient scheme and a parameter scheme of policy/phases.hpp, or
/// hooks of its own over the same operations), the collectives of those phases, and its buffer rule.
template <class P>
concept Policy = requires(detail::ArchetypeCommunicator& comm, const BucketView& bucket, const BufferInputs& in,
                          detail::ArchetypeBucketOps& ops, std::size_t b) {
  { P::name } -> std::convertible_to<const char*>;
  { P::state } -> std::convertible_to<StateSharding>;
  { P::reduction } -> std::convertible_to<GradientReduction>;
  { P::parameters } -> std::convertible_to<ParameterSharding>;
  P::gradients_complete(ops, b);
  P::after_update(ops, b);
  { P::open_parameters(ops, b) } -> std::same_as<const void*>;
  P::reduce_gradients(comm, bucket);
  P::gather_parameters(comm, bucket);
  { P::buffers(in) } -> std::same_as<Buffers>;
};

/// What a rank allocates under policy P: the policy's buffer rule, and what a 16-bit DataParallelOptions::reduce_dtype
/// changes in it: the front's own reduce buffer (one bucket: reductions run one after another on one stream), and a
/// reduced-gradient shard that no second micro-step adds into (accumulation_steps 1) keeps the reduced values in the
/// reduce dtype, as the ZeRO paper's 16-bit gradients (2 bytes per element of the shard instead of 4).
template <Policy P>
Buffers buffers_for(const BufferInputs& in) {
  Buffers b = P::buffers(in);
  if (in.reduce_dtype == DType::fp32) return b;
  b.reduce_buffer = in.plan.max_bucket_size();
  if (b.grad_shard != 0 && in.accumulation_steps == 1) b.grad_shard_dtype = in.reduce_dtype;
  return b;
}

/// Who keeps a policy's parameters: its `parameters` trait (its parameter scheme's).
template <Policy P>
inline constexpr ParameterSharding parameter_sharding_of = P::parameters;

/// The flat range of bucket b that `rank` owns under P (updates, and keeps the master weights and optimizer state of):
/// the whole bucket under StateSharding::replicated, shard `rank` under StateSharding::sharded. Every rule of the owned
/// space (owned_offset, owned_shards) follows from this one.
template <Policy P>
Range owned_range(const Plan& plan, std::size_t b, int rank) {
  if constexpr (P::state == StateSharding::replicated) {
    const Bucket& bucket = plan.bucket(b);
    return {bucket.offset, bucket.offset + bucket.size};
  } else {
    return plan.shard(b, rank);
  }
}

/// Where bucket b's owned range starts in the owned space (the arrays of master weights and optimizer state).
template <Policy P>
std::size_t owned_offset(const Plan& plan, std::size_t b) {
  if constexpr (P::state == StateSharding::replicated) return plan.bucket(b).offset;
  return plan.bucket(b).shard_offset;
}

/// How many of a bucket's `world` shards one rank owns (all of them, or its own).
template <Policy P>
constexpr int owned_shards(int world) {
  return P::state == StateSharding::replicated ? world : 1;
}
/// Whether a rank owns every shard of every bucket, so that nothing of the owned space needs gathering.
template <Policy P>
constexpr bool owns_every_shard(int world) {
  return owned_shards<P>(world) == world;
}

/// A policy that reduce-scatters every micro-step keeps only its shard of the reduced gradients, so it must shard the
/// optimizer state too.
template <Policy P>
inline constexpr bool state_follows_reduction =
    !(P::state == StateSharding::replicated && P::reduction == GradientReduction::every_micro_step);

/// A policy that shards the parameters updates only its shard, so it must shard the optimizer state, and keeps no full
/// gradients (it could not use them), so it must reduce every micro-step.
template <Policy P>
inline constexpr bool parameters_follow_state = parameter_sharding_of<P> == ParameterSharding::replicated ||
                                                (P::state == StateSharding::sharded &&
                                                 P::reduction == GradientReduction::every_micro_step);

/// Whether a policy's traits can work together; DataParallel states the reason when they cannot.
template <Policy P>
inline constexpr bool coherent_policy = state_follows_reduction<P>&& parameters_follow_state<P>;

}  // namespace tandem
