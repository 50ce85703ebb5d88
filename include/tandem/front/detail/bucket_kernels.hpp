// SPDX-License-Identifier: Apache-2.0
// BucketKernels: every launch a step makes on a bucket, typed once. The dtypes are fixed at construction (the
// parameters' T, the reduce dtype R, the reduced gradients' G: fp32, or R where the reduced shard stays 16-bit), so
// the front resolves them then into this table of functions, each instantiated for its own types only, and a step
// launches through it without looking at a dtype again. It depends on the optimizer and the backend, not on the
// policy or the communicator: every DataParallel over one (optimizer, backend) shares its instantiations.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "tandem/core/dtype.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/stream.hpp"
#include "tandem/kernels/optimizer.hpp"
#include "tandem/kernels/pack.hpp"
#include "tandem/kernels/sum_squares.hpp"
#include "tandem/kernels/vector.hpp"

namespace tandem::detail {

/// One optimizer launch over a flat range, its pointers untyped (BucketKernels::update types them).
struct UpdateRange {
  void* param = nullptr;       ///< the parameter dtype's values
  float* master = nullptr;     ///< fp32 weights (== param for fp32 parameters)
  const void* grad = nullptr;  ///< the reduced gradients, in G
  float* state[2] = {nullptr, nullptr};
  std::size_t n = 0;
  const float* grad_scale = nullptr;    ///< in backend memory (StepControl)
  const std::uint32_t* skip = nullptr;  ///< in backend memory (StepControl): nonzero leaves the range as it is
};

template <class Opt, class Backend>
struct BucketKernels {
  using Scalars = typename Opt::Scalars;

  /// Parameters between the user's buffers and a bucket (T both sides).
  void (*pack_params)(const Backend&, const PackTableView&, void* bucket, StoreHint, Stream) = nullptr;
  void (*unpack_params)(const Backend&, const PackTableView&, void* bucket, StoreHint, Stream) = nullptr;
  /// The user's gradients (T) into an fp32 bucket, scaled: assigned or added.
  void (*pack_grads)(const Backend&, const PackTableView&, float* bucket, WriteMode, float scale, StoreHint,
                     Stream) = nullptr;
  /// fp32 master weights from n parameters (T).
  void (*masters_from_params)(const Backend&, const void* params, float* master, std::size_t n, Stream) = nullptr;
  /// n fp32 gradients, scaled and rounded into the reduce dtype R (16-bit reductions only).
  void (*round_for_reduction)(const Backend&, const float* grads, void* wire, std::size_t n, float scale,
                              Stream) = nullptr;
  /// n reduced gradients (R) into the reduced-gradient store (G): assigned or added (fp32), or copied (G == R).
  void (*land)(const Backend&, const void* reduced, void* store, std::size_t n, WriteMode, Stream) = nullptr;
  /// The optimizer over one range (T parameters, G gradients), its scalars in backend memory.
  void (*update)(const Backend&, const UpdateRange&, const Scalars*, Stream) = nullptr;
  /// *out = the sum of squares of n reduced gradients (G), in the fixed chunking of kernels/sum_squares.hpp.
  void (*sum_squares)(const Backend&, const void* grads, std::size_t n, double* out, Stream) = nullptr;

  /// The table for parameters of `param`, reductions in `reduce` and reduced gradients kept in `reduced` (fp32, or
  /// `reduce` itself).
  static BucketKernels make(DType param, DType reduce, DType reduced) {
    if (reduced != DType::fp32 && reduced != reduce)
      fail("tandem: internal error: reduced gradients are kept in fp32 or in the reduce dtype");
    BucketKernels k;
    visit_param_dtype(param, [&](auto t) {
      using T = decltype(t);
      k.pack_params = &pack_params_as<T>;
      k.unpack_params = &unpack_params_as<T>;
      k.pack_grads = &pack_grads_as<T>;
      k.masters_from_params = &masters_as<T>;
      visit_param_dtype(reduced, [&](auto g) { k.update = &update_as<T, decltype(g)>; });
    });
    visit_param_dtype(reduce, [&](auto r) {
      using R = decltype(r);
      k.round_for_reduction = &round_as<R>;
      if (reduced == DType::fp32)
        k.land = &land_as<R, float>;
      else
        k.land = &land_as<R, R>;
    });
    visit_param_dtype(reduced, [&](auto g) { k.sum_squares = &sum_squares_as<decltype(g)>; });
    return k;
  }

