// SPDX-License-Identifier: Apache-2.0
// The stream-faithful host backend: the CPU's stand-in for a GPU's asynchrony, where stream and event ordering bugs
// are caught without a GPU (docs/design.md, "Streams").
//
//   HostStream          a worker thread that runs its enqueued operations one after another, in enqueue order, each
//                       after an optional seeded random delay. A failed operation makes the stream's error sticky, as
//                       a CUDA fault is: later work is skipped (event records and waits still run, so nobody hangs
//                       on it) and every later enqueue, synchronize or read on the stream throws that error.
//   HostEvent           record(event, stream) marks the point the stream has reached; wait(stream, event) makes later
//                       work on `stream` wait until the stream that recorded it reaches the most recent record made
//                       before the wait (cudaEventRecord / cudaStreamWaitEvent): each record is its own state, so a
//                       later record never releases an earlier wait. Waiting on an event never recorded does
//                       nothing. An error on the recording stream passes to the waiting stream.
//   capture             begin_capture() / end_capture() on a HostStream: what is enqueued meanwhile is recorded, not
//                       run (cudaStreamBeginCapture / EndCapture): a stream that waits on an event recorded during the
//                       capture joins it, and must rejoin the capturing stream by an event before the capture ends.
//                       Synchronizing or reading a capturing stream throws, as CUDA refuses it, and so does a wait of a
//                       capturing stream on a record made outside the capture (a dependency across its boundary: CUDA's
//                       cudaErrorStreamCaptureIsolation, unless the wait is marked external). HostGraph::replay()
//                       enqueues the recorded work again, with fresh events between its streams (cudaGraphLaunch):
//                       the capturing stream's part on the capturing stream, each joined stream's part on a stream of
//                       the graph's own. So a replay is ordered in the capturing stream's order alone, as a CUDA graph
//                       is: after the work enqueued on the capturing stream before it, before the work enqueued there
//                       after it, and neither after nor before other work on the streams that joined the capture. The
//                       host's stand-in for a step captured in a CUDA graph.
//   StreamHostBackend   HostBackend's operations (copy, zero, launch, sum_to, read) enqueued on a stream; buffers are
//                       freed in stream order (cudaFreeAsync), poisoned with 0xFF bytes (NaN) when allocated and
//                       again just before they are freed, so reading uninitialised or freed memory shows.
//
// Stream{} (a null handle) is the calling thread: work on it runs before the call returns, record on it marks
// "now", and wait(Stream{}, event) blocks the calling thread until the event is reached (and rethrows its error).
// Against non-blocking streams (the only kind tandem creates) that is stricter than CUDA's default stream, never
// looser; unlike CUDA's legacy default stream it does not wait for other streams by itself. Copies read host memory
// when they run, not when they are enqueued: a host source must outlive the copy (synchronize first), which CUDA's
// pageable copies may not need. LocalComm (comm/local_group.hpp) enqueues its collectives on a HostStream it is given,
// as NCCL does on a CUDA stream, so the whole DataParallel protocol runs on it unchanged.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tandem/backend/host.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/stream.hpp"

