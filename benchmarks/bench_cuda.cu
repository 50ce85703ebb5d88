// SPDX-License-Identifier: Apache-2.0
// GPU benchmarks: pack and unpack of whole layouts (a launch per run of buckets as DataParallel makes them, tables
// resident in device memory), the AdamW shard update, and a whole step() of the GPT-2-124M layout at one rank, eager
// and replayed from a CUDA graph; each timed with CUDA events (manual time) and reported as bytes/s and as x_copy: the
// time of a device-to-device cudaMemcpyAsync moving the same traffic, measured in the same run, over the measured time
// (1.0 = as fast as a copy). Layouts: the GPT-2-124M tensor list and 10,000 x 1 KB. Targets (issues #3, #16):
// pack/unpack x_copy >= 0.9 on GPT-2, AdamW x_copy >= 0.85, step() at most 1.2x its floor (x_copy >= 1 / 1.2). Rows
// without a target measure the alternatives in the same run: plain launches (/plain_launch,
// CudaBackendOptions::programmatic_launch off), a launch per bucket (/per_bucket), one launch over every bucket
// (/one_launch), items of 1024, 2048 and 4096 elements instead of CudaBackend's 512 (/chunk1024, /chunk2048,
// /chunk4096), plain launches of SMs x 8 blocks whatever the kernel's occupancy (/grid8), 16 or 8 lanes per item
// (/lanes16, /lanes8), runs after a pass's first that start beside the run before them (/overlap: run_overlapping),
// each warp's next item read before it moves the current one (/prefetch: run_prefetching), the pack's items in the
// host's order, tensors in layout order (/user_order; /chunk1024/user_order is the pack as it was before CudaBackend's
// 512-element items in one list). The rows of the bench's own kernels (/overlap, /prefetch) first check that a pass
// writes what CudaBackend::launch writes over the same tables. Data is never zeros. Without a GPU it prints a line and
// exits 0.
//
// Timing. A pack pass, an AdamW update and the copy they are divided by are each timed one at a time, in the same way:
// the stream is held by a one-thread kernel (StreamHold) while the host enqueues the start event, the work and the end
// event, and then released, so that the events time the GPU's work and not the host's launch calls (NVBench's blocking
// kernel does the same). x_copy is then GPU time against GPU time. A pass of several launches is spared the host's
// time between them, which a step pays only where its GPU gets ahead of its host (in a step the packs are enqueued
// while backward runs). Unheld, the GPU may pass the start event before the host's first launch call returns, while
// the copies a pass was compared with ran back to back. Pack rows also report x_copy_unheld, approximately that
// previous measure (20 passes alone and unheld, after the timed ones, against 20 copies back to back), for comparison
// with earlier runs. step() is timed unheld (an eager step's host work is part of what it costs) and divided by the
// held copy (copies of gigabytes, where a few microseconds of launch are a small share). Under a profiler, which may
// serialize launches, the flag --unheld times every pass unheld (NVBench's --disable-blocking-kernel).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "support.hpp"
#include "tandem/backend/cuda.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/core/plan.hpp"
#include "tandem/kernels/adamw.hpp"
#include "tandem/kernels/pack.hpp"
#if TANDEM_BENCH_STEP  // where NCCL is found
#include "tandem/comm/nccl.hpp"
#include "tandem/front/data_parallel.hpp"
#include "tandem/policy/replicated.hpp"
#endif

