// SPDX-License-Identifier: Apache-2.0
// Adding tandem to an existing CUDA training loop (docs/cuda.md). The "model" keeps its own parameters and
// gradients in device memory and runs its own kernels on its own stream; tandem is told which buffers to train,
// which stream backward runs on, and (optionally) when each gradient is complete, so that the bucket's
// reduction overlaps the rest of backward. One rank per visible GPU (NcclGroup); without a GPU it says so. It fails
// (exit code 1, one line) where training did not move the first parameter into (0, 1) or the ranks' copies differ.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "tandem/backend/cuda.hpp"
#include "tandem/comm/nccl.hpp"
#include "tandem/tandem.hpp"

namespace {

// The user's backward for one tensor: a stand-in gradient, 0.1 * sin(i) + w - target (pulls w to `target`).
__global__ void toy_backward(const float* w, float* g, std::size_t n, float target, int rank) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x)
    g[i] = 0.1f * sinf(static_cast<float>(i + rank)) + (w[i] - target);
}

}  // namespace

int main() {
  if (tandem::visible_cuda_devices() == 0) {
    std::printf("cuda_integration: no CUDA device here; nothing to run\n");
    return 0;
  }
  const std::vector<std::size_t> sizes = {50257 * 64, 64, 64 * 256, 256, 256 * 64, 64};
  std::vector<int> rank_failed(static_cast<std::size_t>(tandem::visible_cuda_devices()), 0);  // a flag per rank
  try {
    tandem::NcclGroup::all_devices().run([&](tandem::Nccl& comm) {
      cudaStream_t stream = nullptr;  // the user's compute stream
      TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      std::vector<float*> params(sizes.size()), grads(sizes.size());
      std::vector<tandem::TensorRef> refs;
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        TANDEM_CUDA_CHECK(cudaMallocAsync(&params[i], sizes[i] * sizeof(float), stream));
        TANDEM_CUDA_CHECK(cudaMallocAsync(&grads[i], sizes[i] * sizeof(float), stream));
        TANDEM_CUDA_CHECK(cudaMemsetAsync(params[i], 0, sizes[i] * sizeof(float), stream));
        refs.push_back({"layer" + std::to_string(i), params[i], grads[i], sizes[i], tandem::DType::fp32});
      }
      {
        // 1. Wrap the buffers; tandem's work is ordered after `stream` and on its own work stream. `stream` must
        //    outlive `dp`: its destructor orders the release of tandem's buffers after the work issued on `stream`.
        tandem::DataParallel<tandem::GradientSharded, tandem::AdamW, tandem::CudaBackend, tandem::Nccl> dp(
            comm, refs, {.lr = 1e-2f}, {.max_grad_norm = 1.0f, .stream = {stream}});
        dp.broadcast_parameters();  // rank 0's initial values everywhere
        for (int step = 0; step < 20; ++step) {
          // 2. Backward produces gradients last layer first; announce each one as soon as its kernel is enqueued.
          for (std::size_t i = sizes.size(); i-- > 0;) {
            toy_backward<<<256, 256, 0, stream>>>(params[i], grads[i], sizes[i], 1.0f, comm.rank());
            TANDEM_CUDA_CHECK(cudaGetLastError());
            dp.grad_ready(i);  // the bucket's pack + reduce-scatter start behind this point of `stream`
          }
          // 3. Finish the step: the rest of the reductions, the update, the all-gather, the unpack. Work issued on
          //    `stream` afterwards (the next forward) waits for it; the host does not.
          dp.step();
        }
      }  // 4. `dp` is gone; the buffers it wrapped and the stream are the user's to free
      // Every rank's first parameter, gathered: training moved it from 0 towards 1, and every rank holds the same.
      float* gathered = nullptr;
      const auto ranks = static_cast<std::size_t>(comm.size());
      TANDEM_CUDA_CHECK(cudaMallocAsync(&gathered, ranks * sizeof(float), stream));
      comm.all_gather(params[0], gathered, 1, tandem::DType::fp32, tandem::Stream{stream});
      std::vector<float> w0(ranks);
      TANDEM_CUDA_CHECK(cudaMemcpyAsync(w0.data(), gathered, ranks * sizeof(float), cudaMemcpyDeviceToHost, stream));
      TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream));
      TANDEM_CUDA_CHECK(cudaFreeAsync(gathered, stream));
      bool agree = true;
      for (const float w : w0) agree = agree && w == w0[0];
      rank_failed[static_cast<std::size_t>(comm.rank())] = !(agree && w0[0] > 0.0f && w0[0] < 1.0f);
      if (comm.rank() == 0)
        std::printf("cuda_integration: %d rank(s), 20 steps, first parameter %.4f (moving from 0 towards 1), %s\n",
                    comm.size(), w0[0], agree ? "the same on every rank" : "DIFFERENT ACROSS RANKS");
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        TANDEM_CUDA_CHECK(cudaFreeAsync(params[i], stream));
        TANDEM_CUDA_CHECK(cudaFreeAsync(grads[i], stream));
      }
      TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream));
      TANDEM_CUDA_CHECK(cudaStreamDestroy(stream));
    });
  } catch (const std::exception& e) {  // a CUDA, NCCL or tandem error on any rank: NcclGroup::run rethrows the first
    std::fprintf(stderr, "cuda_integration: %s\n", e.what());
    return 1;
  }
  if (std::count(rank_failed.begin(), rank_failed.end(), 1) != 0) {
    std::fprintf(stderr, "cuda_integration: the first parameter is outside (0, 1) or differs across ranks\n");
    return 1;
  }
  return 0;
}