namespace tandem {

/// Options of a HostStream, for designated initializers.
struct HostStreamOptions {
  /// Before each operation the worker sleeps a random time in [0, max_delay] (half of the operations: none);
  /// 0 runs every operation at once.
  std::chrono::microseconds max_delay{0};
  std::uint64_t seed = 0;  ///< the delays' seed; each stream mixes in its own serial number
};

class HostStream;

namespace detail {

/// splitmix64: the delays' generator (small, and the same everywhere).
inline std::uint64_t splitmix64(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

inline std::uint64_t next_host_stream_serial() {
  static std::atomic<std::uint64_t> serial{0};
  return serial.fetch_add(1, std::memory_order_relaxed);
}

struct HostCapture;

/// One record of an event: reached when the recording stream runs it (with that stream's failure, if any). Waits
/// capture the record that is current when they are made, so a later record never releases them, as with CUDA.
class HostEventRecord {
 public:
  void reach(std::exception_ptr failure) {
    {
      std::lock_guard lock(mutex_);
      reached_ = true;
      failure_ = std::move(failure);
    }
    changed_.notify_all();
  }
  /// Blocks until reached; returns the recording stream's failure, if any.
  std::exception_ptr wait() {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return reached_; });
    return failure_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  bool reached_ = false;
  std::exception_ptr failure_;

 public:
  /// Set where the record was made on a capturing stream: it is reached only in a replay of the capture.
  std::shared_ptr<HostCapture> capture;
  std::size_t number = 0;  ///< its number in the capture
};

/// Work recorded on HostStreams during a capture (HostStream::begin_capture): the steps in the order they were made,
/// each on its stream; event records and waits between the streams are numbered, so that a replay makes fresh ones.
struct HostCapture {
  struct Step {
    enum class Kind { op, record, wait, issue };
    HostStream* stream = nullptr;
    Kind kind = Kind::op;
    std::function<void(const std::exception_ptr&)> op;  ///< Kind::op: the operation, given the stream's error
    bool always = false;                                ///< Kind::op: runs after a failure too (enqueue_always)
    std::size_t record = 0;                             ///< Kind::record, Kind::wait: the capture's record number
    std::function<void(Stream)> issue;                  ///< Kind::issue: called at each replay (HostStream::issue)
  };
  HostStream* origin = nullptr;
  std::vector<HostStream*> streams;  ///< origin first, then the streams that joined
  std::vector<Step> steps;
  std::size_t records = 0;
  std::atomic<bool> ended{false};  ///< end_capture ran: its records are reached in replays only

  void add(HostStream* stream, Step::Kind kind, std::size_t record) {
    Step step;
    step.stream = stream;
    step.kind = kind;
    step.record = record;
    steps.push_back(std::move(step));
  }
  void add_op(HostStream* stream, std::function<void(const std::exception_ptr&)> op, bool always) {
    Step step;
    step.stream = stream;
    step.op = std::move(op);
    step.always = always;
    steps.push_back(std::move(step));
  }
  void add_issue(HostStream* stream, std::function<void(Stream)> issue) {
    Step step;
    step.stream = stream;
    step.kind = Step::Kind::issue;
    step.issue = std::move(issue);
    steps.push_back(std::move(step));
  }
};

/// An event: its most recent record (none before the first).
struct HostEventState {
  std::mutex mutex;
  std::shared_ptr<HostEventRecord> current;
};

}  // namespace detail

class HostGraph;

/// A host "stream": a worker thread running enqueued operations in order (see the top of this file).
class HostStream {
 public:
  explicit HostStream(HostStreamOptions options = {}) : HostStream(options, detail::error_rank(), Role::user) {}
  HostStream(const HostStream&) = delete;
  HostStream& operator=(const HostStream&) = delete;
  /// Runs what is queued, then stops the worker. An error nobody synchronized on is logged.
  ~HostStream() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    queued_.notify_all();
    worker_.join();
    if (failure_ && !failure_seen_ && role_ == Role::user)
      std::fprintf(stderr, "tandem: a HostStream was destroyed with an error nobody read: %s\n",
                   detail::exception_message(failure_).c_str());
  }

  /// This stream as the last argument of an asynchronous call.
  Stream stream() { return {this, StreamKind::host_queue}; }

  /// Runs op() after everything enqueued before it; skipped once the stream has failed. An exception it throws
  /// becomes the stream's error. Throws the stream's error if it has already failed.
  void enqueue(std::function<void()> op) {
    push([op = std::move(op)](const std::exception_ptr& failed) {
      if (!failed) op();
    });
  }

  /// Like enqueue, but also runs after a failure, given the stream's error (null if none): event records and
  /// waits, and frees, which must happen whatever came before.
  void enqueue_always(std::function<void(const std::exception_ptr&)> op) { push(std::move(op), Admit::always); }

