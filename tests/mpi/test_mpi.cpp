// SPDX-License-Identifier: Apache-2.0
// tandem::Mpi under `mpirun -np N` (ctest mpi_np2, mpi_np3): every collective, dtype, op and in-place form against a
// plain-loop reference on fresh random data; results equal to LocalGroup's bit for bit; DataParallel over Mpi equal
// to DataParallel over LocalGroup at the same world size for every policy (each process runs the LocalGroup reference
// itself, in threads, and compares its own rank); disagreeing calls, a late rank, a rank that leaves early, unequal
// batches. tests/mpi/failure.cpp covers ranks that are killed or throw. Every process runs the same test cases in the
// same order; the exit status is the worst over the ranks.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "support/comm.hpp"
#include "support/params.hpp"
#include "support/train.hpp"
#include "tandem/comm/mpi.hpp"
#include "tandem/tandem.hpp"

namespace {

using namespace std::chrono_literals;

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

/// A seed every rank agrees on, fresh for each run: rank 0 draws it, MPI broadcasts it.
std::uint64_t shared_seed() {
  std::uint64_t seed = world_rank() == 0 ? std::random_device{}() : 0;
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  return seed;
}

/// Rank q's input: n values in [-2, 2) drawn from (seed, q), stored as T. Any rank can recompute any rank's input.
template <class T>
std::vector<T> input(std::uint64_t seed, int q, std::size_t n) {
  std::mt19937_64 rng(seed * 1000003u + static_cast<std::uint64_t>(q));
  std::uniform_real_distribution<double> u(-2.0, 2.0);
  std::vector<T> v(n);
  for (auto& x : v) {
    if constexpr (std::is_same_v<T, double>) {
      x = u(rng);
    } else {
      x = T(static_cast<float>(u(rng)));
    }
  }
  return v;
}

/// The reference reduction, written out: element i is ((s0 + s1) + s2) + ... in rank order, in fp32 (fp64 for fp64),
/// divided by the rank count for avg, rounded once to T.
template <class T>
std::vector<T> reference_reduce(std::uint64_t seed, int size, std::size_t n, tandem::ReduceOp op) {
  using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
  std::vector<Acc> acc(n, Acc(0));
  for (int q = 0; q < size; ++q) {
    const std::vector<T> s = input<T>(seed, q, n);
    for (std::size_t i = 0; i < n; ++i) acc[i] = q == 0 ? static_cast<Acc>(s[i]) : acc[i] + static_cast<Acc>(s[i]);
  }
  std::vector<T> out(n);
  for (std::size_t i = 0; i < n; ++i)
    out[i] = op == tandem::ReduceOp::avg ? T(acc[i] / static_cast<Acc>(size)) : T(acc[i]);
  return out;
}

template <class T>
bool same_bits(const T* a, const T* b, std::size_t n) {
  return n == 0 || std::memcmp(a, b, n * sizeof(T)) == 0;
}

template <class T>
void poison(std::vector<T>& v) {
  std::memset(v.data(), 0xA5, v.size() * sizeof(T));
}

enum class Form { separate, in_place };

/// Every collective of `comm` for element type T against the plain-loop reference, both forms, both ops.
template <class T>
void check_collectives(tandem::Mpi& comm, std::uint64_t seed, std::size_t count) {
  const tandem::DType dtype = tandem::dtype_of<T>;
  const int r = comm.rank(), n = comm.size();
  const auto ur = static_cast<std::size_t>(r), un = static_cast<std::size_t>(n);
  CAPTURE(tandem::dtype_name(dtype));
  CAPTURE(count);
  for (const Form form : {Form::separate, Form::in_place}) {
    CAPTURE(form == Form::in_place);
    for (const tandem::ReduceOp op : {tandem::ReduceOp::sum, tandem::ReduceOp::avg}) {
      CAPTURE(tandem::reduce_op_name(op));
      // all_reduce
      {
        const std::vector<T> want = reference_reduce<T>(seed, n, count, op);
        std::vector<T> send = input<T>(seed, r, count), recv(count);
        poison(recv);
        if (form == Form::in_place) {
          comm.all_reduce(send.data(), send.data(), count, dtype, op);
          CHECK(same_bits(send.data(), want.data(), count));
        } else {
          comm.all_reduce(send.data(), recv.data(), count, dtype, op);
          CHECK(same_bits(recv.data(), want.data(), count));
          CHECK(same_bits(send.data(), input<T>(seed, r, count).data(), count));  // send untouched
        }
      }
      // reduce_scatter: send holds n blocks; rank r gets block r reduced
      {
        const std::vector<T> full = reference_reduce<T>(seed + 1, n, count * un, op);
        std::vector<T> send = input<T>(seed + 1, r, count * un), recv(count);
        poison(recv);
        const T* got = recv.data();
        if (form == Form::in_place) {
          comm.reduce_scatter(send.data(), send.data() + ur * count, count, dtype, op);
          got = send.data() + ur * count;
        } else {
          comm.reduce_scatter(send.data(), recv.data(), count, dtype, op);
        }
        CHECK(same_bits(got, full.data() + ur * count, count));
      }
    }
    // all_gather: block q of recv is rank q's send
    {
      std::vector<T> want;
      for (int q = 0; q < n; ++q) {
        const std::vector<T> s = input<T>(seed + 2, q, count);
        want.insert(want.end(), s.begin(), s.end());
      }
      std::vector<T> recv(count * un);
      poison(recv);
      const std::vector<T> mine = input<T>(seed + 2, r, count);
      if (form == Form::in_place) {
        std::copy(mine.begin(), mine.end(), recv.begin() + static_cast<std::ptrdiff_t>(ur * count));
        comm.all_gather(recv.data() + ur * count, recv.data(), count, dtype);
      } else {
        comm.all_gather(mine.data(), recv.data(), count, dtype);
      }
      CHECK(same_bits(recv.data(), want.data(), count * un));
    }
    // broadcast from every root
    for (int root = 0; root < n; ++root) {
      CAPTURE(root);
      const std::vector<T> want = input<T>(seed + 3, root, count);
      std::vector<T> send = input<T>(seed + 3, r, count), recv(count);
      poison(recv);
      if (form == Form::in_place) {
        comm.broadcast(send.data(), send.data(), count, dtype, root);
        CHECK(same_bits(send.data(), want.data(), count));
      } else {
        comm.broadcast(send.data(), recv.data(), count, dtype, root);
        CHECK(same_bits(recv.data(), want.data(), count));
      }
    }
  }
}

template <class T>
void check_all_counts(tandem::Mpi& comm, std::uint64_t seed) {
  for (const std::size_t count :
       {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1000}, std::size_t{4099}, std::size_t{70001}})
    check_collectives<T>(comm, seed + count, count);
}

