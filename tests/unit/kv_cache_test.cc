// Paged KV cache: the bf16 block pool, paged attention against a plain contiguous fp32 attention, and the
// block manager with its prefix cache.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "moex/base/cpu.h"
#include "moex/base/dtype.h"
#include "moex/base/error.h"
#include "moex/base/threads.h"
#include "moex/kernels/paged_attention.h"
#include "moex/model/decoder.h"
#include "moex/runtime/kv_block_manager.h"
#include "moex/model/paged_kv_cache.h"

namespace moex {
namespace {

using kernels::PagedAttentionSeq;
using kernels::PagedKvLayout;

// ---- paged attention -------------------------------------------------------------------------------

// One sequence of the test batch: its whole K/V history (fp32, [position][kv_head][head_dim]) and the
// query rows of this step at positions q_pos .. q_pos + q_len - 1.
struct TestSeq {
  int64_t q_pos, q_len;
};

// The simplest attention: per query row and head, softmax(q.k / sqrt(hd)) over positions 0..p, times V,
// in double, over contiguous arrays.
void contiguous_attention(const std::vector<float>& q, const std::vector<std::vector<float>>& keys,
                          const std::vector<std::vector<float>>& values, const std::vector<TestSeq>& seqs,
                          int64_t heads, int64_t kv_heads, int64_t hd, std::vector<float>& out) {
  const int64_t group = heads / kv_heads;
  int64_t row = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    for (int64_t i = 0; i < seqs[s].q_len; ++i, ++row) {
      const int64_t p = seqs[s].q_pos + i;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t g = h / group;
        std::vector<double> w(p + 1);
        double max_w = -1e300, sum = 0;
        for (int64_t j = 0; j <= p; ++j) {
          double dot = 0;
          for (int64_t e = 0; e < hd; ++e) dot += double{q[(row * heads + h) * hd + e]} * keys[s][(j * kv_heads + g) * hd + e];
          w[j] = dot / std::sqrt(double(hd));
          max_w = std::max(max_w, w[j]);
        }
        for (double& x : w) sum += (x = std::exp(x - max_w));
        for (int64_t e = 0; e < hd; ++e) {
          double acc = 0;
          for (int64_t j = 0; j <= p; ++j) acc += w[j] * values[s][(j * kv_heads + g) * hd + e];
          out[(row * heads + h) * hd + e] = static_cast<float>(acc / sum);
        }
      }
    }
  }
}

struct AttentionCase {
  int64_t heads, kv_heads, hd;
  std::vector<TestSeq> seqs;
};

