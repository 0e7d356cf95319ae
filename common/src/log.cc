#include "sparsecar/common/log.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <mutex>
#include <string>

namespace sparsecar {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
std::mutex g_tag_mu;
std::string g_tag;  // guarded by g_tag_mu

const char* level_name(LogLevel level) {
  switch (level) {
    case LogLevel::kError: return "ERROR";
    case LogLevel::kWarn: return "WARN ";
    case LogLevel::kInfo: return "INFO ";
    case LogLevel::kDebug: return "DEBUG";
    case LogLevel::kTrace: return "TRACE";
  }
  return "?    ";
}

}  // namespace

void set_log_level(LogLevel level) { g_level.store(static_cast<int>(level)); }
LogLevel log_level() { return static_cast<LogLevel>(g_level.load(std::memory_order_relaxed)); }

bool parse_log_level(std::string_view text, LogLevel* out) {
  static constexpr std::pair<std::string_view, LogLevel> kNames[] = {
      {"error", LogLevel::kError}, {"warn", LogLevel::kWarn},   {"info", LogLevel::kInfo},
      {"debug", LogLevel::kDebug}, {"trace", LogLevel::kTrace},
  };
  for (const auto& [name, level] : kNames) {
    if (text == name) {
      *out = level;
      return true;
    }
  }
  return false;
}

void set_log_tag(std::string_view tag) {
  std::lock_guard<std::mutex> lock(g_tag_mu);
  g_tag.assign(tag);
}

std::string strfmt(const char* format, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, format);
  int n = std::vsnprintf(buf, sizeof buf, format, ap);
  va_end(ap);
  if (n < 0) return "(format error)";
  return std::string(buf, static_cast<size_t>(n) < sizeof buf ? static_cast<size_t>(n) : sizeof buf - 1);
}

void log_write(LogLevel level, const char* file, int line, const char* fmt, ...) {
  char buf[2048];
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  tm tm_utc{};
  gmtime_r(&ts.tv_sec, &tm_utc);
  const char* base = std::strrchr(file, '/');
  base = base ? base + 1 : file;
  std::string tag;
  {
    std::lock_guard<std::mutex> lock(g_tag_mu);
    tag = g_tag;
  }
  int n = std::snprintf(buf, sizeof buf, "%02d:%02d:%02d.%03ld %s %s%s%s%s:%d ", tm_utc.tm_hour,
                        tm_utc.tm_min, tm_utc.tm_sec, ts.tv_nsec / 1000000, level_name(level),
                        tag.empty() ? "" : "[", tag.c_str(), tag.empty() ? "" : "] ", base, line);
  if (n < 0) return;
  size_t used = static_cast<size_t>(n) < sizeof buf ? static_cast<size_t>(n) : sizeof buf - 1;
  va_list ap;
  va_start(ap, fmt);
  int m = std::vsnprintf(buf + used, sizeof buf - used, fmt, ap);
  va_end(ap);
  if (m > 0) used += static_cast<size_t>(m) < sizeof buf - used ? static_cast<size_t>(m) : sizeof buf - used - 1;
  if (used >= sizeof buf - 1) used = sizeof buf - 2;
  buf[used++] = '\n';
  ssize_t ignored = ::write(STDERR_FILENO, buf, used);
  (void)ignored;
}

}  // namespace sparsecar
