#include "moex/runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "moex/base/error.h"

namespace moex {
namespace {
// Up to this many candidates (top-k) are sorted at once; more are sorted lazily (see Sampler::sample).
constexpr int kSortAllBelow = 1024;

// The nucleus cut and the draw, over candidates in sampling order (largest logit first): `weight(i)` is
// candidate i's unnormalised probability (it may sort lazily, so it is asked in increasing i), `total`
// the sum of weights over [0, keep). Cuts to the smallest prefix whose probability reaches top_p, then
// draws from it with `rng`; returns the index drawn.
template <class Weight>
int cut_and_draw(int keep, double total, float top_p, std::mt19937_64& rng, const Weight& weight) {
  if (top_p < 1.0f) {
    double cumulative = 0.0;
    for (int i = 0; i < keep; ++i) {
      cumulative += weight(i) / total;
      if (cumulative >= top_p) {
        keep = i + 1;
        total = cumulative * total;
        break;
      }
    }
  }
  std::uniform_real_distribution<double> uniform(0.0, total);
  double r = uniform(rng);
  for (int i = 0; i < keep; ++i) {
    r -= weight(i);
    if (r <= 0.0) return i;
  }
  weight(keep - 1);  // rounding left r above 0: the last candidate (sorted into place first)
  return keep - 1;
}
}  // namespace

// The first index of the largest logit, as the one-line walk `if (x[i] > x[best]) best = i` gives it (NaN never
// wins; a NaN at index 0 keeps 0), in one pass the compiler vectorises: each block of 256 logits' largest value
// over 16 running maxima (maxps), and only a block whose largest beats the best so far is walked for the first
// index holding it (a few blocks of a row). The walk's compare-and-select chain took ~70 us for 32,000 logits;
// the two-pass form before this ~18 us (the pass for the index is scalar); this one is bound by reading the row
// (~7 us from L3; a batch-64 step's 64 rows are 8 MB).
int argmax(const float* logits, int n) {
  if (n <= 0) return 0;
  constexpr int kLanes = 16, kBlock = 256;
  float best = logits[0];
  int best_index = 0, i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    float lane[kLanes];
    std::fill_n(lane, kLanes, -std::numeric_limits<float>::infinity());
    for (int b = 0; b < kBlock; b += kLanes)
      for (int j = 0; j < kLanes; ++j) lane[j] = logits[i + b + j] > lane[j] ? logits[i + b + j] : lane[j];
    float largest = lane[0];
    for (int j = 1; j < kLanes; ++j) largest = lane[j] > largest ? lane[j] : largest;
    if (!(largest > best)) continue;  // (a NaN best, at index 0, is never beaten)
    for (int k = i;; ++k)
      if (logits[k] == largest) {
        best = largest;
        best_index = k;
        break;
      }
  }
  for (; i < n; ++i)
    if (logits[i] > best) {
      best = logits[i];
      best_index = i;
    }
  return best_index;
}