// Fills a paged pool (scattered, shuffled block ids) and compares paged_attention and paged_attention_ref
// with contiguous_attention, on the exact fp32 K/V and on K/V rounded to bf16.
void check_case(const AttentionCase& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  const int64_t layers = 2, layer = 1, bs = kernels::kKvBlockSize, row_dim = c.kv_heads * c.hd;
  int64_t total_blocks = 0, rows = 0;
  for (const TestSeq& s : c.seqs) {
    total_blocks += (s.q_pos + s.q_len + bs - 1) / bs;
    rows += s.q_len;
  }
  PagedKvLayout layout;
  layout.num_blocks = total_blocks + 5;  // spare blocks, never read
  layout.layers = layers;
  layout.kv_heads = c.kv_heads;
  layout.head_dim = c.hd;
  std::vector<uint16_t> pool(layout.num_blocks * layout.block_elems(), f32_to_bf16(NAN));  // unwritten = NaN
  PagedKvLayout layout_f32 = layout;  // the same blocks in an exact f32 pool
  layout_f32.elem_bytes = 4;
  std::vector<float> pool_f32(layout.num_blocks * layout.block_elems(), NAN);
  std::vector<int32_t> ids(layout.num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);

  std::vector<std::vector<float>> keys, values, keys_bf16, values_bf16;
  std::vector<std::vector<int32_t>> tables;
  size_t next_id = 0;
  for (const TestSeq& s : c.seqs) {
    const int64_t len = s.q_pos + s.q_len;
    std::vector<int32_t> table((len + bs - 1) / bs);
    for (int32_t& b : table) b = ids[next_id++];
    std::vector<float> k(len * row_dim), v(len * row_dim);
    for (float& x : k) x = uniform(rng);
    for (float& x : v) x = uniform(rng);
    for (int64_t p = 0; p < len; ++p) {
      kernels::paged_kv_write(layout, pool.data(), layer, table.data(), p, k.data() + p * row_dim, v.data() + p * row_dim);
      kernels::paged_kv_write(layout_f32, pool_f32.data(), layer, table.data(), p, k.data() + p * row_dim,
                              v.data() + p * row_dim);
    }
    std::vector<float> kr(k), vr(v);
    for (float& x : kr) x = bf16_to_f32(f32_to_bf16(x));
    for (float& x : vr) x = bf16_to_f32(f32_to_bf16(x));
    keys.push_back(k);
    values.push_back(v);
    keys_bf16.push_back(kr);
    values_bf16.push_back(vr);
    tables.push_back(table);
  }
  std::vector<float> q(rows * c.heads * c.hd);
  for (float& x : q) x = uniform(rng);
  std::vector<PagedAttentionSeq> seqs;
  int64_t row = 0;
  for (size_t s = 0; s < c.seqs.size(); ++s) {
    seqs.push_back({tables[s].data(), row, c.seqs[s].q_len, c.seqs[s].q_pos});
    row += c.seqs[s].q_len;
  }

  std::vector<float> exact(q.size()), rounded(q.size()), fast(q.size(), NAN), ref(q.size(), NAN);
  contiguous_attention(q, keys, values, c.seqs, c.heads, c.kv_heads, c.hd, exact);
  contiguous_attention(q, keys_bf16, values_bf16, c.seqs, c.heads, c.kv_heads, c.hd, rounded);
  std::vector<float> scratch(num_threads() * kernels::paged_attention_scratch_floats(layout, c.heads));
  // Both tiles: the portable one, and this CPU's vector one (x86/paged_attention_avx512.cc, or _avx2.cc on a
  // CPU without AVX-512) where it has one.
  const bool had_x86 = x86_kernels_allowed();
  for (bool x86 : {false, true}) {
    if (x86 && !cpu_features().has_avx2_kernels()) continue;
    SCOPED_TRACE(!x86 ? "portable tile" : cpu_features().has_avx512_kernels() ? "avx512 tile" : "avx2 tile");
    set_use_x86_kernels(x86);
    std::fill(fast.begin(), fast.end(), NAN);
    kernels::paged_attention(layout, pool.data(), layer, seqs.data(), seqs.size(), q.data(), c.heads, fast.data(),
                             scratch.data());
    kernels::paged_attention_ref(layout, pool.data(), layer, seqs.data(), seqs.size(), q.data(), c.heads, ref.data());

    // Against the same bf16 values the only difference is fp32 summation order: 2e-5 on outputs |o| <= 1.
    // Against exact fp32 K/V, bf16 storage adds: V rounding <= 2^-9 |v| (0.002) directly, and K rounding moves
    // each score by <= 2^-9 * sum|q||k| / sqrt(hd) (<= 0.002 * sqrt(hd) worst case, ~0.002 typical with
    // random signs), which moves the output by about that times |v|: 1e-2 bounds both with margin.
    float worst_exact = 0;
    for (size_t i = 0; i < q.size(); ++i) {
      ASSERT_NEAR(fast[i], rounded[i], 2e-5f) << "fast, element " << i;
      ASSERT_NEAR(ref[i], rounded[i], 2e-5f) << "ref, element " << i;
      ASSERT_NEAR(fast[i], exact[i], 1e-2f) << "fast vs fp32, element " << i;
      worst_exact = std::max(worst_exact, std::abs(fast[i] - exact[i]));
    }
    EXPECT_GT(worst_exact, 0.0f);  // the pool really is bf16

    // The f32 pool: against the exact K/V only the summation order differs.
    std::vector<float> fast32(q.size(), NAN), ref32(q.size(), NAN);
    kernels::paged_attention(layout_f32, pool_f32.data(), layer, seqs.data(), seqs.size(), q.data(), c.heads,
                             fast32.data(), scratch.data());
    kernels::paged_attention_ref(layout_f32, pool_f32.data(), layer, seqs.data(), seqs.size(), q.data(), c.heads,
                                 ref32.data());
    for (size_t i = 0; i < q.size(); ++i) {
      ASSERT_NEAR(fast32[i], exact[i], 2e-5f) << "fast f32, element " << i;
      ASSERT_NEAR(ref32[i], exact[i], 2e-5f) << "ref f32, element " << i;
    }
  }
  set_use_x86_kernels(had_x86);
}

