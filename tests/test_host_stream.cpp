// SPDX-License-Identifier: Apache-2.0
// The stream-faithful host backend (backend/host_stream.hpp): streams run their work in order on worker threads,
// events order streams, errors are sticky, buffers are freed in stream order; and DataParallel's stream protocol
// on it, with the user's work on a stream of its own, as a GPU user's backward is. Labels "host" and "streams".
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <vector>

#include "../examples/mlp/mlp.hpp"
#include "support/backend.hpp"
#include "support/params.hpp"
#include "tandem/tandem.hpp"

namespace {

using namespace std::chrono_literals;

/// A launch body that runs f() once (one item): the "kernel" a test enqueues on a stream.
template <class F>
struct Task {
  F f;
  void operator()(std::size_t, unsigned, unsigned) const { f(); }
};
template <class F>
Task(F) -> Task<F>;

/// A gate that work on a stream waits at (pass()) until the test opens it (release()), once `free_passes` have gone
/// through; bounded, so that a stream protocol that waits for the work where it must not fails the test instead of
/// hanging it. GatedComm holds collectives of one kind at it.
struct Gate {
  enum class Holds { reductions, gathers } holds = Holds::reductions;
  int free_passes = 0;
  std::mutex mutex;
  std::condition_variable opened;
  bool open = false;
  std::atomic<int> passed{0};
  void pass() {
    std::unique_lock lock(mutex);
    if (passed >= free_passes) opened.wait_for(lock, 10s, [this] { return open; });
    ++passed;
  }
  void release() {
    {
      const std::lock_guard lock(mutex);
      open = true;
    }
    opened.notify_all();
  }
};

}  // namespace

TEST_CASE("a HostStream runs its work in order, after the delays, on its own thread") {
  tandem::HostStream stream({.max_delay = 200us, .seed = 7});
  const tandem::StreamHostBackend backend;
  std::vector<int> order;
  std::thread::id worker;
  for (int i = 0; i < 50; ++i)
    backend.launch(1, Task{[&order, &worker, i] {
                     worker = std::this_thread::get_id();
                     order.push_back(i);
                   }},
                   stream.stream());
  stream.synchronize();
  REQUIRE(order.size() == 50);
  CHECK(std::is_sorted(order.begin(), order.end()));
  CHECK(worker != std::this_thread::get_id());
}

TEST_CASE("an event orders one stream after another; a never-recorded event orders nothing") {
  tandem::HostStream slow({.max_delay = 500us, .seed = 1}), fast;
  const tandem::StreamHostBackend backend;
  tandem::HostEvent never;
  backend.wait(fast.stream(), never);  // waiting on an event never recorded does nothing
  for (int round = 0; round < 20; ++round) {
    int value = 0, seen = -1;
    backend.launch(1, Task{[&value] {
                     std::this_thread::sleep_for(1ms);
                     value = 42;
                   }},
                   slow.stream());
    tandem::HostEvent done;
    backend.record(done, slow.stream());
    backend.wait(fast.stream(), done);
    backend.launch(1, Task{[&value, &seen] { seen = value; }}, fast.stream());
    fast.synchronize();
    CHECK(seen == 42);
    slow.synchronize();
  }
}

TEST_CASE("an event waits for the record made before the wait, not a later one") {
  tandem::HostStream a, b;
  const tandem::StreamHostBackend backend;
  tandem::HostEvent e;
  std::atomic<bool> release{false};
  std::atomic<int> stage{0};
  backend.launch(1, Task{[&stage] { stage = 1; }}, a.stream());
  backend.record(e, a.stream());  // reached once stage is 1
  backend.wait(b.stream(), e);
  int seen = -1;
  backend.launch(1, Task{[&stage, &seen] { seen = stage.load(); }}, b.stream());
  backend.launch(1, Task{[&release, &stage] {
                   while (!release) std::this_thread::yield();
                   stage = 2;
                 }},
                 a.stream());
  backend.record(e, a.stream());  // a later record: b must not wait for it
  b.synchronize();                // would hang if b waited for the second record
  CHECK(seen == 1);
  release = true;
  a.synchronize();
}

TEST_CASE("a wait is released by the record it saw, not by a later record on another stream") {
  tandem::HostStream a, b, c;
  const tandem::StreamHostBackend backend;
  std::atomic<bool> release{false};
  std::atomic<int> stage{0};
  backend.launch(1, Task{[&release, &stage] {
                   while (!release) std::this_thread::yield();
                   stage = 1;
                 }},
                 a.stream());
  tandem::HostEvent e;
  backend.record(e, a.stream());  // reached once stage is 1
  backend.wait(c.stream(), e);
  int seen = -1;
  backend.launch(1, Task{[&stage, &seen] { seen = stage.load(); }}, c.stream());
  backend.record(e, b.stream());  // b is idle: this record is reached at once, but c waits for a's
  b.synchronize();
  std::this_thread::sleep_for(5ms);
  release = true;
  c.synchronize();
  CHECK(seen == 1);
  a.synchronize();
}

