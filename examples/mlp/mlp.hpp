// SPDX-License-Identifier: Apache-2.0
// A small multi-layer perceptron with a hand-written backward pass, and a synthetic classification task.
// It is the "user's model" of the host example and of the equivalence tests: its parameters and gradients
// are the user's own buffers (std::vector), which tandem wraps with TensorRefs.
//
// Shape: x (batch x d0) -> [scale by g (d0)] -> L1 -> tanh -> ... -> L_last -> logits (batch x classes),
// softmax cross-entropy averaged over the batch. Layer l has weight W_l (d_{l+1} x d_l, row-major) and bias b_l.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "tandem/core/dtype.hpp"
#include "tandem/core/tensor.hpp"

namespace mlp {

/// A deterministic synthetic task: inputs ~ N(0, 1); the label is the argmax of a fixed random teacher
/// network (one tanh hidden layer), so it is learnable but not linearly trivial.
struct Dataset {
  int features = 0, classes = 0;
  std::vector<float> x;  // samples x features
  std::vector<int> y;    // samples

  Dataset(int samples, int features_, int classes_, std::uint64_t seed) : features(features_), classes(classes_) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> n01(0.0f, 1.0f);
    const int hidden = 16;
    std::vector<float> a(static_cast<std::size_t>(hidden * features)), b(static_cast<std::size_t>(classes * hidden));
    for (auto& v : a) v = n01(rng);
    for (auto& v : b) v = n01(rng);
    x.resize(static_cast<std::size_t>(samples) * features);
    y.resize(static_cast<std::size_t>(samples));
    for (auto& v : x) v = n01(rng);
    for (int s = 0; s < samples; ++s) {
      std::vector<float> h(hidden);
      for (int j = 0; j < hidden; ++j) {
        float acc = 0;
        for (int i = 0; i < features; ++i)
          acc += a[static_cast<std::size_t>(j * features + i)] * x[static_cast<std::size_t>(s * features + i)];
        h[static_cast<std::size_t>(j)] = std::tanh(acc);
      }
      int best = 0;
      float best_v = -1e30f;
      for (int c = 0; c < classes; ++c) {
        float acc = 0;
        for (int j = 0; j < hidden; ++j)
          acc += b[static_cast<std::size_t>(c * hidden + j)] * h[static_cast<std::size_t>(j)];
        if (acc > best_v) best_v = acc, best = c;
      }
      y[static_cast<std::size_t>(s)] = best;
    }
  }
  int size() const { return static_cast<int>(y.size()); }
};

/// The model, with parameters of type T (float, tandem::BFloat16 or tandem::Float16); maths in float.
template <class T>
class Mlp {
 public:
  /// dims = {features, hidden..., classes}; weights drawn from `seed` (ranks may differ: broadcast fixes it).
  Mlp(std::vector<int> dims, std::uint64_t seed) : dims_(std::move(dims)) {
    std::mt19937_64 rng(seed);
    add("input.gain", static_cast<std::size_t>(dims_[0]), [&](std::size_t) { return 1.0f; });
    for (std::size_t l = 0; l + 1 < dims_.size(); ++l) {
      const float bound = 1.0f / std::sqrt(static_cast<float>(dims_[l]));
      std::uniform_real_distribution<float> u(-bound, bound);
      add("layers." + std::to_string(l) + ".weight", static_cast<std::size_t>(dims_[l + 1] * dims_[l]),
          [&](std::size_t) { return u(rng); });
      add("layers." + std::to_string(l) + ".bias", static_cast<std::size_t>(dims_[l + 1]),
          [&](std::size_t) { return u(rng); });
    }
  }

  /// The tensors, in model order, as tandem sees them.
  std::vector<tandem::TensorRef> tensors() {
    std::vector<tandem::TensorRef> refs;
    for (std::size_t i = 0; i < params_.size(); ++i)
      refs.push_back({names_[i], params_[i].data(), grads_[i].data(), params_[i].size(), tandem::dtype_of<T>});
    return refs;
  }

  std::vector<std::vector<T>>& params() { return params_; }
  std::vector<std::vector<T>>& grads() { return grads_; }

