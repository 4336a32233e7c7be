#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <set>
#include <thread>
#include <vector>

#include "moex/base/dtype.h"
#include "moex/base/error.h"
#include "moex/base/tensor.h"
#include "moex/base/threads.h"

namespace moex {
namespace {

// The CPU masks of an OpenMP team of `threads` started by the calling thread, one string per thread.
std::set<std::string> team_masks(int threads) {
  std::vector<std::string> masks(threads);
#pragma omp parallel num_threads(threads)
  {
    cpu_set_t m;
    CPU_ZERO(&m);
    pthread_getaffinity_np(pthread_self(), sizeof(m), &m);
    std::string bits;
    for (int c = 0; c < 64; ++c) bits += CPU_ISSET(c, &m) ? '1' : '0';
    masks[omp_get_thread_num()] = bits;
  }
  return {masks.begin(), masks.end()};
}

// serve runs the forward on an engine thread started after set_num_threads pinned the main thread to one
// CPU: without become_compute_thread, that thread and its whole OpenMP team inherit that one CPU.
TEST(Threads, AComputeThreadStartedAfterPinningGetsEveryCpu) {
  if (cpu_count() < 2) GTEST_SKIP() << "needs 2 CPUs";
  if (const char* pin = std::getenv("MOEX_PIN_THREADS"); pin && std::atoi(pin) == 0) GTEST_SKIP() << "pinning is off";
  std::set<std::string> inherited, adopted;
  std::thread setup([&] {  // a thread of its own, so the test process's main thread keeps its mask
    set_num_threads(2);    // pins this thread to the first CPU
    std::thread([&] { inherited = team_masks(2); }).join();
    std::thread([&] {
      become_compute_thread();
      adopted = team_masks(2);
    }).join();
  });
  setup.join();
  EXPECT_EQ(inherited.size(), 1u) << "a thread started by a pinned thread shares its one CPU";
  EXPECT_EQ(adopted.size(), 2u) << "become_compute_thread pins its team to distinct CPUs";
}

// Reference for bf16 rounding: the exact nearest bf16 value, ties to even, found by brute force.
TEST(DType, Bf16RoundsToNearestEven) {
  const float samples[] = {0.0f, 1.0f, -1.0f, 3.14159265f, 1e-30f, -7.5e20f, 1.00390625f, 1.01171875f, 65504.0f};
  for (float f : samples) {
    const uint16_t h = f32_to_bf16(f);
    const float back = bf16_to_f32(h);
    const float up = bf16_to_f32(static_cast<uint16_t>(h + 1)), down = bf16_to_f32(static_cast<uint16_t>(h - 1));
    EXPECT_LE(std::fabs(back - f), std::fabs(up - f)) << f;
    if (h != 0) EXPECT_LE(std::fabs(back - f), std::fabs(down - f)) << f;  // 0x0000 - 1 is a NaN code
  }
  EXPECT_EQ(f32_to_bf16(1.00390625f), 0x3f80);  // exactly halfway between 1.0 and 1.0078125: even wins
  EXPECT_EQ(f32_to_bf16(1.01171875f), 0x3f82);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
}

TEST(DType, F16RoundTripsEveryFiniteHalf) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if (((h >> 10) & 0x1f) == 0x1f) continue;  // inf/nan
    const float f = f16_to_f32(static_cast<uint16_t>(h));
    EXPECT_EQ(f32_to_f16(f), (f == 0.0f && !(h & 0x8000)) ? 0 : h) << h;
  }
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));
}

TEST(DType, F8E4M3RoundTripsEveryCode) {
  for (int v = 0; v < 256; ++v) {
    if ((v & 0x7f) == 0x7f) continue;  // NaN
    const float f = f8e4m3_to_f32(static_cast<uint8_t>(v));
    if (v == 0x80) continue;  // -0 maps to the +0 / -0 code of its sign: checked below
    EXPECT_EQ(f32_to_f8e4m3(f), v) << v << " " << f;
  }
  EXPECT_EQ(f8e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(f8e4m3_to_f32(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(f32_to_f8e4m3(1e6f), 0x7e);    // saturates
  EXPECT_EQ(f32_to_f8e4m3(-1e6f), 0xfe);
  EXPECT_EQ(f32_to_f8e4m3(-0.0f), 0x80);
}

// The branch-free conversion against the step-by-step definition: every float whose top 24 bits are given and
// a pseudo-random low byte (2^24 values over every exponent, NaNs and infinities included), the ties between
// neighbouring codes, and the ends of the subnormal range. A version that rounded ties away from zero, or let a
// value past 448 through, fails here.
TEST(DType, F8E4M3FastEqualsTheDefinition) {
  uint32_t lcg = 1;
  int64_t bad = 0;
  for (uint32_t hi = 0; hi < (1u << 24); ++hi) {
    lcg = lcg * 1664525u + 1013904223u;
    const uint32_t bits = hi << 8 | (lcg >> 24);
    float f;
    std::memcpy(&f, &bits, 4);
    if (f32_to_f8e4m3(f) != f32_to_f8e4m3_ref(f) && bad++ < 5)
      ADD_FAILURE() << std::hex << "bits 0x" << bits << ": 0x" << int(f32_to_f8e4m3(f)) << " vs 0x" << int(f32_to_f8e4m3_ref(f));
  }
  EXPECT_EQ(bad, 0);
  for (int v = 0; v < 0x7e; ++v) {
    const float lo = f8e4m3_to_f32(static_cast<uint8_t>(v)), hi = f8e4m3_to_f32(static_cast<uint8_t>(v + 1));
    for (const float f : {(lo + hi) / 2, -(lo + hi) / 2, std::nextafter((lo + hi) / 2, hi)})
      EXPECT_EQ(f32_to_f8e4m3(f), f32_to_f8e4m3_ref(f)) << f;
  }
  for (const float f : {std::ldexp(1.0f, -10), std::ldexp(1.0f, -6), std::ldexp(0.9375f, -6), 448.0f, 464.0f, 465.0f,
                        std::numeric_limits<float>::infinity(), std::numeric_limits<float>::denorm_min()})
    EXPECT_EQ(f32_to_f8e4m3(f), f32_to_f8e4m3_ref(f)) << f;
}

TEST(DType, F8E4M3RoundsToNearest) {
  // Every value between two neighbouring codes goes to the nearer one.
  for (int v = 0; v < 0x7e; ++v) {
    const float lo = f8e4m3_to_f32(static_cast<uint8_t>(v)), hi = f8e4m3_to_f32(static_cast<uint8_t>(v + 1));
    EXPECT_EQ(f32_to_f8e4m3(lo + (hi - lo) * 0.25f), v);
    EXPECT_EQ(f32_to_f8e4m3(lo + (hi - lo) * 0.75f), v + 1);
  }
}

TEST(Tensor, RowViewsAdvanceByRowBytes) {
  float data[6] = {0, 1, 2, 3, 4, 5};
  TensorView t{data, DType::kF32, Shape{2, 3}};
  TensorView r = t.row(1);
  EXPECT_EQ(r.shape, (Shape{3}));
  EXPECT_EQ(r.as<float>()[0], 3.0f);
  EXPECT_THROW(t.row(2), Error);
}

TEST(Error, InputErrorsExitWithTwo) {
  try {
    MOEX_CHECK_INPUT(1 + 1 == 3, "value ", 42, " is wrong");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.exit_code(), 2);
    EXPECT_STREQ(e.what(), "value 42 is wrong");
  }
}

}  // namespace
}  // namespace moex