TEST_CASE("a capture records work without running it; each replay runs it again, ordered across the joined streams") {
  tandem::HostStream origin({.max_delay = 200us, .seed = 5}), side({.max_delay = 200us, .seed = 6});
  const tandem::StreamHostBackend backend;
  std::mutex m;
  std::vector<int> order;
  auto push = [&](int v) {
    std::lock_guard lock(m);
    order.push_back(v);
  };
  origin.begin_capture();
  backend.launch(1, Task{[&] { push(1); }}, origin.stream());
  tandem::HostEvent fork, join;
  backend.record(fork, origin.stream());
  backend.wait(side.stream(), fork);  // side joins the capture
  backend.launch(1, Task{[&] {
                   std::this_thread::sleep_for(2ms);
                   push(2);
                 }},
                 side.stream());
  backend.record(join, side.stream());
  backend.wait(origin.stream(), join);  // and rejoins
  backend.launch(1, Task{[&] { push(3); }}, origin.stream());
  const tandem::HostGraph graph = origin.end_capture();
  CHECK(graph.size() == 7);
  origin.synchronize();
  side.synchronize();
  CHECK(order.empty());  // captured, not run
  for (int k = 0; k < 3; ++k) graph.replay();
  origin.synchronize();
  CHECK(order == std::vector<int>{1, 2, 3, 1, 2, 3, 1, 2, 3});
  // the streams capture no more: work runs
  backend.launch(1, Task{[&] { push(4); }}, side.stream());
  side.synchronize();
  CHECK(order.back() == 4);
}

TEST_CASE("a replay runs in the capturing stream's order alone, as a CUDA graph: not in the joined streams' orders") {
  // The joined stream's part of a replay waits neither for the work enqueued on the joined stream before the replay
  // nor holds up the work enqueued there after it; a failure in it reaches the capturing stream, not the joined one.
  // (The stand-in replayed the part on the joined stream itself, in its order: stricter than CUDA, and so blind to a
  // missing event between the capturing stream and work on the joined stream.)
  tandem::HostStream origin({.max_delay = 200us, .seed = 7}), side({.max_delay = 200us, .seed = 8});
  const tandem::StreamHostBackend backend;
  std::atomic<int> joined_part{0};
  std::atomic<bool> fail{false};
  origin.begin_capture();
  tandem::HostEvent fork, join;
  backend.record(fork, origin.stream());
  backend.wait(side.stream(), fork);
  backend.launch(1, Task{[&] {
                   if (fail) throw std::runtime_error("the joined part failed");
                   ++joined_part;
                 }},
                 side.stream());
  backend.record(join, side.stream());
  backend.wait(origin.stream(), join);
  const tandem::HostGraph graph = origin.end_capture();
  // a launch on `on` held at `gate`, which sets `done` when it ends
  auto held = [&](tandem::HostStream& on, Gate& gate, std::atomic<bool>& done) {
    backend.launch(1, Task{[&gate, &done] {
                     gate.pass();
                     done = true;
                   }},
                   on.stream());
  };
  {
    Gate gate;  // work held on the joined stream does not hold up the replay
    std::atomic<bool> held_done{false};
    held(side, gate, held_done);
    graph.replay();
    origin.synchronize();
    CHECK(joined_part == 1);
    CHECK(!held_done);  // (else the replay waited for the gate to time out)
    gate.release();
    side.synchronize();
  }
  {
    Gate gate;  // a held replay does not hold up later work on the joined stream
    std::atomic<bool> held_done{false};
    held(origin, gate, held_done);
    graph.replay();
    int seen = -1;
    backend.launch(1, Task{[&] { seen = joined_part; }}, side.stream());
    side.synchronize();
    CHECK(seen == 1);  // before the held replay's joined part
    CHECK(!held_done);
    gate.release();
    origin.synchronize();
    CHECK(joined_part == 2);
  }
  fail = true;
  graph.replay();
  CHECK_THROWS_WITH_AS(origin.synchronize(), doctest::Contains("the joined part failed"), std::runtime_error);
  side.synchronize();  // the joined stream has not failed
}

TEST_CASE("a capturing stream, or one that joined the capture, cannot wait on an event recorded outside it") {
  // CUDA refuses it (cudaErrorStreamCaptureIsolation); the stand-in accepted it, and replayed the wait.
  tandem::HostStream a, b, c;
  const tandem::StreamHostBackend backend;
  tandem::HostEvent before, fork;
  backend.record(before, c.stream());
  c.synchronize();  // reached, even: CUDA refuses the wait all the same
  a.begin_capture();
  CHECK_THROWS_WITH_AS(backend.wait(a.stream(), before), doctest::Contains("recorded outside the capture"),
                       tandem::error);
  backend.record(fork, a.stream());
  backend.wait(b.stream(), fork);  // b joins
  CHECK_THROWS_WITH_AS(backend.wait(b.stream(), before), doctest::Contains("recorded outside the capture"),
                       tandem::error);
  tandem::HostEvent join;
  backend.record(join, b.stream());
  backend.wait(a.stream(), join);
  (void)a.end_capture();
  backend.wait(a.stream(), before);  // outside a capture, as ever
  a.synchronize();
}

