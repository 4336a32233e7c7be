// `moex bench e2e`: a llama-bench-like table of the whole model per expert weight format: pp<N> (one prompt
// of N tokens in one forward call), tg<N> (N decode steps of one sequence) and decode at batch B (B sequences,
// one token each per step), each against its roofline from probes run in the same process just before the
// format's rows: read bandwidth for the bytes a step reads (each format's own bytes, scales included), the
// peak of the dot-product instruction each part's FLOPs run on (the experts' on their format's: vpdpbusd for
// int8-w8a8 / int4-w4a8, vdpbf16ps otherwise; the rest, attention projections, attention and lm_head, on the
// --dense-weights format's), and for a step the slower of the two: roofline time = max(bytes / read, expert
// FLOPs / expert peak + other FLOPs / dense peak). The tg and decode bB
// rows' read term is the replay probe's time instead (docs/kernels.md): the weight ranges each step of the
// measured run read, streamed again in the same order over the same steps, so a cache that holds part of them
// serves the probe as it served the model, and the bytes are read from the pages the kernels read them from.
// The plain DRAM probe stays as a second column (%dram). %parts sums the experts' and the rest's own bounds
// (E2eRow::parts_roof_seconds), for steps where one is bound by its bytes and the other by its FLOPs.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "moex/base/error.h"
#include "moex/base/threads.h"
#include "moex/model/decoder.h"
#include "moex/runtime/generation.h"
#include "tools/lib/kernel_bench.h"
#include "tools/lib/probes.h"
#include "tools/lib/read_replay.h"
#include "tools/lib/synthetic.h"
#include "tools/moex/bench.h"
#include "tools/moex/model_flags.h"

