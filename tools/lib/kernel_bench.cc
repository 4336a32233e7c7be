#include "tools/lib/kernel_bench.h"

#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>

#include "moex/base/cpu.h"
#include "moex/base/dtype.h"
#include "moex/base/error.h"
#include "moex/base/system_memory.h"
#include "moex/base/threads.h"
#include "moex/kernels/matmul.h"
#include "moex/kernels/paged_attention.h"
#include "tools/lib/read_replay.h"

namespace moex::kernels {
namespace {

// A row's time and its own read roofline. Each timed sample of `calls` calls (call(i): the i-th call of the run)
// is followed by the replay of exactly the bytes those calls read (reads(i): the i-th call's ranges, in the order
// the kernel reads them; stream_read_steps), so the row and its probe sample the same moments: on the Zen 4 VM
// the read rate flips between ~35 and ~60 GB/s within seconds, and one probe per run taken before the rows let
// rows read 107-119% of it. Medians of each, as bench e2e's batched rows.
struct Timed {
  double seconds = 0;             // per call, median of the samples
  double replay_bytes_per_s = 0;  // median of the samples' replays (0: no reads given)
};
Timed median_call_seconds(int repeats, double sample_ms, bool cpu_clock, const std::function<void(int64_t)>& call,
                          const std::function<void(int64_t, StepReads&)>& reads) {
  int64_t next = 0;
  call(next++);  // warm-up: sizes the per-thread buffers
  const auto start = std::chrono::steady_clock::now();
  int calls = 0;
  do {
    call(next++);
    ++calls;
  } while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < sample_ms * 1e-3);
  std::vector<double> samples, rates;
  std::vector<StepReads> steps(calls);
  for (int r = 0; r < std::max(repeats, 1); ++r) {
    const int64_t first = next;
    const double t0 = now_seconds(cpu_clock);
    for (int i = 0; i < calls; ++i) call(next++);
    samples.push_back((now_seconds(cpu_clock) - t0) / calls);
    if (!reads) continue;
    size_t bytes = 0;
    for (int i = 0; i < calls; ++i) {
      steps[i].clear();
      reads(first + i, steps[i]);
      bytes += tools::bytes_of(steps[i]);
    }
    const double seconds = tools::timed_replay(steps, cpu_clock);
    if (bytes > 0 && seconds > 0) rates.push_back(static_cast<double>(bytes) / seconds);
  }
  std::sort(samples.begin(), samples.end());
  std::sort(rates.begin(), rates.end());
  return {samples[samples.size() / 2], rates.empty() ? 0.0 : rates[rates.size() / 2]};
}

}  // namespace

double read_bandwidth(size_t bytes, int repeats, bool cpu_clock) { return read_probe(bytes, repeats, cpu_clock).bytes_per_s; }

std::string describe_probes(const ReadProbe& read, double clock_hz, const PeakResult& bf16, const PeakResult& vnni,
                            const PeakResult& fma, const PeakResult& amx_bf16) {
  const CpuId id = cpu_id();
  const CpuClassRates rates = cpu_class_rates();
  char line[1024];
  std::string out;
  std::snprintf(line, sizeof line, "cpu: %s (family %d model %d), clock %.2f GHz (dependent adds, all threads at once)\n",
                rates.name, id.family, id.model, clock_hz / 1e9);
  out += line;
  std::snprintf(line, sizeof line,
                "read probe: %.1f GB/s (%s; loads alone %.1f, loads + prefetch %.1f), all threads, huge pages\n",
                read.bytes_per_s / 1e9, read.method, read.plain_bytes_per_s / 1e9, read.prefetch_bytes_per_s / 1e9);
  out += line;
  // instructions per cycle per thread: FLOP/s over FLOP per instruction, threads and clock
  const auto ipc = [&](const PeakResult& p, double ops) {
    return p.per_second > 0 && clock_hz > 0 && p.threads > 0 ? p.per_second / ops / p.threads / clock_hz : 0.0;
  };
  const double fma_ops = use_x86_kernels() ? 32 : 16;
  std::snprintf(line, sizeof line,
                "dot-product probes, %d chains per thread, instructions per cycle per thread (documented per core): "
                "vdpbf16ps %.2f (%.2g), vpdpbusd %.2f (%.2g), vfmadd231ps %.2f (%.2g), tdpbf16ps %.3f (%.3g)%s%s\n",
                x86::kPeakChains, ipc(bf16, 64), rates.bf16_zmm, ipc(vnni, 128), rates.vnni_zmm, ipc(fma, fma_ops),
                rates.fma_zmm, ipc(amx_bf16, 16384), rates.amx_tile, *rates.source ? "; source: " : "", rates.source);
  out += line;
  return out;
}

