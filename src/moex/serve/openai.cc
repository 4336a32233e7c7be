#include "moex/serve/openai.h"

#include <cmath>
#include <limits>
#include <random>
#include <set>

#include "moex/base/error.h"

namespace moex::serve {

using nlohmann::json;

json error_body(const ApiError& e) {
  return json{{"error",
               {{"message", e.message},
                {"type", e.type},
                {"param", e.param.empty() ? json(nullptr) : json(e.param)},
                {"code", e.status == 404 ? json("model_not_found") : json(nullptr)}}}};
}

bool nesting_within(const std::string& body, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char c : body) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return false;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return true;
}

namespace {

[[noreturn]] void bad(const std::string& param, const std::string& message) {
  ApiError e;
  e.message = message;
  e.param = param;
  throw e;
}

// Field readers: absent or null -> the default; present with the wrong type -> 400 naming it.
bool get_bool(const json& body, const char* key, bool fallback) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) bad(key, std::string("'") + key + "' must be a boolean");
  return it->get<bool>();
}

double get_number(const json& body, const char* key, double fallback, double lo, double hi) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return fallback;
  if (!it->is_number()) bad(key, std::string("'") + key + "' must be a number");
  const double v = it->get<double>();
  if (!std::isfinite(v) || v < lo || v > hi)
    bad(key, std::string("'") + key + "' must be between " + std::to_string(lo) + " and " + std::to_string(hi) +
                 ", got " + it->dump());
  return v;
}

int64_t get_int(const json& body, const char* key, int64_t fallback, int64_t lo, int64_t hi) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return fallback;
  if (!it->is_number_integer()) bad(key, std::string("'") + key + "' must be an integer");
  if (it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(hi))
    bad(key, std::string("'") + key + "' must be at most " + std::to_string(hi) + ", got " + it->dump());
  const int64_t v = it->get<int64_t>();
  if (v < lo || v > hi)
    bad(key, std::string("'") + key + "' must be between " + std::to_string(lo) + " and " + std::to_string(hi) +
                 ", got " + it->dump());
  return v;
}

std::string get_string(const json& body, const char* key) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return "";
  if (!it->is_string()) bad(key, std::string("'") + key + "' must be a string");
  return it->get<std::string>();
}

std::vector<std::string> get_stop(const json& body) {
  const auto it = body.find("stop");
  if (it == body.end() || it->is_null()) return {};
  std::vector<std::string> out;
  if (it->is_string()) {
    out.push_back(it->get<std::string>());
  } else if (it->is_array()) {
    if (it->size() > 4) bad("stop", "'stop' takes at most 4 strings");
    for (const json& s : *it) {
      if (!s.is_string()) bad("stop", "'stop' must be a string or an array of strings");
      out.push_back(s.get<std::string>());
    }
  } else {
    bad("stop", "'stop' must be a string or an array of strings");
  }
  for (const std::string& s : out)
    if (s.empty()) bad("stop", "'stop' strings must not be empty");
  return out;
}

// What a message's content is: a string, or an array of {"type": "text", "text": ...} parts.
std::string message_text(const json& content, size_t index) {
  const std::string param = "messages[" + std::to_string(index) + "].content";
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) bad(param, "'" + param + "' must be a string or an array of text parts");
  std::string text;
  for (const json& part : content) {
    if (!part.is_object() || part.value("type", json()) != "text" || !part.contains("text") || !part["text"].is_string())
      bad(param, "'" + param + "' parts must be {\"type\": \"text\", \"text\": string} (only text is supported)");
    text += part["text"].get<std::string>();
  }
  return text;
}

[[noreturn]] void too_long(const std::string& param, int64_t max_model_len, size_t bytes, int64_t max_bytes) {
  bad(param, "This model's maximum context length is " + std::to_string(max_model_len) + " tokens. However, your " +
                 (param == "prompt" ? "prompt" : "messages' text") + " is " + std::to_string(bytes) +
                 " bytes, more than that many tokens can hold (" + std::to_string(max_bytes) +
                 " bytes). Please reduce the length of the prompt.");
}

}  // namespace

