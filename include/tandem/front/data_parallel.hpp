// SPDX-License-Identifier: Apache-2.0
// DataParallel<Policy, Optimizer, Backend, Comm>: the user-facing front. It validates the user's tensors
// (and checks that every rank passed the same ones), plans buckets, allocates what the policy needs, and
// runs each step: pack -> collective -> (clip) -> update -> gather -> unpack, bucket by bucket.
//
// This file is the public API and the call protocol (streams, the accumulation window, the bucket handles); the work
// is done by its parts in front/detail/, each fixed at construction and testable alone:
//   training_state.hpp  the buffers the policy's rule asks for (buffers_for<P>), and what they amount to
//   bucket_kernels.hpp  every launch of a step, typed once for the dtypes (parameters, reduction, reduced gradients)
//   checkpoint_io.hpp   the state to and from a checkpoint
//   agreement.hpp       what every rank must agree on, and how a problem on one rank reaches every rank
//   validation.hpp      the checks of the user's arguments
//   slot_pool.hpp, gather_slots.hpp   which bucket holds which reused gradient or gather buffer
// The policy acts through its phase hooks (policy/phases.hpp), over the operations of Ops below; the storage mode
// (the user's buffers, or tandem's) is fixed by the constructor taken, which selects StorageSteps: the steps of that
// mode, instantiated for it alone; the dtypes select the kernels (BucketKernels). No step dispatches on a dtype, a
// policy trait or the storage mode again; what it asks is which buffers the policy's rule made (TrainingState).
//
// Buffers (F = plan.total_size(), S = plan.total_shard_size(), M = plan.max_bucket_size(); the owned space is the
// flat space under StateSharding::replicated, the rank's shards under sharded):
//   param_flat  F  parameter dtype   every bucket's parameters; the update writes the owned part, the
//                                    gather fills the rest, unpack copies it to the user's buffers
//   param_shard S  parameter dtype   ParameterSharding::sharded instead of param_flat: this rank's shard, updated
//   gather      K'×M parameter dtype ParameterSharding::sharded: K' reused buffers a bucket is gathered into while
//                                    a pass reads it (parameters(b))
//   master      owned  fp32          16-bit parameters only; for fp32 the owned part of param_flat (or
//                                    param_shard) is it
//   state[k]    owned  fp32          the optimizer's per-element state
//   grad_flat   F  fp32              ReduceAtBoundary: gradients accumulated across micro-steps
//   staging     M  fp32              ReduceEveryMicroStep with the user's storage
//   grad_slots  K×M fp32             ReduceEveryMicroStep with owned storage: K reused bucket buffers
//   grad_shard  S  fp32              ReduceEveryMicroStep: the reduced-gradient accumulator (in the 16-bit reduce
//                                    dtype where accumulation_steps is 1: nothing adds into it)
//   reduce      M  reduce dtype      a 16-bit DataParallelOptions::reduce_dtype: a bucket's gradients rounded and
//                                    reduced here, the owned range then read back into fp32
// With owned storage (zero-copy; construct from TensorSpecs) the user's tensors are views into param_flat and
// grad_flat or a gradient slot, and pack/unpack disappear. A bucket's gradients are written through a GradientBucket
// (gradients(b)): under GradientSharded it holds one of the K slots from when it is opened until the bucket has been
// reduce-scattered into grad_shard; the slot is then zeroed and handed to the next bucket.
//
// Streams (docs/cuda.md): the user's work is ordered on options.stream, tandem's on the backend's work stream. Every
// public call that issues work on the user's buffers holds a StreamScope: it enters by making the work stream wait for
// an event recorded on the user's stream, and a call that ends the user's hold on its buffers (construction, step,
// broadcast_parameters, initialize_parameters, load_checkpoint, discard_gradients, store_optimizer_options) leaves by
// making the user's stream wait for an event recorded on the work stream, also when it throws. The destructor enters
// and leaves, so that the buffers, freed in order on the work stream, outlive the user's queued work on them, and the
// user's later work comes after tandem's. A bucket's collective, and the bucket work that follows it, run on the
// backend's comm stream behind an event on the work stream (after_work), so the work stream packs or updates the next
// bucket meanwhile; the work stream waits for the comm stream (join_comm) before it reads what the collectives wrote,
// before a collective of its own, and when a call leaves. tandem's own buffers are used by one of the two in turn,
// ordered by those events, except the two kinds the user's stream uses too: the gradient slots (ordered by
// slot_events_) and the gather buffers (pslot_ready_ after a gather, pslot_free_ after the user's reads). On
// HostBackend events are empty and calls are no-ops; StreamHostBackend runs all of it for real on worker threads
// (backend/host_stream.hpp), which is where the suite tests this protocol.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tandem/backend/host.hpp"
#include "tandem/comm/communicator.hpp"
#include "tandem/core/checkpoint.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/hash.hpp"
#include "tandem/core/plan.hpp"
#include "tandem/core/tensor.hpp"
#include "tandem/front/detail/agreement.hpp"
#include "tandem/front/detail/bucket_kernels.hpp"
#include "tandem/front/detail/checkpoint_io.hpp"
#include "tandem/front/detail/gather_slots.hpp"
#include "tandem/front/detail/slot_pool.hpp"
#include "tandem/front/detail/step_control.hpp"
#include "tandem/front/detail/training_state.hpp"
#include "tandem/front/detail/validation.hpp"
#include "tandem/front/options.hpp"
#include "tandem/kernels/optimizer.hpp"
#include "tandem/kernels/pack.hpp"
#include "tandem/kernels/sum_squares.hpp"
#include "tandem/kernels/vector.hpp"
#include "tandem/policy/policy.hpp"

namespace tandem {

/// Whether this rank has another micro-batch to train on, for DataParallel::all_ranks_have_batch.
enum class Batch {
  available,  ///< this rank will call step() once more
  exhausted   ///< this rank's data is used up
};

/// What one call of step() did (or, from DataParallel::last_step(), the latest optimizer step).
struct StepResult {
  bool updated = false;    ///< the optimizer ran (this call ended an accumulation window)
  bool skipped = false;    ///< the window ended with non-finite gradients and NonFinite::skip_step dropped it
  std::uint64_t step = 0;  ///< optimizer steps taken so far
  double grad_norm = std::numeric_limits<double>::quiet_NaN();  ///< global norm before clipping, when clipping or
                                                                ///< checking for non-finite gradients
  float clip_coefficient = 1.0f;                                ///< the factor the gradients were scaled by
  /// StepReport::deferred: this call ended an accumulation window whose outcome only the device knows yet; the fields
  /// above are not set, and DataParallel::last_step() reports it.
  bool pending = false;
};

class LocalComm;  // <tandem/comm/local_group.hpp>: include it to use the default communicator (the umbrella does)

template <Policy P, Optimizer Opt, class Backend = HostBackend, Communicator Comm = LocalComm>
class DataParallel {
  static_assert(P::state == StateSharding::replicated || Opt::elementwise,
                "sharded policies need an optimizer whose state is elementwise, so that it can be split by shard");
  static_assert(state_follows_reduction<P>,
                "a policy that reduce-scatters every micro-step keeps only its shard of the reduced gradients, so it "
                "must shard the optimizer state too (StateSharding::sharded)");
  static_assert(parameters_follow_state<P>,
                "a policy that shards the parameters updates only its shard, so it must shard the optimizer state "
                "(StateSharding::sharded) and reduce-scatter every micro-step (GradientReduction::every_micro_step)");
  /// The parameters live in shards between uses (ParameterSharded): no full parameter buffer exists. For the API's
  /// compile-time checks only; no step branches on it.
  static constexpr bool shards_params_ = parameter_sharding_of<P> == ParameterSharding::sharded;

 public:
  using OptimizerOptions = typename Opt::Options;

  /// Wraps the user's tensors (copy mode: tandem packs the user's gradients and unpacks the parameters).
  DataParallel(Comm& comm, std::vector<TensorRef> tensors, OptimizerOptions optimizer = {},
               DataParallelOptions options = {}, Backend backend = {})
      : comm_(comm), backend_(std::move(backend)), groups_{optimizer}, options_(options), refs_(std::move(tensors)) {
    static_assert(!shards_params_,
                  "a policy that shards the parameters keeps no full copy of them, so it cannot work on the user's "
                  "buffers: construct DataParallel from TensorSpecs (owned storage) and read each bucket's parameters "
                  "through parameters(b)");
    std::vector<TensorSpec> specs;
    specs.reserve(refs_.size());
    for (const TensorRef& t : refs_) specs.push_back({t.name, t.numel, t.dtype});
    construct(std::move(specs), Storage::user, storage_steps<Storage::user>());
  }

  /// Zero-copy: tandem owns flat parameter and gradient storage; param_view(i) (or parameters(b)) points into it, and
  /// backward writes the gradients through gradients(b). Before the first step(), write initial values through the
  /// views and call broadcast_parameters(), or write them with initialize_parameters (the only way under a policy that
  /// shards the parameters).
  DataParallel(Comm& comm, std::vector<TensorSpec> tensors, OptimizerOptions optimizer = {},
               DataParallelOptions options = {}, Backend backend = {})
      : comm_(comm), backend_(std::move(backend)), groups_{optimizer}, options_(options) {
    construct(std::move(tensors), Storage::owned, storage_steps<Storage::owned>());
  }

  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;
  /// Movable (construct it in a factory, keep it in a container): the buffers, tables and queued work move with it;
  /// the moved-from object may only be destroyed (the calls that act on it throw). Not while a GradientBucket or
  /// ParameterBucket is open: the move throws tandem::error and moves nothing, which is also why the move is not
  /// noexcept (a std::vector that reallocates then loses the elements it had moved: release handles, or reserve, before
  /// growing one). Not assignable (it refers to its communicator).
  DataParallel(DataParallel&&) = default;
  DataParallel& operator=(DataParallel&&) = delete;

  /// The buffers are freed in order on the work stream (cudaFreeAsync on CUDA), after it has waited for everything
  /// issued so far on the user's stream, which may still read the views or the parameters tandem wrote; and the user's
  /// stream waits for the work stream, so that what it does next (free or overwrite the gradients a pack still reads,
  /// say) comes after tandem's queued work.
  ~DataParallel() {
    if (!live_.yes) return;  // moved from: nothing of its own is left
    for (std::size_t b = 0; b < open_.gradients.size(); ++b)
      if (open_.gradients[b])
        std::fprintf(stderr,
                     "tandem: ~DataParallel: bucket %zu's GradientBucket is still open; its views dangle, and the "
                     "handle refuses every use\n",
                     b);
    for (std::size_t b = 0; b < open_.parameters.size(); ++b)
      if (open_.parameters[b])
        std::fprintf(stderr,
                     "tandem: ~DataParallel: bucket %zu's ParameterBucket is still open; its views dangle, and the "
                     "handle refuses every use\n",
                     b);
    if (handles_target_) *handles_target_ = false;
    try {
      const StreamScope scope(*this, Exit::leave);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "tandem: ~DataParallel: the work stream could not wait for the user's stream: %s\n",
                   e.what());
    }
  }

  /// Makes every rank's parameters equal to `root`'s (its buffers, or its views with owned storage) and
  /// re-derives the fp32 master weights from them. Also the way to change parameters between steps: the next update
  /// starts from tandem's copies (the flat copy in copy mode, the master weights of 16-bit parameters), so a value
  /// written into the buffers or views without it is overwritten there.
  TANDEM_COLD void broadcast_parameters(int root = 0) {
    static_assert(!shards_params_,
                  "under a policy that shards the parameters the ranks hold one model between them, so there is "
                  "nothing to broadcast: write the initial values with initialize_parameters(fill, root)");
    check_live("broadcast_parameters");
    if (root < 0 || root >= world_)
      detail::fail("tandem: broadcast_parameters: root " + std::to_string(root) + " is out of range [0, " +
                   std::to_string(world_) + ")");
    broadcast_from(root);
  }

 private:
  /// broadcast_parameters(root), a root in range.
  TANDEM_COLD void broadcast_from(int root) {
    StreamScope scope(*this, Exit::leave);
    for (std::size_t b = 0; b < plan_.num_buckets(); ++b) {
      const Bucket& bucket = plan_.bucket(b);
      if (rank_ == root) (this->*steps_->params_in)(scope, {b, b + 1}, work_stream());
      void* flat = param_bucket(b);
      comm_.broadcast(flat, flat, bucket.size, pdtype_, root, work_stream());  // the scope joined the comm stream
      if (rank_ != root) (this->*steps_->params_out)(scope, {b, b + 1}, work_stream());
    }
    init_masters(scope);
    synced_ = true;
    scope.leave();
  }

 public:
  /// Optional, for overlap: tensor i's gradient for this micro-step is complete on the user's stream (call it from
  /// backward, as each gradient is produced). When every tensor of the next bucket in bucket order is ready, that
  /// bucket's pack is issued on the work stream behind an event on the user's stream, and its collective on the comm
  /// stream behind the pack, so they overlap the rest of backward and the next bucket's pack; step() issues whatever is
  /// left. Buckets go out in bucket order on every rank (a bucket that completes early waits for the ones before it),
  /// so the ranks' collectives always match. On the host backend the bucket's work simply runs now. Calling it for some
  /// tensors, all or none gives the same result. Under ParameterSharded, whose parameters(b) and prefetch_parameters(b)
  /// issue gathers on the same communicator, the ranks' reductions and gathers interleave as their calls do: every rank
  /// must then make the same calls (grad_ready, GradientBucket releases, parameters, prefetch_parameters) in the same
  /// order.
  void grad_ready(std::size_t i) {
    check_stepping("grad_ready");
    if (i >= layout_.size())
      detail::fail("tandem: grad_ready(" + std::to_string(i) + "): index out of range; the layout has " +
                   std::to_string(layout_.size()) + " tensors");
    if (ready_[i] == released_with_bucket)
      detail::fail("tandem: grad_ready(" + std::to_string(i) + ") after bucket " +
                   std::to_string(plan_.placement(i).bucket) + "'s GradientBucket was released in this micro-step (" +
                   layout_.describe(i) +
                   "), which announced its tensors; announce a bucket's tensors through "
                   "gradients(b) or grad_ready, not both");
    if (ready_[i])
      detail::fail("tandem: grad_ready(" + std::to_string(i) + ") called twice in one micro-step (" +
                   layout_.describe(i) + "); call it once per tensor between two step() calls");
    ready_[i] = 1;
    ++bucket_ready_[plan_.placement(i).bucket];
    issue_completed_buckets();
  }

