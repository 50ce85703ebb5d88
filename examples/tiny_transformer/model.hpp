// SPDX-License-Identifier: Apache-2.0
// A decoder-only transformer with a hand-written forward and backward pass: token and position embeddings,
// pre-LayerNorm blocks of causal multi-head self-attention and a GELU MLP, a final LayerNorm and an output head.
// It is written once against a Compute (compute.hpp): matrix products go through its gemm (CBLAS on the host,
// cuBLAS on CUDA), everything else through the item bodies of ops.hpp. It is the "user's model" of the example:
// its parameters and gradients are its own buffers (in the compute's memory), which tandem wraps with TensorRefs.
// Or, for a policy that shards the parameters, they are tandem's: bind() points each tensor at tandem's views, a
// unit hook (set_unit_hook) runs before each unit of layers in forward and backward so that the views of just that
// unit can be fetched, and release_storage() frees the model's own buffers.
//
// Shapes (B sequences of L <= context tokens, N = B*L rows, C width, H heads of D = C/H, F = mlp_ratio*C):
//   x      N x C      residual stream            qkv   N x 3C   [q | k | v], head h at columns h*D
//   probs  B x H x L x L   attention (row i: query i over keys 0..i)
//   h      N x F      MLP pre-activation          logits N x V
// Weights are stored [in][out] (row-major), so a linear layer is y = x W + b and its backward is
// dx = dy W^T, dW = x^T dy, db = column sums of dy. Sums over rows (bias, LayerNorm and position gradients) are
// the compute's column_sums, so that no two GPU threads add into the same element.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "compute.hpp"
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

/// Which pass a unit hook runs in.
enum class Phase { forward, backward };

/// The outcome of a forward pass over a batch.
struct ForwardStats {
  double loss_sum = 0;  ///< summed over the rows with a target
  int rows = 0;         ///< rows with a target (>= 0)
  int correct = 0;      ///< of those, rows whose argmax is the target
  double mean_loss() const { return rows ? loss_sum / rows : 0.0; }
};

template <class T, class Compute = HostCompute>
class Transformer {
 public:
  template <class U>
  using Array = typename Compute::template Array<U>;

  /// Builds the model with GPT-2's initialisation (normal(0, 0.02) weights, residual projections scaled by
  /// 1/sqrt(2 layers), zero biases, unit LayerNorm gains), deterministic in `seed`.
  Transformer(ModelConfig config, std::uint64_t seed, Compute compute = {})
      : cfg_(config), compute_(std::move(compute)) {
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
    std::vector<T> init(total_, T(0));  // on the host, then to the compute's memory
    auto at = [&](std::size_t t) { return init.data() + tensors_[t].offset; };
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> normal(0.0, 0.02);
    const double residual_scale = 1.0 / std::sqrt(2.0 * cfg_.layers);
    auto fill_normal = [&](std::size_t t, double scale) {
      for (std::size_t i = 0; i < tensors_[t].numel; ++i) at(t)[i] = T(normal(rng) * scale);
    };
    auto fill = [&](std::size_t t, T value) { std::fill_n(at(t), tensors_[t].numel, value); };
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
    compute_.resize(params_, total_);
    compute_.resize(grads_, total_);
    compute_.to_device(params_.data(), init.data(), total_ * sizeof(T));
    for (std::size_t t = 0; t < tensors_.size(); ++t) {
      bound_params_.push_back(param(t));
      bound_grads_.push_back(grad(t));
    }
  }

  Transformer(const Transformer&) = delete;
  Transformer& operator=(const Transformer&) = delete;

  const ModelConfig& config() const { return cfg_; }
  std::size_t num_parameters() const { return total_; }
  std::size_t num_tensors() const { return tensors_.size(); }
  const std::string& tensor_name(std::size_t t) const { return tensors_[t].name; }
  std::size_t tensor_numel(std::size_t t) const { return tensors_[t].numel; }
  /// Tensor t's parameters and gradient in the model's own buffers, in the compute's memory.
  T* param(std::size_t t) { return params_.data() + tensors_[t].offset; }
  T* grad(std::size_t t) { return grads_.data() + tensors_[t].offset; }

