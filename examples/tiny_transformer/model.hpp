// SPDX-License-Identifier: Apache-2.0
// A decoder-only transformer with a hand-written forward and backward pass on the host: token and position
// embeddings, pre-LayerNorm blocks of causal multi-head self-attention and a GELU MLP, a final LayerNorm and
// an output head. Matrix products go through CBLAS (blas.hpp), everything else through the row bodies of
// ops.hpp. It is the "user's model" of the example: its parameters and gradients are its own buffers, which
// tandem wraps with TensorRefs.
//
// Shapes (B sequences of L <= context tokens, N = B*L rows, C width, H heads of D = C/H, F = mlp_ratio*C):
//   x      N x C      residual stream            qkv   N x 3C   [q | k | v], head h at columns h*D
//   probs  B x H x L x L   attention (row i: query i over keys 0..i)
//   h      N x F      MLP pre-activation          logits N x V
// Weights are stored [in][out] (row-major), so a linear layer is y = x W + b and its backward is
// dx = dy W^T, dW = x^T dy, db = column sums of dy.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "blas.hpp"
#include "ops.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/core/tensor.hpp"

namespace tiny {

struct ModelConfig {
  int vocab = 256;
  int context = 128;  ///< the longest sequence (position embeddings)
  int width = 128;
  int layers = 4;
  int heads = 4;
  int mlp_ratio = 4;

  void validate() const {
    auto need = [](bool ok, const std::string& what) {
      if (!ok) throw std::invalid_argument("tiny transformer: " + what);
    };
    need(vocab >= 2, "vocab must be at least 2");
    need(context >= 1, "context must be at least 1");
    need(width >= 1 && heads >= 1, "width and heads must be positive");
    need(width % heads == 0,
         "width (" + std::to_string(width) + ") must be a multiple of heads (" + std::to_string(heads) + ")");
    need(layers >= 1 && mlp_ratio >= 1, "layers and mlp_ratio must be positive");
  }
};

/// What a forward pass does besides computing the loss.
enum class Pass {
  evaluate,  ///< loss and accuracy only
  train      ///< also keep what backward() needs, with the loss gradient ready
};

/// The outcome of a forward pass over a batch.
struct ForwardStats {
  double loss_sum = 0;  ///< summed over the rows with a target
  int rows = 0;         ///< rows with a target (>= 0)
  int correct = 0;      ///< of those, rows whose argmax is the target
  double mean_loss() const { return rows ? loss_sum / rows : 0.0; }
};

template <class T>
class Transformer {
 public:
  /// Builds the model with GPT-2's initialisation (normal(0, 0.02) weights, residual projections scaled by
  /// 1/sqrt(2 layers), zero biases, unit LayerNorm gains), deterministic in `seed`.
  Transformer(ModelConfig config, std::uint64_t seed) : cfg_(config) {
    cfg_.validate();
    const int c = cfg_.width, f = cfg_.mlp_ratio * cfg_.width, v = cfg_.vocab;
    auto add = [&](std::string name, std::size_t numel) {
      tensors_.push_back({std::move(name), total_, numel});
      total_ += numel;
      return tensors_.size() - 1;
    };
    wte_ = add("wte", std::size_t(v) * c);
    wpe_ = add("wpe", std::size_t(cfg_.context) * c);
    for (int l = 0; l < cfg_.layers; ++l) {
      const std::string p = "h." + std::to_string(l) + ".";
      Block blk;
      blk.ln1_w = add(p + "ln_1.weight", c);
      blk.ln1_b = add(p + "ln_1.bias", c);
      blk.qkv_w = add(p + "attn.c_attn.weight", std::size_t(c) * 3 * c);
      blk.qkv_b = add(p + "attn.c_attn.bias", 3 * std::size_t(c));
      blk.proj_w = add(p + "attn.c_proj.weight", std::size_t(c) * c);
      blk.proj_b = add(p + "attn.c_proj.bias", c);
      blk.ln2_w = add(p + "ln_2.weight", c);
      blk.ln2_b = add(p + "ln_2.bias", c);
      blk.fc_w = add(p + "mlp.c_fc.weight", std::size_t(c) * f);
      blk.fc_b = add(p + "mlp.c_fc.bias", f);
      blk.fc2_w = add(p + "mlp.c_proj.weight", std::size_t(f) * c);
      blk.fc2_b = add(p + "mlp.c_proj.bias", c);
      blocks_.push_back(blk);
    }
    lnf_w_ = add("ln_f.weight", c);
    lnf_b_ = add("ln_f.bias", c);
    head_ = add("lm_head.weight", std::size_t(c) * v);
    params_.assign(total_, T(0));
    grads_.assign(total_, T(0));

    std::mt19937_64 rng(seed);
    std::normal_distribution<double> normal(0.0, 0.02);
    const double residual_scale = 1.0 / std::sqrt(2.0 * cfg_.layers);
    auto fill_normal = [&](std::size_t t, double scale) {
      for (std::size_t i = 0; i < tensors_[t].numel; ++i) param(t)[i] = T(normal(rng) * scale);
    };
    auto fill = [&](std::size_t t, T value) { std::fill_n(param(t), tensors_[t].numel, value); };
    fill_normal(wte_, 1.0);
    fill_normal(wpe_, 1.0);
    for (const Block& blk : blocks_) {
      fill(blk.ln1_w, T(1));
      fill_normal(blk.qkv_w, 1.0);
      fill_normal(blk.proj_w, residual_scale);
      fill(blk.ln2_w, T(1));
      fill_normal(blk.fc_w, 1.0);
      fill_normal(blk.fc2_w, residual_scale);
    }
    fill(lnf_w_, T(1));
    fill_normal(head_, 1.0);
  }

