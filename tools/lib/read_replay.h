// The replay roofline of the benchmarks (docs/kernels.md, "Probes"): which weight bytes each forward step of
// a measured run read, recorded after each engine step's forward (GenerationOptions::after_forward), for kernels::stream_read_steps to
// stream again in the same order over the same sequence of steps.
#pragma once
#include <cstdint>
#include <functional>
#include <set>
#include <vector>

#include "moex/kernels/packed.h"
#include "moex/model/decoder.h"
#include "moex/runtime/step_protocol.h"
#include "tools/lib/probes.h"

namespace moex::tools {

// The weight bytes one forward step of `model` read, in the order the forward pass reads them: the embedding
// rows of the step's input `tokens`; per layer its norms, q/k/v projections (and biases, q/k norms), o
// projection, router (and its correction bias), the experts that got a token in the last forward call
// (`moe_stats()`; codes, scales, offsets and column sums when packed: all gate/up then all down, as
// fused_experts reads them), shared expert or dense MLP; the final norm and lm_head. One rank, whole
// (contiguous) views. KV-cache reads are not weights and not included.
kernels::StepReads step_weight_reads(const DecoderModel& model, const std::vector<int32_t>& tokens);
size_t bytes_of(const kernels::StepReads& step);
// Appends what a kernel reads of a packed matrix: its codes, scales, offsets and column sums (those it has).
void add_reads(kernels::StepReads& reads, const kernels::PackedWeights& p);
// One replay of `steps` (kernels::stream_read_steps) with each of its splits, timed on now_seconds(cpu_clock):
// the faster one's seconds. The benchmarks
// run it right after each timed sample of what they judge, so the row and its read roofline sample the same
// moments (on the Zen 4 VM the read rate flips between ~35 and ~60 GB/s within seconds).
double timed_replay(const std::vector<kernels::StepReads>& steps, bool cpu_clock);

// What a run's reads repeat (ranges compared by start and length): the mean bytes per step, the mean of
// each step's bytes that the step before read too (steps 1..n-1), and the distinct bytes of the whole run.
struct RepeatStats {
  double step_bytes = 0, repeated_bytes = 0, distinct_bytes = 0;
};
RepeatStats repeat_stats(const std::vector<kernels::StepReads>& steps);

// Records the steps of generate() runs: pass on_step() as GenerationOptions::after_forward. Each step's
// reads are taken right after its forward, from its input tokens and the experts it routed to.
// skip_prefill drops the prefill steps (a step with a prompt chunk: not what a decode step reads).
class StepReadRecorder {
 public:
  StepReadRecorder(const DecoderModel& model, bool skip_prefill);
  std::function<void(const StepInput&, StepKind)> on_step();
  const std::vector<kernels::StepReads>& steps() const { return steps_; }
  double mean_step_bytes() const;

 private:
  const DecoderModel& model_;
  bool skip_prefill_;
  std::vector<kernels::StepReads> steps_;
};

}  // namespace moex::tools