  /// The units forward runs in order (backward in reverse): the embeddings, each block, the final LayerNorm with the
  /// head. Unit u's tensors are [unit_tensors(u).first, unit_tensors(u).second).
  std::size_t num_units() const { return blocks_.size() + 2; }
  std::pair<std::size_t, std::size_t> unit_tensors(std::size_t u) const {
    if (u == 0) return {wte_, blocks_.empty() ? lnf_w_ : blocks_[0].ln1_w};
    if (u <= blocks_.size()) return {blocks_[u - 1].ln1_w, blocks_[u - 1].fc2_b + 1};
    return {lnf_w_, head_ + 1};
  }
  /// Called with (phase, first tensor, end tensor) before each unit of forward and backward uses its tensors.
  using UnitHook = std::function<void(Phase, std::size_t, std::size_t)>;
  void set_unit_hook(UnitHook hook) { hook_ = std::move(hook); }
  /// Tensor t's parameters (read by forward and backward) and gradient (written by backward) from now on.
  void bind(std::size_t t, const T* param, T* grad) {
    bound_params_[t] = param;
    bound_grads_[t] = grad;
  }
  /// Frees the model's own parameter and gradient buffers; every tensor must be bound (by the unit hook) before use.
  void release_storage() {
    params_ = Array<T>();  // (a moved-in empty array: the storage is freed)
    grads_ = Array<T>();
    std::fill(bound_params_.begin(), bound_params_.end(), nullptr);
    std::fill(bound_grads_.begin(), bound_grads_.end(), nullptr);
  }
  Array<T>& parameters() { return params_; }  ///< every tensor, contiguous in tensor order
  Array<T>& gradients() { return grads_; }
  Compute& compute() { return compute_; }
  /// The parameters, copied to the host.
  std::vector<T> host_parameters() {
    std::vector<T> out(total_);
    compute_.to_host(out.data(), params_.data(), total_ * sizeof(T));
    return out;
  }

  /// The model's tensors for tandem, in forward order (param and grad buffers stay the model's).
  std::vector<tandem::TensorRef> tensor_refs() {
    std::vector<tandem::TensorRef> refs;
    for (std::size_t t = 0; t < tensors_.size(); ++t)
      refs.push_back({tensors_[t].name, param(t), grad(t), tensors_[t].numel, tandem::dtype_of<T>});
    return refs;
  }

  /// Allocates everything forward and backward need for batches of up to `batch` sequences of `len` tokens now,
  /// rather than at the first such batch (on a GPU, allocation must not happen between collectives).
  void reserve(int batch, int len) {
    const std::size_t c = cfg_.width, f = std::size_t(cfg_.mlp_ratio) * c, layers = cfg_.layers;
    std::size_t n = std::size_t(batch) * len, probs = std::size_t(batch) * cfg_.heads * len * len;
    const std::size_t sequence_probs = std::size_t(cfg_.heads) * len * len;  // dprobs: one sequence, every head
    if (n <= act_.rows && probs <= act_.probs_per_layer && sequence_probs <= act_.dprobs.size()) return;
    act_.rows = std::max(n, act_.rows);
    act_.probs_per_layer = std::max(probs, act_.probs_per_layer);
    n = act_.rows;
    probs = act_.probs_per_layer;
    compute_.reserve_rows(n);
    compute_.resize(act_.x, (layers + 1) * n * c);
    compute_.resize(act_.mid, layers * n * c);
    compute_.resize(act_.ln1, layers * n * c);
    compute_.resize(act_.ln2, layers * n * c);
    compute_.resize(act_.mean, 2 * layers * n);
    compute_.resize(act_.rstd, 2 * layers * n);
    compute_.resize(act_.qkv, layers * n * 3 * c);
    compute_.resize(act_.att, layers * n * c);
    compute_.resize(act_.probs, layers * probs);
    compute_.resize(act_.h, layers * n * f);
    compute_.resize(act_.g, layers * n * f);
    compute_.resize(act_.lnf, n * c);
    compute_.resize(act_.lnf_mean, n);
    compute_.resize(act_.lnf_rstd, n);
    compute_.resize(act_.logits, n * cfg_.vocab);
    compute_.resize(act_.row_loss, n);
    compute_.resize(act_.row_correct, n);
    compute_.resize(act_.dx, n * c);
    compute_.resize(act_.dln, n * c);
    compute_.resize(act_.dwx, n * c);
    compute_.resize(act_.dqkv, n * 3 * c);
    compute_.resize(act_.dh, n * f);
    compute_.resize(act_.dprobs, std::max(sequence_probs, act_.dprobs.size()));
    compute_.resize(tokens_, n);
    compute_.resize(targets_, n);
    compute_.resize(token_rows_, n);
    compute_.resize(token_start_, std::size_t(cfg_.vocab) + 1);
  }