  Transformer(const Transformer&) = delete;
  Transformer& operator=(const Transformer&) = delete;

  const ModelConfig& config() const { return cfg_; }
  std::size_t num_parameters() const { return total_; }
  std::size_t num_tensors() const { return tensors_.size(); }
  const std::string& tensor_name(std::size_t t) const { return tensors_[t].name; }
  std::size_t tensor_numel(std::size_t t) const { return tensors_[t].numel; }
  T* param(std::size_t t) { return params_.data() + tensors_[t].offset; }
  T* grad(std::size_t t) { return grads_.data() + tensors_[t].offset; }
  std::vector<T>& parameters() { return params_; }  ///< every tensor, contiguous in tensor order
  std::vector<T>& gradients() { return grads_; }

  /// The model's tensors for tandem, in forward order (param and grad buffers stay the model's).
  std::vector<tandem::TensorRef> tensor_refs() {
    std::vector<tandem::TensorRef> refs;
    for (std::size_t t = 0; t < tensors_.size(); ++t)
      refs.push_back({tensors_[t].name, param(t), grad(t), tensors_[t].numel, tandem::dtype_of<T>});
    return refs;
  }

  /// Runs B sequences of `len` tokens (tokens[b*len + i]); targets[b*len + i] is the token expected after
  /// position i, or -1 for none. With Pass::train the loss gradient (of the mean loss over the rows with a
  /// target) is ready for backward().
  ForwardStats forward(const int* tokens, const int* targets, int batch, int len, Pass pass) {
    if (batch < 1 || len < 1 || len > cfg_.context)
      throw std::invalid_argument("tiny transformer: forward needs batch >= 1 and 1 <= len <= context (" +
                                  std::to_string(cfg_.context) + "), got batch " + std::to_string(batch) + ", len " +
                                  std::to_string(len));
    const int c = cfg_.width, n = batch * len, v = cfg_.vocab;
    reserve(batch, len);
    batch_ = batch;
    len_ = len;
    tokens_.assign(tokens, tokens + n);

    // Embeddings: x[b, i] = wte[token] + wpe[i].
    T* x = act_.x.data();
    for (int r = 0; r < n; ++r) {
      const int tok = tokens[r];
      if (tok < 0 || tok >= v)
        throw std::invalid_argument("tiny transformer: token " + std::to_string(tok) + " at row " + std::to_string(r) +
                                    " is outside the vocabulary [0, " + std::to_string(v) + ")");
      const T* te = param(wte_) + std::size_t(tok) * c;
      const T* pe = param(wpe_) + std::size_t(r % len) * c;
      T* xr = x + std::size_t(r) * c;
      for (int i = 0; i < c; ++i) xr[i] = te[i] + pe[i];
    }
    for (int l = 0; l < cfg_.layers; ++l) block_forward(l);

    // Final LayerNorm and head.
    T* xf = x + std::size_t(cfg_.layers) * act_.stride_nc;
    layernorm(xf, param(lnf_w_), param(lnf_b_), act_.lnf.data(), act_.lnf_mean.data(), act_.lnf_rstd.data(), n);
    T* logits = act_.logits.data();
    gemm(Trans::no, Trans::no, n, v, c, T(1), act_.lnf.data(), c, param(head_), v, T(0), logits, v);

    ForwardStats stats;
    row_correct_.assign(std::size_t(n), 1);
    for (int r = 0; r < n; ++r) stats.rows += targets[r] >= 0;
    const T grad_scale = pass == Pass::train && stats.rows > 0 ? T(1) / T(stats.rows) : T(0);
    for (int r = 0; r < n; ++r) {
      T* row = logits + std::size_t(r) * v;
      if (targets[r] < 0) {
        if (pass == Pass::train) std::fill_n(row, v, T(0));
        continue;
      }
      if (targets[r] >= v)
        throw std::invalid_argument("tiny transformer: target " + std::to_string(targets[r]) + " at row " +
                                    std::to_string(r) + " is outside the vocabulary");
      const CrossEntropyRow ce = cross_entropy_row(row, targets[r], v, grad_scale);
      stats.loss_sum += ce.loss;
      stats.correct += ce.correct;
      row_correct_[std::size_t(r)] = ce.correct;
    }
    trained_ = pass == Pass::train;
    return stats;
  }

