// `moex bench roofline` and `moex bench decode`: batch-B decode throughput as a fraction of the memory
// read roofline measured in the same run (bytes of weights one step touches / measured read bandwidth), and
// against the replay probe: the weight ranges each decode step of a run read, streamed again in the same order
// over the same steps, the least time any kernel could take for them in that cache state (docs/kernels.md).
#include <sys/mman.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "moex/base/error.h"
#include "moex/base/system_memory.h"
#include "moex/base/threads.h"
#include "tools/lib/kernel_bench.h"
#include "tools/lib/probes.h"
#include "moex/runtime/generation.h"
#include "tools/lib/read_replay.h"
#include "tools/moex/bench.h"
#include "tools/moex/model_flags.h"
#include "tools/moex/profile_flags.h"

namespace moex::tools {
namespace {

struct RooflineFlags {
  size_t megabytes = 2048;
  int repeats = 5;
  ThreadsFlags threads;
  bool cpu_clock = false;
  bool json = false;
};

// The probe's buffer is allocated and touched in full: refuse one the machine cannot hold.
void check_roofline_buffer(size_t megabytes, const char* flag) {
  MOEX_CHECK_INPUT(megabytes >= 1 && megabytes <= (size_t{1} << 30), flag, " ", megabytes, " must be in 1..",
                   size_t{1} << 30);
  check_fits_in_memory(static_cast<double>(megabytes << 20), std::string("the roofline probe (") + flag + " " +
                                                                std::to_string(megabytes) + ")",
                       std::string("lower ") + flag);
}

void run_roofline(const RooflineFlags& f) {
  MOEX_CHECK_INPUT(f.repeats >= 1, "--repeats must be >= 1");
  f.threads.apply();
  check_roofline_buffer(f.megabytes, "--buffer-mb");
  MOEX_CHECK_INPUT(!f.cpu_clock || num_threads() == 1, "--cpu-clock times one thread: add --threads 1");
  const double bandwidth = kernels::read_bandwidth(f.megabytes << 20, f.repeats, f.cpu_clock);
  if (f.json) {
    std::printf("%s\n", nlohmann::json{{"buffer_mb", f.megabytes}, {"threads", num_threads()}, {"cpu_clock", f.cpu_clock},
                                       {"read_gb_per_s", bandwidth / 1e9}}.dump().c_str());
  } else {
    std::printf("memory read roofline: %.2f GB/s (buffer %zu MB, %d threads, median of %d)\n", bandwidth / 1e9,
                f.megabytes, num_threads(), f.repeats);
  }
}

struct DecodeFlags : SyntheticRunFlags {
  DecodeFlags() : SyntheticRunFlags(16) {}
  ModelFlags model;
  int repeats = 5;
  size_t roofline_mb = 2048;
  bool json = false;
  ProfileFlags profile;
};

void run_decode(DecodeFlags& f) {
  f.check();
  MOEX_CHECK_INPUT(f.repeats >= 1, "--repeats must be >= 1");
  check_roofline_buffer(f.roofline_mb, "--roofline-mb");
  f.model.max_seq_len = std::max(f.model.max_seq_len, f.prompt_len + f.steps + 1);
  auto model = f.model.load(f.batch);
  const ModelConfig& c = model->config();
  const std::vector<std::vector<int>> prompts = f.prompts(c.vocab_size);
  GenerationOptions options;
  options.max_new_tokens = f.steps;
  options.stop_at_eos = false;
  std::vector<double> step_seconds, run_seconds;  // per repeat: mean decode step; prefill + decode
  // The replay probe's recording: one untimed run, outside the profile, records each decode step's reads
  // (greedy: the timed runs route the same way).
  StepReadRecorder recorder(*model, /*skip_prefill=*/true);
  GenerationOptions recording = options;
  recording.after_forward = recorder.on_step();
  generate(*model, prompts, recording);
  f.profile.start();
  // Median over repeats of the mean decode step time (each repeat re-prefills: same positions, same work).
  measure_median({.repeats = f.repeats}, [&] {
    const GenerationResult r = generate(*model, prompts, options);
    step_seconds.push_back(r.decode_seconds / std::max<int64_t>(r.decode_steps, 1));
    run_seconds.push_back(r.prefill_seconds + r.decode_seconds);
    if (step_seconds.size() == 1) f.profile.after_warmup();  // the profile covers the timed runs only
  });
  const size_t warm = step_seconds.size() > 1 ? 1 : 0;  // drop the warm-up run (unless it is the only one)
  std::vector<double> sorted(step_seconds.begin() + warm, step_seconds.end());
  std::sort(sorted.begin(), sorted.end());
  const double step = sorted[sorted.size() / 2];
  // With its prefill: the batch's new tokens over prefill + decode, what a server's output throughput
  // counts (`bench serve` at concurrency B, --input-len prompt-len, --output-len steps): generate() runs the
  // server's engine, whose prefill steps hold several prompts' chunks.
  std::vector<double> runs(run_seconds.begin() + warm, run_seconds.end());
  std::sort(runs.begin(), runs.end());
  const double with_prefill_tokens_per_s = static_cast<double>(f.batch) * f.steps / runs[runs.size() / 2];
  const double bandwidth = kernels::read_bandwidth(f.roofline_mb << 20, 5, false);
  // Bytes one step reads: the batch's distinct experts could be more than k, but at batch 1 it is exactly k.
  const double bytes = static_cast<double>(model->weight_bytes_per_token());
  const double roofline_step = bytes / bandwidth;
  volatile float sink = 0.0f;
  const bool replayed = !recorder.steps().empty();  // --steps 1: the prompt's call only, no decode step
  const double replay_step =
      replayed ? measure_median({.repeats = f.repeats},
                                [&] { sink = sink + kernels::stream_read_steps(recorder.steps()).checksum; })
                         .seconds / static_cast<double>(recorder.steps().size())
               : 0.0;
  const double replay_bytes = recorder.mean_step_bytes();
  const double tokens_per_s = f.batch / step;
  if (f.json) {
    nlohmann::json out{{"batch", f.batch}, {"threads", num_threads()}, {"step_ms", step * 1e3},
                                       {"tokens_per_s", tokens_per_s},
                                       {"with_prefill_tokens_per_s", with_prefill_tokens_per_s},
                                       {"weight_bytes_per_step", bytes},
                                       {"read_gb_per_s", bandwidth / 1e9},
                                       {"achieved_gb_per_s", bytes / step / 1e9},
                                       {"roofline_fraction", roofline_step / step}};
    if (replayed) {
      out["replay_bytes_per_step"] = replay_bytes;
      out["replay_ms_per_step"] = replay_step * 1e3;
      out["replay_gb_per_s"] = replay_bytes / replay_step / 1e9;
      out["replay_roofline_fraction"] = replay_step / step;
    }
    std::printf("%s\n", out.dump().c_str());
    f.profile.finish(stderr);  // stdout stays one JSON line
    return;
  }
  std::printf("decode batch %d: %.2f ms/step, %.1f tokens/s (median of %d runs of %d steps; experts %s, dense %s)\n",
              f.batch, step * 1e3, tokens_per_s, f.repeats, f.steps, model->options().expert_weights.name().c_str(),
              model->options().dense_weights.name().c_str());
  std::printf("with the prefill of its %d-token prompts: %.1f tokens/s (%d new tokens per sequence / prefill + decode)\n",
              f.prompt_len, with_prefill_tokens_per_s, f.steps);
  std::printf("weights read per step: %.1f MB (attention, router, %d of %d experts, lm_head)\n", bytes / 1e6,
              c.num_experts_per_tok, c.num_local_experts);
  std::printf("achieved %.2f GB/s of a %.2f GB/s measured read roofline = %.0f%% of roofline\n", bytes / step / 1e9,
              bandwidth / 1e9, 100.0 * roofline_step / step);
  if (f.batch > 1) std::printf("(batch > 1 may touch more than k experts per layer: the percentage is a lower bound)\n");
  if (replayed)
    std::printf("replay probe: the %zu decode steps' own reads (%.1f MB/step, experts as routed) streamed again in "
              "%.3f ms/step, %.2f GB/s = %.0f%% of the replay roofline\n",
              recorder.steps().size(), replay_bytes / 1e6, replay_step * 1e3, replay_bytes / replay_step / 1e9,
              100.0 * replay_step / step);
  f.profile.finish();
}

void setup_decode_benches(CLI::App& bench) {
  auto roofline = std::make_shared<RooflineFlags>();
  auto* r = bench.add_subcommand("roofline", "Measure the memory read bandwidth (the decode roofline)");
  r->add_option("--buffer-mb", roofline->megabytes,
                "Buffer size, re-read every pass: far above the L3 for DRAM, below it for the cache's bandwidth")
      ->capture_default_str();
  r->add_option("--repeats", roofline->repeats, "Passes (median reported)")->capture_default_str();
  roofline->threads.add_to(r);
  r->add_flag("--cpu-clock", roofline->cpu_clock, "Time on the thread's CPU clock (with --threads 1), for a loaded machine");
  r->add_flag("--json", roofline->json, "Machine-readable output");
  r->callback([roofline] { run_roofline(*roofline); });

  auto decode = std::make_shared<DecodeFlags>();
  auto* d = bench.add_subcommand("decode", "Decode throughput against the memory roofline, measured in one run");
  decode->model.add_to(d);
  decode->SyntheticRunFlags::add_to(d, "Decode steps per run");
  d->add_option("--repeats", decode->repeats, "Runs (median reported)")->capture_default_str();
  d->add_option("--roofline-mb", decode->roofline_mb, "Roofline probe buffer")->capture_default_str();
  d->add_flag("--json", decode->json, "Machine-readable output");
  decode->profile.add_to(d);
  d->callback([decode] { run_decode(*decode); });
}
MOEX_REGISTER_BENCH(setup_decode_benches);

}  // namespace
}  // namespace moex::tools