  /// Runs B sequences of `len` tokens (tokens[b*len + i], host memory); targets[b*len + i] is the token expected
  /// after position i, or -1 for none. With Pass::train the loss gradient (of the mean loss over the rows with a
  /// target) is ready for backward().
  ForwardStats forward(const int* tokens, const int* targets, int batch, int len, Pass pass) {
    if (batch < 1 || len < 1 || len > cfg_.context)
      throw std::invalid_argument("tiny transformer: forward needs batch >= 1 and 1 <= len <= context (" +
                                  std::to_string(cfg_.context) + "), got batch " + std::to_string(batch) + ", len " +
                                  std::to_string(len));
    const int c = cfg_.width, n = batch * len, v = cfg_.vocab;
    ForwardStats stats;
    for (int r = 0; r < n; ++r) {
      if (tokens[r] < 0 || tokens[r] >= v)
        throw std::invalid_argument("tiny transformer: token " + std::to_string(tokens[r]) + " at row " +
                                    std::to_string(r) + " is outside the vocabulary [0, " + std::to_string(v) + ")");
      if (targets[r] >= v)
        throw std::invalid_argument("tiny transformer: target " + std::to_string(targets[r]) + " at row " +
                                    std::to_string(r) + " is outside the vocabulary");
      stats.rows += targets[r] >= 0;
    }
    trained_ = false;
    reserve(batch, len);
    batch_ = batch;
    len_ = len;
    act_.stride_nc = std::size_t(n) * c;
    compute_.to_device(tokens_.data(), tokens, std::size_t(n) * sizeof(int));
    compute_.to_device(targets_.data(), targets, std::size_t(n) * sizeof(int));
    if (pass == Pass::train) index_token_rows(tokens, n);

    T* x = act_.x.data();
    enter(Phase::forward, 0);
    compute_.for_each(std::size_t(n),
                      EmbedBody<T>{tokens_.data(), weights(wte_), weights(wpe_), x, std::size_t(len), std::size_t(c)});
    for (int l = 0; l < cfg_.layers; ++l) {
      enter(Phase::forward, std::size_t(l) + 1);
      block_forward(l);
    }
    enter(Phase::forward, num_units() - 1);

    // Final LayerNorm, head, and the loss of every row.
    T* xf = x + std::size_t(cfg_.layers) * act_.stride_nc;
    layernorm(xf, weights(lnf_w_), weights(lnf_b_), act_.lnf.data(), act_.lnf_mean.data(), act_.lnf_rstd.data(), n);
    T* logits = act_.logits.data();
    compute_.gemm(Trans::no, Trans::no, n, v, c, T(1), act_.lnf.data(), c, weights(head_), v, T(0), logits, v);
    const T grad_scale = stats.rows > 0 ? T(1) / T(stats.rows) : T(0);
    compute_.for_each(std::size_t(n), CrossEntropyBody<T>{logits, targets_.data(), act_.row_loss.data(),
                                                          act_.row_correct.data(), v, grad_scale, pass == Pass::train});
    row_loss_.resize(std::size_t(n));
    row_correct_.resize(std::size_t(n));
    compute_.to_host(row_loss_.data(), act_.row_loss.data(), std::size_t(n) * sizeof(T));
    compute_.to_host(row_correct_.data(), act_.row_correct.data(), std::size_t(n));
    for (int r = 0; r < n; ++r)
      if (targets[r] >= 0) {
        stats.loss_sum += static_cast<double>(row_loss_[std::size_t(r)]);
        stats.correct += row_correct_[std::size_t(r)];
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
    if (grads_.size() > 0) compute_.zero(grads_.data(), grads_.size());  // (bound gradients: zero as tandem gives them)
    T* dx = act_.dx.data();  // gradient of the residual stream, carried down the layers
    compute_.zero(dx, std::size_t(n) * c);

    // Head and final LayerNorm.
    enter(Phase::backward, num_units() - 1);
    T* dlogits = act_.logits.data();
    compute_.gemm(Trans::yes, Trans::no, c, v, n, T(1), act_.lnf.data(), c, dlogits, v, T(0), grad_out(head_), v);
    T* dln = act_.dln.data();
    compute_.gemm(Trans::no, Trans::yes, n, c, v, T(1), dlogits, v, weights(head_), v, T(0), dln, c);
    const T* xf = act_.x.data() + std::size_t(cfg_.layers) * act_.stride_nc;
    layernorm_backward(dln, xf, weights(lnf_w_), act_.lnf_mean.data(), act_.lnf_rstd.data(), dx, grad_out(lnf_w_),
                       grad_out(lnf_b_), n);

    for (int l = cfg_.layers - 1; l >= 0; --l) {
      enter(Phase::backward, std::size_t(l) + 1);
      block_backward(l);
    }
    enter(Phase::backward, 0);

    // Embeddings: a token's gradient sums the rows holding it; a position's sums that position over the batch.
    compute_.for_each(std::size_t(v) * c,
                      TokenGradBody<T>{dx, token_start_.data(), token_rows_.data(), grad_out(wte_), std::size_t(c)});
    compute_.column_sums(dx, batch_, len_ * c, grad_out(wpe_));
  }

 private:
  void enter(Phase phase, std::size_t unit) {
    if (!hook_) return;
    const auto [first, end] = unit_tensors(unit);
    hook_(phase, first, end);
  }
  /// Tensor t's parameters and gradient as forward and backward use them: the model's own, or bound.
  const T* weights(std::size_t t) const {
    if (bound_params_[t] == nullptr)
      throw std::logic_error("tiny transformer: " + tensors_[t].name + "'s parameters are used but not bound");
    return bound_params_[t];
  }
  T* grad_out(std::size_t t) const {
    if (bound_grads_[t] == nullptr)
      throw std::logic_error("tiny transformer: " + tensors_[t].name + "'s gradient is written but not bound");
    return bound_grads_[t];
  }

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
    Array<T> x, mid;                // residual stream before each block, and after its attention
    Array<T> ln1, ln2, mean, rstd;  // LayerNorm outputs; mean/rstd: 2 per layer per row
    Array<T> qkv, att, probs;       // attention: q|k|v, merged head outputs, softmax
    Array<T> h, g;                  // MLP pre-activation and GELU
    Array<T> lnf, lnf_mean, lnf_rstd, logits, row_loss;
    Array<std::uint8_t> row_correct;
    Array<T> dx, dln, dwx, dqkv, dh, dprobs;  // backward scratch
  };

