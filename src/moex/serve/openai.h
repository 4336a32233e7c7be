// The OpenAI API's shapes: request bodies of /v1/completions and /v1/chat/completions checked field by
// field into a GenerationRequest (the chat prompt rendered by the model's chat template,
// text/chat_template.h), logprobs objects, usage and error objects. Pure functions of their inputs, so
// the HTTP server (http_server.cc) only moves bytes; streamed text and stop strings are text/stop_strings.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "moex/text/chat_template.h"
#include "moex/text/tokenizer.h"
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
  // vLLM's extension: logprobs name each token "token_id:N" instead of its text, so a client can tell the
  // ids apart (byte tokens of invalid UTF-8 all render as U+FFFD).
  bool tokens_as_ids = false;
};

// Rejects JSON nested deeper than `max_depth` (before parsing, so a hostile body cannot exhaust the stack).
bool nesting_within(const std::string& body, int max_depth);

// The most input bytes one token can stand for: its text's length, plus one for the leading space a
// SentencePiece piece ("\u2581the") carries and a lone decode drops. Bytes over max_model_len times this
// cannot fit the context (unless the tokenizer's normalizer folds runs of white space).
int64_t longest_token_bytes(const Tokenizer& tokenizer);

// Parses and checks a request body. Throws ApiError (400 for malformed JSON, wrong types, unknown fields,
// values out of range; 404 for another model's name). `served_model` is the name /v1/models lists.
// `chat_template`: the model's (null: it has none, and a chat request is a 400, as vLLM answers).
// `longest_token_bytes` > 0: a prompt text (or messages' text) longer than max_model_len times it is refused
// before it is tokenized, so the time and memory a request costs are bounded by the context, not the body.
ApiRequest parse_request(const std::string& body, bool chat, const Tokenizer& tokenizer, const std::string& served_model,
                         int64_t max_model_len, const ChatTemplate* chat_template = nullptr,
                         int64_t longest_token_bytes = 0);

// The prompt ids of a chat request's `messages`: checked (roles, text content), rendered by the template
// and encoded (its bos / eos text as their ids). The template's raise_exception is a 400 naming 'messages'.
// `longest_token_bytes` > 0: messages whose text adds up to more than max_model_len times it are refused
// before rendering, as parse_request's prompt.
std::vector<int32_t> chat_prompt(const nlohmann::json& messages, const ChatTemplate& chat_template,
                                 const Tokenizer& tokenizer, int64_t max_model_len = 0, int64_t longest_token_bytes = 0);

// logprobs objects. `text` is each token's text (what the detokenizer gave for it), `offset` the completion
// text's length before each token.
// /v1/completions (legacy): {tokens, token_logprobs, top_logprobs: [{text: logprob}], text_offset}.
nlohmann::json completion_logprobs(const std::vector<SampledToken>& tokens, const std::vector<std::string>& text,
                                   const std::vector<int64_t>& offset, const std::vector<std::vector<std::string>>& top_text);
// chat: {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}.
nlohmann::json chat_logprobs(const std::vector<SampledToken>& tokens, const std::vector<std::string>& text,
                             const std::vector<std::vector<std::string>>& top_text);

nlohmann::json usage_json(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens);

}  // namespace moex::serve