TEST_CASE("a capturing stream cannot be waited for, and a stream that joined a capture must rejoin it") {
  tandem::HostStream a, b;
  const tandem::StreamHostBackend backend;
  a.begin_capture();
  CHECK_THROWS_WITH_AS(a.begin_capture(), doctest::Contains("capturing already"), tandem::error);
  CHECK_THROWS_WITH_AS(a.synchronize(), doctest::Contains("while capturing"), tandem::error);
  float x = 1.0f, y = 0.0f;
  CHECK_THROWS_WITH_AS(backend.read(&y, &x, sizeof x, a.stream()), doctest::Contains("while capturing"), tandem::error);
  tandem::HostEvent e;
  backend.record(e, a.stream());
  CHECK_THROWS_WITH_AS(backend.wait(tandem::Stream{}, e), doctest::Contains("recorded during a capture"),
                       tandem::error);
  backend.wait(b.stream(), e);  // b joins
  int ran = 0;
  backend.launch(1, Task{[&] { ++ran; }}, b.stream());
  CHECK_THROWS_WITH_AS(b.end_capture(), doctest::Contains("did not begin a capture"), tandem::error);
  CHECK_THROWS_WITH_AS(a.end_capture(), doctest::Contains("did not rejoin"), tandem::error);
  // the failed end left neither stream capturing
  backend.launch(1, Task{[&] { ++ran; }}, b.stream());
  b.synchronize();
  a.synchronize();
  CHECK(ran == 1);
}

TEST_CASE("an error is sticky on its stream, passes through events, and never hangs a waiter") {
  tandem::HostStream failing, downstream;
  const tandem::StreamHostBackend backend;
  bool ran_after = false;
  std::atomic<bool> go{false};
  backend.launch(1, Task{[&go] {  // holds the stream until everything below is enqueued
                   while (!go) std::this_thread::yield();
                 }},
                 failing.stream());
  backend.launch(1, Task{[] { throw tandem::error("injected failure"); }}, failing.stream());
  backend.launch(1, Task{[&ran_after] { ran_after = true; }}, failing.stream());
  tandem::HostEvent e;
  backend.record(e, failing.stream());
  backend.wait(downstream.stream(), e);
  go = true;
  CHECK_THROWS_WITH_AS(failing.synchronize(), "injected failure", tandem::error);
  CHECK_FALSE(ran_after);
  CHECK_THROWS_WITH_AS(downstream.synchronize(), "injected failure", tandem::error);
  CHECK_THROWS_WITH_AS(backend.zero(&ran_after, 1, failing.stream()), "injected failure", tandem::error);
  CHECK_THROWS_WITH_AS(backend.wait(tandem::Stream{}, e), "injected failure", tandem::error);
}

TEST_CASE("a buffer is freed in stream order, poisoned when it begins and when it ends") {
  const tandem::StreamHostBackend backend;
  float seen = 0.0f;
  {
    auto buffer = backend.allocate<float>(16);
    float fresh = 0.0f;
    backend.read(&fresh, buffer.data(), sizeof fresh, backend.stream());
    CHECK(std::isnan(fresh));  // uninitialised memory reads as NaN
    backend.launch(1, Task{[p = buffer.data()] { p[3] = 5.0f; }}, backend.stream());
    backend.launch(1, Task{[p = buffer.data(), &seen] {  // a slow reader, still queued when the buffer goes
                     std::this_thread::sleep_for(20ms);
                     seen = p[3];
                   }},
                   backend.stream());
  }  // freed (and poisoned) after the reader, on the work stream; an eager free would leave it NaN
  backend.synchronize(backend.stream());
  CHECK(seen == 5.0f);
}

TEST_CASE("LocalComm enqueues its collectives on a HostStream, in call order") {
  tandem::LocalGroup group(3);
  group.run([&](tandem::LocalComm& comm) {
    tandem::HostStream stream({.max_delay = 100us, .seed = static_cast<std::uint64_t>(comm.rank())});
    const tandem::StreamHostBackend backend;
    std::vector<float> x(100), sum(100), all(300);
    backend.launch(1, Task{[&x, r = comm.rank()] { std::fill(x.begin(), x.end(), float(r + 1)); }}, stream.stream());
    comm.all_reduce(x.data(), sum.data(), x.size(), tandem::DType::fp32, tandem::ReduceOp::sum, stream.stream());
    comm.all_gather(x.data(), all.data(), x.size(), tandem::DType::fp32, stream.stream());
    comm.barrier();  // a call without a stream waits for the ones enqueued before it
    CHECK(sum == std::vector<float>(100, 6.0f));
    for (int q = 0; q < 3; ++q) CHECK(all[static_cast<std::size_t>(q) * 100 + 7] == float(q + 1));
  });
}

