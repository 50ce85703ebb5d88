// SPDX-License-Identifier: Apache-2.0
// Combinations that cannot work fail to compile with a sentence that says why (tests/compile_fail/run.cmake compiles
// this file once per case and checks the compiler's message). Case 0 is a policy composed of the same parts that
// works: it must compile, so that a failing case fails for its own reason.
#include <vector>

#include "tandem/tandem.hpp"

namespace {

/// A policy composed from the schemes of policy/phases.hpp, with the given state sharding.
template <class Gradients, class Parameters, tandem::StateSharding State>
struct Composed : Gradients, Parameters, tandem::detail::ShardedCollectives {
  static constexpr const char* name = "Composed";
  static constexpr tandem::StateSharding state = State;
  static tandem::Buffers buffers(const tandem::BufferInputs& in) { return tandem::GradientSharded::buffers(in); }
};

/// AdamW whose state could not be split by shard.
struct WholeTensorAdamW : tandem::AdamW {
  static constexpr const char* name = "WholeTensorAdamW";
  static constexpr bool elementwise = false;
};

}  // namespace

#if TANDEM_COMPILE_FAIL_CASE == 0
using Ok = Composed<tandem::ReduceEveryMicroStep, tandem::GatherAfterUpdate, tandem::StateSharding::sharded>;
static_assert(tandem::Policy<Ok>);
static_assert(sizeof(tandem::DataParallel<Ok, tandem::AdamW>) > 0);
#elif TANDEM_COMPILE_FAIL_CASE == 1  // expect: must shard the optimizer state too
using Bad = Composed<tandem::ReduceEveryMicroStep, tandem::GatherAfterUpdate, tandem::StateSharding::replicated>;
static_assert(sizeof(tandem::DataParallel<Bad, tandem::AdamW>) > 0);
#elif TANDEM_COMPILE_FAIL_CASE == 2  // expect: reduce-scatter every micro-step (GradientReduction::every_micro_step)
using Bad = Composed<tandem::ReduceAtBoundary, tandem::GatherBeforeUse, tandem::StateSharding::sharded>;
static_assert(sizeof(tandem::DataParallel<Bad, tandem::AdamW>) > 0);
#elif TANDEM_COMPILE_FAIL_CASE == 3  // expect: need an optimizer whose state is elementwise
static_assert(sizeof(tandem::DataParallel<tandem::OptimizerSharded, WholeTensorAdamW>) > 0);
#elif TANDEM_COMPILE_FAIL_CASE == 4  // expect: cannot work on the user's buffers
void make(tandem::LocalComm& comm) {
  tandem::DataParallel<tandem::ParameterSharded, tandem::AdamW> dp(comm, std::vector<tandem::TensorRef>{});
}
#elif TANDEM_COMPILE_FAIL_CASE == 5  // expect: grad_view needs a policy that keeps full-size gradients
float* view(tandem::DataParallel<tandem::GradientSharded, tandem::AdamW>& dp) { return dp.grad_view(0); }
#elif TANDEM_COMPILE_FAIL_CASE == 6  // expect: nothing to broadcast
void broadcast(tandem::DataParallel<tandem::ParameterSharded, tandem::AdamW>& dp) { dp.broadcast_parameters(); }
#elif TANDEM_COMPILE_FAIL_CASE == 7  // expect: gradients_complete
struct NoHooks {  // traits and collectives, but no phase hooks
  static constexpr const char* name = "NoHooks";
  static constexpr tandem::StateSharding state = tandem::StateSharding::sharded;
  static constexpr tandem::GradientReduction reduction = tandem::GradientReduction::every_micro_step;
  static constexpr tandem::ParameterSharding parameters = tandem::ParameterSharding::replicated;
  template <class C>
  static void reduce_gradients(C&, const tandem::BucketView&) {}
  template <class C>
  static void gather_parameters(C&, const tandem::BucketView&) {}
  static tandem::Buffers buffers(const tandem::BufferInputs& in) { return tandem::GradientSharded::buffers(in); }
};
static_assert(sizeof(tandem::DataParallel<NoHooks, tandem::AdamW>) > 0);
#endif

int main() {}