bool bitwise_equal(const test::Params& a, const test::Params& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || !same_bits(a[i].data(), b[i].data(), a[i].size())) return false;
  return true;
}

const tandem::AdamWOptions adamw{.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-8f, .weight_decay = 0.05f};
const tandem::SGDOptions sgd{.lr = 0.05f, .momentum = 0.9f, .weight_decay = 1e-3f, .nesterov = tandem::Nesterov::on};

/// DataParallel<Policy, Optimizer> with T parameters over Mpi, and over a LocalGroup of the same size run here in
/// threads: this rank's parameters must be the same bits.
template <class Policy, class Optimizer, class T>
void check_training(const test::TrainSetup& setup, const typename Optimizer::Options& options) {
  const mlp::Dataset data = test::make_dataset(setup);
  tandem::Mpi comm(MPI_COMM_WORLD, {.timeout = 60s});
  const test::Params over_mpi = test::train_rank<Policy, Optimizer, T>(comm, setup, data, options);
  test::Params over_threads;
  tandem::LocalGroup(comm.size()).run([&](tandem::LocalComm& local) {
    test::Params p = test::train_rank<Policy, Optimizer, T>(local, setup, data, options);
    if (local.rank() == comm.rank()) over_threads = std::move(p);
  });
  CHECK(bitwise_equal(over_mpi, over_threads));
  // And the run moved the parameters at all (a test that cannot fail proves nothing).
  mlp::Mlp<T> initial(setup.dims, setup.seed);
  CHECK(!bitwise_equal(over_mpi, test::as_float(initial.params())));
}

