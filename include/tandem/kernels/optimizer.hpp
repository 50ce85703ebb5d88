// SPDX-License-Identifier: Apache-2.0
// What every optimizer body shares: the arguments of an update over one flat range (the range of a bucket a
// rank owns), its chunking into work items, and the concept an optimizer type satisfies.
//
// Data layout: element i of the range has an fp32 master weight master[i] (for fp32 parameters this is the
// parameter itself, so param == master), a gradient grad[i] (already reduced over ranks; of type G: fp32, or the
// 16-bit reduce dtype where the reduced shard stays in it; read as float and multiplied by *grad_scale, which
// carries clipping and any deferred averaging) and up to two fp32 state elements state[0][i], state[1][i]. The
// step's scalars (the factor *grad_scale and the optimizer's Scalars) are read from backend memory, where
// PrepareStepBody computes them on the stream: the host passes pointers, never values that depend on the step. The
// updated weight is written to master[i] and, cast, to param[i]. Bodies follow the rounding rule of
// kernels/detail/rounding.hpp, so an update gives the same bits on host and device.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <type_traits>

#include "tandem/core/config.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/core/hash.hpp"
#include "tandem/kernels/detail/host_simd.hpp"
#include "tandem/kernels/detail/rounding.hpp"
#include "tandem/kernels/detail/word_agreement.hpp"
#include "tandem/kernels/vector.hpp"

