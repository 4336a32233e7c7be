// Sampler: greedy at temperature 0; otherwise temperature, then top-k, then top-p (nucleus), seeded.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

namespace moex {

struct SamplerOptions {
  float temperature = 0.0f;  // 0: greedy
  int top_k = 0;             // 0: all tokens
  float top_p = 1.0f;        // 1: no nucleus cut
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(const SamplerOptions& options);  // throws Error(kInvalidInput) for bad options
  int sample(const float* logits, int vocab_size);

 private:
  SamplerOptions options_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int>> candidates_;
};

// The greedy choice: the first index of the largest logit.
int argmax(const float* logits, int n);

}  // namespace moex