class PagedAttentionTest : public ::testing::Test {
 protected:
  void SetUp() override { saved_threads_ = num_threads(); set_num_threads(2); }  // exercise the parallel path
  void TearDown() override { set_num_threads(saved_threads_); }
  int saved_threads_ = 1;
};

TEST_F(PagedAttentionTest, DecodeRaggedLengthsMatchContiguousFp32) {
  // One query per sequence; contexts of 1 position, a partly filled block, exactly one block, one more
  // than a block, and several blocks with a partial last one.
  const std::vector<TestSeq> seqs = {{0, 1}, {14, 1}, {15, 1}, {16, 1}, {49, 1}, {99, 1}};
  check_case({4, 4, 16, seqs}, 1);  // multi-head
  check_case({8, 2, 32, seqs}, 2);  // GQA, 4 query heads per KV head
  check_case({6, 1, 16, seqs}, 3);  // MQA
}

TEST_F(PagedAttentionTest, PrefillChunksAreCausalAcrossTilesAndBlocks) {
  // A fresh prompt over 3 query tiles, a chunk continuing a cached prefix mid-block, and decoders in the
  // same step.
  const std::vector<TestSeq> seqs = {{0, 37}, {20, 19}, {70, 1}, {5, 16}, {31, 2}};
  check_case({4, 4, 16, seqs}, 4);
  check_case({8, 2, 32, seqs}, 5);
  check_case({8, 1, 8, seqs}, 6);
}

TEST_F(PagedAttentionTest, RaggedHeadDimsAndLaneGroups) {
  // head_dim not a multiple of 16 (the x86 tile's masked chunks), mini's 64, and the 128 limit; query
  // vectors per item (rows x group) that fill 16 lanes partly, exactly and over several lane groups.
  const std::vector<TestSeq> seqs = {{0, 33}, {16, 7}, {3, 1}, {47, 17}};
  check_case({16, 4, 64, seqs}, 7);   // mini's shape: 64 query vectors per tile
  check_case({6, 2, 40, seqs}, 8);    // hd 40, group 3: 48 vectors, lane groups of 16
  check_case({5, 5, 128, seqs}, 9);   // hd 128, no GQA
  check_case({14, 2, 72, seqs}, 10);  // hd 72, group 7: 112 vectors
}

