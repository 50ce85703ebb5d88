// SPDX-License-Identifier: Apache-2.0
// allocate_named: a backend allocation whose failure says what was being allocated. Every allocation tandem makes
// for a purpose goes through it, so that running out of host or device memory is a tandem::error naming the buffer
// and its size (and, from the backend, the cause), not a bare std::bad_alloc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>

#include "tandem/core/error.hpp"

namespace tandem::detail {

/// backend.allocate<T>(n); a failure becomes tandem::error "tandem: allocating <what> (<bytes> bytes) failed: ...".
template <class T, class Backend>
auto allocate_named(const Backend& backend, std::size_t n, const char* what) {
  try {
    return backend.template allocate<T>(n);
  } catch (const std::exception& e) {
    const std::string size = n <= SIZE_MAX / sizeof(T)
                                 ? std::to_string(n * sizeof(T)) + " bytes"
                                 : std::to_string(n) + " elements of " + std::to_string(sizeof(T)) + " bytes";
    fail(std::string("tandem: allocating ") + what + " (" + size + ") failed: " + e.what());
  }
}

}  // namespace tandem::detail