  /// Calls call(stream()) now, on the calling thread, to enqueue work there: for a library that orders its operations
  /// when they are issued, whatever their stream, as NCCL orders a communicator's (LocalComm does so with an event
  /// chain). During a capture the call is recorded instead, and each replay makes it, at its place among the captured
  /// steps, with the stream that replays this stream's part: NCCL orders a graph's operations at the graph's launch.
  void issue(std::function<void(Stream)> call) {
    {
      std::lock_guard lock(mutex_);
      if (capture_ != nullptr) {
        capture_->add_issue(this, std::move(call));
        return;
      }
    }
    call(stream());
  }

  /// Blocks until every operation enqueued so far has run; throws the stream's error, or tandem::error while the
  /// stream is capturing (nothing it recorded has run).
  void synchronize() {
    std::unique_lock lock(mutex_);
    if (capture_ != nullptr)
      detail::fail(
          "tandem: a HostStream was synchronized (or read) while capturing; a captured step must not wait "
          "for its work (as in CUDA graph capture)");
    const std::uint64_t target = enqueued_;
    drained_.wait(lock, [&] { return done_ >= target; });
    rethrow_locked();
  }

 private:
  using Op = std::function<void(const std::exception_ptr&)>;
  enum class Admit { unless_failed, always };
  /// A graph's stream runs a joined stream's part of its replays; its error reaches the capturing stream through the
  /// event it rejoins by, and is read there, so it is not logged again.
  enum class Role { user, graph };
  HostStream(HostStreamOptions options, int rank, Role role)
      : options_(options),
        random_(options.seed ^ (detail::next_host_stream_serial() * 0xd1b54a32d192ed03ull)),
        rank_(rank),
        role_(role) {
    worker_ = std::thread([this] { work(); });
  }
  friend class HostEvent;
  friend class HostGraph;

  /// A record of this stream's current point: reached when the stream runs it, or numbered in the capture.
  std::shared_ptr<detail::HostEventRecord> record_point() {
    auto record = std::make_shared<detail::HostEventRecord>();
    {
      std::lock_guard lock(mutex_);
      if (capture_ != nullptr) {
        record->capture = capture_;
        record->number = capture_->records++;
        capture_->add(this, Kind::record, record->number);
        return record;
      }
    }
    enqueue_always([record](const std::exception_ptr& failed) { record->reach(failed); });
    return record;
  }

  /// Later work on this stream waits for `record`. A record made during a capture makes this stream join it.
  void wait_for(std::shared_ptr<detail::HostEventRecord> record) {
    {
      std::lock_guard lock(mutex_);
      if (record->capture != nullptr && record->capture->ended)
        detail::fail(
            "tandem: a HostStream waited on an event last recorded during a capture that has ended (its "
            "record is reached only inside a replay); record the event again first");
      if (record->capture != nullptr && capture_ != record->capture) {
        if (capture_ != nullptr)
          detail::fail("tandem: a HostStream capturing one capture waited on an event of another capture");
        capture_ = record->capture;  // joins
        capture_->streams.push_back(this);
      }
      if (capture_ != nullptr) {
        if (record->capture == nullptr)
          detail::fail(
              "tandem: a capturing HostStream waited on an event recorded outside the capture; CUDA refuses such a "
              "wait (cudaErrorStreamCaptureIsolation: a dependency across the capture's boundary)");
        capture_->add(this, Kind::wait, record->number);
        return;
      }
    }
    enqueue_always([record = std::move(record)](const std::exception_ptr& failed) {
      if (failed) return;  // this stream is failed already: nothing after it runs anyway
      if (std::exception_ptr failure = record->wait()) std::rethrow_exception(failure);
    });
  }
  using Kind = detail::HostCapture::Step::Kind;

  void rethrow_locked() {
    if (!failure_) return;
    failure_seen_ = true;
    std::rethrow_exception(failure_);
  }

