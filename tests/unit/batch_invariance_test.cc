// Batch invariance (`--batch-invariant`, ModelOptions::batch_invariant): a sequence's numbers must not depend
// on what else is in its step. What made them depend on it: the packed weight-only kernels (int8, fp8, int4)
// switch register-tile loops at kernels::kManyRowsFrom rows per call, and the two loops sum K in different
// blocks, so a row's result changes in its last bits with the number of rows its expert got in that step.
// The tests compare bit for bit (memcmp), and show that without the flag the same comparison fails where the
// kernels switch (so the comparison can fail).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "moex/base/error.h"
#include "moex/base/threads.h"
#include "moex/kernels/packed.h"
#include "moex/model/decoder.h"
#include "moex/runtime/generation.h"
#include "moex/runtime/sampler.h"
#include "test_util.h"

namespace moex {
namespace {

using test::random_floats;

using kernels::RowKernel;
using kernels::WeightFormat;

TEST(BatchInvariance, OneFunctionPinsTheRowKernel) {
  using kernels::Isa;
  // Each format on its AVX-512 kernels without AMX: bf16 and W8A8 sum alike on both loops
  // (PackedMatmulTest.ManyRowGemmGivesTheFewRowLoopsBits), W4A8 has one loop, int4's and fp8's vdpbf16ps loops
  // and int8's s16-code loops agree: no pin; the f32-FMA loops (kAvx512) differ, so the pin holds there.
  struct Case {
    WeightFormat format;
    Isa isa;
    int64_t from;  // the crossover, or 0: one loop
    bool pinned;
  };
  for (const Case& c : {Case{WeightFormat::kBF16, Isa::kAvx512Bf16, 12, false},
                        Case{WeightFormat::kInt8W8A8, Isa::kAvx512Vnni, 12, false},
                        Case{WeightFormat::kInt4W4A8, Isa::kAvx512Vnni, 0, false},
                        Case{WeightFormat::kInt8, Isa::kAvx512Vnni, 32, false},
                        Case{WeightFormat::kInt8, Isa::kAvx512, 16, true},
                        Case{WeightFormat::kInt4, Isa::kAvx512, 16, true},
                        Case{WeightFormat::kFP8E4M3, Isa::kAvx512, 16, true}}) {
    if (c.isa == Isa::kAvx512 && use_amx_kernels()) continue;  // there the many rows move to tiles (below)
    const std::string what = std::string(kernels::weight_format_name(c.format)) + " on " + std::string(kernels::isa_name(c.isa));
    EXPECT_EQ(kernels::row_result_depends_on_row_count(c.format, c.isa), c.pinned) << what;
    for (int64_t rows : {1, 2, 11, 12, 15, 16, 17, 31, 32, 64, 512}) {
      const RowKernel by_rows = c.from && rows >= c.from ? RowKernel::kManyRows : RowKernel::kFewRows;
      EXPECT_EQ(kernels::row_kernel_for(c.format, c.isa, rows, false), by_rows) << what << " " << rows;
      EXPECT_EQ(kernels::row_kernel_for(c.format, c.isa, rows, true), c.pinned ? kernels::kBatchInvariantRowKernel : by_rows)
          << what << " " << rows;
    }
  }
  // On AMX CPUs bf16 runs tiles for every row count (one loop: tdpbf16ps's order is not vdpbf16ps's, so the
  // AVX-512 few-row loop is not used there); W8A8 from 4 rows, W4A8 from 6, exact either way (integer sums folded
  // alike). No pin for any.
  for (int64_t rows : {1, 3, 4, 5, 6, 16, 512}) {
    for (bool pin : {false, true}) {
      EXPECT_EQ(kernels::row_kernel_for(WeightFormat::kBF16, Isa::kAmx, rows, pin), RowKernel::kManyRows) << rows;
      EXPECT_EQ(kernels::row_kernel_for(WeightFormat::kInt8W8A8, Isa::kAmx, rows, pin),
                rows >= 4 ? RowKernel::kManyRows : RowKernel::kFewRows) << rows;
      EXPECT_EQ(kernels::row_kernel_for(WeightFormat::kInt4W4A8, Isa::kAmx, rows, pin),
                rows >= 6 ? RowKernel::kManyRows : RowKernel::kFewRows) << rows;
    }
  }
  // fp8's, int4's and int8's tiles (isa kAmx on AMX CPUs) from their own row counts (int4 3, fp8 and int8 5); two
  // summation orders (int8: f32 activations against their bf16 split), so the pin holds.
  for (WeightFormat format : {WeightFormat::kFP8E4M3, WeightFormat::kInt4, WeightFormat::kInt8})
    for (int64_t rows : {1, 2, 3, 4, 5, 7, 8, 15, 16, 512}) {
      const int64_t from = format == WeightFormat::kInt4 ? 3 : 5;
      EXPECT_EQ(kernels::many_rows_from(format, Isa::kAmx), from);
      const RowKernel by_rows = rows >= from ? RowKernel::kManyRows : RowKernel::kFewRows;
      EXPECT_EQ(kernels::row_kernel_for(format, Isa::kAmx, rows, false), by_rows) << rows;
      EXPECT_EQ(kernels::row_kernel_for(format, Isa::kAmx, rows, true), kernels::kBatchInvariantRowKernel) << rows;
    }
}

kernels::QuantizedMatrix quantize(WeightFormat f, std::vector<float>& w, int64_t n, int64_t k) {
  const TensorView view{w.data(), DType::kF32, Shape{n, k}};
  switch (f) {
    case WeightFormat::kBF16: return kernels::quantize_bf16(view);
    case WeightFormat::kInt8:
    case WeightFormat::kInt8W8A8: return kernels::quantize_int8(view, f);
    case WeightFormat::kInt4:
    case WeightFormat::kInt4W4A8: return kernels::quantize_int4(view, 128, true, f);
    case WeightFormat::kFP8E4M3: return kernels::quantize_fp8(view);
  }
  return {};
}

// Row 0's result of packed_matmul alone and as the first of 24 rows (K = 2560: more than one K block of
// every many-row loop), bit for bit. Returns whether they are equal.
bool first_row_equal_alone_and_in_24(WeightFormat f, bool batch_invariant) {
  const int64_t n = 128, k = 2560, rows = 24;
  std::vector<float> w = random_floats(n * k, 5);
  const kernels::PackedWeights p = kernels::pack(quantize(f, w, n, k));
  const std::vector<float> x = random_floats(rows * k, 6);
  std::vector<float> alone(n), batch(rows * n);
  kernels::packed_matmul(x.data(), 1, p, alone.data(), false, batch_invariant);
  kernels::packed_matmul(x.data(), rows, p, batch.data(), false, batch_invariant);
  return std::memcmp(alone.data(), batch.data(), n * sizeof(float)) == 0;
}

TEST(BatchInvariance, PackedMatmulRowDoesNotDependOnTheRowCount) {
  for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kInt8, WeightFormat::kInt8W8A8, WeightFormat::kInt4,
                         WeightFormat::kInt4W4A8, WeightFormat::kFP8E4M3}) {
    const std::string name(kernels::weight_format_name(f));
    EXPECT_TRUE(first_row_equal_alone_and_in_24(f, true)) << name;
    if (kernels::row_result_depends_on_row_count(f, kernels::kernel_isa(f))) {
      EXPECT_FALSE(first_row_equal_alone_and_in_24(f, false)) << name << ": the loops no longer differ without the pin";
    }
  }
}

