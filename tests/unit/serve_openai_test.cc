// The OpenAI request checks and the streamed text assembly of `moex serve` (src/moex/serve/openai.*).
// The server end to end, driven by the official `openai` client, is tests/serve.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "moex/runtime/tokenizer.h"
#include "moex/serve/openai.h"

namespace moex::serve {
namespace {

const Tokenizer& tiny_tokenizer() {
  static const Tokenizer tokenizer = [] {
    const std::string out = (std::filesystem::temp_directory_path() / "moex_serve_test_tiny").string();
    if (!std::filesystem::exists(out + "/tokenizer.model")) {
      const std::string cmd = std::string(MOEX_BINARY) + " gen-model --preset tiny --seed 5 --out " + out + " > /dev/null";
      EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    }
    return Tokenizer(out + "/tokenizer.model");
  }();
  return tokenizer;
}

ApiError refused(const std::string& body, bool chat = false) {
  try {
    parse_request(body, chat, tiny_tokenizer(), "tiny", 64);
  } catch (const ApiError& e) {
    return e;
  }
  ADD_FAILURE() << "accepted " << body;
  return {};
}

TEST(ServeOpenAI, ParsesACompletionRequest) {
  const ApiRequest r = parse_request(
      R"({"model": "tiny", "prompt": "Once upon a time", "max_tokens": 7, "temperature": 0, "top_k": -1,
          "seed": 3, "stream": true, "stream_options": {"include_usage": true}, "stop": ["\n", "."]})",
      false, tiny_tokenizer(), "tiny", 64);
  EXPECT_EQ(r.generation.prompt, [] {
    const std::vector<int> ids = tiny_tokenizer().encode("Once upon a time", true);
    return std::vector<int32_t>(ids.begin(), ids.end());
  }());
  EXPECT_EQ(r.generation.max_tokens, 7);
  EXPECT_EQ(r.generation.sampler.temperature, 0.0f);
  EXPECT_EQ(r.generation.sampler.top_k, 0);
  EXPECT_EQ(r.generation.sampler.seed, 3u);
  EXPECT_TRUE(r.stream && r.include_usage);
  EXPECT_EQ(r.stop.size(), 2u);
  // Token ids as the prompt; OpenAI's default max_tokens (16) for completions.
  const ApiRequest ids = parse_request(R"({"prompt": [1, 5, 9]})", false, tiny_tokenizer(), "tiny", 64);
  EXPECT_EQ(ids.generation.prompt, (std::vector<int32_t>{1, 5, 9}));
  EXPECT_EQ(ids.generation.max_tokens, 16);
  const ApiRequest pen = parse_request(R"({"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -1.5})", false,
                                       tiny_tokenizer(), "tiny", 64);
  EXPECT_EQ(pen.generation.sampler.presence_penalty, 0.5f);
  EXPECT_EQ(pen.generation.sampler.frequency_penalty, -1.5f);
}

TEST(ServeOpenAI, ChatPromptIsMixtralsInstFormat) {
  const ApiRequest r = parse_request(
      R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": "Hello"}, {"role": "user", "content": [{"type": "text", "text": "Why?"}]}]})",
      true, tiny_tokenizer(), "tiny", 256);
  const Tokenizer& t = tiny_tokenizer();
  std::vector<int32_t> want = {static_cast<int32_t>(t.bos_id())};
  for (int id : t.encode("[INST] Be brief.\n\nHi [/INST]", false)) want.push_back(id);
  for (int id : t.encode("Hello", false)) want.push_back(id);
  want.push_back(t.eos_id());
  for (int id : t.encode("[INST] Why? [/INST]", false)) want.push_back(id);
  EXPECT_EQ(r.generation.prompt, want);
  EXPECT_EQ(r.generation.max_tokens, 256 - static_cast<int64_t>(want.size()));  // chat: what the context leaves
}

