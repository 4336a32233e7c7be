// Helpers several unit-test files share (one definition: the unit tests also build as one unity batch).
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "moex/base/error.h"

namespace moex::test {

// n draws from N(0, stddev^2), the same for the same seed.
inline std::vector<float> random_floats(size_t n, uint32_t seed, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (float& f : v) f = dist(rng);
  return v;
}

// `text` with the first `from` replaced by `to`; a test failure if `from` is not there.
inline std::string replace(std::string text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  return at == std::string::npos ? text : text.replace(at, from.size(), to);
}

// The Error `fn` throws: an input error (exit 2), one line, naming `cause`.
inline void expect_input_error(const std::function<void()>& fn, const std::string& cause) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one naming " << cause;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput) << e.what();
    EXPECT_NE(std::string(e.what()).find(cause), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << "one line: " << e.what();
  }
}

}  // namespace moex::test
