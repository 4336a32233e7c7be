// Packed weight formats: every fast kernel (and the scalar path over the packed layout) against the
// natural-layout oracle in kernels::ref on ragged shapes; the quantizers against a double-precision float
// matmul within each format's error bound; ISA dispatch against CPU feature sets; the compute probes'
// instruction counts; CPU detection against /proc/cpuinfo.
#include <gtest/gtest.h>

#include <sys/mman.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "moex/base/cpu.h"
#include "moex/base/dtype.h"
#include "moex/base/error.h"
#include "moex/base/threads.h"
#include "tools/lib/kernel_bench.h"
#include "moex/kernels/formats/format.h"
#include "moex/kernels/packed.h"
#include "tools/lib/probes.h"
#include "moex/kernels/x86/packed_x86.h"
#include "test_util.h"

namespace moex {
namespace {

using test::random_floats;

using kernels::Isa;
using kernels::QuantizedMatrix;
using kernels::WeightFormat;

// The formats the tests cover; int4 in both flavours and all group sizes.
struct FormatCase {
  WeightFormat format;
  int64_t group = 0;
  bool symmetric = true;
  std::string name() const {
    std::string n(kernels::weight_format_name(format));
    for (char& c : n)
      if (c == '-') c = '_';
    if (kernels::group_is_user_set(format)) n += (symmetric ? "_sym_g" : "_asym_g") + std::to_string(group);
    return n;
  }
};

void PrintTo(const FormatCase& f, std::ostream* os) { *os << f.name(); }

const FormatCase kFormats[] = {
    {WeightFormat::kBF16},          {WeightFormat::kInt8},           {WeightFormat::kInt8W8A8},
    {WeightFormat::kInt4, 32, true}, {WeightFormat::kInt4, 64, false}, {WeightFormat::kInt4, 128, true},
    {WeightFormat::kInt4, 128, false}, {WeightFormat::kInt4W4A8, 32, true}, {WeightFormat::kInt4W4A8, 64, false},
    {WeightFormat::kInt4W4A8, 128, true}, {WeightFormat::kFP8E4M3},
};

QuantizedMatrix quantize(const FormatCase& f, const std::vector<float>& w, int64_t rows, int64_t cols) {
  const TensorView view{const_cast<float*>(w.data()), DType::kF32, Shape{rows, cols}};
  return kernels::quantize(view, f.format, f.group, f.symmetric);
}

// |y| of the dot products' magnitudes: sum_k |x_k w_nk| per output, the scale rounding errors are relative to.
std::vector<double> magnitudes(const std::vector<float>& x, int64_t tokens, const QuantizedMatrix& w) {
  std::vector<double> m(tokens * w.rows);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t n = 0; n < w.rows; ++n)
      for (int64_t k = 0; k < w.cols; ++k) m[t * w.rows + n] += std::fabs(x[t * w.cols + k] * w.weight(n, k));
  return m;
}

// int8's VNNI kernel (x86/packed_int8_avx512vnni.cc, CPUs with VNNI and no AMX) reads x as s16 codes per token and
// K group of kInt8ActivationGroup: an activation is off by at most half a step, absmax_g / 65534, so an output by at
// most sum_k |w_nk| absmax_g(k) / 65534 beyond the f32 path's rounding (its tolerance adds this bound).
std::vector<double> s16_activation_error(const std::vector<float>& x, int64_t tokens, const QuantizedMatrix& w) {
  const int64_t K = w.cols, G = kernels::x86::kInt8ActivationGroup;
  std::vector<double> e(tokens * w.rows);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<double> half_step(K);
    for (int64_t g0 = 0; g0 < K; g0 += G) {
      double absmax = 0;
      for (int64_t k = g0; k < std::min(K, g0 + G); ++k) absmax = std::max(absmax, std::fabs(double(x[t * K + k])));
      for (int64_t k = g0; k < std::min(K, g0 + G); ++k) half_step[k] = absmax / 65534 * (1 + 1e-6);
    }
    for (int64_t n = 0; n < w.rows; ++n)
      for (int64_t k = 0; k < K; ++k) e[t * w.rows + n] += std::fabs(w.weight(n, k)) * half_step[k];
  }
  return e;
}
bool int8_on_s16_codes(WeightFormat format, Isa isa) { return format == WeightFormat::kInt8 && isa == Isa::kAvx512Vnni; }

struct Shape3 {
  int64_t tokens, n, k;
};

// The shapes: 0..7 and 13 tokens (token-tile tails of every kernel), N odd and below / above a panel, K odd
// and not a multiple of any tile, group or 128-block, one K over the kernels' 2048 K block, and K = 0;
// from 16 tokens the weight-only kernels take their prefill path (weights decoded once per K block), the last
// shape over two of its blocks. 17, 40 and 70 tokens over a K of several AMX slices (32 k steps up to 4 token
// blocks, 128 above: 1024 / 4096 bf16 k, twice that in int8) take the tiles' slice-by-slice passes with two,
// three and five token blocks. The real models' K (Mixtral's hidden 4096 and intermediate 14336) in a slice of a
// few rows, at batch 1 and 16 (decode; {70, 9, 8300} above covers the many-row path over several K blocks).
const Shape3 kShapes[] = {{0, 5, 7},   {2, 5, 0},   {1, 1, 1},     {1, 65, 33},    {2, 7, 130},  {3, 64, 64},    {4, 129, 257},
                          {5, 31, 96}, {6, 70, 200},  {7, 3, 131},    {13, 67, 95}, {1, 9, 4100},   {8, 64, 2051},
                          {17, 67, 1100}, {32, 9, 300}, {16, 5, 2100}, {40, 33, 2100}, {70, 9, 8300}, {35, 5, 0},
                          {1, 9, 4096},   {16, 7, 4096}, {1, 5, 14336}, {16, 3, 14336}};

void expect_close(const std::vector<float>& actual, const std::vector<float>& expected, const std::vector<double>& mag,
                  double rel, const std::string& what, const std::vector<double>* extra = nullptr) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i)
    ASSERT_NEAR(actual[i], expected[i], rel * mag[i % mag.size()] + 1e-6 + (extra ? (*extra)[i] : 0.0)) << what << " at " << i;
}

class PackedMatmulTest : public ::testing::TestWithParam<FormatCase> {};

// Every registered kernel of the format (kernels/formats.cc: each (ISA, loop) row this CPU runs, the many-row loops
// forced on every row count as well as the few-row ones) and the scalar path, through the one op's packed call,
// against the scalar oracle (ref::matmul over the natural layout) on the ragged shapes above.
TEST_P(PackedMatmulTest, EveryRegisteredKernelMatchesTheReference) {
  const FormatCase f = GetParam();
  std::vector<Isa> isas = kernels::usable_isas(f.format, cpu_features());
  if (!request_amx_permission()) std::erase(isas, Isa::kAmx);  // an AMX CPU under a Linux older than 5.16
  std::vector<kernels::KernelEntry> kernels_here = {{f.format, Isa::kScalar, kernels::RowKernel::kFewRows, nullptr}};
  for (const kernels::KernelEntry& e : kernels::registered_kernels())
    if (e.format == f.format && std::find(isas.begin(), isas.end(), e.isa) != isas.end()) kernels_here.push_back(e);
  int loops_checked = 0;
  for (const auto& [tokens, n, k] : kShapes) {
    const std::vector<float> x = random_floats(std::max<int64_t>(tokens, 1) * k, 11 + n), w = random_floats(n * k, 7 + k);
    const QuantizedMatrix q = quantize(f, w, n, k);
    const kernels::PackedWeights packed = kernels::pack(q);
    std::vector<double> mag = magnitudes(x, tokens, q);
    if (mag.empty()) mag.push_back(0);
    const std::vector<double> s16_error =
        f.format == WeightFormat::kInt8 ? s16_activation_error(x, tokens, q) : std::vector<double>{};
    for (bool accumulate : {false, true}) {
      std::vector<float> expected(tokens * n, 0.25f);
      kernels::ref::matmul(x.data(), tokens, q, expected.data(), accumulate);
      for (const kernels::KernelEntry& e : kernels_here) {
        std::vector<float> actual(tokens * n, 0.25f);
        if (e.run) kernels::packed_matmul_with(e, x.data(), tokens, packed, actual.data(), accumulate);
        else kernels::packed_matmul_on(Isa::kScalar, x.data(), tokens, packed, actual.data(), accumulate);
        ++loops_checked;
        const std::string what = f.name() + " " + std::string(kernels::isa_name(e.isa)) +
                                 (e.loop == kernels::RowKernel::kManyRows ? " many-row" : " few-row") + " T" +
                                 std::to_string(tokens) + " N" + std::to_string(n) + " K" + std::to_string(k) +
                                 (accumulate ? " +=" : " =");
        // W8A8 sums integers: the same codes give the same float; the others differ in summation order only.
        expect_close(actual, expected, mag, f.format == WeightFormat::kInt8W8A8 ? 1e-6 : 2e-6 * std::sqrt(double(k)), what,
                     int8_on_s16_codes(f.format, e.isa) ? &s16_error : nullptr);
      }
      // The call a model makes (the weight's own KernelChoice for this row count) is one of those.
      std::vector<float> actual(tokens * n, 0.25f);
      kernels::packed_matmul(x.data(), tokens, packed, actual.data(), accumulate);
      expect_close(actual, expected, mag, f.format == WeightFormat::kInt8W8A8 ? 1e-6 : 2e-6 * std::sqrt(double(k)),
                   f.name() + " dispatched T" + std::to_string(tokens),
                   int8_on_s16_codes(f.format, packed.kernel.for_rows(tokens, false).isa) ? &s16_error : nullptr);
    }
  }
  EXPECT_GT(loops_checked, 0);
  if (isas.size() == 1) GTEST_SKIP() << "scalar path only: this CPU has no " << f.name() << " kernel";
}

// Each format's table row against what its code does: pack() fills exactly the buffers the row declares, sized as
// packed_layout says, and k_padded is a multiple of the row's k step; the memory estimate is within a few percent of
// the bytes a packed matrix really takes.
TEST(FormatTable, EveryFormatHasARowAndAFewRowKernelOnEveryIsaItsChoiceCanName) {
  ASSERT_EQ(kernels::all_formats().size(), size_t{kernels::kWeightFormats});
  EXPECT_EQ(kernels::weight_format_from_name("fp8"), WeightFormat::kFP8E4M3);
  EXPECT_EQ(kernels::weight_format_from_name("int5"), std::nullopt);
  for (const kernels::FormatTraits& t : kernels::all_formats())
    for (Isa isa : {Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kAvx512Vnni, Isa::kAmx}) {
      // Every ISA kernel_isa can give this format on some CPU resolves to registered kernels.
      bool reachable = false;
      for (const kernels::KernelEntry& e : kernels::registered_kernels()) reachable = reachable || (e.format == t.format && e.isa == isa);
      if (!reachable) continue;
      const kernels::KernelChoice c = kernels::choose_kernel_on(t.format, isa);
      EXPECT_NE(c.few.run, nullptr) << t.name << " " << kernels::isa_name(isa);
      EXPECT_NE(c.many.run, nullptr) << t.name << " " << kernels::isa_name(isa);
    }
}

