// SPDX-License-Identifier: Apache-2.0
// SGD and AdamW updates of one flat shard (the owned range of DataParallel's step), fp32, bf16 and fp16 parameters,
// against a copy moving the same bytes (x_copy = the copy ceiling's time for half the traffic / the update's time:
// support.hpp's copy_seconds, the faster of memcpy and a streaming copy).
#include <benchmark/benchmark.h>

#include <vector>

#include "support.hpp"
#include "tandem/backend/host.hpp"
#include "tandem/kernels/adamw.hpp"
#include "tandem/kernels/sgd.hpp"

namespace {

template <class Opt, class P>
void BM_update(benchmark::State& state) {
  const std::size_t n = static_cast<std::size_t>(state.range(0));
  tandem::HostBuffer<float> master(n), grad(n), s0(n), s1(n);
  tandem::HostBuffer<P> param(n);
  for (std::size_t i = 0; i < n; ++i) {
    master.data()[i] = 0.01f * static_cast<float>(i % 100);
    grad.data()[i] = 1e-3f * static_cast<float>(i % 37);
    s0.data()[i] = s1.data()[i] = 0.0f;
    param.data()[i] = P(master.data()[i]);
  }
  typename Opt::Options options{};
  if constexpr (std::is_same_v<Opt, tandem::SGD>) options.momentum = 0.9f;
  tandem::UpdateArgs<P> a;
  a.master = master.data();
  a.param = std::is_same_v<P, float> ? reinterpret_cast<P*>(master.data()) : param.data();
  a.grad = grad.data();
  a.state[0] = s0.data();
  a.state[1] = s1.data();
  a.n = n;
  const tandem::HostBackend backend;
  // bytes per element: read grad and master, read+write each state, write master, and the param copy
  const std::size_t states = Opt::state_count(options);
  const std::size_t per_element = 4 + 4 + 8 * states + 4 + (std::is_same_v<P, float> ? 0 : sizeof(P));
  // the step's scalars as a DataParallel makes them: PrepareStepBody before each update (host memory is the backend's)
  std::uint64_t t = 0;
  float grad_scale = 0.0f;
  typename Opt::Scalars scalars{};
  a.grad_scale = &grad_scale;
  const tandem::detail::PrepareStepBody<Opt> prepare{
      .step = &t, .grad_scale = &grad_scale, .options = &options, .scalars = &scalars, .groups = 1};
  bench::run_against_copy(state, n * per_element, n * per_element / 2, [&] {
    backend.launch(1, prepare);
    backend.launch(tandem::update_items(n), typename Opt::template Body<P>{a, &scalars});
  });
}

}  // namespace

BENCHMARK(BM_update<tandem::AdamW, float>)
    ->Name("adamw/fp32")
    ->RangeMultiplier(16)
    ->Range(1 << 16, 1 << 24)
    ->UseRealTime();
BENCHMARK(BM_update<tandem::AdamW, tandem::BFloat16>)
    ->Name("adamw/bf16")
    ->RangeMultiplier(16)
    ->Range(1 << 16, 1 << 24)
    ->UseRealTime();
BENCHMARK(BM_update<tandem::AdamW, tandem::Float16>)
    ->Name("adamw/fp16")
    ->RangeMultiplier(16)
    ->Range(1 << 16, 1 << 24)
    ->UseRealTime();
BENCHMARK(BM_update<tandem::SGD, float>)
    ->Name("sgd_momentum/fp32")
    ->RangeMultiplier(16)
    ->Range(1 << 16, 1 << 24)
    ->UseRealTime();

BENCHMARK_MAIN();
