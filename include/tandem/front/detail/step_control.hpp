// SPDX-License-Identifier: Apache-2.0
// StepControl: what an optimizer step's update reads besides the arrays, kept in backend memory and made on the work
// stream. The step count lives there and advances there; a step stores the groups' options where they changed since
// the last store (the host keeps a copy of what it last stored: the options the update reads), and PrepareStepBody
// (kernels/optimizer.hpp) decides from the reduced squared norm and the options' agreement whether the step updates,
// and turns the options, the new count and the norm into each group's Scalars and the gradients' factor, which the
// update bodies read by pointer. So the values an update uses and whether it runs follow the stream's order, not the
// host's: the host passes no value that depends on the step to the update's launches (docs/cuda.md, "Step scalars"),
// and reads the step's record to report it.
//
// A step's launches are made for the optimizer groups of that moment (their count, and each tensor's group: the update
// segments, the buffers of the options and scalars). A change of them (regroup) numbers a new grouping, stored in
// stream order, and each prepare launch carries the number it was made for: replays of a step captured before do not
// update (StepVerdict::regrouped) instead of updating with the launches of groups that no longer exist.
//
//   counts       uint64[5]       optimizer steps taken (DataParallel::step_count() mirrors it; replays of a captured
//                                step advance this one only), then the steps skipped for a non-finite norm, those
//                                refused for differing options and those refused as regrouped, so far (the host learns
//                                of them from the record), then the number of the grouping in use
//   grad_scale   fp32            the gradients' factor of the current step: averaging x clip coefficient
//   skip         uint32          1 where the current step's verdict is not to update (the update bodies return)
//   record       StepRecord      the current step's norm, clip coefficient, verdict and step count
//   options[g]   Opt::Options    group g's options, as last stored (by a step, or by store_options)
//   lanes        fp64[4]         their fingerprint's WordAgreement lanes, stored with them (more than one rank), which
//                                each step all-reduces (step_lanes), with a lane that says whether the step's launches
//                                are of the grouping in use: a captured step checks the options stored before each
//                                replay, and every rank refuses a replay that is stale on any rank
//   scalars[g]   Opt::Scalars    group g's per-step scalars of the current step
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "tandem/backend/allocate.hpp"
#include "tandem/core/stream.hpp"
#include "tandem/kernels/optimizer.hpp"
#include "tandem/kernels/sum_squares.hpp"

namespace tandem::detail {

template <class Opt, class Backend>
class StepControl {
  template <class T>
  using Buffer = typename Backend::template Buffer<T>;
  using Options = typename Opt::Options;
  using Scalars = typename Opt::Scalars;
  /// The launch that stores options, 8 at a time. Its sizes are literals: nvcc 13 spells a StoreValuesBody
  /// specialization first written with a named constant as `unsigned long(...)` in its host code, which host compilers
  /// reject.
  using OptionsStore = StoreValuesBody<Options, 8>;
  static constexpr std::size_t options_per_store = OptionsStore::capacity;

 public:
  StepControl() = default;

  /// Room for `groups` optimizer groups, and the step count set to `step` on stream s.
  StepControl(const Backend& backend, std::size_t groups, std::uint64_t step, Stream s)
      : lanes_(allocate_named<double>(backend, WordAgreement::lanes, "the optimizer options' fingerprint lanes")),
        counts_(allocate_named<std::uint64_t>(backend, count_words, "the optimizer step count")),
        grad_scale_(allocate_named<float>(backend, 1, "the optimizer step's gradient factor")),
        skip_(allocate_named<std::uint32_t>(backend, 1, "the optimizer step's skip word")),
        record_(allocate_named<StepRecord>(backend, 1, "the optimizer step's record")) {
    reserve_groups(backend, groups);
    backend.zero(counts_.data(), count_words * sizeof(std::uint64_t), s);  // grouping 0, grouping_'s
    set_step(backend, step, 0, s);
  }

  /// Room for `groups` optimizer groups (set_optimizer_groups, load_checkpoint; nothing is allocated where there is
  /// room already). The buffers it replaces are kept until destruction: a step captured before reads them still.
  void reserve_groups(const Backend& backend, std::size_t groups) {
    if (groups <= options_.size()) return;
    Buffer<Options> options = allocate_named<Options>(backend, groups, "the optimizer groups' options");
    Buffer<Scalars> scalars = allocate_named<Scalars>(backend, groups, "the optimizer groups' step scalars");
    if (options_.size() != 0) {
      retired_options_.reserve(retired_options_.size() + 1);  // (nothing is moved until nothing can throw)
      retired_scalars_.reserve(retired_scalars_.size() + 1);
      retired_options_.push_back(std::move(options_));
      retired_scalars_.push_back(std::move(scalars_));
    }
    options_ = std::move(options);
    scalars_ = std::move(scalars);
    stored_.clear();  // the new buffer holds none: the next step stores them
  }

  /// The step count becomes `step` and the tally of steps skipped for a non-finite norm `non_finite` in stream order
  /// (construction, a checkpoint's load), and the record says that no step was taken since.
  void set_step(const Backend& backend, std::uint64_t step, std::uint64_t non_finite, Stream s) {
    backend.launch(1,
                   SetStepBody{.step = counts_.data(),
                               .tallies = counts_.data() + 1,
                               .record = record_.data(),
                               .count = step,
                               .non_finite = non_finite},
                   s);
  }