TEST_CASE(
    "a replayed collective takes its place among the rank's others at the replay, as NCCL's at a graph's launch") {
  // Each rank captures an all-reduce on one stream. Rank 0 holds that stream at a gate, replays the capture, and then
  // calls an all-gather on another stream; rank 1 does the same without a gate. Called after the replay, the
  // all-gather runs after the replayed all-reduce on both ranks, so the ranks' collectives pair up. (Replayed out of
  // the rank's order, rank 0's all-gather would meet rank 1's all-reduce, and LocalComm would throw a mismatch.)
  tandem::LocalGroup group(2);
  group.run([&](tandem::LocalComm& comm) {
    tandem::HostStream captured, other;
    const tandem::StreamHostBackend backend;
    const float mine = float(comm.rank() + 1);
    float sum = 0.0f;
    std::vector<float> all(2, 0.0f);
    captured.begin_capture();
    comm.all_reduce(&mine, &sum, 1, tandem::DType::fp32, tandem::ReduceOp::sum, captured.stream());
    const tandem::HostGraph graph = captured.end_capture();
    Gate gate;
    if (comm.rank() == 0) backend.launch(1, Task{[&] { gate.pass(); }}, captured.stream());
    graph.replay();
    comm.all_gather(&mine, all.data(), 1, tandem::DType::fp32, other.stream());
    std::this_thread::sleep_for(20ms);  // time for an all-gather out of order to run first
    gate.release();
    other.synchronize();
    CHECK(sum == 3.0f);  // the all-gather ran after the replay's all-reduce
    CHECK(all == std::vector<float>{1.0f, 2.0f});
    captured.synchronize();
  });
}

TEST_CASE("a rank that throws with collectives still queued on its stream: run() rethrows, nothing dangles") {
  std::vector<std::unique_ptr<tandem::HostStream>> streams;  // outlive run(): their queued work must not
  for (int r = 0; r < 3; ++r) streams.push_back(std::make_unique<tandem::HostStream>());
  std::vector<std::vector<float>> x(3, std::vector<float>(64, 1.0f));
  tandem::LocalGroup group(3);
  CHECK_THROWS_WITH_AS(group.run([&](tandem::LocalComm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    const tandem::StreamHostBackend backend;
    backend.launch(1, Task{[] { std::this_thread::sleep_for(30ms); }}, streams[r]->stream());
    comm.all_reduce(x[r].data(), x[r].data(), 64, tandem::DType::fp32, tandem::ReduceOp::sum, streams[r]->stream());
    if (r == 1) throw std::runtime_error("rank 1 fails with its all_reduce still queued");
    comm.all_reduce(x[r].data(), x[r].data(), 64, tandem::DType::fp32, tandem::ReduceOp::sum, streams[r]->stream());
    streams[r]->synchronize();
  }),
                       "rank 1 fails with its all_reduce still queued", std::runtime_error);
  for (auto& s : streams) CHECK_THROWS_AS(s->synchronize(), tandem::error);  // each stream's collective failed
}

// ---- DataParallel with the user's work on a stream of its own -----------------------------------------------------

namespace {

struct Tensors {
  std::vector<std::vector<float>> params, grads;
  std::vector<tandem::TensorRef> refs;
  explicit Tensors(const std::vector<std::size_t>& sizes) : params(sizes.size()), grads(sizes.size()) {
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      params[i].assign(sizes[i], 0.0f);
      grads[i].assign(sizes[i], 0.0f);
      for (std::size_t e = 0; e < sizes[i]; ++e) params[i][e] = 0.01f * static_cast<float>((e * 7 + i) % 13);
      refs.push_back({"t" + std::to_string(i), params[i].data(), grads[i].data(), sizes[i], tandem::DType::fp32});
    }
  }
};

const std::vector<std::size_t> small_sizes = {37, 300, 129, 64, 1000};

}  // namespace

TEST_CASE_TEMPLATE("grad_ready for every tensor, then more work on the user's stream: step() waits for it", Policy,
                   tandem::Replicated, tandem::OptimizerSharded, tandem::GradientSharded) {
  tandem::LocalGroup group(2);
  group.run([&](tandem::LocalComm& comm) {
    tandem::HostStream user;
    Tensors t(small_sizes);
    tandem::DataParallel<Policy, tandem::SGD, tandem::StreamHostBackend> dp(
        comm, t.refs, {.lr = 0.5f}, {.bucket_cap_bytes = 1024, .first_bucket_cap_bytes = 512, .stream = user.stream()});
    dp.broadcast_parameters();
    user.synchronize();
    const tandem::StreamHostBackend backend;
    for (int step = 0; step < 3; ++step) {
      const test::Params before = t.params;
      backend.launch(1, Task{[&t, step] {  // backward writes the gradients
                       for (auto& g : t.grads) std::fill(g.begin(), g.end(), 1.0f + float(step));
                     }},
                     user.stream());
      for (std::size_t i = t.refs.size(); i-- > 0;) dp.grad_ready(i);  // every bucket goes out now
      test::Params seen;
      backend.launch(1, Task{[&t, &seen] {  // the user's stream still reads the parameters (a metric, say)
                       std::this_thread::sleep_for(20ms);
                       seen = t.params;
                     }},
                     user.stream());
      CHECK(dp.step().updated);
      user.synchronize();
      CHECK_MESSAGE(test::bitwise_equal(seen, before),
                    "step() updated the parameters while the user's stream read them");
      CHECK_FALSE(test::bitwise_equal(t.params, before));
    }
  });
}