// Each format's file (kernels/formats/<name>.cc) declares its kernels once per ISA, and the registry is exactly the
// rows made from them: each declared loop found under its (format, ISA, loop) with the entry's kernel and activation
// layout, no undeclared one; the table's fields that replaced enum tests elsewhere say what they did.
TEST(FormatTable, EachFormatsFileRegistersOnlyItsOwnKernels) {
  size_t rows = 0;
  for (const kernels::FormatTraits& t : kernels::all_formats()) {
    const kernels::FormatDef& def = kernels::format_def(t.format);
    EXPECT_EQ(def.traits.name, t.name);
    std::set<Isa> isas;
    for (const kernels::IsaKernels& k : def.kernels) {
      EXPECT_TRUE(isas.insert(k.isa).second) << t.name << " declares " << kernels::isa_name(k.isa) << " twice";
      for (kernels::RowKernel loop : {kernels::RowKernel::kFewRows, kernels::RowKernel::kManyRows}) {
        const kernels::PanelKernel run = loop == kernels::RowKernel::kFewRows ? k.few : k.many;
        const kernels::KernelEntry* e = kernels::find_kernel(t.format, k.isa, loop);
        if (!run) {
          EXPECT_EQ(e, nullptr) << t.name << " " << kernels::isa_name(k.isa);
          continue;
        }
        ++rows;
        ASSERT_NE(e, nullptr) << t.name << " " << kernels::isa_name(k.isa);
        EXPECT_EQ(e->run, run) << t.name << " " << kernels::isa_name(k.isa);
        EXPECT_EQ(e->activations, k.activations) << t.name << " " << kernels::isa_name(k.isa);
      }
    }
  }
  EXPECT_EQ(rows, kernels::registered_kernels().size());
  EXPECT_TRUE(kernels::group_is_user_set(WeightFormat::kInt4));
  EXPECT_TRUE(kernels::group_is_user_set(WeightFormat::kInt4W4A8));
  EXPECT_FALSE(kernels::group_is_user_set(WeightFormat::kFP8E4M3));  // grouped, but its 128 is fixed
  EXPECT_FALSE(kernels::group_is_user_set(WeightFormat::kInt8));
}

TEST(FormatTable, RowsDescribeThePackedWeights) {
  const std::vector<float> w = random_floats(128 * 300, 5);
  for (const FormatCase& f : kFormats) {
    const kernels::FormatTraits& t = kernels::format_traits(f.format);
    EXPECT_EQ(t.format, f.format);
    EXPECT_EQ(kernels::weight_format_name(f.format), t.name);
    EXPECT_EQ(kernels::weight_format_from_name(t.name), f.format);
    const kernels::PackedWeights p = kernels::pack(quantize(f, w, 128, 300));
    const kernels::PackedWeights layout = kernels::packed_layout(f.format, 128, 300, p.group, false);
    EXPECT_EQ(p.k_padded % t.k_multiple, 0) << f.name();
    for (int b = 0; b < kernels::PackedWeights::kBuffers; ++b) {
      EXPECT_EQ(bool(p.buffer(b).ptr), kernels::PackedWeights::has_buffer(f.format, b)) << f.name() << " buffer " << b;
      EXPECT_EQ(p.buffer(b).size, layout.buffer(b).size) << f.name() << " buffer " << b;
    }
    const double estimate = kernels::packed_bytes_per_weight(f.format, double(p.group), 300.0) * 128 * 300;
    EXPECT_NEAR(double(p.weight_bytes()), estimate, 0.08 * estimate) << f.name();  // k padded up to 64 at most: 7%
    // The choice is made once, at packing: a call reads it.
    EXPECT_EQ(p.kernel.isa, kernels::kernel_isa(f.format)) << f.name();
  }
}

// The integer kernels' partial sums at their bounds: every activation code +-127 and every weight code at its
// extreme (int8 +-127, int4 0 / 15), K over several int16 runs and K blocks. AVX2's vpmaddubsw saturates a pair
// sum above 32,767, so a kernel that let one grow past it (or summed too many k in int16) is off by thousands.
TEST(PackedMatmul, IntegerKernelsAtTheirExtremeCodesMatchTheReference) {
  const int64_t n = 70, k = 4100;
  std::vector<float> x(2 * k), w(n * k);
  for (int64_t i = 0; i < k; ++i) {
    x[i] = 1.0f;                          // token 0: all codes 127
    x[k + i] = i % 3 == 0 ? -2.0f : 2.0f;  // token 1: +-127
  }
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < k; ++i) w[r * k + i] = (r % 2 == 0) == (i % 5 != 0) ? 1.0f : -1.0f;
  const TensorView view{w.data(), DType::kF32, Shape{n, k}};
  for (const QuantizedMatrix& q : {kernels::quantize_int8(view, WeightFormat::kInt8W8A8),
                                   kernels::quantize_int4(view, 32, false, WeightFormat::kInt4W4A8),
                                   kernels::quantize_int4(view, 128, false, WeightFormat::kInt4W4A8)}) {
    const kernels::PackedWeights packed = kernels::pack(q);
    std::vector<float> expected(2 * n);
    kernels::ref::matmul(x.data(), 2, q, expected.data());
    const std::vector<double> mag = magnitudes(x, 2, q);  // ~k: the reference's own f32 sums round by ~1e-5 of it
    for (Isa isa : kernels::usable_isas(q.format, cpu_features())) {
      std::vector<float> actual(2 * n);
      kernels::packed_matmul_on(isa, x.data(), 2, packed, actual.data());
      for (int64_t i = 0; i < 2 * n; ++i)
        ASSERT_NEAR(actual[i], expected[i], 2e-6 * std::sqrt(double(k)) * mag[i])
            << kernels::weight_format_name(q.format) << " g" << q.group << " " << kernels::isa_name(isa) << " at " << i;
    }
  }
}

TEST(PackedMatmul, DispatchRunsKernelIsasChoice) {
  // packed_matmul (no ISA given) is packed_matmul_on(the ISA isa_for_rows picks from kernel_isa(...) for the call's
  // rows: 5 rows of int4 are on AMX CPUs' tiles), and MOEX_ISA=ref means kScalar.
  const std::vector<float> w = random_floats(70 * 33, 3), x = random_floats(5 * 33, 4);
  const kernels::PackedWeights p = kernels::pack(kernels::quantize_int4(TensorView{const_cast<float*>(w.data()), DType::kF32, Shape{70, 33}}, 32, false));
  for (bool x86 : {false, true}) {
    set_use_x86_kernels(x86);
    std::vector<float> a(5 * 70), b(5 * 70);
    kernels::packed_matmul(x.data(), 5, p, a.data());
    kernels::packed_matmul_on(kernels::isa_for_rows(WeightFormat::kInt4, kernels::kernel_isa(WeightFormat::kInt4), 5),
                              x.data(), 5, p, b.data());
    EXPECT_EQ(a, b);
    if (!x86) {
      EXPECT_EQ(kernels::kernel_isa(WeightFormat::kInt4), Isa::kScalar);
    }
  }
  set_use_x86_kernels(true);
}

// The quantizers, through the reference: each format's result within its error bound of the exact product.
TEST_P(PackedMatmulTest, ReferenceIsWithinTheFormatsErrorOfTheFloatMatmul) {
  const FormatCase f = GetParam();
  const int64_t tokens = 3, n = 37, k = 300;
  const std::vector<float> x = random_floats(tokens * k, 5), w = random_floats(n * k, 6, 0.05f);
  const QuantizedMatrix q = quantize(f, w, n, k);
  std::vector<float> y(tokens * n);
  kernels::ref::matmul(x.data(), tokens, q, y.data());
  for (int64_t t = 0; t < tokens; ++t) {
    double xmax = 0;
    for (int64_t i = 0; i < k; ++i) xmax = std::max(xmax, std::fabs(double(x[t * k + i])));
    for (int64_t r = 0; r < n; ++r) {
      double exact = 0, bound = 1e-5;
      for (int64_t i = 0; i < k; ++i) {
        const double xv = x[t * k + i], wv = w[r * k + i], ax = std::fabs(xv), aw = std::fabs(wv);
        exact += xv * wv;
        double wmax_row = 0;
        switch (f.format) {  // the largest error of one weight (and, for W8A8, of one activation)
          case WeightFormat::kBF16: bound += ax * aw * std::ldexp(1.0, -8) + aw * ax * std::ldexp(1.0, -8); break;
          case WeightFormat::kInt8: bound += ax * q.scales[r] * 0.5; break;
          case WeightFormat::kInt8W8A8:
            for (int64_t j = 0; j < k; ++j) wmax_row = std::max(wmax_row, std::fabs(double(w[r * k + j])));
            bound += ax * q.scales[r] * 0.5 + (xmax / 127 * 0.5) * (aw + q.scales[r] * 0.5);
            break;
          case WeightFormat::kInt4:  // and the activation's bf16 rounding
            bound += ax * q.scales[r * q.groups() + i / f.group] * (f.symmetric ? 0.5 : 1.0) + ax * std::ldexp(1.0, -8) * (aw + q.scales[r * q.groups() + i / f.group]);
            break;
          case WeightFormat::kInt4W4A8: {  // and the activation's code: half a step of absmax / 127
            const double scale = q.scales[r * q.groups() + i / f.group];
            bound += ax * scale * (f.symmetric ? 0.5 : 1.0) + (xmax / 127 * 0.5) * (aw + scale);
            break;
          }
          case WeightFormat::kFP8E4M3: {  // and the activation's bf16 rounding
            const double werr = aw * 0.0625 + q.scales[(r / 128) * q.groups() + i / 128] * std::ldexp(1.0, -9);
            bound += ax * werr + ax * std::ldexp(1.0, -8) * (aw + werr);
            break;
          }
        }
      }
      EXPECT_NEAR(y[t * n + r], exact, bound) << f.name() << " t " << t << " row " << r;
    }
  }
}

