// Errors for cold paths (loading, flag parsing, set-up): thrown as moex::Error and turned by the
// command into one line and a non-zero exit. The hot path checks shapes once, up front, and never throws.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace moex {

// The exit code tells scripts what went wrong: 2 = the user's input (flags, config, files), 1 = ours.
enum class ErrorKind { kInternal = 1, kInvalidInput = 2, kComm = 3 };

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }
  int exit_code() const { return static_cast<int>(kind_); }

 private:
  ErrorKind kind_;
};

[[noreturn]] void throw_error(ErrorKind kind, const std::string& message);
// An input error about a file or other named source: "<origin>: <problem>" (exit code 2).
[[noreturn]] void throw_input_error(const std::string& origin, const std::string& problem);

namespace detail {
// Builds the message only when a check fails, so a passing check costs one branch.
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}
}  // namespace detail

}  // namespace moex

// Input errors (bad config, corrupt file, bad flag): exit code 2.
#define MOEX_CHECK_INPUT(cond, ...)                                                            \
  do {                                                                                         \
    if (!(cond)) ::moex::throw_error(::moex::ErrorKind::kInvalidInput, ::moex::detail::concat(__VA_ARGS__)); \
  } while (0)
// Internal invariants: exit code 1.
#define MOEX_CHECK(cond, ...)                                                                  \
  do {                                                                                         \
    if (!(cond)) ::moex::throw_error(::moex::ErrorKind::kInternal, ::moex::detail::concat(__FILE__, ":", __LINE__, ": check failed: " #cond " ", ##__VA_ARGS__)); \
  } while (0)
