// SPDX-License-Identifier: Apache-2.0
// GPU tests of N ranks on one GPU (DeviceGroup<CudaBackend>, comm/device_group.hpp) and of the CUDA backend at its
// limits (label `gpu`; skipped where no GPU exists). The device must give the host's bits (the rounding rule):
//   - every collective, dtype and in-place form of DeviceGroup equals LocalGroup on the host, bit for bit;
//   - DataParallel over DeviceGroup, every policy at world sizes 1-4: each micro-step's backward is a slow kernel on
//     the user's stream announced with grad_ready at once (no host synchronisation before grad_ready or step), with
//     broadcast from the last rank and a NaN on one rank's gradients that every rank skips; bitwise equal across
//     policies and to LocalGroup on the host; a checkpoint saved at N ranks loads at M bit for bit;
//   - a launch of more items than the grid-stride cap, a buffer of more than 2^31 elements, a step of the whole
//     GPT-2-124M layout (tests/data/gpt2_124m.tsv) equal to the host's, and pack launches captured in a CUDA graph
//     and replayed, equal to eager launches.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "support/device_memory.hpp"
#include "support/gpu_main.hpp"
#include "support/params.hpp"
#include "tandem/backend/cuda.hpp"
#include "tandem/comm/device_group.hpp"
#include "tandem/kernels/detail/rounding.hpp"
#include "tandem/tandem.hpp"

// Launch bodies live outside the anonymous namespace: a kernel instantiated on a type with internal linkage cannot
// take the hidden visibility tandem gives its kernels.
namespace cuda_group_bodies {

/// The gradient a test's "backward" writes: the same bits on host and device (one rounded product, exact terms).
TANDEM_HD inline float gradient(float w, std::size_t i, std::size_t e, int step, int rank) {
  const int k = static_cast<int>(
                    (e * 7 + i * 3 + static_cast<std::size_t>(step) * 5 + static_cast<std::size_t>(rank) * 11) % 17) -
                8;
  return tandem::detail::mul_rn(0.01f, w) + static_cast<float>(k) * 0.03125f;
}

/// A slow producer: spins for about `ns` nanoseconds on the device, then writes tensor i's gradients.
struct SlowGradBody {
  float* grad;
  const float* param;
  std::size_t n, i;
  int step, rank;
  unsigned spin_ns;
  bool poison;
  TANDEM_HD void operator()(std::size_t item, unsigned lane, unsigned lanes) const {
#if TANDEM_IN_DEVICE_CODE
    if (item == 0 && spin_ns != 0)
      for (unsigned t = 0; t < spin_ns; t += 1000) __nanosleep(1000);
    __syncthreads();
#endif
    if (item != 0) return;
    for (std::size_t e = lane; e < n; e += lanes) grad[e] = gradient(param[e], i, e, step, rank);
    if (poison && lane == 0 && n > 0) grad[0] = NAN;
  }
};

struct MarkBody {
  unsigned* out;
  TANDEM_HD void operator()(std::size_t item, unsigned lane, unsigned) const {
    if (lane == 0) out[item] += static_cast<unsigned>(item) + 1u;
  }
};

struct FillBody {
  float* out;
  std::size_t n;
  TANDEM_HD void operator()(std::size_t item, unsigned lane, unsigned lanes) const {
    const std::size_t begin = item * tandem::cast_chunk_elements;
    const std::size_t end = begin + tandem::cast_chunk_elements < n ? begin + tandem::cast_chunk_elements : n;
    for (std::size_t e = begin + lane; e < end; e += lanes) out[e] = static_cast<float>(e % 1000003u);
  }
};

}  // namespace cuda_group_bodies