namespace {

/// LocalComm whose fp32 all-reduces and reduce-scatters (the gradients'), or fp32 all-gathers (the parameters'),
/// first wait at the gate, on their stream.
struct GatedComm {
  tandem::LocalComm& comm;
  Gate& gate;
  int rank() const { return comm.rank(); }
  int size() const { return comm.size(); }
  void all_reduce(const void* s, void* r, std::size_t n, tandem::DType d, tandem::ReduceOp op, tandem::Stream st) {
    hold(Gate::Holds::reductions, d, st);
    comm.all_reduce(s, r, n, d, op, st);
  }
  void reduce_scatter(const void* s, void* r, std::size_t n, tandem::DType d, tandem::ReduceOp op, tandem::Stream st) {
    hold(Gate::Holds::reductions, d, st);
    comm.reduce_scatter(s, r, n, d, op, st);
  }
  void all_gather(const void* s, void* r, std::size_t n, tandem::DType d, tandem::Stream st) {
    hold(Gate::Holds::gathers, d, st);
    comm.all_gather(s, r, n, d, st);
  }
  void broadcast(const void* s, void* r, std::size_t n, tandem::DType d, int root, tandem::Stream st) {
    comm.broadcast(s, r, n, d, root, st);
  }
  void barrier() { comm.barrier(); }

 private:
  void hold(Gate::Holds kind, tandem::DType d, tandem::Stream st) {
    if (kind != gate.holds || d != tandem::DType::fp32) return;
    tandem::HostStream* q = tandem::detail::host_queue(st);
    REQUIRE(q != nullptr);
    q->enqueue([g = &gate] { g->pass(); });
  }
};
static_assert(tandem::Communicator<GatedComm>);

}  // namespace

TEST_CASE_TEMPLATE(
    "a bucket is packed on the work stream while the previous bucket's reduction waits on the comm stream", Policy,
    tandem::Replicated, tandem::OptimizerSharded) {
  // Copy mode, two buckets of one tensor each. Bucket 0's all-reduce (reduce-scatter) is held at the gate; the work
  // stream must still pack bucket 1: it finishes its work while the gate is shut, and the pack has read tensor 0's
  // gradients by then (they are changed afterwards, and the update does not see the change).
  tandem::LocalGroup group(1);
  group.run([&](tandem::LocalComm& local) {
    Gate gate;
    GatedComm comm{local, gate};
    tandem::HostStream user;
    Tensors t({1000, 1000});
    const test::Params start = t.params;
    tandem::StreamHostBackend backend;
    const tandem::Stream work = backend.stream();
    tandem::DataParallel<Policy, tandem::SGD, tandem::StreamHostBackend, GatedComm> dp(
        comm, t.refs, {.lr = 0.5f}, {.bucket_cap_bytes = 4096, .first_bucket_cap_bytes = 4096, .stream = user.stream()},
        std::move(backend));
    REQUIRE(dp.num_buckets() == 2);
    dp.broadcast_parameters();
    const tandem::StreamHostBackend launcher;
    launcher.launch(1, Task{[&t] {  // backward writes the gradients
                      for (auto& g : t.grads) std::fill(g.begin(), g.end(), 1.0f);
                    }},
                    user.stream());
    dp.grad_ready(1);  // bucket 0 (the last tensor): packed, then its reduction held at the gate
    dp.grad_ready(0);  // bucket 1: packed on the work stream
    auto packed = std::async(std::launch::async, [work] { tandem::detail::host_queue(work)->synchronize(); });
    const bool beside = packed.wait_for(5s) == std::future_status::ready;
    CHECK_MESSAGE(beside, "the work stream waited for bucket 0's reduction before packing bucket 1");
    CHECK(gate.passed == 0);
    std::fill(t.grads[0].begin(), t.grads[0].end(), 100.0f);  // too late for the pack, if it ran
    gate.release();
    packed.get();
    CHECK(dp.step().updated);
    user.synchronize();
    CHECK(gate.passed == 2);
    for (std::size_t i = 0; i < 2; ++i)
      for (std::size_t e = 0; e < t.params[i].size(); e += 97) CHECK(t.params[i][e] == start[i][e] - 0.5f);
  });
}

TEST_CASE("ParametersReady: the user's stream reads the bucket gathered first while the next one is held, or waits") {
  // OptimizerSharded, copy mode, two buckets of one tensor each. step() gathers bucket 1 (tensor 0, the first layer)
  // first; bucket 0's gather is held at the gate. Under by_bucket the user's stream, after wait_parameters(1), reads
  // tensor 0's updated values while the gate is shut, and tensor 1's after wait_parameters(0). Under at_step it
  // waits for both gathers when step() returns.
  for (const tandem::ParametersReady ready : {tandem::ParametersReady::by_bucket, tandem::ParametersReady::at_step}) {
    CAPTURE(ready);
    tandem::LocalGroup(1).run([&](tandem::LocalComm& local) {
      Gate gate;
      gate.holds = Gate::Holds::gathers;
      GatedComm comm{local, gate};
      tandem::HostStream user;
      Tensors t({1000, 1000});
      const test::Params start = t.params;
      tandem::DataParallel<tandem::OptimizerSharded, tandem::SGD, tandem::StreamHostBackend, GatedComm> dp(
          comm, t.refs, {.lr = 0.5f},
          {.bucket_cap_bytes = 4096,
           .first_bucket_cap_bytes = 4096,
           .parameters_ready = ready,
           .stream = user.stream()});
      REQUIRE(dp.num_buckets() == 2);
      REQUIRE(dp.plan().bucket(1).tensors == std::vector<std::size_t>{0});
      dp.broadcast_parameters();
      const tandem::StreamHostBackend launcher;
      launcher.launch(1, Task{[&t] {  // backward writes the gradients
                        for (auto& g : t.grads) std::fill(g.begin(), g.end(), 1.0f);
                      }},
                      user.stream());
      gate.free_passes = 1;  // bucket 1's gather
      CHECK(dp.step().updated);
      dp.wait_parameters(1);
      std::vector<float> first;
      launcher.launch(1, Task{[&t, &first] { first = t.params[0]; }}, user.stream());  // the forward reads bucket 1
      auto read = std::async(std::launch::async, [&user] { user.synchronize(); });
      const bool beside =
          read.wait_for(ready == tandem::ParametersReady::by_bucket ? 5s : 200ms) == std::future_status::ready;
      CHECK(beside == (ready == tandem::ParametersReady::by_bucket));
      CHECK(gate.passed == 1);
      gate.release();
      read.get();
      for (std::size_t e = 0; e < first.size(); e += 97) CHECK(first[e] == start[0][e] - 0.5f);
      dp.wait_parameters(0);
      user.synchronize();
      for (std::size_t e = 0; e < t.params[1].size(); e += 97) CHECK(t.params[1][e] == start[1][e] - 0.5f);
      CHECK(gate.passed == 2);
      CHECK_THROWS_WITH_AS(dp.wait_parameters(2),
                           "tandem: wait_parameters(2): bucket out of range; the plan has 2 buckets", tandem::error);
    });
  }
}