int64_t longest_token_bytes(const Tokenizer& tokenizer) {
  size_t longest = 0;
  for (int id = 0; id < tokenizer.vocab_size(); ++id) longest = std::max(longest, tokenizer.decode({id}).size());
  return static_cast<int64_t>(longest) + 1;
}

std::vector<int32_t> chat_prompt(const json& messages, const ChatTemplate& chat_template, const Tokenizer& tokenizer,
                                 int64_t max_model_len, int64_t longest_token_bytes) {
  if (!messages.is_array() || messages.empty()) bad("messages", "'messages' must be a non-empty array");
  std::vector<ChatMessage> turns;
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    const std::string param = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) bad(param, "'" + param + "' must be an object");
    for (const auto& [key, value] : m.items())
      if (key != "role" && key != "content" && key != "name")
        bad(param + "." + key, "Unrecognized field '" + key + "' in " + param);
    if (!m.contains("role") || !m["role"].is_string()) bad(param + ".role", "'" + param + ".role' must be a string");
    if (!m.contains("content")) bad(param + ".content", "'" + param + ".content' is required");
    const std::string role = m["role"].get<std::string>();
    if (role != "system" && role != "user" && role != "assistant")
      bad(param + ".role", "'" + param + ".role' must be system, user or assistant, got '" + role + "'");
    turns.push_back(ChatMessage{role, message_text(m["content"], i)});
  }
  if (longest_token_bytes > 0) {
    size_t bytes = 0;
    for (const ChatMessage& t : turns) bytes += t.content.size();
    if (bytes > static_cast<size_t>(max_model_len * longest_token_bytes))
      too_long("messages", max_model_len, bytes, max_model_len * longest_token_bytes);
  }
  // The template decides what a conversation may look like (Mixtral's raises on roles that do not alternate).
  std::string rendered;
  try {
    rendered = chat_template.render(turns, /*add_generation_prompt=*/true);
  } catch (const Error& e) {
    bad("messages", std::string("the chat template refused the messages: ") + e.what());
  }
  const std::vector<int> ids = chat_template.encode(tokenizer, rendered);
  return std::vector<int32_t>(ids.begin(), ids.end());
}

