// Sampler: greedy at temperature 0; otherwise temperature, then top-k, then top-p (nucleus), seeded.
// Per request (as the OpenAI API has them): presence/frequency penalties over the tokens generated so
// far, and the log-probability of the chosen token plus the top_logprobs most likely ones.
//
// Order of operations on one row of logits [vocab]:
//   logprobs     = log_softmax(raw logits)                    (reported; never affected by what follows)
//   adjusted[j]  = logit[j] - count[j] * frequency_penalty - (count[j] > 0) * presence_penalty   (OpenAI)
//   temperature 0: argmax(adjusted) (first index of the largest); else softmax(adjusted / T) cut to the
//   top_k largest, then to the smallest prefix reaching top_p, and drawn with the sampler's own RNG.
// Serving uses one Sampler per request (its seed, its RNG stream); `moex generate` shares one for a batch.
#pragma once
#include <cstdint>
#include <random>
#include <unordered_map>
#include <vector>

namespace moex {

struct SamplerOptions {
  float temperature = 0.0f;  // 0: greedy
  int top_k = 0;             // 0: all tokens
  float top_p = 1.0f;        // 1: no nucleus cut
  uint64_t seed = 0;
  float presence_penalty = 0.0f;   // [-2, 2]: subtracted once from every token generated at least once
  float frequency_penalty = 0.0f;  // [-2, 2]: subtracted per occurrence of the token so far
  bool logprobs = false;           // report the chosen token's logprob
  int top_logprobs = 0;            // and this many most likely tokens' (0..kMaxTopLogprobs; needs logprobs)
};

constexpr int kMaxTopLogprobs = 20;

// How often each token occurs in a sequence's output so far (what the penalties look at). Sparse:
// a request generates far fewer distinct tokens than the vocabulary holds.
class TokenCounts {
 public:
  void add(int token) { ++counts_[token]; }
  void clear() { counts_.clear(); }
  int count(int token) const {
    auto it = counts_.find(token);
    return it == counts_.end() ? 0 : it->second;
  }
  const std::unordered_map<int, int>& entries() const { return counts_; }

 private:
  std::unordered_map<int, int> counts_;
};

struct TokenLogprob {
  int token = 0;
  float logprob = 0.0f;
};

struct SampledToken {
  int token = 0;
  float logprob = 0.0f;            // log_softmax(logits)[token]; set when options.logprobs
  std::vector<TokenLogprob> top;   // options.top_logprobs entries, most likely first (ties: lower id)
};

class Sampler {
 public:
  explicit Sampler(const SamplerOptions& options);  // throws Error(kInvalidInput) for bad options
  // The next token of one row of logits [vocab_size]. `generated` (may be null: no penalties) holds the
  // sequence's output tokens so far; the caller adds the returned token to it.
  int sample(const float* logits, int vocab_size, const TokenCounts* generated = nullptr);
  // As sample(), and fills `out` (token, and the logprobs options asked for). `out` may be reused
  // between calls, so a decode loop does not allocate.
  void sample(const float* logits, int vocab_size, const TokenCounts* generated, SampledToken* out);
  const SamplerOptions& options() const { return options_; }
  // Whether sample() without penalties is argmax(logits) (temperature 0): no random numbers drawn, so rows may be
  // decided in any order or in parallel.
  bool greedy() const { return options_.temperature == 0.0f; }

 private:
  SamplerOptions options_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int>> candidates_;
  std::vector<float> adjusted_;
};

// The greedy choice: the first index of the largest logit.
int argmax(const float* logits, int n);

// log_softmax(logits)[token], computed in double: the log-probability the model gives `token`.
// When `top` is non-null, also its `k` most likely tokens, most likely first (ties: lower id).
float token_logprob(const float* logits, int n, int token, int k = 0, std::vector<TokenLogprob>* top = nullptr);

}  // namespace moex
