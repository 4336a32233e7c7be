#include "moex/base/log.h"

#include <cstdlib>

namespace moex {
bool log_enabled(LogLevel level) {
  static const int threshold = [] {
    const char* env = std::getenv("MOEX_LOG_LEVEL");
    return env ? std::atoi(env) : 1;
  }();
  return static_cast<int>(level) <= threshold;
}
}  // namespace moex