  /// Ends one micro-step: the user's backward has written this micro-batch's gradients. Every accumulation_steps-th
  /// call reduces the accumulated gradients and runs the optimizer. Under StepReport::at_step such an optimizer step
  /// reads its verdict on the host where it has one to read (the norm, more than one rank): it then refuses a capturing
  /// user stream, before it issues anything (docs/cuda.md, "Capturing a step"). So does the first optimizer step that
  /// sums the gradients' norm (clipping, a non-finite check): that sum sizes the backend's scratch.
  StepResult step() {
    check_stepping("step()");
    check_no_open_bucket("step()");
    check_no_open_parameters("step()");
    const bool boundary = micro_ + 1 == options_.accumulation_steps;
    if (boundary && options_.step_report == StepReport::at_step && step_decided())
      refuse_capture("step()", Uncapturable::verdict_read);
    if (boundary && norm_checked() && !norm_summed_) refuse_capture("step()", Uncapturable::first_norm);
    // Entered whether or not grad_ready issued every bucket already: the update below writes the parameters, which
    // the user's stream may still be reading after its last grad_ready. The buckets issued here are packed beside the
    // collectives of those issued before.
    StreamScope scope(*this, Exit::leave, Collectives::beside);
    issue_ready_buckets(scope, true);  // the buckets grad_ready has not issued yet
    std::fill(ready_.begin(), ready_.end(), 0);
    std::fill(bucket_ready_.begin(), bucket_ready_.end(), 0);
    next_bucket_ = 0;
    if (!boundary) {
      ++micro_;
      scope.leave();
      return {.updated = false, .step = step_};
    }

    // Gradients already carry the 1/(N*k) averaging in copy mode and when rounded to a 16-bit reduce dtype (see
    // reduce()); with owned storage in fp32 it is applied here.
    const float average = steps_->averaged || rounded_reduction() ? 1.0f : pack_scale();
    // A failure from here on leaves the window's gradients reduced (a second reduction would add them again): before
    // the step's device work starts, the window must be dropped (broken_); after, the state is no whole training state
    // (damaged_: the step count, or some buckets' parameters, may have moved on).
    const auto failed = [](std::string& why, const char* where, const std::exception& e, const char* then) {
      why = std::string("step() failed ") + where + " (" + e.what() + ")" + then;
    };
    detail::StepChecks checks;
    try {
      join_comm();                    // the reduced gradients, for the norm and the updates
      store_options(Store::changed);  // before the scalar all-reduce copies their lanes
      checks = boundary_scalars(scope, norm_checked(), average);
      if (norm_checked()) norm_summed_ = true;
    } catch (const std::exception& e) {
      failed(broken_, "at the end of the accumulation window, before any update", e, ", with its gradients reduced");
      throw;
    }
    // The device decided (PrepareStepBody), and the updates obey its verdict there. With StepReport::at_step the host
    // reads it back before launching them, to report it (and to launch none for a step that does not update). With
    // one rank and no norm there is nothing to decide: every step updates.
    const bool decided = step_decided();
    std::optional<detail::StepRecord> record;
    try {
      control_.prepare(backend_, groups_.size(), checks, work_stream());
      if (decided && options_.step_report == StepReport::at_step) record = control_.record(backend_, work_stream());
    } catch (const std::exception& e) {
      failed(damaged_, "deciding the optimizer step", e, "; load a checkpoint");
      throw;
    }
    ++windows_;
    StepResult result;
    if (record) {
      // a step that does not update: the next window starts clean, the caller may go on (or load a checkpoint)
      if (record->verdict != detail::StepVerdict::update) drop_window();
      result = report(*record, "step()", Reach::every_rank);  // throws where the verdict says so
      if (!result.updated) {
        scope.leave();
        return result;
      }
    }
    try {
      update_all(scope);
    } catch (const std::exception& e) {
      failed(damaged_, "while updating the parameters", e,
             ", so some buckets may be updated and others not (and the ranks' copies may differ); load a checkpoint");
      throw;
    }
    try {
      drop_window();
    } catch (const std::exception& e) {
      failed(broken_, "clearing the window's gradients after the update", e, "");
      throw;
    }
    if (!decided)
      result = {.updated = true, .step = ++step_};
    else if (options_.step_report == StepReport::deferred)
      result.pending = true;
    scope.leave(options_.parameters_ready == ParametersReady::at_step ? Leave::all : Leave::work);
    return result;
  }

  /// The rule for ranks with unequal numbers of batches: every rank calls step() the same number of times. A rank that
  /// simply stops while the others still step makes them fail at their next collective (LocalGroup: at once; Mpi: at
  /// once through its departure notice, or when the timeout expires); it never hangs. A micro-step that issues none
  /// (inside an accumulation window, without grad_ready) goes on unnoticed until the window's end. To stop together,
  /// call this collective before each micro-step on every rank, saying whether this rank has another batch:
  ///
  ///   using tandem::Batch;
  ///   while (dp.all_ranks_have_batch(it != end ? Batch::available : Batch::exhausted)) { ...; dp.step(); }
  ///
  /// It returns true while every rank has one and false on every rank as soon as any rank has none, so the ranks with
  /// more batches drop their extra ones. Stopping inside an accumulation window leaves that window open: the next
  /// step() (the next epoch's, say) adds the gradients of its micro-steps in, and save_checkpoint refuses until then;
  /// discard_gradients() drops them.
  /// It also checks the rule: if the ranks have taken different numbers of micro-steps so far, every rank throws
  /// tandem::error naming them. Costs one all-gather of two words per rank. Under StepReport::deferred it then reports
  /// the optimizer steps taken so far, as last_step() does, and throws for those refused since the last report.
  /// Refused while the user's stream is capturing (a host wait; a graph would not run it again at each replay).
  bool all_ranks_have_batch(Batch mine) {
    check_live("all_ranks_have_batch");
    refuse_capture("all_ranks_have_batch", Uncapturable::host_wait);
    const std::uint64_t taken =
        windows_ * static_cast<std::uint64_t>(options_.accumulation_steps) + static_cast<std::uint64_t>(micro_);
    // 0: available, 1: exhausted, else not a Batch (every rank learns of it, none is left in the gather)
    const std::uint64_t said = mine == Batch::available ? 0u : mine == Batch::exhausted ? 1u : 2u;
    const std::vector<std::uint64_t> all = all_gather_words({said, taken});
    bool available = true;
    for (int r = 0; r < world_; ++r) {
      const std::uint64_t* w = &all[2 * static_cast<std::size_t>(r)];
      if (w[0] > 1)
        detail::fail("tandem: all_ranks_have_batch: rank " + std::to_string(r) +
                     " passed a value that is not a Batch (available or exhausted)");
      if (w[1] != all[1])
        detail::fail("tandem: all_ranks_have_batch: rank 0 has taken " + std::to_string(all[1]) +
                     " micro-steps but rank " + std::to_string(r) + " has taken " + std::to_string(w[1]) +
                     "; every rank must call step() as many times as the others (call all_ranks_have_batch before "
                     "every micro-step on every rank)");
      if (w[0] != 0) available = false;
    }
    // after the gather: a rank that throws leaves no peer waiting in it
    if (options_.step_report == StepReport::deferred) report_latest("all_ranks_have_batch", Reach::every_rank);
    return available;
  }

  /// Reduces host values (a loss, accuracy counts) across ranks in place: every rank receives the sum over ranks or,
  /// with ReduceOp::avg, their mean, added in rank order under LocalGroup and Mpi. Collective: every rank passes as
  /// many values. It goes through backend memory (NCCL reduces device memory only) and waits for the work stream, so
  /// it is refused while the user's stream is capturing.
  TANDEM_COLD void all_reduce_host(std::span<double> values, ReduceOp op = ReduceOp::sum) {
    check_live("all_reduce_host");
    refuse_capture("all_reduce_host", Uncapturable::host_wait);
    if (values.empty()) return;
    join_comm();  // a collective on the work stream: after those of the comm stream
    Buffer<double> staging = detail::allocate_named<double>(backend_, values.size(), "all_reduce_host's staging");
    detail::stage_host(backend_, staging.data(), values.data(), values.size_bytes());  // on work_stream()
    comm_.all_reduce(staging.data(), staging.data(), values.size(), DType::fp64, op, work_stream());
    backend_.read(values.data(), staging.data(), values.size_bytes(), work_stream());
  }

  /// Saves the whole training state (parameters, fp32 master weights, optimizer state, the optimizer options of every
  /// group and the groups' assignment, step count; and skipped_steps())
  /// as a sharded checkpoint in directory `dir` (created if missing): every rank writes its shard of every bucket to a
  /// safetensors file of its own, in parallel and streamed through a few MiB of host memory, and rank 0 then writes
  /// manifest.json, which makes the set the checkpoint (core/checkpoint_manifest.hpp). A crash before that leaves the
  /// previous checkpoint in `dir` whole; after it, the previous one's files are removed, and those crashed saves left.
  /// `dir` must be one directory that every rank sees (shared storage: rank 0 checks that it finds every rank's file),
  /// and one model's: a checkpoint of other tensors there is not replaced, and a second save into it while one runs
  /// (another job's) is refused on every rank (detail::SaveLock, `dir`/.tandem-save.lock, which stays). Collective;
  /// call it between optimizer steps, not inside an accumulation window. If any rank fails, every rank throws
  /// tandem::error; where the collective after the manifest's rename fails, whether it was written is unknown, and
  /// `dir` holds the new checkpoint or the previous one, whole (verify_checkpoint says which). It refuses, as step()
  /// does, a state that a failed load_checkpoint left partly overwritten and, with owned storage, one whose initial
  /// parameters were never set (broadcast_parameters, initialize_parameters), so that it never replaces a good
  /// checkpoint with one that is not a training state. `metadata`, the program's own records (the options that chose
  /// its data, its data loader's position), is kept with the state, under the checksums that cover it, and
  /// load_checkpoint returns it; every rank must give the same, as the same optimizer options (which must be valid).
  TANDEM_COLD void save_checkpoint(const std::string& dir, const CheckpointMetadata& metadata = {}) {
    check_state_whole("save_checkpoint");  // a half-restored or uninitialized state is no checkpoint
    refuse_capture("save_checkpoint", Uncapturable::host_wait);
    if (micro_ != 0)
      detail::fail("tandem: save_checkpoint inside an accumulation window (micro-step " + std::to_string(micro_) +
                   " of " + std::to_string(options_.accumulation_steps) +
                   "); save after the optimizer step, or drop the window's gradients with discard_gradients() first");
    const StreamScope scope(*this, Exit::stay);  // the parameters as the user's stream left them; tandem only reads
    std::string problem;
    try {
      // the step count the checkpoint records: replays of a captured step advanced the device's count only; steps
      // refused since the last report (StepReport::deferred) fail the save on every rank
      report(control_.record(backend_, work_stream()), "save_checkpoint", Reach::every_rank);
    } catch (const error& e) {
      problem = e.what();
    }
    std::uint64_t given = detail::fnv1a_basis;  // this rank's metadata, which the ranks compare below
    if (problem.empty()) try {
        try {
          check_groups("save_checkpoint");  // the options the checkpoint records, as the next step would take them
        } catch (const error& e) {
          detail::fail(std::string(e.what()) + ". Nothing was saved");
        }
        detail::check_checkpoint_metadata(metadata, "tandem: save_checkpoint: the metadata ");
        for (const auto& [key, value] : metadata)
          for (const std::string* text : {&key, &value}) {
            const std::uint64_t n = text->size();
            given = detail::fnv1a(*text, detail::fnv1a(&n, sizeof n, given));
          }
      } catch (const error& e) {
        problem = e.what();
      }
    // Compared before anything is created: a refused save leaves no trace (not even a new, empty directory).
    const std::vector<std::uint64_t> given_by = all_gather_words({given, optimizer_fingerprint()});
    for (int r = 1; r < world_ && problem.empty(); ++r) {
      const auto at = 2 * static_cast<std::size_t>(r);
      if (given_by[at] != given_by[0])
        problem = "tandem: save_checkpoint: ranks 0 and " + std::to_string(r) +
                  " gave different metadata; every rank must give the same. Nothing was saved";
      else if (given_by[at + 1] != given_by[1])
        problem = "tandem: save_checkpoint: ranks 0 and " + std::to_string(r) +
                  " have different optimizer options (optimizer_options()); every rank must set the same. Nothing "
                  "was saved";
    }
    std::uint64_t id = 0;
    try {
      if (problem.empty()) detail::create_directories_durably(dir);
    } catch (const std::exception& e) {
      problem = detail::problem_of(e, "creating the directory `" + dir + "`");  // (the error names it)
    }
    std::optional<detail::SaveLock> lock;  // rank 0's, from before any rank writes until the clean-up is done
    std::vector<std::string> previous;     // the files of the checkpoint this save replaces (rank 0)
    if (rank_ == 0 && problem.empty()) try {
        lock.emplace(dir, "save_checkpoint");
        previous = detail::check_replaceable(dir, layout_.tensors());
        id = detail::new_save_id();
      } catch (const std::exception& e) {
        problem = detail::problem_of(e, "reading the checkpoint `" + dir + "` this save would replace");
      }
    all_ranks_succeed(problem);
    id = all_gather_words({id})[0];  // rank 0's: the name of this save's files
    SafetensorsSummary mine;
    const std::string file = dir + "/" + detail::shard_file_name(step_, id, rank_, world_);
    // A save that fails after this rank's file was written takes the file with it: no manifest will name it.
    struct Orphan {
      const std::string& file;
      bool kept = false;
      ~Orphan() {
        std::error_code ignored;
        if (!kept) std::filesystem::remove(file, ignored);
      }
    } orphan{file};
    try {
      mine = detail::write_shard<P>(backend_, plan_, layout_, state_, pdtype_, rank_, world_, step_, metadata, file);
    } catch (const std::exception& e) {
      problem = detail::problem_of(e, "writing the checkpoint shard `" + file + "`");
    }
    all_ranks_succeed(problem);
    const std::vector<std::uint64_t> files = all_gather_words({mine.bytes, mine.header_crc});
    if (rank_ == 0) try {
        CheckpointManifest m;
        m.step = step_;
        m.skipped_steps = skipped_;
        m.policy = P::name;
        m.world_size = static_cast<std::uint32_t>(world_);
        m.optimizer = Opt::name;
        m.optimizer_fingerprint = optimizer_fingerprint();
        if constexpr (OptionsNamed<Opt>) {
          for (const OptimizerOptions& group : groups_) m.optimizer_groups.push_back(detail::option_values<Opt>(group));
          if (groups_.size() > 1)
            for (std::size_t group : group_of_) m.optimizer_group_of.push_back(static_cast<std::uint32_t>(group));
        }
        m.state_count = static_cast<std::uint32_t>(state_.state_count());
        m.param_dtype = pdtype_;
        m.bucket_cap_bytes = options_.bucket_cap_bytes;
        m.first_bucket_cap_bytes = options_.first_bucket_cap_bytes;
        m.metadata = metadata;
        m.tensors = layout_.tensors();
        for (int r = 0; r < world_; ++r)
          m.files.push_back({detail::shard_file_name(step_, id, r, world_), files[2 * static_cast<std::size_t>(r)],
                             static_cast<std::uint32_t>(files[2 * static_cast<std::size_t>(r) + 1])});
        detail::commit_manifest(dir, m, &previous);
      } catch (const std::exception& e) {
        problem = detail::problem_of(e, "writing the manifest of the checkpoint `" + dir + "`");
      }
    // The manifest's rename is the commit: from there on the files it names are the checkpoint. Where the collective
    // that tells the ranks whether rank 0 got there fails, every file stays (a stray file, removed by the next save,
    // rather than a committed checkpoint missing a shard); where it says rank 0 failed, none does.
    orphan.kept = rank_ != 0 || problem.empty();
    join_comm();
    if (std::optional<std::string> failed = detail::first_problem(comm_, backend_, problem)) {
      orphan.kept = false;
      throw error(std::move(*failed));
    }
  }