namespace tandem {

/// Elements per optimizer work item.
inline constexpr std::size_t update_chunk_elements = 1024;

/// Whether SGD uses Nesterov momentum.
enum class Nesterov { off, on };

template <class P, class G = float>
struct UpdateArgs {
  float* master = nullptr;  ///< fp32 weights (== param for fp32 parameters)
  P* param = nullptr;       ///< parameter-dtype copy that is gathered and unpacked
  const G* grad = nullptr;
  float* state[2] = {nullptr, nullptr};
  std::size_t n = 0;
  const float* grad_scale = nullptr;    ///< in backend memory: the factor of every gradient
  const std::uint32_t* skip = nullptr;  ///< in backend memory: nonzero leaves every array as it is (null: never)
};

/// Work items of an update over n elements.
constexpr std::size_t update_items(std::size_t n) { return (n + update_chunk_elements - 1) / update_chunk_elements; }

namespace detail {

/// FNV-1a over the bit patterns of an optimizer's option values: equal options, equal fingerprints.
inline std::uint64_t fingerprint_values(std::initializer_list<float> values) {
  std::uint64_t h = fnv1a_basis;
  for (float v : values) {
    std::uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    for (int k = 0; k < 4; ++k) {  // little-endian byte order on every host
      const auto byte = static_cast<unsigned char>((bits >> (8 * k)) & 0xffu);
      h = fnv1a(&byte, 1, h);
    }
  }
  return h;
}

/// Elements per group of an update: one 16-byte vector of its narrowest array (4 with fp32 parameters and gradients,
/// 8 where either is 16-bit; the fp32 arrays then move two 16-byte vectors per group).
template <class P, class G>
inline constexpr std::size_t update_group_elements = 16 / (sizeof(P) < 4 || sizeof(G) < 4 ? 2 : 4);

/// Updates the elements [first, first + n / Block * Block), Block at a time, and returns how many (update_item): f(g,
/// w, s) on each element's values loaded into registers, then w stored to master[i] and, cast, to param[i] where Own,
/// and s[k] to state k. On the host a block of host_update_block elements, a multiple of every vector width, is a loop
/// of a fixed trip count over restrict-qualified parameters: it needs neither a scalar epilogue nor a runtime alias
/// check, so the compiler vectorizes it at -O2 too (GCC's cost model there, very-cheap, vectorizes no loop that needs
/// either: an update written as one loop over n ran at half the speed of -O3's). The loops and accesses are written
/// here, in the parameters' scope (GCC honours a parameter's restrict, not a local's: around a call, or through a
/// lambda's captures, the loop was not vectorized), and f is taken by value, a copy that no store to the arrays can
/// change (through a reference, its scalars were checked for aliasing). A 16-bit parameter is written after the block's
/// loop, narrowed eight at a time from the master weights just stored (kernels/detail/host_simd.hpp, the scalar
/// conversion's bits). Converted in the loop, as the device does, each BFloat16 went through shuffles, and Float16's
/// conversion, which branches, kept GCC from vectorizing the loop at all: AdamW over 65,536 elements in cache took
/// 1.3x as long with bf16 parameters, 3x with fp16 ones (GCC 12).
template <std::size_t Block, std::size_t States, bool Own, class P, class G, class F>
TANDEM_HD inline std::size_t update_blocks(float* TANDEM_RESTRICT master, P* TANDEM_RESTRICT param,
                                           const G* TANDEM_RESTRICT grad, float* TANDEM_RESTRICT state0,
                                           float* TANDEM_RESTRICT state1, float scale, std::size_t first, std::size_t n,
                                           F f) {
  constexpr std::size_t S = States > 0 ? States : 1;  // arrays of zero length are not C++
#if TANDEM_HOST_SSE2
  constexpr bool narrow_after = Own && Block % 8 == 0 && sizeof(P) == 2 && host_simd_type<P>;
#else
  constexpr bool narrow_after = false;
#endif
  std::size_t done = 0;
  for (; done + Block <= n; done += Block) {
    for (std::size_t i = first + done; i < first + done + Block; ++i) {
      float s[S] = {};
      if constexpr (States > 0) s[0] = state0[i];
      if constexpr (States > 1) s[1] = state1[i];
      float w = master[i];
      f(mul_rn(scale, static_cast<float>(grad[i])), w, s);
      master[i] = w;
      if constexpr (Own && !narrow_after) param[i] = convert<P>(w);
      if constexpr (States > 0) state0[i] = s[0];
      if constexpr (States > 1) state1[i] = s[1];
    }
#if TANDEM_HOST_SSE2
    if constexpr (narrow_after)
      for (std::size_t i = first + done; i < first + done + Block; i += 8) narrow8(widen8(master + i), param + i);
#endif
  }
  return done;
}

/// Elements per block of the host's update loop (update_blocks).
inline constexpr std::size_t host_update_block = 16;

/// Runs the element update `f(g, w, s)` over the elements of work item `item` that lane `lane` of `lanes` owns: g is
/// *grad_scale * grad[i], w the master weight and s[k] state k's value, all in registers; f updates w and s[0 ..
/// States). Then w goes to master[i] and, cast, to param[i] (not written separately for fp32 parameters whose param is
/// the master), and s[k] to state[k][i].
///
/// Shape: the chunk [item * update_chunk_elements, +update_chunk_elements) is cut like a cast segment
/// (kernels/vector.hpp): a scalar head up to the first element at which every array is 16-byte aligned, groups of
/// W = update_group_elements<P, G> elements, a scalar tail (all scalar when the arrays are misaligned by different
/// amounts). A group loads W elements of every array into registers with 16-byte loads, updates them (W independent
/// elements in flight: no element waits for another's stores, which the arrays could alias without __restrict__), and
/// stores them with 16-byte stores. Lane `lane` takes groups lane, lane + lanes, ... (coalesced on CUDA) and the scalar
/// elements congruent to it; the host runs one lane in unit stride (update_blocks), which the compiler vectorizes.
template <std::size_t States, class P, class G, class F>
TANDEM_HD inline void update_item(const UpdateArgs<P, G>& a, std::size_t item, unsigned lane, unsigned lanes, F&& f) {
  static_assert(States <= 2, "an update keeps at most two state arrays");
  if (a.skip != nullptr && *a.skip != 0) return;  // the step's verdict was not to update (PrepareStepBody)
  constexpr std::size_t W = update_group_elements<P, G>;
  constexpr std::size_t S = States > 0 ? States : 1;  // arrays of zero length are not C++
  const std::size_t begin = item * update_chunk_elements;
  const std::size_t n = a.n - begin < update_chunk_elements ? a.n - begin : update_chunk_elements;
  // Distinct arrays (a DataParallel's and every caller's): the restrict qualifiers let the compiler keep all of an
  // element's values in registers. param is only touched where it is not the master.
  const bool own_param = !std::is_same_v<P, float> || static_cast<const void*>(a.param) != a.master;
  float* TANDEM_RESTRICT master = a.master + begin;
  P* TANDEM_RESTRICT param = a.param + begin;
  const G* TANDEM_RESTRICT grad = a.grad + begin;
  float* TANDEM_RESTRICT state0 = States > 0 ? a.state[0] + begin : nullptr;
  float* TANDEM_RESTRICT state1 = States > 1 ? a.state[1] + begin : nullptr;
  const float scale = *a.grad_scale;

  // elements [from, from + count) Block at a time (a whole number of blocks), param written where it is not the master
  auto blocks = [&](auto block, std::size_t from, std::size_t count) {
    constexpr std::size_t Block = decltype(block)::value;
    return own_param ? update_blocks<Block, States, true>(master, param, grad, state0, state1, scale, from, count, f)
                     : update_blocks<Block, States, false>(master, param, grad, state0, state1, scale, from, count, f);
  };
  auto scalar = [&](std::size_t i) { blocks(std::integral_constant<std::size_t, 1>{}, i, 1); };
#if !TANDEM_IN_DEVICE_CODE
  if (lanes == 1) {  // the host: unit stride, in blocks the compiler vectorizes, then the rest one by one
    const std::size_t done = blocks(std::integral_constant<std::size_t, host_update_block>{}, 0, n);
    blocks(std::integral_constant<std::size_t, 1>{}, done, n - done);
    return;
  }
#endif
  auto group = [&](std::size_t at) {
    const Vec<G, W> gv = load_vec<G, W>(grad + at);
    Vec<float, W> w = load_vec<float, W>(master + at);
    Vec<float, W> s0, s1;
    if constexpr (States > 0) s0 = load_vec<float, W>(state0 + at);
    if constexpr (States > 1) s1 = load_vec<float, W>(state1 + at);
    Vec<P, W> p;
    TANDEM_UNROLL
    for (std::size_t k = 0; k < W; ++k) {
      float s[S] = {};
      if constexpr (States > 0) s[0] = s0.v[k];
      if constexpr (States > 1) s[1] = s1.v[k];
      f(mul_rn(scale, static_cast<float>(gv.v[k])), w.v[k], s);
      if constexpr (States > 0) s0.v[k] = s[0];
      if constexpr (States > 1) s1.v[k] = s[1];
      p.v[k] = convert<P>(w.v[k]);
    }
    store_vec<float, W>(master + at, w);
    if (own_param) store_vec<P, W>(param + at, p);
    if constexpr (States > 0) store_vec<float, W>(state0 + at, s0);
    if constexpr (States > 1) store_vec<float, W>(state1 + at, s1);
  };

  // head: the first element at which every array the update touches is 16-byte aligned
  std::size_t head = n;
  for (std::size_t h = 0; h < W && h < n; ++h) {
    std::uintptr_t mis = misalignment16(master + h) | misalignment16(grad + h);
    if (own_param) mis |= misalignment16(param + h);
    if constexpr (States > 0) mis |= misalignment16(state0 + h);
    if constexpr (States > 1) mis |= misalignment16(state1 + h);
    if (mis == 0) {
      head = h;
      break;
    }
  }
  const std::size_t groups = (n - head) / W;
  const std::size_t tail = head + groups * W;
  for (std::size_t i = lane; i < head; i += lanes) scalar(i);
  for (std::size_t g = lane; g < groups; g += lanes) group(head + g * W);
  for (std::size_t i = tail + lane; i < n; i += lanes) scalar(i);
}

/// The global gradient norm from its square's sum over ranks (before the averaging of owned fp32 storage: `average`).
TANDEM_HD inline double grad_norm(double sum_of_squares, float average) {
  return mul_rn(sqrt_rn(sum_of_squares), double{average});
}

/// The factor clipping scales the gradients by (torch.nn.utils.clip_grad_norm_'s rule: max_norm / (norm + 1e-6), at
/// most 1); 1 where the norm is not finite.
TANDEM_HD inline float clip_coefficient(double norm, float max_grad_norm) {
  if (!finite(norm)) return 1.0f;
  const double q = div_rn(double{max_grad_norm}, norm + 1e-6);
  return static_cast<float>(q < 1.0 ? q : 1.0);
}

/// What the device decided at an optimizer step (StepRecord::verdict).
enum class StepVerdict : std::uint32_t {
  update = 0,          ///< the optimizer runs
  options_differ = 1,  ///< the ranks' optimizer options have different fingerprints: nothing is updated
  non_finite = 2,      ///< the global norm is not finite and non-finite gradients skip the update
  none = 3,            ///< no optimizer step since the count was set (SetStepBody)
  regrouped = 4        ///< a replay of a step whose launches are of optimizer groups replaced since: nothing is updated
};

/// What an optimizer step's decision reads: the reduced values in backend memory, and constants of the configuration.
struct StepChecks {
  const double* sum_of_squares = nullptr;  ///< the squared global norm (null: not computed)
  float average = 1.0f;                    ///< the averaging the gradients' factor applies
  float max_grad_norm = 0.0f;              ///< > 0: clip to it
  const double* lanes = nullptr;  ///< WordAgreement's lanes of the options' fingerprint summed over ranks (null: none)
  const double* stale = nullptr;  ///< StepLanesBody's stale lane summed over ranks (null: none)
  int world = 1;                  ///< the ranks the lanes were summed over
  bool skip_non_finite = false;   ///< a non-finite norm skips the update (NonFinite::skip_step and throw_error)
};

/// One optimizer step's outcome, written by PrepareStepBody to backend memory, where the host reads it.
struct StepRecord {
  double grad_norm = 0.0;         ///< the global norm before clipping (0 where not computed)
  float clip_coefficient = 1.0f;  ///< the factor clipping scaled the gradients by
  StepVerdict verdict = StepVerdict::update;
  std::uint64_t step = 0;              ///< optimizer steps taken after this one
  std::uint64_t non_finite_steps = 0;  ///< steps whose verdict was non_finite so far (0 where not counted)
  std::uint64_t refused_steps = 0;     ///< steps whose verdict was options_differ so far (0 where not counted)
  std::uint64_t regrouped_steps = 0;   ///< steps whose verdict was regrouped so far (0 where not counted)
};

/// The lanes an optimizer step all-reduces besides the norm's (more than one rank), written on the stream (one item,
/// lane 0): the optimizer options' fingerprint lanes last stored (WordAgreement), then 1 where this rank's launches are
/// of optimizer groups replaced since (*grouping, the grouping in use, is not launched_grouping, the one they were made
/// for: a replay of a step captured before the groups' count or assignment changed), else 0. Summed over the ranks,
/// the last lane tells every rank whether any rank's step is stale, so that every rank refuses it alike.
struct StepLanesBody {
  const double* options_lanes = nullptr;
  const std::uint64_t* grouping = nullptr;
  std::uint64_t launched_grouping = 0;
  double* out = nullptr;  ///< WordAgreement::lanes + 1 doubles