  /// The rows holding each token, in ascending order (a counting sort), for the token embeddings' backward.
  void index_token_rows(const int* tokens, int n) {
    std::vector<int> start(std::size_t(cfg_.vocab) + 1, 0), rows(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) ++start[std::size_t(tokens[r]) + 1];
    for (int t = 0; t < cfg_.vocab; ++t) start[std::size_t(t) + 1] += start[std::size_t(t)];
    std::vector<int> next(start.begin(), start.end() - 1);
    for (int r = 0; r < n; ++r) rows[std::size_t(next[std::size_t(tokens[r])]++)] = r;
    compute_.to_device(token_start_.data(), start.data(), start.size() * sizeof(int));
    compute_.to_device(token_rows_.data(), rows.data(), rows.size() * sizeof(int));
  }

  void layernorm(const T* x, const T* w, const T* b, T* y, T* mean, T* rstd, int n) {
    compute_.for_each(std::size_t(n), LayerNormBody<T>{x, w, b, y, mean, rstd, cfg_.width});
  }

  /// dx += the input gradient; dw and db are overwritten.
  void layernorm_backward(const T* dy, const T* x, const T* w, const T* mean, const T* rstd, T* dx, T* dw, T* db,
                          int n) {
    const int c = cfg_.width;
    compute_.for_each(std::size_t(n), LayerNormBackwardBody<T>{dy, x, w, mean, rstd, dx, act_.dwx.data(), c});
    compute_.column_sums(act_.dwx.data(), n, c, dw);
    compute_.column_sums(dy, n, c, db);
  }

  /// y (n x out) = x (n x in) W (in x out) + b: the bias rows, then the product added.
  void linear(const T* x, const T* w, const T* b, T* y, int n, int in, int out) {
    compute_.broadcast_rows(b, y, n, out);
    compute_.gemm(Trans::no, Trans::no, n, out, in, T(1), x, in, w, out, T(1), y, out);
  }

