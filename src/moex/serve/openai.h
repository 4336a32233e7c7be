// The OpenAI API's shapes: request bodies of /v1/completions and /v1/chat/completions checked field by
// field into a GenerationRequest, the chat prompt (Mixtral's [INST] format), streamed text assembly with
// stop strings, and the response / chunk / error objects. Pure functions of their inputs, so the HTTP
// server (http_server.cc) only moves bytes.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "moex/runtime/tokenizer.h"
#include "moex/serve/engine.h"

namespace moex::serve {

// A request the API refuses: HTTP status and an OpenAI error object.
struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // the offending field, or empty
};
nlohmann::json error_body(const ApiError& e);

struct ApiRequest {
  bool chat = false;
  GenerationRequest generation;
  bool stream = false;
  bool include_usage = false;       // stream_options.include_usage
  std::vector<std::string> stop;    // stop strings: the text ends before the first one
  std::string model;
};

// Rejects JSON nested deeper than `max_depth` (before parsing, so a hostile body cannot exhaust the stack).
bool nesting_within(const std::string& body, int max_depth);

// Parses and checks a request body. Throws ApiError (400 for malformed JSON, wrong types, unknown fields,
// values out of range; 404 for another model's name). `served_model` is the name /v1/models lists.
ApiRequest parse_request(const std::string& body, bool chat, const Tokenizer& tokenizer, const std::string& served_model,
                         int64_t max_model_len);

// The chat prompt in Mixtral's format: <s>[INST] {system}\n\n{user} [/INST]{assistant}</s>[INST] ... [/INST]
std::vector<int32_t> mixtral_chat_prompt(const nlohmann::json& messages, const Tokenizer& tokenizer);

// Turns generated ids into text as they arrive: the text is decode(prompt + generated) after decode(prompt)
// (SentencePiece drops a leading space at the start of a decode), held back while it ends in an incomplete
// UTF-8 sequence or could be the start of a stop string.
class TextAssembler {
 public:
  TextAssembler(const Tokenizer& tokenizer, std::vector<int32_t> prompt, std::vector<std::string> stop, int eos_id);
  // Adds tokens; returns the text that is now final (not yet returned). `last`: nothing more will come.
  std::string add(const std::vector<int32_t>& tokens, bool last);
  bool stopped() const { return stopped_; }  // a stop string was found: the text ends before it
  int64_t completion_tokens() const { return static_cast<int64_t>(generated_.size()); }

 private:
  const Tokenizer& tokenizer_;
  std::vector<int32_t> ids_;  // prompt + generated (EOS excluded)
  std::vector<int32_t> generated_;
  std::vector<std::string> stop_;
  int eos_id_;
  size_t prompt_text_len_ = 0;
  std::string text_;    // the completion's text so far
  size_t emitted_ = 0;  // bytes of text_ returned
  bool stopped_ = false;
};

nlohmann::json usage_json(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens);

}  // namespace moex::serve
