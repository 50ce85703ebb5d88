// SPDX-License-Identifier: Apache-2.0
// Non-owning references to the user's tensors, and the Layout: the tensors in model order, with names.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "tandem/core/dtype.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/hash.hpp"

namespace tandem {

/// One trainable tensor as the user holds it: a parameter buffer and its gradient buffer, both `numel`
/// elements of `dtype`, in memory of the backend the tensor is used with. tandem never owns these.
struct TensorRef {
  std::string name;  ///< unique in a DataParallel's layout: checkpoints key by it (detail::validate_checkpoint_names)
  void* param = nullptr;
  void* grad = nullptr;
  std::size_t numel = 0;
  DType dtype = DType::fp32;
};

/// What a tensor is, without where it lives: enough to plan buckets and to check that ranks agree.
struct TensorSpec {
  std::string name;  ///< as TensorRef::name
  std::size_t numel = 0;
  DType dtype = DType::fp32;
};

/// The largest element count tandem accepts for one tensor (and for a whole layout): 2^48, so that byte
/// counts of any dtype and sums over thousands of tensors cannot overflow 64 bits.
inline constexpr std::size_t max_numel = std::size_t{1} << 48;

/// The user's tensors in model order (the order of the forward pass; backward produces gradients in
/// reverse). Zero-size tensors are allowed: they take no space and are skipped by every kernel.
class Layout {
 public:
  Layout() = default;

  /// Validates sizes and dtypes; throws tandem::error naming the first bad tensor. (The names, which checkpoints
  /// key by, DataParallel's construction checks: detail::validate_checkpoint_names.)
  TANDEM_COLD explicit Layout(std::vector<TensorSpec> tensors) : tensors_(std::move(tensors)) {
    if (tensors_.empty()) detail::fail("tandem: the layout has no tensors; pass at least one tensor to train");
    std::size_t total = 0;
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      const TensorSpec& t = tensors_[i];
      if (t.numel > max_numel)
        detail::fail(describe(i) + ": numel " + std::to_string(t.numel) + " exceeds tandem's limit of 2^48 elements");
      if (t.dtype != DType::fp32 && t.dtype != DType::bf16 && t.dtype != DType::fp16)
        detail::fail(describe(i) + ": dtype " +
                     (t.dtype == DType::fp64 ? "fp64" : "DType " + std::to_string(static_cast<int>(t.dtype))) +
                     " is not supported for parameters; use fp32, bf16 or fp16");
      total += t.numel;
      if (total > max_numel)
        detail::fail(describe(i) + ": the layout's total element count exceeds tandem's limit of 2^48 elements");
    }
    total_numel_ = total;
  }

  std::size_t size() const { return tensors_.size(); }
  const TensorSpec& operator[](std::size_t i) const { return tensors_[i]; }
  const std::vector<TensorSpec>& tensors() const { return tensors_; }
  std::size_t total_numel() const { return total_numel_; }

  /// "tensor 7 (`blocks.3.mlp.w`)": how error messages name a tensor.
  TANDEM_COLD std::string describe(std::size_t i) const {
    return "tensor " + std::to_string(i) + " (`" + (i < tensors_.size() ? tensors_[i].name : std::string("?")) + "`)";
  }

  /// A 64-bit FNV-1a hash of every name, size and dtype in order; equal layouts have equal fingerprints.
  std::uint64_t fingerprint() const {
    std::uint64_t h = detail::fnv1a_basis;
    auto mix = [&h](const void* data, std::size_t n) { h = detail::fnv1a(data, n, h); };
    for (const TensorSpec& t : tensors_) {
      const std::uint64_t n = t.numel, d = static_cast<std::uint64_t>(t.dtype), len = t.name.size();
      mix(&len, sizeof len);
      mix(t.name.data(), t.name.size());
      mix(&n, sizeof n);
      mix(&d, sizeof d);
    }
    return h;
  }

 private:
  std::vector<TensorSpec> tensors_;
  std::size_t total_numel_ = 0;
};

}  // namespace tandem
