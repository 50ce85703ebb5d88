// SPDX-License-Identifier: Apache-2.0
// Which OpenBLAS kernels the tiny transformer runs on, and choosing better ones safely (--blas-core).
//
// OpenBLAS built with DYNAMIC_ARCH (Debian's) chooses its kernels when it loads, from the CPU's model number. A CPU
// newer than the OpenBLAS release (Intel's Xeons with AVX-512 and AMX under OpenBLAS 0.3.21, for one) gets the
// generic Prescott (SSE3) kernels, several times slower than the AVX-512 ones the CPU could run. The variable
// OPENBLAS_CORETYPE, read once when the library loads, names the kernels instead. This header
//   - judges the loaded kernels against the CPU: pure functions of the core name and the CPU's feature flags;
//   - checks candidate kernels in a child process (OpenBLAS must load the kernels named, and sgemm on several
//     shapes must match a plain-loop double reference), so that wrong results or an illegal instruction stay there;
//   - plans --blas-core keep|auto|NAME: an OPENBLAS_CORETYPE already set is never overridden, and the program is
//     restarted only on kernels that passed the check.
#pragma once

#include <algorithm>
#include <cerrno>
#include <cfloat>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "blas.hpp"

#if defined(__linux__)
#include <dlfcn.h>
#include <poll.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;
#endif

namespace tiny {

// --- Pure: kernels against the CPU ----------------------------------------------------------------------------------

/// The widest vector instructions that a CPU offers or that a set of OpenBLAS kernels uses, in increasing order.
enum class SimdLevel { unknown, sse, avx, avx2, avx512 };

inline const char* simd_name(SimdLevel level) {
  switch (level) {
    case SimdLevel::sse:
      return "SSE";
    case SimdLevel::avx:
      return "AVX";
    case SimdLevel::avx2:
      return "AVX2";
    case SimdLevel::avx512:
      return "AVX-512";
    case SimdLevel::unknown:
      break;
  }
  return "unknown";
}

/// What the CPU supports, and the operating system saves (AVX needs both). All false off x86-64.
struct CpuFeatures {
  bool x86_64 = false;
  bool avx = false, avx2 = false, fma = false;
  bool avx512f = false, avx512dq = false, avx512cd = false, avx512bw = false, avx512vl = false;
};

/// The CPU's level as OpenBLAS's x86-64 kernels need it: SkylakeX's take AVX-512 F, DQ, CD, BW and VL; Haswell's
/// AVX2 and FMA; Sandybridge's AVX. Unknown off x86-64.
inline SimdLevel cpu_simd_level(const CpuFeatures& f) {
  if (!f.x86_64) return SimdLevel::unknown;
  if (f.avx512f && f.avx512dq && f.avx512cd && f.avx512bw && f.avx512vl) return SimdLevel::avx512;
  if (f.avx2 && f.fma) return SimdLevel::avx2;
  if (f.avx) return SimdLevel::avx;
  return SimdLevel::sse;
}

inline bool equal_ignoring_case(std::string_view a, std::string_view b) {
  auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? char(c - 'A' + 'a') : c; };
  return a.size() == b.size() &&
         std::equal(a.begin(), a.end(), b.begin(), [&](char x, char y) { return lower(x) == lower(y); });
}

/// OpenBLAS's x86-64 kernel sets (the names openblas_get_corename() returns and OPENBLAS_CORETYPE takes) and the
/// widest instructions each uses. The older ones are all SSE-class: the generic fallback is Prescott (SSE3).
struct OpenBlasCore {
  std::string_view name;
  SimdLevel simd;
};
inline constexpr OpenBlasCore openblas_x86_cores[] = {
    {"SapphireRapids", SimdLevel::avx512},
    {"Cooperlake", SimdLevel::avx512},
    {"SkylakeX", SimdLevel::avx512},
    {"Haswell", SimdLevel::avx2},
    {"Zen", SimdLevel::avx2},
    {"Excavator", SimdLevel::avx2},
    {"Sandybridge", SimdLevel::avx},
    {"Bulldozer", SimdLevel::avx},
    {"Piledriver", SimdLevel::avx},
    {"Steamroller", SimdLevel::avx},
    {"Prescott", SimdLevel::sse},
    {"Core2", SimdLevel::sse},
    {"Penryn", SimdLevel::sse},
    {"Dunnington", SimdLevel::sse},
    {"Nehalem", SimdLevel::sse},
    {"Atom", SimdLevel::sse},
    {"Opteron", SimdLevel::sse},
    {"Opteron_SSE3", SimdLevel::sse},
    {"Barcelona", SimdLevel::sse},
    {"Bobcat", SimdLevel::sse},
    {"Katmai", SimdLevel::sse},
    {"Coppermine", SimdLevel::sse},
    {"Northwood", SimdLevel::sse},
    {"Banias", SimdLevel::sse},
    {"Athlon", SimdLevel::sse},
    {"Unknown", SimdLevel::sse},
};