TEST(ServeOpenAI, RefusesBadRequestsNamingTheField) {
  EXPECT_EQ(refused("{\"prompt\": ").message, "the request body is not valid JSON");
  EXPECT_EQ(refused("[1, 2]").message, "the request body must be a JSON object");
  EXPECT_EQ(refused(std::string(100, '[') + std::string(100, ']')).status, 400);  // nesting, before parsing
  EXPECT_EQ(refused(R"({"prompt": "x", "max_tokens": "5"})").param, "max_tokens");
  EXPECT_EQ(refused(R"({"prompt": "x", "max_tokens": 0})").param, "max_tokens");
  EXPECT_EQ(refused(R"({"prompt": "x", "max_tokens": 1e3})").param, "max_tokens");
  EXPECT_EQ(refused(R"({"prompt": "x", "max_tokens": 18446744073709551615})").param, "max_tokens");
  EXPECT_EQ(refused(R"({"prompt": "x", "temperature": "hot"})").param, "temperature");
  EXPECT_EQ(refused(R"({"prompt": "x", "temperature": 3})").param, "temperature");
  EXPECT_EQ(refused(R"({"prompt": "x", "top_p": 0})").param, "top_p");
  EXPECT_EQ(refused(R"({"prompt": "x", "stream": 1})").param, "stream");
  EXPECT_EQ(refused(R"({"prompt": "x", "stop": 5})").param, "stop");
  EXPECT_EQ(refused(R"({"prompt": "x", "n": 2})").param, "n");
  EXPECT_EQ(refused(R"({"prompt": "x", "frobnicate": true})").param, "frobnicate");
  EXPECT_EQ(refused(R"({"prompt": "x", "logprobs": 2})").param, "logprobs");
  EXPECT_EQ(refused(R"({"prompt": "x", "presence_penalty": 2.5})").param, "presence_penalty");
  EXPECT_EQ(refused(R"({"prompt": "x", "frequency_penalty": "lots"})").param, "frequency_penalty");
  EXPECT_EQ(refused(R"({"prompt": "x", "stream_options": {"include_usage": true}})").param, "stream_options");
  EXPECT_EQ(refused(R"({"prompt": 5})").param, "prompt");
  EXPECT_EQ(refused(R"({"prompt": []})").param, "prompt");
  EXPECT_EQ(refused(R"({"prompt": [1, -2]})").param, "prompt");
  EXPECT_EQ(refused(R"({"max_tokens": 3})").param, "prompt");
  EXPECT_EQ(refused(R"({"prompt": "x", "model": "other"})").status, 404);
  const std::vector<int32_t> long_prompt(64, 5);
  std::string ids = "[";
  for (size_t i = 0; i < long_prompt.size(); ++i) ids += (i ? ",5" : "5");
  EXPECT_NE(refused("{\"prompt\": " + ids + "]}").message.find("maximum context length is 64"), std::string::npos);
  EXPECT_EQ(refused(R"({"messages": []})", true).param, "messages");
  EXPECT_EQ(refused(R"({"messages": [{"role": "user"}]})", true).param, "messages[0].content");
  EXPECT_EQ(refused(R"({"messages": [{"role": "robot", "content": "x"}]})", true).param, "messages[0].role");
  EXPECT_EQ(refused(R"({"messages": [{"role": "user", "content": 7}]})", true).param, "messages[0].content");
  EXPECT_EQ(refused(R"({"messages": [{"role": "user", "content": "x"}], "prompt": "y"})", true).param, "prompt");
}

TEST(ServeOpenAI, StreamedTextEqualsTheWholeDecodeAndStopsBeforeAStopString) {
  const Tokenizer& t = tiny_tokenizer();
  const std::vector<int> prompt = t.encode("The cat", true);
  const std::vector<int> completion = t.encode("The cat sat on the mat. Then it slept.", true);
  std::vector<int32_t> gen(completion.begin() + static_cast<long>(prompt.size()), completion.end());
  const std::string whole = t.decode(completion).substr(t.decode(prompt).size());
  // Token by token, the pieces add up to the whole decode.
  TextAssembler streamed(t, std::vector<int32_t>(prompt.begin(), prompt.end()), {}, t.eos_id());
  std::string text;
  for (size_t i = 0; i < gen.size(); ++i) text += streamed.add({gen[i]}, i + 1 == gen.size());
  EXPECT_EQ(text, whole);
  // A stop string split over tokens ends the text before it, and nothing of it leaks out first.
  TextAssembler stopping(t, std::vector<int32_t>(prompt.begin(), prompt.end()), {"mat."}, t.eos_id());
  text.clear();
  for (size_t i = 0; i < gen.size() && !stopping.stopped(); ++i) text += stopping.add({gen[i]}, i + 1 == gen.size());
  EXPECT_TRUE(stopping.stopped());
  EXPECT_EQ(text, whole.substr(0, whole.find("mat.")));
}

}  // namespace
}  // namespace moex::serve
