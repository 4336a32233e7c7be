#include "moex/runtime/sampler.h"

#include <algorithm>
#include <cmath>

#include "moex/base/error.h"

namespace moex {

int argmax(const float* logits, int n) {
  int best = 0;
  for (int i = 1; i < n; ++i)
    if (logits[i] > logits[best]) best = i;
  return best;
}

Sampler::Sampler(const SamplerOptions& options) : options_(options), rng_(options.seed) {
  MOEX_CHECK_INPUT(options.temperature >= 0.0f, "--temperature must be >= 0, got ", options.temperature);
  MOEX_CHECK_INPUT(options.top_k >= 0, "--top-k must be >= 0, got ", options.top_k);
  MOEX_CHECK_INPUT(options.top_p > 0.0f && options.top_p <= 1.0f, "--top-p must be in (0, 1], got ", options.top_p);
}

int Sampler::sample(const float* logits, int vocab_size) {
  if (options_.temperature == 0.0f) return argmax(logits, vocab_size);
  candidates_.resize(vocab_size);
  for (int i = 0; i < vocab_size; ++i) candidates_[i] = {logits[i] / options_.temperature, i};
  int keep = options_.top_k > 0 ? std::min(options_.top_k, vocab_size) : vocab_size;
  const auto by_logit = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
  std::partial_sort(candidates_.begin(), candidates_.begin() + keep, candidates_.end(), by_logit);
  const float max_logit = candidates_[0].first;
  double total = 0.0;
  for (int i = 0; i < keep; ++i) total += (candidates_[i].first = std::exp(candidates_[i].first - max_logit));
  if (options_.top_p < 1.0f) {  // smallest prefix whose probability reaches top_p
    double cumulative = 0.0;
    for (int i = 0; i < keep; ++i) {
      cumulative += candidates_[i].first / total;
      if (cumulative >= options_.top_p) {
        keep = i + 1;
        total = cumulative * total;
        break;
      }
    }
  }
  std::uniform_real_distribution<double> uniform(0.0, total);
  double r = uniform(rng_);
  for (int i = 0; i < keep; ++i) {
    r -= candidates_[i].first;
    if (r <= 0.0) return candidates_[i].second;
  }
  return candidates_[keep - 1].second;
}

}  // namespace moex