namespace {

using tandem::PackDirection;

/// Device bytes, freed at exit.
struct DeviceBytes {
  void* p = nullptr;
  explicit DeviceBytes(std::size_t bytes) { TANDEM_CUDA_CHECK(cudaMalloc(&p, bytes)); }
  ~DeviceBytes() { cudaFree(p); }
  DeviceBytes(const DeviceBytes&) = delete;
};

/// Two CUDA events, destroyed with it: the start and end of what is timed.
struct EventPair {
  cudaEvent_t a = nullptr, b = nullptr;
  EventPair() {
    TANDEM_CUDA_CHECK(cudaEventCreate(&a));
    TANDEM_CUDA_CHECK(cudaEventCreate(&b));
  }
  ~EventPair() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  EventPair(const EventPair&) = delete;
  EventPair& operator=(const EventPair&) = delete;
  /// Seconds between the two, once b has been reached.
  double seconds() const {
    TANDEM_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    TANDEM_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    return ms * 1e-3;
  }
};

/// Seconds per call of f(), averaged over `reps` calls between two events on `stream`, unheld (the host may still be
/// enqueuing when the GPU reaches the first event).
template <class F>
double event_seconds(cudaStream_t stream, int reps, F&& f) {
  const EventPair e;
  TANDEM_CUDA_CHECK(cudaEventRecord(e.a, stream));
  for (int i = 0; i < reps; ++i) f();
  TANDEM_CUDA_CHECK(cudaEventRecord(e.b, stream));
  return e.seconds() / reps;
}

/// Spins one thread until the host has released hold `generation` or a later one (*release), or until `timeout_ns`
/// have passed (then *timed_out = generation). Generations keep a hold that the host released early (an exception) and
/// that the GPU reaches late from being held by, or blamed for, the next one.
__global__ void hold_stream(const volatile unsigned* release, volatile unsigned* timed_out, unsigned generation,
                            unsigned long long timeout_ns) {
  unsigned long long start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  while (*release < generation) {
    __nanosleep(256);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start > timeout_ns) {
      *timed_out = generation;
      return;
    }
  }
}

/// Holds a stream while the host enqueues what is timed (hold_stream over two flags in mapped pinned memory).
class StreamHold {
 public:
  StreamHold() {
    void* p = nullptr;
    TANDEM_CUDA_CHECK(cudaHostAlloc(&p, 2 * sizeof(unsigned), cudaHostAllocMapped));
    flags_ = static_cast<volatile unsigned*>(p);
    flags_[0] = 0;
    flags_[1] = 0;
    void* d = nullptr;
    TANDEM_CUDA_CHECK(cudaHostGetDevicePointer(&d, p, 0));
    device_ = static_cast<volatile unsigned*>(d);
  }
  ~StreamHold() { cudaFreeHost(const_cast<unsigned*>(flags_)); }
  StreamHold(const StreamHold&) = delete;
  StreamHold& operator=(const StreamHold&) = delete;

  /// Holds `stream` from here on (a new generation), until release().
  void hold(cudaStream_t stream) {
    ++generation_;
    // 2 s: far more than any pass takes to enqueue
    hold_stream<<<1, 1, 0, stream>>>(device_, device_ + 1, generation_, 2'000'000'000ull);
    TANDEM_CUDA_CHECK(cudaGetLastError());
  }
  void release() { flags_[0] = generation_; }
  /// Whether the last hold ran out before its release (what followed it was then timed unheld).
  bool timed_out() const { return flags_[1] == generation_; }

 private:
  volatile unsigned* flags_ = nullptr;   // host view: [0] the last generation released, [1] the last that ran out
  volatile unsigned* device_ = nullptr;  // the same flags, as the device addresses them
  unsigned generation_ = 0;
};

StreamHold& stream_hold() {
  static StreamHold hold;
  return hold;
}

/// False with --unheld: every pass is timed unheld. For profilers (Nsight Compute, compute-sanitizer), which may
/// serialize launches, so that the hold would only run out: NVBench's --disable-blocking-kernel.
bool hold_streams = true;

/// GPU seconds of one call of f() (its work on `stream`): the stream is held until f() and the end event are enqueued.
template <class F>
double held_seconds(cudaStream_t stream, F&& f) {
  if (!hold_streams) return event_seconds(stream, 1, f);
  StreamHold& hold = stream_hold();
  const EventPair e;
  hold.hold(stream);
  struct Release {  // also where f() throws: the GPU must not wait out the timeout
    StreamHold& h;
    ~Release() { h.release(); }
  };
  {
    const Release release{hold};
    TANDEM_CUDA_CHECK(cudaEventRecord(e.a, stream));
    f();
    TANDEM_CUDA_CHECK(cudaEventRecord(e.b, stream));
  }
  const double seconds = e.seconds();
  if (hold.timed_out())
    tandem::detail::fail(
        "bench_cuda: the stream hold ran out (2 s) before the host had enqueued the pass; under a profiler, which may "
        "serialize launches, run with --unheld");
  return seconds;
}

/// Runs f() once untimed, then once per iteration of `state`, each timed held (its manual time); the mean seconds.
template <class F>
double timed_iterations(benchmark::State& state, cudaStream_t stream, F&& f) {
  f();
  double total = 0;
  for (auto _ : state) {
    const double t = held_seconds(stream, f);
    state.SetIterationTime(t);
    total += t;
  }
  return total / static_cast<double>(state.iterations());
}

/// Seconds of a device-to-device copy of `bytes` (the ceiling every figure is divided by), two ways: `held`, the mean
/// of 200 copies each timed held (as many as make the events' half-microsecond resolution small against a copy of a
/// few microseconds), and `back_to_back`, 20 copies between two events, unheld (the previous measure).
struct CopyTimes {
  double held = 0, back_to_back = 0;
};
CopyTimes copy_seconds(const tandem::CudaBackend& cuda, std::size_t bytes) {
  DeviceBytes a(bytes), b(bytes);
  const cudaStream_t s = tandem::detail::native(cuda.stream());
  TANDEM_CUDA_CHECK(cudaMemsetAsync(a.p, 1, bytes, s));
  auto copy = [&] { TANDEM_CUDA_CHECK(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice, s)); };
  event_seconds(s, 3, copy);
  CopyTimes t;
  t.back_to_back = event_seconds(s, 20, copy);
  for (int i = 0; i < 200; ++i) t.held += held_seconds(s, copy);
  t.held /= 200;
  return t;
}

