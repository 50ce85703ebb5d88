// SPDX-License-Identifier: Apache-2.0
// The README's hello world: 4 ranks (threads) train one parameter vector with ZeRO-2 and AdamW.
#include <cstdio>
#include <tandem/tandem.hpp>
#include <vector>

int main() {
  tandem::LocalGroup(4).run([](tandem::LocalComm& comm) {
    std::vector<float> w(1000, 1.0f), g(1000);  // your parameters and gradients
    tandem::DataParallel<tandem::GradientSharded, tandem::AdamW> dp(comm, {{"w", w.data(), g.data(), w.size()}},
                                                                    {.lr = 0.05f});
    for (int step = 0; step < 100; ++step) {
      for (std::size_t i = 0; i < w.size(); ++i) g[i] = w[i] - 0.5f * comm.rank();  // your backward
      dp.step();                                                                    // average, update, regather
    }
    if (comm.rank() == 0) std::printf("w[0] = %.3f (every rank agrees)\n", w[0]);
  });
}