namespace {

using namespace cuda_group_bodies;
using tandem::CudaBackend;
using Group = tandem::DeviceGroup<CudaBackend>;
using Comm = tandem::DeviceComm<CudaBackend>;

using test::Device;
using test::UserStream;

// ---- collectives --------------------------------------------------------------------------------------------------

enum class Kind { all_reduce, reduce_scatter, all_gather, broadcast };

template <class T>
std::vector<T> random_values(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(-4.0f, 4.0f);
  std::vector<T> v(n);
  for (T& x : v) x = tandem::convert<T>(d(rng));
  return v;
}

/// Every rank's result of one collective (its recv, or the received part of send for the in-place forms).
template <class T, class GroupT, class Issue>
std::vector<std::vector<T>> run_collective(GroupT& group, Kind kind, bool in_place, std::size_t count, Issue issue) {
  const int world = group.size();
  std::vector<std::vector<T>> out(static_cast<std::size_t>(world));
  group.run([&](auto& comm) {
    const int r = comm.rank();
    const std::size_t n = static_cast<std::size_t>(world);
    const std::size_t send_n = kind == Kind::reduce_scatter ? n * count : count;
    const std::size_t recv_n = kind == Kind::all_gather ? n * count : count;
    std::vector<T> send = random_values<T>(send_n, 1000 + static_cast<std::uint64_t>(r));
    std::vector<T> recv(recv_n, tandem::convert<T>(-99.0f));
    std::vector<T> got = issue(comm, send, recv, kind, in_place, count);
    out[static_cast<std::size_t>(r)] = std::move(got);
  });
  return out;
}

/// On the host (LocalGroup): the collective on host vectors.
template <class T>
std::vector<T> host_issue(tandem::LocalComm& comm, std::vector<T>& send, std::vector<T>& recv, Kind kind, bool in_place,
                          std::size_t count) {
  const auto dt = tandem::dtype_of<T>;
  const std::size_t at = static_cast<std::size_t>(comm.rank()) * count;
  switch (kind) {
    case Kind::all_reduce:
      comm.all_reduce(send.data(), in_place ? send.data() : recv.data(), count, dt, tandem::ReduceOp::avg);
      return in_place ? send : recv;
    case Kind::reduce_scatter:
      comm.reduce_scatter(send.data(), in_place ? send.data() + at : recv.data(), count, dt, tandem::ReduceOp::sum);
      return in_place ? std::vector<T>(send.begin() + static_cast<std::ptrdiff_t>(at),
                                       send.begin() + static_cast<std::ptrdiff_t>(at + count))
                      : recv;
    case Kind::all_gather:
      if (in_place) std::copy(send.begin(), send.end(), recv.begin() + static_cast<std::ptrdiff_t>(at));
      comm.all_gather(in_place ? recv.data() + at : send.data(), recv.data(), count, dt);
      return recv;
    case Kind::broadcast:
      comm.broadcast(send.data(), in_place ? send.data() : recv.data(), count, dt, comm.size() - 1);
      return in_place ? send : recv;
  }
  return {};
}

/// On the GPU (DeviceGroup): the same on device copies, uploaded and read back on the rank's own stream, with no
/// host synchronisation between the upload and the collective.
template <class T>
std::vector<T> device_issue(Comm& comm, std::vector<T>& send, std::vector<T>& recv, Kind kind, bool in_place,
                            std::size_t count) {
  UserStream user;
  Device<T> ds(send.size()), dr(recv.size());
  TANDEM_CUDA_CHECK(cudaMemcpyAsync(ds.p, send.data(), send.size() * sizeof(T), cudaMemcpyHostToDevice, user.s));
  TANDEM_CUDA_CHECK(cudaMemcpyAsync(dr.p, recv.data(), recv.size() * sizeof(T), cudaMemcpyHostToDevice, user.s));
  const auto dt = tandem::dtype_of<T>;
  const std::size_t at = static_cast<std::size_t>(comm.rank()) * count;
  const tandem::Stream s = user.stream();
  const T* result = dr.p;
  std::size_t n = recv.size();
  switch (kind) {
    case Kind::all_reduce:
      comm.all_reduce(ds.p, in_place ? ds.p : dr.p, count, dt, tandem::ReduceOp::avg, s);
      if (in_place) result = ds.p;
      break;
    case Kind::reduce_scatter:
      comm.reduce_scatter(ds.p, in_place ? ds.p + at : dr.p, count, dt, tandem::ReduceOp::sum, s);
      if (in_place) result = ds.p + at;
      break;
    case Kind::all_gather:
      if (in_place)
        TANDEM_CUDA_CHECK(cudaMemcpyAsync(dr.p + at, ds.p, count * sizeof(T), cudaMemcpyDeviceToDevice, user.s));
      comm.all_gather(in_place ? dr.p + at : ds.p, dr.p, count, dt, s);
      break;
    case Kind::broadcast:
      comm.broadcast(ds.p, in_place ? ds.p : dr.p, count, dt, comm.size() - 1, s);
      if (in_place) result = ds.p;
      break;
  }
  if (kind == Kind::reduce_scatter || (in_place && kind != Kind::all_gather)) n = count;
  std::vector<T> out(n);
  TANDEM_CUDA_CHECK(cudaMemcpyAsync(out.data(), result, n * sizeof(T), cudaMemcpyDeviceToHost, user.s));
  user.synchronize();
  return out;
}

template <class T>
void check_collectives() {
  for (int world : {1, 2, 3, 4})
    for (Kind kind : {Kind::all_reduce, Kind::reduce_scatter, Kind::all_gather, Kind::broadcast})
      for (bool in_place : {false, true})
        for (std::size_t count : {std::size_t{1}, std::size_t{4097}, std::size_t{70001}}) {
          CAPTURE(world);
          CAPTURE(static_cast<int>(kind));
          CAPTURE(in_place);
          CAPTURE(count);
          tandem::LocalGroup local(world);
          const auto expected = run_collective<T>(local, kind, in_place, count, host_issue<T>);
          Group group(world);
          const auto got = run_collective<T>(group, kind, in_place, count, device_issue<T>);
          bool same = got.size() == expected.size();
          for (std::size_t r = 0; same && r < got.size(); ++r)
            same = got[r].size() == expected[r].size() &&
                   std::memcmp(got[r].data(), expected[r].data(), got[r].size() * sizeof(T)) == 0;
          CHECK(same);
        }
}

// ---- DataParallel over DeviceGroup ----------------------------------------------------------------------------------

const std::vector<std::size_t> sizes = {3, 1, 0, 700, 129, 4100, 64, 5, 257, 2048, 33};

/// Tensor i's initial parameters on rank `rank` (ranks differ: the broadcast must fix it).
float initial(std::size_t i, std::size_t e, int rank) {
  return 0.02f * static_cast<float>(static_cast<int>((e * 13 + i) % 101) - 50) + 0.001f * static_cast<float>(rank);
}

/// The test's tensors in device memory, parameters at their initial values for `rank`, and their TensorRefs.
struct DeviceTensors {
  std::vector<std::unique_ptr<Device<float>>> w, g;
  std::vector<tandem::TensorRef> refs;
  explicit DeviceTensors(int rank) {
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      std::vector<float> init;
      for (std::size_t e = 0; e < sizes[i]; ++e) init.push_back(initial(i, e, rank));
      w.push_back(std::make_unique<Device<float>>(sizes[i]));
      g.push_back(std::make_unique<Device<float>>(sizes[i]));
      w[i]->upload(init.data(), sizes[i]);
      refs.push_back({"t" + std::to_string(i), w[i]->p, g[i]->p, sizes[i], tandem::DType::fp32});
    }
    TANDEM_CUDA_CHECK(cudaDeviceSynchronize());  // pageable uploads may return before their copy lands
  }
  /// The parameters as `user`'s stream has them (read on it, then waited for).
  test::Params parameters(const UserStream& user) const {
    test::Params params(sizes.size());
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      params[i].resize(sizes[i]);
      TANDEM_CUDA_CHECK(
          cudaMemcpyAsync(params[i].data(), w[i]->p, sizes[i] * sizeof(float), cudaMemcpyDeviceToHost, user.s));
    }
    user.synchronize();
    return params;
  }
};