TEST_P(PackedMatmulTest, FusedGateUpAndRoutedDownMatchTheReference) {
  const FormatCase f = GetParam();
  const int64_t hidden = 70, inter = 45;  // odd I: the last gate/up panel is ragged
  // From kernels::kManyRowsFrom (12) rows the many-row GEMM runs: 12, 13, 19, 31 are its tiles' tails.
  for (int64_t tokens : {0, 1, 2, 5, 7, 9, 12, 13, 19, 31}) {
    const std::vector<float> x = random_floats(std::max<int64_t>(tokens, 1) * hidden, 21), w1 = random_floats(inter * hidden, 22),
                             w3 = random_floats(inter * hidden, 23), w2 = random_floats(hidden * inter, 24);
    const QuantizedMatrix q1 = quantize(f, w1, inter, hidden), q3 = quantize(f, w3, inter, hidden),
                          q2 = quantize(f, w2, hidden, inter);
    const kernels::PackedWeights p13 = kernels::pack_gate_up(q1, q3), p2 = kernels::pack(q2);
    // Tokens land in scattered rows of a bigger output with a wider stride, over values already there.
    const int64_t out_rows_total = 12, stride = hidden + 3;
    std::vector<int32_t> rows(tokens);
    for (int64_t t = 0; t < tokens; ++t) rows[t] = static_cast<int32_t>((t * 5 + 3) % out_rows_total);
    const std::vector<float> route = random_floats(std::max<int64_t>(tokens, 1), 25), base = random_floats(out_rows_total * stride, 26);

    std::vector<float> h_ref(tokens * inter), out_ref = base;
    kernels::ref::expert_gate_up(x.data(), tokens, q1, q3, h_ref.data());
    kernels::ref::expert_down_accumulate(h_ref.data(), tokens, q2, route.data(), rows.data(), out_ref.data(), stride);
    // Tolerances from the magnitudes of the sums (as in the matmul test): h = silu(g) u moves by at most
    // 1.1 |u| dg + |silu(g)| du, and a routed output by |route| dy.
    const double rel = 2e-6 * std::sqrt(double(hidden + inter));
    std::vector<float> gate(tokens * inter), up(tokens * inter);
    kernels::ref::matmul(x.data(), tokens, q1, gate.data());
    kernels::ref::matmul(x.data(), tokens, q3, up.data());
    const std::vector<double> mag_gate = magnitudes(x, tokens, q1), mag_up = magnitudes(x, tokens, q3),
                              mag_down = magnitudes(h_ref, tokens, q2);
    std::vector<double> tol_h(tokens * inter), tol_out(out_ref.size(), 1e-6);
    for (int64_t i = 0; i < tokens * inter; ++i) {
      const double g = gate[i], silu = g / (1 + std::exp(-g));
      tol_h[i] = rel * (1.1 * std::fabs(up[i]) * mag_gate[i] + std::fabs(silu) * mag_up[i]) + 1e-6 * (1 + std::fabs(h_ref[i]));
    }
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t n = 0; n < hidden; ++n)
        tol_out[rows[t] * stride + n] += rel * std::fabs(route[t]) * mag_down[t * hidden + n] + 1e-6 * std::fabs(out_ref[rows[t] * stride + n]);
    // int8 on s16 codes: each half's own activation error on top (s16_activation_error).
    std::vector<double> tol_h_x86 = tol_h, tol_out_x86 = tol_out;
    if (int8_on_s16_codes(f.format, kernels::kernel_isa(f.format, cpu_features(), true))) {
      const std::vector<double> e_gate = s16_activation_error(x, tokens, q1), e_up = s16_activation_error(x, tokens, q3),
                                e_down = s16_activation_error(h_ref, tokens, q2);
      for (int64_t i = 0; i < tokens * inter; ++i) {
        const double g = gate[i], silu = g / (1 + std::exp(-g));
        tol_h_x86[i] += 1.1 * std::fabs(up[i]) * e_gate[i] + std::fabs(silu) * e_up[i];
      }
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t n = 0; n < hidden; ++n) tol_out_x86[rows[t] * stride + n] += std::fabs(route[t]) * e_down[t * hidden + n];
    }
    for (bool x86 : {false, true}) {
      if (x86 && kernels::kernel_isa(f.format, cpu_features(), true) == Isa::kScalar) continue;
      set_use_x86_kernels(x86);
      const std::vector<double>& tol_h_here = x86 ? tol_h_x86 : tol_h;
      const std::vector<double>& tol_out_here = x86 ? tol_out_x86 : tol_out;
      const std::string what = f.name() + (x86 ? " x86" : " scalar") + " T" + std::to_string(tokens);
      std::vector<float> h(tokens * inter, -1.0f), out = base;
      kernels::expert_gate_up(x.data(), tokens, p13, h.data());
      for (size_t i = 0; i < h.size(); ++i) ASSERT_NEAR(h[i], h_ref[i], tol_h_here[i]) << what << " h " << i;
      // Down from the reference's h, so only this step's error is measured.
      kernels::expert_down_accumulate(h_ref.data(), tokens, p2, route.data(), rows.data(), out.data(), stride);
      for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], out_ref[i], tol_out_here[i]) << what << " out " << i;
    }
  }
  set_use_x86_kernels(true);
}

// int8 on VNNI (x86/packed_int8_avx512vnni.cc) against a scalar model of its arithmetic, bit for bit: each K group of
// kInt8ActivationGroup quantized to s16 codes, the group's integer sum exact, folded c = fma(float(sum), scale, c)
// group after group, times the row's scale. Token counts on both row loops (decode in registers below
// kWeightOnlyManyRowsFrom rows, a decoded K block of 1024 above), K odd, ragged against the group and the block.
TEST(PackedMatmul, Int8OnVnniEqualsItsScalarModelBitForBit) {
  if (!int8_on_s16_codes(WeightFormat::kInt8, kernels::kernel_isa(WeightFormat::kInt8, cpu_features(), true)))
    GTEST_SKIP() << "int8 runs s16 codes only on VNNI CPUs without AMX";
  const int64_t G = kernels::x86::kInt8ActivationGroup;
  for (const auto& [tokens, n, K] : std::vector<Shape3>{{1, 67, 33}, {3, 64, 130}, {5, 9, 1025}, {7, 70, 2051},
                                                       {13, 67, 255}, {16, 5, 1100}, {17, 67, 2051}, {40, 9, 300}}) {
    std::vector<float> x = random_floats(tokens * K, 31 + K), w = random_floats(n * K, 32 + n);
    x[0] = 0.0f;
    if (K > G) std::fill(x.begin() + G, x.begin() + 2 * G, 0.0f);  // an all-zero group: scale 0
    const QuantizedMatrix q = kernels::quantize_int8(TensorView{w.data(), DType::kF32, Shape{n, K}}, WeightFormat::kInt8);
    std::vector<float> expected(tokens * n);
    for (int64_t t = 0; t < tokens; ++t) {
      std::vector<int32_t> codes(K);
      std::vector<float> scales;
      for (int64_t g0 = 0; g0 < K; g0 += G) {
        const int64_t g1 = std::min(K, g0 + G);
        float absmax = 0.0f;
        for (int64_t k = g0; k < g1; ++k) absmax = std::max(absmax, std::fabs(x[t * K + k]));
        const float inv = absmax > 0.0f ? 32767.0f / absmax : 0.0f;
        for (int64_t k = g0; k < g1; ++k)
          codes[k] = static_cast<int32_t>(std::clamp(std::nearbyint(x[t * K + k] * inv), -32767.0f, 32767.0f));
        scales.push_back(absmax > 0.0f ? absmax / 32767.0f : 0.0f);
      }
      for (int64_t r = 0; r < n; ++r) {
        float c = 0.0f;
        for (int64_t g0 = 0; g0 < K; g0 += G) {
          int64_t sum = 0;
          for (int64_t k = g0; k < std::min(K, g0 + G); ++k) sum += int64_t{codes[k]} * static_cast<int8_t>(q.codes[r * K + k]);
          c = std::fma(static_cast<float>(sum), scales[g0 / G], c);
        }
        expected[t * n + r] = c * q.scales[r];
      }
    }
    std::vector<float> actual(tokens * n);
    kernels::packed_matmul_on(Isa::kAvx512Vnni, x.data(), tokens, kernels::pack(q), actual.data());
    for (size_t i = 0; i < actual.size(); ++i)
      ASSERT_EQ(actual[i], expected[i]) << "T" << tokens << " N" << n << " K" << K << " at " << i;
  }
}

// int4's two vdpbf16ps loops (x86/packed_int4_avx512bf16vbmi.cc: decode below kWeightOnlyManyRowsFrom rows, a K
// block decoded once above) run a row's K groups with the same operations in the same order, so T rows in one call
// equal the same rows one call each, bit for bit, K over the 2048-k block included. (int4 still counts as a format
// whose loops differ: on AMX CPUs its many rows run tiles, and under MOEX_ISA=avx512 there the f32-FMA loop.)
TEST_P(PackedMatmulTest, Int4Vdpbf16psLoopsGiveARowTheSameBits) {
  const FormatCase f = GetParam();
  if (f.format != WeightFormat::kInt4) GTEST_SKIP() << "int4 only";
  const std::vector<Isa> usable = kernels::usable_isas(f.format, cpu_features());
  if (std::find(usable.begin(), usable.end(), Isa::kAvx512Bf16) == usable.end()) GTEST_SKIP() << "no AVX512-BF16 + VBMI";
  const int threads_before = num_threads();
  for (const auto& [tokens, n, k] : {Shape3{16, 67, 95}, Shape3{17, 130, 2051}, Shape3{23, 7, 4101}, Shape3{40, 70, 200}}) {
    ASSERT_GE(tokens, kernels::many_rows_from(f.format, Isa::kAvx512Bf16));
    const std::vector<float> x = random_floats(tokens * k, 51 + n), w = random_floats(n * k, 53 + k);
    const kernels::PackedWeights packed = kernels::pack(quantize(f, w, n, k));
    std::vector<float> y(tokens * n), y_rows(tokens * n);
    for (int threads : {1, 2}) {
      set_num_threads(threads);
      kernels::packed_matmul_on(Isa::kAvx512Bf16, x.data(), tokens, packed, y.data());
      for (int64_t t = 0; t < tokens; ++t)
        kernels::packed_matmul_on(Isa::kAvx512Bf16, x.data() + t * k, 1, packed, y_rows.data() + t * n);
      for (size_t j = 0; j < y.size(); ++j)
        ASSERT_EQ(y[j], y_rows[j]) << f.name() << " T" << tokens << " N" << n << " K" << k << " " << j;
    }
  }
  set_num_threads(threads_before);
}