  /// dW = x^T dy, db = column sums of dy, and dx = dy W^T (all overwritten).
  void linear_backward(const T* x, const T* w, const T* dy, T* dx, T* dw, T* db, int n, int in, int out) {
    compute_.gemm(Trans::yes, Trans::no, in, out, n, T(1), x, in, dy, out, T(0), dw, out);
    compute_.column_sums(dy, n, out, db);
    compute_.gemm(Trans::no, Trans::yes, n, in, out, T(1), dy, out, w, out, T(0), dx, in);
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
    layernorm(x, weights(blk.ln1_w), weights(blk.ln1_b), ln1, mean, rstd, n);
    linear(ln1, weights(blk.qkv_w), weights(blk.qkv_b), qkv, n, c, 3 * c);
    attention_forward(l, qkv, att);
    linear(att, weights(blk.proj_w), weights(blk.proj_b), mid, n, c, c);
    compute_.for_each(nc, AddBody<T>{mid, x});

    // MLP half: out = mid + fc2(gelu(fc(ln2(mid)))).
    layernorm(mid, weights(blk.ln2_w), weights(blk.ln2_b), ln2, mean + n, rstd + n, n);
    linear(ln2, weights(blk.fc_w), weights(blk.fc_b), h, n, c, f);
    compute_.for_each(std::size_t(n) * f, GeluBody<T>{h, g});
    linear(g, weights(blk.fc2_w), weights(blk.fc2_b), out, n, f, c);
    compute_.for_each(nc, AddBody<T>{out, mid});
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
    linear_backward(g, weights(blk.fc2_w), dx, dh, grad_out(blk.fc2_w), grad_out(blk.fc2_b), n, f, c);
    compute_.for_each(std::size_t(n) * f, GeluBackwardBody<T>{h, dh});
    linear_backward(ln2, weights(blk.fc_w), dh, dln, grad_out(blk.fc_w), grad_out(blk.fc_b), n, c, f);
    layernorm_backward(dln, mid, weights(blk.ln2_w), mean + n, rstd + n, dx, grad_out(blk.ln2_w), grad_out(blk.ln2_b),
                       n);

    // Attention half (mid = x + proj(attention(ln1(x)))), reusing dln for the merged heads' gradient.
    T* datt = dln;
    linear_backward(att, weights(blk.proj_w), dx, datt, grad_out(blk.proj_w), grad_out(blk.proj_b), n, c, c);
    attention_backward(l, qkv, datt, dqkv);
    linear_backward(ln1, weights(blk.qkv_w), dqkv, dln, grad_out(blk.qkv_w), grad_out(blk.qkv_b), n, c, 3 * c);
    layernorm_backward(dln, x, weights(blk.ln1_w), mean, rstd, dx, grad_out(blk.ln1_w), grad_out(blk.ln1_b), n);
  }

  // Causal self-attention, one sequence at a time with every head in one batched product: S = Q K^T / sqrt(D),
  // P = causal softmax(S), O = P V. Q, K, V are L x D column blocks of qkv (leading dimension 3C, head h at
  // column h*D); O a column block of att. Causality makes P lower triangular, so the products run over blocks of
  // `attention_block` query rows, each against the keys it can see only: about half the multiply-adds of the
  // full L x L products. (A sequence's heads together keep the host's working set in its caches.)
  static constexpr int attention_block = 64;

  void attention_forward(int l, const T* qkv, T* att) {
    const int c = cfg_.width, hn = cfg_.heads, d = c / hn, len = len_, ld = 3 * c;
    const T scale = T(1) / std::sqrt(T(d));
    const std::size_t head_p = std::size_t(len) * len;
    for (int b = 0; b < batch_; ++b) {
      const T* q = qkv + std::size_t(b) * len * ld;
      const T* k = q + c;
      const T* v = q + 2 * c;
      T* p = probs(l, b);
      T* o = att + std::size_t(b) * len * c;
      for (int r0 = 0; r0 < len; r0 += attention_block) {  // query rows [r0, r1) see keys [0, r1)
        const int r1 = std::min(len, r0 + attention_block);
        T* pr = p + std::size_t(r0) * len;
        compute_.gemm_batched(Trans::no, Trans::yes, r1 - r0, r1, d, scale, q + std::size_t(r0) * ld, ld, d, k, ld, d,
                              T(0), pr, len, head_p, hn);
        compute_.for_each(std::size_t(hn) * (r1 - r0), CausalSoftmaxBody<T>{p, head_p, r0, r1 - r0, len});
        compute_.gemm_batched(Trans::no, Trans::no, r1 - r0, d, r1, T(1), pr, len, head_p, v, ld, d, T(0),
                              o + std::size_t(r0) * c, c, d, hn);
      }
    }
  }