 private:
  template <class T>
  static void pack_params_as(const Backend& be, const PackTableView& t, void* bucket, StoreHint hint, Stream s) {
    be.launch(t.items,
              PackBody<T, T, PackDirection::to_bucket>{t.reading_user, t.tensors, static_cast<T*>(bucket), 1.0f, hint},
              s);
  }
  template <class T>
  static void unpack_params_as(const Backend& be, const PackTableView& t, void* bucket, StoreHint hint, Stream s) {
    be.launch(
        t.items,
        PackBody<T, T, PackDirection::from_bucket>{t.reading_bucket, t.tensors, static_cast<T*>(bucket), 1.0f, hint},
        s);
  }
  template <class T>
  static void pack_grads_as(const Backend& be, const PackTableView& t, float* bucket, WriteMode mode, float scale,
                            StoreHint hint, Stream s) {
    if (mode == WriteMode::assign)
      be.launch(t.items,
                PackBody<T, float, PackDirection::to_bucket, WriteMode::assign>{t.reading_user, t.tensors, bucket,
                                                                                scale, hint},
                s);
    else  // read-modify-write: the bucket is read back, so its stores stay cached
      be.launch(
          t.items,
          PackBody<T, float, PackDirection::to_bucket, WriteMode::accumulate>{t.reading_user, t.tensors, bucket, scale},
          s);
  }
  /// The store hint of a flat cast writing n elements of T (pack.hpp's rule: streaming from 4 MiB on).
  template <class T>
  static constexpr StoreHint hint_for(std::size_t n) {
    return store_hint_for(n * sizeof(T));
  }
  template <class T>
  static void masters_as(const Backend& be, const void* params, float* master, std::size_t n, Stream s) {
    be.launch(cast_items(n), CastBody<T, float>{static_cast<const T*>(params), master, n, 1.0f, hint_for<float>(n)}, s);
  }
  template <class R>
  static void round_as(const Backend& be, const float* grads, void* wire, std::size_t n, float scale, Stream s) {
    be.launch(cast_items(n), CastBody<float, R>{grads, static_cast<R*>(wire), n, scale, hint_for<R>(n)}, s);
  }
  template <class R, class G>
  static void land_as(const Backend& be, const void* reduced, void* store, std::size_t n, WriteMode mode, Stream s) {
    const R* src = static_cast<const R*>(reduced);
    G* dst = static_cast<G*>(store);
    if constexpr (std::is_same_v<G, float>) {
      if (mode == WriteMode::assign)
        be.launch(cast_items(n), CastBody<R, float, WriteMode::assign>{src, dst, n, 1.0f, hint_for<float>(n)}, s);
      else
        be.launch(cast_items(n), CastBody<R, float, WriteMode::accumulate>{src, dst, n, 1.0f}, s);
    } else {
      if (mode != WriteMode::assign)
        fail("tandem: internal error: a 16-bit gradient shard is only ever assigned (nothing accumulates into it)");
      be.launch(cast_items(n), CastBody<R, R>{src, dst, n, 1.0f, hint_for<R>(n)}, s);
    }
  }
  template <class T, class G>
  static void update_as(const Backend& be, const UpdateRange& r, const Scalars* scalars, Stream s) {
    UpdateArgs<T, G> a;
    a.param = static_cast<T*>(r.param);
    a.master = r.master;
    a.grad = static_cast<const G*>(r.grad);
    a.state[0] = r.state[0];
    a.state[1] = r.state[1];
    a.n = r.n;
    a.grad_scale = r.grad_scale;
    a.skip = r.skip;
    be.launch(update_items(a.n), typename Opt::template Body<T, G>{a, scalars}, s);
  }
  template <class G>
  static void sum_squares_as(const Backend& be, const void* grads, std::size_t n, double* out, Stream s) {
    be.sum_to(sum_squares_items(n), SumSquaresBody{static_cast<const G*>(grads), n}, out, s);
  }
};

}  // namespace tandem::detail