// The many-row GEMM (kernels/x86/expert_gemm_*, from kManyRowsFrom rows; W8A8 on AMX from kAmxManyRowsFrom) sums
// each lane's k in the few-row loop's order (bf16 on AVX-512) or exactly (W8A8, on VNNI and on AMX tiles): T rows in
// one call equal, bit for bit, the same rows one call each (one row: the few-row loop; bf16 on AMX: a one-row tile
// call, so this checks that a row's tile sums do not depend on the rows beside it), for the matmul, the fused
// gate/up and the routed down projection. Row counts on every tile tail (6-row and 16-row tiles), N ragged, K over
// the K block (2048 bf16, 4096 W8A8) and not a multiple of a k pair/quad. The AVX-512 GEMMs under an AMX
// kernel_isa are checked through packed_matmul_on against their own few-row loop.
TEST_P(PackedMatmulTest, ManyRowGemmGivesTheFewRowLoopsBits) {
  const FormatCase f = GetParam();
  if (!kernels::row_kernels_agree(f.format)) GTEST_SKIP() << "their two loops differ in the last bits (batch_invariant pins one)";
  if (kernels::kernel_isa(f.format, cpu_features(), true) == Isa::kScalar) GTEST_SKIP() << "no x86 kernel here";
  const Isa isa = kernels::kernel_isa(f.format);
  const kernels::KernelChoice choice = kernels::choose_kernel(f.format);
  EXPECT_EQ(choice.isa, isa);
  EXPECT_FALSE(choice.row_dependent);
  const int64_t from = choice.many_from;  // W4A8 on VNNI: one loop (max)
  if (from < 1000) {
    ASSERT_EQ(kernels::row_kernel_for(f.format, isa, from), kernels::RowKernel::kManyRows);
    if (from > 1) ASSERT_EQ(kernels::row_kernel_for(f.format, isa, from - 1), kernels::RowKernel::kFewRows);
  }
  // The AVX-512 GEMMs under an AMX kernel_isa still run under packed_matmul_on (against their own one-row calls).
  std::vector<Isa> gemm_isas;
  for (Isa i : kernels::usable_isas(f.format, cpu_features()))
    if (i == Isa::kAvx512Bf16 || i == Isa::kAvx512Vnni || i == Isa::kAmx) gemm_isas.push_back(i);
  const int threads_before = num_threads();
  for (const auto& [tokens, n, k] : {Shape3{5, 67, 95}, Shape3{12, 67, 95}, Shape3{13, 130, 2051}, Shape3{17, 7, 4101},
                                     Shape3{23, 64, 33}, Shape3{31, 65, 257}, Shape3{40, 70, 200}, Shape3{40, 70, 2100},
                                     Shape3{70, 9, 8300}}) {
    const std::vector<float> x = random_floats(tokens * k, 41 + n), w = random_floats(n * k, 43 + k),
                             w3 = random_floats(n * k, 44 + k), route = random_floats(tokens, 45);
    const QuantizedMatrix q = quantize(f, w, n, k), q3 = quantize(f, w3, n, k);
    const kernels::PackedWeights packed = kernels::pack(q), p13 = kernels::pack_gate_up(q, q3);
    std::vector<int32_t> rows(tokens);
    for (int64_t t = 0; t < tokens; ++t) rows[t] = static_cast<int32_t>(tokens - 1 - t);
    const std::string what = f.name() + " T" + std::to_string(tokens) + " N" + std::to_string(n) + " K" + std::to_string(k);
    std::vector<float> y_one(tokens * n), h_one(tokens * n), out_one(tokens * k, 0.5f);
    set_num_threads(1);
    for (int64_t t = 0; t < tokens; ++t) {
      kernels::packed_matmul(x.data() + t * k, 1, packed, y_one.data() + t * n);
      kernels::expert_gate_up(x.data() + t * k, 1, p13, h_one.data() + t * n);
    }
    // The down projection: W^T of q is [k, n], from h rows of n.
    const kernels::PackedWeights p2 = kernels::pack(quantize(f, random_floats(k * n, 46 + n), k, n));
    for (int64_t t = 0; t < tokens; ++t)
      kernels::expert_down_accumulate(h_one.data() + t * n, 1, p2, route.data() + t, rows.data() + t, out_one.data(), k);
    for (int threads : {1, 2}) {
      set_num_threads(threads);
      for (Isa i : gemm_isas) {
        std::vector<float> y(tokens * n), y_rows(tokens * n);
        kernels::packed_matmul_on(i, x.data(), tokens, packed, y.data());
        for (int64_t t = 0; t < tokens; ++t) kernels::packed_matmul_on(i, x.data() + t * k, 1, packed, y_rows.data() + t * n);
        for (size_t j = 0; j < y.size(); ++j)
          ASSERT_EQ(y[j], y_rows[j]) << what << " matmul on " << kernels::isa_name(i) << " " << j << " threads " << threads;
      }
      std::vector<float> y(tokens * n), h(tokens * n), out(tokens * k, 0.5f);
      kernels::packed_matmul(x.data(), tokens, packed, y.data());
      kernels::expert_gate_up(x.data(), tokens, p13, h.data());
      kernels::expert_down_accumulate(h_one.data(), tokens, p2, route.data(), rows.data(), out.data(), k);
      for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(y[i], y_one[i]) << what << " matmul " << i << " threads " << threads;
      for (size_t i = 0; i < h.size(); ++i) ASSERT_EQ(h[i], h_one[i]) << what << " gate_up " << i << " threads " << threads;
      for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], out_one[i]) << what << " down " << i << " threads " << threads;
    }
  }
  set_num_threads(threads_before);
}

// packed_matmul_group (q, k and v in one region, x converted once) gives each output exactly what packed_matmul
// gives it alone: ragged row counts, a row count on each side of the many-row switches, accumulate on one output,
// 1 and 2 threads. A group whose outputs differ in format falls back to one call each.
TEST_P(PackedMatmulTest, GroupEqualsSeparateCalls) {
  const FormatCase f = GetParam();
  const int64_t k = 95, rows[3] = {67, 16, 130};
  std::vector<kernels::PackedWeights> packed;
  for (int i = 0; i < 3; ++i) packed.push_back(kernels::pack(quantize(f, random_floats(rows[i] * k, 60 + i), rows[i], k)));
  const int threads_before = num_threads();
  for (int64_t tokens : {1, 3, 20}) {
    const std::vector<float> x = random_floats(tokens * k, 64);
    for (int threads : {1, 2}) {
      set_num_threads(threads);
      std::vector<std::vector<float>> alone(3), grouped(3);
      for (int i = 0; i < 3; ++i) {
        alone[i] = grouped[i] = std::vector<float>(tokens * rows[i], 0.5f);
        kernels::packed_matmul(x.data(), tokens, packed[i], alone[i].data(), i == 2);
      }
      const kernels::PackedOutput outputs[3] = {
          {&packed[0], grouped[0].data()}, {&packed[1], grouped[1].data()}, {&packed[2], grouped[2].data(), true}};
      kernels::packed_matmul_group(x.data(), tokens, outputs, 3);
      for (int i = 0; i < 3; ++i)
        for (size_t j = 0; j < alone[i].size(); ++j)
          ASSERT_EQ(grouped[i][j], alone[i][j]) << f.name() << " output " << i << " T" << tokens << " threads " << threads;
    }
  }
  set_num_threads(threads_before);
  // Mixed formats: each output through its own call.
  const kernels::PackedWeights other = kernels::pack(kernels::quantize_bf16(
      TensorView{random_floats(16 * k, 70).data(), DType::kF32, Shape{16, k}}));
  if (other.format == packed[0].format) return;
  const std::vector<float> x = random_floats(4 * k, 71);
  std::vector<float> a(4 * rows[0]), b(4 * 16), a_alone(4 * rows[0]), b_alone(4 * 16);
  kernels::packed_matmul(x.data(), 4, packed[0], a_alone.data());
  kernels::packed_matmul(x.data(), 4, other, b_alone.data());
  const kernels::PackedOutput mixed[2] = {{&packed[0], a.data()}, {&other, b.data()}};
  kernels::packed_matmul_group(x.data(), 4, mixed, 2);
  EXPECT_EQ(a, a_alone);
  EXPECT_EQ(b, b_alone);
}

// The fused MoE pass (one parallel region for every expert) against the same kernels run expert by expert,
// which it must equal bit for bit (same panels, same sums, experts added in order), on 1 and 2 threads; and
// against the scalar reference. Experts with 0, 1, a few and prefill-many rows, tokens shared between
// experts (their outputs add into the same rows), a ragged I. Decode-shaped passes too (one token on 2 of 4
// experts, on 8 of 12): up to kSerialConvertRows rows the x rows are converted before the parallel region.
// Many small experts too (30 of 40 with 1-3 rows, as Qwen3's batch 16).
void check_fused_experts(const FormatCase& f, const std::vector<int64_t>& rows_per_expert);
TEST_P(PackedMatmulTest, FusedExpertsEqualTheExpertByExpertKernels) {
  std::vector<int64_t> many(40);
  for (int e = 0; e < 40; ++e) many[e] = (e * 5) % 4;
  for (const std::vector<int64_t>& rows : {std::vector<int64_t>{3, 0, 1, 19, 2}, std::vector<int64_t>{1, 0, 0, 1},
                                           std::vector<int64_t>{1, 1, 0, 1, 1, 0, 1, 1, 0, 1, 0, 1}, many}) {
    SCOPED_TRACE(::testing::Message() << rows.size() << " experts");
    check_fused_experts(GetParam(), rows);
  }
}

void check_fused_experts(const FormatCase& f, const std::vector<int64_t>& rows_per_expert) {
  const int64_t hidden = 70, inter = 45, out_total = 20;
  const int experts = static_cast<int>(rows_per_expert.size());
  std::vector<QuantizedMatrix> q1, q3, q2;
  std::vector<kernels::PackedWeights> p13, p2;
  for (int e = 0; e < experts; ++e) {
    q1.push_back(quantize(f, random_floats(inter * hidden, 100 + e), inter, hidden));
    q3.push_back(quantize(f, random_floats(inter * hidden, 200 + e), inter, hidden));
    q2.push_back(quantize(f, random_floats(hidden * inter, 300 + e), hidden, inter));
    p13.push_back(kernels::pack_gate_up(q1[e], q3[e]));
    p2.push_back(kernels::pack(q2[e]));
  }
  int64_t total = 0;
  for (int64_t r : rows_per_expert) total += r;
  const std::vector<float> x = random_floats(total * hidden, 31), route = random_floats(total, 32),
                           base = random_floats(out_total * hidden, 33);
  std::vector<int32_t> out_rows(total);
  for (int e = 0, row = 0; e < experts; ++e)  // distinct within an expert, shared across experts
    for (int64_t r = 0; r < rows_per_expert[e]; ++r, ++row) out_rows[row] = static_cast<int32_t>((r * 7 + e) % out_total);

  // The reference: natural-layout oracles, expert by expert.
  std::vector<float> out_ref = base, h_ref(total * inter);
  for (int e = 0, row = 0; e < experts; row += rows_per_expert[e], ++e) {
    kernels::ref::expert_gate_up(x.data() + row * hidden, rows_per_expert[e], q1[e], q3[e], h_ref.data() + row * inter);
    kernels::ref::expert_down_accumulate(h_ref.data() + row * inter, rows_per_expert[e], q2[e], route.data() + row,
                                         out_rows.data() + row, out_ref.data(), hidden);
  }
  double scale = 0;
  for (float v : out_ref) scale = std::max(scale, double(std::fabs(v)));

  const int threads_before = num_threads();
  for (bool x86 : {false, true}) {
    if (x86 && kernels::kernel_isa(f.format, cpu_features(), true) == Isa::kScalar) continue;
    set_use_x86_kernels(x86);
    for (int threads : {1, 2}) {
      set_num_threads(threads);
      const std::string what = f.name() + (x86 ? " x86" : " scalar") + " threads " + std::to_string(threads);
      std::vector<float> expected = base, h_one(total * inter);
      for (int e = 0, row = 0; e < experts; row += rows_per_expert[e], ++e) {
        if (rows_per_expert[e] == 0) continue;
        kernels::expert_gate_up(x.data() + row * hidden, rows_per_expert[e], p13[e], h_one.data() + row * inter);
        kernels::expert_down_accumulate(h_one.data() + row * inter, rows_per_expert[e], p2[e], route.data() + row,
                                        out_rows.data() + row, expected.data(), hidden);
      }
      std::vector<float> out = base, h(total * inter, -1.0f);
      std::vector<kernels::ExpertRows> args(experts);
      for (int e = 0, row = 0; e < experts; row += rows_per_expert[e], ++e)
        args[e] = {&p13[e], &p2[e], x.data() + row * hidden, rows_per_expert[e], h.data() + row * inter,
                   route.data() + row, out_rows.data() + row};
      kernels::fused_experts(args.data(), experts, out.data(), hidden);
      for (size_t i = 0; i < h.size(); ++i) ASSERT_EQ(h[i], h_one[i]) << what << " h " << i;
      for (size_t i = 0; i < out.size(); ++i) {
        ASSERT_EQ(out[i], expected[i]) << what << " out " << i;
        ASSERT_NEAR(out[i], out_ref[i], 1e-4 * scale) << what << " out " << i << " against the reference";
      }
    }
  }
  set_num_threads(threads_before);
  set_use_x86_kernels(true);
}