/// The level of the kernels OpenBLAS calls `corename` (any case); unknown for names outside the x86-64 table.
inline SimdLevel kernels_simd_level(std::string_view corename) {
  for (const OpenBlasCore& core : openblas_x86_cores)
    if (equal_ignoring_case(core.name, corename)) return core.simd;
  return SimdLevel::unknown;
}

/// The kernels to name for a CPU of this level: the oldest (most tried) set that uses all of its vector width.
inline std::string_view best_openblas_core(SimdLevel cpu) {
  switch (cpu) {
    case SimdLevel::avx512:
      return "SkylakeX";
    case SimdLevel::avx2:
      return "Haswell";
    case SimdLevel::avx:
      return "Sandybridge";
    case SimdLevel::sse:
    case SimdLevel::unknown:
      break;
  }
  return {};
}

/// The loaded kernels against the CPU.
struct BlasVerdict {
  SimdLevel kernels = SimdLevel::unknown;
  SimdLevel cpu = SimdLevel::unknown;
  std::string better;  ///< kernels that would use more of the CPU; empty when these are its best or either is unknown

  /// The kernels are narrower than the CPU: OpenBLAS did not recognise it, or was told to.
  bool generic() const { return !better.empty(); }
};

inline BlasVerdict judge_blas_kernels(std::string_view corename, const CpuFeatures& features) {
  BlasVerdict v{.kernels = kernels_simd_level(corename), .cpu = cpu_simd_level(features), .better = {}};
  if (v.kernels != SimdLevel::unknown && v.cpu != SimdLevel::unknown && v.kernels < v.cpu)
    v.better = std::string(best_openblas_core(v.cpu));
  return v;
}

/// What OpenBLAS says about itself: openblas_get_corename(), openblas_get_config(), and the file it was loaded from
/// (empty where unknown: a BLAS that is not OpenBLAS leaves corename empty).
struct BlasInfo {
  std::string corename, config, library;
};

/// "OpenBLAS 0.3.21" from openblas_get_config()'s "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH ..."; else "OpenBLAS".
inline std::string openblas_version(std::string_view config) {
  if (config.substr(0, 9) != "OpenBLAS ") return "OpenBLAS";
  const std::size_t end = config.find(' ', 9);
  return std::string(config.substr(0, end));
}

inline std::string file_name(std::string_view path) {
  const std::size_t slash = path.rfind('/');
  return std::string(slash == std::string_view::npos ? path : path.substr(slash + 1));
}

/// The advice for generic kernels, or "" when they are not: the variable to set, and --blas-core auto unless it is
/// set already (then the user chose, and only the user can change it).
inline std::string blas_advice(const BlasVerdict& v, const char* coretype_env) {
  if (!v.generic()) return {};
  std::string s = v.kernels == SimdLevel::sse ? std::string("generic kernels on a CPU with ") + simd_name(v.cpu)
                                              : std::string("kernels narrower than this CPU's ") + simd_name(v.cpu);
  s += ": OPENBLAS_CORETYPE=" + v.better;
  s += coretype_env ? " chooses faster ones" : " or --blas-core auto (which checks them first) chooses faster ones";
  return s;
}

/// The program's one line on its BLAS: "blas: SkylakeX kernels (AVX-512) of OpenBLAS 0.3.21 (libopenblas.so.0)",
/// then the OPENBLAS_CORETYPE in force and the advice, if any. Scripts read the name after "blas: ".
inline std::string describe_blas(const BlasInfo& info, const BlasVerdict& v, const char* coretype_env) {
  if (info.corename.empty())
    return "blas: " + (info.library.empty() ? std::string("a BLAS") : file_name(info.library)) +
           " that does not say which kernels it runs (not OpenBLAS?)";
  std::string s = "blas: " + info.corename + " kernels";
  if (v.kernels != SimdLevel::unknown) s += std::string(" (") + simd_name(v.kernels) + ")";
  s += " of " + openblas_version(info.config);
  if (!info.library.empty()) s += " (" + file_name(info.library) + ")";
  if (coretype_env) s += std::string(", OPENBLAS_CORETYPE=") + coretype_env;
  if (const std::string advice = blas_advice(v, coretype_env); !advice.empty()) s += "; " + advice;
  return s;
}

