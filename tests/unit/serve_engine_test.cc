// The serving engine's loop on the tiny model (src/moex/serve/engine.*): requests of mixed lengths served
// together (chunked prefill next to decoding, more requests than --max-num-seqs) give each the greedy
// tokens of `generate` on that prompt alone; a cancelled request frees its blocks.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "moex/base/error.h"
#include "moex/runtime/generation.h"
#include "moex/serve/engine.h"

namespace moex::serve {
namespace {

std::string tiny_model_dir() {
  static const std::string dir = [] {
    const std::string out = (std::filesystem::temp_directory_path() / "moex_serve_engine_test_tiny").string();
    if (!std::filesystem::exists(out + "/config.json")) {
      const std::string cmd = std::string(MOEX_BINARY) + " gen-model --preset tiny --seed 9 --out " + out + " > /dev/null";
      EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    }
    return out;
  }();
  return dir;
}

ModelOptions model_options() {
  ModelOptions o;
  o.max_batch = 4;
  o.max_seq_len = 128;
  o.max_step_tokens = 32;  // prompts above 32 tokens are prefilled in chunks
  o.kv_cache_dtype = KvCacheDType::kF32;
  return o;
}

std::vector<int32_t> collect(RequestStream& stream, std::string* reason) {
  std::vector<int32_t> tokens;
  for (int i = 0; i < 2000; ++i) {  // 100 s at most
    RequestStream::Read r = stream.wait(std::chrono::milliseconds(50));
    tokens.insert(tokens.end(), r.tokens.begin(), r.tokens.end());
    if (r.finished) {
      *reason = r.finish_reason;
      return tokens;
    }
  }
  ADD_FAILURE() << "a request never finished";
  return tokens;
}

bool wait_for_free_cache(Engine& engine) {
  for (int i = 0; i < 200; ++i) {
    if (engine.metrics().kv_blocks_used.value() == 0 && engine.metrics().serving.num_requests_running.value() == 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

TEST(ServeEngine, ConcurrentRequestsGetTheTokensOfEachAlone) {
  const std::vector<int> lengths = {5, 40, 17, 70, 3, 33};
  std::vector<std::vector<int32_t>> prompts;
  for (size_t p = 0; p < lengths.size(); ++p) {
    std::vector<int32_t> ids(lengths[p]);
    for (int i = 0; i < lengths[p]; ++i) ids[i] = 1 + static_cast<int32_t>((i * 31 + p * 97) % 500);
    prompts.push_back(ids);
  }
  const int64_t max_tokens = 10;

  DecoderModel model(tiny_model_dir(), model_options());
  EngineOptions eo;
  eo.max_num_seqs = 4;  // 6 requests: two wait for a place
  eo.max_batch_tokens = 32;
  eo.max_model_len = 128;
  Engine engine(model, eo);
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const auto& p : prompts) {
    GenerationRequest r;
    r.prompt = p;
    r.max_tokens = max_tokens;
    r.ignore_eos = true;  // temperature 0 (greedy) by default
    streams.push_back(engine.submit(r));
    ASSERT_TRUE(streams.back());
  }
  std::vector<std::vector<int32_t>> served;
  for (auto& s : streams) {
    std::string reason;
    served.push_back(collect(*s, &reason));
    EXPECT_EQ(reason, "length");
  }

  DecoderModel alone_model(tiny_model_dir(), model_options());
  GenerationOptions go;
  go.max_new_tokens = static_cast<int>(max_tokens);
  go.stop_at_eos = false;
  for (size_t p = 0; p < prompts.size(); ++p) {
    const GenerationResult alone =
        generate(alone_model, {std::vector<int>(prompts[p].begin(), prompts[p].end())}, go);
    EXPECT_EQ(served[p], std::vector<int32_t>(alone.new_tokens[0].begin(), alone.new_tokens[0].end()))
        << "prompt of " << lengths[p] << " tokens";
  }
  EXPECT_TRUE(wait_for_free_cache(engine));
  EXPECT_EQ(engine.metrics().serving.generation_tokens.value(), static_cast<double>(prompts.size() * max_tokens));

  // The step accounting: every prompt token is a prompt row of some prefill step, each request feeds back
  // max_tokens - 1 sampled tokens as decode rows, decode steps carry no prompt row, and decoders rode
  // along the prefill chunks (6 prompts, 168 tokens, 32-token steps).
  const EngineMetrics& m = engine.metrics();
  ASSERT_EQ(m.serving.num_preemptions.value(), 0);  // no recompute rows in the counts below
  int64_t total_prompt = 0;
  for (int l : lengths) total_prompt += l;
  EXPECT_EQ(m.prefill_steps.prompt_rows.value() + m.decode_steps.prompt_rows.value(), static_cast<double>(total_prompt));
  EXPECT_EQ(m.decode_steps.prompt_rows.value(), 0);
  EXPECT_EQ(m.prefill_steps.decode_rows.value() + m.decode_steps.decode_rows.value(),
            static_cast<double>(prompts.size() * (max_tokens - 1)));
  EXPECT_GT(m.prefill_steps.decode_rows.value(), 0);  // chunked prefill beside decoding
  EXPECT_GE(m.prefill_steps.steps.value(), static_cast<double>((total_prompt + 31) / 32));
  EXPECT_EQ(m.request_prompt_computed_tokens.count(), prompts.size());
  EXPECT_EQ(m.request_prompt_computed_tokens.sum(), static_cast<double>(total_prompt));  // distinct prompts: no hits
  EXPECT_LE(m.prefill_steps.forward_seconds.value(), m.prefill_steps.step_seconds.value());
  EXPECT_LE(m.decode_steps.forward_seconds.value(), m.decode_steps.step_seconds.value());
  EXPECT_EQ(m.prefill_steps.step_duration.count() + m.decode_steps.step_duration.count(),
            static_cast<uint64_t>(m.prefill_steps.steps.value() + m.decode_steps.steps.value()));

  // stats() (/v1/engine/stats) agrees with the metrics, and its profiler part with the rows computed: every
  // row is routed to k experts in each MoE layer (dropless), and the zones plus "other" are the steps' time.
  const nlohmann::json st = engine.stats();
  EXPECT_EQ(st["steps"]["count"].get<double>(), m.prefill_steps.steps.value() + m.decode_steps.steps.value());
  const int64_t rows = st["steps"]["prompt_rows"].get<int64_t>() + st["steps"]["decode_rows"].get<int64_t>();
  EXPECT_EQ(rows, total_prompt + static_cast<int64_t>(prompts.size() * (max_tokens - 1)));
  EXPECT_EQ(st["tokens"]["generated"].get<int64_t>(), static_cast<int64_t>(prompts.size() * max_tokens));
  EXPECT_EQ(st["requests"]["finished_length"].get<int64_t>(), static_cast<int64_t>(prompts.size()));
  const ModelConfig& config = model.config();
  ASSERT_EQ(st["expert_tokens"].size(), static_cast<size_t>(config.num_hidden_layers));
  for (int l = 0; l < config.num_hidden_layers; ++l) {
    int64_t sum = 0;
    for (const auto& v : st["expert_tokens"][l]) sum += v.get<int64_t>();
    EXPECT_EQ(sum, config.moe_layer(l) ? rows * config.num_experts_per_tok : 0) << "layer " << l;
  }
  double zoned = 0;
  for (const auto& [zone, seconds] : st["zone_seconds"].items()) zoned += seconds.get<double>();
  EXPECT_GT(st["zone_seconds"]["attention"].get<double>(), 0);
  EXPECT_GT(st["zone_seconds"]["experts"].get<double>(), 0);
  EXPECT_NEAR(zoned, st["steps"]["seconds"].get<double>(), 1e-6);
  const auto& kv = st["kv_blocks"];
  EXPECT_EQ(kv["used"].get<int64_t>() + kv["cached"].get<int64_t>() + kv["free"].get<int64_t>(), kv["total"].get<int64_t>());
}

// Penalties reach the sampler with the request's own output so far: the served tokens equal a plain loop
// (prefill, then decode) that samples each step with a Sampler of the same options and its TokenCounts.
TEST(ServeEngine, PenaltiesSeeTheRequestsOwnOutput) {
  const std::vector<int> prompt = {1, 40, 41, 42, 43, 44, 45, 46, 47, 48};
  SamplerOptions so;
  so.presence_penalty = 1.5f;
  so.frequency_penalty = 2.0f;  // greedy (temperature 0) on penalised logits
  const int steps = 16;
  std::vector<int32_t> want;
  {
    DecoderModel model(tiny_model_dir(), model_options());
    const int V = model.config().vocab_size;
    KvBlockManager kv = make_block_manager(model);
    std::vector<float> logits(V);
    prefill(model, kv, 0, prompt, logits.data());
    Sampler sampler(so);
    TokenCounts counts;
    for (int s = 0; s < steps; ++s) {
      const int32_t token = sampler.sample(logits.data(), V, &counts), position = static_cast<int32_t>(prompt.size()) + s;
      counts.add(token);
      want.push_back(token);
      if (s + 1 < steps) decode_step(model, kv, {0}, &token, &position, logits.data());
    }
  }
  DecoderModel model(tiny_model_dir(), model_options());
  EngineOptions eo;
  eo.max_num_seqs = 4;
  eo.max_batch_tokens = 32;
  eo.max_model_len = 128;
  Engine engine(model, eo);
  GenerationRequest r;
  r.prompt.assign(prompt.begin(), prompt.end());
  r.max_tokens = steps;
  r.ignore_eos = true;
  r.sampler = so;
  auto stream = engine.submit(r);
  ASSERT_TRUE(stream);
  std::string reason;
  EXPECT_EQ(collect(*stream, &reason), want);
}

TEST(ServeEngine, CancelledRequestFreesItsBlocksAndOthersGoOn) {
  // Room for 2000 tokens, so the request is still running when it is cancelled: 110 one-token steps of the
  // tiny model took ~11 ms once prefill got faster, less than the test thread's wake-up on a loaded machine.
  ModelOptions mo = model_options();
  mo.max_seq_len = 2048;
  DecoderModel model(tiny_model_dir(), mo);
  EngineOptions eo;
  eo.max_num_seqs = 4;
  eo.max_batch_tokens = 32;
  eo.max_model_len = 2048;
  Engine engine(model, eo);
  GenerationRequest r;
  r.prompt = {1, 2, 3, 4, 5, 6, 7};
  r.max_tokens = 2000;
  r.ignore_eos = true;
  auto cancelled = engine.submit(r);
  ASSERT_TRUE(cancelled);
  RequestStream::Read first = cancelled->wait(std::chrono::seconds(30));
  ASSERT_FALSE(first.tokens.empty());
  cancelled->cancel();
  std::string reason;
  collect(*cancelled, &reason);
  EXPECT_EQ(reason, "cancelled");
  EXPECT_TRUE(wait_for_free_cache(engine));
  // Still serving; a request that can never fit is refused up front.
  r.max_tokens = 5;
  auto next = engine.submit(r);
  ASSERT_TRUE(next);
  EXPECT_EQ(collect(*next, &reason).size(), 5u);
  r.max_tokens = 4000;
  EXPECT_THROW(engine.submit(r), Error);
}

}  // namespace
}  // namespace moex::serve

namespace moex::serve {
namespace {

// Attention DP's request placement (serve/engine.h least_loaded_rank): fewest sequences, then the longest
// cached prefix, then the most free blocks, then the lowest rank.
TEST(ServeEngine, DataParallelAssignsTheLeastLoadedRank) {
  EXPECT_EQ(least_loaded_rank({{0, 0, 10}}), 0);
  EXPECT_EQ(least_loaded_rank({{3, 0, 10}, {2, 0, 1}, {4, 0, 99}}), 1);     // sequences decide first
  EXPECT_EQ(least_loaded_rank({{2, 0, 10}, {2, 3, 1}}), 1);                 // a tie: the cached prefix
  EXPECT_EQ(least_loaded_rank({{2, 1, 10}, {2, 1, 11}}), 1);                // then the free blocks
  EXPECT_EQ(least_loaded_rank({{2, 1, 10}, {2, 1, 10}, {2, 1, 10}}), 0);    // then the lowest rank
  EXPECT_EQ(least_loaded_rank({{1, 0, 10}, {2, 9, 99}}), 0);                // a prefix does not outweigh load
  // A burst of requests on 2 empty ranks alternates between them.
  std::vector<RankLoad> load(2, RankLoad{0, 0, 100});
  std::vector<int> picked;
  for (int i = 0; i < 6; ++i) {
    const int r = least_loaded_rank(load);
    picked.push_back(r);
    ++load[r].sequences;
    load[r].free_blocks -= 2;
  }
  EXPECT_EQ(picked, (std::vector<int>{0, 1, 0, 1, 0, 1}));
}

}  // namespace
}  // namespace moex::serve