  /// Per row of the last forward: 1 if the row has no target or its argmax is the target, else 0.
  const std::vector<std::uint8_t>& row_correct() const { return row_correct_; }

  /// Writes the gradient of the last Pass::train forward's mean loss into gradients() (overwriting them).
  void backward() {
    if (!trained_) throw std::logic_error("tiny transformer: backward() needs a forward(..., Pass::train) first");
    trained_ = false;
    const int c = cfg_.width, n = batch_ * len_, v = cfg_.vocab;
    std::fill(grads_.begin(), grads_.end(), T(0));
    T* dx = act_.dx.data();  // gradient of the residual stream, carried down the layers
    std::fill_n(dx, std::size_t(n) * c, T(0));

    // Head and final LayerNorm.
    T* dlogits = act_.logits.data();
    gemm(Trans::yes, Trans::no, c, v, n, T(1), act_.lnf.data(), c, dlogits, v, T(0), grad(head_), v);
    T* dln = act_.dln.data();
    gemm(Trans::no, Trans::yes, n, c, v, T(1), dlogits, v, param(head_), v, T(0), dln, c);
    const T* xf = act_.x.data() + std::size_t(cfg_.layers) * act_.stride_nc;
    layernorm_backward(dln, xf, param(lnf_w_), act_.lnf_mean.data(), act_.lnf_rstd.data(), dx, grad(lnf_w_),
                       grad(lnf_b_), n);

    for (int l = cfg_.layers - 1; l >= 0; --l) block_backward(l);

    // Embeddings: every row adds to its token's and its position's vector.
    for (int r = 0; r < n; ++r) {
      T* te = grad(wte_) + std::size_t(tokens_[r]) * c;
      T* pe = grad(wpe_) + std::size_t(r % len_) * c;
      const T* d = dx + std::size_t(r) * c;
      for (int i = 0; i < c; ++i) te[i] += d[i], pe[i] += d[i];
    }
  }

 private:
  struct TensorInfo {
    std::string name;
    std::size_t offset = 0, numel = 0;
  };
  struct Block {
    std::size_t ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b, fc_w, fc_b, fc2_w, fc2_b;
  };
  // Activations kept for backward, for `rows` = N rows. x holds layers+1 residual streams (stride_nc apart):
  // x_l is block l's input, x_layers the final LayerNorm's. Per-layer buffers are stacked the same way.
  struct Activations {
    std::size_t rows = 0, probs_per_layer = 0, stride_nc = 0;
    std::vector<T> x, mid;                // residual stream before each block, and after its attention
    std::vector<T> ln1, ln2, mean, rstd;  // LayerNorm outputs; mean/rstd: 2 per layer per row
    std::vector<T> qkv, att, probs;       // attention: q|k|v, merged head outputs, softmax
    std::vector<T> h, g;                  // MLP pre-activation and GELU
    std::vector<T> lnf, lnf_mean, lnf_rstd, logits;
    std::vector<T> dx, dln, dqkv, dh, dprobs;  // backward scratch
  };

