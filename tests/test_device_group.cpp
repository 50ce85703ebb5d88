// SPDX-License-Identifier: Apache-2.0
// DeviceGroup (comm/device_group.hpp), N ranks as threads on one device, run here over StreamHostBackend: every
// rank's collectives are issued on a HostStream of its own with random delays, as on a GPU. It must give LocalGroup's
// bits for every collective, dtype, count and in-place form, reject mismatched calls on every rank, time out, and
// release the others when a rank fails; and DataParallel over it must train bit for bit as over LocalGroup.
// Labels "host" and "streams".
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "../examples/mlp/mlp.hpp"
#include "support/backend.hpp"
#include "support/params.hpp"
#include "tandem/comm/device_group.hpp"
#include "tandem/tandem.hpp"

namespace {

using namespace std::chrono_literals;
using tandem::DType;
using tandem::ReduceOp;
using Group = tandem::DeviceGroup<tandem::StreamHostBackend>;
using Comm = tandem::DeviceComm<tandem::StreamHostBackend>;

enum class Kind { all_reduce, reduce_scatter, all_gather, broadcast };
enum class Place { separate, in_place };

/// Rank r's input: `elements` random values of T (a seed per rank and case), as raw bytes.
template <class T>
std::vector<unsigned char> input(std::size_t elements, int rank, std::uint64_t seed) {
  std::mt19937_64 rng(seed * 131 + static_cast<std::uint64_t>(rank));
  std::uniform_real_distribution<double> d(-4.0, 4.0);
  std::vector<unsigned char> bytes(elements * sizeof(T));
  for (std::size_t i = 0; i < elements; ++i) {
    const T v = tandem::convert<T>(static_cast<float>(d(rng)));
    std::memcpy(bytes.data() + i * sizeof(T), &v, sizeof(T));
  }
  return bytes;
}

/// One collective on every rank of `group`, each rank issuing on the stream make_stream(rank) returns; every rank's
/// result (its whole recv buffer, or for the in-place forms the part of send that received it) as bytes.
template <class T, class GroupT, class MakeStream>
std::vector<std::vector<unsigned char>> collect(GroupT& group, Kind kind, Place place, std::size_t count, ReduceOp op,
                                                int root, std::uint64_t seed, MakeStream make_stream) {
  const int world = group.size();
  std::vector<std::vector<unsigned char>> out(static_cast<std::size_t>(world));
  group.run([&](auto& comm) {
    const int r = comm.rank();
    const std::size_t n = static_cast<std::size_t>(world);
    const std::size_t send_elements = kind == Kind::reduce_scatter ? n * count : count;
    const std::size_t recv_elements = kind == Kind::all_gather ? n * count : count;
    std::vector<unsigned char> send = input<T>(send_elements, r, seed);
    std::vector<unsigned char> recv(recv_elements * sizeof(T), 0xAB);  // poisoned: every byte must be written
    auto stream = make_stream(r);
    const DType dt = tandem::dtype_of<T>;
    const std::size_t at = static_cast<std::size_t>(r) * count * sizeof(T);
    switch (kind) {
      case Kind::all_reduce:
        if (place == Place::in_place) {
          comm.all_reduce(send.data(), send.data(), count, dt, op, stream->stream());
        } else {
          comm.all_reduce(send.data(), recv.data(), count, dt, op, stream->stream());
        }
        break;
      case Kind::reduce_scatter:
        if (place == Place::in_place) {
          comm.reduce_scatter(send.data(), send.data() + at, count, dt, op, stream->stream());
        } else {
          comm.reduce_scatter(send.data(), recv.data(), count, dt, op, stream->stream());
        }
        break;
      case Kind::all_gather:
        if (place == Place::in_place) {
          if (count != 0) std::memcpy(recv.data() + at, send.data(), count * sizeof(T));
          comm.all_gather(recv.data() + at, recv.data(), count, dt, stream->stream());
        } else {
          comm.all_gather(send.data(), recv.data(), count, dt, stream->stream());
        }
        break;
      case Kind::broadcast:
        if (place == Place::in_place) {
          comm.broadcast(send.data(), send.data(), count, dt, root, stream->stream());
        } else {
          comm.broadcast(send.data(), recv.data(), count, dt, root, stream->stream());
        }
        break;
    }
    stream->synchronize();
    if (place == Place::in_place && kind != Kind::all_gather) {
      const std::size_t from = kind == Kind::reduce_scatter ? at : 0;
      recv.assign(send.begin() + static_cast<std::ptrdiff_t>(from),
                  send.begin() + static_cast<std::ptrdiff_t>(from + count * sizeof(T)));
    }
    out[static_cast<std::size_t>(r)] = std::move(recv);
  });
  return out;
}

/// A stand-in for LocalGroup's streams: the calling thread.
struct CallingThread {
  tandem::Stream stream() const { return {}; }
  void synchronize() const {}
};

template <class T>
void check_against_local_group(Kind kind) {
  std::uint64_t seed = 1;
  for (int world : {1, 2, 3, 4})
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{17}, std::size_t{4097}, std::size_t{9000}})
      for (Place place : {Place::separate, Place::in_place})
        for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg}) {
          if ((kind == Kind::all_gather || kind == Kind::broadcast) && op == ReduceOp::avg) continue;
          CAPTURE(world);
          CAPTURE(count);
          CAPTURE(static_cast<int>(place));
          CAPTURE(tandem::reduce_op_name(op));
          const int root = world - 1;
          ++seed;
          tandem::LocalGroup local(world);
          const auto expected = collect<T>(local, kind, place, count, op, root, seed,
                                           [](int) { return std::make_unique<CallingThread>(); });
          Group group(world);
          const auto got = collect<T>(group, kind, place, count, op, root, seed, [](int r) {
            return std::make_unique<tandem::HostStream>(
                tandem::HostStreamOptions{.max_delay = 100us, .seed = static_cast<std::uint64_t>(r)});
          });
          CHECK(got == expected);
        }
}

}  // namespace