// A layer's experts moved into one WeightArena (model/weights.cc does this at load): the same fused pass, bit for
// bit, over buffers that now lie back to back in adoption order inside one 2 MB-aligned allocation.
TEST_P(PackedMatmulTest, ExpertsInAWeightArenaComputeWhatTheirOwnBuffersDid) {
  const FormatCase& f = GetParam();
  const int64_t hidden = 70, inter = 45, experts = 3;
  std::vector<kernels::PackedWeights> p13, p2;
  for (int e = 0; e < experts; ++e) {
    p13.push_back(kernels::pack_gate_up(quantize(f, random_floats(inter * hidden, 100 + e), inter, hidden),
                                        quantize(f, random_floats(inter * hidden, 200 + e), inter, hidden)));
    p2.push_back(kernels::pack(quantize(f, random_floats(hidden * inter, 300 + e), hidden, inter)));
  }
  const std::vector<float> x = random_floats(experts * 2 * hidden, 31), route = random_floats(experts * 2, 32);
  const std::vector<int32_t> out_rows = {0, 1, 1, 2, 0, 2};
  const auto run = [&] {
    std::vector<float> out(3 * hidden, 0.5f), h(experts * 2 * inter);
    std::vector<kernels::ExpertRows> args(experts);
    for (int e = 0; e < experts; ++e)
      args[e] = {&p13[e], &p2[e], x.data() + 2 * e * hidden, 2, h.data() + 2 * e * inter, route.data() + 2 * e,
                 out_rows.data() + 2 * e};
    kernels::fused_experts(args.data(), experts, out.data(), hidden);
    return out;
  };
  const std::vector<float> before = run();
  kernels::WeightArena arena;
  const size_t per_expert = kernels::WeightArena::bytes_for(p13[0]) + kernels::WeightArena::bytes_for(p2[0]);
  arena.reserve(experts * per_expert);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(arena.base()) % (2 << 20), 0u);
  EXPECT_EQ(arena.capacity() % (2 << 20), 0u);
  const uint8_t* expected_at = arena.base();
  for (int e = 0; e < experts; ++e) {
    for (kernels::PackedWeights* w : {&p13[e], &p2[e]}) {
      const std::vector<uint8_t> bytes(w->data.as<uint8_t>(), w->data.as<uint8_t>() + w->data.size);
      ASSERT_TRUE(arena.adopt(*w));
      EXPECT_EQ(w->data.as<const uint8_t>(), expected_at) << "expert " << e << ": adoption order is address order";
      EXPECT_EQ(std::vector<uint8_t>(w->data.as<uint8_t>(), w->data.as<uint8_t>() + w->data.size), bytes);
      expected_at += kernels::WeightArena::bytes_for(*w);
    }
  }
  const std::vector<float> after = run();
  for (size_t i = 0; i < before.size(); ++i) ASSERT_EQ(after[i], before[i]) << f.name() << " out " << i;
  // Full: a matrix that does not fit keeps its own buffers.
  kernels::PackedWeights extra = kernels::pack(quantize(f, random_floats(hidden * inter, 5), hidden, inter));
  int adopted = 0;
  while (adopted < 100000 && arena.adopt(extra)) ++adopted;
  EXPECT_EQ(adopted, static_cast<int>((arena.capacity() - experts * per_expert) / kernels::WeightArena::bytes_for(extra)));
  const uint8_t* own = extra.data.as<const uint8_t>();
  EXPECT_FALSE(arena.adopt(extra));
  EXPECT_EQ(extra.data.as<const uint8_t>(), own);
}

INSTANTIATE_TEST_SUITE_P(Formats, PackedMatmulTest, ::testing::ValuesIn(kFormats),
                         [](const ::testing::TestParamInfo<FormatCase>& info) { return info.param.name(); });

TEST(PackedMatmul, GateUpSiluIsAccurateToAFewUlps) {
  // x = [1], w3 = 1 and w1 = the test points (bf16-exact): the sums are exact, so h = silu(w1) shows the
  // vector exp's error alone.
  const int64_t inter = 64;
  std::vector<float> w1(inter), w3(inter, 1.0f), x = {1.0f};
  for (int64_t i = 0; i < inter; ++i) w1[i] = bf16_to_f32(f32_to_bf16(-40.0f + 80.0f * i / (inter - 1) + 0.013f * i));
  const auto view = [](std::vector<float>& v) { return TensorView{v.data(), DType::kF32, Shape{static_cast<int64_t>(v.size()), 1}}; };
  const kernels::PackedWeights p = kernels::pack_gate_up(kernels::quantize_bf16(view(w1)), kernels::quantize_bf16(view(w3)));
  for (bool x86 : {false, true}) {
    set_use_x86_kernels(x86);
    std::vector<float> h(inter);
    kernels::expert_gate_up(x.data(), 1, p, h.data());
    for (int64_t i = 0; i < inter; ++i) {
      const double g = w1[i], silu = g / (1 + std::exp(-g));
      EXPECT_NEAR(h[i], silu, 4e-7 * std::fabs(silu) + 1e-30) << (x86 ? "x86" : "scalar") << " g " << g;
    }
  }
  set_use_x86_kernels(true);
}

// packed_layout (what a panels.moex must hold) against the layouts packed.h documents, for every format,
// gate/up or not, ragged rows and K; and pack() fills exactly that geometry.
TEST(PackedWeights, LayoutIsTheDocumentedOne) {
  const auto up = [](int64_t n, int64_t m) { return (n + m - 1) / m * m; };
  for (const FormatCase& f : kFormats) {
    for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {63, 130}, {64, 128}, {130, 257}}) {
      const std::vector<float> w = random_floats(rows * cols, 7);
      const QuantizedMatrix q = quantize(f, w, rows, cols);
      for (const bool gate_up : {false, true}) {
        SCOPED_TRACE(f.name() + " [" + std::to_string(rows) + ", " + std::to_string(cols) + "]" + (gate_up ? " gate_up" : ""));
        const kernels::PackedWeights l = kernels::packed_layout(q.format, rows, cols, q.group, gate_up);
        const int64_t P = (rows + (gate_up ? 31 : 63)) / (gate_up ? 32 : 64), G = q.groups();
        int64_t kp = cols, data = 0, scales = P * 64 * 4, offsets = 0, col_sums = 0;
        switch (q.format) {
          case WeightFormat::kBF16: kp = up(cols, 32); data = P * kp * 64 * 2; scales = 0; break;
          case WeightFormat::kInt8: data = P * cols * 64; break;
          case WeightFormat::kInt8W8A8: kp = up(cols, 64); data = P * kp * 64; col_sums = P * 64 * 4; break;
          case WeightFormat::kInt4: kp = up(cols, 2); data = P * kp / 2 * 64; scales = offsets = P * G * 64 * 4; break;
          case WeightFormat::kInt4W4A8: kp = up(cols, 8); data = P * kp / 2 * 64; scales = offsets = P * G * 64 * 4; break;
          case WeightFormat::kFP8E4M3: kp = up(cols, 2); data = P * cols * 64; scales = P * G * 64 * 4; break;
        }
        EXPECT_EQ(l.panels, P);
        EXPECT_EQ(l.k_padded, kp);
        EXPECT_EQ(l.data.size, static_cast<size_t>(data));
        EXPECT_EQ(l.scales.size, static_cast<size_t>(scales));
        EXPECT_EQ(l.offsets.size, static_cast<size_t>(offsets));
        EXPECT_EQ(l.col_sums.size, static_cast<size_t>(col_sums));
        EXPECT_EQ(l.data.ptr, nullptr);
        const kernels::PackedWeights p = gate_up ? kernels::pack_gate_up(q, q) : kernels::pack(q);
        EXPECT_EQ(p.panels, P);
        EXPECT_EQ(p.data.size, l.data.size);
        EXPECT_EQ(p.scales.size, l.scales.size);
      }
    }
  }
}

TEST(PackedMatmul, ZeroTokensWritesNothing) {
  const std::vector<float> w = random_floats(3 * 4, 1);
  const kernels::PackedWeights p = kernels::pack(kernels::quantize_int8(TensorView{const_cast<float*>(w.data()), DType::kF32, Shape{3, 4}}));
  float y = 42.0f;
  kernels::packed_matmul(nullptr, 0, p, &y);
  EXPECT_EQ(y, 42.0f);
}

// The quantizers round half to even (std::nearbyint in the default mode), ties included, and a NaN weight is
// skipped by the row's / group's range. Scales of 1 (absmax 127 for int8, 7 for symmetric int4) make the codes
// the weights themselves; 34 columns take the vector loops and their tails.
TEST(Quantizers, RoundHalfToEvenAsNearbyint) {
  const std::vector<float> ties = {-126.5f, -2.5f, -1.5f, -0.5f, 0.5f, 1.5f, 2.5f, 3.5f, 126.5f, 0.49999997f, -7.5f};
  std::vector<float> row(34, 0.0f);
  std::copy(ties.begin(), ties.end(), row.begin());
  row[20] = 127.0f;
  row[21] = std::nanf("");
  const QuantizedMatrix q8 = kernels::quantize_int8(TensorView{row.data(), DType::kF32, Shape{1, 34}}, WeightFormat::kInt8);
  EXPECT_EQ(q8.scales[0], 1.0f);
  for (int c = 0; c < 34; ++c)
    if (c != 21) EXPECT_EQ(static_cast<int8_t>(q8.codes[c]), static_cast<int8_t>(std::nearbyint(row[c]))) << c;
  std::vector<float> small = {0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 7.0f, 3.5f, -3.5f, 6.5f, 0.0f, 1.0f};
  small.resize(32, 0.25f);
  const QuantizedMatrix q4 =
      kernels::quantize_int4(TensorView{small.data(), DType::kF32, Shape{1, 32}}, 32, true, WeightFormat::kInt4);
  EXPECT_EQ(q4.scales[0], 1.0f);
  for (int c = 0; c < 32; ++c) EXPECT_EQ(q4.codes[c], static_cast<uint8_t>(std::nearbyint(small[c]) + 8)) << c;
}

// quantize_fp8's AVX-512 row (f32_to_f8e4m3_row_avx512) gives f32_to_f8e4m3(x / scale)'s codes: over a 2^24-value
// sample of every exponent (NaNs, infinities, subnormals, the ties) for a few scales, row lengths not a multiple
// of 16. A lane that rounded or saturated otherwise, or a tail that wrote past n, fails here.
TEST(Quantizers, Fp8RowOnAvx512EqualsTheScalarCodes) {
  if (!use_x86_kernels()) GTEST_SKIP() << "no AVX-512 kernels here";
  constexpr int64_t kRow = 4093;
  std::vector<float> x(kRow);
  std::vector<uint8_t> out(kRow + 16);
  uint32_t lcg = 7;
  int64_t bad = 0;
  for (const float scale : {1.0f, 0.37f, 3.0e-3f, 2.5e4f}) {
    for (uint32_t hi = 0; hi < (1u << 24); hi += kRow) {
      for (int64_t i = 0; i < kRow; ++i) {
        lcg = lcg * 1664525u + 1013904223u;
        const uint32_t bits = (hi + static_cast<uint32_t>(i)) << 8 | (lcg >> 24);
        std::memcpy(&x[i], &bits, 4);
      }
      const int64_t n = kRow - (hi & 15);
      std::fill(out.begin(), out.end(), uint8_t{0xa5});
      kernels::x86::f32_to_f8e4m3_row_avx512(x.data(), n, scale, out.data());
      for (int64_t i = 0; i < n; ++i)
        if (out[i] != f32_to_f8e4m3(x[i] / scale) && bad++ < 5)
          ADD_FAILURE() << "x " << x[i] << " scale " << scale << ": " << int(out[i]) << " vs " << int(f32_to_f8e4m3(x[i] / scale));
      for (int64_t i = n; i < kRow + 16; ++i) ASSERT_EQ(out[i], 0xa5) << "wrote past n at " << i;
    }
  }
  EXPECT_EQ(bad, 0);
}

