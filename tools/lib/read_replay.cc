#include "tools/lib/read_replay.h"

#include "moex/base/error.h"

namespace moex::tools {
namespace {

void add(kernels::StepReads& reads, const TensorView& v) {
  if (v.data && v.numel() > 0) reads.push_back({v.data, v.bytes()});
}

void add(kernels::StepReads& reads, const kernels::PackedWeights& p) { add_reads(reads, p); }

void add(kernels::StepReads& reads, const DenseWeight& w) {
  if (w.packed) add_reads(reads, *w.packed);
  else add(reads, w.view);
}

}  // namespace

void add_reads(kernels::StepReads& reads, const kernels::PackedWeights& p) {
  for (const kernels::AlignedBytes* b : {&p.data, &p.scales, &p.offsets, &p.col_sums})
    if (b->size > 0) reads.push_back({b->ptr.get(), b->size});
}

double timed_replay(const std::vector<kernels::StepReads>& steps, bool cpu_clock) {
  static volatile float sink = 0.0f;  // keeps the loads
  // The faster of the two ways threads can share the bytes: a kernel that splits each matrix's rows reads like
  // the one, a kernel whose threads take whole experts like the other, and a roofline must bound both.
  double best = 0;
  for (kernels::ReplaySplit split : {kernels::ReplaySplit::kEachRange, kernels::ReplaySplit::kEachStep}) {
    const double t0 = kernels::now_seconds(cpu_clock);
    sink = sink + kernels::stream_read_steps(steps, split).checksum;
    const double t = kernels::now_seconds(cpu_clock) - t0;
    if (best == 0 || t < best) best = t;
  }
  return best;
}

kernels::StepReads step_weight_reads(const DecoderModel& model, const std::vector<int32_t>& tokens) {
  const DecoderWeights& w = model.weights();
  const ModelConfig& c = model.config();
  MOEX_CHECK(model.options().plan.single(), "the replay probe records one rank's whole weights");
  kernels::StepReads reads;
  const size_t row = w.embed.bytes() / static_cast<size_t>(c.vocab_size);
  for (int32_t t : tokens) reads.push_back({static_cast<const uint8_t*>(w.embed.data) + row * t, row});
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& L = w.layers[l];
    add(reads, L.input_norm);
    for (const DenseWeight* p : {&L.wq, &L.wk, &L.wv}) add(reads, *p);
    for (const TensorView* v : {&L.bq, &L.bk, &L.bv, &L.q_norm, &L.k_norm}) add(reads, *v);
    add(reads, L.wo);
    add(reads, L.post_norm);
    if (L.is_moe) {
      const MoELayerWeights& m = L.moe;
      add(reads, m.gate);
      add(reads, m.gate_bias);
      const std::vector<int>& used = model.moe_stats()[l].tokens_per_expert;
      const auto active = [&](int e) { return used[m.experts.first + e] > 0; };
      if (m.packed.empty()) {
        for (int e = 0; e < m.experts.count; ++e)
          if (active(e)) {
            add(reads, m.local[e].w1);
            add(reads, m.local[e].w3);
            add(reads, m.local[e].w2);
          }
      } else {
        for (int e = 0; e < m.experts.count; ++e)
          if (active(e)) add(reads, m.packed[e].w13);
        for (int e = 0; e < m.experts.count; ++e)
          if (active(e)) add(reads, m.packed[e].w2);
      }
    }
    if (L.mlp.packed) {
      add(reads, L.mlp.packed->w13);
      add(reads, L.mlp.packed->w2);
    } else {
      add(reads, L.mlp.w1);
      add(reads, L.mlp.w3);
      add(reads, L.mlp.w2);
    }
    add(reads, L.shared_gate);
  }
  add(reads, w.final_norm);
  add(reads, w.lm_head);
  return reads;
}

size_t bytes_of(const kernels::StepReads& step) {
  size_t total = 0;
  for (const kernels::ByteRange& r : step) total += r.bytes;
  return total;
}

RepeatStats repeat_stats(const std::vector<kernels::StepReads>& steps) {
  RepeatStats r;
  if (steps.empty()) return r;
  using Key = std::pair<const void*, size_t>;
  std::set<Key> all, before;
  for (size_t s = 0; s < steps.size(); ++s) {
    std::set<Key> now;
    for (const kernels::ByteRange& b : steps[s]) {
      r.step_bytes += static_cast<double>(b.bytes);
      if (s > 0 && before.count({b.data, b.bytes})) r.repeated_bytes += static_cast<double>(b.bytes);
      now.insert({b.data, b.bytes});
      if (all.insert({b.data, b.bytes}).second) r.distinct_bytes += static_cast<double>(b.bytes);
    }
    before = std::move(now);
  }
  r.step_bytes /= static_cast<double>(steps.size());
  if (steps.size() > 1) r.repeated_bytes /= static_cast<double>(steps.size() - 1);
  return r;
}

StepReadRecorder::StepReadRecorder(const DecoderModel& model, bool skip_prefill)
    : model_(model), skip_prefill_(skip_prefill) {}

std::function<void(const StepInput&, StepKind)> StepReadRecorder::on_step() {
  return [this](const StepInput& step, StepKind kind) {
    if (skip_prefill_ && kind == StepKind::kPrefill) return;
    steps_.push_back(step_weight_reads(model_, std::vector<int32_t>(step.tokens, step.tokens + step.num_tokens)));
  };
}

double StepReadRecorder::mean_step_bytes() const {
  double total = 0;
  for (const kernels::StepReads& s : steps_) total += static_cast<double>(bytes_of(s));
  return steps_.empty() ? 0.0 : total / static_cast<double>(steps_.size());
}

}  // namespace moex::tools