// tiny's shape with experts of intermediate 2560: w2's K spans more than one K block of every many-row loop.
std::string model_dir() {
  static const std::string dir = [] {
    const std::string out = (std::filesystem::temp_directory_path() / "moex_batch_invariance_test").string();
    if (!std::filesystem::exists(out + "/config.json")) {
      const std::string cmd = std::string(MOEX_BINARY) + " gen-model --preset tiny --intermediate 2560 --seed 13 --out " +
                              out + " --force > /dev/null";
      EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    }
    return out;
  }();
  return dir;
}

ModelOptions options(const std::string& weights, bool batch_invariant) {
  ModelOptions o;
  o.max_batch = 4;
  o.max_seq_len = 128;
  o.max_step_tokens = 128;
  o.batch_invariant = batch_invariant;
  if (weights != "as-stored") {
    o.expert_weights.packed = o.dense_weights.packed = true;
    o.expert_weights.format = o.dense_weights.format = weights == "int8"   ? WeightFormat::kInt8
                                                     : weights == "int4"   ? WeightFormat::kInt4
                                                     : weights == "fp8"    ? WeightFormat::kFP8E4M3
                                                     : weights == "w8a8"   ? WeightFormat::kInt8W8A8
                                                                           : WeightFormat::kBF16;
  }
  return o;
}