std::string rows_over_probe(const KernelBenchReport& report) {
  std::string out;
  for (const KernelBenchRow& r : report.rows)
    if (r.pct_roofline > 100.0) {
      char line[256];
      std::snprintf(line, sizeof line,
                    "PROBE TOO LOW: %s %s T=%lld at %.1f%% of its roofline (read %.1f%% of %.1f GB/s, peak %.1f%%)\n",
                    r.kernel.c_str(), r.format.c_str(), static_cast<long long>(r.tokens), r.pct_roofline,
                    r.pct_read_roofline, r.read_bytes_per_s / 1e9, r.pct_compute_peak);
      out += line;
    }
  return out;
}

namespace {

QuantizedMatrix make_weights(const FormatSpec& spec, int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f / std::sqrt(static_cast<float>(cols)));
  std::vector<float> w(rows * cols);  // [rows, cols]
  for (float& v : w) v = normal(rng);
  const TensorView view{w.data(), DType::kF32, Shape{rows, cols}};
  return quantize(view, spec.format, spec.group, spec.symmetric);
}

PackedWeights clone(const PackedWeights& p) {
  PackedWeights c;
  c.format = p.format;
  c.rows = p.rows, c.cols = p.cols, c.group = p.group, c.gate_up = p.gate_up, c.panels = p.panels,
  c.k_padded = p.k_padded;
  for (auto [from, to] : {std::pair{&p.data, &c.data}, std::pair{&p.scales, &c.scales}, std::pair{&p.offsets, &c.offsets},
                          std::pair{&p.col_sums, &c.col_sums}}) {
    if (!from->size) continue;
    to->allocate(from->size);
    std::memcpy(to->ptr.get(), from->ptr.get(), from->size);
  }
  return c;
}

// Moves the packed matrices into one 2 MB-aligned WeightArena, back to back, as the model's load does with a
// layer's experts (model/weights.cc): on huge pages. A matrix below 4 MB keeps its own 4 KB pages otherwise (the
// Qwen3-30B-A3B geometry's experts: 1.5-6 MB), where the hardware prefetchers stop at every page and one thread
// streamed ~55% of the read probe.
void onto_huge_pages(const std::vector<PackedWeights*>& ws) {
  size_t total = 0;
  for (const PackedWeights* w : ws) total += WeightArena::bytes_for(*w);
  if (total == 0) return;
  WeightArena arena;  // its slices keep the memory alive
  arena.reserve(total);
  for (PackedWeights* w : ws) MOEX_CHECK(arena.adopt(*w), "onto_huge_pages: the arena is too small");
}

}  // namespace

FormatSpec parse_format_spec(const std::string& name) {
  // The table's names; a format whose K group --group-size sets is spelled <name>-g<group>[-asym].
  std::string choices;
  for (const kernels::FormatTraits& t : kernels::all_formats()) {
    const std::string base(t.name);
    choices += (choices.empty() ? "" : ", ") + base;
    if (!kernels::group_is_user_set(t.format)) {
      if (name == base) return {t.format};
      continue;
    }
    choices += "-g32|g64|g128[-asym]";
    for (int64_t g : {32, 64, 128}) {
      if (name == base + "-g" + std::to_string(g)) return {t.format, g, true};
      if (name == base + "-g" + std::to_string(g) + "-asym") return {t.format, g, false};
    }
  }
  throw_error(ErrorKind::kInvalidInput, "unknown weight format '" + name + "' (choose " + choices + ")");
}