  /// Restores the training state from a checkpoint, at any world size and under any policy: a directory written by
  /// save_checkpoint (each rank reads only the saved slices that overlap its owned range of each array, each checked
  /// against its checksum, and gathers the parameters it keeps beyond that from their owners, as after an optimizer
  /// step; at the saving plan, under a policy that shards the optimizer state, a rank reads its own file only), a
  /// parameters-only one (tandem_checkpoint import: the parameters; master weights derived, optimizer state and step
  /// zero), or a single file of tandem's earlier format. The tensors (names, sizes, dtypes) and the optimizer must
  /// match. The optimizer options become those the checkpoint recorded, with its groups (optimizer_options(g),
  /// set_optimizer_groups), as torch's Optimizer.load_state_dict restores its param_groups' hyperparameters: to go on
  /// with others (another learning rate), change them after the load. A checkpoint that recorded none (parameters-only,
  /// the earlier file format, a save before tandem recorded them, an optimizer that is not OptionsNamed) leaves the
  /// program's. Collective. Every rank reads and checks the manifest (or file) before anything is changed; if any rank
  /// fails there, or the ranks read different checkpoints, every rank throws and nothing changed. Where a save (another
  /// job's: a load takes no lock) commits into the directory while the ranks read it, so that they read two manifests
  /// or a file of the one they read is gone, they read it again, together, up to detail::checkpoint_load_attempts times
  /// in all. A slice that fails its checksum while it is restored makes every rank throw too; the state is then partly
  /// overwritten, and stepping is refused until a load succeeds. The accumulation window starts clean (no gradient of a
  /// half-finished window survives). The restored state is bit for bit the saved one, and the user's parameter buffers
  /// receive it. Returns the metadata save_checkpoint kept with it (none from a parameters-only checkpoint or a single
  /// file).
  TANDEM_COLD CheckpointMetadata load_checkpoint(const std::string& path) {
    check_live("load_checkpoint");  // a moved-from object has no state to restore, nor a collective to take part in
    refuse_capture("load_checkpoint", Uncapturable::host_wait);
    // A save that commits into the directory while the ranks read it (another job's: a load takes no lock) removes the
    // files of the checkpoint it replaces: a rank then cannot open one, or open again one it closed (and on NFS, reads
    // of one that another node removed fail), or the ranks read two manifests. They then read it again, together.
    const auto during = [&](bool saving, int attempt) {
      return saving ? detail::replaced_while_read(path, attempt, "load") : std::string();
    };
    for (int attempt = 1;; ++attempt) {
      const auto hook = [&](detail::LoadPhase phase) {
        if (const auto& h = detail::checkpoint_load_hook()) h(attempt, phase);
      };
      std::string problem;
      std::optional<CheckpointData> single;
      std::optional<detail::ShardedCheckpoint> sharded;
      std::optional<detail::OptimizerGroups<Opt>> saved;  // the optimizer groups the checkpoint recorded
      std::uint64_t step = 0, content = 0;
      bool looked = false;  // this rank looked for the checkpoint (the checks of its own calls passed)
      try {
        check_no_open_bucket("load_checkpoint");
        check_no_open_parameters("load_checkpoint");
        looked = true;
        hook(detail::LoadPhase::reading);
        if (std::filesystem::is_directory(path)) {
          const std::string manifest = detail::manifest_path(path);
          const std::string text = detail::read_text_file(manifest, "the checkpoint manifest");
          content = detail::crc32c(text.data(), text.size());
          CheckpointManifest m = detail::parse_manifest(text, manifest);
          detail::check_manifest(m, path, layout_, Opt::name, state_.state_count(), pdtype_);
          if constexpr (OptionsNamed<Opt>) saved = detail::recorded_groups<Opt>(m, path, state_.state_count());
          step = m.parameters_only ? 0 : m.step;
          sharded.emplace(path, std::move(m), layout_);
          // The files this rank will read, opened and checked now: a missing or damaged one changes nothing.
          detail::restore_sharded<P>(backend_, plan_, layout_, rank_, state_, *sharded, detail::Restore::check);
        } else {
          if (std::filesystem::path(path).filename() == detail::manifest_name)
            detail::fail("tandem: `" + path + "` is the manifest of a sharded checkpoint: load its directory, `" +
                         std::filesystem::path(path).parent_path().string() + "`");
          single = read_checkpoint(path);
          detail::check_checkpoint(*single, path, layout_, Opt::name, state_.state_count(), pdtype_);
          step = single->step;
          content = single->content_id;
        }
      } catch (const std::exception& e) {
        problem = detail::problem_of(e, "reading the checkpoint `" + path + "`");
      }
      if (looked) hook(detail::LoadPhase::read);
      // Every rank must restore the same state: the same checkpoint's contents (or a copy of them), hence the same
      // step.
      const std::vector<std::uint64_t> read = all_gather_words({problem.empty() ? 0u : 1u, step, content});
      int differs = 0;  // the first rank that read other contents than rank 0
      bool failed = false;
      for (int r = 0; r < world_; ++r) {
        const auto at = 3 * static_cast<std::size_t>(r);
        failed = failed || read[at] != 0;
        if (differs == 0 && (read[at + 1] != read[1] || read[at + 2] != read[2])) differs = r;
      }
      if (failed || differs != 0) {
        const bool saving = replaced_since_read(path, looked, content);
        if (saving && attempt < detail::checkpoint_load_attempts) continue;
        if (!problem.empty()) problem += during(saving, attempt);
        all_ranks_succeed(problem);
        const std::uint64_t other = read[3 * static_cast<std::size_t>(differs) + 1];
        detail::fail("tandem: load_checkpoint: ranks 0 and " + std::to_string(differs) +
                     " read different checkpoints (" +
                     (other == read[1] ? "both of step " + std::to_string(other)
                                       : "steps " + std::to_string(read[1]) + " and " + std::to_string(other)) +
                     "); every rank must load the same one. Nothing was changed" + during(saving, attempt));
      }
      StreamScope scope(*this, Exit::leave);
      if (single) {
        // The copies read `single` as late as when they run on the work stream (the stream-faithful backend's rule),
        // so it must outlive them: the synchronize below.
        detail::restore_checkpoint<P>(backend_, plan_, layout_, rank_, state_, *single);
        backend_.synchronize(work_stream());
      } else {
        hook(detail::LoadPhase::copying);
        try {
          // room for the recorded groups' options, allocated once every rank has read the checkpoint (a graph captured
          // before reads the buffers it was captured with: StepControl keeps them)
          if (saved) control_.reserve_groups(backend_, saved->groups.size());
          detail::restore_sharded<P>(backend_, plan_, layout_, rank_, state_, *sharded, detail::Restore::copy);
        } catch (const std::exception& e) {
          problem = detail::problem_of(e, "reading the checkpoint `" + path + "`");
        }
        const auto damage = [&](const std::string& what) {
          damaged_ = "load_checkpoint failed while restoring (" + what +
                     "), so the state is partly overwritten; load a checkpoint that verifies";
        };
        std::optional<std::string> copy_failed;
        try {
          join_comm();
          copy_failed = detail::first_problem(comm_, backend_, problem);
          if (!copy_failed) {
            // Each rank read its owned range of the parameters: the rest comes from the ranks that own it, as after
            // an optimizer step (a gather where the policy keeps the full parameters and shards their update).
            Ops ops{*this};
            for (std::size_t b = 0; b < plan_.num_buckets(); ++b) P::after_update(ops, b);
            join_comm();  // the gathered parameters, for the unpacks below
          }
        } catch (const std::exception& e) {
          damage(e.what());
          throw;
        }
        if (copy_failed) {  // a whole load of the checkpoint that replaced it overwrites what was restored
          damage(*copy_failed);
          const bool saving = replaced_since_read(path, true, content);
          if (saving && attempt < detail::checkpoint_load_attempts) continue;
          throw error(*copy_failed + during(saving, attempt));
        }
        if (sharded->manifest().parameters_only) {  // parameters only: the optimizer starts afresh
          init_masters(scope);
          for (std::size_t k = 0; k < state_.state_count(); ++k)
            backend_.zero(state_.state(k), state_.held().state * sizeof(float), work_stream());
        }
      }
      step_ = step;
      skipped_ = sharded && !sharded->manifest().parameters_only ? sharded->manifest().skipped_steps : 0;
      windows_ = step;
      control_.set_step(backend_, step, skipped_, work_stream());
      reported_ = reported_together_ = control_.record(backend_, work_stream());  // refusals before the load: dropped
      reset_window();
      gathered_.forget();
      synced_ = true;
      damaged_.clear();
      if (saved) apply_groups(scope, std::move(saved->groups), std::move(saved->group_of), "load_checkpoint");
      for (const Range& run : param_runs_.runs) (this->*steps_->params_out)(scope, run, work_stream());
      scope.leave();
      return sharded && !sharded->manifest().parameters_only ? sharded->manifest().metadata : CheckpointMetadata{};
    }
  }

  /// Drops the gradients of the current accumulation window (every micro-step since the last optimizer step, and any
  /// bucket half written) and starts a clean window; parameters, optimizer state and the step count are unchanged.
  /// This is how to go on after a failure inside a micro-step (a GradientBucket destroyed by an exception, say). It
  /// issues no collective: call it on every rank at the same point, or the ranks' micro-steps no longer match
  /// (all_ranks_have_batch reports it).
  void discard_gradients() {
    check_live("discard_gradients");
    check_no_open_bucket("discard_gradients");
    const StreamScope scope(*this, Exit::leave);  // the user's stream may still write gradients tandem now zeroes
    reset_window();
  }

  /// Bytes this rank holds for training, by category (see MemoryReport), counted from the actual allocations.
  /// estimate_memory (front/estimate.hpp), given pack_table_layout_of<Backend>(), gives the same figures without
  /// constructing anything.
  TANDEM_COLD MemoryReport memory_report() const {
    check_live("memory_report()");
    MemoryReport r = memory_of(state_.held(), buffer_inputs(), layout_.total_numel(), state_.state_count());
    r.pack_tables = param_tables_.bytes() + grad_tables_.bytes();
    return r;
  }

  /// Owned storage only: tensor i's parameters, a view into tandem's parameter buckets. T must be the
  /// parameter dtype's type (float, BFloat16 or Float16).
  template <class T>
  T* param_view(std::size_t i) const {
    static_assert(!shards_params_,
                  "param_view needs a policy that keeps every parameter on every rank; under a policy that shards "
                  "them (ParameterSharded) read each bucket's parameters through parameters(b)");
    check_view(i, "param_view");
    if (dtype_of<T> != pdtype_)
      detail::fail(std::string("tandem: param_view<") + dtype_name(dtype_of<T>) + ">(" + std::to_string(i) +
                   "): the parameters are " + dtype_name(pdtype_));
    return reinterpret_cast<T*>(state_.param_flat()) + flat_index(i);
  }

  /// Owned storage only, under a policy that keeps full gradients (Replicated, OptimizerSharded): tensor i's
  /// gradients, an fp32 view into tandem's gradient buckets (fp32 whatever the parameter dtype), valid for the
  /// DataParallel's life. Backward adds into it; tandem zeroes it once the gradients are consumed. Under every
  /// policy, gradients(b) gives the same views bucket by bucket.
  float* grad_view(std::size_t i) const {
    static_assert(P::reduction == GradientReduction::at_boundary,
                  "grad_view needs a policy that keeps full-size gradients across the step; under a policy that "
                  "reduces every micro-step (GradientSharded) write each bucket's gradients through gradients(b)");
    check_view(i, "grad_view");
    return state_.grad_flat() + flat_index(i);
  }

  class GradientBucket;

  /// Owned storage: opens bucket b's gradients for this micro-step's backward. The returned handle's grad(i) are the
  /// fp32 gradient views of the bucket's tensors (zero at the first micro-step of a window; backward adds into
  /// them); they are valid until the handle is released. Releasing it (its destructor, or release()) announces
  /// every tensor of the bucket as grad_ready, so its reduction can start while backward goes on. Under
  /// GradientSharded the views point into one of DataParallelOptions::gradient_buffers reused bucket buffers: the
  /// user's stream first waits until tandem has finished with that buffer's previous bucket, and opening more
  /// buckets than there are buffers (counting released buckets not yet reduced, which go out in bucket order) throws.
  /// Buckets never opened in a micro-step contribute zero gradients.
  [[nodiscard]] GradientBucket gradients(std::size_t b) {
    check_stepping("gradients(b)");
    check_bucket_call(b, "gradients");
    if (open_.gradients[b])
      detail::fail("tandem: gradients(" + std::to_string(b) + "): the bucket is already open in this micro-step");
    if (b < next_bucket_ || bucket_ready_[b] == plan_.bucket(b).tensors.size())
      detail::fail("tandem: gradients(" + std::to_string(b) +
                   "): the bucket's gradients are already complete in this micro-step (released, or every tensor "
                   "announced by grad_ready); open each bucket at most once per micro-step");
    if (state_.grad_flat() == nullptr) {  // the bucket's gradients live in a reused slot while it is open
      refuse_capture("gradients(b)", Uncapturable::reused_buffers);
      const std::size_t slot = slots_.acquire(b, next_bucket_);
      try {
        backend_.wait(options_.stream, slot_events_[slot]);  // backward writes after tandem zeroed the buffer
      } catch (...) {
        slots_.release(b);
        throw;
      }
    }
    open_.gradients[b] = 1;
    return GradientBucket(*this, b);
  }

  class ParameterBucket;

  /// Owned storage: bucket b's parameters for a forward or backward pass. The handle's param<T>(i) are read-only views
  /// of the bucket's tensors as the last optimizer step left them, valid until it is released (release(), or its
  /// destructor); the user's stream waits for them. Under a policy that keeps every parameter (Replicated,
  /// OptimizerSharded, GradientSharded) they point into the parameter buckets and the handle costs nothing, so one
  /// training loop serves every policy. Under ParameterSharded the call all-gathers the bucket into one of
  /// DataParallelOptions::parameter_buffers reused buffers (unless a prefetch_parameters(b) or an earlier handle left
  /// it there since the last step) and throws if every buffer is held. Collective under ParameterSharded: every rank
  /// opens and prefetches the same buckets in the same order.
  [[nodiscard]] ParameterBucket parameters(std::size_t b) {
    check_stepping("parameters(b)");
    check_bucket_call(b, "parameters");
    if (open_.parameters[b])
      detail::fail("tandem: parameters(" + std::to_string(b) + "): the bucket's ParameterBucket is already open");
    if (gathered_.slots() != 0) refuse_capture("parameters(b)", Uncapturable::reused_buffers);
    wait_pending_parameters(b);  // ParametersReady::by_bucket: the last step's work on b
    Ops ops{*this};
    const void* params = P::open_parameters(ops, b);
    open_.parameters[b] = 1;
    return ParameterBucket(*this, b, params);
  }