  void reserve(int batch, int len) {
    const std::size_t c = cfg_.width, f = std::size_t(cfg_.mlp_ratio) * c, layers = cfg_.layers;
    std::size_t n = std::size_t(batch) * len, probs = std::size_t(batch) * cfg_.heads * len * len;
    if (n <= act_.rows && probs <= act_.probs_per_layer && std::size_t(len) * len <= act_.dprobs.size()) {
      act_.stride_nc = n * c;
      return;
    }
    act_.rows = std::max(n, act_.rows);
    act_.probs_per_layer = std::max(probs, act_.probs_per_layer);
    act_.stride_nc = n * c;
    n = act_.rows;
    probs = act_.probs_per_layer;
    const std::size_t square = std::max(std::size_t(len) * len, act_.dprobs.size());
    act_.x.assign((layers + 1) * n * c, T(0));
    act_.mid.assign(layers * n * c, T(0));
    act_.ln1.assign(layers * n * c, T(0));
    act_.ln2.assign(layers * n * c, T(0));
    act_.mean.assign(2 * layers * n, T(0));
    act_.rstd.assign(2 * layers * n, T(0));
    act_.qkv.assign(layers * n * 3 * c, T(0));
    act_.att.assign(layers * n * c, T(0));
    act_.probs.assign(layers * probs, T(0));
    act_.h.assign(layers * n * f, T(0));
    act_.g.assign(layers * n * f, T(0));
    act_.lnf.assign(n * c, T(0));
    act_.lnf_mean.assign(n, T(0));
    act_.lnf_rstd.assign(n, T(0));
    act_.logits.assign(n * cfg_.vocab, T(0));
    act_.dx.assign(n * c, T(0));
    act_.dln.assign(n * c, T(0));
    act_.dqkv.assign(n * 3 * c, T(0));
    act_.dh.assign(n * f, T(0));
    act_.dprobs.assign(square, T(0));
  }

  void layernorm(const T* x, const T* w, const T* b, T* y, T* mean, T* rstd, int n) {
    const int c = cfg_.width;
    for (int r = 0; r < n; ++r)
      layernorm_row(x + std::size_t(r) * c, w, b, y + std::size_t(r) * c, mean + r, rstd + r, c);
  }

  void layernorm_backward(const T* dy, const T* x, const T* w, const T* mean, const T* rstd, T* dx, T* dw, T* db,
                          int n) {
    const int c = cfg_.width;
    for (int r = 0; r < n; ++r) {
      const std::size_t o = std::size_t(r) * c;
      layernorm_row_backward(dy + o, x + o, w, mean[r], rstd[r], dx + o, dw, db, c);
    }
  }

  /// y (n x out) = x (n x in) W (in x out) + b.
  static void linear(const T* x, const T* w, const T* b, T* y, int n, int in, int out) {
    for (int r = 0; r < n; ++r) std::copy_n(b, out, y + std::size_t(r) * out);
    gemm(Trans::no, Trans::no, n, out, in, T(1), x, in, w, out, T(1), y, out);
  }

  /// dW = x^T dy, db = column sums of dy, and dx = dy W^T (overwritten).
  static void linear_backward(const T* x, const T* w, const T* dy, T* dx, T* dw, T* db, int n, int in, int out) {
    gemm(Trans::yes, Trans::no, in, out, n, T(1), x, in, dy, out, T(0), dw, out);
    for (int r = 0; r < n; ++r) {
      const T* d = dy + std::size_t(r) * out;
      for (int j = 0; j < out; ++j) db[j] += d[j];
    }
    gemm(Trans::no, Trans::yes, n, in, out, T(1), dy, out, w, out, T(0), dx, in);
  }