  // Backward of attention_forward, one sequence at a time: dP = dO V^T, dS = softmax backward, dQ = dS K / sqrt(D)
  // by blocks of query rows; dV = P^T dO and dK = dS^T Q / sqrt(D) by blocks of key rows (key j is seen by
  // queries j..L-1). dqkv is overwritten.
  void attention_backward(int l, const T* qkv, const T* datt, T* dqkv) {
    const int c = cfg_.width, hn = cfg_.heads, d = c / hn, len = len_, ld = 3 * c;
    const T scale = T(1) / std::sqrt(T(d));
    const std::size_t head_p = std::size_t(len) * len;
    T* dp = act_.dprobs.data();  // this sequence's dP, then dS, for every head (head_p apart)
    for (int b = 0; b < batch_; ++b) {
      const std::size_t base = std::size_t(b) * len * ld;
      const T* q = qkv + base;
      const T* k = q + c;
      const T* v = q + 2 * c;
      T* dq = dqkv + base;
      T* dk = dq + c;
      T* dv = dq + 2 * c;
      const T* p = probs(l, b);
      const T* dout = datt + std::size_t(b) * len * c;
      for (int r0 = 0; r0 < len; r0 += attention_block) {  // query rows [r0, r1), keys [0, r1)
        const int r1 = std::min(len, r0 + attention_block);
        T* dpr = dp + std::size_t(r0) * len;
        compute_.gemm_batched(Trans::no, Trans::yes, r1 - r0, r1, d, T(1), dout + std::size_t(r0) * c, c, d, v, ld, d,
                              T(0), dpr, len, head_p, hn);
        compute_.for_each(std::size_t(hn) * (r1 - r0),
                          CausalSoftmaxBackwardBody<T>{p, dp, head_p, head_p, r0, r1 - r0, len});
        compute_.gemm_batched(Trans::no, Trans::no, r1 - r0, d, r1, scale, dpr, len, head_p, k, ld, d, T(0),
                              dq + std::size_t(r0) * ld, ld, d, hn);
      }
      for (int c0 = 0; c0 < len; c0 += attention_block) {  // key rows [c0, c1), seen by queries [c0, L)
        const int c1 = std::min(len, c0 + attention_block);
        const std::size_t corner = std::size_t(c0) * len + c0;
        compute_.gemm_batched(Trans::yes, Trans::no, c1 - c0, d, len - c0, T(1), p + corner, len, head_p,
                              dout + std::size_t(c0) * c, c, d, T(0), dv + std::size_t(c0) * ld, ld, d, hn);
        compute_.gemm_batched(Trans::yes, Trans::no, c1 - c0, d, len - c0, scale, dp + corner, len, head_p,
                              q + std::size_t(c0) * ld, ld, d, T(0), dk + std::size_t(c0) * ld, ld, d, hn);
      }
    }
  }

  /// Sequence b's scores in layer l: one L x L matrix per head, head after head.
  T* probs(int l, int b) {
    return act_.probs.data() + std::size_t(l) * act_.probs_per_layer + std::size_t(b) * cfg_.heads * len_ * len_;
  }

  ModelConfig cfg_;
  Compute compute_;
  std::vector<TensorInfo> tensors_;
  std::vector<Block> blocks_;
  std::size_t wte_ = 0, wpe_ = 0, lnf_w_ = 0, lnf_b_ = 0, head_ = 0, total_ = 0;
  Array<T> params_, grads_;
  std::vector<const T*> bound_params_;  ///< what forward and backward read: into params_, or bound
  std::vector<T*> bound_grads_;
  UnitHook hook_;
  Activations act_;
  Array<int> tokens_, targets_, token_start_, token_rows_;  // the batch, and the rows of each token (CSR)
  std::vector<T> row_loss_;                                 // the last forward's losses, on the host
  std::vector<std::uint8_t> row_correct_;
  int batch_ = 0, len_ = 0;
  bool trained_ = false;
};

}  // namespace tiny