  TANDEM_HD void operator()(std::size_t, unsigned lane, unsigned) const {
    if (lane != 0) return;
    for (std::size_t k = 0; k < WordAgreement::lanes; ++k) out[k] = options_lanes[k];
    out[WordAgreement::lanes] = *grouping != launched_grouping ? 1.0 : 0.0;
  }
};

/// An optimizer step's decision and scalars, made in backend memory on the stream (one item, lane 0), where the update
/// bodies read them. The verdict: the step's launches must be of the optimizer groups in use on every rank (*grouping,
/// where not null, equal to launched_grouping: the grouping when they were made; a replay of a step captured before the
/// groups' count or assignment changed fails it; and checks.stale, where not null, 0: no rank's failed it), then the
/// options' lanes must agree (WordAgreement), then a non-finite norm skips the update where checks.skip_non_finite;
/// *skip becomes 1 unless the verdict is to update, and the update bodies then leave every array as it is. On an update
/// the step count advances by one, the gradients' factor *grad_scale becomes average times the clip coefficient of the
/// squared norm (1 without clipping), and each group's Scalars come from its options and the new count, by the same
/// operations as on the host (Opt::scalars is host+device code). tallies (if not null) count the steps of each verdict
/// that skips, and *record (if not null) receives the outcome. So what the updates do depends on no value the host
/// read: the host may read the record before it launches them, later, or never (docs/cuda.md, "The one host wait").
template <class Opt>
struct PrepareStepBody {
  std::uint64_t* step = nullptr;
  float* grad_scale = nullptr;
  const typename Opt::Options* options = nullptr;
  typename Opt::Scalars* scalars = nullptr;
  std::size_t groups = 0;
  StepChecks checks{};
  std::uint32_t* skip = nullptr;     ///< null: the caller updates whatever the verdict
  StepRecord* record = nullptr;      ///< null: not written
  std::uint64_t* tallies = nullptr;  ///< [non_finite, options_differ, regrouped steps] so far (null: not counted)
  const std::uint64_t* grouping = nullptr;  ///< the groups in use (null: not checked), as StepControl numbers them
  std::uint64_t launched_grouping = 0;      ///< the groups this launch's step was made for