TEST_CASE("destroying DataParallel waits for the user's stream before its buffers are freed") {
  tandem::LocalGroup group(1);
  group.run([&](tandem::LocalComm& comm) {
    tandem::HostStream user;
    std::vector<float> seen(64, -1.0f);
    {
      tandem::DataParallel<tandem::Replicated, tandem::SGD, tandem::StreamHostBackend> dp(
          comm, std::vector<tandem::TensorSpec>{{"w", 64, tandem::DType::fp32}}, {.lr = 0.1f},
          {.stream = user.stream()});
      float* w = dp.param_view<float>(0);
      const tandem::StreamHostBackend backend;
      backend.launch(1, Task{[w] { std::fill(w, w + 64, 3.0f); }}, user.stream());  // initial values, on the stream
      dp.broadcast_parameters();
      backend.launch(1, Task{[w, &seen] {  // the user's stream reads a view, slowly
                       std::this_thread::sleep_for(20ms);
                       std::copy(w, w + 64, seen.begin());
                     }},
                     user.stream());
    }
    user.synchronize();
    CHECK(seen == std::vector<float>(64, 3.0f));
  });
}

namespace {

/// Trains the MLP example, each micro-step's backward enqueued on the user's stream after a random delay and its
/// gradients announced with grad_ready right after (no synchronisation), under Backend; rank 0's final parameters.
template <class Policy, class Backend>
test::Params train_on_user_stream(int world, int accumulation) {
  const std::vector<int> dims = {13, 37, 29, 23, 7};
  const int global_batch = 12, steps = 6;
  const mlp::Dataset data(global_batch * accumulation * steps, dims.front(), dims.back(), 7);
  test::Params result;
  std::mutex m;
  tandem::LocalGroup group(world);
  group.run([&](tandem::LocalComm& comm) {
    // HostBackend runs everything on the calling thread: there the user's work must too (Stream{}).
    constexpr bool streamed = !std::is_same_v<Backend, tandem::HostBackend>;
    tandem::HostStream user({.max_delay = 300us, .seed = 99u + static_cast<std::uint64_t>(comm.rank())});
    const tandem::Stream user_stream = streamed ? user.stream() : tandem::Stream{};
    mlp::Mlp<float> model(dims, 42 + static_cast<std::uint64_t>(comm.rank()) * 1000);
    tandem::DataParallel<Policy, tandem::AdamW, Backend> dp(comm, model.tensors(), {.lr = 3e-3f},
                                                            {.bucket_cap_bytes = 1024,
                                                             .first_bucket_cap_bytes = 512,
                                                             .accumulation_steps = accumulation,
                                                             .max_grad_norm = 1.0f,
                                                             .non_finite = tandem::NonFinite::skip_step,
                                                             .stream = user_stream},
                                                            Backend{});
    dp.broadcast_parameters(world - 1);
    const int local = global_batch / world;
    const tandem::StreamHostBackend enqueue;
    for (int step = 0; step < steps; ++step)
      for (int micro = 0; micro < accumulation; ++micro) {
        const int begin = (step * accumulation + micro) * global_batch + comm.rank() * local;
        enqueue.launch(1, Task{[&model, &data, begin, local] { model.forward_backward(data, begin, local); }},
                       user_stream);
        for (std::size_t i = model.tensors().size(); i-- > 0;) dp.grad_ready(i);
        dp.step();
      }
    user.synchronize();
    if (comm.rank() == 0) {
      std::lock_guard lock(m);
      result = test::as_float(model.params());
    }
  });
  return result;
}

/// Enqueues on the user's stream (`on_user`) the copy of every bucket's parameters (its ParameterBucket) into `model`,
/// the last bucket first, as a forward pass reads them; `prefetch`: each bucket prefetches the one after it.
template <class DP, class OnUser>
void read_into_model(DP& dp, mlp::Mlp<float>& model, const OnUser& on_user, bool prefetch) {
  for (std::size_t b = dp.num_buckets(); b-- > 0;) {
    auto params = dp.parameters(b);
    if (prefetch && b > 0) dp.prefetch_parameters(b - 1);
    for (std::size_t i : params.tensors())
      on_user([&model, i, view = params.template param<float>(i)] {
        std::copy(view, view + model.params()[i].size(), model.params()[i].begin());
      });
  }
}

/// Enqueues the addition of `model`'s gradients into every bucket's GradientBucket views.
template <class DP, class OnUser>
void add_model_gradients(DP& dp, mlp::Mlp<float>& model, const OnUser& on_user) {
  for (std::size_t b = 0; b < dp.num_buckets(); ++b) {
    auto bucket = dp.gradients(b);
    for (std::size_t i : bucket.tensors())
      on_user([&model, i, g = bucket.grad(i)] {
        for (std::size_t e = 0; e < model.grads()[i].size(); ++e) g[e] += model.grads()[i][e];
      });
  }
}

/// Every tensor's parameters, read through the ParameterBuckets on the user's stream (synchronize it before use).
template <class DP, class OnUser>
test::Params read_parameters(DP& dp, const std::vector<tandem::TensorSpec>& specs, const OnUser& on_user) {
  test::Params final(specs.size());
  for (std::size_t b = 0; b < dp.num_buckets(); ++b) {
    auto params = dp.parameters(b);
    for (std::size_t i : params.tensors())
      on_user([&final, &specs, i, view = params.template param<float>(i)] {
        final[i].assign(view, view + specs[i].numel);
      });
  }
  return final;
}

/// The same with owned storage: the user's stream writes the initial parameters (initialize_parameters), reads each
/// bucket's parameters from its ParameterBucket (reused gather buffers under ParameterSharded, with the next bucket
/// prefetched), runs backward and adds the gradients into each bucket's GradientBucket views (reused buffers under
/// GradientSharded and ParameterSharded), all enqueued without waiting; tandem must order its gathers, reductions and
/// the buffers' zeroing around that work.
template <class Policy, class Backend>
test::Params train_owned_on_user_stream(int world, int accumulation, int buffers) {
  const std::vector<int> dims = {13, 37, 29, 23, 7};
  const int global_batch = 12, steps = 6;
  const mlp::Dataset data(global_batch * accumulation * steps, dims.front(), dims.back(), 7);
  test::Params result;
  std::mutex m;
  tandem::LocalGroup group(world);
  group.run([&](tandem::LocalComm& comm) {
    constexpr bool streamed = !std::is_same_v<Backend, tandem::HostBackend>;
    tandem::HostStream user({.max_delay = 300us, .seed = 7u + static_cast<std::uint64_t>(comm.rank())});
    const tandem::Stream user_stream = streamed ? user.stream() : tandem::Stream{};
    mlp::Mlp<float> model(dims, 42 + static_cast<std::uint64_t>(comm.rank()) * 1000);
    std::vector<tandem::TensorSpec> specs;
    for (const auto& t : model.tensors()) specs.push_back({t.name, t.numel, t.dtype});
    tandem::DataParallel<Policy, tandem::AdamW, Backend> dp(comm, specs, {.lr = 3e-3f},
                                                            {.bucket_cap_bytes = 1024,
                                                             .first_bucket_cap_bytes = 512,
                                                             .accumulation_steps = accumulation,
                                                             .max_grad_norm = 1.0f,
                                                             .gradient_buffers = buffers,
                                                             .parameter_buffers = buffers,
                                                             .stream = user_stream},
                                                            Backend{});
    const tandem::StreamHostBackend enqueue;
    auto on_user = [&](auto f) { enqueue.launch(1, Task{f}, user_stream); };
    dp.template initialize_parameters<float>(
        [&](std::size_t i, float* values) {
          on_user([&model, i, values] { std::copy(model.params()[i].begin(), model.params()[i].end(), values); });
        },
        world - 1);
    const int local = global_batch / world;
    for (int step = 0; step < steps; ++step)
      for (int micro = 0; micro < accumulation; ++micro) {
        const int begin = (step * accumulation + micro) * global_batch + comm.rank() * local;
        read_into_model(dp, model, on_user, buffers > 1);
        on_user([&model, &data, begin, local] { model.forward_backward(data, begin, local); });
        add_model_gradients(dp, model, on_user);
        dp.step();
      }
    test::Params final = read_parameters(dp, specs, on_user);
    user.synchronize();
    if (comm.rank() == 0) {
      std::lock_guard lock(m);
      result = std::move(final);
    }
  });
  return result;
}

}  // namespace

