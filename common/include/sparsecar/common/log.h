// Minimal leveled logger shared by the daemon, the client library and the tools.
//
// Log the real cause once, where it is first seen (UCX's LoggingStyle): a failed system call is
// logged by the code that made it, with errno text and the peer or tensor involved; callers up
// the stack add context to the returned Status instead of logging again.
// Lines go to stderr as "<time> <level> [<component>] message". Thread-safe: each line is
// written with a single write(2).
#pragma once

#include <cstdarg>
#include <string>
#include <string_view>

namespace sparsecar {

enum class LogLevel : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3, kTrace = 4 };

void set_log_level(LogLevel level);
LogLevel log_level();
// Parses "error|warn|info|debug|trace"; returns false on anything else.
bool parse_log_level(std::string_view text, LogLevel* out);
// A short tag printed on every line of this process (e.g. "rank 2"); empty by default.
void set_log_tag(std::string_view tag);

inline bool log_enabled(LogLevel level) { return static_cast<int>(level) <= static_cast<int>(log_level()); }

// printf into a std::string (messages of Status values); truncated at 1 KiB.
std::string strfmt(const char* format, ...) __attribute__((format(printf, 1, 2)));

void log_write(LogLevel level, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));

}  // namespace sparsecar

#define SC_LOG(level, ...)                                                     \
  do {                                                                         \
    if (::sparsecar::log_enabled(level))                                       \
      ::sparsecar::log_write(level, __FILE__, __LINE__, __VA_ARGS__);          \
  } while (0)
#define SC_LOG_ERROR(...) SC_LOG(::sparsecar::LogLevel::kError, __VA_ARGS__)
#define SC_LOG_WARN(...) SC_LOG(::sparsecar::LogLevel::kWarn, __VA_ARGS__)
#define SC_LOG_INFO(...) SC_LOG(::sparsecar::LogLevel::kInfo, __VA_ARGS__)
#define SC_LOG_DEBUG(...) SC_LOG(::sparsecar::LogLevel::kDebug, __VA_ARGS__)
#define SC_LOG_TRACE(...) SC_LOG(::sparsecar::LogLevel::kTrace, __VA_ARGS__)

// "Cannot happen": crash with a reason (a broken invariant, never bad input).
#define SC_CHECK(cond, ...)                                                     \
  do {                                                                          \
    if (!(cond)) {                                                              \
      ::sparsecar::log_write(::sparsecar::LogLevel::kError, __FILE__, __LINE__, \
                             "check failed: " #cond);                          \
      ::sparsecar::log_write(::sparsecar::LogLevel::kError, __FILE__, __LINE__, \
                             __VA_ARGS__);                                      \
      __builtin_trap();                                                         \
    }                                                                           \
  } while (0)