namespace {

// Fills a row's rates from its seconds, weight_bytes, flops and its replay rate (`timed`): against that read rate
// (the DRAM probe of the run where the row has no replay) and `peak`, the FLOP/s of the instruction its kernel
// sums with (0: no probe, so compute and the roofline are memory alone).
void finish_row(KernelBenchRow& r, const KernelBenchReport& report, const Timed& timed, double peak) {
  r.seconds = timed.seconds;
  r.read_bytes_per_s = timed.replay_bytes_per_s > 0 ? timed.replay_bytes_per_s : report.read_bytes_per_s;
  r.gb_per_s = r.weight_bytes / r.seconds / 1e9;
  r.gflops = r.flops / r.seconds / 1e9;
  r.pct_read_roofline = 100.0 * r.weight_bytes / r.seconds / r.read_bytes_per_s;
  r.pct_dram = 100.0 * r.weight_bytes / r.seconds / report.read_bytes_per_s;
  r.pct_compute_peak = peak > 0 ? 100.0 * r.flops / r.seconds / peak : 0.0;
  r.pct_roofline = 100.0 * std::max(r.weight_bytes / r.read_bytes_per_s, peak > 0 ? r.flops / peak : 0.0) / r.seconds;
}

// The ISA a call of `rows` rows per matrix runs for a format on this CPU (kAmx's few-row loop is AVX-512's).
Isa row_isa(WeightFormat format, int64_t rows) { return isa_for_rows(format, kernel_isa(format), rows); }

// The peak of the instruction a format's kernel on this CPU sums with at `rows` rows (0: none measured).
double compute_peak(const KernelBenchReport& report, WeightFormat format, int64_t rows) {
  const kernels::ActivationKind activations = kernels::format_traits(format).activations;
  const bool int8_activations =
      activations == kernels::ActivationKind::kS8PerToken || activations == kernels::ActivationKind::kS8PerGroup;
  switch (row_isa(format, rows)) {
    case Isa::kAmx: return int8_activations ? report.amx_int8_peak.per_second : report.amx_bf16_peak.per_second;
    case Isa::kAvx512Bf16: return report.bf16_peak.per_second;
    // int8 (weight-only) there is vpdpwssd: two products per lane where vpdpbusd does four, at the same instruction
    // rate (Zen 4: 3.6 G/s per core each, as vdpbf16ps, measured 2026-12-05).
    case Isa::kAvx512Vnni:  // f32 activations there are s16 codes (int8's loop)
      return activations == kernels::ActivationKind::kF32 ? report.vnni_peak.per_second / 2 : report.vnni_peak.per_second;
    case Isa::kAvx2: return int8_activations ? report.maddubs_peak.per_second : report.fma_peak.per_second;
    case Isa::kAvx512: return report.fma_peak.per_second;
    default: return 0.0;
  }
}

// The experts token t is routed to, `top_k` of `experts`: with 8 experts top-2 (mini's, Mixtral's) experts t % 8
// and (t + 3) % 8 (at T = 1: two experts, one row each); otherwise (Qwen3-30B-A3B's 128 top-8) k distinct experts
// drawn uniformly from a generator seeded by t, so batch 16 spreads ~128 rows over ~80 experts as a real router
// does, not over a few neighbours.
std::vector<int> route_token(int64_t t, int experts, int top_k) {
  std::vector<int> chosen;
  if (experts == 8 && top_k == 2) return {static_cast<int>(t % 8), static_cast<int>((t + 3) % 8)};
  std::mt19937 rng(static_cast<uint32_t>(1000 + t));
  std::vector<int> all(experts);
  for (int e = 0; e < experts; ++e) all[e] = e;
  for (int j = 0; j < top_k; ++j) {  // a partial Fisher-Yates shuffle
    std::uniform_int_distribution<int> pick(j, experts - 1);
    std::swap(all[j], all[pick(rng)]);
    chosen.push_back(all[j]);
  }
  return chosen;
}

// A whole MoE layer's expert stage: o.experts experts, each token routed to o.top_k of them (route_token),
// through fused_experts (one parallel region) or expert by expert (expert_gate_up + expert_down_accumulate per
// expert: two regions each). Only the experts some call routes to are generated. Bytes: the experts with rows.
// Like the single-matrix rows, calls cycle over copies of the experts (--roofline-mb in all): mini's 8 experts are
// 176 MB, which a large L3 (480 MB on the AMX Xeon) would otherwise serve from cache on every call.
void bench_moe(const KernelBenchOptions& o, const FormatSpec& spec, const std::string& format_name, bool fused,
               KernelBenchReport& report, const std::vector<float>& x_source) {
  const int64_t H = o.hidden, I = o.intermediate;
  const int E = o.experts;
  MOEX_CHECK_INPUT(o.experts >= 1 && o.top_k >= 1 && o.top_k <= o.experts, "moe: need 1 <= top-k <= experts");
  std::vector<bool> used(E, false);
  for (int64_t T : o.tokens)
    for (int64_t t = 0; t < T; ++t)
      for (int e : route_token(t, o.experts, o.top_k)) used[e] = true;
  std::vector<PackedWeights> w13(E), w2(E);
  for (int e = 0; e < E; ++e) {
    if (!used[e]) continue;
    w13[e] = pack_gate_up(make_weights(spec, I, H, 10 + e), make_weights(spec, I, H, 20 + e));
    w2[e] = pack(make_weights(spec, H, I, 30 + e));
  }
  std::vector<PackedWeights*> all;
  for (int e = 0; e < E; ++e)
    if (used[e]) all.insert(all.end(), {&w13[e], &w2[e]});
  onto_huge_pages(all);
  for (int64_t T : o.tokens) {
    // Plan: rows grouped by expert, each row's token; x rows gathered.
    std::vector<std::vector<int32_t>> tokens_of(E);
    for (int64_t t = 0; t < T; ++t)
      for (int e : route_token(t, o.experts, o.top_k)) tokens_of[e].push_back(static_cast<int32_t>(t));
    const int64_t rows = o.top_k * T;
    std::vector<float> x(rows * H), h(rows * I), out(T * H), route(rows);  // [rows, H], [rows, I], [T, H]
    std::vector<int32_t> out_rows(rows);
    std::vector<ExpertRows> first(E);
    double bytes = 0;
    for (int e = 0, row = 0; e < E; ++e) {
      const int64_t n = static_cast<int64_t>(tokens_of[e].size());
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t i = 0; i < H; ++i) x[(row + r) * H + i] = x_source[(tokens_of[e][r] * H + i) % x_source.size()];
        out_rows[row + r] = tokens_of[e][r];
        route[row + r] = 0.5f;
      }
      first[e] = {&w13[e], &w2[e], x.data() + row * H, n, h.data() + row * I, route.data() + row, out_rows.data() + row};
      if (n > 0) bytes += static_cast<double>(w13[e].weight_bytes() + w2[e].weight_bytes());
      row += static_cast<int>(n);
    }
    // Copies of the experts with rows, --roofline-mb of them in all: args [copy * E + e].
    const int64_t copies = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(double(o.cycle_mb << 20) / bytes)));
    std::vector<PackedWeights> copy13, copy2;
    copy13.reserve((copies - 1) * E);
    copy2.reserve((copies - 1) * E);
    std::vector<ExpertRows> args(first);
    std::vector<PackedWeights*> copy;  // every copy in one arena (a small layer has thousands of copies)
    for (int64_t c = 1; c < copies; ++c) {
      for (int e = 0; e < E; ++e) {
        ExpertRows a = first[e];
        if (a.rows > 0) {
          copy13.push_back(clone(w13[e]));
          copy2.push_back(clone(w2[e]));
          a.w13 = &copy13.back();
          a.w2 = &copy2.back();
          copy.insert(copy.end(), {&copy13.back(), &copy2.back()});
        }
        args.push_back(a);
      }
    }
    onto_huge_pages(copy);
    // The bytes a call reads: the experts with rows, all gate/up then all down (fused_experts' order).
    const auto reads = [&](int64_t i, StepReads& out) {
      const ExpertRows* set = args.data() + (i % copies) * E;
      for (int e = 0; e < E; ++e)
        if (set[e].rows > 0) tools::add_reads(out, *set[e].w13);
      for (int e = 0; e < E; ++e)
        if (set[e].rows > 0) tools::add_reads(out, *set[e].w2);
    };
    const Timed timed = median_call_seconds(o.repeats, o.sample_ms, o.cpu_clock, [&](int64_t i) {
      const ExpertRows* set = args.data() + (i % copies) * E;
      if (fused) {
        fused_experts(set, E, out.data(), H);
        return;
      }
      for (int e = 0; e < E; ++e) {
        const ExpertRows& a = set[e];
        if (a.rows == 0) continue;
        expert_gate_up(a.x, a.rows, *a.w13, a.h);
        expert_down_accumulate(a.h, a.rows, *a.w2, a.route_weights, a.out_rows, out.data(), H);
      }
    }, reads);
    KernelBenchRow r;
    r.kernel = fused ? "moe" : "moe_unfused";
    r.format = format_name;
    int64_t with_rows = 0;
    for (int e = 0; e < E; ++e) with_rows += !tokens_of[e].empty();
    // The mean rows of an expert with rows.
    const int64_t per_expert = std::max<int64_t>(1, rows / std::max<int64_t>(with_rows, 1));
    r.isa = std::string(isa_name(row_isa(spec.format, per_expert)));
    r.tokens = T;
    r.rows = I;
    r.cols = H;
    r.weight_bytes = bytes;
    r.flops = 2.0 * rows * 3.0 * H * I;
    finish_row(r, report, timed, compute_peak(report, spec.format, per_expert));
    report.rows.push_back(r);
  }
}