  void push(Op op, Admit admit = Admit::unless_failed) {
    {
      std::lock_guard lock(mutex_);
      if (admit == Admit::unless_failed) rethrow_locked();
      if (capture_ != nullptr) {
        capture_->add_op(this, std::move(op), admit == Admit::always);
        return;
      }
      queue_.push_back(std::move(op));
      ++enqueued_;
    }
    queued_.notify_one();
  }

  void delay() {
    if (options_.max_delay.count() <= 0) return;
    const std::uint64_t r = detail::splitmix64(random_);
    if (r & 1) return;
    const auto span = static_cast<std::uint64_t>(options_.max_delay.count()) + 1;
    std::this_thread::sleep_for(std::chrono::microseconds(static_cast<std::int64_t>((r >> 1) % span)));
  }

  void work() {
    detail::error_rank() = rank_;  // errors raised by the operations name the creating thread's rank
    for (;;) {
      Op op;
      std::exception_ptr failed;
      {
        std::unique_lock lock(mutex_);
        queued_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and everything has run
        op = std::move(queue_.front());
        queue_.pop_front();
        failed = failure_;
      }
      delay();
      try {
        op(failed);
      } catch (...) {
        std::lock_guard lock(mutex_);
        if (!failure_) failure_ = std::current_exception();
      }
      op = nullptr;  // what it captured (a buffer being freed, say) goes now, in stream order
      {
        std::lock_guard lock(mutex_);
        ++done_;
      }
      drained_.notify_all();
    }
  }

  HostStreamOptions options_;
  std::uint64_t random_;  // the worker's alone
  int rank_;
  Role role_;
  std::mutex mutex_;
  std::condition_variable queued_, drained_;
  std::deque<Op> queue_;
  std::uint64_t enqueued_ = 0, done_ = 0;
  std::exception_ptr failure_;
  bool failure_seen_ = false;
  bool stopping_ = false;
  std::shared_ptr<detail::HostCapture> capture_;  ///< the capture this stream records into (null: none)
  std::thread worker_;                            // last: it starts once everything above exists

 public:
  /// From now on, what is enqueued on this stream is recorded, not run (see the top of this file).
  void begin_capture() {
    std::lock_guard lock(mutex_);
    if (capture_ != nullptr) detail::fail("tandem: HostStream::begin_capture on a stream that is capturing already");
    capture_ = std::make_shared<detail::HostCapture>();
    capture_->origin = this;
    capture_->streams.push_back(this);
  }

  /// Whether what is enqueued on this stream now is recorded into a capture rather than run.
  bool capturing() {
    std::lock_guard lock(mutex_);
    return capture_ != nullptr;
  }

  /// Ends the capture begun on this stream and returns its work. Every stream that joined must have rejoined: its
  /// last step a record that this stream waited on after it (else tandem::error, and the capture ends unused).
  HostGraph end_capture();
};

/// Work captured on HostStreams (HostStream::end_capture), to be replayed. Copies share the graph.
class HostGraph {
 public:
  /// Enqueues the captured work again (cudaGraphLaunch), with a fresh record for every event record made during the
  /// capture: the capturing stream's steps on it, after what was enqueued there before; each joined stream's steps, in
  /// their order, on a stream of the graph's own (with the joined stream's delays and rank), after the capturing
  /// stream's record it first waited on. Later work on the capturing stream waits for the whole replay (every joined
  /// stream rejoined it); work on the streams that joined neither waits for it nor holds it up, as with a CUDA graph.
  void replay() const {
    std::vector<std::shared_ptr<detail::HostEventRecord>> records(capture_->records);
    for (auto& r : records) r = std::make_shared<detail::HostEventRecord>();
    for (std::size_t i = 0; i < capture_->steps.size(); ++i) {
      const detail::HostCapture::Step& step = capture_->steps[i];
      using Kind = detail::HostCapture::Step::Kind;
      HostStream& q = *streams_->of_step[i];
      if (step.kind == Kind::op)
        q.push(step.op, step.always ? HostStream::Admit::always : HostStream::Admit::unless_failed);
      else if (step.kind == Kind::issue)
        step.issue(q.stream());
      else if (step.kind == Kind::record)
        q.enqueue_always([r = records[step.record]](const std::exception_ptr& failed) { r->reach(failed); });
      else
        q.enqueue_always([r = records[step.record]](const std::exception_ptr& failed) {
          if (failed) return;
          if (std::exception_ptr failure = r->wait()) std::rethrow_exception(failure);
        });
    }
  }
  /// Operations, event records and waits captured.
  std::size_t size() const { return capture_->steps.size(); }