  void block_forward(int l) {
    const Block& blk = blocks_[std::size_t(l)];
    const int c = cfg_.width, f = cfg_.mlp_ratio * c, n = batch_ * len_;
    const std::size_t nc = act_.stride_nc;
    const T* x = act_.x.data() + l * nc;
    T* mid = act_.mid.data() + l * nc;
    T* out = act_.x.data() + (l + 1) * nc;
    T* ln1 = act_.ln1.data() + l * nc;
    T* ln2 = act_.ln2.data() + l * nc;
    T* mean = act_.mean.data() + 2 * std::size_t(l) * n;
    T* rstd = act_.rstd.data() + 2 * std::size_t(l) * n;
    T* qkv = act_.qkv.data() + 3 * l * nc;
    T* att = act_.att.data() + l * nc;
    T* h = act_.h.data() + std::size_t(l) * n * f;
    T* g = act_.g.data() + std::size_t(l) * n * f;

    // Attention half: mid = x + proj(attention(ln1(x))).
    layernorm(x, param(blk.ln1_w), param(blk.ln1_b), ln1, mean, rstd, n);
    linear(ln1, param(blk.qkv_w), param(blk.qkv_b), qkv, n, c, 3 * c);
    attention_forward(l, qkv, att);
    linear(att, param(blk.proj_w), param(blk.proj_b), mid, n, c, c);
    for (std::size_t i = 0; i < nc; ++i) mid[i] += x[i];

    // MLP half: out = mid + fc2(gelu(fc(ln2(mid)))).
    layernorm(mid, param(blk.ln2_w), param(blk.ln2_b), ln2, mean + n, rstd + n, n);
    linear(ln2, param(blk.fc_w), param(blk.fc_b), h, n, c, f);
    const std::size_t nf = std::size_t(n) * f;
    for (std::size_t i = 0; i < nf; ++i) g[i] = gelu(h[i]);
    linear(g, param(blk.fc2_w), param(blk.fc2_b), out, n, f, c);
    for (std::size_t i = 0; i < nc; ++i) out[i] += mid[i];
  }

  /// dx holds the gradient of block l's output; on return, of its input.
  void block_backward(int l) {
    const Block& blk = blocks_[std::size_t(l)];
    const int c = cfg_.width, f = cfg_.mlp_ratio * c, n = batch_ * len_;
    const std::size_t nc = act_.stride_nc;
    const T* x = act_.x.data() + l * nc;
    const T* mid = act_.mid.data() + l * nc;
    const T* ln1 = act_.ln1.data() + l * nc;
    const T* ln2 = act_.ln2.data() + l * nc;
    const T* mean = act_.mean.data() + 2 * std::size_t(l) * n;
    const T* rstd = act_.rstd.data() + 2 * std::size_t(l) * n;
    const T* qkv = act_.qkv.data() + 3 * l * nc;
    const T* att = act_.att.data() + l * nc;
    const T* h = act_.h.data() + std::size_t(l) * n * f;
    const T* g = act_.g.data() + std::size_t(l) * n * f;
    T* dx = act_.dx.data();
    T* dln = act_.dln.data();
    T* dh = act_.dh.data();
    T* dqkv = act_.dqkv.data();

    // MLP half (out = mid + fc2(gelu(fc(ln2(mid))))): dx flows to mid unchanged, plus through the MLP.
    linear_backward(g, param(blk.fc2_w), dx, dh, grad(blk.fc2_w), grad(blk.fc2_b), n, f, c);
    const std::size_t nf = std::size_t(n) * f;
    for (std::size_t i = 0; i < nf; ++i) dh[i] *= gelu_grad(h[i]);
    linear_backward(ln2, param(blk.fc_w), dh, dln, grad(blk.fc_w), grad(blk.fc_b), n, c, f);
    layernorm_backward(dln, mid, param(blk.ln2_w), mean + n, rstd + n, dx, grad(blk.ln2_w), grad(blk.ln2_b), n);

    // Attention half (mid = x + proj(attention(ln1(x)))), reusing dln for the merged heads' gradient.
    T* datt = dln;
    linear_backward(att, param(blk.proj_w), dx, datt, grad(blk.proj_w), grad(blk.proj_b), n, c, c);
    attention_backward(l, qkv, datt, dqkv);
    linear_backward(ln1, param(blk.qkv_w), dqkv, dln, grad(blk.qkv_w), grad(blk.qkv_b), n, c, 3 * c);
    layernorm_backward(dln, x, param(blk.ln1_w), mean, rstd, dx, grad(blk.ln1_w), grad(blk.ln1_b), n);
  }

  // Causal self-attention, one (sequence, head) at a time: S = Q K^T / sqrt(D), P = causal softmax(S),
  // O = P V. Q, K, V are L x D column blocks of qkv (leading dimension 3C); O a column block of att.
  // Causality makes P lower triangular, so the products run over blocks of `attention_block` query rows,
  // each against the keys it can see only: about half the multiply-adds of the full L x L products.
  static constexpr int attention_block = 64;