TEST(PackedMatmul, BF16WeightsFromTheCheckpointKeepTheirBits) {
  // quantize_bf16 of a BF16 view copies; the packed kernel then multiplies exactly those numbers.
  const std::vector<uint16_t> w = {0x3f80, 0xc000, 0x3e00, 0x4040};  // [[1, -2], [0.125, 3]]
  const QuantizedMatrix q = kernels::quantize_bf16(TensorView{const_cast<uint16_t*>(w.data()), DType::kBF16, Shape{2, 2}});
  const float x[2] = {0.5f, 4.0f};
  float y[2];
  kernels::packed_matmul(x, 1, kernels::pack(q), y);
  EXPECT_EQ(y[0], 0.5f * 1 - 2.0f * 4);
  EXPECT_EQ(y[1], 0.5f * 0.125f + 3.0f * 4);
}

TEST(PackedMatmul, Fp8FromCheckpointUsesTheBlockScales) {
  // 130 x 3: two row blocks; code 0x38 is 1.0 in e4m3, 0xb8 is -1.0, 0x01 the smallest subnormal 2^-9.
  const int64_t rows = 130, cols = 3;
  std::vector<uint8_t> codes(rows * cols, 0x38);
  codes[129 * cols + 1] = 0xb8;
  codes[2] = 0x01;
  const float scale_inv[2] = {0.5f, 4.0f};  // [ceil(130/128), ceil(3/128)]
  const QuantizedMatrix q = kernels::fp8_from_checkpoint(TensorView{codes.data(), DType::kF8E4M3, Shape{rows, cols}},
                                                         TensorView{const_cast<float*>(scale_inv), DType::kF32, Shape{2, 1}});
  EXPECT_EQ(q.weight(0, 0), 0.5f);
  EXPECT_EQ(q.weight(0, 2), 0.5f * std::ldexp(1.0f, -9));
  EXPECT_EQ(q.weight(129, 1), -4.0f);
  const float x[3] = {1.0f, 2.0f, 3.0f};
  std::vector<float> y(rows);
  kernels::packed_matmul(x, 1, kernels::pack(q), y.data());
  EXPECT_FLOAT_EQ(y[0], 0.5f * (1 + 2) + 3 * 0.5f * std::ldexp(1.0f, -9));
  EXPECT_FLOAT_EQ(y[129], 4.0f * (1 - 2 + 3));
  try {
    kernels::fp8_from_checkpoint(TensorView{codes.data(), DType::kF8E4M3, Shape{rows, cols}},
                                 TensorView{const_cast<float*>(scale_inv), DType::kF32, Shape{1, 1}});
    FAIL() << "a wrong weight_scale_inv shape was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
    EXPECT_NE(std::string(e.what()).find("weight_scale_inv"), std::string::npos) << e.what();
  }
}

TEST(PackedMatmul, W8A8ActivationCodesAreRoundedAndClamped) {
  const float x[4] = {1.0f, -0.5f, 0.25f, 0.0f};
  int8_t q[4];
  const float scale = kernels::quantize_activations_s8(x, 4, q);
  EXPECT_FLOAT_EQ(scale, 1.0f / 127);
  EXPECT_EQ(q[0], 127);
  EXPECT_EQ(q[1], -64);  // -63.5 rounds to even
  EXPECT_EQ(q[2], 32);   // 31.75
  EXPECT_EQ(q[3], 0);
  const float zeros[3] = {0, 0, 0};
  EXPECT_EQ(kernels::quantize_activations_s8(zeros, 3, q), 0.0f);
}

// ---- dispatch and CPU detection ----

CpuFeatures avx2_only() {  // Zen 1-3, Haswell .. Alder Lake
  CpuFeatures f;
  f.avx2 = f.fma = f.f16c = f.os_avx = true;
  return f;
}

CpuFeatures full_avx512() {
  CpuFeatures f = avx2_only();
  f.avx512f = f.avx512bw = f.avx512vl = f.avx512dq = true;
  f.os_avx512 = true;
  return f;
}

TEST(KernelIsa, NeverPicksAnIsaTheCpuOrOsLacks) {
  const WeightFormat all[] = {WeightFormat::kBF16, WeightFormat::kInt8, WeightFormat::kInt8W8A8, WeightFormat::kInt4,
                              WeightFormat::kInt4W4A8, WeightFormat::kFP8E4M3};
  // AVX2 + FMA + F16C: every format on its AVX2 kernel (W8A8 / W4A8 on vpmaddubsw).
  const CpuFeatures zen3 = avx2_only();
  CpuFeatures no_f16c = zen3, no_ymm_state = zen3;
  no_f16c.f16c = false;
  no_ymm_state.os_avx = false;
  for (WeightFormat f : all) {
    const std::string name(kernels::weight_format_name(f));
    EXPECT_EQ(kernels::kernel_isa(f, zen3, true), Isa::kAvx2) << name;
    EXPECT_EQ(kernels::usable_isas(f, zen3), (std::vector<Isa>{Isa::kScalar, Isa::kAvx2})) << name;
    EXPECT_EQ(kernels::kernel_isa(f, no_f16c, true), Isa::kScalar) << name;
    EXPECT_EQ(kernels::kernel_isa(f, no_ymm_state, true), Isa::kScalar) << name;
    EXPECT_EQ(kernels::kernel_isa(f, zen3, false), Isa::kScalar) << "MOEX_ISA=ref";
  }
  CpuFeatures plain = full_avx512();  // AVX-512 without BF16 / VNNI (Skylake-X): bf16 on the AVX2 kernel
  EXPECT_EQ(kernels::kernel_isa(WeightFormat::kBF16, plain, true), Isa::kAvx2);
  EXPECT_EQ(kernels::kernel_isa(WeightFormat::kInt8W8A8, plain, true), Isa::kAvx2);  // no vpdpbusd: vpmaddubsw
  EXPECT_EQ(kernels::kernel_isa(WeightFormat::kInt4W4A8, plain, true), Isa::kAvx2);
  EXPECT_EQ(kernels::kernel_isa(WeightFormat::kInt4, plain, true), Isa::kAvx512);
  EXPECT_EQ(kernels::usable_isas(WeightFormat::kBF16, plain), (std::vector<Isa>{Isa::kScalar, Isa::kAvx2}));
  CpuFeatures zen4 = plain;
  zen4.avx512_bf16 = zen4.avx512_vnni = true;
  EXPECT_EQ(kernels::kernel_isa(WeightFormat::kBF16, zen4, true), Isa::kAvx512Bf16);
  EXPECT_EQ(kernels::usable_isas(WeightFormat::kBF16, zen4), (std::vector<Isa>{Isa::kScalar, Isa::kAvx2, Isa::kAvx512Bf16}));
  EXPECT_EQ(kernels::kernel_isa(WeightFormat::kInt8W8A8, zen4, true), Isa::kAvx512Vnni);
  EXPECT_EQ(kernels::kernel_isa(WeightFormat::kInt4W4A8, zen4, true), Isa::kAvx512Vnni);
  EXPECT_EQ(kernels::usable_isas(WeightFormat::kInt4W4A8, zen4), (std::vector<Isa>{Isa::kScalar, Isa::kAvx2, Isa::kAvx512Vnni}));
  EXPECT_EQ(kernels::usable_isas(WeightFormat::kInt8W8A8, zen4), (std::vector<Isa>{Isa::kScalar, Isa::kAvx2, Isa::kAvx512Vnni}));
  // fp8's table decode and int4's nibble placing need VBMI beside BF16 (Cooper Lake has BF16 without it): the f32
  // AVX-512 path then.
  CpuFeatures zen4_vbmi = zen4;
  zen4_vbmi.avx512_vbmi = true;
  for (WeightFormat f : {WeightFormat::kFP8E4M3, WeightFormat::kInt4}) {
    const std::string name(kernels::weight_format_name(f));
    EXPECT_EQ(kernels::kernel_isa(f, plain, true), Isa::kAvx512) << name;
    EXPECT_EQ(kernels::kernel_isa(f, zen4, true), Isa::kAvx512) << name;
    EXPECT_EQ(kernels::usable_isas(f, zen4), (std::vector<Isa>{Isa::kScalar, Isa::kAvx2, Isa::kAvx512})) << name;
    EXPECT_EQ(kernels::kernel_isa(f, zen4_vbmi, true), Isa::kAvx512Bf16) << name;
    EXPECT_EQ(kernels::usable_isas(f, zen4_vbmi),
              (std::vector<Isa>{Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16})) << name;
  }
  // int8 on VNNI without AMX: s16 activation codes and vpdpwssd; the f32-FMA loop beside it.
  EXPECT_EQ(kernels::kernel_isa(WeightFormat::kInt8, zen4_vbmi, true), Isa::kAvx512Vnni);
  EXPECT_EQ(kernels::kernel_isa(WeightFormat::kInt8, plain, true), Isa::kAvx512);
  EXPECT_FALSE(kernels::row_result_depends_on_row_count(WeightFormat::kInt8, Isa::kAvx512Vnni));
  CpuFeatures os_off = zen4;  // the CPU has it, the OS does not save ZMM state: the AVX2 kernels (YMM state) only
  os_off.os_avx512 = false;
  CpuFeatures amx = zen4;  // AMX: tiles for bf16, W8A8 and W4A8 (their few-row loops on AVX-512), the rest as on zen4
  amx.amx_tile = amx.amx_bf16 = amx.amx_int8 = amx.os_amx = true;
  for (WeightFormat f : all) {
    const std::string name(kernels::weight_format_name(f));
    EXPECT_EQ(kernels::kernel_isa(f, os_off, true), Isa::kAvx2) << name;
    EXPECT_EQ(kernels::kernel_isa(f, zen4, false), Isa::kScalar) << "MOEX_ISA=ref";
    EXPECT_EQ(kernels::kernel_isa(f, CpuFeatures{}, true), Isa::kScalar);
    const bool tiles = f == WeightFormat::kBF16 || f == WeightFormat::kInt8W8A8 || f == WeightFormat::kInt4W4A8;
    // int8 on AMX CPUs: the f32-FMA few-row loop (its many rows on tiles), not zen4's s16 codes.
    EXPECT_EQ(kernels::kernel_isa(f, amx, true), tiles                       ? Isa::kAmx
                                                 : f == WeightFormat::kInt8 ? Isa::kAvx512
                                                                            : kernels::kernel_isa(f, zen4, true))
        << name;
    EXPECT_EQ(kernels::usable_isas(f, os_off), (std::vector<Isa>{Isa::kScalar, Isa::kAvx2})) << name;
  }
  EXPECT_FALSE(os_off.has_avx512_kernels());
  EXPECT_FALSE(zen4.has_amx_kernels());
  CpuFeatures amx_os_off = amx;
  amx_os_off.os_amx = false;
  EXPECT_FALSE(amx_os_off.has_amx_kernels());
  EXPECT_TRUE(amx.has_amx_kernels());
  EXPECT_EQ(kernels::usable_isas(WeightFormat::kBF16, amx),
            (std::vector<Isa>{Isa::kScalar, Isa::kAvx2, Isa::kAvx512Bf16, Isa::kAmx}));
  EXPECT_EQ(kernels::usable_isas(WeightFormat::kInt8W8A8, amx),
            (std::vector<Isa>{Isa::kScalar, Isa::kAvx2, Isa::kAvx512Vnni, Isa::kAmx}));
  EXPECT_EQ(kernels::usable_isas(WeightFormat::kInt4W4A8, amx),
            (std::vector<Isa>{Isa::kScalar, Isa::kAvx2, Isa::kAvx512Vnni, Isa::kAmx}));
  EXPECT_EQ(kernels::usable_isas(WeightFormat::kBF16, amx_os_off), (std::vector<Isa>{Isa::kScalar, Isa::kAvx2, Isa::kAvx512Bf16}));
  // fp8 and int4 keep their vdpbf16ps loops (VBMI) and add tiles for their many-row loops; without VBMI no tiles
  // either.
  CpuFeatures amx_vbmi = amx;
  amx_vbmi.avx512_vbmi = true;
  for (WeightFormat f : {WeightFormat::kFP8E4M3, WeightFormat::kInt4}) {
    EXPECT_EQ(kernels::usable_isas(f, amx_vbmi),
              (std::vector<Isa>{Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16, Isa::kAmx}));
    EXPECT_EQ(kernels::usable_isas(f, amx), (std::vector<Isa>{Isa::kScalar, Isa::kAvx2, Isa::kAvx512}));
  }
  // int8 (weight-only) adds tiles beside its f32-FMA loop.
  EXPECT_EQ(kernels::usable_isas(WeightFormat::kInt8, amx),
            (std::vector<Isa>{Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAmx}));
  EXPECT_EQ(kernels::usable_isas(WeightFormat::kInt8, zen4),
            (std::vector<Isa>{Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Vnni}));
  EXPECT_TRUE(kernels::row_result_depends_on_row_count(WeightFormat::kInt8, Isa::kAmx));
  EXPECT_TRUE(kernels::row_result_depends_on_row_count(WeightFormat::kFP8E4M3, Isa::kAmx));
  EXPECT_TRUE(kernels::row_result_depends_on_row_count(WeightFormat::kInt4, Isa::kAmx));
  // On kAmx bf16 runs tiles for every call; W8A8 below kAmxManyRowsFrom rows runs its VNNI few-row loop.
  EXPECT_EQ(kernels::isa_for_rows(WeightFormat::kBF16, Isa::kAmx, 1), Isa::kAmx);
  EXPECT_EQ(kernels::isa_for_rows(WeightFormat::kBF16, Isa::kAmx, 512, true), Isa::kAmx);
  EXPECT_EQ(kernels::isa_for_rows(WeightFormat::kInt8W8A8, Isa::kAmx, kernels::many_rows_from(WeightFormat::kInt8W8A8, Isa::kAmx) - 1), Isa::kAvx512Vnni);
  EXPECT_EQ(kernels::isa_for_rows(WeightFormat::kInt8W8A8, Isa::kAmx, kernels::many_rows_from(WeightFormat::kInt8W8A8, Isa::kAmx)), Isa::kAmx);
  EXPECT_EQ(kernels::isa_for_rows(WeightFormat::kInt8W8A8, Isa::kAmx, 512, true), Isa::kAmx);  // exact: no pin
  EXPECT_EQ(kernels::isa_for_rows(WeightFormat::kInt4W4A8, Isa::kAmx, kernels::many_rows_from(WeightFormat::kInt4W4A8, Isa::kAmx) - 1), Isa::kAvx512Vnni);
  EXPECT_EQ(kernels::isa_for_rows(WeightFormat::kInt4W4A8, Isa::kAmx, kernels::many_rows_from(WeightFormat::kInt4W4A8, Isa::kAmx)), Isa::kAmx);
  EXPECT_EQ(kernels::isa_for_rows(WeightFormat::kInt4W4A8, Isa::kAmx, 512, true), Isa::kAmx);  // the same bits: no pin
  EXPECT_FALSE(kernels::row_result_depends_on_row_count(WeightFormat::kInt4W4A8, Isa::kAmx));
  EXPECT_FALSE(kernels::row_result_depends_on_row_count(WeightFormat::kBF16, Isa::kAmx));
  EXPECT_FALSE(kernels::row_result_depends_on_row_count(WeightFormat::kInt8W8A8, Isa::kAmx));
}

