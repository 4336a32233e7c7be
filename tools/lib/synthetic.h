// Synthetic Mixtral checkpoints for `moex gen-model`: preset geometries and deterministic, numerically
// healthy random weights in Hugging Face tensor naming.
//
// Every element is a pure function of (seed, tensor name, element index): a counter-based hash
// (splitmix64), so tensors can be generated in any order, in parallel, in chunks, and regenerated later.
// Init scheme (d = hidden, L = layers, z ~ Irwin-Hall(4), approximately N(0,1) and bounded at +-3.46):
//   Channel c = 0 is a constant "bias channel" that only the router reads: embed[:, c] = sqrt(d), no layer
//   writes it (row c of o_proj and of every w2 is 0) and no other matrix reads it (column c of q/k/v_proj,
//   w1, w3 and lm_head is 0). So every normalised hidden state, at every layer and position, has
//   x̂[c] ~ sqrt(d/2) > 0, and gate[e][c] adds a steady per-expert logit offset: that is --router-skew.
//   The channel holds half of each hidden state's energy, so the other coordinates of x̂ have rms
//   1/sqrt(2) and matrices reading x̂ get a gain of sqrt(2) (g below) to keep unit-variance outputs.
//   model.embed_tokens        z (std 1), column c = sqrt(d)
//   *_layernorm, model.norm   1 + 0.05 z, element c = 1
//   q/k/v_proj, w1, w3        g z / sqrt(d), column c = 0                       (g = sqrt(2))
//   o_proj, w2                z / sqrt(fan_in) / sqrt(2L) (GPT-2 residual scaling), row c = 0
//   gate                      g z / sqrt(d) (router logits ~N(0,1)), column c = calibrated offset_e / x̂[c]
//   lm_head                   2 g z / sqrt(d), column c = 0 (logits std ~2, max ~6-9)
//   q/k/v biases, e_score_correction_bias   0.1 z
//   q_norm, k_norm            1 + 0.05 z (element 0 = 1); shared experts and dense MLPs as the experts;
//   shared_expert_gate        as q_proj (column c = 0)
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "moex/base/dtype.h"
#include "moex/model/config.h"
#include "tools/lib/safetensors_writer.h"

namespace moex {

// tiny, small (the second test config: hidden 256, 4 layers), mini, mixtral-8x7b; then per family a
// small preset and a real model's geometry: qwen2-moe-tiny / qwen2-moe-a2.7b, qwen3-moe-tiny / qwen3-30b-a3b,
// olmoe-tiny / olmoe-1b-7b, dots1-tiny / dots-llm1.
const std::vector<std::string>& synthetic_preset_names();
// Throws Error(kInvalidInput) listing the presets when `name` is not one.
ModelConfig synthetic_preset(const std::string& name);

// What --router-skew produced, measured (not predicted) at layer 0 by routing normalised embedding rows
// (rmsnorm(embed[v]) * post_attention_layernorm) through the stored (rounded) gate, top-k.
struct RouterSkewReport {
  float skew = 0;                     // the Zipf exponent asked for
  int tokens = 0;                     // token ids routed
  std::vector<double> target_share;   // Zipf 1/r^S, capped at 0.95/k per expert (top-k picks k distinct)
  std::vector<double> measured_share; // fraction of the tokens*k assignments per expert
  double max_over_mean = 0;           // max measured share * E
  double min_over_mean = 0;
  std::vector<float> gate_offset;     // stored gate[e][c] per expert (same in every layer)
};

// --router-skew's range. Above it the Zipf weights 1/r^S of the tail experts underflow a double to 0 for
// mixtral-size expert counts and the calibration would divide 0 by 0 (NaN gate weights); long before that the
// tail's share is below one routed token in the calibration sample, so a larger exponent means nothing more.
constexpr float kMaxRouterSkew = 16.0f;

// Router logits of `tokens` tokens for `experts` experts, modelled as noise[t * experts + e] (the part of the
// gate that does not read the bias channel) + gate_offset[e] * channel[t] (the bias channel's value).
// route_shares: each expert's share of the tokens * top_k assignments under top-k (lower index wins ties).
std::vector<double> route_shares(const std::vector<float>& noise, const std::vector<float>& channel,
                                 const std::vector<float>& gate_offset, int top_k);

// The gate offsets that make those logits route expert e a Zipf share ~ 1/(e+1)^skew, water-filled under a
// cap of 0.95/top_k (an expert takes at most one of a token's k picks): found by iterating on route_shares.
// skew <= 0 (or a cap the experts cannot meet) gives zero offsets and the balanced target.
struct ZipfRouterCalibration {
  std::vector<double> target_share;  // per expert
  std::vector<float> gate_offset;    // per expert, the bias channel's gate weight
};
ZipfRouterCalibration calibrate_zipf_router(float skew, int top_k, const std::vector<float>& noise,
                                            const std::vector<float>& channel);

class SyntheticModel {
 public:
  // Calibrates the router skew (a few ms to ~1 s for mixtral-8x7b geometry). Throws Error(kInvalidInput)
  // for a skew outside [0, kMaxRouterSkew].
  SyntheticModel(const ModelConfig& config, uint64_t seed, float router_skew, DType dtype);

  const ModelConfig& config() const { return config_; }
  // In state-dict order (the order HF's MixtralForCausalLM registers its parameters).
  const std::vector<TensorToWrite>& tensors() const { return tensors_; }
  const RouterSkewReport& router_skew() const { return skew_; }
  // 16 hex digits, a function of everything the weights depend on (seed, skew, dtype, tensor names and
  // shapes): two runs that differ in any of them write shards the loader will not mix.
  std::string checkpoint_id() const;

  // Element `index` of tensor `tensor` as float, after rounding to the file dtype (what a loader sees).
  float value(size_t tensor, int64_t index) const;
  // Elements [first, first + count) of `tensor` in the file dtype, little-endian; uses all threads.
  void fill(size_t tensor, int64_t first, int64_t count, uint8_t* out) const;
  // A TensorFill for write_safetensors.
  TensorFill filler() const;

  static constexpr int kBiasChannel = 0;

 private:
  enum class Init { kEmbedding, kNorm, kProjection, kResidualOut, kGate, kLmHead, kBias };
  struct Rule {
    Init init;
    uint64_t key;          // hash of (seed, name)
    int64_t cols;
    float scale;           // value = offset + scale * z, except the special row/column
    float offset;
  };
  float raw_value(const Rule& rule, int64_t row, int64_t col, int64_t index) const;
  void add(const std::string& name, std::vector<int64_t> shape, Init init, float scale, float offset);
  void calibrate_router_skew(float skew);

  ModelConfig config_;
  uint64_t seed_key_;
  DType dtype_;
  std::vector<TensorToWrite> tensors_;
  std::vector<Rule> rules_;
  std::vector<float> gate_offset_;  // per expert: gate[e][kBiasChannel], before rounding
  RouterSkewReport skew_;
};

// Prompt ids for the benchmarks and the profiler: `batch` sequences of `length` ids, spread over the
// vocabulary by a prime stride and different per sequence, so every command that times a model times the
// same prompts (and a rerun the same ones).
std::vector<std::vector<int>> synthetic_prompts(int batch, int length, int vocab_size);

// generation_config.json: bos/eos ids, as transformers writes it from the model config.
std::string generation_config_json(const ModelConfig& config);

}  // namespace moex
