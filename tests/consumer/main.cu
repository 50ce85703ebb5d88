// SPDX-License-Identifier: Apache-2.0
// A user's CUDA program (TANDEM_CONSUMER_CUDA): a .cu file that includes tandem's umbrella and CUDA backend headers,
// with a kernel of its own on tandem's types, built with nothing but tandem::cuda (C++20 included). It prints the
// version and how many GPUs it sees; without one it launches nothing.
#include <cstdio>
#include <tandem/backend/cuda.hpp>
#include <tandem/tandem.hpp>

__global__ void halve(tandem::BFloat16* x, int n) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) x[i] = tandem::convert<tandem::BFloat16>(0.5f * tandem::convert<float>(x[i]));
}

int main() {
  std::printf("tandem %s (CUDA, %d GPU(s) visible)\n", tandem::version_string(), tandem::visible_cuda_devices());
  return 0;
}
