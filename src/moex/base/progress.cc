#include "moex/base/progress.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

namespace moex {
namespace {

std::atomic<bool> quiet{false};

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string duration_text(double seconds) {
  char buf[32];
  const long long s = std::llround(seconds);
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%lldh%02lldm", s / 3600, s / 60 % 60);
  else if (s >= 60) std::snprintf(buf, sizeof buf, "%lldm%02llds", s / 60, s % 60);
  else std::snprintf(buf, sizeof buf, "%llds", s);
  return buf;
}

}  // namespace

std::string bytes_text(double bytes) {
  char buf[32];
  if (bytes >= 1e9) std::snprintf(buf, sizeof buf, "%.2f GB", bytes / 1e9);
  else if (bytes >= 1e6) std::snprintf(buf, sizeof buf, "%.0f MB", bytes / 1e6);
  else if (bytes >= 1e3) std::snprintf(buf, sizeof buf, "%.0f kB", bytes / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f B", bytes);
  return buf;
}

void set_progress_quiet(bool q) { quiet = q; }

bool progress_enabled() { return !quiet && isatty(STDERR_FILENO) == 1; }

std::string progress_line(const std::string& what, double done, double total, ProgressUnit unit, double seconds) {
  const bool bytes = unit == ProgressUnit::kBytes;
  const auto amount = [&](double v) { return bytes ? bytes_text(v) : std::to_string(std::llround(v)); };
  std::string line = what + ": " + amount(done) + " of " + amount(total);
  if (total > 0) line += " (" + std::to_string(static_cast<int>(std::floor(100.0 * std::min(done, total) / total))) + "%)";
  if (seconds > 0 && done > 0) {
    const double rate = done / seconds;
    char items[32];
    std::snprintf(items, sizeof items, rate < 10 ? "%.1f" : "%.0f", rate);
    line += ", " + (bytes ? bytes_text(rate) : std::string(items)) + "/s";
    if (done < total) line += ", " + duration_text((total - done) / rate) + " left";
    else line += ", " + duration_text(seconds);
  }
  return line;
}

bool ProgressThrottle::due(double now, bool last) {
  if (!last && now - last_drawn_ < interval_) return false;
  last_drawn_ = now;
  return true;
}

Progress::Progress(std::string what, double total, ProgressUnit unit)
    : what_(std::move(what)),
      total_(total),
      unit_(unit),
      enabled_(progress_enabled()),
      start_(now_seconds()),
      throttle_(1.0 / kRedrawsPerSecond) {}

Progress::~Progress() {
  if (!enabled_ || drawn_width_ == 0) return;
  std::fprintf(stderr, "\r%*s\r", static_cast<int>(drawn_width_), "");
  std::fflush(stderr);
}

void Progress::set_total(double total) { total_ = total; }

void Progress::add(double amount) {
  const double done = done_.fetch_add(amount) + amount;
  if (enabled_) draw(done, done >= total_);
}

void Progress::draw(double done, bool last) {
  std::unique_lock lock(draw_mutex_, std::try_to_lock);
  if (!lock.owns_lock()) return;  // another thread is drawing: this update shows in the next line
  const double now = now_seconds();
  if (!throttle_.due(now, last)) return;
  std::string line = progress_line(what_, done, total_, unit_, now - start_);
  const size_t width = line.size();
  if (width < drawn_width_) line.append(drawn_width_ - width, ' ');  // covers the longer line before
  std::fprintf(stderr, "\r%s", line.c_str());
  std::fflush(stderr);
  drawn_width_ = std::max(drawn_width_, width);
}

}  // namespace moex