ApiRequest parse_request(const std::string& body, bool chat, const Tokenizer& tokenizer, const std::string& served_model,
                         int64_t max_model_len, const ChatTemplate* chat_template, int64_t longest_token_bytes) {
  if (!nesting_within(body, 32)) bad("", "the request body nests JSON deeper than 32 levels");
  const json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) bad("", "the request body is not valid JSON");
  if (!j.is_object()) bad("", "the request body must be a JSON object");
  static const std::set<std::string> common = {
      "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stream", "stream_options", "stop",
      "ignore_eos", "user", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
      "return_tokens_as_token_ids"};
  static const std::set<std::string> completion_only = {"prompt", "echo", "best_of", "suffix"};
  static const std::set<std::string> chat_only = {"messages", "max_completion_tokens", "top_logprobs"};
  for (const auto& [key, value] : j.items()) {
    if (common.count(key) || (chat ? chat_only : completion_only).count(key)) continue;
    bad(key, "Unrecognized request argument supplied: " + key);
  }
  ApiRequest r;
  r.chat = chat;
  r.model = get_string(j, "model");
  if (!r.model.empty() && r.model != served_model) {
    ApiError e;
    e.status = 404;
    e.type = "NotFoundError";
    e.param = "model";
    e.message = "The model '" + r.model + "' does not exist; this server serves '" + served_model + "'";
    throw e;
  }
  // Features not offered (yet): refused rather than silently ignored.
  if (get_int(j, "n", 1, 1, 1) != 1) bad("n", "'n' must be 1");
  // logprobs: completions take `logprobs: N` (the top N besides the sampled token), chat `logprobs: true`
  // with `top_logprobs: N`. Computed on the raw logits (runtime/sampler.h), N <= kMaxTopLogprobs.
  SamplerOptions& so = r.generation.sampler;
  if (chat) {
    so.logprobs = get_bool(j, "logprobs", false);
    so.top_logprobs = static_cast<int>(get_int(j, "top_logprobs", 0, 0, kMaxTopLogprobs));
    if (so.top_logprobs > 0 && !so.logprobs) bad("top_logprobs", "'top_logprobs' needs 'logprobs': true");
  } else {
    const auto lp = j.find("logprobs");
    if (lp != j.end() && !lp->is_null()) {
      if (lp->is_boolean()) bad("logprobs", "'logprobs' must be an integer (0..20) for /v1/completions");
      so.top_logprobs = static_cast<int>(get_int(j, "logprobs", 0, 0, kMaxTopLogprobs));
      so.logprobs = true;
    }
  }
  if (j.contains("logit_bias") && !j["logit_bias"].is_null() && !(j["logit_bias"].is_object() && j["logit_bias"].empty()))
    bad("logit_bias", "'logit_bias' is not supported yet");
  if (!chat) {
    if (get_bool(j, "echo", false)) bad("echo", "'echo' is not supported yet");
    if (get_int(j, "best_of", 1, 1, 1) != 1) bad("best_of", "'best_of' must be 1");
    if (!get_string(j, "suffix").empty()) bad("suffix", "'suffix' is not supported");
  }
  get_string(j, "user");

  // The prompt. A text longer in bytes than the context can hold is refused before it is tokenized.
  std::vector<int32_t>& prompt = r.generation.prompt;
  const int64_t max_bytes = longest_token_bytes > 0 ? max_model_len * longest_token_bytes : 0;
  const auto encode_text = [&](const std::string& text) {
    if (max_bytes > 0 && text.size() > static_cast<size_t>(max_bytes)) too_long("prompt", max_model_len, text.size(), max_bytes);
    const std::vector<int> ids = tokenizer.encode(text, /*add_bos=*/true);
    prompt.assign(ids.begin(), ids.end());
  };
  if (chat) {
    if (!j.contains("messages")) bad("messages", "'messages' is required");
    if (!chat_template)
      bad("messages", "this model has no chat template (tokenizer_config.json has no \"chat_template\"): "
                      "use /v1/completions, or start the server with --chat-template FILE");
    prompt = chat_prompt(j["messages"], *chat_template, tokenizer, max_model_len, longest_token_bytes);
  } else {
    if (!j.contains("prompt")) bad("prompt", "'prompt' is required");
    const json& p = j["prompt"];
    if (p.is_string()) {
      encode_text(p.get_ref<const std::string&>());
    } else if (p.is_array() && p.size() == 1 && p[0].is_string()) {
      encode_text(p[0].get_ref<const std::string&>());
    } else if (p.is_array() && !p.empty() && p[0].is_number_integer()) {
      for (const json& t : p) {
        if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > std::numeric_limits<int32_t>::max())
          bad("prompt", "'prompt' token ids must be non-negative integers");
        prompt.push_back(static_cast<int32_t>(t.get<int64_t>()));
      }
    } else if (p.is_array() && p.size() > 1 && p[0].is_string()) {
      bad("prompt", "'prompt' holds one prompt per request here (a batch of prompts is not supported)");
    } else {
      bad("prompt", "'prompt' must be a string or an array of token ids");
    }
    if (prompt.empty()) bad("prompt", "'prompt' is empty");
  }
  const int64_t prompt_len = static_cast<int64_t>(prompt.size());
  if (prompt_len >= max_model_len)
    bad(chat ? "messages" : "prompt", "This model's maximum context length is " + std::to_string(max_model_len) +
                                          " tokens. However, your prompt has " + std::to_string(prompt_len) +
                                          " tokens (no room for a completion). Please reduce the length of the prompt.");
  // max_tokens: OpenAI's default is 16 for completions; for chat, what the context leaves.
  const int64_t big = std::numeric_limits<int32_t>::max();
  const char* max_key = chat && j.contains("max_completion_tokens") && !j["max_completion_tokens"].is_null()
                            ? "max_completion_tokens"
                            : "max_tokens";
  r.generation.max_tokens = get_int(j, max_key, chat ? max_model_len - prompt_len : 16, 1, big);

  SamplerOptions& s = so;
  s.temperature = static_cast<float>(get_number(j, "temperature", 1.0, 0.0, 2.0));
  s.top_p = static_cast<float>(get_number(j, "top_p", 1.0, 0.0, 1.0));
  if (s.top_p <= 0.0f) bad("top_p", "'top_p' must be in (0, 1]");
  const int64_t top_k = get_int(j, "top_k", 0, -1, big);
  s.top_k = top_k < 0 ? 0 : static_cast<int>(top_k);  // -1 (vLLM) and 0: all tokens
  const auto seed = j.find("seed");
  if (seed != j.end() && !seed->is_null()) {
    if (!seed->is_number_integer()) bad("seed", "'seed' must be an integer");
    s.seed = seed->is_number_unsigned() ? seed->get<uint64_t>() : static_cast<uint64_t>(seed->get<int64_t>());
  } else {
    static thread_local std::random_device device;
    s.seed = (static_cast<uint64_t>(device()) << 32) | device();
  }
  // OpenAI's penalties over the tokens generated so far (runtime/sampler.h).
  s.presence_penalty = static_cast<float>(get_number(j, "presence_penalty", 0.0, -2.0, 2.0));
  s.frequency_penalty = static_cast<float>(get_number(j, "frequency_penalty", 0.0, -2.0, 2.0));
  r.generation.ignore_eos = get_bool(j, "ignore_eos", false);
  r.tokens_as_ids = get_bool(j, "return_tokens_as_token_ids", false);
  r.stream = get_bool(j, "stream", false);
  if (j.contains("stream_options") && !j["stream_options"].is_null()) {
    const json& o = j["stream_options"];
    if (!o.is_object()) bad("stream_options", "'stream_options' must be an object");
    for (const auto& [key, value] : o.items())
      if (key != "include_usage") bad("stream_options." + key, "Unrecognized field 'stream_options." + key + "'");
    if (!r.stream) bad("stream_options", "'stream_options' is only allowed with 'stream': true");
    r.include_usage = get_bool(o, "include_usage", false);
  }
  r.stop = get_stop(j);
  return r;
}

