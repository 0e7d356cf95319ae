// Leveled logger shared by the daemon, the client library and the tools: fmt-style format strings
// (checked at compile time through fmt::format_string) written through spdlog.
//
// Log the real cause once, where it is first seen (UCX's LoggingStyle): a failed system call is
// logged by the code that made it, with errno text and the peer or tensor involved; callers up
// the stack add context to the returned Status instead of logging again.
// Lines go to stderr as "<time> <level> [<tag>] <file>:<line> message" (UTC time; the tag only
// when set_log_tag() gave one). Thread-safe: any thread may log; each line is written with a
// single write(2). A disabled level costs one relaxed atomic load: the arguments are not formatted.
//
//   SC_LOG_INFO("tensor '{}' registered ({} elements)", name, n);
//   return invalid_argument(fmt::format("bad shape {}", text));   // messages of Status values
//
// printf conversions ("%d", "%s") are not format specifiers here; tests/lint/printf_format_lint.py
// (ctest unit.printf_format_lint) rejects them in SC_LOG_*, SC_CHECK and fmt::format calls.
#pragma once

// fmt header-only: the binaries need no libfmt.so, and the copies of these sources compiled into
// other modules (python/ through CMake or setup.py, the extension built by hand on the GPU machine)
// link without it. spdlog is header-only too (log.cc).
#ifndef FMT_HEADER_ONLY
#define FMT_HEADER_ONLY
#endif
#include <fmt/core.h>

#include <string>
#include <string_view>
#include <utility>

namespace sparsecar {

enum class LogLevel : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3, kTrace = 4 };

void set_log_level(LogLevel level);
LogLevel log_level();
// Parses "error|warn|info|debug|trace"; returns false on anything else.
bool parse_log_level(std::string_view text, LogLevel* out);
// A short tag printed on every line of this process (e.g. "rank 2"); empty by default.
void set_log_tag(std::string_view tag);

inline bool log_enabled(LogLevel level) { return static_cast<int>(level) <= static_cast<int>(log_level()); }

// Writes one finished line (level, source position, message) whatever the current level.
void log_write(LogLevel level, const char* file, int line, std::string_view message);

template <typename... Args>
void log_format(LogLevel level, const char* file, int line, fmt::format_string<Args...> format,
                Args&&... args) {
  log_write(level, file, line, fmt::vformat(format, fmt::make_format_args(args...)));
}

// Legacy printf into a std::string, without truncation. Only python/src/module.cc still calls it
// (its owner moves it to fmt::format); new code uses fmt::format. The lint test rejects new callers.
std::string strfmt(const char* format, ...) __attribute__((format(printf, 1, 2)));

}  // namespace sparsecar

#define SC_LOG(level, ...)                                                     \
  do {                                                                         \
    if (::sparsecar::log_enabled(level))                                       \
      ::sparsecar::log_format(level, __FILE__, __LINE__, __VA_ARGS__);         \
  } while (0)
#define SC_LOG_ERROR(...) SC_LOG(::sparsecar::LogLevel::kError, __VA_ARGS__)
#define SC_LOG_WARN(...) SC_LOG(::sparsecar::LogLevel::kWarn, __VA_ARGS__)
#define SC_LOG_INFO(...) SC_LOG(::sparsecar::LogLevel::kInfo, __VA_ARGS__)
#define SC_LOG_DEBUG(...) SC_LOG(::sparsecar::LogLevel::kDebug, __VA_ARGS__)
#define SC_LOG_TRACE(...) SC_LOG(::sparsecar::LogLevel::kTrace, __VA_ARGS__)

// "Cannot happen": crash with a reason (a broken invariant, never bad input). Logged whatever the
// level; the condition's text is written as is (it is not a format string).
#define SC_CHECK(cond, ...)                                                        \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      ::sparsecar::log_write(::sparsecar::LogLevel::kError, __FILE__, __LINE__,    \
                             "check failed: " #cond);                             \
      ::sparsecar::log_format(::sparsecar::LogLevel::kError, __FILE__, __LINE__,   \
                              __VA_ARGS__);                                        \
      __builtin_trap();                                                            \
    }                                                                              \
  } while (0)