// --- Pure: the --blas-core plan -------------------------------------------------------------------------------------

enum class BlasCoreMode { keep, automatic, named };

struct BlasCoreOption {
  BlasCoreMode mode = BlasCoreMode::automatic;
  std::string name;  ///< with BlasCoreMode::named
};

/// --blas-core: "keep", "auto", or the name of a set of OpenBLAS kernels (any case, as OPENBLAS_CORETYPE takes it).
inline BlasCoreOption parse_blas_core(std::string_view s) {
  if (s == "keep") return {.mode = BlasCoreMode::keep, .name = {}};
  if (s == "auto") return {.mode = BlasCoreMode::automatic, .name = {}};
  const bool name = !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
  });
  if (!name)
    throw std::invalid_argument("--blas-core '" + std::string(s) +
                                "': expected keep, auto or an OpenBLAS core name such as SkylakeX or Haswell");
  return {.mode = BlasCoreMode::named, .name = std::string(s)};
}

/// The kernels to check and restart on, or "" to stay on the loaded ones. Never when OPENBLAS_CORETYPE is set (the
/// user's or the machine's choice, and how the restarted program knows it was restarted); with auto only for generic
/// kernels; with a name only when other kernels are loaded.
inline std::string blas_core_candidate(const BlasCoreOption& option, const char* coretype_env,
                                       std::string_view corename, const BlasVerdict& v) {
  if (coretype_env != nullptr || corename.empty()) return {};
  switch (option.mode) {
    case BlasCoreMode::keep:
      return {};
    case BlasCoreMode::automatic:
      return v.better;
    case BlasCoreMode::named:
      return equal_ignoring_case(option.name, corename) ? std::string() : option.name;
  }
  return {};
}

// --- The check of candidate kernels ---------------------------------------------------------------------------------

/// One product of the check: C (m x n) = alpha op(A) op(B) + beta C.
struct GemmShape {
  int m, n, k;
  Trans ta, tb;
  float alpha, beta;
};

/// Shapes that reach OpenBLAS's small-matrix paths, its edge kernels (sizes that are no multiple of the register
/// blocks) and its blocked main loop, every transposition, beta 0 (C must be overwritten, not read), 1 and other.
inline constexpr GemmShape blas_check_shapes[] = {
    {1, 1, 1, Trans::no, Trans::no, 1.0f, 0.0f},        {3, 5, 7, Trans::yes, Trans::no, 0.5f, 1.0f},
    {16, 16, 16, Trans::no, Trans::yes, 1.0f, 0.0f},    {33, 17, 65, Trans::yes, Trans::yes, -1.5f, 0.25f},
    {64, 192, 64, Trans::no, Trans::no, 1.0f, 1.0f},    {100, 257, 129, Trans::no, Trans::yes, 0.75f, 0.0f},
    {256, 64, 256, Trans::yes, Trans::no, 1.0f, -0.5f}, {129, 384, 128, Trans::no, Trans::no, 1.0f, 0.0f},
    {512, 128, 31, Trans::yes, Trans::yes, 2.0f, 1.0f},
};