/// DataParallel<Policy, AdamW> over Mpi on StreamHostBackend, its work and comm streams worker threads with random
/// delays: this rank's parameters must be the bits of the same training on HostBackend (Mpi waits for each stream's
/// earlier work before a collective reads it).
template <class Policy>
void check_streams(const test::TrainSetup& setup) {
  const mlp::Dataset data = test::make_dataset(setup);
  tandem::Mpi comm(MPI_COMM_WORLD, {.timeout = 60s});
  const test::Params on_streams =
      test::train_rank<Policy, tandem::AdamW, float, test::DelayedStreamBackend>(comm, setup, data, adamw);
  const test::Params in_order =
      test::train_rank<Policy, tandem::AdamW, float, tandem::HostBackend>(comm, setup, data, adamw);
  CHECK(bitwise_equal(on_streams, in_order));
  mlp::Mlp<float> initial(setup.dims, setup.seed);
  CHECK(!bitwise_equal(on_streams, test::as_float(initial.params())));
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("collectives: fp32, fp64, bf16, fp16; sum and avg; separate and in place; against plain loops") {
  const std::uint64_t seed = shared_seed();
  tandem::Mpi comm(MPI_COMM_WORLD, {.timeout = 60s});
  REQUIRE(comm.size() == world_size());
  REQUIRE(comm.rank() == world_rank());
  check_all_counts<float>(comm, seed);
  check_all_counts<double>(comm, seed + 11);
  check_all_counts<tandem::BFloat16>(comm, seed + 22);
  check_all_counts<tandem::Float16>(comm, seed + 33);
  comm.barrier();
}

TEST_CASE("collectives split into many messages (max_message_bytes = 100) give the same bits") {
  const std::uint64_t seed = shared_seed();
  tandem::Mpi comm(MPI_COMM_WORLD, {.timeout = 60s, .max_message_bytes = 100});
  check_collectives<float>(comm, seed, 1003);
  check_collectives<tandem::BFloat16>(comm, seed, 777);
}

TEST_CASE("all_reduce equals LocalGroup's bit for bit, including 16-bit rounding and avg") {
  const std::uint64_t seed = shared_seed();
  tandem::Mpi comm(MPI_COMM_WORLD, {.timeout = 60s});
  const std::size_t count = 12345;
  for (const tandem::DType dtype : {tandem::DType::fp32, tandem::DType::bf16, tandem::DType::fp16}) {
    tandem::visit_dtype(dtype, [&](auto tag) {
      using T = decltype(tag);
      std::vector<T> mine = input<T>(seed, comm.rank(), count);
      comm.all_reduce(mine.data(), mine.data(), count, dtype, tandem::ReduceOp::avg);
      std::vector<T> local;
      tandem::LocalGroup(comm.size()).run([&](tandem::LocalComm& lc) {
        std::vector<T> v = input<T>(seed, lc.rank(), count);
        lc.all_reduce(v.data(), v.data(), count, dtype, tandem::ReduceOp::avg);
        if (lc.rank() == comm.rank()) local = std::move(v);
      });
      CHECK(same_bits(mine.data(), local.data(), count));
    });
  }
}

TEST_CASE("calls that disagree, or arguments one rank rejects: every rank throws, and the communicator stays usable") {
  tandem::Mpi comm(MPI_COMM_WORLD, {.timeout = 60s});
  std::vector<float> a(16, 1.0f), b(16 * static_cast<std::size_t>(comm.size()));
  std::string what;
  try {
    comm.all_reduce(a.data(), a.data(), comm.rank() == 1 ? 8 : 16, tandem::DType::fp32, tandem::ReduceOp::sum);
  } catch (const tandem::error& e) {
    what = e.what();
  }
  CHECK(contains(what,
                 "collective mismatch: rank 0 called all_reduce(count=16, fp32, sum) but rank 1 called "
                 "all_reduce(count=8, fp32, sum)"));
  what.clear();
  try {
    comm.all_gather(a.data(), comm.rank() == 1 ? nullptr : b.data(), 16, tandem::DType::fp32);
  } catch (const tandem::error& e) {
    what = e.what();
  }
  CHECK(contains(what, comm.rank() == 1 ? "`recv` is null" : "rank 1 rejected its arguments"));
  what.clear();
  try {
    comm.barrier();
    comm.all_reduce(a.data(), a.data(), 16, tandem::DType::fp32, tandem::ReduceOp::sum);
  } catch (const tandem::error& e) {
    what = e.what();
  }
  CHECK(what.empty());
  CHECK(a[0] == static_cast<float>(comm.size()));
}

TEST_CASE("DataParallel over Mpi equals DataParallel over LocalGroup bit for bit: every policy") {
  const test::TrainSetup setup;
  check_training<tandem::Replicated, tandem::AdamW, float>(setup, adamw);
  check_training<tandem::OptimizerSharded, tandem::AdamW, float>(setup, adamw);
  check_training<tandem::GradientSharded, tandem::AdamW, float>(setup, adamw);
  check_training<tandem::ParameterSharded, tandem::AdamW, float>(setup, adamw);
}

TEST_CASE("DataParallel over Mpi: bf16 parameters, SGD, gradient accumulation") {
  test::TrainSetup setup;
  setup.accumulation = 2;
  check_training<tandem::Replicated, tandem::SGD, tandem::BFloat16>(setup, sgd);
  check_training<tandem::OptimizerSharded, tandem::SGD, tandem::BFloat16>(setup, sgd);
  check_training<tandem::GradientSharded, tandem::AdamW, tandem::BFloat16>(setup, adamw);
  check_training<tandem::ParameterSharded, tandem::SGD, tandem::BFloat16>(setup, sgd);
}

TEST_CASE("DataParallel over Mpi: gradients reduced in bf16 and fp16 (DataParallelOptions::reduce_dtype)") {
  test::TrainSetup setup;
  setup.reduce_dtype = tandem::DType::bf16;
  check_training<tandem::Replicated, tandem::AdamW, float>(setup, adamw);
  check_training<tandem::ParameterSharded, tandem::AdamW, float>(setup, adamw);
  setup.reduce_dtype = tandem::DType::fp16;
  setup.accumulation = 2;
  check_training<tandem::OptimizerSharded, tandem::SGD, tandem::BFloat16>(setup, sgd);
  check_training<tandem::GradientSharded, tandem::SGD, float>(setup, sgd);
}

TEST_CASE("DataParallel over Mpi on the stream-faithful backend equals HostBackend bit for bit") {
  test::TrainSetup setup;
  setup.max_grad_norm = 0.5f;  // the norm's all-reduce reads what the work stream wrote
  check_streams<tandem::Replicated>(setup);
  check_streams<tandem::GradientSharded>(setup);
  check_streams<tandem::ParameterSharded>(setup);
}

TEST_CASE("Mpi on streams: a HostStream's earlier work is done first; a CUDA stream and a capture are refused") {
  tandem::Mpi comm(MPI_COMM_WORLD, {.timeout = 60s});
  tandem::HostStream stream({.max_delay = 2ms, .seed = 7});
  std::vector<float> a(1000, 0.0f);
  stream.enqueue([&] { std::fill(a.begin(), a.end(), 1.0f + static_cast<float>(comm.rank())); });
  comm.all_reduce(a.data(), a.data(), a.size(), tandem::DType::fp32, tandem::ReduceOp::sum, stream.stream());
  const float sum = static_cast<float>(comm.size() * (comm.size() + 1) / 2);
  CHECK(std::count(a.begin(), a.end(), sum) == static_cast<std::ptrdiff_t>(a.size()));
  int not_a_cuda_stream = 0;
  CHECK_THROWS_WITH_AS(comm.broadcast(a.data(), a.data(), a.size(), tandem::DType::fp32, 0,
                                      tandem::Stream{&not_a_cuda_stream, tandem::StreamKind::native}),
                       doctest::Contains("Mpi::broadcast was given a CUDA stream"), tandem::error);
  stream.begin_capture();
  CHECK_THROWS_WITH_AS(comm.all_gather(a.data() + comm.rank(), a.data(), 1, tandem::DType::fp32, stream.stream()),
                       doctest::Contains("Mpi::all_gather on a capturing HostStream"), tandem::error);
  (void)stream.end_capture();
  comm.barrier();  // each call ended on every rank with its refusal: the communicator goes on
  // One rank's refusal reaches the others in the call's header: every rank throws at once, not at the timeout.
  tandem::Mpi quick(MPI_COMM_WORLD, {.timeout = 60s});
  const auto began = std::chrono::steady_clock::now();
  const tandem::Stream given =
      comm.rank() == 1 ? tandem::Stream{&not_a_cuda_stream, tandem::StreamKind::native} : tandem::Stream{};
  const std::string message = test::message_of(
      [&] { quick.all_reduce(a.data(), a.data(), a.size(), tandem::DType::fp32, tandem::ReduceOp::sum, given); });
  CHECK(std::chrono::steady_clock::now() - began < 30s);
  CHECK(message.find(comm.rank() == 1 ? "Mpi::all_reduce was given a CUDA stream" : "rank 1 rejected its arguments") !=
        std::string::npos);
  quick.barrier();
}

TEST_CASE("an unbounded timeout (milliseconds::max()) waits rather than expiring at once") {
  tandem::Mpi comm(MPI_COMM_WORLD, {.timeout = std::chrono::milliseconds::max()});
  if (comm.rank() == 1) std::this_thread::sleep_for(100ms);
  float a = 1.0f;
  comm.all_reduce(&a, &a, 1, tandem::DType::fp32, tandem::ReduceOp::sum);
  CHECK(a == static_cast<float>(comm.size()));
}

TEST_CASE("unequal batches: all_ranks_have_batch stops every rank after the shortest rank's batches") {
  const test::TrainSetup setup;
  const mlp::Dataset data = test::make_dataset(setup);
  tandem::Mpi comm(MPI_COMM_WORLD, {.timeout = 60s});
  const int r = comm.rank();
  const int batches = r == comm.size() - 1 ? 3 : 5 + r;  // the last rank has the fewest
  int fewest = batches;
  MPI_Allreduce(MPI_IN_PLACE, &fewest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  mlp::Mlp<float> model(setup.dims, setup.seed + static_cast<std::uint64_t>(r) * 1000);
  tandem::DataParallel<tandem::GradientSharded, tandem::AdamW, tandem::HostBackend, tandem::Mpi> dp(
      comm, model.tensors(), adamw, {.bucket_cap_bytes = 2048, .first_bucket_cap_bytes = 1024});
  dp.broadcast_parameters(0);
  const int local = setup.global_batch / comm.size();
  int step = 0;
  while (dp.all_ranks_have_batch(step < batches ? tandem::Batch::available : tandem::Batch::exhausted)) {
    model.forward_backward(data, step * setup.global_batch + r * local, local);
    dp.step();
    ++step;
  }
  CHECK(dp.step_count() == static_cast<std::uint64_t>(fewest));
  // Every rank ends with the same parameters.
  std::vector<float> mine;
  for (const auto& t : model.params()) mine.insert(mine.end(), t.begin(), t.end());
  std::vector<float> all(mine.size() * static_cast<std::size_t>(comm.size()));
  comm.all_gather(mine.data(), all.data(), mine.size(), tandem::DType::fp32);
  for (int q = 0; q < comm.size(); ++q)
    CHECK(same_bits(all.data() + static_cast<std::size_t>(q) * mine.size(), mine.data(), mine.size()));
}

TEST_CASE("all_ranks_have_batch: ranks that took different numbers of micro-steps are told so on every rank") {
  // Accumulation 2 under Replicated: the first micro-step runs no collective, so nothing else catches the extra
  // step() on rank 1.
  const test::TrainSetup setup;
  const mlp::Dataset data = test::make_dataset(setup);
  tandem::Mpi comm(MPI_COMM_WORLD, {.timeout = 60s});
  mlp::Mlp<float> model(setup.dims, setup.seed);
  tandem::DataParallel<tandem::Replicated, tandem::AdamW, tandem::HostBackend, tandem::Mpi> dp(
      comm, model.tensors(), adamw, {.accumulation_steps = 2});
  model.forward_backward(data, 0, 4);
  if (comm.rank() == 1) dp.step();
  CHECK_THROWS_WITH_AS(dp.all_ranks_have_batch(tandem::Batch::available),
                       doctest::Contains("rank 0 has taken 0 micro-steps but rank 1 has taken 1"), tandem::error);
  // The communicator stays usable: every rank goes on together.
  float one = 1.0f;
  comm.all_reduce(&one, &one, 1, tandem::DType::fp32, tandem::ReduceOp::sum);
  CHECK(one == static_cast<float>(comm.size()));
}

TEST_CASE("a rank that stops early and destroys its Mpi: the others fail at once, naming it") {
  const test::TrainSetup setup;
  const mlp::Dataset data = test::make_dataset(setup);
  const int leaver = world_size() - 1;
  std::string what;
  const auto start = std::chrono::steady_clock::now();
  try {
    tandem::Mpi comm(MPI_COMM_WORLD, {.timeout = 60s});
    test::TrainSetup mine = setup;
    if (comm.rank() == leaver) mine.steps = 3;  // fewer batches, and no all_ranks_have_batch
    test::train_rank<tandem::Replicated, tandem::AdamW, float>(comm, mine, data, adamw);
  } catch (const tandem::error& e) {
    what = e.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (world_rank() == leaver) {
    CHECK(what.empty());
  } else {
    INFO(what);
    CHECK(contains(what, "rank " + std::to_string(leaver) + " destroyed its tandem::Mpi after"));
    CHECK(seconds < 30.0);  // long before the 60 s timeout
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("a late rank: the others time out naming it; it then learns that they failed") {
  const int late = 1;
  std::string what;
  bool timed_out = false;
  try {
    tandem::Mpi comm(MPI_COMM_WORLD, {.timeout = 500ms});
    if (comm.rank() == late) std::this_thread::sleep_for(2s);
    comm.barrier();
  } catch (const tandem::timeout_error& e) {
    what = e.what();
    timed_out = true;
  } catch (const tandem::peer_error& e) {
    what = e.what();
  }
  INFO(what);
  CHECK(contains(what, "rank 1 did not arrive"));
  if (world_rank() != late) {  // it timed out itself, or heard first from another rank that did
    CHECK(contains(what, "barrier timed out after 500 ms on rank "));
    if (world_rank() == 0 && timed_out)
      CHECK(contains(what, "tandem: barrier timed out after 500 ms on rank 0: rank 1 did not arrive"));
  }
  if (world_rank() == late) {
    CHECK(!timed_out);
    CHECK(contains(what, "failed: barrier timed out after 500 ms on rank"));
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("construction checks its arguments") {
  CHECK_THROWS_WITH_AS(tandem::Mpi(MPI_COMM_NULL), doctest::Contains("MPI_COMM_NULL"), tandem::error);
  CHECK_THROWS_WITH_AS(tandem::Mpi(MPI_COMM_WORLD, {.timeout = 0ms}), doctest::Contains("options.timeout"),
                       tandem::error);
  CHECK_THROWS_WITH_AS(tandem::Mpi(MPI_COMM_WORLD, {.max_message_bytes = 0}),
                       doctest::Contains("options.max_message_bytes"), tandem::error);
}

TEST_CASE("ranks constructed with different max_message_bytes: every rank throws, naming the values") {
  // They took a piece of a transfer for the whole and left buffers partly written, without an error.
  const int rank = world_rank();
  const std::size_t mine = rank == 0 ? 1024 : 2048;
  const std::string says = "MpiOptions::max_message_bytes " + std::to_string(mine) + " and rank";
  CHECK_THROWS_WITH_AS(tandem::Mpi(MPI_COMM_WORLD, {.timeout = 60s, .max_message_bytes = mine}),
                       doctest::Contains(says.c_str()), tandem::error);
  tandem::Mpi comm(MPI_COMM_WORLD, {.timeout = 60s, .max_message_bytes = 1024});  // equal values: it works
  std::vector<float> v(600, float(rank + 1));
  comm.broadcast(v.data(), v.data(), v.size(), tandem::DType::fp32, 0);
  CHECK(std::ranges::count(v, 1.0f) == 600);
}

TEST_CASE("TANDEM_MPI_CHECK names the call, the status and the rank") {
  std::string what;
  try {
    TANDEM_MPI_CHECK(MPI_ERR_COUNT);  // a failed status, without breaking anything
  } catch (const tandem::mpi_error& e) {
    what = e.what();
  }
  INFO(what);
  CHECK(contains(what, "MPI call `MPI_ERR_COUNT` failed with status"));
  CHECK(contains(what, "test_mpi.cpp:"));
  CHECK(contains(what, "on rank " + std::to_string(world_rank()) + " of MPI_COMM_WORLD"));
}

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);  // LocalGroup threads never call MPI
  doctest::Context context(argc, argv);
  const int result = context.run();
  int worst = result;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
