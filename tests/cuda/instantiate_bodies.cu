// SPDX-License-Identifier: Apache-2.0
// Compile-only: instantiates every kernel body inside a __global__ grid-stride wrapper (a warp per item; the sum of
// squares a block per item), for each parameter dtype (fp32, bf16, fp16; parameters are never fp64) and, for the
// optimizers and the sum of squares, each gradient dtype, so that nvcc proves the bodies are host+device clean (CI has
// nvcc but no GPU). The CUDA backend's real wrappers have the same shape.
//
// The object is also where the rounding rule (kernels/detail/rounding.hpp) can be read in the machine code:
// `cuobjdump -sass` shows no FFMA or DFMA in any body but AdamW's, and AdamW's all come from its one correctly
// rounded division and square root (__fdiv_rn, __fsqrt_rn expand to FFMA refinement steps; with those two replaced
// the count is 0).
#include <tandem/kernels/collective.hpp>
#include <tandem/tandem.hpp>

namespace {

template <class Body>
__global__ void run_body(Body body, std::size_t items) {
  const unsigned lane = threadIdx.x % tandem::item_lanes;
  tandem::for_each_item_of_slot(blockIdx.x, threadIdx.x / tandem::item_lanes, gridDim.x, items, tandem::item_lanes,
                                [&](std::size_t item) { body(item, lane, tandem::item_lanes); });
}

template <class Body>
__global__ void run_sum(Body body, std::size_t items, double* lane_partials) {
  double s = 0.0;
  tandem::for_each_item_of_block(blockIdx.x, gridDim.x, items,
                                 [&](std::size_t item) { s += body(item, threadIdx.x, blockDim.x); });
  lane_partials[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

/// The optimizer bodies for parameters T and gradients G.
template <class T, class G>
void instantiate_updates() {
  using namespace tandem;
  const LaunchShape s = launch_shape(1);
  run_body<<<s.grid, s.block>>>(AdamW::Body<T, G>{}, 1);
  run_body<<<s.grid, s.block>>>(SGD::Body<T, G>{}, 1);
}

template <class T>
void instantiate_for() {
  using namespace tandem;
  const LaunchShape s = launch_shape(1);
  run_body<<<s.grid, s.block>>>(PackBody<T, float, PackDirection::to_bucket>{}, 1);
  run_body<<<s.grid, s.block>>>(PackBody<T, float, PackDirection::to_bucket, WriteMode::accumulate>{}, 1);
  run_body<<<s.grid, s.block>>>(PackBody<T, T, PackDirection::to_bucket>{}, 1);
  run_body<<<s.grid, s.block>>>(PackBody<T, T, PackDirection::from_bucket>{}, 1);
  run_body<<<s.grid, s.block>>>(PackBody<float, T, PackDirection::to_bucket>{}, 1);
  run_body<<<s.grid, s.block>>>(CastBody<T, float>{}, 1);
  run_body<<<s.grid, s.block>>>(CastBody<T, float, WriteMode::accumulate>{}, 1);
  run_body<<<s.grid, s.block>>>(CastBody<float, T>{}, 1);
  run_body<<<s.grid, s.block>>>(CastBody<T, T>{}, 1);
  run_body<<<s.grid, s.block>>>(GroupReduceBody<T>{}, 1);
  run_sum<<<1, block_threads>>>(SumSquaresBody<T>{}, 1, nullptr);
  instantiate_updates<T, float>();
  instantiate_updates<T, BFloat16>();  // a 16-bit reduced shard (DataParallelOptions::reduce_dtype)
  instantiate_updates<T, Float16>();
}

}  // namespace

void tandem_instantiate_bodies() {
  instantiate_for<float>();
  instantiate_for<tandem::BFloat16>();
  instantiate_for<tandem::Float16>();
  run_body<<<1, tandem::block_threads>>>(tandem::OrderedSumBody{}, 1);
  run_body<<<1, tandem::block_threads>>>(tandem::StoreValuesBody<double, 4>{}, 1);
  run_body<<<1, tandem::block_threads>>>(tandem::StoreValuesBody<std::uint64_t, 1>{}, 1);  // the grouping
  run_body<<<1, tandem::block_threads>>>(tandem::detail::PrepareStepBody<tandem::AdamW>{}, 1);
  run_body<<<1, tandem::block_threads>>>(tandem::detail::PrepareStepBody<tandem::SGD>{}, 1);
  run_body<<<1, tandem::block_threads>>>(tandem::detail::SetStepBody{}, 1);
  run_body<<<1, tandem::block_threads>>>(tandem::GroupReduceBody<double>{}, 1);
}