/// sgemm through `gemm` (blas.hpp's signature) on every blas_check_shapes entry, with fresh random inputs, padded
/// leading dimensions and C poisoned (NaN when beta is 0), against a plain-loop double reference. Returns "" when
/// every element matches within (k + 2) float roundings of its magnitude and the padding is untouched; else the first
/// mismatch.
template <class Gemm>
std::string check_sgemm(Gemm&& gemm, std::uint64_t seed = 1) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  const float pad_value = 12345.0f;
  for (const GemmShape& s : blas_check_shapes) {
    // Row-major op(A) is m x k: A itself is m x k (lda >= k) or, transposed, k x m (lda >= m); likewise B.
    const int a_rows = s.ta == Trans::no ? s.m : s.k, a_cols = s.ta == Trans::no ? s.k : s.m;
    const int b_rows = s.tb == Trans::no ? s.k : s.n, b_cols = s.tb == Trans::no ? s.n : s.k;
    const int lda = a_cols + 3, ldb = b_cols + 1, ldc = s.n + 2;
    std::vector<float> a(std::size_t(a_rows) * lda), b(std::size_t(b_rows) * ldb), c(std::size_t(s.m) * ldc);
    for (float& x : a) x = uniform(rng);
    for (float& x : b) x = uniform(rng);
    for (int i = 0; i < s.m; ++i)
      for (int j = 0; j < ldc; ++j)
        c[std::size_t(i) * ldc + j] = j >= s.n         ? pad_value
                                      : s.beta == 0.0f ? std::numeric_limits<float>::quiet_NaN()
                                                       : uniform(rng);
    const std::vector<float> c0 = c;
    gemm(s.ta, s.tb, s.m, s.n, s.k, s.alpha, a.data(), lda, b.data(), ldb, s.beta, c.data(), ldc);
    for (int i = 0; i < s.m; ++i)
      for (int j = 0; j < ldc; ++j) {
        const std::size_t at = std::size_t(i) * ldc + j;
        auto where = [&] {  // built only for the message
          return std::to_string(s.m) + "x" + std::to_string(s.n) + "x" + std::to_string(s.k) +
                 (s.ta == Trans::yes ? " A^T" : "") + (s.tb == Trans::yes ? " B^T" : "") + ", element (" +
                 std::to_string(i) + ", " + std::to_string(j) + ")";
        };
        if (j >= s.n) {
          if (c[at] != pad_value) return "sgemm " + where() + ": wrote past n into the padding";
          continue;
        }
        double sum = 0, magnitude = 0;
        for (int p = 0; p < s.k; ++p) {
          const double x = s.ta == Trans::no ? a[std::size_t(i) * lda + p] : a[std::size_t(p) * lda + i];
          const double y = s.tb == Trans::no ? b[std::size_t(p) * ldb + j] : b[std::size_t(j) * ldb + p];
          sum += x * y;
          magnitude += std::abs(x * y);
        }
        const double beta_c = s.beta == 0.0f ? 0.0 : double(s.beta) * c0[at];
        const double expected = double(s.alpha) * sum + beta_c;
        const double tolerance =
            (s.k + 2) * double(FLT_EPSILON) * (std::abs(double(s.alpha)) * magnitude + std::abs(beta_c)) + 1e-30;
        if (!(std::abs(double(c[at]) - expected) <= tolerance))  // NaN fails too
          return "sgemm " + where() + ": " + std::to_string(c[at]) + ", expected " + std::to_string(expected);
      }
  }
  return {};
}

/// How the child process of the check ended.
struct ChildExit {
  bool exited = false;  ///< returned from main or called exit; `code` holds the status
  int code = 0;
  int signal = 0;  ///< killed by this signal (when not `exited`)
  bool timed_out = false;
};

struct BlasCheck {
  bool passed = false;
  std::string detail;  ///< what was checked, or why it failed
};

/// The flag that makes the program run the check and nothing else (blas_self_test()): the child's command line.
inline constexpr const char* blas_self_test_flag = "--blas-self-test";
inline constexpr int blas_check_seconds = 60;

/// The child's answer (its output: "core NAME", then "ok" or "mismatch WHAT") and how it ended, as a verdict on the
/// candidate kernels.
inline BlasCheck judge_blas_self_test(std::string_view candidate, const ChildExit& ended, std::string_view output) {
  std::string loaded, mismatch;
  bool ok = false;
  for (std::size_t at = 0; at < output.size();) {
    const std::size_t end = std::min(output.find('\n', at), output.size());
    const std::string_view line = output.substr(at, end - at);
    if (line.substr(0, 5) == "core ") loaded = line.substr(5);
    if (line.substr(0, 9) == "mismatch ") mismatch = line.substr(9);
    if (line == "ok") ok = true;
    at = end + 1;
  }
  if (ended.timed_out) return {false, "the check did not finish in " + std::to_string(blas_check_seconds) + " s"};
  if (!ended.exited) {
    std::string why = "the check crashed (signal " + std::to_string(ended.signal);
    if (ended.signal == SIGILL) why += ", SIGILL: these kernels use an instruction this CPU lacks";
    if (ended.signal == SIGSEGV) why += ", SIGSEGV";
    return {false, why + ")"};
  }
  if (loaded.empty()) return {false, "the check gave no answer (exit status " + std::to_string(ended.code) + ")"};
  if (!equal_ignoring_case(loaded, candidate))
    return {false, "OpenBLAS loaded its " + loaded + " kernels, not " + std::string(candidate) +
                       " (a name this OpenBLAS does not know, or a build with only one set of kernels)"};
  if (!mismatch.empty()) return {false, mismatch};
  if (ended.code != 0 || !ok) return {false, "the check failed (exit status " + std::to_string(ended.code) + ")"};
  return {true, "sgemm on " + std::to_string(std::size(blas_check_shapes)) + " shapes matches a double reference"};
}