float token_logprob(const float* logits, int n, int token, int k, std::vector<TokenLogprob>* top) {
  // log_softmax(x)[j] = x[j] - (max + log(sum exp(x - max))), the sum in double.
  float max_logit = logits[0];
  for (int i = 1; i < n; ++i) max_logit = std::max(max_logit, logits[i]);
  double total = 0.0;
  for (int i = 0; i < n; ++i) total += std::exp(static_cast<double>(logits[i]) - max_logit);
  const double log_normalizer = static_cast<double>(max_logit) + std::log(total);
  if (top != nullptr) {
    // A running top-k by insertion into `top` itself (k <= 20: cheaper than sorting the vocabulary, and
    // no allocation once `top` has grown); ids first, turned into logprobs at the end.
    top->clear();
    k = std::min(k, n);
    const auto better = [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
    for (int i = 0; i < n && k > 0; ++i) {
      if (static_cast<int>(top->size()) == k && !better(i, top->back().token)) continue;
      auto at = std::upper_bound(top->begin(), top->end(), i,
                                 [&](int id, const TokenLogprob& entry) { return better(id, entry.token); });
      top->insert(at, TokenLogprob{i, 0.0f});
      if (static_cast<int>(top->size()) > k) top->pop_back();
    }
    for (TokenLogprob& entry : *top) entry.logprob = static_cast<float>(logits[entry.token] - log_normalizer);
  }
  return static_cast<float>(logits[token] - log_normalizer);
}

Sampler::Sampler(const SamplerOptions& options) : options_(options), rng_(options.seed) {
  MOEX_CHECK_INPUT(std::isfinite(options.temperature) && options.temperature >= 0.0f,
                   "temperature (--temperature) must be >= 0, got ", options.temperature);
  MOEX_CHECK_INPUT(options.top_k >= 0, "top_k (--top-k) must be >= 0, got ", options.top_k);
  MOEX_CHECK_INPUT(options.top_p > 0.0f && options.top_p <= 1.0f, "top_p (--top-p) must be in (0, 1], got ",
                   options.top_p);
  MOEX_CHECK_INPUT(options.presence_penalty >= -2.0f && options.presence_penalty <= 2.0f,
                   "presence_penalty must be in [-2, 2], got ", options.presence_penalty);
  MOEX_CHECK_INPUT(options.frequency_penalty >= -2.0f && options.frequency_penalty <= 2.0f,
                   "frequency_penalty must be in [-2, 2], got ", options.frequency_penalty);
  MOEX_CHECK_INPUT(options.top_logprobs >= 0 && options.top_logprobs <= kMaxTopLogprobs,
                   "top_logprobs must be in [0, ", kMaxTopLogprobs, "], got ", options.top_logprobs);
  MOEX_CHECK_INPUT(options.top_logprobs == 0 || options.logprobs, "top_logprobs needs logprobs");
}

int Sampler::sample(const float* logits, int vocab_size, const TokenCounts* generated) {
  const bool penalised = generated != nullptr && !generated->entries().empty() &&
                         (options_.presence_penalty != 0.0f || options_.frequency_penalty != 0.0f);
  if (penalised) {  // OpenAI's penalties, on a copy: the caller's logits also feed the logprobs
    adjusted_.assign(logits, logits + vocab_size);
    for (const auto& [token, count] : generated->entries()) {
      if (token < 0 || token >= vocab_size || count <= 0) continue;
      adjusted_[token] -= count * options_.frequency_penalty + options_.presence_penalty;
    }
    logits = adjusted_.data();
  }
  if (greedy()) return argmax(logits, vocab_size);
  candidates_.resize(vocab_size);
  for (int i = 0; i < vocab_size; ++i) candidates_[i] = {logits[i] / options_.temperature, i};
  int keep = options_.top_k > 0 ? std::min(options_.top_k, vocab_size) : vocab_size;
  const auto by_logit = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
  if (keep <= kSortAllBelow) {  // a small top-k: sort it, as below but at once
    std::partial_sort(candidates_.begin(), candidates_.begin() + keep, candidates_.end(), by_logit);
    const float max_logit = candidates_[0].first;
    double total = 0.0;
    for (int i = 0; i < keep; ++i) total += (candidates_[i].first = std::exp(candidates_[i].first - max_logit));
    const auto weight = [&](int i) { return static_cast<double>(candidates_[i].first); };
    return candidates_[cut_and_draw(keep, total, options_.top_p, rng_, weight)].second;
  }
  // Many candidates (no top-k, or a large one): the same walk in the same order (largest logit first, ties
  // to the lower id), but sorted lazily, a growing prefix at a time, since the walk and the top-p cut
  // almost always end within the first few hundred. Sorting all 32000 took ~3 ms a token; this ~0.1 ms.
  // Only the total mass is summed in index order instead of sorted order (its last bits may differ).
  if (keep < vocab_size)
    std::nth_element(candidates_.begin(), candidates_.begin() + keep, candidates_.end(), by_logit);
  float max_logit = candidates_[0].first;
  for (int i = 1; i < keep; ++i) max_logit = std::max(max_logit, candidates_[i].first);
  double total = 0.0;
  for (int i = 0; i < keep; ++i) total += std::exp(candidates_[i].first - max_logit);
  int sorted = 0;  // candidates_[0, sorted) hold the largest, in order, as plain logits
  const auto weight_at = [&](int i) {
    if (i >= sorted) {
      const int upto = std::min(keep, std::max(i + 1, sorted * 8 + 256));
      std::partial_sort(candidates_.begin() + sorted, candidates_.begin() + upto, candidates_.begin() + keep, by_logit);
      sorted = upto;
    }
    return std::exp(candidates_[i].first - max_logit);
  };
  return candidates_[cut_and_draw(keep, total, options_.top_p, rng_, weight_at)].second;
}

void Sampler::sample(const float* logits, int vocab_size, const TokenCounts* generated, SampledToken* out) {
  out->token = sample(logits, vocab_size, generated);
  out->top.clear();
  out->logprob = 0.0f;
  if (options_.logprobs)
    out->logprob = token_logprob(logits, vocab_size, out->token, options_.top_logprobs,
                                 options_.top_logprobs > 0 ? &out->top : nullptr);
}

}  // namespace moex