  /// Under ParametersReady::by_bucket: the user's stream waits until bucket b's parameters are as the last optimizer
  /// step left them (its update, and its gather and unpack into the user's buffers or the parameter bucket), and no
  /// longer; call it before the pass reads bucket b (parameters(b) does). step() made the user's stream wait for the
  /// updates of every bucket, and it issues the gathers from the last bucket (the first layers) to bucket 0, so a
  /// forward in layout order waits for each bucket's just before it reads it. Under at_step step() made the user's
  /// stream wait for every bucket already, and this adds nothing. Costs no host wait. Either storage mode.
  void wait_parameters(std::size_t b) {
    check_live("wait_parameters(b)");
    if (b >= plan_.num_buckets())
      detail::fail("tandem: wait_parameters(" + std::to_string(b) + "): bucket out of range; the plan has " +
                   std::to_string(plan_.num_buckets()) + " buckets");
    wait_pending_parameters(b);
  }

  /// Under ParameterSharded: starts gathering bucket b's parameters now, on the comm stream, so that the gather
  /// overlaps the pass's work on other buckets; the later parameters(b) finds them. The buffer stays reserved for b
  /// until then (a bucket still gathered from an earlier use is only reserved). Does nothing under a policy that
  /// keeps every parameter. Collective.
  void prefetch_parameters(std::size_t b) {
    check_stepping("prefetch_parameters(b)");
    check_bucket_call(b, "prefetch_parameters");
    if (gathered_.slots() == 0) return;  // the policy keeps every parameter: nothing is gathered for use
    refuse_capture("prefetch_parameters(b)", Uncapturable::reused_buffers);
    std::size_t slot = gathered_.find(b);
    if (slot == detail::GatherSlots::none) slot = gather_into_slot(b);
    if (!gathered_.held(slot)) gathered_.prefetched(slot);  // reserved until opened, even if it was gathered before
  }

  /// Owned storage: writes the initial parameters on `root` and gives them to every rank, bucket by bucket, then
  /// derives the fp32 master weights. For each tensor i, in bucket order, `fill(i, values)` is called on rank `root`
  /// only with a pointer to tensor i's numel elements of T (the parameter dtype's type) in backend memory, holding its
  /// current parameters (zero before any were set; under every policy); the values there once it returns (written with
  /// host stores on the host backend, or by work ordered on options().stream) become tensor i's parameters on every
  /// rank. Under ParameterSharded this is the only way to set them, and it never holds more than one bucket; under the
  /// other policies it writes the views and calls broadcast_parameters(root). Collective. Call it before the first
  /// step(); optimizer state and the step count are left as they are. If `fill` throws on the root, every rank throws
  /// tandem::error saying so, and stepping is refused until a call succeeds. Refused while the user's stream is
  /// capturing: the ranks learn of the fill's outcome by a host wait.
  template <class T, class Fill>
  TANDEM_COLD void initialize_parameters(Fill&& fill, int root = 0) {
    check_live("initialize_parameters");
    require_owned("initialize_parameters");
    refuse_capture("initialize_parameters", Uncapturable::host_wait);
    if (dtype_of<T> != pdtype_)
      detail::fail(std::string("tandem: initialize_parameters<") + dtype_name(dtype_of<T>) + ">: the parameters are " +
                   dtype_name(pdtype_));
    if (root < 0 || root >= world_)
      detail::fail("tandem: initialize_parameters: root " + std::to_string(root) + " is out of range [0, " +
                   std::to_string(world_) + ")");
    check_no_open_parameters("initialize_parameters");
    // The root's fill of buckets [first, end), and what it threw: every rank learns of it before any rank goes on to
    // the broadcast, so that a throwing fill never leaves the others waiting there.
    auto fill_on_root = [&](std::size_t first, std::size_t end, auto&& at) {
      std::string problem;
      if (rank_ == root) try {
          for (std::size_t b = first; b < end; ++b)
            for (std::size_t i : plan_.bucket(b).tensors) fill(i, at(i));
        } catch (const std::exception& e) {
          problem = std::string("tandem: initialize_parameters: fill threw on rank ") + std::to_string(root) + ": " +
                    e.what();
        } catch (...) {  // not a std::exception: the other ranks must learn of it all the same
          problem = "tandem: initialize_parameters: fill threw on rank " + std::to_string(root) +
                    " (an exception not derived from std::exception)";
        }
      all_ranks_succeed(problem);
    };
    synced_ = false;                       // until every bucket is written
    if (state_.param_flat() != nullptr) {  // every rank keeps every parameter: fill the root's, then broadcast
      {
        const StreamScope scope(*this, Exit::leave);  // the user's stream writes after tandem's last use of the views
      }
      fill_on_root(0, plan_.num_buckets(),
                   [&](std::size_t i) { return reinterpret_cast<T*>(state_.param_flat()) + flat_index(i); });
      broadcast_from(root);
    } else {  // the parameters live in shards: one bucket at a time through a gather buffer
      StreamScope scope(*this, Exit::leave);
      gathered_.forget();
      unsigned char* slot = state_.gather_buffer(0);  // the first gather buffer, bucket after bucket
      for (std::size_t b = 0; b < plan_.num_buckets(); ++b) {
        const Bucket& bucket = plan_.bucket(b);
        backend_.wait(work_stream(), pslot_free_[0]);  // the user's last reads of the buffer, and its last fill
        // the current parameters, as the other policies' views show them: a fill may leave some, or read them
        comm_.all_gather(owned_params(b), slot, bucket.shard_size, pdtype_, work_stream());
        backend_.record(pslot_ready_[0], work_stream());
        if (rank_ == root) backend_.wait(options_.stream, pslot_ready_[0]);
        fill_on_root(b, b + 1, [&](std::size_t i) { return reinterpret_cast<T*>(slot) + plan_.placement(i).offset; });
        backend_.record(pslot_free_[0], options_.stream);
        backend_.wait(work_stream(), pslot_free_[0]);
        comm_.broadcast(slot, slot, bucket.size, pdtype_, root, work_stream());
        backend_.copy(state_.param_shard() + bucket.shard_offset * psize_,
                      slot + static_cast<std::size_t>(rank_) * bucket.shard_size * psize_, bucket.shard_size * psize_,
                      work_stream());
      }
      init_masters(scope);
      synced_ = true;
      scope.leave();
    }
  }

  const Plan& plan() const { return plan_; }
  const Layout& layout() const { return layout_; }
  int rank() const { return rank_; }
  int world_size() const { return world_; }
  /// Optimizer steps taken, as last reported: by step() (StepReport::at_step), or by last_step(),
  /// all_ranks_have_batch() or save_checkpoint(), which read the device's count. Replays of a step captured in a CUDA
  /// graph advance the device's count only (docs/cuda.md, "Capturing a step").
  std::uint64_t step_count() const { return step_; }
  /// Optimizer steps dropped for non-finite gradients under NonFinite::skip_step, as last reported (see step_count()).
  /// A load sets it to the checkpoint's count (0 from a checkpoint that records none), from which skip_step counts on;
  /// under the other NonFinite modes it stays at that.
  std::uint64_t skipped_steps() const { return skipped_; }

  /// The latest optimizer step's outcome (updated or skipped, the step count, the norm and the clip coefficient): what
  /// step() returned for it under StepReport::at_step, and the way to learn it under StepReport::deferred. It reads
  /// the device's record after everything the user's stream and tandem's work stream hold so far (a host wait, which
  /// includes replays of a captured step), and step_count() and skipped_steps() follow it. Throws tandem::error for the
  /// optimizer steps refused since this rank's last report (NonFinite::throw_error, optimizer options that differ
  /// between ranks, replays of a step captured before the optimizer groups changed). Not collective: every rank's
  /// device made the same verdicts, so the ranks that ask throw alike, but only they do; all_ranks_have_batch() and
  /// save_checkpoint() throw on every rank for the refusals they have not reported together, whichever ranks called
  /// last_step() since. Before the first optimizer step, and after a load, `updated` and `skipped` are false. Refused
  /// while the user's stream is capturing (a host wait), as save_checkpoint, load_checkpoint, all_ranks_have_batch(),
  /// all_reduce_host and initialize_parameters are.
  StepResult last_step() {
    check_live("last_step()");
    refuse_capture("last_step()", Uncapturable::host_wait);
    return report_latest("last_step()", Reach::rank);
  }
  int micro_step() const { return micro_; }
  /// The number of buckets, for gradients(b); plan().bucket(b).tensors lists bucket b's tensors.
  std::size_t num_buckets() const { return plan_.num_buckets(); }

  /// What both bucket handles share: the DataParallel and bucket they refer to, and the checks of every use.
  class BucketHandle {
   public:
    BucketHandle(BucketHandle&& o) noexcept
        : dp_(std::exchange(o.dp_, nullptr)),
          target_(std::move(o.target_)),
          bucket_(o.bucket_),
          kind_(o.kind_),
          exceptions_(o.exceptions_) {}
    BucketHandle& operator=(BucketHandle&&) = delete;

    std::size_t bucket() const { return bucket_; }
    /// Layout indices of the bucket's tensors (reverse layout order).
    const std::vector<std::size_t>& tensors() const { return dp().plan_.bucket(bucket_).tensors; }

   protected:
    BucketHandle(DataParallel& dp, std::size_t b, const char* kind)
        : dp_(&dp), target_(dp.handles_target_), bucket_(b), kind_(kind), exceptions_(std::uncaught_exceptions()) {}
    ~BucketHandle() = default;

    /// The DataParallel, or an error saying why the handle cannot be used.
    DataParallel& dp() const {
      if (dp_ == nullptr)
        detail::fail(std::string("tandem: ") + kind_ + " used after release() (or after being moved from)");
      if (!*target_)
        detail::fail(std::string("tandem: ") + kind_ + " of bucket " + std::to_string(bucket_) +
                     " used after its DataParallel was destroyed; release every handle first");
      return *dp_;  // live: a DataParallel with a handle open refuses to move (OpenHandles)
    }
    /// Tensor i's offset in the bucket, or an error naming `call` if i is not one of its tensors.
    std::size_t offset_of(std::size_t i, const char* call) const {
      const DataParallel& d = dp();
      if (i >= d.layout_.size() || d.plan_.placement(i).bucket != bucket_)
        detail::fail(std::string("tandem: ") + kind_ + "::" + call + "(" + std::to_string(i) + "): " +
                     (i < d.layout_.size()
                          ? d.layout_.describe(i) + " is in bucket " + std::to_string(d.plan_.placement(i).bucket)
                          : std::string("the index is out of range")) +
                     ", not in this handle's bucket " + std::to_string(bucket_));
      return d.plan_.placement(i).offset;
    }
    /// The destructor's release: whether there is anything to do (nothing where the DataParallel is gone).
    bool releasing() const { return dp_ != nullptr && *target_; }
    bool unwinding() const { return std::uncaught_exceptions() > exceptions_; }
    /// Ends the handle, returning its DataParallel for the release.
    DataParallel& take() {
      DataParallel& d = dp();
      dp_ = nullptr;
      return d;
    }
    void log_failed_release(const std::exception& e) const {
      std::fprintf(stderr, "tandem: releasing bucket %zu's %s failed: %s\n", bucket_, kind_, e.what());
    }

    DataParallel* dp_;
    std::shared_ptr<const bool> target_;  ///< whether *dp_ still exists (DataParallel::handles_target_)
    std::size_t bucket_;
    const char* kind_;
    int exceptions_;
  };

  /// Bucket b's gradient views for one micro-step's backward, from gradients(b). Move-only. Releasing it (release(),
  /// or its destructor) announces the bucket's tensors as grad_ready; the views are then no longer the user's to
  /// write. Destroyed by an exception, it announces nothing, and the DataParallel refuses to go on with the
  /// micro-step (its gradients are incomplete) until discard_gradients() or load_checkpoint.
  class GradientBucket : public BucketHandle {
   public:
    GradientBucket(GradientBucket&&) noexcept = default;
    ~GradientBucket() {
      if (!this->releasing()) return;
      if (this->unwinding()) {
        this->take().abandon_bucket(this->bucket_);
        return;
      }
      try {
        release();
      } catch (const std::exception& e) {
        this->log_failed_release(e);
      }
    }

    /// Tensor i's fp32 gradients (i is a layout index of a tensor in this bucket).
    float* grad(std::size_t i) const {
      const std::size_t at = this->offset_of(i, "grad");
      return this->dp().bucket_grads(this->bucket_) + at;
    }

    /// Announces the bucket's tensors as grad_ready now (throws what issuing its reduction throws).
    void release() { this->take().release_bucket(this->bucket_); }

   private:
    friend class DataParallel;
    GradientBucket(DataParallel& dp, std::size_t b) : BucketHandle(dp, b, "GradientBucket") {}
  };

  /// Bucket b's parameters for one pass, from parameters(b): read-only views, valid until the handle is released
  /// (release(), or its destructor; also when an exception destroys it, since reading changes nothing). Move-only.
  class ParameterBucket : public BucketHandle {
   public:
    ParameterBucket(ParameterBucket&&) noexcept = default;
    ~ParameterBucket() {
      if (!this->releasing()) return;
      try {
        release();
      } catch (const std::exception& e) {
        this->log_failed_release(e);
      }
    }

    /// Tensor i's parameters (i is a layout index of a tensor in this bucket; T the parameter dtype's type).
    template <class T>
    const T* param(std::size_t i) const {
      const std::size_t at = this->offset_of(i, "param");
      const DataParallel& d = this->dp();
      if (dtype_of<T> != d.pdtype_)
        detail::fail(std::string("tandem: ParameterBucket::param<") + dtype_name(dtype_of<T>) + ">(" +
                     std::to_string(i) + "): the parameters are " + dtype_name(d.pdtype_));
      return static_cast<const T*>(params_) + at;
    }

    /// Gives the views back now: the gather buffer may take another bucket once the user's stream is past this point.
    void release() { this->take().release_params(this->bucket_); }

   private:
    friend class DataParallel;
    ParameterBucket(DataParallel& dp, std::size_t b, const void* params)
        : BucketHandle(dp, b, "ParameterBucket"), params_(params) {}
    const void* params_;  ///< the bucket's full parameters (the policy's open_parameters)
  };

  /// The optimizer's options (of group 0: every tensor's, unless set_optimizer_groups says otherwise); change them
  /// between steps (a learning-rate schedule, say). The reference stays valid until set_optimizer_groups, or a
  /// load_checkpoint of a checkpoint with another number of groups, replaces the groups.
  OptimizerOptions& optimizer_options() { return optimizer_options(0); }

  /// Group g's optimizer options (set_optimizer_groups); change them between steps as optimizer_options(). Throws
  /// tandem::error for a group that does not exist.
  OptimizerOptions& optimizer_options(std::size_t group) {
    check_live("optimizer_options()");
    if (group >= groups_.size())
      detail::fail("tandem: optimizer_options(" + std::to_string(group) + "): there are " +
                   std::to_string(groups_.size()) + " optimizer groups (set_optimizer_groups)");
    return groups_[group];
  }
  std::size_t optimizer_group_count() const { return groups_.size(); }
  /// The optimizer group of tensor `tensor` (layout order; set_optimizer_groups). Throws tandem::error for a tensor
  /// that does not exist.
  std::size_t optimizer_group(std::size_t tensor) const {
    check_live("optimizer_group()");
    if (tensor >= layout_.size())
      detail::fail("tandem: optimizer_group(" + std::to_string(tensor) + "): the layout has " +
                   std::to_string(layout_.size()) + " tensors");
    return group_in(group_of_, tensor);
  }