 private:
  friend class HostStream;
  /// The streams replays run on: the graph's own, one per joined stream, and each step's.
  struct Streams {
    std::vector<std::unique_ptr<HostStream>> own;
    std::vector<HostStream*> of_step;
  };
  explicit HostGraph(std::shared_ptr<const detail::HostCapture> capture)
      : capture_(std::move(capture)), streams_(std::make_shared<Streams>()) {
    const std::vector<HostStream*>& captured = capture_->streams;  // the capturing stream first
    std::vector<HostStream*> replayed{captured[0]};
    for (std::size_t k = 1; k < captured.size(); ++k) {
      streams_->own.emplace_back(new HostStream(captured[k]->options_, captured[k]->rank_, HostStream::Role::graph));
      replayed.push_back(streams_->own.back().get());
    }
    for (const detail::HostCapture::Step& step : capture_->steps)
      streams_->of_step.push_back(replayed[static_cast<std::size_t>(
          std::find(captured.begin(), captured.end(), step.stream) - captured.begin())]);
  }
  std::shared_ptr<const detail::HostCapture> capture_;
  std::shared_ptr<Streams> streams_;
};

inline HostGraph HostStream::end_capture() {
  std::shared_ptr<detail::HostCapture> capture;
  {
    std::lock_guard lock(mutex_);
    if (capture_ == nullptr || capture_->origin != this)
      detail::fail("tandem: HostStream::end_capture on a stream that did not begin a capture");
    capture = capture_;
  }
  // Stop every stream's recording first, so that a failed check below leaves no stream capturing.
  capture->ended = true;
  for (HostStream* q : capture->streams) {
    std::lock_guard lock(q->mutex_);
    q->capture_.reset();
  }
  using Kind = detail::HostCapture::Step::Kind;
  const std::vector<detail::HostCapture::Step>& steps = capture->steps;
  for (std::size_t k = 1; k < capture->streams.size(); ++k) {
    const HostStream* joined = capture->streams[k];
    std::size_t last = steps.size();
    for (std::size_t i = 0; i < steps.size(); ++i)
      if (steps[i].stream == joined) last = i;
    bool rejoined = last < steps.size() && steps[last].kind == Kind::record;
    if (rejoined) {
      rejoined = false;
      for (std::size_t i = last + 1; i < steps.size(); ++i)
        if (steps[i].stream == this && steps[i].kind == Kind::wait && steps[i].record == steps[last].record)
          rejoined = true;
    }
    if (!rejoined)
      detail::fail(
          "tandem: HostStream::end_capture: a stream joined the capture and did not rejoin it (record an "
          "event on it last and make the capturing stream wait for it)");
  }
  return HostGraph(std::move(capture));
}

namespace detail {

/// The HostStream a Stream names, or null for the calling thread. Throws for a stream of another kind.
inline HostStream* host_queue(Stream s) {
  if (s.handle == nullptr) return nullptr;
  if (s.kind != StreamKind::host_queue)
    fail(
        "tandem: a native (CUDA) stream was passed to the stream-faithful host backend or a host communicator; "
        "pass a tandem::HostStream's stream(), or Stream{} for the calling thread");
  return static_cast<HostStream*>(s.handle);
}

/// Runs op on `s`: enqueued on its HostStream, or now on the calling thread for Stream{}.
template <class Op>
void run_on(Stream s, Op&& op) {
  if (HostStream* q = host_queue(s))
    q->enqueue(std::forward<Op>(op));
  else
    op();
}

}  // namespace detail