/// The step and rank whose gradients hold one NaN (every rank must skip that step).
constexpr int nan_step = 3, steps = 6;

struct Run {
  int accumulation = 1;
  float max_grad_norm = 0.0f;
};

using Result = std::pair<test::Params, std::uint64_t>;  // rank 0's parameters, steps skipped

template <class P>
Result train_host(int world, const Run& run) {
  Result out;
  std::mutex m;
  tandem::LocalGroup group(world);
  group.run([&](tandem::LocalComm& comm) {
    std::vector<std::vector<float>> w(sizes.size()), g(sizes.size());
    std::vector<tandem::TensorRef> refs;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      for (std::size_t e = 0; e < sizes[i]; ++e) w[i].push_back(initial(i, e, comm.rank()));
      g[i].assign(sizes[i], 0.0f);
      refs.push_back({"t" + std::to_string(i), w[i].data(), g[i].data(), sizes[i], tandem::DType::fp32});
    }
    tandem::DataParallel<P, tandem::AdamW> dp(comm, refs, {.lr = 1e-2f},
                                              {.bucket_cap_bytes = 8192,
                                               .first_bucket_cap_bytes = 4096,
                                               .accumulation_steps = run.accumulation,
                                               .max_grad_norm = run.max_grad_norm,
                                               .non_finite = tandem::NonFinite::skip_step});
    dp.broadcast_parameters(world - 1);
    for (int s = 0; s < steps * run.accumulation; ++s) {
      for (std::size_t i = 0; i < sizes.size(); ++i)
        for (std::size_t e = 0; e < sizes[i]; ++e) g[i][e] = gradient(w[i][e], i, e, s, comm.rank());
      if (s == nan_step && comm.rank() == world - 1) g[3][0] = NAN;
      dp.step();
    }
    if (comm.rank() == 0) {
      std::lock_guard lock(m);
      out = {w, dp.skipped_steps()};
    }
  });
  return out;
}