  /// Makes the optimizer options as they are now (every group's) those the next update uses, in the order of the
  /// user's stream. step() does it itself whenever they changed since; a step replayed from a captured graph runs no
  /// host code, so between replays change them and call this: a learning-rate schedule over replays (docs/cuda.md,
  /// "Capturing a step"). Validates them as step() does. Local: no collective, no host wait.
  void store_optimizer_options() {
    check_live("store_optimizer_options()");
    check_groups("store_optimizer_options()");
    StreamScope scope(*this, Exit::leave);
    store_options(Store::always);
    scope.leave();
  }

  /// Per-tensor optimizer options, as torch's parameter groups: tensor i is updated with groups[group_of[i]] (no
  /// weight decay for biases and norms, say). groups[0] replaces optimizer_options(). A collective call, on every rank
  /// with the same groups and assignment, between steps (it applies from the next update, also inside an
  /// accumulation window); the state buffers are those of construction, so no group may need more (construct with
  /// the most demanding options). Throws tandem::error on every rank if any rank's arguments are wrong or the ranks
  /// disagree; the groups are then unchanged. It stores the options for the updates, as store_optimizer_options(). A
  /// new count or assignment changes a step's launches: a step captured before updates nothing when replayed, and the
  /// next report throws; capture it again (docs/cuda.md). Refused while the user's stream is capturing.
  ///
  ///   auto no_decay = dp.optimizer_options();
  ///   no_decay.weight_decay = 0;
  ///   std::vector<std::size_t> group(dp.layout().size(), 0);
  ///   for (std::size_t i = 0; i < group.size(); ++i) if (dp.layout()[i].name.ends_with(".bias")) group[i] = 1;
  ///   dp.set_optimizer_groups({dp.optimizer_options(), no_decay}, group);
  TANDEM_COLD void set_optimizer_groups(std::vector<OptimizerOptions> groups, std::vector<std::size_t> group_of) {
    check_live("set_optimizer_groups");
    refuse_capture("set_optimizer_groups", Uncapturable::regroup);
    std::string problem;
    try {
      if (groups.empty()) detail::fail("tandem: set_optimizer_groups: no groups; give at least one");
      if (group_of.size() != layout_.size())
        detail::fail("tandem: set_optimizer_groups: " + std::to_string(group_of.size()) + " group indices for " +
                     std::to_string(layout_.size()) + " tensors; give one per tensor, in layout order");
      for (std::size_t i = 0; i < group_of.size(); ++i)
        if (group_of[i] >= groups.size())
          detail::fail("tandem: set_optimizer_groups: " + layout_.describe(i) + " is in group " +
                       std::to_string(group_of[i]) + " of " + std::to_string(groups.size()));
      for (std::size_t g = 0; g < groups.size(); ++g) check_group(groups[g], g, groups.size(), "set_optimizer_groups");
      control_.reserve_groups(backend_, groups.size());  // room for the groups' scalars; every rank learns a failure
    } catch (const std::exception& e) {
      problem = e.what();
    }
    all_ranks_succeed(problem);
    const std::vector<std::uint64_t> all = all_gather_words({detail::groups_fingerprint<Opt>(groups, group_of)});
    for (int r = 0; r < world_; ++r)
      if (all[static_cast<std::size_t>(r)] != all[0])
        detail::fail("tandem: set_optimizer_groups: ranks 0 and " + std::to_string(r) +
                     " passed different groups or assignments; every rank must pass the same");
    StreamScope scope(*this, Exit::leave);
    apply_groups(scope, std::move(groups), std::move(group_of), "set_optimizer_groups");
    scope.leave();
  }
  const DataParallelOptions& options() const { return options_; }

 private:
  // ---- streams and buckets in flight ----------------------------------------------------------------------

  /// tandem's work stream (the backend's).
  Stream work_stream() const { return backend_.stream(); }
  /// tandem's comm stream (the backend's): the buckets' collectives and the bucket work that follows each.
  Stream comm_stream() const { return backend_.comm_stream(); }

  /// Later work on the comm stream waits for everything issued so far on the work stream (a bucket's packs or update,
  /// and anything earlier); returns the comm stream.
  Stream after_work() {
    backend_.record(to_comm_, work_stream());
    backend_.wait(comm_stream(), to_comm_);
    comm_pending_ = true;
    return comm_stream();
  }
  /// Later work on the work stream waits for everything issued so far on the comm stream (nothing to wait for where
  /// nothing was issued there since the last join). So the communicator's collectives, on either stream, run in the
  /// order they are issued: each stream issues one only after waiting for the other. With `user_too` the user's stream
  /// waits for the comm stream too (a call leaving: a capture's fork to the comm stream rejoins the capturing stream).
  ///
  /// The comm stream first waits for the work stream (a no-op for the order): in a capture that began after the comm
  /// stream's last work, the event the work stream waits for is then recorded in the capture, as CUDA requires.
  void join_comm(bool user_too = false) {
    if (!comm_pending_) return;
    after_work();
    backend_.record(from_comm_, comm_stream());
    backend_.wait(work_stream(), from_comm_);
    if (user_too) {
      backend_.wait(options_.stream, from_comm_);
      std::fill(params_pending_.begin(), params_pending_.end(), 0);  // the user's stream waited for every bucket
    }
    comm_pending_ = false;
  }
  /// ParametersReady::by_bucket: the user's stream waits for bucket b's gather and unpack in the last step, once (an
  /// event wait only while one is pending: none after a call that made the user's stream wait for the comm stream, so
  /// an eager call never waits for an event last recorded in a capture, nor a captured one for an eager record).
  void wait_pending_parameters(std::size_t b) {
    if (!params_pending_[b]) return;
    backend_.wait(options_.stream, params_ready_[b]);
    params_pending_[b] = 0;
  }

  /// How a call's hold on the user's buffers ends.
  enum class Exit {
    leave,  ///< the user's stream waits for the work stream (and the comm stream) when the call ends
    stay    ///< it does not (grad_ready: the rest of backward must not wait for tandem; save_checkpoint only reads)
  };
  /// What the user's stream waits for when a call leaves.
  enum class Leave {
    all,  ///< the work stream and the comm stream
    work  ///< the work stream only: the comm stream's gathers and unpacks by bucket (ParametersReady::by_bucket)
  };
  /// How a call's work on the work stream is ordered against the collectives issued before it.
  enum class Collectives {
    after,  ///< it comes after them (the work stream joins the comm stream on entry)
    beside  ///< it may run beside them (the calls that issue buckets: grad_ready, a bucket's release, step())
  };

  /// One public call's scope on the streams, an RAII pair so that neither half can be missed. On entry, later work
  /// on the work stream waits for everything issued so far on the user's stream (the gradients, and the parameters
  /// or views as the user left them) and, unless Collectives::beside, on the comm stream. On leaving (Exit::leave),
  /// later work on the user's stream waits for everything issued so far on the work stream and the comm stream: the
  /// user may then read the parameters and overwrite the gradients. It leaves in its destructor too when the call
  /// throws. Every function that issues work touching the user's buffers takes the scope as its first argument, so
  /// that such work cannot be issued outside one.
  class StreamScope {
   public:
    StreamScope(DataParallel& dp, Exit exit, Collectives order = Collectives::after) : dp_(dp), exit_(exit) {
      dp_.backend_.record(dp_.user_event_, dp_.options_.stream);
      dp_.backend_.wait(dp_.work_stream(), dp_.user_event_);
      if (order == Collectives::after) dp_.join_comm();
    }
    StreamScope(const StreamScope&) = delete;
    StreamScope& operator=(const StreamScope&) = delete;
    /// Leaves now (Exit::leave), reporting what the streams report; the destructor then does nothing.
    void leave(Leave what = Leave::all) {
      if (std::exchange(exit_, Exit::stay) == Exit::leave) leave_now(what);
    }
    ~StreamScope() {
      if (exit_ != Exit::leave) return;
      try {
        leave_now(Leave::all);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "tandem: leaving a failed call, the streams reported: %s\n", e.what());
      }
    }