std::vector<int> ids(int length, int salt) {
  std::vector<int> v(length);
  for (int i = 0; i < length; ++i) v[i] = 1 + (i * 37 + salt * 101) % 500;
  return v;
}

constexpr int kSteps = 4;

// Sequence P's logits: its last prompt position, then kSteps greedy decode steps ([1 + kSteps][V]), alone.
std::vector<std::vector<float>> alone(DecoderModel& model, const std::vector<int>& prompt) {
  const int V = model.config().vocab_size;
  KvBlockManager kv = make_block_manager(model);
  std::vector<std::vector<float>> out(1, std::vector<float>(V));
  prefill(model, kv, 0, prompt, out[0].data());
  for (int s = 0; s < kSteps; ++s) {
    const int32_t token = argmax(out.back().data(), V), position = static_cast<int32_t>(prompt.size()) + s;
    out.emplace_back(V);
    decode_step(model, kv, {0}, &token, &position, out.back().data());
  }
  return out;
}

// The same P inside steps of other compositions: its prompt prefilled in one step beside two other prompts'
// chunks (ragged), then each decode row beside prefill chunks of other prompts and other sequences' decode rows.
std::vector<std::vector<float>> batched(DecoderModel& model, const std::vector<int>& prompt) {
  const int V = model.config().vocab_size;
  KvBlockManager kv = make_block_manager(model);
  struct Part {
    SeqId seq;
    std::vector<int> tokens;  // this step's tokens of seq
    int64_t pos;
  };
  std::vector<float> logits;
  const auto step = [&](const std::vector<Part>& parts) {
    std::vector<int32_t> tokens, rows;
    std::vector<StepSeq> seqs;
    for (const Part& p : parts) {
      EXPECT_TRUE(kv.reserve(p.seq, p.pos + static_cast<int64_t>(p.tokens.size())));
      const auto& table = kv.block_table(p.seq);
      seqs.push_back({table.data(), static_cast<int64_t>(table.size()), p.pos, static_cast<int64_t>(p.tokens.size())});
      tokens.insert(tokens.end(), p.tokens.begin(), p.tokens.end());
      rows.push_back(static_cast<int32_t>(tokens.size()) - 1);  // each part's last row
    }
    StepInput in;
    in.tokens = tokens.data();
    in.num_tokens = static_cast<int64_t>(tokens.size());
    in.seqs = seqs.data();
    in.num_seqs = static_cast<int64_t>(seqs.size());
    in.logit_rows = rows.data();
    in.num_logit_rows = static_cast<int64_t>(rows.size());
    logits.assign(rows.size() * V, 0.0f);
    model.forward(in, logits.data());
  };
  const std::vector<int> a = ids(70, 1), b = ids(9, 2), c = ids(60, 3);
  // P's prompt between a's first 50 tokens and all of b: 50 + |P| + 9 rows.
  step({{1, {a.begin(), a.begin() + 50}, 0}, {0, prompt, 0}, {2, b, 0}});
  std::vector<std::vector<float>> out(1, std::vector<float>(logits.begin() + V, logits.begin() + 2 * V));
  int32_t pos = static_cast<int32_t>(prompt.size());
  const auto next = [&] { return std::vector<int>{argmax(out.back().data(), V)}; };
  // Decode rows of P: beside a's last 20 prompt tokens and b's decode; beside c's prompt; beside c's 60
  // tokens again at another place in the step; alone last.
  step({{2, {7}, 9}, {0, next(), pos}, {1, {a.begin() + 50, a.end()}, 50}});
  out.emplace_back(logits.begin() + V, logits.begin() + 2 * V);
  ++pos;
  step({{0, next(), pos}, {3, c, 0}});
  out.emplace_back(logits.begin(), logits.begin() + V);
  ++pos;
  kv.free(3);
  step({{3, c, 0}, {1, {8}, 70}, {0, next(), pos}});
  out.emplace_back(logits.begin() + 2 * V, logits.begin() + 3 * V);
  ++pos;
  step({{0, next(), pos}});
  out.emplace_back(logits.begin(), logits.begin() + V);
  return out;
}

