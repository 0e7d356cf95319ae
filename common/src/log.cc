// The logger behind log.h: one unregistered spdlog logger whose sink writes each formatted line
// to stderr with a single write(2) (lines of several processes sharing a terminal or a pipe do not
// interleave), with our level names and the per-process tag added by a custom pattern flag.
#include "sparsecar/common/log.h"

#include <spdlog/logger.h>
#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/base_sink.h>
#include <unistd.h>

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>

namespace sparsecar {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
std::mutex g_tag_mu;
std::string g_tag;  // guarded by g_tag_mu

spdlog::level::level_enum to_spdlog(LogLevel level) {
  switch (level) {
    case LogLevel::kError: return spdlog::level::err;
    case LogLevel::kWarn: return spdlog::level::warn;
    case LogLevel::kInfo: return spdlog::level::info;
    case LogLevel::kDebug: return spdlog::level::debug;
    case LogLevel::kTrace: return spdlog::level::trace;
  }
  return spdlog::level::err;
}

std::string_view level_name(spdlog::level::level_enum level) {
  switch (level) {
    case spdlog::level::err: return "ERROR";
    case spdlog::level::warn: return "WARN ";
    case spdlog::level::info: return "INFO ";
    case spdlog::level::debug: return "DEBUG";
    case spdlog::level::trace: return "TRACE";
    default: return "?    ";
  }
}

// "%*": "<LEVEL> " then "[<tag>] " when this process has a tag.
class LevelAndTagFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&, spdlog::memory_buf_t& dest) override {
    const std::string_view name = level_name(msg.level);
    dest.append(name.data(), name.data() + name.size());
    dest.push_back(' ');
    std::lock_guard<std::mutex> lock(g_tag_mu);
    if (!g_tag.empty()) {
      dest.push_back('[');
      dest.append(g_tag.data(), g_tag.data() + g_tag.size());
      dest.append(std::string_view("] "));
    }
  }
  std::unique_ptr<spdlog::custom_flag_formatter> clone() const override {
    return std::make_unique<LevelAndTagFlag>();
  }
};

// stderr, one write(2) per line; the base sink's mutex guards the formatter's cached state.
std::atomic<bool> g_rehearsal{false};  // true while the startup line below is formatted, not written

class StderrWriteSink final : public spdlog::sinks::base_sink<std::mutex> {
 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t line;
    formatter_->format(msg, line);
    if (g_rehearsal.load(std::memory_order_relaxed)) return;
    const char* p = line.data();
    size_t left = line.size();
    while (left > 0) {  // a pipe may take a long line in parts
      ssize_t n = ::write(STDERR_FILENO, p, left);
      if (n <= 0) return;  // nowhere to report a failing stderr
      p += n;
      left -= static_cast<size_t>(n);
    }
  }
  void flush_() override {}
};

spdlog::logger& logger() {
  // Never destroyed: threads may still log while static destructors run at exit.
  static spdlog::logger* const instance = [] {
    auto formatter = std::make_unique<spdlog::pattern_formatter>(spdlog::pattern_time_type::utc, "\n");
    formatter->add_flag<LevelAndTagFlag>('*').set_pattern("%H:%M:%S.%e %*%s:%# %v");
    auto sink = std::make_shared<StderrWriteSink>();
    sink->set_formatter(std::move(formatter));
    auto* l = new spdlog::logger("sparsecar", std::move(sink));
    l->set_level(spdlog::level::trace);  // log_enabled() filters before anything is formatted
    return l;
  }();
  return *instance;
}

// Built during static initialisation rather than at the first line: a process that first logs
// when it is out of file descriptors (the rendezvous' "out of file descriptors" line) then only
// formats and writes. Under UBSan this matters too: its vptr check of the logger's freshly made
// shared_ptrs reads memory through a pipe(2) and reports "invalid vptr" when none can be opened.
// It also formats one line without writing it, through every step a real line takes: UBSan
// caches the dynamic types it has verified, so its first checks happen here and not when logging
// in a process out of descriptors.
[[maybe_unused]] const bool g_ready_at_startup = [] {
  spdlog::logger& l = logger();
  g_rehearsal.store(true);
  l.log(spdlog::source_loc{__FILE__, __LINE__, ""}, spdlog::level::info,
        fmt::format("{} {:.3f} {:016x}", "rehearsal", 1.0, 1u));
  g_rehearsal.store(false);
  return true;
}();

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

void log_write(LogLevel level, const char* file, int line, std::string_view message) {
  logger().log(spdlog::source_loc{file, line, ""}, to_spdlog(level),
               spdlog::string_view_t(message.data(), message.size()));
}

std::string strfmt(const char* format, ...) {
  va_list ap;
  va_start(ap, format);
  va_list again;
  va_copy(again, ap);
  const int n = std::vsnprintf(nullptr, 0, format, ap);
  va_end(ap);
  std::string out;
  if (n > 0) {
    out.resize(static_cast<size_t>(n) + 1);
    std::vsnprintf(out.data(), out.size(), format, again);
    out.resize(static_cast<size_t>(n));
  }
  va_end(again);
  return n < 0 ? std::string("(format error)") : out;
}

}  // namespace sparsecar