  /// Forward and backward over samples [begin, begin + count) of `data`; overwrites the gradients with the
  /// gradient of the mean loss over those samples and returns that mean loss.
  float forward_backward(const Dataset& data, int begin, int count) {
    const std::size_t layers = dims_.size() - 1;
    std::vector<std::vector<float>> acts(layers + 1);  // acts[0] = scaled input, acts[l] = tanh outputs
    std::vector<std::vector<float>> grad_acc(params_.size());
    for (std::size_t i = 0; i < params_.size(); ++i) grad_acc[i].assign(params_[i].size(), 0.0f);
    const std::vector<float> gain = as_float(params_[0]);
    std::vector<std::vector<float>> w(layers), wt(layers), b(layers);  // wt: W transposed (in x out)
    for (std::size_t l = 0; l < layers; ++l) {
      w[l] = as_float(params_[1 + 2 * l]);
      b[l] = as_float(params_[2 + 2 * l]);
      const std::size_t in = static_cast<std::size_t>(dims_[l]), out = static_cast<std::size_t>(dims_[l + 1]);
      wt[l].resize(in * out);
      for (std::size_t o = 0; o < out; ++o)
        for (std::size_t i = 0; i < in; ++i) wt[l][i * out + o] = w[l][o * in + i];
    }
    float loss = 0.0f;
    for (int s = begin; s < begin + count; ++s) {
      const float* x = &data.x[static_cast<std::size_t>(s) * static_cast<std::size_t>(data.features)];
      acts[0].resize(static_cast<std::size_t>(dims_[0]));
      for (int i = 0; i < dims_[0]; ++i)
        acts[0][static_cast<std::size_t>(i)] = x[i] * gain[static_cast<std::size_t>(i)];
      for (std::size_t l = 0; l < layers; ++l) {
        const std::size_t in = static_cast<std::size_t>(dims_[l]), out = static_cast<std::size_t>(dims_[l + 1]);
        std::vector<float>& z = acts[l + 1];
        z = b[l];
        for (std::size_t i = 0; i < in; ++i) {  // z += a_i * W[:, i], contiguous in wt
          const float a = acts[l][i];
          const float* col = &wt[l][i * out];
          for (std::size_t o = 0; o < out; ++o) z[o] += a * col[o];
        }
        if (l + 1 < layers)
          for (float& v : z) v = std::tanh(v);
      }
      // softmax cross-entropy on the logits
      std::vector<float>& logits = acts[layers];
      float top = logits[0];
      for (float v : logits) top = std::max(top, v);
      float sum = 0.0f;
      for (float v : logits) sum += std::exp(v - top);
      const int label = data.y[static_cast<std::size_t>(s)];
      loss += std::log(sum) + top - logits[static_cast<std::size_t>(label)];
      std::vector<float> delta(logits.size());
      for (std::size_t c = 0; c < logits.size(); ++c)
        delta[c] = std::exp(logits[c] - top) / sum - (static_cast<int>(c) == label ? 1.0f : 0.0f);
      // backward through the layers
      for (std::size_t l = layers; l-- > 0;) {
        const int in = dims_[l], out = dims_[l + 1];
        std::vector<float>& gw = grad_acc[1 + 2 * l];
        std::vector<float>& gb = grad_acc[2 + 2 * l];
        std::vector<float> prev(static_cast<std::size_t>(in), 0.0f);
        for (int o = 0; o < out; ++o) {
          const float d = delta[static_cast<std::size_t>(o)];
          gb[static_cast<std::size_t>(o)] += d;
          for (int i = 0; i < in; ++i) {
            gw[static_cast<std::size_t>(o * in + i)] += d * acts[l][static_cast<std::size_t>(i)];
            prev[static_cast<std::size_t>(i)] += d * w[l][static_cast<std::size_t>(o * in + i)];
          }
        }
        if (l > 0)
          for (int i = 0; i < in; ++i) {
            const float a = acts[l][static_cast<std::size_t>(i)];
            prev[static_cast<std::size_t>(i)] *= 1.0f - a * a;  // tanh'
          }
        delta = std::move(prev);
      }
      for (int i = 0; i < dims_[0]; ++i)
        grad_acc[0][static_cast<std::size_t>(i)] += delta[static_cast<std::size_t>(i)] * x[i];
    }
    const float inv = 1.0f / static_cast<float>(count);
    for (std::size_t i = 0; i < params_.size(); ++i)
      for (std::size_t e = 0; e < params_[i].size(); ++e) grads_[i][e] = T(grad_acc[i][e] * inv);
    return loss * inv;
  }

  /// Fraction of samples [begin, begin + count) classified correctly.
  double accuracy(const Dataset& data, int begin, int count) const {
    int right = 0;
    const std::size_t layers = dims_.size() - 1;
    for (int s = begin; s < begin + count; ++s) {
      std::vector<float> a(static_cast<std::size_t>(dims_[0]));
      for (int i = 0; i < dims_[0]; ++i)
        a[static_cast<std::size_t>(i)] = data.x[static_cast<std::size_t>(s) * static_cast<std::size_t>(data.features) +
                                                static_cast<std::size_t>(i)] *
                                         static_cast<float>(params_[0][static_cast<std::size_t>(i)]);
      for (std::size_t l = 0; l < layers; ++l) {
        const int in = dims_[l], out = dims_[l + 1];
        std::vector<float> z(static_cast<std::size_t>(out));
        for (int o = 0; o < out; ++o) {
          float acc = static_cast<float>(params_[2 + 2 * l][static_cast<std::size_t>(o)]);
          for (int i = 0; i < in; ++i)
            acc += static_cast<float>(params_[1 + 2 * l][static_cast<std::size_t>(o * in + i)]) *
                   a[static_cast<std::size_t>(i)];
          z[static_cast<std::size_t>(o)] = l + 1 == layers ? acc : std::tanh(acc);
        }
        a = std::move(z);
      }
      int best = 0;
      for (std::size_t c = 1; c < a.size(); ++c)
        if (a[c] > a[static_cast<std::size_t>(best)]) best = static_cast<int>(c);
      right += best == data.y[static_cast<std::size_t>(s)];
    }
    return static_cast<double>(right) / count;
  }

 private:
  template <class F>
  void add(std::string name, std::size_t numel, F init) {
    names_.push_back(std::move(name));
    params_.emplace_back(numel);
    grads_.emplace_back(numel);
    for (std::size_t e = 0; e < numel; ++e) params_.back()[e] = T(init(e));
  }

  static std::vector<float> as_float(const std::vector<T>& v) {
    std::vector<float> f(v.size());
    for (std::size_t e = 0; e < v.size(); ++e) f[e] = static_cast<float>(v[e]);
    return f;
  }

  std::vector<int> dims_;
  std::vector<std::string> names_;
  std::vector<std::vector<T>> params_, grads_;
};

}  // namespace mlp