// How many of P's 1 + kSteps logit rows differ (any bit) between alone and batched.
// threads: 2 splits every kernel's work (panels, attention items) between two threads; on a shared, loaded
// machine two spinning threads cost ten times one, so most cases run on one.
int rows_that_differ(const std::string& weights, bool batch_invariant, int threads = 1) {
  set_num_threads(threads);
  DecoderModel model(model_dir(), options(weights, batch_invariant));
  const std::vector<int> prompt = ids(21, 0);
  const auto want = alone(model, prompt), got = batched(model, prompt);
  int differ = 0;
  for (int r = 0; r <= kSteps; ++r)
    differ += std::memcmp(want[r].data(), got[r].data(), want[r].size() * sizeof(float)) != 0;
  return differ;
}

TEST(BatchInvariance, ASequencesLogitsDoNotDependOnItsNeighbours) {
  for (const std::string weights : {"as-stored", "bf16", "int8", "int4", "fp8", "w8a8"})
    EXPECT_EQ(rows_that_differ(weights, true), 0) << "--weights " << weights << " --batch-invariant";
  EXPECT_EQ(rows_that_differ("int8", true, 2), 0) << "--weights int8 --batch-invariant, 2 threads";
}

TEST(BatchInvariance, WithoutTheFlagTheWeightOnlyKernelsMakeThemDepend) {
  std::vector<std::string> formats;
  // The formats whose many-row loop is the f32-FMA kernel: its K blocks sum in another order than the few-row loop,
  // which shows in these logits. (fp8's tile loop on AMX CPUs differs from its few-row loop only in how tdpbf16ps
  // adds a k pair, which this small model need not show.)
  for (const auto& [name, f] : {std::pair{"int8", WeightFormat::kInt8}, std::pair{"fp8", WeightFormat::kFP8E4M3}})
    if (kernels::row_result_depends_on_row_count(f, kernels::kernel_isa(f)) &&
        kernels::isa_for_rows(f, kernels::kernel_isa(f), 512) == kernels::Isa::kAvx512)
      formats.push_back(name);
  if (formats.empty()) GTEST_SKIP() << "this CPU's int8 and fp8 kernels have one summation order";
  for (const std::string& weights : formats) {
    const int differ = rows_that_differ(weights, false);
    EXPECT_GT(differ, 0) << "--weights " << weights;
    std::printf("--weights %s without --batch-invariant: %d of %d rows of P differ\n", weights.c_str(), differ,
                kSteps + 1);
  }
}

TEST(BatchInvariance, RefusesCapacityDrops) {
  ModelOptions o = options("as-stored", true);
  o.capacity_factor = 1.0f;
  try {
    DecoderModel model(model_dir(), o);
    FAIL() << "a capacity factor was accepted with batch invariance";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--batch-invariant needs dropless"), std::string::npos) << e.what();
  }
}

// `moex bench batch-variance` (the report without the flag) on the same model: served together, int8 moves
// the logprobs of the tokens both runs chose (bitwise) and --batch-invariant moves none.
nlohmann::json bench_batch_variance(const std::string& flags) {
  const std::string cmd = std::string(MOEX_BINARY) + " bench batch-variance --model " + model_dir() +
                          " --weights int8 --prompts 8 -n 4 --threads 1 --json " + flags;
  FILE* pipe = popen(cmd.c_str(), "r");
  EXPECT_NE(pipe, nullptr) << cmd;
  std::string out;
  char buf[4096];
  for (size_t n; pipe && (n = fread(buf, 1, sizeof buf, pipe)) > 0;) out.append(buf, n);
  EXPECT_EQ(pipe ? pclose(pipe) : -1, 0) << cmd;
  return nlohmann::json::parse(out);
}

TEST(BatchInvariance, BenchBatchVarianceCountsWhatMoved) {
  if (!kernels::row_result_depends_on_row_count(WeightFormat::kInt8, kernels::kernel_isa(WeightFormat::kInt8)))
    GTEST_SKIP() << "this CPU's int8 kernel has one summation order";
  const nlohmann::json without = bench_batch_variance(""), with = bench_batch_variance("--batch-invariant");
  EXPECT_EQ(without["prompts"], 8);
  EXPECT_GT(without["logprob_differs_steps"].get<int>(), 0) << without.dump();
  EXPECT_EQ(with["differ"], 0) << with.dump();
  EXPECT_EQ(with["logprob_differs_steps"], 0) << with.dump();
  EXPECT_EQ(with["same_token_steps"], 8 * 4) << with.dump();
}

}  // namespace
}  // namespace moex