namespace moex::tools {
namespace {

struct E2EFlags {
  ModelFlags model;
  std::vector<std::string> weights = {"as-stored", "bf16", "int8", "int8-w8a8", "int4", "int4-w4a8", "fp8"};
  int prompt_tokens = 512;      // pp
  int generate_tokens = 128;    // tg (batch 1)
  std::vector<int> batches = {16, 64};
  int batch_steps = 16;         // decode steps per timed run at batch > 1
  int repeats = 3;
  size_t roofline_mb = 1024;
  bool cpu_clock = false;
  bool json = false;
};

struct Probes {
  double read_bytes_per_s = 0, bf16_flops = 0, vnni_ops = 0, maddubs_ops = 0, fma_flops = 0;
  double amx_bf16_flops = 0, amx_int8_ops = 0;  // AMX tiles (0 without them)
  kernels::ReadProbe read;
  double clock_hz = 0;
  kernels::PeakResult bf16, vnni, fma, amx_bf16;  // the best runs, for describe_probes
};

Probes measure_probes(const E2EFlags& f) {
  Probes p;
  p.read = kernels::read_probe(f.roofline_mb << 20, f.repeats, f.cpu_clock);
  p.read_bytes_per_s = p.read.bytes_per_s;
  p.clock_hz = kernels::core_clock_hz();
  const kernels::PeakSet peaks = kernels::best_peaks(f.cpu_clock);
  p.bf16 = peaks.bf16;
  p.vnni = peaks.vnni;
  p.fma = peaks.fma;
  p.amx_bf16 = peaks.amx_bf16;
  p.bf16_flops = peaks.bf16.per_second;
  p.vnni_ops = peaks.vnni.per_second;
  p.maddubs_ops = peaks.maddubs.per_second;
  p.fma_flops = peaks.fma.per_second;
  p.amx_bf16_flops = peaks.amx_bf16.per_second;
  p.amx_int8_ops = peaks.amx_int8.per_second;
  return p;
}

// The experts' share of flops_per_token: k experts' three matrices per layer.
double expert_flops_per_token(const ModelConfig& c) {
  return 2.0 * c.num_hidden_layers * c.num_experts_per_tok * 3.0 * c.hidden_size * c.intermediate_size;
}

// FLOPs of one token through the model: 2 per weight it multiplies (attention projections, router, k
// experts, lm_head when its logits are wanted) plus attention over `context` cached positions.
double flops_per_token(const ModelConfig& c, double context, bool logits) {
  const double d = c.hidden_size, I = c.intermediate_size, hd = c.head_dim, H = c.num_attention_heads,
               KV = c.num_key_value_heads;
  const double per_layer = d * (H + 2 * KV) * hd + H * hd * d + c.num_local_experts * d +
                           c.num_experts_per_tok * 3.0 * d * I;
  return 2.0 * (c.num_hidden_layers * per_layer + (logits ? static_cast<double>(c.vocab_size) * d : 0.0)) +
         4.0 * c.num_hidden_layers * H * hd * context;
}

struct E2eRow {
  std::string weights, test;
  std::string dense;           // the dense layers' format (--dense-weights resolved for this row)
  int batch = 1, tokens = 0;   // tokens per timed unit (pp: the prompt; decode: per step)
  double seconds = 0;          // per unit (pp: the prompt; tg / decode: one step)
  double bytes = 0, flops = 0; // per unit
  double expert_flops = 0;     // per unit: the part of `flops` the experts compute
  double expert_bytes = 0;     // per unit: the part of `bytes` the experts read (the experts with a row)
  double peak = 0;             // FLOP/s of the instruction the experts' kernels sum with
  double dense_peak = 0;       // FLOP/s of the dense layers' (--dense-weights) instruction, for the other FLOPs
  Probes probes;
  double replay_seconds = 0;   // per unit: the replay probe over the run's own reads (tg, decode rows; 0: none)
  double read_before = 0, read_after = 0;  // the read probe before and after the format's rows (bytes/s)
  RepeatStats repeats;         // tg rows: what the run's reads repeat from step to step
  std::string geometry;        // the model's shapes, e.g. "hidden 4096, intermediate 14336, 8 experts top-2, 2 layers"
  double tokens_per_s() const { return tokens / seconds; }
  // The read term: the replay probe's time where it ran, else bytes over the DRAM probe.
  double read_seconds() const { return replay_seconds > 0 ? replay_seconds : bytes / probes.read_bytes_per_s; }
  // Each part's FLOPs at its own instruction's peak: W8A8 experts beside bf16 dense layers cannot run all of
  // their FLOPs at vpdpbusd's rate.
  double compute_seconds() const { return expert_flops / peak + (flops - expert_flops) / dense_peak; }
  double roof_seconds() const { return std::max(read_seconds(), compute_seconds()); }
  double dram_roof_seconds() const { return std::max(bytes / probes.read_bytes_per_s, compute_seconds()); }
  // The parts one after the other: the experts' max(bytes / read, FLOPs / peak) plus the rest's (attention
  // projections, attention, router, lm_head), both read at the row's read rate (bytes / read_seconds()). The
  // engine runs the parts in sequence, so this too is a lower bound on the step's time, and a tighter one where
  // one part is bound by its bytes and the other by its FLOPs: at batch 16 on the Mixtral geometry the W8A8
  // experts are read-bound while the bf16 dense layers' 16 rows are vdpbf16ps-bound, and the step cannot take
  // less than the sum of the two (roof_seconds() counts the larger of the step's totals only).
  double parts_roof_seconds() const {
    const double rate = bytes / read_seconds(), rest_bytes = std::max(0.0, bytes - expert_bytes);
    return std::max(expert_bytes / rate, expert_flops / peak) +
           std::max(rest_bytes / rate, (flops - expert_flops) / dense_peak);
  }
  const char* bound() const {
    if (read_seconds() < compute_seconds()) return "compute";
    return replay_seconds > 0 ? "replay" : "read";
  }
};

// The experts' bytes one step reads: per layer, every expert with a token in the last call.
double expert_bytes_read(const DecoderModel& m) {
  double total = 0;
  for (size_t l = 0; l < m.weights().layers.size(); ++l) {
    const MoELayerWeights& w = m.weights().layers[l].moe;
    const double expert = w.packed.empty()
                              ? static_cast<double>(w.local[0].w1.bytes() + w.local[0].w3.bytes() + w.local[0].w2.bytes())
                              : static_cast<double>(w.packed[0].w13.weight_bytes() + w.packed[0].w2.weight_bytes());
    int used = 0;
    for (int e = 0; e < w.experts.count; ++e) used += m.moe_stats()[l].tokens_per_expert[w.experts.first + e] > 0;
    total += used * expert;
  }
  return total;
}

double expert_bytes_per_token(const DecoderModel& m) {
  double total = 0;
  for (const LayerWeights& l : m.weights().layers) {
    const MoELayerWeights& w = l.moe;
    const double expert = w.packed.empty()
                              ? static_cast<double>(w.local[0].w1.bytes() + w.local[0].w3.bytes() + w.local[0].w2.bytes())
                              : static_cast<double>(w.packed[0].w13.weight_bytes() + w.packed[0].w2.weight_bytes());
    total += std::min(m.config().num_experts_per_tok, w.experts.count) * expert;
  }
  return total;
}

std::vector<E2eRow> bench_format(const E2EFlags& f, const std::string& weights) {
  ModelFlags mf = f.model;
  mf.weights = weights;
  if (weights != "int4" && weights != "int4-w4a8") mf.group_size_option = nullptr;  // --group-size is int4's
  int max_batch = 1;
  for (int b : f.batches) max_batch = std::max(max_batch, b);
  mf.max_seq_len = std::max({f.prompt_tokens, f.generate_tokens, f.batch_steps}) + 2;
  mf.max_step_tokens = std::max(f.prompt_tokens, max_batch);
  const std::unique_ptr<DecoderModel> model = mf.load(max_batch);
  const ModelConfig& c = model->config();
  const std::string name = model->options().expert_weights.name();
  const Probes probes = measure_probes(f);
  // The best instruction the CPU has: AMX tiles, else the AVX-512 dot products. A CPU without them (AVX2 only, or
  // AVX-512 without BF16) is bounded by f32 FMAs, or for the int8 activations by vpmaddubsw (AVX2 without VNNI).
  const auto peak_of = [&](const ExpertWeightFormat& format) {
    const bool int8_activations =
        format.format == kernels::WeightFormat::kInt8W8A8 || format.format == kernels::WeightFormat::kInt4W4A8;
    double p = int8_activations ? std::max(probes.amx_int8_ops, probes.vnni_ops)
                                : std::max(probes.amx_bf16_flops, probes.bf16_flops);
    if (p <= 0 && int8_activations) p = probes.maddubs_ops;
    if (p <= 0) p = probes.fma_flops;
    return p;
  };
  // The experts' instruction (as stored: vdpbf16ps's, the best the CPU has for bf16).
  const bool int8_activations = weights == "int8-w8a8" || weights == "int4-w4a8";
  double peak = int8_activations ? std::max(probes.amx_int8_ops, probes.vnni_ops)
                                 : std::max(probes.amx_bf16_flops, probes.bf16_flops);
  if (peak <= 0 && int8_activations) peak = probes.maddubs_ops;
  if (peak <= 0) peak = probes.fma_flops;
  // The dense layers' (as stored, the exact path on f32 FMAs, at the experts' peak as before: a stricter bound).
  const double dense_peak = model->options().dense_weights.packed ? peak_of(model->options().dense_weights) : peak;
  // Dense bytes per token: everything but the experts (attention, router, norms, lm_head, one embedding row).
  const double dense_bytes = static_cast<double>(model->weight_bytes_per_token()) - expert_bytes_per_token(*model);
  const TimingOptions timing{.repeats = f.repeats, .cpu_clock = f.cpu_clock};
  // Through generate(), the engine every command runs: a prompt's prefill is one step of up to --step-tokens
  // tokens per chunk, each decode step one forward call with a token of every live sequence.
  const auto run = [&](int batch, int prompt_len, int new_tokens) {
    GenerationOptions options;
    options.max_new_tokens = new_tokens;
    options.stop_at_eos = false;
    return generate(*model, synthetic_prompts(batch, prompt_len, c.vocab_size), options);
  };
  std::vector<E2eRow> rows;
  const auto add = [&](const std::string& test, int batch, int units_tokens, double seconds, double bytes,
                       double flops, double expert_flops) {
    // The last forward call's experts: the prompt's, the last tg step's or the last batched step's.
    E2eRow r;
    r.weights = name;
    r.dense = model->options().dense_weights.name();
    r.test = test;
    r.batch = batch;
    r.tokens = units_tokens;
    r.seconds = seconds;
    r.bytes = bytes;
    r.flops = flops;
    r.expert_flops = expert_flops;
    r.expert_bytes = std::min(bytes, expert_bytes_read(*model));
    r.dense_peak = dense_peak;
    r.peak = peak;
    r.probes = probes;
    r.geometry = "hidden " + std::to_string(c.hidden_size) + ", intermediate " + std::to_string(c.intermediate_size) +
                 ", " + std::to_string(c.num_local_experts) + " experts top-" + std::to_string(c.num_experts_per_tok) +
                 ", " + std::to_string(c.num_hidden_layers) + " layers";
    rows.push_back(r);
  };
  if (f.prompt_tokens > 0) {  // the prompt's forward call (its one new token is sampled from that call)
    const int n = f.prompt_tokens;
    const double seconds = measure_median(timing, [&] { run(1, n, 1); }).seconds;
    // Every expert a token chose is read once; attention over n / 2 positions on average; one lm_head row.
    const double flops = n * flops_per_token(c, (n - 1) / 2.0, false) + 2.0 * c.vocab_size * c.hidden_size;
    add("pp" + std::to_string(n), 1, n, seconds, dense_bytes + expert_bytes_read(*model), flops,
        n * expert_flops_per_token(c));
  }
  if (f.generate_tokens > 0) {  // a 1-token prompt, then n - 1 decode steps: n calls of one token
    const int n = f.generate_tokens;
    // One untimed run records what each of its n steps read (greedy: every run routes the same way).
    const std::vector<std::vector<int>> prompts = synthetic_prompts(1, 1, c.vocab_size);
    StepReadRecorder recorder(*model, false);
    GenerationOptions options;
    options.max_new_tokens = n;
    options.stop_at_eos = false;
    options.after_forward = recorder.on_step();
    generate(*model, prompts, options);
    MOEX_CHECK(static_cast<int>(recorder.steps().size()) == n, "recorded ", recorder.steps().size(), " of ", n, " steps");
    const double seconds = measure_median(timing, [&] { run(1, 1, n); }).seconds / n;
    volatile float sink = 0.0f;
    const double replay = measure_median(timing, [&] { sink = sink + kernels::stream_read_steps(recorder.steps()).checksum; }).seconds / n;
    add("tg" + std::to_string(n), 1, 1, seconds, recorder.mean_step_bytes(), flops_per_token(c, (n - 1) / 2.0, true),
        expert_flops_per_token(c));
    rows.back().replay_seconds = replay;
    rows.back().repeats = repeat_stats(recorder.steps());
  }
  for (int batch : f.batches) {
    // B one-token prompts (one call each), then n decode steps of B tokens, timed by generate() itself (its
    // decode loop: the steps' forward calls, sampling and bookkeeping), median over the runs. (The run's time less
    // a run with no steps, as before, put the prompts' ~0.5 s of noise into 8 steps of ~40 ms: b64 moved 58-72%.)
    const int n = f.batch_steps;
    // One untimed run records what each decode step read, as for tg: at batch 16 on Mixtral's geometry that is
    // every expert, gigabytes a step, and the replay reads them where they sit (their pages, as the kernels find
    // them), which a separate probe buffer does not (docs/kernels.md, "Trusting the probes").
    StepReadRecorder recorder(*model, true);
    {
      GenerationOptions options;
      options.max_new_tokens = n + 1;
      options.stop_at_eos = false;
      options.after_forward = recorder.on_step();
      generate(*model, synthetic_prompts(batch, 1, c.vocab_size), options);
    }
    // Each run is followed by the replay of the recorded steps, so the two sample the same moments: on the Zen 4
    // VM the bandwidth the cores get flips between ~35 and ~60 GB/s within seconds, and a replay timed apart
    // from the rows can land in the other state (a bf16 row read 111% of such a replay).
    std::vector<double> replay_samples;
    const double decode_seconds = measure_median_reported(timing, [&] {
      const GenerationResult result = run(batch, 1, n + 1);
      MOEX_CHECK(result.decode_steps == n, "decode b", batch, ": ", result.decode_steps, " steps of ", n);
      replay_samples.push_back(timed_replay(recorder.steps(), f.cpu_clock));
      return result.decode_seconds;
    }).seconds;
    const double seconds = std::max(decode_seconds, 1e-9) / n;
    // The last call was a decode step of the batch: its distinct experts per layer are what a step reads.
    add("decode b" + std::to_string(batch), batch, batch, seconds, dense_bytes + expert_bytes_read(*model),
        batch * flops_per_token(c, n / 2.0, true), batch * expert_flops_per_token(c));
    if (!recorder.steps().empty()) {
      if (replay_samples.size() > 1) replay_samples.erase(replay_samples.begin());  // the warm-up's, as the rows'
      std::sort(replay_samples.begin(), replay_samples.end());
      rows.back().replay_seconds =
          replay_samples[replay_samples.size() / 2] / static_cast<double>(recorder.steps().size());
      rows.back().bytes = recorder.mean_step_bytes();
      rows.back().repeats = repeat_stats(recorder.steps());
    }
  }
  // The read probe again after the rows: on the Zen 4 VM it read ~35 GB/s in one format's probe and ~60 in the
  // next format's, minutes apart, with the buffer on huge pages both times; the better of the two moments is the
  // DRAM probe (%dram), and both are printed.
  const kernels::ReadProbe after = kernels::read_probe(f.roofline_mb << 20, f.repeats, f.cpu_clock);
  for (E2eRow& r : rows) {
    r.read_before = probes.read.bytes_per_s;
    r.read_after = after.bytes_per_s;
    if (after.bytes_per_s > r.probes.read_bytes_per_s) {
      r.probes.read = after;
      r.probes.read_bytes_per_s = after.bytes_per_s;
    }
  }
  return rows;
}

void run_e2e(E2EFlags& f) {
  MOEX_CHECK_INPUT(f.repeats >= 1, "--repeats must be >= 1");
  MOEX_CHECK_INPUT(f.prompt_tokens >= 0 && f.prompt_tokens <= kMaxBenchTokens && f.generate_tokens >= 0 &&
                       f.generate_tokens <= kMaxBenchTokens,
                   "--pp and --tg must be in 0..", kMaxBenchTokens);
  MOEX_CHECK_INPUT(f.batch_steps >= 1 && f.batch_steps <= kMaxBenchTokens, "--batch-steps must be in 1..", kMaxBenchTokens);
  for (int b : f.batches) MOEX_CHECK_INPUT(b >= 1 && b <= 4096, "--batches: ", b, " must be in 1..4096");
  MOEX_CHECK_INPUT(!f.weights.empty(), "--weights needs at least one format");
  for (const std::string& w : f.weights)
    MOEX_CHECK_INPUT(w == "as-stored" || w == "bf16" || w == "int8" || w == "int8-w8a8" || w == "int4" ||
                         w == "int4-w4a8" || w == "fp8",
                     "--weights ", w, ": use as-stored, bf16, int8, int8-w8a8, int4, int4-w4a8 or fp8");
  MOEX_CHECK_INPUT(f.model.group_size_option == nullptr || f.model.group_size_option->count() == 0 ||
                       std::find(f.weights.begin(), f.weights.end(), "int4") != f.weights.end() ||
                       std::find(f.weights.begin(), f.weights.end(), "int4-w4a8") != f.weights.end(),
                   "--group-size applies to --weights int4 or int4-w4a8 only");
  MOEX_CHECK_INPUT(f.roofline_mb >= 64 && f.roofline_mb <= 65536, "--roofline-mb must be in 64..65536");
  MOEX_CHECK_INPUT(f.model.world().size() == 1, "bench e2e runs on one rank");
  f.model.ThreadsFlags::apply();
  // Each format's load applies the flags again: with the count fixed, not re-derived from an affinity that
  // pinning has already narrowed to one CPU.
  f.model.threads = num_threads();
  MOEX_CHECK_INPUT(!f.cpu_clock || num_threads() == 1, "--cpu-clock times one thread: add --threads 1");
  std::vector<E2eRow> rows;
  for (const std::string& w : f.weights) {
    const std::vector<E2eRow> r = bench_format(f, w);
    rows.insert(rows.end(), r.begin(), r.end());
    if (!f.json) {
      const Probes& p = r.front().probes;
      std::fprintf(stderr, "%s (%s; dense layers %s, KV cache %s): probes read %.1f GB/s, vdpbf16ps %.0f GFLOPS, vpdpbusd %.0f GOPS, "
                   "vpmaddubsw %.0f GOPS, vfmadd %.0f GFLOPS, AMX tdpbf16ps %.0f GFLOPS, tdpbusd %.0f GOPS\n",
                   r.front().weights.c_str(), r.front().geometry.c_str(), r.front().dense.c_str(),
                   f.model.kv_cache_dtype.c_str(), p.read_bytes_per_s / 1e9, p.bf16_flops / 1e9, p.vnni_ops / 1e9,
                   p.maddubs_ops / 1e9, p.fma_flops / 1e9, p.amx_bf16_flops / 1e9, p.amx_int8_ops / 1e9);
      std::fprintf(stderr, "%s", kernels::describe_probes(p.read, p.clock_hz, p.bf16, p.vnni, p.fma, p.amx_bf16).c_str());
      std::fprintf(stderr, "read probe before the rows %.1f GB/s, after them %.1f GB/s (the better is the DRAM probe); "
                   "buffer %.0f of %.0f MB on huge pages\n", r.front().read_before / 1e9, r.front().read_after / 1e9,
                   p.read.huge_page_bytes / 1048576.0, p.read.bytes / 1048576.0);
      for (const E2eRow& row : r)
        if (row.replay_seconds > 0)
          std::fprintf(stderr, "%s %s: %.1f MB/step, %.1f MB of it (%.0f%%) read by the step before too; %.1f MB "
                       "distinct over the run; replay %.1f GB/s\n", row.weights.c_str(), row.test.c_str(),
                       row.bytes / 1e6, row.repeats.repeated_bytes / 1e6,
                       100.0 * row.repeats.repeated_bytes / row.repeats.step_bytes, row.repeats.distinct_bytes / 1e6,
                       row.bytes / row.replay_seconds / 1e9);
    }
  }
  if (f.json) {
    nlohmann::json out = nlohmann::json::array();
    for (const E2eRow& r : rows) {
      nlohmann::json row = {{"weights", r.weights}, {"test", r.test}, {"batch", r.batch}, {"ms", r.seconds * 1e3},
                            {"geometry", r.geometry}, {"tokens_per_s", r.tokens_per_s()}, {"roofline_tokens_per_s", r.tokens / r.roof_seconds()},
                            {"pct_roofline", 100.0 * r.roof_seconds() / r.seconds}, {"bound", r.bound()},
                            {"pct_dram_roofline", 100.0 * r.dram_roof_seconds() / r.seconds},
                            {"pct_parts_roofline", 100.0 * r.parts_roof_seconds() / r.seconds},
                            {"expert_bytes", r.expert_bytes},
                            {"bytes", r.bytes}, {"flops", r.flops}, {"read_gb_per_s", r.probes.read_bytes_per_s / 1e9},
                            {"read_before_gb_per_s", r.read_before / 1e9}, {"read_after_gb_per_s", r.read_after / 1e9},
                            {"peak_gflops", r.peak / 1e9}, {"dense_peak_gflops", r.dense_peak / 1e9},
                            {"expert_flops", r.expert_flops}, {"vdpbf16ps_gflops", r.probes.bf16_flops / 1e9},
                            {"vpdpbusd_gops", r.probes.vnni_ops / 1e9}, {"amx_bf16_gflops", r.probes.amx_bf16_flops / 1e9},
                            {"amx_int8_gops", r.probes.amx_int8_ops / 1e9}};
      if (r.replay_seconds > 0) {
        row["replay_ms"] = r.replay_seconds * 1e3;
        row["replay_gb_per_s"] = r.bytes / r.replay_seconds / 1e9;
        row["repeated_bytes_per_step"] = r.repeats.repeated_bytes;  // also read by the step before
        row["distinct_bytes"] = r.repeats.distinct_bytes;           // over the whole run
      }
      out.push_back(row);
    }
    std::printf("%s\n", nlohmann::json{{"model", f.model.model_dir}, {"threads", num_threads()},
                                       {"cpu_clock", f.cpu_clock}, {"results", out}}.dump().c_str());
    return;
  }
  std::printf("%-10s %-12s %10s %11s %12s %7s %7s %7s %-8s %9s %9s %9s\n", "weights", "test", "ms", "tok/s",
              "roof tok/s", "%roof", "%parts", "%dram", "bound", "MB/step", "replayGB/s", "GFLOP");
  for (const E2eRow& r : rows) {
    char replay[16] = "-";
    if (r.replay_seconds > 0) std::snprintf(replay, sizeof replay, "%.1f", r.bytes / r.replay_seconds / 1e9);
    std::printf("%-10s %-12s %10.2f %11.1f %12.1f %7.1f %7.1f %7.1f %-8s %9.1f %9s %9.2f\n", r.weights.c_str(),
                r.test.c_str(), r.seconds * 1e3, r.tokens_per_s(), r.tokens / r.roof_seconds(),
                100.0 * r.roof_seconds() / r.seconds, 100.0 * r.parts_roof_seconds() / r.seconds,
                100.0 * r.dram_roof_seconds() / r.seconds, r.bound(),
                r.bytes / 1e6, replay, r.flops / 1e9);
  }
  for (const E2eRow& r : rows)  // a row faster than its roofline: the probe, not the model, is wrong
    if (r.parts_roof_seconds() > r.seconds)
      std::printf("PROBE TOO LOW: %s %s at %.1f%% of its roofline, %.1f%% of the parts' (%s)\n", r.weights.c_str(),
                  r.test.c_str(), 100.0 * r.roof_seconds() / r.seconds, 100.0 * r.parts_roof_seconds() / r.seconds,
                  r.bound());
  std::printf("%d threads%s, median of %d runs after a warm-up. ms: per prompt (pp) or per step. roof: max(read time, "
              "FLOPs / peak), each part's FLOPs at its own instruction's peak (the experts' at their format's, the rest at the dense layers' format's): AMX tdpbusd's or else vpdpbusd's for int8-w8a8 / int4-w4a8 (vpmaddubsw's without VNNI), AMX tdpbf16ps's or else vdpbf16ps's otherwise (vfmadd's on a CPU without them); the read time is the replay "
              "probe's (tg, decode bB: the run's own weight reads streamed again, same order, same steps) or bytes / DRAM probe; "
              "%%roof = roof time / time; %%parts: the experts' max(read, FLOPs / peak) plus the rest's, at the same read rate, over the time; %%dram: %%roof with bytes / DRAM probe.\n",
              num_threads(), f.cpu_clock ? " (CPU clock)" : "", f.repeats);
}

void setup_e2e_bench(CLI::App& bench) {
  auto f = std::make_shared<E2EFlags>();
  auto* cmd = bench.add_subcommand("e2e", "pp / tg / batched decode of the whole model per weight format, "
                                          "against read and dot-product rooflines measured in the same run");
  // Every command's defaults (model_flags.h): `--dense-weights auto` (bf16 dense layers for a bf16 checkpoint);
  // `--dense-weights experts` runs them in each row's expert format (int8-w8a8's through vpdpbusd too);
  // `--dense-weights as-stored --kv-cache-dtype f32` is the exact path.
  f->model.add_to(cmd);
  cmd->remove_option(cmd->get_option("--weights"));  // a list here
  f->model.weights_option = nullptr;
  cmd->remove_option(cmd->get_option("--exact"));  // the rows name their formats; the exact path is as-stored with
                                                    // --dense-weights as-stored --kv-cache-dtype f32
  add_list_flag(cmd, "--weights", f->weights, "Expert weight formats: as-stored, bf16, int8, int8-w8a8, int4, int4-w4a8, fp8");
  cmd->add_option("--pp", f->prompt_tokens, "Prompt tokens of the prefill test (0: skip)")->capture_default_str();
  cmd->add_option("--tg", f->generate_tokens, "Decode steps of the batch-1 test (0: skip)")->capture_default_str();
  add_list_flag(cmd, "--batches", f->batches, "Batch sizes of the batched decode tests");
  cmd->add_option("--batch-steps", f->batch_steps, "Decode steps per timed run at batch > 1")->capture_default_str();
  cmd->add_option("--repeats", f->repeats, "Timed runs per test (median reported)")->capture_default_str();
  cmd->add_option("--roofline-mb", f->roofline_mb, "Read-probe buffer")->capture_default_str();
  cmd->add_flag("--cpu-clock", f->cpu_clock, "Time on the thread's CPU clock (with --threads 1), for a loaded machine");
  cmd->add_flag("--json", f->json, "Machine-readable output");
  cmd->callback([f] { run_e2e(*f); });
}
MOEX_REGISTER_BENCH(setup_e2e_bench);

}  // namespace
}  // namespace moex::tools