/// An event of HostStreams (see the top of this file). Copies share one event.
class HostEvent {
 public:
  HostEvent() : state_(std::make_shared<detail::HostEventState>()) {}

  /// Marks the point `s` has reached (Stream{}: now).
  void record(Stream s) {
    HostStream* q = detail::host_queue(s);
    std::shared_ptr<detail::HostEventRecord> record;
    if (q != nullptr) {
      record = q->record_point();
    } else {
      record = std::make_shared<detail::HostEventRecord>();
      record->reach(nullptr);
    }
    std::lock_guard lock(state_->mutex);
    state_->current = std::move(record);
  }

  /// Later work on `s` waits for the most recent record made before this call (Stream{}: the calling thread blocks,
  /// and rethrows the recording stream's error).
  void wait_on(Stream s) const {
    std::shared_ptr<detail::HostEventRecord> record;
    {
      std::lock_guard lock(state_->mutex);
      record = state_->current;
    }
    if (record == nullptr) return;  // never recorded: nothing to wait for
    HostStream* q = detail::host_queue(s);
    if (q != nullptr) return q->wait_for(std::move(record));
    if (record->capture != nullptr)
      detail::fail("tandem: the host waited on an event recorded during a capture (it is reached only in a replay)");
    if (std::exception_ptr failure = record->wait()) std::rethrow_exception(failure);
  }

 private:
  std::shared_ptr<detail::HostEventState> state_;
};

/// A host allocation freed in order on a HostStream (cudaFreeAsync's counterpart), poisoned as it begins and ends.
template <class T>
class StreamHostBuffer {
 public:
  StreamHostBuffer() = default;
  StreamHostBuffer(std::size_t n, std::shared_ptr<HostStream> stream)
      : buffer_(std::make_shared<HostBuffer<T>>(n)), stream_(std::move(stream)) {
    if (buffer_->bytes() != 0) std::memset(static_cast<void*>(buffer_->data()), 0xFF, buffer_->bytes());
  }
  StreamHostBuffer(StreamHostBuffer&& o) noexcept = default;
  StreamHostBuffer& operator=(StreamHostBuffer&& o) noexcept {
    if (this != &o) {
      release();
      buffer_ = std::move(o.buffer_);
      stream_ = std::move(o.stream_);
    }
    return *this;
  }
  StreamHostBuffer(const StreamHostBuffer&) = delete;
  StreamHostBuffer& operator=(const StreamHostBuffer&) = delete;
  ~StreamHostBuffer() { release(); }

  T* data() const { return buffer_ ? buffer_->data() : nullptr; }
  std::size_t size() const { return buffer_ ? buffer_->size() : 0; }
  std::size_t bytes() const { return size() * sizeof(T); }

 private:
  void release() noexcept {
    if (!buffer_) return;
    try {
      stream_->enqueue_always([buffer = std::move(buffer_)](const std::exception_ptr&) {
        if (buffer->bytes() != 0) std::memset(static_cast<void*>(buffer->data()), 0xFF, buffer->bytes());
      });  // the buffer itself is freed when the worker drops the operation
    } catch (...) {
      std::fprintf(stderr, "tandem: could not enqueue a StreamHostBuffer's free; it is freed now\n");
    }
    buffer_.reset();
    stream_.reset();
  }
  std::shared_ptr<HostBuffer<T>> buffer_;
  std::shared_ptr<HostStream> stream_;
};

struct StreamHostBackendOptions {
  int threads = 1;                  ///< threads one launch is split across, on its stream's worker
  HostStreamOptions work_stream{};  ///< the delays of the backend's own work stream
  HostStreamOptions comm_stream{};  ///< the delays of its comm stream
};