TEST_CASE_TEMPLATE("training with backward on the user's stream equals HostBackend bit for bit", Policy,
                   tandem::Replicated, tandem::OptimizerSharded, tandem::GradientSharded) {
  for (int world : {1, 3})
    for (int accumulation : {1, 2}) {
      CAPTURE(world);
      CAPTURE(accumulation);
      const test::Params reference = train_on_user_stream<Policy, tandem::HostBackend>(world, accumulation);
      const test::Params streamed = train_on_user_stream<Policy, test::DelayedStreamBackend>(world, accumulation);
      CHECK(test::bitwise_equal(streamed, reference));
    }
}

TEST_CASE_TEMPLATE("owned storage with the passes on the user's stream equals HostBackend", Policy, tandem::Replicated,
                   tandem::OptimizerSharded, tandem::GradientSharded, tandem::ParameterSharded) {
  for (int world : {1, 3})
    for (int accumulation : {1, 2})
      for (int buffers : {1, 2}) {
        CAPTURE(world);
        CAPTURE(accumulation);
        CAPTURE(buffers);
        const test::Params reference =
            train_owned_on_user_stream<Policy, tandem::HostBackend>(world, accumulation, buffers);
        const test::Params streamed =
            train_owned_on_user_stream<Policy, test::DelayedStreamBackend>(world, accumulation, buffers);
        CHECK(test::bitwise_equal(streamed, reference));
      }
}