// Paged attention over a bf16 KV cache with mini's heads (16 query, 4 KV, head dim 64), through this CPU's
// vector tile (AVX-512, or AVX2 on a CPU without it) or the portable one (the `_portable` rows), in the same run:
// - `attention`: causal self-attention of one T-token prompt;
// - `attention_decode`: kDecodeSeqs sequences, one query each at position T - 1 (T: the context), their blocks
//   interleaved in the pool as growing sequences' are.
// FLOPs: q.k and p.v, 2 x 2 x head_dim per (query head, key) pair the causal mask keeps; judged against the
// vfmadd231ps probe (the tiles' instruction). Bytes: the K/V the call reads (decode's roofline: it streams them).
constexpr int64_t kDecodeSeqs = 16;
void bench_attention(const KernelBenchOptions& o, bool decode, bool vector_tile, KernelBenchReport& report) {
  const int64_t heads = 16, kv_heads = 4, hd = 64, num_seqs = decode ? kDecodeSeqs : 1;
  const bool had_x86 = x86_kernels_allowed();
  for (int64_t T : o.tokens) {
    PagedKvLayout layout;
    layout.layers = 1;
    layout.kv_heads = kv_heads;
    layout.head_dim = hd;
    const int64_t blocks_per_seq = (T + layout.block_size - 1) / layout.block_size;
    layout.num_blocks = num_seqs * blocks_per_seq;
    std::vector<uint16_t> pool;  // on huge pages where the kernel allows them, as PagedKvCache's
    pool.reserve(layout.num_blocks * layout.block_elems());
    advise_huge_pages(pool.data(), pool.capacity() * sizeof(uint16_t));
    pool.resize(layout.num_blocks * layout.block_elems());
    std::mt19937 rng(decode ? 13 : 11);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (uint16_t& v : pool) v = f32_to_bf16(normal(rng));
    // Sequence s owns blocks s, s + num_seqs, ...
    std::vector<int32_t> tables(layout.num_blocks);
    std::vector<PagedAttentionSeq> seqs(num_seqs);
    for (int64_t s = 0; s < num_seqs; ++s) {
      for (int64_t b = 0; b < blocks_per_seq; ++b)
        tables[s * blocks_per_seq + b] = static_cast<int32_t>(b * num_seqs + s);
      seqs[s] = decode ? PagedAttentionSeq{tables.data() + s * blocks_per_seq, s, 1, T - 1}
                       : PagedAttentionSeq{tables.data(), 0, T, 0};
    }
    const int64_t rows = decode ? num_seqs : T;
    std::vector<float> q(rows * heads * hd), out(rows * heads * hd);  // [rows, heads * hd]
    for (float& v : q) v = normal(rng);
    std::vector<float> scratch(num_threads() * paged_attention_scratch_floats(layout, heads));
    set_use_x86_kernels(vector_tile);
    // The reads: the pool (every block is some sequence's), the K/V the call reads.
    const Timed timed = median_call_seconds(
        o.repeats, o.sample_ms, o.cpu_clock,
        [&](int64_t) {
          paged_attention(layout, pool.data(), 0, seqs.data(), num_seqs, q.data(), heads, out.data(), scratch.data());
        },
        [&](int64_t, StepReads& out) { out.push_back({pool.data(), pool.size() * sizeof(uint16_t)}); });
    set_use_x86_kernels(had_x86);
    KernelBenchRow r;
    r.kernel = std::string(decode ? "attention_decode" : "attention") + (vector_tile ? "" : "_portable");
    r.format = "bf16-kv";
    r.isa = !vector_tile ? "none" : use_x86_kernels() ? "avx512" : use_avx2_kernels() ? "avx2" : "none";
    r.tokens = T;
    r.rows = num_seqs * heads;
    r.cols = hd;
    r.weight_bytes = 2.0 * num_seqs * T * kv_heads * hd * 2;
    const double pairs = decode ? static_cast<double>(num_seqs) * T : static_cast<double>(T) * (T + 1) / 2;
    r.flops = 4.0 * hd * heads * pairs;
    finish_row(r, report, timed, report.fma_peak.per_second);
    report.rows.push_back(r);
  }
}

