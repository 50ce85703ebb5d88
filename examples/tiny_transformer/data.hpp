// SPDX-License-Identifier: Apache-2.0
// The tiny transformer's data, all made here: tokenizers, the default task (sorting), a byte-level language
// model over any text file, and the distributed sampler that gives each rank its slice of every global batch.
//
// Every dataset is a list of examples of one length: tokens[e*len + i] is the input at position i and
// targets[e*len + i] the token the model must predict there (-1: nothing to predict).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <numeric>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "tandem/core/hash.hpp"

namespace tiny {

struct Examples {
  int len = 0;
  std::vector<int> tokens, targets;
  std::size_t size() const { return len ? tokens.size() / std::size_t(len) : 0; }
  const int* tokens_of(std::size_t e) const { return tokens.data() + e * len; }
  const int* targets_of(std::size_t e) const { return targets.data() + e * len; }
  /// A fingerprint of every token and target, in order (FNV-1a, as the trained parameters' in main.cpp).
  std::uint64_t fingerprint() const {
    using tandem::detail::fnv1a;
    return fnv1a(targets.data(), targets.size() * sizeof(int), fnv1a(tokens.data(), tokens.size() * sizeof(int)));
  }
};

// --- Tokenizers
// --------------------------------------------------------------------------------------------------------

/// Bytes are tokens 0..255: any text, no vocabulary to learn or ship.
struct ByteTokenizer {
  static constexpr int vocab = 256;
  static std::vector<int> encode(const std::string& text) { return {text.begin(), text.end()}; }
  static int encode_byte(char c) { return static_cast<unsigned char>(c); }
  static std::string decode(const std::vector<int>& tokens) {
    std::string s;
    for (int t : tokens) s += static_cast<char>(t);
    return s;
  }
};

/// The sorting task's tokens: numbers 0..values-1 are themselves, then the separator "|".
struct SortTokenizer {
  int values = 64;
  int separator() const { return values; }
  int vocab() const { return values + 1; }
  std::string decode(const std::vector<int>& tokens) const {
    std::string s;
    for (int t : tokens) {
      if (!s.empty()) s += ' ';
      s += t == separator() ? std::string("|") : std::to_string(t);
    }
    return s;
  }
};

// --- The default task: sort a list of distinct numbers ---------------------------------------------------------------
// An example is `x_1 .. x_k | y_1 .. y_k` with y the sorted x (k distinct numbers below `values`). The model
// reads x and the separator and must write y one token at a time; only y's k tokens are targets. It is solved
// when, for a held-out list, every one of the k predictions is right (then greedy decoding writes y exactly).

struct SortTask {
  int length = 8;   ///< k, numbers per list
  int values = 64;  ///< numbers are 0 .. values-1

  SortTokenizer tokenizer() const { return {values}; }
  int vocab() const { return values + 1; }
  int sequence_length() const { return 2 * length; }  // x_1..x_k | y_1..y_{k-1}: the model never reads y_k

  void validate() const {
    if (length < 2 || values < length)
      throw std::invalid_argument("sort task: need 2 <= length <= values, got length " + std::to_string(length) +
                                  " and values " + std::to_string(values));
  }

  /// How many distinct lists there are, C(values, length) (saturating at 2^63).
  std::uint64_t lists() const {
    double c = 1;  // C(n, k) = prod (n - k + i) / i, exact in double up to 2^53 and then only an estimate
    for (int i = 1; i <= length; ++i) c = c * double(values - length + i) / double(i);
    return c >= 9.2e18 ? std::uint64_t{1} << 63 : std::uint64_t(std::llround(c));
  }