  TANDEM_HD void operator()(std::size_t, unsigned lane, unsigned) const {
    if (lane != 0) return;
    StepRecord r;
    const double* sum = checks.sum_of_squares;
    if (sum != nullptr) r.grad_norm = grad_norm(*sum, checks.average);
    if ((grouping != nullptr && *grouping != launched_grouping) || (checks.stale != nullptr && *checks.stale != 0.0))
      r.verdict = StepVerdict::regrouped;
    else if (checks.lanes != nullptr && !WordAgreement::agree(checks.lanes, checks.world))
      r.verdict = StepVerdict::options_differ;
    else if (sum != nullptr && checks.skip_non_finite && !finite(r.grad_norm))
      r.verdict = StepVerdict::non_finite;
    if (sum != nullptr && checks.max_grad_norm > 0.0f)
      r.clip_coefficient = clip_coefficient(r.grad_norm, checks.max_grad_norm);
    const bool update = r.verdict == StepVerdict::update;
    r.step = *step + (update ? 1 : 0);
    if (skip != nullptr) *skip = update ? 0u : 1u;
    if (tallies != nullptr) {
      if (r.verdict == StepVerdict::non_finite) ++tallies[0];
      if (r.verdict == StepVerdict::options_differ) ++tallies[1];
      if (r.verdict == StepVerdict::regrouped) ++tallies[2];
      r.non_finite_steps = tallies[0];
      r.refused_steps = tallies[1];
      r.regrouped_steps = tallies[2];
    }
    if (update) {
      *step = r.step;
      *grad_scale = mul_rn(checks.average, r.clip_coefficient);
      for (std::size_t g = 0; g < groups; ++g) scalars[g] = Opt::scalars(options[g], r.step);
    }
    if (record != nullptr) *record = r;
  }
};

/// The step count set to `count` and the tally of non-finite steps to `non_finite` in stream order (construction, a
/// checkpoint's load; one item, lane 0), and the record made to say that no step was taken since, with the tallies
/// (PrepareStepBody) as they are then.
struct SetStepBody {
  std::uint64_t* step = nullptr;
  std::uint64_t* tallies = nullptr;
  StepRecord* record = nullptr;
  std::uint64_t count = 0, non_finite = 0;

