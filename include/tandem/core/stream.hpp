// SPDX-License-Identifier: Apache-2.0
// A backend-neutral stream handle: the last argument of every asynchronous call.
//   HostBackend          work runs in call order on the calling thread; the handle is ignored.
//   StreamHostBackend    a HostStream's worker thread (kind host_queue, handle a tandem::HostStream*); a null
//                        handle is the calling thread itself (work runs before the call returns).
//   CudaBackend, Nccl    a cudaStream_t (kind native); null is CUDA's default stream.
#pragma once

namespace tandem {

/// What a Stream's handle is.
enum class StreamKind : unsigned char {
  native,     ///< the device runtime's stream (cudaStream_t), or none
  host_queue  ///< a tandem::HostStream (backend/host_stream.hpp)
};

struct Stream {
  void* handle = nullptr;  ///< cudaStream_t, or HostStream* when kind is host_queue
  StreamKind kind = StreamKind::native;
};

}  // namespace tandem