// The as-stored matmul (kernels::matmul: f32 activations, bf16 weights read where the checkpoint's mapping has
// them, the --dense-weights as-stored path of attention projections and lm_head) on w1's shape [I, H], cycled
// over copies as the packed rows are. Judged against the vfmadd231ps probe (its instruction).
void bench_dense(const KernelBenchOptions& o, const std::vector<float>& x, std::vector<float>& y,
                 KernelBenchReport& report) {
  const int64_t N = o.intermediate, K = o.hidden;
  const double bytes = 2.0 * N * K;
  const int64_t copies = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(double(o.cycle_mb << 20) / bytes)));
  std::vector<uint16_t> w(copies * N * K);  // copies x [N, K] bf16
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f / std::sqrt(static_cast<float>(K)));
  for (int64_t i = 0; i < N * K; ++i) w[i] = f32_to_bf16(normal(rng));
  for (int64_t c = 1; c < copies; ++c) std::memcpy(w.data() + c * N * K, w.data(), N * K * sizeof(uint16_t));
  for (int64_t T : o.tokens) {
    const Timed timed = median_call_seconds(
        o.repeats, o.sample_ms, o.cpu_clock,
        [&](int64_t i) { matmul(x.data(), T, TensorView{w.data() + (i % copies) * N * K, DType::kBF16, Shape{N, K}}, y.data()); },
        [&](int64_t i, StepReads& out) { out.push_back({w.data() + (i % copies) * N * K, static_cast<size_t>(bytes)}); });
    KernelBenchRow r;
    r.kernel = "dense";
    r.format = "bf16-as-stored";
    r.isa = use_x86_kernels() ? "avx512" : use_avx2_kernels() ? "avx2" : "none";
    r.tokens = T;
    r.rows = N;
    r.cols = K;
    r.weight_bytes = bytes;
    r.flops = 2.0 * T * N * K;
    finish_row(r, report, timed, r.isa != "none" ? report.fma_peak.per_second : 0.0);  // the portable loop: memory alone
    report.rows.push_back(r);
  }
}

}  // namespace