/// The same training over DeviceGroup<CudaBackend>: parameters and gradients in device memory, backward on the
/// user's stream, grad_ready right after each gradient's kernel, no host synchronisation inside the loop.
/// With `save`, rank 0's checkpoint is written there at the end.
template <class P>
Result train_device(int world, const Run& run, const std::string& save = {}) {
  Result out;
  std::mutex m;
  Group group(world);
  group.run([&](Comm& comm) {
    UserStream user;
    DeviceTensors t(comm.rank());
    auto& w = t.w;
    auto& g = t.g;
    const auto& refs = t.refs;
    const CudaBackend launcher;
    tandem::DataParallel<P, tandem::AdamW, CudaBackend, Comm> dp(comm, refs, {.lr = 1e-2f},
                                                                 {.bucket_cap_bytes = 8192,
                                                                  .first_bucket_cap_bytes = 4096,
                                                                  .accumulation_steps = run.accumulation,
                                                                  .max_grad_norm = run.max_grad_norm,
                                                                  .non_finite = tandem::NonFinite::skip_step,
                                                                  .stream = user.stream()});
    dp.broadcast_parameters(world - 1);
    for (int s = 0; s < steps * run.accumulation; ++s) {
      for (std::size_t i = sizes.size(); i-- > 0;) {  // backward: last tensor first
        const bool poison = s == nan_step && comm.rank() == world - 1 && i == 3;
        launcher.launch(1, SlowGradBody{g[i]->p, w[i]->p, sizes[i], i, s, comm.rank(), 20000, poison}, user.stream());
        dp.grad_ready(i);
      }
      dp.step();
    }
    if (!save.empty()) dp.save_checkpoint(save);
    const test::Params params = t.parameters(user);
    if (comm.rank() == 0) {
      std::lock_guard lock(m);
      out = {params, dp.skipped_steps()};
    }
  });
  return out;
}

/// Loads `path` at `world` ranks over DeviceGroup and returns rank r's parameters for every r (all must agree).
std::vector<test::Params> load_device(int world, const std::string& path) {
  std::vector<test::Params> out(static_cast<std::size_t>(world));
  Group group(world);
  group.run([&](Comm& comm) {
    UserStream user;
    DeviceTensors t(comm.rank());
    const auto& refs = t.refs;
    tandem::DataParallel<tandem::OptimizerSharded, tandem::AdamW, CudaBackend, Comm> dp(
        comm, refs, {.lr = 1e-2f}, {.bucket_cap_bytes = 4096, .first_bucket_cap_bytes = 2048, .stream = user.stream()});
    dp.load_checkpoint(path);
    const test::Params params = t.parameters(user);
    out[static_cast<std::size_t>(comm.rank())] = params;
  });
  return out;
}

// ---- the backend at its limits ------------------------------------------------------------------------------------

/// The GPT-2-124M tensor list (tests/data/gpt2_124m.tsv: name, numel, shape).
std::vector<tandem::TensorSpec> gpt2_layout() {
  std::ifstream in(TANDEM_TEST_DATA_DIR "/gpt2_124m.tsv");
  REQUIRE(in.good());
  std::vector<tandem::TensorSpec> specs;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    std::string name;
    std::size_t numel = 0;
    fields >> name >> numel;
    specs.push_back({name, numel, tandem::DType::fp32});
  }
  return specs;
}

}  // namespace

TEST_CASE_TEMPLATE("DeviceGroup on one GPU gives LocalGroup's bits for every collective", T, float, tandem::BFloat16,
                   double) {
  test::require_gpus(1);
  check_collectives<T>();
}