  TANDEM_HD void operator()(std::size_t, unsigned lane, unsigned) const {
    if (lane != 0) return;
    *step = count;
    tallies[0] = non_finite;
    StepRecord r;
    r.verdict = StepVerdict::none;
    r.step = count;
    r.non_finite_steps = tallies[0];
    r.refused_steps = tallies[1];
    r.regrouped_steps = tallies[2];
    *record = r;
  }
};

}  // namespace detail

/// An optimizer type: its options (trivially copyable: a DataParallel keeps them in backend memory), how much fp32
/// state it keeps per element, a validation of its options, the per-step scalars (host+device code, TANDEM_HD: a
/// DataParallel computes them on its backend from the step count it keeps there) and a body templated on the parameter
/// type and the gradient type (Body<P, G = float>{UpdateArgs<P, G>, const Scalars*}, the scalars in backend memory).
template <class O>
concept Optimizer = requires(const typename O::Options& options, std::uint64_t step) {
  { O::name } -> std::convertible_to<const char*>;
  { O::state_count(options) } -> std::convertible_to<std::size_t>;
  O::validate(options);
  { O::fingerprint(options) } -> std::convertible_to<std::uint64_t>;
  { O::scalars(options, step) } -> std::same_as<typename O::Scalars>;
  typename O::template Body<float>;
  typename O::template Body<float, BFloat16>;  // a 16-bit reduced shard (DataParallelOptions::reduce_dtype)
  { O::elementwise } -> std::convertible_to<bool>;
  requires std::is_trivially_copyable_v<typename O::Options> && std::is_trivially_copyable_v<typename O::Scalars>;
};

namespace detail {
/// A visitor of every option type (the archetype OptionsNamed tests visit_options with).
struct AnyOptionVisitor {
  template <class T>
  void operator()(const char*, T&) const {}
};
}  // namespace detail

/// An optimizer whose options have names: O::visit_options(options, f) calls f(name, member) for each option, in a
/// fixed order, every member a float or an enumeration (SGD's Nesterov), and every option O::fingerprint covers (a load
/// checks the recorded values against the recorded fingerprint). Checkpoints record such options, and a load restores
/// them; an optimizer without visit_options saves none, and a load leaves the program's. AdamW and SGD name theirs.
template <class O>
concept OptionsNamed = Optimizer<O> && requires(typename O::Options& options, const typename O::Options& recorded) {
  O::visit_options(options, detail::AnyOptionVisitor{});   // to restore them
  O::visit_options(recorded, detail::AnyOptionVisitor{});  // to record them
};

}  // namespace tandem
