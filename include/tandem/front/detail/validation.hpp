// SPDX-License-Identifier: Apache-2.0
// Validation: pure checks of what a user passes to DataParallel, each throwing tandem::error with a message that names
// the argument and the fix, before anything is allocated or written. (DataParallelOptions and the one-dtype rule are
// checked in front/options.hpp, which the memory estimator shares.)
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tandem/core/checkpoint.hpp"
#include "tandem/core/checkpoint_manifest.hpp"
#include "tandem/core/config.hpp"
#include "tandem/core/dtype.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/tensor.hpp"

namespace tandem::detail {

/// Throws where the communicator and the backend both say which device they use (tandem::Nccl and CudaBackend:
/// the device current when each was made) and differ: NCCL would be handed memory and streams of another device, and
/// fail or hang at the first collective. A rank's own check; the caller makes every rank learn of it.
template <class Comm, class Backend>
void check_same_device(const Comm& comm, const Backend& backend) {
  if constexpr (requires {
                  { comm.device() } -> std::convertible_to<int>;
                  { backend.device() } -> std::convertible_to<int>;
                })
    if (comm.device() != backend.device())
      fail("tandem: the communicator uses device " + std::to_string(comm.device()) + " and the backend device " +
           std::to_string(backend.device()) +
           ": make the communicator and DataParallel with the same device current (select_device first), or pass a "
           "backend of the communicator's device");
}

/// The user's buffers of a layout (TensorRef i is layout tensor i): non-null, aligned to their element size, and no
/// two overlapping (every parameter and gradient needs its own memory). Zero-size tensors may be anything.
TANDEM_COLD inline void validate_user_buffers(const Layout& layout, const std::vector<TensorRef>& refs) {
  struct Span {
    std::uintptr_t begin, end;
    std::size_t tensor;
    const char* what;
  };
  std::vector<Span> spans;
  for (std::size_t i = 0; i < refs.size(); ++i) {
    const TensorRef& t = refs[i];
    if (t.numel == 0) continue;
    if (t.param == nullptr) fail(layout.describe(i) + ": param pointer is null");
    if (t.grad == nullptr) fail(layout.describe(i) + ": grad pointer is null");
    const std::size_t bytes = t.numel * dtype_size(t.dtype);
    const auto p = reinterpret_cast<std::uintptr_t>(t.param), g = reinterpret_cast<std::uintptr_t>(t.grad);
    if (p % dtype_size(t.dtype) != 0 || g % dtype_size(t.dtype) != 0)
      fail(layout.describe(i) + ": buffers must be aligned to their element size (" +
           std::to_string(dtype_size(t.dtype)) + " bytes)");
    spans.push_back({p, p + bytes, i, "param"});
    spans.push_back({g, g + bytes, i, "grad"});
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (std::size_t k = 1; k < spans.size(); ++k)
    if (spans[k].begin < spans[k - 1].end)
      fail(layout.describe(spans[k - 1].tensor) + "'s " + spans[k - 1].what + " buffer overlaps " +
           layout.describe(spans[k].tensor) + "'s " + spans[k].what +
           " buffer; every parameter and gradient needs its own memory");
}

/// Throws where a checkpoint's optimizer state (`held`'s, `held_count` arrays) is not what this DataParallel's
/// optimizer keeps (`optimizer`'s, `state_count` arrays, as the options it was constructed with decide). `where` begins
/// the message.
TANDEM_COLD inline void check_optimizer_state(const std::string& where, const std::string& held, std::size_t held_count,
                                              const char* optimizer, std::size_t state_count) {
  if (held == optimizer && held_count == state_count) return;
  std::string why = where + "holds " + held + " state (" + std::to_string(held_count) +
                    " arrays) but this DataParallel uses " + optimizer + " (" + std::to_string(state_count) + ")";
  if (held == optimizer && held == "SGD")
    why +=
        ", as the options it was constructed with decide (SGD keeps a momentum buffer only where `momentum` is not "
        "0): construct it with options that keep as many as the saved run's (the load then restores those options)";
  fail(why);
}

/// What a checkpoint must match to be loaded: the optimizer (and its number of state arrays), the parameter dtype and
/// the layout (names, sizes, dtypes, in order). `path` names the file in the message.
TANDEM_COLD inline void check_checkpoint(const CheckpointData& c, const std::string& path, const Layout& layout,
                                         const char* optimizer, std::size_t state_count, DType param_dtype) {
  const std::string where = "tandem: the checkpoint `" + path + "` ";
  check_optimizer_state(where, c.optimizer, c.state_count, optimizer, state_count);
  if (c.param_dtype != param_dtype)
    fail(where + "holds " + dtype_name(c.param_dtype) + " parameters but these are " + dtype_name(param_dtype));
  if (c.tensors.size() != layout.size())
    fail(where + "holds " + std::to_string(c.tensors.size()) + " tensors but the layout has " +
         std::to_string(layout.size()));
  for (std::size_t i = 0; i < layout.size(); ++i) {
    const TensorSpec& t = c.tensors[i];
    if (t.name != layout[i].name || t.numel != layout[i].numel || t.dtype != layout[i].dtype)
      fail(where + "differs at " + layout.describe(i) + ": it holds `" + t.name + "` with " + std::to_string(t.numel) +
           " " + dtype_name(t.dtype) + " elements");
  }
}

/// What a sharded checkpoint's manifest must match to be loaded: as check_checkpoint; a parameters-only one may list
/// the tensors in any order, but must hold each of the layout's (by name, with its size and dtype) and nothing else.
TANDEM_COLD inline void check_manifest(const CheckpointManifest& m, const std::string& path, const Layout& layout,
                                       const char* optimizer, std::size_t state_count, DType param_dtype) {
  const std::string where = "tandem: the checkpoint `" + path + "` ";
  if (!m.parameters_only) check_optimizer_state(where, m.optimizer, m.state_count, optimizer, state_count);
  if (m.param_dtype != param_dtype)
    fail(where + "holds " + dtype_name(m.param_dtype) + " parameters but these are " + dtype_name(param_dtype));
  if (m.parameters_only) {
    std::vector<const TensorSpec*> by_name;  // (the manifest's order among equal names: a search per layout tensor)
    for (const TensorSpec& t : m.tensors) by_name.push_back(&t);
    const auto name_less = [](const TensorSpec* a, const TensorSpec* b) { return a->name < b->name; };
    std::stable_sort(by_name.begin(), by_name.end(), name_less);
    for (std::size_t i = 0; i < layout.size(); ++i) {
      const TensorSpec key{layout[i].name, 0, DType::fp32};
      const auto [first, last] = std::equal_range(by_name.begin(), by_name.end(), &key, name_less);
      for (auto it = first; it != last; ++it)
        if ((*it)->numel != layout[i].numel)
          fail(where + "holds `" + (*it)->name + "` with " + std::to_string((*it)->numel) + " elements, but " +
               layout.describe(i) + " has " + std::to_string(layout[i].numel));
      if (last - first != 1) fail(where + (first == last ? "lacks " : "holds more than one ") + layout.describe(i));
    }
    if (m.tensors.size() != layout.size())
      fail(where + "holds " + std::to_string(m.tensors.size()) + " tensors, of which the layout names " +
           std::to_string(layout.size()) + "; every tensor it holds must be one of the model's");
    return;
  }
  if (m.tensors.size() != layout.size())
    fail(where + "holds " + std::to_string(m.tensors.size()) + " tensors but the layout has " +
         std::to_string(layout.size()));
  for (std::size_t i = 0; i < layout.size(); ++i) {
    const TensorSpec& t = m.tensors[i];
    if (t.name != layout[i].name || t.numel != layout[i].numel || t.dtype != layout[i].dtype)
      fail(where + "differs at " + layout.describe(i) + ": it holds `" + t.name + "` with " + std::to_string(t.numel) +
           " " + dtype_name(t.dtype) + " elements");
  }
}

}  // namespace tandem::detail