#define TANDEM_GROUP_TYPES float, tandem::BFloat16, tandem::Float16, double

TEST_CASE_TEMPLATE("DeviceGroup all_reduce gives LocalGroup's bits", T, TANDEM_GROUP_TYPES) {
  check_against_local_group<T>(Kind::all_reduce);
}
TEST_CASE_TEMPLATE("DeviceGroup reduce_scatter gives LocalGroup's bits", T, TANDEM_GROUP_TYPES) {
  check_against_local_group<T>(Kind::reduce_scatter);
}
TEST_CASE_TEMPLATE("DeviceGroup all_gather gives LocalGroup's bits", T, float, tandem::BFloat16, double) {
  check_against_local_group<T>(Kind::all_gather);
}
TEST_CASE_TEMPLATE("DeviceGroup broadcast gives LocalGroup's bits", T, float, tandem::Float16) {
  check_against_local_group<T>(Kind::broadcast);
}

TEST_CASE(
    "DeviceGroup: mismatched calls make every rank throw; a missing rank times out; a failing rank releases the "
    "others") {
  SUBCASE("mismatch") {
    Group group(3);
    std::atomic<int> threw{0};
    group.run([&](Comm& comm) {
      tandem::HostStream stream;
      std::vector<float> x(40, 1.0f);
      const std::size_t count = comm.rank() == 1 ? 39 : 40;
      try {
        comm.all_reduce(x.data(), x.data(), count, DType::fp32, ReduceOp::sum, stream.stream());
      } catch (const tandem::error& e) {
        CHECK(std::string(e.what()).find("count") != std::string::npos);
        ++threw;
      }
      stream.synchronize();
    });
    CHECK(threw == 3);
  }
  SUBCASE("timeout") {
    // Rank 1 comes back only after 400 ms: rank 0 must have timed out at 100 ms, not have learnt at 400 ms that rank 1
    // returned (a plain tandem::error, which a missing timeout would give).
    Group group(2, {}, {.timeout = 100ms});
    std::string message;
    double waited_ms = 0;
    CHECK_THROWS_AS(group.run([&](Comm& comm) {
      if (comm.rank() == 1) {
        std::this_thread::sleep_for(400ms);
        return;
      }
      tandem::HostStream stream;
      std::vector<float> x(8, 1.0f);
      const auto start = std::chrono::steady_clock::now();
      try {
        comm.all_reduce(x.data(), x.data(), 8, DType::fp32, ReduceOp::sum, stream.stream());
      } catch (const tandem::error& e) {
        waited_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
        message = e.what();
        throw;
      }
    }),
                    tandem::timeout_error);
    CHECK(message.find("timed out after 100 ms") != std::string::npos);
    CHECK(waited_ms >= 99.0);
    CHECK(waited_ms < 350.0);
  }
  SUBCASE("a rank throws") {
    Group group(3);
    std::atomic<int> released{0};
    CHECK_THROWS_WITH_AS(group.run([&](Comm& comm) {
      if (comm.rank() == 2) throw std::runtime_error("rank 2 failed on purpose");
      tandem::HostStream stream;
      std::vector<float> x(8, 1.0f);
      try {
        comm.all_reduce(x.data(), x.data(), 8, DType::fp32, ReduceOp::sum, stream.stream());
      } catch (const tandem::peer_error&) {
        ++released;
        throw;
      }
    }),
                         "rank 2 failed on purpose", std::runtime_error);
    CHECK(released == 2);
  }
  CHECK_THROWS_AS(Group(0), tandem::error);
  CHECK_THROWS_AS(Group(tandem::max_group_ranks + 1), tandem::error);
}

