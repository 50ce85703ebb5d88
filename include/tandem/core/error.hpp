// SPDX-License-Identifier: Apache-2.0
// The error hierarchy. Every failure tandem reports is a tandem::error; subclasses say where it came from.
// Invalid input is rejected before anything is written, with a message naming the argument and the fix.
#pragma once

#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "tandem/core/config.hpp"

namespace tandem {

/// Base of every exception tandem throws.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A CUDA runtime call failed.
class cuda_error : public error {
 public:
  using error::error;
};

/// An NCCL call failed.
class nccl_error : public error {
 public:
  using error::error;
};

/// An MPI call failed.
class mpi_error : public error {
 public:
  using error::error;
};

/// A collective or barrier waited longer than its timeout; the message names the ranks that did not arrive.
class timeout_error : public error {
 public:
  using error::error;
};

/// Another rank of the group failed; this rank's collective was abandoned so that it does not hang.
class peer_error : public error {
 public:
  using error::error;
};

namespace detail {

/// Throws tandem::error with `what` (a complete sentence naming the argument and the fix).
[[noreturn]] TANDEM_COLD inline void fail(std::string what) { throw error(std::move(what)); }

/// An error's message without its leading "tandem: ", to follow the start of another message.
TANDEM_COLD inline std::string reason(const std::exception& e) {
  const std::string_view what = e.what();
  return std::string(what.starts_with("tandem: ") ? what.substr(8) : what);
}

/// A float option's value as a message shows it: every digit that tells it apart ("-1e-07", "0.1", "nan"), where
/// std::to_string would print "-0.000000".
TANDEM_COLD inline std::string number(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.9g", value);
  return text;
}

/// `before`, then `name` in backquotes, then `after`: a message about something named ("the checksum of `w` does not
/// match"), built by appending (GCC 12 warns falsely of overlapping copies in `"..." + std::string&&`).
TANDEM_COLD inline std::string naming(std::string_view before, std::string_view name, std::string_view after) {
  std::string s(before);
  return s.append("`").append(name).append("`").append(after);
}

/// The rank this thread works for, named in errors raised by CUDA, NCCL and MPI calls (-1: not known yet).
/// Communicators set it when a rank's thread builds them.
inline int& error_rank() {
  thread_local int rank = -1;
  return rank;
}

/// "status N (name) in `call` at file:line on rank R": how CUDA/NCCL/MPI check macros describe a failure.
inline std::string describe_failure(const char* library, int status, const char* name, const char* call,
                                    const char* file, int line) {
  std::string s = std::string("tandem: ") + library + " call `" + call + "` failed with status " +
                  std::to_string(status) + " (" + name + ") at " + file + ":" + std::to_string(line);
  if (error_rank() >= 0) s += " on rank " + std::to_string(error_rank());
  return s;
}

/// The message of an exception held in an exception_ptr (what() for a std::exception).
TANDEM_COLD inline std::string exception_message(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "an exception not derived from std::exception";
  }
}

/// Throws tandem::error with `what` unless `condition` holds.
inline void require(bool condition, const char* what) {
  if (!condition) fail(what);
}

}  // namespace detail
}  // namespace tandem