   private:
    void leave_now(Leave what) {
      if (what == Leave::all) dp_.join_comm(true);
      dp_.backend_.record(dp_.work_event_, dp_.work_stream());
      dp_.backend_.wait(dp_.options_.stream, dp_.work_event_);
    }
    DataParallel& dp_;
    Exit exit_;
  };

  /// Why a call refuses a capturing user stream.
  enum class Uncapturable {
    host_wait,       ///< it waits on the host for the streams' work (the step's record, the state it saves or restores)
    reused_buffers,  ///< owned storage under a sharded policy: a pass waits on tandem's reused buffers
    regroup,         ///< set_optimizer_groups: the change is made on the stream, in the steps' order
    verdict_read,    ///< step() under StepReport::at_step reads its verdict on the host
    first_norm,      ///< step()'s first sum of the gradients' norm: it sizes the backend's scratch
  };

  /// Throws, naming `call` and `why`, where the user's stream is capturing; each call that refuses a capture checks
  /// before it issues anything, so that the capture stays as it was and can end, and on its own rank, before any
  /// agreement between the ranks: a step captured before leaves tandem's streams joined to the capture until it ends,
  /// so the agreement's wait would fail there (and under either StepReport). A CUDA graph can hold neither a host
  /// wait (CUDA refuses it and ends the capture) nor a wait on an event recorded before the capture
  /// (cudaErrorStreamCaptureIsolation), which a pass on owned storage under GradientSharded or ParameterSharded makes
  /// on tandem's reused buffers (and ParameterSharded's gathers would run once, at capture time).
  void refuse_capture(const char* call, Uncapturable why) const {
    if (!backend_.capturing(options_.stream)) return;
    std::string reason;
    switch (why) {
      case Uncapturable::host_wait:
        reason =
            "it waits on the host for the streams' work, which a captured graph cannot hold; call it between "
            "captures (docs/cuda.md, \"Capturing a step\")";
        break;
      case Uncapturable::reused_buffers:
        reason = std::string("under ") + P::name +
                 " with owned storage a pass waits on tandem's reused buffers across the capture's boundary, which a "
                 "CUDA graph cannot hold; capture steps with user storage, or under Replicated or OptimizerSharded "
                 "(docs/cuda.md)";
        break;
      case Uncapturable::regroup:
        reason =
            "the change is made on the stream, in the steps' order; call it between captures, and capture the "
            "step again after it";
        break;
      case Uncapturable::verdict_read:
        reason =
            "under StepReport::at_step this optimizer step reads its verdict on the host (for the gradient norm, "
            "the non-finite check or the ranks' options check), which a captured graph cannot hold; capture it "
            "under StepReport::deferred (docs/cuda.md, \"Capturing a step\")";
        break;
      case Uncapturable::first_norm:
        reason =
            "this is the first optimizer step to sum the gradients' norm (for clipping or the non-finite check), "
            "which sizes the backend's scratch for it, an allocation a captured graph would own; run one optimizer "
            "step eagerly before the capture (docs/cuda.md, \"Capturing a step\")";
        break;
    }
    detail::fail(std::string("tandem: ") + call + " while the user's stream is capturing: " + reason);
  }

  void check_stepping(const char* what) const {
    check_state_whole(what);
    if (!broken_.empty())
      detail::fail(std::string("tandem: ") + what + ": " + broken_ +
                   "; discard_gradients() (on every rank) or load_checkpoint starts a clean window");
    check_groups(what);
  }

  /// A moved-from object may only be destroyed: every call that steps, communicates, or reads or writes the training
  /// state refuses it here, before touching anything (a collective from it would pair with the live object's).
  void check_live(const char* what) const {
    if (!live_.yes) detail::fail(std::string("tandem: ") + what + " on a DataParallel that has been moved from");
  }

  /// That the parameters and the optimizer state are a whole training state: not moved from, not partly overwritten
  /// by a failed load or a failed step's update, and initialized on every rank.
  void check_state_whole(const char* what) const {
    check_live(what);
    if (!damaged_.empty()) detail::fail(std::string("tandem: ") + what + ": " + damaged_);
    if (!synced_)
      detail::fail(std::string("tandem: ") + what +
                   (state_.param_flat() == nullptr
                        ? " before initialize_parameters(): with sharded parameters, write the initial "
                          "parameters with initialize_parameters(fill) first"
                        : " before broadcast_parameters(): with owned storage, write the initial "
                          "parameters through the views and call broadcast_parameters() first (or use "
                          "initialize_parameters(fill))"));
  }

  void check_no_open_bucket(const char* what) const {
    for (std::size_t b = 0; b < plan_.num_buckets(); ++b)
      if (open_.gradients[b])
        detail::fail(std::string("tandem: ") + what + " while bucket " + std::to_string(b) +
                     "'s GradientBucket is still open; release it (let it go out of scope) first");
  }

  /// The parameters are about to change: no pass may still be reading them.
  void check_no_open_parameters(const char* what) const {
    for (std::size_t b = 0; b < open_.parameters.size(); ++b)
      if (open_.parameters[b])
        detail::fail(std::string("tandem: ") + what + " while bucket " + std::to_string(b) +
                     "'s ParameterBucket is still open; release it (let it go out of scope) first");
  }

  /// `call` (a function and how its argument reads, "gradients(b)") needs owned storage.
  void require_owned(const std::string& call) const {
    if (storage_ != Storage::owned)
      detail::fail("tandem: " + call +
                   " is for owned storage (DataParallel built from TensorSpecs); with your own buffers, use them");
  }

  /// gradients(b), parameters(b), prefetch_parameters(b): owned storage and a bucket in range.
  void check_bucket_call(std::size_t b, const char* what) const {
    require_owned(std::string(what) + "(b)");
    if (b >= plan_.num_buckets())
      detail::fail(std::string("tandem: ") + what + "(" + std::to_string(b) + "): bucket out of range; the plan has " +
                   std::to_string(plan_.num_buckets()) + " buckets");
  }

  /// param_view(i), grad_view(i): owned storage and a tensor in range.
  void check_view(std::size_t i, const char* what) const {
    check_live(what);
    require_owned(what);
    if (i >= layout_.size())
      detail::fail(std::string("tandem: ") + what + "(" + std::to_string(i) + "): index out of range; the layout has " +
                   std::to_string(layout_.size()) + " tensors");
  }

  // ---- the operations the policy's phase hooks call (policy/phases.hpp) -------------------------------------

  /// What a policy's hooks act through (the contract is detail::ArchetypeBucketOps).
  struct Ops {
    DataParallel& dp;
    bool window_ends() const { return dp.micro_ + 1 == dp.options_.accumulation_steps; }
    void accumulate(std::size_t b) { (dp.*dp.steps_->accumulate)(b); }
    void reduce(std::size_t b) { dp.reduce_local(b); }
    void reduce_into_shard(std::size_t b) { dp.reduce_into_shard(b); }
    void gather(std::size_t b) {  // on the comm stream, after the update (or the load) that wrote the owned range
      dp.after_work();
      P::gather_parameters(dp.comm_, dp.view(b, nullptr));
    }
    const void* parameters(std::size_t b) { return dp.param_bucket(b); }
    const void* gather_for_use(std::size_t b) { return dp.gather_for_use(b); }
  };

  /// The 1/(N*k) that averages a micro-step's gradients over the ranks and the window.
  float pack_scale() const {
    return 1.0f / (static_cast<float>(world_) * static_cast<float>(options_.accumulation_steps));
  }
  /// Gradients cross ranks rounded to a 16-bit DataParallelOptions::reduce_dtype.
  bool rounded_reduction() const { return options_.reduce_dtype != DType::fp32; }

  /// ReduceAtBoundary: bucket b's full local gradients (grad_flat, where the micro-steps accumulated) reduced by the
  /// policy; a rounded reduction is read back into the owned range, in fp32.
  /// On the comm stream, after the packs.
  void reduce_local(std::size_t b) {
    const Stream s = after_work();
    float* grads = state_.grad_flat() + plan_.bucket(b).offset;
    const void* reduced = reduce(b, grads, s);
    if (rounded_reduction())
      kernels_.land(backend_, reduced, state_.grad_flat() + owned_range(b).begin, owned_range(b).size(),
                    WriteMode::assign, s);
  }

  /// ReduceEveryMicroStep: this micro-step's gradients of bucket b (the storage mode's) reduced by the policy into the
  /// shard accumulator: at the window's first micro-step written there by the collective itself, where the accumulator
  /// has the reduction's dtype and the policy honours BucketView::reduced (no copy after it); otherwise reduced in
  /// place and landed (assigned, or added after the first micro-step). Then they are dropped. All on the comm stream:
  /// copy mode's pack into the shared staging bucket too, so that only the comm stream uses it.
  void reduce_into_shard(std::size_t b) {
    const Stream s = after_work();
    float* grads = (this->*steps_->micro_step_gradients)(b, s);
    if (honours_reduced<P> && micro_ == 0 && state_.grad_shard_dtype() == options_.reduce_dtype) {
      reduce(b, grads, s, owned_grads(b));
    } else {
      const void* reduced = reduce(b, grads, s);
      kernels_.land(backend_, reduced, owned_grads(b), plan_.bucket(b).shard_size,
                    micro_ == 0 ? WriteMode::assign : WriteMode::accumulate, s);
    }
    (this->*steps_->gradients_reduced)(b, grads, s);
  }

  /// Reduces bucket b's fp32 gradients as the policy says, in DataParallelOptions::reduce_dtype: in fp32, or rounded
  /// into the reduce buffer and reduced there (grads keep their values). Rounded, they are averaged first (owned
  /// storage's gradients are sums; copy mode's pack averaged already), so that the sum fits a 16-bit range N*k times
  /// larger, and both storage modes round the same values. The reduced owned range (in the reduce dtype) goes to
  /// `into` (BucketView::reduced; ReduceEveryMicroStep only), or stays in place; returns where it is.
  const void* reduce(std::size_t b, float* grads, Stream s, void* into = nullptr) {
    const Bucket& bucket = plan_.bucket(b);
    const std::size_t own = owned_range(b).begin - bucket.offset;
    void* wire = grads;
    if (rounded_reduction()) {
      wire = state_.reduce_buffer();
      kernels_.round_for_reduction(backend_, grads, wire, bucket.size, steps_->averaged ? 1.0f : pack_scale(), s);
    }
    BucketView v = view(b, wire, options_.reduce_dtype);
    v.reduced = into;
    P::reduce_gradients(comm_, v);
    return into != nullptr ? into : static_cast<unsigned char*>(wire) + own * dtype_size(options_.reduce_dtype);
  }

  /// GatherBeforeUse: bucket b's parameters gathered into a gather buffer (or found there from an earlier use since
  /// the last step), the user's stream waiting for them; the buffer is held until the ParameterBucket is released.
  const void* gather_for_use(std::size_t b) {
    std::size_t slot = gathered_.find(b);
    if (slot == detail::GatherSlots::none) slot = gather_into_slot(b);
    backend_.wait(options_.stream, pslot_ready_[slot]);  // the pass reads the gathered bucket
    gathered_.open(slot);
    return state_.gather_buffer(slot);
  }

  /// Gathers bucket b into a free gather buffer on the comm stream, after the user's stream is done reading the
  /// buffer's previous bucket; returns the buffer. A gather that fails to issue leaves the ranks' collective sequences
  /// apart, like a failed reduction.
  std::size_t gather_into_slot(std::size_t b) {
    const std::size_t slot = gathered_.assign(b);
    try {
      const Stream s = after_work();  // the shard as the last update left it
      backend_.wait(s, pslot_free_[slot]);
      BucketView v = view(b, nullptr);
      v.param = state_.gather_buffer(slot);
      P::gather_parameters(comm_, v);
      backend_.record(pslot_ready_[slot], s);
    } catch (const std::exception& e) {
      gathered_.drop(slot);
      broken_ = std::string("gathering bucket ") + std::to_string(b) + "'s parameters failed (" + e.what() + ")";
      throw;
    }
    return slot;
  }

  /// ParameterBucket::release: the user's stream records where its reads of a gathered bucket end.
  void release_params(std::size_t b) {
    open_.parameters[b] = 0;
    const std::size_t slot = gathered_.find(b);
    if (slot == detail::GatherSlots::none) return;  // read where the policy keeps it
    gathered_.close(slot);
    backend_.record(pslot_free_[slot], options_.stream);
  }

  // ---- what the storage mode does in a step ----------------------------------------------------------------

  /// The steps of one storage mode, chosen by the constructor taken (the user's buffers, or tandem's storage) and
  /// instantiated for that mode only.
  struct StorageSteps {
    /// The user's parameters into `buckets` (a run of param_runs_, or one of its buckets), and back (copy mode;
    /// nothing where the user's tensors are the views).
    void (DataParallel::*params_in)(const StreamScope&, Range buckets, Stream s);
    void (DataParallel::*params_out)(const StreamScope&, Range buckets, Stream s);
    /// ReduceAtBoundary: this micro-step's gradients of b added into grad_flat.
    void (DataParallel::*accumulate)(std::size_t b);
    /// ReduceEveryMicroStep: this micro-step's gradients of b in an fp32 bucket, and their release once reduced.
    float* (DataParallel::*micro_step_gradients)(std::size_t b, Stream s);
    void (DataParallel::*gradients_reduced)(std::size_t b, float* grads, Stream s);
    /// The window's gradients are consumed: whatever backward adds into next starts from zero.
    void (DataParallel::*clear_gradients)();
    /// Whether the gradients tandem reduces already carry the 1/(N*k) average (copy mode's pack scales them).
    bool averaged;
    /// What construction does for this mode once the buffers exist.
    void (DataParallel::*construct)(const StreamScope&);
  };

  template <Storage S>
  static const StorageSteps& storage_steps() {
    static constexpr StorageSteps steps{&DataParallel::template params_in_as<S>,
                                        &DataParallel::template params_out_as<S>,
                                        &DataParallel::template accumulate_as<S>,
                                        &DataParallel::template micro_step_gradients_as<S>,
                                        &DataParallel::template gradients_reduced_as<S>,
                                        &DataParallel::template clear_gradients_as<S>,
                                        S == Storage::user,
                                        &DataParallel::template construct_as<S>};
    return steps;
  }

  template <Storage S>
  void params_in_as(const StreamScope&, Range buckets, Stream s) {
    if constexpr (S == Storage::user)
      kernels_.pack_params(backend_, param_tables_.view(param_runs_, buckets),
                           param_bucket(param_runs_.of(buckets.begin).begin), hint(buckets, psize_), s);
  }
  template <Storage S>
  void params_out_as(const StreamScope&, Range buckets, Stream s) {
    if constexpr (S == Storage::user)
      kernels_.unpack_params(backend_, param_tables_.view(param_runs_, buckets),
                             param_bucket(param_runs_.of(buckets.begin).begin), hint(buckets, psize_), s);
  }
  /// Packs bucket b's gradients into grad_flat (owned storage: backward added into grad_flat itself). Buckets come in
  /// bucket order from 0 in each micro-step: at the first bucket of a run, the whole run where issue_ready_buckets
  /// issues all of it now (one launch), else that bucket alone; a later bucket of the run was packed with it, or is
  /// packed alone.
  template <Storage S>
  void accumulate_as(std::size_t b) {
    if constexpr (S == Storage::user) {
      const Range& run = grad_runs_.of(b);
      if (b != run.begin && b < packed_end_) return;
      const Range buckets = b == run.begin && run.end <= issuing_end_ ? run : Range{b, b + 1};
      packed_end_ = buckets.end;
      kernels_.pack_grads(backend_, grad_tables_.view(grad_runs_, buckets),
                          state_.grad_flat() + plan_.bucket(run.begin).offset,
                          micro_ == 0 ? WriteMode::assign : WriteMode::accumulate, pack_scale(),
                          hint(buckets, sizeof(float)), work_stream());
    }
  }
  template <Storage S>
  float* micro_step_gradients_as(std::size_t b, Stream s) {
    if constexpr (S == Storage::user) {
      float* staging = state_.staging();  // one bucket at a time: grad_runs_ is a run per bucket
      kernels_.pack_grads(backend_, grad_tables_.view(grad_runs_, {b, b + 1}), staging, WriteMode::assign, pack_scale(),
                          hint({b, b + 1}, sizeof(float)), s);
      for (const Range& gap : staging_gaps_[b])  // the staging buffer is shared: clear what pack skips
        backend_.zero(staging + gap.begin, gap.size() * sizeof(float), s);
      return staging;
    } else {
      if (slots_.slot_of(b) == detail::SlotPool::none) slots_.acquire(b, next_bucket_);  // never opened: zero
      return bucket_grads(b);
    }
  }
  template <Storage S>
  void gradients_reduced_as(std::size_t b, float* grads, Stream s) {
    if constexpr (S == Storage::owned) {  // the slot is zero again, and free for the next bucket
      const std::size_t slot = slots_.slot_of(b);
      backend_.zero(grads, plan_.bucket(b).size * sizeof(float), s);
      backend_.record(slot_events_[slot], s);
      slots_.release(b);
    }
  }
  template <Storage S>
  void clear_gradients_as() {  // copy mode assigns at the window's first micro-step instead
    if constexpr (S == Storage::owned)
      if (state_.grad_flat() != nullptr) backend_.zero(state_.grad_flat(), state_.grad_flat_bytes(), work_stream());
  }
  template <Storage S>
  TANDEM_COLD void construct_as(const StreamScope& scope) {
    if constexpr (S == Storage::user) {  // the user's buffers hold the parameters already
      build_pack_tables();
      for (const Range& run : param_runs_.runs) params_in_as<S>(scope, run, work_stream());
      init_masters(scope);
      synced_ = true;
    }
  }

  // ---- the accumulation window ------------------------------------------------------------------------------

  /// Issues the buckets that grad_ready or a released GradientBucket has completed, if the next one in bucket order is.
  void issue_completed_buckets() {
    if (!next_bucket_complete()) return;
    // The gradients written so far on the user's stream; the rest of backward must not wait for tandem, so the user's
    // stream does not wait here, and the packs go on beside the collectives issued before.
    StreamScope scope(*this, Exit::stay, Collectives::beside);
    issue_ready_buckets(scope, false);
  }

  /// GradientBucket::release: every tensor of bucket b not yet announced is grad_ready.
  void release_bucket(std::size_t b) {
    open_.gradients[b] = 0;
    for (std::size_t i : plan_.bucket(b).tensors)
      if (!ready_[i]) {
        ready_[i] = released_with_bucket;
        ++bucket_ready_[b];
      }
    issue_completed_buckets();
  }

  /// A GradientBucket destroyed by an exception: its gradients may be half written, so this micro-step cannot end
  /// correctly. Nothing is issued; later calls say why they cannot go on until discard_gradients() or load_checkpoint
  /// resets the window.
  void abandon_bucket(std::size_t b) noexcept {
    open_.gradients[b] = 0;
    broken_ = "bucket " + std::to_string(b) +
              "'s GradientBucket was destroyed by an exception during backward, so this micro-step's gradients are "
              "incomplete";
  }

  /// The window's gradients are consumed (or dropped): the next micro-step starts a window, adding into zero.
  void drop_window() {
    (this->*steps_->clear_gradients)();
    micro_ = 0;
  }

  /// Starts a clean accumulation window (load_checkpoint, discard_gradients): no micro-step taken, no bucket announced,
  /// open or holding a gradient slot, and every gradient buffer zero.
  void reset_window() {
    drop_window();
    std::fill(ready_.begin(), ready_.end(), 0);
    std::fill(bucket_ready_.begin(), bucket_ready_.end(), 0);
    next_bucket_ = 0;
    slots_.clear();
    broken_.clear();
    if (state_.grad_slots() != 0) backend_.zero(state_.grad_slots_data(), state_.grad_slots_bytes(), work_stream());
    for (std::size_t k = 0; k < slot_events_.size(); ++k) backend_.record(slot_events_[k], work_stream());
  }

  /// Bucket b's gradients in this micro-step: its part of grad_flat, or the slot it holds.
  float* bucket_grads(std::size_t b) const {
    if (state_.grad_flat() != nullptr) return state_.grad_flat() + plan_.bucket(b).offset;
    return state_.grad_slot(slots_.slot_of(b));
  }

  /// A bucket whose reduction fails to issue leaves the ranks' collective sequences apart: the micro-step is over.
  void issue_ready_buckets(const StreamScope&, bool all) {
    Ops ops{*this};
    for (issuing_end_ = next_bucket_; issuing_end_ < plan_.num_buckets() && (all || bucket_complete(issuing_end_));)
      ++issuing_end_;
    for (; next_bucket_ < issuing_end_; ++next_bucket_) {
      try {
        P::gradients_complete(ops, next_bucket_);
      } catch (const std::exception& e) {
        broken_ = "issuing bucket " + std::to_string(next_bucket_) + "'s reduction failed (" + e.what() + ")";
        throw;
      }
    }
  }

  /// Whether every tensor of the next bucket to issue has been announced by grad_ready.
  bool next_bucket_complete() const { return next_bucket_ < plan_.num_buckets() && bucket_complete(next_bucket_); }
  bool bucket_complete(std::size_t b) const {
    return !open_.gradients[b] && bucket_ready_[b] == plan_.bucket(b).tensors.size();
  }

  /// The agreement's collectives run on the work stream, after the comm stream's.
  std::vector<std::uint64_t> all_gather_words(const std::vector<std::uint64_t>& mine) {
    join_comm();
    return detail::all_gather_words(comm_, backend_, mine);
  }
  void all_ranks_succeed(const std::string& problem) {
    join_comm();
    detail::all_ranks_succeed(comm_, backend_, problem);
  }

  /// Whether a save replaced the checkpoint in `path` since a rank read its manifest (`content`, its CRC-32C; 0: none
  /// was read; `looked`: this rank looked for it): each rank reads the manifest again, after every rank's reads (the
  /// collective before). Collective.
  bool replaced_since_read(const std::string& path, bool looked, std::uint64_t content) {
    const std::vector<std::uint64_t> saw =
        all_gather_words({looked && detail::manifest_replaced(path, content) ? 1u : 0u});
    return std::find(saw.begin(), saw.end(), 1u) != saw.end();
  }

  // ---- construction -------------------------------------------------------------------------------------

  TANDEM_COLD void construct(std::vector<TensorSpec> specs, Storage storage, const StorageSteps& steps) {
    storage_ = storage;
    steps_ = &steps;
    world_ = comm_.size();
    rank_ = comm_.rank();
    if (world_ < 1) detail::fail("tandem: the communicator's size is " + std::to_string(world_) + "; it must be >= 1");
    if (rank_ < 0 || rank_ >= world_)
      detail::fail("tandem: the communicator's rank " + std::to_string(rank_) + " is out of range [0, " +
                   std::to_string(world_) + ")");
    std::string problem;
    try {
      detail::validate(options_);
      detail::check_same_device(comm_, backend_);
      Opt::validate(groups_[0]);
      layout_ = Layout(std::move(specs));
      detail::validate_one_dtype(layout_);
      detail::validate_checkpoint_names(layout_, Opt::state_count(groups_[0]));
      if (storage_ == Storage::user) detail::validate_user_buffers(layout_, refs_);
    } catch (const std::exception& e) {
      problem = e.what();
    } catch (...) {
      problem = "tandem: an unknown exception was thrown while validating the arguments";
    }
    all_ranks_succeed(problem);
    detail::agree_on_configuration(
        comm_, backend_,
        detail::configuration_of(layout_, P::name, detail::fnv1a(Opt::name) ^ Opt::fingerprint(groups_[0]), options_,
                                 storage_, world_));
    StreamScope scope(*this, Exit::leave);  // the user's buffers as written on the user's stream

    pdtype_ = layout_[0].dtype;
    psize_ = dtype_size(pdtype_);
    plan_ = detail::plan_for(layout_, options_, world_);
    ready_.assign(layout_.size(), 0);
    bucket_ready_.assign(plan_.num_buckets(), 0);
    try {  // a rank that cannot allocate says so on every rank, so that none waits for it in a collective
      detail::validate_checkpoint_names(plan_, layout_, Opt::state_count(groups_[0]), rank_);
      allocate();
      plan_runs();
      segments_ = segments_of(group_of_);
      (this->*steps_->construct)(scope);
    } catch (const std::exception& e) {
      problem = e.what();
    }
    all_ranks_succeed(problem);
    scope.leave();
  }

  BufferInputs buffer_inputs() const { return detail::buffer_inputs(plan_, pdtype_, storage_, options_); }

  /// Allocates the buffers the policy's rule and the front ask for (buffers_for<P>), types the kernels for them, and
  /// makes the bookkeeping of the reused buffers.
  TANDEM_COLD void allocate() {
    state_ = detail::TrainingState<Backend>(backend_, buffers_for<P>(buffer_inputs()), pdtype_, options_.reduce_dtype,
                                            Opt::state_count(groups_[0]), work_stream());
    state_.step_scalars(backend_, step_scalars_size());  // here, where every rank agrees on its allocations
    control_ = Control(backend_, groups_.size(), step_, work_stream());
    kernels_ = detail::BucketKernels<Opt, Backend>::make(pdtype_, options_.reduce_dtype, state_.grad_shard_dtype());
    gathered_ = detail::GatherSlots(state_.gather_buffers());
    for (std::size_t k = 0; k < state_.gather_buffers(); ++k) {
      pslot_ready_.push_back(backend_.make_event());
      pslot_free_.push_back(backend_.make_event());
    }
    open_.parameters.assign(plan_.num_buckets(), 0);
    slots_ = detail::SlotPool(state_.grad_slots(), plan_.num_buckets());
    for (std::size_t k = 0; k < state_.grad_slots(); ++k) slot_events_.push_back(backend_.make_event());
    open_.gradients.assign(plan_.num_buckets(), 0);
    for (std::size_t b = 0; b < plan_.num_buckets(); ++b) params_ready_.push_back(backend_.make_event());
    params_pending_.assign(plan_.num_buckets(), 0);
  }

  /// The runs of buckets that one launch packs or unpacks where a step issues the run together (kernels/pack.hpp,
  /// RunGrouping); copy mode only, a run per bucket with owned storage (nothing is packed). Gradients are packed in
  /// bucket order, into grad_flat: in runs growing from bucket 0 (at one rank, with no collective to start early, in
  /// one run); a staging bucket holds one bucket at a time. The parameters are unpacked from the last bucket down, in
  /// runs growing from it, each after the update of its buckets: the next forward can start on the first layers
  /// (ParametersReady::by_bucket), and a run's unpack runs beside the updates of the buckets before it (with one run
  /// after every update, a step of GPT-2-124M at one rank took 2% longer on an H200, docs/cuda.md).
  TANDEM_COLD void plan_runs() {
    const std::size_t n = plan_.num_buckets();
    const bool copy = storage_ == Storage::user;
    grad_runs_ = BucketRuns(n, !copy || state_.staging() != nullptr ? RunGrouping::per_bucket
                               : world_ == 1                        ? RunGrouping::one
                                                                    : RunGrouping::from_first);
    param_runs_ = BucketRuns(n, copy ? RunGrouping::from_last : RunGrouping::per_bucket);
  }

  TANDEM_COLD void build_pack_tables() {
    std::vector<void*> params, grads;
    for (const TensorRef& t : refs_) {
      params.push_back(t.param);
      grads.push_back(t.grad);
    }
    const std::size_t n = plan_.num_buckets();
    std::vector<PackTable> param_tables, grad_tables;  // a table per run (plan_runs)
    const std::size_t chunk = pack_table_layout_of<Backend>().chunk_elements;
    for (const Range& run : param_runs_.runs) param_tables.push_back(make_pack_table(plan_, run, params, chunk));
    for (const Range& run : grad_runs_.runs) grad_tables.push_back(make_pack_table(plan_, run, grads, chunk));
    // Built once, kept in backend memory: a step launches with three pointers per run and copies nothing.
    param_tables_ = ResidentPackTables<Backend>(backend_, param_tables, work_stream());
    grad_tables_ = ResidentPackTables<Backend>(backend_, grad_tables, work_stream());
    if (state_.staging() == nullptr) return;
    staging_gaps_.resize(n);  // bucket elements no tensor covers: alignment gaps, padding
    for (std::size_t b = 0; b < n; ++b) {
      std::size_t at = 0;
      for (const PackTensor& t : grad_tables[b].tensors) {  // a run per bucket
        if (t.offset > at) staging_gaps_[b].push_back({at, t.offset});
        at = std::max(at, t.offset + t.numel);
      }
      if (plan_.bucket(b).size > at) staging_gaps_[b].push_back({at, plan_.bucket(b).size});
    }
  }

  // ---- where things are -----------------------------------------------------------------------------------

  std::size_t flat_index(std::size_t tensor) const { return plan_.flat_offset(tensor); }

  /// Bucket b's part of the full parameter buffer (none under sharded parameters).
  void* param_bucket(std::size_t b) const {
    if (state_.param_flat() == nullptr) return nullptr;
    return state_.param_flat() + plan_.bucket(b).offset * psize_;
  }

  /// The owned flat range of bucket b (the policy's rule), and where it starts in the owned space.
  Range owned_range(std::size_t b) const { return tandem::owned_range<P>(plan_, b, rank_); }
  std::size_t owned_offset(std::size_t b) const { return tandem::owned_offset<P>(plan_, b); }

  /// The parameters of bucket b's owned range (where the update writes): this rank's shard, or in the full buffer.
  void* owned_params(std::size_t b) const {
    if (state_.param_shard() != nullptr) return state_.param_shard() + owned_offset(b) * psize_;
    return state_.param_flat() + owned_range(b).begin * psize_;
  }

  /// The reduced gradients of bucket b's owned range (where the update reads them): the shard accumulator, or the
  /// owned part of the full gradients.
  void* owned_grads(std::size_t b) const {
    if (state_.grad_shard() != nullptr) return state_.grad_shard() + plan_.bucket(b).shard_offset * reduced_size();
    return state_.grad_flat() + owned_range(b).begin;
  }
  /// Bytes per reduced gradient where the update reads them: the shard's dtype, or fp32.
  std::size_t reduced_size() const {
    return state_.grad_shard() != nullptr ? dtype_size(state_.grad_shard_dtype()) : sizeof(float);
  }

  /// Bucket b as the policy's collectives see it. They run on the comm stream: the caller has ordered it after the work
  /// that wrote their inputs (after_work).
  BucketView view(std::size_t b, void* grads, DType grad_dtype = DType::fp32) const {
    const Bucket& bucket = plan_.bucket(b);
    void* param = param_bucket(b);  // under sharded parameters none: a gather names its buffer
    const void* shard =
        state_.param_shard() != nullptr
            ? owned_params(b)
            : static_cast<unsigned char*>(param) + static_cast<std::size_t>(rank_) * bucket.shard_size * psize_;
    return {grads, grad_dtype, param, shard, pdtype_, bucket.size, bucket.shard_size, rank_, comm_stream()};
  }

  StoreHint hint(Range buckets, std::size_t element_bytes) const {
    const Bucket& last = plan_.bucket(buckets.end - 1);
    return store_hint_for((last.offset + last.size - plan_.bucket(buckets.begin).offset) * element_bytes);
  }

  // ---- the optimizer step ---------------------------------------------------------------------------------

  /// Doubles of the optimizer step's scalars: the norm's terms (one per owned shard and bucket), their total, and the
  /// lanes of the options check and of the grouping's (StepControl::step_lanes).
  std::size_t step_scalars_size() const {
    return static_cast<std::size_t>(owned_shards<P>(world_)) * plan_.num_buckets() + 1 + Control::step_lanes_size;
  }

  /// The optimizer step's one scalar all-reduce, in backend memory, and what PrepareStepBody decides from. It carries
  /// the optimizer options' fingerprint (detail::WordAgreement's lanes: options changed through optimizer_options() on
  /// some ranks only are found before anything is updated, at no collective of their own where the norm is reduced
  /// anyway), whether any rank's step is of optimizer groups replaced since (a replay of a step captured before them:
  /// every rank then refuses it) and, when `norm`, the squared global gradient norm: sum over ranks r (in rank order)
  /// of the sum over buckets b (in bucket order) of shard (b, r)'s sum of squares. A rank that owns every shard
  /// (replicated state) computes every term itself in that order; a rank that owns one computes its own, and the
  /// all-reduce adds them in rank order. Either way the norm is bitwise the same under every policy.
  ///
  /// The terms are combined in backend memory in that order (OrderedSumBody) and all-reduced there with the lanes; the
  /// result stays there, for PrepareStepBody. With one rank and no norm nothing runs.
  detail::StepChecks boundary_scalars(const StreamScope&, bool norm, float average) {
    constexpr std::size_t lanes = detail::WordAgreement::lanes;
    const bool check = world_ > 1;
    detail::StepChecks checks{.average = average,
                              .max_grad_norm = options_.max_grad_norm,
                              .world = world_,
                              .skip_non_finite = options_.non_finite != NonFinite::ignore};
    if (!norm && !check) return checks;
    const std::size_t buckets = plan_.num_buckets();
    const auto shards = static_cast<std::size_t>(owned_shards<P>(world_));
    const std::size_t gsize = reduced_size();
    double* terms = state_.step_scalars(backend_, step_scalars_size());  // allocated at construction
    // terms: one per owned shard and bucket, then their total, then the lanes
    double* total = terms + shards * buckets;
    if (norm) {
      for (std::size_t g = 0; g < shards; ++g)
        for (std::size_t b = 0; b < buckets; ++b) {
          const std::size_t n = plan_.bucket(b).shard_size;
          const auto* x = static_cast<const unsigned char*>(owned_grads(b)) + g * n * gsize;
          kernels_.sum_squares(backend_, x, n, terms + g * buckets + b, work_stream());
        }
      backend_.launch(1, OrderedSumBody{terms, shards, buckets, total}, work_stream());
      checks.sum_of_squares = total;
    }
    if (check) {
      // the lanes of the options stored last, in stream order (a captured step checks those stored before each replay),
      // and whether this rank's step is of a grouping replaced since (a replay captured before): any rank's refuses
      // the step on every rank
      control_.step_lanes(backend_, total + 1, work_stream());
      const bool with_total = norm && !owns_every_shard<P>(world_);  // each rank holds its own shards' terms
      double* first = with_total ? total : total + 1;
      comm_.all_reduce(first, first, Control::step_lanes_size + (with_total ? 1 : 0), DType::fp64, ReduceOp::sum,
                       work_stream());
      checks.lanes = total + 1;
      checks.stale = total + 1 + lanes;
    }
    return checks;
  }

  /// When the optimizer options are stored for the updates (StepControl).
  enum class Store { changed, always };

  /// The optimizer options stored for the updates, with their fingerprint's lanes (the options check across ranks; none
  /// at one rank), where they changed since the last store or always.
  void store_options(Store when) {
    const std::array<double, detail::WordAgreement::lanes> mine =
        world_ > 1 ? detail::WordAgreement::encode(optimizer_fingerprint(), world_)
                   : std::array<double, detail::WordAgreement::lanes>{};
    const std::span<const double> lanes(mine.data(), world_ > 1 ? mine.size() : 0);
    if (when == Store::always)
      control_.store_options(backend_, groups_, lanes, work_stream());
    else
      control_.store_changed_options(backend_, groups_, lanes, work_stream());
  }

  /// Whether an optimizer step computes the global norm: for clipping or the non-finite check.
  bool norm_checked() const { return options_.max_grad_norm > 0.0f || options_.non_finite != NonFinite::ignore; }
  /// Whether an optimizer step has a verdict to decide (PrepareStepBody): with the norm, or the ranks' options check.
  bool step_decided() const { return norm_checked() || world_ > 1; }

  /// Who makes a report: the calling rank alone (last_step()), or every rank at the same point (step() under
  /// StepReport::at_step, all_ranks_have_batch(), save_checkpoint()).
  enum class Reach { rank, every_rank };

  /// The host's side of a step's record (StepControl::record): step_count() and skipped_steps() follow it, the
  /// optimizer steps the device refused since the last report of this reach (this rank's, or every rank's together)
  /// throw, and the latest step is returned. Each rank's device made the same verdicts, so the ranks of a report of
  /// every rank throw alike. `what` names the caller in the errors.
  StepResult report(const detail::StepRecord& r, const char* what, Reach reach) {
    const detail::StepRecord& since = reach == Reach::every_rank ? reported_together_ : reported_;
    const std::uint64_t refused = r.refused_steps - since.refused_steps;
    const std::uint64_t non_finite = r.non_finite_steps - since.non_finite_steps;
    const std::uint64_t regrouped = r.regrouped_steps - since.regrouped_steps;
    reported_ = r;
    if (reach == Reach::every_rank) reported_together_ = r;
    step_ = r.step;
    if (options_.non_finite == NonFinite::skip_step) skipped_ = r.non_finite_steps;
    // at_step reports each step as it ends (the refused one is the next count's); deferred, several may be due
    const bool late = options_.step_report == StepReport::deferred;
    auto where = [&](std::uint64_t steps) {
      return late ? std::to_string(steps) +
                        " optimizer step(s) since the last report (StepReport::deferred; the step "
                        "count is now " +
                        std::to_string(r.step) + ")"
                  : "optimizer step " + std::to_string(r.step + 1);
    };
    const std::string dropped = late ? "nothing was updated at them and their windows' gradients were dropped"
                                     : "nothing was updated and the window's gradients were dropped";
    // Every kind of refusal due is named in one message: the report has consumed them all.
    std::string refusals;
    const auto refusal = [&](const std::string& text) { refusals += (refusals.empty() ? "" : "; and ") + text; };
    // (only replays are regrouped: a step that reads cannot be captured, and set_optimizer_groups refuses a capture)
    if (regrouped > 0)
      refusal(std::to_string(regrouped) +
              " replay(s) of a step captured before the optimizer groups changed updated nothing: "
              "set_optimizer_groups or load_checkpoint changed their count or assignment since the capture (on this "
              "rank, or on another, whose stale replay every rank refuses with it), and the captured launches are "
              "those of the groups before (the step count is now " +
              std::to_string(r.step) + "); capture the step again after such a change (docs/cuda.md)");
    if (refused > 0)
      refusal("the ranks' optimizer options differ at " + where(refused) +
              " (changed through optimizer_options() on some ranks only?); " + dropped +
              ": set the same options on every rank, and the next step() trains on");
    if (non_finite > 0 && options_.non_finite == NonFinite::throw_error)
      refusal("non-finite gradients at " + where(non_finite) +
              (late ? std::string() : " (global norm " + std::to_string(r.grad_norm) + ")") + "; " + dropped +
              ", so the next step() starts a clean window (NonFinite::skip_step drops such steps without throwing)");
    if (!refusals.empty()) detail::fail("tandem: " + std::string(what) + ": " + refusals);
    StepResult result{
        .updated = r.verdict == detail::StepVerdict::update,
        .skipped = r.verdict == detail::StepVerdict::non_finite && options_.non_finite == NonFinite::skip_step,
        .step = r.step};
    if (norm_checked() && (result.updated || result.skipped)) {
      result.grad_norm = r.grad_norm;
      result.clip_coefficient = r.clip_coefficient;
    }
    return result;
  }

  /// report() of the latest step's record, read after everything the user's stream and the work stream hold so far.
  StepResult report_latest(const char* what, Reach reach) {
    const StreamScope scope(*this, Exit::stay);
    return report(control_.record(backend_, work_stream()), what, reach);
  }

  /// master = float(param) over the owned ranges (16-bit parameters; fp32 parameters are their own master).
  TANDEM_COLD void init_masters(const StreamScope&) {
    if (state_.master() == nullptr) return;
    for (std::size_t b = 0; b < plan_.num_buckets(); ++b)
      kernels_.masters_from_params(backend_, owned_params(b), state_.master() + owned_offset(b), owned_range(b).size(),
                                   work_stream());
  }

  /// step()'s updates: every bucket's optimizer update, and its parameters out to where the user reads them.
  void update_all(const StreamScope& scope) {
    // Bucket b's gather and unpack on the comm stream, beside the next bucket's update on the work stream; the last
    // bucket (the first layers, which the next forward reads first) first.
    Ops ops{*this};
    // A run of buckets (param_runs_) is unpacked in one launch once all its buckets are updated: at its lowest bucket,
    // which this loop reaches last.
    for (std::size_t b = plan_.num_buckets(); b-- > 0;) {
      update(scope, b);
      P::after_update(ops, b);
      const Range& run = param_runs_.of(b);
      if (b != run.begin) continue;
      const Stream s = after_work();
      (this->*steps_->params_out)(scope, run, s);
      if (options_.parameters_ready == ParametersReady::by_bucket)
        for (std::size_t k = run.begin; k < run.end; ++k) {
          backend_.record(params_ready_[k], s);
          params_pending_[k] = 1;
        }
    }
    gathered_.forget();  // the shards changed: a bucket gathered for use is gathered again at its next use
  }

  /// The optimizer over bucket b's owned range, one launch per segment of one optimizer group, its scalars those
  /// control_.prepare() made.
  void update(const StreamScope&, std::size_t b) {
    const std::size_t gsize = reduced_size();
    auto* params = static_cast<unsigned char*>(owned_params(b));
    const auto* grads = static_cast<const unsigned char*>(owned_grads(b));
    for (const Segment& seg : segments_[b]) {
      detail::UpdateRange r;
      r.param = params + seg.begin * psize_;
      r.master = state_.master() != nullptr ? state_.master() + owned_offset(b) + seg.begin
                                            : reinterpret_cast<float*>(r.param);
      r.grad = grads + seg.begin * gsize;
      for (std::size_t k = 0; k < 2; ++k)
        r.state[k] = state_.state(k) != nullptr ? state_.state(k) + owned_offset(b) + seg.begin : nullptr;
      r.n = seg.end - seg.begin;
      r.grad_scale = control_.grad_scale();
      r.skip = control_.skip();
      kernels_.update(backend_, r, control_.scalars(seg.group), work_stream());
    }
  }

  /// A run of a bucket's owned range whose tensors share an optimizer group.
  struct Segment {
    std::size_t begin, end;  ///< offsets into the owned range
    std::size_t group;
  };

  /// The update's segments under the assignment `group_of` (group_in): each owned range cut where the tensors' group
  /// changes. Alignment gaps and padding (zero parameters, zero gradients) go with the tensor before them, or the first
  /// one.
  TANDEM_COLD std::vector<std::vector<Segment>> segments_of(const std::vector<std::size_t>& group_of) const {
    std::vector<std::vector<Segment>> segments(plan_.num_buckets());
    for (std::size_t b = 0; b < plan_.num_buckets(); ++b) {
      const Range own = owned_range(b);
      std::vector<Segment>& segs = segments[b];
      std::vector<std::size_t> tensors = plan_.bucket(b).tensors;
      std::sort(tensors.begin(), tensors.end(),
                [&](std::size_t x, std::size_t y) { return flat_index(x) < flat_index(y); });
      for (std::size_t t : tensors) {
        const std::size_t begin = std::max(flat_index(t), own.begin);
        const std::size_t end = std::min(flat_index(t) + layout_[t].numel, own.end);
        const std::size_t group = group_in(group_of, t);
        if (begin >= end) continue;
        if (!segs.empty() && segs.back().group == group) continue;  // the previous segment reaches here
        if (!segs.empty()) segs.back().end = begin - own.begin;
        segs.push_back({segs.empty() ? 0 : begin - own.begin, own.size(), group});
      }
      if (segs.empty()) segs.push_back({0, own.size(), 0});  // padding only
    }
    return segments;
  }

  /// The group of tensor t under the assignment `of` (empty: every tensor in group 0).
  static std::size_t group_in(const std::vector<std::size_t>& of, std::size_t t) { return of.empty() ? 0 : of[t]; }

  /// Makes `groups` and `group_of` (checked, and the same on every rank) the optimizer groups (`what` names the
  /// caller), in the order of the user's stream: the updates' segments; where the count or the assignment changed, a
  /// new grouping (StepControl::regroup: replays of a step captured before then update nothing, and the next report
  /// throws; docs/cuda.md, "Capturing a step"); and the options stored for the updates, as store_optimizer_options().
  /// The same count and assignment keep a captured step's launches good. References to the options stay valid where the
  /// count is the same. The host's side changes at once, and nothing of it throws; a launch that throws (a failed
  /// backend) leaves the state damaged, as a failed load does.
  void apply_groups(const StreamScope&, std::vector<OptimizerOptions> groups, std::vector<std::size_t> group_of,
                    const char* what) {
    bool same = groups.size() == groups_.size();
    for (std::size_t t = 0; same && t < layout_.size(); ++t) same = group_in(group_of, t) == group_in(group_of_, t);
    std::vector<std::vector<Segment>> segments = segments_of(group_of);  // (allocates: before anything changes)
    if (groups.size() == groups_.size())
      std::copy(groups.begin(), groups.end(), groups_.begin());
    else
      groups_.swap(groups);
    group_of_.swap(group_of);
    segments_.swap(segments);
    try {
      if (!same) control_.regroup(backend_, work_stream());
      store_options(Store::always);
    } catch (const std::exception& e) {
      damaged_ = std::string(what) + " failed storing the optimizer groups for the updates (" + e.what() +
                 "), so the steps' launches may not match them; load a checkpoint";
      throw;
    }
  }

  /// check_group() of every group's options as they are now (they may have been changed through optimizer_options()).
  void check_groups(const std::string& what) const {
    for (std::size_t g = 0; g < groups_.size(); ++g) check_group(groups_[g], g, groups_.size(), what);
  }

  /// Throws tandem::error, its message naming the caller `what` and, of more than one, the group, if `options` (group g
  /// of `count`) are invalid (Opt::validate) or need more state buffers than were allocated.
  void check_group(const OptimizerOptions& options, std::size_t g, std::size_t count, const std::string& what) const {
    // (the group's name is made only for a message: step() checks every group at every call)
    const auto group = [&](const char* before, const char* after) {
      return count == 1 ? std::string() : before + std::to_string(g) + after;
    };
    try {
      Opt::validate(options);
    } catch (const std::exception& e) {
      detail::fail("tandem: " + what + ": " + detail::reason(e) + group(" (optimizer group ", ")"));
    }
    if (Opt::state_count(options) > state_.state_count())
      detail::fail("tandem: " + what + ": the " + Opt::name + " options" + group(" of optimizer group ", "") +
                   " need " + std::to_string(Opt::state_count(options)) +
                   " state buffers but DataParallel was constructed with " + std::to_string(state_.state_count()) +
                   " (e.g. SGD momentum enabled later); construct with it enabled");
  }

  /// The optimizer options' fingerprint (detail::groups_fingerprint, which checkpoints record).
  std::uint64_t optimizer_fingerprint() const { return detail::groups_fingerprint<Opt>(groups_, group_of_); }

  template <class T>
  using Buffer = typename Backend::template Buffer<T>;
  using Control = detail::StepControl<Opt, Backend>;

  /// Which buckets have a GradientBucket (gradients[b]) or a ParameterBucket (parameters[b]) alive. The first member,
  /// so that moving a DataParallel while a handle is open throws before anything has moved: the handle refers to this
  /// object, and the moved-to one could never see it released.
  struct OpenHandles {
    std::vector<unsigned char> gradients, parameters;
    OpenHandles() = default;
    OpenHandles(OpenHandles&& o) {
      for (const auto& [open, handle] : {std::pair{&o.gradients, "GradientBucket"}, {&o.parameters, "ParameterBucket"}})
        for (std::size_t b = 0; b < open->size(); ++b)
          if ((*open)[b])
            detail::fail("tandem: a DataParallel cannot be moved while bucket " + std::to_string(b) + "'s " + handle +
                         " is open: the handle refers to it. Release the handle first; nothing was moved");
      gradients = std::move(o.gradients);
      parameters = std::move(o.parameters);
    }
    OpenHandles& operator=(OpenHandles&&) = delete;
  } open_;
  Comm& comm_;
  Backend backend_;
  std::vector<OptimizerOptions> groups_;  ///< optimizer options per group; [0] is optimizer_options()
  std::vector<std::size_t> group_of_;     ///< each tensor's group (empty: all in group 0)
  /// Per bucket, its owned range cut where the group changes (offsets into the range); one segment with one group.
  std::vector<std::vector<Segment>> segments_;
  DataParallelOptions options_;
  std::vector<TensorRef> refs_;
  Storage storage_ = Storage::user;
  const StorageSteps* steps_ = nullptr;  ///< the storage mode's steps (storage_steps<S>())
  int world_ = 1;
  int rank_ = 0;
  Layout layout_;
  Plan plan_;
  DType pdtype_ = DType::fp32;
  std::size_t psize_ = 4;
  detail::TrainingState<Backend> state_;
  detail::BucketKernels<Opt, Backend> kernels_;
  Control control_;  ///< the step count and the step's scalars, in backend memory
  ResidentPackTables<Backend> param_tables_, grad_tables_;  ///< copy mode: the user's buffers, a table per run
  BucketRuns param_runs_, grad_runs_;  ///< copy mode: the buckets one launch covers (build_pack_tables)
  std::size_t issuing_end_ = 0;        ///< issue_ready_buckets issues the buckets before this one now
  std::size_t packed_end_ = 0;         ///< the run packed last (accumulate_as) ends before this bucket
  std::vector<std::vector<Range>> staging_gaps_;
  detail::GatherSlots gathered_;                       ///< which bucket each gather buffer holds
  std::vector<typename Backend::Event> pslot_ready_;   ///< recorded when a gather into slot s is done (comm stream)
  std::vector<typename Backend::Event> pslot_free_;    ///< recorded on the user's stream when its reads of slot s end
  detail::SlotPool slots_;                             ///< which gradient slot each bucket holds in this micro-step
  std::vector<typename Backend::Event> slot_events_;   ///< recorded when slot s is zero again (comm stream, or a reset)
  std::vector<typename Backend::Event> params_ready_;  ///< recorded after step()'s gather and unpack of bucket b (comm)
  std::vector<unsigned char> params_pending_;  ///< by_bucket: the user's stream has not waited for params_ready_[b]
  std::string broken_;                         ///< why the current micro-step cannot go on (empty: it can)
  std::string damaged_;  ///< why the state is no whole training state until a load succeeds (empty: it is)
  typename Backend::Event user_event_ = backend_.make_event();
  typename Backend::Event work_event_ = backend_.make_event();
  typename Backend::Event to_comm_ = backend_.make_event();    ///< recorded on the work stream, for the comm stream
  typename Backend::Event from_comm_ = backend_.make_event();  ///< recorded on the comm stream, for the work stream
  bool comm_pending_ = false;  ///< work issued on the comm stream that the work stream has not waited for
  std::vector<unsigned char>
      ready_;  ///< tensor i announced in this micro-step: 1 by grad_ready, or released_with_bucket
  static constexpr unsigned char released_with_bucket = 2;  ///< announced by its GradientBucket's release
  std::vector<std::size_t> bucket_ready_;                   ///< ready tensors per bucket in this micro-step
  std::size_t next_bucket_ = 0;                             ///< buckets [0, next_bucket_) are issued in this micro-step
  int micro_ = 0;
  std::uint64_t step_ = 0;
  std::uint64_t skipped_ = 0;
  std::uint64_t windows_ = 0;             ///< accumulation windows ended (optimizer steps taken, skipped or refused)
  detail::StepRecord reported_;           ///< the record this rank last reported: its tallies were thrown here
  detail::StepRecord reported_together_;  ///< the record every rank last reported together (Reach::every_rank)
  bool synced_ = false;
  bool norm_summed_ = false;  ///< an optimizer step summed the gradients' norm: the backend's scratch has its size
  /// Shared with the open bucket handles: false once this DataParallel is destroyed with one still open, which then
  /// refuses every use and releases nothing (it pointed at freed memory). Moves with the object (a DataParallel with
  /// a handle open refuses to move).
  std::shared_ptr<bool> handles_target_ = std::make_shared<bool>(true);
  /// False once moved from (the defaulted move constructor moves it last, like every member).
  struct Live {
    bool yes = true;
    Live() = default;
    Live(Live&& o) noexcept : yes(std::exchange(o.yes, false)) {}
    Live& operator=(Live&&) = delete;
  } live_;
};

}  // namespace tandem