const tandem::CudaBackend& backend() {
  static const tandem::CudaBackend cuda;
  return cuda;
}

/// A backend whose launches are plain (CudaBackendOptions::programmatic_launch off): what programmatic launches
/// save, in the same run.
const tandem::CudaBackend& plain_backend() {
  static const tandem::CudaBackend cuda(tandem::CudaBackendOptions{.programmatic_launch = false});
  return cuda;
}

/// How a pack benchmark launches: a launch per run of buckets (kernels/pack.hpp, RunGrouping), with `chunk` elements
/// per item. The target rows launch as a step of DataParallel does where it issues every bucket at once (step() with no
/// grad_ready), at more than one rank: the packs in runs from bucket 0, the unpacks in runs from the last bucket (at
/// one rank the packs are one run: /one_launch).
struct PackVariant {
  std::optional<tandem::RunGrouping> grouping;  ///< none: the step's, for the direction
  /// Elements per item: CudaBackend's unless said.
  std::size_t chunk = tandem::CudaBackend::pack_table_layout.chunk_elements;
  bool plain = false;    ///< launched by plain_backend(), or by backend() (programmatic launches, the default)
  bool grid8 = false;    ///< plain launches of SMs x 8 blocks (before CudaBackend::resident_blocks), not by the backend
  bool overlap = false;  ///< run_overlapping: a pass's later runs start while the run before them ends
  bool prefetch = false;    ///< run_prefetching: each slot reads its next item before it moves the current one
  bool user_order = false;  ///< the tables' one list in the pack's host order (PackTable::reading_user)
  unsigned lanes = tandem::item_lanes;  ///< per item: a warp, or a slot of 16 or 8 threads (several items per warp)
  tandem::RunGrouping runs(PackDirection direction) const {
    return grouping.value_or(direction == PackDirection::to_bucket ? tandem::RunGrouping::from_first
                                                                   : tandem::RunGrouping::from_last);
  }
  std::string suffix() const {
    return std::string(grouping == tandem::RunGrouping::one          ? "/one_launch"
                       : grouping == tandem::RunGrouping::per_bucket ? "/per_bucket"
                                                                     : "") +
           (chunk == PackVariant{}.chunk ? "" : "/chunk" + std::to_string(chunk)) + (plain ? "/plain_launch" : "") +
           (grid8 ? "/grid8" : "") + (overlap ? "/overlap" : "") + (prefetch ? "/prefetch" : "") +
           (user_order ? "/user_order" : "") + (lanes == tandem::item_lanes ? "" : "/lanes" + std::to_string(lanes));
  }
};

