// SPDX-License-Identifier: Apache-2.0
// The examples' command lines: one parse that exits 2 on every usage error (CLI11's own codes are 100 and up), and
// value checks whose messages name the bound, not CLI11's 300-digit double range.
#pragma once

#include <CLI/CLI.hpp>
#include <cmath>
#include <limits>
#include <string>

namespace examples {

/// Parses `argv` into `app`. Returns -1 where the program goes on; otherwise the code it exits with: 0 after --help,
/// 2 after a usage error (CLI11's message, which names the flag, is on stderr).
inline int parse_command_line(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
    return -1;
  } catch (const CLI::Success& e) {  // --help
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return 2;
  }
}

/// A check of a number against 0: above it (`zero_allowed` false) or at least it; NaN and infinities are refused.
inline CLI::Validator sign_check(bool zero_allowed, const std::string& name) {
  return CLI::Validator(
      [zero_allowed](std::string& text) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(text, v)) return "`" + text + "` is not a number";
        if (!std::isfinite(v) || v < 0 || (!zero_allowed && v == 0))
          return "`" + text + "` must be a finite number " + (zero_allowed ? "0 or more" : "above 0");
        if (v > std::numeric_limits<float>::max())  // (a float option would hold an infinity)
          return "`" + text + "` is beyond a float's range (3.4e38)";
        return {};
      },
      name);
}

inline const CLI::Validator positive = sign_check(false, "POSITIVE");         ///< > 0
inline const CLI::Validator non_negative = sign_check(true, "NON-NEGATIVE");  ///< >= 0

/// A path that is not empty: "" would be no file, or as a directory the file system's root (`"" + "/" + name`).
inline const CLI::Validator named_path(
    [](std::string& text) -> std::string { return text.empty() ? "an empty path names no file" : std::string(); },
    "PATH");

}  // namespace examples