/// The line printed before restarting on checked kernels, saying what was chosen and how to turn it off.
inline std::string describe_restart(const BlasInfo& info, const BlasVerdict& v, std::string_view candidate,
                                    const BlasCheck& check) {
  std::string s = "blas: " + openblas_version(info.config) + " loaded its " + info.corename + " kernels";
  if (v.generic()) s += std::string(" (") + simd_name(v.kernels) + ") on a CPU with " + simd_name(v.cpu);
  s += "; " + std::string(candidate) + " kernels passed a check in a child process (" + check.detail +
       "): restarting with OPENBLAS_CORETYPE=" + std::string(candidate) + " (--blas-core keep stays on " +
       info.corename + ")";
  return s;
}

/// The line printed when candidate kernels failed their check (auto stays on the loaded ones).
inline std::string describe_failed_check(const BlasInfo& info, std::string_view candidate, const BlasCheck& check) {
  return "blas: " + std::string(candidate) + " kernels failed a check in a child process (" + check.detail +
         "): staying on " + info.corename;
}

// --- The platform: this CPU, this OpenBLAS, the child, the restart ---------------------------------------------------

inline CpuFeatures this_cpu_features() {
  CpuFeatures f;
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();  // GCC's and Clang's checks include the operating system's support (XGETBV)
  f.x86_64 = true;
  f.avx = __builtin_cpu_supports("avx");
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512dq = __builtin_cpu_supports("avx512dq");
  f.avx512cd = __builtin_cpu_supports("avx512cd");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
#endif
  return f;
}

inline BlasInfo this_blas() {
  BlasInfo info;
#if defined(TINY_HAVE_OPENBLAS_CORENAME)
  if (const char* name = openblas_get_corename()) info.corename = name;
  if (const char* config = openblas_get_config()) info.config = config;
  // Trim the trailing spaces some releases leave in the name.
  while (!info.corename.empty() && info.corename.back() == ' ') info.corename.pop_back();
#endif
#if defined(__linux__)
  // The library's own address of a symbol it defines (an executable's address of it may be its own PLT entry).
  void* symbol = dlsym(RTLD_DEFAULT, "openblas_get_corename");
  if (!symbol) symbol = dlsym(RTLD_DEFAULT, "cblas_sgemm");
  Dl_info where{};
  if (symbol && dladdr(symbol, &where) != 0 && where.dli_fname) {
    char* real = realpath(where.dli_fname, nullptr);  // the file, not a symlink (Debian: an alternative)
    info.library = real ? real : where.dli_fname;
    std::free(real);
  }
#endif
  return info;
}

/// The child's side of the check: which kernels loaded, then the sgemm check on one BLAS thread. Returns the exit
/// status (0: ok).
inline int blas_self_test() {
  use_one_blas_thread();
  std::printf("core %s\n", this_blas().corename.c_str());
  std::fflush(stdout);
  const std::string mismatch = check_sgemm([](auto... args) { gemm(args...); });
  if (!mismatch.empty()) {
    std::printf("mismatch %s\n", mismatch.c_str());
    return 1;
  }
  std::printf("ok\n");
  return 0;
}

