// SPDX-License-Identifier: Apache-2.0
// The tiny transformer's default task and model for the tests that train it: sorting lists of 8 distinct numbers
// below 64, the held-out lists drawn with the training lists excluded.
#pragma once

#include <set>
#include <vector>

#include "../../examples/tiny_transformer/train.hpp"

namespace test {

inline tiny::Task sort_task(int train_examples) {
  const tiny::SortTask sort{.length = 8, .values = 64};
  std::set<std::vector<int>> seen;
  tiny::Examples train = sort.make(std::size_t(train_examples), 1, nullptr, &seen);
  tiny::Examples eval = sort.make(2048, 1000004, &seen);
  return {"sort", std::move(train), std::move(eval), sort.vocab(), true};
}

inline tiny::TrainConfig sort_config(int steps) {
  tiny::TrainConfig cfg;
  cfg.model = {.vocab = 65, .context = 16, .width = 64, .layers = 2, .heads = 4, .mlp_ratio = 4};
  cfg.steps = steps;
  cfg.batch = 32;
  cfg.lr = 3e-3f;
  return cfg;
}

}  // namespace test