/// detail::run_items for the runs of one pass of packs or unpacks (the /overlap rows), whose runs read and write
/// disjoint memory: the pass's first run (`first`) waits for the work before it, as every tandem kernel does, and only
/// then lets the next launch start (griddepcontrol.launch_dependents), so that no later run starts before that work is
/// done; a later run starts beside the run before it, as that run's blocks end, and waits for it only before each
/// block exits, so that it ends after it (stream order is kept for whatever follows the pass). What the gaps between a
/// pass's launches cost, in the same run: a pass of 3 runs against one launch (/one_launch) and against runs as
/// launched today.
template <class Body>
__global__ void __launch_bounds__(tandem::block_threads) run_overlapping(Body body, std::size_t items, bool first) {
#if __CUDA_ARCH__ >= 900  // before, a launch is never programmatic: nothing to wait for or to let start
  if (first) asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  tandem::detail::run_slot_items(body, items);
#if __CUDA_ARCH__ >= 900
  if (!first) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/// A launch of one of the bench's own kernels over `items` as CudaBackend::launch launches run_items: a grid of the
/// blocks of it the device keeps resident (CudaBackend::resident_blocks_of, at most), programmatic where the backend's
/// launches are and the kernel waits for the one before it (where not, the rows are the plain ones).
template <auto kernel, class Body, class... Args>
void launch_as_backend(const tandem::CudaBackend& cuda, std::size_t items, cudaStream_t stream, const Body& body,
                       Args... args) {
  if (items == 0) return;
  tandem::detail::launch_kernel(
      kernel, tandem::launch_shape(items, cuda.resident_blocks_of<kernel>(), tandem::lanes_of<Body>()), stream,
      cuda.programmatic() && cuda.waits_for_prior_of<kernel>(), body, items, args...);
}

/// detail::run_items for a pack body, with each slot's next item read before it moves the current one
/// (for_each_item_of_slot_ahead; the /prefetch rows): the load of the next item's descriptor, which a warp otherwise
/// waits for between its items, is in flight while the current item's data moves. At most 40 registers (6 blocks of
/// 256 threads per SM, as run_items holds for the fp32 pack and unpack): 40 by ptxas (CUDA 13, sm_90), no spills;
/// without the bound the pack takes 48, 5 blocks per SM.
template <class Body>
__global__ void __launch_bounds__(tandem::block_threads, 6) run_prefetching(Body body, std::size_t items) {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  constexpr unsigned lanes = tandem::lanes_of<Body>();
  const unsigned lane = threadIdx.x % lanes;
  tandem::for_each_item_of_slot_ahead(
      blockIdx.x, threadIdx.x / lanes, gridDim.x, items, lanes, [&](std::size_t item) { return body.items[item]; },
      [&](const tandem::PackItem& it) { body.run(it, lane, lanes); });
}

/// A layout's user tensors (one device arena, each tensor 16-byte aligned like separate allocations), its flat
/// buckets and the resident tables of its runs, built once per (layout, variant, direction, types).
template <class UserT, class BucketT>
struct PackSetup {
  std::vector<std::size_t> sizes;
  tandem::Plan plan;
  tandem::BucketRuns runs;
  std::size_t user_bytes, flat_bytes;
  DeviceBytes user, flat;
  tandem::ResidentPackTables<tandem::CudaBackend> tables;
  bool checked = false;  ///< check() has run

  PackSetup(const std::string& layout, PackVariant v, PackDirection direction)
      : sizes(bench::layout(layout)),
        plan(sizes, options()),
        runs(plan.num_buckets(), v.runs(direction)),
        user_bytes((bench::total(sizes) + 16 * sizes.size()) * sizeof(UserT)),
        flat_bytes(plan.total_size() * sizeof(BucketT)),
        user(user_bytes),
        flat(flat_bytes) {
    std::vector<void*> pointers;
    std::size_t at = 0;
    for (std::size_t n : sizes) {
      pointers.push_back(static_cast<UserT*>(user.p) + at);
      at += (n + 15) / 16 * 16;
    }
    std::vector<tandem::PackTable> host;
    for (const tandem::Range& run : runs.runs) {
      host.push_back(tandem::make_pack_table(plan, run, pointers, v.chunk));
      // CudaBackend keeps the bucket-order list alone; /user_order puts the pack's host order (tensors in layout
      // order) in its place
      if (v.user_order) std::swap(host.back().reading_bucket, host.back().reading_user);
    }
    tables = tandem::ResidentPackTables<tandem::CudaBackend>(backend(), host, backend().stream());
    fill();
  }
  /// Both sides to 0x3e bytes: 0.186 in fp32 and bf16, not zeros.
  void fill() const {
    TANDEM_CUDA_CHECK(cudaMemset(user.p, 0x3e, user_bytes));
    TANDEM_CUDA_CHECK(cudaMemset(flat.p, 0x3e, flat_bytes));
    TANDEM_CUDA_CHECK(cudaDeviceSynchronize());
  }
  /// For a row whose kernel is the bench's own: `pass(false)`, the row's pass, writes what `pass(true)`, the same
  /// tables launched by CudaBackend::launch, writes, from the same source bytes (a pattern) into a destination poisoned
  /// alike, gaps included; throws where not. Leaves both sides as fill() does.
  template <class Pass>
  void check(PackDirection direction, cudaStream_t stream, const Pass& pass) const {
    const bool to_bucket = direction == PackDirection::to_bucket;
    void* const src = to_bucket ? user.p : flat.p;
    void* const dst = to_bucket ? flat.p : user.p;
    const std::size_t src_bytes = to_bucket ? user_bytes : flat_bytes, dst_bytes = to_bucket ? flat_bytes : user_bytes;
    std::vector<unsigned char> pattern(src_bytes), want(dst_bytes), got(dst_bytes);
    for (std::size_t i = 0; i < src_bytes; ++i) pattern[i] = static_cast<unsigned char>((i * 2654435761u) >> 11);
    TANDEM_CUDA_CHECK(cudaMemcpy(src, pattern.data(), src_bytes, cudaMemcpyHostToDevice));
    for (const bool library : {true, false}) {
      TANDEM_CUDA_CHECK(cudaMemset(dst, 0xff, dst_bytes));
      TANDEM_CUDA_CHECK(cudaDeviceSynchronize());
      pass(library);
      TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream));
      TANDEM_CUDA_CHECK(cudaMemcpy(library ? want.data() : got.data(), dst, dst_bytes, cudaMemcpyDeviceToHost));
    }
    fill();
    if (got != want) throw std::runtime_error("its output differs from CudaBackend::launch's over the same tables");
  }
  static tandem::PlanOptions options() {
    tandem::PlanOptions o;
    o.alignment_elements = 16 / std::min(sizeof(UserT), sizeof(BucketT));
    o.shard_alignment_elements = 128 / std::min(sizeof(UserT), sizeof(BucketT));
    return o;
  }
  /// Launches: one per table, each over its run.
  std::size_t launches() const { return tables.size(); }
  /// Where table k's tensor offsets count from: its run's first bucket.
  BucketT* base(std::size_t k) const { return static_cast<BucketT*>(flat.p) + plan.bucket(runs.runs[k].begin).offset; }
  static PackSetup& get(const std::string& layout, PackVariant v, PackDirection direction) {
    // The backend is built before the cache, so that at exit it is destroyed after it: the tables free themselves
    // on the backend's stream (the other order crashed the first GPU run at exit).
    backend();
    plain_backend();
    static std::map<std::string, std::unique_ptr<PackSetup>> cache;
    auto& p = cache[layout + v.suffix() + (direction == PackDirection::to_bucket ? "/pack" : "/unpack")];
    if (!p) p = std::make_unique<PackSetup>(layout, v, direction);
    return *p;
  }
};

