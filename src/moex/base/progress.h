// One progress line for long work (packing at load, quantize, pack, convert, gen-model, tune-comm), as
// llama.cpp's loader and Hugging Face's tools show: "what: done of total, rate, time left", rewritten in place
// with \r at most kRedrawsPerSecond times a second, and cleared when the work ends. Nothing is printed when
// stderr is not a terminal or after set_progress_quiet(true) (`--quiet`), so pipes and logs see no \r lines.
#pragma once
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

namespace moex {

// --quiet: no progress lines in this process (and no other terminal-only status lines; see progress_enabled).
void set_progress_quiet(bool quiet);
// stderr is a terminal and --quiet was not given.
bool progress_enabled();

enum class ProgressUnit { kBytes, kItems };

// The line's text for `done` of `total` after `seconds` (pure: the unit test's subject). Bytes as kB / MB / GB
// (decimal) with a rate per second, items as counts; the time left is extrapolated from the rate so far and
// left out until there is a rate to extrapolate from. E.g. "packing experts: 412 MB of 1.58 GB, 1.2 GB/s, 1 s left".
// "1.58 GB", "463 MB", "12 kB", "512 B": the sizes a progress line (and `moex plan`) prints.
std::string bytes_text(double bytes);

std::string progress_line(const std::string& what, double done, double total, ProgressUnit unit, double seconds);

// When to redraw: at most once per `interval` seconds, and always on the last update (done == total).
class ProgressThrottle {
 public:
  explicit ProgressThrottle(double interval) : interval_(interval) {}
  bool due(double now, bool last);  // true: draw now (and count it as drawn)

 private:
  double interval_;
  double last_drawn_ = -1e300;
};

// One line of work with a known total. add() may be called from any thread; the line is drawn by whichever
// caller finds a redraw due (the others do not wait). The destructor clears the line.
class Progress {
 public:
  static constexpr double kRedrawsPerSecond = 10;
  Progress(std::string what, double total, ProgressUnit unit = ProgressUnit::kBytes);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  void add(double amount);
  void set_total(double total);
  bool enabled() const { return enabled_; }

 private:
  void draw(double done, bool last);
  std::string what_;
  std::atomic<double> total_;
  ProgressUnit unit_;
  bool enabled_;
  double start_;  // steady clock, seconds
  std::atomic<double> done_{0};
  std::mutex draw_mutex_;
  ProgressThrottle throttle_;
  size_t drawn_width_ = 0;  // characters on the line now (cleared by the destructor)
};

}  // namespace moex
