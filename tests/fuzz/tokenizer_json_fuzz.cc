// libFuzzer target for tokenizer.json: any byte string is either a tokenizer MoEX can run or a moex::Error,
// never a crash, a hang or undefined behaviour (ASan + UBSan). Input starting with '{' is read as a
// tokenizer.json and, when accepted, encodes and decodes a few texts; any other input is the text for two
// built-in tokenizers (byte-level BPE with Qwen2's split, SentencePiece-style BPE with byte fallback), where
// byte-level decoding must give the text back exactly (after U+FFFD for invalid UTF-8). `make fuzz` runs it.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "moex/base/error.h"
#include "moex/text/tokenizer_json.h"

namespace {

std::string byte_level_json() {
  using json = nlohmann::json;
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[moex::byte_level_char(static_cast<unsigned char>(b))] = b;
  vocab["th"] = 256;
  vocab["the"] = 257;
  vocab["\xC4\xA0the"] = 258;
  const json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
  const json split = {{"type", "Split"}, {"pattern", {{"Regex", std::string(moex::kQwen2SplitPattern)}}},
                      {"behavior", "Isolated"}, {"invert", false}};
  const json t = {
      {"added_tokens", json::array({json{{"id", 259}, {"content", "<|end|>"}, {"normalized", false}, {"special", true}}})},
      {"pre_tokenizer", {{"type", "Sequence"}, {"pretokenizers", json::array({split, byte_level})}}},
      {"decoder", byte_level},
      {"model", {{"type", "BPE"}, {"vocab", vocab},
                 {"merges", json::array({json::array({"t", "h"}), json::array({"th", "e"}), json::array({"\xC4\xA0", "the"})})}}}};
  return t.dump();
}

const char kSentencePieceJson[] = R"({"version": "1.0", "truncation": null, "padding": null,
  "added_tokens": [{"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": true,
                    "normalized": false, "special": true}],
  "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Prepend", "prepend": "\u2581"},
                 {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
  "pre_tokenizer": null,
  "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}}], "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
  "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
              {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
  "model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": true, "byte_fallback": true,
            "vocab": {"<unk>": 0, "<s>": 1, "<0x41>": 2, "<0xC3>": 3, "<0xA9>": 4, "\u2581": 5, "a": 6, "\u2581a": 7},
            "merges": ["\u2581 a"]}})";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  if (!input.empty() && input[0] == '{') {
    std::unique_ptr<moex::JsonTokenizer> t;
    try {
      t = moex::JsonTokenizer::parse(input, "fuzz");
    } catch (const moex::Error&) {
      return 0;
    }
    try {
      for (const char* text : {"", "Hello  world 12\n", "\xE4\xBD\xA0\xFF<s> <|end|>", "\xE2\x96\x81x \xCC\x81"}) {
        const std::vector<int> ids = t->encode(text, true);
        (void)t->decode(ids, true);
        (void)t->decode(ids, false);
      }
      (void)t->decode({-1, 0, 1, 2, t->vocab_size(), 1 << 30}, false);
    } catch (const moex::Error&) {  // a regex over its match limit is an input error too
    }
    return 0;
  }
  static const auto byte_level = moex::JsonTokenizer::parse(byte_level_json(), "byte-level");
  static const auto sentencepiece = moex::JsonTokenizer::parse(kSentencePieceJson, "sentencepiece");
  try {
    const std::vector<int> ids = byte_level->encode(input, false);
    if (byte_level->decode(ids, false) != moex::sanitize_utf8(input)) __builtin_trap();
    (void)sentencepiece->decode(sentencepiece->encode(input, true), true);
  } catch (const moex::Error&) {
  }
  return 0;
}