template <class UserT, class BucketT, PackDirection Direction>
void BM_pack(benchmark::State& state, const std::string& layout, PackVariant variant) {
  auto& s = PackSetup<UserT, BucketT>::get(layout, variant, Direction);
  const tandem::CudaBackend& cuda = variant.plain ? plain_backend() : backend();
  const cudaStream_t stream = tandem::detail::native(cuda.stream());
  // A pass as the row launches it, or (`library`) by CudaBackend::launch over the same tables.
  auto pass = [&](bool library) {
    for (std::size_t j = 0; j < s.launches(); ++j) {  // in the step's order: unpacks from the last run
      const std::size_t k = Direction == PackDirection::to_bucket ? j : s.launches() - 1 - j;
      const tandem::PackTableView& t = s.tables[k];
      const auto* items = Direction == PackDirection::to_bucket ? t.reading_user : t.reading_bucket;
      using Body = tandem::PackBody<UserT, BucketT, Direction>;
      const Body body{items, t.tensors, s.base(k), 1.0f};
      if (library)
        cuda.launch(t.items, body, cuda.stream());
      else if (variant.overlap)
        launch_as_backend<run_overlapping<Body>>(cuda, t.items, stream, body, j == 0);
      else if (variant.prefetch)
        launch_as_backend<run_prefetching<Body>>(cuda, t.items, stream, body);
      else if (variant.grid8)
        tandem::detail::
            run_items<<<tandem::launch_shape(t.items, cuda.max_blocks()).grid, tandem::block_threads, 0, stream>>>(
                body, t.items);
      else if (variant.lanes == 16)
        cuda.launch(t.items, tandem::WithItemLanes<Body, 16>{body}, cuda.stream());
      else if (variant.lanes == 8)
        cuda.launch(t.items, tandem::WithItemLanes<Body, 8>{body}, cuda.stream());
      else
        cuda.launch(t.items, body, cuda.stream());
    }
  };
  auto one_pass = [&] { pass(false); };
  try {  // a stream hold that ran out (held_seconds), or output unlike the library's: this row's error
    if ((variant.overlap || variant.prefetch) && !s.checked) {
      s.check(Direction, stream, pass);
      s.checked = true;
    }
    const double mean = timed_iterations(state, stream, one_pass);
    const std::size_t n = bench::total(s.sizes);
    const std::size_t src = Direction == PackDirection::to_bucket ? sizeof(UserT) : sizeof(BucketT);
    const std::size_t dst = Direction == PackDirection::to_bucket ? sizeof(BucketT) : sizeof(UserT);
    const std::size_t traffic = n * (src + dst);
    state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * traffic));
    const CopyTimes copy = copy_seconds(cuda, traffic / 2);
    state.counters["x_copy"] = copy.held / mean;
    double unheld = 0;  // approximately the previous measure, for comparison with earlier runs (file comment)
    for (int i = 0; i < 20; ++i) unheld += event_seconds(stream, 1, one_pass);
    state.counters["x_copy_unheld"] = copy.back_to_back / (unheld / 20);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  state.counters["launches"] = static_cast<double>(s.launches());
}