TEST_F(PagedAttentionTest, AQueryRowsResultDoesNotDependOnTheRowsBesideIt) {
  // Each query vector's lane runs its own sums in the same order whatever shares its tile: a prompt's rows
  // computed in one prefill call equal, bit for bit, the same rows computed one decode-style call each
  // (what --batch-invariant relies on). Both tiles; on AVX-512 the decode calls run the key-lane tile (few
  // query vectors) and the prefill the vertical one, so this also holds them to the same bits: head dims of
  // 1, 3, 4 and 8 chunks of 16 (ragged 40 and 48), GQA groups of 1, 3, 4 and 6 (passes of 4, 3, 2 and 1
  // vectors), contexts over several passes of blocks.
  struct Shape {
    int64_t heads, kv_heads, hd, len;
  };
  for (const Shape& sh : {Shape{8, 2, 48, 37}, Shape{16, 4, 64, 137}, Shape{8, 2, 128, 70}, Shape{6, 2, 40, 300},
                          Shape{6, 1, 16, 53}, Shape{4, 4, 64, 20}}) {
    SCOPED_TRACE("heads " + std::to_string(sh.heads) + ", kv heads " + std::to_string(sh.kv_heads) + ", head dim " +
                 std::to_string(sh.hd));
    PagedKvLayout layout;
    layout.layers = 1;
    layout.kv_heads = sh.kv_heads;
    layout.head_dim = sh.hd;
    const int64_t heads = sh.heads, len = sh.len, width = heads * layout.head_dim;
    layout.num_blocks = (len + layout.block_size - 1) / layout.block_size;
    std::mt19937 rng(12);
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    std::vector<uint16_t> pool(layout.num_blocks * layout.block_elems());
    for (uint16_t& v : pool) v = f32_to_bf16(uniform(rng));
    std::vector<int32_t> table(layout.num_blocks);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), rng);
    std::vector<float> q(len * width);
    for (float& v : q) v = uniform(rng);
    std::vector<float> scratch(num_threads() * kernels::paged_attention_scratch_floats(layout, heads));
    const bool had_x86 = x86_kernels_allowed();
    for (bool x86 : {false, true}) {
      if (x86 && !cpu_features().has_avx2_kernels()) continue;
      SCOPED_TRACE(!x86 ? "portable tile" : cpu_features().has_avx512_kernels() ? "avx512 tile" : "avx2 tile");
      set_use_x86_kernels(x86);
      std::vector<float> together(len * width, NAN), alone(len * width, NAN), ref(len * width, NAN);
      const PagedAttentionSeq prompt{table.data(), 0, len, 0};
      kernels::paged_attention(layout, pool.data(), 0, &prompt, 1, q.data(), heads, together.data(), scratch.data());
      kernels::paged_attention_ref(layout, pool.data(), 0, &prompt, 1, q.data(), heads, ref.data());
      for (int64_t r = 0; r < len; ++r) {
        const PagedAttentionSeq one{table.data(), r, 1, r};
        kernels::paged_attention(layout, pool.data(), 0, &one, 1, q.data(), heads, alone.data(), scratch.data());
      }
      for (int64_t i = 0; i < len * width; ++i) {
        ASSERT_EQ(together[i], alone[i]) << "element " << i;
        ASSERT_NEAR(alone[i], ref[i], 2e-5f) << "element " << i;  // and right: summation order alone differs
      }
    }
    set_use_x86_kernels(had_x86);
  }
}

// ---- the block pool ---------------------------------------------------------------------------------

TEST(PagedKvCache, Bf16HoldsTwiceThePositionsOfTheFp32CacheInTheSameBytes) {
  ModelConfig config;
  config.num_hidden_layers = 2;
  config.head_dim = 64;
  const int kv_heads = 2, positions = 1024;
  // The f32 pool holds what the contiguous fp32 cache held: layers x 2 x kv_heads x positions x head_dim x 4.
  const PagedKvCache fp32_cache(config.num_hidden_layers, kv_heads, config.head_dim, int64_t{positions / 16},
                                KvCacheDType::kF32);
  EXPECT_EQ(fp32_cache.bytes(), int64_t{config.num_hidden_layers} * 2 * kv_heads * positions * config.head_dim * 4);
  const PagedKvCache paged(config.num_hidden_layers, kv_heads, config.head_dim,
                           static_cast<double>(fp32_cache.bytes()) / 1e9);
  EXPECT_EQ(paged.capacity_positions(), 2 * positions);
  EXPECT_EQ(paged.bytes(), static_cast<int64_t>(fp32_cache.bytes()));
  // layers x (k, v) x kv_heads x block_size x head_dim x 2 bytes
  EXPECT_EQ(paged.layout().block_bytes(), 2 * 2 * kv_heads * 16 * 64 * 2);
}