// int4's and fp8's many-row calls leave vdpbf16ps on AMX CPUs (half vfmadd's rate there): for tiles where this
// process may use them, else (MOEX_ISA=avx512, a Linux that refuses the tile state) for the f32-FMA kernels; their
// few-row calls, and every call under the --batch-invariant pin, stay on vdpbf16ps. Elsewhere the row count never
// changes their ISA.
TEST(KernelIsa, WeightOnlyManyRowsMoveOffVdpbf16psOnAmxCpus) {
  for (WeightFormat f : {WeightFormat::kInt4, WeightFormat::kFP8E4M3, WeightFormat::kInt8}) {
    const Isa isa = kernels::kernel_isa(f);
    // int8's few-row loop is the f32-FMA one (kAvx512): only tiles move it.
    const bool moves = f == WeightFormat::kInt8 ? isa == Isa::kAvx512 && cpu_features().has_amx_kernels() && use_amx_kernels()
                                                : isa == Isa::kAvx512Bf16 && cpu_features().has_amx_kernels();
    const bool tiles = moves && use_amx_kernels();
    const Isa to = tiles ? Isa::kAmx : Isa::kAvx512;
    const int64_t many = kernels::many_rows_from(f, tiles ? Isa::kAmx : moves ? Isa::kAvx512 : isa);
    EXPECT_EQ(kernels::isa_for_rows(f, isa, many), moves ? to : isa);
    EXPECT_EQ(kernels::isa_for_rows(f, isa, many - 1), isa);
    EXPECT_EQ(kernels::isa_for_rows(f, isa, 512, true), isa);  // the pin keeps the few-row loop and its ISA
    if (moves) EXPECT_TRUE(kernels::row_result_depends_on_row_count(f, isa));
    // Without AMX int4's and fp8's two vdpbf16ps loops give a row the same bits (Int4Vdpbf16psLoopsGiveARowTheSameBits,
    // fp8's table loops alike): no --batch-invariant pin there.
    if (isa == Isa::kAvx512Bf16 && !cpu_features().has_amx_kernels())
      EXPECT_FALSE(kernels::row_result_depends_on_row_count(f, isa)) << kernels::weight_format_name(f);
  }
}

TEST(CpuFeatures, DetectionAgreesWithProcCpuinfo) {
  std::ifstream in("/proc/cpuinfo");
  if (!in) GTEST_SKIP() << "no /proc/cpuinfo";
  std::string line;
  std::set<std::string> flags;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    for (std::string w; words >> w;) flags.insert(w);
    break;
  }
  const CpuFeatures& f = cpu_features();
  // Linux lists a flag only when the OS supports its state, which is what detection checks too.
  EXPECT_EQ(f.avx2 && f.os_avx, flags.count("avx2") == 1);
  EXPECT_EQ(f.f16c && f.os_avx, flags.count("f16c") == 1);
  EXPECT_EQ(f.avx512f && f.os_avx512, flags.count("avx512f") == 1);
  EXPECT_EQ(f.avx512_bf16 && f.os_avx512, flags.count("avx512_bf16") == 1);
  EXPECT_EQ(f.avx512_vnni && f.os_avx512, flags.count("avx512_vnni") == 1);
  EXPECT_EQ(f.avx512_vbmi && f.os_avx512, flags.count("avx512vbmi") == 1);
  EXPECT_EQ(f.amx_int8 && f.os_amx, flags.count("amx_int8") == 1);
  EXPECT_EQ(f.amx_tile && f.os_amx, flags.count("amx_tile") == 1);
  EXPECT_EQ(request_amx_permission(), f.has_amx_kernels());  // Linux >= 5.16 grants it when the CPU has AMX
}

TEST(Probe, DotProductPeaksCountTheirInstructions) {
  const int64_t iterations = 1000;
  const kernels::PeakResult bf16 = kernels::dot_peak_bf16(iterations), vnni = kernels::dot_peak_vnni(iterations);
  if (use_x86_kernels() && cpu_features().has_avx512_bf16_kernels()) {
    // a = b = 1.0: each instruction adds 1*1 + 1*1 to each of 16 lanes.
    EXPECT_EQ(bf16.checksum, 2.0 * 16 * static_cast<double>(bf16.instructions));
    EXPECT_EQ(bf16.instructions, iterations * kernels::x86::kPeakChains * bf16.threads);
    EXPECT_GT(bf16.per_second, 0);
  } else {
    EXPECT_EQ(bf16.per_second, 0);
  }
  const kernels::PeakResult fma = kernels::fma_peak_f32(iterations);
  if (use_x86_kernels()) {
    EXPECT_EQ(fma.checksum, 1.0 * 16 * static_cast<double>(fma.instructions));  // 1 * 1 per lane
    EXPECT_GT(fma.per_second, 0);
  } else if (use_avx2_kernels()) {
    EXPECT_EQ(fma.checksum, 1.0 * 8 * static_cast<double>(fma.instructions));  // 8 lanes
    EXPECT_GT(fma.per_second, 0);
  } else {
    EXPECT_EQ(fma.per_second, 0);
  }
  if (use_x86_kernels() && cpu_features().has_avx512_vnni_kernels()) {
    EXPECT_EQ(vnni.checksum, 4.0 * 16 * static_cast<double>(vnni.instructions));  // 4 products of 1*1 per lane
    EXPECT_GT(vnni.per_second, 0);
  } else {
    EXPECT_EQ(vnni.per_second, 0);
  }
  const kernels::PeakResult maddubs = kernels::dot_peak_maddubs(iterations);
  if (use_avx2_kernels()) {
    EXPECT_EQ(maddubs.checksum, 32.0 * static_cast<double>(maddubs.instructions));  // 16 pairs of 1*1 + 1*1
    EXPECT_EQ(maddubs.instructions, iterations * kernels::x86::kPeakChains * maddubs.threads);
    EXPECT_GT(maddubs.per_second, 0);
  } else {
    EXPECT_EQ(maddubs.per_second, 0);
  }
  // AMX: A has a 1 in the first element of each row, B all ones, so each C element (256 per tile) gains exactly 1.
  const kernels::PeakResult amx_bf16 = kernels::dot_peak_amx_bf16(iterations / 10),
                            amx_int8 = kernels::dot_peak_amx_int8(iterations / 10);
  if (use_amx_kernels()) {
    for (const kernels::PeakResult& r : {amx_bf16, amx_int8}) {
      EXPECT_EQ(r.instructions, iterations / 10 * kernels::x86::kPeakChains * r.threads);
      EXPECT_EQ(r.checksum, 256.0 * static_cast<double>(r.instructions));
      EXPECT_GT(r.per_second, 0);
    }
  } else {
    EXPECT_EQ(amx_bf16.per_second, 0);
    EXPECT_EQ(amx_int8.per_second, 0);
  }
}

// huge_page_bytes counts only the range asked about: a region kept on 4 KB pages has none, however many huge pages
// the rest of the process holds (a huge-page region beside it, touched first).
TEST(Probe, HugePageBytesOfARange) {
  constexpr size_t kHuge = size_t{2} << 20, kBytes = 8 * kHuge;
  void* map = ::mmap(nullptr, 2 * kBytes + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(map, MAP_FAILED);
  auto* huge = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(map) + kHuge - 1) & ~(kHuge - 1));
  uint8_t* small = huge + kBytes;
  ::madvise(huge, kBytes, MADV_HUGEPAGE);
  ::madvise(small, kBytes, MADV_NOHUGEPAGE);  // splits the mapping: smaps lists the two halves apart
  std::fill_n(huge, kBytes, uint8_t{1});
  std::fill_n(small, kBytes, uint8_t{1});
  EXPECT_EQ(kernels::huge_page_bytes(small, kBytes), 0u);
  const size_t h = kernels::huge_page_bytes(huge, kBytes);
  EXPECT_LE(h, kBytes);
  std::printf("huge pages: %zu of %zu bytes of the advised region\n", h, kBytes);
  ::munmap(map, 2 * kBytes + kHuge);
}

