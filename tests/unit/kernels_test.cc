// Kernels: the AVX-512 matmul against the scalar oracle on every shape class (tails, token blocks,
// both weight dtypes), and the small ops against formulas evaluated in double.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <utility>
#include <vector>

#include "moex/base/cpu.h"
#include "moex/base/dtype.h"
#include "moex/base/threads.h"
#include "moex/kernels/matmul.h"
#include "moex/kernels/ops.h"
#include "tools/lib/probes.h"
#include "test_util.h"

namespace moex {
namespace {

using test::random_floats;

struct MatmulCase {
  int64_t tokens, n, k;
};

class MatmulTest : public ::testing::TestWithParam<MatmulCase> {};

TEST_P(MatmulTest, X86MatchesScalarForBf16AndF32) {
  // Each x86 kernel this CPU can run (AVX-512 and AVX2 on an AVX-512 CPU), called directly, and the dispatch.
  using Rows = void (*)(const float*, int64_t, const TensorView&, float*, bool, int64_t, int64_t);
  std::vector<std::pair<const char*, Rows>> kernels_here;
  if (cpu_features().has_avx512_kernels()) kernels_here.push_back({"avx512", kernels::x86::matmul_rows_avx512});
  if (cpu_features().has_avx2_kernels()) kernels_here.push_back({"avx2", kernels::x86::matmul_rows_avx2});
  if (kernels_here.empty()) GTEST_SKIP() << "no AVX2 or AVX-512 on this machine";
  const auto [tokens, n, k] = GetParam();
  const std::vector<float> x = random_floats(tokens * k, 1), w32 = random_floats(n * k, 2);
  std::vector<uint16_t> w16(n * k);
  for (size_t i = 0; i < w16.size(); ++i) w16[i] = f32_to_bf16(w32[i]);
  // A bf16 tensor and the same values stored as f32 (a GGUF f32 file of a bf16 checkpoint) give the same bits.
  std::vector<float> w16_as_f32(n * k);
  for (size_t i = 0; i < w16.size(); ++i) w16_as_f32[i] = bf16_to_f32(w16[i]);
  for (const auto& [name, rows] : kernels_here) {
    std::vector<float> from_bf16(tokens * n), from_f32(tokens * n);
    rows(x.data(), tokens, TensorView{w16.data(), DType::kBF16, Shape{n, k}}, from_bf16.data(), false, 0, n);
    rows(x.data(), tokens, TensorView{w16_as_f32.data(), DType::kF32, Shape{n, k}}, from_f32.data(), false, 0, n);
    EXPECT_EQ(from_bf16, from_f32) << name;
  }
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    TensorView w{dtype == DType::kBF16 ? static_cast<void*>(w16.data()) : const_cast<float*>(w32.data()), dtype,
                 Shape{n, k}};
    for (bool accumulate : {false, true}) {
      std::vector<float> expected(tokens * n, 0.5f), actual(tokens * n, 0.5f);
      kernels::ref::matmul(x.data(), tokens, w, expected.data(), accumulate);
      set_use_x86_kernels(true);
      kernels::matmul(x.data(), tokens, w, actual.data(), accumulate);
      for (int64_t i = 0; i < tokens * n; ++i)
        ASSERT_NEAR(actual[i], expected[i], 1e-4f * std::sqrt(static_cast<float>(k)))
            << "dtype " << dtype_name(dtype) << " i " << i;
      for (const auto& [name, rows] : kernels_here) {
        std::vector<float> direct(tokens * n, 0.5f);
        rows(x.data(), tokens, w, direct.data(), accumulate, 0, n);
        for (int64_t i = 0; i < tokens * n; ++i)
          ASSERT_NEAR(direct[i], expected[i], 1e-4f * std::sqrt(static_cast<float>(k)))
              << name << " dtype " << dtype_name(dtype) << " i " << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, MatmulTest,
                         ::testing::Values(MatmulCase{1, 1, 1}, MatmulCase{1, 7, 5}, MatmulCase{1, 64, 64},
                                           MatmulCase{1, 130, 1024}, MatmulCase{2, 33, 17}, MatmulCase{3, 9, 48},
                                           MatmulCase{4, 16, 16}, MatmulCase{5, 70, 100}, MatmulCase{9, 129, 33},
                                           MatmulCase{6, 21, 40}, MatmulCase{2, 70, 1030}, MatmulCase{7, 11, 31},
                                           MatmulCase{64, 96, 256}));

TEST(Matmul, ColumnSliceEqualsACopiedSlice) {
  // A TP rank's part of w2 is W[:, begin:end): a strided view must give what a contiguous copy gives.
  const int64_t n = 19, k = 70, begin = 13, end = 51, tokens = 5;
  std::vector<float> w = random_floats(n * k, 9), x = random_floats(tokens * (end - begin), 10);
  std::vector<float> copy;
  for (int64_t r = 0; r < n; ++r) copy.insert(copy.end(), w.begin() + r * k + begin, w.begin() + r * k + end);
  const TensorView full{w.data(), DType::kF32, Shape{n, k}};
  const TensorView slice = full.columns(begin, end), copied{copy.data(), DType::kF32, Shape{n, end - begin}};
  std::vector<uint16_t> w16(n * k), copy16(copy.size());  // the same in bf16, as checkpoints store w2
  for (size_t i = 0; i < w16.size(); ++i) w16[i] = f32_to_bf16(w[i]);
  for (size_t i = 0; i < copy16.size(); ++i) copy16[i] = f32_to_bf16(copy[i]);
  const TensorView full16{w16.data(), DType::kBF16, Shape{n, k}};
  const TensorView slice16 = full16.columns(begin, end), copied16{copy16.data(), DType::kBF16, Shape{n, end - begin}};
  for (bool x86 : {false, true}) {
    set_use_x86_kernels(x86);
    for (int64_t t : {tokens, int64_t{1}, int64_t{2}}) {
      std::vector<float> a(t * n), b(t * n);
      kernels::matmul(x.data(), t, slice, a.data());
      kernels::matmul(x.data(), t, copied, b.data());
      EXPECT_EQ(a, b) << (x86 ? "x86" : "ref") << " f32 T " << t;
      kernels::matmul(x.data(), t, slice16, a.data());
      kernels::matmul(x.data(), t, copied16, b.data());
      EXPECT_EQ(a, b) << (x86 ? "x86" : "ref") << " bf16 T " << t;
    }
  }
  set_use_x86_kernels(true);
  EXPECT_EQ(full.rows(3, 5).as<float>(), w.data() + 3 * k);
}

// matmul_group (q, k, v in one parallel region): each output equals its own matmul() bit for bit, whatever
// the thread count, for ragged row counts whose thread split falls inside and between the weights.
TEST(Matmul, GroupEqualsSeparateMatmuls) {
  const int64_t k = 70;
  const std::vector<int64_t> rows = {37, 5, 100};
  std::vector<std::vector<uint16_t>> w16;
  for (size_t i = 0; i < rows.size(); ++i) {
    const std::vector<float> w = random_floats(rows[i] * k, 20 + i);
    w16.emplace_back(w.size());
    for (size_t j = 0; j < w.size(); ++j) w16.back()[j] = f32_to_bf16(w[j]);
  }
  const int threads_before = num_threads();
  for (bool x86 : {false, true}) {
    set_use_x86_kernels(x86);
    for (int threads : {1, 2, 3}) {
      set_num_threads(threads);
      for (int64_t tokens : {1, 2, 5}) {
        const std::vector<float> x = random_floats(tokens * k, 30 + tokens);
        std::vector<kernels::MatmulOutput> outputs;
        std::vector<std::vector<float>> got(rows.size()), expected(rows.size());
        for (size_t i = 0; i < rows.size(); ++i) {
          const TensorView w{w16[i].data(), DType::kBF16, Shape{rows[i], k}};
          got[i].assign(tokens * rows[i], 0.25f);
          expected[i] = got[i];
          kernels::matmul(x.data(), tokens, w, expected[i].data(), /*accumulate=*/i == 1);
          outputs.push_back({w, got[i].data(), /*accumulate=*/i == 1});
        }
        kernels::matmul_group(x.data(), tokens, outputs.data(), static_cast<int>(outputs.size()));
        for (size_t i = 0; i < rows.size(); ++i)
          EXPECT_EQ(got[i], expected[i]) << (x86 ? "x86" : "ref") << " threads " << threads << " tokens " << tokens
                                         << " output " << i;
      }
    }
  }
  set_num_threads(threads_before);
  set_use_x86_kernels(true);
}

TEST(Matmul, ZeroTokensWritesNothing) {
  float w[4] = {1, 2, 3, 4}, y = 42.0f;
  kernels::matmul(nullptr, 0, TensorView{w, DType::kF32, Shape{2, 2}}, &y);
  EXPECT_EQ(y, 42.0f);
}

TEST(Ops, RmsNormMatchesFormula) {
  const int64_t d = 37;
  const std::vector<float> x = random_floats(2 * d, 3), w = random_floats(d, 4);
  std::vector<float> y(2 * d);
  kernels::rmsnorm(x.data(), 2, d, w.data(), false, 1e-5f, y.data());
  for (int t = 0; t < 2; ++t) {
    double ss = 0;
    for (int i = 0; i < d; ++i) ss += double(x[t * d + i]) * x[t * d + i];
    const double scale = 1.0 / std::sqrt(ss / d + 1e-5);
    for (int i = 0; i < d; ++i) EXPECT_NEAR(y[t * d + i], x[t * d + i] * scale * w[i], 1e-5);
  }
}

TEST(Ops, RopeRotatesHalvesByPositionTimesFrequency) {
  const int64_t hd = 8, max_pos = 40;
  std::vector<float> cos_t(max_pos * hd / 2), sin_t(max_pos * hd / 2);
  kernels::rope_tables(max_pos, hd, 10000.0, cos_t.data(), sin_t.data());
  std::vector<float> v = random_floats(2 * hd, 5), original = v;
  kernels::rope_apply(v.data(), 2, hd, 33, cos_t.data(), sin_t.data());
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < hd / 2; ++i) {
      const double angle = 33.0 * std::pow(10000.0, -2.0 * i / hd);
      const double x1 = original[h * hd + i], x2 = original[h * hd + i + hd / 2];
      EXPECT_NEAR(v[h * hd + i], x1 * std::cos(angle) - x2 * std::sin(angle), 1e-5);
      EXPECT_NEAR(v[h * hd + i + hd / 2], x2 * std::cos(angle) + x1 * std::sin(angle), 1e-5);
    }
  }
}

TEST(Ops, SiluMulAndSoftmax) {
  const float gate[3] = {-2.0f, 0.0f, 3.0f}, up[3] = {1.0f, 5.0f, -1.0f};
  float out[3];
  kernels::silu_mul(gate, up, 3, out);
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(out[i], gate[i] / (1 + std::exp(-gate[i])) * up[i], 1e-6);
  float x[3] = {1000.0f, 1001.0f, 999.0f};  // large values: the max is subtracted first
  kernels::softmax(x, 3);
  const double z = std::exp(-1.0) + 1 + std::exp(-2.0);
  EXPECT_NEAR(x[1], 1.0 / z, 1e-6);
  EXPECT_NEAR(x[0] + x[1] + x[2], 1.0, 1e-6);
}

TEST(Ops, GroupedQueryAttentionUsesTheSharedKvHead) {
  // 4 query heads over 2 KV heads: heads 0,1 read KV head 0 and heads 2,3 read KV head 1.
  const int64_t heads = 4, kv_heads = 2, hd = 4, max_seq = 6, length = 5;
  const std::vector<float> q = random_floats(heads * hd, 6), k = random_floats(kv_heads * max_seq * hd, 7),
                           v = random_floats(kv_heads * max_seq * hd, 8);
  std::vector<float> out(heads * hd), scratch(max_seq);
  kernels::attention_one_token(q.data(), k.data(), v.data(), heads, kv_heads, hd, max_seq, length, out.data(),
                               scratch.data());
  for (int h = 0; h < heads; ++h) {
    const int g = h / 2;
    std::vector<double> p(length);
    double z = 0, m = -1e300;
    for (int j = 0; j < length; ++j) {
      double dot = 0;
      for (int i = 0; i < hd; ++i) dot += q[h * hd + i] * k[(g * max_seq + j) * hd + i];
      p[j] = dot / std::sqrt(double(hd));
      m = std::max(m, p[j]);
    }
    for (double& e : p) z += (e = std::exp(e - m));
    for (int i = 0; i < hd; ++i) {
      double o = 0;
      for (int j = 0; j < length; ++j) o += p[j] / z * v[(g * max_seq + j) * hd + i];
      EXPECT_NEAR(out[h * hd + i], o, 1e-5) << "head " << h;
    }
  }
}

// The AVX-512 attention against a double-precision reference and against the scalar loop, on head sizes
// that are and are not a multiple of 16, lengths 1..70 (softmax tails), grouped heads.
TEST(Ops, VectorAttentionMatchesTheScalarLoopAndADoubleReference) {
  if (!use_x86_kernels()) GTEST_SKIP() << "no AVX-512 kernels on this CPU";
  for (int64_t hd : {64, 40, 128}) {
    for (int64_t length : {1, 2, 15, 16, 17, 70}) {
      const int64_t heads = 4, kv_heads = 2, max_seq = 80;
      const std::vector<float> q = random_floats(heads * hd, 16), k = random_floats(kv_heads * max_seq * hd, 17),
                               v = random_floats(kv_heads * max_seq * hd, 18);
      std::vector<float> fast(heads * hd), slow(heads * hd), scratch(max_seq);
      kernels::attention_one_token(q.data(), k.data(), v.data(), heads, kv_heads, hd, max_seq, length, fast.data(),
                                   scratch.data());
      kernels::attention_one_token_scalar(q.data(), k.data(), v.data(), heads, kv_heads, hd, max_seq, length,
                                          slow.data(), scratch.data());
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t g = h / 2;
        std::vector<double> p(length);
        double z = 0, m = -1e300;
        for (int64_t j = 0; j < length; ++j) {
          double dot = 0;
          for (int64_t i = 0; i < hd; ++i) dot += double(q[h * hd + i]) * k[(g * max_seq + j) * hd + i];
          p[j] = dot / std::sqrt(double(hd));
          m = std::max(m, p[j]);
        }
        for (double& e : p) z += (e = std::exp(e - m));
        for (int64_t i = 0; i < hd; ++i) {
          double o = 0;
          for (int64_t j = 0; j < length; ++j) o += p[j] / z * v[(g * max_seq + j) * hd + i];
          ASSERT_NEAR(fast[h * hd + i], o, 1e-5) << "hd " << hd << " length " << length << " head " << h;
          ASSERT_NEAR(fast[h * hd + i], slow[h * hd + i], 1e-5) << "hd " << hd << " length " << length;
        }
      }
    }
  }
}

TEST(Probe, StreamReadSumsWhatItReads) {
  std::vector<float> data(1 << 16, 0.0f);  // 256 KB: 4 blocks of 64 KB
  for (size_t i = 0; i < data.size(); i += 16) data[i] = 1.0f;
  const float sum = kernels::stream_read(data.data(), data.size() * sizeof(float));
  // Every 16th float is 1; the x86 probe adds every float, the scalar one every 16th: both see them all.
  EXPECT_EQ(sum, static_cast<float>(data.size() / 16));
}

}  // namespace
}  // namespace moex
