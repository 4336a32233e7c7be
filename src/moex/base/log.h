// Minimal logging to stderr; MOEX_LOG_LEVEL=0..3 (error, warn, info, debug), default warn.
#pragma once
#include <cstdio>

namespace moex {
enum class LogLevel { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };
bool log_enabled(LogLevel level);
}  // namespace moex

#define MOEX_LOG(level, ...)                                             \
  do {                                                                   \
    if (::moex::log_enabled(::moex::LogLevel::level)) {                  \
      std::fprintf(stderr, "moex: " __VA_ARGS__);                        \
      std::fputc('\n', stderr);                                          \
    }                                                                    \
  } while (0)
