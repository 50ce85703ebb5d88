// SPDX-License-Identifier: Apache-2.0
// detail::native(Stream): the cudaStream_t of a tandem::Stream, for CudaBackend and Nccl. A host_queue stream (a
// tandem::HostStream of the stream-faithful host backend) is refused with tandem::error: taken for a cudaStream_t it
// would be a pointer to something else entirely.
#pragma once

#include <cuda_runtime.h>

#include "tandem/core/config.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/stream.hpp"

namespace tandem::detail {

[[noreturn]] TANDEM_COLD inline void fail_host_queue_stream() {
  fail(
      "tandem: a CUDA call (CudaBackend or Nccl) was given a host_queue Stream, a tandem::HostStream of the "
      "stream-faithful host backend (StreamHostBackend), which is not a cudaStream_t: pass tandem::Stream{stream} "
      "with a cudaStream_t (kind native; a null handle is CUDA's default stream), or run that work on "
      "StreamHostBackend and LocalComm");
}

/// The CUDA stream `s` names; throws tandem::error when `s` is a host_queue stream.
inline cudaStream_t native(Stream s) {
  if (s.kind != StreamKind::native) fail_host_queue_stream();
  return static_cast<cudaStream_t>(s.handle);
}

}  // namespace tandem::detail
