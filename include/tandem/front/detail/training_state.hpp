// SPDX-License-Identifier: Apache-2.0
// TrainingState: the buffers one rank holds for training, allocated from a policy's buffer rule (Buffers, from
// buffers_for<P>) in backend memory and zeroed on the backend's work stream, and what they amount to (held(), the
// Buffers actually allocated, which memory_of turns into the MemoryReport). It knows nothing of policies, plans or
// steps: the front decides what each buffer holds.
//
//   param_flat   parameter dtype   every bucket's parameters                         (the plan's F elements)
//   param_shard  parameter dtype   this rank's shard of every bucket's parameters    (S)
//   gather[s]    parameter dtype   reused buffers a bucket is gathered into           (K' x M)
//   master       fp32              master weights of the owned space (16-bit parameters; fp32 ones are their own)
//   state[k]     fp32              optimizer state k over the owned space
//   grad_flat    fp32              full gradients living across the step              (F)
//   grad_slot[s] fp32              reused bucket gradient buffers                     (K x M)
//   staging      fp32              one bucket of packed gradients                     (M)
//   grad_shard   its dtype         the reduced-gradient shard accumulator             (S)
//   reduce       reduce dtype      one bucket rounded for a 16-bit reduction          (M)
//   scalars      fp64              the optimizer step's: the norm's terms, the options check (not counted)
#pragma once

#include <cstddef>
#include <type_traits>

#include "tandem/backend/allocate.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/core/stream.hpp"
#include "tandem/policy/policy.hpp"

namespace tandem::detail {

template <class Backend>
class TrainingState {
  template <class T>
  using Buffer = typename Backend::template Buffer<T>;

 public:
  TrainingState() = default;

  /// Allocates `need` (elements; the parameter dtype's, fp32, the shard's or the reduce dtype's as Buffers says) with
  /// `state_count` optimizer state arrays, every byte zero (padding stays zero forever) except the master weights,
  /// which the caller derives from the parameters.
  TrainingState(const Backend& backend, const Buffers& need, DType param_dtype, DType reduce_dtype,
                std::size_t state_count, Stream stream)
      : psize_(dtype_size(param_dtype)),
        gather_size_(need.param_slot_size),
        slot_size_(need.grad_slot_size),
        state_count_(state_count),
        shard_dtype_(need.grad_shard_dtype),
        reduce_dtype_(reduce_dtype) {
    auto allocate = [&](auto& buffer, std::size_t n, const char* what) {
      using T = std::remove_pointer_t<decltype(buffer.data())>;
      if (n != 0) buffer = allocate_named<T>(backend, n, what);
    };
    auto zeroed = [&](auto& buffer, std::size_t n, const char* what) {
      allocate(buffer, n, what);
      if (n != 0) backend.zero(buffer.data(), buffer.bytes(), stream);
    };
    zeroed(param_flat_, need.param_flat * psize_, "the parameters");
    zeroed(param_shard_, need.param_shard * psize_, "the parameter shard");
    zeroed(gather_, need.param_slots * need.param_slot_size * psize_, "the parameter gather buffers");
    allocate(master_, need.master, "the fp32 master weights");
    zeroed(state_[0], state_count > 0 ? need.state : 0, "the optimizer state");
    zeroed(state_[1], state_count > 1 ? need.state : 0, "the optimizer state");
    zeroed(grad_flat_, need.grad_flat, "the gradients");
    zeroed(staging_, need.staging, "the gradient staging bucket");
    zeroed(grad_slots_, need.grad_slots * need.grad_slot_size, "the gradient bucket buffers");
    zeroed(grad_shard_, need.grad_shard * dtype_size(shard_dtype_), "the reduced-gradient shard");
    zeroed(reduce_, need.reduce_buffer * dtype_size(reduce_dtype), "the reduce-dtype bucket");
  }

  /// What was allocated, in Buffers' terms.
  Buffers held() const {
    constexpr std::size_t f = sizeof(float);
    return {.param_flat = param_flat_.bytes() / psize_,
            .param_shard = param_shard_.bytes() / psize_,
            .param_slots = gather_buffers(),
            .param_slot_size = gather_size_,
            .master = master_.bytes() / f,
            .state = state_[0].bytes() / f,
            .grad_flat = grad_flat_.bytes() / f,
            .grad_slots = grad_slots(),
            .grad_slot_size = slot_size_,
            .staging = staging_.bytes() / f,
            .grad_shard = grad_shard_.bytes() / dtype_size(shard_dtype_),
            .reduce_buffer = reduce_.bytes() / dtype_size(reduce_dtype_),
            .grad_shard_dtype = shard_dtype_};
  }
  /// Optimizer state arrays allocated.
  std::size_t state_count() const { return state_count_; }

  /// The full parameters (null where the policy keeps only shards).
  unsigned char* param_flat() const { return param_flat_.data(); }
  /// This rank's parameter shards (null unless the policy shards the parameters).
  unsigned char* param_shard() const { return param_shard_.data(); }
  /// Counted from the allocation (none of no elements; none after a move).
  std::size_t gather_buffers() const { return gather_size_ == 0 ? 0 : gather_.bytes() / (gather_size_ * psize_); }
  unsigned char* gather_buffer(std::size_t s) const { return gather_.data() + s * gather_size_ * psize_; }
  /// fp32 master weights of the owned space (null for fp32 parameters, which are their own).
  float* master() const { return master_.data(); }
  /// Optimizer state array k over the owned space (null beyond state_count()).
  float* state(std::size_t k) const { return state_[k].data(); }
  /// Full fp32 gradients living across the step (null where the policy keeps none).
  float* grad_flat() const { return grad_flat_.data(); }
  float* staging() const { return staging_.data(); }
  std::size_t grad_slots() const { return slot_size_ == 0 ? 0 : grad_slots_.bytes() / (slot_size_ * sizeof(float)); }
  std::size_t grad_slot_size() const { return slot_size_; }
  float* grad_slot(std::size_t s) const { return grad_slots_.data() + s * slot_size_; }
  /// All gradient slots, for zeroing them at once.
  float* grad_slots_data() const { return grad_slots_.data(); }
  std::size_t grad_slots_bytes() const { return grad_slots_.bytes(); }
  unsigned char* grad_shard() const { return grad_shard_.data(); }
  DType grad_shard_dtype() const { return shard_dtype_; }
  std::size_t grad_flat_bytes() const { return grad_flat_.bytes(); }
  unsigned char* reduce_buffer() const { return reduce_.data(); }

  /// The optimizer step's scalars (the norm's terms and total, the options check's lanes): `n` doubles, allocated at
  /// the first call with that size (DataParallel makes it at construction).
  double* step_scalars(const Backend& backend, std::size_t n) {
    if (scalars_.size() != n) scalars_ = allocate_named<double>(backend, n, "the optimizer step's scalars");
    return scalars_.data();
  }

 private:
  std::size_t psize_ = 4;
  std::size_t gather_size_ = 0;  ///< elements per gather buffer
  std::size_t slot_size_ = 0;    ///< elements per gradient slot
  std::size_t state_count_ = 0;
  DType shard_dtype_ = DType::fp32;
  DType reduce_dtype_ = DType::fp32;
  Buffer<unsigned char> param_flat_, param_shard_, gather_;
  Buffer<float> master_;
  Buffer<float> state_[2];
  Buffer<float> grad_flat_, staging_, grad_slots_;
  Buffer<unsigned char> grad_shard_, reduce_;
  Buffer<double> scalars_;
};

}  // namespace tandem::detail