namespace {

thread_local bool fail_launch = false;  // set by a rank's body: that rank's launches throw

/// StreamHostBackend whose launches throw on the ranks that ask for it.
struct FailingBackend : tandem::StreamHostBackend {
  template <class Body>
  void launch(std::size_t items, const Body& body, tandem::Stream s = {}) const {
    if (fail_launch) throw tandem::error("injected launch failure");
    tandem::StreamHostBackend::launch(items, body, s);
  }
};

}  // namespace

TEST_CASE("DeviceGroup: a rank that fails to issue its share makes every other rank throw peer_error") {
  tandem::DeviceGroup<FailingBackend> group(3);
  std::atomic<int> peers{0};
  CHECK_THROWS_WITH_AS(group.run([&](tandem::DeviceComm<FailingBackend>& comm) {
    tandem::HostStream stream;
    std::vector<float> x(100, 1.0f);
    fail_launch = comm.rank() == 1;
    try {
      comm.all_reduce(x.data(), x.data(), x.size(), DType::fp32, ReduceOp::sum, stream.stream());
    } catch (const tandem::peer_error& e) {
      CHECK(std::string(e.what()).find("rank 1 failed to issue its share") != std::string::npos);
      ++peers;
      throw;
    }
    stream.synchronize();
  }),
                       "injected launch failure", tandem::error);
  CHECK(peers == 2);
}

// ---- DataParallel over DeviceGroup --------------------------------------------------------------------------------

namespace {

/// Trains the MLP example under Policy at `world` ranks over GroupT (each rank's DataParallel on Backend), with
/// broadcast from the last rank, clipping and skip_step, and a NaN injected into one rank's gradients at one step;
/// returns rank 0's final parameters and how many steps were skipped.
template <class Policy, class GroupT, class Backend>
std::pair<test::Params, std::uint64_t> train_over(GroupT& group) {
  const std::vector<int> dims = {13, 37, 29, 23, 7};
  const int global_batch = 12, steps = 6;
  const mlp::Dataset data(global_batch * steps, dims.front(), dims.back(), 7);
  test::Params result;
  std::uint64_t skipped = 0;
  std::mutex m;
  group.run([&](auto& comm) {
    using CommT = std::remove_reference_t<decltype(comm)>;
    const int world = comm.size();
    mlp::Mlp<float> model(dims, 42 + static_cast<std::uint64_t>(comm.rank()) * 1000);
    tandem::DataParallel<Policy, tandem::AdamW, Backend, CommT> dp(comm, model.tensors(), {.lr = 3e-3f},
                                                                   {.bucket_cap_bytes = 1024,
                                                                    .first_bucket_cap_bytes = 512,
                                                                    .max_grad_norm = 1.0f,
                                                                    .non_finite = tandem::NonFinite::skip_step});
    dp.broadcast_parameters(world - 1);
    const int local = global_batch / world;
    for (int step = 0; step < steps; ++step) {
      model.forward_backward(data, step * global_batch + comm.rank() * local, local);
      if (step == 3 && comm.rank() == world - 1) static_cast<float*>(model.tensors()[2].grad)[5] = std::nanf("");
      dp.step();
    }
    if (comm.rank() == 0) {
      std::lock_guard lock(m);
      result = test::as_float(model.params());
      skipped = dp.skipped_steps();
    }
  });
  return {result, skipped};
}

}  // namespace

TEST_CASE_TEMPLATE("DataParallel over DeviceGroup trains bit for bit as over LocalGroup", Policy, tandem::Replicated,
                   tandem::OptimizerSharded, tandem::GradientSharded) {
  for (int world : {1, 2, 3, 4}) {
    CAPTURE(world);
    tandem::LocalGroup local(world);
    const auto expected = train_over<Policy, tandem::LocalGroup, tandem::HostBackend>(local);
    Group group(world);
    const auto got = train_over<Policy, Group, test::DelayedStreamBackend>(group);
    CHECK(got.second == 1);
    CHECK(expected.second == 1);
    CHECK(test::bitwise_equal(got.first, expected.first));
  }
}
