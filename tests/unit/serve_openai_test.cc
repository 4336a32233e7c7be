// The OpenAI request checks of `moex serve` (src/moex/serve/openai.*); streamed text and stop strings are
// text/stop_strings (stop_strings_test.cc).
// The server end to end, driven by the official `openai` client, is tests/serve.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "moex/text/tokenizer.h"
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

const ChatTemplate& mixtral_template();

ApiError refused(const std::string& body, bool chat = false, bool with_template = true) {
  try {
    parse_request(body, chat, tiny_tokenizer(), "tiny", 64, chat && with_template ? &mixtral_template() : nullptr);
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

const ChatTemplate& mixtral_template() {
  static const ChatTemplate t(kMixtralChatTemplate, "<s>", "</s>");
  return t;
}

TEST(ServeOpenAI, ChatPromptIsTheTemplatesWithSpecialTokensAsIds) {
  const ApiRequest r = parse_request(
      R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": "Hello"}, {"role": "user", "content": [{"type": "text", "text": "Why?"}]}]})",
      true, tiny_tokenizer(), "tiny", 256, &mixtral_template());
  // Mixtral-Instruct's format, written out here: the text between <s> / </s> is encoded in one piece.
  const Tokenizer& t = tiny_tokenizer();
  std::vector<int32_t> want = {static_cast<int32_t>(t.bos_id())};
  for (int id : t.encode(" [INST] Be brief.\n\nHi [/INST] Hello", false)) want.push_back(id);
  want.push_back(t.eos_id());
  for (int id : t.encode(" [INST] Why? [/INST]", false)) want.push_back(id);
  EXPECT_EQ(r.generation.prompt, want);
  EXPECT_EQ(r.generation.max_tokens, 256 - static_cast<int64_t>(want.size()));  // chat: what the context leaves
  // The template's raise_exception (roles that do not alternate) is a 400 naming messages.
  try {
    parse_request(R"({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})", true,
                  tiny_tokenizer(), "tiny", 256, &mixtral_template());
    ADD_FAILURE() << "accepted two user turns in a row";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.param, "messages");
    EXPECT_NE(e.message.find("alternate"), std::string::npos) << e.message;
  }
  // No template: a chat request is a 400 that says so.
  const ApiError none = refused(R"({"messages": [{"role": "user", "content": "a"}]})", true, /*with_template=*/false);
  EXPECT_NE(none.message.find("no chat template"), std::string::npos) << none.message;
}

TEST(ServeOpenAI, ParsesLogprobsInBothShapes) {
  const ApiRequest c = parse_request(R"({"prompt": "x", "logprobs": 3})", false, tiny_tokenizer(), "tiny", 64);
  EXPECT_TRUE(c.generation.sampler.logprobs);
  EXPECT_EQ(c.generation.sampler.top_logprobs, 3);
  const ApiRequest z = parse_request(R"({"prompt": "x", "logprobs": 0})", false, tiny_tokenizer(), "tiny", 64);
  EXPECT_TRUE(z.generation.sampler.logprobs);
  EXPECT_EQ(z.generation.sampler.top_logprobs, 0);
  const ApiRequest h = parse_request(R"({"messages": [{"role": "user", "content": "a"}], "logprobs": true, "top_logprobs": 5})",
                                     true, tiny_tokenizer(), "tiny", 64, &mixtral_template());
  EXPECT_TRUE(h.generation.sampler.logprobs);
  EXPECT_EQ(h.generation.sampler.top_logprobs, 5);
  EXPECT_EQ(refused(R"({"prompt": "x", "logprobs": 21})").param, "logprobs");
  EXPECT_EQ(refused(R"({"prompt": "x", "logprobs": true})").param, "logprobs");
  EXPECT_EQ(refused(R"({"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2})", true).param, "top_logprobs");
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

}  // namespace
}  // namespace moex::serve