TEST_CASE_TEMPLATE("DataParallel over DeviceGroup on one GPU, world sizes 1-4, equals LocalGroup on the host", P,
                   tandem::Replicated, tandem::OptimizerSharded, tandem::GradientSharded) {
  test::require_gpus(1);
  for (int world : {1, 2, 3, 4}) {
    CAPTURE(world);
    const Result host = train_host<P>(world, Run{});
    const Result gpu = train_device<P>(world, Run{});
    CHECK(host.second == 1);
    CHECK(gpu.second == 1);  // the NaN on one rank: every rank skipped that step
    CHECK(test::bitwise_equal(gpu.first, host.first));
    // Across policies: the same bits as Replicated, with clipping too (the norm is summed alike under every policy).
    const Run clipped{.max_grad_norm = 0.05f};
    CHECK(test::bitwise_equal(train_device<P>(world, clipped).first,
                              train_device<tandem::Replicated>(world, clipped).first));
    CHECK(test::max_relative_error(train_device<P>(world, clipped).first, train_host<P>(world, clipped).first) <= 1e-6);
  }
}

TEST_CASE("DataParallel over DeviceGroup: accumulation, and a checkpoint saved at N ranks loads at M bit for bit") {
  test::require_gpus(1);
  const Run run{.accumulation = 2};
  const Result host = train_host<tandem::OptimizerSharded>(3, run);
  const std::string path = "test_cuda_group_" + std::to_string(::getpid()) + ".ckpt";
  const Result gpu = train_device<tandem::OptimizerSharded>(3, run, path);
  CHECK(test::bitwise_equal(gpu.first, host.first));
  for (int m : {1, 2, 4}) {
    CAPTURE(m);
    for (const test::Params& loaded : load_device(m, path)) CHECK(test::bitwise_equal(loaded, gpu.first));
  }
  std::filesystem::remove_all(path);
}

TEST_CASE("CUDA launch of more items than the grid-stride cap reaches every item exactly once") {
  test::require_gpus(1);
  const CudaBackend backend;
  // three grids' worth of items (a warp each) and a few: the grid-stride loop reaches the rest
  const std::size_t items = 3 * std::size_t{backend.max_blocks()} * tandem::items_per_block + 7;
  Device<unsigned> out(items);
  backend.zero(out.p, items * sizeof(unsigned), backend.stream());  // on the stream the launch runs on
  backend.launch(items, MarkBody{out.p}, backend.stream());
  std::vector<unsigned> host(items);
  backend.read(host.data(), out.p, items * sizeof(unsigned), backend.stream());
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < items; ++i) wrong += host[i] != static_cast<unsigned>(i) + 1u;
  CHECK(wrong == 0);
}

TEST_CASE("CUDA fill and cast over one buffer of more than 2^31 elements reach its end") {
  test::require_gpus(1);
  const CudaBackend backend;
  const std::size_t n = (std::size_t{1} << 31) + 4099;
  Device<float> src(n), dst(n);
  backend.launch(tandem::cast_items(n), FillBody{src.p, n}, backend.stream());
  backend.launch(tandem::cast_items(n), tandem::CastBody<float, float>{src.p, dst.p, n, 0.5f}, backend.stream());
  for (std::size_t at : {std::size_t{0}, (std::size_t{1} << 31) - 2048, n - 4096}) {
    std::vector<float> host(4096);
    backend.read(host.data(), dst.p + at, host.size() * sizeof(float), backend.stream());
    std::size_t wrong = 0;
    for (std::size_t e = 0; e < host.size(); ++e) wrong += host[e] != 0.5f * static_cast<float>((at + e) % 1000003u);
    CAPTURE(at);
    CHECK(wrong == 0);
  }
}