  /// The groups' options become those the updates read, and `lanes` (their fingerprint's WordAgreement lanes; empty
  /// at one rank) those the options check all-reduces, in the order of stream s (launches of 8 options each).
  void store_options(const Backend& backend, std::span<const Options> groups, std::span<const double> lanes, Stream s) {
    if (groups.size() > options_.size()) fail("tandem: internal error: more optimizer groups than StepControl holds");
    if (lanes.size() != 0 && lanes.size() != WordAgreement::lanes)
      fail("tandem: internal error: an options fingerprint has 4 lanes");
    for (std::size_t g = 0; g < groups.size(); g += options_per_store) {
      OptionsStore store{.out = options_.data() + g};
      for (; store.count < options_per_store && g + store.count < groups.size(); ++store.count)
        store.values[store.count] = groups[g + store.count];
      backend.launch(1, store, s);
    }
    if (!lanes.empty()) {
      // a literal size, as for OptionsStore
      StoreValuesBody<double, 4> store{.out = lanes_.data(), .count = WordAgreement::lanes};
      static_assert(WordAgreement::lanes == std::size(store.values));
      std::copy(lanes.begin(), lanes.end(), store.values);
      backend.launch(1, store, s);
    }
    stored_.assign(groups.begin(), groups.end());
    stored_lanes_.assign(lanes.begin(), lanes.end());
  }

  /// The optimizer groups' count or assignment changed (DataParallel::set_optimizer_groups, load_checkpoint): a new
  /// grouping, in the order of stream s. Replays of a step prepared before it no longer update.
  void regroup(const Backend& backend, Stream s) {
    // a literal size, as for OptionsStore
    const StoreValuesBody<std::uint64_t, 1> store{
        .out = counts_.data() + grouping_word, .values = {grouping_ + 1}, .count = 1};
    backend.launch(1, store, s);
    ++grouping_;
  }

  /// store_options() where the options or the lanes differ from those last stored (bytewise), as at each optimizer
  /// step: a step whose options did not change launches no store, so, captured, it reads the options (and checks the
  /// lanes) that store_options() last stored before each replay.
  void store_changed_options(const Backend& backend, std::span<const Options> groups, std::span<const double> lanes,
                             Stream s) {
    if (groups.size() != stored_.size() ||
        std::memcmp(groups.data(), stored_.data(), groups.size() * sizeof(Options)) != 0 ||
        !std::equal(lanes.begin(), lanes.end(), stored_lanes_.begin(), stored_lanes_.end()))
      store_options(backend, groups, lanes, s);
  }

  /// One optimizer step's verdict and scalars, on stream s (after store_changed_options): PrepareStepBody decides from
  /// `checks` (the reduced values it names, in backend memory) whether the step updates, and if so advances the step
  /// count and computes each of the `groups` groups' Scalars and the gradients' factor.
  void prepare(const Backend& backend, std::size_t groups, const StepChecks& checks, Stream s) {
    if (groups > stored_.size()) fail("tandem: internal error: a step of optimizer groups never stored");
    backend.launch(1,
                   PrepareStepBody<Opt>{.step = counts_.data(),
                                        .grad_scale = grad_scale_.data(),
                                        .options = options_.data(),
                                        .scalars = scalars_.data(),
                                        .groups = groups,
                                        .checks = checks,
                                        .skip = skip_.data(),
                                        .record = record_.data(),
                                        .tallies = counts_.data() + 1,
                                        .grouping = counts_.data() + grouping_word,
                                        .launched_grouping = grouping_},
                   s);
  }

  /// The lanes a step all-reduces besides the norm (more than one rank; StepLanesBody), written to
  /// out[0, step_lanes_size) on stream s: the options' lanes last stored, and 1 where this step's launches are of a
  /// grouping replaced since, else 0.
  void step_lanes(const Backend& backend, double* out, Stream s) const {
    backend.launch(1,
                   StepLanesBody{.options_lanes = lanes_.data(),
                                 .grouping = counts_.data() + grouping_word,
                                 .launched_grouping = grouping_,
                                 .out = out},
                   s);
  }
  static constexpr std::size_t step_lanes_size = WordAgreement::lanes + 1;

  /// The record of the last step prepared (or of set_step), read back (waits for stream s).
  StepRecord record(const Backend& backend, Stream s) const {
    StepRecord r;
    backend.read(&r, record_.data(), sizeof r, s);
    return r;
  }

  /// Group g's Scalars and the gradients' factor of the step prepare() made (backend memory).
  const Scalars* scalars(std::size_t g) const { return scalars_.data() + g; }
  const float* grad_scale() const { return grad_scale_.data(); }
  /// Nonzero where the step prepare() decided on does not update (backend memory).
  const std::uint32_t* skip() const { return skip_.data(); }

 private:
  static constexpr std::size_t grouping_word = 4;  ///< counts_: the step count, three tallies, the grouping
  static constexpr std::size_t count_words = grouping_word + 1;
  Buffer<double> lanes_;
  Buffer<std::uint64_t> counts_;
  Buffer<float> grad_scale_;
  Buffer<std::uint32_t> skip_;
  Buffer<StepRecord> record_;
  Buffer<Options> options_;
  Buffer<Scalars> scalars_;
  std::vector<Buffer<Options>> retired_options_;  ///< buffers reserve_groups replaced (a captured step's)
  std::vector<Buffer<Scalars>> retired_scalars_;
  std::vector<Options> stored_;       ///< the options last stored into options_, in stream order (host memory)
  std::vector<double> stored_lanes_;  ///< the lanes last stored into lanes_ (none at one rank)
  std::uint64_t grouping_ = 0;        ///< the grouping last stored, in stream order
};

}  // namespace tandem::detail