template <class P>
void BM_adamw(benchmark::State& state) {
  const std::size_t n = static_cast<std::size_t>(state.range(0));
  DeviceBytes master(n * 4), grad(n * 4), s0(n * 4), s1(n * 4), param(n * sizeof(P));
  for (void* p : {master.p, grad.p, s0.p, s1.p}) TANDEM_CUDA_CHECK(cudaMemset(p, 0x3e, n * 4));  // 0.186: not zeros
  tandem::UpdateArgs<P> a;
  a.master = static_cast<float*>(master.p);
  a.param = std::is_same_v<P, float> ? reinterpret_cast<P*>(master.p) : static_cast<P*>(param.p);
  a.grad = static_cast<const float*>(grad.p);
  a.state[0] = static_cast<float*>(s0.p);
  a.state[1] = static_cast<float*>(s1.p);
  a.n = n;
  const tandem::CudaBackend& cuda = backend();
  const cudaStream_t stream = tandem::detail::native(cuda.stream());
  // the step's scalars as a DataParallel makes them: PrepareStepBody on the stream before each update
  DeviceBytes step(sizeof(std::uint64_t)), scale(sizeof(float)), options(sizeof(tandem::AdamWOptions)),
      scalars(sizeof(tandem::AdamW::Scalars));
  const tandem::AdamWOptions defaults;
  TANDEM_CUDA_CHECK(cudaMemset(step.p, 0, sizeof(std::uint64_t)));
  TANDEM_CUDA_CHECK(cudaMemcpy(options.p, &defaults, sizeof defaults, cudaMemcpyHostToDevice));
  a.grad_scale = static_cast<const float*>(scale.p);
  const tandem::detail::PrepareStepBody<tandem::AdamW> prepare{
      .step = static_cast<std::uint64_t*>(step.p),
      .grad_scale = static_cast<float*>(scale.p),
      .options = static_cast<const tandem::AdamWOptions*>(options.p),
      .scalars = static_cast<tandem::AdamW::Scalars*>(scalars.p),
      .groups = 1};
  auto update = [&] {
    cuda.launch(1, prepare, cuda.stream());
    cuda.launch(tandem::update_items(n),
                tandem::AdamW::Body<P>{a, static_cast<const tandem::AdamW::Scalars*>(scalars.p)}, cuda.stream());
  };
  try {  // a stream hold that ran out (held_seconds): this row's error
    const double mean = timed_iterations(state, stream, update);
    // read grad, master, m, v; write master, m, v (and the 16-bit param)
    const std::size_t traffic = n * (4 + 4 + 16 + 4 + (std::is_same_v<P, float> ? 0 : sizeof(P)));
    state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * traffic));
    state.counters["x_copy"] = copy_seconds(cuda, traffic / 2).held / mean;
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