TEST_CASE("a DataParallel step of the whole GPT-2-124M layout on one GPU equals the host's") {
  test::require_gpus(1);
  const std::vector<tandem::TensorSpec> specs = gpt2_layout();
  REQUIRE(specs.size() == 148);
  const auto train = [&](auto backend_tag, auto& comm) {
    using B = decltype(backend_tag);
    using C = std::remove_reference_t<decltype(comm)>;
    tandem::DataParallel<tandem::GradientSharded, tandem::AdamW, B, C> dp(comm, specs, {.lr = 1e-3f});
    const B launcher;
    for (std::size_t i = 0; i < specs.size(); ++i) {  // initial values, then two steps of the test's gradients
      launcher.launch(tandem::cast_items(specs[i].numel), FillBody{dp.template param_view<float>(i), specs[i].numel},
                      {});
    }
    dp.broadcast_parameters();
    for (int s = 0; s < 2; ++s) {
      for (std::size_t b = 0; b < dp.num_buckets(); ++b) {
        auto bucket = dp.gradients(b);
        for (std::size_t i : bucket.tensors())
          launcher.launch(1,
                          SlowGradBody{bucket.grad(i), dp.template param_view<float>(i), specs[i].numel, i, s,
                                       comm.rank(), 0, false},
                          {});
      }
      dp.step();
    }
    launcher.synchronize({});
    std::vector<float> sample;
    for (std::size_t i = 0; i < specs.size(); i += 7) {
      std::vector<float> t(std::min<std::size_t>(specs[i].numel, 5000));
      launcher.read(t.data(), dp.template param_view<float>(i) + (specs[i].numel - t.size()), t.size() * sizeof(float),
                    {});
      sample.insert(sample.end(), t.begin(), t.end());
    }
    return sample;
  };
  std::vector<float> host, gpu;
  tandem::LocalGroup(1).run([&](tandem::LocalComm& comm) { host = train(tandem::HostBackend{}, comm); });
  Group(1).run([&](Comm& comm) { gpu = train(CudaBackend{}, comm); });
  REQUIRE(host.size() == gpu.size());
  CHECK(std::memcmp(host.data(), gpu.data(), host.size() * sizeof(float)) == 0);
}

TEST_CASE("pack launches captured in a CUDA graph and replayed equal eager launches") {
  test::require_gpus(1);
  const CudaBackend backend;
  const std::vector<std::size_t> numels = {5, 4096, 70001, 3, 1000, 129};
  tandem::PlanOptions o;
  o.bucket_cap_bytes = 1 << 16;
  o.first_bucket_cap_bytes = 1 << 14;
  const tandem::Plan plan(numels, o);
  std::vector<std::unique_ptr<Device<float>>> user;
  std::vector<void*> pointers;
  for (std::size_t n : numels) {
    user.push_back(std::make_unique<Device<float>>(n));
    pointers.push_back(user.back()->p);
  }
  std::vector<tandem::PackTable> tables;
  for (std::size_t b = 0; b < plan.num_buckets(); ++b)
    tables.push_back(tandem::make_pack_table(plan, b, pointers, CudaBackend::pack_table_layout.chunk_elements));
  const tandem::ResidentPackTables<CudaBackend> resident(backend, tables, backend.stream());
  Device<float> eager(plan.total_size()), replayed(plan.total_size());
  const auto pack_all = [&](float* flat, tandem::Stream s) {
    for (std::size_t b = 0; b < plan.num_buckets(); ++b) {
      const tandem::PackTableView& t = resident[b];
      backend.launch(t.items,
                     tandem::PackBody<float, float, tandem::PackDirection::to_bucket>{
                         t.reading_user, t.tensors, flat + plan.bucket(b).offset, 0.25f, tandem::StoreHint::cached},
                     s);
    }
  };
  UserStream capture;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  TANDEM_CUDA_CHECK(cudaStreamBeginCapture(capture.s, cudaStreamCaptureModeThreadLocal));
  pack_all(replayed.p, capture.stream());
  TANDEM_CUDA_CHECK(cudaStreamEndCapture(capture.s, &graph));
  TANDEM_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int round = 0; round < 3; ++round) {
    CAPTURE(round);
    for (std::size_t i = 0; i < numels.size(); ++i) {  // new inputs each round: the graph reads them anew
      const std::vector<float> v = random_values<float>(numels[i], 77 + 10 * static_cast<std::uint64_t>(round) + i);
      TANDEM_CUDA_CHECK(cudaMemcpy(user[i]->p, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice));
    }
    TANDEM_CUDA_CHECK(cudaMemset(eager.p, 0, plan.total_size() * sizeof(float)));
    TANDEM_CUDA_CHECK(cudaMemset(replayed.p, 0, plan.total_size() * sizeof(float)));
    TANDEM_CUDA_CHECK(cudaDeviceSynchronize());  // the inputs and the zeroing land before either pack reads
    pack_all(eager.p, capture.stream());
    TANDEM_CUDA_CHECK(cudaGraphLaunch(exec, capture.s));
    capture.synchronize();
    std::vector<float> a(plan.total_size()), b(plan.total_size());
    TANDEM_CUDA_CHECK(cudaMemcpy(a.data(), eager.p, a.size() * sizeof(float), cudaMemcpyDeviceToHost));
    TANDEM_CUDA_CHECK(cudaMemcpy(b.data(), replayed.p, b.size() * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}