TEST(PagedKvCache, SizesThatHoldNoBlockAreInputErrors) {
  for (double gb : {0.0, -1.0, static_cast<double>(NAN), 1e-9}) {
    try {
      PagedKvCache cache(2, 2, 64, gb);
      FAIL() << "accepted --kv-cache-gb " << gb;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
      EXPECT_NE(std::string(e.what()).find("--kv-cache-gb"), std::string::npos) << e.what();
    }
  }
}

// ---- block manager and prefix cache --------------------------------------------------------------------

std::vector<int32_t> iota_tokens(int n, int start) {
  std::vector<int32_t> t(n);
  std::iota(t.begin(), t.end(), start);
  return t;
}

TEST(KvBlockManager, ReserveFreeAndRefCounts) {
  KvBlockManager m(4, 16);
  EXPECT_TRUE(m.reserve(1, 17));  // 2 blocks
  EXPECT_EQ(m.block_table(1).size(), 2u);
  EXPECT_EQ(m.num_used_blocks(), 2);
  EXPECT_TRUE(m.can_allocate(2));
  EXPECT_FALSE(m.can_allocate(3));
  EXPECT_FALSE(m.reserve(2, 3 * 16));  // 3 blocks: refused, nothing taken
  EXPECT_EQ(m.num_free_blocks(), 2);
  EXPECT_TRUE(m.reserve(1, 32));  // still 2 blocks
  EXPECT_EQ(m.num_used_blocks(), 2);
  for (int32_t b : m.block_table(1)) EXPECT_EQ(m.ref_count(b), 1);
  m.free(1);
  EXPECT_EQ(m.num_free_blocks(), 4);
  EXPECT_FALSE(m.has_sequence(1));
}

TEST(KvBlockManager, SharedPrefixReusesFullBlocks) {
  KvBlockManager m(16, 16);
  const std::vector<int32_t> a = iota_tokens(40, 100);  // 2 full blocks + 8
  ASSERT_TRUE(m.reserve(1, 40));
  m.cache_full_blocks(1, a.data(), 40);
  const std::vector<int32_t> a_table = m.block_table(1);

  std::vector<int32_t> b = a;  // same 35 tokens, then its own
  b.resize(35);
  b.push_back(7);
  const auto probe = m.probe_prefix(b.data(), b.size());
  EXPECT_EQ(probe.blocks, 2);
  EXPECT_EQ(probe.evictable, 0);
  EXPECT_EQ(m.adopt_prefix(2, b.data(), b.size()), 32);
  ASSERT_TRUE(m.reserve(2, b.size()));
  EXPECT_EQ(m.block_table(2)[0], a_table[0]);
  EXPECT_EQ(m.block_table(2)[1], a_table[1]);
  EXPECT_NE(m.block_table(2)[2], a_table[2]);  // the partial block is never shared
  EXPECT_EQ(m.ref_count(a_table[0]), 2);
  EXPECT_EQ(m.ref_count(a_table[2]), 1);

  // A prompt of exactly 32 shared tokens reuses one block: its last token is computed for the logits.
  std::vector<int32_t> c(a.begin(), a.begin() + 32);
  EXPECT_EQ(m.probe_prefix(c.data(), c.size()).blocks, 1);
  // Same second block after a different first block: the chain hash does not match it.
  std::vector<int32_t> d = a;
  d[0] = 99999;
  EXPECT_EQ(m.probe_prefix(d.data(), d.size()).blocks, 0);
  // Blocks of a freed sequence stay findable (evictable) until taken.
  m.free(1);
  m.free(2);
  const auto again = m.probe_prefix(b.data(), b.size());
  EXPECT_EQ(again.blocks, 2);
  EXPECT_EQ(again.evictable, 2);
  EXPECT_EQ(m.num_used_blocks(), 0);
  EXPECT_EQ(m.num_evictable_blocks(), 2);
  EXPECT_EQ(m.adopt_prefix(3, b.data(), b.size()), 32);
  EXPECT_EQ(m.num_evictable_blocks(), 0);
  EXPECT_EQ(m.num_used_blocks(), 2);
  m.free(3);
}