#if TANDEM_BENCH_STEP
/// step() of a layout at one rank (Replicated, AdamW, fp32 parameters in the user's buffers, no clipping), eager or
/// replayed from a CUDA graph it was captured into after a first eager step (docs/cuda.md, "Capturing a step"). Its
/// floor is its memory traffic: the pack reads the gradients and writes the bucket, AdamW reads gradient, weight, m
/// and v and writes weight, m and v, the unpack reads the bucket and writes the parameters (44 bytes per element).
void BM_step(benchmark::State& state, const std::string& layout, bool graph, bool plain) {
  const std::vector<std::size_t> sizes = bench::layout(layout);
  std::size_t at = 0;
  std::vector<std::size_t> offsets;
  for (std::size_t n : sizes) {  // each tensor 16-byte aligned, as separate allocations are
    offsets.push_back(at);
    at += (n + 15) / 16 * 16;
  }
  DeviceBytes params(at * sizeof(float)), grads(at * sizeof(float));
  TANDEM_CUDA_CHECK(cudaMemset(params.p, 0x3e, at * sizeof(float)));  // 0.186: not zeros
  TANDEM_CUDA_CHECK(cudaMemset(grads.p, 0x3e, at * sizeof(float)));
  std::vector<tandem::TensorRef> refs;
  for (std::size_t i = 0; i < sizes.size(); ++i)
    refs.push_back({"t" + std::to_string(i), static_cast<float*>(params.p) + offsets[i],
                    static_cast<float*>(grads.p) + offsets[i], sizes[i], tandem::DType::fp32});
  double total = 0;
  std::string failed;
  tandem::NcclGroup({0}).run([&](tandem::Nccl& comm) {
    cudaStream_t user = nullptr;
    TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&user, cudaStreamNonBlocking));
    cudaGraph_t captured = nullptr;
    cudaGraphExec_t exec = nullptr;
    try {
      tandem::DataParallel<tandem::Replicated, tandem::AdamW, tandem::CudaBackend, tandem::Nccl> dp(
          comm, refs, {.lr = 1e-4f}, {.stream = tandem::Stream{user}},
          tandem::CudaBackend(tandem::CudaBackendOptions{.programmatic_launch = !plain}));
      dp.broadcast_parameters();
      dp.step();  // the warm-up step: whatever a first step sets up is set up
      if (graph) {
        TANDEM_CUDA_CHECK(cudaStreamBeginCapture(user, cudaStreamCaptureModeThreadLocal));
        dp.step();
        TANDEM_CUDA_CHECK(cudaStreamEndCapture(user, &captured));
        TANDEM_CUDA_CHECK(cudaGraphInstantiate(&exec, captured, 0));
      }
      auto one = [&] {
        if (graph)
          TANDEM_CUDA_CHECK(cudaGraphLaunch(exec, user));
        else
          dp.step();
      };
      one();
      for (auto _ : state) {
        const double t = event_seconds(user, 1, one);
        state.SetIterationTime(t);
        total += t;
      }
      TANDEM_CUDA_CHECK(cudaStreamSynchronize(user));
    } catch (const std::exception& e) {
      failed = e.what();
    }
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    if (captured != nullptr) cudaGraphDestroy(captured);
    cudaStreamDestroy(user);
  });
  if (!failed.empty()) {
    state.SkipWithError(failed.c_str());
    return;
  }
  const std::size_t traffic = bench::total(sizes) * (8 + 28 + 8);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * traffic));
  state.counters["x_copy"] =
      copy_seconds(backend(), traffic / 2).held / (total / static_cast<double>(state.iterations()));
}
#endif