KernelBenchReport bench_kernels(const KernelBenchOptions& o) {
  MOEX_CHECK_INPUT(o.hidden > 0 && o.intermediate > 0, "hidden and intermediate sizes must be > 0");
  for (const std::string& k : o.kernels)
    MOEX_CHECK_INPUT(k == "w1" || k == "gate_up" || k == "down" || k == "moe" || k == "moe_unfused" ||
                         k == "attention" || k == "attention_portable" || k == "attention_decode" ||
                         k == "attention_decode_portable" || k == "dense",
                     "unknown kernel '", k,
                     "' (choose w1, gate_up, down, moe, moe_unfused, attention, attention_portable, attention_decode, "
                     "attention_decode_portable, dense)");
  std::vector<FormatSpec> specs;
  for (const std::string& f : o.formats) specs.push_back(parse_format_spec(f));
  int64_t max_tokens = 1;
  for (int64_t t : o.tokens) {
    MOEX_CHECK_INPUT(t >= 1, "token counts must be >= 1");
    max_tokens = std::max(max_tokens, t);
  }

  KernelBenchReport report;
  report.threads = num_threads();
  MOEX_CHECK_INPUT(!o.cpu_clock || report.threads == 1, "--cpu-clock times one thread: add --threads 1");
  report.read = read_probe(o.roofline_mb << 20, o.repeats, o.cpu_clock);
  report.read_bytes_per_s = report.read.bytes_per_s;
  report.clock_hz = core_clock_hz();
  const PeakSet peaks = best_peaks(o.cpu_clock);
  report.bf16_peak = peaks.bf16;
  report.vnni_peak = peaks.vnni;
  report.maddubs_peak = peaks.maddubs;
  report.fma_peak = peaks.fma;
  report.amx_bf16_peak = peaks.amx_bf16;
  report.amx_int8_peak = peaks.amx_int8;

  const int64_t H = o.hidden, I = o.intermediate;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(max_tokens * std::max(H, I)), out(max_tokens * H), h(max_tokens * I);  // [T, H|I]
  for (float& v : x) v = normal(rng);
  std::vector<float> route(max_tokens, 0.5f);
  std::vector<int32_t> out_rows(max_tokens);
  for (int64_t t = 0; t < max_tokens; ++t) out_rows[t] = static_cast<int32_t>(t);

  for (const std::string& kernel : o.kernels) {  // not per format: the KV cache and the as-stored weights are bf16
    if (kernel.rfind("attention", 0) == 0) {
      const bool decode = kernel.rfind("attention_decode", 0) == 0, portable = kernel.ends_with("_portable");
      bench_attention(o, decode, !portable, report);
    }
    if (kernel == "dense") bench_dense(o, x, h, report);
  }
  for (size_t s = 0; s < specs.size(); ++s) {
    const FormatSpec& spec = specs[s];
    const QuantizedMatrix w1 = make_weights(spec, I, H, 1), w3 = make_weights(spec, I, H, 3), w2 = make_weights(spec, H, I, 2);
    for (const std::string& kernel : o.kernels) {
      if (kernel.rfind("attention", 0) == 0 || kernel == "dense") continue;
      if (kernel == "moe" || kernel == "moe_unfused") {
        bench_moe(o, spec, o.formats[s], kernel == "moe", report, x);
        continue;
      }
      const PackedWeights packed = kernel == "gate_up" ? pack_gate_up(w1, w3) : pack(kernel == "down" ? w2 : w1);
      const int64_t copies = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(double(o.cycle_mb << 20) / packed.weight_bytes())));
      std::vector<PackedWeights> cycle;
      cycle.push_back(clone(packed));
      for (int64_t c = 1; c < copies; ++c) cycle.push_back(clone(packed));
      std::vector<PackedWeights*> all;  // every copy in one arena (a small matrix has thousands of copies)
      for (PackedWeights& w : cycle) all.push_back(&w);
      onto_huge_pages(all);
      for (int64_t T : o.tokens) {
        const Timed timed = median_call_seconds(o.repeats, o.sample_ms, o.cpu_clock, [&](int64_t i) {
          const PackedWeights& w = cycle[i % copies];
          if (kernel == "w1") packed_matmul(x.data(), T, w, h.data());
          else if (kernel == "gate_up") expert_gate_up(x.data(), T, w, h.data());
          else expert_down_accumulate(x.data(), T, w, route.data(), out_rows.data(), out.data(), H);
        }, [&](int64_t i, StepReads& out) { tools::add_reads(out, cycle[i % copies]); });
        KernelBenchRow r;
        r.kernel = kernel;
        r.format = o.formats[s];
        r.isa = std::string(isa_name(row_isa(spec.format, T)));
        r.tokens = T;
        r.rows = kernel == "down" ? H : I;
        r.cols = kernel == "down" ? I : H;
        r.weight_bytes = static_cast<double>(packed.weight_bytes());
        r.flops = 2.0 * T * r.rows * r.cols * (kernel == "gate_up" ? 2 : 1);
        finish_row(r, report, timed, compute_peak(report, spec.format, T));
        report.rows.push_back(r);
      }
    }
  }
  return report;
}

}  // namespace moex::kernels