TEST(KvBlockManager, EvictsLeastRecentlyFreedAndTailBlocksFirst) {
  KvBlockManager m(6, 4);
  const std::vector<int32_t> a = iota_tokens(8, 0), b = iota_tokens(8, 50), c = iota_tokens(8, 90);
  for (auto [id, t] : {std::pair{1, &a}, std::pair{2, &b}, std::pair{3, &c}}) {
    ASSERT_TRUE(m.reserve(id, 8));
    m.cache_full_blocks(id, t->data(), 8);
  }
  const auto ta = m.block_table(1), tb = m.block_table(2), tc = m.block_table(3);
  m.free(2);  // b first, then a, then c; within a sequence its last block first
  m.free(1);
  m.free(3);
  EXPECT_EQ(m.evictable_in_order(), (std::vector<int32_t>{tb[1], tb[0], ta[1], ta[0], tc[1], tc[0]}));
  EXPECT_EQ(m.num_free_blocks(), 6);
  // Three new blocks evict b's two and a's tail; a keeps its first block.
  ASSERT_TRUE(m.reserve(4, 12));
  EXPECT_EQ(m.evictable_in_order(), (std::vector<int32_t>{ta[0], tc[1], tc[0]}));
  std::vector<int32_t> b_query = b, a_query = a;
  b_query.push_back(1);
  a_query.push_back(1);
  EXPECT_EQ(m.probe_prefix(b_query.data(), b_query.size()).blocks, 0);
  EXPECT_EQ(m.probe_prefix(a_query.data(), a_query.size()).blocks, 1);
  m.free(4);
}

TEST(KvBlockManager, RefCountsReturnToZeroAfterSharingSequencesFinish) {
  KvBlockManager m(32, 16);
  const std::vector<int32_t> prompt = iota_tokens(64, 7);
  ASSERT_TRUE(m.reserve(0, 64));
  m.cache_full_blocks(0, prompt.data(), 64);
  for (SeqId s = 1; s <= 5; ++s) {
    EXPECT_EQ(m.adopt_prefix(s, prompt.data(), prompt.size()), 48);
    ASSERT_TRUE(m.reserve(s, 64 + s));
  }
  EXPECT_EQ(m.ref_count(m.block_table(0)[0]), 6);
  EXPECT_EQ(m.ref_count(m.block_table(0)[3]), 1);
  for (SeqId s = 0; s <= 5; ++s) m.free(s);
  for (int32_t b = 0; b < m.num_blocks(); ++b) EXPECT_EQ(m.ref_count(b), 0) << "block " << b;
  EXPECT_EQ(m.num_used_blocks(), 0);
  EXPECT_EQ(m.num_free_blocks(), 32);
  EXPECT_EQ(m.num_evictable_blocks(), 4);  // the prompt's blocks stay cached
}

TEST(KvBlockManager, WithoutPrefixCachingNothingIsShared) {
  KvBlockManager m(8, 16, /*prefix_caching=*/false);
  const std::vector<int32_t> prompt = iota_tokens(40, 1);
  ASSERT_TRUE(m.reserve(1, 40));
  m.cache_full_blocks(1, prompt.data(), 40);
  EXPECT_EQ(m.probe_prefix(prompt.data(), prompt.size()).blocks, 0);
  m.free(1);
  EXPECT_EQ(m.num_evictable_blocks(), 0);
}

}  // namespace
}  // namespace moex