/// Runs this program's blas_self_test() in a child process with OPENBLAS_CORETYPE=candidate (a fresh process: OpenBLAS
/// reads the variable only when it loads) and judges its answer. A crash or a hang stays in the child.
inline BlasCheck check_blas_core_in_child(const std::string& candidate) {
#if defined(__linux__)
  std::vector<std::string> env_strings{"OPENBLAS_CORETYPE=" + candidate, "OPENBLAS_NUM_THREADS=1"};
  for (char** e = environ; *e; ++e) {
    const std::string_view var(*e);
    if (var.substr(0, 18) != "OPENBLAS_CORETYPE=" && var.substr(0, 21) != "OPENBLAS_NUM_THREADS=")
      env_strings.emplace_back(var);
  }
  std::vector<char*> envp;
  for (std::string& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe", flag = blas_self_test_flag;
  char* argv[] = {exe.data(), flag.data(), nullptr};

  int fds[2];
  if (pipe(fds) != 0) return {false, "could not start the check (pipe)"};
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDERR_FILENO);  // OpenBLAS's "Core not found" warning
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  posix_spawn_file_actions_addclose(&actions, fds[1]);
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv, envp.data());
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  if (spawned != 0) {
    close(fds[0]);
    return {false, "could not start the check (posix_spawn: error " + std::to_string(spawned) + ")"};
  }
  std::string output;
  ChildExit ended;
  for (int waited_ms = 0;;) {
    pollfd p{fds[0], POLLIN, 0};
    const int ready = poll(&p, 1, 100);
    if (ready > 0) {
      char buffer[512];
      const ssize_t got = read(fds[0], buffer, sizeof buffer);
      if (got <= 0) break;  // end of output: the child has closed it (exited)
      output.append(buffer, std::size_t(got));
    } else if ((waited_ms += 100) >= blas_check_seconds * 1000) {
      kill(pid, SIGKILL);
      ended.timed_out = true;
      break;
    }
  }
  close(fds[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!ended.timed_out) {
    ended.exited = WIFEXITED(status);
    ended.code = ended.exited ? WEXITSTATUS(status) : 0;
    ended.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  }
  return judge_blas_self_test(candidate, ended, output);
#else
  return {false, "checking kernels in a child process is implemented for Linux only"};
#endif
}

/// Restarts this program, same arguments, with OPENBLAS_CORETYPE=core. Returns only when that failed, saying why.
inline std::string restart_with_blas_core(const std::string& core, char** argv) {
#if defined(__linux__)
  if (setenv("OPENBLAS_CORETYPE", core.c_str(), 1) != 0) return "setenv failed";
  std::fflush(stdout);
  std::fflush(stderr);
  execv("/proc/self/exe", argv);
  unsetenv("OPENBLAS_CORETYPE");
  return "execv failed (errno " + std::to_string(errno) + ")";
#else
  (void)core;
  (void)argv;
  return "restarting is implemented for Linux only";
#endif
}

/// --blas-core at start-up, before anything else has run: prints the program's BLAS line (when `report`; under MPI
/// only rank 0 reports) and, where the option asks for kernels that are not loaded, checks them in a child process and
/// restarts the program on them. Throws std::invalid_argument when the kernels named by --blas-core NAME fail.
inline void settle_blas_core(const BlasCoreOption& option, char** argv, bool report) {
  const BlasInfo info = this_blas();
  const BlasVerdict verdict = judge_blas_kernels(info.corename, this_cpu_features());
  const char* coretype_env = std::getenv("OPENBLAS_CORETYPE");
  if (option.mode == BlasCoreMode::named && info.corename.empty())
    throw std::invalid_argument("--blas-core " + option.name + ": this BLAS does not say which kernels it runs");
  if (const std::string candidate = blas_core_candidate(option, coretype_env, info.corename, verdict);
      !candidate.empty()) {
    const BlasCheck check = check_blas_core_in_child(candidate);
    if (check.passed) {
      if (report) std::printf("%s\n", describe_restart(info, verdict, candidate, check).c_str());
      const std::string why = restart_with_blas_core(candidate, argv);
      if (report) std::printf("blas: could not restart (%s): staying on %s\n", why.c_str(), info.corename.c_str());
    } else if (option.mode == BlasCoreMode::named) {
      throw std::invalid_argument("--blas-core " + option.name + ": " + check.detail +
                                  "; --blas-core keep runs on the kernels OpenBLAS chose");
    } else if (report) {
      std::printf("%s\n", describe_failed_check(info, candidate, check).c_str());
    }
  } else if (option.mode == BlasCoreMode::named && coretype_env != nullptr &&
             !equal_ignoring_case(option.name, info.corename) && report) {
    std::printf("blas: OPENBLAS_CORETYPE=%s is set, and wins over --blas-core %s\n", coretype_env, option.name.c_str());
  }
  if (report) std::printf("%s\n", describe_blas(info, verdict, coretype_env).c_str());
  std::fflush(stdout);
}

}  // namespace tiny
