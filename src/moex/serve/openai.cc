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

std::vector<int32_t> encode(const Tokenizer& tokenizer, const std::string& text) {
  const std::vector<int> ids = tokenizer.encode(text, /*add_bos=*/false);
  return std::vector<int32_t>(ids.begin(), ids.end());
}

}  // namespace

std::vector<int32_t> mixtral_chat_prompt(const json& messages, const Tokenizer& tokenizer) {
  if (!messages.is_array() || messages.empty()) bad("messages", "'messages' must be a non-empty array");
  std::vector<int32_t> ids;
  if (tokenizer.bos_id() >= 0) ids.push_back(tokenizer.bos_id());
  std::string system;
  bool expect_user = true;
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
    const std::string text = message_text(m["content"], i);
    if (role == "system") {
      if (i != 0) bad(param + ".role", "a system message may only come first");
      system = text;
    } else if (role == "user") {
      if (!expect_user) bad(param + ".role", "roles must alternate user / assistant after an optional system message");
      const std::string turn = "[INST] " + (system.empty() ? "" : system + "\n\n") + text + " [/INST]";
      system.clear();
      const std::vector<int32_t> t = encode(tokenizer, turn);
      ids.insert(ids.end(), t.begin(), t.end());
      expect_user = false;
    } else if (role == "assistant") {
      if (expect_user) bad(param + ".role", "roles must alternate user / assistant after an optional system message");
      const std::vector<int32_t> t = encode(tokenizer, text);
      ids.insert(ids.end(), t.begin(), t.end());
      if (tokenizer.eos_id() >= 0) ids.push_back(tokenizer.eos_id());
      expect_user = true;
    } else {
      bad(param + ".role", "'" + param + ".role' must be system, user or assistant, got '" + role + "'");
    }
  }
  if (expect_user) bad("messages", "the last message must come from the user");
  return ids;
}

ApiRequest parse_request(const std::string& body, bool chat, const Tokenizer& tokenizer, const std::string& served_model,
                         int64_t max_model_len) {
  if (!nesting_within(body, 32)) bad("", "the request body nests JSON deeper than 32 levels");
  const json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) bad("", "the request body is not valid JSON");
  if (!j.is_object()) bad("", "the request body must be a JSON object");
  static const std::set<std::string> common = {
      "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stream", "stream_options", "stop",
      "ignore_eos", "user", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias"};
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
  if (j.contains("logprobs") && !j["logprobs"].is_null() && j["logprobs"] != false)
    bad("logprobs", "'logprobs' is not supported by this server yet");
  if (j.contains("top_logprobs") && !j["top_logprobs"].is_null()) bad("top_logprobs", "'top_logprobs' is not supported yet");
  if (j.contains("logit_bias") && !j["logit_bias"].is_null() && !(j["logit_bias"].is_object() && j["logit_bias"].empty()))
    bad("logit_bias", "'logit_bias' is not supported yet");
  if (!chat) {
    if (get_bool(j, "echo", false)) bad("echo", "'echo' is not supported yet");
    if (get_int(j, "best_of", 1, 1, 1) != 1) bad("best_of", "'best_of' must be 1");
    if (!get_string(j, "suffix").empty()) bad("suffix", "'suffix' is not supported");
  }
  get_string(j, "user");

  // The prompt.
  std::vector<int32_t>& prompt = r.generation.prompt;
  if (chat) {
    if (!j.contains("messages")) bad("messages", "'messages' is required");
    prompt = mixtral_chat_prompt(j["messages"], tokenizer);
  } else {
    if (!j.contains("prompt")) bad("prompt", "'prompt' is required");
    const json& p = j["prompt"];
    if (p.is_string()) {
      const std::vector<int> ids = tokenizer.encode(p.get<std::string>(), /*add_bos=*/true);
      prompt.assign(ids.begin(), ids.end());
    } else if (p.is_array() && p.size() == 1 && p[0].is_string()) {
      const std::vector<int> ids = tokenizer.encode(p[0].get<std::string>(), /*add_bos=*/true);
      prompt.assign(ids.begin(), ids.end());
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

  SamplerOptions& s = r.generation.sampler;
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

// ---- text assembly -------------------------------------------------------------------------------------

TextAssembler::TextAssembler(const Tokenizer& tokenizer, std::vector<int32_t> prompt, std::vector<std::string> stop,
                             int eos_id)
    : tokenizer_(tokenizer), stop_(std::move(stop)), eos_id_(eos_id) {
  // Only the last few prompt tokens matter for how the completion's first piece decodes.
  const size_t keep = std::min<size_t>(prompt.size(), 8);
  ids_.assign(prompt.end() - keep, prompt.end());
  prompt_text_len_ = tokenizer_.decode(std::vector<int>(ids_.begin(), ids_.end())).size();
}

namespace {
// Bytes at the end of `s` that start an incomplete UTF-8 sequence (0 when it ends on a whole character).
size_t incomplete_utf8_tail(const std::string& s) {
  for (size_t back = 1; back <= std::min<size_t>(4, s.size()); ++back) {
    const unsigned char c = static_cast<unsigned char>(s[s.size() - back]);
    if ((c & 0xC0) == 0x80) continue;  // continuation byte
    const size_t need = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    return need > back ? back : 0;
  }
  return 0;
}
}  // namespace

std::string TextAssembler::add(const std::vector<int32_t>& tokens, bool last) {
  if (stopped_) return "";
  const int pieces = tokenizer_.vocab_size();
  for (int32_t t : tokens) {
    generated_.push_back(t);
    if (t != eos_id_ && t >= 0 && t < pieces) ids_.push_back(t);  // ids past the tokenizer have no text
  }
  const std::string full = tokenizer_.decode(std::vector<int>(ids_.begin(), ids_.end()));
  text_ = full.size() >= prompt_text_len_ ? full.substr(prompt_text_len_) : std::string();
  size_t final_end = text_.size();
  // The first stop string (earliest position) ends the text.
  size_t stop_at = std::string::npos;
  for (const std::string& s : stop_) {
    const size_t at = text_.find(s, emitted_ > s.size() ? emitted_ - s.size() : 0);
    if (at != std::string::npos && at < stop_at) stop_at = at;
  }
  if (stop_at != std::string::npos) {
    stopped_ = true;
    final_end = stop_at;
  } else if (!last) {
    // Hold back what could still become a stop string or is half a character.
    size_t hold = 0;
    for (const std::string& s : stop_)
      for (size_t k = std::min(s.size() - 1, text_.size()); k > hold; --k)
        if (text_.compare(text_.size() - k, k, s, 0, k) == 0) {
          hold = k;
          break;
        }
    hold = std::max(hold, incomplete_utf8_tail(text_));
    // A decode ending in U+FFFD (an incomplete byte-fallback character) waits for its next token too.
    if (text_.size() >= 3 && text_.compare(text_.size() - 3, 3, "\xEF\xBF\xBD") == 0) hold = std::max<size_t>(hold, 3);
    final_end = text_.size() - std::min(hold, text_.size());
  }
  if (final_end <= emitted_) return "";
  std::string out = text_.substr(emitted_, final_end - emitted_);
  emitted_ = final_end;
  return out;
}

json usage_json(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens) {
  return json{{"prompt_tokens", prompt_tokens},
              {"completion_tokens", completion_tokens},
              {"total_tokens", prompt_tokens + completion_tokens},
              {"prompt_tokens_details", {{"cached_tokens", cached_tokens}}}};
}

}  // namespace moex::serve