namespace {

/// One rank, owned storage: an eager optimizer step, then `steps - 1` more on one batch, each a forward through the
/// ParameterBuckets, a backward adding into the GradientBuckets and step(), all on the user's stream; `captured`: the
/// second step captured on the user's stream (HostStream::begin_capture) and replayed for the others. Clipping under
/// StepReport::deferred: the step makes no host read. Returns the final parameters, or the capture's error.
template <class Policy>
std::pair<test::Params, std::string> train_owned_captured(bool captured) {
  const std::vector<int> dims = {13, 37, 29, 23, 7};
  constexpr int batch = 12, steps = 5;
  const mlp::Dataset data(batch * 2, dims.front(), dims.back(), 7);
  test::Params result;
  std::string refused;
  tandem::LocalGroup(1).run([&](tandem::LocalComm& comm) {
    tandem::HostStream user({.max_delay = 300us, .seed = 11});
    mlp::Mlp<float> model(dims, 42);
    std::vector<tandem::TensorSpec> specs;
    for (const auto& t : model.tensors()) specs.push_back({t.name, t.numel, t.dtype});
    tandem::DataParallel<Policy, tandem::AdamW, test::DelayedStreamBackend> dp(
        comm, specs, {.lr = 3e-3f},
        {.bucket_cap_bytes = 1024,
         .first_bucket_cap_bytes = 512,
         .max_grad_norm = 1.0f,
         .step_report = tandem::StepReport::deferred,
         .stream = user.stream()},
        test::DelayedStreamBackend{});
    const tandem::StreamHostBackend enqueue;
    auto on_user = [&](auto f) { enqueue.launch(1, Task{f}, user.stream()); };
    dp.template initialize_parameters<float>([&](std::size_t i, float* values) {
      on_user([&model, i, values] { std::copy(model.params()[i].begin(), model.params()[i].end(), values); });
    });
    auto optimizer_step = [&](int begin) {
      read_into_model(dp, model, on_user, false);
      on_user([&model, &data, begin, n = batch] { model.forward_backward(data, begin, n); });
      add_model_gradients(dp, model, on_user);
      dp.step();
    };
    optimizer_step(0);  // eager in both runs, as a CUDA graph is captured after a warm-up step
    if (!captured) {
      for (int s = 1; s < steps; ++s) optimizer_step(batch);
    } else {
      user.begin_capture();
      try {
        optimizer_step(batch);
        // after the captured step, a call that waits on the host refuses by name, and the capture ends whole
        CHECK_THROWS_WITH_AS(dp.template initialize_parameters<float>([](std::size_t, float*) {}),
                             doctest::Contains("initialize_parameters while the user's stream is capturing"),
                             tandem::error);
      } catch (const tandem::error& e) {
        refused = e.what();
        (void)user.end_capture();
        return;
      }
      const tandem::HostGraph graph = user.end_capture();
      for (int s = 1; s < steps; ++s) graph.replay();
    }
    test::Params final = read_parameters(dp, specs, on_user);
    user.synchronize();
    result = std::move(final);
  });
  return {result, refused};
}

}  // namespace

TEST_CASE_TEMPLATE("owned storage: a captured step (forward, backward and step()) replays the bits of eager steps",
                   Policy, tandem::Replicated, tandem::OptimizerSharded) {
  // The passes use the parameter and gradient buckets in place: nothing waits across the capture's boundary.
  const auto [eager, none] = train_owned_captured<Policy>(false);
  const auto [replayed, refused] = train_owned_captured<Policy>(true);
  REQUIRE(refused.empty());
  CHECK(test::bitwise_equal(replayed, eager));
}

TEST_CASE_TEMPLATE("owned storage: a pass through reused buffers is refused while the user's stream captures", Policy,
                   tandem::GradientSharded, tandem::ParameterSharded) {
  // Its buffers' events come from before the capture, and CUDA refuses a wait on them (the stand-in now does too);
  // ParameterSharded's gathers would run once, at capture time.
  const auto [none, refused] = train_owned_captured<Policy>(true);
  CHECK(refused.find(std::is_same_v<Policy, tandem::GradientSharded> ? "gradients(b) while the user's stream is "
                                                                       "capturing: under GradientSharded"
                                                                     : "parameters(b) while the user's stream is "
                                                                       "capturing: under ParameterSharded") !=
        std::string::npos);
}