// The read probe's methods both ran and the best is the probe; the clock is a plausible x86 clock; CPUID's family
// and model are /proc/cpuinfo's (an independent reader of the same registers, through the kernel).
TEST(Probe, ReadProbeClockAndCpuClass) {
  const kernels::ReadProbe r = kernels::read_probe(size_t{64} << 20, 1, false);
  EXPECT_GT(r.plain_bytes_per_s, 0);
  EXPECT_GT(r.prefetch_bytes_per_s, 0);
  EXPECT_EQ(r.bytes_per_s, std::max(r.plain_bytes_per_s, r.prefetch_bytes_per_s));
  EXPECT_EQ(r.bytes, size_t{64} << 20);
  EXPECT_LE(r.huge_page_bytes, r.bytes);
  const double hz = kernels::core_clock_hz(int64_t{1} << 22);
  EXPECT_GT(hz, 0.3e9);  // a dependent add per cycle: any x86 core of the last 20 years, however loaded
  EXPECT_LT(hz, 8e9);    // more would mean the adds were not dependent
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  int family = -1, model = -1;
  while (std::getline(cpuinfo, line) && (family < 0 || model < 0)) {
    if (line.rfind("cpu family", 0) == 0) family = std::stoi(line.substr(line.find(':') + 1));
    else if (line.rfind("model\t", 0) == 0) model = std::stoi(line.substr(line.find(':') + 1));
  }
  if (family < 0) GTEST_SKIP() << "no /proc/cpuinfo family";
  const kernels::CpuId id = kernels::cpu_id();
  EXPECT_EQ(id.family, family);
  EXPECT_EQ(id.model, model);
}

}  // namespace
}  // namespace moex

// ---- the microbenchmark ----

namespace moex {
namespace {

TEST(BenchKernels, OneRowPerFormatKernelAndTokenCountWithConsistentRates) {
  kernels::KernelBenchOptions o;
  o.hidden = 64;
  o.intermediate = 96;
  o.tokens = {1, 3};
  o.formats = {"bf16", "int8", "int8-w8a8", "int4-g32", "int4-g64-asym", "fp8-e4m3"};
  o.repeats = 1;
  o.sample_ms = 0;
  o.roofline_mb = 4;
  o.cycle_mb = 1;
  const kernels::KernelBenchReport r = kernels::bench_kernels(o);
  ASSERT_EQ(r.rows.size(), o.formats.size() * o.kernels.size() * o.tokens.size());
  EXPECT_GT(r.read_bytes_per_s, 0);
  for (const auto& row : r.rows) {
    const std::string what = row.kernel + " " + row.format;
    const double matrices = row.kernel == "gate_up" ? 2 : 1;
    EXPECT_EQ(row.flops, 2.0 * row.tokens * row.rows * row.cols * matrices) << what;
    EXPECT_EQ(row.rows, row.kernel == "down" ? 64 : 96) << what;
    EXPECT_GT(row.seconds, 0) << what;
    EXPECT_NEAR(row.gflops, row.flops / row.seconds / 1e9, 1e-9 * row.gflops) << what;
    // Every row has its own read probe (the replay of its calls' bytes) beside the run's DRAM probe.
    EXPECT_GT(row.read_bytes_per_s, 0) << what;
    EXPECT_NEAR(row.pct_read_roofline, 100 * row.weight_bytes / row.seconds / row.read_bytes_per_s, 1e-9 * row.pct_read_roofline);
    EXPECT_NEAR(row.pct_dram, 100 * row.weight_bytes / row.seconds / r.read_bytes_per_s, 1e-9 * row.pct_dram);
    const bool int8_activations = row.format.find("w8a8") != std::string::npos || row.format.find("w4a8") != std::string::npos;
    const double peak = row.isa == "amx"                          ? (int8_activations ? r.amx_int8_peak : r.amx_bf16_peak).per_second
                        : row.isa == "avx512bf16"                 ? r.bf16_peak.per_second
                        : row.isa == "avx512vnni" && row.format == "int8" ? r.vnni_peak.per_second / 2  // vpdpwssd
                        : row.isa == "avx512vnni"                 ? r.vnni_peak.per_second
                        : row.isa == "avx2" && int8_activations   ? r.maddubs_peak.per_second
                        : row.isa == "avx512" || row.isa == "avx2" ? r.fma_peak.per_second
                                                                   : 0;
    const double roofline = std::max(row.weight_bytes / row.read_bytes_per_s, peak > 0 ? row.flops / peak : 0.0);
    EXPECT_NEAR(row.pct_roofline, 100 * roofline / row.seconds, 1e-9 * row.pct_roofline) << what;
    // Weight bytes at least the codes' (bf16 2, int8 1, int4 0.5 byte per weight).
    const double per_weight = row.format == "bf16" ? 2 : row.format.rfind("int4", 0) == 0 ? 0.5 : 1;
    EXPECT_GE(row.weight_bytes, per_weight * row.rows * row.cols * matrices) << what;
    // The ISA the call ran: kernel_isa's, or on AMX below kAmxManyRowsFrom rows its AVX-512 few-row loop.
    const WeightFormat format = kernels::parse_format_spec(row.format).format;
    EXPECT_EQ(row.isa, std::string(kernels::isa_name(kernels::isa_for_rows(format, kernels::kernel_isa(format), row.tokens))));
  }
  try {
    kernels::parse_format_spec("int3");
    FAIL() << "int3 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
    EXPECT_NE(std::string(e.what()).find("int4-g32"), std::string::npos) << "the message lists the formats: " << e.what();
  }
}

// The as-stored dense rows: one per token count whatever the formats, bf16 bytes of w1's shape, the FMA roof.
TEST(BenchKernels, DenseRowsTimeTheAsStoredMatmul) {
  kernels::KernelBenchOptions o;
  o.hidden = 64;
  o.intermediate = 96;
  o.tokens = {1, 5};
  o.formats = {"bf16", "int8"};
  o.kernels = {"dense"};
  o.repeats = 1;
  o.sample_ms = 0;
  o.roofline_mb = 4;
  o.cycle_mb = 1;
  const kernels::KernelBenchReport r = kernels::bench_kernels(o);
  ASSERT_EQ(r.rows.size(), 2u);
  for (const auto& row : r.rows) {
    EXPECT_EQ(row.kernel, "dense");
    EXPECT_EQ(row.format, "bf16-as-stored");
    EXPECT_EQ(row.isa, use_x86_kernels() ? "avx512" : use_avx2_kernels() ? "avx2" : "none");
    EXPECT_EQ(row.weight_bytes, 2.0 * 96 * 64);
    EXPECT_EQ(row.flops, 2.0 * row.tokens * 96 * 64);
    EXPECT_GT(row.seconds, 0);
    if (row.isa != "none") {
      EXPECT_NEAR(row.pct_compute_peak, 100 * row.flops / row.seconds / r.fma_peak.per_second, 1e-9 * row.pct_compute_peak);
    }
  }
  o.kernels = {"dense", "gemv"};
  EXPECT_THROW(kernels::bench_kernels(o), Error);
}

// The attention rows: one per token count and kernel whatever the formats; the prefill row's bytes are one
// prompt's K/V and its FLOPs the causal pairs, the decode row's 16 sequences' K/V and one query each.
TEST(BenchKernels, AttentionRowsCountThePromptOrTheDecodeBatch) {
  kernels::KernelBenchOptions o;
  o.tokens = {3, 20};
  o.formats = {"bf16", "int8"};
  o.kernels = {"attention", "attention_decode_portable"};
  o.repeats = 1;
  o.sample_ms = 0;
  o.roofline_mb = 4;
  const kernels::KernelBenchReport r = kernels::bench_kernels(o);
  ASSERT_EQ(r.rows.size(), 4u);
  const double kv_per_position = 2.0 * 4 * 64 * 2;  // K and V, 4 KV heads x head dim 64, bf16
  for (int i = 0; i < 2; ++i) {
    const auto& prefill = r.rows[i];
    const auto& decode = r.rows[2 + i];
    const double T = static_cast<double>(o.tokens[i]);
    EXPECT_EQ(prefill.kernel, "attention");
    EXPECT_EQ(prefill.isa, use_x86_kernels() ? "avx512" : use_avx2_kernels() ? "avx2" : "none");
    EXPECT_EQ(prefill.weight_bytes, T * kv_per_position);
    EXPECT_EQ(prefill.flops, 4.0 * 64 * 16 * T * (T + 1) / 2);
    EXPECT_EQ(decode.kernel, "attention_decode_portable");
    EXPECT_EQ(decode.isa, "none");
    EXPECT_EQ(decode.weight_bytes, 16 * T * kv_per_position);
    EXPECT_EQ(decode.flops, 4.0 * 64 * 16 * 16 * T);
    EXPECT_GT(prefill.seconds, 0);
    EXPECT_GT(decode.seconds, 0);
  }
}

#ifdef MOEX_BINARY
// The MoE-layer rows: the fused pass and the expert-by-expert calls on the same 8 experts, bytes of the
// experts that got a token (T = 1: two; T = 3: six), FLOPs of 2 choices per token.
TEST(BenchKernels, MoeRowsCountTheExpertsTheTokensReach) {
  kernels::KernelBenchOptions o;
  o.hidden = 64;
  o.intermediate = 96;
  o.tokens = {1, 3};
  o.formats = {"bf16"};
  o.kernels = {"moe", "moe_unfused"};
  o.repeats = 1;
  o.sample_ms = 0;
  o.roofline_mb = 4;
  const kernels::KernelBenchReport r = kernels::bench_kernels(o);
  ASSERT_EQ(r.rows.size(), 4u);
  EXPECT_EQ(r.rows[0].kernel, "moe");
  EXPECT_EQ(r.rows[2].kernel, "moe_unfused");
  for (const auto& row : r.rows) {
    EXPECT_EQ(row.flops, 2.0 * 2 * row.tokens * 3 * 64 * 96) << row.kernel;
    EXPECT_GT(row.seconds, 0) << row.kernel;
  }
  EXPECT_DOUBLE_EQ(r.rows[1].weight_bytes, 3 * r.rows[0].weight_bytes);
  EXPECT_DOUBLE_EQ(r.rows[2].weight_bytes, r.rows[0].weight_bytes);
}

TEST(BenchKernels, CommandPrintsJsonAndRejectsAnUnknownFormat) {
  const std::string moex = MOEX_BINARY;
  const std::string base = moex + " bench kernels --hidden 64 --intermediate 32 --tokens 2 --repeats 1 --roofline-mb 4";
  FILE* pipe = popen((base + " --formats int8,bf16 --kernels down --json").c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, pipe)) out.append(buf, n);
  ASSERT_EQ(pclose(pipe), 0) << out;
  for (const char* key : {"\"read_gb_per_s\"", "\"bf16_peak_gflops\"", "\"format\":\"int8\"", "\"format\":\"bf16\"", "\"kernel\":\"down\"", "\"pct_roofline\""})
    EXPECT_NE(out.find(key), std::string::npos) << key << " in " << out;
  const int status = std::system((base + " --formats int3 >/dev/null 2>&1").c_str());
  EXPECT_EQ(WIFEXITED(status) ? WEXITSTATUS(status) : -1, 2);
}
#endif

}  // namespace
}  // namespace moex