// ---- logprobs ------------------------------------------------------------------------------------------

json completion_logprobs(const std::vector<SampledToken>& tokens, const std::vector<std::string>& text,
                         const std::vector<int64_t>& offset, const std::vector<std::vector<std::string>>& top_text) {
  json out = {{"tokens", json::array()}, {"token_logprobs", json::array()}, {"top_logprobs", json::array()},
              {"text_offset", json::array()}};
  for (size_t i = 0; i < tokens.size(); ++i) {
    out["tokens"].push_back(text[i]);
    out["token_logprobs"].push_back(tokens[i].logprob);
    json top = json::object();  // as vLLM: the top N, and the sampled token
    for (size_t k = 0; k < tokens[i].top.size(); ++k)
      if (!top.contains(top_text[i][k])) top[top_text[i][k]] = tokens[i].top[k].logprob;
    if (!top.contains(text[i])) top[text[i]] = tokens[i].logprob;
    out["top_logprobs"].push_back(std::move(top));
    out["text_offset"].push_back(offset[i]);
  }
  return out;
}

namespace {
json bytes_of(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}
}  // namespace

json chat_logprobs(const std::vector<SampledToken>& tokens, const std::vector<std::string>& text,
                   const std::vector<std::vector<std::string>>& top_text) {
  json content = json::array();
  for (size_t i = 0; i < tokens.size(); ++i) {
    json top = json::array();
    for (size_t k = 0; k < tokens[i].top.size(); ++k)
      top.push_back({{"token", top_text[i][k]}, {"logprob", tokens[i].top[k].logprob}, {"bytes", bytes_of(top_text[i][k])}});
    content.push_back({{"token", text[i]}, {"logprob", tokens[i].logprob}, {"bytes", bytes_of(text[i])},
                       {"top_logprobs", std::move(top)}});
  }
  return json{{"content", std::move(content)}};
}

json usage_json(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens) {
  return json{{"prompt_tokens", prompt_tokens},
              {"completion_tokens", completion_tokens},
              {"total_tokens", prompt_tokens + completion_tokens},
              {"prompt_tokens_details", {{"cached_tokens", cached_tokens}}}};
}

}  // namespace moex::serve