  /// `count` examples from `seed`, none of whose lists appears in `exclude` (a held-out split draws with
  /// the training set's lists excluded); their sorted lists are added to `seen` when it is given.
  Examples make(std::size_t count, std::uint64_t seed, const std::set<std::vector<int>>* exclude = nullptr,
                std::set<std::vector<int>>* seen = nullptr) const {
    validate();
    Examples ex;
    ex.len = sequence_length();
    std::mt19937_64 rng(seed);
    std::vector<int> pool(values);
    std::iota(pool.begin(), pool.end(), 0);
    const int sep = values;
    // Where `exclude` holds (nearly) every list there is, draws are excluded without end: give up after this many
    // in a row. A held-out list is then rarer than one draw in 2^20, so the split would take far too long anyway.
    constexpr std::size_t max_excluded_in_a_row = std::size_t{1} << 20;
    std::size_t excluded_in_a_row = 0;
    while (ex.size() < count) {
      for (int i = 0; i < length; ++i) std::swap(pool[i], pool[i + rng() % (values - i)]);  // partial shuffle
      std::vector<int> x(pool.begin(), pool.begin() + length), y = x;
      std::sort(y.begin(), y.end());
      if (exclude && exclude->count(y)) {
        if (++excluded_in_a_row == max_excluded_in_a_row)
          throw std::invalid_argument(
              "sort task: no list is left for the held-out split: the training set holds " +
              std::to_string(exclude->size()) + " of the " + std::to_string(lists()) + " lists of " +
              std::to_string(length) + " distinct numbers below " + std::to_string(values) +
              " (the last 2^20 draws were all training lists); raise --sort-values or lower --sort-length");
        continue;
      }
      excluded_in_a_row = 0;
      if (seen) seen->insert(y);
      // input: x_1..x_k | y_1..y_{k-1} (2k tokens); the target at position i is the token after it, for the
      // separator and y (positions k..2k-1: y_1..y_k); x_k's successor, the separator, is no target.
      for (int i = 0; i < length; ++i) ex.tokens.push_back(x[i]);
      ex.tokens.push_back(sep);
      for (int i = 0; i + 1 < length; ++i) ex.tokens.push_back(y[i]);
      for (int i = 0; i < length; ++i) ex.targets.push_back(-1);
      for (int i = 0; i < length; ++i) ex.targets.push_back(y[i]);
    }
    return ex;
  }
};

// --- Byte-level language model over a text file ----------------------------------------------------------------------

/// Splits `text` into a training part (the first `train_fraction`) and a held-out part, each cut into
/// non-overlapping windows of len + 1 bytes: the model reads len bytes and predicts each next one.
inline std::pair<Examples, Examples> make_text_examples(const std::string& text, int len, double train_fraction = 0.9) {
  const std::size_t cut = static_cast<std::size_t>(static_cast<double>(text.size()) * train_fraction);
  auto windows = [len](const std::string& part) {
    Examples ex;
    ex.len = len;
    for (std::size_t start = 0; start + std::size_t(len) + 1 <= part.size(); start += std::size_t(len)) {
      for (int i = 0; i < len; ++i) {
        ex.tokens.push_back(ByteTokenizer::encode_byte(part[start + i]));
        ex.targets.push_back(ByteTokenizer::encode_byte(part[start + i + 1]));
      }
    }
    return ex;
  };
  auto train = windows(text.substr(0, cut)), eval = windows(text.substr(cut));
  if (train.size() == 0 || eval.size() == 0)
    throw std::invalid_argument("text: " + std::to_string(text.size()) + " bytes are too few for windows of " +
                                std::to_string(len + 1) + " bytes in both the training and the held-out part; " +
                                "use a longer file or a shorter --context");
  return {std::move(train), std::move(eval)};
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument("cannot open text file '" + path + "'");
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// --- Distributed sampler ---------------------------------------------------------------------------------------------
// Each epoch is a permutation of the examples seeded by (seed, epoch); global batch g of the epoch is the
// permutation's entries [g*B, (g+1)*B) (a last partial batch is dropped). A global batch is cut into
// `accumulation` micro-batches and each micro-batch into `world` equal rank slices, so the examples of a
// global batch are the same whatever the rank count.

class DistributedSampler {
 public:
  DistributedSampler(std::size_t examples, int global_batch, std::uint64_t seed)
      : examples_(examples), batch_(global_batch), seed_(seed) {
    if (global_batch < 1 || examples < std::size_t(global_batch))
      throw std::invalid_argument("sampler: a global batch of " + std::to_string(global_batch) + " needs at least " +
                                  "that many examples; the dataset has " + std::to_string(examples));
  }

  std::size_t batches_per_epoch() const { return examples_ / std::size_t(batch_); }

  /// The examples rank `rank` of `world` trains on in micro-batch `micro` of `accumulation` of global step `step`.
  std::vector<std::size_t> indices(std::uint64_t step, int micro, int accumulation, int rank, int world) {
    if (accumulation < 1 || world < 1 || batch_ % (std::int64_t(accumulation) * world) != 0)  // 64-bit: no overflow
      throw std::invalid_argument("sampler: the global batch (" + std::to_string(batch_) +
                                  ") must be a multiple of accumulation x ranks (" + std::to_string(accumulation) +
                                  " x " + std::to_string(world) + ")");
    const std::uint64_t epoch = step / batches_per_epoch();
    if (epoch != epoch_ || order_.empty()) shuffle(epoch);
    const std::size_t per_micro = std::size_t(batch_ / accumulation), per_rank = per_micro / std::size_t(world);
    const std::size_t begin = std::size_t(step % batches_per_epoch()) * std::size_t(batch_) +
                              std::size_t(micro) * per_micro + std::size_t(rank) * per_rank;
    return {order_.begin() + std::ptrdiff_t(begin), order_.begin() + std::ptrdiff_t(begin + per_rank)};
  }

 private:
  void shuffle(std::uint64_t epoch) {
    order_.resize(examples_);
    std::iota(order_.begin(), order_.end(), std::size_t{0});
    std::mt19937_64 rng(seed_ ^ (0x9e3779b97f4a7c15ull * (epoch + 1)));
    for (std::size_t i = examples_; i > 1; --i) std::swap(order_[i - 1], order_[rng() % i]);  // Fisher-Yates
    epoch_ = epoch;
  }

  std::size_t examples_;
  int batch_;
  std::uint64_t seed_;
  std::uint64_t epoch_ = 0;
  std::vector<std::size_t> order_;
};

}  // namespace tiny