void register_all() {
  const PackVariant as_step{};
  for (const char* name : {"gpt2", "10000x1KB"}) {
    const std::string l = name;
    benchmark::RegisterBenchmark(("cuda_pack/fp32->fp32/" + l).c_str(), BM_pack<float, float, PackDirection::to_bucket>,
                                 l, as_step)
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("cuda_unpack/fp32->fp32/" + l).c_str(),
                                 BM_pack<float, float, PackDirection::from_bucket>, l, as_step)
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("cuda_pack/bf16->fp32/" + l).c_str(),
                                 BM_pack<tandem::BFloat16, float, PackDirection::to_bucket>, l, as_step)
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
  }
  benchmark::RegisterBenchmark("cuda_adamw/fp32", BM_adamw<float>)
      ->RangeMultiplier(16)
      ->Range(1 << 20, 1 << 28)
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("cuda_adamw/bf16", BM_adamw<tandem::BFloat16>)
      ->RangeMultiplier(16)
      ->Range(1 << 20, 1 << 28)
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
#if TANDEM_BENCH_STEP
  for (const bool plain : {false, true})
    for (const bool graph : {false, true})  // one call each: a DataParallel of GPT-2's size is built per call
      benchmark::RegisterBenchmark(
          (std::string(graph ? "cuda_step/graph/gpt2" : "cuda_step/eager/gpt2") + (plain ? "/plain_launch" : ""))
              .c_str(),
          BM_step, std::string("gpt2"), graph, plain)
          ->Iterations(20)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
#endif
  // What plain launches, a launch per bucket, one launch over every bucket, larger or smaller items, 16 or 8 lanes per
  // item (two or four items per warp), each warp's next item read ahead, and the pack's items in the host's order
  // give (no target: they say where to go next). /chunk1024/user_order is the pack as it was before 512-element items.
  // Last, so that a run cut short by its time bound still has every target's row.
  for (const PackVariant v :
       {PackVariant{.plain = true}, PackVariant{.grid8 = true}, PackVariant{.overlap = true},
        PackVariant{.prefetch = true}, PackVariant{.grouping = tandem::RunGrouping::per_bucket},
        PackVariant{.grouping = tandem::RunGrouping::one}, PackVariant{.chunk = 1024}, PackVariant{.chunk = 2048},
        PackVariant{.chunk = 4096}, PackVariant{.lanes = 16}, PackVariant{.lanes = 8}, PackVariant{.user_order = true},
        PackVariant{.chunk = 1024, .user_order = true}})
    for (const char* name : {"gpt2", "10000x1KB"}) {
      const std::string l = name;
      // 1 KB tensors are one item whatever the size, in nearly the same order either way
      if (l != "gpt2" && (v.chunk != PackVariant{}.chunk || v.user_order)) continue;
      benchmark::RegisterBenchmark(("cuda_pack/fp32->fp32/" + l + v.suffix()).c_str(),
                                   BM_pack<float, float, PackDirection::to_bucket>, l, v)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
      if (v.user_order) continue;  // the unpack reads the bucket's order, as before
      benchmark::RegisterBenchmark(("cuda_unpack/fp32->fp32/" + l + v.suffix()).c_str(),
                                   BM_pack<float, float, PackDirection::from_bucket>, l, v)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
    }
}

}  // namespace

int main(int argc, char** argv) {
  if (tandem::visible_cuda_devices() == 0) {
    std::printf("bench_cuda: no CUDA device, nothing to measure\n");
    return 0;
  }
  for (int i = 1; i < argc; ++i)  // --unheld (hold_streams) is ours: taken out before Google Benchmark's flags
    if (std::string(argv[i]) == "--unheld") {
      hold_streams = false;
      for (int j = i; j + 1 < argc; ++j) argv[j] = argv[j + 1];
      --argc;
      --i;
    }
  benchmark::Initialize(&argc, argv);
  register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
