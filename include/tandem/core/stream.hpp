// SPDX-License-Identifier: Apache-2.0
// A backend-neutral stream handle: the last argument of every asynchronous call. On the host backend work
// runs in call order and the handle is ignored; on CUDA it carries a cudaStream_t.
#pragma once

namespace tandem {

struct Stream {
  void* handle = nullptr;  ///< cudaStream_t on the CUDA backend; unused on the host backend
};

}  // namespace tandem