/// HostBackend's operations, each enqueued on its stream (see the top of this file). Owns a work stream.
class StreamHostBackend {
 public:
  template <class T>
  using Buffer = StreamHostBuffer<T>;
  using Event = HostEvent;

  /// Buffers are host memory, but the host must not read them without read() or a synchronize: as on a device.
  static constexpr bool host_memory = false;

  StreamHostBackend() : StreamHostBackend(StreamHostBackendOptions{}) {}
  explicit StreamHostBackend(StreamHostBackendOptions options)
      : direct_(HostBackendOptions{.threads = options.threads}),
        work_(std::make_shared<HostStream>(options.work_stream)),
        comm_(std::make_shared<HostStream>(options.comm_stream)) {}
  /// Move-only, as CudaBackend: a copy would share the work stream, and ranks given copies of one backend would
  /// queue their collectives on one worker, where the first blocks the others (a hang until the timeout).
  StreamHostBackend(StreamHostBackend&&) noexcept = default;
  StreamHostBackend& operator=(StreamHostBackend&&) noexcept = default;
  StreamHostBackend(const StreamHostBackend&) = delete;
  StreamHostBackend& operator=(const StreamHostBackend&) = delete;

  static constexpr const char* name() { return "host-stream"; }
  /// tandem's work stream: a HostStream the backend owns.
  Stream stream() const { return work_->stream(); }
  /// tandem's comm stream: a second HostStream the backend owns (as CudaBackend::comm_stream).
  Stream comm_stream() const { return comm_->stream(); }

  template <class T>
  Buffer<T> allocate(std::size_t n) const {
    return Buffer<T>(n, work_);
  }

  void copy(void* dst, const void* src, std::size_t bytes, Stream s = {}) const {
    if (bytes == 0 || dst == src) return;
    detail::run_on(s, [dst, src, bytes] { std::memmove(dst, src, bytes); });
  }

  void zero(void* dst, std::size_t bytes, Stream s = {}) const {
    if (bytes == 0) return;
    detail::run_on(s, [dst, bytes] { std::memset(dst, 0, bytes); });
  }

  /// Copies `bytes` to the host once `s` reaches this point, and waits for it.
  void read(void* host, const void* src, std::size_t bytes, Stream s = {}) const {
    copy(host, src, bytes, s);
    synchronize(s);
  }

  template <class Body>
  void launch(std::size_t items, const Body& body, Stream s = {}) const {
    if (items == 0) return;
    detail::run_on(s, [direct = direct_, items, body] { direct.launch(items, body); });
  }

  /// *out = the sum over items of body(item, 0, 1), added in item order, once `s` reaches this point.
  template <class Body>
  void sum_to(std::size_t items, const Body& body, double* out, Stream s = {}) const {
    detail::run_on(s, [direct = direct_, items, body, out] { *out = direct.sum(items, body); });
  }

  /// The sum of sum_to, read back to the host (waits for `s`).
  template <class Body>
  double sum(std::size_t items, const Body& body, Stream s = {}) const {
    double total = 0.0;
    sum_to(items, body, &total, s);
    synchronize(s);
    return total;
  }

  Event make_event() const { return Event{}; }
  void record(Event& event, Stream s) const { event.record(s); }
  void wait(Stream s, const Event& event) const { event.wait_on(s); }

  /// Blocks until `s` has run everything enqueued on it; throws its error.
  void synchronize(Stream s = {}) const {
    if (HostStream* q = detail::host_queue(s)) q->synchronize();
  }
  /// Whether `s` is capturing (HostStream::begin_capture, or a stream that joined its capture).
  bool capturing(Stream s) const {
    HostStream* q = detail::host_queue(s);
    return q != nullptr && q->capturing();
  }

  const HostBackendOptions& options() const { return direct_.options(); }

 private:
  HostBackend direct_;
  std::shared_ptr<HostStream> work_;
  std::shared_ptr<HostStream> comm_;
};

}  // namespace tandem