  void attention_forward(int l, const T* qkv, T* att) {
    const int c = cfg_.width, hn = cfg_.heads, d = c / hn, len = len_, ld = 3 * c;
    const T scale = T(1) / std::sqrt(T(d));
    for (int b = 0; b < batch_; ++b)
      for (int hh = 0; hh < hn; ++hh) {
        const T* q = qkv + std::size_t(b) * len * ld + std::size_t(hh) * d;
        const T* k = q + c;
        const T* v = q + 2 * c;
        T* p = probs(l, b, hh);
        T* o = att + std::size_t(b) * len * c + std::size_t(hh) * d;
        for (int r0 = 0; r0 < len; r0 += attention_block) {  // query rows [r0, r1) see keys [0, r1)
          const int r1 = std::min(len, r0 + attention_block);
          T* pr = p + std::size_t(r0) * len;
          gemm(Trans::no, Trans::yes, r1 - r0, r1, d, scale, q + std::size_t(r0) * ld, ld, k, ld, T(0), pr, len);
          for (int i = r0; i < r1; ++i) causal_softmax_row(p + std::size_t(i) * len, i + 1, len);
          gemm(Trans::no, Trans::no, r1 - r0, d, r1, T(1), pr, len, v, ld, T(0), o + std::size_t(r0) * c, c);
        }
      }
  }

  // Backward of attention_forward: dP = dO V^T, dS = softmax backward, dQ = dS K / sqrt(D) by blocks of query
  // rows; dV = P^T dO and dK = dS^T Q / sqrt(D) by blocks of key rows (key j is seen by queries j..L-1).
  // dqkv is overwritten.
  void attention_backward(int l, const T* qkv, const T* datt, T* dqkv) {
    const int c = cfg_.width, hn = cfg_.heads, d = c / hn, len = len_, ld = 3 * c;
    const T scale = T(1) / std::sqrt(T(d));
    T* dp = act_.dprobs.data();
    for (int b = 0; b < batch_; ++b)
      for (int hh = 0; hh < hn; ++hh) {
        const std::size_t base = std::size_t(b) * len * ld + std::size_t(hh) * d;
        const T* q = qkv + base;
        const T* k = q + c;
        const T* v = q + 2 * c;
        T* dq = dqkv + base;
        T* dk = dq + c;
        T* dv = dq + 2 * c;
        const T* p = probs(l, b, hh);
        const T* dout = datt + std::size_t(b) * len * c + std::size_t(hh) * d;
        for (int r0 = 0; r0 < len; r0 += attention_block) {  // query rows [r0, r1), keys [0, r1)
          const int r1 = std::min(len, r0 + attention_block);
          T* dpr = dp + std::size_t(r0) * len;
          gemm(Trans::no, Trans::yes, r1 - r0, r1, d, T(1), dout + std::size_t(r0) * c, c, v, ld, T(0), dpr, len);
          for (int i = r0; i < r1; ++i)
            causal_softmax_row_backward(p + std::size_t(i) * len, dp + std::size_t(i) * len, i + 1, len);
          gemm(Trans::no, Trans::no, r1 - r0, d, r1, scale, dpr, len, k, ld, T(0), dq + std::size_t(r0) * ld, ld);
        }
        for (int c0 = 0; c0 < len; c0 += attention_block) {  // key rows [c0, c1), seen by queries [c0, L)
          const int c1 = std::min(len, c0 + attention_block);
          const std::size_t corner = std::size_t(c0) * len + c0;
          gemm(Trans::yes, Trans::no, c1 - c0, d, len - c0, T(1), p + corner, len, dout + std::size_t(c0) * c, c, T(0),
               dv + std::size_t(c0) * ld, ld);
          gemm(Trans::yes, Trans::no, c1 - c0, d, len - c0, scale, dp + corner, len, q + std::size_t(c0) * ld, ld, T(0),
               dk + std::size_t(c0) * ld, ld);
        }
      }
  }

  T* probs(int l, int b, int hh) {
    const std::size_t per_seq = std::size_t(cfg_.heads) * len_ * len_;
    return act_.probs.data() + std::size_t(l) * act_.probs_per_layer + b * per_seq + std::size_t(hh) * len_ * len_;
  }

  ModelConfig cfg_;
  std::vector<TensorInfo> tensors_;
  std::vector<Block> blocks_;
  std::size_t wte_ = 0, wpe_ = 0, lnf_w_ = 0, lnf_b_ = 0, head_ = 0, total_ = 0;
  std::vector<T> params_, grads_;
  Activations act_;
  std::vector<int> tokens_;
  std::vector<std::uint8_t> row_correct_;
  int batch_ = 0, len_ = 0;
  bool trained_ = false;
};

}  // namespace tiny
